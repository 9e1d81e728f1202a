"""The measurement model: context, tools, workloads, rows of the result tables.

A *workload* names the data it needs, the *tools* it runs on that data, the
tool that stands for the limit (iperf3, fio) and the *rows* of its verdict
table. The engine (`run_workload`) starts every tool's session (a server,
say), tries each candidate setting of a tunable peer once and keeps the
fastest, then runs each tool once per run, tools interleaved within a run so
that slow drifts of the machine's load hit all of them alike, and collects
one dict of figures per tool and run. Where a peer is faster than dmover it
finally takes a profile of dmover (module profile).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import ContextManager

from . import profile
from .datasets import Dataset
from .system import BenchError, CommandLog, remove_tree, run


@dataclass
class Context:
    """Settings and shared state of one harness invocation."""

    quick: bool
    runs: int
    scratch: Path           # data sets (kept) and work/ (cleared at start)
    dmover: Path
    repo: Path
    wanem_dir: Path
    baseline: Path | None = None   # a second dmover build, measured beside `dmover`
    cold_cache: bool = True
    timeout: float = 900    # per command
    profile: bool = True    # profile dmover where a peer is faster
    perf_dir: Path | None = None   # set while a profile is being taken
    log: CommandLog = field(default_factory=CommandLog)
    notes: list[str] = field(default_factory=list)
    _token: Path | None = None

    @property
    def work(self) -> Path:
        return self.scratch / "work"

    def token(self) -> Path:
        """The token file shared by every dmover server and client."""
        if self._token is None:
            path = self.work / "token"
            path.unlink(missing_ok=True)
            res = run(self.log, [str(self.dmover), "token", str(path)], timeout=60)
            if res.rc != 0 or not path.exists():
                raise BenchError(f"cannot create a token: {res.describe()}")
            self._token = path
        return self._token

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


# The name of the baseline build's tools: "dmover-baseline", or with
# settings after it ("dmover-baseline --streams 4") like dmover's own.
BASELINE = "dmover-baseline"


def measured_name(name: str) -> str | None:
    """The measured build's counterpart of a baseline tool's name
    ("dmover-baseline --streams 4" -> "dmover --streams 4"), else None."""
    if name == BASELINE or name.startswith(BASELINE + " "):
        return "dmover" + name[len(BASELINE):]
    return None


class Tool:
    """One program measured by a workload. Subclasses set `name` and
    implement `measure`; `session` holds what lives across runs. `options`
    are the settings shown in the report; a tool with several `candidates`
    is tuned: the engine sets `options` to the fastest of them."""

    name = "tool"
    options: tuple[str, ...] = ()
    candidates: tuple[tuple[str, ...], ...] = ()

    def session(self, ctx: Context) -> ContextManager:
        return contextlib.nullcontext()

    def measure(self, ctx: Context, run_no: int) -> dict:
        raise NotImplementedError

    def checks(self) -> tuple[str, ...]:
        """What of the tool's output is checked after every run (a copy:
        each file's content and the attributes the tool keeps)."""
        return ()


@dataclass(frozen=True)
class Target:
    """A pass criterion on a row: on the ratio dmover/peer or on dmover's
    own figure, judged on the median (or on the worst run with stat="max")."""

    op: str                 # ">=", ">", "<="
    value: float
    text: str
    on: str = "ratio"       # "ratio" | "value"
    stat: str = "median"    # "median" | "max"

    def judge(self, value: float | None, ratio: float | None) -> bool | None:
        x = ratio if self.on == "ratio" else value
        if x is None:
            return None
        return {">=": x >= self.value, ">": x > self.value, "<=": x <= self.value}[self.op]


@dataclass(frozen=True)
class Row:
    """One line of a result table: `tool`'s figure `key`, optionally
    compared with `peer`'s figure of the same key. With `paired` (two
    builds or settings of one tool, run side by side in every round) the
    ratio is the median of the rounds' ratios, which a machine whose speed
    drifts between rounds moves far less than the ratio of the medians."""

    measure: str
    tool: str
    key: str
    peer: str | None = None
    target: Target | None = None
    paired: bool = False


@dataclass
class Stat:
    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)


class Workload:
    """Base class; see the module docstring."""

    key = "workload"
    title = "workload"
    limit: str | None = None     # the tool whose figures are the limit
    score = "mb_per_s"           # higher is better; decides whether to profile dmover

    def describe(self, ctx: Context) -> str:
        return ""

    def datasets(self, ctx: Context) -> list[Dataset]:
        return []

    def tools(self, ctx: Context) -> list[Tool]:
        raise NotImplementedError

    def rows(self, ctx: Context) -> list[Row]:
        raise NotImplementedError

    def skip_reason(self, ctx: Context) -> str | None:
        return None

    def environment(self, ctx: Context) -> ContextManager:
        """Set-up around all tool sessions (e.g. an emulated WAN link)."""
        return contextlib.nullcontext()

    def environment_lost(self) -> str | None:
        """Why the environment stopped working (e.g. an emulated link whose
        emulator died), or None while it works."""
        return None


