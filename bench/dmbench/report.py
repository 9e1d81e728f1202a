"""RESULTS.md (figures per tool, ratios, verdicts, profiles, plots, command
lines) and results.json (raw figures)."""

from __future__ import annotations

import json
from dataclasses import asdict

from .core import Row, WorkloadResult, measured_name


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

# The figures shown for every tool: (key, column heading).
METRICS = (("seconds", "wall s"), ("mb_per_s", "MB/s"), ("files_per_s", "files/s"),
           ("client_cpu_s_per_gb", "client CPU s/GB"), ("server_cpu_s_per_gb", "server CPU s/GB"),
           ("client_rss_mib", "client peak RSS MiB"), ("server_rss_mib", "server peak RSS MiB"))


def render_markdown(meta: dict, results: list[WorkloadResult],
                    plots: list[tuple[str, str]]) -> str:
    out = [_header(meta), _summary(results)]
    for i, res in enumerate(results, 1):
        out.append(_section(i, res, meta["runs"]))
    if plots or meta.get("plot_error"):
        out.append(_plots(plots, meta.get("plot_error")))
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
        "Measured apart, each with its command: what encryption costs (bench/ENCRYPTION.md), "
        "what durable confirmation costs (bench/DURABILITY.md), what the metrics page costs "
        "(bench/METRICS.md), this build against an "
        "earlier one (bench/BASELINE.md), pulling over ssh (bench/SSH.md), downloads and third-party "
        "copies across a WAN (bench/PULL.md), streaming "
        "(bench/STREAMING.md), tuning (bench/TUNING.md) and batch jobs (bench/JOBS.md).",
        "",
        f"- **date**: {meta['date']}",
        f"- **mode**: {mode}; {meta['runs']} runs per measurement",
        f"- **machine**: {meta['nproc']} CPUs ({meta['cpu']}), {meta['memory_gib']} GiB memory, "
        f"kernel {meta['kernel']}",
        f"- **dmover measured**: `{meta['dmover_build']}` (`{meta['dmover_path']} --version`)",
        *([f"- **baseline**: `{meta['baseline_build']}` (`{meta['baseline_path']} --version`), "
           "the tool `dmover-baseline`: the same commands run by this build against a "
           "`dmover serve` of its own, interleaved with the others and checked the same way; "
           "rows against it give the measured build's figure ÷ the baseline's"]
          if meta.get("baseline_build") else []),
        f"- **load average at start**: {meta['loadavg_at_start']} — the machine may be shared "
        "with other jobs, so absolute figures are noisy",
        f"- **TCP congestion control**: {meta['tcp_congestion_control']}",
        f"- **page cache**: {meta['page_cache']}",
        "- **peers**: " + "; ".join(v.values()),
        f"- **scratch directory** (data sets, destinations): `{meta['scratch']}`",
        "",
        "Each figure is the median of the runs, with the min – max spread. A ratio is "
        "a median divided by dmover's median, or by the limit's (the tool named as the "
        "limit of the workload: iperf3 for a network, fio for a disk). Peers with several "
        "candidate settings ran each once first and the fastest was kept (listed per "
        "section). Raw per-run figures: `bench/"
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
    for i, res in enumerate(results, 1):
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
    slower = [(i, r) for i, r in enumerate(results, 1) if r.profile]
    if slower:
        lines += ["", "Where a peer moved more MB/s than dmover (a profile of dmover is in the "
                  "section): " + "; ".join(f"{i}. {r.title} ({', '.join(r.profile['faster'])})"
                                         for i, r in slower) + "."]
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
    lines += _figures_table(res) + _ratio_table(res) + _verdict_table(res) + _cpu(res) + _trials(res)
    lines += _checks(res)
    lines += _profile(res) if res.profile else []
    per_run = "; the other runs repeat run 1 with the tools in rotated order"
    if any("dst-1" in c for c in res.commands.lines("run 1")):
        per_run += " and their own run number in `dst-N`"
    lines += [f"Commands (set-up with the trial runs, run 1 of {runs}, profile, teardown"
              f"{per_run}):", "", "```sh"]
    for phase, title in (("setup", "set-up"), ("run 1", "each run"), ("profile", "profile"),
                         ("teardown", "teardown")):
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


