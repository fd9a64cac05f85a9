"""Log-probabilities of probes: token ids written right after a prefix of a rollout.

A :class:`Probe` is a short sequence of token ids appended after the first ``b`` response tokens
of a row (answer likelihood probes a correct answer, :mod:`rredcot.methods.answer_probes`;
continuation likelihood a known-good continuation). This module scores the per-token log-probs of
every probe under the policy, with no generation.

**Packed** (:func:`packed_probe_logprobs`): all probes of a trace go into **one** forward row
``[prompt | response up to b_{n-1} | probe_0 | probe_1 | ...]`` with a 4D float attention mask (0
allowed, dtype-min elsewhere) under which each probe sees the prompt, the response up to its
boundary and its own earlier tokens, and position ids that continue from its prefix.
**From the cache** (:func:`probe_logprobs_from_cache`): where the batch carries the fast
decoder's cache of its sampling (``batch.probe_cache``, train's ``probe_from_cache``) and the
policy is unchanged since, only the probe tokens are forwarded, against the cached keys and values
of the prompt and prefix (:func:`rredcot.sampling.decode.score_probes`); other rows fall back to packing.
**Unpacked** (:func:`unpacked_probe_logprobs`): one left-padded row per probe, the reference, and
the fallback for models whose attention does not take a custom 4D mask
(:func:`packing_supported`); :func:`probe_pass_tokens` says what falling back costs.
:class:`ProbeScorer` is what the credit methods call: the cache first, then packed, then
unpacked, with the warnings and counts they report; :func:`packing_disagrees` is their first-batch
check that a model honours the packed mask.

Rows are grouped into forwards of at most ``max_batch_tokens`` tokens. The forward runs the
model's trunk only (``get_decoder()``); the output head is applied to the hidden states of the
scored positions alone, at most ``logits_mb`` MiB of fp32 logits at a time, so no
``(rows, length, vocab)`` logits tensor is ever built (models whose trunk and head do not
reproduce their logits on a first check use the full forward). What this saves at a real
vocabulary: docs/answer_likelihood.md (Memory at a real vocabulary) and
``benchmarks/results/answer_likelihood_memory/``.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.decode import score_probes
from rredcot.sampling.forward import eval_mode, position_ids_from_mask
from rredcot.sampling.memory import token_chunks

_PACKED_ATTENTION = ("eager", "sdpa")  # attention implementations that add a custom 4D mask
PACKING_MODES = ("auto", "packed", "unpacked")


@dataclass(frozen=True)
class Probe:
    """One probe: token ids ``ids`` scored right after boundary ``b`` of row ``row`` (an answer,
    or a known-good continuation)."""

    row: int
    k: int  # boundary index: the prefix is s_k
    b: int  # response tokens in the prefix (b_k)
    ids: tuple[int, ...]


def prompt_token_ids(batch: RolloutBatch, row: int) -> list[int]:
    """The non-pad prompt tokens of ``row``."""
    P = batch.prompt_len
    keep = batch.attention_mask[row, :P].bool()
    return batch.input_ids[row, :P][keep].tolist()


def model_device_dtype(policy) -> tuple[torch.device, torch.dtype]:
    """The device of the policy's parameters, and their dtype (float32 if they are not float)."""
    param = next(policy.parameters())
    dtype = param.dtype if param.dtype.is_floating_point else torch.float32
    return param.device, dtype


def _unwrap(policy):
    """The model inside a DDP / DeepSpeed style wrapper (``.module``)."""
    while isinstance(getattr(policy, "module", None), nn.Module):
        policy = policy.module
    return policy


def _plain_forward(policy):
    """The model's own ``forward`` at its parameters' dtype: the class's method on the unwrapped
    model. Mixed precision (accelerate's ``prepare`` with bf16, as TRL runs on a CPU by default)
    wraps the *instance's* forward in an autocast; calling the trunk directly bypasses that
    wrapper, so the logits it is checked against must bypass it too."""
    model = _unwrap(policy)
    return type(model).forward.__get__(model)


def _no_autocast(device: torch.device):
    """Probe log-probs at the parameters' own dtype whatever autocast is active outside: packed
    and unpacked passes then agree to that dtype's precision (under a bf16 autocast they differ
    by bf16 noise, which read as a mask the model does not honour; its size on SmolLM2-135M:
    docs/answer_likelihood.md)."""
    return torch.autocast(device_type=device.type, enabled=False)


def _vocab_size(policy, head: nn.Module | None) -> int:
    size = getattr(head, "out_features", None) or getattr(
        getattr(_unwrap(policy), "config", None), "vocab_size", None
    )
    if not size:
        raise ValueError("cannot tell the policy's vocabulary size (no config.vocab_size)")
    return int(size)


