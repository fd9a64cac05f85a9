"""The credit-method contract and its registry.

One sequence runs every credit method, in the trainer, the TRL and verl adapters, the
benchmarks and ``explain`` (docs/architecture.md, the credit seam):

1. ``rows = method.rows(batch)``: the small tensor record of the rows to credit
   (:class:`CreditRows`: rewards, groups, segment counts, and what the method measured on its
   own rows: boundary features, values or weights). Adapters that split a batch across
   processes gather these rows.
2. ``est = method.estimate(rows)``: values or weights (:class:`rredcot.algebra.credit.Values`,
   :class:`rredcot.algebra.credit.Weights`), with the guard applied (:mod:`rredcot.methods.guard`), their
   cost and diagnostics, and whatever ``update`` needs: no state passes between the calls.
3. ``seg, metrics = method.segment_stage(rows, est)``: the segment stage of the algebra over all rows.
4. ``credit.token_advantages(seg, segment_ids, response_mask, method.scale(rows, ...))``: the token
   stage, on a process's own rows and tokens.
5. ``method.update(rows, est)``: learn from the outcomes, after the credit was formed.

:meth:`CreditMethod.credit_output` runs stages 3-4 (for one process's rows of a gathered batch:
``local``); :meth:`CreditMethod.compute` runs 1-4 on a batch.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from rredcot.algebra import credit, layout
from rredcot.algebra.credit import Cost, SegmentCredit, Values, Weights
from rredcot.algebra.normalization import Scale, advantage_scale, group_mean_std, masked_mean
from rredcot.algebra.shared_prefixes import node_fraction, node_values
from rredcot.config import CreditConfig, SamplingConfig
from rredcot.methods import BUILTIN_CREDIT_METHODS
from rredcot.sampling.batch import RolloutBatch
from rredcot.segment import Segmenter
from rredcot.tasks.base import Task


@dataclass
class CreditContext:
    """What a method may use besides the batch: the live policy and the task's parts."""

    policy: Any  # a transformers causal LM (the current policy)
    tokenizer: Any
    task: Task | None = None
    segmenter: Segmenter | None = None
    sampling: SamplingConfig | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    micro_batch_tokens: int = (
        0  # tokens one extra forward may take (rredcot.sampling.memory); 0: no cap
    )


@dataclass(frozen=True)
class CreditRows:
    """The rows a method credits, one per completion, as tensors.

    Attributes:
        rewards: ``(B,)`` outcomes ``R``; group_ids: ``(B,)`` long prompt groups.
        num_segments: ``(B,)`` long, ``n_b``; live: ``(B,)`` bool, rows with a response.
        value_mask: ``(B, S+1)`` bool, the valid boundaries ``s_0 .. s_n`` of each row.
        segment_lengths: ``(B, S)`` tokens per segment (reweighting averages over tokens).
        features: ``(B, S+1, F)`` boundary features (the value head), or None.
        values: ``(B, S+1)`` the method's own values ``V(s_k)`` (a frozen estimator, rollouts,
            step labels), or None.
        weights: ``(B, S)`` attribution weights, or None.
        prefix_ids: ``(B, S+1)`` the group's shared prefixes
            (:func:`rredcot.algebra.layout.shared_prefix_ids`), or None.
        tree: the rows were sampled as tree groups (``sampling.tree``).
        cost, metrics: what measuring the rows cost, and its diagnostics.
    """

    rewards: Tensor
    group_ids: Tensor
    num_segments: Tensor
    live: Tensor
    value_mask: Tensor
    segment_lengths: Tensor
    features: Tensor | None = None
    values: Tensor | None = None
    weights: Tensor | None = None
    prefix_ids: Tensor | None = None
    tree: bool = False
    cost: Cost = field(default_factory=Cost)
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: RolloutBatch) -> CreditRows:
        """The rows of a segmented batch, before any method measured them."""
        _, value_mask = batch.boundary_positions()
        device = batch.rewards.device
        num_segments = batch.num_segments
        lengths = layout.segment_token_counts(
            batch.segment_ids, batch.response_mask, int(num_segments.max()) if batch.size else 0
        )
        return cls(
            rewards=batch.rewards,
            group_ids=batch.group_ids,
            num_segments=num_segments,
            live=batch.response_mask.sum(-1) > 0,
            value_mask=value_mask.to(device),
            segment_lengths=lengths,
            prefix_ids=batch.prefix_ids,
            tree=batch.token_share_counts is not None,
        )

    @classmethod
    def from_tensors(
        cls,
        rewards: Tensor,
        group_ids: Tensor,
        segment_ids: Tensor,
        response_mask: Tensor,
        **fields,
    ) -> CreditRows:
        """The rows of tensors (for callers that hold no :class:`RolloutBatch`).

        Args:
            rewards: ``(B,)``; group_ids: ``(B,)`` long; segment_ids: ``(B, T)`` long, ``-1`` on
                padding, row ``b`` using segments ``0..n_b-1``; response_mask: ``(B, T)``.
            fields: any other field (``values``, ``features``, ...).
        """
        num_segments = (
            (segment_ids.max(dim=1).values + 1).clamp_min(0)
            if segment_ids.shape[1]
            else torch.zeros(len(rewards), dtype=torch.long)
        )
        S = int(num_segments.max()) if len(num_segments) else 0
        value_mask = (
            torch.arange(S + 1, device=segment_ids.device)[None, :] <= num_segments[:, None]
        )
        return cls(
            rewards=rewards,
            group_ids=group_ids,
            num_segments=num_segments,
            live=response_mask.sum(-1) > 0,
            value_mask=value_mask,
            segment_lengths=layout.segment_token_counts(segment_ids, response_mask, S),
            **fields,
        )

    @property
    def segment_mask(self) -> Tensor:
        """``(B, S)`` bool: the valid segments of each row."""
        return self.value_mask[:, 1:]

    def replace(self, **changes: Any) -> CreditRows:
        return dataclasses.replace(self, **changes)


