"""One ``rredcot train`` step per scenario, run by ``test_several_processes.py`` twice: in one process
on a whole batch, then under ``torchrun --nproc_per_node 2`` (gloo, CPU) with each process
holding half of that batch (process 0 the first two prompt groups, process 1 the last two).
Writes ``{scenario}_{rank}.pt``: the gradient the first optimiser step sees and a few metrics.

The rollout is replayed (the one-process run samples the batch once and saves it; every run
reads it) and the credit is hand-built from each row's tokens and reward, so both runs update on
the same rows with the same advantages; what differs is only how the update is split across
processes: the cut after a row's last credited token (with ``advantage_tail_floor``), the
budgeted draw of agreeing rows, the references' rows and terms.

The credit scenarios (``CREDIT_SCENARIOS``, after the others wrote the batch) use the method's own
credit instead: its statistics, estimate and update over every process's rows.

Usage: ``train_two_process.py INIT_DIR BATCH_FILE OUT_DIR [credit]``.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from rredcot.config import TrainConfig  # noqa: E402
from rredcot.sampling.batch import segment_layout  # noqa: E402
from rredcot.training.seeding import seed_everything  # noqa: E402
from rredcot.training.trainer import Trainer  # noqa: E402

GROUP = 4  # samples per prompt
# record keys logged over every process's rows (the same on every process)
EVERY = ("entropy", "clip_fraction", "kl", "ratio_mean", "reward_mean", "reward_std")
EVERY += ("zero_variance_groups", "samples_seen", "tokens_generated", "extra_tokens_generated")
# scenario -> (settings, rewards of the four groups: process 0 holds groups 0-1, process 1 2-3)
SCENARIOS = {
    # process 1's credit is zero on every row: it skips all of them (a stand-in of zero weight)
    "cut": (
        {"advantage_tail_floor": 0.01},
        [[1, 0, 1, 0], [0, 1, 0, 0], [-1] * 4, [-1] * 4],
    ),
    # the same in micro-batches (process 0 runs several, process 1 none), seq_mean
    "cut_micro": (
        {"advantage_tail_floor": 0.01, "micro_batch_tokens": 48, "loss_agg": "seq_mean"},
        [[1, 0, 1, 0], [0, 1, 0, 0], [-1] * 4, [-1] * 4],
    ),
    # process 1 credits its first group only: fewer micro-batches than process 0, evened out by
    # stand-ins (of zero weight, on its first row, which is credited), dr_grpo
    "cut_fewer": (
        {"advantage_tail_floor": 0.01, "micro_batch_tokens": 48, "loss_agg": "dr_grpo"},
        [[1, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 1], [-1] * 4],
    ),
    # agreeing groups (1 and 2) on both processes drawn to a budget
    "budget": (
        {"agreeing_update_fraction": 0.5},
        [[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]],
    ),
    # references in group 1 (no correct sample) only: process 0 has references, process 1 none
    "sft": ({"references.mode": "sft"}, [[1, 0, 1, 0], [0] * 4, [1, 1, 0, 1], [0, 1, 1, 0]]),
    "luffy": ({"references.mode": "luffy"}, [[1, 0, 1, 0], [0] * 4, [1, 1, 0, 1], [0, 1, 1, 0]]),
    "bread": ({"references.mode": "bread"}, [[1, 0, 1, 0], [0] * 4, [1, 1, 0, 1], [0, 1, 1, 0]]),
    # a KL penalty to a reference the policy has drifted from: process 1's credit is zero on
    # every row, as in "cut", yet the KL term's gradient reaches its rows, so none is skipped
    "kl": (
        {"kl_coef": 0.1, "advantage_tail_floor": 0.01},
        [[1, 0, 1, 0], [0, 1, 0, 0], [-1] * 4, [-1] * 4],
    ),
}


# credit scenario -> (credit settings, rewards): the method's own credit (no hand credit), whose
# statistics, estimate and update read every process's rows. Process 0's groups (0-1) and
# process 1's (2-3) have different reward spreads, so a process's own statistics differ.
MIXED = [[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 1], [1, 1, 1, 0]]
CREDIT_SCENARIOS = {
    # the batch's std divides every advantage
    "batch_std": ({"credit_method": "uniform", "normalization": "batch_std"}, MIXED),
    # whitened over every token of the step
    "whiten": ({"credit_method": "uniform", "normalization": "whiten"}, MIXED),
    # the group's shared prefixes (each process's prefix ids, shifted past the ones before it):
    # a node's value is the mean reward below it, s_0's the group's mean
    "node_values": ({"credit_method": "node_values"}, MIXED),
    # a learned estimator: its values, the group-or-batch scale, and the head's fit after the
    # step (the state every process checkpoints)
    "value_head": ({"credit_method": "value_head"}, MIXED),
}


def config(init_dir: str, out: str, method: str = "uniform") -> TrainConfig:
    cfg = TrainConfig(
        init=init_dir,
        out=out,
        task_args={"num_steps": 2},
        credit_method=method,
        steps=1,
        prompts_per_step=4,
        eval_size=2,
        eval_every=0,
        checkpoint_every=1,
        progress=False,
        max_grad_norm=0.0,
        threads=1,
        seed=5,
    )
    cfg.sampling.num_generations = GROUP
    cfg.sampling.max_new_tokens = 16
    cfg.references.groups = "failed"
    cfg.references.branch_rollouts = 2
    return cfg


def hand_credit(ids: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` advantages from each row's response tokens ``ids (B, T)`` alone (so a row gets
    the same credit wherever it sits): a signed ramp up to a row-dependent token, then a tail of
    0.004 (below the scenarios' floor of 0.01); 0 on rows whose reward is negative."""
    B, T = ids.shape
    h = (ids * torch.arange(1, T + 1) * mask.long()).sum(dim=1) % 9973
    length = mask.sum(dim=1).long()
    end = 1 + h % length.clamp(min=1)
    sign = 1.0 - 2.0 * (h % 2).float()
    size = 0.5 + 0.1 * (h % 5).float()
    column = torch.arange(T).unsqueeze(0)
    ramp = (sign * size)[:, None] * (1 + 0.05 * column)
    adv = torch.where(column < end[:, None], ramp, torch.full_like(ramp, 0.004))
    adv = adv * mask * (rewards >= 0).float()[:, None]
    return adv


