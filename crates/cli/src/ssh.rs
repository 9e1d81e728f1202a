//! Hosts reached over ssh: `[user@]host:path` and
//! `ssh://[user@]host[:port]/path` locations, with no daemon at the far end.
//!
//! The system's `ssh` program starts `dmover remote` on the host (so keys,
//! agents, `~/.ssh/config`, ProxyJump and site policies all apply), and
//! hands it a one-time token on its standard input. The remote end listens
//! on a fresh port of the address the ssh connection reached, says which on
//! its standard output, and serves the user's own files, with the user's
//! own permissions: `home` is the home directory, `root` is `/`. From then
//! on the ssh pipe carries the client's control connections (channels of a
//! [`Mux`]) and data connections go straight to the port; each connection
//! is authenticated with the one-time token and encrypted, as with any
//! `dmover serve`. When the port cannot be reached (a firewall lets only
//! ssh through), or with `--via-ssh`, every data connection is carried by
//! an ssh of its own instead, running `dmover remote --relay` to join the
//! remote end's port from the inside. When the client ends — or is killed,
//! or the link dies — the pipe closes and the remote end exits: no process
//! and no port is left behind.

use clap::Args;
use dmover_engine::session::{Credential, Dialer};
use dmover_engine::transport::{Mux, Piped, Transport};
use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The first word of the remote end's ready line.
pub(crate) const READY: &str = "dmover-remote";

/// Where a host reached over ssh is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshTarget {
    pub user: Option<String>,
    pub host: String,
    pub port: Option<u16>,
}

impl SshTarget {
    /// `user@host` or `host`, as ssh takes it.
    pub fn destination(&self) -> String {
        match &self.user {
            Some(u) => format!("{u}@{}", self.host),
            None => self.host.clone(),
        }
    }
}

fn bad(s: &str, why: &str) -> Error {
    Error::new(ErrorKind::Usage, s, format!("malformed ssh location: {why} (expected [user@]host:path or ssh://[user@]host[:port]/path)"))
}

/// `[user@]host[:port]` (an IPv6 address in brackets); a port only where
/// `with_port`.
fn parse_authority(s: &str, a: &str, with_port: bool) -> Result<SshTarget> {
    let (user, hostport) = match a.rsplit_once('@') {
        Some((u, h)) if !u.is_empty() => (Some(u.to_string()), h),
        Some(_) => return Err(bad(s, "empty user")),
        None => (None, a),
    };
    let (host, port) = match hostport.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6.split_once(']').ok_or_else(|| bad(s, "unclosed '['"))?;
            (host, after.strip_prefix(':'))
        }
        None if with_port => match hostport.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        },
        None => (hostport, None),
    };
    if host.is_empty()
        || host.starts_with('-')
        || host.contains(['/', ' ', '@'])
        || (!with_port && host.contains(':') && !hostport.starts_with('['))
    {
        return Err(bad(s, &format!("bad host '{host}'")));
    }
    let port = match port {
        Some(p) if with_port => Some(p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| bad(s, &format!("bad port '{p}'")))?),
        Some(_) => return Err(bad(s, "a port goes in the ssh:// form")),
        None => None,
    };
    Ok(SshTarget { user, host: host.to_string(), port })
}

/// The path as the remote end exports it: `home/...` for a path relative
/// to the home directory, `root/...` for an absolute one, spelled as names
/// travel (a path typed here is a file's path, as a local one is).
fn export_path(s: &str, path: &str) -> Result<String> {
    let path = dmover_proto::path::from_bytes(path.as_bytes());
    let exported = match path.strip_prefix('/') {
        Some(abs) => format!("root/{abs}"),
        None if path.is_empty() => "home/".to_string(),
        None => format!("home/{path}"),
    };
    let body = exported.trim_end_matches('/');
    dmover_proto::path::check_relative(body).map_err(|e| bad(s, &e.to_string()))?;
    Ok(exported)
}

