"""The programs under test: dmover (`cp`, `bench`) and its peers
(globus-url-copy, rsync, rclone, cp, iperf3, fio). Each tool returns a dict
of figures per run: wall seconds, MB/s, files/s, CPU seconds per GB of
client and server, peak RSS of both, and (on an emulated link) the
throughput over time.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from . import profile
from .core import BASELINE, Context, Tool
from .datasets import Dataset, verify_copy
from .servers import DmoverServer, GridftpServer, Iperf3Server, RsyncDaemon, Server
from .system import BenchError, Result, drop_caches, in_netns, remove_tree, run
from .usage import Sampler, ServerUsage, read_timed, timed

MB = 1e6
MIB = 1 << 20


def _check(res: Result) -> Result:
    if res.rc != 0 or res.timed_out:
        raise BenchError(res.describe())
    return res


def parse_json_report(res: Result) -> dict:
    """The last JSON object a tool printed on stdout, starting at a line start
    (the whole output, or after other lines)."""
    text = res.stdout.strip()
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and text[i + 1:i + 2] == "{"]
    decoder = json.JSONDecoder()
    for start in reversed(starts):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    raise BenchError(f"`{' '.join(res.argv)}` printed no JSON object on stdout; "
                     f"stdout was:\n{text[-2000:] or '(empty)'}\nstderr:\n{res.tail()}")


def rates(fig: dict, nbytes: int, seconds: float, files: int | None = None) -> dict:
    """Add the derived figures: MB/s, files/s and CPU seconds per GB."""
    gb = nbytes / 1e9
    fig.update(bytes=nbytes, seconds=seconds, mb_per_s=nbytes / MB / seconds)
    if files:
        fig.update(files=files, files_per_s=files / seconds)
    for side in ("client", "server"):
        if fig.get(f"{side}_cpu_s") is not None and gb:
            fig[f"{side}_cpu_s_per_gb"] = fig[f"{side}_cpu_s"] / gb
    return fig


class MeasuredTool(Tool):
    """A tool whose client command runs under /usr/bin/time, with the CPU
    and memory of its server (if any) and the link's receive counter (if
    any) read around it."""

    server: Server | None = None
    netns: str | None = None     # the client's network namespace
    link = None                  # wanem.WanLink: sample its receive counter
    toward_client = False        # the data flows to the client: sample the send counter

    def execute(self, ctx: Context, argv: list[str]) -> tuple[Result, dict]:
        time_file = ctx.work / "logs" / "time.txt"
        argv = timed(profile.wrap_client(ctx, in_netns(self.netns, argv)), time_file)
        spid = self.server.pid if self.server else None
        usage = ServerUsage(spid) if spid else None
        anchor, iface = (self.link.anchor_pid, self.link.iface) if self.link else (None, None)
        with profile.attach_server(ctx, spid), \
                Sampler(spid, anchor, iface, sent=self.toward_client) as sampler:
            res = run(ctx.log, argv, timeout=ctx.timeout,
                      abort_if=self.link.down if self.link else None)
        if self.link:
            self.link.check()
        _check(res)
        fig = read_timed(time_file)
        if usage:
            fig.update(usage.finish(sampler.peak_rss_kib))
        if self.link:
            fig["timeline"] = sampler.timeline()
        return res, fig


# --------------------------------------------------------------------------
# memory to memory and the network limit
# --------------------------------------------------------------------------

class DmoverBuild:
    """Mixin of the tools that run dmover: `baseline` picks the baseline
    build (`--baseline`, tool name "dmover-baseline") instead of the
    measured one, for the client and for the `dmover serve` it talks to."""

    baseline = False

    def binary(self, ctx: Context) -> Path:
        return ctx.baseline if self.baseline else ctx.dmover


class DmoverBench(DmoverBuild, MeasuredTool):
    """`dmover bench`: memory to memory through a dmover server."""

    def __init__(self, size: str, streams: int, baseline: bool = False):
        self.size, self.streams, self.baseline = size, streams, baseline
        self.name = BASELINE if baseline else "dmover"
        self.options = ("--streams", str(streams))

    def session(self, ctx: Context) -> DmoverServer:
        self.server = DmoverServer(ctx, ctx.work / f"export-{self.name}", self.binary(ctx))
        return self.server

    def measure(self, ctx: Context, run_no: int) -> dict:
        argv = [str(self.binary(ctx)), "bench", *self.options, "--size", self.size,
                "--json", "--token-file", str(ctx.token()), self.server.url()]
        res, fig = self.execute(ctx, argv)
        rep = parse_json_report(res)
        try:
            nbytes, seconds = int(rep["bytes"]), float(rep["seconds"])
        except (KeyError, TypeError, ValueError):
            raise BenchError(f"dmover bench JSON lacks bytes/seconds: {res.stdout.strip()}")
        if nbytes <= 0 or seconds <= 0:
            raise BenchError(f"dmover bench reported no transfer: {res.stdout.strip()}")
        _check_reported_rate(ctx, rep.get("mb_per_s"), nbytes, seconds)
        rates(fig, nbytes, res.seconds)
        fig.update(gbit_per_s=nbytes * 8 / res.seconds / 1e9, reported_seconds=seconds)
        return fig


def _check_reported_rate(ctx: Context, reported, nbytes: int, seconds: float) -> None:
    """Note it when dmover's mb_per_s is not bytes / 10^6 / seconds."""
    try:
        reported = float(reported)
    except (TypeError, ValueError):
        ctx.note(f"dmover's JSON report has no numeric mb_per_s ({reported!r})")
        return
    mb, mib = nbytes / MB / seconds, nbytes / MIB / seconds
    if abs(reported - mb) <= 0.02 * mb:
        return
    unit = "MiB/s (2^20 bytes)" if abs(reported - mib) <= 0.02 * mib else "an unknown unit"
    ctx.note(f"dmover reports mb_per_s={reported:.1f} for {nbytes} bytes in {seconds:.3f} s, "
             f"i.e. in {unit}, not 10^6 bytes/s ({mb:.1f}); the tables use bytes / seconds")


