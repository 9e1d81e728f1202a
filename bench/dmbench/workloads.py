"""The workloads of the suite, in report order. Add new ones to WORKLOADS.

Each workload has a full size and a --quick size (a smoke test of the
harness: same steps, much less data, verdicts only indicative). The data
sets are the DMOVER paper's scaled to a 2-core machine: many small files,
medium files, a few large files, and an HSM-like session of 378 files with
spread sizes.
"""

from __future__ import annotations

from pathlib import Path

from .core import BASELINE, Context, Row, Target, Workload
from .datasets import Dataset
from .system import BenchError
from .tools import (Cp, DmoverBench, DmoverCopy, DmoverDownload, DmoverThirdParty, Fio,
                    GlobusThirdParty, GlobusUrlCopy, GridftpMemory, Iperf3, Rclone, Rsync)
from .wanem import WanLink

STREAMS = (1, 2, 4, 8, 16)


def pick(ctx: Context, full, quick):
    return quick if ctx.quick else full


def dmovers(ctx: Context, make) -> list:
    """dmover's tool `make(baseline=False)` and, with `--baseline`, the
    baseline build's twin `make(baseline=True)` right after it."""
    return [make(baseline=False)] + ([make(baseline=True)] if ctx.baseline else [])


# What the measured build must reach against the baseline build.
NO_SLOWER = Target(">=", 0.95, "≥ 95 % of the baseline")


def against_baseline(ctx: Context, measure: str, key: str, tool: str = "dmover",
                     target: Target | None = NO_SLOWER) -> list[Row]:
    """With `--baseline`, the row comparing `tool` with the baseline build's
    twin on `key` (its ratio is new ÷ baseline); else none."""
    if ctx.baseline is None:
        return []
    return [Row(measure, tool, key, BASELINE + tool.removeprefix("dmover"), target)]


def small(ctx):
    return pick(ctx, Dataset(5000, 64 << 10, 20), Dataset(500, 64 << 10, 20))


def medium(ctx):
    return pick(ctx, Dataset(300, 4 << 20), Dataset(16, 4 << 20))


def large(ctx):
    return pick(ctx, Dataset(4, 512 << 20), Dataset(4, 32 << 20))


def hsm(ctx):
    """The shape of the DMOVER paper's HSM sessions: 378 files from 73 KB to 19 MB."""
    return pick(ctx, Dataset(378, 73_000, max_size=19_000_000), Dataset(40, 73_000, max_size=4_000_000))


MEASURES = ("Wall seconds from spawn to exit; MB/s = 10^6 bytes / wall seconds; CPU = user + "
            "sys seconds of the client (/usr/bin/time) and of the server process with its "
            "reaped children (/proc/PID/stat), per 10^9 bytes moved; peak RSS of the client "
            "(/usr/bin/time) and of the server (VmHWM reset before each run, and the "
            "summed RSS of its process tree sampled every 100 ms).")


class MemToMem(Workload):
    key = "mem2mem"
    title = "Memory to memory over loopback"
    limit = "iperf3"
    STREAMS = 4

    def params(self, ctx):
        return pick(ctx, (4 << 30, 10), (512 << 20, 2))

    def describe(self, ctx):
        nbytes, secs = self.params(ctx)
        return (f"`dmover bench --size {nbytes}` sends data generated in memory over "
                f"{self.STREAMS} streams to a `dmover serve` on 127.0.0.1, which checks and "
                f"discards it; globus-url-copy sends `-len {nbytes}` bytes of /dev/zero to "
                "/dev/null on a GridFTP server on 127.0.0.1; iperf3 (the limit) runs "
                f"{self.STREAMS} streams for {secs} s (its own end.sum_received). "
                "Gbit/s = 10^9 bit/s over the wall seconds of the command. " + MEASURES)

    def tools(self, ctx):
        nbytes, secs = self.params(ctx)
        return [*dmovers(ctx, lambda **b: DmoverBench(str(nbytes), self.STREAMS, **b)),
                GridftpMemory(nbytes), Iperf3(self.STREAMS, secs)]

    def rows(self, ctx):
        return [Row("throughput (Gbit/s)", "dmover", "gbit_per_s", "iperf3",
                    Target(">=", 0.90, "≥ 90 % of iperf3")),
                Row("throughput (Gbit/s)", "dmover", "gbit_per_s", "globus-url-copy"),
                *against_baseline(ctx, "throughput (Gbit/s)", "gbit_per_s")]


