"""Scenario (w), bench/latest.py: a burst on one busy key, with and without pending="latest".

Counts only, never timings: the quick scenario, once, on this tree's inturn
(marker ``bench``: out of the default run, CI runs it once, on the newest
Python); the table's test, on made-up figures, runs with the others.
"""

from __future__ import annotations

import asyncio

import pytest
from bench import latest


@pytest.mark.bench
def test_a_burst_on_a_busy_key_runs_two_works_with_latest_and_every_work_without() -> None:
    sizes = latest.Sizes(quick=True)
    sizes.bursts = 1
    # Every burst checks each caller's answer, and that no key is kept once idle
    # (else bench.scenarios.Verification).
    medians = asyncio.run(latest.measure(sizes, 1, lambda message: None))
    rows = latest.derive(medians, sizes)
    n = latest.BURST
    assert n == 1_000
    for way in latest.WAYS:
        assert rows[latest.runs_label(way)] == {
            "pending=all": n + 1,
            "pending=latest": 2,
            "pending=latest raise": 2,
            "lock+ticket": 2,
        }, way
    superseded = rows[latest.SUPERSEDED]
    assert superseded["pending=all"] == 0
    assert superseded["pending=latest"] == superseded["pending=latest raise"] == n - 1


def test_the_table_shows_counts_as_they_are_and_costs_beside_their_ratio_to_all() -> None:
    sizes = latest.Sizes(quick=True)
    names = [cls.name for cls in latest.ALL]
    medians: dict[str, dict[str, float]] = {}
    for way in latest.WAYS:
        medians[f"runs {way}"] = dict.fromkeys(names, 2.0) | {"pending=all": 1_001.0}
        medians[f"superseded {way}"] = dict.fromkeys(names, 999.0)
        medians[f"us {way}"] = dict.fromkeys(names, 1000.0) | {"pending=all": 10_000.0}
        medians[f"peak {way}"] = dict.fromkeys(names, 500.0)
    for n in (sizes.small, sizes.burst):
        medians[f"held {n}"] = dict.fromkeys(names, 2_000.0) | {"pending=all": 500.0 * n}
        medians[f"idle {n}"] = dict.fromkeys(names, -16.0)
        medians[f"unclaimed {n}"] = dict.fromkeys(names, 0.0)
    rows = latest.derive(medians, sizes)
    assert rows[latest.slope_label(sizes)]["pending=all"] == 500.0
    assert rows[latest.slope_label(sizes)]["pending=latest"] == 0.0
    lines = latest.table(rows, names).splitlines()
    runs = next(line for line in lines if line.startswith(f"| {latest.runs_label(latest.SUBMIT)}"))
    assert runs.endswith("| 1,001 | 2 | 2 | 2 |")
    burst = next(line for line in lines if line.startswith(f"| {latest.time_label(latest.RUN)}"))
    assert burst.endswith("| 10,000 (1.00x) | 1,000 (0.10x) | 1,000 (0.10x) | 1,000 (0.10x) |")
    idle = next(line for line in lines if line.startswith(f"| {latest.IDLE}"))
    assert idle.endswith("| -16 | -16 | -16 | -16 |")
