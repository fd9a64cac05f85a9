"""Run-directory I/O that loses nothing: a run directory owned by one process, atomic checkpoints
with a manifest of sizes and checksums, and an append-only metrics log that a resumed run
continues without duplicated or truncated lines.

- ``RunLock``: an advisory ``flock`` on ``RUN/.lock``; a second writer is refused with the pid
  and host of the first. The kernel drops the lock when its process dies, however it dies.
- ``claim_run_dir``: a directory that holds a run already is refused unless the run is resumed
  or explicitly overwritten.
- ``write_run_config``: ``config.yaml``, rewritten only when the run's config changes.
- ``save_checkpoint`` writes ``checkpoints/step_N`` through a temporary directory, with
  ``manifest.json`` (every file's size and SHA-256) written last, then a rename; every name it
  creates in ``checkpoints/`` (which may link to another disk) is recorded first in
  ``checkpoints.json``, and pruning (and ``--overwrite``) deletes only those;
  ``find_checkpoint`` returns the newest of the run's checkpoints that matches its manifest and
  says why it skipped the newer ones; ``resume_checkpoint`` is the one a resume starts from.
- ``MetricsLog``: ``metrics.jsonl``; ``MetricSink``: the same records to TensorBoard or W&B.

Below the run directory nothing is written through a link (``rredcot.safe_fs``), and a resume
refuses a run file that is a link, a FIFO or a device, or too large to read, before it loads
anything (``check_run_entries``).

What a trainer checkpoint holds (optimiser, schedule, credit method, counters) is
``rredcot.training.checkpoint``'s.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import math
import os
import pickle
import random
import re
import shutil
import socket
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import safe_open

from rredcot.config import TrainConfig
from rredcot.config.io import to_dict
from rredcot.errors import UserError
from rredcot.models import NUMPY_ARRAY_GLOBALS, unsafe_objects
from rredcot.safe_fs import (
    MAX_CONFIG_BYTES,
    check_no_links,
    create_file,
    make_dirs,
    open_for_append,
    read_json_file,
    read_regular,
    read_yaml_file,
)
from rredcot.safe_fs import write_text_atomic as atomic_write_text

try:
    import fcntl
except ImportError:  # not POSIX: no locking
    fcntl = None  # type: ignore[assignment]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
# (metric, title) pairs that plots.plot_run draws against the step when present: the PNGs
# a run directory holds under plots/ (which --overwrite may delete)
CURVES = [
    ("reward_mean", "mean reward of sampled completions"),
    ("eval_accuracy", "held-out greedy accuracy"),
    ("policy_loss", "policy loss"),
    ("entropy", "token entropy"),
    ("grad_norm", "gradient norm"),
    ("kl", "KL to the reference"),
    ("value/loss", "value-head loss"),
    ("credit/handover_reliability", "measured reliability of the values"),
    ("credit/handover_weight", "weight of value-based credit"),
]
PLOTS = "plots"


def plot_file_name(metric: str) -> str:
    """The PNG of ``metric`` under ``plots/`` (``value/loss`` -> ``value_loss.png``)."""
    return f"{metric.replace('/', '_')}.png"


LOCK = ".lock"
MANIFEST = "manifest.json"
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
UNREADABLE_METRICS = "metrics.unreadable.jsonl"
CREDIT_CHOICE = "credit_choice.json"  # what --credit auto chose, and why
# the names the run wrote (or began to write) in checkpoints/, and the checkpoints it completed:
# a save prunes, and --overwrite deletes, only those (checkpoints/ may be a user's folder)
CHECKPOINT_INDEX = "checkpoints.json"
MAX_METRICS_BYTES = 256 << 20  # metrics.jsonl: about 1 kB a step, so 250,000 steps
MAX_MANIFEST_BYTES = 1 << 20  # a checkpoint's manifest.json: a few hundred bytes a file
RUN_FILES = (
    CONFIG,
    METRICS,
    UNREADABLE_METRICS,
    CHECKPOINTS,
    CHECKPOINT_INDEX,
    PLOTS,
    "value_pretrain.json",
    CREDIT_CHOICE,
    "tensorboard",
    "wandb",
)
"""What a run writes into its directory (``--overwrite`` removes these and nothing else)."""
LINKABLE = (CHECKPOINTS,)
"""The one entry of a run directory that may be a link (to a folder on another disk)."""


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` through a temporary file, fsync and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with os.fdopen(create_file(tmp), "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
    except RuntimeError as err:  # torch's writer reports a failed write (a full disk) this way
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"{path}: could not be written ({str(err).splitlines()[0]}); is the disk full? free "
            "space or write elsewhere"
        ) from None
    except OSError as err:  # a write that failed (a full disk): name the file
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, err.strerror or str(err), str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _clean(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """``metrics.jsonl``: one JSON object per step, flushed and fsynced as it is written.

    Readers keep every line that holds a record (a JSON object with an integer ``step``) and
    pass over the others (a line cut by a kill or a full disk, a garbled one); a resume
    (:meth:`continue_after`) sets those aside in ``metrics.unreadable.jsonl`` and says so."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=False)
        with os.fdopen(open_for_append(self.path), "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read(self) -> list[dict[str, Any]]:
        """Every readable record, in file order."""
        return self.read_lines()[0]

    def read_lines(self) -> tuple[list[dict[str, Any]], list[tuple[int, str, str]]]:
        """The readable records and the unreadable lines as ``(line number, text, problem)``
        (blank lines are neither)."""
        numbered, unreadable = self._parse()
        return [record for _, _, record in numbered], unreadable

    def _parse(self) -> tuple[list[tuple[int, str, dict[str, Any]]], list[tuple[int, str, str]]]:
        """``(line number, text, record)`` of every readable record and the unreadable lines; a
        log that is a link, not a regular file or over :data:`MAX_METRICS_BYTES` is a
        one-line ``UserError``."""
        try:
            data = read_regular(self.path, "metrics log", limit=MAX_METRICS_BYTES)
        except FileNotFoundError:
            return [], []
        records, unreadable = [], []
        for number, raw in enumerate(data.splitlines(keepends=True), 1):
            text = raw.decode("utf-8", errors="backslashreplace")
            if not text.strip():
                continue
            try:
                record = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):  # nested past the stack
                cut = not raw.endswith(b"\n")
                unreadable.append((number, text, "cut short" if cut else "not JSON"))
                continue
            if not isinstance(record, dict) or type(record.get("step")) is not int:
                unreadable.append((number, text, "not a record with an integer step"))
                continue
            records.append((number, text, record))
        return records, unreadable

    def continue_after(
        self, step: int, counters: dict[str, int] | None = None, log=print
    ) -> list[int]:
        """Prepare the log for a run that continues after ``step`` (``-1``: from scratch):
        keep the first readable record of each step ``0..step``, move unreadable lines and
        records that cannot be the run's (a negative step, a second record of a step) to
        ``metrics.unreadable.jsonl`` (appended, with their line numbers), and give each
        completed step whose record was lost a ``{"step": k, "metrics_lost": true}`` record
        (with ``counters``, the checkpoint's totals, at ``step``) so that no completed step
        goes missing unremarked. Returns the steps whose metrics were lost."""
        numbered, unreadable = self._parse()
        kept, refused, seen = [], [], set()
        for number, text, record in numbered:
            k = record["step"]
            if k < 0 or k in seen:
                problem = "a negative step" if k < 0 else f"a second record of step {k}"
                refused.append((number, text, problem))
            elif k <= step:
                seen.add(k)
                kept.append(record)
        for lines, said in ((unreadable, "could not read"), (refused, "set aside")):
            if lines:
                self._set_aside(lines)
                where = ", ".join(f"{number} ({problem})" for number, _, problem in lines)
                log(f"{self.path.name}: {said} line(s) {where}; kept in {UNREADABLE_METRICS}")
        lost = sorted(set(range(step + 1)) - seen)
        for k in lost:
            kept.append({"step": k, **(counters or {} if k == step else {}), "metrics_lost": True})
        if lost:
            log(
                f"{self.path.name}: no readable record of completed step(s) "
                f"{', '.join(map(str, lost))}; they stay in the log marked metrics_lost"
            )
        kept.sort(key=lambda r: r["step"])
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        return lost

    def _set_aside(self, lines: list[tuple[int, str, str]]) -> None:
        """Append ``(line number, text, problem)`` entries to ``metrics.unreadable.jsonl``."""
        aside = self.path.with_name(UNREADABLE_METRICS)
        with os.fdopen(open_for_append(aside), "a", encoding="utf-8") as fh:
            for number, text, problem in lines:
                entry = {"line": number, "problem": problem, "text": text.rstrip("\n")}
                fh.write(json.dumps(entry) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


class MetricSink:
    """Optional TensorBoard / Weights & Biases logging (``report_to``) of the records that
    ``MetricsLog`` writes (always); ``none`` logs nothing."""

    def __init__(self, kind: str, run_dir: Path) -> None:
        self.kind = kind
        self.writer = None
        if kind == "tensorboard":
            try:  # optional: tensorboard
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError(
                    "report_to=tensorboard needs tensorboard: pip install tensorboard"
                ) from err
            self.writer = SummaryWriter(str(make_dirs(run_dir, "tensorboard")))
        elif kind == "wandb":
            try:  # optional: wandb
                import wandb
            except ImportError as err:
                raise ImportError("report_to=wandb needs wandb: pip install wandb") from err
            make_dirs(run_dir, "wandb")  # where wandb writes: a link there is refused
            self.writer = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "rredcot"), dir=str(run_dir)
            )

    def log(self, record: dict[str, Any], step: int) -> None:
        if self.writer is None:
            return
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.kind == "tensorboard":
            for k, v in numeric.items():
                self.writer.add_scalar(k, v, step)
        else:
            self.writer.log(numeric, step=step)

    def close(self) -> None:
        if self.writer is not None:
            (self.writer.close if self.kind == "tensorboard" else self.writer.finish)()