def _softcap(policy, logits: Tensor) -> Tensor:
    cap = getattr(getattr(_unwrap(policy), "config", None), "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


_SPLIT_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _trunk_and_head(policy) -> tuple[nn.Module, nn.Module] | None:
    """``(trunk, output head)`` of a causal LM whose ``head(trunk(x))`` (soft-capped as the model
    does) reproduces its logits, checked once per model on a short input; None otherwise."""
    model = _unwrap(policy)
    if model in _SPLIT_CHECKED:
        return _SPLIT_CHECKED[model]
    split = None
    try:
        trunk, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError, ValueError):
        trunk = head = None
    separable = isinstance(trunk, nn.Module) and isinstance(head, nn.Module) and trunk is not model
    if separable:
        device, dtype = model_device_dtype(model)
        vocab = _vocab_size(model, head)
        ids = (torch.arange(6, device=device) * 7 + 3).remainder(vocab).unsqueeze(0)
        with torch.no_grad(), eval_mode(model), _no_autocast(device):
            try:
                full = _plain_forward(model)(input_ids=ids, use_cache=False).logits.float()
                hidden = _last_hidden(trunk(input_ids=ids, use_cache=False))
                mine = _softcap(model, head(hidden)).float()
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                if mine.shape == full.shape and bool(
                    ((mine - full).abs() <= tol * (1.0 + full.abs())).all()
                ):
                    split = (trunk, head)
            except (RuntimeError, TypeError, ValueError, AttributeError):
                split = None
    if split is None:
        why = "do not reproduce its logits" if separable else "are not separable"
        warnings.warn(
            f"probe scoring: {type(model).__name__}'s trunk and output head "
            f"(get_decoder(), get_output_embeddings()) {why}; probes are scored from the full "
            f"logits: {4 * (getattr(model.config, 'vocab_size', 0) or 0) / 2**20:.2f} MiB of fp32 "
            "per forwarded token "
            "(rows x length x vocabulary) instead of per probe token only (lower the method's "
            "chunk_tokens, e.g. credit.answer_likelihood.chunk_tokens, if it runs out)",
            stacklevel=3,
        )
    _SPLIT_CHECKED[model] = split
    return split


def _last_hidden(output) -> Tensor:
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if hidden is not None else output[0]


def _score(
    policy,
    forward: dict[str, Tensor],
    predictors: list[tuple[int, Tensor, Tensor, int]],
    out: list,
    logits_mb: int,
) -> None:
    """Log-probs of each probe's targets at its predictor columns, into ``out[i]``.

    The trunk's hidden states are gathered at the predictor positions before the output head, and
    the head and log-softmax run over at most ``logits_mb`` MiB of fp32 logits at a time.
    """
    if not predictors:
        return
    with _no_autocast(forward["input_ids"].device):
        _score_at_own_dtype(policy, forward, predictors, out, logits_mb)


