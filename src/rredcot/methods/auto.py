"""``--credit auto``: the credit method for a run, chosen from its first training batch.

The rule (the one ``rredcot diagnose``'s verdict states too, docs/diagnose.md): a credit method
is chosen only where it was measured ahead of GRPO **per second** (equal training time) on a
testbed like the run's, else ``uniform`` (GRPO). What was measured is :data:`MEASUREMENTS`, read
from a data file the learn bench writes (``rredcot bench record-auto``), one row per (testbed,
model, method); a testbed is like the run when its policy is of the same kind (the character
model is not like a pretrained language model; language models within a factor of ten of each
other's parameters are alike) and the run's first batch has a share of
all-wrong groups within ``ALL_WRONG_BAND`` and a mean reward within ``REWARD_BAND`` of the
testbed's (each widened by two standard errors of the batch's own share), and the task writes reference solutions where the method reads them. A row decides
for its method when both of its per-second figures (accuracy at GRPO's last training second and
time-averaged accuracy over GRPO's run, paired per seed) are more than two standard errors above
GRPO. A new measured row (a cheaper estimator) changes the choice by being added to the file.

This module is the rule only (pure functions over a batch's rewards; torch-free at import). The
entry point is :func:`choose_from_rollouts`: the trainer calls it on step 1's own rollouts (no
extra sampling), the TRL integration on its first generation batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rredcot.errors import UserError
from rredcot.methods.settings import (
    check_credit_settings,
    check_data_method,
    credit_config_with,
    plain_fields,
)
from rredcot.safe_fs import read_json_file, write_text_atomic

if TYPE_CHECKING:  # torch-free at import: the CLI's flags and the bench's specs read this module
    import torch

AUTO = "auto"  # the value of ``credit_method`` that asks for this choice
SUCCESS = 1.0  # a reward at or above this is a right trace (the project's 0/1 convention)
REWARD_LOW = 0.05  # mean reward below which no outcome-based credit has a signal (diagnose)
ALL_WRONG_HIGH = 0.25  # share of all-wrong groups at which GRPO is blind to much of the batch
ALL_WRONG_BAND = 0.15  # a testbed is like the run within this of its share of all-wrong groups
REWARD_BAND = 0.15  # ... and within this of its mean reward
FALLBACK_METHOD = "uniform"  # GRPO: what auto runs where nothing was measured ahead of it

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


MODEL_KINDS = ("character", "language_model")
"""What a measured row's policy was: the built-in character-level tiny Llama (``rredcot sft``),
or a language model with a subword vocabulary (a pretrained Hugging Face causal LM)."""
CHARACTER_VOCAB_MAX = 512  # a vocabulary this small is a character tokenizer's (ours has 100)
PARAMETER_FACTOR = 10.0  # two language models are alike within this factor of parameters
MIN_SEEDS = 5  # a row decides a run only when measured on at least this many paired seeds


def model_kind(vocab_size: int) -> str:
    """The kind (:data:`MODEL_KINDS`) of a policy whose tokenizer has ``vocab_size`` tokens."""
    return "character" if vocab_size <= CHARACTER_VOCAB_MAX else "language_model"


MEASUREMENTS_FILE = Path(__file__).parents[1] / "measurements" / "credit_auto.json"
"""The rows ``auto`` reads, written by ``rredcot bench record-auto`` from a ``learn.json``."""


@dataclass(frozen=True)
class Measurement:
    """One measured (testbed, model, method) against GRPO, paired per seed, in accuracy / 100.

    The settings must not change sampling or segmentation (the choice is made after step 1's
    batch was sampled and segmented)."""

    testbed: str  # in words
    all_wrong: float  # the testbed's share of all-wrong groups at the run's G (its probes' mean)
    mean_reward: float  # the testbed's mean reward of the starting policy
    method: str
    settings: dict[str, Any]  # credit.<dotted field> -> value
    variant: str  # the method's row (``variant``) in ``source``'s summary
    needs_references: bool  # the method scores reference solutions
    per_token: tuple[float, float]  # mean accuracy in training − GRPO's: (mean, s.e.)
    at_grpo_last_second: tuple[float, float]  # accuracy at GRPO's last training second − GRPO's
    time_averaged: tuple[float, float]  # accuracy averaged over GRPO's training seconds − GRPO's
    seeds: int
    source: str  # the learn.json the figures are read from, under benchmarks/results/
    model_kind: str = "character"  # MODEL_KINDS
    model: str = ""  # the policy in words
    model_parameters: int | None = None  # the policy's parameters (language models)

    def ahead_per_second(self) -> bool:
        """Both per-second figures more than two standard errors above GRPO, on at least
        :data:`MIN_SEEDS` seeds (a partial block's rows are kept, and cited, but decide nothing)."""
        pairs = (self.at_grpo_last_second, self.time_averaged)
        return self.seeds >= MIN_SEEDS and all(m - 2 * se > 0 for m, se in pairs)

    def like_model(self, figures: dict[str, Any]) -> bool:
        """Whether the run's policy (``figures["model_kind"]``, ``figures["model_parameters"]``,
        where given) is like this row's: the same kind, and for language models within
        :data:`PARAMETER_FACTOR` of its parameters where both are known."""
        kind = figures.get("model_kind")
        if kind is None:
            return True  # a caller that does not know the model (a pure figures check)
        if kind != self.model_kind:
            return False
        theirs, ours = figures.get("model_parameters"), self.model_parameters
        if kind == "language_model" and theirs and ours:
            return max(theirs, ours) / min(theirs, ours) <= PARAMETER_FACTOR
        return True

    def like(self, figures: dict[str, Any], has_references: bool) -> bool:
        """Whether a run whose first batch scored ``figures`` is on a testbed like this one: a
        policy like the row's (:meth:`like_model`) and shares within the bands, widened by two
        standard errors of the batch's own shares (a batch of 16 groups measures a share to
        about ±0.1; ``figures["groups"]``, when given)."""
        if self.needs_references and not has_references:
            return False
        if not self.like_model(figures):
            return False
        groups = figures.get("groups") or 0

        def slack(share: float) -> float:
            share = min(max(share, 0.0), 1.0)
            return 2 * math.sqrt(share * (1 - share) / groups) if groups else 0.0

        wrong, mean = figures["all_wrong"], figures["mean_reward"]
        return abs(wrong - self.all_wrong) <= ALL_WRONG_BAND + slack(wrong) and abs(
            mean - self.mean_reward
        ) <= REWARD_BAND + slack(mean)

    def words(self) -> str:
        """The measurement in one phrase (the start-up line's)."""

        def pts(x: tuple[float, float]) -> str:
            return f"{100 * x[0]:+.1f} ± {100 * x[1]:.1f}"

        return (
            f"{self.method} on {self.testbed}, {self.all_wrong:.0%} all wrong, mean reward "
            f"{self.mean_reward:.2f}: {pts(self.per_token)} points per token, "
            f"{pts(self.at_grpo_last_second)} at GRPO's last second, "
            f"{pts(self.time_averaged)} time-averaged, {self.seeds} seeds [{self.source}]"
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


MEASUREMENTS_FIX = "fix the row, or record it again (rredcot bench record-auto)"


def measurement_from_json(row: Any, where: str) -> Measurement:
    """A row of the measurements file, checked as data (``rredcot.methods.settings``): declared
    fields of their declared types, finite figures, a method that runs no named code, and plain
    credit settings that name no code and produce a valid credit config. Else a ``UserError``
    naming the row."""
    fix = MEASUREMENTS_FIX
    values = plain_fields(Measurement, row, where, fix)
    if values.get("model_kind", "character") not in MODEL_KINDS:
        raise UserError(
            f"{where}: model_kind {values['model_kind']!r}; valid: {MODEL_KINDS}; {fix}"
        )
    for name in ("all_wrong", "mean_reward"):
        if not 0.0 <= values[name] <= 1.0:
            raise UserError(f"{where}: {name}={values[name]} must be a share in [0, 1]; {fix}")
    if values["seeds"] < 0 or any(values[p][1] < 0 for p in _PAIRS):
        raise UserError(f"{where}: seeds and standard errors must be >= 0; {fix}")
    check_data_method(values["method"], where, fix)
    values["settings"] = check_credit_settings(values["settings"], where, fix)
    credit_config_with(values["settings"], where, fix)
    return Measurement(**values)


_PAIRS = ("per_token", "at_grpo_last_second", "time_averaged")


def load_measurements(path: str | Path | None = None) -> tuple[Measurement, ...]:
    """The rows of a measurements file (:data:`MEASUREMENTS_FILE` by default), read within size
    and nesting limits and checked row by row; a bad file is one ``UserError`` naming it."""
    path = Path(path) if path is not None else MEASUREMENTS_FILE
    data = read_json_file(path, "measurements file")
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise UserError(
            f"measurements file {path}: expected an object with a list 'rows'; {MEASUREMENTS_FIX}"
        )
    return tuple(measurement_from_json(r, f"{path} row {i}") for i, r in enumerate(rows))


def write_measurements(rows: tuple[Measurement, ...] | list[Measurement], path: str | Path) -> None:
    """Write ``rows`` to a measurements file, keeping its ``about`` text (atomically, through
    no planted link: ``config_io.write_text_atomic``)."""
    path = Path(path)
    old = read_json_file(path, "measurements file") if path.exists() else {}
    about = old.get("about", "") if isinstance(old, dict) else ""
    text = json.dumps({"about": about, "rows": [r.to_json() for r in rows]}, indent=1) + "\n"
    write_text_atomic(path, text)


def measured_rows() -> tuple[Measurement, ...]:
    """What was measured against GRPO at equal training time (``bench learn``'s per-second
    columns, each method at its tuned rate): :data:`MEASUREMENTS_FILE`'s rows, read when auto
    first needs them (never at import: a bad file fails only what reads it), then kept as
    ``MEASUREMENTS``. A row's figures are its source's ``*_vs_reference`` means and standard
    errors (tests check them)."""
    rows = globals().get("MEASUREMENTS")
    if rows is None:
        rows = load_measurements()
        globals()["MEASUREMENTS"] = rows
    return rows


def __getattr__(name: str) -> Any:
    if name == "MEASUREMENTS":  # read lazily (:func:`measured_rows`)
        return measured_rows()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


CHOICE_FILE = "credit_choice.json"  # where a run saves what auto chose (runio.CREDIT_CHOICE)


@dataclass(frozen=True)
class CreditChoice:
    """What ``--credit auto`` chose and why (written to the run directory as
    ``credit_choice.json``)."""

    method: str
    settings: dict[str, Any]  # credit.<dotted field> -> value, applied over the run's config
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)  # the first batch's figures
    decided_by: str | None = None  # the measurement's source (MEASUREMENTS) that decided

    @classmethod
    def read_dict(cls, data: Any, where: str = CHOICE_FILE) -> CreditChoice:
        """A saved choice (one written before ``decided_by`` existed too), checked as data from
        a file someone else may have written: a mapping of the choice's own fields, a ``method``
        that ``auto`` can choose, and ``settings`` that are plain values of credit fields, none
        of which names code or a model to load (``process_reward.function``/``model``: only
        ever given on the command line). Anything else is a one-line ``UserError`` naming
        ``where``; nothing named in it is imported."""
        return cls(**validate_saved_choice(data, where))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, path: str | Path) -> CreditChoice:
        """The choice a run wrote (``credit_choice.json``), checked by :meth:`read_dict`."""

        return cls.read_dict(read_json_file(path, "saved credit choice"), str(path))


