"""The verdict of ``rredcot diagnose``: the headline figures in, a sentence and its reasons out
(docs/diagnose.md, "the verdict"). The thresholds it shares with ``--credit auto`` are
:mod:`rredcot.methods.auto`'s, so the two read a policy by one rule.
"""

from __future__ import annotations

import math
from typing import Any

from rredcot.config.diagnose import DEFAULT_UNCERTAIN_P
from rredcot.methods.auto import ALL_WRONG_HIGH, REWARD_LOW, choose_credit, flow_flags

# the verdict's thresholds (docs/diagnose.md, "the verdict"); REWARD_LOW and ALL_WRONG_HIGH are
# --credit auto's too (rredcot.methods.auto)
ALL_RIGHT_HIGH = 0.5  # share of all-right groups at G above which the prompts are too easy
PREFIX_LOW, PREFIX_HIGH = 0.15, 0.30  # GRPO's gradient share on still-right prefixes
UNCERTAIN_LOW, UNCERTAIN_HIGH = 1.0, 4.0  # uncertain decisions per trace
VARIANCE_LOW, VARIANCE_HIGH = 0.2, 0.5  # share of the advantage's mean square step credit removes


def verdict(figures: dict[str, Any]) -> tuple[str, list[str]]:
    """A plain-words verdict and its reasons from the headline figures (``None`` = not measured):

    ``mean_reward``, ``all_wrong``, ``all_right`` (shares of groups at G), ``prefix_share`` and ``prefix_tokens``
    (GRPO's gradient share and token share of the still-right prefix of wrong traces),
    ``error_share`` (the first wrong step's gradient share), ``uncertain_per_trace``,
    ``uncertain_p``, ``variance_removed`` (Monte Carlo: the share of the logit gradient's mean
    square that step-level values remove, ``gradient_variance_removed`` of the report);
    ``task``, ``model_kind`` and ``has_references`` (what the run is: a recommendation
    measured on one kind of testbed is made only on a run of that kind).

    Each figure past a threshold (module constants, docs/diagnose.md) is a reason for or against;
    the verdict: at least two reasons for and more for than against: "finer credit is likely to
    help"; no reason for and at least one against: "little to win"; otherwise "may help a little".
    """
    found = [
        *_outcome_reasons(figures),
        *_prefix_reasons(figures),
        *_uncertainty_reasons(figures),
        *_variance_reasons(figures),
    ]
    pros = [text for sign, text in found if sign == "+"]
    cons = [text for sign, text in found if sign == "-"]
    notes = [text for sign, text in found if sign == " "]
    if len(pros) >= 2 and len(pros) > len(cons):
        head = "finer credit is likely to help this run"
    elif not pros and cons:
        head = "credit assignment has little to win here"
    else:
        head = "finer credit may help a little; measure a ceiling before paying for it"
    reasons = [f"+ {p}" for p in pros] + [f"- {c}" for c in cons] + [f"  {n}" for n in notes]
    return head, reasons


# A reason of the verdict: ("+", text) for finer credit, ("-", text) against, (" ", text) a note.
_Reason = tuple[str, str]


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _outcome_reasons(figures: dict[str, Any]) -> list[_Reason]:
    """Reasons from the mean reward and the shares of all-wrong and all-right groups."""
    reasons: list[_Reason] = []
    wrong, right = figures.get("all_wrong"), figures.get("all_right")
    mean_reward = figures.get("mean_reward")
    if mean_reward is not None and mean_reward < REWARD_LOW:
        reasons.append(
            (
                "-",
                f"the policy solves only {_pct(mean_reward)} of its samples: an outcome reward "
                "gives almost no signal to any credit method; warm-start it or use easier "
                "prompts first",
            )
        )
    elif wrong is not None and wrong >= ALL_WRONG_HIGH:
        reasons.append(
            (
                "+",
                f"{_pct(wrong)} of groups are all wrong: GRPO learns nothing from them; "
                "credit that blames the line where a trace broke can, without generating: "
                f"where the task has reference solutions, {flow_flags()} was ahead of GRPO per "
                "sampled token on arithmetic chains with the tiny character model (docs/diagnose.md)",
            )
        )
        if figures.get(
            "has_references", True
        ):  # the reference baseline (rredcot.training.references)
            reasons.append(_reference_baseline_reason(figures))
        if mean_reward is not None:  # and per second: --credit auto's rule (credit_choice)
            choice = choose_credit(
                {
                    "mean_reward": mean_reward,
                    "all_wrong": wrong,
                    "model_kind": figures.get("model_kind"),
                    "model_parameters": figures.get("model_parameters"),
                },
                has_references=figures.get("has_references", True),
                seen_in="the policy",
            )
            reasons.append((" ", f"--credit auto would run {choice.method}: {choice.reason}"))
    if right is not None and right >= ALL_RIGHT_HIGH:
        reasons.append(
            (
                " ",
                f"{_pct(right)} of groups are all right: those prompts are too easy for this "
                "policy and give no update whatever the credit; harder prompts help more than "
                "finer credit",
            )
        )
    return reasons