def _score_at_own_dtype(policy, forward, predictors, out, logits_mb) -> None:
    split = _trunk_and_head(policy)
    device = forward["input_ids"].device
    rows = torch.cat([torch.full_like(cols, r) for r, cols, _, _ in predictors]).to(device)
    cols = torch.cat([c for _, c, _, _ in predictors]).to(device)
    targets = torch.cat([t for _, _, t, _ in predictors]).to(device)
    if split is not None:
        trunk, head = split
        picked = _last_hidden(trunk(**forward, use_cache=False))[rows, cols]  # (N, H)

        def logits_of(sl: slice) -> Tensor:
            return _softcap(policy, head(picked[sl]))
    else:
        head = None
        picked = _plain_forward(policy)(**forward, use_cache=False).logits[rows, cols]  # (N, V)

        def logits_of(sl: slice) -> Tensor:
            return picked[sl]

    step = max(1, (logits_mb << 20) // (4 * _vocab_size(policy, head)))
    token_logp = torch.empty(len(targets), dtype=torch.float32)
    for start in range(0, len(targets), step):
        sl = slice(start, start + step)
        logits = logits_of(sl).float()
        chosen = logits.gather(-1, targets[sl].unsqueeze(-1)).squeeze(-1)
        token_logp[sl] = (chosen - torch.logsumexp(logits, dim=-1)).cpu()
        del logits
    start = 0
    for _, c, _, i in predictors:
        out[i] = token_logp[start : start + len(c)]
        start += len(c)


@torch.no_grad()
def packed_probe_logprobs(
    policy,
    batch: RolloutBatch,
    probes: list[Probe],
    max_batch_tokens: int = 16384,
    logits_mb: int = 256,
) -> tuple[list[Tensor], int]:
    """Per-token log-probs of every probe, all probes of a trace in one packed row.

    Row layout ``[prompt (P columns, left-padded) | response[:c] | probe_0 | probe_1 | ...]``
    (``c`` the largest boundary probed in that row), right-padded to the chunk's longest row.
    Mask ``(R, 1, L, L)``: context tokens are causal over the non-pad context; a probe at
    boundary ``b`` sees the prompt, ``response[:b]`` and its own earlier tokens. Positions of a
    probe continue from its prefix (``prompt tokens + b``). Rows go into forwards of at most
    ``max_batch_tokens`` (rows x longest row); ``logits_mb`` bounds the logits (see
    :func:`_score`).

    Returns (one ``(len(probe.ids),)`` float tensor per probe, in order; tokens forwarded).
    """
    device, dtype = model_device_dtype(policy)
    P = batch.prompt_len
    by_row: dict[int, list[int]] = {}
    for i, p in enumerate(probes):
        by_row.setdefault(p.row, []).append(i)
    rows = list(by_row)
    ctx = {r: max(probes[i].b for i in by_row[r]) for r in rows}
    lengths = [P + ctx[r] + sum(len(probes[i].ids) for i in by_row[r]) for r in rows]
    pad = _pad_id(policy)
    out: list[Tensor | None] = [None] * len(probes)
    forwarded = 0
    for group in token_chunks(lengths, max_batch_tokens):
        L = max(lengths[g] for g in group)
        R = len(group)
        ids = torch.full((R, L), pad, dtype=torch.long)
        pos = torch.zeros(R, L, dtype=torch.long)
        allowed = torch.zeros(R, L, L, dtype=torch.bool)
        allowed[:, torch.arange(L), torch.arange(L)] = True  # pad queries see themselves only
        predictors: list[tuple[int, Tensor, Tensor, int]] = []  # (r, cols, targets, i)
        for r, g in enumerate(group):
            row = rows[g]
            C = P + ctx[row]
            ids[r, :C] = batch.input_ids[row, :C].cpu()
            key = torch.ones(C, dtype=torch.bool)
            key[:P] = batch.attention_mask[row, :P].bool().cpu()
            allowed[r, :C, :C] = torch.tril(torch.ones(C, C, dtype=torch.bool)) & key
            allowed[r, torch.arange(C), torch.arange(C)] = True
            pos[r, :C] = position_ids_from_mask(key.long())
            n_prompt = int(key[:P].sum())
            forwarded += n_prompt + ctx[row]
            start = C
            for i in by_row[row]:
                p = probes[i]
                m = len(p.ids)
                sl = slice(start, start + m)
                ids[r, sl] = torch.tensor(p.ids)
                allowed[r, sl, :P] = key[:P]
                allowed[r, sl, P : P + p.b] = True
                allowed[r, sl, sl] = torch.tril(torch.ones(m, m, dtype=torch.bool))
                pos[r, sl] = n_prompt + p.b + torch.arange(m)
                cols = torch.cat([torch.tensor([P + p.b - 1]), torch.arange(start, start + m - 1)])
                predictors.append((r, cols, torch.tensor(p.ids), i))
                forwarded += m
                start += m
        mask = torch.zeros(R, 1, L, L, dtype=dtype)
        mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)
        del allowed
        forward = {
            "input_ids": ids.to(device),
            "attention_mask": mask.to(device),
            "position_ids": pos.to(device),
        }
        del mask
        _score(policy, forward, predictors, out, logits_mb)
    return out, forwarded  # type: ignore[return-value]


@torch.no_grad()
def unpacked_probe_logprobs(
    policy,
    batch: RolloutBatch,
    probes: list[Probe],
    max_batch_tokens: int = 16384,
    logits_mb: int = 256,
) -> tuple[list[Tensor], int]:
    """The same log-probs as :func:`packed_probe_logprobs`, one left-padded row per probe
    (``prompt + response[:b] + probe``): the reference, and the fallback for models that do not
    take a custom 4D attention mask."""
    device, _ = model_device_dtype(policy)
    P = batch.prompt_len
    seqs = []
    for p in probes:
        prefix = prompt_token_ids(batch, p.row) + batch.input_ids[p.row, P : P + p.b].tolist()
        seqs.append(prefix + list(p.ids))
    pad = _pad_id(policy)
    out: list[Tensor | None] = [None] * len(probes)
    forwarded = sum(len(s) for s in seqs)
    for group in token_chunks([len(s) for s in seqs], max_batch_tokens):
        L = max(len(seqs[i]) for i in group)
        ids = torch.full((len(group), L), pad, dtype=torch.long)
        attn = torch.zeros(len(group), L, dtype=torch.long)
        predictors = []
        for r, i in enumerate(group):
            s = seqs[i]
            ids[r, L - len(s) :] = torch.tensor(s)
            attn[r, L - len(s) :] = 1
            m = len(probes[i].ids)
            predictors.append((r, torch.arange(L - m - 1, L - 1), torch.tensor(probes[i].ids), i))
        forward = {
            "input_ids": ids.to(device),
            "attention_mask": attn.to(device),
            "position_ids": position_ids_from_mask(attn).to(device),
        }
        _score(policy, forward, predictors, out, logits_mb)
    return out, forwarded  # type: ignore[return-value]