# ---------------------------------------------------------------------------------------------
# the run directory: one writer, no silent reuse


class RunLock:
    """Exclusive ownership of a run directory by this process (an advisory ``flock`` on
    ``RUN/.lock``, which also records the owner's pid and host). Released by ``release()`` or,
    whatever happens, when the process exits or is killed."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None
        self.pid = os.getpid()
        if fcntl is None:
            return
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:  # a link planted as .lock is refused, never followed (nor truncated)
            fd = os.open(self.path, flags, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise UserError(
                    f"{self.path} is a symbolic link; a run's lock is never written through a "
                    "link: remove it"
                ) from None
            raise UserError(
                f"cannot write to run directory {Path(run_dir)}: {err.strerror}"
            ) from err
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device planted as .lock
            os.close(fd)
            raise UserError(f"{self.path} is not a regular file; a run's lock is a file: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _lock_owner(fd)
            os.close(fd)
            raise UserError(
                f"run directory {Path(run_dir)} is in use by {owner}; wait for that run to finish "
                "(or stop it), or pick another --out"
            ) from None
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        self.fd, self.pid = fd, os.getpid()

    def release(self) -> None:
        """Give the directory up (idempotent; in a forked child it only closes its copy)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            if self.pid == os.getpid():
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor drops the flock

    def __del__(self) -> None:
        self.release()


