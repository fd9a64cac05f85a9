"""RREDCoT with a learned value head (docs/method.md, value sources; measured figures live in
benchmarks/results/, not here).

A small fp32 MLP reads the policy's hidden state at the last token of each prefix ``s_k`` (column
0: the last prompt token; column k: token ``b_k - 1``) and predicts ``V(s_k)``, the chance that the
trace ends correct. The hidden states come from the forward pass the step already runs (on-policy:
the loss forward itself), so values cost no extra forward pass and no generation.

By default (``credit.value_head.logprob_features``) the head also reads four numbers per prefix from
that same pass: the mean and the minimum of the policy's log-probs of the tokens of the last
segment and of the whole response so far (a step the policy itself found unlikely is the clearest
sign of a wrong step). With ``credit.value_head.alik_feature`` (off by default) it also reads the
answer-likelihood value of each prefix, from one packed probe forward per batch with the
reference answers only (that forward is the feature's cost).

Per RL step (the contract of :mod:`rredcot.methods.base`):

1. ``rows(batch)``: the boundary features of the fresh batch; ``estimate(rows)``: values from the
   head as it stands
   (trained only on earlier batches, so the credit never sees this batch's outcomes), anchored on
   the group's mean reward, with the hand-over weight ``w`` the head has earned. By default
   (``credit.value_head.shared_prefixes``) the segment stage lets the group's shared prefixes set
   the values wherever several samples pass through the same prefix, the head's (``w``-scaled)
   values in between with ``credit.lam``: the shared-prefix rule of every method
   (:meth:`~rredcot.methods.base.CreditMethod.with_node_values`).
2. ``update(rows, estimate)``: first score the values the estimate gave credit (the head, not yet
   trained on this batch) on its outcomes (the slope or explained variance of
   :mod:`rredcot.methods.guard`, ``Guard.fold_estimate``, as every value source), fold that into
   the guard's reliability (the EMA the hand-over weight follows), then train the head by
   TD(lambda_v) over segment boundaries, with replay of recent batches.

Anchoring (``credit.anchor="group"``): ``V'(s_k) = V(s_k) - V(s_0) + mean(R_group)``, so
every trace gets GRPO's total credit and the head only decides how it is spread over the trace;
its errors about a prompt's difficulty cancel. With ``lam = 1`` and anchoring the credit is GRPO's
advantage minus ``w`` times the head's value gain before each segment: unbiased for any head,
GRPO itself while ``w = 0`` (docs/method.md, the guards).

With ``credit.value_head.teacher=continuation_likelihood`` the head distils that estimator
(built through the registry with the same credit settings) instead of learning by TD: on every
``teacher_every``-th step the rows carry the teacher's values, the credit is the teacher's own
estimate and the head regresses each boundary ``k < n`` on those values; on the steps between the
credit uses the head's values and the head does not train. One guard (the teacher's) serves both.

The pure tensor helpers (``gather_boundary_features``, ``td_lambda_targets``, ...) are public so
that tests and benchmarks can check them against plain loops.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from rredcot.algebra.credit import Cost, Values
from rredcot.algebra.normalization import group_mean_std, masked_mean
from rredcot.config import ValueHeadConfig
from rredcot.methods.answer_likelihood import answer_values, prefix_features
from rredcot.methods.answer_probes import ProbeFormat
from rredcot.methods.base import (
    CreditContext,
    CreditMethod,
    CreditRows,
    Estimate,
    build_credit,
    register_credit,
)
from rredcot.methods.guard import Guard, bounded_skill, explained_variance, prediction_slope
from rredcot.methods.value_fit import ValueFit, ValueMLP, td_lambda_targets
from rredcot.sampling.batch import RolloutBatch

__all__ = [
    "ValueHeadCredit",
    "ValueMLP",
    "auto_hidden_size",
    "brier_skill",
    "config_num_parameters",
    "expected_calibration_error",
    "explained_variance",
    "gather_boundary_features",
    "logprob_features",
    "monotone_fraction",
    "policy_num_parameters",
    "prediction_slope",
    "td_lambda_targets",
]

HEAD_FRACTION = 0.01  # auto width: the head has about this share of the policy's parameters
MIN_HIDDEN = 8  # ... but never fewer hidden units than this
NUM_LOGPROB_FEATURES = 4  # segment mean, segment min, prefix mean, prefix min
NUM_ALIK_FEATURES = 2  # answer-likelihood V(s_k) and its squashed log


# ---------------------------------------------------------------------------------------------
# the head


def auto_hidden_size(
    num_policy_params: int, input_size: int, fraction: float = HEAD_FRACTION
) -> int:
    """Hidden width ``h`` so that the head's ``h (D + 2) + 1`` parameters are about ``fraction``
    of the policy's, but at least ``MIN_HIDDEN`` units."""
    budget = fraction * num_policy_params - 1
    return max(MIN_HIDDEN, round(budget / (input_size + 2)))


