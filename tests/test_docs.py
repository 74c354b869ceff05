"""The documentation's sources: every snippet include resolves, and none is mangled.

The site (``mkdocs build --strict``) includes code from the tree with
pymdownx.snippets: a line ``--8<-- "examples/x.py:section"``. ``ruff format``
(0.16 and newer) formats Python blocks in Markdown too, and an include line
parses as Python: it was rewritten with spaces around ``<`` and the site
showed it as text (issue 31). These tests catch that without building the site.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: What the site is built from: its pages, and the README and changelog they take.
SOURCES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md", ROOT / "CHANGELOG.md"]
#: An include line as pymdownx.snippets reads it (its base_path is the tree's root).
INCLUDE = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>[^"]+))?"$')
#: The marker in any spacing, starting a line: an include, or what a formatter left of one.
MARKER = re.compile(r"^-+\s*8\s*<\s*-+")
FENCE = re.compile(r"^(`{3,}|~{3,})")


def _includes() -> list[tuple[Path, int, str]]:
    """Each line of the sources that starts with the marker: (file, line number, line)."""
    return [
        (source, number, line.strip())
        for source in SOURCES
        for number, line in enumerate(source.read_text().splitlines(), 1)
        if MARKER.match(line.strip())
    ]


def _opening_fences(lines: list[str]) -> list[int | None]:
    """For each line, the index of the fence line that opens its block, or None."""
    opening: list[int | None] = []
    start: int | None = None
    fence = ""  # the open block's fence characters
    for i, line in enumerate(lines):
        match = FENCE.match(line.strip())
        if start is not None:
            opening.append(start)
            if match and line.strip() == match.group(1) and match.group(1).startswith(fence):
                start = None
        elif match:
            start, fence = i, match.group(1)
            opening.append(start)
        else:
            opening.append(None)
    return opening


def _id(value: object) -> str:
    return f"{value.parent.name}/{value.name}" if isinstance(value, Path) else str(value)


INCLUDES = pytest.mark.parametrize(("source", "number", "line"), _includes(), ids=_id)


def test_the_prometheus_recipe_is_an_include() -> None:
    # else the tests below may check nothing
    assert any(source.name == "operations.md" for source, _, _ in _includes())


@INCLUDES
def test_an_include_is_written_as_pymdownx_snippets_reads_it(
    source: Path, number: int, line: str
) -> None:
    assert INCLUDE.match(line), (
        f"{source.name}:{number}: {line!r} is not an include: "
        'write --8<-- "path" or --8<-- "path:section"'
    )


@INCLUDES
def test_an_include_names_a_file_and_a_section_it_has(source: Path, number: int, line: str) -> None:
    match = INCLUDE.match(line)
    if match is None:
        pytest.skip("not an include (the test above fails)")
    path = ROOT / match["path"]
    assert path.is_file(), f"{source.name}:{number}: no file {match['path']}"
    section = match["section"]
    if section is None or re.fullmatch(r"[0-9:,-]+", section):  # the whole file, or lines
        return
    lines = [ln.rstrip() for ln in path.read_text().splitlines()]
    for end in ("start", "end"):
        marker = f"--8<-- [{end}:{section}]"
        found = sum(ln.endswith(marker) for ln in lines)
        assert found == 1, f"{source.name}:{number}: {match['path']} has {found} {marker}"


@INCLUDES
def test_ruff_format_leaves_an_include_alone(source: Path, number: int, line: str) -> None:
    # ruff format skips a block between <!-- fmt:off --> and <!-- fmt:on -->
    lines = source.read_text().splitlines()
    start = _opening_fences(lines)[number - 1]
    if start is None:
        return  # outside any fenced block: ruff formats none of it
    before = [ln.strip() for ln in lines[:start] if ln.strip()]
    after = [ln.strip() for ln in lines[number:] if ln.strip()]
    closing = next(i for i, ln in enumerate(after) if FENCE.fullmatch(ln))
    fix = "put <!-- fmt:off --> before its block and <!-- fmt:on --> after it"
    assert before[-1:] == ["<!-- fmt:off -->"], f"{source.name}:{number}: {fix}"
    assert after[closing + 1 : closing + 2] == ["<!-- fmt:on -->"], f"{source.name}:{number}: {fix}"


#: The longest code a table header may hold (a few names): the site keeps a
#: header's code on one line (docs/stylesheets/extra.css), so a longer one, a
#: signature, widens its table past the page.
LONGEST_HEADER_CODE = 32


def test_table_headers_hold_no_long_code() -> None:
    long = []
    for source in SOURCES:
        lines = source.read_text().splitlines()
        opening = _opening_fences(lines)
        for i, line in enumerate(lines[:-1]):
            separator = re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip())
            if opening[i] is None and line.lstrip().startswith("|") and separator:
                long += [
                    f"{source.name}:{i + 1}: `{code}`"
                    for code in re.findall(r"`([^`]+)`", line)
                    if len(code) > LONGEST_HEADER_CODE
                ]
    assert not long, "put it in a row of the table instead:\n" + "\n".join(long)


def _python_block_after(page: Path, heading: str) -> str:
    """The first ```python block of page after the line heading."""
    text = page.read_text().split(f"\n{heading}\n", 1)[1]
    return text.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_the_migration_pages_fencing_program_runs_as_pasted(tmp_path: Path) -> None:
    # (a complete program: the page says what it prints, and that is checked here)
    heading = "## Fencing a store's writes with `turn.token`"
    program = _python_block_after(ROOT / "docs" / "migrating.md", heading)
    assert _run(program, tmp_path) == ["left: 5", "a write with the stale token 1 was refused"]


def _run(program: str, tmp_path: Path) -> list[str]:
    """What program prints, run as a script of its own."""
    script = tmp_path / "program.py"
    script.write_text(program)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_readmes_first_example_runs_as_pasted_and_loses_updates_without_inturn(
    tmp_path: Path,
) -> None:
    example = _python_block_after(ROOT / "README.md", "## A first example")
    assert _run(example, tmp_path) == ["5"]
    decorator = '@queue_by_key(key="stock-{product_id}")\n'
    assert decorator in example
    assert _run(example.replace(decorator, ""), tmp_path) == ["9"]  # what the text says
