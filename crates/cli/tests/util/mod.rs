//! Shared helpers for the end-to-end tests: they run the real `dmover`
//! binary as separate processes, on loopback, with real files.
//!
//! * [`Env`]: a temporary directory with a token, from which servers and
//!   trees are made; everything under it goes away with it.
//! * [`Server`]: a `dmover serve` process on port 0; killed when dropped.
//! * [`BIN_FAULTY`]: the same command with a fault injector, switched on by
//!   `DMOVER_FAULT_*` variables ([`ServerSpec::bin`], [`Cmd::faulty`]).
//! * [`dmover`] / [`Cmd`]: run a client command with a timeout and capture
//!   its exit code, stdout and stderr; [`Cmd::spawn`] for one to interrupt.
//! * Trees: [`make_tree`] writes deterministic pseudo-random files with
//!   varied sizes, modes and (nanosecond) mtimes; [`assert_same_tree`]
//!   compares two trees byte for byte, with mode and mtime (and the modes
//!   of empty directories).
//! * [`Relay`]: a loopback TCP relay in front of a server that counts the
//!   bytes crossing it each way (what was sent, seen from outside dmover).
//! * [`Mount`]: a tmpfs or read-only bind mount, unmounted when dropped.
//! * [`proc_status`], [`open_fds`]: what a process holds.
//! * [`http_get`], [`sample`], [`promtool_check`]: read and lint a
//!   `/metrics` page; [`browser::Browser`]: a headless Chromium on a page.
//! * [`S3Server`]: a real S3 server (versitygw, from `dmover-testkit`);
//!   [`Cmd::s3`] points a command at it.
//! * [`Raw`]: a connection that speaks the wire protocol by hand (for
//!   hostile peers and for holding a session open).
#![allow(dead_code)]

pub mod browser;

use dmover_engine::transport::{Sealed, Transport};
use dmover_proto::auth::{Channel, Initiator, KeyId, Responder, SessionKey, TOKEN_KEY_ID};
use dmover_proto::frame::{Header, HEADER_LEN};
use dmover_proto::record::Protection;
use dmover_proto::{ErrorKind, Msg};
pub use dmover_testkit::s3::{foreign_env, S3Server};
use serde_json::Value;
use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read, Seek, Write};
use std::net::TcpStream;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_dmover");

/// `dmover` with a fault injector (`src/bin/dmover-faulty.rs`), for the
/// tests that damage data in flight: `DMOVER_FAULT_CORRUPT_EVERY=N` flips
/// a bit in every Nth block it sends. `dmover` itself has no such hook.
pub const BIN_FAULTY: &str = env!("CARGO_BIN_EXE_dmover-faulty");

/// How long any single client command may run before the test gives up.
pub const CMD_TIMEOUT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------
// Polling

/// Polls `f` every 20 ms until it returns true; false after `timeout`.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------
// The environment: a temp dir with a token

pub struct Env {
    pub dir: tempfile::TempDir,
    pub token: PathBuf,
}

impl Env {
    pub fn new() -> Env {
        // A receiver masks the modes it gives with its umask: the tests and
        // the processes they start run under 022, whatever the shell's
        // (every test sets the same, so setting it again changes nothing).
        // SAFETY: umask(2) cannot fail.
        unsafe { libc::umask(0o022) };
        let dir = tempfile::Builder::new().prefix("dmover-e2e-").tempdir().expect("temp dir");
        // Readable by other users, for the tests that drop privileges.
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let token = dir.path().join("token");
        let r = dmover(["token".as_ref(), token.as_os_str()]).run();
        assert_eq!(r.code, 0, "dmover token failed: {}", r.stderr);
        let mode = fs::metadata(&token).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "token file mode");
        Env { dir, token }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// Makes (and returns) a directory below the environment.
    pub fn mkdir(&self, rel: &str) -> PathBuf {
        let p = self.path(rel);
        fs::create_dir_all(&p).unwrap();
        p
    }

    pub fn token_str(&self) -> String {
        fs::read_to_string(&self.token).unwrap().trim().to_string()
    }

    /// Starts a server exporting `exports` (NAME, DIR) with this env's token.
    pub fn serve(&self, exports: &[(&str, &Path)]) -> Server {
        Server::start(ServerSpec::new(&self.token, exports, &self.path(&format!("server-{}.log", unique()))))
    }

    /// Starts a `dmover sink` writing to `dir`, with extra flags (e.g. `--hook`).
    pub fn sink<S: AsRef<OsStr>>(&self, dir: &Path, extra: impl IntoIterator<Item = S>) -> Server {
        let mut spec = ServerSpec::new(&self.token, &[], &self.path(&format!("sink-{}.log", unique())));
        spec.command = "sink";
        spec.extra = vec!["--dir".into(), dir.as_os_str().to_owned()];
        spec.extra.extend(extra.into_iter().map(|a| a.as_ref().to_owned()));
        Server::start(spec)
    }

    /// A `dmover cp ... --json -q --token-file TOKEN` command.
    pub fn cp<S: AsRef<OsStr>>(&self, args: impl IntoIterator<Item = S>) -> Cmd {
        let mut c = dmover(["cp", "--json", "-q", "--token-file"]);
        c.arg(&self.token);
        c.args(args);
        c
    }

    /// A copy slow enough (3 MB/s, small staging and blocks) that a test can
    /// change a source file, or the link, while it is still being read.
    pub fn slow_cp(&self, from: String, to: String) -> Cmd {
        self.cp([from, to, "--bwlimit".into(), "3M".into(), "--staging".into(), "1M".into(), "--block-size".into(), "64K".into()])
    }
}

/// A number unique in this process (for file names).
pub fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::SeqCst)
}