def config_num_parameters(config) -> int | None:
    """The parameter count a decoder-only transformer's config implies (embeddings, attention
    with grouped KV heads, a gated or plain MLP, an untied LM head), or None when the config
    lacks the sizes. An estimate (norms and biases left out), for sharded models."""
    get = lambda name: getattr(config, name, None)  # noqa: E731
    hidden, layers, vocab = get("hidden_size"), get("num_hidden_layers"), get("vocab_size")
    if not (hidden and layers and vocab):
        return None
    heads = get("num_attention_heads") or 1
    head_dim = get("head_dim") or hidden // heads
    kv = (get("num_key_value_heads") or heads) * head_dim
    inter = get("intermediate_size") or 4 * hidden
    mlp = (3 if get("hidden_act") in ("silu", "swiglu") else 2) * hidden * inter
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv
    embed = vocab * hidden * (1 if get("tie_word_embeddings") else 2)
    return int(embed + layers * (attn + mlp))


def policy_num_parameters(policy) -> int:
    """The policy's parameter count as if unsharded.

    DeepSpeed ZeRO-3 leaves each local parameter empty and keeps its full size in ``ds_numel``;
    FSDP or other sharding leaves only a slice. Where the local count falls below a quarter of
    what the config implies (:func:`config_num_parameters`), the config's count is used, so the
    head's width never depends on how the policy is sharded."""
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in policy.parameters())
    cfg = getattr(policy, "config", None)
    if cfg is None and hasattr(policy, "module"):
        cfg = getattr(policy.module, "config", None)
    estimate = config_num_parameters(cfg) if cfg is not None else None
    if estimate is not None and total < estimate // 4:
        return estimate
    return total


# ---------------------------------------------------------------------------------------------
# pure tensor helpers


