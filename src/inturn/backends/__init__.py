"""Where the lines live.

Today every line lives in process, inside its :class:`~inturn.KeyedQueue`.
This package is the seam that backends sharing lines across processes plug
into; it holds what every backend has in common, starting with the
:class:`Turn` a holder is given.
"""

from __future__ import annotations

from .._queue import Turn as Turn

__all__ = ("Turn",)