/// Makes a child die with the test thread that started it, should the test
/// process be killed before its guards run.
fn die_with_parent(c: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        c.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

// ---------------------------------------------------------------------------
// Servers

#[derive(Clone)]
pub struct ServerSpec {
    /// The binary: [`BIN`], or [`BIN_FAULTY`].
    pub bin: &'static str,
    /// The subcommand: `serve`, or `sink`.
    pub command: &'static str,
    pub token: PathBuf,
    pub exports: Vec<(String, PathBuf)>,
    /// `--listen`'s address; empty: no `--listen`, the command's default.
    pub listen: String,
    pub log: PathBuf,
    pub extra: Vec<OsString>,
    /// Command prefix (e.g. setpriv ...), if any.
    pub prefix: Vec<OsString>,
    /// Environment variables for the server process: set, or (None) removed.
    pub envs: Vec<(OsString, Option<OsString>)>,
    /// `serve --push-to` values: where its third-party copies may go
    /// (loopback, where the tests' other servers listen, unless told).
    pub push_to: Vec<String>,
}

impl ServerSpec {
    pub fn new(token: &Path, exports: &[(&str, &Path)], log: &Path) -> ServerSpec {
        ServerSpec {
            bin: BIN,
            command: "serve",
            token: token.to_path_buf(),
            exports: exports.iter().map(|(n, d)| (n.to_string(), d.to_path_buf())).collect(),
            listen: "127.0.0.1:0".into(),
            log: log.to_path_buf(),
            extra: Vec::new(),
            prefix: Vec::new(),
            envs: Vec::new(),
            push_to: vec!["127.0.0.1".into()],
        }
    }
}

/// A running `dmover serve` (or `dmover sink`). Dropping it kills it
/// (SIGKILL) and reaps it.
pub struct Server {
    pub spec: ServerSpec,
    child: Option<Child>,
    pub port: u16,
    /// Exit status, once it exited and was reaped.
    pub status: Option<ExitStatus>,
}

impl Server {
    pub fn start(spec: ServerSpec) -> Server {
        let mut s = Server { spec, child: None, port: 0, status: None };
        s.launch(Duration::from_secs(60));
        s
    }

    /// Starts the process and waits for its "listening on" line. Retries
    /// while the address is still taken (a restart on the same port).
    fn launch(&mut self, patience: Duration) {
        let end = Instant::now() + patience;
        loop {
            match self.try_launch() {
                Ok(port) => {
                    self.port = port;
                    return;
                }
                Err(e) if Instant::now() < end && e.contains("cannot listen") => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("server did not start: {e}\nlog:\n{}", self.log()),
            }
        }
    }

    fn try_launch(&mut self) -> Result<u16, String> {
        let log = fs::OpenOptions::new().create(true).append(true).open(&self.spec.log).unwrap();
        let mut cmd = if self.spec.prefix.is_empty() {
            Command::new(self.spec.bin)
        } else {
            let mut c = Command::new(&self.spec.prefix[0]);
            c.args(&self.spec.prefix[1..]).arg(self.spec.bin);
            c
        };
        cmd.arg(self.spec.command);
        if !self.spec.listen.is_empty() {
            cmd.arg("--listen").arg(&self.spec.listen);
        }
        for (n, d) in &self.spec.exports {
            let mut e = OsString::from(format!("{n}="));
            e.push(d.as_os_str());
            cmd.arg("--export").arg(e);
        }
        cmd.arg("--token-file").arg(&self.spec.token).args(&self.spec.extra);
        for p in self.spec.push_to.iter().filter(|_| self.spec.command == "serve") {
            cmd.arg("--push-to").arg(p);
        }
        for (k, v) in &self.spec.envs {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(log));
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().map_err(|e| format!("spawn: {e}"))?;
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(l)) = lines.next() {
                let _ = tx.send(l);
            }
            // Keep draining so the server never blocks on stdout.
            for _ in lines {}
        });
        let line = rx.recv_timeout(Duration::from_secs(60));
        match line {
            Ok(l) => {
                let port = l
                    .strip_prefix("dmover: listening on ")
                    .and_then(|a| a.rsplit_once(':'))
                    .and_then(|(_, p)| p.trim().parse::<u16>().ok())
                    .ok_or_else(|| format!("unexpected first line {l:?}"))?;
                assert_ne!(port, 0, "server reported port 0");
                self.child = Some(child);
                self.status = None;
                Ok(port)
            }
            Err(_) => {
                let _ = child.kill();
                let st = child.wait();
                Err(format!("no 'listening on' line (exit {st:?}); log: {}", self.log()))
            }
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `dmover://127.0.0.1:PORT/rel`
    pub fn url(&self, rel: &str) -> String {
        format!("dmover://{}/{}", self.addr(), rel)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server running").id()
    }

    /// The server's stderr so far (all its runs).
    pub fn log(&self) -> String {
        fs::read_to_string(&self.spec.log).unwrap_or_default()
    }

    /// True while the process has not exited.
    pub fn running(&mut self) -> bool {
        match self.child.as_mut() {
            None => false,
            Some(c) => match c.try_wait().unwrap() {
                None => true,
                Some(st) => {
                    self.status = Some(st);
                    self.child = None;
                    false
                }
            },
        }
    }

    /// SIGKILL, and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            self.status = c.wait().ok();
        }
    }

    /// Sends a signal to the server process.
    pub fn signal(&self, sig: i32) {
        let pid = self.pid() as libc::pid_t;
        // SAFETY: kill(2) with a pid we own.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
    }

    /// Waits for the process to exit; its status, or None after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        wait_until(timeout, || !self.running());
        self.status
    }

    /// How much the server has logged so far: a mark for [`Server::wait_for_log`].
    pub fn log_mark(&self) -> usize {
        self.log().len()
    }

    /// Waits up to 20 s for a log line containing `what` written after
    /// `mark` (from [`Server::log_mark`]); panics saying `why` it was
    /// awaited, with the log, if none comes.
    #[track_caller]
    pub fn wait_for_log(&self, mark: usize, what: &str, why: &str) {
        let logged = || self.log().get(mark..).is_some_and(|new| new.contains(what));
        assert!(wait_until(Duration::from_secs(20), logged), "no {what:?} in the server's log within 20 s ({why}):\n{}", self.log());
    }

    /// Starts the server again on the same port, with the same exports.
    pub fn restart(&mut self) {
        assert!(!self.running(), "restart of a running server");
        self.spec.listen = self.addr();
        self.launch(Duration::from_secs(30));
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!("--- log of the server at {} ---\n{}", self.addr(), self.log());
        }
    }
}

/// What a server logs when a session ends because its client vanished.
pub const ENDED: &str = "the peer closed the connection";

/// Lines of a server's log that contain `what`, a summary line of
/// refusals held back ("N more connections ...; the last: ...") counted as
/// N: how many connections the log tells of (`" WARN "`: all it warned of).
pub fn logged_connections(log: &str, what: &str) -> usize {
    log.lines()
        .filter(|l| l.contains(what))
        .map(|l| {
            let summary = l.split_once("] ").and_then(|(_, m)| m.split_once(" more connections ")).and_then(|(n, _)| n.parse().ok());
            summary.unwrap_or(1)
        })
        .sum()
}