def gather_boundary_features(hidden_states: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
    """The hidden state at the last token of every prefix.

    Args:
        hidden_states: ``(B, L, D)``.
        positions: ``(B, S+1)`` long sequence positions (``RolloutBatch.boundary_positions``).
        mask: ``(B, S+1)`` bool, valid prefixes.

    Returns:
        features ``(B, S+1, D)``, exactly 0 where ``mask`` is False (padding never leaks in).
    """
    B, L, _ = hidden_states.shape
    if positions.shape[0] != B or positions.shape != mask.shape:
        raise ValueError(
            f"positions {tuple(positions.shape)} and mask {tuple(mask.shape)} must both be "
            f"(B, S+1) with B = {B}"
        )
    idx = torch.where(mask, positions, torch.zeros_like(positions)).clamp(0, L - 1)
    rows = torch.arange(B, device=hidden_states.device).unsqueeze(1)
    feats = hidden_states[rows, idx.to(hidden_states.device)]
    return torch.where(mask.to(feats.device).unsqueeze(-1), feats, torch.zeros_like(feats))


def logprob_features(
    logprobs: Tensor, response_mask: Tensor, segment_ids: Tensor, num_columns: int
) -> Tensor:
    """How likely the policy found each prefix, per boundary, from its own token log-probs.

    Column ``k >= 1`` holds ``[mean, min]`` of the log-probs of segment k's tokens, then
    ``[mean, min]`` over all response tokens up to ``b_k``; each number ``x <= 0`` is squashed to
    ``-log(1 - x)`` so that one very unlikely token does not dwarf the rest. Column 0 (the prompt)
    and padding are 0.

    Args:
        logprobs: ``(B, T)`` log-probs of the response tokens (``batch.old_logprobs``).
        response_mask: ``(B, T)``.
        segment_ids: ``(B, T)`` long, ``-1`` on padding.
        num_columns: ``S + 1``, the width of the value layout.

    Returns:
        ``(B, S+1, 4)`` float32.
    """
    B = logprobs.shape[0]
    S = num_columns - 1
    device = logprobs.device
    out = torch.zeros(B, num_columns, NUM_LOGPROB_FEATURES, device=device)
    if S == 0:
        return out
    valid = response_mask.bool() & (segment_ids >= 0)
    ids = segment_ids.clamp_min(0)
    lp = torch.where(valid, logprobs.float(), torch.zeros_like(logprobs, dtype=torch.float32))
    zeros = torch.zeros(B, S, device=device)
    seg_sum = zeros.scatter_add(1, ids, lp)
    seg_count = zeros.scatter_add(1, ids, valid.float())
    inf = torch.full_like(lp, float("inf"))
    seg_min = torch.full((B, S), float("inf"), device=device).scatter_reduce(
        1, ids, torch.where(valid, lp, inf), reduce="amin", include_self=True
    )
    present = seg_count > 0
    prefix_mean = seg_sum.cumsum(1) / seg_count.cumsum(1).clamp_min(1)
    prefix_min = seg_min.cummin(1).values
    feats = torch.stack(
        [seg_sum / seg_count.clamp_min(1), seg_min, prefix_mean, prefix_min], dim=-1
    )
    feats = torch.where(present.unsqueeze(-1), feats, torch.zeros_like(feats))
    out[:, 1:] = -torch.log1p(-feats.clamp(max=0.0))
    return out


def expected_calibration_error(
    pred: Tensor, target: Tensor, mask: Tensor, num_bins: int = 10
) -> float:
    """ECE of predicted probabilities against 0/1 outcomes over the masked entries: the
    count-weighted mean over ``num_bins`` equal-width bins of ``|mean(pred) - mean(target)|``.
    Predictions are clipped to ``[0, 1]``. NaN when nothing is masked in or a prediction is
    not finite (a head that diverged)."""
    m = mask.bool()
    p = pred[m].float().clamp(0.0, 1.0)
    y = target[m].float()
    if p.numel() == 0 or not bool(torch.isfinite(p).all()):
        return float("nan")
    bins = (p * num_bins).long().clamp(max=num_bins - 1).cpu()
    p_sum = torch.zeros(num_bins).index_add(0, bins, p.cpu())
    y_sum = torch.zeros(num_bins).index_add(0, bins, y.cpu())
    gap = (p_sum - y_sum).abs()  # = count * |mean p - mean y| per bin
    return float(gap.sum() / p.numel())


def monotone_fraction(values: Tensor, value_mask: Tensor, rewards: Tensor) -> float:
    """Share of correct traces (``R >= 1``, at least one segment) whose values never drop along
    ``V(s_0), ..., V(s_{n-1}), R``. NaN when the batch has no such trace."""
    hits = total = 0
    for row in range(values.shape[0]):
        n = int(value_mask[row].sum()) - 1
        if n < 1 or float(rewards[row]) < 1.0:
            continue
        seq = torch.cat([values[row, :n].float(), rewards[row : row + 1].float().to(values.device)])
        total += 1
        hits += int(bool((seq[1:] >= seq[:-1]).all()))
    return hits / total if total else float("nan")


def brier_skill(values: Tensor, baseline: Tensor, target_mask: Tensor, rewards: Tensor) -> float:
    """``1 - MSE(values, R) / MSE(baseline, R)`` over the masked boundaries: 1 is a perfect
    predictor, 0 no better than the baseline, negative worse. NaN when the baseline is exact
    (all outcomes of every group agree), where there is nothing to compare.

    Args:
        values, baseline: ``(B, S+1)`` predictions of ``R`` at each boundary.
        target_mask: ``(B, S+1)`` the boundaries to score (``k = 0 .. n-1``).
        rewards: ``(B,)``.
    """
    r = rewards.to(values.dtype).unsqueeze(1).expand_as(values)
    mse = masked_mean((values - r) ** 2, target_mask)
    ref = masked_mean((baseline.to(values.dtype) - r) ** 2, target_mask)
    if float(ref) < 1e-8:
        return float("nan")
    return float(1.0 - mse / ref)


def _added(a: Cost, b: Cost) -> Cost:
    """The cost of two passes."""
    return Cost(
        extra_forward_tokens=a.extra_forward_tokens + b.extra_forward_tokens,
        extra_backward_tokens=a.extra_backward_tokens + b.extra_backward_tokens,
        extra_generated_tokens=a.extra_generated_tokens + b.extra_generated_tokens,
    )


# ---------------------------------------------------------------------------------------------
# the credit method


@register_credit("value_head", options=ValueHeadConfig)
class ValueHeadCredit(CreditMethod):
    """Segment values from a learned head on the policy's hidden states, trained by TD(lambda).

    ``pretrain(sample_batch, steps)`` fits the head on the warm-start policy's own samples before
    RL; ``guard.reliability`` is the smoothed skill that sets the hand-over weight.
    """

    needs_hidden_states = True
    learns = True

    @property
    def node_values(self) -> str:
        """Its own option, ``credit.value_head.shared_prefixes`` (on by default, with independent
        samples too): the shared-prefix rule of every method (:meth:`with_node_values`)."""
        return "always" if self.options.shared_prefixes else "never"

    @property
    def node_min_count(self) -> int:
        return self.options.shared_min_count

    def __init__(self, config, context: CreditContext) -> None:
        super().__init__(config, context)
        self.hidden_layers = tuple(self.options.layer_indices)  # checked by ValueHeadConfig
        self.device = torch.device(context.device)
        self.fit = ValueFit(self.options, self.device)  # the network and its TD fit
        self.guard = Guard(config)  # the anchor and the hand-over weight the head earns
        if self.options.alik_feature and context.task is None:
            raise ValueError(
                "credit.value_head.alik_feature needs the task (its answer line writes the "
                "probes); pass CreditContext(task=...) or turn the feature off"
            )
        self.teacher = self._build_teacher()
        if self.teacher is not None:  # one guard for whichever values set the credit
            self.guard = self.teacher.guard
        self.probes_prefixes = bool(self.options.alik_feature or self.teacher is not None)
        self.steps = 0  # updates done: the teacher runs on steps 0, k, 2k, ...
        self._paused = False  # teacher_paused(): the head's values on every batch
        input_size = self._input_size_from_policy()
        if input_size is not None:
            self._build(input_size, self._hidden_size_for(input_size))

    def _build_teacher(self) -> CreditMethod | None:
        """The method the head distils (``credit.value_head.teacher``), built through the
        registry with this method's credit settings, or None."""
        name = self.options.teacher  # CreditConfig checked it with the teacher's options
        return None if name == "none" else build_credit(name, self.config, self.context)

    @property
    def teacher_due(self) -> bool:
        """Whether the next batch's rows run the teacher."""
        if self.teacher is None or self._paused:
            return False
        return self.steps % self.options.teacher_every == 0

    @contextlib.contextmanager
    def teacher_paused(self) -> Iterator[None]:
        """Inside, every batch gets the head's own values (the credit benchmark scores the
        distilled head, not its teacher)."""
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused

    # -- building the head --------------------------------------------------------------------
    def _input_size_from_policy(self) -> int | None:
        cfg = getattr(self.context.policy, "config", None)
        hidden = getattr(cfg, "hidden_size", None)
        layers = getattr(cfg, "num_hidden_layers", None)
        if layers is not None:
            bad = [i for i in self.hidden_layers if not -(layers + 1) <= i <= layers]
            if bad:
                raise ValueError(
                    f"credit.value_head.layers={self.options.layers!r}: the policy has "
                    f"{layers} layers, so indices must lie in [{-(layers + 1)}, {layers}] "
                    f"(0 = embeddings, -1 = last layer); got {bad}"
                )
        return None if hidden is None else int(hidden) * len(self.hidden_layers)

    def _hidden_size_for(self, input_size: int) -> int:
        if self.options.hidden_size > 0:
            return int(self.options.hidden_size)
        policy = self.context.policy
        if policy is None or not hasattr(policy, "parameters"):
            return 64  # no policy to size against (a head built lazily from a batch)
        return auto_hidden_size(policy_num_parameters(policy), input_size + self.extra_size)

    @property
    def extra_size(self) -> int:
        size = NUM_LOGPROB_FEATURES if self.options.logprob_features else 0
        return size + (NUM_ALIK_FEATURES if self.options.alik_feature else 0)

    def _alik_features(self, batch: RolloutBatch, num_columns: int) -> tuple[Tensor, float]:
        """``((B, S+1, 2) answer-likelihood features of the batch, forward tokens they cost)``."""
        if len(batch.problems) != batch.size:
            raise ValueError(
                "credit.value_head.alik_feature needs the batch's problems and token ids (the full "
                "RolloutBatch, not a compact one of boundary states); turn it off here"
            )
        ctx = self.context
        values, mask, stats = answer_values(
            ctx.policy,
            ctx.tokenizer,
            ctx.task,
            batch,
            answer_source="reference",
            max_batch_tokens=self.config.answer_likelihood.chunk_tokens,
            probe=ProbeFormat.from_config(self.config.answer_likelihood),
            logits_mb=self.config.answer_likelihood.logits_mb,
        )
        feats = prefix_features(values, mask)
        if feats.shape[1] != num_columns:
            raise ValueError(
                f"answer-likelihood features have {feats.shape[1]} columns, the boundaries "
                f"{num_columns}"
            )
        return feats, stats["credit/extra_forward_tokens"]

    def _build(self, input_size: int, hidden_size: int) -> None:
        self.fit.build(input_size, hidden_size, self.extra_size)

    # the fit's parts, as the benchmarks, the TRL adapter and the tests read them
    @property
    def head(self) -> ValueMLP | None:
        return self.fit.head

    @property
    def target(self) -> ValueMLP | None:
        return self.fit.target

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.fit.optimizer

    @property
    def replay(self) -> deque[dict[str, Tensor]]:
        return self.fit.replay

    @property
    def num_head_parameters(self) -> int:
        return 0 if self.head is None else sum(p.numel() for p in self.head.parameters())

    # -- features and values ------------------------------------------------------------------
    def boundary_features(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, Cost]:
        """``(features (B, S+1, D + E) fp32 on the head's device, mask (B, S+1) bool, cost)``:
        the hidden states at the prefix ends, then the log-prob features (if enabled), then the
        answer-likelihood features (if enabled: their probe pass is the cost)."""
        needs_logprobs = self.options.logprob_features
        if batch.hidden_states is None or (needs_logprobs and batch.old_logprobs is None):
            raise ValueError(
                "value_head needs batch.hidden_states and batch.old_logprobs: run "
                "forward.fill_forward(policy, batch, hidden_layers=method.hidden_layers) before "
                "compute/update"
            )
        positions, mask = batch.boundary_positions()
        feats = gather_boundary_features(batch.hidden_states, positions, mask)
        feats = feats.to(self.device, torch.float32)
        mask = mask.to(self.device)
        if self.head is None:
            self._build(feats.shape[-1], self._hidden_size_for(feats.shape[-1]))
        if feats.shape[-1] != self.head.input_size:
            raise ValueError(
                f"batch.hidden_states has {feats.shape[-1]} features per token but the value head "
                f"reads {self.head.input_size} ({len(self.hidden_layers)} layer(s) "
                f"{self.hidden_layers} of the policy); fill the batch with "
                "hidden_layers=method.hidden_layers"
            )
        if self.options.logprob_features:
            extra = logprob_features(
                batch.old_logprobs, batch.response_mask, batch.segment_ids, mask.shape[1]
            )
            feats = torch.cat([feats, extra.to(self.device)], dim=-1)
        cost = Cost()
        if self.options.alik_feature:
            alik, tokens = self._alik_features(batch, mask.shape[1])
            feats = torch.cat([feats, alik.to(self.device)], dim=-1)
            cost = Cost(extra_forward_tokens=tokens)
        return feats, mask, cost

    def _predict(self, net: nn.Module, feats: Tensor) -> Tensor:
        return self.fit.predict(net, feats)

    @torch.no_grad()
    def head_values(self, features: Tensor, mask: Tensor) -> Tensor:
        """``(B, S+1)`` the head's own predictions as it stands (before this batch's update),
        not anchored; 0 on padding."""
        values = self._predict(self.head, features)
        return torch.where(mask, values, torch.zeros_like(values))

    # -- the contract -----------------------------------------------------------------------------
    def rows(self, batch: RolloutBatch) -> CreditRows:
        """The batch's rows with their boundary features (:meth:`boundary_features`); on a
        teacher step also the teacher's values (``rows.values``), its cost and its stats."""
        feats, mask, cost = self.boundary_features(batch)
        if not self.teacher_due:
            return CreditRows.of(batch).replace(features=feats, value_mask=mask, cost=cost)
        taught = self.teacher.rows(batch)
        if not torch.equal(taught.value_mask.to(mask.device), mask):
            raise ValueError(
                f"the teacher's values have {tuple(taught.value_mask.shape)} boundaries, the "
                f"head's {tuple(mask.shape)}, or other rows' lengths"
            )
        return taught.replace(
            features=feats,
            value_mask=mask,  # on the head's device, as on every other step
            values=taught.values.to(mask.device),
            cost=_added(cost, taught.cost),
        )

    def estimate(self, rows: CreditRows) -> Estimate:
        """The head's values anchored by the guard and handed over from uniform credit by the
        weight it has earned, with the method's lambda; the group's shared prefixes come in at
        the segment stage (:meth:`node_values`, ``credit.value_head.shared_prefixes``). Rows
        that carry the teacher's values get the teacher's own estimate."""
        mask = rows.value_mask
        raw = self.head_values(rows.features, mask)
        metrics = self._fresh_diagnostics(raw, mask, rows.rewards, rows.group_ids, rows.live)
        if self.teacher is not None:
            metrics.update(self._teacher_metrics(raw, rows))
        if rows.values is not None and self.teacher is not None:
            est = self.teacher.estimate(rows)
            return dataclasses.replace(est, metrics={**est.metrics, **metrics})
        group_mean, _ = group_mean_std(rows.rewards, rows.group_ids)
        values = self.guard.anchor(raw, mask, group_mean)
        metrics.update(self.guard.metrics())
        w = metrics["credit/handover_weight"]
        return Estimate(Values(values, mask, lam=self.lam, handover_weight=w), rows.cost, metrics)

    def _teacher_metrics(self, raw: Tensor, rows: CreditRows) -> dict[str, float]:
        """Whether the teacher ran on these rows and, where it did, the head's mean squared
        distance to its values (before the head learns from them)."""
        if rows.values is None:
            return {"value/teacher_ran": 0.0, "value/teacher_mse": float("nan")}
        targets, target_mask = self._teacher_targets(rows)
        diff = (raw - targets) ** 2
        mse = float(masked_mean(diff, target_mask)) if target_mask.any() else float("nan")
        return {"value/teacher_ran": 1.0, "value/teacher_mse": mse}

    def _teacher_targets(self, rows: CreditRows) -> tuple[Tensor, Tensor]:
        """``(targets, target_mask)`` on the head's device: the teacher's values at boundaries
        ``k < n`` of the live rows (clipped to [0, 1] for a sigmoid head)."""
        values = rows.values.to(self.device, torch.float32)
        mask = rows.value_mask.to(self.device)
        _, target_mask = td_lambda_targets(values, mask, rows.rewards.to(self.device), 1.0)
        target_mask = target_mask & rows.live.to(self.device).unsqueeze(1)
        if self.options.output == "sigmoid":
            values = values.clamp(0.0, 1.0)
        return torch.where(target_mask, values, torch.zeros_like(values)), target_mask

    def with_node_values(self, est: Estimate, rows: CreditRows) -> Estimate:
        """The teacher's shared-prefix rule on rows with the teacher's values (its credit as it
        is), else the head's own (:meth:`CreditMethod.with_node_values`)."""
        if rows.values is not None and self.teacher is not None:
            return self.teacher.with_node_values(est, rows)
        return super().with_node_values(est, rows)

    def _fresh_diagnostics(
        self, values: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor, live: Tensor
    ) -> dict[str, float]:
        """Calibration, shape and skill against the group mean of the head's own values before
        this batch's update (not anchored), on the live rows' outcomes."""
        live = live.to(values.device)
        rewards = rewards.to(values.device)
        _, target_mask = td_lambda_targets(values, mask, rewards, 1.0)
        target_mask = target_mask & live.unsqueeze(1)
        r = rewards.unsqueeze(1).expand_as(values)
        keep = live.unsqueeze(1) & mask
        group_mean = group_mean_std(rewards, group_ids.to(values.device))[0]
        baseline = group_mean.to(values.dtype)[live].unsqueeze(1).expand_as(values[live])
        skill = brier_skill(
            values[live], baseline, target_mask[live], rewards[live].to(values.dtype)
        )
        return {
            "value/calibration_error": expected_calibration_error(values, r, target_mask),
            "value/monotone_fraction": monotone_fraction(values, keep, rewards),
            "value/mean": float(masked_mean(values, target_mask))
            if target_mask.any()
            else float("nan"),
            "value/skill_vs_group_mean": bounded_skill(skill),
        }

    # -- training -----------------------------------------------------------------------------
    def _entry(
        self, feats: Tensor, mask: Tensor, rewards: Tensor, live: Tensor
    ) -> dict[str, Tensor]:
        """What training needs from a batch (and all the replay buffer keeps): boundary features,
        masks and rewards; rows whose response was skipped are dropped."""
        live = live.to(self.device)
        rewards = rewards.to(self.device, torch.float32)
        if self.options.loss == "bce" and bool(((rewards < 0) | (rewards > 1))[live].any()):
            raise ValueError(
                "credit.value_head.loss=bce needs rewards in [0, 1]; for other rewards use "
                "--credit.value_head.loss mse --credit.value_head.output linear"
            )
        return {"features": feats[live], "mask": mask[live], "rewards": rewards[live]}

    def update(self, rows: CreditRows, est: Estimate) -> dict[str, float]:
        """Score the values the estimate gave credit on the fresh rows (the guard's one scoring,
        :meth:`Guard.fold_estimate`, as every value source), then train the head on them
        (TD(lambda_v), replay); with a teacher, on its values, on the steps it ran only."""
        self.steps += 1
        entry = self._entry(rows.features, rows.value_mask, rows.rewards, rows.live)
        if self.teacher is not None:
            if rows.values is None:  # nothing to learn from: the credit was the head's
                metrics = self.guard.fold_estimate(rows, est)
                metrics["credit/handover_reliability_after"] = float(self.guard.reliability)
                return metrics
            targets, target_mask = self._teacher_targets(rows)
            live = rows.live.to(self.device)
            entry.update(targets=targets[live], target_mask=target_mask[live])
        metrics: dict[str, float] = {}
        if self.fit.has_targets(entry):
            with torch.no_grad():
                metrics["value/loss_fresh"] = float(self.fit.loss(entry))
        metrics.update(self.guard.fold_estimate(rows, est))
        metrics.update(self.fit.fit(entry))
        metrics["credit/handover_reliability_after"] = float(self.guard.reliability)
        return metrics

    def pretrain_summary(self, history: list[dict[str, float]]) -> dict[str, float]:
        """The first and last fresh losses, the last calibration error, the reliability."""
        fresh = [m.get("value/loss_fresh", float("nan")) for m in history]
        last = history[-1] if history else {}
        summary = {
            "value_pretrain/loss_first": fresh[0] if fresh else float("nan"),
            "value_pretrain/loss_last": fresh[-1] if fresh else float("nan"),
            "value_pretrain/calibration_error": last.get("value/calibration_error", float("nan")),
            "value_pretrain/reliability": float(self.guard.reliability),
        }
        if self.teacher is not None:  # the head's distance to the teacher where it ran
            taught = [m["value/teacher_mse"] for m in history if m.get("value/teacher_ran")]
            summary["value_pretrain/teacher_steps"] = float(len(taught))
            summary["value_pretrain/teacher_mse_first"] = taught[0] if taught else float("nan")
            summary["value_pretrain/teacher_mse_last"] = taught[-1] if taught else float("nan")
        return summary

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly (copied: later updates do not
        change it)."""
        state = {
            "version": 1,
            **self.fit.state_dict(),
            **self.guard.state_dict(),
            "steps": self.steps,
        }
        return copy.deepcopy(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)
        if state.get("version") != 1:
            raise ValueError(
                f"value_head state has version {state.get('version')!r}; this code reads 1"
            )
        if state["head"] is not None and state["extra_size"] != self.extra_size:
            raise ValueError(
                f"the saved value head reads {state['extra_size']} extra features but "
                f"credit.value_head.logprob_features={self.options.logprob_features} and "
                f"credit.value_head.alik_feature={self.options.alik_feature} give "
                f"{self.extra_size}; resume with the run's own config"
            )
        self.fit.load_state_dict(state)
        self.guard.load_state_dict(state)
        self.steps = int(state.get("steps", 0))  # saved before the teacher existed: 0
