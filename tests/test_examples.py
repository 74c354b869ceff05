"""Every example runs as its users would run it, and checks its own claims."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
#: Examples that need a server, each run against the session's by a test module of its own.
NEEDS_A_SERVER = {"redis_stream_consumer": "test_redis_stream_example.py"}


def test_there_are_examples() -> None:
    assert {p.stem for p in EXAMPLES} >= {
        "inventory",
        "log_append",
        "chat",
        "batch",
        "partitioned_batch",
        *NEEDS_A_SERVER,
    }
    for module in NEEDS_A_SERVER.values():
        assert (Path(__file__).parent / module).is_file()


@pytest.mark.parametrize(
    "example", [p for p in EXAMPLES if p.stem not in NEEDS_A_SERVER], ids=lambda p: p.stem
)
def test_example_runs(example: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "Traceback" not in result.stderr
