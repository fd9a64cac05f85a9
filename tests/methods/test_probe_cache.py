"""Probes scored against the fast decoder's cache of the sampled batch
(rredcot.sampling.decode.score_probes, rredcot.methods.probe_logprobs.probe_logprobs_from_cache): the same
log-probs as the packed re-forward, forwarding the probe tokens only."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from helpers import micro_config, train_step_with_grads
from rredcot.config import RESUMABLE_FIELDS, TrainConfig
from rredcot.methods.probe_logprobs import (
    Probe,
    packed_probe_logprobs,
    probe_logprobs_from_cache,
)
from rredcot.sampling import decode
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.rollout import sample_keeping_cache
from rredcot.tasks import Verdict, register_task
from rredcot.tasks.arithmetic import ArithmeticTask
from rredcot.training.trainer import Trainer
from tiny_lms import gqa_lm, lively

PROMPTS = ["1+2=?\n", "12*34+5=?\n", "7\n", "(3+4)*5-6=?\n"]  # different lengths: left padding


def _model(arch: str, tok, tiny_policy):
    if arch == "llama":
        return lively(tiny_policy, 0).eval()
    if arch == "llama_gqa":
        return gqa_lm(LlamaForCausalLM, LlamaConfig, tok, seed=1).eval()
    return gqa_lm(Qwen2ForCausalLM, Qwen2Config, tok, seed=2).eval()


def sampled_batch(model, tok, *, samples=2, max_new_tokens=10, eos=None, seed=0) -> RolloutBatch:
    """A batch of ``len(PROMPTS) x samples`` rows sampled with the fast decoder, its cache kept
    (``eos``: the id that ends a row; None: every row runs ``max_new_tokens``)."""
    torch.manual_seed(seed)
    ids, mask, P, response_mask, cache = sample_keeping_cache(
        model,
        _Tok(tok, eos),
        PROMPTS,
        num_generations=samples,
        max_new_tokens=max_new_tokens,
        decoder="fast",
        keep_cache=True,
    )
    assert cache is not None
    B = ids.shape[0]
    lengths = response_mask.sum(-1).long().tolist()
    bounds = [[0, n] for n in lengths]
    return RolloutBatch(
        input_ids=ids,
        attention_mask=mask,
        prompt_len=P,
        response_mask=response_mask,
        rewards=torch.zeros(B),
        group_ids=torch.arange(len(PROMPTS)).repeat_interleave(samples),
        boundaries=bounds,
        segment_ids=torch.zeros_like(response_mask, dtype=torch.long),
        probe_cache=cache,
    )


class _Tok:
    """The tokenizer with another EOS id (None: no row ends early)."""

    def __init__(self, tok, eos):
        self._tok, self.eos_token_id = tok, eos

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *args, **kwargs):
        return self._tok(*args, **kwargs)


def some_probes(batch: RolloutBatch, vocab: int, seed: int = 0) -> list[Probe]:
    """Several probes per row at boundaries 0, 1, the middle, the last and the full length,
    rows out of order, 1-4 tokens each."""
    g = torch.Generator().manual_seed(seed)
    lengths = batch.response_mask.sum(-1).long().tolist()
    probes = []
    for row in reversed(range(batch.size)):
        n = lengths[row]
        for k, b in enumerate(sorted({0, min(1, n), n // 2, max(n - 1, 0), n})):
            m = int(torch.randint(1, 5, (1,), generator=g))
            ids = tuple(torch.randint(3, vocab, (m,), generator=g).tolist())
            probes.append(Probe(row, k, b, ids))
    return probes


def _packed_only(policy, batch):
    def score(probes):
        return packed_probe_logprobs(policy, batch, probes)

    return score


@pytest.mark.parametrize("arch", ["llama", "llama_gqa", "qwen2"])
@pytest.mark.parametrize("eos", ["none", "mid"])
def test_cached_logprobs_equal_packed(arch, eos, char_tokenizer, tiny_policy):
    model = _model(arch, char_tokenizer, tiny_policy)
    end = None if eos == "none" else _common_token(model, char_tokenizer)
    batch = sampled_batch(model, char_tokenizer, eos=end)
    assert not batch.attention_mask[:, : batch.prompt_len].all()  # left padding
    probes = some_probes(batch, len(char_tokenizer))
    packed, _ = packed_probe_logprobs(model, batch, probes)
    cached, forwarded, from_cache = probe_logprobs_from_cache(
        model, batch, probes, _packed_only(model, batch)
    )
    assert from_cache == len(probes)
    for want, got, p in zip(packed, cached, probes):
        assert got.dtype == torch.float32 and got.shape == (len(p.ids),)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the probe tokens, plus the last decoded token where a probe follows a whole row
    # (sampled, never forwarded)
    lengths = batch.response_mask.sum(-1).long()
    filled = batch.probe_cache.filled
    tails = sum(int(lengths[r]) > filled for r in {p.row for p in probes})
    assert forwarded == sum(len(p.ids) for p in probes) + tails


def _common_token(model, tok) -> int:
    """A token that ends some sampled rows early and not others."""
    batch = sampled_batch(model, tok, eos=None, max_new_tokens=10)
    P = batch.prompt_len
    counts = torch.bincount(batch.input_ids[:, P + 1 :].flatten(), minlength=len(tok))
    return int(counts.argmax())


def _scored(model, batch, probes, **budget):
    """``(log-probs, forwarded, from the cache, re-forwarded probes)`` of
    :func:`probe_logprobs_from_cache`, the rest scored packed."""
    rest = []

    def packed(some):
        rest.extend(some)
        return packed_probe_logprobs(model, batch, some)

    logprobs, forwarded, from_cache = probe_logprobs_from_cache(
        model, batch, probes, packed, **budget
    )
    return logprobs, forwarded, from_cache, rest


def test_rows_reordered_dropped_or_changed_map_to_their_cache_rows(char_tokenizer, tiny_policy):
    """A batch whose rows were selected (reordered, some dropped) reads each row's own cache
    row; a row whose tokens are not the sampled ones (or that was added after sampling) is
    re-forwarded, the others still read the cache."""
    model = _model("llama_gqa", char_tokenizer, tiny_policy)
    batch = sampled_batch(model, char_tokenizer, samples=2)
    picked = batch.select([6, 1, 3, 0])
    changed = picked.input_ids.clone()
    changed[2, picked.prompt_len + 1] = (changed[2, picked.prompt_len + 1] + 1) % 40 + 3
    picked = picked.replace(input_ids=changed, attention_mask=picked.attention_mask)
    probes = some_probes(picked, len(char_tokenizer))
    want, _ = packed_probe_logprobs(model, picked, probes)
    got, _, from_cache, rest = _scored(model, picked, probes)
    assert {p.row for p in rest} == {2}  # its prefix beyond b = 1 is not the sampled one
    assert from_cache == sum(p.row != 2 for p in probes)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    extra = picked.replace(probe_cache=picked.probe_cache.appended(0).select([0, 1, 2, 3]))
    assert extra.probe_cache.rows.tolist() == picked.probe_cache.rows.tolist()
    unsampled = picked.probe_cache.appended(1).select([4, 0])
    assert unsampled.rows.tolist() == [-1, int(picked.probe_cache.rows[0])]


def test_a_changed_policy_or_a_freed_cache_reforwards(char_tokenizer, tiny_policy):
    model = _model("llama", char_tokenizer, tiny_policy)
    batch = sampled_batch(model, char_tokenizer)
    probes = some_probes(batch, len(char_tokenizer))
    assert _scored(model, batch, probes)[2] == len(probes)
    version = decode.parameter_version(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(batch.input_ids).logits.float().mean().backward()
    optimizer.step()
    assert decode.parameter_version(model) != version
    assert "parameters changed" in batch.probe_cache.unusable_reason(model)
    want, _ = packed_probe_logprobs(model, batch, probes)
    got, forwarded, from_cache, rest = _scored(model, batch, probes)
    assert from_cache == 0 and len(rest) == len(probes)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    fresh = sampled_batch(model, char_tokenizer)
    fresh.probe_cache.free()
    assert _scored(model, fresh, some_probes(fresh, len(char_tokenizer)))[2] == 0


def test_chunked_cached_pass_gives_the_same_logprobs(char_tokenizer, tiny_policy, monkeypatch):
    model = _model("qwen2", char_tokenizer, tiny_policy)
    batch = sampled_batch(
        model, char_tokenizer, samples=3, eos=_common_token(model, char_tokenizer)
    )
    lengths = batch.response_mask.sum(-1)
    assert lengths.min() < lengths.max()  # rows reading different numbers of decoded columns
    probes = sorted(some_probes(batch, len(char_tokenizer)), key=lambda p: int(lengths[p.row]))
    forwards = []
    own = decode._forward_queries
    monkeypatch.setattr(decode, "_forward_queries", lambda *a: forwards.append(1) or own(*a))
    whole, forwarded, _, _ = _scored(model, batch, probes)
    assert len(forwards) == 1
    small, forwarded_small, _, _ = _scored(model, batch, probes, max_batch_tokens=30, logits_mb=1)
    assert len(forwards) > 3  # one forward per row or two
    assert forwarded == forwarded_small
    for a, b in zip(whole, small):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_probe_from_cache_is_a_validated_switch():
    assert TrainConfig().probe_from_cache is True
    with pytest.raises(ValueError, match="probe_from_cache"):
        TrainConfig(probe_from_cache="yes")
    assert "probe_from_cache" in RESUMABLE_FIELDS


@register_task("test_probe_cache_digit_first")
class _DigitFirstTask(ArithmeticTask):
    """Reward 1 when the completion starts with a digit: a random policy's groups mix rewards,
    so the advantages are not zero."""

    def verify(self, problem, completion):
        return Verdict(float(completion[:1].isdigit()), None, None, "digit first")


def _trainer(init_dir, out, method: str, probe_from_cache: bool):
    cfg = micro_config(
        init_dir,
        out,
        credit_method=method,
        steps=2,
        task="test_probe_cache_digit_first",
        prompts_per_step=4,
        probe_from_cache=probe_from_cache,
    )
    cfg.credit.segmenter = "tokens:3"  # boundaries inside every row: probes after real prefixes
    cfg.credit.handover.mode = "off"  # the method's credit itself, not GRPO's, from step 1
    trainer = Trainer(cfg, log=lambda *_: None)
    trainer.generation_rows = 0  # the batch sampled at once: its cache is kept
    values = []
    own = trainer.method.boundary_values

    def recorded(batch):
        out = own(batch)
        values.append(out[0].detach().clone())
        return out

    trainer.method.boundary_values = recorded
    return trainer, values


@pytest.mark.parametrize("method", ["continuation_likelihood", "answer_likelihood"])
def test_train_step_credit_from_the_cache_equals_the_reforward(init_dir, tmp_path, method):
    """A two-step run with the cache on and off: the same first update (probe values, credit,
    advantages, gradients to float rounding), fewer extra forward tokens, and the cache read on
    both steps (the second samples after an update, with a fresh cache)."""
    records, grads, values = {}, {}, {}
    for on in (True, False):
        trainer, values[on] = _trainer(init_dir, tmp_path / f"run{on}", method, on)
        records[on], grads[on] = train_step_with_grads(trainer, 1)
        trainer.step = 2
        second = trainer.train_step(2)
        assert second["credit/probe_from_cache"] == float(on)
        assert trainer.cfg.probe_from_cache == on
        trainer.release()
    on, off = records[True], records[False]
    assert (on["credit/probe_from_cache"], off["credit/probe_from_cache"]) == (1.0, 0.0)
    assert on["reward_mean"] == off["reward_mean"]
    assert 0 < on["reward_mean"] < 1 and on["advantage_abs_mean"] > 1e-3
    probed = values[True][0][:, :-1]
    assert (probed > 0).any()
    torch.testing.assert_close(values[True][0], values[False][0], rtol=1e-3, atol=1e-9)
    for key in ("advantage_abs_mean", "policy_loss", "credit/mean_abs_segment_reward"):
        assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
    assert 0 < on["credit/extra_forward_tokens"] < off["credit/extra_forward_tokens"]
    if method == "answer_likelihood":  # the probe tokens, and a row's last token where probed
        rows = 4 * 4
        probe_tokens = on["credit/probe_tokens"]
        assert probe_tokens <= on["credit/extra_forward_tokens"] <= probe_tokens + rows


@pytest.mark.parametrize("setting", ["hf_decoder", "tree"])
def test_runs_without_the_fast_decoders_cache_reforward(init_dir, tmp_path, setting):
    """Hugging Face generate and tree sampling keep no cache: the probes re-forward."""
    cfg = micro_config(
        init_dir, tmp_path / "run", credit_method="answer_likelihood", steps=1, prompts_per_step=2
    )
    if setting == "hf_decoder":
        cfg.sampling.decoder = "hf"
    else:
        cfg.sampling.tree.enabled = True
    trainer = Trainer(cfg, log=lambda *_: None)
    trainer.step = 1
    record = trainer.train_step(1)
    assert record["credit/probe_from_cache"] == 0.0
    assert record["credit/extra_forward_tokens"] > record["credit/probe_tokens"]
    trainer.release()
