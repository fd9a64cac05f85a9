"""references.mode (rredcot.training.references): the reference sample's shaped loss and weight, the
supervised term's gradient, the budget, refusals, and mode off leaving a run unchanged."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import FIXTURES, micro_config, train_step_with_grads
from metrics_doc import undocumented
from rredcot.algebra.loss import LossSettings, policy_loss
from rredcot.config import ReferencesConfig, TrainConfig
from rredcot.sampling.forward import policy_forward
from rredcot.sampling.rollout import build_rollout_batch, render_prompt
from rredcot.segment import get_segmenter, segment_completion
from rredcot.tasks import Verdict, get_task, register_task
from rredcot.tasks.arithmetic import ArithmeticTask
from rredcot.training import references
from rredcot.training.trainer import Trainer

FIXTURE = FIXTURES / "references_off_micro_run.json"


class _ParityTask(ArithmeticTask):
    """Reward 1 for completions of even length: varied rewards from a random policy."""

    def verify(self, problem, completion):
        return Verdict(float(len(completion) % 2 == 0), None, None, "parity")


class _NoGoldTask(ArithmeticTask):
    """Arithmetic without reference solutions (a task that only verifies)."""

    def gold_completion(self, problem):
        return None


register_task("test_references_parity")(_ParityTask)
register_task("test_references_no_gold")(_NoGoldTask)


def _wrong_batch(policy, tokenizer, task, num_prompts=2, G=3):
    """A real sampled batch of a random-init policy: every sample wrong."""
    torch.manual_seed(0)
    batch, _ = build_rollout_batch(
        policy,
        tokenizer,
        task,
        task.train_problems(num_prompts, seed=1),
        get_segmenter("newline"),
        num_generations=G,
        max_new_tokens=12,
    )
    assert float(batch.rewards.max()) == 0.0  # all-wrong groups: the case LUFFY is used for
    return batch


def _chosen_references(batch, task, tokenizer, which="failed"):
    P = batch.prompt_len
    return references.choose_references(
        batch.rewards,
        batch.group_ids,
        batch.input_ids[:, :P],
        batch.attention_mask[:, :P],
        batch.problems,
        which,
        task,
        tokenizer,
    )


# ---------------------------------------------------------------------------------------------
# luffy: the reference sample


def test_reference_samples_join_their_groups(tiny_policy, char_tokenizer):
    task = get_task("arithmetic", num_steps=2)
    batch = _wrong_batch(tiny_policy, char_tokenizer, task)
    groups = references.chosen_groups(batch.rewards, batch.group_ids, "failed")
    assert groups == [0, 1]
    refs = _chosen_references(batch, task, char_tokenizer)
    assert refs.group_ids.tolist() == groups and refs.failed_groups == 2
    merged = references.reference_samples(
        batch, refs, task, char_tokenizer, get_segmenter("newline")
    )
    P = batch.prompt_len
    assert merged.size == batch.size + 2
    assert merged.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # G + 1 rows, contiguous
    assert merged.off_policy.tolist() == [False, False, False, True] * 2
    for row, gid in ((3, 0), (7, 1)):
        problem = merged.problems[row]
        gold = task.gold_completion(problem)
        n = int(merged.response_mask[row].sum())
        ids = merged.input_ids[row, P : P + n].tolist()
        assert ids == char_tokenizer(gold, add_special_tokens=False)["input_ids"] + [
            char_tokenizer.eos_token_id
        ]
        assert float(merged.rewards[row]) == 1.0  # the verifier's verdict on the reference
        first = batch.group_ids.tolist().index(gid)
        assert torch.equal(merged.input_ids[row, :P], batch.input_ids[first, :P])  # its prompt
        # segmented as a sampled completion is: "1+3=4\n" | "4+2=6\nA:6" EOS (answer merged)
        bounds, _, _ = segment_completion(get_segmenter("newline"), char_tokenizer, ids, text=gold)
        assert merged.boundaries[row] == bounds and len(bounds) == 3 and bounds[-1] == n
    # the sampled rows are untouched (their response columns padded with the pad id)
    sampled = (~merged.off_policy).nonzero().squeeze(1)
    T = batch.response_len
    assert torch.equal(merged.input_ids[sampled, : P + T], batch.input_ids)
    assert torch.equal(merged.rewards[sampled], batch.rewards)
    assert merged.boundaries[0] == batch.boundaries[0]


def test_reference_sample_loss_and_importance_weight_by_hand(tiny_policy, char_tokenizer):
    """LUFFY's term on a hand-worked batch: the reference row's per-token loss is
    ``-A pi / (pi + gamma)`` (behaviour probability 1, never clipped), the sampled rows keep
    PPO's clipped term; the total is their token mean."""
    task = get_task("arithmetic", num_steps=2)
    batch = _wrong_batch(tiny_policy, char_tokenizer, task, num_prompts=1, G=3)
    refs = _chosen_references(batch, task, char_tokenizer)
    assert refs.group_ids.tolist() == [0]
    merged = references.reference_samples(
        batch, refs, task, char_tokenizer, get_segmenter("newline")
    )
    fwd = policy_forward(tiny_policy, merged.input_ids, merged.attention_mask, merged.prompt_len)
    logprobs, mask = fwd.logprobs, merged.response_mask
    # a hand-made group: three wrong samples and the reference, GRPO's advantages of 0,0,0,1
    mean = 0.25
    std = math.sqrt(3 * mean**2 + (1 - mean) ** 2) / 2  # population std over the 4 rows
    adv_rows = [(0 - mean) / std] * 3 + [(1 - mean) / std]
    advantages = torch.tensor(adv_rows)[:, None] * mask
    # old log-probs far below: every sampled token's ratio is e^2 (clipped at 1.28 for A > 0)
    old = logprobs.detach() - 2.0
    gamma = 0.1
    loss_of = functools.partial(
        policy_loss,
        logprobs,
        old,
        advantages,
        mask,
        LossSettings(
            clip_eps_low=0.2,
            clip_eps_high=0.28,
            loss_agg="token_mean",
            max_len=12,
            off_policy_gamma=gamma,
        ),
        num_rows=4,
        num_tokens=float(mask.sum()),
    )
    loss, stats = loss_of(off_policy=merged.off_policy)
    total, n_tokens, clipped, sampled_tokens = 0.0, 0, 0, 0
    lp = logprobs.detach().tolist()
    for row in range(4):
        A = adv_rows[row]
        for t in range(int(mask[row].sum())):
            if row == 3:  # the reference: its importance weight from its log-prob, by hand
                pi = math.exp(lp[row][t])
                total += -A * pi / (pi + gamma)
            else:  # sampled: ratio e^2, A < 0 -> max(-A r, -A clip(r)) = -A r (not clipped)
                r = math.exp(2.0)
                total += max(-A * r, -A * min(max(r, 0.8), 1.28))
                clipped += int(-A * min(max(r, 0.8), 1.28) > -A * r)
                sampled_tokens += 1
            n_tokens += 1
    assert loss.item() == pytest.approx(total / n_tokens, rel=1e-5)
    assert stats["clip_fraction"] == pytest.approx(clipped / n_tokens)  # the reference's none
    # the gradient of the reference's tokens: -A gamma pi / (pi + gamma)^2 per log-prob
    (grad,) = torch.autograd.grad(loss, logprobs)
    for t in range(int(mask[3].sum())):
        pi = math.exp(lp[3][t])
        expected = -adv_rows[3] * gamma * pi / (pi + gamma) ** 2 / n_tokens
        assert grad[3, t].item() == pytest.approx(expected, rel=1e-4)
    # and the off-policy mask changes only the reference row's terms
    plain, _ = loss_of()
    assert plain.item() != pytest.approx(loss.item())


