"""The credit-method interface, its registry, and the batch every method reads.

A credit method turns a batch of verified, segmented completions into token-level advantages.
Value-based methods only say what ``V(s_k)`` is (``segment_values``); weight-based attribution
methods only say how to split ``R - V(s_0)`` (``segment_weights``). Both go through the one credit
algebra in :mod:`rredcot.credit`; no method re-implements it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from rredcot import credit

if TYPE_CHECKING:
    from rredcot.config import CreditConfig, SamplingConfig
    from rredcot.segment import Segmenter
    from rredcot.tasks.base import Problem, Task, Verdict


@dataclass
class RolloutBatch:
    """B sampled completions with everything a credit method may read.

    The sequence layout is ``[left-padded prompt (P columns) | right-padded response (T columns)]``.
    """

    input_ids: torch.Tensor  # (B, L), L = P + T
    attention_mask: torch.Tensor  # (B, L)
    prompt_len: int  # P
    response_mask: torch.Tensor  # (B, T) float, 1 on real response tokens (EOS included)
    rewards: torch.Tensor  # (B,) float
    group_ids: torch.Tensor  # (B,) long; the G samples of one prompt share an id
    boundaries: list[list[int]]  # per row: [0, b_1, ..., b_n = T_b]
    segment_ids: torch.Tensor  # (B, T) long, -1 on padding
    segment_char_starts: list[list[int]] = field(default_factory=list)  # per row, per segment
    problems: list[Problem] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    old_logprobs: torch.Tensor | None = None  # (B, T)
    hidden_states: torch.Tensor | None = None  # (B, L, H * len(layers)) from the old-logprob pass
    position_ids: torch.Tensor | None = None  # (B, L)
    entropies: torch.Tensor | None = None  # (B, T) next-token entropy (entropy segmentation)
    prefix_ids: torch.Tensor | None = None  # (B, S+1) credit.shared_prefix_ids, -1 on padding

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def num_segments(self) -> torch.Tensor:
        """(B,) number of segments of each row."""
        return torch.tensor([len(b) - 1 for b in self.boundaries], dtype=torch.long)

    def boundary_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence positions of the last token of each prefix ``s_k`` and their mask.

        Returns ``(positions (B, S+1) long, mask (B, S+1) bool)``: column 0 is the last prompt
        token (``s_0``), column k the last token of segment k (``P + b_k - 1``).
        """
        max_segments = max((len(b) - 1 for b in self.boundaries), default=0)
        positions = torch.zeros(self.size, max_segments + 1, dtype=torch.long)
        mask = torch.zeros(self.size, max_segments + 1, dtype=torch.bool)
        for row, bounds in enumerate(self.boundaries):
            for k, b in enumerate(bounds):
                positions[row, k] = self.prompt_len + b - 1
                mask[row, k] = True
        return positions.to(self.input_ids.device), mask.to(self.input_ids.device)

    def select(self, rows: torch.Tensor | list[int]) -> RolloutBatch:
        """A sub-batch of the given rows (for minibatches and replay)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        pick = lambda t: None if t is None else t[idx.to(t.device)]  # noqa: E731
        keep = idx.tolist()
        return RolloutBatch(
            input_ids=pick(self.input_ids),
            attention_mask=pick(self.attention_mask),
            prompt_len=self.prompt_len,
            response_mask=pick(self.response_mask),
            rewards=pick(self.rewards),
            group_ids=pick(self.group_ids),
            boundaries=[self.boundaries[i] for i in keep],
            segment_ids=pick(self.segment_ids),
            segment_char_starts=[self.segment_char_starts[i] for i in keep]
            if self.segment_char_starts
            else [],
            problems=[self.problems[i] for i in keep] if self.problems else [],
            completions=[self.completions[i] for i in keep] if self.completions else [],
            verdicts=[self.verdicts[i] for i in keep] if self.verdicts else [],
            old_logprobs=pick(self.old_logprobs),
            hidden_states=pick(self.hidden_states),
            position_ids=pick(self.position_ids),
            entropies=pick(self.entropies),
            prefix_ids=pick(self.prefix_ids),
        )


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
    """A method's credit for one batch."""

    advantages: torch.Tensor  # (B, T), zero on padding
    segment_advantages: torch.Tensor  # (B, S)
    segment_mask: torch.Tensor  # (B, S) bool
    values: torch.Tensor | None = None  # (B, S+1) V(s_k) as estimated (before V(s_n) := R)
    value_mask: torch.Tensor | None = None  # (B, S+1) bool
    metrics: dict[str, float] = field(default_factory=dict)