/// The ends of the established TCP connections to and from `port` on this
/// host (`ss`), each as (bytes received and not yet read by its process,
/// bytes sent and not yet acknowledged by the other end). `from_port`: only
/// the ends whose local port is `port` (a server's own ends).
pub fn socket_queues(port: u16, from_port: bool) -> Vec<(u64, u64)> {
    let filter = if from_port { format!("sport = :{port}") } else { format!("( sport = :{port} or dport = :{port} )") };
    let out = Command::new("ss").args(["-Htn", "state", "established", &filter]).output().expect("run ss");
    assert!(out.status.success(), "ss failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let queue = |w: Option<&str>| w.and_then(|w| w.parse::<u64>().ok()).unwrap_or_else(|| panic!("unexpected ss line: {text}"));
    text.lines()
        .map(|l| {
            let mut w = l.split_whitespace();
            (queue(w.next()), queue(w.next()))
        })
        .collect()
}

/// Waits up to 20 s until every byte between a server at `port` and its
/// peers on this host was read, both ways: what was sent so far has been
/// taken in on each side. The server must have at least `peers`
/// connections; `why` says what the wait is for, should it fail.
#[track_caller]
pub fn wait_quiet(port: u16, peers: usize, why: &str) {
    let mut seen = Vec::new();
    let quiet = || {
        seen = socket_queues(port, false);
        seen.len() >= 2 * peers && seen.iter().all(|&q| q == (0, 0))
    };
    assert!(wait_until(Duration::from_secs(20), quiet), "the connections of port {port} never went quiet ({why}): {seen:?}");
}

/// A loopback port nobody listens on (bound, then released).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

// ---------------------------------------------------------------------------
// Metrics pages

/// One HTTP/1.0 GET (no chunked answers): status code and body.
pub fn http_get(addr: &str, target: &str) -> Option<(u16, String)> {
    http_get_with(addr, target, "")
}

/// [`http_get`] with more header lines (each ending in CRLF).
pub fn http_get_with(addr: &str, target: &str, header: &str) -> Option<(u16, String)> {
    let mut c = TcpStream::connect(addr).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(c, "GET {target} HTTP/1.0\r\nHost: {addr}\r\n{header}\r\n").ok()?;
    let mut answer = String::new();
    c.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// Asserts that Prometheus' own linter (`promtool check metrics`) finds
/// nothing to say about `page`.
#[track_caller]
pub fn promtool_check(page: &str) {
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    lint.stdin.take().unwrap().write_all(page.as_bytes()).unwrap();
    let out = lint.wait_with_output().unwrap();
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics: {}{}\npage:\n{page}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether `program` is on the PATH.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
}

/// The value of the sample `name` (with its labels, as written) on a page.
pub fn sample(page: &str, name: &str) -> Option<f64> {
    page.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

// ---------------------------------------------------------------------------
// An ssh server

/// A real `sshd` on a loopback port, accepting one key generated for it,
/// for the current user: what `[user@]host:path` locations need. Stopped
/// when dropped.
pub struct Sshd {
    pub port: u16,
    key: PathBuf,
    child: Child,
}

/// How an [`Sshd`] differs from the plain one on loopback.
#[derive(Default)]
pub struct SshdOptions<'a> {
    /// The network namespace it runs in (None: this one).
    pub ns: Option<&'a str>,
    /// `HOME` in the sessions it starts, where relative paths of a
    /// `host:path` location lead (None: the user's own home directory).
    pub home: Option<&'a Path>,
    /// No ClientAlive probes: sshd never ends a session whose client went
    /// silent, leaving that to dmover's remote end alone.
    pub no_client_alive: bool,
}

impl Sshd {
    /// Starts sshd on a free loopback port, with its configuration, keys
    /// and logs under `dir`.
    pub fn start(dir: &Path) -> Sshd {
        Sshd::start_with(dir, SshdOptions::default())
    }

    /// Starts sshd on a free loopback port, as `o` says.
    pub fn start_with(dir: &Path, o: SshdOptions) -> Sshd {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        Sshd::start_in(dir, "127.0.0.1", port, o)
    }

    /// Starts sshd listening on `ip:port`, as `o` says.
    pub fn start_in(dir: &Path, ip: &str, port: u16, o: SshdOptions) -> Sshd {
        let ns = o.ns;
        fs::create_dir_all(dir).unwrap();
        // sshd wants its privilege separation directory (made as root).
        let _ = fs::create_dir_all("/run/sshd");
        let keygen = |file: &Path| {
            let st = Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                .arg(file)
                .status()
                .expect("ssh-keygen (apt install openssh-client)");
            assert!(st.success(), "ssh-keygen failed");
        };
        let (host_key, key) = (dir.join("host_key"), dir.join("client_key"));
        keygen(&host_key);
        keygen(&key);
        fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys")).unwrap();
        let config = dir.join("sshd_config");
        fs::write(
            &config,
            format!(
                "Port {port}\nListenAddress {ip}\nHostKey {}\nAuthorizedKeysFile {}\nPidFile {}\nPermitRootLogin prohibit-password\n\
                 StrictModes no\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nLogLevel ERROR\n\
                 ClientAliveInterval {}\nClientAliveCountMax 3\nMaxStartups 100\n{}",
                host_key.display(),
                dir.join("authorized_keys").display(),
                dir.join("sshd.pid").display(),
                if o.no_client_alive { 0 } else { 1 },
                o.home.map(|h| format!("SetEnv HOME={}\n", h.display())).unwrap_or_default(),
            ),
        )
        .unwrap();
        let sshd =
            ["/usr/sbin/sshd", "/usr/bin/sshd"].into_iter().find(|p| Path::new(p).exists()).expect("sshd (apt install openssh-server)");
        let mut c = in_netns(ns, sshd);
        c.arg("-D").arg("-e").arg("-f").arg(&config).stderr(File::create(dir.join("sshd.log")).unwrap());
        die_with_parent(&mut c);
        let child = c.spawn().expect("start sshd");
        let listening = || in_netns(ns, "ss").args(["-Hltn", &format!("sport = :{port}")]).output().is_ok_and(|o| !o.stdout.is_empty());
        let up = wait_until(Duration::from_secs(10), listening);
        assert!(up, "sshd did not start: {}", fs::read_to_string(dir.join("sshd.log")).unwrap_or_default());
        Sshd { port, key, child }
    }

    /// The ssh command for `--ssh`: this server's port and key, no host checks.
    pub fn ssh(&self) -> String {
        format!("ssh -p {} {}", self.port, self.ssh_without_port().trim_start_matches("ssh "))
    }

    /// The same without the port, for a location that names it.
    pub fn ssh_without_port(&self) -> String {
        format!(
            "ssh -i {} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes -o LogLevel=ERROR",
            self.key.display()
        )
    }
}

/// `program`, to run in the network namespace `ns` if given.
pub fn in_netns(ns: Option<&str>, program: &str) -> Command {
    match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, program]);
            c
        }
        None => Command::new(program),
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------
// A counting relay

