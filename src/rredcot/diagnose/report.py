"""What ``rredcot diagnose`` writes: :class:`DiagnoseReport` (``diagnose.json``), its terminal
and markdown summary (``diagnose.md``) and its picture (``diagnose.png``, :func:`plot_report`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rredcot.diagnose.figures import KINDS
from rredcot.safe_fs import read_json_file, save_figure_atomic, write_text_atomic

# ---------------------------------------------------------------------------------------------
# the report


@dataclass
class DiagnoseReport:
    """What :func:`diagnose` measured: settings, figures, verdict. ``to_json()`` is the whole of
    it (``diagnose.json``); ``summary()`` the terminal text; ``write(out_dir)`` the files."""

    settings: dict[str, Any]
    groups: dict[str, Any]
    gradient: dict[str, Any]
    trace: dict[str, Any]
    monte_carlo: dict[str, Any] | None
    estimators: list[dict[str, Any]] | None
    verdict: str
    reasons: list[str]
    headline: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, path: str | Path) -> DiagnoseReport:
        """A report read back from its ``diagnose.json`` (to redraw or compare it)."""
        return cls(**read_json_file(path, "diagnose report"))

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> str:
        return summary_text(self)

    def write(self, out_dir: str | Path) -> list[Path]:
        """Write ``diagnose.json``, ``diagnose.md`` and ``diagnose.png`` into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "diagnose.json", out / "diagnose.md"]
        _write_atomic(paths[0], self.to_json() + "\n")
        _write_atomic(paths[1], self.summary())
        picture = plot_report(self, out / "diagnose.png")
        return paths + ([picture] if picture else [])


def _write_atomic(path: Path, text: str) -> None:
    """The run directory's writer: a link planted at the temporary or the file is replaced,
    never written through."""
    write_text_atomic(path, text)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(float(x)) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, torch.Tensor):
        return _jsonable(x.tolist())
    return x


def _fmt(x: Any, spec: str = ".1%") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, spec)


def _ci(entry: dict[str, Any], spec: str = ".1%") -> str:
    return f"{_fmt(entry['value'], spec)} [{_fmt(entry['lo'], spec)}, {_fmt(entry['hi'], spec)}]"


def summary_text(report: DiagnoseReport) -> str:
    """The report in plain text (Markdown): verdict first, then each figure with its interval."""
    lines = [
        *_summary_head(report),
        *_groups_table(report.groups),
        *_gradient_tables(report.gradient, report.trace),
        *_trace_summary(report.settings, report.trace),
        *_monte_carlo_summary(report.monte_carlo),
        *_estimators_table(report.estimators),
        "",
        "Figures defined in docs/diagnose.md; the numbers are in diagnose.json.",
    ]
    return "\n".join(lines) + "\n"


def _summary_head(report: DiagnoseReport) -> list[str]:
    """The verdict, its reasons and what was sampled."""
    s = report.settings
    return [
        f"# rredcot diagnose: {report.verdict}",
        "",
        *[f"{r}" for r in report.reasons],
        "",
        f"Policy `{s['policy']}`, task `{s['task']}` {s.get('task_params') or ''}, "
        f"{s['prompts']} prompts x {s['samples']} samples at temperature {s['temperature']:g} "
        f"(top-p {s['top_p']:g}, {s['max_new_tokens']} new tokens), segmenter `{s['segmenter']}`;"
        f" mean reward {_fmt(s['mean_reward'], '.3f')}; {s['seconds']:.0f} s.",
    ]


def _groups_table(groups: dict[str, Any]) -> list[str]:
    """Section 1: the shares of agreeing groups at every group size."""
    lines = [
        "",
        "## 1. Where GRPO is blind: groups whose rewards all agree",
        "",
        "| G | agree | all wrong | all right | interval |",
        "|---|---|---|---|---|",
    ]
    for row in groups["by_group_size"]:

        def cell(name: str, row=row) -> str:
            lo, hi = row[f"{name}_ci"]
            return f"{_fmt(row[name])} [{_fmt(lo)}, {_fmt(hi)}]"

        lines.append(
            f"| {row['group_size']} | {cell('agree')} | {cell('all_wrong')} | "
            f"{cell('all_right')} | {row['interval']} |"
        )
    return lines


