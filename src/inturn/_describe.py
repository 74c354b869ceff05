"""How a message shows a user's value: a safe, bounded repr, and a function's name."""

from __future__ import annotations

from typing import Final

#: An int of at most this many bits is named in decimal: 603 digits at most,
#: under any limit ``sys.set_int_max_str_digits()`` can set (640 at least),
#: so every process names it alike. A larger one is named in hexadecimal,
#: which has no such limit.
DECIMAL_BITS: Final = 2000
#: The most characters a value takes in a message (see :func:`describe`).
SHOWN: Final = 200


def describe(value: object, limit: int = SHOWN) -> str:
    """Write value for a message as repr() does, but never fail and never flood.

    A message about a key must not raise in its place (from a timer callback,
    it would leave a waiter waiting forever). A value whose repr() raises is
    written ``<module.Type object at 0x...>`` (a tuple's items each so); a
    long int in hexadecimal, its leading digits only (``str()`` refuses
    beyond ``sys.get_int_max_str_digits()``); anything longer than limit is
    cut short, with an ellipsis. For people only: two values may look alike.
    """
    try:
        shown = _shown(value, limit)
    except Exception:  # even its type's name failed
        shown = f"<object at {id(value):#x}>"
    return cut(shown, limit)


def cut(text: str, limit: int = SHOWN) -> str:
    """text, cut short to limit characters with an ellipsis (a message must not flood)."""
    return text if len(text) <= limit else text[: limit - 1] + "\N{HORIZONTAL ELLIPSIS}"


def _shown(value: object, limit: int) -> str:
    """describe() before the cut: may be longer than limit."""
    kind = type(value)
    if isinstance(value, int) and kind.__repr__ is int.__repr__:
        bits = value.bit_length()
        if bits > min(4 * limit, DECIMAL_BITS):  # (a smaller one str() always converts)
            digits = (bits + 3) // 4  # in hexadecimal
            leading = abs(value) >> 4 * max(0, digits - limit)
            return f"{'-' if value < 0 else ''}0x{leading:x}\N{HORIZONTAL ELLIPSIS}"
    try:
        return repr(value)
    except Exception:
        pass
    if kind is tuple:
        parts = []
        length = 0
        for item in value:  # type: ignore[attr-defined]  # a tuple
            parts.append(describe(item, limit))
            length += len(parts[-1]) + 2
            if length > limit:
                break
        return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"
    return f"<{kind.__module__}.{kind.__qualname__} object at {id(value):#x}>"


def function_name(function: object) -> str:
    """How a message names a function: its qualified name and ``()``, else describe() of it.

    Never fails and never floods, as :func:`describe`: a name is cut at :data:`SHOWN` characters.
    """
    try:
        name = getattr(function, "__qualname__", None)
    except Exception:
        name = None
    if not isinstance(name, str):
        return describe(function)
    return cut(f"{name}()")
