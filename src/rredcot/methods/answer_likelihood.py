"""Answer likelihood: the policy as its own judge (docs/method.md, value sources;
docs/answer_likelihood.md).

``V(s_k) = sum_{a in A+} pi(probe(a) | s_k)``: the probability that the policy, made to answer
right after the prefix ``s_k``, states a correct answer. Which answers ``A+`` count and how each
probe is written: :mod:`rredcot.methods.answer_probes`; how the probes are scored:
:mod:`rredcot.methods.probe_logprobs`. This module turns the probes' log-probs into values
(:func:`answer_values`), value-head features (:func:`prefix_features`) and credit
(:class:`AnswerLikelihoodCredit`).

Where it works: a model that has learned to answer from a partial chain (warm-start with
``early_answer_prob > 0``), or a reasoning model probed with the cue it answers after. A model
that only ever copies its final running result into the answer line gives every intermediate
probe a probability near zero, and the estimator then cannot tell good steps from bad ones
(docs/method.md, failure modes).

**Safe credit** (the value head's guards, :mod:`rredcot.methods.guard`): the values are anchored
on the group's mean reward (``credit.anchor=group``: ``V'(s_k) = V(s_k) - V(s_0) + mean R_group``,
so every trace gets GRPO's total credit); the credit is handed over from uniform (GRPO) credit by a
weight ``w`` that tracks the estimator's measured reliability on fresh outcomes (the slope
``prediction_slope`` of the batch's outcomes on ``V'(s_{n-1})``, measured in ``update`` after the
step's credit was computed, smoothed across steps, clipped to [0, 1]; ``credit.handover.mode``); and
the advantages are divided by the group's reward std, or by the batch's where a group's rewards
agree (``group_or_batch_std``). With ``w = 0`` (the first step) the credit is uniform GRPO credit
bit for bit. A batch whose values hardly depart from the baseline (root mean square of
``V'(s_{n-1}) - mean R_group`` below ``MIN_DEPARTURE_RMS = 0.01``) leaves the reliability as it
is: on a warm-start that never answers early, every probe before the last step is near 0, and the
slope of those tiny departures is noise that, clipped to 1, would hand over an estimator with
nothing to say (the figures: docs/answer_likelihood.md, Safe credit); at ``lam < 1`` its credit
is the all-blame-on-the-last-segment credit of docs/method.md, failure modes.

**Cost**: no generation; all probes of a trace go into one packed forward pass
(:mod:`rredcot.methods.probe_logprobs`), in forwards of at most
``credit.answer_likelihood.chunk_tokens`` tokens and at most ``credit.answer_likelihood.logits_mb``
MiB of fp32 logits at a time. Models whose attention does not take a custom 4D mask (or whose
packed log-probs do not match the unpacked ones on a first check) fall back to one row per probe
with a warning. ``V(s_n)`` is not probed: the credit algebra sets it to the outcome ``R``.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from rredcot.batch import RolloutBatch
from rredcot.config import AnswerLikelihoodConfig
from rredcot.methods.answer_probes import ProbeFormat, build_probes, probe_answers, resolve_cue
from rredcot.methods.base import CreditContext, register_credit
from rredcot.methods.probe_logprobs import (
    Probe,
    model_device_dtype,
    packed_probe_logprobs,
    packing_supported,
    probe_logprobs_from_cache,
    probe_pass_tokens,
    unpacked_probe_logprobs,
)
from rredcot.methods.value_source import ValueSourceCredit
from rredcot.rollout import eval_mode

PACKING_MODES = ("auto", "packed", "unpacked")
NUM_FEATURES = 2  # value-head features: V and its squashed log


def _fallback_cost(batch: RolloutBatch, probes: list[Probe]) -> str:
    packed, unpacked = probe_pass_tokens(batch, probes)
    ratio = unpacked / max(packed, 1)
    return (
        f"one row per probe re-runs each probe's prompt and prefix: {ratio:.1f}x the forward "
        f"tokens of packing on this batch ({unpacked} against {packed}), so expect the probe pass "
        f"to take about {ratio:.1f}x as long"
    )


# ---------------------------------------------------------------------------------------------
# Values


@torch.no_grad()
def answer_values(
    policy,
    tokenizer,
    task,
    batch: RolloutBatch,
    *,
    answer_source: str = "reference",
    packing: str = "auto",
    max_batch_tokens: int = 16384,
    probe: ProbeFormat | None = None,
    logits_mb: int = 256,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """``V(s_k) = sum_{a in A+} exp(sum log pi(probe(a) | s_k))`` for every boundary ``k < n``.

    Returns ``(values (B, S+1), value_mask (B, S+1) bool, stats)``; ``values[b, n_b] = R_b``
    (the algebra sets ``V(s_n) := R`` anyway). ``probe`` says how probes are written (default:
    :class:`ProbeFormat` ``()``); ``packing``: ``packed`` (one forward row per trace),
    ``unpacked`` (one row per probe) or ``auto`` (packed when the attention implementation takes
    a custom 4D mask, else unpacked with a warning; a packed pass that raises also falls back
    with a warning).
    """
    if packing not in PACKING_MODES:
        raise ValueError(f"packing={packing!r}: use {', '.join(PACKING_MODES)}")
    if task is None:
        raise ValueError(
            "answer_likelihood needs the task (its render_answer writes the probes); "
            "pass CreditContext(task=...)"
        )
    probe = probe or ProbeFormat()
    answers = probe_answers(batch, task, answer_source, probe.renderings)
    probes, _ = build_probes(batch, tokenizer, task, answers, probe)
    budget = {"max_batch_tokens": max_batch_tokens, "logits_mb": logits_mb}
    logprobs, forwarded, use_packed, from_cache = _probe_logprobs(
        policy, batch, probes, packing, budget
    )
    values, mask = _values_from_probes(batch, probes, logprobs)
    device = batch.rewards.device
    probed_rows = [a for a in answers if a]
    stats = {
        "credit/extra_forward_tokens": float(forwarded),
        "credit/extra_generated_tokens": 0.0,
        "credit/probe_tokens": float(sum(len(p.ids) for p in probes)),
        "credit/probes": float(len(probes)),
        "credit/probe_packed": float(use_packed),
        "credit/probe_from_cache": from_cache / max(len(probes), 1),
        "credit/probe_think_cue": float(resolve_cue(probe.cue, tokenizer) != "task"),
        "credit/answers_per_row": sum(len(a) for a in probed_rows) / max(len(probed_rows), 1),
        "credit/empty_answer_sets": float(sum(1 for a in answers if not a)),
    }
    return values.to(device), mask.to(device), stats


def _probe_logprobs(
    policy, batch: RolloutBatch, probes: list, packing: str, budget: dict
) -> tuple[list[Tensor], int, bool, int]:
    """``(log-probs of each probe's tokens, tokens forwarded, packed or not, probes read from
    the cache)``: against the sampling's cache where the batch carries one
    (:func:`probe_logprobs_from_cache`), the other probes re-forwarded
    (:func:`_reforwarded_logprobs`)."""
    packed = [packing == "packed" or (packing == "auto" and packing_supported(policy))]

    def reforward(rest: list) -> tuple[list[Tensor], int]:
        logprobs, forwarded, packed[0] = _reforwarded_logprobs(policy, batch, rest, packing, budget)
        return logprobs, forwarded

    with eval_mode(policy):
        logprobs, forwarded, from_cache = probe_logprobs_from_cache(
            policy, batch, probes, reforward, **budget
        )
    return logprobs, forwarded, packed[0], from_cache


def _reforwarded_logprobs(
    policy, batch: RolloutBatch, probes: list, packing: str, budget: dict
) -> tuple[list[Tensor], int, bool]:
    """``(log-probs of each probe's tokens, tokens forwarded, packed or not)``: packed where
    ``packing`` asks for it or ``auto`` finds the attention takes a custom 4D mask, else (or
    where an ``auto`` packed pass raises) one row per probe, with a warning."""
    use_packed = packing == "packed"
    if packing == "auto":
        use_packed = packing_supported(policy)
        if not use_packed:
            impl = getattr(policy.config, "_attn_implementation", None)
            warnings.warn(
                f"answer_likelihood: attention implementation {impl!r} may not take a custom 4D "
                f"mask; probing with one row per probe: {_fallback_cost(batch, probes)}. Load the "
                "policy with attn_implementation='sdpa' or 'eager' to pack the probes.",
                stacklevel=3,
            )
    with eval_mode(policy):
        logprobs, forwarded = None, 0
        if use_packed and probes:
            try:
                logprobs, forwarded = packed_probe_logprobs(policy, batch, probes, **budget)
            except (RuntimeError, ValueError, TypeError) as err:
                if packing == "packed":
                    raise
                warnings.warn(
                    f"answer_likelihood: the packed probe pass failed ({type(err).__name__}: "
                    f"{err}); falling back to one row per probe: {_fallback_cost(batch, probes)}",
                    stacklevel=3,
                )
                use_packed = False
        if logprobs is None:
            logprobs, forwarded = unpacked_probe_logprobs(policy, batch, probes, **budget)
    return logprobs, forwarded, use_packed


def _values_from_probes(
    batch: RolloutBatch, probes: list, logprobs: list[Tensor]
) -> tuple[Tensor, Tensor]:
    """``(values (B, S+1), value_mask (B, S+1))`` on the CPU: ``V(s_k)`` the summed probability
    of row ``b``'s probes at boundary ``k`` (capped at 1), ``V(s_n) = R``."""
    n = batch.num_segments
    S = int(n.max()) if len(n) else 0
    values = torch.zeros(batch.size, S + 1, dtype=torch.float)
    for p, lp in zip(probes, logprobs):
        values[p.row, p.k] += float(lp.sum().exp())
    values = values.clamp(max=1.0)
    rows = torch.arange(batch.size)
    values[rows, n] = batch.rewards.detach().float().cpu()
    mask = torch.arange(S + 1).unsqueeze(0) <= n.unsqueeze(1)
    return values, mask


def prefix_features(values: Tensor, value_mask: Tensor) -> Tensor:
    """Answer-likelihood values as value-head input features: ``[V, -log(1 - log V)]`` at every
    boundary ``k < n`` (the log squashed as the log-prob features are), 0 at ``s_n`` (where
    :func:`answer_values` holds the outcome, which a feature must never see) and on padding.

    Args:
        values: ``(B, S+1)`` from :func:`answer_values`; value_mask: ``(B, S+1)``.

    Returns:
        ``(B, S+1, 2)`` float32.
    """
    mask = value_mask.bool()
    n = mask.sum(dim=1) - 1
    cols = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    keep = mask & (cols < n.unsqueeze(1))
    v = torch.where(keep, values.float(), torch.zeros_like(values, dtype=torch.float32))
    log_v = torch.log(v.clamp_min(1e-30))
    feats = torch.stack([v, -torch.log1p(-log_v)], dim=-1)
    return torch.where(keep.unsqueeze(-1), feats, torch.zeros_like(feats))


# ---------------------------------------------------------------------------------------------
# The credit method


@register_credit("answer_likelihood", options=AnswerLikelihoodConfig)
class AnswerLikelihoodCredit(ValueSourceCredit):
    """Values from the policy's probability of answering correctly right after each prefix, with
    the value head's guards (anchor, hand-over, safe normalisation; module docstring).

    ``compute(batch)`` probes the batch and hands credit over from uniform by ``reliability``
    (from earlier batches); ``update(batch)`` then scores those same values against the batch's
    outcomes and folds the slope into ``reliability``. ``pretrain(sample_batch, steps)`` earns
    reliability on the warm-start policy's samples before RL.

    The first batch in ``auto`` packing is also probed unpacked once, and a mismatch (a model
    whose attention does not honour the custom 4D mask) switches this instance to unpacked
    probing with a warning.
    """

    probes_prefixes = True

    def __init__(self, config, context: CreditContext) -> None:
        super().__init__(config, context)
        if context.task is None:
            raise ValueError(
                "answer_likelihood needs the task (its render_answer writes the probes); "
                "pass CreditContext(task=...)"
            )
        self.probe = ProbeFormat.from_config(self.options)
        self._packing = "auto"
        self._checked = False

    @property
    def max_batch_tokens(self) -> int:
        return int(self.options.chunk_tokens)

    def _check_packing(self, batch: RolloutBatch) -> None:
        """Compare packed and unpacked log-probs on the first row that has probes."""
        self._checked = True
        ctx = self.context
        if not packing_supported(ctx.policy):
            return
        answers = probe_answers(batch, ctx.task, self.options.source, self.probe.renderings)
        probes, _ = build_probes(batch, ctx.tokenizer, ctx.task, answers, self.probe)
        if not probes:
            self._checked = False  # nothing to compare yet
            return
        first = [p for p in probes if p.row == probes[0].row]
        budget = {
            "max_batch_tokens": self.max_batch_tokens,
            "logits_mb": self.options.logits_mb,
        }
        with torch.no_grad(), eval_mode(ctx.policy):
            try:
                packed, _ = packed_probe_logprobs(ctx.policy, batch, first, **budget)
            except (RuntimeError, ValueError, TypeError):
                return  # answer_values falls back (and warns) on its own
            plain, _ = unpacked_probe_logprobs(ctx.policy, batch, first, **budget)
        _, dtype = model_device_dtype(ctx.policy)
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        worst = max(float((a - b).abs().max()) for a, b in zip(packed, plain))
        if worst > tol:
            warnings.warn(
                f"answer_likelihood: packed probe log-probs differ from unpacked ones by {worst:.3g} "
                "(the model does not honour a custom 4D attention mask with per-probe position "
                f"ids); probing with one row per probe from now on: {_fallback_cost(batch, probes)}",
                stacklevel=3,
            )
            self._packing = "unpacked"

    # -- values ---------------------------------------------------------------------------------
    def boundary_values(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, dict[str, float]]:
        """``(values (B, S+1), mask (B, S+1), stats)``: the probed values, not anchored, with
        ``values[:, n] = R``, and the probe pass's statistics."""
        # packing is checked on the first batch that re-forwards its probes (one that carries
        # the sampling's cache reads them from it)
        if not self._checked and batch.probe_cache is None:
            self._check_packing(batch)
        ctx = self.context
        return answer_values(
            ctx.policy,
            ctx.tokenizer,
            ctx.task,
            batch,
            answer_source=self.options.source,
            packing=self._packing,
            max_batch_tokens=self.max_batch_tokens,
            probe=self.probe,
            logits_mb=self.options.logits_mb,
        )