_CHOICE_FIELDS = ("method", "settings", "reason", "figures", "decided_by")


def choosable_methods() -> list[str]:
    """The methods ``auto`` can choose: GRPO and every measured row's method."""
    return sorted({FALLBACK_METHOD, *(m.method for m in measured_rows())})


def validate_saved_choice(data: Any, where: str = CHOICE_FILE) -> dict[str, Any]:
    """The fields of a saved choice (see :meth:`CreditChoice.read_dict`), or a ``UserError``."""
    fix = "delete the file to choose again from a fresh run, or name --credit yourself"
    if not isinstance(data, dict):
        raise UserError(
            f"{where} holds a {type(data).__name__}, not a saved credit choice (a mapping of "
            f"{', '.join(_CHOICE_FIELDS)}); {fix}"
        )
    unknown = sorted(str(k) for k in data if k not in _CHOICE_FIELDS)
    if unknown:
        raise UserError(
            f"{where}: unknown field(s) {', '.join(unknown)[:200]}; a saved credit choice has "
            f"{', '.join(_CHOICE_FIELDS)}; {fix}"
        )
    method = data.get("method")
    allowed = choosable_methods()
    if not isinstance(method, str) or method not in allowed:
        raise UserError(
            f"{where}: method {str(method)[:80]!r} is not one --credit auto chooses "
            f"({', '.join(allowed)}); {fix}"
        )
    settings = check_credit_settings(data.get("settings") or {}, where, fix)
    credit_config_with(settings, where, fix)
    figures = data.get("figures") or {}
    if not isinstance(figures, dict):
        raise UserError(f"{where}: figures must be a mapping; {fix}")
    reason, decided = data.get("reason", ""), data.get("decided_by")
    if not isinstance(reason, str) or not isinstance(decided, (str, type(None))):
        raise UserError(f"{where}: reason and decided_by must be text; {fix}")
    return {
        "method": method,
        "settings": settings,
        "reason": reason,
        "figures": dict(figures),
        "decided_by": decided,
    }


