"""Targets: bounds on the benchmark's numbers, each printed as PASS, MISS, SKIP or INFO.

A target passes only on a value that was measured and can be what it
claims: a value that is missing, NaN or infinite, or negative where the
quantity cannot be (a cost, a count, a ratio of costs), is a MISS, never a
PASS. A cost above a floor is a difference of two noisy timings and can come
out negative; a ratio of two such costs can then meet any bound, so
:func:`ratio` refuses anything but two positive costs.

SKIP is only for a target whose contenders this run did not measure (such as
the ``--before`` revision's, without ``--before``); INFO only for a number
reported, not targeted, on this interpreter (and only when it is valid).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PASS, MISS, SKIP, INFO = "PASS", "MISS", "SKIP", "INFO"

#: A run's numbers: row label -> contender name -> value.
Rows = Mapping[str, Mapping[str, float]]


def valid(value: float | None, *, signed: bool = False) -> bool:
    """Whether value is a measured, finite number, and not negative unless signed."""
    return value is not None and math.isfinite(value) and (signed or value >= 0)


def check(value: float | None, limit: float, *, at_most: bool = True, signed: bool = False) -> bool:
    """Whether value meets limit (value <= limit, or >= with ``at_most=False``).

    False for a value that is not :func:`valid`, whatever the limit: a
    comparison with NaN or with a negative cost must not read as met.
    """
    if value is None or not valid(value, signed=signed):
        return False
    return value <= limit if at_most else value >= limit


def ratio(numerator: float | None, denominator: float | None) -> float:
    """numerator / denominator, or NaN unless both are finite and positive.

    Two negative costs (both below their floor, by noise) would otherwise
    divide to a positive ratio that looks measured.
    """
    if numerator is None or denominator is None:
        return math.nan
    if not (valid(numerator) and valid(denominator)) or numerator <= 0 or denominator <= 0:
        return math.nan
    return numerator / denominator


def cell(rows: Rows, label: str, name: str) -> float | None:
    """rows[label][name], or None if the run has no such number."""
    return rows.get(label, {}).get(name)


@dataclass(frozen=True)
class Target:
    """One target line: a value computed from a run's rows, and the bound it must meet."""

    label: str
    #: The contenders whose numbers it reads; if one was not measured in this run: SKIP.
    needs: tuple[str, ...]
    #: Its value, from the rows (None or NaN: not measured, a MISS).
    value: Callable[[Rows], float | None]
    limit: float
    #: True: the value must be at most the limit; False: at least.
    at_most: bool = True
    #: Whether a negative value is a valid measure (memory that shrank); else it is a MISS.
    signed: bool = False
    form: str = "{:.2f}"
    #: The first interpreter on which it is a target; before it, a valid value is INFO.
    since: tuple[int, int] | None = None


def at_most(
    row: str, name: str, limit: float, baseline: str, *, label: str = "", **options: Any
) -> Target:
    """name's row figure at most limit times baseline's (both positive, or a MISS)."""
    return Target(
        label or f"{row[:3]} {name} <= {limit:g}x {baseline}",
        (name, baseline),
        lambda rows: ratio(cell(rows, row, name), cell(rows, row, baseline)),
        limit,
        **options,
    )


def evaluate(
    target: Target,
    rows: Rows,
    measured: Sequence[str],
    version: tuple[int, int] = (sys.version_info.major, sys.version_info.minor),
) -> tuple[str, str, str]:
    """(verdict, label, value as text) of target on rows, where measured names the contenders."""
    label = target.label
    if target.since is not None:
        label += f" (a target on CPython {target.since[0]}.{target.since[1]}+)"
    if any(name not in measured for name in target.needs):
        return SKIP, label, "not measured in this run"
    try:
        value = target.value(rows)
    except (KeyError, ZeroDivisionError):
        value = None
    if value is None or not valid(value, signed=target.signed):
        return MISS, label, _unmet(target, value)
    text = target.form.format(value)
    if target.since is not None and version < target.since:
        return INFO, label, text
    if not check(value, target.limit, at_most=target.at_most, signed=target.signed):
        return MISS, label, text
    return PASS, label, text


def _unmet(target: Target, value: float | None) -> str:
    """Why value is not a measure."""
    if value is None:
        return "not measured"
    if math.isnan(value):
        return "no valid value (a figure it divides was missing, zero or negative)"
    return f"{target.form.format(value)}, not a valid measure"
