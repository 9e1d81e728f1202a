"""PNG plots with matplotlib: the DMOVER paper's aggregate and per-stream
bandwidth against the number of streams (from the streams-* workloads), and
the throughput over time on each emulated WAN link (from the wan-*
workloads' 100 ms samples of the receiving interface).
"""

from __future__ import annotations

import re
from pathlib import Path

from .core import BASELINE, WorkloadResult


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def render(results: list[WorkloadResult], out_dir: Path) -> list[tuple[str, str]]:
    """Write the plots into out_dir; return (title, path relative to out_dir's parent)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("streams.png"), *out_dir.glob("wan-*.png")]:
        old.unlink()
    plots = []
    sweeps = [r for r in results if r.key.startswith("streams-") and r.figures]
    if sweeps:
        path = out_dir / "streams.png"
        _streams(sweeps, path)
        plots.append(("Aggregate and per-stream bandwidth against the number of streams", path))
    for res in results:
        if res.key.startswith("wan-") and any(_timeline(f) for f in res.figures.values()):
            path = out_dir / f"{res.key}.png"
            _wan(res, path)
            plots.append((f"Throughput over time: {res.title}", path))
    return [(title, str(path.relative_to(out_dir.parent))) for title, path in plots]


def _streams(sweeps: list[WorkloadResult], path: Path) -> None:
    plt = _pyplot()
    fig, (agg, per) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, res in zip(colors, sweeps):
        data = res.key.removeprefix("streams-")
        series: dict[str, list[tuple[int, object]]] = {}
        for tool in res.figures:
            match = re.fullmatch(r"(.*?) (?:--streams|-cc) (\d+)", tool)
            stat = res.stat(tool, "mb_per_s")
            if match and stat:
                series.setdefault(match.group(1), []).append((int(match.group(2)), stat))
        for name, points in series.items():
            points.sort()
            n = [p[0] for p in points]
            style = {"dmover": "-o", BASELINE: ":^"}.get(name, "--s")
            for ax, div in ((agg, [1] * len(n)), (per, n)):
                med = [p[1].median / d for p, d in zip(points, div)]
                err = [[(p[1].median - p[1].lo) / d for p, d in zip(points, div)],
                       [(p[1].hi - p[1].median) / d for p, d in zip(points, div)]]
                ax.errorbar(n, med, yerr=err, fmt=style, color=color, capsize=3,
                            label=f"{name}, {data}")
    for ax, title in ((agg, "a) aggregate bandwidth"), (per, "b) per-stream bandwidth")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
        ax.set_xlabel("streams (dmover --streams N; globus-url-copy -cc N)")
        ax.set_ylabel("MB/s (10^6 B/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    agg.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _timeline(figs: list[dict]) -> list:
    """The samples of the first run that has any."""
    return next((f["timeline"] for f in figs if f.get("timeline")), [])


def _wan(res: WorkloadResult, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for tool, figs in res.figures.items():
        samples = _timeline(figs)
        if samples:
            ax.plot([s[0] for s in samples], [s[1] for s in samples], label=tool, lw=1.2)
    ax.set_xlabel("seconds since the command started (first run)")
    ax.set_ylabel("Mbit/s received (IP bytes, 100 ms samples)")
    ax.set_title(res.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