class DiskCopy(Workload):
    """Disk to disk over loopback: dmover and every peer on one data set,
    fio's sequential rate as the limit."""

    limit = "fio"
    targets: dict[str, tuple[str, Target]] = {}
    baseline_key = "mb_per_s"     # the figure compared with the baseline build

    def dataset(self, ctx) -> Dataset:
        raise NotImplementedError

    def describe(self, ctx):
        return (f"{self.dataset(ctx).describe()}. dmover copies to a `dmover serve` and "
                "globus-url-copy to a GridFTP server, both on 127.0.0.1 (and, as \"globus-url-copy "
                "third party\", between two endpoints of that server); rsync, rclone and "
                "cp copy locally. The limit is fio's sequential rate with direct I/O (the "
                "lower of write and read, 1 MiB blocks). Destination removed and page cache "
                "dropped before every run; every copy is checked afterwards. dmover reports "
                "a file copied only once it is durable; the peers return with data still in "
                "the page cache, so each figure is also given including a `sync` after the "
                "command, the like-for-like comparison. " + MEASURES)

    def datasets(self, ctx):
        return [self.dataset(ctx)]

    def tools(self, ctx):
        ds = self.dataset(ctx)
        return [*dmovers(ctx, lambda **b: DmoverCopy(ds, **b)),
                GlobusUrlCopy(ds), GlobusThirdParty(ds), Rsync(ds), Rclone(ds), Cp(ds),
                Fio(pick(ctx, "1G", "64M"))]

    def rows(self, ctx):
        # dmover confirms a file only once it is durable; the peers return
        # with their data still in the page cache. So each comparison is
        # given as the command returned and including a final sync (the
        # like-for-like figure), and a build is compared with the baseline
        # including the sync, since a baseline may not make files durable.
        rows, synced = [], []
        for peer in ("globus-url-copy", "globus-url-copy third party", "rsync", "rclone", "cp -r"):
            key, target = self.targets.get(peer, ("mb_per_s", None))
            measure = "files/s" if key == "files_per_s" else "MB/s"
            rows.append(Row(measure, "dmover", key, peer, target))
            synced.append(Row(f"{measure} including a final sync", "dmover", f"{key}_with_sync", peer))
        measure = "files/s" if self.baseline_key == "files_per_s" else "MB/s"
        return rows + synced + against_baseline(ctx, f"{measure} including a final sync", f"{self.baseline_key}_with_sync")


class SmallFiles(DiskCopy):
    key = "small"
    title = "Small files, disk to disk over loopback"
    beat = Target(">", 1.0, "more files/s than the peer")
    targets = {"rsync": ("files_per_s", beat), "rclone": ("files_per_s", beat),
               "globus-url-copy": ("files_per_s", None), "globus-url-copy third party": ("files_per_s", None)}
    baseline_key = "files_per_s"
    # Everything rsync -aHAX keeps: owners, hard links, ACLs, xattrs.
    ARCHIVE = ("-aHAX", "--numeric-ids")

    def dataset(self, ctx):
        return small(ctx)

    def describe(self, ctx):
        return super().describe(ctx) + (f" `dmover {' '.join(self.ARCHIVE)}` keeps what rsync's "
                                        "does (each file's extended attributes read and sent, "
                                        "owners set); it is compared with dmover without flags.")

    def tools(self, ctx):
        archive = DmoverCopy(self.dataset(ctx), self.ARCHIVE, name="dmover " + " ".join(self.ARCHIVE))
        return [*super().tools(ctx), archive]

    def rows(self, ctx):
        archive = Row("files/s including a final sync (median of the rounds' ratios)", "dmover " + " ".join(self.ARCHIVE),
                      "files_per_s_with_sync", "dmover", Target(">=", 0.95, "-aHAX costs at most 5 %"), paired=True)
        return super().rows(ctx) + [archive]


class MediumFiles(DiskCopy):
    key = "medium"
    title = "Medium files, disk to disk over loopback"

    def dataset(self, ctx):
        return medium(ctx)


class LargeFiles(DiskCopy):
    key = "large"
    title = "Large files, disk to disk over loopback"
    targets = {"cp -r": ("mb_per_s", Target(">=", 0.75, "≥ 75 % of cp"))}

    def dataset(self, ctx):
        return large(ctx)


class HsmFiles(DiskCopy):
    """Spread sizes: besides the peers, dmover with a fixed `-p 4` (where
    its tuner starts), to show what the tuner costs or brings here."""

    key = "hsm"
    title = "HSM session (spread sizes), disk to disk over loopback"
    FIXED = ("-p", "4")

    def dataset(self, ctx):
        return hsm(ctx)

    def describe(self, ctx):
        return super().describe(ctx) + (f" `dmover {' '.join(self.FIXED)}` is dmover with a fixed "
                                        "count of streams, where its tuner starts.")

    def tools(self, ctx):
        fixed = DmoverCopy(self.dataset(ctx), self.FIXED, name="dmover " + " ".join(self.FIXED))
        return [*super().tools(ctx), fixed]

    def rows(self, ctx):
        tuned = Row("MB/s including a final sync", "dmover", "mb_per_s_with_sync",
                    "dmover " + " ".join(self.FIXED),
                    Target(">=", 0.95, "the tuner costs at most 5 %"))
        return super().rows(ctx) + [tuned]