def _gradient_tables(g: dict[str, Any], tr: dict[str, Any]) -> list[str]:
    """Section 2: where the gradient mass lands by segment kind, relative position (with the
    entropy there) and segment position."""
    lines = [
        "",
        "## 2. Where GRPO's update lands (traces of groups whose rewards differ)",
        "",
        f"Logit-gradient mass |A|(1 - p) per token; {g['wrong_traces']} wrong traces "
        f"({g['labelled_wrong_traces']} with a step label), {g['right_traces']} right traces.",
        "",
        "| kind | share of tokens | share of gradient mass | of wrong traces: tokens | of wrong "
        "traces: gradient | mean 1 - p | uncertain tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in KINDS:
        k = g["kinds"][name]
        w = g["wrong_kinds"].get(name)
        lines.append(
            f"| {name} | {_ci(k['tokens'])} | {_ci(k['mass'])} | "
            + (f"{_ci(w['tokens'])} | {_ci(w['mass'])}" if w else "— | —")
            + f" | {_fmt(k['mean_1_minus_p'], '.4f')} | {_fmt(k['uncertain_share'])} |"
        )
    lines += [
        "",
        "Along the trace (relative position, all traces of mixed groups):",
        "",
        "| position | share of tokens | share of gradient mass | mean entropy (nats) |",
        "|---|---|---|---|",
    ]
    for b in g["positions"]:
        lines.append(
            f"| {b['label']} | {_fmt(b['tokens'])} | {_ci(b['mass'])} | "
            f"{_fmt(tr['entropy_by_position'][b['index']]['value'], '.3f')} |"
        )
    lines += [
        "",
        "By segment position (1 = first segment; the last row pools the later ones):",
        "",
        "| segment | share of tokens | share of gradient mass |",
        "|---|---|---|",
    ]
    used = [b for b in g["segments"] if b["tokens"] and b["tokens"] > 0]
    for b in used or g["segments"]:
        lines.append(f"| {b['label']} | {_fmt(b['tokens'])} | {_ci(b['mass'])} |")
    return lines


def _trace_summary(s: dict[str, Any], tr: dict[str, Any]) -> list[str]:
    """The uncertain decisions, entropy and length of a trace."""
    u = tr["uncertain_per_trace"]
    return [
        "",
        f"Uncertain decisions (sampled tokens with p < {s['uncertain_p']:g}) per trace: "
        f"{_ci(u, '.2f')}; traces with none: {_fmt(tr['traces_without_uncertain'])}; mean "
        f"entropy per token {_fmt(tr['mean_entropy'], '.3f')} nats; tokens per trace "
        f"{_fmt(tr['tokens_per_trace'], '.1f')}.",
    ]


def _monte_carlo_summary(mc: dict[str, Any] | None) -> list[str]:
    """Section 3: what step-level values would change, or that it was not measured."""
    lines = ["", "## 3. What better credit could change (Monte Carlo)", ""]
    if not mc:
        return lines + ["Not measured (--mc-traces 0)."]
    return lines + [
        f"{mc['traces']} traces ({mc['wrong_traces']} wrong), K = {mc['k']} continuations "
        f"per boundary, {mc['continuations']} continuations, "
        f"{mc['generated_tokens']:.0f} generated tokens, {mc['seconds']:.0f} s.",
        "",
        f"- share of the per-token advantage's mean square that step-level values remove: "
        f"{_ci(mc['variance_removed'])}; of the logit gradient's (weighted by (1 - p)^2): "
        f"{_ci(mc['gradient_variance_removed'])}",
        f"- still-right prefix of wrong traces ({mc['prefix_definition']}): "
        f"{_ci(mc['prefix_tokens'])} of their tokens; GRPO's blame there "
        f"{_ci(mc['grpo_prefix_blame'])}; step-level credit's blame there "
        f"{_ci(mc['step_prefix_blame'])}",
    ]


def _estimators_table(estimators: list[dict[str, Any]] | None) -> list[str]:
    """Section 4 (only where estimators were scored): each against the Monte Carlo values."""
    if not estimators:
        return []
    lines = [
        "",
        "## 4. Cheap estimators against the Monte Carlo values",
        "",
        "| estimator | ρ pooled | ρ per trace | sign agr. | value MSE | error_acc | "
        "correct_acc | F1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in estimators:
        lines.append(
            f"| {e['method']} | {_fmt(e.get('spearman_pooled'), '.3f')} | "
            f"{_fmt(e.get('spearman_trace_mean'), '.3f')} | "
            f"{_fmt(e.get('sign_agreement'), '.3f')} | {_fmt(e.get('value_mse'), '.4f')} | "
            f"{_fmt(e.get('error_acc'), '.3f')} | {_fmt(e.get('correct_acc'), '.3f')} | "
            f"{_fmt(e.get('f1'), '.3f')} |"
        )
    return lines


def plot_report(report: DiagnoseReport, path: str | Path) -> Path | None:
    """``diagnose.png``: GRPO's gradient mass along the trace stacked by segment kind, token
    share against gradient share per kind (with intervals), and entropy and 1 - p along the
    trace."""
    import matplotlib  # only when a picture is drawn (the Agg backend)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g, tr = report.gradient, report.trace
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    labels = [b["label"] for b in g["positions"]]
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    by_kind = g["mass_by_position_and_kind"]
    colors = plt.get_cmap("tab10")
    for i, name in enumerate(KINDS):
        heights = np.array([by_kind[name][j] for j in range(len(labels))], dtype=float)
        heights = np.nan_to_num(heights)
        if heights.sum() <= 0:
            continue
        ax.bar(x, heights, bottom=bottom, label=name, color=colors(i))
        bottom += heights
    tokens = np.array([b["tokens"] for b in g["positions"]], dtype=float)
    ax.plot(x, tokens, "k--", marker="o", markersize=3, label="share of tokens")
    top = np.nanmax(np.concatenate([bottom, tokens, [0.0]]))
    ax.set_ylim(0, 1.6 * top if top > 0 else 1.0)  # room for the legend above the bars
    ax.set_xticks(x, labels, rotation=45, fontsize=7)
    ax.set_xlabel("relative position along the trace")
    ax.set_title("GRPO gradient mass |A|(1-p) along the trace")
    ax.legend(fontsize=6, ncol=3, loc="upper center")

    ax = axes[1]
    kinds = [k for k in KINDS if (g["kinds"][k]["tokens"]["value"] or 0) > 0]
    xk = np.arange(len(kinds))
    for off, key, name in ((-0.2, "tokens", "share of tokens"), (0.2, "mass", "share of gradient")):
        vals = np.array([g["kinds"][k][key]["value"] for k in kinds], dtype=float)
        lo = np.array([g["kinds"][k][key]["lo"] for k in kinds], dtype=float)
        hi = np.array([g["kinds"][k][key]["hi"] for k in kinds], dtype=float)
        err = np.nan_to_num(np.vstack([vals - lo, hi - vals]))
        ax.bar(xk + off, vals, width=0.4, yerr=err, capsize=2, label=name)
    ax.set_xticks(xk, kinds, rotation=30, fontsize=7, ha="right")
    ax.set_title("per segment kind (traces of mixed groups)")
    ax.legend(fontsize=7, loc="upper right")

    ax = axes[2]
    ent = [tr["entropy_by_position"][j]["value"] for j in range(len(labels))]
    unc = [tr["one_minus_p_by_position"][j]["value"] for j in range(len(labels))]
    ax.plot(x, ent, marker="o", markersize=3, label="entropy (nats)")
    ax.plot(x, unc, marker="s", markersize=3, label="mean 1 - p(y_t)")
    ax.set_xticks(x, labels, rotation=45, fontsize=7)
    ax.set_title("the policy's uncertainty along the trace")
    ax.legend(fontsize=7)
    fig.suptitle(f"rredcot diagnose: {report.verdict}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    try:
        save_figure_atomic(fig, path, dpi=100)  # a link planted there: not followed
    finally:
        plt.close(fig)
    return path