class CreditMethod:
    """Base class. Subclasses set ``name`` and implement ``segment_values`` or
    ``segment_weights``; stateful ones (the value head) override ``update`` and the state dict."""

    name: ClassVar[str] = ""
    needs_hidden_states: ClassVar[bool] = False
    hidden_layers: tuple[int, ...] = (-1,)
    default_lam: ClassVar[float | None] = None  # a method may force its own lambda (uniform: 1)

    def __init__(self, config: CreditConfig, context: CreditContext) -> None:
        self.config = config
        self.context = context

    @property
    def lam(self) -> float:
        return self.config.lam if self.default_lam is None else self.default_lam

    @property
    def normalization(self) -> str:
        mode = self.config.normalization
        if mode != "auto":
            return mode
        return "group_std" if self.name == "uniform" else "group_or_batch_std"

    # -- what subclasses provide ------------------------------------------------------------
    def segment_values(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values (B, S+1), value_mask (B, S+1))`` with ``values[:, k] = V(s_k)``."""
        raise NotImplementedError

    def segment_weights(self, batch: RolloutBatch) -> torch.Tensor:
        """``(B, S)`` non-negative attribution weights (for methods without values)."""
        raise NotImplementedError

    # -- the shared path through the credit algebra -----------------------------------------
    def compute(self, batch: RolloutBatch) -> CreditOutput:
        if type(self).segment_values is not CreditMethod.segment_values:
            return self._from_values(batch, *self.segment_values(batch))
        return self._from_weights(batch, self.segment_weights(batch))

    def _from_values(
        self, batch: RolloutBatch, values: torch.Tensor, value_mask: torch.Tensor
    ) -> CreditOutput:
        rewards = batch.rewards.to(values.dtype)
        seg_adv, seg_mask, seg_rewards = credit.segment_advantages_from_values(
            values, value_mask, rewards, self.lam
        )
        advantages = self._to_tokens(batch, seg_adv)
        metrics = {
            "credit/mean_abs_segment_reward": float(credit.masked_mean(seg_rewards.abs(), seg_mask))
            if seg_mask.any()
            else 0.0,
        }
        return CreditOutput(advantages, seg_adv, seg_mask, values, value_mask, metrics)

    def _from_weights(self, batch: RolloutBatch, weights: torch.Tensor) -> CreditOutput:
        seg_mask = _segment_mask(batch, weights.device)
        mean, _ = credit.group_mean_std(batch.rewards, batch.group_ids)
        seg_adv = credit.weights_to_segment_rewards(weights, seg_mask, batch.rewards, mean)
        return CreditOutput(self._to_tokens(batch, seg_adv), seg_adv, seg_mask)

    def _to_tokens(self, batch: RolloutBatch, segment_advantages: torch.Tensor) -> torch.Tensor:
        token_adv = credit.segments_to_tokens(
            segment_advantages, batch.segment_ids.to(segment_advantages.device), batch.response_mask
        )
        return credit.normalize_advantages(
            token_adv, batch.response_mask, batch.rewards, batch.group_ids, self.normalization
        )

    # -- state --------------------------------------------------------------------------------
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Learn from the batch after its credit was computed (value heads train here)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def _segment_mask(batch: RolloutBatch, device: torch.device) -> torch.Tensor:
    n = batch.num_segments
    max_s = int(n.max()) if len(n) else 0
    return (torch.arange(max_s).unsqueeze(0) < n.unsqueeze(1)).to(device)


# ---------------------------------------------------------------------------------------------
# registry

_CREDIT_METHODS: dict[str, type[CreditMethod]] = {}
# Methods that live in their own modules, imported on first use.
_LAZY = {
    "value_head": "rredcot.methods.value_head",
    "answer_likelihood": "rredcot.methods.answer_likelihood",
    "monte_carlo": "rredcot.methods.monte_carlo",
    "gradient": "rredcot.methods.attribution",
    "attention": "rredcot.methods.attribution",
    "first_last": "rredcot.methods.attribution",
    "oracle": "rredcot.methods.oracle",  # benchmark only: reads the verifier's step labels
}


def register_credit(name: str):
    """Class decorator: make a credit method available as ``--credit NAME``."""

    def wrap(cls: type[CreditMethod]) -> type[CreditMethod]:
        cls.name = name
        _CREDIT_METHODS[name] = cls
        return cls

    return wrap


def credit_names() -> list[str]:
    return sorted(set(_CREDIT_METHODS) | set(_LAZY))


def get_credit(name: str) -> type[CreditMethod]:
    """The credit method class registered as ``name``."""
    if name not in _CREDIT_METHODS and name in _LAZY:
        import importlib

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

    def segment_values(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        mean, _ = credit.group_mean_std(batch.rewards, batch.group_ids)
        n = batch.num_segments
        max_s = int(n.max()) if len(n) else 0
        mask = torch.arange(max_s + 1).unsqueeze(0) <= n.unsqueeze(1)
        values = mean.unsqueeze(1).expand(-1, max_s + 1).clone()
        return values, mask.to(values.device)
