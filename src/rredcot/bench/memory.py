"""``rredcot bench memory``: peak resident memory of RL steps, per credit method, model and batch.

Each measurement runs in its own process (``python -m rredcot.bench.memory SPEC``): it builds the
run's :class:`~rredcot.training.trainer.Trainer` (model, reference, credit method, optimiser) at the
defaults of ``rredcot train`` with the method named, then runs ``--steps`` full steps
(``Trainer.train_step``: sampling, scoring, credit, update, the method's own update; no
evaluation). It reports its resident memory once built (``setup``), the highest resident memory
during the steps (``step peak``, polled every 10 ms) and the process's own high-water mark
(``getrusage`` ``ru_maxrss``, loading included). Batches: ``prompts_per_step`` times each
``--scales`` factor (16, 32, 64 prompts x 8 samples at the defaults), so that the table shows
whether memory grows with the batch or with the micro-batch (``micro_batch_tokens``). Writes
``memory.json`` and ``memory.md`` under ``--out``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from rredcot.bench.configs import MemoryBenchConfig
from rredcot.bench.report import markdown_table
from rredcot.config import TrainConfig
from rredcot.errors import UserError
from rredcot.methods.auto import check_method_name
from rredcot.models import looks_like_path, shipped_model
from rredcot.safe_fs import write_text_atomic
from rredcot.training.trainer import Trainer

GIB = 1 << 30
MARKER = "MEMORY-RESULT "
PARTIAL = "MEMORY-SO-FAR "  # the peak so far, printed while a step runs (kept when it times out)


def _rss() -> int:
    """This process's resident memory now (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakPoller:
    """The highest resident memory of this process while a block runs, polled in a thread."""

    def __init__(self, every: float = 0.01, report=None, report_every: float = 10.0) -> None:
        self.every, self.peak, self._stop = every, _rss(), threading.Event()
        self.report, self.report_every = report, report_every  # report(peak) now and then
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, _rss())
            if self.report is not None and time.monotonic() - last >= self.report_every:
                self.report(self.peak)
                last = time.monotonic()

    def __enter__(self) -> _PeakPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this process: build the trainer of ``spec``, run its steps."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    cfg = TrainConfig(
        task=spec["task"],
        task_args=dict(spec.get("task_args") or {}),
        credit_method=spec["method"],
        out=spec["out"],
        overwrite=True,
        seed=spec["seed"],
        steps=spec["steps"],
        prompts_per_step=spec["prompts"],
        progress=False,
        threads=spec.get("threads", 0),
        micro_batch_tokens=spec.get("micro_batch_tokens", 0),
    )
    if spec.get("model"):
        cfg.model.name_or_path = spec["model"]
    start = time.perf_counter()
    trainer = Trainer(cfg, log=lambda *_: None)
    setup_seconds = time.perf_counter() - start
    setup_rss = _rss()
    start = time.perf_counter()

    def so_far(peak: int) -> None:  # read back by _run_child if the step runs out of time
        seconds = time.perf_counter() - start
        line = {"setup_rss": setup_rss, "step_peak_rss": peak, "seconds": seconds}
        print(PARTIAL + json.dumps(line), flush=True)

    try:
        with _PeakPoller(report=so_far, report_every=spec.get("report_every", 10.0)) as poller:
            records = []
            for step in range(1, spec["steps"] + 1):
                trainer.step = step
                records.append(trainer.train_step(step))
            step_seconds = (time.perf_counter() - start) / spec["steps"]
    finally:
        trainer.release()
    batch_rows = cfg.prompts_per_step * cfg.sampling.num_generations
    return {
        "setup_rss": setup_rss,
        "step_peak_rss": poller.peak,
        "process_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "setup_seconds": setup_seconds,
        "step_seconds": step_seconds,
        "rows": batch_rows,
        "mean_length": sum(r["rollout/mean_length"] for r in records) / len(records),
        "micro_batch_tokens": trainer.micro_batch_tokens,
        "scoring_pass": records[-1]["forward/scoring_pass"],
    }