def test_luffy_run_trains_the_reference_and_charges_it(init_dir, tmp_path):
    run = tmp_path / "run"
    cfg = micro_config(init_dir, run, steps=1)
    cfg.references.mode = "luffy"
    trainer = Trainer(cfg, log=lambda *_: None)
    problems = trainer.prompts_for_step(1)
    record, grads = train_step_with_grads(trainer, 1)
    assert record["reward_mean"] == 0.0  # the sampled rows only: every group failed
    assert record["samples_seen"] == 8  # 2 prompts x 4 samples; the references are not samples
    gold_tokens = sum(
        len(
            trainer.tokenizer(trainer.task.gold_completion(p), add_special_tokens=False)[
                "input_ids"
            ]
        )
        + 1
        for p in problems
    )
    assert record["references/groups"] == 2 and record["references/failed_groups"] == 2
    assert record["references/tokens"] == gold_tokens
    assert record["reference_tokens_trained"] == gold_tokens
    assert record["extra_tokens_generated"] == gold_tokens  # charged to the budget
    assert record["advantage_abs_mean"] > 0  # the failed groups now have a signal
    assert any(float(g.abs().sum()) > 0 for g in grads)
    assert undocumented(set(record)) == []


def test_luffy_bills_its_reference_rows_as_trained_not_sampled(init_dir, tmp_path):
    """compute/step: the sampled rows' tokens once (sampling), every row's 3 (forward and
    backward: nothing skipped here), the given references never as sampled."""
    cfg = micro_config(init_dir, tmp_path / "run", steps=1, skip_zero_advantage_rows=False)
    cfg.references.mode = "luffy"
    trainer = Trainer(cfg, log=lambda *_: None)
    seen = []
    with_references = trainer._with_references
    trainer._with_references = lambda *args: seen.append(with_references(*args)) or seen[-1]
    record, _ = train_step_with_grads(trainer, 1)
    trainer.release()
    batch = seen[0]
    sampled = float(batch.attention_mask[~batch.off_policy].sum())
    assert int(batch.off_policy.sum()) == 2 and record["forward/scoring_pass"] == 0.0
    assert record["compute/step"] == pytest.approx(sampled + 3 * float(batch.attention_mask.sum()))