class Replay(Trainer):
    """A trainer whose rollout is a given batch and whose credit is :func:`hand_credit`."""

    given = None

    def rollout(self, problems, forward=True, keep_cache=False, seed=None):
        if seed is not None:  # seeded as the step's own rollout is
            seed_everything(seed)
        batch = self.given
        stats = {"rollout/tokens": float(batch.response_mask.sum()), "rollout/skipped_samples": 0}
        return batch, stats

    def _with_references(self, batch, stats, work):
        self.seen = super()._with_references(batch, stats, work)
        return self.seen

    def use_hand_credit(self) -> None:
        credit_output = self.method.credit_output

        def hand(*args, **kwargs):
            out = credit_output(*args, **kwargs)
            seen = self.seen
            P = seen.prompt_len
            adv = hand_credit(seen.input_ids[:, P:], seen.response_mask, seen.rewards)
            return dataclasses.replace(out, advantages=adv.to(out.advantages.dtype))

        self.method.credit_output = hand


def scenario_batch(whole, rewards, rank: int, world: int):
    """The rows of process ``rank`` of ``world`` (half the groups each), ``rewards`` set, laid
    out as that process's own rollout lays them out: group ids and shared-prefix ids from 0."""
    R = torch.tensor([float(r) for group in rewards for r in group])
    batch = whole.replace(rewards=R)
    per = batch.size // world
    mine = batch.select(list(range(rank * per, (rank + 1) * per)))
    groups = mine.group_ids - mine.group_ids.min()
    P = mine.prompt_len
    _, prefix_ids = segment_layout(
        mine.boundaries, mine.response_mask, mine.input_ids[:, P:], groups
    )
    return mine.replace(group_ids=groups, prefix_ids=prefix_ids)


def apply(trainer: Trainer, settings: dict) -> None:
    cfg = trainer.cfg
    for key, value in settings.items():
        if key == "micro_batch_tokens":
            trainer.micro_batch_tokens = value
        elif key == "kl_coef":
            cfg.kl_coef = value
            trainer.reference = drifted_copy(trainer.policy)
        elif key.startswith("references."):
            setattr(cfg.references, key.split(".", 1)[1], value)
        else:
            setattr(cfg, key, value)


