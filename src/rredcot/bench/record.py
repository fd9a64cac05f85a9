"""``rredcot bench record-auto``: a learn bench's per-second figures become rows of the file
``--credit auto`` reads (:data:`rredcot.methods.auto.MEASUREMENTS_FILE`), so that auto is
decided by measurements, not rows typed into code. A row replaces one of the same source and
variant; the others are kept."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rredcot.bench.configs import RecordAutoConfig
from rredcot.config.io import brief
from rredcot.errors import UserError
from rredcot.methods.auto import (
    MEASUREMENTS_FILE,
    Measurement,
    load_measurements,
    measurement_from_json,
    write_measurements,
)
from rredcot.methods.settings import check_credit_settings
from rredcot.safe_fs import read_json_file

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


_FIX = "record a learn.json that rredcot bench learn wrote"
_FIGURES = (
    ("per_token", "mean_accuracy_vs_reference"),
    ("at_grpo_last_second", "accuracy_at_reference_seconds_vs_reference"),
    ("time_averaged", "time_averaged_accuracy_vs_reference"),
)


def _credit_settings(variant: dict[str, Any], where: str) -> dict[str, Any]:
    """The variant's overrides as ``credit.<field>`` settings (auto can apply only credit
    settings), checked and typed as every file's are (``rredcot.methods.settings``)."""
    overrides = variant.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise UserError(f"{where}: overrides must be a mapping of config fields; fix the file")
    settings: dict[str, Any] = {}
    for key, value in overrides.items():
        if not str(key).startswith("credit."):
            raise UserError(
                f"{where} sets {str(key)[:80]}: --credit auto chooses credit settings only; "
                "record credit variants"
            )
        settings[str(key).removeprefix("credit.")] = value
    return check_credit_settings(settings, where, _FIX, from_text=True)


def _read_summary(learn: Path) -> dict[str, dict[str, Any]]:
    """The learn.json's summary rows by variant, read within size and nesting limits."""
    where = f"--learn {learn}"
    report = read_json_file(learn, "--learn")
    summary = report.get("summary") if isinstance(report, dict) else None
    if not isinstance(summary, list) or not summary:
        raise UserError(
            f"{where} holds no summary of variants (a learn bench's report: an object with a "
            f"'summary' list): nothing to record; {_FIX}"
        )
    rows: dict[str, dict[str, Any]] = {}
    for i, s in enumerate(summary):
        name = s.get("variant") if isinstance(s, dict) else None
        if not isinstance(name, str) or not name:
            raise UserError(f"{where}: summary entry {i} is not a variant's row; {_FIX}")
        rows[name] = s
    return rows


def _figures(s: dict[str, Any], where: str) -> dict[str, tuple[float, float]]:
    """The variant's paired figures against the reference: finite means, finite s.e. >= 0."""
    pairs = {}
    for field, key in _FIGURES:
        paired = s.get(key) or {}
        mean, sem = (paired.get(k) if isinstance(paired, dict) else None for k in ("mean", "sem"))
        if mean is None or sem is None:
            raise UserError(f"{where} has no paired {key}; {_FIX}")
        numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (mean, sem))
        if not numbers or not (math.isfinite(mean) and math.isfinite(sem) and sem >= 0):
            raise UserError(
                f"{where}: {key} is {brief(paired)}; a recorded figure is a finite mean and "
                f"standard error: {_FIX}"
            )
        pairs[field] = (float(mean), float(sem))
    return pairs


def _row(cfg: RecordAutoConfig, learn: Path, name: str, s: dict[str, Any]) -> Measurement:
    """The measurement of variant ``name`` (summary row ``s``), checked as auto reads it."""
    where = f"--learn {learn} variant {name[:80]!r}"
    if s.get("reference") in (None, name):
        raise UserError(f"variant {name!r} is the reference (GRPO) itself: nothing to record")
    seeds, method = s.get("seeds"), s.get("method")
    if not isinstance(seeds, list) or not isinstance(method, str):
        raise UserError(f"{where} has no method name or no list of seeds; {_FIX}")
    row = Measurement(
        testbed=cfg.testbed,
        all_wrong=cfg.all_wrong,
        mean_reward=cfg.mean_reward,
        method=method,
        settings=_credit_settings(s, where),
        variant=name,
        needs_references=NEEDS_REFERENCES.get(method, False),
        seeds=len(seeds),
        source=_source(learn),
        model_kind=cfg.model_kind,
        model=cfg.model,
        model_parameters=cfg.model_parameters or None,
        **_figures(s, where),
    )
    return measurement_from_json(row.to_json(), where)  # the path auto reads rows by


def rows_from_learn(cfg: RecordAutoConfig) -> list[Measurement]:
    """The rows of ``cfg.learn``'s chosen variants, each checked as auto reads it; an empty
    result, a non-finite figure or a setting the config refuses is a ``UserError``."""
    learn = Path(cfg.learn)
    if not learn.is_file():
        raise UserError(f"--learn {cfg.learn}: no such file (a learn bench's learn.json)")
    summary = _read_summary(learn)
    wanted = [v for v in cfg.variants.split(",") if v.strip()] or [
        name for name, s in summary.items() if s.get("reference") not in (None, name)
    ]
    unknown = [v for v in wanted if v not in summary]
    if unknown:
        raise UserError(f"--variants {unknown} not in {cfg.learn}; valid: {', '.join(summary)}")
    if not wanted:
        raise UserError(
            f"--learn {cfg.learn}: no variant was measured against a reference (GRPO): nothing "
            f"to record; {_FIX}"
        )
    return [_row(cfg, learn, name, summary[name]) for name in wanted]


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