@dataclass
class CreditOutput:
    """A method's credit for one batch, as the trainer, the adapters and the benchmarks read it."""

    advantages: torch.Tensor  # (B, T), zero on padding
    segment_advantages: torch.Tensor  # (B, S)
    segment_mask: torch.Tensor  # (B, S) bool
    values: torch.Tensor | None = None  # (B, S+1) V(s_k) as credit used them (before V(s_n) := R)
    value_mask: torch.Tensor | None = None  # (B, S+1) bool
    metrics: dict[str, float] = field(default_factory=dict)
    cost: Cost = field(default_factory=Cost)


@dataclass(frozen=True)
class Estimate:
    """What a method says about its rows: values or weights, what they cost, diagnostics."""

    credit: Values | Weights
    cost: Cost = field(default_factory=Cost)
    metrics: dict[str, float] = field(default_factory=dict)


class CreditMethod:
    """Base class. Subclasses set ``name``, measure their rows in :meth:`rows` (values,
    features or weights of the batch) and turn them into an :class:`Estimate` in
    :meth:`estimate`; methods that learn (the value head, the guard of every value source) set
    ``learns`` and override :meth:`update` and the state dict."""

    name: ClassVar[str] = ""
    # the dataclass of the method's own options (a section of CreditConfig, e.g.
    # ValueHeadConfig = credit.value_head), set by register_credit; read as ``self.options``
    options_class: ClassVar[type | None] = None
    needs_hidden_states: ClassVar[bool] = False
    hidden_layers: tuple[int, ...] = (-1,)
    default_lam: ClassVar[float | None] = None  # a method may force its own lambda (uniform: 1)
    # credit.normalization=auto: GRPO's per-group std is only safe for uniform credit (zero in
    # a group whose rewards agree); redistributed credit falls back to the batch's std there.
    default_normalization: ClassVar[str] = "group_or_batch_std"
    # where the nodes of the group's prefix tree (prefixes several samples share) override the
    # method's values (shared_prefixes.node_values): "tree" in tree groups (sampling.tree), "always",
    # or "never" (uniform credit); the value head sets it by its own option, shared_prefixes
    node_values: ClassVar[str] = "tree"
    # the samples of a group that must pass through a prefix to make it a node
    node_min_count: ClassVar[int] = 2
    # credit.form=reweight applies to this method's Values (uniform's are GRPO by definition)
    reweights: ClassVar[bool] = True
    # whether update() learns anything (pretraining before RL needs it)
    learns: ClassVar[bool] = False
    # whether rows() scores probes after prefixes of the batch's rows: the trainer then keeps
    # the sampling's KV cache for them (train's probe_from_cache)
    probes_prefixes: bool = False
    # whether rows() reads the other samples of each row's group: a trainer whose groups may
    # span processes (TRL) then gives the batch those rows (RolloutBatch.peers)
    reads_group_samples: bool = False

    def __init__(self, config: CreditConfig, context: CreditContext) -> None:
        self.config = config
        self.context = context
        cls = type(self).options_class
        self.options: Any = None if cls is None else config.section(cls)

    @property
    def lam(self) -> float:
        return self.config.lam if self.default_lam is None else self.default_lam

    @property
    def normalization(self) -> str:
        mode = self.config.normalization
        return self.default_normalization if mode == "auto" else mode

    # -- 1. the rows ------------------------------------------------------------------------
    def rows(self, batch: RolloutBatch) -> CreditRows:
        """The batch's rows with what this method measures on them (by default nothing)."""
        return CreditRows.of(batch)

    # -- 2. the estimate --------------------------------------------------------------------
    def estimate(self, rows: CreditRows) -> Estimate:
        """The rows' values (with this method's lambda) or weights, as measured."""
        if rows.weights is not None:
            return Estimate(Weights(rows.weights, rows.segment_mask), rows.cost, rows.metrics)
        if rows.values is None:
            raise ValueError(f"{self.name}: its rows carry no values or weights")
        return Estimate(Values(rows.values, rows.value_mask, lam=self.lam), rows.cost, rows.metrics)

    # -- 3. the segment stage ---------------------------------------------------------------
    def segment_stage(self, rows: CreditRows, est: Estimate) -> tuple[SegmentCredit, dict]:
        """The estimate through :func:`rredcot.algebra.credit.segment_credit` over every row, with the
        tree's node values (:meth:`with_node_values`) and ``credit.form`` applied; with the
        credit's diagnostics over every row (logged by every path)."""
        est = self.with_node_values(est, rows)
        estimate = self.credit_form(est.credit)
        seg = credit.segment_credit(estimate, rows.rewards, rows.group_ids, rows.segment_lengths)
        metrics = {
            "credit/agreeing_groups": agreeing_group_share(
                rows.rewards, rows.group_ids, self.config.agreeing_std
            ),
            "credit/mean_abs_segment_reward": float(masked_mean(seg.rewards.abs(), seg.mask))
            if seg.mask.any()
            else 0.0,
            **est.cost.metrics(),
            **est.metrics,
        }
        return seg, metrics

    def with_node_values(self, est: Estimate, rows: CreditRows) -> Estimate:
        """``est`` with the values of the group's tree nodes put in
        (:func:`rredcot.algebra.shared_prefixes.node_values`): in tree groups, or always for
        ``node_values = "always"``. The method's values fill the boundaries between nodes,
        trusted by its hand-over weight, with the method's own lambda; weights are returned as
        they are. The one shared-prefix rule of every method (the value head's
        ``shared_prefixes`` included)."""
        wanted = self.node_values == "always" or (self.node_values == "tree" and rows.tree)
        if not wanted or rows.prefix_ids is None or not isinstance(est.credit, Values):
            return est
        mask = est.credit.mask
        if tuple(rows.prefix_ids.shape) != tuple(mask.shape):
            raise ValueError(
                f"batch.prefix_ids {tuple(rows.prefix_ids.shape)} do not match its "
                f"{tuple(mask.shape)} boundaries: segment the batch with "
                "rollout.segment_batch, which fills both"
            )
        combined, lam = node_values(
            est.credit.values,
            mask,
            est.credit.lam,
            rows.prefix_ids,
            rows.rewards,
            fallback_weight=min(max(float(est.credit.handover_weight), 0.0), 1.0),
            min_count=self.node_min_count,
        )
        metrics = {
            **est.metrics,
            "credit/node_boundary_fraction": node_fraction(
                rows.prefix_ids, mask, self.node_min_count
            ),
        }
        return Estimate(Values(combined, mask, lam=lam), est.cost, metrics)

    def credit_form(self, estimate: Values | Weights) -> Values | Weights:
        """``estimate`` with ``credit.form`` and its reweight options applied (Values of a
        method that :attr:`reweights` only; anything else as it is)."""
        if self.config.form == "redistribute" or not self.reweights:
            return estimate
        if not isinstance(estimate, Values):
            return estimate
        return dataclasses.replace(
            estimate,
            form=self.config.form,
            sigma_rule=self.config.reweight.rule,
            sigma_temperature=self.config.reweight.temperature,
        )

    # -- 4. the token stage -----------------------------------------------------------------
    def normalization_for(self, est: Estimate) -> str:
        """The normaliser of this estimate: :attr:`normalization`, except that reweighted credit
        under ``auto`` is scaled as GRPO scales its advantage (``group_std``)."""
        reweighted = self.credit_form(est.credit) is not est.credit
        if reweighted and self.config.normalization == "auto":
            return "group_std"
        return self.normalization

    def scale(self, rows: CreditRows, est: Estimate, like: Tensor) -> Scale:
        """The rows' :class:`~rredcot.algebra.normalization.Scale` (over every row, like the segment
        stage); ``like``: the advantages it will divide (their dtype)."""
        mode = self.normalization_for(est)
        floor = self.config.agreeing_std if mode == "group_or_batch_std" else None
        return advantage_scale(rows.rewards, rows.group_ids, mode, min_std=floor, like=like)

    def credit_output(
        self,
        rows: CreditRows,
        est: Estimate,
        segment_ids: Tensor,
        response_mask: Tensor,
        local: slice | None = None,
    ) -> CreditOutput:
        """Stages 3 and 4: the segment stage and the scale over every row of ``rows``, the token
        stage on the rows one process holds.

        Args:
            rows, est: every row (an adapter gathers them across processes).
            segment_ids: ``(B, T)`` long, ``-1`` on padding; response_mask: ``(B, T)``: the
                tokens of the rows ``local``.
            local: the rows of ``rows`` this process holds (None: all of them); the output is
                theirs. ``whiten`` needs every token, so it refuses a part of the rows.
        """
        seg, metrics = self.segment_stage(rows, est)
        scale = self.scale(rows, est, like=seg.advantages)
        value_mask = est.credit.mask if isinstance(est.credit, Values) else None
        if local is not None:
            if scale.whiten and len(range(len(rows.rewards))[local]) != len(rows.rewards):
                raise ValueError(
                    "credit.normalization='whiten' whitens over every token of the batch, but "
                    "this process holds part of it; use group_or_batch_std or batch_std"
                )
            seg, scale = seg.rows(local), scale.rows(local)
            value_mask = None if value_mask is None else value_mask[local]
        advantages = credit.token_advantages(seg, segment_ids, response_mask, scale)
        return CreditOutput(
            advantages,
            seg.advantages,
            seg.mask,
            seg.values,
            value_mask,
            metrics,
            est.cost,
        )

    def compute(self, batch: RolloutBatch) -> CreditOutput:
        """The whole credit of a batch (stages 1-4), for callers that do not update."""
        rows = self.rows(batch)
        return self.credit_output(rows, self.estimate(rows), batch.segment_ids, batch.response_mask)

    # -- 5. learning ------------------------------------------------------------------------
    def update(self, rows: CreditRows, est: Estimate) -> dict[str, float]:
        """Learn from the rows' outcomes after their credit was formed from ``est``."""
        return {}

    def pretrain(
        self,
        sample_batch: Callable[[], RolloutBatch],
        steps: int,
        every: Callable[[CreditRows], CreditRows] | None = None,
    ) -> dict[str, float]:
        """Before RL: ``steps`` rounds of rows -> estimate -> update on ``sample_batch()`` (the
        warm-start policy's samples), exactly as in RL; returns :meth:`pretrain_summary`.
        ``every``: a process's rows -> every process's (several processes), as in RL."""
        if not self.learns:
            raise ValueError(f"credit method {self.name!r} learns nothing: nothing to pretrain")
        if steps < 0:
            raise ValueError(f"pretrain steps must be >= 0, got {steps}")
        history = []
        for _ in range(steps):
            rows = self.rows(sample_batch())
            if every is not None:
                rows = every(rows)
            est = self.estimate(rows)
            history.append({**est.metrics, **self.update(rows, est)})
        return {"value_pretrain/steps": float(steps), **self.pretrain_summary(history)}

    def pretrain_summary(self, history: list[dict[str, float]]) -> dict[str, float]:
        """What :meth:`pretrain` reports of its rounds' metrics."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def uniform_values(
    rewards: torch.Tensor, group_ids: torch.Tensor, num_segments: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's values: ``V(s_k)`` is the group's mean reward at every boundary.

    Args:
        rewards: ``(B,)``; group_ids: ``(B,)`` long; num_segments: ``(B,)`` long, ``n_b``.

    Returns:
        ``(values (B, S+1), mask (B, S+1) bool)``, ``mask[b, k] = k <= n_b``.
    """
    mean, _ = group_mean_std(rewards, group_ids)
    max_s = int(num_segments.max()) if len(num_segments) else 0
    mask = torch.arange(max_s + 1).unsqueeze(0) <= num_segments.cpu().unsqueeze(1)
    values = mean.unsqueeze(1).expand(-1, max_s + 1).clone()
    return values, mask.to(values.device)


