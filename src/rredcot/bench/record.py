"""``rredcot bench record-auto``: a learn bench's per-second figures become rows of the file
``--credit auto`` reads (:data:`rredcot.credit_choice.MEASUREMENTS_FILE`), so that auto is
decided by measurements, not rows typed into code. A row replaces one of the same source and
variant; the others are kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rredcot.bench.configs import RecordAutoConfig
from rredcot.config import CreditConfig
from rredcot.credit_choice import (
    MEASUREMENTS_FILE,
    Measurement,
    load_measurements,
    write_measurements,
)
from rredcot.errors import UserError

NEEDS_REFERENCES = {"continuation_likelihood": True}
"""Methods that score reference solutions (the others read the outcome, the answer or the
policy's own states)."""


def _source(learn: Path) -> str:
    """The learn.json's path under benchmarks/results/ (how rows cite it)."""
    parts = learn.resolve().parts
    for i in range(len(parts) - 1):
        if parts[i : i + 2] == ("benchmarks", "results"):
            return "/".join(parts[i + 2 :])
    raise UserError(f"--learn {learn}: record a learn.json under benchmarks/results/")


def _credit_settings(variant: dict[str, Any]) -> dict[str, Any]:
    """The variant's overrides as ``credit.<field>`` settings typed as the credit config types
    them (auto can apply only credit settings)."""
    settings: dict[str, Any] = {}
    for key, value in (variant.get("overrides") or {}).items():
        if not key.startswith("credit."):
            raise UserError(
                f"variant {variant['variant']!r} sets {key}: --credit auto chooses credit "
                "settings only; record credit variants"
            )
        dotted = key.removeprefix("credit.")
        settings[dotted] = _typed(dotted, value)
    return settings


def _typed(dotted: str, value: Any) -> Any:
    """``value`` (a variant's string) as the type of ``CreditConfig``'s field ``dotted``."""
    *path, name = dotted.split(".")
    target: Any = CreditConfig()
    for part in path:
        target = getattr(target, part, None)
    if target is None or not hasattr(target, name):
        raise UserError(f"credit.{dotted} is not a credit setting")
    current = getattr(target, name)
    if not isinstance(value, str):
        return value
    if isinstance(current, bool):
        return value.lower() == "true"
    if isinstance(current, int | float):
        return type(current)(float(value)) if isinstance(current, float) else int(value)
    return value


def rows_from_learn(cfg: RecordAutoConfig) -> list[Measurement]:
    """The rows of ``cfg.learn``'s chosen variants."""
    learn = Path(cfg.learn)
    if not learn.is_file():
        raise UserError(f"--learn {cfg.learn}: no such file (a learn bench's learn.json)")
    report = json.loads(learn.read_text())
    summary = {s["variant"]: s for s in report.get("summary", [])}
    wanted = [v for v in cfg.variants.split(",") if v.strip()] or [
        name for name, s in summary.items() if s.get("reference") not in (None, name)
    ]
    unknown = [v for v in wanted if v not in summary]
    if unknown:
        raise UserError(f"--variants {unknown} not in {cfg.learn}; valid: {', '.join(summary)}")
    rows = []
    for name in wanted:
        s = summary[name]
        if s.get("reference") in (None, name):
            raise UserError(f"variant {name!r} is the reference (GRPO) itself: nothing to record")
        pairs = {}
        for field, key in (
            ("per_token", "mean_accuracy_vs_reference"),
            ("at_grpo_last_second", "accuracy_at_reference_seconds_vs_reference"),
            ("time_averaged", "time_averaged_accuracy_vs_reference"),
        ):
            paired = s.get(key) or {}
            if paired.get("mean") is None or paired.get("sem") is None:
                raise UserError(f"variant {name!r} has no paired {key} in {cfg.learn}")
            pairs[field] = (float(paired["mean"]), float(paired["sem"]))
        rows.append(
            Measurement(
                testbed=cfg.testbed,
                all_wrong=cfg.all_wrong,
                mean_reward=cfg.mean_reward,
                method=s["method"],
                settings=_credit_settings(s),
                variant=name,
                needs_references=NEEDS_REFERENCES.get(s["method"], False),
                seeds=len(s["seeds"]),
                source=_source(learn),
                model_kind=cfg.model_kind,
                model=cfg.model,
                model_parameters=cfg.model_parameters or None,
                **pairs,
            )
        )
    return rows


def run_record_auto(cfg: RecordAutoConfig) -> list[Measurement]:
    """Write ``cfg.learn``'s rows into the measurements file; returns them."""
    path = Path(cfg.file) if cfg.file else MEASUREMENTS_FILE
    rows = rows_from_learn(cfg)
    kept = [
        r
        for r in (load_measurements(path) if path.exists() else ())
        if (r.source, r.variant) not in {(n.source, n.variant) for n in rows}
    ]
    write_measurements([*kept, *rows], path)
    for row in rows:
        print(f"recorded in {path}: {row.words()}")
    return rows