/// Parses an ssh location, or None if `s` is not one. As in rsync, a
/// colon before any slash makes a location remote; a local path with such
/// a colon is written `./a:b`.
/// Several hosts, separated by commas (`host1,host2:path`), name the same
/// path on each.
pub fn parse(s: &str) -> Result<Option<(Vec<SshTarget>, String)>> {
    let targets =
        |authorities: &str, with_port: bool| authorities.split(',').map(|a| parse_authority(s, a, with_port)).collect::<Result<Vec<_>>>();
    if let Some(rest) = s.strip_prefix("ssh://") {
        let (authority, path) = rest.split_once('/').ok_or_else(|| bad(s, "no path"))?;
        let target = targets(authority, true)?;
        // ssh://host/~/dir is relative to the home directory, ssh://host/dir absolute.
        let path = match path.strip_prefix('~') {
            Some(home) => home.trim_start_matches('/').to_string(),
            None => format!("/{path}"),
        };
        return Ok(Some((target, export_path(s, &path)?)));
    }
    if s.contains("://") {
        return Ok(None);
    }
    let colon = if s.starts_with('[') { s.find("]:").map(|i| i + 1) } else { s.find(':') };
    let Some(colon) = colon.filter(|&c| !s[..c].contains('/')) else { return Ok(None) };
    Ok(Some((targets(&s[..colon], false)?, export_path(s, &s[colon + 1..])?)))
}

/// How to reach hosts over ssh, as rsync's `-e` and `--rsync-path`.
#[derive(Args, Debug, Clone)]
pub struct SshOptions {
    /// The ssh command for [user@]host:path locations, with its options
    /// (e.g. 'ssh -p 2222 -i key'), split as a shell splits words.
    #[arg(long, value_name = "COMMAND", default_value = "ssh", env = "DMOVER_SSH")]
    pub ssh: String,
    /// The dmover to run on a host reached over ssh.
    #[arg(long, value_name = "PATH", default_value = "dmover")]
    pub remote_dmover: String,
    /// Carry every data connection to a host reached over ssh inside an
    /// ssh of its own, not straight to its port (dmover does so by itself
    /// when the port cannot be reached).
    #[arg(long)]
    pub via_ssh: bool,
}

impl SshOptions {
    /// The ssh command line that runs `command` on `t`.
    fn command(&self, t: &SshTarget, command: &str) -> Result<Command> {
        let usage = |m: String| Error::new(ErrorKind::Usage, "--ssh", m);
        let argv =
            shlex::split(&self.ssh).filter(|a| !a.is_empty()).ok_or_else(|| usage(format!("cannot split '{}' into words", self.ssh)))?;
        let remote = shlex::try_quote(&self.remote_dmover).map_err(|e| Error::new(ErrorKind::Usage, "--remote-dmover", e.to_string()))?;
        let mut c = Command::new(&argv[0]);
        c.args(&argv[1..]);
        if let Some(p) = t.port {
            c.args(["-p".to_string(), p.to_string()]);
        }
        c.args(["--".to_string(), t.destination(), format!("{remote} remote{command}")]);
        c.stdin(Stdio::piped()).stdout(Stdio::piped());
        Ok(c)
    }
}

/// Reaches the remote end's port from the inside: each connection is an
/// ssh running `dmover remote --relay ADDR` on the host.
struct OverSsh {
    target: SshTarget,
    options: SshOptions,
    /// The remote end's address, as the host sees it.
    addr: String,
}

impl Dialer for OverSsh {
    fn dial(&self, _host: &str) -> std::io::Result<Box<dyn Transport>> {
        let mut c = self.options.command(&self.target, &format!(" --relay {}", self.addr)).map_err(std::io::Error::other)?;
        let child = c.stderr(Stdio::inherit()).spawn()?;
        Ok(Box::new(Piped::new(child, format!("{} (over ssh)", self.target.destination()))?))
    }
}