/// A TCP relay on a loopback port: every connection it accepts is forwarded
/// to `target`, and the bytes that cross it are counted each way — a view of
/// the wire that does not depend on what dmover reports. Point a client at
/// [`Relay::url`] instead of the server's; its control and data connections
/// all pass through. It stops accepting when dropped. A relay started with
/// a [`Tap`] shows it every piece it forwards from clients to the server,
/// to record or change: an attacker on the path.
pub struct Relay {
    pub port: u16,
    /// Bytes forwarded client → server, server → client.
    counts: std::sync::Arc<[std::sync::atomic::AtomicU64; 2]>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Sees, and may change, each piece of bytes a relay forwards from a
/// client to the server.
pub type Tap = std::sync::Arc<dyn Fn(&mut [u8]) + Send + Sync>;

impl Relay {
    pub fn start(target: &str) -> Relay {
        Relay::tapped(target, None)
    }

    pub fn tapped(target: &str, tap: Option<Tap>) -> Relay {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("relay: bind");
        let port = listener.local_addr().unwrap().port();
        let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let accepted = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, a, st, target) = (counts.clone(), accepted.clone(), stop.clone(), target.to_string());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                a.fetch_add(1, Ordering::SeqCst);
                // With the server down, the client sees its connection reset, as it would without the relay.
                let Ok(server) = TcpStream::connect(&target) else {
                    reset(&client);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                for (from, to, i) in [(client.try_clone().unwrap(), server.try_clone().unwrap(), 0), (server, client, 1)] {
                    let c = c.clone();
                    let tap = if i == 0 { tap.clone() } else { None };
                    std::thread::spawn(move || pump(from, to, &c[i], tap));
                }
            }
        });
        Relay { port, counts, accepted, stop }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `dmover://127.0.0.1:RELAY_PORT/rel`
    pub fn url(&self, rel: &str) -> String {
        format!("dmover://{}/{}", self.addr(), rel)
    }

    /// Bytes forwarded from clients to the server since the last reset.
    pub fn to_server(&self) -> u64 {
        self.counts[0].load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Bytes forwarded from the server to clients since the last reset.
    pub fn to_client(&self) -> u64 {
        self.counts[1].load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Connections accepted since the last reset.
    pub fn connections(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Starts counting afresh (call it when no transfer is running).
    pub fn reset(&self) {
        use std::sync::atomic::Ordering;
        self.counts.iter().for_each(|c| c.store(0, Ordering::SeqCst));
        self.accepted.store(0, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wake the accepting thread so that it sees the flag.
        let _ = TcpStream::connect(self.addr());
    }
}

/// Makes closing `s` send a reset rather than an orderly end.
pub fn reset(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid socket and a linger struct of the size given.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// Forwards `from` to `to`, counting, until either end closes. An orderly
/// end is passed on as a half close; an error (a peer killed) closes both.
fn pump(mut from: TcpStream, mut to: TcpStream, count: &std::sync::atomic::AtomicU64, tap: Option<Tap>) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match from.read(&mut buf) {
            Ok(0) => {
                let _ = to.shutdown(std::net::Shutdown::Write);
                return;
            }
            Ok(n) => {
                if let Some(tap) = &tap {
                    tap(&mut buf[..n]);
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
                count.fetch_add(n as u64, std::sync::atomic::Ordering::SeqCst);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

// ---------------------------------------------------------------------------
// Running dmover

/// The environment a dmover process reaching `s3` gets: its keys, and
/// nothing of this environment's own S3 settings (credentials, endpoint,
/// CA bundles, proxies), nor the user's ~/.aws (HOME is `home`, and resume
/// state goes under it too). In order: a later variable wins.
pub fn s3_env(s3: &S3Server, home: &Path) -> Vec<(OsString, Option<OsString>)> {
    let mut env: Vec<(OsString, Option<OsString>)> = foreign_env().into_iter().map(|k| (k.into(), None)).collect();
    env.push(("HOME".into(), Some(home.into())));
    env.push(("XDG_CACHE_HOME".into(), None));
    env.extend(s3.client_env().into_iter().map(|(k, v)| (k.into(), Some(v.into()))));
    env
}

/// A dmover command being put together.
pub struct Cmd {
    bin: &'static str,
    prefix: Vec<OsString>,
    args: Vec<OsString>,
    /// Variables set (or, None, removed), in order: a later one wins.
    envs: Vec<(OsString, Option<OsString>)>,
    cwd: Option<PathBuf>,
    timeout: Duration,
    stdout_closed: bool,
    stderr_closed: bool,
}

pub fn dmover<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Cmd {
    Cmd {
        bin: BIN,
        prefix: Vec::new(),
        args: args.into_iter().map(|a| a.as_ref().to_os_string()).collect(),
        envs: Vec::new(),
        cwd: None,
        timeout: CMD_TIMEOUT,
        stdout_closed: false,
        stderr_closed: false,
    }
}

/// What a finished command did.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Run {
    /// The JSON report on stdout.
    #[track_caller]
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not a JSON report ({e}):\n{}\nstderr:\n{}", self.stdout, self.stderr))
    }

    /// Lines of stderr that are dmover's own error messages.
    pub fn error_lines(&self) -> Vec<&str> {
        self.stderr.lines().filter(|l| l.starts_with("dmover: error")).collect()
    }

    /// Asserts success: exit 0, `ok`, check passed, no errors. Returns the report.
    #[track_caller]
    pub fn assert_ok(&self) -> Value {
        assert_eq!(self.code, 0, "exit code; stderr:\n{}\nstdout:\n{}", self.stderr, self.stdout);
        let j = self.json();
        assert_eq!(j["ok"], true, "report: {j:#}");
        assert_eq!(j["check"]["passed"], true, "report: {j:#}");
        assert_eq!(j["check"]["digests_match"], true, "report: {j:#}");
        assert_eq!(j["errors"].as_array().map(Vec::len), Some(0), "report: {j:#}");
        assert_eq!(j["check"]["source_files"], j["files"], "report: {j:#}");
        assert_eq!(j["check"]["dest_files"], j["files"], "report: {j:#}");
        assert_eq!(j["check"]["source_bytes"], j["bytes"], "report: {j:#}");
        assert_eq!(j["check"]["dest_bytes"], j["bytes"], "report: {j:#}");
        assert!(!self.stderr.contains("panicked"), "stderr: {}", self.stderr);
        j
    }

    /// Asserts a failure with `code` and exactly one one-line error on
    /// stderr that mentions every one of `names`.
    #[track_caller]
    pub fn assert_fails(&self, code: i32, names: &[&str]) {
        assert_eq!(self.code, code, "exit code (want {code}); stderr:\n{}\nstdout:\n{}", self.stderr, self.stdout);
        assert!(!self.stderr.contains("panicked"), "dmover panicked: {}", self.stderr);
        let errs = self.error_lines();
        assert_eq!(errs.len(), 1, "want exactly one 'dmover: error' line on stderr, got:\n{}", self.stderr);
        for n in names {
            assert!(errs[0].contains(n), "the error line does not name {n:?}: {:?}\nstderr:\n{}", errs[0], self.stderr);
        }
    }
}

impl Cmd {
    pub fn arg(&mut self, a: impl AsRef<OsStr>) -> &mut Cmd {
        self.args.push(a.as_ref().to_os_string());
        self
    }

    pub fn args<S: AsRef<OsStr>>(&mut self, a: impl IntoIterator<Item = S>) -> &mut Cmd {
        self.args.extend(a.into_iter().map(|a| a.as_ref().to_os_string()));
        self
    }

    pub fn env(&mut self, k: impl AsRef<OsStr>, v: impl AsRef<OsStr>) -> &mut Cmd {
        self.envs.push((k.as_ref().into(), Some(v.as_ref().into())));
        self
    }

    pub fn env_remove(&mut self, k: impl AsRef<OsStr>) -> &mut Cmd {
        self.envs.push((k.as_ref().into(), None));
        self
    }

    /// Reaches `s3` as [`s3_env`] says.
    pub fn s3(&mut self, s3: &S3Server, home: &Path) -> &mut Cmd {
        self.envs.extend(s3_env(s3, home));
        self
    }

    pub fn cwd(&mut self, d: impl AsRef<Path>) -> &mut Cmd {
        self.cwd = Some(d.as_ref().to_path_buf());
        self
    }

    pub fn timeout(&mut self, t: Duration) -> &mut Cmd {
        self.timeout = t;
        self
    }

    /// Runs [`BIN_FAULTY`] instead of `dmover`.
    pub fn faulty(&mut self) -> &mut Cmd {
        self.bin = BIN_FAULTY;
        self
    }

    /// Runs it under `prefix` (e.g. `setpriv --reuid=...`).
    pub fn prefix<S: AsRef<OsStr>>(&mut self, p: impl IntoIterator<Item = S>) -> &mut Cmd {
        self.prefix = p.into_iter().map(|a| a.as_ref().to_os_string()).collect();
        self
    }

    /// Gives it a stdout whose reader has already gone (as in
    /// `dmover status JOB | head -2` once `head` has its lines): what it
    /// prints is lost, and the [`Run`]'s stdout is empty.
    pub fn stdout_closed(&mut self) -> &mut Cmd {
        self.stdout_closed = true;
        self
    }

    /// Gives it one stdout and stderr whose reader has already gone (as in
    /// `dmover run JOB 2>&1 | head -2`): the [`Run`] has only its exit code.
    pub fn output_closed(&mut self) -> &mut Cmd {
        self.stdout_closed = true;
        self.stderr_closed = true;
        self
    }

    /// Starts it in the background.
    pub fn spawn(&self) -> Proc {
        let out = tempfile::tempfile().unwrap();
        let err = tempfile::tempfile().unwrap();
        let mut c = if self.prefix.is_empty() {
            Command::new(self.bin)
        } else {
            let mut c = Command::new(&self.prefix[0]);
            c.args(&self.prefix[1..]).arg(self.bin);
            c
        };
        c.args(&self.args);
        c.env_remove("DMOVER_TOKEN").env_remove("DMOVER_LOG");
        for (k, v) in &self.envs {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        if let Some(d) = &self.cwd {
            c.current_dir(d);
        }
        let stdout = if self.stdout_closed { closed_pipe() } else { Stdio::from(out.try_clone().unwrap()) };
        let stderr = if self.stderr_closed { closed_pipe() } else { Stdio::from(err.try_clone().unwrap()) };
        c.stdin(Stdio::null()).stdout(stdout).stderr(stderr);
        die_with_parent(&mut c);
        let child = c.spawn().expect("spawn dmover");
        Proc { child: Some(child), out, err, started: Instant::now(), timeout: self.timeout, desc: format!("{:?}", self.args) }
    }

    /// Runs it to the end (killing it after the timeout, which fails the test).
    pub fn run(&self) -> Run {
        self.spawn().wait()
    }
}

/// The writing end of a pipe whose reading end is already closed.
pub fn closed_pipe() -> Stdio {
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut fds = [0; 2];
    // SAFETY: pipe() fills both descriptors, which are then owned here.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe");
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(reader);
    writer.into()
}

/// A background dmover process; killed (SIGKILL) if dropped while running.
pub struct Proc {
    child: Option<Child>,
    out: File,
    err: File,
    started: Instant,
    timeout: Duration,
    desc: String,
}

fn read_all(f: &mut File) -> String {
    let mut s = String::new();
    f.rewind().unwrap();
    let mut b = Vec::new();
    f.read_to_end(&mut b).unwrap();
    s.push_str(&String::from_utf8_lossy(&b));
    s
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Still running?
    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// SIGKILL and reap; returns what it printed.
    pub fn kill9(mut self) -> Run {
        let mut c = self.child.take().unwrap();
        let _ = c.kill();
        let st = c.wait().unwrap();
        Run { code: code_of(st), stdout: read_all(&mut self.out), stderr: read_all(&mut self.err), elapsed: self.started.elapsed() }
    }

    /// Waits for the end (the test fails if it takes longer than the timeout).
    pub fn wait(mut self) -> Run {
        let mut c = self.child.take().unwrap();
        let deadline = self.started + self.timeout;
        let st = loop {
            if let Some(st) = c.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!(
                    "dmover {} did not finish within {:?}\nstdout:\n{}\nstderr:\n{}",
                    self.desc,
                    self.timeout,
                    read_all(&mut self.out),
                    read_all(&mut self.err)
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        Run { code: code_of(st), stdout: read_all(&mut self.out), stderr: read_all(&mut self.err), elapsed: self.started.elapsed() }
    }

    /// Waits for the end as [`Proc::wait`] does, and answers also the
    /// process's peak resident memory in KiB (its `ru_maxrss` when reaped:
    /// the most it ever held, however briefly).
    pub fn wait_peak_rss(mut self) -> (Run, u64) {
        use std::os::unix::process::ExitStatusExt;
        let pid = self.pid() as libc::pid_t;
        let deadline = self.started + self.timeout;
        let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
        loop {
            // SAFETY: status and usage are valid for wait4 to fill.
            let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
            assert!(r >= 0, "wait4: {}", std::io::Error::last_os_error());
            if r == pid {
                break;
            }
            assert!(Instant::now() <= deadline, "dmover {} did not finish within {:?}", self.desc, self.timeout);
            std::thread::sleep(Duration::from_millis(10));
        }
        // Reaped here: the Child must not be waited for or killed again.
        drop(self.child.take());
        let run = Run {
            code: code_of(ExitStatus::from_raw(status)),
            stdout: read_all(&mut self.out),
            stderr: read_all(&mut self.err),
            elapsed: self.started.elapsed(),
        };
        (run, usage.ru_maxrss as u64)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn code_of(st: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0))
}

// ---------------------------------------------------------------------------
// Files and trees

/// xorshift64*: deterministic pseudo-random bytes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// Writes `size` pseudo-random bytes (from `seed`) to `path`, making parents.
pub fn write_random(path: &Path, size: u64, seed: u64) {
    if let Some(p) = path.parent() {
        fs::create_dir_all(p).unwrap();
    }
    let mut f = std::io::BufWriter::new(File::create(path).unwrap());
    let mut rng = Rng::new(seed ^ 0x5151);
    let mut buf = vec![0u8; 1 << 16];
    let mut left = size;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill(&mut buf[..n]);
        f.write_all(&buf[..n]).unwrap();
        left -= n as u64;
    }
    f.flush().unwrap();
}

/// Sets a file's mtime (and atime) to `secs`.`nsec` without following symlinks.
pub fn set_mtime(path: &Path, secs: i64, nsec: i64) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let ts = [
        libc::timespec { tv_sec: secs as libc::time_t, tv_nsec: nsec as _ },
        libc::timespec { tv_sec: secs as libc::time_t, tv_nsec: nsec as _ },
    ];
    // SAFETY: a valid C string and two timespecs.
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), ts.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) };
    assert_eq!(r, 0, "utimensat {}: {}", path.display(), std::io::Error::last_os_error());
}

pub fn mtime_of(path: &Path) -> (i64, i64) {
    let m = fs::symlink_metadata(path).unwrap();
    (m.mtime(), m.mtime_nsec())
}

/// A command prefix ([`Cmd::prefix`], [`ServerSpec::prefix`]) that runs
/// the program under umask `mask`, whatever the test process's is.
pub fn under_umask(mask: u32) -> Vec<OsString> {
    ["sh".to_string(), "-c".into(), format!("umask {mask:03o}; exec \"$0\" \"$@\"")].map(OsString::from).to_vec()
}

pub fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

/// Writes a file with content, mode and mtime chosen by `rng`.
pub fn make_file(path: &Path, size: u64, rng: &mut Rng) {
    write_random(path, size, rng.next());
    const MODES: [u32; 5] = [0o644, 0o600, 0o755, 0o640, 0o444];
    chmod(path, MODES[rng.below(MODES.len() as u64) as usize]);
    // Somewhere in 2001..2021, with nanoseconds.
    set_mtime(path, 1_000_000_000 + rng.below(600_000_000) as i64, rng.below(1_000_000_000) as i64);
}

/// A tree of `n_small` small files spread over a few directories, plus a few
/// edge cases (empty, one byte, exactly one block, one block and a byte,
/// a multi-block file, odd names). Returns the relative paths of all files.
pub fn make_tree(root: &Path, seed: u64, n_small: usize) -> Vec<String> {
    let mut rng = Rng::new(seed);
    let mut files = Vec::new();
    let mib = 1u64 << 20;
    let fixed: [(&str, u64); 8] = [
        ("empty.dat", 0),
        ("one.bin", 1),
        ("a/page.dat", 4095),
        ("a/block.dat", mib),
        ("a/b/block_plus_one.dat", mib + 1),
        ("a/b/c/multi.dat", 3 * mib + 12_345),
        ("name with spaces.txt", 777),
        ("ünïcødé/€.txt", 1234),
    ];
    for (p, size) in fixed {
        make_file(&root.join(p), size, &mut rng);
        files.push(p.to_string());
    }
    let dirs = ["", "a", "a/b", "d1", "d1/d2", "d3"];
    for i in 0..n_small {
        let d = dirs[i % dirs.len()];
        let ext = if i % 3 == 0 { "txt" } else { "dat" };
        let p = if d.is_empty() { format!("f{i:03}.{ext}") } else { format!("{d}/f{i:03}.{ext}") };
        let size = rng.below(40_000);
        make_file(&root.join(&p), size, &mut rng);
        files.push(p);
    }
    files.sort();
    files
}

/// An entry of a tree snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Dir { mode: u32 },
    File { size: u64, mode: u32, mtime: (i64, i64) },
    Link(PathBuf),
    Other,
}

/// Every entry below `root` (relative path → node), not following symlinks.
/// Paths are spelled as dmover spells names on the wire (bytes that are not
/// UTF-8 as `\xHH`, a backslash doubled): no two names share a key.
pub fn list_tree(root: &Path) -> BTreeMap<String, Node> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, rel)) = stack.pop() {
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => rd,
            // A directory that vanished while a transfer runs.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !rel.is_empty() => continue,
            Err(e) => panic!("read_dir {}: {e}", dir.display()),
        };
        for e in rd {
            let Ok(e) = e else { continue };
            let name = dmover_proto::path::from_bytes(e.file_name().as_bytes()).into_owned();
            let r = if rel.is_empty() { name } else { format!("{rel}/{name}") };
            // Entries can vanish between readdir and lstat (a temporary file renamed).
            let Ok(m) = fs::symlink_metadata(e.path()) else { continue };
            let node = if m.file_type().is_symlink() {
                Node::Link(fs::read_link(e.path()).unwrap_or_default())
            } else if m.is_dir() {
                stack.push((e.path(), r.clone()));
                Node::Dir { mode: m.mode() & 0o7777 }
            } else if m.is_file() {
                Node::File { size: m.len(), mode: m.mode() & 0o7777, mtime: (m.mtime(), m.mtime_nsec()) }
            } else {
                Node::Other
            };
            out.insert(r, node);
        }
    }
    out
}

