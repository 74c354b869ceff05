"""The package itself: its errors' public names, its version, what its sdist ships."""

from __future__ import annotations

import ast
import importlib.metadata
import pickle
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import inturn

ROOT = Path(__file__).resolve().parent.parent
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
    """``__version__`` is read when asked for, not at every ``import inturn``."""
    code = "import inturn; print('__version__' in vars(inturn))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


#: What ``import inturn`` must not import: wrapt (at the first decoration instead), whose
#: import pulls importlib.metadata and, through it, email, zipfile and csv; and
#: typing_extensions (typing has what the running code needs). Together they cost more
#: than the rest of ``import inturn``.
HEAVY = ("wrapt", "importlib.metadata", "email", "zipfile", "csv", "typing_extensions")


def _imported(code: str) -> list[str]:
    """Which of HEAVY a fresh interpreter has imported after running code."""
    check = f"{code}\nimport sys\nprint(*[m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_importing_inturn_imports_none_of_the_heavy_modules() -> None:
    # (Not a timing, which a loaded machine makes noise of: what is imported.)
    assert _imported("import inturn") == []
    assert _imported("import inturn, inturn.backends") == []


def test_the_first_decoration_imports_wrapt() -> None:
    # (else the check above would pass for a decorator that no longer works)
    code = "import inturn\n@inturn.queue_by_key\ndef f(): pass"
    assert "wrapt" in _imported(code)


def test_the_version_is_the_installed_distribution_s() -> None:
    assert inturn.__version__ == importlib.metadata.version("inturn")
    assert "__version__" in dir(inturn)
    from inturn import __version__

    assert __version__ == inturn.__version__


def test_the_sdist_ships_every_package_of_the_tree_that_the_tests_import() -> None:
    """Tests that import ``bench`` (say) fail at collection in an sdist without it."""
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = set(config["tool"]["hatch"]["build"]["targets"]["sdist"]["include"])
    packages = {path.name for path in ROOT.iterdir() if (path / "__init__.py").is_file()}
    imported: set[str] = set()
    for test in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(test.read_text(), str(test))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.partition(".")[0])
            elif isinstance(node, ast.Import):
                imported.update(alias.name.partition(".")[0] for alias in node.names)
    assert sorted((imported & packages) - shipped) == []


def test_the_sdist_ships_every_file_of_the_tree_that_the_tests_read() -> None:
    """A test that reads ``docs/`` (say) fails in an sdist without it.

    Counted: each name of the tree's top level that a test names in a string
    (``ROOT / "docs"``); hatch ships ``pyproject.toml`` itself.
    """
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = config["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    top = {path.name for path in ROOT.iterdir()}
    named: set[str] = set()
    for test in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(test.read_text(), str(test))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named.update({node.value} & top)
    assert {"docs", "README.md", "examples"} <= named  # (else this checks little)
    missing = {
        name
        for name in named - {"pyproject.toml"}
        if not any(entry == name or entry.startswith(f"{name}/") for entry in shipped)
    }
    assert sorted(missing) == []


def test_the_snapshots_of_lines_are_imported_when_first_asked_for() -> None:
    # (only lines() and inspect use them; their dataclasses cost the import most)
    code = (
        "import sys, inturn, inturn.backends as b\n"
        "print('inturn.backends._lines' in sys.modules, 'LineInfo' in dir(b))\n"
        "from inturn.backends import HolderInfo, LineInfo, WaiterInfo\n"
        "from inturn.backends import _lines\n"
        "print((HolderInfo, LineInfo, WaiterInfo) == "
        "(_lines.HolderInfo, _lines.LineInfo, _lines.WaiterInfo))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True"]