/// How long a first data connection may take to reach the remote end's
/// port before dmover carries data connections over ssh instead.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The data connections to a remote end: straight to its port, unless the
/// first of them cannot reach it (a firewall lets only ssh through); from
/// then on, each inside an ssh of its own.
struct DataRoute {
    /// `user@host`, for the message that says so.
    host: String,
    addr: std::net::SocketAddr,
    over_ssh: OverSsh,
    /// Whether the port answers: None until a connection has tried.
    reachable: Mutex<Option<bool>>,
}

impl DataRoute {
    /// Tries the port directly (within [`PROBE_TIMEOUT`] while it is not
    /// known to answer); remembers a failure and says so, once.
    fn connect(&self) -> std::io::Result<std::net::TcpStream> {
        let known = *self.reachable.lock().expect("route lock");
        let limit = if known == Some(true) { dmover_engine::transport::CONNECT_TIMEOUT } else { PROBE_TIMEOUT };
        let tried = std::net::TcpStream::connect_timeout(&self.addr, limit);
        let mut reachable = self.reachable.lock().expect("route lock");
        match &tried {
            Ok(_) => *reachable = Some(true),
            Err(e) if known.is_none() && reachable.is_none() => {
                *reachable = Some(false);
                errln!("dmover: {}: port {} cannot be reached directly ({e}); data connections go over ssh", self.host, self.addr.port());
            }
            Err(_) => {}
        }
        tried
    }
}

impl Dialer for DataRoute {
    fn dial(&self, host: &str) -> std::io::Result<Box<dyn Transport>> {
        let known = *self.reachable.lock().expect("route lock");
        if known != Some(false) {
            match self.connect() {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    return Ok(Box::new(s));
                }
                Err(e) if known == Some(true) => return Err(e),
                Err(_) => {}
            }
        }
        self.over_ssh.dial(host)
    }

    fn direct(&self) -> bool {
        let known = *self.reachable.lock().expect("route lock");
        known.unwrap_or_else(|| self.connect().is_ok())
    }
}

/// A remote end started over ssh; it exits when this is dropped.
pub struct Endpoint {
    /// ssh (None once handed to the thread that reaps it).
    child: Option<Child>,
    /// The ssh pipe: it carries the control connections, and closing it
    /// ends the remote end.
    pipe: Mux,
    /// `ip:port` the remote end listens on.
    pub addr: String,
    pub cred: Credential,
}

/// How long the remote end has to say it is ready (ssh may ask for a
/// password or a passphrase on the terminal first).
const READY_TIMEOUT: Duration = Duration::from_secs(120);

impl Endpoint {
    /// Starts `dmover remote` on `t` over ssh.
    pub fn start(t: &SshTarget, o: &SshOptions) -> Result<Endpoint> {
        let host = t.destination();
        let mut c = o.command(t, "")?;
        let mut child = c.stderr(Stdio::piped()).spawn().map_err(|e| {
            let program = c.get_program().to_string_lossy().into_owned();
            Error::new(ErrorKind::Usage, "--ssh", format!("cannot run '{program}': {e}"))
        })?;
        let said = forward_stderr(child.stderr.take().expect("piped stderr"), host.clone());
        let token: [u8; 32] = dmover_engine::handshake::random();
        let mut stdin = child.stdin.take().expect("piped stdin");
        // A remote end that never starts has closed its input: its error is on stderr.
        let _ = writeln!(stdin, "{}", hex::encode(token));
        let _ = stdin.flush();
        let (tx, rx) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut line = String::new();
            let _ = r.read_line(&mut line);
            let _ = tx.send((line, r));
        });
        let (line, stdout) = match rx.recv_timeout(READY_TIMEOUT) {
            Ok((line, r)) => (line, Some(r)),
            Err(_) => (String::new(), None),
        };
        let addr = match ready_addr(&line) {
            Ok(addr) => addr,
            Err(why) => {
                drop(stdin);
                return Err(failed(child, &host, o, &said, why));
            }
        };
        let stdout = stdout.expect("a ready line was read");
        said.lock().expect("stderr lock").forward = true;
        let pipe = Mux::opener(stdout, stdin, host.clone());
        let over_ssh = OverSsh { target: t.clone(), options: o.clone(), addr: addr.to_string() };
        let via: Arc<dyn Dialer> = if o.via_ssh {
            errln!("dmover: {host}: --via-ssh: data connections go over ssh");
            Arc::new(over_ssh)
        } else {
            Arc::new(DataRoute { host: host.clone(), addr, over_ssh, reachable: Mutex::new(None) })
        };
        let cred = Credential { via: Some(via), control: Some(Arc::new(pipe.clone())), ..Credential::token(&token) };
        Ok(Endpoint { child: Some(child), pipe, addr: addr.to_string(), cred })
    }
}