/// Regular files below `root` (relative path → node).
pub fn list_files(root: &Path) -> BTreeMap<String, Node> {
    list_tree(root).into_iter().filter(|(_, n)| matches!(n, Node::File { .. })).collect()
}

/// Byte-for-byte comparison of two files.
pub fn same_content(a: &Path, b: &Path) -> bool {
    let (Ok(fa), Ok(fb)) = (File::open(a), File::open(b)) else { return false };
    if fa.metadata().unwrap().len() != fb.metadata().unwrap().len() {
        return false;
    }
    let (mut ra, mut rb) = (BufReader::with_capacity(1 << 20, fa), BufReader::with_capacity(1 << 20, fb));
    let (mut ba, mut bb) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    loop {
        let n = read_full(&mut ra, &mut ba);
        let m = read_full(&mut rb, &mut bb);
        if n != m || ba[..n] != bb[..m] {
            return false;
        }
        if n == 0 {
            return true;
        }
    }
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]).unwrap() {
            0 => break,
            k => n += k,
        }
    }
    n
}

/// Asserts that `dst` holds exactly the tree `src` holds (same paths, same
/// kinds; files byte-identical with the same mode and mtime; directories
/// that are empty at the source with the same mode — the directory
/// attributes CLI.md says are kept). Any leftover (temporary file, resume state)
/// in `dst` fails the comparison.
#[track_caller]
pub fn assert_same_tree(src: &Path, dst: &Path) {
    let a = list_tree(src);
    let b = list_tree(dst);
    let only_a: Vec<_> = a.keys().filter(|k| !b.contains_key(*k)).collect();
    let only_b: Vec<_> = b.keys().filter(|k| !a.contains_key(*k)).collect();
    assert!(
        only_a.is_empty() && only_b.is_empty(),
        "trees differ: {} vs {}\nmissing at the destination: {only_a:?}\nextra at the destination: {only_b:?}",
        src.display(),
        dst.display()
    );
    for (k, na) in &a {
        let nb = &b[k];
        match (na, nb) {
            (Node::Dir { mode: ma }, Node::Dir { mode: mb }) => {
                let prefix = format!("{k}/");
                if !a.keys().any(|c| c.starts_with(&prefix)) {
                    assert_eq!(format!("{ma:o}"), format!("{mb:o}"), "{k}: mode of an empty directory");
                }
            }
            (Node::File { size: sa, mode: ma, mtime: ta }, Node::File { size: sb, mode: mb, mtime: tb }) => {
                assert_eq!(sa, sb, "{k}: size");
                let rel = dmover_proto::path::to_path(k).unwrap();
                assert!(same_content(&src.join(&rel), &dst.join(&rel)), "{k}: content differs");
                assert_eq!(format!("{ma:o}"), format!("{mb:o}"), "{k}: mode");
                assert_eq!(ta, tb, "{k}: mtime (s, ns)");
            }
            _ => assert_eq!(na, nb, "{k}: kind"),
        }
    }
}

