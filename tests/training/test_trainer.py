"""The RL loop: loss aggregation, a micro run end to end, SIGKILL + resume, bad input."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from helpers import micro_config
from metrics_doc import undocumented
from rredcot.algebra.loss import LossSettings, policy_loss
from rredcot.config import TrainConfig
from rredcot.tasks import Verdict, register_task
from rredcot.tasks.arithmetic import ArithmeticTask
from rredcot.training.trainer import Trainer

# ---------------------------------------------------------------------------------------------
# the loss


def _loss_inputs():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g) * 0.1 - 1.0
    old = logp + torch.randn(3, 5, generator=g) * 0.3
    adv = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float)
    return logp, old, adv, mask


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "dr_grpo"])
def test_policy_loss_matches_a_loop(agg):
    logp, old, adv, mask = _loss_inputs()
    loss, stats = policy_loss(
        logp,
        old,
        adv,
        mask,
        LossSettings(clip_eps_low=0.2, clip_eps_high=0.28, loss_agg=agg, max_len=5),
        num_rows=3,
        num_tokens=float(mask.sum()),
    )
    per_row, total, count = [], 0.0, 0
    for b in range(3):
        row = []
        for t in range(5):
            if mask[b, t] == 0:
                continue
            r = math.exp(logp[b, t] - old[b, t])
            a = float(adv[b, t])
            value = max(-a * r, -a * min(max(r, 0.8), 1.28))
            row.append(value)
            total += value
            count += 1
        per_row.append(sum(row) / len(row))
    expected = {
        "token_mean": total / count,
        "seq_mean": sum(per_row) / 3,
        "dr_grpo": total / (3 * 5),
    }[agg]
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert 0.0 <= stats["clip_fraction"] <= 1.0
    assert stats["kl"] == 0.0


def test_kl_penalty_is_zero_at_the_reference_and_positive_away():
    logp, old, adv, mask = _loss_inputs()
    settings = LossSettings(
        clip_eps_low=0.2, clip_eps_high=0.2, loss_agg="token_mean", max_len=5, kl_coef=0.5
    )
    kw = dict(num_rows=3, num_tokens=float(mask.sum()))
    base, _ = policy_loss(logp, old, adv, mask, settings, **kw, ref_logprobs=None)
    same, st_same = policy_loss(logp, old, adv, mask, settings, **kw, ref_logprobs=logp.clone())
    away, st_away = policy_loss(logp, old, adv, mask, settings, **kw, ref_logprobs=logp - 0.5)
    assert float(same) == pytest.approx(float(base))
    assert st_same["kl"] == pytest.approx(0.0, abs=1e-7)
    assert st_away["kl"] > 0.05 and float(away) > float(base)


def test_unknown_aggregation_is_rejected():
    logp, old, adv, mask = _loss_inputs()
    with pytest.raises(ValueError, match="token_mean"):
        policy_loss(
            logp,
            old,
            adv,
            mask,
            LossSettings(clip_eps_low=0.2, clip_eps_high=0.2, loss_agg="sum", max_len=5),
            num_rows=3,
            num_tokens=1.0,
        )


# ---------------------------------------------------------------------------------------------
# a micro run


REQUIRED = {
    "step",
    "samples_seen",
    "tokens_generated",
    "reward_mean",
    "policy_loss",
    "kl",
    "entropy",
    "grad_norm",
    "step_seconds",
}


def test_micro_run_writes_metrics_config_checkpoints_and_plots(init_dir, tmp_path):
    run = tmp_path / "run"
    cfg = micro_config(init_dir, run, credit_method="uniform", kl_coef=0.1)
    result = Trainer(cfg, log=lambda *_: None).train()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        assert set(r) >= REQUIRED, REQUIRED - set(r)
        assert math.isfinite(r["policy_loss"]) and r["grad_norm"] >= 0
    assert records[1]["samples_seen"] == 8 and records[3]["samples_seen"] == 24
    assert records[3]["tokens_generated"] > records[1]["tokens_generated"] > 0
    assert "eval_accuracy" in records[2] and "eval_accuracy" in records[3]
    assert result["final_accuracy"] == records[3]["eval_accuracy"]
    assert (run / "config.yaml").exists()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert len(list((run / "checkpoints").glob("step_*"))) == cfg.keep_checkpoints
    assert (run / "plots" / "reward_mean.png").exists()


class _ParityTask(ArithmeticTask):
    """Reward 1 for completions of even length: varied rewards even from a random policy."""

    def verify(self, problem, completion):
        return Verdict(float(len(completion) % 2 == 0), None, None, "parity")


register_task("test_parity")(_ParityTask)


# ---------------------------------------------------------------------------------------------
# bad input


class _NaNTask(ArithmeticTask):
    """Arithmetic whose reward is NaN for every other call: a broken user reward function."""

    calls = 0

    def verify(self, problem, completion):
        type(self).calls += 1
        if type(self).calls % 2:
            return Verdict(float("nan"), None, None, "broken")
        return super().verify(problem, completion)


register_task("test_nan_arithmetic")(_NaNTask)


def test_bad_rewards_are_skipped_and_counted(init_dir, tmp_path):
    cfg = micro_config(init_dir, tmp_path / "run", task="test_nan_arithmetic", steps=1)
    Trainer(cfg, log=lambda *_: None).train()
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["rollout/skipped_samples"] == 4  # half of 2 prompts x 4 samples
    assert rec["skipped_samples_total"] == 4
    assert math.isfinite(rec["policy_loss"])


def test_unknown_names_fail_with_the_valid_ones(init_dir, tmp_path):
    with pytest.raises(ValueError, match="arithmetic"):
        Trainer(micro_config(init_dir, tmp_path / "a", task="nope"))
    with pytest.raises(ValueError, match="uniform"):
        Trainer(micro_config(init_dir, tmp_path / "b", credit_method="nope"))
    with pytest.raises(ValueError, match="token_mean"):
        micro_config(init_dir, tmp_path / "c", loss_agg="mean")


def test_prompts_longer_than_the_context_are_a_clear_error(tmp_path, char_tokenizer):
    from rredcot.models import build_tiny_llama

    model = build_tiny_llama(
        char_tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=20
    )
    model.save_pretrained(tmp_path / "short")
    char_tokenizer.save_pretrained(tmp_path / "short")
    with pytest.raises(ValueError, match="max_new_tokens"):
        Trainer(micro_config(tmp_path / "short", tmp_path / "run"))


def test_resume_needs_a_run_directory(tmp_path):
    from rredcot.training.trainer import train

    with pytest.raises(FileNotFoundError, match="run directory"):
        train(TrainConfig(resume=str(tmp_path / "missing")))


# ---------------------------------------------------------------------------------------------
# SIGKILL and resume


def _cli(init_dir, out, steps, *extra):
    return [
        sys.executable,
        "-m",
        "rredcot.cli.commands",
        "train",
        "--init",
        str(init_dir),
        "--out",
        str(out),
        "--credit",
        "uniform",
        "--steps",
        str(steps),
        "--prompts_per_step",
        "2",
        "--sampling.num_generations",
        "4",
        "--sampling.max_new_tokens",
        "16",
        "--eval_size",
        "4",
        "--eval_every",
        "3",
        "--checkpoint_every",
        "2",
        "--progress",
        "false",
        "--task.num_steps",
        "2",
        *extra,
    ]


VOLATILE = ("step_seconds", "time/")


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


# `rredcot train` that SIGKILLs itself half-way through writing step 4's checkpoint
_KILLED_DURING_CHECKPOINT = """
import os, signal, sys
from rredcot.training import runio
save = runio.atomic_torch_save
def save_then_die(obj, path):
    if "step_000004" in str(path):
        with open(path, "wb") as fh:
            fh.write(b"half a trainer state")
            fh.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    save(obj, path)
