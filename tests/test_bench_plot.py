"""The across-process picture (bench/mp_plot.py), drawn from a made-up run's JSON.

No benchmark runs here: the figures are made up, as a ``--json`` run writes them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from bench import mp_plot, multiproc


def _figures(ops: float, order: float, wait: float) -> dict[str, float]:
    """A contender's medians, as a run writes them (the picture reads three)."""
    made_up = {"handoff_p50_us": 150.0, "handoff_p99_us": 400.0, "fairness": 0.9}
    made_up |= {"lost_updates": 0.0, "cpu_us_per_op": 90.0}
    return {"ops_per_s": ops, "arrival_order_pct": order, "longest_wait_ms": wait, **made_up}


#: What bench.multiproc --json writes, less what the picture does not read.
RESULT: dict[str, Any] = {
    "machine": "CPython 3.11.7 on x86_64 (2 cores), Linux",
    "settings": {"workers": 8, "seconds": 2.0, "repeats": 3},
    "medians": {
        "f1": {
            "portalocker": _figures(107_245, 0.4, 44.0),
            "inturn-file": _figures(6_015, 95.9, 4.5),
            "filelock": _figures(13_289, 0.2, 254.0),
        },
        "f2": {"inturn-file": _figures(5_000, 90.0, 3.0)},  # (not drawn)
        "r1": {
            "inturn-redis": _figures(4_294, 96.3, 5.0),
            "redis-py-lock": _figures(5_376, 0.2, 705),
        },
    },
}


def test_each_backend_is_a_row_of_its_measured_contenders_inturn_first() -> None:
    assert [(title, [name for name, _ in bars]) for title, bars in mp_plot.rows(RESULT)] == [
        ("Files", ["inturn FileBackend", "filelock (polls)", "portalocker (flock)"]),
        ("Redis", ["inturn RedisBackend", "redis-py Lock (polls)"]),
    ]  # (no PostgreSQL row: not measured)
    (_, bars), _ = mp_plot.rows(RESULT)
    assert bars[0][1]["arrival_order_pct"] == 95.9


def test_a_result_with_none_of_the_scenarios_is_refused() -> None:
    with pytest.raises(ValueError, match="none of the scenarios f1, r1, p1"):
        mp_plot.plot({**RESULT, "medians": {"f2": RESULT["medians"]["f2"]}}, Path("never.png"))


def _size(png: Path) -> tuple[int, int]:
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # (IHDR, the first chunk)
    return width, height


def test_the_picture_is_drawn_again_from_a_runs_json(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run, picture = tmp_path / "run.json", tmp_path / "across.png"
    run.write_text(json.dumps({**RESULT, "targets": [], "unavailable": {}}))
    assert multiproc.main(["--from-json", str(run), "--plot", str(picture)]) == 0
    width, height = _size(picture)
    assert width == 1150  # 11.5 in at 100 dpi: legible at the docs' width
    assert 400 < height < width


def test_the_machines_load_during_the_run_is_told_where_the_system_tells_it() -> None:
    told = mp_plot.loaded({"load": [3.5, 12.04]})
    assert told == ", load average 3.5 at the start and 12.0 at the end"
    assert mp_plot.loaded({}) == ""  # (a run from before it was recorded)
    assert mp_plot.loaded({"load": [None, None]}) == ""