def _metrics(res: WorkloadResult) -> list[tuple[str, str]]:
    return [(k, h) for k, h in METRICS if any(res.stat(t, k) for t in res.figures)]


def _tool_label(res: WorkloadResult, tool: str) -> str:
    label = f"{tool} (limit)" if tool == res.limit else tool
    settings = res.settings.get(tool)
    return f"{label} `{settings}`" if settings and settings not in tool else label


def _figures_table(res: WorkloadResult) -> list[str]:
    metrics = _metrics(res)
    if not metrics:
        return []
    lines = ["| tool | runs | " + " | ".join(h for _, h in metrics) + " |",
             "|---|---|" + "---|" * len(metrics)]
    for tool, figs in res.figures.items():
        cells = []
        for key, _ in metrics:
            st = res.stat(tool, key)
            cells.append(f"{fmt(st.median)} ({fmt_spread(st)})" if st else "–")
        lines.append(f"| {_tool_label(res, tool)} | {len(figs)} | " + " | ".join(cells) + " |")
    return lines + ["", "Median (min – max) of the runs.", ""]


def _ratio_pairs(res: WorkloadResult) -> list[tuple[str, str]]:
    """(tool, reference) of each line of the ratio table: the measured
    build's tools ÷ the baseline build's twins first, then every other
    tool ÷ dmover and ÷ the limit."""
    measured = [(new, tool) for tool in res.figures
                if (new := measured_name(tool)) in res.figures]
    refs = [r for r in ("dmover", res.limit) if r and res.stat(r, "seconds")]
    return measured + [(tool, ref) for tool in res.figures for ref in refs
                       if tool != ref and not (ref == "dmover" and measured_name(tool))]


def _ratio_table(res: WorkloadResult) -> list[str]:
    metrics = _metrics(res)
    pairs = _ratio_pairs(res)
    if not metrics or not pairs:
        return []
    lines = ["| tool | ÷ | " + " | ".join(h for _, h in metrics) + " |",
             "|---|---|" + "---|" * len(metrics)]
    for tool, ref in pairs:
        cells = []
        for key, _ in metrics:
            own, base = res.stat(tool, key), res.stat(ref, key)
            cells.append(f"{own.median / base.median:.2f}" if own and base and base.median
                         else "–")
        lines.append(f"| {tool} | {ref} | " + " | ".join(cells) + " |")
    caption = "Ratios of medians: the tool's figure divided by dmover's, and by the limit's"
    if any(measured_name(ref) for _, ref in pairs):
        caption += "; the measured build's divided by the baseline build's (`dmover-baseline`)"
    return lines + ["", caption + ".", ""]


