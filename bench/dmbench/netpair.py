"""Two network namespaces joined by an emulated WAN link (tools/wanem), for
the benchmarks that run a server in one (B) and their clients in the other
(A): bring the link up and down, run a timed command in A, measure the
link's limit with iperf3 -P 8. Also the small helpers those benchmarks
share: run and echo a command, show a command portably, digest a tree.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
WANEM = REPO / "tools" / "wanem"


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Runs a command (echoed first); raises if it fails."""
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, text=True, **kw)


def portable(text: str, work: Path) -> str:
    """A command as a reader can run it from the repository: paths in it
    relative to the repository, the work directory as $WORK (--work)."""
    return text.replace(f"{REPO}/", "").replace(str(work), "$WORK")


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file below root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
            out[str(p.relative_to(root))] = h.hexdigest()
    return out


def measure(argv: list[str], timeout: int, ns: str | None = None,
            env: dict[str, str] | None = None) -> tuple[float | None, str]:
    """Runs argv (in namespace ns, if given); its wall seconds, or None and why it failed."""
    cmd = ["ip", "netns", "exec", ns, *argv] if ns else argv
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    took = time.monotonic() - t0
    if r.returncode != 0:
        return None, f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"
    return took, ""


class Pair:
    """Namespaces A and B on 10.250.SUBNET.0/24, A at .1 and B at .2."""

    def __init__(self, ns_a: str, ns_b: str, subnet: int):
        self.ns_a, self.ns_b, self.subnet = ns_a, ns_b, subnet
        self.ip_a, self.ip_b = f"10.250.{subnet}.1", f"10.250.{subnet}.2"

    def up(self, row: dict) -> list[str]:
        """Brings the link up as row says (delay_ms, rate_mbit, queue_pkts,
        loss, cubic: CUBIC on the route in both namespaces); returns the
        commands that did it."""
        self.down()
        up = [str(WANEM / "wanem-up"), "--subnet", str(self.subnet), "--delay-ms", str(row["delay_ms"]),
              "--rate-mbit", str(row["rate_mbit"]), "--queue-pkts", str(row["queue_pkts"]),
              "--loss", str(row["loss"]), "--dev-a", f"{self.ns_a}-tun", "--dev-b", f"{self.ns_b}-tun",
              "--timeout-s", "7200", self.ns_a, self.ns_b]
        sh(up)
        cmds = [" ".join(up)]
        if row.get("cubic"):
            for ns, dst, src in ((self.ns_a, self.ip_b, self.ip_a), (self.ns_b, self.ip_a, self.ip_b)):
                c = ["ip", "-n", ns, "route", "replace", dst, "dev", f"{ns}-tun", "proto", "kernel", "scope", "link",
                     "src", src, "congctl", "cubic"]
                sh(c)
                cmds.append(" ".join(c))
        return cmds

    def down(self) -> None:
        """Tears the link down, if it is up."""
        if Path(f"/run/wanem/{self.ns_a}-{self.ns_b}.state").exists():
            subprocess.run([str(WANEM / "wanem-down"), self.ns_a, self.ns_b])

    def iperf3(self, reverse: bool, seconds: int = 10) -> float:
        """iperf3 -P 8 from A to B (reverse: B sends to A). Mbit/s received."""
        end, _ = self._iperf3(reverse, ["-t", str(seconds)])
        return end["sum_received"]["bits_per_second"] / 1e6

    def iperf3_bytes(self, reverse: bool, nbytes: int) -> tuple[float, float]:
        """`iperf3 -P 8 -n NBYTES` from A to B (reverse: B sends to A): how
        long TCP itself takes to move that much from a cold start. Wall
        seconds from the client's start to its exit (its own setup and
        results exchange included), and seconds of its data phase alone."""
        end, wall = self._iperf3(reverse, ["-n", str(nbytes)])
        return wall, end["sum_received"]["seconds"]

    def _iperf3(self, reverse: bool, extra: list[str]) -> tuple[dict, float]:
        srv = subprocess.Popen(["ip", "netns", "exec", self.ns_b, "iperf3", "-s", "-1", "-B", self.ip_b],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        try:
            argv = ["ip", "netns", "exec", self.ns_a, "iperf3", "-c", self.ip_b, "-P", "8", *extra, "-J"]
            t0 = time.monotonic()
            out = sh(argv + (["-R"] if reverse else []), capture_output=True).stdout
            wall = time.monotonic() - t0
        finally:
            srv.wait(30)
        return json.loads(out)["end"], wall
