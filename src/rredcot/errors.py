"""The exceptions for mistakes a user can make (a bad flag, file or run directory, a missing extra).

``rredcot``'s command line prints a ``UserError`` (and an ``ImportError``, such as
``MissingExtra``) as one line, ``rredcot: error: MESSAGE``, and exits with status 2; anything else
that escapes is a bug in rredcot and keeps its traceback. The message names the problem and the
fix.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class UserError(Exception):
    """A problem the user can fix; the message says what it is and how."""


class MissingExtra(ImportError):
    """An optional package is not installed; the message names the extra that brings it."""


def missing_extra_message(package: str, extra: str, purpose: str, then: str = "") -> str:
    """One line: what needs ``package`` and the ``pip install 'rredcot[extra]'`` that brings it
    (``then``: a further step, such as verl's ``--no-deps`` install)."""
    line = f"{purpose} needs the {package} package: pip install 'rredcot[{extra}]'"
    return f"{line} {then}" if then else line


def require_extra(module: str, extra: str, purpose: str, then: str = "") -> ModuleType:
    """Import ``module`` (dotted names allowed), or raise :class:`MissingExtra` with one line that
    names the extra to install; the import's own error is chained."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        message = missing_extra_message(package, extra, purpose, then)
        missing = isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == package
        if not missing:  # installed but broken (a wrong version, a missing dependency of its own)
            message += (
                f" (importing {module} failed: {str(err).splitlines()[0] if str(err) else err!r})"
            )
        raise MissingExtra(message) from err


__all__ = ["MissingExtra", "UserError", "missing_extra_message", "require_extra"]
