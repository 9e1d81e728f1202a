"""Profiles of dmover where a peer is faster: one extra run of the
workload's dmover command with `perf record -g` on the client and attached
to the server, summarised from `perf report --stdio` (CPU time per thread
and the hottest functions).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from .system import remove_tree, run, start, stop

if TYPE_CHECKING:
    from .core import Context, Tool

PERF = ["perf", "record", "-F", "999", "-g"]
TOP = 12


def wrap_client(ctx: Context, argv: list[str]) -> list[str]:
    """argv under `perf record` when a profile is being taken."""
    if ctx.perf_dir is None:
        return argv
    return [*PERF, "-o", str(ctx.perf_dir / "client.data"), "--", *argv]


@contextlib.contextmanager
def attach_server(ctx: Context, server_pid: int | None):
    """`perf record -p` on the server while a profile is being taken."""
    if ctx.perf_dir is None or server_pid is None:
        yield
        return
    argv = [*PERF, "-p", str(server_pid), "-o", str(ctx.perf_dir / "server.data")]
    proc = start(ctx.log, argv, ctx.perf_dir / "perf-server.log")
    time.sleep(0.5)       # perf attaches to every thread before the client starts
    try:
        yield
    finally:
        stop(ctx.log, proc, "perf record", grace=60)


def take(ctx: Context, tool: Tool, key: str) -> dict:
    """Run `tool` once under perf; return excerpts of the reports."""
    ctx.perf_dir = ctx.work / "perf" / key
    remove_tree(None, ctx.perf_dir)
    ctx.perf_dir.mkdir(parents=True)
    try:
        tool.measure(ctx, 0)
        parts = {}
        for part in ("client", "server"):
            data = ctx.perf_dir / f"{part}.data"
            if data.exists():
                parts[part] = {"threads": _report(ctx, data, "comm"),
                               "functions": _report(ctx, data, "dso,sym")}
    finally:
        ctx.perf_dir = None
    return {"parts": parts}


def _report(ctx: Context, data, sort: str) -> list[str]:
    res = run(ctx.log, ["perf", "report", "-i", str(data), "--stdio", "--no-children",
                        "--sort", sort, "-g", "none", "--percent-limit", "1"], timeout=600)
    lines = [line.rstrip() for line in res.stdout.splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    return lines[:TOP] or [f"(no samples; perf report: {res.tail(3)})"]