/// Bytes actually allocated to regular files below `dir` (sparse-aware:
/// what has been written so far), not counting dmover's resume state.
pub fn written_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let Ok(m) = fs::symlink_metadata(e.path()) else { continue };
            if m.is_dir() {
                if e.file_name() != ".dmover-partial" {
                    stack.push(e.path());
                }
            } else if m.is_file() {
                total += (m.blocks() * 512).min(m.len());
            }
        }
    }
    total
}

/// True for a relative path that is a final name: not a temporary
/// `.NAME.dmover-part` and not in resume state (`.dmover-partial/`).
pub fn is_final_name(rel: &str) -> bool {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    !(rel.split('/').any(|c| c == ".dmover-partial") || name.starts_with('.') && name.ends_with(".dmover-part"))
}

/// Asserts that every file below `dst` under a final name (not a
/// `.NAME.dmover-part`, not in `.dmover-partial/`) equals its counterpart
/// below `src`: no final name is ever half-written. Returns how many there were.
#[track_caller]
pub fn assert_final_names_complete(src: &Path, dst: &Path) -> usize {
    let mut n = 0;
    for (k, _) in list_files(dst) {
        if !is_final_name(&k) {
            continue;
        }
        assert!(same_content(&src.join(&k), &dst.join(&k)), "{k} exists under its final name but differs from the source");
        n += 1;
    }
    n
}

