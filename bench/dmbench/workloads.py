"""The workloads of the suite, in report order. Add new ones to WORKLOADS.

Each workload has a full size and a --quick size (a smoke test of the
harness: same steps, much less data, verdicts only indicative).
"""

from __future__ import annotations

from .core import Context, Row, Target, Workload
from .datasets import Dataset
from .tools import Cp, DmoverBench, DmoverCopy, DmoverPeakRss, Fio, Iperf3, Rclone, Rsync
from .wanem import WanLink


def pick(ctx: Context, full, quick):
    return quick if ctx.quick else full


class DiskBaseline(Workload):
    key = "disk"
    title = "Disk baseline (fio, reference only)"

    def size(self, ctx):
        return pick(ctx, "1G", "64M")

    def describe(self, ctx):
        return (f"Sequential write then read of a file of `--size={self.size(ctx)}` in the scratch "
                "directory, 1 MiB blocks, direct I/O. No target: it shows what the disk "
                "under the disk-to-disk workloads can do.")

    def tools(self, ctx):
        return [Fio(self.size(ctx))]

    def rows(self, ctx):
        return [Row("sequential write (MB/s)", "fio", "write_mb_per_s"),
                Row("sequential read (MB/s)", "fio", "read_mb_per_s")]


class MemToMem(Workload):
    key = "mem2mem"
    title = "Memory to memory over loopback"
    STREAMS = 4

    def params(self, ctx):
        return pick(ctx, ("4G", 10), ("512M", 2))

    def describe(self, ctx):
        size, secs = self.params(ctx)
        return (f"`dmover bench --size {size}` sends data generated in memory over "
                f"{self.STREAMS} streams "
                f"to a `dmover serve` on 127.0.0.1 (rate from its JSON report: bytes / "
                f"seconds); iperf3 runs {self.STREAMS} streams for {secs} s "
                "(end.sum_received). Gbit/s = 10^9 bit/s.")

    def tools(self, ctx):
        size, secs = self.params(ctx)
        return [DmoverBench(size, self.STREAMS),
                Iperf3(self.STREAMS, secs, name=f"iperf3 -P {self.STREAMS}")]

    def rows(self, ctx):
        return [Row("throughput (Gbit/s)", "dmover", "gbit_per_s", f"iperf3 -P {self.STREAMS}",
                    Target(">=", 0.90, "≥ 90 % of iperf3"))]


class SmallFiles(Workload):
    key = "small-files"
    title = "Small files, disk to disk over loopback"

    def dataset(self, ctx):
        return pick(ctx, Dataset(5000, 64 << 10, 20), Dataset(500, 64 << 10, 20))

    def describe(self, ctx):
        return (f"{self.dataset(ctx).describe()}. dmover copies to a `dmover serve` on "
                "127.0.0.1; rsync and rclone copy locally. files/s = files / wall seconds "
                "of the command (spawn to exit). Destination removed and page cache dropped "
                "before every run; every copy is checked afterwards.")

    def datasets(self, ctx):
        return [self.dataset(ctx)]

    def tools(self, ctx):
        ds = self.dataset(ctx)
        return [DmoverCopy(ds), Rsync(ds), Rclone(ds)]

    def rows(self, ctx):
        beat = Target(">", 1.0, "more files/s than the peer")
        return [Row("files/s", "dmover", "files_per_s", "rsync", beat),
                Row("files/s", "dmover", "files_per_s", "rclone", beat)]


class LargeFiles(Workload):
    key = "large-files"
    title = "Large files, disk to disk over loopback"

    def dataset(self, ctx):
        return pick(ctx, Dataset(4, 512 << 20), Dataset(4, 32 << 20))

    def describe(self, ctx):
        return (f"{self.dataset(ctx).describe()}. dmover copies to a `dmover serve` on "
                "127.0.0.1; `cp -r` copies locally. MB/s = 10^6 bytes / wall seconds of the "
                "command; page cache dropped before every run. The second row adds the time "
                "of a `sync` after the command (write-back of dirty pages).")

    def datasets(self, ctx):
        return [self.dataset(ctx)]

    def tools(self, ctx):
        ds = self.dataset(ctx)
        return [DmoverCopy(ds), Cp(ds)]

    def rows(self, ctx):
        return [Row("MB/s", "dmover", "mb_per_s", "cp -r", Target(">=", 0.75, "≥ 75 % of cp")),
                Row("MB/s including final sync", "dmover", "mb_per_s_with_sync", "cp -r")]