class Wan(Workload):
    """An emulated link between namespaces dmbA (clients) and dmbB (servers)."""

    limit = "iperf3"
    NS_A, NS_B, SUBNET = "dmbA", "dmbB", 7
    delay_ms = rate_mbit = queue_pkts = 0
    loss = 0.0
    target: Target | None = None

    def dataset(self, ctx) -> Dataset:
        raise NotImplementedError

    def iperf_seconds(self, ctx):
        return pick(ctx, 10, 3)

    def describe(self, ctx):
        loss = f", {self.loss * 100:g} % random loss each way" if self.loss else ""
        return (f"Emulated link (wanem) between namespaces {self.NS_A} (clients) and "
                f"{self.NS_B} (servers): {self.delay_ms} ms each way (RTT "
                f"{2 * self.delay_ms} ms), {self.rate_mbit} Mbit/s each way, "
                f"{self.queue_pkts}-packet queue{loss}. Each tool copies "
                f"{self.dataset(ctx).describe()} from {self.NS_A} to {self.NS_B}: dmover to a "
                "`dmover serve`, globus-url-copy to a GridFTP server, rsync to an `rsync "
                "--daemon`, all in " + self.NS_B + "; `dmover download` copies the set "
                f"back from a `dmover serve` in {self.NS_B} that exports it into {self.NS_A}, "
                f"and in `dmover third party` a `dmover serve` in {self.NS_A} that exports "
                f"it pushes it to the one in {self.NS_B} (the client in {self.NS_A}); every "
                "dmover row runs with its default settings (tuned streams); the page cache "
                "is dropped and the destination removed before each run. The limit is "
                f"iperf3 with 4 streams from {self.NS_A} to {self.NS_B} (the link is the "
                "same both ways) "
                f"for {self.iperf_seconds(ctx)} s. Goodput = payload bytes / wall seconds, as % "
                "of the link rate; TCP payload reaches at most 1448/1500 = 96.5 % of it. The "
                "throughput plot samples the receive counter of the TUN device in " +
                self.NS_B + " every 100 ms (for `dmover download`, its send counter). " + MEASURES)

    def skip_reason(self, ctx):
        return None if Path("/dev/net/tun").exists() else "the kernel offers no TUN devices (/dev/net/tun)"

    def environment(self, ctx):
        return self.link(ctx)

    def environment_lost(self):
        link = getattr(self, "_link", None)
        try:
            if link:
                link.check()
        except BenchError as exc:
            return str(exc)
        return None

    def link(self, ctx) -> WanLink:
        """The link (brought up by `environment`); the tools sample it."""
        if getattr(self, "_link", None) is None:
            self._link = WanLink(ctx, ctx.wanem_dir, ns_a=self.NS_A, ns_b=self.NS_B,
                                 subnet=self.SUBNET, delay_ms=self.delay_ms,
                                 rate_mbit=self.rate_mbit, queue_pkts=self.queue_pkts,
                                 loss=self.loss, timeout_s=pick(ctx, 7200, 900))
        return self._link

    def datasets(self, ctx):
        return [self.dataset(ctx)]

    def tools(self, ctx):
        ds, b_ip = self.dataset(ctx), f"10.250.{self.SUBNET}.2"
        ends = dict(server_netns=self.NS_B, client_netns=self.NS_A, link=self.link(ctx))
        a_ip = f"10.250.{self.SUBNET}.1"
        return [Iperf3(4, self.iperf_seconds(ctx), host=b_ip, **ends),
                *dmovers(ctx, lambda **b: DmoverCopy(ds, host=b_ip, **ends, **b)),
                *dmovers(ctx, lambda **b: DmoverDownload(ds, host=b_ip, name="dmover download",
                                                         **ends, **b)),
                *dmovers(ctx, lambda **b: DmoverThirdParty(ds, host=b_ip, source_host=a_ip,
                                                           name="dmover third party", **ends, **b)),
                GlobusUrlCopy(ds, host=b_ip, **ends),
                Rsync(ds, daemon_host=b_ip, **ends)]

    def rows(self, ctx):
        measure = f"goodput (% of {self.rate_mbit} Mbit/s)"
        rows = [Row(measure, "dmover", "goodput_pct", peer)
                for peer in ("iperf3", "globus-url-copy", "rsync")]
        rows[0] = Row(measure, "dmover", "goodput_pct", "iperf3", self.target)
        directions = [Row(measure, tool, "goodput_pct", "iperf3")
                      for tool in ("dmover download", "dmover third party")]
        return (rows + directions + against_baseline(ctx, measure, "goodput_pct")
                + [row for tool in ("dmover download", "dmover third party")
                   for row in against_baseline(ctx, measure, "goodput_pct", tool)])