def drifted_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A frozen reference the policy has moved away from (each weight plus seeded noise, the
    same on every process): at the reference itself the KL term's gradient would be zero."""
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for weight in reference.parameters():
            weight.add_(0.05 * torch.randn(weight.shape, generator=generator))
    return reference


def replayed_batch(trainer: Trainer, batch_file: str):
    """The whole batch every run replays: sampled once, by the first one-process run."""
    if not Path(batch_file).exists():
        problems = trainer.prompts_for_step(1)
        torch.manual_seed(0)
        whole, _ = Trainer.rollout(trainer, problems, forward=False)
        assert whole.size == len(MIXED) * GROUP, "a sample was rejected"
        torch.save(whole, batch_file)
    return torch.load(batch_file, weights_only=False)


def run_credit(init_dir: str, batch_file: str, out: str) -> None:
    """The credit scenarios: one step with the method's own credit; writes the gradient, a few
    metrics and the method's state after its update."""
    for name, (settings, rewards) in CREDIT_SCENARIOS.items():
        cfg = config(init_dir, f"{out}/run_{name}", method=settings["credit_method"])
        cfg.credit.normalization = settings.get("normalization", cfg.credit.normalization)
        trainer = Replay(cfg, log=lambda *_: None)
        whole = replayed_batch(trainer, batch_file)
        trainer.given = scenario_batch(whole, rewards, trainer.rank, trainer.world)
        record, grads = step_with_grads(trainer)
        torch.save(
            {
                "grads": grads,
                "state": trainer.method.state_dict(),
                **{k: v for k, v in record.items() if k.startswith("value/")},
            },
            f"{out}/{name}_{trainer.rank}.pt",
        )
        trainer.release()
    # value pretraining: each process samples its own prompts' batch, the head fits every row
    cfg = config(init_dir, f"{out}/run_pretrain", method="value_head")
    cfg.credit.value_head.pretrain_steps = 2
    trainer = Trainer(cfg, log=lambda *_: None)  # its own rollouts
    trainer._pretrain_credit()
    torch.save({"state": trainer.method.state_dict()}, f"{out}/pretrain_{trainer.rank}.pt")
    trainer.release()
    # a measurement's diagnostics, averaged over the processes that report each
    rank = trainer.rank
    means = trainer.collective.mean_metrics(
        {"a": float(rank), f"only{rank}": 1.0, "nan": rank or float("nan")}
    )
    torch.save(means, f"{out}/mean_metrics_{rank}.pt")


def run(init_dir: str, batch_file: str, out: str) -> None:
    trainer = Replay(config(init_dir, f"{out}/run"), log=lambda *_: None)
    rank, world = trainer.rank, trainer.world
    whole = replayed_batch(trainer, batch_file)
    start = copy.deepcopy(trainer.policy.state_dict())
    base = copy.deepcopy(trainer.cfg)
    trainer.use_hand_credit()
    for name, (settings, rewards) in SCENARIOS.items():
        trainer.policy.load_state_dict(start)
        trainer.cfg.__dict__.update(copy.deepcopy(base).__dict__)
        trainer.micro_batch_tokens = 1 << 20
        trainer.reference = None  # the run's own (kl_coef 0: none); "kl" sets one
        apply(trainer, settings)
        trainer.given = scenario_batch(whole, rewards, rank, world)
        record, grads = step_with_grads(trainer)
        keys = ("update/rows_forwarded", "update/agreeing_rows_kept", "policy_loss", *EVERY)
        torch.save(
            {
                "grads": grads,
                "rows": trainer.seen.size,
                "sft_rows": 0
                if trainer.last_step.sft_rows is None
                else trainer.last_step.sft_rows.size,
                **{k: record[k] for k in keys if k in record},
            },
            f"{out}/{name}_{rank}.pt",
        )
    trainer.release()


def step_with_grads(trainer: Trainer):
    """``(record, grads)`` of one step: the gradient as its optimiser step sees it."""
    seen = []
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    handle = inner.register_step_pre_hook(
        lambda *_: seen.append([p.grad.detach().clone() for p in trainer.policy.parameters()])
    )
    trainer.step = 1
    try:
        return trainer.train_step(1), seen[0]
    finally:
        handle.remove()


if __name__ == "__main__":
    (run_credit if sys.argv[4:] == ["credit"] else run)(*sys.argv[1:4])
