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

import torch
from torch import Tensor

from rredcot.config import AnswerLikelihoodConfig
from rredcot.config.method_options import ANSWER_ESTIMATORS
from rredcot.methods.answer_probes import ProbeFormat, build_probes, probe_answers, resolve_cue
from rredcot.methods.base import CreditContext, register_credit
from rredcot.methods.probe_logprobs import (
    ProbeScorer,
    packing_disagrees,
)
from rredcot.methods.value_source import ValueSourceCredit
from rredcot.sampling.batch import RolloutBatch

NUM_FEATURES = 2  # value-head features: V and its squashed log


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
    estimator: str = "probability",
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """``V(s_k) = sum_{a in A+} exp(sum log pi(probe(a) | s_k))`` for every boundary ``k < n``
    (``estimator="per_token"``: ``max_a exp(mean log pi(probe(a) | s_k))``, the per-token form).

    Returns ``(values (B, S+1), value_mask (B, S+1) bool, stats)``; ``values[b, n_b] = R_b``
    (the algebra sets ``V(s_n) := R`` anyway). ``probe`` says how probes are written (default:
    :class:`ProbeFormat` ``()``); ``packing``: ``packed`` (one forward row per trace),
    ``unpacked`` (one row per probe) or ``auto`` (packed when the attention implementation takes
    a custom 4D mask, else unpacked with a warning; a packed pass that raises also falls back
    with a warning).
    """
    if task is None:
        raise ValueError(
            "answer_likelihood needs the task (its render_answer writes the probes); "
            "pass CreditContext(task=...)"
        )
    probe = probe or ProbeFormat()
    answers = probe_answers(batch, task, answer_source, probe.renderings)
    probes, _ = build_probes(batch, tokenizer, task, answers, probe)
    scorer = ProbeScorer(
        policy,
        batch,
        packing,
        name="answer_likelihood",
        max_batch_tokens=max_batch_tokens,
        logits_mb=logits_mb,
    )
    values, mask = _values_from_probes(batch, probes, scorer(probes), estimator)
    device = batch.rewards.device
    probed_rows = [a for a in answers if a]
    stats = {
        "credit/extra_forward_tokens": float(scorer.forwarded),
        "credit/extra_generated_tokens": 0.0,
        "credit/probe_tokens": float(sum(len(p.ids) for p in probes)),
        "credit/probes": float(len(probes)),
        "credit/probe_packed": float(scorer.packed),
        "credit/probe_from_cache": scorer.from_cache / max(len(probes), 1),
        "credit/probe_think_cue": float(resolve_cue(probe.cue, tokenizer) != "task"),
        "credit/answers_per_row": sum(len(a) for a in probed_rows) / max(len(probed_rows), 1),
        "credit/empty_answer_sets": float(sum(1 for a in answers if not a)),
    }
    return values.to(device), mask.to(device), stats


def _values_from_probes(
    batch: RolloutBatch, probes: list, logprobs: list[Tensor], estimator: str = "probability"
) -> tuple[Tensor, Tensor]:
    """``(values (B, S+1), value_mask (B, S+1))`` on the CPU: ``V(s_k)`` the summed probability
    of row ``b``'s probes at boundary ``k`` (capped at 1; ``per_token``: the largest per-token
    probability of one of them), ``V(s_n) = R``."""
    if estimator not in ANSWER_ESTIMATORS:
        raise ValueError(f"answer estimator={estimator!r}: use {', '.join(ANSWER_ESTIMATORS)}")
    n = batch.num_segments
    S = int(n.max()) if len(n) else 0
    values = torch.zeros(batch.size, S + 1, dtype=torch.float)
    for p, lp in zip(probes, logprobs):
        if estimator == "per_token":
            per_token = float(lp.mean().exp()) if lp.numel() else 0.0
            values[p.row, p.k] = max(float(values[p.row, p.k]), per_token)
        else:
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

    @property
    def reads_group_samples(self) -> bool:
        """The ``group`` and ``both`` sources read the group's correct answers."""
        return self.options.source != "reference"

    def _check_packing(self, batch: RolloutBatch) -> None:
        """Compare packed and unpacked log-probs on the first row that has probes."""
        self._checked = True
        ctx = self.context
        answers = probe_answers(batch, ctx.task, self.options.source, self.probe.renderings)
        probes, _ = build_probes(batch, ctx.tokenizer, ctx.task, answers, self.probe)
        if not probes:
            self._checked = False  # nothing to compare yet
            return
        first = [p for p in probes if p.row == probes[0].row]
        budget = {"max_batch_tokens": self.max_batch_tokens, "logits_mb": self.options.logits_mb}
        if packing_disagrees(ctx.policy, batch, first, name="answer_likelihood", **budget):
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
            estimator=self.options.estimator,
        )