def _lock_owner(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on host {info['host']} (since {info['started']})"
    except (ValueError, KeyError, TypeError, OSError):
        return "another process"


def make_run_dir(run_dir: str | Path) -> Path:
    """Create ``run_dir`` (and its parents); a path that exists as a file is a ``UserError``."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--out {run_dir} is a file, not a directory; pick another --out")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:  # a parent is a file
        raise UserError(f"cannot create run directory {run_dir}: a parent is a file") from err
    except PermissionError as err:
        raise UserError(f"cannot create run directory {run_dir}: permission denied") from err
    except OSError as err:  # a read-only file system, a full disk
        raise UserError(f"cannot create run directory {run_dir}: {err.strerror}") from err
    return run_dir


def describe_run(run_dir: str | Path) -> str:
    """A short account of what a run directory holds (for messages)."""
    run_dir = Path(run_dir)
    parts = []
    try:
        steps = [r["step"] for r in MetricsLog(run_dir / METRICS).read()]
    except UserError:  # a link, a FIFO: the message that quotes this names the run only
        steps = []
    if steps:
        parts.append(f"metrics up to step {max(steps)}")
    ckpts = _checkpoint_dirs(run_dir, tolerant=True)
    if ckpts:
        parts.append(f"checkpoints {', '.join(p.name for p in reversed(ckpts))}")
    if (run_dir / CONFIG).exists():
        parts.append(CONFIG)
    return "; ".join(parts) or "run files"


def is_rredcot_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a run that rredcot wrote: a ``config.yaml`` of a training run
    or a checkpoint with ``trainer_state.pt``."""
    run_dir = Path(run_dir)
    data = _run_config(run_dir)
    if isinstance(data, dict) and {"credit_method", "steps", "out"} <= set(data):
        return True
    ckpts = _checkpoint_dirs(run_dir, tolerant=True)
    return any((ckpt / "trainer_state.pt").is_file() for ckpt in ckpts)


def _run_config(run_dir: Path) -> Any:
    """The run's ``config.yaml`` as read (``None`` if it is missing or unreadable, a link)."""
    try:
        return read_yaml_file(run_dir / CONFIG, follow=False)
    except UserError:
        return None


def remove_run_files(run_dir: Path, names: list[str]) -> None:
    """Delete what a run wrote under ``names`` (of ``RUN_FILES``) and nothing else: in
    ``checkpoints/`` only the entries its ``checkpoints.json`` names (:func:`_own_entries`),
    in ``plots/`` only the PNGs rredcot draws. A ``checkpoints`` linked to a folder elsewhere
    (another disk) keeps the link and loses only the run's own checkpoints there. Any other
    link is removed, never followed."""
    for name in names:
        path = run_dir / name
        if name == CHECKPOINTS and path.is_dir():
            for entry in _own_entries(run_dir, tolerant=True):
                _remove(path / entry)
            if not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()
        elif name == PLOTS and path.is_dir() and not path.is_symlink():
            for entry in [plot_file_name(key) for key, _ in CURVES]:
                with contextlib.suppress(FileNotFoundError):
                    _remove(path / entry)
            for entry in path.glob(".*.png.tmp"):
                _remove(entry)
            if not any(path.iterdir()):
                path.rmdir()
        else:
            _remove(path)


def _own_checkpoint_entry(entry: Path) -> bool:
    """Whether ``entry`` of a linked ``checkpoints/`` of a run from before ``checkpoints.json``
    is one rredcot wrote: a ``step_N`` folder (``N`` digits) with its ``trainer_state.pt`` and
    ``manifest.json``, or the ``latest`` file naming one (a ``.tmp_step_N`` may be anyone's)."""
    if entry.is_symlink():
        return False
    if entry.name == LATEST:
        return entry.is_file() and entry.stat().st_size < 64
    if not re.fullmatch(r"step_[0-9]+", entry.name) or not entry.is_dir():
        return False
    return (entry / "trainer_state.pt").is_file() and (entry / MANIFEST).is_file()


def _remove(path: Path) -> None:
    """Remove a file, a link (not its target) or a directory tree (if there)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


_SINKS = ("tensorboard", "wandb")  # folders a run writes only with report_to naming them


def _wrote(run_dir: Path, name: str) -> bool:
    """Whether the run wrote ``name`` of ``RUN_FILES``: a ``tensorboard/`` or ``wandb/`` folder
    only when its ``config.yaml`` reports there (otherwise the folder is the user's)."""
    if name not in _SINKS:
        return True
    data = _run_config(run_dir)
    return isinstance(data, dict) and data.get("report_to") == name


def claim_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool) -> RunLock:
    """Make, lock and check a run directory before anything is written to it.

    A directory that holds a run (any of ``RUN_FILES``; a ``checkpoints/`` linked to another
    disk alone is none) is refused unless the run is being resumed or ``overwrite`` is set, which removes those files (``remove_run_files``: nothing
    else) of a folder that ``is_rredcot_run``, and refuses any other. Returns the lock; the
    caller releases it when the run ends. A resumed run's files are checked first
    (:func:`check_run_entries`)."""
    run_dir = make_run_dir(run_dir)
    lock = RunLock(run_dir)
    try:
        present = [name for name in RUN_FILES if os.path.lexists(run_dir / name)]
        # a checkpoints/ linked to another disk alone is a run's layout set up, not a run
        linked = [n for n in LINKABLE if (run_dir / n).is_symlink() and (run_dir / n).is_dir()]
        if resume:
            check_run_entries(run_dir)
        elif set(present) - set(linked):
            if not overwrite:
                raise UserError(
                    f"--out {run_dir} holds a run already ({describe_run(run_dir)}); continue it "
                    f"with `rredcot train --resume {run_dir}`, replace it with --overwrite, or "
                    "pick another --out"
                )
            if not is_rredcot_run(run_dir):
                raise UserError(
                    f"--out {run_dir} holds {', '.join(present)} but no run that rredcot wrote "
                    "(no config.yaml of a run, no checkpoint); --overwrite deletes only a "
                    "rredcot run's files: pick another --out, or clear that folder yourself"
                )
            remove_run_files(run_dir, [name for name in present if _wrote(run_dir, name)])
    except BaseException:
        lock.release()
        raise
    return lock


# what a resume reads whole: larger files are refused before anything loads
_READ_LIMITS = {
    METRICS: MAX_METRICS_BYTES,
    CONFIG: MAX_CONFIG_BYTES,
    CHECKPOINT_INDEX: MAX_CONFIG_BYTES,
    CREDIT_CHOICE: MAX_CONFIG_BYTES,
}


def check_run_entries(run_dir: Path) -> None:
    """Refuse, in one line, a run directory whose files (``RUN_FILES``) a resume would read or
    write through a symbolic link (``checkpoints/`` may link to a folder: another disk), that
    holds a FIFO or a device where a run writes a file or a folder, or a file a resume reads
    whole that is larger than rredcot writes one."""
    for name in RUN_FILES:
        path = run_dir / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        limit = _READ_LIMITS.get(name)
        if limit is not None and stat.S_ISREG(mode) and os.lstat(path).st_size > limit:
            raise UserError(
                f"{path} is over {limit >> 20} MiB, larger than any {name} rredcot writes: move "
                "it away, or start the run again with --overwrite"
            )
        if stat.S_ISLNK(mode) and not (name in LINKABLE and path.is_dir()):
            raise UserError(
                f"{path} is a symbolic link; a run's files are never read or written through a "
                "link: put the file itself there, or start the run again with --overwrite"
            )
        if not (stat.S_ISLNK(mode) or stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UserError(
                f"{path} is not a regular file or a folder (a FIFO, a device or a socket): "
                "remove it, or start the run again with --overwrite"
            )


def write_run_config(run_dir: str | Path, cfg: TrainConfig) -> None:
    """``config.yaml``, written atomically, and only when it changes (a resume with more
    steps); ``out``/``resume``/``overwrite`` say how a run was started, not what it is."""
    path = Path(run_dir) / CONFIG
    record = to_dict(cfg)
    record.update(resume=None, overwrite=False)
    old = read_regular(path, CONFIG, limit=MAX_CONFIG_BYTES) if os.path.lexists(path) else None
    if cfg.resume and old is not None:
        record["out"] = (read_yaml_file(path, follow=False) or {}).get("out", record["out"])
    text = yaml.safe_dump(record, sort_keys=False)
    if old is None or old != text.encode("utf-8"):
        atomic_write_text(path, text)


# ---------------------------------------------------------------------------------------------
# checkpoints


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def step_of(path: Path | str) -> int:
    """``N`` of a checkpoint ``step_N`` (or ``.tmp_step_N``); ``-1`` for any other name."""
    name = Path(path).name.removeprefix(".tmp_")
    try:
        return int(name.removeprefix("step_"))
    except ValueError:
        return -1


# what a run writes in checkpoints/: names checkpoints.json may hold (no path, no '..')
_OWN_NAME = re.compile(r"(\.tmp_)?step_[0-9]+")


def _read_index(run_dir: Path) -> dict[str, list[str]] | None:
    """``checkpoints.json``: ``{"own": names, "completed": names}``, the entries of
    ``checkpoints/`` the run wrote or began to write and the checkpoints it completed; ``None``
    for a run from before it. One that is not such an index is a one-line ``UserError``."""
    path = run_dir / CHECKPOINT_INDEX
    if not os.path.lexists(path):
        return None
    data = read_json_file(path, "checkpoint index", follow=False)
    lists = [data.get(key) if isinstance(data, dict) else None for key in ("own", "completed")]
    if not all(
        isinstance(names, list)
        and all(isinstance(n, str) and (n == LATEST or _OWN_NAME.fullmatch(n)) for n in names)
        for names in lists
    ):
        raise UserError(
            f"{path} is not a checkpoint index rredcot wrote; delete it to treat the run as one "
            "from before that file, or start the run again with --overwrite"
        )
    return {"own": lists[0], "completed": lists[1]}


def _write_index(run_dir: Path, own: set[str], completed: set[str]) -> None:
    index = {"own": sorted(own, key=str), "completed": sorted(completed, key=str)}
    atomic_write_text(run_dir / CHECKPOINT_INDEX, json.dumps(index, indent=1) + "\n")


def start_checkpoint_index(run_dir: str | Path, *, fresh: bool) -> None:
    """``checkpoints.json`` for a run that starts from step 0, kept if there: empty for a
    ``fresh`` run, else (a resumed run from before the file) naming what the run wrote."""
    run_dir = Path(run_dir)
    if _read_index(run_dir) is None:
        _write_index(run_dir, set() if fresh else set(_own_entries(run_dir)), set())


def _own_entries(run_dir: Path, tolerant: bool = False) -> list[str]:
    """The names in ``checkpoints/`` that the run wrote (``checkpoints.json``); for a run from
    before that file, those rredcot writes: in a linked folder, only ``step_N`` folders with a
    ``trainer_state.pt`` (:func:`_own_checkpoint_entry`). ``tolerant``: a malformed index
    counts as none (for ``--overwrite``)."""
    try:
        index = _read_index(run_dir)
    except UserError:
        if not tolerant:
            raise
        index = None
    if index is not None:
        return index["own"]
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    own = [e for e in root.iterdir() if e.name == LATEST or _OWN_NAME.fullmatch(e.name)]
    if root.is_symlink():
        own = [e for e in own if _own_checkpoint_entry(e)]
    return sorted(e.name for e in own)


def _checkpoint_dirs(run_dir: str | Path, tolerant: bool = False) -> list[Path]:
    """The run's own ``checkpoints/step_N`` (folders, or links planted in their place), oldest
    first (``tolerant``: see :func:`_own_entries`)."""
    root = Path(run_dir) / CHECKPOINTS
    names = [n for n in _own_entries(Path(run_dir), tolerant) if n.startswith("step_")]
    dirs = [root / n for n in names if (root / n).is_dir() or (root / n).is_symlink()]
    return sorted(dirs, key=step_of)


def check_checkpoint_names(run_dir: str | Path, steps: list[int], *, fresh: bool = False) -> None:
    """Refuse, before a run trains, a ``checkpoints/step_N`` it would save at one of ``steps``
    that is there already and not the run's own (a folder of the user's in a linked
    ``checkpoints/``; a ``fresh`` run owns none yet): a save never replaces what the run did
    not write (a link there it does)."""
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return
    own, planned = set() if fresh else set(_own_entries(run_dir)), set(steps)
    for entry in root.iterdir():
        if entry.name in own or not _OWN_NAME.fullmatch(entry.name) or entry.is_symlink():
            continue
        if step_of(entry) in planned and entry.name.removeprefix(".tmp_") == (
            checkpoint_dir(run_dir, step_of(entry)).name
        ):
            raise UserError(
                f"{entry} is there already and this run did not write it; move it away (or "
                f"link {CHECKPOINTS}/ to a folder of the run's own), then run the command again"
            )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(ckpt: Path, step: int) -> None:
    """``manifest.json``: the size and SHA-256 of every file of the checkpoint (written last)."""
    files = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = path.relative_to(ckpt).as_posix()
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    atomic_write_text(ckpt / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: Any,
    tokenizer: Any,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write ``checkpoints/step_N`` through a temporary directory and a rename (its manifest
    last), then point ``checkpoints/latest`` at it. A kill at any moment leaves the previous
    checkpoint intact. Keeps the newest ``keep`` checkpoints and drops any newer than ``step``
    (left by a timeline that a resume from an older checkpoint abandoned): only the run's own,
    which ``checkpoints.json`` names (each name is recorded there before it is created), and no
    folder below the run is a link (``checkpoints/`` itself may be: another disk)."""
    run_dir = Path(run_dir)
    root = make_dirs(run_dir, CHECKPOINTS, allow=LINKABLE)
    index = _read_index(run_dir)
    if index is None:  # a run from before checkpoints.json: what it wrote, by name
        legacy = _own_entries(run_dir)
        index = {"own": legacy, "completed": [n for n in legacy if n.startswith("step_")]}
    own, completed = set(index["own"]), set(index["completed"])
    for name in sorted(n for n in own if n.startswith(".tmp_")):  # a save killed half-way
        with contextlib.suppress(OSError):
            _remove(root / name)
            own.discard(name)
    final = checkpoint_dir(run_dir, step)
    tmp = root / f".tmp_{final.name}"
    check_checkpoint_names(run_dir, [step])
    own |= {tmp.name, final.name}
    if not os.path.lexists(root / LATEST) or (root / LATEST).is_symlink():
        own.add(LATEST)  # a user's own file called latest in a linked folder stays
    _write_index(run_dir, own, completed)
    _remove(tmp)  # a link planted there: removed, never followed
    tmp.mkdir()
    try:  # a failed write (a full disk) leaves no half checkpoint behind
        _write_checkpoint_files(tmp, final, step, model, tokenizer, state)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove(final)  # an earlier one of the run's, or a link planted there
    os.replace(tmp, final)
    own.discard(tmp.name)
    completed.add(final.name)
    if LATEST in own:
        atomic_write_text(root / LATEST, final.name)
    steps = sorted((n for n in own if n.startswith("step_") and n != final.name), key=step_of)
    older = [n for n in steps if step_of(n) < step]
    newer = [n for n in steps if step_of(n) > step]
    for name in newer + (older[: max(len(older) - (keep - 1), 0)] if keep > 0 else []):
        with contextlib.suppress(OSError):
            _remove(root / name)
            own.discard(name)
            completed.discard(name)
    _write_index(run_dir, own, completed)
    return final


def _write_checkpoint_files(
    tmp: Path, final: Path, step: int, model: Any, tokenizer: Any, state: dict[str, Any]
) -> None:
    """The policy, ``trainer_state.pt`` and (last) ``manifest.json`` of a checkpoint, in the
    fresh folder ``tmp`` that becomes ``final``."""
    try:
        model.save_pretrained(tmp / "policy")
        tokenizer.save_pretrained(tmp / "policy")
    except Exception as err:
        raise _write_failed(err, final / "policy") from None
    atomic_torch_save(state, tmp / "trainer_state.pt")
    write_manifest(tmp, step)


def _write_failed(err: Exception, where: Path) -> Exception:
    """A failed write of a checkpoint's policy as one line: safetensors reports a full disk or
    a file-size limit as ``SafetensorError`` (its own type), transformers as ``OSError``;
    anything else is a bug and keeps its traceback."""
    text = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
    if isinstance(err, OSError) or type(err).__name__ == "SafetensorError":
        return UserError(
            f"{where}: could not be written ({text}); the run's last checkpoint is kept. Free "
            "space (or raise the file-size limit), then resume with `rredcot train --resume`"
        )
    return err


def verify_checkpoint(ckpt: str | Path) -> str | None:
    """Why checkpoint ``ckpt`` cannot be resumed from (``None`` if it can): a file missing, cut
    or changed against ``manifest.json``; without a manifest (older checkpoints), a file that
    does not load."""
    ckpt = Path(ckpt)
    if ckpt.is_symlink():
        return "it is a symbolic link, not a checkpoint the run wrote"
    manifest = ckpt / MANIFEST
    if not os.path.lexists(manifest):
        return _verify_by_loading(ckpt)
    info = os.lstat(manifest)
    if not stat.S_ISREG(info.st_mode):
        return f"{MANIFEST} is not a regular file (a link, a FIFO or a device)"
    if info.st_size > MAX_MANIFEST_BYTES:
        return f"{MANIFEST} has {info.st_size} bytes, more than any manifest rredcot writes"
    try:
        files = read_json_file(manifest, MANIFEST, follow=False, limit=MAX_MANIFEST_BYTES)["files"]
        entries = [(rel, int(info["size"]), str(info["sha256"])) for rel, info in files.items()]
    except (UserError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is unreadable"
    if "trainer_state.pt" not in files:
        return "trainer_state.pt is not in the manifest"
    for rel, size, sha in entries:
        try:
            path = check_no_links(ckpt, rel)
        except (UserError, ValueError):  # a link, or a path outside the checkpoint
            return f"{rel} is a link or outside the checkpoint"
        if not path.is_file():
            return f"{rel} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{rel} has {actual} bytes, its manifest says {size} (truncated or replaced)"
        if _sha256(path) != sha:
            return f"{rel} does not match its checksum (corrupted)"
    return None


def _verify_by_loading(ckpt: Path) -> str | None:
    state = ckpt / "trainer_state.pt"
    if not state.is_file():
        return "trainer_state.pt is missing"
    try:
        load_trainer_state(state)
    except UserError as err:
        return f"trainer_state.pt is refused: {err}"
    except Exception as err:  # noqa: BLE001 - any failure to load means "not resumable"
        return f"trainer_state.pt does not load ({type(err).__name__})"
    weights = sorted((ckpt / "policy").glob("*.safetensors"))
    if not weights and not list((ckpt / "policy").glob("*.bin")):
        return "policy/ holds no model weights"

    for path in weights:
        try:
            with safe_open(str(path), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 - not a dict
                    fh.get_tensor(key)
        except Exception as err:  # noqa: BLE001
            return f"policy/{path.name} does not load ({type(err).__name__})"
    return None


def find_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint of a run that verifies (``verify_checkpoint``), and the newer ones
    it skipped, each with the reason."""
    skipped = []
    for ckpt in reversed(_checkpoint_dirs(run_dir)):
        reason = verify_checkpoint(ckpt)
        if reason is None:
            return ckpt, skipped
        skipped.append((ckpt, reason))
    return None, skipped


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest valid checkpoint of a run (``find_checkpoint``), or ``None``."""
    return find_checkpoint(run_dir)[0]


def resume_checkpoint(run_dir: str | Path, *, log=print, main: bool = True) -> Path | None:
    """The newest valid checkpoint to resume ``run_dir`` from, saying (on the main process)
    which newer ones were skipped and why; ``None`` for a run that recorded no step yet. A
    resume that would restart over recorded steps is a ``UserError``."""
    run_dir = Path(run_dir)
    ckpt, skipped = find_checkpoint(run_dir)
    for path, reason in skipped if main else []:
        log(f"skipping checkpoint {path.name}: {reason}")
    if ckpt is not None:
        if skipped and main:
            log(f"resuming from the older checkpoint {ckpt.name} instead")
        return ckpt
    index = _read_index(run_dir)
    if index is not None and not index["completed"] and not skipped:
        if main:  # stopped before (or while) writing its first checkpoint: nothing to lose
            log(
                f"{run_dir}: the run completed no checkpoint (it was stopped before or during its "
                "first); it starts again from step 0 with its own config"
            )
        return None
    recorded = [r["step"] for r in MetricsLog(run_dir / METRICS).read() if r.get("step", 0) > 0]
    if recorded or skipped:
        why = "; ".join(f"{p.name}: {r}" for p, r in skipped) or "none found"
        raise UserError(
            f"--resume {run_dir}: no valid checkpoint left ({why}) but {METRICS} records steps "
            f"up to {max(recorded, default=0)}; resuming would restart over that history. Start "
            "the run again with --overwrite, or pick another --out"
        )
    if main:
        log(f"{run_dir}: no checkpoint and no step recorded yet: from step 0")
    return None


def capture_rng_state() -> dict[str, Any]:
    """The Python, NumPy, torch (and CUDA) RNG states as tensors and plain numbers, so that
    ``trainer_state.pt`` loads with ``torch.load(weights_only=True)``."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` captured (or the tuples older checkpoints hold)."""
    python, numpy_state = state["python"], state["numpy"]
    if isinstance(python, dict):
        python = (python["version"], tuple(python["internal"].tolist()), python["gauss_next"])
    if isinstance(numpy_state, dict):
        numpy_state = (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# reading trainer_state.pt: plain data only, never code


# What ``trainer_state.pt`` of checkpoints written before the plain-data format holds beyond
# tensors and plain types: the NumPy RNG state, a ``uint32`` array (``_reconstruct`` under both
# module names, as NumPy 1 and 2 pickle it). Its elements go through the same restricted
# unpickler, so allowing arrays allows no other object.
def load_plain(path: str | Path) -> Any:
    """A torch file as tensors and plain data (``weights_only=True``); a file that would build
    anything else (a pickle that runs code), a cut one or one that is no torch file is a
    one-line ``UserError`` naming it."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UserError(
            f"{path} holds objects other than tensors and plain data ({unsafe_objects(path, err)}"
            "); rredcot does not load it, since loading it could run code"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        raise UserError(
            f"{path} cannot be read ({str(err).splitlines()[0][:200]}): cut short or not a "
            "file torch wrote; use a complete copy"
        ) from None


RESUME_FIX = (
    "resume from an earlier checkpoint (delete this one) or start the run again with --overwrite"
)


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """``trainer_state.pt`` as tensors and plain data, through ``torch.load(weights_only=True)``,
    which builds nothing else: a file that would create any other object (a pickle that runs
    code) is a ``UserError`` and nothing in it runs. Checkpoints from before the plain-data
    format (a NumPy array in the RNG state) load with NumPy arrays allowed and nothing more."""
    path = Path(path)
    try:
        # torch < 2.5 has no safe_globals: checkpoints of the old format are refused there
        allow = getattr(torch.serialization, "safe_globals", None)
        with allow(NUMPY_ARRAY_GLOBALS) if allow else contextlib.nullcontext():
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UserError(
            f"{path} holds objects other than tensors and plain data "
            f"({unsafe_objects(path, err)}); rredcot does not "
            "load it, since loading it could run code. Use a checkpoint written by `rredcot "
            "train`, or re-save one from a source you trust as plain data"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:  # cut, empty, not torch's
        kind = type(err).__name__
        raise UserError(
            f"{path} cannot be read ({kind}: cut short, empty or not a file torch wrote); "
            f"{RESUME_FIX}"
        ) from None
    if not isinstance(state, dict):
        raise UserError(f"{path} holds a {type(state).__name__}, not a trainer state (a dict)")
    return state