@dataclass
class WorkloadResult:
    key: str
    title: str
    description: str
    rows: list[Row]
    figures: dict[str, list[dict]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    commands: CommandLog = field(default_factory=CommandLog)
    skipped: str | None = None
    seconds: float = 0.0
    limit: str | None = None
    settings: dict[str, str] = field(default_factory=dict)
    trials: dict[str, list] = field(default_factory=dict)
    profile: dict | None = None
    checks: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def stat(self, tool: str | None, key: str) -> Stat | None:
        if tool is None:
            return None
        values = [f[key] for f in self.figures.get(tool, []) if f.get(key) is not None]
        return Stat(values) if values else None

    def evaluate(self, row: Row) -> dict:
        """Statistics, ratio and verdict of one row."""
        own = self.stat(row.tool, row.key)
        peer = self.stat(row.peer, row.key)
        ratio = own.median / peer.median if own and peer and peer.median else None
        if row.paired and own and peer:
            rounds = zip(self.figures.get(row.tool, []), self.figures.get(row.peer, []))
            ratios = [a[row.key] / b[row.key] for a, b in rounds if a.get(row.key) and b.get(row.key)]
            ratio = statistics.median(ratios) if ratios else None
        value = None
        if own:
            value = own.hi if row.target and row.target.stat == "max" else own.median
        verdict = row.target.judge(value, ratio) if row.target else None
        return {"own": own, "peer": peer, "ratio": ratio, "verdict": verdict}

    def faster_peers(self, key: str) -> list[str]:
        """Peers (not the limit) whose median `key` beats dmover's."""
        own = self.stat("dmover", key)
        if own is None:
            return []
        return [name for name in self.figures
                if name not in ("dmover", self.limit)
                and (peer := self.stat(name, key)) and peer.median > own.median]


def run_workload(ctx: Context, wl: Workload) -> WorkloadResult:
    """Run a workload: set-up, trials, timed runs, profile. When its
    environment fails under it (not a tool), everything is set up afresh
    and the step that failed runs again, up to MAX_RENEWALS times."""
    res = WorkloadResult(wl.key, wl.title, wl.describe(ctx), wl.rows(ctx), limit=wl.limit)
    ctx.log, ctx.notes = res.commands, res.notes
    t0 = time.monotonic()
    reason = wl.skip_reason(ctx)
    if reason:
        res.skipped = reason
        print(f"== {wl.title}: skipped ({reason})", flush=True)
        return res
    print(f"== {wl.title}", flush=True)
    try:
        for ds in wl.datasets(ctx):
            ds.ensure(ctx.scratch)
            warm_up(ctx, ds)
        tools = wl.tools(ctx)
        for tool in tools:
            res.figures[tool.name] = []
            if tool.checks():
                res.checks[tool.name] = tool.checks()
        with contextlib.ExitStack() as stack:
            renewals = 0

            def renew(why: str, what: str) -> bool:
                """After the environment was lost under `what`: tear down
                and ask for a fresh set-up, unless renewals ran out."""
                nonlocal renewals
                if renewals >= MAX_RENEWALS:
                    return False
                renewals += 1
                res.notes.append(f"{what}: {why}; set everything up again and ran it once more")
                print(f"   {why}; setting up again", flush=True)
                stack.close()
                return True

            while True:
                mark = len(res.errors)
                active = _bring_up(ctx, wl, tools, res, stack, first=True)
                why = wl.environment_lost()
                if not (why and renew(why, "set-up and trials")):
                    break
                del res.errors[mark:]
            for run_no in range(1, ctx.runs + 1):
                res.commands.phase = f"run {run_no}"
                for tool in rotated(active, run_no - 1):
                    while True:
                        error = _measure_once(ctx, tool, run_no, res)
                        why = error and wl.environment_lost()
                        if not (why and renew(why, f"{tool.name}, run {run_no}")):
                            break
                        res.errors.remove(error)
                        active = _bring_up(ctx, wl, tools, res, stack, first=False)
                        if tool not in active:
                            break
            slower_than = res.faster_peers(wl.score)
            dmover = [t for t in active if t.name == "dmover"]
            if ctx.profile and slower_than and dmover:
                res.commands.phase = "profile"
                print(f"   profiling dmover (slower than {', '.join(slower_than)})", flush=True)
                try:
                    res.profile = dict(profile.take(ctx, dmover[0], wl.key),
                                       faster=slower_than)
                except Exception as exc:  # noqa: BLE001
                    res.errors.append(f"dmover profile: {_explain(exc)}")
            res.commands.phase = "teardown"
    except Exception as exc:  # noqa: BLE001
        res.errors.append(_explain(exc))
    for name, figs in res.figures.items():
        if not figs and not any(e.startswith(name + ":") for e in res.errors):
            res.errors.append(f"{name}: produced no figures")
    res.seconds = time.monotonic() - t0
    return res


# How often a workload's environment is set up afresh after it failed.
MAX_RENEWALS = 5


def _bring_up(ctx: Context, wl: Workload, tools: list[Tool], res: WorkloadResult,
              stack: contextlib.ExitStack, first: bool) -> list[Tool]:
    """Enters the workload's environment and each tool's session on
    `stack`; the first time, tools with several candidate settings pick
    theirs. Returns the tools that are ready."""
    stack.enter_context(wl.environment(ctx))
    active = []
    for tool in tools:
        try:
            stack.enter_context(tool.session(ctx))
            if first and len(tool.candidates) > 1:
                tune(ctx, tool, res)
            active.append(tool)
        except Exception as exc:  # noqa: BLE001 - reported, other tools go on
            res.errors.append(f"{tool.name}: set-up failed: {_explain(exc)}")
        if first:
            res.settings[tool.name] = " ".join(tool.options)
    return active


def warm_up(ctx: Context, ds: Dataset) -> None:
    """Copy the data set once, untimed, and delete the copy. On a virtual
    machine the host caches the virtual disk and allocates its blocks on
    first write; without this the first run would be much slower than the
    others."""
    dest = ctx.work / "warm-up"
    ctx.log.add("# warm-up, not timed:")
    res = run(ctx.log, ["cp", "-r", str(ds.src(ctx.scratch)), str(dest)], timeout=ctx.timeout)
    remove_tree(ctx.log, dest)
    if res.rc != 0:
        raise BenchError(f"warm-up copy failed: {res.describe()}")


def tune(ctx: Context, tool: Tool, res: WorkloadResult) -> None:
    """One untimed trial run (run number 0) per candidate setting; the tool
    keeps the fastest. Trials that fail are reported and skipped."""
    ctx.log.add(f"# {tool.name}: one trial run per candidate setting, the fastest is kept")
    trials = []
    for options in tool.candidates:
        tool.options = options
        print(f"   trial {tool.name} {' '.join(options)}", end=" ", flush=True)
        try:
            seconds = tool.measure(ctx, 0)["seconds"]
        except Exception as exc:  # noqa: BLE001
            print("FAILED", flush=True)
            res.errors.append(f"{tool.name} {' '.join(options)}: trial: {_explain(exc)}")
            continue
        print(f"seconds={seconds:.4g}", flush=True)
        trials.append((seconds, options))
    if not trials:
        raise BenchError("every candidate setting failed")
    tool.options = min(trials)[1]
    res.trials[tool.name] = [[" ".join(o), s] for s, o in trials]


def rotated(items: list, k: int) -> list:
    """items rotated left by k: each tool takes its turn at going first."""
    k %= max(len(items), 1)
    return items[k:] + items[:k]


def _measure_once(ctx: Context, tool: Tool, run_no: int, res: WorkloadResult) -> str | None:
    """One timed run of `tool`; its figures go to `res`. Returns the error
    it added to `res`, if it failed."""
    print(f"   run {run_no}/{ctx.runs} {tool.name:<15}", end=" ", flush=True)
    try:
        fig = tool.measure(ctx, run_no)
    except Exception as exc:  # noqa: BLE001
        print("FAILED", flush=True)
        error = f"{tool.name}: run {run_no}: {_explain(exc)}"
        res.errors.append(error)
        return error
    fig["run"] = run_no
    res.figures[tool.name].append(fig)
    shown = {k: v for k, v in fig.items() if k in _PROGRESS_KEYS}
    print("  ".join(f"{k}={v:.4g}" for k, v in shown.items()), flush=True)


_PROGRESS_KEYS = ("seconds", "mb_per_s", "files_per_s", "goodput_pct",
                  "client_cpu_s", "server_cpu_s", "client_rss_mib", "server_rss_mib")


def _explain(exc: Exception) -> str:
    if isinstance(exc, BenchError):
        return str(exc)
    return "harness error: " + "".join(traceback.format_exception(exc, limit=-3)).strip()
