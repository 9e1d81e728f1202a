"""Process, host and page-cache helpers shared by every workload.

Everything the harness executes goes through `run()` or `start()`, which
record the exact command line in the context's command log so that the
report can print it.
"""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Binaries the harness needs, and the Debian package that provides each.
REQUIRED_BINARIES = {
    "iperf3": "iperf3",
    "rsync": "rsync",
    "rclone": "rclone",
    "fio": "fio",
    "/usr/bin/time": "time",
    "fincore": "util-linux",
    "ss": "iproute2",
    "ip": "iproute2",
    "globus-gridftp-server": "globus-gridftp-server-progs",
    "globus-url-copy": "globus-gass-copy-progs",
    "perf": "linux-perf",
}


class BenchError(Exception):
    """A step failed; the message says what and is shown in the report."""


# --------------------------------------------------------------------------
# command log
# --------------------------------------------------------------------------

# The repository: results name files in it relative to its root, so that
# they hold no path of the machine they were measured on.
REPO = Path(__file__).resolve().parents[2]


def shown(text: str) -> str:
    """`text` with paths inside the repository made relative to its root."""
    return text.replace(f"{REPO}/", "")


@dataclass
class CommandLog:
    """Commands of one workload, grouped by phase ("setup", "run 1", ...)."""

    phase: str = "setup"
    entries: list[tuple[str, str]] = field(default_factory=list)

    def add(self, line: str) -> None:
        self.entries.append((self.phase, shown(line)))

    def lines(self, phase: str) -> list[str]:
        return [line for p, line in self.entries if p == phase]


def _shell_line(argv: list[str], env: dict[str, str] | None) -> str:
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    return prefix + shlex.join(argv)


# --------------------------------------------------------------------------
# running commands
# --------------------------------------------------------------------------

@dataclass
class Result:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    def tail(self, n: int = 15) -> str:
        text = (self.stderr.strip() + "\n" + self.stdout.strip()).strip()
        return "\n".join(text.splitlines()[-n:])

    def describe(self) -> str:
        what = "timed out" if self.timed_out else f"exited with code {self.rc}"
        return f"`{shlex.join(self.argv)}` {what}:\n{self.tail()}"


def in_netns(netns: str | None, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", netns, *argv] if netns else list(argv)


def run(log: CommandLog | None, argv: list[str], *, timeout: float = 600,
        env: dict[str, str] | None = None, cwd: str | None = None,
        abort_if: Callable[[], bool] | None = None) -> Result:
    """Run argv to completion, timing it from spawn to exit.

    The child gets its own session so that, on timeout, its whole process
    group (and nothing else) can be killed. `abort_if` is polled every
    second; when it returns True the child is killed as on a timeout.
    """
    if log is not None:
        log.add(_shell_line(argv, env))
    full_env = dict(os.environ, **(env or {}))
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, errors="replace",
                                env=full_env, cwd=cwd, start_new_session=True)
    except OSError as exc:
        return Result(argv, 127, "", f"cannot execute: {exc}", 0.0)
    timed_out = False
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=1 if abort_if else timeout)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 >= timeout or (abort_if and abort_if()):
                    timed_out = True
                    kill_group(proc.pid)
                    out, err = proc.communicate()
                    break
    except BaseException:          # e.g. SIGTERM to the harness: take the child along
        kill_group(proc.pid)
        proc.wait()
        raise
    seconds = time.monotonic() - t0
    return Result(argv, proc.returncode, out, err, seconds, timed_out)


