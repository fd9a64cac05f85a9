"""Several processes give one process's update: two real CPU processes (torchrun, gloo) against
one process on the union of their batches, for every feature that splits the update across
processes (the cut after the last credited token, budgeted agreeing rows, reference baselines),
in ``rredcot train`` (``train_two_process.py``) and in TRL's adapter
(``trl_references_two_process.py``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
# the float rounding of a sum in another order (gradients of size ~1e-2 agree to ~1e-8)
RTOL, ATOL = 1e-4, 1e-6


def launch(script: str, *args: str, processes: int = 1, timeout: int = 180) -> str:
    """Run ``script`` (or ``-m MODULE``) in ``processes`` processes (torchrun, gloo, on the CPU)
    with this session's import path; a run that fails, or hangs because one process skipped a
    collective the other entered, fails the test. Returns what the processes printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    target = [script] if script == "-m" else [str(HERE / script)]
    cmd = [sys.executable, *target, *args]
    if processes > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        run = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
        cmd = [sys.executable, *run, "--master_port", str(port), *cmd[1:]]
    # torchrun ends its workers (each in a session of its own) when it is terminated
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise AssertionError(
            f"{script} hung for {timeout} s (a collective one process skipped?)"
        ) from None
    assert proc.returncode == 0, err[-3000:]
    return out


def load(folder: Path, name: str, rank: int) -> dict:
    return torch.load(folder / f"{name}_{rank}.pt", weights_only=False)


def assert_same_gradient(two: list[torch.Tensor], one: list[torch.Tensor]) -> None:
    assert len(two) == len(one)
    for a, b in zip(two, one):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert any(float(g.abs().max()) > 1e-3 for g in one)  # not a vacuous comparison


@pytest.mark.slow
def test_rredcot_train_on_two_processes_updates_as_one_process(init_dir, tmp_path):
    """``rredcot train``, one step per scenario: each process's gradient after the all-reduce
    equals one process's on the union of their rows (its rows in process order), where process
    1 skips every row (``cut``: one loss forward; ``cut_micro``: micro-batches, seq_mean),
    where process 1 runs fewer micro-batches than process 0 (``cut_fewer``, dr_grpo), where the
    agreeing rows of both are drawn to a budget, and where only process 0 has
    references (``sft``: an NLL pass there, a stand-in on process 1; ``luffy``: a reference
    row; ``bread``: branched rollouts), and where a KL penalty keeps process 1's zero-credit
    rows in the update (``kl``). The record's means (entropy, KL, rewards, ...) and totals
    (samples, tokens) are every process's rows'."""
    from train_two_process import EVERY, SCENARIOS

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    batch = str(tmp_path / "batch.pt")
    launch("train_two_process.py", str(init_dir), batch, str(one))
    launch("train_two_process.py", str(init_dir), batch, str(two), processes=2)
    for name in SCENARIOS:
        whole, first, second = load(one, name, 0), load(two, name, 0), load(two, name, 1)
        for a, b in zip(first["grads"], second["grads"]):
            assert torch.equal(a, b), name  # the processes hold one gradient
        assert_same_gradient(first["grads"], whole["grads"])
        assert first["rows"] + second["rows"] == whole["rows"], name
        assert first["policy_loss"] == pytest.approx(whole["policy_loss"], rel=1e-5)
        for key in EVERY:  # the record's means over every process's rows
            assert first[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-9), (name, key)
            assert second[key] == pytest.approx(first[key], rel=1e-9, abs=1e-12), (name, key)
    # what each scenario exercises happened
    cut = load(two, "cut", 1), load(two, "cut_micro", 1)
    assert all(r["update/rows_forwarded"] == 0.0 for r in cut)  # process 1 skipped every row
    assert load(two, "cut", 0)["update/rows_forwarded"] > 0
    assert load(two, "cut_fewer", 1)["update/rows_forwarded"] == 0.5
    kept = load(one, "budget", 0)["update/agreeing_rows_kept"]
    assert 0 < kept < 1 and load(two, "budget", 0)["update/agreeing_rows_kept"] == kept
    assert (load(two, "sft", 0)["sft_rows"], load(two, "sft", 1)["sft_rows"]) == (1, 0)
    assert load(one, "sft", 0)["sft_rows"] == 1
    for name in ("luffy", "bread"):  # process 0's batch grew, process 1's did not
        assert load(two, name, 0)["rows"] > load(two, name, 1)["rows"] == 8
    # the KL term keeps process 1's zero-credit rows in the update
    assert load(two, "kl", 1)["update/rows_forwarded"] == 1.0
    assert load(two, "kl", 0)["kl"] > 0 and load(two, "cut", 0)["kl"] == 0
    assert 0 < load(two, "budget", 0)["zero_variance_groups"] < 1
    # the run's totals: every process's samples and tokens (bread's branches charged)
    assert load(two, "cut", 1)["tokens_generated"] > 2 * load(two, "cut", 1)["samples_seen"] > 0
    assert load(two, "bread", 0)["extra_tokens_generated"] > 0