class WanSlow(Wan):
    key = "wan-a"
    title = "WAN (a): 100 Mbit/s, 10 ms one way, 100-packet queue"
    delay_ms, rate_mbit, queue_pkts = 10, 100, 100
    target = Target(">=", 85, "≥ 85 % of the link", on="value")

    def dataset(self, ctx):
        return pick(ctx, Dataset(2000, 64 << 10, 20), Dataset(200, 64 << 10, 20))


class WanFast(Wan):
    key = "wan-b"
    title = "WAN (b): 500 Mbit/s, 25 ms one way"
    # 500 Mbit/s is what wanem sustains here next to the tools on 2 cores (at
    # 1 Gbit/s it drops packets in the kernel); the queue is about one BDP.
    delay_ms, rate_mbit, queue_pkts = 25, 500, 2000

    def dataset(self, ctx):
        return hsm(ctx)


class WanLossy(WanFast):
    key = "wan-c"
    title = "WAN (c): 500 Mbit/s, 25 ms one way, 0.01 % loss"
    loss = 0.0001


class PeakRss(Workload):
    key = "peak-rss"
    title = "Peak memory (RSS), --streams 8, loopback"

    def dataset(self, ctx):
        return pick(ctx, Dataset(1, 2 << 30), Dataset(1, 256 << 20))

    def describe(self, ctx):
        return (f"`dmover cp --streams 8` (other settings default) of "
                f"{self.dataset(ctx).describe()} to a `dmover serve` on 127.0.0.1. Client: "
                "maximum resident set size from /usr/bin/time; server: VmHWM from "
                "/proc/PID/status, reset before each run. MiB = 2^20 bytes; judged on the "
                "worst run.")

    def datasets(self, ctx):
        return [self.dataset(ctx)]

    def tools(self, ctx):
        return dmovers(ctx, lambda **b: DmoverCopy(self.dataset(ctx), ("--streams", "8"), **b))

    def rows(self, ctx):
        return [Row("client peak RSS (MiB)", "dmover", "client_rss_mib",
                    target=Target("<=", 128, "≤ 128 MiB", on="value", stat="max")),
                Row("server peak RSS (MiB)", "dmover", "server_rss_mib",
                    target=Target("<=", 128, "≤ 128 MiB", on="value", stat="max")),
                *against_baseline(ctx, "client peak RSS (MiB)", "client_rss_mib", target=None),
                *against_baseline(ctx, "server peak RSS (MiB)", "server_rss_mib", target=None)]


class Streams(Workload):
    """The DMOVER paper's figure of aggregate and per-stream bandwidth
    against the number of streams, for dmover and globus-url-copy."""

    def dataset(self, ctx) -> Dataset:
        raise NotImplementedError

    def describe(self, ctx):
        return (f"{self.dataset(ctx).describe()}, disk to disk over loopback, for N in "
                f"{', '.join(map(str, STREAMS))}: `dmover cp --streams N` (TCP connections; "
                "other settings default) and `globus-url-copy -fast -pp -cc N` (N files "
                "moving at once, each over its own connection, as the paper's N concurrent "
                "transfers). Per-stream MB/s = MB/s / N. " + MEASURES)

    def datasets(self, ctx):
        return [self.dataset(ctx)]

    def tools(self, ctx):
        ds = self.dataset(ctx)
        tools = []
        for n in STREAMS:
            tools += [*dmovers(ctx, lambda **b: DmoverCopy(ds, ("--streams", str(n)),
                                                           name=f"dmover --streams {n}", **b)),
                      GlobusUrlCopy(ds, ("-fast", "-pp", "-cc", str(n)),
                                    name=f"globus-url-copy -cc {n}")]
        return tools

    def rows(self, ctx):
        # Against the baseline including a final sync, as the disk rows
        # (DiskCopy): a build may return only once its files are durable.
        return [row for n in STREAMS
                for row in against_baseline(ctx, f"MB/s including a final sync, {n} streams",
                                            "mb_per_s_with_sync", tool=f"dmover --streams {n}")]


class StreamsSmall(Streams):
    key = "streams-small"
    title = "Streams: small files"

    def dataset(self, ctx):
        return small(ctx)


class StreamsMedium(Streams):
    key = "streams-medium"
    title = "Streams: medium files"

    def dataset(self, ctx):
        return medium(ctx)


class StreamsLarge(Streams):
    key = "streams-large"
    title = "Streams: large files"

    def dataset(self, ctx):
        return large(ctx)


WORKLOADS: list[type[Workload]] = [MemToMem, SmallFiles, MediumFiles, LargeFiles, HsmFiles,
                                   WanSlow, WanFast, WanLossy, PeakRss,
                                   StreamsSmall, StreamsMedium, StreamsLarge]
