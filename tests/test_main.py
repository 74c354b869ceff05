"""python -m inturn: the demo."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from inturn.__main__ import main


def test_demo_loses_updates_without_inturn_and_none_with_it() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "inturn", "demo", "--tasks", "300", "--keys", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lost = dict(re.findall(r"(without|with) inturn\s*:.*?(\d+) updates lost", result.stdout))
    assert int(lost["without"]) > 0
    assert int(lost["with"]) == 0
    assert re.search(r"in\s+[\d.]+ ms", result.stdout)


def test_demo_rejects_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--tasks", "0"])
    assert "at least 1" in capsys.readouterr().err


def test_demo_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tasks", "50", "--keys", "1"]) == 0
    assert "0 updates lost" in capsys.readouterr().out