def test_luffy_step_where_no_group_takes_a_reference_trains_as_grpo(
    init_dir, tmp_path, monkeypatch
):
    # a step whose every group has a correct sample joins no reference (the default task does
    # this once it trains): no off-policy rows, the step is GRPO's (it crashed on ~None once)
    cfg = micro_config(init_dir, tmp_path / "run", steps=1)
    cfg.references.mode = "luffy"
    trainer = Trainer(cfg, log=lambda *_: None)
    monkeypatch.setattr(references, "chosen_groups", lambda rewards, group_ids, which: [])
    record, _ = train_step_with_grads(trainer, 1)
    assert record["references/groups"] == 0 and record["references/tokens"] == 0
    assert record["extra_tokens_generated"] == 0 and record["samples_seen"] == 8


# ---------------------------------------------------------------------------------------------
# sft: the supervised term


def _reference_nll_grads(trainer, problems, coef, loss_agg):
    """The gradient of ``coef * NLL`` of the references after their prompts, computed one row at
    a time with the model's own forward (no padding, no shared prompt), aggregated by hand."""
    tok, policy = trainer.tokenizer, trainer.policy
    per_row = []
    for problem in problems:
        prompt = tok(render_prompt(problem, tok), add_special_tokens=True)["input_ids"]
        gold = tok(trainer.task.gold_completion(problem), add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + gold + [tok.eos_token_id]])
        logp = F.log_softmax(policy(input_ids=ids).logits[0, :-1].float(), -1)
        targets = ids[0, 1:]
        token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)[len(prompt) - 1 :]
        per_row.append(-token_logp)
    if loss_agg == "token_mean":
        nll = torch.cat(per_row).sum() / sum(len(r) for r in per_row)
    else:  # seq_mean
        nll = torch.stack([r.mean() for r in per_row]).mean()
    params = [p for p in policy.parameters() if p.requires_grad]
    return torch.autograd.grad(coef * nll, params), nll.item()


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
def test_sft_term_gradient_is_the_weighted_nll_gradient(init_dir, tmp_path, loss_agg):
    cfg = micro_config(init_dir, tmp_path / "run", steps=1, loss_agg=loss_agg, max_grad_norm=0.0)
    cfg.references.mode = "sft"
    cfg.references.sft_coef = 0.3
    trainer = Trainer(cfg, log=lambda *_: None)
    problems = trainer.prompts_for_step(1)
    expected, nll = _reference_nll_grads(trainer, problems, 0.3, loss_agg)
    record, grads = train_step_with_grads(trainer, 1)
    # every group failed: uniform credit gives the PG term nothing, the gradient is the sft term's
    assert record["reward_mean"] == 0.0 and record["advantage_abs_mean"] == 0.0
    assert record["references/sft_nll"] == pytest.approx(nll, rel=1e-5)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert max(float(g.abs().max()) for g in grads) > 0