def probe_pass_tokens(batch: RolloutBatch, probes: list[Probe]) -> tuple[int, int]:
    """``(packed, unpacked)``: the tokens a probe pass forwards with one packed row per trace
    (prompt, the longest probed prefix, every probe) and with one row per probe (each re-runs its
    prompt and prefix). Their ratio is what falling back to unpacked probing costs."""
    P = batch.prompt_len
    prompt = batch.attention_mask[:, :P].sum(dim=1).tolist()
    longest: dict[int, int] = {}
    packed = unpacked = 0
    for p in probes:
        longest[p.row] = max(longest.get(p.row, 0), p.b)
        packed += len(p.ids)
        unpacked += int(prompt[p.row]) + p.b + len(p.ids)
    packed += sum(int(prompt[r]) + b for r, b in longest.items())
    return packed, unpacked


def _pad_id(policy) -> int:
    pad = getattr(getattr(policy, "config", None), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def packing_supported(policy) -> bool:
    """Whether the policy's attention implementation adds a custom 4D float mask as given."""
    impl = getattr(getattr(policy, "config", None), "_attn_implementation", None)
    return impl in _PACKED_ATTENTION


def cached_rows(policy, batch: RolloutBatch, probes: list[Probe]) -> dict[int, int]:
    """``{batch row: sampled row of batch.probe_cache}`` for every probed row whose prompt and
    longest probed prefix the cache holds token for token, for the current ``policy``; empty
    where there is no cache, another model or parameters changed since sampling."""
    cache = batch.probe_cache
    if cache is None or not probes or cache.unusable_reason(_unwrap(policy)) is not None:
        return {}
    if batch.prompt_len != cache.prompt_ids.shape[1]:
        return {}
    P = batch.prompt_len
    longest: dict[int, int] = {}
    for p in probes:
        longest[p.row] = max(longest.get(p.row, 0), p.b)
    ids, mask = batch.input_ids.cpu(), batch.attention_mask.cpu()
    found = {}
    for row, c in longest.items():
        sampled = cache.sampled_row(row, ids[row, :P], mask[row, :P], ids[row, P : P + c])
        if sampled >= 0:
            found[row] = sampled
    return found


@torch.no_grad()
def probe_logprobs_from_cache(
    policy,
    batch: RolloutBatch,
    probes: list[Probe],
    score_rest,
    max_batch_tokens: int = 16384,
    logits_mb: int = 256,
) -> tuple[list[Tensor], int, int]:
    """Per-token log-probs of every probe (as :func:`packed_probe_logprobs`), the probes of rows
    that ``batch.probe_cache`` holds (:func:`cached_rows`) read against it
    (:func:`rredcot.sampling.decode.score_probes`: only their tokens are forwarded), the others scored by
    ``score_rest(probes) -> (log-probs, tokens forwarded)``.

    Returns (one ``(len(probe.ids),)`` float tensor per probe, in order; tokens forwarded;
    probes read from the cache)."""
    rows = cached_rows(policy, batch, probes)
    from_cache = [i for i, p in enumerate(probes) if p.row in rows]
    rest = [i for i, p in enumerate(probes) if p.row not in rows]
    out: list[Tensor | None] = [None] * len(probes)
    forwarded = 0
    if from_cache:
        queries = [(rows[probes[i].row], probes[i].b, probes[i].ids) for i in from_cache]
        with _no_autocast(model_device_dtype(policy)[0]):
            scored, forwarded = score_probes(
                batch.probe_cache, queries, max_batch_tokens, logits_mb
            )
        for i, lp in zip(from_cache, scored):
            out[i] = lp
    if rest:
        scored, more = score_rest([probes[i] for i in rest])
        forwarded += more
        for i, lp in zip(rest, scored):
            out[i] = lp
    return out, forwarded, len(from_cache)  # type: ignore[return-value]


def _fallback_cost(batch: RolloutBatch, probes: list[Probe]) -> str:
    packed, unpacked = probe_pass_tokens(batch, probes)
    ratio = unpacked / max(packed, 1)
    return (
        f"one row per probe re-runs each probe's prompt and prefix: {ratio:.1f}x the forward "
        f"tokens of packing on this batch ({unpacked} against {packed}), so expect the probe pass "
        f"to take about {ratio:.1f}x as long"
    )


class ProbeScorer:
    """Probes -> their per-token log-probs under the policy, for one credit call of the method
    ``name``: read against the sampling's cache where the batch carries one
    (:func:`probe_logprobs_from_cache`), the other probes re-forwarded packed (one row per trace)
    or unpacked (one row per probe: ``packing="unpacked"``, or ``auto`` where the attention does
    not take a custom 4D mask or the packed pass raises, each with a warning saying what it costs).

    Counts what it did: ``forwarded`` tokens, ``probes`` scored, ``from_cache`` of them read from
    the cache; ``packed``: whether the re-forward packs."""

    def __init__(
        self,
        policy,
        batch: RolloutBatch,
        packing: str = "auto",
        *,
        name: str,
        max_batch_tokens: int = 16384,
        logits_mb: int = 256,
    ) -> None:
        if packing not in PACKING_MODES:
            raise ValueError(f"packing={packing!r}: use {', '.join(PACKING_MODES)}")
        self.policy, self.batch, self.packing, self.name = policy, batch, packing, name
        self.budget = {"max_batch_tokens": max_batch_tokens, "logits_mb": logits_mb}
        self.packed = packing == "packed" or (packing == "auto" and packing_supported(policy))
        self._warned_unsupported = False
        self.forwarded = self.probes = self.from_cache = 0

    def __call__(self, probes: list[Probe]) -> list[Tensor]:
        with eval_mode(self.policy):
            logprobs, forwarded, cached = probe_logprobs_from_cache(
                self.policy, self.batch, probes, self._reforward, **self.budget
            )
        self.forwarded += forwarded
        self.probes += len(probes)
        self.from_cache += cached
        return logprobs

    def _reforward(self, probes: list[Probe]) -> tuple[list[Tensor], int]:
        if not probes:
            return [], 0
        if not self.packed and self.packing == "auto" and not self._warned_unsupported:
            self._warned_unsupported = True
            impl = getattr(self.policy.config, "_attn_implementation", None)
            warnings.warn(
                f"{self.name}: attention implementation {impl!r} may not take a custom 4D mask; "
                f"probing with one row per probe: {_fallback_cost(self.batch, probes)}. Load the "
                "policy with attn_implementation='sdpa' or 'eager' to pack the probes.",
                stacklevel=4,
            )
        if self.packed:
            try:
                return packed_probe_logprobs(self.policy, self.batch, probes, **self.budget)
            except (RuntimeError, ValueError, TypeError) as err:
                if self.packing == "packed":
                    raise
                warnings.warn(
                    f"{self.name}: the packed probe pass failed ({type(err).__name__}: {err}); "
                    f"falling back to one row per probe: {_fallback_cost(self.batch, probes)}",
                    stacklevel=4,
                )
                self.packed = False
        return unpacked_probe_logprobs(self.policy, self.batch, probes, **self.budget)


@torch.no_grad()
def packing_disagrees(
    policy, batch: RolloutBatch, probes: list[Probe], *, name: str, **budget
) -> bool:
    """Score ``probes`` packed and unpacked once (a method's first re-forwarding batch, packing
    ``auto``): True, with a warning, where they differ beyond float rounding (a model that does
    not honour a custom 4D mask with per-probe position ids); False where they agree, where the
    attention cannot pack, or where the packed pass raises (the scorer falls back on its own)."""
    if not probes or not packing_supported(policy):
        return False
    with eval_mode(policy):
        try:
            packed, _ = packed_probe_logprobs(policy, batch, probes, **budget)
        except (RuntimeError, ValueError, TypeError):
            return False
        plain, _ = unpacked_probe_logprobs(policy, batch, probes, **budget)
    _, dtype = model_device_dtype(policy)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    worst = max(float((a - b).abs().max()) for a, b in zip(packed, plain))
    if worst <= tol:
        return False
    warnings.warn(
        f"{name}: packed probe log-probs differ from unpacked ones by {worst:.3g} (the model "
        "does not honour a custom 4D attention mask with per-probe position ids); probing with "
        f"one row per probe from now on: {_fallback_cost(batch, probes)}",
        stacklevel=3,
    )
    return True
