"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from inturn import KeyedQueue

from helpers import Recorder


@pytest.fixture
def queue() -> KeyedQueue:
    return KeyedQueue()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()