def agreeing_group_share(rewards: torch.Tensor, group_ids: torch.Tensor, below: float) -> float:
    """The share of groups whose reward std is below ``below`` (``credit.agreeing_std``): groups
    with no outcome signal, whose value credit ``group_or_batch_std`` divides by the batch's std.

    Args:
        rewards: ``(B,)``; group_ids: ``(B,)`` long.
    """
    if group_ids is None or rewards.numel() == 0:
        return float("nan")
    r = rewards if rewards.is_floating_point() else rewards.float()
    _, std = group_mean_std(r, group_ids.to(rewards.device))
    groups, first = torch.unique(group_ids.to(rewards.device), return_inverse=True)
    agreeing = torch.zeros(len(groups), dtype=torch.bool, device=rewards.device)
    agreeing = agreeing.index_fill(0, first[std < below], True)
    return float(agreeing.float().mean())


# ---------------------------------------------------------------------------------------------
# registry

_CREDIT_METHODS: dict[str, type[CreditMethod]] = {}
# Methods that live in their own modules, imported on first use (the torch-free table in
# rredcot.methods, from which the CLI's help lists them).
_LAZY = {name: module for name, module in BUILTIN_CREDIT_METHODS.items() if module != __name__}


def register_credit(name: str, options: type | None = None):
    """Class decorator: make a credit method available as ``--credit NAME``, with ``options``
    the dataclass of its own settings (a section of :class:`rredcot.config.CreditConfig`, e.g.
    ``ValueHeadConfig`` for ``--credit.value_head.*``), which the method reads as
    ``self.options``."""

    def wrap(cls: type[CreditMethod]) -> type[CreditMethod]:
        cls.name = name
        cls.options_class = options
        _CREDIT_METHODS[name] = cls
        return cls

    return wrap