class GridftpMemory(MeasuredTool):
    """globus-url-copy from /dev/zero (client) to /dev/null on a GridFTP
    server: memory to memory, `-len` bytes."""

    name = "globus-url-copy"
    candidates = (("-fast", "-p", "1"), ("-fast", "-p", "4"), ("-fast", "-p", "8"))

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.options = self.candidates[1]

    def session(self, ctx: Context) -> GridftpServer:
        self.server = GridftpServer(ctx)
        return self.server

    def measure(self, ctx: Context, run_no: int) -> dict:
        argv = ["globus-url-copy", *self.options, "-len", str(self.nbytes),
                "file:///dev/zero", self.server.url("/dev/null")]
        res, fig = self.execute(ctx, argv)
        rates(fig, self.nbytes, res.seconds)
        fig["gbit_per_s"] = self.nbytes * 8 / res.seconds / 1e9
        return fig


class Iperf3(MeasuredTool):
    """iperf3 client against an iperf3 server it starts (optionally in netns)."""

    def __init__(self, streams: int, seconds: int, host: str = "127.0.0.1",
                 server_netns: str | None = None, client_netns: str | None = None,
                 link=None, name: str = "iperf3"):
        self.seconds, self.host, self.name = seconds, host, name
        self.server_netns, self.netns, self.link = server_netns, client_netns, link
        self.options = ("-P", str(streams))

    def session(self, ctx: Context) -> Iperf3Server:
        self.server = Iperf3Server(ctx, host=self.host, netns=self.server_netns)
        return self.server

    def measure(self, ctx: Context, run_no: int) -> dict:
        argv = ["iperf3", "-c", self.host, "-p", str(self.server.port), *self.options,
                "-t", str(self.seconds), "-J"]
        res, fig = self.execute(ctx, argv)
        rep = parse_json_report(res)
        try:
            end = rep["end"]["sum_received"]
            nbytes, seconds = int(end["bytes"]), float(end["seconds"])
        except (KeyError, TypeError, ValueError):
            raise BenchError(f"iperf3 JSON has no end.sum_received: {rep.get('error', '')}")
        rates(fig, nbytes, seconds)
        fig.update(gbit_per_s=nbytes * 8 / seconds / 1e9,
                   retransmits=rep["end"].get("sum_sent", {}).get("retransmits"))
        return fig


# --------------------------------------------------------------------------
# copies
# --------------------------------------------------------------------------

