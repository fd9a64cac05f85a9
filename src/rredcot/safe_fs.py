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
import json
import os
import stat
from pathlib import Path
from typing import Any

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


# ---------------------------------------------------------------------------------------------
# YAML and JSON documents someone else may have written: bounded, one-line errors


def read_yaml_file(path: str | Path, what: str = "config file", follow: bool = True) -> Any:
    """The parsed content of a YAML file; a missing file, a directory, a FIFO or a device, a file
    over :data:`MAX_CONFIG_BYTES`, bytes that are not UTF-8 or malformed YAML are a ``UserError``
    that names the file and the place (``follow=False``: a link there too, for a run's files)."""
    import yaml  # CLI start-up: YAML is read only with --config (and by runs)

    path = Path(path)
    if not os.path.lexists(path):
        raise UserError(f"{what} {path} does not exist; check the path")
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory; pass a YAML file")
    try:
        data = read_regular(path, what, limit=MAX_CONFIG_BYTES, follow=follow)
        return load_yaml_text(data.decode("utf-8"), f"{what} {path}")
    except UnicodeDecodeError as err:
        raise UserError(
            f"{what} {path} is not UTF-8 text ({err.reason} at byte {err.start})"
        ) from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(
            f"{what} {path} is not valid YAML{where} ({problem}); fix the file"
        ) from err
    except OSError as err:
        raise UserError(f"cannot read {what} {path}: {err.strerror or err}") from err


MAX_CONFIG_BYTES = 16 << 20  # a config or a run's settings file: a few kB in practice
MAX_NESTING = 64  # sections within sections of a YAML or JSON document (a config has 3-4)
MAX_YAML_NODES = 100_000  # values of a YAML document with every alias expanded


def load_yaml_text(text: str, where: str) -> Any:
    """``yaml.safe_load`` of ``text`` within limits: nesting deeper than :data:`MAX_NESTING`
    (which would exhaust the interpreter's stack) and aliases that expand to more than
    :data:`MAX_YAML_NODES` values (the "billion laughs", which would exhaust memory) are a
    one-line ``UserError`` naming ``where``, refused before anything is built."""
    import yaml

    class _Limited(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):  # type: ignore[override]
            self.depth += 1
            if self.depth > MAX_NESTING:
                mark = self.peek_event().start_mark
                raise UserError(
                    f"{where} nests deeper than {MAX_NESTING} levels (at line {mark.line + 1}); "
                    "a config is a few sections deep: fix the file"
                )
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    loader = _Limited(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_expanded_size(node, where)
            return loader.construct_document(node)
        return None
    finally:
        loader.dispose()


def _check_expanded_size(root: Any, where: str) -> None:
    """Count the values of a composed YAML document as a reader that expands every alias sees
    them; refuse past :data:`MAX_YAML_NODES` (counting stops there, so this is quick)."""
    import yaml

    count, stack = 0, [root]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_YAML_NODES:
            raise UserError(
                f"{where} expands to more than {MAX_YAML_NODES} values through its aliases (*name)"
                " (a YAML 'billion laughs'); write the values out, or fix the file"
            )
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack.extend((key, value))


def check_json_depth(text: str | bytes, where: str, limit: int = MAX_NESTING) -> None:
    """Refuse JSON nested deeper than ``limit`` (``json.loads`` would exhaust the stack: a
    ``RecursionError``) with a one-line ``UserError`` naming ``where``. A scan of brackets
    outside strings, linear in the text."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    depth, in_string, escaped = 0, False, False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                raise UserError(f"{where} nests JSON deeper than {limit} levels; fix the file")
        elif byte in (0x5D, 0x7D):
            depth -= 1


def loads_json(text: str | bytes, where: str) -> Any:
    """``json.loads`` of text read from a file someone else may have written (a line of a
    JSONL log): nesting past :data:`MAX_NESTING` and malformed JSON are a one-line
    ``UserError`` naming ``where``."""
    check_json_depth(text, where)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        raise UserError(
            f"{where} is not valid JSON ({str(err).splitlines()[0][:120]}); fix or delete it"
        ) from None


def read_json_file(
    path: str | Path, what: str = "file", follow: bool = True, limit: int | None = None
) -> Any:
    """The parsed content of a JSON file a run directory holds, within limits (size: ``limit``,
    else :data:`MAX_CONFIG_BYTES`; nesting); a missing, unreadable, oversized or malformed file,
    a FIFO or a device (and a link, with ``follow=False``) is a one-line ``UserError`` naming
    it."""
    path = Path(path)
    try:
        data = read_regular(path, what, limit=limit or MAX_CONFIG_BYTES, follow=follow)
    except FileNotFoundError as err:
        raise UserError(f"cannot read {what} {path}: {err.strerror or err}") from None
    check_json_depth(data, f"{what} {path}")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:
        raise UserError(
            f"{what} {path} is not valid JSON ({str(err).splitlines()[0][:120]}); fix or delete it"
        ) from None


def save_figure_atomic(fig: Any, path: str | Path, **savefig: Any) -> Path:
    """``fig.savefig`` (PNG) through a temporary file (:func:`create_file`: a link planted there
    is never followed) and a rename (a reader never sees half a picture); returns ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with os.fdopen(create_file(tmp), "wb") as fh:
            fig.savefig(fh, format="png", **savefig)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)
    return path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` through a temporary file (:func:`create_file`), fsync and a rename (which
    replaces a link at ``path`` itself, never its target)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with os.fdopen(create_file(tmp), "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
