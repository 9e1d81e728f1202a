//! `dmover remote`: the far end of an ssh location (see [`crate::ssh`]),
//! started by the client's `ssh` on the host. It serves the user's own files
//! to holders of a one-time token, carries control connections over the ssh
//! pipe, and exits once that pipe closes; with `--relay` it carries one data
//! connection between the pipe and its port instead.

use crate::ssh::READY;
use clap::Args;
use dmover_engine::transport::Mux;
use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use std::io::{Read, Write};
use std::time::Duration;

/// `dmover remote`: the far end of an ssh location. Reads the one-time
/// token from its standard input, listens on a fresh port of the address
/// the ssh connection reached, says which on its standard output, serves
/// `home` (the home directory) and `root` (`/`) to holders of the token,
/// and exits once its standard input ends.
pub fn remote(a: RemoteArgs) -> Result<i32> {
    if let Some(addr) = a.relay {
        return relay(&addr);
    }
    let usage = |m: &str| Error::new(ErrorKind::Usage, "remote", m.to_string());
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| Error::io("stdin", &e))?;
    let token = hex::decode(line.trim())
        .ok()
        .filter(|t| t.len() == 32)
        .ok_or_else(|| usage("expected a token on stdin (dmover remote is started by dmover cp over ssh)"))?;
    let home = std::env::var("HOME").map_err(|_| usage("HOME is not set"))?;
    let mut exports = std::collections::HashMap::new();
    for (name, dir) in [("home", home.as_str()), ("root", "/")] {
        let store = dmover_engine::storage::export(name, std::path::Path::new(dir)).map_err(|e| Error::io(dir, &e))?;
        exports.insert(name.to_string(), store);
    }
    // SSH_CONNECTION is "client-ip client-port server-ip server-port": listen
    // where the client reached this host.
    let ip = std::env::var("SSH_CONNECTION").ok().and_then(|c| c.split_whitespace().nth(2).and_then(|ip| ip.parse().ok()));
    let ip: std::net::IpAddr = ip.unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
    let listener = crate::serve::bind(&std::net::SocketAddr::new(ip, 0).to_string())?;
    let port = listener.local_addr().map_err(|e| Error::io("listener", &e))?.port();
    let cfg = dmover_server::Config {
        // The user's own account, as a local copy is: owners are set
        // where the user may set them.
        allow_owners: exports.keys().cloned().collect(),
        exports,
        token,
        max_connections: 256,
        idle_timeout: Duration::from_secs(120),
        grace: Duration::from_secs(2),
        staging: 64 << 20,
        writers: 2,
        sink: None,
        ticket_lifetime: dmover_server::TICKET_LIFETIME,
        // Only the user who started it over ssh holds its token, and may
        // reach what this host reaches anyway.
        push_to: dmover_server::push_to::PushTo::anywhere(),
        metrics: Default::default(),
    };
    let (shutdown, signal) = dmover_server::shutdown_pair().map_err(|e| Error::io("signal pipe", &e))?;
    outln!("{READY} {} {ip} {port}", dmover_proto::frame::MAGIC[7]);
    // From here on the pipe carries the client's control connections.
    let (_, output) = unbuffered_stdio()?;
    let carried = Mux::acceptor(std::io::stdin(), output, "the client (ssh pipe)".into());
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        carried.iter().for_each(|c| drop(tx.send(c)));
        // The client's end of ssh went away and closed the pipe: time to go.
        shutdown.trigger();
    });
    dmover_server::run(listener, cfg, signal, Some(rx)).map_err(|e| Error::io("server", &e))?;
    Ok(0)
}

/// Standard input and output as plain files: Rust's stdout holds bytes
/// back until a newline, which a byte stream may never send.
fn unbuffered_stdio() -> Result<(std::fs::File, std::fs::File)> {
    use std::os::fd::AsFd;
    let unbuffered = |fd: std::os::fd::BorrowedFd| fd.try_clone_to_owned().map(std::fs::File::from).map_err(|e| Error::io("stdio", &e));
    Ok((unbuffered(std::io::stdin().as_fd())?, unbuffered(std::io::stdout().as_fd())?))
}

/// The remote end's options.
#[derive(Args)]
pub struct RemoteArgs {
    /// Join the remote end listening at ADDR on this host: standard input
    /// to it, it to standard output (a connection carried by ssh).
    #[arg(long, value_name = "ADDR")]
    pub relay: Option<String>,
}

/// Carries one connection between standard input and output and the
/// remote end at `addr`, until either side ends.
fn relay(addr: &str) -> Result<i32> {
    let s = std::net::TcpStream::connect(addr).map_err(|e| Error::network(addr, &e))?;
    let _ = s.set_nodelay(true);
    let mut to = s.try_clone().map_err(|e| Error::network(addr, &e))?;
    let (mut input, mut output) = unbuffered_stdio()?;
    std::thread::spawn(move || {
        pump(&mut input, &mut to);
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
    let mut from = s;
    pump(&mut from, &mut output);
    Ok(0)
}

/// Copies `from` to `to` until the end of `from` or an error, with plain
/// reads and writes: `std::io::copy`, which may use splice(2) between a
/// socket and a pipe, ended the relay at once.
fn pump(from: &mut impl Read, to: &mut impl Write) {
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}
