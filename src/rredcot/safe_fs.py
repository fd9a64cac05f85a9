"""Files under a directory the user named: written without following a link, read without
hanging or running out of memory.

A command writes under the one directory its user named (``train --out RUN``, ``bench learn
--out L``). Below it, nothing is written through a symbolic link, whoever planted it:

- :func:`make_dirs` creates folders one component at a time and :func:`check_no_links` checks
  the components of a path; a link at any component below the root is refused in one line. The
  one link a caller may allow (``allow``) is a run's ``checkpoints/`` kept on another disk.
- :func:`create_file` (a new file, ``O_EXCL | O_NOFOLLOW``) and :func:`open_for_append`
  (``O_NOFOLLOW``, a regular file only) open the last component without following it.
- :func:`read_regular` reads a file someone else may have put there: a FIFO or a device (which
  would hang or never end) and a file over a size limit are refused in one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from rredcot.errors import UserError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # not on Windows
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not wait for its other end


def _link_error(path: Path, root: Path) -> UserError:
    return UserError(
        f"{path} is a symbolic link; rredcot does not write through a link below {root}: remove "
        "it (or put the folder or file itself there)"
    )


def _parts(rel: str | Path) -> tuple[str, ...]:
    rel = Path(rel)
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"{rel}: a path below the root is relative, without '..'")
    return rel.parts


def check_no_links(root: str | Path, rel: str | Path, *, allow: tuple[str, ...] = ()) -> Path:
    """``root / rel`` after checking that no component of it below ``root`` is a symbolic link
    (a component that does not exist yet ends the check); ``allow``: paths relative to ``root``
    that may be a link to a folder. A link elsewhere is a one-line ``UserError``."""
    root = Path(root)
    current = root
    for part in _parts(rel):
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except (FileNotFoundError, NotADirectoryError):
            break
        if stat.S_ISLNK(mode):
            if current.relative_to(root).as_posix() in allow and current.is_dir():
                continue
            raise _link_error(current, root)
    return root / rel


def make_dirs(root: str | Path, rel: str | Path, *, allow: tuple[str, ...] = ()) -> Path:
    """Create the folder ``root / rel`` one component at a time (``root`` must exist); a
    symbolic link (other than ``allow``, see :func:`check_no_links`) or a file at a component is
    a one-line ``UserError``. Returns the folder."""
    root = Path(root)
    current = root
    for part in _parts(rel):
        current = current / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(current)
            continue
        mode = os.lstat(current).st_mode
        if stat.S_ISLNK(mode):
            if current.relative_to(root).as_posix() in allow and current.is_dir():
                continue
            raise _link_error(current, root)
        if not stat.S_ISDIR(mode):
            raise UserError(
                f"{current} is a file, not a folder; move it away or pick another --out"
            )
    return current


def create_file(path: str | Path) -> int:
    """A descriptor of a new, empty file at ``path``, opened for writing: whatever is there (a
    link someone planted, a temporary file left by a kill) is removed first, never followed, and
    the file is created exclusively, so nothing outside the directory is ever written."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666)


def open_for_append(path: str | Path) -> int:
    """A descriptor of ``path`` opened to append (created if missing); a link there is refused
    (a ``UserError``), never followed, and so is anything but a regular file (a FIFO)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK, 0o666)
    except OSError as err:
        if err.errno == errno.ENXIO:  # a FIFO nobody reads
            raise _not_regular(Path(path), "file") from None
        if err.errno != errno.ELOOP:
            raise
        raise UserError(
            f"{path} is a symbolic link; rredcot does not write through a link in a run "
            "directory: remove it (or replace it with the file itself)"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_regular(Path(path), "file")
    os.set_blocking(fd, True)
    return fd


def _not_regular(path: Path, what: str) -> UserError:
    return UserError(
        f"{what} {path} is not a regular file (a FIFO, a device or a socket), which rredcot "
        "neither reads nor writes: remove it or pass a file"
    )


def open_regular(path: str | Path, what: str, *, limit: int, follow: bool = False) -> int:
    """A descriptor of the regular file ``path`` opened to read, at most ``limit`` bytes long; a
    FIFO, a device, a link (unless ``follow``) or a larger file is a one-line ``UserError``
    naming ``what`` (a missing file: ``FileNotFoundError``)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | (0 if follow else _NOFOLLOW))
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(
                f"{what} {path} is a symbolic link; rredcot does not read a run's files through "
                "a link: remove it (or put the file itself there)"
            ) from None
        raise UserError(f"cannot read {what} {path}: {err.strerror or err}") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = _not_regular(path, what)
    elif info.st_size > limit:
        problem = _too_large(path, what, limit)
    if problem is not None:
        os.close(fd)
        raise problem
    os.set_blocking(fd, True)
    return fd


def _too_large(path: Path, what: str, limit: int) -> UserError:
    size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
    return UserError(
        f"{what} {path} is over {size}, larger than any such file rredcot writes: pass the right "
        "file (or move this one away)"
    )


def read_regular(path: str | Path, what: str, *, limit: int, follow: bool = False) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`); a file that grows past
    ``limit`` while it is read is refused too."""
    with os.fdopen(open_regular(path, what, limit=limit, follow=follow), "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise _too_large(Path(path), what, limit)
    return data


__all__ = [
    "check_no_links",
    "create_file",
    "make_dirs",
    "open_for_append",
    "open_regular",
    "read_regular",
]