/// Why the remote end did not start (its input is closed): ssh's own
/// message, or what to do about a dmover that is missing or of another version.
fn failed(mut child: Child, host: &str, o: &SshOptions, said: &Mutex<Said>, why: String) -> Error {
    let status = wait_for(&mut child, Duration::from_secs(5));
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    // Give the stderr reader a moment to take the last words.
    std::thread::sleep(Duration::from_millis(100));
    let text = said.lock().expect("stderr lock").text.trim().to_string();
    let missing = status == Some(127) || text.contains("command not found") || text.contains("No such file");
    if missing {
        let msg = format!("dmover is not on {host} (tried '{}'){}", o.remote_dmover, quoted(&text));
        return Error::new(ErrorKind::Usage, host, msg).advised("install dmover there, or give its path with --remote-dmover PATH");
    }
    // ssh's own words when the host refused every way of logging in.
    if status == Some(255) && (text.contains("Permission denied") || text.contains("Too many authentication failures")) {
        let msg = format!("ssh could not log in{}", quoted(&text));
        return Error::new(ErrorKind::Auth, host, msg)
            .advised("check the user name and key: `ssh HOST` must log in without a password prompt");
    }
    if status == Some(255) || (status.is_some() && why.is_empty()) {
        let msg = format!("ssh failed (exit {}){}", status.unwrap_or(-1), quoted(&text));
        return Error::new(ErrorKind::Unreachable, host, msg)
            .advised("check that `ssh HOST` works from this shell, or give the command with --ssh");
    }
    Error::new(ErrorKind::Unreachable, host, format!("the remote dmover did not start: {why}{}", quoted(&text)))
}

impl Drop for Endpoint {
    /// Closes the ssh pipe: the remote end exits (letting running transfers
    /// end for a moment), and ssh with it. A command that ends now does not
    /// wait for that; one that goes on reaps ssh, killing it if it lingers.
    fn drop(&mut self) {
        let closed = self.pipe.close();
        if let Some(mut child) = self.child.take() {
            if !closed {
                // A write stuck on the pipe (the link died): ssh must go.
                let _ = child.kill();
            }
            std::thread::spawn(move || {
                if wait_for(&mut child, Duration::from_secs(5)).is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            });
        }
    }
}

fn quoted(text: &str) -> String {
    if text.is_empty() {
        String::new()
    } else {
        format!(": {text}")
    }
}

/// The address in the remote end's ready line, or why there is none.
fn ready_addr(line: &str) -> std::result::Result<std::net::SocketAddr, String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        [READY, version, ip, port] => {
            let ours = dmover_proto::frame::MAGIC[7].to_string();
            if *version != ours {
                return Err(format!(
                    "it speaks protocol version {version}, this dmover speaks {ours}: install the same release at both ends"
                ));
            }
            let ip: std::net::IpAddr = ip.parse().map_err(|_| format!("bad address '{ip}' in its answer"))?;
            let port: u16 = port.parse().map_err(|_| format!("bad port '{port}' in its answer"))?;
            Ok(std::net::SocketAddr::new(ip, port))
        }
        [] => Err(String::new()),
        // An older or newer release answering in its own way, naming itself.
        ["dmover", version, ..] => Err(format!(
            "it is dmover {version}, and this is dmover {}: install the same release at both ends, or name one with --remote-dmover PATH",
            env!("CARGO_PKG_VERSION")
        )),
        _ => Err(format!("unexpected answer '{}'", line.trim())),
    }
}

