"""The credit-method interface and its registry.

A credit method reads a batch of verified, segmented completions (:class:`rredcot.batch.RolloutBatch`)
and returns an :class:`Estimate`: :class:`rredcot.credit.Values` (what ``V(s_k)`` is) or
:class:`rredcot.credit.Weights` (how to split ``R - mean(R_group)``), with its typed
:class:`rredcot.credit.Cost`. Every estimate goes through the one path
:func:`rredcot.credit.token_credit`; no method re-implements the algebra.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rredcot import credit
from rredcot.batch import RolloutBatch
from rredcot.config import CreditConfig, SamplingConfig
from rredcot.credit import Cost, Values, Weights
from rredcot.methods.handover import live_rows
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
    """What a method says about a batch: values or weights, what they cost, and diagnostics."""

    credit: Values | Weights
    cost: Cost = field(default_factory=Cost)
    metrics: dict[str, float] = field(default_factory=dict)


class CreditMethod:
    """Base class. Subclasses set ``name`` and implement ``segment_values`` or
    ``segment_weights`` (or, to say more, ``estimate``); stateful ones (the value head) override
    ``update`` and the state dict. ``compute`` is the same for every method: the estimate goes
    through :func:`rredcot.credit.token_credit`."""

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
    # method's values (credit.node_values): "tree" in tree groups (sampling.tree), "always",
    # or "never" (uniform credit; the value head, which does it itself by its own option)
    node_values: ClassVar[str] = "tree"
    # credit.form=reweight applies to this method's Values (uniform's are GRPO by definition)
    reweights: ClassVar[bool] = True

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

    # -- what subclasses provide ------------------------------------------------------------
    def segment_values(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values (B, S+1), value_mask (B, S+1))`` with ``values[:, k] = V(s_k)``."""
        raise NotImplementedError

    def segment_weights(self, batch: RolloutBatch) -> torch.Tensor:
        """``(B, S)`` non-negative attribution weights (for methods without values)."""
        raise NotImplementedError

    def estimate(self, batch: RolloutBatch) -> Estimate:
        """Values (with this method's lambda) or weights of the batch; no extra cost."""
        if type(self).segment_values is not CreditMethod.segment_values:
            values, mask = self.segment_values(batch)
            return self.estimate_from_values(
                values, mask, batch.rewards, batch.group_ids, live_rows(batch)
            )
        weights = self.segment_weights(batch)
        return Estimate(Weights(weights, segment_mask(batch, weights.device)))

    def with_node_values(self, est: Estimate, batch: RolloutBatch) -> Estimate:
        """``est`` with the values of the group's tree nodes put in (:func:`credit.node_values`):
        in tree groups (``batch.token_share_counts``), or always for ``node_values = "always"``.
        The method's values fill the boundaries between nodes, trusted by its hand-over weight;
        weights (attribution methods) are returned as they are."""
        wanted = self.node_values == "always" or (
            self.node_values == "tree" and batch.token_share_counts is not None
        )
        if not wanted or batch.prefix_ids is None or not isinstance(est.credit, Values):
            return est
        values = est.credit.values
        mask = est.credit.mask
        if est.credit.anchor is not None:
            values = credit.anchor_values(values, mask, est.credit.anchor)
        combined, lam = credit.node_values(
            values,
            mask,
            est.credit.lam,
            batch.prefix_ids,
            batch.rewards,
            fallback_weight=min(max(float(est.credit.handover_weight), 0.0), 1.0),
        )
        metrics = dict(est.metrics)
        interior = credit.node_fraction(batch.prefix_ids, mask)
        metrics["credit/node_boundary_fraction"] = interior
        return Estimate(Values(combined, mask, lam=lam), est.cost, metrics)

    # -- values computed elsewhere, as tensors (the integrations) ---------------------------
    def estimate_from_values(
        self, values: torch.Tensor, mask: torch.Tensor, rewards, group_ids, live
    ) -> Estimate:
        """The estimate from values ``(B, S+1)`` with ``mask (B, S+1)`` computed elsewhere (on
        each process's rows, by a PRM, by verl's driver), for rows with outcomes ``rewards
        (B,)``, groups ``group_ids (B,)`` and ``live (B,)`` bool (rows with a response). By
        default the values as they are, with this method's lambda; methods with guards (the
        anchor, the hand-over) apply them here."""
        return Estimate(Values(values, mask, lam=self.lam))

    # -- the one path through the credit algebra --------------------------------------------
    def compute(self, batch: RolloutBatch) -> CreditOutput:
        """The batch's :meth:`estimate` (with the tree's node values where :attr:`node_values`
        says so) through :meth:`credit_output`."""
        return self.credit_output(
            self.with_node_values(self.estimate(batch), batch),
            batch.rewards,
            batch.group_ids,
            batch.segment_ids,
            batch.response_mask,
        )

    def credit_output(
        self,
        est: Estimate,
        rewards: torch.Tensor,
        group_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        response_mask: torch.Tensor,
        normalization: str | None = None,
    ) -> CreditOutput:
        """An estimate through :func:`rredcot.credit.token_credit` with this method's
        normalisation (or ``normalization``), with the credit's diagnostics: what ``compute``
        returns, for callers that hold tensors rather than a batch (the integrations).

        Args:
            rewards: ``(B,)``; group_ids: ``(B,)`` long.
            segment_ids: ``(B, T)`` long, ``-1`` on padding; response_mask: ``(B, T)``.
        """
        estimate = self.credit_form(est.credit)
        mode = self.normalization if normalization is None else normalization
        reweighted = estimate is not est.credit
        if normalization is None and reweighted and self.config.normalization == "auto":
            mode = "group_std"  # GRPO's advantage, scaled as GRPO scales it
        agreeing_std = self.config.agreeing_std
        out = credit.token_credit(
            estimate,
            rewards,
            group_ids,
            segment_ids,
            response_mask,
            mode,
            min_std=agreeing_std if mode == "group_or_batch_std" else None,
        )
        seg_mask = out.segment_mask
        metrics = {
            "credit/agreeing_groups": agreeing_group_share(rewards, group_ids, agreeing_std),
            "credit/mean_abs_segment_reward": float(
                credit.masked_mean(out.segment_rewards.abs(), seg_mask)
            )
            if seg_mask.any()
            else 0.0,
            **est.cost.metrics(),
            **est.metrics,
        }
        value_mask = est.credit.mask if isinstance(est.credit, Values) else None
        return CreditOutput(
            out.advantages,
            out.segment_advantages,
            seg_mask,
            out.values,
            value_mask,
            metrics,
            est.cost,
        )

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

    # -- state --------------------------------------------------------------------------------
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Learn from the batch after its credit was computed (value heads train here)."""
        return {}

    def update_from_values(
        self, values: torch.Tensor, mask: torch.Tensor, rewards, group_ids, live
    ) -> dict[str, float]:
        """:meth:`update` for rows whose values were computed elsewhere (the arguments of
        :meth:`estimate_from_values`); learns nothing by default."""
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
    mean, _ = credit.group_mean_std(rewards, group_ids)
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
    _, std = credit.group_mean_std(r, group_ids.to(rewards.device))
    groups, first = torch.unique(group_ids.to(rewards.device), return_inverse=True)
    agreeing = torch.zeros(len(groups), dtype=torch.bool, device=rewards.device)
    agreeing = agreeing.index_fill(0, first[std < below], True)
    return float(agreeing.float().mean())


def segment_mask(batch: RolloutBatch, device: torch.device | None = None) -> torch.Tensor:
    """``(B, S)`` bool: the valid segments of each row."""
    n = batch.num_segments
    max_s = int(n.max()) if len(n) else 0
    mask = torch.arange(max_s).unsqueeze(0) < n.unsqueeze(1)
    return mask if device is None else mask.to(device)


# ---------------------------------------------------------------------------------------------
# registry

_CREDIT_METHODS: dict[str, type[CreditMethod]] = {}
# Methods that live in their own modules, imported on first use.
_LAZY = {
    "value_head": "rredcot.methods.value_head",
    "answer_likelihood": "rredcot.methods.answer_likelihood",
    "continuation_likelihood": "rredcot.methods.continuation_likelihood",
    "process_reward": "rredcot.methods.process_reward",
    "monte_carlo": "rredcot.methods.monte_carlo",
    "gradient": "rredcot.methods.attribution",
    "attention": "rredcot.methods.attribution",
    "first_last": "rredcot.methods.attribution",
    "oracle": "rredcot.methods.oracle",  # benchmark only: reads the verifier's step labels
}


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

    def segment_values(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return uniform_values(batch.rewards, batch.group_ids, batch.num_segments)


@register_credit("node_values")
class NodeValuesCredit(UniformCredit):
    """The prefix tree's values alone (made for ``sampling.tree``): a node's value is the mean
    reward of the leaves below it, ``s_0``'s the group mean, and a segment between two nodes gets
    the change in value it caused (lambda 0 at nodes); between nodes credit passes through
    (lambda 1), so a leaf's last stretch gets ``R - V(last node)``. With independent samples the
    only nodes are the prefixes samples share by chance (mostly ``s_0``: GRPO's credit)."""

    default_normalization = "group_or_batch_std"
    node_values = "always"