REFERENCE_TESTBEDS = "arithmetic chains with the tiny character model"
"""Where the reference baseline was measured (benchmarks/results/references/): the 4-step and
12-step arithmetic testbeds, whose warm-starts are supervised training on the same gold traces
the references are, cut short."""
REFERENCE_LANGUAGE_MODEL = (
    "SmolLM2-135M-Instruct on word problems, whose references it never trained on; there the "
    "references are the task generator's own solution template and 110-120 of the 128 held-out "
    "problems' arithmetic chains also occur in the training pool, so its lead measures the "
    "model copying that template, not RL"
)
"""The pretrained model the reference baseline was measured on
(benchmarks/results/smollm2/word_problems_report/; the overlap: smollm2/overlap/)."""
_REFERENCE_CONDITION = (
    "measured only on arithmetic chains with the tiny character model, whose warm-start is "
    "supervised training on those same reference traces, cut short"
)


def like_reference_testbeds(figures: dict[str, Any]) -> bool:
    """Whether the run is like the testbeds the reference baseline was measured on: the
    ``arithmetic`` task and a character-level policy (``figures["task"]``,
    ``figures["model_kind"]``; unknown counts as unlike)."""
    return figures.get("task") == "arithmetic" and figures.get("model_kind") == "character"


def _reference_baseline_reason(figures: dict[str, Any]) -> _Reason:
    """The reference baseline (--references.mode sft): recommended only on a run like a testbed
    it was measured on (the character model's arithmetic chains, with their warm-start's
    condition); for a pretrained language model, a note of what SmolLM2's lead measured
    (template copying); elsewhere a note that it was not measured on a model like this one."""
    if like_reference_testbeds(figures):
        return (
            "+",
            "with reference solutions, training on them first: --references.mode sft "
            "--references.sft_coef 1 (the references of all-wrong groups as targets) was further "
            "ahead of GRPO, per sampled token and per second, than any credit method that reads "
            f"them; {_REFERENCE_CONDITION} (docs/references.md)",
        )
    if figures.get("model_kind") == "language_model":
        return (
            " ",
            "with reference solutions, --references.mode sft --references.sft_coef 1 (the "
            "references of all-wrong groups as targets) was far ahead of GRPO on the one "
            f"pretrained model measured: {REFERENCE_LANGUAGE_MODEL}; whether it helps on your "
            "references is not known (docs/references.md)",
        )
    return (
        " ",
        "training on the reference solutions (--references.mode sft) has not been measured on a "
        f"model or task like this one: it was {_REFERENCE_CONDITION}, so its lead there may "
        "come from finishing that training (docs/references.md)",
    )


def _prefix_reasons(figures: dict[str, Any]) -> list[_Reason]:
    """Reasons from GRPO's gradient share on the still-right prefix of wrong traces."""
    prefix, tokens = figures.get("prefix_share"), figures.get("prefix_tokens")
    error = figures.get("error_share")
    if prefix is None:
        return []
    where = (
        f"only {_pct(prefix)} of GRPO's gradient on wrong traces lands on their still-right "
        f"prefix ({_pct(tokens)} of their tokens)"
        if tokens is not None
        else f"{_pct(prefix)} of GRPO's gradient on wrong traces lands on their still-right prefix"
    )
    if prefix <= PREFIX_LOW:
        return [
            (
                "-",
                where
                + (f", and {_pct(error)} on the step that failed" if error is not None else "")
                + ": the softmax already points uniform credit at the uncertain tokens",
            )
        ]
    if prefix >= PREFIX_HIGH:
        return [
            (
                "+",
                f"{_pct(prefix)} of GRPO's gradient on wrong traces blames their still-right "
                f"prefix ({_pct(tokens or float('nan'))} of their tokens): uniform credit spends "
                "much of its update on steps that were right",
            )
        ]
    return []


def _uncertainty_reasons(figures: dict[str, Any]) -> list[_Reason]:
    """Reasons from the uncertain decisions per trace."""
    uncertain = figures.get("uncertain_per_trace")
    thr = figures.get("uncertain_p", DEFAULT_UNCERTAIN_P)
    if uncertain is None:
        return []
    if uncertain < UNCERTAIN_LOW:
        return [
            (
                "-",
                f"a trace holds {uncertain:.1f} uncertain decisions (p < {thr:g}) on average: "
                "there are few choices for credit to sort out",
            )
        ]
    if uncertain >= UNCERTAIN_HIGH:
        return [
            (
                "+",
                f"a trace holds {uncertain:.1f} uncertain decisions (p < {thr:g}) on average: "
                "many choices share one outcome, which is where segment credit pays",
            )
        ]
    return []


def _variance_reasons(figures: dict[str, Any]) -> list[_Reason]:
    """Reasons from the share of the logit gradient's mean square that step values remove."""
    removed = figures.get("variance_removed")
    if removed is None or not math.isfinite(removed):
        return []
    if removed >= VARIANCE_HIGH:
        return [
            (
                "+",
                f"step-level values would remove {_pct(removed)} of the logit gradient's mean "
                "square (Monte Carlo)",
            )
        ]
    if removed <= VARIANCE_LOW:
        return [
            (
                "-",
                f"step-level values would remove only {_pct(removed)} of the logit gradient's "
                "mean square (Monte Carlo): the noise they cut sits on tokens the policy is sure "
                "of",
            )
        ]
    return []
