"""`StateMismatchError`: saved state that does not fit what restores it."""

from __future__ import annotations


class StateMismatchError(ValueError):
    """A saved state does not fit what restores it (another model, other data); nothing was loaded into it.

    Raised by restores that would otherwise fail with a raw torch error or, worse, silently load
    state that means something else (a data position onto other data). A backup's saver adds its
    folder and the fix to the message.
    """