// ---------------------------------------------------------------------------
// Mounts

/// A mount point, unmounted (lazily) when dropped.
pub struct Mount {
    pub path: PathBuf,
}

fn sh(cmd: &str, args: &[&OsStr]) -> Result<(), String> {
    let out = Command::new(cmd).args(args).output().map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr)))
    }
}

impl Mount {
    /// A tmpfs of `size` (e.g. "4m") at `path` (created).
    pub fn tmpfs(path: &Path, size: &str) -> Mount {
        fs::create_dir_all(path).unwrap();
        let opt = format!("size={size},mode=0755");
        sh("mount", &["-t".as_ref(), "tmpfs".as_ref(), "-o".as_ref(), opt.as_ref(), "tmpfs".as_ref(), path.as_os_str()])
            .unwrap_or_else(|e| panic!("cannot mount a tmpfs (these tests need root): {e}"));
        Mount { path: path.to_path_buf() }
    }

    /// A fresh ext4 file system of `size` (e.g. "8M") at `path` (created),
    /// in the image file `image`, mounted through a loop device (freed
    /// with the mount): a real disk's space accounting, delayed
    /// allocation and journal.
    pub fn ext4(path: &Path, image: &Path, size: &str) -> Mount {
        fs::create_dir_all(path).unwrap();
        let _ = fs::remove_file(image);
        sh("truncate", &["-s".as_ref(), size.as_ref(), image.as_os_str()]).unwrap_or_else(|e| panic!("an ext4 image: {e}"));
        sh("mkfs.ext4", &["-q".as_ref(), "-F".as_ref(), image.as_os_str()]).unwrap_or_else(|e| panic!("mkfs.ext4 (e2fsprogs): {e}"));
        sh("mount", &["-o".as_ref(), "loop".as_ref(), image.as_os_str(), path.as_os_str()])
            .unwrap_or_else(|e| panic!("cannot loop-mount an ext4 image (these tests need root and loop devices): {e}"));
        Mount { path: path.to_path_buf() }
    }

    /// `path` bind-mounted onto itself, read-only.
    pub fn read_only(path: &Path) -> Mount {
        sh("mount", &["--bind".as_ref(), path.as_os_str(), path.as_os_str()]).unwrap_or_else(|e| panic!("bind mount: {e}"));
        let m = Mount { path: path.to_path_buf() };
        sh("mount", &["-o".as_ref(), "remount,ro,bind".as_ref(), path.as_os_str()]).unwrap_or_else(|e| panic!("read-only remount: {e}"));
        m
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = sh("umount", &[self.path.as_os_str()]) {
            eprintln!("umount failed ({e}); unmounting lazily");
            let _ = sh("umount", &["-l".as_ref(), self.path.as_os_str()]);
        }
    }
}

// ---------------------------------------------------------------------------
// Processes

