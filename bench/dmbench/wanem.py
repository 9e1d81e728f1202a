"""An emulated WAN link between two network namespaces, via tools/wanem.

Used as a context manager: the link is torn down on every way out, and a
link with the same names left behind by an aborted earlier run is torn down
before a new one is brought up. An idle process kept in namespace B lets
the harness read B's interface counters through /proc/PID/net/dev.
"""

from __future__ import annotations

import re
from pathlib import Path

from .core import Context
from .system import BenchError, run, start, stop

STATE_DIR = Path("/run/wanem")
LINK_DOWN = "the emulated link is down"


def find_wanem(repo: Path) -> Path:
    """The emulator's scripts, in the repository."""
    return repo / "tools" / "wanem"


class WanLink:

    def __init__(self, ctx: Context, wanem_dir: Path, *, ns_a: str, ns_b: str, subnet: int,
                 delay_ms: float, rate_mbit: float, queue_pkts: int, loss: float,
                 timeout_s: int):
        self.ctx, self.dir = ctx, wanem_dir
        self.ns_a, self.ns_b, self.subnet = ns_a, ns_b, subnet
        self.delay_ms, self.rate_mbit, self.timeout_s = delay_ms, rate_mbit, timeout_s
        self.queue_pkts, self.loss = queue_pkts, loss
        self.ip_a, self.ip_b = f"10.250.{subnet}.1", f"10.250.{subnet}.2"
        # TUN device names of our own, so as not to meet other links' devices
        self.dev_a, self.iface = f"{ns_a}-tun", f"{ns_b}-tun"
        self.anchor = None
        self.pid = 0

    @property
    def anchor_pid(self) -> int:
        return self.anchor.pid

    def _down(self, record: bool) -> str:
        res = run(self.ctx.log if record else None,
                  [str(self.dir / "wanem-down"), self.ns_a, self.ns_b], timeout=60)
        return res.stdout + res.stderr

    def __enter__(self) -> "WanLink":
        if (STATE_DIR / f"{self.ns_a}-{self.ns_b}.state").exists():
            self.ctx.note(f"a {self.ns_a}/{self.ns_b} link left by an earlier run was torn down")
            self._down(record=True)
        # --timeout-s: the emulator stops by itself even if this harness is killed.
        argv = [str(self.dir / "wanem-up"), "--subnet", str(self.subnet),
                "--delay-ms", f"{self.delay_ms:g}", "--rate-mbit", f"{self.rate_mbit:g}",
                "--queue-pkts", str(self.queue_pkts), "--loss", f"{self.loss:g}",
                "--dev-a", self.dev_a, "--dev-b", self.iface,
                "--timeout-s", str(self.timeout_s), self.ns_a, self.ns_b]
        res = run(self.ctx.log, argv, timeout=120)
        if res.rc != 0:
            raise BenchError(f"cannot bring the emulated link up: {res.describe()}")
        self.pid = int((STATE_DIR / f"{self.ns_a}-{self.ns_b}.pid").read_text().split()[0])
        self.anchor = start(self.ctx.log, ["ip", "netns", "exec", self.ns_b, "sleep", "infinity"],
                            self.ctx.work / "logs" / "anchor.log")
        return self

    def down(self) -> bool:
        """Has the emulator exited? The link then carries nothing."""
        try:
            return b"wanem" not in Path(f"/proc/{self.pid}/cmdline").read_bytes()
        except OSError:
            return True

    def check(self) -> None:
        """Raise BenchError if the link is down, with the kernel's word on why."""
        if not self.down():
            return
        kernel = run(None, ["dmesg"], timeout=30).stdout.splitlines()
        why = [line for line in kernel if f"wanem[{self.pid}]" in line][-1:]
        raise BenchError(f"{LINK_DOWN}: the emulator (wanem, pid {self.pid}) "
                         "exited during this run" + (f"; kernel log: {why[0]}" if why else ""))

    def __exit__(self, *exc) -> None:
        if self.anchor:
            stop(self.ctx.log, self.anchor, f"sleep in {self.ns_b}", grace=5)
        out = self._down(record=True)
        counters = [line.strip() for line in out.splitlines()
                    if line.strip().startswith("wanem: ")]
        if counters:
            self.ctx.note("wanem counters at teardown (check `kernel-txdrop` and `late`):\n"
                          + "\n".join(counters))
        drops = [int(n) for n in re.findall(r"kernel-txdrop (\d+)", out)]
        if any(drops):
            self.ctx.note(f"wanem reported kernel-txdrop {drops}: the emulator was starved "
                          "of CPU at times; WAN figures may be pessimistic")
