"""Run-directory I/O that loses nothing: atomic checkpoints and an append-only metrics log that a
resumed run continues without duplicated or truncated lines."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS = "checkpoints"
LATEST = "latest"


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a file so that readers see either the old or the new content, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _clean(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """``metrics.jsonl``: one JSON object per step, flushed and fsynced as it is written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=False)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        records = []
        with open(self.path, encoding="utf-8") as fh:
            for line in fh:
                if not line.endswith("\n"):
                    break  # a line cut by a kill: drop it
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        return records

    def truncate_after(self, step: int) -> None:
        """Keep only complete records with ``step <= step`` (what the checkpoint has seen)."""
        kept = [r for r in self.read() if r.get("step", -1) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: Any,
    tokenizer: Any,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write ``checkpoints/step_N`` through a temporary directory and a rename, then point
    ``checkpoints/latest`` at it. A kill at any moment leaves the previous checkpoint intact."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(run_dir, step)
    tmp = root / f".tmp_step_{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "policy")
    tokenizer.save_pretrained(tmp / "policy")
    atomic_torch_save(state, tmp / "trainer_state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(root / LATEST, final.name)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.exists():
        candidate = root / pointer.read_text().strip()
        if (candidate / "trainer_state.pt").exists():
            return candidate
    steps = sorted(p for p in root.glob("step_*") if (p / "trainer_state.pt").exists())
    return steps[-1] if steps else None


def capture_rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