class Wan(Workload):
    key = "wan"
    title = "WAN: 25 ms one-way delay, 100 Mbit/s (wanem)"
    NS_A, NS_B, SUBNET = "dmbA", "dmbB", 7
    DELAY_MS, RATE_MBIT = 25, 100

    def dataset(self, ctx):
        return pick(ctx, Dataset(2000, 64 << 10, 20), Dataset(200, 64 << 10, 20))

    def iperf_seconds(self, ctx):
        return pick(ctx, 10, 3)

    def describe(self, ctx):
        return (f"Emulated link between namespaces {self.NS_A} (client) and {self.NS_B} "
                f"(server): {self.DELAY_MS} ms each way (RTT {2 * self.DELAY_MS} ms), "
                f"{self.RATE_MBIT} Mbit/s each way, 100-packet queue. "
                f"`dmover cp` with default settings copies {self.dataset(ctx).describe()}. "
                "Goodput = payload bytes / wall seconds from the start of `dmover cp` to its "
                "exit (after verification), as % of the link rate. iperf3 "
                f"(1 stream, {self.iperf_seconds(ctx)} s) through the same link for reference; "
                "TCP payload can reach at most 1448/1500 = 96.5 % of the IP rate.")

    def skip_reason(self, ctx):
        if ctx.wanem_dir is None:
            return "shared/tools/wanem not found"
        return None

    def environment(self, ctx):
        return WanLink(ctx, ctx.wanem_dir, ns_a=self.NS_A, ns_b=self.NS_B, subnet=self.SUBNET,
                       delay_ms=self.DELAY_MS, rate_mbit=self.RATE_MBIT,
                       timeout_s=pick(ctx, 3600, 900))

    def datasets(self, ctx):
        return [self.dataset(ctx)]

    def tools(self, ctx):
        b_ip = f"10.250.{self.SUBNET}.2"
        return [Iperf3(1, self.iperf_seconds(ctx), host=b_ip, server_netns=self.NS_B,
                       client_netns=self.NS_A, link_mbit=self.RATE_MBIT, name="iperf3"),
                DmoverCopy(self.dataset(ctx), host=b_ip, server_netns=self.NS_B,
                           client_netns=self.NS_A, link_mbit=self.RATE_MBIT)]

    def rows(self, ctx):
        return [Row(f"goodput (% of {self.RATE_MBIT} Mbit/s)", "dmover", "goodput_pct",
                    "iperf3", Target(">=", 85, "≥ 85 % of the link", on="value"))]


class PeakRss(Workload):
    key = "peak-rss"
    title = "Peak memory (RSS), --streams 8, loopback"

    def dataset(self, ctx):
        return pick(ctx, Dataset(1, 2 << 30), Dataset(1, 256 << 20))

    def describe(self, ctx):
        return (f"`dmover cp --streams 8` (other settings default) of "
                f"{self.dataset(ctx).describe()} to a fresh `dmover serve` on 127.0.0.1 "
                "per run. Client: maximum resident set size from `/usr/bin/time -v`; "
                "server: VmHWM from /proc/PID/status just before SIGTERM. "
                "MiB = 2^20 bytes; judged on the worst run.")

    def datasets(self, ctx):
        return [self.dataset(ctx)]

    def tools(self, ctx):
        return [DmoverPeakRss(self.dataset(ctx), ("--streams", "8"))]

    def rows(self, ctx):
        return [Row("client peak RSS (MiB)", "dmover", "client_rss_mib",
                    target=Target("<=", 128, "≤ 128 MiB", on="value", stat="max")),
                Row("server peak RSS (MiB)", "dmover", "server_rss_mib",
                    target=Target("<=", 128, "≤ 128 MiB", on="value", stat="max"))]


WORKLOADS: list[type[Workload]] = [MemToMem, SmallFiles, LargeFiles, Wan, PeakRss, DiskBaseline]

