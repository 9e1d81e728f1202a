"""The servers the harness starts: `dmover serve`, a GridFTP server, an
rsync daemon and `iperf3 -s`, each on a free port, optionally inside a
network namespace, and stopped on every way out (context managers).
"""

from __future__ import annotations

from pathlib import Path

from .core import Context
from .system import (free_port, in_netns, kill_group, log_tail, remove_tree, start, stop,
                     wait_listening)


class Server:
    """A long-running server process; subclasses give `argv` and `label`."""

    label = "server"
    grace = 10

    def __init__(self, ctx: Context, host: str = "127.0.0.1", netns: str | None = None):
        self.ctx, self.host, self.netns = ctx, host, netns
        self.port = free_port()
        self.log_path = ctx.work / "logs" / f"{self.label.split()[0]}-{self.port}.log"
        self.proc = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def argv(self) -> list[str]:
        raise NotImplementedError

    def prepare(self) -> None:
        """Set-up before the start (directories, configuration)."""

    def stopped(self, rc: int | None) -> None:
        """Called after the stop with the exit code (None: killed)."""

    def __enter__(self):
        self.prepare()
        self.proc = start(self.ctx.log, in_netns(self.netns, self.argv()), self.log_path)
        try:
            wait_listening(self.port, self.proc, self.label, self.log_path, self.netns)
        except BaseException:
            stop(None, self.proc, self.label, grace=5)
            raise
        return self

    def __exit__(self, *exc) -> None:
        rc = stop(self.ctx.log, self.proc, self.label, grace=self.grace)
        kill_group(self.pid)      # per-connection processes a forking server left behind
        self.stopped(rc)


class DmoverServer(Server):
    """`dmover serve` with one export, run by the binary `binary` (the
    measured build's by default; the baseline's serves its own client).
    The export is made empty at the start and removed at the end, unless
    `existing` (a data set it serves to be read). With `allow_owners`
    clients may set owners in it (a build from before that flag has none)."""

    label = "dmover serve"
    grace = 40
    EXPORT = "bench"

    def __init__(self, ctx: Context, export_dir: Path, binary: Path | None = None,
                 existing: bool = False, allow_owners: bool = False, **kw):
        super().__init__(ctx, **kw)
        self.export_dir, self.binary, self.existing = export_dir, binary or ctx.dmover, existing
        self.allow_owners = allow_owners

    def url(self, path: str = "") -> str:
        return f"dmover://{self.host}:{self.port}/{self.EXPORT}" + (f"/{path}" if path else "")

    def prepare(self) -> None:
        if not self.existing:
            remove_tree(None, self.export_dir)
            self.export_dir.mkdir(parents=True)

    def argv(self) -> list[str]:
        return [str(self.binary), "serve", "--listen", f"{self.host}:{self.port}",
                "--export", f"{self.EXPORT}={self.export_dir}",
                "--token-file", str(self.ctx.token())] + \
            (["--allow-owners", self.EXPORT] if self.allow_owners else [])

    def stopped(self, rc):
        if rc != 0:
            what = "did not exit within 40 s of SIGTERM" if rc is None else \
                f"exited with code {rc} after SIGTERM (expected 0)"
            self.ctx.note(f"`dmover serve` {what}; last log lines:\n{log_tail(self.log_path)}")
        if not self.existing:
            remove_tree(None, self.export_dir)


class GridftpServer(Server):
    """globus-gridftp-server with anonymous access (no certificates): it
    forks one process per connection, which runs as `nobody`, so the
    directories it writes into are made world-writable. Its data channels
    listen on `host` (else it offers an address the client cannot reach
    from another namespace)."""

    label = "globus-gridftp-server"

    def url(self, path: Path | str) -> str:
        return f"ftp://{self.host}:{self.port}{path}"

    def argv(self) -> list[str]:
        return ["globus-gridftp-server", "-aa", "-anonymous-user", "nobody",
                "-p", str(self.port), "-data-interface", self.host, "-d", "error"]


class RsyncDaemon(Server):
    """`rsync --daemon` exporting one writable module."""

    label = "rsync --daemon"
    MODULE = "bench"

    def __init__(self, ctx: Context, module_dir: Path, **kw):
        super().__init__(ctx, **kw)
        self.module_dir = module_dir
        self.conf = ctx.work / "logs" / f"rsyncd-{self.port}.conf"

    def url(self, path: str) -> str:
        return f"rsync://{self.host}:{self.port}/{self.MODULE}/{path}"

    def prepare(self) -> None:
        self.module_dir.mkdir(parents=True, exist_ok=True)
        self.conf.write_text(f"uid = root\ngid = root\nuse chroot = no\n[{self.MODULE}]\n"
                             f"path = {self.module_dir}\nread only = no\n")

    def argv(self) -> list[str]:
        return ["rsync", "--daemon", "--no-detach", "--address", self.host,
                "--port", str(self.port), "--config", str(self.conf)]


class Iperf3Server(Server):
    label = "iperf3 -s"

    def argv(self) -> list[str]:
        return ["iperf3", "-s", "-p", str(self.port)]
