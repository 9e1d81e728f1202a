"""The programs under test: dmover (server, cp, bench) and its peers
(iperf3, rsync, rclone, cp, fio). Each tool returns a dict of figures per run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

from .core import Context, Tool
from .datasets import Dataset, verify_copy
from .system import (BenchError, Result, drop_caches, free_port, in_netns, log_tail,
                     remove_tree, run, start, stop, wait_listening)

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


# --------------------------------------------------------------------------
# dmover server
# --------------------------------------------------------------------------

class DmoverServer:
    """`dmover serve` with one export, started and stopped by the harness."""

    EXPORT = "bench"

    def __init__(self, ctx: Context, export_dir: Path, host: str = "127.0.0.1",
                 netns: str | None = None, label: str = "dmover serve"):
        self.ctx, self.export_dir, self.host, self.netns = ctx, export_dir, host, netns
        self.label = label
        self.port = free_port()
        self.log_path = ctx.work / "logs" / f"serve-{self.port}.log"
        self.proc = None

    def url(self, path: str = "") -> str:
        return f"dmover://{self.host}:{self.port}/{self.EXPORT}" + (f"/{path}" if path else "")

    def __enter__(self) -> "DmoverServer":
        token = self.ctx.token()
        remove_tree(None, self.export_dir)
        self.export_dir.mkdir(parents=True)
        argv = in_netns(self.netns, [
            str(self.ctx.dmover), "serve", "--listen", f"{self.host}:{self.port}",
            "--export", f"{self.EXPORT}={self.export_dir}", "--token-file", str(token)])
        self.proc = start(self.ctx.log, argv, self.log_path)
        try:
            wait_listening(self.port, self.proc, self.label, self.log_path, self.netns)
        except BaseException:
            stop(None, self.proc, self.label, grace=5)
            raise
        return self

    def peak_rss_mib(self) -> float:
        """VmHWM of the server process (the peak of its resident set)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", status, re.M)
        if not match:
            raise BenchError(f"no VmHWM in /proc/{self.proc.pid}/status")
        return int(match.group(1)) / 1024

    def __exit__(self, *exc) -> None:
        rc = stop(self.ctx.log, self.proc, self.label)
        if rc != 0:
            what = "did not exit within 40 s of SIGTERM" if rc is None else \
                f"exited with code {rc} after SIGTERM (expected 0)"
            self.ctx.note(f"`dmover serve` {what}; last log lines:\n{log_tail(self.log_path)}")
        remove_tree(None, self.export_dir)


# --------------------------------------------------------------------------
# memory to memory
# --------------------------------------------------------------------------

class DmoverBench(Tool):
    """`dmover bench`: memory to memory through a dmover server."""

    def __init__(self, size: str, streams: int, name: str = "dmover"):
        self.size, self.streams, self.name = size, streams, name
        self.server: DmoverServer | None = None

    def session(self, ctx: Context) -> DmoverServer:
        self.server = DmoverServer(ctx, ctx.work / "export-bench")
        return self.server

    def measure(self, ctx: Context, run_no: int) -> dict:
        argv = [str(ctx.dmover), "bench", "--streams", str(self.streams), "--size", self.size,
                "--json", "--token-file", str(ctx.token()), self.server.url()]
        res = _check(run(ctx.log, argv, timeout=ctx.timeout))
        rep = parse_json_report(res)
        try:
            nbytes, seconds = int(rep["bytes"]), float(rep["seconds"])
        except (KeyError, TypeError, ValueError):
            raise BenchError(f"dmover bench JSON lacks bytes/seconds: {res.stdout.strip()}")
        if nbytes <= 0 or seconds <= 0:
            raise BenchError(f"dmover bench reported no transfer: {res.stdout.strip()}")
        _check_reported_rate(ctx, rep.get("mb_per_s"), nbytes, seconds)
        return {"gbit_per_s": nbytes * 8 / seconds / 1e9, "bytes": nbytes, "seconds": seconds,
                "reported_mb_per_s": rep.get("mb_per_s"), "wall_seconds": res.seconds}


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


