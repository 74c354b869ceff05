"""The package itself: its errors' public names, its version."""

from __future__ import annotations

import importlib.metadata
import pickle
import subprocess
import sys
import traceback

import pytest

import inturn

ERRORS = [
    value
    for value in (getattr(inturn, name) for name in inturn.__all__)
    if isinstance(value, type) and issubclass(value, BaseException)
]


def test_every_exported_error_is_checked() -> None:
    assert {error.__name__ for error in ERRORS} >= {
        "InturnError",
        "QueueFull",
        "QueueClosed",
        "BackendUnavailable",
        "LeaseLost",
        "HoldTimeout",
    }


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: error.__name__)
def test_an_exported_error_is_named_by_its_public_path_and_pickles(
    error: type[BaseException],
) -> None:
    """A traceback says ``inturn.QueueFull``, and pickle finds the class there."""
    assert error.__module__ == "inturn"
    assert getattr(inturn, error.__qualname__) is error
    raised = error("inturn: what happened; the fix")
    (line,) = traceback.format_exception_only(type(raised), raised)
    assert line == f"inturn.{error.__name__}: inturn: what happened; the fix\n"
    back = pickle.loads(pickle.dumps(raised))
    assert type(back) is error
    assert back.args == raised.args


def test_importing_inturn_reads_no_package_metadata() -> None:
    """``__version__`` is read when asked for, not at every ``import inturn``.

    (Not "importlib.metadata is not imported": wrapt 2 imports it itself.)
    """
    code = "import inturn; print('__version__' in vars(inturn))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_version_is_the_installed_distribution_s() -> None:
    assert inturn.__version__ == importlib.metadata.version("inturn")
    assert "__version__" in dir(inturn)
    from inturn import __version__

    assert __version__ == inturn.__version__
