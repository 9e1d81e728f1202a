"""Resource use of the programs under test.

A client's CPU seconds (user + sys) and peak RSS come from /usr/bin/time; a
server's from /proc: the CPU time of its process plus that of the children
it has reaped (a forking server's per-connection processes), and its peak
RSS as the larger of its VmHWM (reset before each run) and the summed RSS of
its process tree sampled every 100 ms. The same sampler reads a network
interface's receive counter, for the throughput-over-time plots.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from .system import BenchError

TIME_FORMAT = "%e %U %S %M"
SAMPLE_S = 0.1
CLK_TCK = os.sysconf("SC_CLK_TCK")


def timed(argv: list[str], out: Path) -> list[str]:
    """argv under /usr/bin/time, which writes its figures to `out`."""
    return ["/usr/bin/time", "-f", TIME_FORMAT, "-o", str(out), *argv]


def read_timed(out: Path) -> dict:
    try:
        _wall, user, sys_, rss_kib = out.read_text().split()[-4:]
        return {"client_cpu_s": float(user) + float(sys_), "client_rss_mib": int(rss_kib) / 1024}
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read the output of /usr/bin/time in {out}: {exc}")


def _stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of a process, in seconds."""
    fields = _stat_fields(pid)
    return sum(int(x) for x in fields[11:15]) / CLK_TCK


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo += _children(p)
    return pids


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_kib(pid: int) -> int:
    return sum(_status_kib(p, "VmRSS") for p in tree(pid))


class ServerUsage:
    """CPU and peak memory of a server process (tree) over one run."""

    def __init__(self, pid: int):
        self.pid = pid
        Path(f"/proc/{pid}/clear_refs").write_text("5\n")   # resets VmHWM
        self.cpu0 = cpu_seconds(pid)

    def finish(self, sampled_rss_kib: int) -> dict:
        deadline = time.monotonic() + 5
        while _children(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)          # per-connection processes still exiting
        peak = max(_status_kib(self.pid, "VmHWM"), sampled_rss_kib)
        return {"server_cpu_s": cpu_seconds(self.pid) - self.cpu0,
                "server_rss_mib": peak / 1024}


class Sampler(threading.Thread):
    """Every 100 ms: the summed RSS of a server's tree and the received
    bytes (or with `sent`, the sent bytes) of interface `iface` in the
    network namespace of process `netns_pid` (read through
    /proc/PID/net/dev, so no process is spawned)."""

    def __init__(self, server_pid: int | None, netns_pid: int | None, iface: str | None,
                 sent: bool = False):
        super().__init__(daemon=True)
        self.server_pid, self.iface = server_pid, iface
        self.column = 8 if sent else 0     # /proc/net/dev: bytes received, ..., bytes sent
        self.dev = Path(f"/proc/{netns_pid}/net/dev") if netns_pid and iface else None
        self.peak_rss_kib = 0
        self.samples: list[tuple[float, int]] = []
        self._done = threading.Event()

    def rx_bytes(self) -> int | None:
        """None once the interface is gone (the link's own check reports that)."""
        try:
            for line in self.dev.read_text().splitlines():
                name, _, rest = line.partition(":")
                if name.strip() == self.iface:
                    return int(rest.split()[self.column])
        except OSError:
            pass
        return None

    def run(self) -> None:
        t0 = time.monotonic()
        while True:
            if self.server_pid:
                self.peak_rss_kib = max(self.peak_rss_kib, tree_rss_kib(self.server_pid))
            rx = self.rx_bytes() if self.dev else None
            if rx is not None:
                self.samples.append((time.monotonic() - t0, rx))
            if self._done.wait(SAMPLE_S):
                return

    def __enter__(self) -> "Sampler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self.join()

    def timeline(self) -> list[list[float]]:
        """[seconds, Mbit/s] per sampling interval."""
        return [[round(t1, 2), round((b1 - b0) * 8 / 1e6 / (t1 - t0), 2)]
                for (t0, b0), (t1, b1) in zip(self.samples, self.samples[1:]) if t1 > t0]