def test_sft_charges_the_reference_tokens_to_the_budget(init_dir, tmp_path):
    run = tmp_path / "run"
    cfg = micro_config(init_dir, run, steps=2)
    cfg.references.mode = "sft"
    cfg.references.groups = "all"
    trainer = Trainer(cfg, log=lambda *_: None)
    charged = 0
    for step in (1, 2):
        problems = trainer.prompts_for_step(step)
        charged += sum(
            len(
                trainer.tokenizer(trainer.task.gold_completion(p), add_special_tokens=False)[
                    "input_ids"
                ]
            )
            + 1
            for p in problems
        )
        trainer.step = step
        record = trainer.train_step(step)
        assert record["reference_tokens_trained"] == charged
        assert record["extra_tokens_generated"] == charged
    # the budget stops the run on the policy's tokens plus the reference tokens
    trainer.cfg.max_tokens_generated = trainer.tokens_generated + 1
    assert trainer.budget_spent()
    trainer.cfg.max_tokens_generated = trainer.tokens_generated + charged + 1
    assert not trainer.budget_spent()
    trainer.release()


def test_sft_bills_the_reference_rows_forward_and_backward(init_dir, tmp_path):
    """compute/step of an sft step: the same step without references plus 3 for each real
    token (prompt + reference) of the reference rows, forwarded and back-propagated once."""
    compute = {}
    for mode in ("off", "sft"):
        cfg = micro_config(init_dir, tmp_path / mode, steps=1)
        cfg.references.mode = mode
        cfg.references.groups = "all"
        trainer = Trainer(cfg, log=lambda *_: None)
        trainer.step = 1
        compute[mode] = trainer.train_step(1)["compute/step"]
        refs = trainer.last_step.sft_rows
        trainer.release()
    assert refs.size == 2
    assert compute["sft"] == pytest.approx(compute["off"] + 3 * float(refs.attention_mask.sum()))


def test_a_run_records_its_references_section(init_dir, tmp_path):
    run = tmp_path / "run"
    cfg = micro_config(init_dir, run, steps=1)
    cfg.references.mode = "sft"
    cfg.references.sft_coef = 0.25
    Trainer(cfg, log=lambda *_: None).train()
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())["references"]
    assert saved == {
        "mode": "sft",
        "groups": "failed",
        "sft_coef": 0.25,
        "shaping_gamma": 0.1,
        "branch_rollouts": 0,
        "branch_fraction": 0.5,
    }


# ---------------------------------------------------------------------------------------------
# refusals and mode off


def test_a_task_without_references_is_refused_before_anything_runs(init_dir, tmp_path):
    run = tmp_path / "run"
    cfg = micro_config(init_dir, run, task="test_references_no_gold")
    cfg.references.mode = "luffy"
    with pytest.raises(ValueError, match="task 'test_references_no_gold' gives none.*mode off"):
        Trainer(cfg, log=lambda *_: None)
    assert not run.exists()  # refused before the run directory was claimed


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"mode": "dpo"}, "references.mode='dpo': use off, sft, luffy"),
        ({"groups": "some"}, "references.groups='some': use failed, all"),
        ({"mode": "sft", "sft_coef": 0.0}, "sft_coef=0.0 must be > 0"),
        ({"mode": "luffy", "shaping_gamma": -1.0}, "shaping_gamma=-1.0 must be > 0"),
    ],
)
def test_bad_references_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ReferencesConfig(**fields)


def test_luffy_with_tree_groups_is_refused():
    cfg = TrainConfig()
    cfg.sampling.tree.enabled = True
    with pytest.raises(ValueError, match="does not join tree groups"):
        TrainConfig(references=ReferencesConfig(mode="luffy"), sampling=cfg.sampling)