def credit_options(name: str) -> type | None:
    """The options dataclass the method ``name`` was registered with (None: it has none)."""
    return get_credit(name).options_class


def credit_names() -> list[str]:
    return sorted(set(_CREDIT_METHODS) | set(_LAZY))


def get_credit(name: str) -> type[CreditMethod]:
    """The credit method class registered as ``name``."""
    if name not in _CREDIT_METHODS and name in _LAZY:
        importlib.import_module(_LAZY[name])
    if name not in _CREDIT_METHODS:
        raise ValueError(f"unknown credit method {name!r}; valid: {', '.join(credit_names())}")
    return _CREDIT_METHODS[name]


def build_credit(name: str, config: CreditConfig, context: CreditContext) -> CreditMethod:
    return get_credit(name)(config, context)


@register_credit("uniform")
class UniformCredit(CreditMethod):
    """GRPO: every segment's value is the group's mean reward, λ = 1, so every token of a
    completion gets ``R - mean(R_group)`` (divided by the group's std by default)."""

    default_lam = 1.0
    default_normalization = "group_std"
    node_values = "never"
    reweights = False

    def estimate(self, rows: CreditRows) -> Estimate:
        """GRPO's values from the rows' rewards (over every process's rows in the adapters), or
        the rows' own values where an adapter put them there (verl keeps dense rewards in
        them)."""
        if rows.values is not None:
            return Estimate(Values(rows.values, rows.value_mask, lam=self.lam))
        values, mask = uniform_values(rows.rewards, rows.group_ids, rows.num_segments)
        return Estimate(Values(values, mask, lam=self.lam))


@register_credit("node_values")
class NodeValuesCredit(UniformCredit):
    """The prefix tree's values alone (made for ``sampling.tree``): a node's value is the mean
    reward of the leaves below it, ``s_0``'s the group mean, and a segment between two nodes gets
    the change in value it caused (lambda 0 at nodes); between nodes credit passes through
    (lambda 1), so a leaf's last stretch gets ``R - V(last node)``. With independent samples the
    only nodes are the prefixes samples share by chance (mostly ``s_0``: GRPO's credit)."""

    default_normalization = "group_or_batch_std"
    node_values = "always"