class Iperf3(Tool):
    """iperf3 client against an iperf3 server it starts (optionally in netns)."""

    def __init__(self, streams: int, seconds: int, host: str = "127.0.0.1",
                 server_netns: str | None = None, client_netns: str | None = None,
                 link_mbit: float | None = None, name: str = "iperf3"):
        self.streams, self.seconds, self.host = streams, seconds, host
        self.server_netns, self.client_netns = server_netns, client_netns
        self.link_mbit, self.name = link_mbit, name
        self.port = free_port()
        self.proc = None

    def session(self, ctx: Context):
        log_path = ctx.work / "logs" / f"iperf3-{self.port}.log"
        argv = in_netns(self.server_netns, ["iperf3", "-s", "-p", str(self.port)])
        self.proc = start(ctx.log, argv, log_path)
        try:
            wait_listening(self.port, self.proc, "iperf3 -s", log_path, self.server_netns)
        except BaseException:
            stop(None, self.proc, "iperf3 -s", grace=5)
            raise
        return _Closer(lambda: stop(ctx.log, self.proc, "iperf3 -s", grace=10))

    def measure(self, ctx: Context, run_no: int) -> dict:
        argv = in_netns(self.client_netns, [
            "iperf3", "-c", self.host, "-p", str(self.port), "-P", str(self.streams),
            "-t", str(self.seconds), "-J"])
        res = _check(run(ctx.log, argv, timeout=self.seconds + 60))
        rep = parse_json_report(res)
        try:
            bps = float(rep["end"]["sum_received"]["bits_per_second"])
        except (KeyError, TypeError, ValueError):
            raise BenchError(f"iperf3 JSON has no end.sum_received: {rep.get('error', '')}")
        fig = {"gbit_per_s": bps / 1e9, "mbit_per_s": bps / 1e6,
               "retransmits": rep["end"].get("sum_sent", {}).get("retransmits")}
        if self.link_mbit:
            fig["goodput_pct"] = 100 * bps / 1e6 / self.link_mbit
        return fig


class _Closer:
    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fn()


# --------------------------------------------------------------------------
# copies
# --------------------------------------------------------------------------