/// A field of /proc/PID/status, in its unit (kB for memory).
pub fn proc_status(pid: u32, field: &str) -> u64 {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let l = s.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    l.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Open file descriptors of a process.
pub fn open_fds(pid: u32) -> usize {
    fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

// ---------------------------------------------------------------------------
// Reports

pub fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not an unsigned number: {v}"))
}

/// Total size of the files listed (relative to `root`).
pub fn total_size(root: &Path) -> u64 {
    list_files(root).values().map(|n| if let Node::File { size, .. } = n { *size } else { 0 }).sum()
}

// ---------------------------------------------------------------------------
// The wire protocol by hand

/// A connection that speaks frames by hand.
pub struct Raw {
    /// The socket, for tests that act on it directly.
    pub s: TcpStream,
    /// What frames go through: the socket, or the sealing layer on it
    /// once the handshake is done.
    io: Box<dyn Transport>,
    /// The connection's session key, once the handshake is done (it
    /// unwraps tickets).
    pub session_key: Option<SessionKey>,
}

impl Raw {
    pub fn connect(addr: &str) -> Raw {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Raw::over(s)
    }

    /// Frames by hand over `s`.
    pub fn over(s: TcpStream) -> Raw {
        Raw { io: Box::new(s.try_clone().unwrap()), s, session_key: None }
    }

    pub fn bytes(m: &Msg) -> Vec<u8> {
        let mut b = Vec::new();
        m.encode(&mut b);
        b
    }

    pub fn send(&mut self, m: &Msg) {
        self.raw(&Raw::bytes(m));
    }

    /// Writes bytes (sealed once the handshake is done); a server that
    /// already closed the connection is fine.
    pub fn raw(&mut self, b: &[u8]) {
        let _ = self.io.write_all(b);
    }

    /// The next message, or None once the server has closed the connection.
    pub fn read(&mut self) -> Option<Msg> {
        let mut h = [0u8; HEADER_LEN];
        self.io.read_exact(&mut h).ok()?;
        let h = Header::parse(&h).expect("the server sent a bad header");
        let mut body = vec![0u8; h.len as usize];
        self.io.read_exact(&mut body).ok()?;
        Some(h.decode_msg(&body).expect("the server sent a bad frame"))
    }

    /// Reads until the server closes the connection; how long that took.
    pub fn wait_closed(&mut self) -> Duration {
        let t = Instant::now();
        let mut buf = [0u8; 4096];
        while matches!(self.io.read(&mut buf), Ok(n) if n > 0) {}
        t.elapsed()
    }

    /// A client's first frame for `secret` (named by `key_id`), and the
    /// handshake state to go on with.
    pub fn hello(key_id: KeyId, secret: &[u8]) -> (Initiator, Msg) {
        let (i, hello) = Initiator::start(&key_id, secret, Protection::Encrypted);
        (i, Msg::Hello { key_id, protection: Protection::Encrypted, hello })
    }

    /// From now on, frames travel sealed with `channel`'s keys.
    pub fn seal(&mut self, channel: Channel) {
        let s = Box::new(self.s.try_clone().unwrap());
        self.io = Box::new(Sealed::new(s, channel.sealer, channel.opener, &[]));
        self.session_key = Some(channel.session_key);
    }

    /// Hello, Challenge, Proof with `token`; returns the sealed connection
    /// and the bytes it sent (to replay them).
    pub fn handshake(addr: &str, token: &[u8]) -> (Raw, Vec<u8>, Vec<u8>) {
        Raw::handshake_with(addr, TOKEN_KEY_ID, token)
    }

    /// Hello, Challenge, Proof with the secret `key_id` names (a ticket).
    pub fn handshake_with(addr: &str, key_id: KeyId, secret: &[u8]) -> (Raw, Vec<u8>, Vec<u8>) {
        let mut c = Raw::connect(addr);
        let (i, hello) = Raw::hello(key_id, secret);
        let hello = Raw::bytes(&hello);
        c.raw(&hello);
        let Some(Msg::Challenge { challenge }) = c.read() else { panic!("no challenge") };
        let (channel, proof) = i.finish(&challenge).expect("the server knows the token");
        let proof = Raw::bytes(&Msg::Proof { proof });
        c.raw(&proof);
        c.seal(channel);
        (c, hello, proof)
    }

    /// The server's side of the handshake on an accepted socket, with
    /// `token`: a server that knows the token.
    pub fn accept(s: TcpStream, token: &[u8]) -> Raw {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut c = Raw::over(s);
        let Some(Msg::Hello { key_id, protection, hello }) = c.read() else { panic!("no hello") };
        let (r, challenge) = Responder::answer(&key_id, token, protection, &hello).expect("a client with the token");
        c.send(&Msg::Challenge { challenge });
        let Some(Msg::Proof { proof }) = c.read() else { panic!("no proof") };
        c.seal(r.verify(&proof).expect("the client knows the token"));
        c
    }

    /// An authenticated control connection.
    pub fn control(addr: &str, token: &[u8]) -> Raw {
        let (mut c, _, _) = Raw::handshake(addr, token);
        assert_eq!(c.read(), Some(Msg::Welcome), "the right token was not welcomed");
        c.send(&Msg::OpenControl);
        c
    }

    /// Sends a request and reads the answer.
    pub fn read_after(&mut self, m: &Msg) -> Option<Msg> {
        self.send(m);
        self.read()
    }

    /// Sends a request and expects a refusal of `kind`.
    #[track_caller]
    pub fn refused(&mut self, m: &Msg, kind: ErrorKind) {
        self.send(m);
        match self.read() {
            Some(Msg::Error { kind: k, message }) => assert_eq!(k, kind, "{m:?} was refused as {k:?} ({message}), not {kind:?}"),
            other => panic!("{m:?} was not refused: {other:?}"),
        }
    }

    /// Opens a receiving session into `dest` and announces each of `paths`
    /// in it: every announcement must be refused, and the session then ends
    /// with nothing committed.
    pub fn announcements_refused(&mut self, dest: &str, options: dmover_proto::frame::TransferOptions, paths: &[&str]) {
        use dmover_proto::frame::FileMeta;
        self.send(&Msg::Receive { dest: dest.into(), options });
        assert!(matches!(self.read(), Some(Msg::SessionOpened { .. })));
        for (i, path) in paths.iter().enumerate() {
            let meta = FileMeta { path: path.to_string(), size: 5, mtime_s: 0, mtime_ns: 0, mode: 0o644, ..Default::default() };
            self.send(&Msg::Announce { id: i as u64, meta, digest: None });
        }
        for path in paths {
            match self.read() {
                Some(Msg::Failed { kind: ErrorKind::Refused, .. }) => {}
                m => panic!("the announcement of {path:?}, leaving the destination, was not refused: {m:?}"),
            }
        }
        self.send(&Msg::Finish { files: 0, bytes: 0, set_digest: 0 });
        assert!(matches!(self.read(), Some(Msg::Finished { files: 0, .. })));
    }
}