def _run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """:func:`measure` in a fresh process; ``{"error": ...}`` where it fails."""
    cmd = [sys.executable, "-m", "rredcot.bench.memory", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as stopped:
        error = {"error": f"timed out after {timeout:.0f} s"}
        out = stopped.stdout or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        partial = [line for line in out.splitlines() if line.startswith(PARTIAL)]
        if partial:  # the step's peak until it was stopped: a lower bound on the whole step's
            last = json.loads(partial[-1][len(PARTIAL) :])
            error["error"] += (
                f" after {last['seconds']:.0f} s of its steps; step peak so far "
                f"{last['step_peak_rss'] / GIB:.2f} GiB"
            )
            error.update(setup_rss=last["setup_rss"], partial_step_peak_rss=last["step_peak_rss"])
        return error
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {proc.returncode}: {tail[:300]}"}


def _cells(cfg: MemoryBenchConfig) -> list[tuple[str, str, int]]:
    """(model, method, scale) of every measurement: per model, every method at scale 1, then
    the larger scales."""
    methods = [m.strip() for m in cfg.methods.split(",") if m.strip()]
    scaled = methods if cfg.scaled_methods == "all" else cfg.scaled_methods.split(",")
    cells = []
    for model in [m.strip() for m in cfg.models.split(",") if m.strip()]:
        for scale in cfg.scale_list():  # every method at the default batch first
            for method in methods:
                if scale == 1 or method in scaled:
                    cells.append((model, method, scale))
    return cells


def check_cells(cfg: MemoryBenchConfig) -> None:
    """Refuse, before any measurement, a method that is not a credit method and a model that
    is a path with nothing there (a run would only write the error into the table)."""
    for method in [m.strip() for m in cfg.methods.split(",") if m.strip()]:
        try:
            check_method_name(method, allow_auto=False)
        except ValueError as err:
            raise UserError(f"--methods {method}: {err}") from None
    for model in [m.strip() for m in cfg.models.split(",") if m.strip()]:
        if model == "tiny" or shipped_model(model) is not None:
            continue
        if looks_like_path(model) and not Path(os.path.expanduser(model)).exists():
            raise UserError(
                f"--models {model}: no such file or directory; give 'tiny', a shipped model "
                "(e.g. smollm2-135m-instruct), a model directory or a hub id"
            )


def run_memory_bench(cfg: MemoryBenchConfig, log=print) -> dict[str, Any]:
    check_cells(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rredcot-memory-") as tmp:
        for i, (model, method, scale) in enumerate(_cells(cfg)):
            real = model != "tiny"
            spec = {
                "model": model if real else None,
                "task": cfg.real_task if real else cfg.tiny_task,
                "task_args": {"data": cfg.real_task_data} if real and cfg.real_task_data else {},
                "method": method,
                "prompts": cfg.prompts_per_step * scale,
                "steps": cfg.steps,
                "seed": cfg.seed,
                "threads": cfg.threads,
                "micro_batch_tokens": cfg.micro_batch_tokens,
                "out": str(Path(tmp) / f"run{i}"),
            }
            result = {
                "model": model,
                "method": method,
                "scale": scale,
                **_run_child(spec, cfg.timeout),
            }
            results.append(result)
            log(_line(result))
            _write(out, cfg, results)
    failed = [r for r in results if "error" in r and not r["error"].startswith("timed out")]
    if failed:  # written to the table, and the command fails (a timeout is a measured bound)
        first = failed[0]
        raise UserError(
            f"bench memory: {len(failed)} of {len(results)} measurements failed (the errors are "
            f"in {out / 'memory.md'}); first: {first['model']} {first['method']}: {first['error']}"
        )
    return {"results": results}


def _line(r: dict[str, Any]) -> str:
    head = f"{r['model']:>24} {r['method']:>24} x{r['scale']}"
    if "error" in r:
        return f"{head}: {r['error']}"
    return (
        f"{head}: setup {r['setup_rss'] / GIB:.2f} GiB, step peak {r['step_peak_rss'] / GIB:.2f} "
        f"GiB, process peak {r['process_peak_rss'] / GIB:.2f} GiB, {r['step_seconds']:.0f} s/step"
    )


def _write(out: Path, cfg: MemoryBenchConfig, results: list[dict[str, Any]]) -> None:
    """memory.json and memory.md: one row per measurement, the step peak's growth over the same
    model and method at scale 1."""
    base = {
        (r["model"], r["method"]): r["step_peak_rss"]
        for r in results
        if r["scale"] == 1 and "error" not in r
    }
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["model"], r["method"], f"x{r['scale']}", "", "", "", "", "", r["error"]])
            continue
        b = base.get((r["model"], r["method"]))
        growth = f"{r['step_peak_rss'] / b:.2f}" if b else ""
        rows.append(
            [
                r["model"],
                r["method"],
                f"x{r['scale']} ({r['rows']} rows)",
                str(r["micro_batch_tokens"]),
                f"{r['setup_rss'] / GIB:.2f}",
                f"{r['step_peak_rss'] / GIB:.2f}",
                f"{r['process_peak_rss'] / GIB:.2f}",
                growth,
                f"{r['step_seconds']:.0f}",
            ]
        )
    header = [
        "model",
        "method",
        "batch",
        "micro_batch_tokens",
        "setup GiB",
        "step peak GiB",
        "process peak GiB",
        "peak / x1",
        "s/step",
    ]
    write_text_atomic(  # a link planted at either file is replaced, never written through
        out / "memory.json", json.dumps({"config": vars(cfg), "results": results}, indent=2) + "\n"
    )
    write_text_atomic(
        out / "memory.md",
        "# Peak resident memory of RL steps (rredcot bench memory)\n\n"
        f"{cfg.steps} step(s) per process, prompts x {cfg.prompts_per_step} per scale, the "
        "defaults of rredcot train otherwise. setup: resident once the trainer is built; step "
        "peak: highest resident memory during the steps; process peak: ru_maxrss (loading "
        "included); peak / x1: step peak over the same method's at the default batch.\n\n"
        + markdown_table(header, rows)
        + "\n",
    )


if __name__ == "__main__":
    print(MARKER + json.dumps(measure(json.loads(sys.argv[1]))), flush=True)
