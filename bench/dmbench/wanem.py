"""An emulated WAN link between two network namespaces, via shared/tools/wanem.

Used as a context manager: the link is torn down on every way out, and a
link with the same names left behind by an aborted earlier run is torn down
before a new one is brought up.
"""

from __future__ import annotations

import re
from pathlib import Path

from .core import Context
from .system import BenchError, run

STATE_DIR = Path("/run/wanem")


def find_wanem(repo: Path) -> Path | None:
    """shared/tools/wanem beside the repository (as in CI), or /work/shared."""
    for cand in (repo.parent / "shared" / "tools" / "wanem",
                 Path("/work/shared/tools/wanem")):
        if (cand / "wanem-up").is_file() and (cand / "wanem-down").is_file():
            return cand
    return None


class WanLink:
    def __init__(self, ctx: Context, wanem_dir: Path, *, ns_a: str, ns_b: str, subnet: int,
                 delay_ms: float, rate_mbit: float, timeout_s: int):
        self.ctx, self.dir = ctx, wanem_dir
        self.ns_a, self.ns_b, self.subnet = ns_a, ns_b, subnet
        self.delay_ms, self.rate_mbit, self.timeout_s = delay_ms, rate_mbit, timeout_s
        self.ip_a, self.ip_b = f"10.250.{subnet}.1", f"10.250.{subnet}.2"

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
                "--timeout-s", str(self.timeout_s), self.ns_a, self.ns_b]
        res = run(self.ctx.log, argv, timeout=120)
        if res.rc != 0:
            raise BenchError(f"cannot bring the emulated link up: {res.describe()}")
        return self

    def __exit__(self, *exc) -> None:
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