@pytest.mark.slow
def test_rredcot_train_credit_on_two_processes_as_one_process(init_dir, tmp_path):
    """``rredcot train``'s credit method over every process's rows: with the batch's std, with
    whitening over every token, with the shared prefixes' node values (prefix ids local to
    each process), and with a value head (its values, and its fit after the step), each process's gradient equals one process's on the union, and every process holds
    the same value head afterwards (the one process 0 checkpoints), after value pretraining on
    each process's own samples too."""
    from train_two_process import CREDIT_SCENARIOS

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    batch = str(tmp_path / "batch.pt")
    launch("train_two_process.py", str(init_dir), batch, str(one), "credit")
    launch("train_two_process.py", str(init_dir), batch, str(two), "credit", processes=2)
    for name in CREDIT_SCENARIOS:
        whole, first, second = load(one, name, 0), load(two, name, 0), load(two, name, 1)
        for a, b in zip(first["grads"], second["grads"]):
            assert torch.equal(a, b), name
        assert_same_gradient(first["grads"], whole["grads"])
        assert_same_state(first["state"], second["state"], exact=True)
        assert_same_state(first["state"], whole["state"], exact=False)
        for key in (k for k in whole if k.startswith("value/")):
            assert first[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-6), (name, key)
    assert load(one, "value_head", 0)["state"]["head"] is not None  # the head was fitted
    # value pretraining on each process's own samples leaves one head on every process
    assert_same_state(load(two, "pretrain", 0)["state"], load(two, "pretrain", 1)["state"], True)
    assert load(two, "pretrain", 0)["state"]["head"] is not None
    means = {"a": 0.5, "only0": 1.0, "only1": 1.0, "nan": 1.0}
    assert load(two, "mean_metrics", 0) == load(two, "mean_metrics", 1) == means


