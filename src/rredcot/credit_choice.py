"""``--credit auto``: the credit method for a run, chosen from how its starting policy does on
its own training prompts.

The rule is the one ``rredcot diagnose`` states in its verdict (docs/diagnose.md), and the only
one measured so far (README, "where credit can pay"):

- where at least ``ALL_WRONG_HIGH`` of the groups are all wrong, GRPO learns nothing from them;
  where the task also has reference solutions, continuation likelihood with credit flowing in
  those groups (``FLOW_SETTINGS``: lambda 0, the estimator's own ``V(s_0)``, a smoothed
  hand-over) blames the line where a trace left the reference, without generating, and was
  measured ahead of GRPO there;
- everywhere else (and where the policy solves almost nothing, ``REWARD_LOW``, so that no
  outcome-based credit has a signal) the value head stays: level with GRPO on the measured
  testbeds, never the cause of a collapse.

This module is the rule only (pure functions over the probe's rewards); the probe, which samples
the starting policy, is ``train_setup.probe_credit_choice``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: the CLI's flags and the bench's specs read this module
    import torch

AUTO = "auto"  # the value of ``credit_method`` that asks for this choice
SUCCESS = 1.0  # a reward at or above this is a right trace (the project's 0/1 convention)
REWARD_LOW = 0.05  # mean reward below which no outcome-based credit has a signal
ALL_WRONG_HIGH = 0.25  # share of all-wrong groups at which GRPO is blind to much of the batch

FALLBACK_METHOD = "value_head"
FLOW_METHOD = "continuation_likelihood"
FLOW_SETTINGS: dict[str, Any] = {"lam": 0.0, "anchor": "none", "handover.smoothing": 0.5}
"""``credit.<field>`` values of the flowing continuation likelihood (the learn bench's
``cl_flow`` variant), dotted below the credit config."""
CHEAP_SETTINGS: dict[str, Any] = {**FLOW_SETTINGS, "continuation_likelihood.window": 1}
"""``cl_flow`` scored cheaply (``cl_cheap``): the reference's log-probs read from one pass per
group wherever a prefix is on its path, one line probed per boundary off it, the rest read from
the reference's pass (benchmarks/results/cheap_continuation/)."""
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "cl_flow": (FLOW_METHOD, FLOW_SETTINGS),
    "cl_cheap": (FLOW_METHOD, CHEAP_SETTINGS),
}
"""Named variants a benchmark's ``--methods`` takes as they are (``uniform,cl_cheap``)."""


def check_method_name(name: str, allow_auto: bool = True) -> None:
    """Raise unless ``name`` is a registered credit method, or ``auto`` where ``allow_auto`` (a
    training run resolves it when it starts; a benchmark of frozen traces cannot); the error
    lists the valid names."""
    # lazy: methods.base imports torch, and this module stays free of it
    from rredcot.methods.base import get_credit

    if name == AUTO:
        if allow_auto:
            return
        raise ValueError(
            f"{AUTO} chooses a method when a training run starts (rredcot train, bench learn); "
            "here name the methods to compare"
        )
    try:
        get_credit(name)
    except ValueError as err:
        if not allow_auto:
            raise
        raise ValueError(f"{err}, or {AUTO} (the run chooses)") from None


def flow_flags() -> str:
    """The command-line flags of the flowing continuation likelihood, as the verdict prints them."""
    flags = " ".join(f"--credit.{k} {_flag_value(v)}" for k, v in FLOW_SETTINGS.items())
    return f"--credit {FLOW_METHOD} {flags}"


def _flag_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def preset_value(value: Any) -> str:
    """A preset's setting as a variant's override string."""
    return str(value).lower() if isinstance(value, bool) else _flag_value(value)


@dataclass(frozen=True)
class CreditChoice:
    """What ``--credit auto`` chose and why (written to the run directory as
    ``credit_choice.json``)."""

    method: str
    settings: dict[str, Any]  # credit.<dotted field> -> value, applied over the run's config
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)  # the probe's measurements

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, path: str | Path) -> CreditChoice:
        """The choice a run wrote (``credit_choice.json``)."""
        return cls(**json.loads(Path(path).read_text()))


def group_outcomes(rewards: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    """The probe's figures from its rewards (B,) and group ids (B,): ``mean_reward``, the shares
    of groups whose samples are all wrong (every reward ``<= 0``) and all right (every reward
    ``>= SUCCESS``), and the number of ``groups``."""
    if rewards.numel() == 0:
        raise ValueError("the probe has no samples: the verifier rejected every one")
    ids = group_ids.unique()
    wrong = sum(bool((rewards[group_ids == g] <= 0).all()) for g in ids)
    right = sum(bool((rewards[group_ids == g] >= SUCCESS).all()) for g in ids)
    return {
        "mean_reward": float(rewards.float().mean()),
        "all_wrong": wrong / len(ids),
        "all_right": right / len(ids),
        "groups": float(len(ids)),
    }


def choose_credit(figures: dict[str, Any], has_references: bool) -> CreditChoice:
    """The credit method for a run whose starting policy scored ``figures``
    (:func:`group_outcomes`) on its training prompts; ``has_references``: the task writes a
    reference solution for those prompts (``Task.gold_completion``)."""
    mean, wrong = figures["mean_reward"], figures["all_wrong"]
    seen = f"the starting policy solves {mean:.0%} of its samples and {wrong:.0%} of its groups are all wrong"
    if mean < REWARD_LOW:
        reason = (
            f"{seen}: no outcome-based credit has a signal yet (warm-start it or use easier "
            f"prompts); {FALLBACK_METHOD} kept"
        )
        return CreditChoice(FALLBACK_METHOD, {}, reason, dict(figures))
    if wrong >= ALL_WRONG_HIGH and has_references:
        reason = (
            f"{seen} (at least {ALL_WRONG_HIGH:.0%}): GRPO learns nothing from those; continuation "
            "likelihood of the reference solutions, with credit flowing in them, was measured "
            f"ahead of GRPO there: {flow_flags()}"
        )
        return CreditChoice(FLOW_METHOD, dict(FLOW_SETTINGS), reason, dict(figures))
    if wrong >= ALL_WRONG_HIGH:
        reason = (
            f"{seen}, but the task has no reference solutions for continuation likelihood to "
            f"score; {FALLBACK_METHOD} kept"
        )
        return CreditChoice(FALLBACK_METHOD, {}, reason, dict(figures))
    reason = (
        f"{seen} (under {ALL_WRONG_HIGH:.0%}): GRPO has a signal in most groups and no finer "
        f"credit was measured ahead of it here; {FALLBACK_METHOD} (level with GRPO)"
    )
    return CreditChoice(FALLBACK_METHOD, {}, reason, dict(figures))


def apply_choice(cfg: Any, choice: CreditChoice) -> None:
    """Set ``cfg.credit_method`` and the chosen ``credit.<field>`` settings of a ``TrainConfig``,
    in place."""
    cfg.credit_method = choice.method
    for dotted, value in choice.settings.items():
        *path, name = dotted.split(".")
        target = cfg.credit
        for part in path:
            target = getattr(target, part)
        if not hasattr(target, name):
            raise AttributeError(f"credit.{dotted} is not a credit setting")
        setattr(target, name, value)
