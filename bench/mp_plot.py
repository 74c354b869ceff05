"""The across-process picture: each backend beside the locks users pick instead.

    python -m bench.multiproc --scenarios f1,r1,p1 --json run.json --plot out.png
    python -m bench.multiproc --from-json run.json --plot out.png   # drawn again

From a ``bench.multiproc`` result (what ``--json`` writes), one row of
panels per backend (its scenario of every worker on one key, nothing outside
the lock) and one column per figure a user compares: ops/s (higher is
better), the share of grants that went to the worker that had waited
longest (arrival order: higher is better), and the longest any op waited
(lower is better, on a log scale: the locks that poll keep a worker waiting
a hundred times longer than a line does). inturn's bars are drawn in the
site's indigo, the others in grey, each with its value written beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: The rows: scenario, backend's title, and the contenders in the order drawn (inturn
#: first); a contender the result lacks is left out, a scenario with none is too.
ROWS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("f1", "Files", ("inturn-file", "filelock", "portalocker")),
    ("r1", "Redis", ("inturn-redis", "redis-py-lock", "python-redis-lock", "pottery")),
    ("p1", "PostgreSQL", ("inturn-postgres", "pg-advisory-lock")),
)
#: How each contender is named in the picture: what a user knows it as.
NAMES: Mapping[str, str] = {
    "inturn-file": "inturn FileBackend",
    "filelock": "filelock (polls)",
    "portalocker": "portalocker (flock)",
    "inturn-redis": "inturn RedisBackend",
    "redis-py-lock": "redis-py Lock (polls)",
    "python-redis-lock": "python-redis-lock",
    "pottery": "pottery Redlock",
    "inturn-postgres": "inturn PostgresBackend",
    "pg-advisory-lock": "pg_advisory_lock loop",
}
#: The columns: metric, title, and how a value is written beside its bar.
COLUMNS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("ops_per_s", "ops/s\nhigher is better", "{:,.0f}".format),
    ("arrival_order_pct", "arrival order, %\nhigher is better", "{:.1f}%".format),
    ("longest_wait_ms", "longest wait, ms\nlower is better", lambda ms: f"{ms:,.{ms < 10:d}f}"),
)
INTURN, OTHER = "#3f51b5", "#9e9e9e"  # the site's indigo, and a grey
#: The longest waits' axis, the same for every backend (ms, log scale): from a line's
#: few milliseconds to a polling lock's second.
WAITS = (1.0, 5000.0)


def rows(result: Mapping[str, Any]) -> list[tuple[str, list[tuple[str, dict[str, float]]]]]:
    """The rows to draw: (title, [(contender's name, its medians), ...]), measured ones only."""
    medians = result["medians"]
    drawn = []
    for scenario, title, contenders in ROWS:
        measured = medians.get(scenario, {})
        bars = [(NAMES[name], measured[name]) for name in contenders if name in measured]
        if bars:
            drawn.append((title, bars))
    return drawn


def loaded(result: Mapping[str, Any]) -> str:
    """How loaded the machine was during result's run, for a title ("" if not told)."""
    load = result.get("load") or []
    if len(load) != 2 or None in load:
        return ""
    return f", load average {load[0]:.1f} at the start and {load[1]:.1f} at the end"


def plot(result: Mapping[str, Any], path: Path) -> None:
    """Draw result's across-process picture into path (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

    drawn = rows(result)
    if not drawn:
        raise ValueError(
            "bench.mp_plot: the result has none of the scenarios "
            f"{', '.join(scenario for scenario, _, _ in ROWS)}: measure them first"
        )
    settings = result["settings"]
    heights = [len(bars) for _, bars in drawn]
    fig, axes = plt.subplots(
        len(drawn),
        len(COLUMNS),
        figsize=(11.5, 1.2 + 0.66 * sum(heights) + 0.55 * len(drawn)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    plt.rcParams.update({"font.size": 12})
    for row, (title, bars) in enumerate(drawn):
        labels = [name for name, _ in bars]
        colors = [INTURN if name.startswith("inturn") else OTHER for name in labels]
        for column, (metric, heading, form) in enumerate(COLUMNS):
            ax = axes[row][column]
            values = [figures[metric] for _, figures in bars]
            positions = range(len(bars))
            ax.barh(positions, values, color=colors, height=0.7)
            ax.invert_yaxis()  # inturn on top
            ax.set_yticks(list(positions))
            ax.set_yticklabels(labels if column == 0 else [""] * len(labels), fontsize=14)
            if metric == "longest_wait_ms":
                ax.set_xscale("log")
                ax.set_xlim(*WAITS)
                ax.xaxis.set_major_locator(FixedLocator([1, 10, 100, 1000]))
                ax.xaxis.set_minor_locator(NullLocator())
                ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
            elif metric == "arrival_order_pct":
                ax.set_xlim(0, 135)
                ax.set_xticks([0, 25, 50, 75, 100])
            else:
                ax.set_xlim(0, max(values) * 1.5)
                ax.xaxis.set_major_locator(MaxNLocator(4))
                ax.xaxis.set_major_formatter(FuncFormatter(_thousands))
            for position, value in zip(positions, values, strict=True):
                ax.text(
                    value,
                    position,
                    f" {form(value)}",
                    va="center",
                    fontsize=14,
                    fontweight="bold" if colors[position] == INTURN else "normal",
                )
            ax.tick_params(axis="x", labelsize=12)
            ax.grid(axis="x", color="#e0e0e0", linewidth=0.8)
            ax.set_axisbelow(True)
            for side in ("top", "right"):
                ax.spines[side].set_visible(False)
            if row == 0:
                ax.set_title(heading, fontsize=14, pad=10)
        axes[row][0].set_ylabel(title, fontsize=14, fontweight="bold", labelpad=12)
    fig.suptitle(
        f"{settings['workers']} processes taking one key again and again "
        f"({settings['seconds']:g} s runs, median of {settings['repeats']})\n"
        f"{result['machine']}{loaded(result)}",
        fontsize=12.5,
        y=0.995,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _thousands(value: float, _: object) -> str:
    """An ops/s tick: 25k, 2.5k, 500."""
    return f"{value / 1000:g}k" if value >= 1000 else f"{value:g}"