def _verdict_table(res: WorkloadResult) -> list[str]:
    if not res.rows:
        return []
    lines = ["| measure | tool | median | min – max | peer | peer median | peer min – max "
             "| dmover / peer | target | result |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in res.rows:
        ev = res.evaluate(row)
        own, peer = ev["own"], ev["peer"]
        n = len(own.values) if own else 0
        lines.append(
            f"| {row.measure} | {row.tool} ({n} runs) | {fmt(own.median if own else None)} "
            f"| {fmt_spread(own)} | {row.peer or '–'} | {fmt(peer.median if peer else None)} "
            f"| {fmt_spread(peer)} | {fmt_ratio(ev['ratio'])} "
            f"| {row.target.text if row.target else '–'} | {verdict_text(row, ev)} |")
    return lines + [""]


def _cpu_per_gb(res: WorkloadResult, tool: str) -> float | None:
    """Client and server CPU seconds per GB together (a local copy has one process)."""
    sides = [st.median for k in ("client_cpu_s_per_gb", "server_cpu_s_per_gb") if (st := res.stat(tool, k))]
    return sum(sides) if sides else None


def _cpu(res: WorkloadResult) -> list[str]:
    """dmover's CPU per GB beside the fastest peer's, and why it is higher
    where it is: the per-byte work only dmover does here."""
    own = _cpu_per_gb(res, "dmover")
    peers = [t for t in res.figures
             if not t.startswith("dmover") and t != res.limit and res.stat(t, "seconds")]
    if own is None or not peers:
        return []
    fastest = min(peers, key=lambda t: res.stat(t, "seconds").median)
    theirs = _cpu_per_gb(res, fastest)
    if theirs is None:
        return []
    line = (f"CPU per GB, client and server together (medians): dmover {fmt(own)} s, the fastest "
            f"peer ({fastest}) {fmt(theirs)} s.")
    if own > theirs:
        line += (" dmover spends more because it encrypts and authenticates every record it "
                 "sends (AES-256-GCM, sealed at one end and opened at the other: "
                 "bench/ENCRYPTION.md), which no peer here does (GridFTP runs without data "
                 "channel protection; rsync, rclone and cp copy locally, with no network between "
                 "their ends), checksums every block at both ends (XXH3-128), and on disk makes "
                 "each file durable before it confirms it (bench/DURABILITY.md).")
    return [line, ""]


def _trials(res: WorkloadResult) -> list[str]:
    lines = []
    for tool, trials in res.trials.items():
        tried = "; ".join(f"`{opts}` {fmt(secs)} s" for opts, secs in trials)
        lines.append(f"- {tool}: kept `{res.settings.get(tool)}`; tried (wall seconds of "
                     f"one run each): {tried}")
    return (["Settings of the tuned peers:", "", *lines, ""]) if lines else []


def _checks(res: WorkloadResult) -> list[str]:
    if not res.checks:
        return []
    what = {"content": "content (SHA-256)", "mode": "permissions", "mtime": "mtime (to the ns)"}
    groups: dict[tuple[str, ...], list[str]] = {}
    for tool, checks in res.checks.items():
        groups.setdefault(tuple(checks), []).append(tool)
    listed = "; ".join(f"{', '.join(tools)}: " + " and ".join(
        filter(None, [", ".join(what[c] for c in checks[:-1]), what[checks[-1]]]))
        for checks, tools in groups.items())
    spent = sum(f.get("check_seconds", 0.0) for figs in res.figures.values() for f in figs)
    return [f"Checked after every run, every file of the copy against its source: {listed}. "
            "Permissions and mtime are checked only for a tool asked to keep them. The checks "
            f"of the timed runs took {spent:.1f} s in all (not in the figures).", ""]


def _profile(res: WorkloadResult) -> list[str]:
    prof = res.profile
    lines = [f"Profile of dmover (slower than {', '.join(prof['faster'])} on MB/s): one more "
             "run of the dmover command below under `perf record -F 999 -g`, with a second "
             "`perf record -g -p` attached to `dmover serve` (commands under *profile*)."]
    wall = res.stat("dmover", "seconds")
    use = [f"the {side} used {fmt(cpu.median)} s of CPU ({100 * cpu.median / wall.median:.0f} % "
           "of one core)" for side in ("client", "server")
           if wall and (cpu := res.stat("dmover", f"{side}_cpu_s"))]
    if use:
        lines[-1] += (f" In the measured runs (medians), over {fmt(wall.median)} s wall, "
                      + " and ".join(use) + ".")
    lines[-1] += (" A side well below 100 % of a core spent most of its time waiting (on the "
                  "disk, the network or the other side) rather than computing.")
    lines.append("")
    for side, part in prof["parts"].items():
        threads = part["threads"] if len(part["threads"]) > 1 else []
        lines += [f"{side}: share of samples " + ("per thread, then " if threads else "") +
                  "per function (`perf report --no-children`, ≥ 1 %):", "", "```",
                  *threads, *([""] if threads else []), *part["functions"], "```", ""]
    return lines


def _plots(plots: list[tuple[str, str]], error: str | None) -> str:
    lines = ["## Plots", ""]
    if error:
        lines += ["Plotting failed:", "", "```", error.strip(), "```", ""]
    for title, path in plots:
        lines += [f"### {title}", "", f"![{title}]({path})", ""]
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
            "skipped": res.skipped, "seconds": round(res.seconds, 1), "limit": res.limit,
            "settings": res.settings, "trials": res.trials, "profile": res.profile,
            "checks": res.checks,
            "rows": rows, "runs": res.figures, "errors": res.errors, "notes": res.notes,
            "commands": [{"phase": p, "command": c} for p, c in res.commands.entries]})
    return json.dumps(doc, indent=2, default=str) + "\n"