runio.atomic_torch_save = save_then_die
from rredcot.cli.commands import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_then_resume_reproduces_the_run(init_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    steps = 7
    full = tmp_path / "full"
    subprocess.run(_cli(init_dir, full, steps), check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    args = _cli(init_dir, killed, steps)[3:]  # drop "python -m rredcot.cli.commands"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_DURING_CHECKPOINT, *args], env=env, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (killed / "checkpoints" / ".tmp_step_000004" / "trainer_state.pt").exists()
    done = [
        json.loads(x)["step"]
        for x in (killed / "metrics.jsonl").read_text().splitlines()
        if x.strip()
    ]
    assert done == [0, 1, 2, 3, 4]  # step 4 was recorded, its checkpoint never completed

    resumed = subprocess.run(
        [sys.executable, "-m", "rredcot.cli.commands", "train", "--resume", str(killed)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {killed / 'checkpoints' / 'step_000002'} at step 2" in resumed.stdout
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert [r["step"] for r in records] == list(range(steps + 1)), "duplicated or missing steps"
    expected = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert _stable(records) == _stable(expected)


@pytest.mark.slow
def test_runs_under_accelerate_launch(init_dir, tmp_path):
    out = tmp_path / "acc"
    args = _cli(init_dir, out, 1)[3:]  # drop "python -m rredcot.cli.commands"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--cpu",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "rredcot.cli.commands",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


def test_value_head_is_pretrained_on_warm_start_samples(init_dir, tmp_path):
    cfg = micro_config(
        init_dir, tmp_path / "run", task="test_parity", credit_method="value_head", steps=1
    )
    cfg.credit.value_head.pretrain_steps = 2
    trainer = Trainer(cfg, log=lambda *_: None)
    head_before = trainer.method.state_dict()["head"]  # the head is built with the method
    trainer.train()
    stats = json.loads((tmp_path / "run" / "value_pretrain.json").read_text())
    assert stats["value_pretrain/steps"] == 2.0
    assert math.isfinite(stats["value_pretrain/loss_first"])
    after = trainer.method.state_dict()["head"]
    assert any(not torch.equal(head_before[k], after[k]) for k in head_before)
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "credit/handover_reliability" in rec and "credit/handover_weight" in rec
    assert undocumented(set(rec)) == []  # every key of the step record is in docs/metrics.md
    # the pretraining samples are paid from the token budget, as generations of the method
    assert rec["extra_tokens_generated"] > 0
    assert rec["extra_tokens_generated"] + rec["tokens_generated"] > rec["rollout/tokens"]


def test_value_pretrain_with_a_method_that_learns_nothing_is_an_error(init_dir, tmp_path):
    cfg = micro_config(init_dir, tmp_path / "run", credit_method="uniform", steps=1)
    cfg.credit.value_head.pretrain_steps = 1
    with pytest.raises(ValueError, match="learns nothing"):
        Trainer(cfg, log=lambda *_: None).train()


def test_threads_follow_the_idle_cores(monkeypatch):
    """threads=0 takes the cores idle right now (at least one); an explicit count wins;
    accelerators keep torch's default; so does a machine whose idleness cannot be read."""
    import os

    import rredcot.training.setup as train_setup
    from rredcot.training.setup import choose_threads, idle_cores

    free = idle_cores(0.05)
    assert free is None or 0.0 <= free <= os.cpu_count() + 0.5  # a real reading of /proc/stat
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(train_setup, "idle_cores", lambda window=0.25: 3.8)
    assert choose_threads(0, torch.device("cpu")) == 4
    monkeypatch.setattr(train_setup, "idle_cores", lambda window=0.25: 1.4)
    assert choose_threads(0, torch.device("cpu")) == 1
    monkeypatch.setattr(train_setup, "idle_cores", lambda window=0.25: 0.1)
    assert choose_threads(0, torch.device("cpu")) == 1
    monkeypatch.setattr(train_setup, "idle_cores", lambda window=0.25: None)
    assert choose_threads(0, torch.device("cpu")) is None
    assert choose_threads(3, torch.device("cpu")) == 3
    assert choose_threads(0, torch.device("meta")) is None


@pytest.mark.parametrize("method", ["uniform", "value_head"])
def test_bfloat16_autocast_runs_the_steps_products_in_bfloat16_and_the_rest_in_float32(
    init_dir, tmp_path, method
):
    """model.autocast=bfloat16: the policy's matrix products of sampling and the update come out
    in bfloat16 (off: float32), while the weights, their gradients, the value head's update
    and evaluation stay float32; the step trains (a finite, non-zero gradient)."""
    seen: dict[str, set] = {}
    for mode in ("off", "bfloat16"):
        cfg = micro_config(init_dir, tmp_path / mode, credit_method=method, steps=1)
        cfg.model.autocast = mode
        trainer = Trainer(cfg, log=lambda *_: None)
        layer = next(m for m in trainer.policy.modules() if isinstance(m, torch.nn.Linear))
        dtypes: set = set()
        hook = layer.register_forward_hook(lambda mod, args, out, seen=dtypes: seen.add(out.dtype))
        trainer.step = 1
        record = trainer.train_step(1)
        seen[mode], step_dtypes = set(dtypes), set(dtypes)
        dtypes.clear()
        trainer.evaluate()
        hook.remove()
        assert dtypes == {torch.float32}  # evaluation reads the float32 policy
        assert {p.dtype for p in trainer.policy.parameters()} == {torch.float32}
        assert math.isfinite(record["grad_norm"]) and step_dtypes
        trainer.release()
    assert seen == {"off": {torch.float32}, "bfloat16": {torch.bfloat16}}
    with pytest.raises(ValueError, match="model.autocast='fp8'; valid: off, bfloat16"):
        micro_config(init_dir, tmp_path / "bad").model.__class__(autocast="fp8")