/// The exit code of `child` once it has exited, waiting up to `limit`.
fn wait_for(child: &mut Child, limit: Duration) -> Option<i32> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return Some(s.code().unwrap_or(-1)),
            Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => return None,
        }
    }
}

/// What ssh and the remote end write on stderr.
#[derive(Default)]
struct Said {
    /// Everything before the remote end was ready, for error messages.
    text: String,
    /// Once ready, lines are passed on to our stderr as they come.
    forward: bool,
}

fn forward_stderr(err: impl Read + Send + 'static, host: String) -> Arc<Mutex<Said>> {
    let said = Arc::new(Mutex::new(Said::default()));
    let keep = said.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(std::io::Result::ok) {
            let mut s = keep.lock().expect("stderr lock");
            if s.forward {
                errln!("{host}: {}", dmover_proto::path::printable(&line));
            } else if s.text.len() < 4096 {
                s.text.push_str(&line);
                s.text.push('\n');
            }
        }
    });
    said
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(user: Option<&str>, host: &str, port: Option<u16>) -> SshTarget {
        SshTarget { user: user.map(String::from), host: host.into(), port }
    }

    #[test]
    fn parses_scp_and_url_forms() {
        let cases = [
            ("host:data/x", t(None, "host", None), "home/data/x"),
            ("me@host:/scratch/x/", t(Some("me"), "host", None), "root/scratch/x/"),
            ("host:", t(None, "host", None), "home/"),
            ("[::1]:/tmp", t(None, "::1", None), "root/tmp"),
            ("ssh://me@host:2222/scratch/x", t(Some("me"), "host", Some(2222)), "root/scratch/x"),
            ("ssh://host/~/data", t(None, "host", None), "home/data"),
            ("ssh://[::1]:22/tmp", t(None, "::1", Some(22)), "root/tmp"),
        ];
        for (s, target, path) in cases {
            assert_eq!(parse(s).unwrap(), Some((vec![target], path.to_string())), "{s}");
        }
        let two = parse("a,me@b:x").unwrap().unwrap();
        assert_eq!(two, (vec![t(None, "a", None), t(Some("me"), "b", None)], "home/x".to_string()));
        for local in ["./a:b", "/tmp/a:b", "dir/x:y", "plain", "dmover://h/e"] {
            assert_eq!(parse(local).unwrap(), None, "{local}");
        }
        for bad in ["@host:x", ":x", "-oProxyCommand=x:y", "host:../x", "ssh://host", "ssh://host:0/x", "ssh://h:x/y", "a,:x", "a,-ob:x"] {
            assert_eq!(parse(bad).unwrap_err().kind, ErrorKind::Usage, "{bad}");
        }
    }

    #[test]
    fn the_ready_line_names_an_address_of_this_protocol_version() {
        let v = dmover_proto::frame::MAGIC[7];
        assert_eq!(ready_addr(&format!("dmover-remote {v} 10.0.0.5 4711\n")).unwrap().to_string(), "10.0.0.5:4711");
        assert_eq!(ready_addr(&format!("dmover-remote {v} ::1 4711")).unwrap().to_string(), "[::1]:4711");
        assert!(ready_addr("dmover-remote 1 10.0.0.5 4711").unwrap_err().contains("protocol version 1"));
        assert!(ready_addr("Welcome to host!").unwrap_err().contains("unexpected answer"));
        let other = ready_addr("dmover 0.0.9 (1234abc 2026-01-01)").unwrap_err();
        assert!(other.contains("it is dmover 0.0.9") && other.contains("--remote-dmover"), "{other}");
    }
}