def assert_same_state(a, b, exact: bool) -> None:
    """Two methods' ``state_dict`` (nested dicts, lists, tensors, numbers) agree."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for key in a:
            assert_same_state(a[key], b[key], exact)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y, exact)
    elif isinstance(a, torch.Tensor):
        if exact:
            assert torch.equal(a, b)
        elif a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        else:
            assert torch.equal(a, b)
    elif isinstance(a, float):
        assert a == (b if exact else pytest.approx(b, rel=RTOL, abs=ATOL))
    else:
        assert a == b


@pytest.mark.slow
def test_rredcot_train_on_two_processes_resumes_as_it_would_have_run(init_dir, tmp_path):
    """``rredcot train`` under torchrun (two CPU processes), stopped after step 2 and resumed to
    step 3, logs what an uninterrupted 3-step run logs, and its totals count both processes'
    samples (what its token budget reads)."""
    import json

    def train(out, *flags):
        common = ["--threads", "1", "--progress", "false"]
        launch("-m", "rredcot", "train", "--out", str(out), *common, *flags, processes=2)

    shape = ["--init", str(init_dir), "--task.num_steps", "2", "--prompts_per_step", "4"]
    shape += ["--sampling.num_generations", "4", "--sampling.max_new_tokens", "16"]
    shape += ["--eval_every", "0", "--eval_size", "4", "--checkpoint_every", "1"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(whole, *shape, "--steps", "3")
    train(cut, *shape, "--steps", "2")
    train(cut, "--resume", str(cut), "--steps", "3")

    def records(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        timed = ("time/", "step_seconds", "eval_accuracy")  # clocks; a stopped run's last eval
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith(timed)} for line in lines
        ]

    assert records(cut) == records(whole)
    assert [r["samples_seen"] for r in records(whole)] == [0, 16, 32, 48]  # 4 prompts x 4


@pytest.mark.slow
def test_rredcot_train_on_two_processes_evaluates_as_one_process(tmp_path):
    """``rredcot train`` splits its held-out set over the processes (7 problems: 3 and 4) and
    sums what each solved: the shipped warm-start's accuracy before RL is one process's."""
    import json

    from rredcot.training.sft import SHIPPED_WARMSTARTS

    init = sorted(p for p in SHIPPED_WARMSTARTS.iterdir() if p.is_dir())[0]
    flags = ["--init", str(init), "--task.num_steps", "4", "--steps", "1", "--eval_size", "7"]
    flags += ["--prompts_per_step", "2", "--sampling.num_generations", "2"]
    flags += ["--threads", "1", "--progress", "false"]
    one, two = tmp_path / "one", tmp_path / "two"
    launch("-m", "rredcot", "train", "--out", str(one), *flags)
    launch("-m", "rredcot", "train", "--out", str(two), *flags, processes=2)

    def start(run):
        first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
        return first["step"], first["eval_accuracy"]

    assert start(two) == start(one) and start(one)[1] > 0


@pytest.mark.slow
def test_rredcot_sft_on_two_processes_trains_as_one_process(tmp_path):
    """``rredcot sft`` under torchrun (two CPU processes) splits each step's batch and its
    held-out set (7 problems: 3 and 4) between the processes: its warm-start is one process's
    (weights within float rounding, the same losses and accuracy), and process 0 alone logs and
    writes ``--out`` (nothing else is left beside it)."""
    import json

    from safetensors.torch import load_file

    from rredcot.training.sft import SHIPPED_WARMSTARTS

    init = sorted(p for p in SHIPPED_WARMSTARTS.iterdir() if p.is_dir())[0]
    flags = ["--init", str(init), "--task.num_steps", "4", "--batch_size", "4", "--lr", "1e-4"]
    flags += ["--max_steps", "20", "--stop_at_step", "2", "--eval_size", "7"]
    flags += ["--max_new_tokens", "64", "--progress", "false", "--threads", "1"]
    one, two = tmp_path / "one", tmp_path / "two"
    launch("-m", "rredcot", "sft", "--out", str(one), *flags)
    printed = launch("-m", "rredcot", "sft", "--out", str(two), *flags, processes=2)
    assert printed.count("warm-start: ") == 1, printed  # process 0's log only
    info = {run: json.loads((run / "warmstart.json").read_text()) for run in (one, two)}
    assert (info[one]["processes"], info[two]["processes"]) == (1, 2)
    first, second = info[one]["history"], info[two]["history"]
    assert [h["step"] for h in first] == [h["step"] for h in second] == [2]
    assert first[0]["eval_accuracy"] == second[0]["eval_accuracy"] > 0
    assert second[0]["loss"] == pytest.approx(first[0]["loss"], rel=1e-5)
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=RTOL, atol=ATOL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


@pytest.mark.slow
@pytest.mark.trl
def test_trl_on_two_processes_updates_as_one_process(tmp_path):
    """TRL's adapter, one step per ``references.mode`` with a group of 4 fixed, all-wrong
    completions split 2 + 2 across the processes: the gradient equals one process's on the
    whole group. ``sft``: process 0 (the group's first row) holds the reference and its NLL,
    process 1 none (a stand-in pass); ``luffy``: process 1 (the group's last row) puts the
    reference in place of its rollout, process 0 none; the reward functions' scores of it reach
    both processes' credit. The references' metrics are the same as in one process. Without
    references, ``credit.normalization='whiten'`` whitens over both processes' tokens. The
    methods that read the group's samples (``continuation_likelihood``, ``answer_likelihood``
    with ``source=group``) read them across processes: process 1, holding only wrong rows,
    values its prefixes as one process holding the whole group does; so does the value head's
    shared prefix (a node whose rows sit on both processes)."""
    from rredcot.models import build_char_tokenizer, build_tiny_llama

    model = tmp_path / "model"
    tok = build_char_tokenizer()
    build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0).save_pretrained(model)
    tok.save_pretrained(model)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    launch("trl_references_two_process.py", str(model), str(one))
    launch("trl_references_two_process.py", str(model), str(two), processes=2)
    holder = {"sft": 0, "luffy": 1}  # the process that holds the group's reference
    for mode, rank in holder.items():
        whole, mine, other = load(one, mode, 0), load(two, mode, rank), load(two, mode, 1 - rank)
        for a, b in zip(mine["grads"], other["grads"]):
            assert torch.equal(a, b), mode
        assert_same_gradient(mine["grads"], whole["grads"])
        assert (whole["rows"], mine["rows"], other["rows"]) == (4, 2, 2)
        assert (whole["own_references"], mine["own_references"]) == (1, 1)
        assert other["own_references"] == 0
        for key in ("rredcot/references/groups", "rredcot/references/tokens"):
            assert mine["logs"][key] == other["logs"][key] == whole["logs"][key] > 0
    # credit.normalization whiten: the token stage over every process's tokens
    whole, first, second = load(one, "whiten", 0), load(two, "whiten", 0), load(two, "whiten", 1)
    assert all(torch.equal(a, b) for a, b in zip(first["grads"], second["grads"]))
    assert_same_gradient(first["grads"], whole["grads"])
    for mode, key in (("sft", "sft_nll"), ("luffy", "shaped_ratio")):  # over every process
        logged = [load(two, mode, r)["logs"][f"rredcot/references/{key}"] for r in (0, 1)]
        expected = load(one, mode, 0)["logs"][f"rredcot/references/{key}"]
        assert logged == pytest.approx([expected] * 2, rel=1e-5)
    # methods that read the group's other samples: process 1 holds only the group's wrong
    # rows, and reads the right ones (continuations, answers) from process 0 (batch.peers)
    for mode in ("continuation", "answer"):
        whole, first, second = load(one, mode, 0), load(two, mode, 0), load(two, mode, 1)
        assert whole["rewards"] == first["rewards"] + second["rewards"] == [1.0, 1.0, 0.0, 0.0]
        both = torch.cat([first["values"], second["values"]])
        torch.testing.assert_close(both, whole["values"], rtol=RTOL, atol=ATOL)
        assert all(torch.equal(a, b) for a, b in zip(first["grads"], second["grads"]))
        assert_same_gradient(first["grads"], whole["grads"])
        # without its peers process 1 would value every prefix at 0 (no right sample of its own)
        assert torch.all(second["alone"][:, 0] == 0), mode
        assert torch.all(second["with_peers"][:, 0] > 0), mode
        width = second["with_peers"].shape[1]
        rows_of_one = whole["with_peers"][2:, :width]
        torch.testing.assert_close(second["with_peers"], rows_of_one, rtol=1e-4, atol=0)
    # the value head's shared prefixes: rows 0, 1 (process 0) and 3 (process 1) start with the
    # same line, a node whose value is the mean reward of the three (1/3) on both processes
    whole, first, second = (
        load(one, "value_head", 0),
        *(load(two, "value_head", r) for r in (0, 1)),
    )
    assert whole["rewards"] == first["rewards"] + second["rewards"] == [1.0, 0.0, 0.0, 0.0]
    both = torch.cat([first["values"], second["values"]])
    torch.testing.assert_close(both, whole["values"], rtol=RTOL, atol=ATOL)
    assert both[[0, 1, 3], 1].tolist() == pytest.approx([1 / 3] * 3)
    assert all(torch.equal(a, b) for a, b in zip(first["grads"], second["grads"]))
    assert_same_gradient(first["grads"], whole["grads"])