def kill_group(pid: int) -> None:
    """SIGKILL the process group `pid` leads (what is left of it)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# Background processes we started, so that they can be stopped on any exit.
_BACKGROUND: dict[int, subprocess.Popen] = {}


def start(log: CommandLog | None, argv: list[str], log_path: Path) -> subprocess.Popen:
    """Start a long-running process (a server) with output going to log_path."""
    if log is not None:
        log.add(shlex.join(argv) + f" > {log_path} 2>&1 &")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    _BACKGROUND[proc.pid] = proc
    return proc


def stop(log: CommandLog | None, proc: subprocess.Popen, name: str,
         grace: float = 40) -> int | None:
    """SIGTERM a process we started, wait up to `grace` s, then SIGKILL it.

    Returns its exit code (None if it had to be killed).
    """
    if log is not None:
        log.add(f"kill -TERM <pid of {name}>")
    _BACKGROUND.pop(proc.pid, None)
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.wait()
        return None


def stop_all_background() -> None:
    """Last-resort cleanup: kill what we started and is still running."""
    for proc in list(_BACKGROUND.values()):
        stop(None, proc, "background", grace=5)


def log_tail(path: Path, n: int = 10) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# --------------------------------------------------------------------------
# network helpers
# --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_listening(port: int, netns: str | None = None) -> bool:
    argv = in_netns(netns, ["ss", "-Hltn", f"sport = :{port}"])
    res = subprocess.run(argv, capture_output=True, text=True)
    return res.returncode == 0 and bool(res.stdout.strip())


def wait_listening(port: int, proc: subprocess.Popen, what: str, log_path: Path,
                   netns: str | None = None, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with code {proc.returncode} at start:\n"
                             f"{log_tail(log_path)}")
        if is_listening(port, netns):
            return
        time.sleep(0.05)
    raise BenchError(f"{what} is not listening on port {port} after {timeout:.0f} s:\n"
                     f"{log_tail(log_path)}")


# --------------------------------------------------------------------------
# page cache
# --------------------------------------------------------------------------

DROP_CACHES_LINE = "sync; echo 3 > /proc/sys/vm/drop_caches"


def drop_caches(log: CommandLog | None) -> bool:
    """Flush dirty pages and drop the page cache. False if not permitted."""
    if log is not None:
        log.add(DROP_CACHES_LINE)
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def resident_bytes(path: Path) -> int | None:
    """Bytes of `path` that are in the page cache (via fincore), or None."""
    if not shutil.which("fincore"):
        return None
    res = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True)
    try:
        return int(res.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def check_drop_caches(scratch: Path) -> tuple[bool, str]:
    """Verify that dropping the page cache really evicts a file we just read."""
    probe = scratch / "drop-caches-probe.bin"
    probe.write_bytes(os.urandom(16 << 20))
    probe.read_bytes()
    before = resident_bytes(probe)
    ok = drop_caches(None)
    after = resident_bytes(probe)
    probe.unlink()
    if not ok:
        return False, "writing /proc/sys/vm/drop_caches is not permitted; runs are NOT cold-cache"
    if before is None or after is None:
        return True, "page cache dropped before each disk run (eviction not verified: no fincore)"
    if after > before // 2:
        return False, (f"drop_caches did not evict a test file ({after} of {before} bytes still "
                       "cached); runs are NOT cold-cache")
    return True, (f"page cache dropped before each disk run; verified: a 16 MiB test file went "
                  f"from {before >> 20} MiB to {after >> 20} MiB cached")


# --------------------------------------------------------------------------
# installation and machine description
# --------------------------------------------------------------------------

def apt_install(packages: list[str]) -> None:
    """apt-get install -y the packages; run apt-get update once if needed."""
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    print(f"installing: {' '.join(packages)}", flush=True)
    res = run(None, ["apt-get", "install", "-y", "-q", *packages], env=env, timeout=1200)
    if res.rc != 0:
        run(None, ["apt-get", "update", "-q"], env=env, timeout=1200)
        res = run(None, ["apt-get", "install", "-y", "-q", *packages], env=env, timeout=1200)
    if res.rc != 0:
        raise BenchError(f"apt-get install failed:\n{res.tail()}")


def ensure_binaries(extra: dict[str, str] | None = None) -> None:
    wanted = dict(REQUIRED_BINARIES, **(extra or {}))
    missing = sorted({pkg for binary, pkg in wanted.items() if not shutil.which(binary)})
    if missing:
        apt_install(missing)


def ensure_matplotlib() -> str | None:
    """Make matplotlib importable: python3-matplotlib, else pip for this
    interpreter. Returns None, or why it is not importable."""
    for install in (lambda: apt_install(["python3-matplotlib"]),
                    lambda: run(None, [sys.executable, "-m", "pip", "install", "-q",
                                       "matplotlib"], timeout=1200)):
        try:
            importlib.import_module("matplotlib")
            return None
        except ImportError:
            pass
        try:
            install()
        except BenchError:
            pass
        importlib.invalidate_caches()
    try:
        importlib.import_module("matplotlib")
        return None
    except ImportError as exc:
        return f"{sys.executable} cannot import matplotlib ({exc}) after installing it"


def first_line(argv: list[str], ok_codes: tuple[int, ...] = (0,)) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"
    text = (res.stdout or res.stderr).strip()
    if not text or res.returncode not in ok_codes:
        return "unavailable"
    return " ".join(text.splitlines()[0].split())


def _meminfo_kib(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def dmover_build(dmover: Path) -> str:
    """The label of results measured with `dmover`: what the binary itself
    says with `--version` (version, commit it was built from, commit date),
    not the state of the repository the harness runs in."""
    try:
        res = subprocess.run([str(dmover), "--version"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown: `{dmover} --version` failed ({exc})"
    line = res.stdout.strip().splitlines()[0] if res.stdout.strip() else ""
    if res.returncode != 0 or not line:
        return f"unknown: `{dmover} --version` exited {res.returncode}: {res.stderr.strip()[:200]}"
    if "(" not in line:
        line += " (a build that does not record its commit)"
    return line


def machine_info(dmover: Path, baseline: Path | None = None) -> dict:
    """The machine, the peers' versions, and the build of `dmover` (and of
    the `baseline` binary, if any) by their own `--version`."""
    try:
        cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        cc = "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "memory_gib": round(_meminfo_kib("MemTotal") / (1 << 20), 1),
        "kernel": platform.release(),
        "cpu": _cpu_model(),
        "loadavg_at_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "tcp_congestion_control": cc,
        "dmover_build": dmover_build(dmover),
        "dmover_path": shown(str(dmover)),
        **({"baseline_build": dmover_build(baseline), "baseline_path": shown(str(baseline))}
           if baseline else {}),
        "versions": {
            "iperf3": first_line(["iperf3", "--version"]),
            "rsync": first_line(["rsync", "--version"]),
            "rclone": first_line(["rclone", "version"]),
            "cp": first_line(["cp", "--version"]),
            "fio": first_line(["fio", "--version"]),
            "globus-url-copy": first_line(["globus-url-copy", "-version"], ok_codes=(0, 1)),
            "globus-gridftp-server": first_line(["globus-gridftp-server", "-version"]),
            "perf": first_line(["perf", "--version"]),
        },
    }


def remove_tree(log: CommandLog | None, path: Path) -> None:
    if log is not None:
        log.add(f"rm -rf {shlex.quote(str(path))}")
    shutil.rmtree(path, ignore_errors=True)
    if path.exists() or path.is_symlink():
        path.unlink()