class CopyTool(Tool):
    """Copies a data set's src/ into a fresh destination and times it.

    Before each run the destination is removed and the page cache dropped;
    afterwards the copy is checked against the source and removed again.
    Figures: wall seconds from spawn to exit, files/s, MB/s (10^6 B), and the
    same rate including a `sync` after the command (write-back not counted
    in `seconds`)."""

    def __init__(self, dataset: Dataset, link_mbit: float | None = None):
        self.dataset, self.link_mbit = dataset, link_mbit

    def dest(self, ctx: Context, run_no: int) -> Path:
        return ctx.work / "out" / self.name.replace(" ", "_") / f"dst-{run_no}"

    def command(self, ctx: Context, src: Path, dest: Path, run_no: int) -> list[str]:
        raise NotImplementedError

    def wrap(self, ctx: Context, argv: list[str], run_no: int) -> list[str]:
        return argv

    def parse(self, ctx: Context, res: Result) -> dict:
        return {}

    def measure(self, ctx: Context, run_no: int) -> dict:
        ds = self.dataset
        src, dest = ds.src(ctx.scratch), self.dest(ctx, run_no)
        remove_tree(ctx.log, dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if ctx.cold_cache:
            drop_caches(ctx.log)
        argv = self.wrap(ctx, self.command(ctx, src, dest, run_no), run_no)
        res = _check(run(ctx.log, argv, timeout=ctx.timeout))
        t0 = time.monotonic()
        os.sync()
        sync_s = time.monotonic() - t0
        fig = {"seconds": res.seconds, "files": ds.files, "bytes": ds.total_bytes,
               "files_per_s": ds.files / res.seconds,
               "mb_per_s": ds.total_bytes / MB / res.seconds,
               "sync_seconds": sync_s,
               "mb_per_s_with_sync": ds.total_bytes / MB / (res.seconds + sync_s)}
        if self.link_mbit:
            fig["goodput_mbit"] = ds.total_bytes * 8 / 1e6 / res.seconds
            fig["goodput_pct"] = 100 * fig["goodput_mbit"] / self.link_mbit
        fig.update(self.parse(ctx, res))
        verify_copy(ds, src, dest)
        remove_tree(None, dest)
        return fig


class Rsync(CopyTool):
    name = "rsync"

    def command(self, ctx, src, dest, run_no):
        return ["rsync", "-a", f"{src}/", f"{dest}/"]


class Rclone(CopyTool):
    name = "rclone"

    def command(self, ctx, src, dest, run_no):
        return ["rclone", "copy", "--transfers", "8", str(src), str(dest)]


class Cp(CopyTool):
    name = "cp -r"

    def command(self, ctx, src, dest, run_no):
        return ["cp", "-r", str(src), str(dest)]


class DmoverCopy(CopyTool):
    """`dmover cp` into a dmover server (loopback, or across a netns link)."""

    def __init__(self, dataset: Dataset, options: tuple[str, ...] = (), *,
                 host: str = "127.0.0.1", server_netns: str | None = None,
                 client_netns: str | None = None, link_mbit: float | None = None,
                 name: str = "dmover"):
        super().__init__(dataset, link_mbit)
        self.options, self.host, self.name = options, host, name
        self.server_netns, self.client_netns = server_netns, client_netns
        self.server: DmoverServer | None = None

    def new_server(self, ctx: Context) -> DmoverServer:
        export = ctx.work / f"export-{self.name.replace(' ', '_')}"
        return DmoverServer(ctx, export, host=self.host, netns=self.server_netns)

    def session(self, ctx: Context):
        self.server = self.new_server(ctx)
        return self.server

    def dest(self, ctx, run_no):
        return self.server.export_dir / f"dst-{run_no}"

    def command(self, ctx, src, dest, run_no):
        return in_netns(self.client_netns, [
            str(ctx.dmover), "cp", "--json", *self.options, "--token-file", str(ctx.token()),
            f"{src}/", self.server.url(f"dst-{run_no}/")])

    def parse(self, ctx, res):
        rep = parse_json_report(res)
        check_cp_report(rep, self.dataset, res)
        if isinstance(rep.get("seconds"), (int, float)) and rep["seconds"] > 0:
            _check_reported_rate(ctx, rep.get("mb_per_s"), rep["bytes"], rep["seconds"])
        return {"reported_seconds": rep.get("seconds"),
                "reported_files_per_s": rep.get("files_per_s"),
                "sent_bytes": rep.get("sent_bytes"), "retries": rep.get("retries"),
                "resent_blocks": rep.get("resent_blocks")}


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


class DmoverPeakRss(DmoverCopy):
    """`dmover cp` under /usr/bin/time -v into a fresh server per run; adds
    the client's maximum RSS and the server's VmHWM (read before SIGTERM)."""

    def session(self, ctx):
        return contextlib.nullcontext()

    def wrap(self, ctx, argv, run_no):
        self.time_file = ctx.work / "logs" / f"time-v-{run_no}.txt"
        return ["/usr/bin/time", "-v", "-o", str(self.time_file), *argv]

    def measure(self, ctx, run_no):
        with self.new_server(ctx) as self.server:
            fig = super().measure(ctx, run_no)
            fig["server_rss_mib"] = self.server.peak_rss_mib()
        text = self.time_file.read_text()
        match = re.search(r"Maximum resident set size \(kbytes\):\s*(\d+)", text)
        if not match:
            raise BenchError(f"no maximum RSS in the output of /usr/bin/time -v:\n{text}")
        fig["client_rss_mib"] = int(match.group(1)) / 1024
        return fig


# --------------------------------------------------------------------------
# disk baseline
# --------------------------------------------------------------------------

class Fio(Tool):
    """fio sequential write then read with direct I/O: what the disk can do."""

    name = "fio"

    def __init__(self, size: str):
        self.size = size

    def _job(self, ctx: Context, rw: str) -> float:
        argv = ["fio", "--name=seq" + rw, f"--filename={ctx.work / 'fio.dat'}", f"--rw={rw}",
                "--bs=1M", f"--size={self.size}", "--direct=1", "--ioengine=psync",
                "--output-format=json"]
        rep = parse_json_report(_check(run(ctx.log, argv, timeout=ctx.timeout)))
        return rep["jobs"][0][rw]["bw_bytes"] / MB

    def measure(self, ctx: Context, run_no: int) -> dict:
        try:
            return {"write_mb_per_s": self._job(ctx, "write"),
                    "read_mb_per_s": self._job(ctx, "read")}
        finally:
            (ctx.work / "fio.dat").unlink(missing_ok=True)
