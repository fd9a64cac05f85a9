"""Probes scored against the fast decoder's cache of the sampled batch
(rredcot.decode.score_probes, rredcot.methods.probe_logprobs.probe_logprobs_from_cache): the same
log-probs as the packed re-forward, forwarding the probe tokens only."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rredcot.batch import RolloutBatch
from rredcot.methods.probe_logprobs import (
    Probe,
    packed_probe_logprobs,
    probe_logprobs_from_cache,
)
from rredcot.rollout import sample_keeping_cache
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
