"""The exception for mistakes a user can make (a bad flag, file or run directory).

``rredcot``'s command line prints a ``UserError`` as one line, ``rredcot: error: MESSAGE``, and
exits with status 2; anything else that escapes is a bug in rredcot and keeps its traceback. The
message names the problem and the fix.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; the message says what it is and how."""


__all__ = ["UserError"]