def test_references_off_leaves_a_run_as_before(init_dir, tmp_path, monkeypatch):
    """Uniform credit with references off: a 2-step run's metrics equal those of the code before
    references existed (main 47062b3, the fixture), and no reference code runs. The fixture was
    made on another CPU: counts must match exactly, floats within a tolerance far below any
    change of behaviour (a different sample or update moves them by 1e-2 or more)."""

    def refuse(*args, **kwargs):
        raise AssertionError("reference code ran with references.mode off")

    for name in ("chosen_groups", "choose_references", "reference_samples", "reference_nll"):
        monkeypatch.setattr(references, name, refuse)
    run = tmp_path / "run"
    cfg = micro_config(
        init_dir, run, steps=2, overwrite=True, task="test_references_parity", kl_coef=0.05, seed=3
    )
    Trainer(cfg, log=lambda *_: None).train()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timeless = [
        {k: v for k, v in r.items() if not (k.startswith("time/") or k == "step_seconds")}
        for r in records
    ]
    before = json.loads(FIXTURE.read_text())
    assert len(timeless) == len(before)
    for now, then in zip(timeless, before, strict=True):
        for key, value in then.items():  # every value logged then, unchanged
            assert key in now, key
            if isinstance(value, float):
                assert now[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
            else:
                assert now[key] == value, key
        # keys logged since the fixture was made: the equal-time and compute budgets (issue 41),
        # the share of tokens the loss forwarded (issue 49)
        added = {"compute/step", "compute/used", "train_seconds", "update/tokens_forwarded"}
        assert set(now) - set(then) <= added, now


def test_a_learn_bench_variant_sets_the_references(tmp_path):
    from rredcot.bench.learn import LearnBenchConfig, train_config
    from rredcot.bench.variants import parse_variants

    spec = "ref_sft=uniform:references.mode=sft:references.sft_coef=0.5,ref_luffy=uniform:references.mode=luffy:references.groups=all"
    cfg = LearnBenchConfig(methods=spec, out=str(tmp_path))
    sft, luffy = (train_config(cfg, v, 0, "init", tmp_path / v.name) for v in parse_variants(spec))
    assert (sft.credit_method, sft.references.mode, sft.references.sft_coef) == (
        "uniform",
        "sft",
        0.5,
    )
    assert (luffy.references.mode, luffy.references.groups) == ("luffy", "all")
    with pytest.raises(ValueError, match="references.mode='rl'"):
        bad = parse_variants("bad=uniform:references.mode=rl")[0]
        train_config(cfg, bad, 0, "init", tmp_path / "bad")


# ---------------------------------------------------------------------------------------------
# bread: rollouts branched from a reference prefix


class _FirstLineTask(ArithmeticTask):
    """Reward 1 when the completion starts with the reference's first line: a branch from the
    reference prefix is right by construction, a random policy's own sample is not."""

    def verify(self, problem, completion):
        first = self.gold_completion(problem).split("\n")[0] + "\n"
        return Verdict(float(completion.startswith(first)), None, None, "first line")


class _FirstLineParityTask(_FirstLineTask):
    """:class:`_FirstLineTask` whose right starts must also go on with a character of even code:
    mixed rewards among the branches, none among a random policy's own samples."""

    def verify(self, problem, completion):
        first = self.gold_completion(problem).split("\n")[0] + "\n"
        rest = completion[len(first) :] if completion.startswith(first) else ""
        return Verdict(float(bool(rest) and ord(rest[0]) % 2 == 0), None, None, "parity")


register_task("test_references_first_line")(_FirstLineTask)
register_task("test_references_first_line_parity")(_FirstLineParityTask)


def test_branched_rollouts_start_from_the_reference_prefix(tiny_policy, char_tokenizer):
    from rredcot.config import SamplingConfig

    task = get_task("test_references_first_line", num_steps=2)
    batch = _wrong_batch(tiny_policy, char_tokenizer, task)
    sampling = SamplingConfig(num_generations=3, max_new_tokens=8)
    torch.manual_seed(5)
    branch, generated = references.branch_samples(
        tiny_policy,
        batch,
        [0, 1],
        task,
        char_tokenizer,
        get_segmenter("newline"),
        sampling,
        "auto",
        fraction=0.5,
        rollouts=2,
    )
    assert branch.size == 4 and generated == int(branch.response_mask.sum()) > 0
    assert branch.group_ids.tolist() == [2, 2, 3, 3]  # groups of their own
    for row in range(4):
        problem = branch.problems[row]
        prefix = task.gold_completion(problem).split("\n")[0] + "\n"  # 1 of 3 lines (fraction 0.5)
        assert references.reference_prefix(task, problem, 0.5) == prefix
        prompt = char_tokenizer.decode(
            branch.input_ids[row, : branch.prompt_len], skip_special_tokens=True
        )
        assert prompt.endswith(
            render_prompt(problem, char_tokenizer) + prefix
        )  # context, not trained
        assert float(branch.rewards[row]) == 1.0  # verified on prefix + completion
    # merged: the batch's own rows score as before (more left padding, same log-probs)
    merged = references.merge_batches(batch, branch, char_tokenizer.pad_token_id)
    assert merged.size == batch.size + 4 and merged.prompt_len == branch.prompt_len
    alone = policy_forward(tiny_policy, batch.input_ids, batch.attention_mask, batch.prompt_len)
    both = policy_forward(tiny_policy, merged.input_ids, merged.attention_mask, merged.prompt_len)
    T = batch.response_len
    mask = batch.response_mask.bool()
    torch.testing.assert_close(
        both.logprobs[: batch.size, :T][mask], alone.logprobs[mask], rtol=1e-4, atol=1e-5
    )
    assert merged.rewards.tolist() == batch.rewards.tolist() + [1.0] * 4


def test_bread_run_charges_its_rollouts_and_learns_from_them(init_dir, tmp_path):
    task = "test_references_first_line_parity"
    cfg = micro_config(init_dir, tmp_path / "run", steps=1, task=task)
    cfg.references.mode = "bread"
    cfg.references.branch_rollouts = 4
    trainer = Trainer(cfg, log=lambda *_: None)
    record, grads = train_step_with_grads(trainer, 1)
    assert record["reward_mean"] == 0.0 and record["samples_seen"] == 8  # own samples only
    assert record["references/groups"] == 2
    assert 0.0 < record["references/branch_reward_mean"] < 1.0  # the branches disagree
    assert record["extra_tokens_generated"] == record["references/branch_tokens"] > 0
    assert record["reference_tokens_trained"] == 0  # the prefix is context, not trained on
    assert undocumented(set(record)) == []
    # the own groups all fail (no signal); the branch groups' mixed rewards give the gradient
    assert record["advantage_abs_mean"] > 0
    assert max(float(g.abs().max()) for g in grads) > 0


def test_bread_needs_uniform_credit():
    with pytest.raises(ValueError, match="bread runs with credit_method uniform"):
        TrainConfig(credit_method="value_head", references=ReferencesConfig(mode="bread"))


def test_every_references_mode_is_a_registered_strategy():
    """The config's modes are the registry's, each a ReferenceMode; off alone reads none."""
    from rredcot.config import REFERENCE_MODES

    assert tuple(references.REFERENCE_MODE_CLASSES) == REFERENCE_MODES
    for name, cls in references.REFERENCE_MODE_CLASSES.items():
        assert issubclass(cls, references.ReferenceMode) and cls.name == name
        assert cls.reads_references == (name != "off")


def test_an_unknown_references_mode_is_refused_with_the_valid_ones():
    valid = "unknown references.mode 'dpo'; valid: off, sft, luffy, bread"
    with pytest.raises(ValueError, match=valid):
        references.reference_mode_class("dpo")
    with pytest.raises(ValueError, match="registered already"):
        references.register_reference_mode("sft")(references.Sft)


def test_references_off_leaves_the_batch_and_adds_no_term(tiny_policy, char_tokenizer):
    task = ArithmeticTask()
    batch = _wrong_batch(tiny_policy, char_tokenizer, task)
    parts = references.ReferenceParts(task, char_tokenizer, get_segmenter("newline"))
    off = references.reference_mode(ReferencesConfig(mode="off"), parts)
    step = off.step(batch, trained_before=7)
    assert step.batch is batch and step.sft_rows is None and step.generated == 0
    assert off.supervised_loss(torch.zeros(1, 1), None) is None


def test_the_sft_term_is_its_weight_times_the_references_nll():
    sft = references.reference_mode(
        ReferencesConfig(mode="sft", sft_coef=0.3), references.ReferenceParts(None, None, None)
    )
    logprobs = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    options = dict(num_rows=4, num_tokens=10.0, scale=2.0, loss_agg="token_mean", max_len=3)
    loss, metrics = sft.supervised_loss(logprobs, mask, **options)
    nll = references.reference_nll(logprobs, mask, "token_mean", 3, num_rows=4, num_tokens=10.0)
    assert float(nll) == pytest.approx(8.0 / 10.0)
    assert float(loss) == pytest.approx(0.3 * 2.0 * float(nll))
    assert metrics == {"references/sft_nll": pytest.approx(float(nll))}
    stand_in, metrics = sft.supervised_loss(logprobs[:1, :1], None, **options)  # no reference
    assert float(stand_in) == 0.0 and metrics["references/sft_nll"] == 0.0
