"""Memory bounded by a micro-batch (rredcot.sampling.memory): the update accumulated over micro-batches has
the whole batch's gradient, chosen-token log-probs from the chunked log-softmax equal
``log_softmax`` + ``gather`` (values, entropies and gradients, bit for bit), the automatic
``micro_batch_tokens`` rule, and a run that cannot fit is refused before it samples."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import micro_config, train_step_with_grads
from rredcot.errors import UserError
from rredcot.sampling import memory
from rredcot.sampling.forward import chosen_token_logprobs, policy_forward, scoring_forward
from rredcot.sampling.memory import ModelShape, auto_micro_batch_tokens, micro_batches
from rredcot.tasks import Verdict, register_task
from rredcot.tasks.arithmetic import ArithmeticTask
from rredcot.training.trainer import Trainer


@register_task("test_micro_batch_digit_first")
class _DigitFirstTask(ArithmeticTask):
    """Reward 1 when the completion starts with a digit: a random policy's groups mix rewards,
    so the advantages (and the gradients compared below) are not zero."""

    def verify(self, problem, completion):
        return Verdict(float(completion[:1].isdigit()), None, None, "digit first")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chosen_token_logprobs_equal_log_softmax_then_gather(dtype, temperature):
    torch.manual_seed(0)
    B, T, V = 3, 11, 257
    logits = (torch.randn(B, T, V) * 3).to(dtype).requires_grad_(True)
    targets = torch.randint(0, V, (B, T))
    weights = torch.randn(B, T)

    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    logp = F.log_softmax(scaled, dim=-1)
    want = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_entropy = -(logp.exp() * logp).sum(-1)
    (want * weights).sum().backward()
    want_grad, logits.grad = logits.grad.clone(), None

    # chunks of 5 rows of the flattened (B * T, V) logits: several chunks, a ragged last one
    got, entropy = chosen_token_logprobs(
        logits, targets, temperature, with_entropy=True, chunk_bytes=5 * 4 * V
    )
    (got * weights).sum().backward()
    assert torch.equal(got, want.detach())
    assert torch.equal(entropy, want_entropy.detach())
    assert not entropy.requires_grad
    assert torch.equal(logits.grad, want_grad)


def test_micro_batches_split_by_tokens_and_keep_at_least_one_row():
    rows = torch.arange(7)
    assert [m.tolist() for m in micro_batches(rows, 10, 30)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [m.tolist() for m in micro_batches(rows, 10, 70)] == [list(range(7))]
    assert [len(m) for m in micro_batches(rows, 10, 5)] == [1] * 7  # a row over the budget


def test_rows_cut_to_different_lengths_pack_by_their_longest_row():
    rows = torch.arange(10, 17)
    # budget 30, in order: [10, 4, 4] takes 3 x 10 = 30; [4, 4] and 12 would take 3 x 12 = 36;
    # [12, 4] takes 2 x 12 = 24
    lengths = torch.tensor([10, 4, 4, 4, 4, 12, 4])
    assert [m.tolist() for m in micro_batches(rows, lengths, 30)] == [
        [10, 11, 12],
        [13, 14],
        [15, 16],
    ]
    same = torch.full((7,), 10)  # equal lengths: as with one length for all
    assert [m.tolist() for m in micro_batches(rows, same, 30)] == [
        m.tolist() for m in micro_batches(rows, 10, 30)
    ]
    assert [len(m) for m in micro_batches(rows, lengths, 5)] == [1] * 7


def test_auto_micro_batch_tokens_rule():
    smollm2 = ModelShape(
        vocab=49152, hidden=576, layers=30, kv_width=192, parameters=1, trainable=1, param_bytes=4
    )
    per_token = 4 * (3 * 49152 + 16 * 576 * 30)
    assert smollm2.forward_bytes_per_token() == per_token
    gib = 1 << 30
    # CPU: min(free / 8, 1 GiB) / bytes per token
    assert auto_micro_batch_tokens(smollm2, 24 * gib, "cpu") == gib // per_token
    assert auto_micro_batch_tokens(smollm2, 2 * gib, "cpu") == (gib // 4) // per_token
    # GPU: free / 4, no cap
    assert auto_micro_batch_tokens(smollm2, 100 * gib, "cuda") == (25 * gib) // per_token
    # never under 64 tokens
    assert auto_micro_batch_tokens(smollm2, 1 << 20, "cpu") == 64


def test_scoring_forward_in_micro_batches_equals_one_forward(tiny_policy, char_tokenizer):
    torch.manual_seed(0)
    ids = torch.randint(3, 40, (6, 9))
    ids[2:4, :4] = ids[0, :4]  # rows sharing a prompt, split across micro-batches below
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with torch.no_grad():
        whole = policy_forward(tiny_policy, ids, mask, 4, with_entropy=True, hidden_layers=(1, 2))
    parts = scoring_forward(
        tiny_policy, ids, mask, 4, micro_batch_tokens=2 * 9, with_entropy=True, hidden_layers=(1, 2)
    )
    for name in ("logprobs", "entropy", "hidden_states"):
        a, b = getattr(whole, name), getattr(parts, name)
        assert a.shape == b.shape
        if name == "hidden_states":  # the padding positions' states are never read
            a, b = a[mask.bool()], b[mask.bool()]
        assert torch.allclose(a, b, atol=1e-5), name


def _micro_trainer(init_dir, out, micro_batch_tokens, **overrides):
    cfg = micro_config(
        init_dir, out, steps=1, task="test_micro_batch_digit_first", prompts_per_step=4, **overrides
    )
    cfg.micro_batch_tokens = micro_batch_tokens
    cfg.credit.segmenter = "tokens:2"
    return Trainer(cfg, log=lambda *_: None)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean", "dr_grpo"])
@pytest.mark.parametrize(
    "method, single_forward",
    [("uniform", True), ("value_head", True), ("uniform", False)],
    ids=["on_policy_only_pass", "scoring_pass_then_update", "two_pass"],
)
def test_update_gradient_in_micro_batches_equals_the_whole_batch_gradient(
    init_dir, tmp_path, loss_agg, method, single_forward
):
    """One row per micro-batch against the whole batch at once (the automatic budget holds the
    tiny model's batch), with the KL term on: the same gradient to float rounding (the sum over
    micro-batches adds the per-row terms in another order), for each loss aggregation."""
    grads, records, trainers = {}, {}, {}
    for tokens in (0, 1):
        trainer = _micro_trainer(
            init_dir,
            tmp_path / f"run{tokens}",
            tokens,
            loss_agg=loss_agg,
            credit_method=method,
            kl_coef=0.1,
            single_forward=single_forward,
        )
        trainer.cfg.credit.handover.mode = "off"
        trainer.generation_rows = 0  # both sample the batch at once: the same rows to update on
        trainers[tokens] = trainer
        records[tokens], grads[tokens] = train_step_with_grads(trainer)
    whole, micro = trainers[0], trainers[1]
    probe = torch.arange(4)
    assert len(micro._micro_batches(_batch_like(8, 20), probe)) == 4  # one row each
    assert len(whole._micro_batches(_batch_like(8, 20), probe)) == 1
    assert records[1]["policy_loss"] == pytest.approx(records[0]["policy_loss"], rel=1e-5, abs=1e-7)
    assert records[1]["kl"] == pytest.approx(records[0]["kl"], rel=1e-5, abs=1e-9)
    assert records[1]["reward_mean"] == records[0]["reward_mean"]
    assert any(g.abs().max() > 0 for g in grads[0])
    for a, b in zip(grads[0], grads[1]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


class _batch_like:
    """What ``Trainer._micro_batches`` reads of a batch: its row count and padded length."""

    def __init__(self, rows: int, length: int) -> None:
        self.size = rows
        self.input_ids = torch.zeros(rows, length, dtype=torch.long)


def test_a_run_that_cannot_fit_is_refused_before_it_samples(init_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1 << 30)
    cfg = micro_config(init_dir, tmp_path / "big", steps=1)
    cfg.sampling.num_generations = 100000
    cfg.sampling.max_new_tokens = 64
    with pytest.raises(UserError, match=r"--sampling\.num_generations \(100000\)") as err:
        Trainer(cfg, log=lambda *_: None)
    assert "GiB" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "big" / "metrics.jsonl").exists()

    cfg = micro_config(init_dir, tmp_path / "mb", steps=1)
    cfg.micro_batch_tokens = 10**9
    with pytest.raises(UserError, match="lower --micro_batch_tokens"):
        Trainer(cfg, log=lambda *_: None)

    cfg = micro_config(init_dir, tmp_path / "ok", steps=1)
    cfg.micro_batch_tokens = 256
    assert Trainer(cfg, log=lambda *_: None).micro_batch_tokens == 256


def test_sampling_in_chunks_of_whole_groups(tiny_policy, char_tokenizer):
    """``max_rows`` generates whole prompts' groups at a time; at or above the batch it draws
    exactly what one generation draws."""
    from rredcot.sampling.rollout import sample

    prompts = ["1+2=?\n", "3*4=?\n", "12+7=?\n"]

    def draw(max_rows):
        torch.manual_seed(0)
        return sample(
            tiny_policy,
            char_tokenizer,
            prompts,
            num_generations=4,
            max_new_tokens=10,
            max_rows=max_rows,
        )

    whole = draw(0)
    assert all(torch.equal(a, b) for a, b in zip(draw(12), whole) if torch.is_tensor(a))
    ids, mask, P, response_mask = draw(5)  # one prompt's 4 rows at a time
    assert whole[2] == P and ids.shape[0] == 12 and ids.shape[1] <= whole[0].shape[1]
    assert torch.equal(ids[:, :P], whole[0][:, :P])  # the same prompts, in the same rows
    assert response_mask.shape == (12, ids.shape[1] - P)
    assert torch.equal(mask[:, P:], response_mask.long())


def test_generation_rows_fit_the_micro_batch_budget():
    shape = ModelShape(
        vocab=49152, hidden=576, layers=30, kv_width=192, parameters=1, trainable=1, param_bytes=4
    )
    rows = memory.generation_rows(shape, 633, 214)
    per_row = 214 * 2 * 30 * 192 * 4 + 16 * 49152
    assert rows == (633 * shape.forward_bytes_per_token()) // per_row
    assert 64 < rows < 128  # SmolLM2 at the defaults: the 128-row batch in two parts


@pytest.mark.slow
def test_bench_memory_measures_a_step_in_its_own_process(tmp_path):
    from rredcot.bench.configs import MemoryBenchConfig
    from rredcot.bench.memory import _cells, run_memory_bench

    cfg = MemoryBenchConfig(
        methods="uniform,value_head",
        models="tiny",
        scales="1,2",
        scaled_methods="uniform",
        prompts_per_step=2,
        threads=1,
        out=str(tmp_path / "memory"),
    )
    assert _cells(cfg) == [
        ("tiny", "uniform", 1),
        ("tiny", "value_head", 1),
        ("tiny", "uniform", 2),
    ]
    with pytest.raises(ValueError, match="--scales"):
        MemoryBenchConfig(scales="1,x")

    cfg.methods, cfg.scales = "uniform", "1"
    (result,) = run_memory_bench(cfg, log=lambda *_: None)["results"]
    assert "error" not in result, result
    assert result["rows"] == 2 * 8
    assert 0 < result["setup_rss"] <= result["step_peak_rss"] <= result["process_peak_rss"] * 1.05
    table = (tmp_path / "memory" / "memory.md").read_text()
    assert "| tiny" in table and "uniform" in table


@pytest.mark.slow
def test_bench_memory_keeps_the_peak_so_far_of_a_step_that_runs_out_of_time(tmp_path):
    # a SmolLM2 monte_carlo step takes hours on a CPU: its row still says how high memory went
    from rredcot.bench.memory import GIB, _run_child

    spec = {
        "model": None,
        "task": "arithmetic",
        "method": "uniform",
        "prompts": 1,
        "steps": 10**6,  # never finishes: stopped by the timeout
        "seed": 0,
        "threads": 1,
        "out": str(tmp_path / "run"),
        "report_every": 0.2,
    }
    result = _run_child(spec, timeout=40)
    assert result["error"].startswith("timed out after 40 s after "), result
    assert "step peak so far" in result["error"]
    assert 0 < result["setup_rss"] <= result["partial_step_peak_rss"] < 8 * GIB


def test_bench_memory_fails_when_a_measurement_fails(tmp_path, monkeypatch):
    # a measurement that fails at run time (not a timeout, which is a measured lower bound)
    # is written to the table and the command fails, naming it
    import rredcot.bench.memory as memory
    from rredcot.bench.configs import MemoryBenchConfig
    from rredcot.errors import UserError

    outcomes = iter([{"error": "exit 1: OSError: no model"}, {"error": "timed out after 5 s"}])
    monkeypatch.setattr(memory, "_run_child", lambda spec, timeout: next(outcomes))
    cfg = MemoryBenchConfig(
        methods="uniform,value_head", models="tiny", scales="1", out=str(tmp_path / "m")
    )
    with pytest.raises(UserError, match="1 of 2 measurements failed.*uniform: exit 1: OSError"):
        memory.run_memory_bench(cfg, log=lambda *_: None)
    table = (tmp_path / "m" / "memory.md").read_text()
    assert "exit 1: OSError: no model" in table and "timed out after 5 s" in table
    outcomes = iter([{"error": "timed out after 5 s"}] * 2)  # timeouts alone: no failure
    memory.run_memory_bench(cfg, log=lambda *_: None)


@pytest.mark.parametrize(
    ("single_pass", "rows", "reads", "plan"),
    [
        (False, 2, False, (True, False, False)),  # off-policy: always a scoring pass
        (True, 2, True, (False, True, False)),  # one micro-batch, the credit reads the forward
        (True, 2, False, (False, False, True)),  # one micro-batch, the credit reads none
        (True, 9, True, (True, False, False)),  # several: the graph cannot wait for the credit
        (True, 9, False, (False, False, False)),  # several, nothing read: forwarded in the update
    ],
)
def test_a_steps_forward_plan(single_pass, rows, reads, plan):
    from rredcot.sampling.memory import forward_plan

    got = forward_plan(rows, 10, 40, single_pass=single_pass, reads_forward=reads)
    assert (got.scoring_pass, got.loss_forward_first, got.loss_forward_after) == plan
