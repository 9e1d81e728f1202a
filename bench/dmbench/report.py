"""RESULTS.md (tables, verdicts, command lines) and results.json (raw figures)."""

from __future__ import annotations

import json
from dataclasses import asdict

from .core import Row, WorkloadResult


def fmt(x: float | None) -> str:
    if x is None:
        return "–"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def fmt_ratio(ratio: float | None) -> str:
    return f"{ratio * 100:.0f} %" if ratio else "–"


def fmt_spread(stat) -> str:
    return f"{fmt(stat.lo)} – {fmt(stat.hi)}" if stat else "–"


def verdict_text(row: Row, ev: dict) -> str:
    if row.target is None:
        return "–"
    if ev["verdict"] is None:
        return "n/a (no figures)"
    return "**PASS**" if ev["verdict"] else "**FAIL**"


# --------------------------------------------------------------------------
# markdown
# --------------------------------------------------------------------------

def render_markdown(meta: dict, results: list[WorkloadResult]) -> str:
    out = [_header(meta), _summary(results)]
    numbered = [r for r in results if r.rows]
    for i, res in enumerate(numbered, 1):
        out.append(_section(i, res, meta["runs"]))
    return "\n".join(out).rstrip() + "\n"


def _header(meta: dict) -> str:
    v = meta["versions"]
    mode = ("**quick** (smoke test: sizes scaled down, verdicts only indicative)"
            if meta["quick"] else "full")
    lines = [
        "# dmover benchmark results",
        "",
        "Reproduce with `bench/run` from the repository root (as root; it installs what it "
        "needs with apt-get). `bench/run --quick` runs the same steps on much less data.",
        "",
        f"- **date**: {meta['date']}",
        f"- **mode**: {mode}; {meta['runs']} runs per measurement",
        f"- **machine**: {meta['nproc']} CPUs ({meta['cpu']}), {meta['memory_gib']} GiB memory, "
        f"kernel {meta['kernel']}",
        f"- **dmover commit**: {meta['dmover_commit']} (`{v['dmover']}`)",
        f"- **load average at start**: {meta['loadavg_at_start']} — the machine may be shared "
        "with other jobs, so absolute figures are noisy",
        f"- **TCP congestion control**: {meta['tcp_congestion_control']}",
        f"- **page cache**: {meta['page_cache']}",
        f"- **peers**: {v['iperf3']}; {v['rsync']}; {v['rclone']}; {v['cp']}; {v['fio']}",
        f"- **scratch directory** (data sets, destinations): `{meta['scratch']}`",
        "",
        "Each figure is the median of the runs, with the min – max spread. A ratio is "
        "dmover's median / the peer's median. Raw per-run figures: `bench/"
        f"{meta['json_name']}`.",
    ]
    if meta.get("setup_commands"):
        lines += ["", "Set-up for all dmover measurements:", "", "```sh",
                  *meta["setup_commands"], "```"]
    return "\n".join(lines) + "\n"


def _summary(results: list[WorkloadResult]) -> str:
    lines = ["## Summary", "",
             "| # | measurement | dmover | peer | dmover / peer | target | result |",
             "|---|---|---|---|---|---|---|"]
    numbered = [r for r in results if r.rows]
    for i, res in enumerate(numbered, 1):
        if res.skipped:
            lines.append(f"| {i} | {res.title} | – | – | – | – | skipped: {res.skipped} |")
            continue
        for row in res.rows:
            if row.target is None:
                continue
            ev = res.evaluate(row)
            own = fmt(ev["own"].median) if ev["own"] else "–"
            peer = f"{row.peer}: {fmt(ev['peer'].median)}" if ev["peer"] else "–"
            lines.append(f"| {i} | {res.title}: {row.measure} | {own} | {peer} | "
                         f"{fmt_ratio(ev['ratio'])} | {row.target.text} | {verdict_text(row, ev)} |")
    failed = [r for r in results if r.errors]
    if failed:
        lines += ["", "Steps that failed: " + ", ".join(f"{r.title} ({len(r.errors)})"
                                                        for r in failed)
                  + ". Details under each section."]
    return "\n".join(lines) + "\n"


def _section(i: int, res: WorkloadResult, runs: int) -> str:
    lines = [f"## {i}. {res.title}", ""]
    if res.description:
        lines += [res.description, ""]
    if res.skipped:
        lines += [f"Skipped: {res.skipped}.", ""]
        return "\n".join(lines)
    lines += ["| measure | tool | median | min – max | peer | peer median | peer min – max "
              "| dmover / peer | target | result |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in res.rows:
        ev = res.evaluate(row)
        own, peer = ev["own"], ev["peer"]
        n = len(own.values) if own else 0
        ratio = fmt_ratio(ev["ratio"])
        lines.append(
            f"| {row.measure} | {row.tool} ({n} runs) | {fmt(own.median if own else None)} "
            f"| {fmt_spread(own)} | {row.peer or '–'} | {fmt(peer.median if peer else None)} "
            f"| {fmt_spread(peer)} | {ratio} | {row.target.text if row.target else '–'} "
            f"| {verdict_text(row, ev)} |")
    per_run = "; the other runs repeat run 1 with the tools in rotated order"
    if any("dst-1" in c for c in res.commands.lines("run 1")):
        per_run += " and their own run number in `dst-N`"
    lines += ["", f"Commands (set-up, run 1 of {runs}, teardown{per_run}):", "", "```sh"]
    for phase, title in (("setup", "set-up"), ("run 1", "each run"), ("teardown", "teardown")):
        cmds = res.commands.lines(phase)
        if cmds:
            lines.append(f"# {title}")
            lines += cmds
    lines += ["```", ""]
    if res.errors:
        lines += ["Errors:", ""]
        for err in res.errors:
            lines += ["```", err.strip(), "```"]
        lines.append("")
    if res.notes:
        lines += ["Notes:", ""]
        for note in res.notes:
            first, *rest = note.strip().splitlines()
            lines.append(f"- {first}")
            if rest:
                lines += ["", "  ```", *[f"  {r}" for r in rest], "  ```"]
        lines.append("")
    lines.append(f"({res.seconds:.0f} s for this section)")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# json
# --------------------------------------------------------------------------

def to_json(meta: dict, results: list[WorkloadResult]) -> str:
    doc = {"meta": meta, "workloads": []}
    for res in results:
        rows = []
        for row in res.rows:
            ev = res.evaluate(row)
            rows.append({
                "measure": row.measure, "tool": row.tool, "key": row.key, "peer": row.peer,
                "target": asdict(row.target) if row.target else None,
                "median": ev["own"].median if ev["own"] else None,
                "min": ev["own"].lo if ev["own"] else None,
                "max": ev["own"].hi if ev["own"] else None,
                "peer_median": ev["peer"].median if ev["peer"] else None,
                "ratio": ev["ratio"], "pass": ev["verdict"]})
        doc["workloads"].append({
            "key": res.key, "title": res.title, "description": res.description,
            "skipped": res.skipped, "seconds": round(res.seconds, 1),
            "rows": rows, "runs": res.figures, "errors": res.errors, "notes": res.notes,
            "commands": [{"phase": p, "command": c} for p, c in res.commands.entries]})
    return json.dumps(doc, indent=2, default=str) + "\n"