class CopyTool(MeasuredTool):
    """Copies a data set's src/ into a fresh destination and times it.

    Before each run the destination is removed and the page cache dropped;
    afterwards the copy is checked against the source (every file's content,
    and the attributes in `preserves`: those the tool is asked to keep) and
    removed again. `seconds` is the wall time from spawn to exit;
    `mb_per_s_with_sync` and `files_per_s_with_sync` add a `sync` after the
    command (write-back not counted in `seconds`); `check_seconds` is the time the check took."""

    preserves: tuple[str, ...] = ()

    def __init__(self, dataset: Dataset, options: tuple[str, ...] = (), name: str = ""):
        self.dataset, self.options = dataset, options or self.options
        self.name = name or self.name

    def checks(self) -> tuple[str, ...]:
        return ("content", *self.preserves)

    def slug(self) -> str:
        return self.name.replace(" ", "_").replace("/", "_")

    def dest(self, ctx: Context, run_no: int) -> Path:
        return ctx.work / "out" / self.slug() / f"dst-{run_no}"

    def command(self, ctx: Context, src: Path, dest: Path, run_no: int) -> list[str]:
        raise NotImplementedError

    def parse(self, ctx: Context, res: Result) -> dict:
        return {}

    def measure(self, ctx: Context, run_no: int) -> dict:
        ds = self.dataset
        src, dest = ds.src(ctx.scratch), self.dest(ctx, run_no)
        remove_tree(ctx.log, dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if ctx.cold_cache:
            drop_caches(ctx.log)
        res, fig = self.execute(ctx, self.command(ctx, src, dest, run_no))
        t0 = time.monotonic()
        os.sync()
        sync_s = time.monotonic() - t0
        rates(fig, ds.total_bytes, res.seconds, ds.files)
        fig.update(sync_seconds=sync_s,
                   mb_per_s_with_sync=ds.total_bytes / MB / (res.seconds + sync_s),
                   files_per_s_with_sync=ds.files / (res.seconds + sync_s))
        if self.link:
            fig["goodput_pct"] = 100 * ds.total_bytes * 8 / 1e6 / res.seconds / self.link.rate_mbit
        fig.update(self.parse(ctx, res))
        fig["check_seconds"] = verify_copy(ds, src, dest, self.preserves)
        remove_tree(None, dest)
        return fig


class Cp(CopyTool):
    """`cp -r`: keeps neither permissions nor times (it is not `cp -a`)."""

    name = "cp -r"

    def command(self, ctx, src, dest, run_no):
        return ["cp", "-r", str(src), str(dest)]


class Rclone(CopyTool):
    """`rclone copy`: sets each file's modification time (its default), not
    its permissions."""

    name = "rclone"
    preserves = ("mtime",)
    candidates = (("--transfers", "4"), ("--transfers", "8"), ("--transfers", "16"))
    options = candidates[1]

    def command(self, ctx, src, dest, run_no):
        return ["rclone", "copy", *self.options, str(src), str(dest)]


class Rsync(CopyTool):
    """`rsync -a` locally, or into an rsync daemon (in a namespace); -a
    keeps permissions and times."""

    name = "rsync"
    preserves = ("mode", "mtime")

    def __init__(self, dataset: Dataset, *, daemon_host: str | None = None,
                 server_netns: str | None = None, client_netns: str | None = None, link=None):
        super().__init__(dataset)
        self.host, self.server_netns, self.netns, self.link = \
            daemon_host, server_netns, client_netns, link

    def session(self, ctx):
        if not self.host:
            return super().session(ctx)
        self.server = RsyncDaemon(ctx, self.dest(ctx, 0).parent, host=self.host,
                                  netns=self.server_netns)
        return self.server

    def command(self, ctx, src, dest, run_no):
        target = self.server.url(dest.name) if self.server else str(dest)
        return ["rsync", "-a", f"{src}/", f"{target}/"]


class ServerCopyTool(CopyTool):
    """A copy into a server: on loopback, or from namespace `client_netns`
    to `host` in `server_netns` across an emulated `link`."""

    def __init__(self, dataset: Dataset, options: tuple[str, ...] = (), *,
                 host: str = "127.0.0.1", server_netns: str | None = None,
                 client_netns: str | None = None, link=None, name: str = ""):
        super().__init__(dataset, options, name)
        self.host, self.server_netns, self.netns, self.link = \
            host, server_netns, client_netns, link


class GlobusUrlCopy(ServerCopyTool):
    """globus-url-copy of the tree (`-r -cd`) to a GridFTP server; it is
    not asked to keep permissions or times."""

    name = "globus-url-copy"
    candidates = (("-fast", "-p", "4"), ("-fast", "-cc", "4", "-pp"),
                  ("-fast", "-cc", "8", "-pp"), ("-fast", "-p", "4", "-cc", "4", "-pp"))
    options = candidates[2]

    def __init__(self, dataset: Dataset, options: tuple[str, ...] = (), **where):
        super().__init__(dataset, options, **where)
        if options:
            self.candidates = ()

    def session(self, ctx):
        out = self.dest(ctx, 0).parent
        out.mkdir(parents=True, exist_ok=True)
        out.chmod(0o777)      # the server's per-connection process runs as nobody
        self.server = GridftpServer(ctx, host=self.host, netns=self.server_netns)
        return self.server

    def command(self, ctx, src, dest, run_no):
        return ["globus-url-copy", "-r", "-cd", *self.options, f"file://{src}/",
                self.server.url(f"{dest}/")]


class GlobusThirdParty(GlobusUrlCopy):
    """globus-url-copy of the tree between two GridFTP endpoints (a
    third-party transfer: the client only steers, the data goes from the
    source server's process to the destination server's), here both
    served by one GridFTP server, as a site's transfer node would. The
    server's processes run as `nobody`, which cannot read the data set's
    private files, so they read a copy of it that anyone may read, made
    once before the runs. Only the pipelined settings are tried: without
    `-pp` (`-fast -p 4`) a third-party copy of 500 small files here did
    not finish within the harness's time limit."""

    name = "globus-url-copy third party"
    candidates = tuple(c for c in GlobusUrlCopy.candidates if "-pp" in c)

    def session(self, ctx):
        src = self.dataset.src(ctx.scratch)
        self.readable = ctx.work / "gridftp-src" / src.parent.name
        if not self.readable.is_dir():
            remove_tree(ctx.log, self.readable.parent)
            self.readable.parent.mkdir(parents=True)
            for argv in (["cp", "-r", str(src), str(self.readable)],
                         ["chmod", "-R", "a+rX", str(self.readable.parent)]):
                res = run(ctx.log, argv)
                if res.rc != 0:
                    raise BenchError(res.describe())
        return super().session(ctx)

    def command(self, ctx, src, dest, run_no):
        return ["globus-url-copy", "-r", "-cd", *self.options, self.server.url(f"{self.readable}/"),
                self.server.url(f"{dest}/")]


class DmoverCopy(DmoverBuild, ServerCopyTool):
    """`dmover cp` into a dmover server of the same build (loopback, or
    across a netns link); it keeps modification times, and permissions
    with `--perms` as `rsync -a` does (a baseline build from before that
    flag kept them by default). With `baseline` the name starts with
    "dmover-baseline" instead of "dmover"."""

    preserves = ("mode", "mtime")

    def __init__(self, dataset: Dataset, options: tuple[str, ...] = (), *,
                 baseline: bool = False, name: str = "dmover", **where):
        if baseline:
            name = BASELINE + name.removeprefix("dmover")
        super().__init__(dataset, options, name=name, **where)
        self.baseline = baseline
        self.keep = () if baseline else ("--perms",)

    def session(self, ctx: Context) -> DmoverServer:
        self.server = DmoverServer(ctx, ctx.work / f"export-{self.slug()}", self.binary(ctx),
                                   host=self.host, netns=self.server_netns, allow_owners=not self.baseline)
        return self.server

    def dest(self, ctx, run_no):
        return self.server.export_dir / f"dst-{run_no}"

    def command(self, ctx, src, dest, run_no):
        return [str(self.binary(ctx)), "cp", "--json", *self.keep, *self.options, "--token-file",
                str(ctx.token()), f"{src}/", self.server.url(f"dst-{run_no}/")]

    def parse(self, ctx, res):
        rep = parse_json_report(res)
        check_cp_report(rep, self.dataset, res)
        if isinstance(rep.get("seconds"), (int, float)) and rep["seconds"] > 0:
            _check_reported_rate(ctx, rep.get("mb_per_s"), rep["bytes"], rep["seconds"])
        return {"reported_seconds": rep.get("seconds"),
                "reported_files_per_s": rep.get("files_per_s"),
                "sent_bytes": rep.get("sent_bytes"), "retries": rep.get("retries"),
                "resent_blocks": rep.get("resent_blocks")}


class DmoverDownload(DmoverCopy):
    """`dmover cp` from a dmover server that exports the data set into a
    local directory: on loopback, or across a netns link from the server in
    `server_netns` to the client in `client_netns`. The server sends (and
    tunes its streams); its CPU is the server's."""

    toward_client = True

    def session(self, ctx: Context) -> DmoverServer:
        self.server = DmoverServer(ctx, self.dataset.root(ctx.scratch), self.binary(ctx),
                                   existing=True, host=self.host, netns=self.server_netns)
        return self.server

    def dest(self, ctx, run_no):
        return CopyTool.dest(self, ctx, run_no)

    def command(self, ctx, src, dest, run_no):
        return [str(self.binary(ctx)), "cp", "--json", *self.keep, *self.options, "--token-file",
                str(ctx.token()), self.server.url(f"{src.name}/"), f"{dest}/"]


class DmoverThirdParty(DmoverCopy):
    """`dmover cp` between two dmover servers: the source server, beside
    the client (at `source_host` in `client_netns`), exports the data set
    and pushes it (tuning its streams) to the destination server at `host`
    (in `server_netns`), across the link if there is one. The CPU reported
    as the server's is the source server's, which does the sending."""

    def __init__(self, dataset: Dataset, options: tuple[str, ...] = (), *,
                 source_host: str = "127.0.0.1", **kw):
        super().__init__(dataset, options, **kw)
        self.source_host = source_host

    def session(self, ctx: Context):
        stack = contextlib.ExitStack()
        self.dest_server = stack.enter_context(
            DmoverServer(ctx, ctx.work / f"export-{self.slug()}", self.binary(ctx),
                         host=self.host, netns=self.server_netns))
        try:
            self.server = stack.enter_context(
                DmoverServer(ctx, self.dataset.root(ctx.scratch), self.binary(ctx),
                             existing=True, host=self.source_host, netns=self.netns))
        except BaseException:
            stack.close()
            raise
        return stack

    def dest(self, ctx, run_no):
        return self.dest_server.export_dir / f"dst-{run_no}"

    def command(self, ctx, src, dest, run_no):
        return [str(self.binary(ctx)), "cp", "--json", *self.keep, *self.options, "--token-file",
                str(ctx.token()), self.server.url(f"{src.name}/"),
                self.dest_server.url(f"{dest.name}/")]


def check_cp_report(rep: dict, ds: Dataset, res: Result) -> None:
    """The JSON report of a successful `dmover cp` must say so consistently."""
    problems = []
    if rep.get("ok") is not True:
        problems.append("ok is not true")
    if rep.get("files") != ds.files:
        problems.append(f"files={rep.get('files')} (expected {ds.files})")
    if rep.get("bytes") != ds.total_bytes:
        problems.append(f"bytes={rep.get('bytes')} (expected {ds.total_bytes})")
    if rep.get("errors"):
        problems.append(f"errors={rep.get('errors')!r:.500}")
    check = rep.get("check")
    if isinstance(check, dict) and check.get("passed") is not True:
        problems.append(f"check={check}")
    if problems:
        raise BenchError(f"`dmover cp` exited 0 but its JSON report is inconsistent: "
                         f"{'; '.join(problems)}\nreport: {res.stdout.strip()[:1500]}")


# --------------------------------------------------------------------------
# disk limit
# --------------------------------------------------------------------------

class Fio(MeasuredTool):
    """fio sequential write then read with direct I/O: what the disk can do.
    Its MB/s is the lower of the two rates (a copy both reads and writes)."""

    name = "fio"

    def __init__(self, size: str):
        self.size = size
        self.options = ("--bs=1M", f"--size={size}", "--direct=1", "--ioengine=psync")

    def _job(self, ctx: Context, rw: str) -> tuple[dict, dict]:
        argv = ["fio", "--name=seq" + rw, f"--filename={ctx.work / 'fio.dat'}", f"--rw={rw}",
                *self.options, "--output-format=json"]
        res, fig = self.execute(ctx, argv)
        job = parse_json_report(res)["jobs"][0][rw]
        return job, fig

    def measure(self, ctx: Context, run_no: int) -> dict:
        try:
            wjob, wfig = self._job(ctx, "write")
            rjob, rfig = self._job(ctx, "read")
        finally:
            (ctx.work / "fio.dat").unlink(missing_ok=True)
        fig = {"write_mb_per_s": wjob["bw_bytes"] / MB, "read_mb_per_s": rjob["bw_bytes"] / MB,
               "client_cpu_s": wfig["client_cpu_s"] + rfig["client_cpu_s"],
               "client_rss_mib": max(wfig["client_rss_mib"], rfig["client_rss_mib"])}
        nbytes = wjob["io_bytes"] + rjob["io_bytes"]
        # seconds: of the slower direction at its own rate, so MB/s = min(read, write)
        slower = min(fig["write_mb_per_s"], fig["read_mb_per_s"])
        return rates(fig, nbytes // 2, nbytes // 2 / MB / slower)