def group_outcomes(rewards: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    """A batch's figures from its rewards (B,) and group ids (B,): ``mean_reward``, the shares
    of groups whose samples are all wrong (every reward ``<= 0``) and all right (every reward
    ``>= SUCCESS``), and the number of ``groups`` and ``samples``."""
    return outcome_figures(outcome_counts(rewards, group_ids))


def outcome_counts(rewards: torch.Tensor, group_ids: torch.Tensor) -> list[float]:
    """``[reward sum, samples, all-wrong groups, all-right groups, groups]`` of a batch: sums,
    so that processes of a distributed run add theirs up before :func:`outcome_figures`."""
    if rewards.numel() == 0:
        raise ValueError("the batch has no samples: the verifier rejected every one")
    ids = group_ids.unique()
    wrong = sum(bool((rewards[group_ids == g] <= 0).all()) for g in ids)
    right = sum(bool((rewards[group_ids == g] >= SUCCESS).all()) for g in ids)
    return [float(rewards.float().sum()), float(rewards.numel()), wrong, right, float(len(ids))]


def outcome_figures(counts: list[float]) -> dict[str, float]:
    """:func:`group_outcomes`' figures from (summed) :func:`outcome_counts`."""
    reward_sum, samples, wrong, right, groups = (float(c) for c in counts)
    return {
        "mean_reward": reward_sum / samples,
        "all_wrong": wrong / groups,
        "all_right": right / groups,
        "groups": groups,
        "samples": samples,
    }


def policy_figures(policy: Any, tokenizer: Any) -> dict[str, Any]:
    """The policy's ``model_kind`` and ``model_parameters``, as :class:`Measurement` compares
    them (the tokenizer's vocabulary tells a character model from a language model)."""
    parameters = sum(p.numel() for p in policy.parameters())
    return {"model_kind": model_kind(len(tokenizer)), "model_parameters": int(parameters)}


def choose_from_rollouts(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    has_references: bool,
    measurements: tuple[Measurement, ...] | None = None,
    model: dict[str, Any] | None = None,
) -> CreditChoice:
    """``--credit auto``'s choice from one batch of the starting policy's own rollouts:
    rewards (B,) and group ids (B,) of G samples per prompt; ``has_references``: the task
    writes a reference solution for every prompt of the batch (``Task.gold_completion``);
    ``model``: :func:`policy_figures` of the policy (rows of other models are not like it)."""
    figures = {**group_outcomes(rewards, group_ids), **(model or {})}
    return choose_credit(figures, has_references, measurements)


def choose_credit(
    figures: dict[str, Any],
    has_references: bool,
    measurements: tuple[Measurement, ...] | None = None,
    seen_in: str = "the first batch",
) -> CreditChoice:
    """The credit method for a run whose starting policy scored ``figures``
    (:func:`outcome_figures`) on its first batch: the best method measured ahead of GRPO per
    second on a testbed like it (:class:`Measurement`; ``measurements`` default to
    :data:`MEASUREMENTS`), else ``uniform``."""
    if measurements is None:
        measurements = measured_rows()
    mean, wrong = figures["mean_reward"], figures["all_wrong"]
    seen = f"{seen_in} solves {mean:.0%} of its samples and {wrong:.0%} of its groups are all wrong"
    figures = {**figures, "has_references": has_references}
    like = [m for m in measurements if m.like(figures, has_references)]
    ahead = sorted(
        (m for m in like if m.ahead_per_second()), key=lambda m: -m.at_grpo_last_second[0]
    )
    if ahead:
        best = ahead[0]
        reason = f"{seen}; measured ahead of GRPO per second on a testbed like it: {best.words()}"
        return CreditChoice(best.method, dict(best.settings), reason, figures, best.source)
    if like:
        # the testbed most like the run; of its methods, the one closest to GRPO per second
        nearest = min(
            like,
            key=lambda m: (
                abs(m.all_wrong - wrong) + abs(m.mean_reward - mean),
                -m.at_grpo_last_second[0],
            ),
        )
        partial = (
            f" (on fewer than {MIN_SEEDS} seeds a row decides nothing)"
            if nearest.seeds < MIN_SEEDS
            else ""
        )
        reason = (
            f"{seen}; on the testbed most like it no credit method was measured ahead of GRPO "
            f"per second{partial}: {nearest.words()}; so {FALLBACK_METHOD} (GRPO)"
        )
        return CreditChoice(FALLBACK_METHOD, {}, reason, figures, nearest.source)
    if not any(m.like_model(figures) for m in measurements):
        reason = (
            f"{seen}; no credit method was measured on a model like it "
            f"({_model_words(figures)}; rows: {_measured_models(measurements)}); "
            f"{FALLBACK_METHOD} (GRPO)"
        )
        return CreditChoice(FALLBACK_METHOD, {}, reason, figures, None)
    reason = (
        f"{seen}; no credit method was measured on a testbed like it (all-wrong share within "
        f"{ALL_WRONG_BAND:.0%} and mean reward within {REWARD_BAND:.2f} of a measured one, "
        "each widened by two standard errors of the batch's"
        f"{'' if has_references else ', with no reference solutions'}); "
        f"{FALLBACK_METHOD} (GRPO)"
    )
    return CreditChoice(FALLBACK_METHOD, {}, reason, figures, None)


def _model_words(figures: dict[str, Any]) -> str:
    kind, parameters = figures.get("model_kind"), figures.get("model_parameters")
    size = f" of {parameters / 1e6:.0f}M parameters" if parameters else ""
    return f"a {kind.replace('_', ' ')}{size}" if kind else "a model of unknown kind"


def _measured_models(measurements: tuple[Measurement, ...]) -> str:
    kinds = sorted({m.model or m.model_kind for m in measurements})
    return "; ".join(kinds) if kinds else "none"


def apply_choice(cfg: Any, choice: CreditChoice) -> None:
    """Set ``cfg.credit_method`` and the chosen ``credit.<field>`` settings of a ``TrainConfig``
    (or of anything with ``credit_method`` and ``credit``), in place, once checked as any file's
    settings are (``rredcot.methods.settings``): a method that runs no named code, declared plain
    fields naming no code, and a config the run's own checks accept."""
    where = f"--credit auto's choice (from {choice.decided_by or 'no measurement'})"
    fix = "fix that row of the measurements file, or name --credit yourself"
    check_data_method(choice.method, where, fix)
    settings = check_credit_settings(choice.settings, where, fix)
    checked = credit_config_with(settings, where, fix, base=cfg.credit)
    if dataclasses.is_dataclass(cfg):  # the whole run's checks (references.mode bread: uniform)
        try:
            dataclasses.replace(cfg, credit_method=choice.method, credit=checked)
        except ValueError as err:
            raise UserError(f"{where}: {err}; {fix}") from None
    cfg.credit_method = choice.method
    for dotted in settings:
        *path, name = dotted.split(".")
        target, source = cfg.credit, checked
        for part in path:
            target, source = getattr(target, part), getattr(source, part)
        setattr(target, name, getattr(source, name))
