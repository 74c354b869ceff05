"""Looking at a file backend's directory from the side, as another process of its user would."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from inturn._order import portable_name


def spec(directory: Path) -> str:
    """The worker's (tests/support/worker.py) name of a file backend on directory."""
    return f"file:{directory}"


def files(directory: Path) -> list[str]:
    """Every file in directory, by name."""
    return sorted(os.listdir(directory))


def line_file(directory: Path, key: str | bytes | int) -> Path:
    """Where key's line file is in directory."""
    return directory / f"{hashlib.sha256(portable_name(key)).hexdigest()}.line"
