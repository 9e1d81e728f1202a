//! Transports: the one small interface every byte stream implements.
//!
//! A [`Transport`] is a reliable, ordered byte stream that can be split into a
//! reading half and a writing half and shut down from any thread. TCP is the
//! network transport; a Unix socket pair connects two engines in one process
//! (local-to-local copies). Encryption or rate limits would be layers that
//! wrap a `Transport`.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// A byte stream between two dmover endpoints.
pub trait Transport: Read + Write + Send + Sync + 'static {
    /// A second handle to the same stream, for reading while another thread writes.
    fn split(&self) -> io::Result<Box<dyn Transport>>;
    /// Ends the stream in both directions; blocked reads and writes return.
    fn close(&self);
    /// Ends the sending direction only: the peer reads what was sent, then
    /// the end of the stream, while this end can still read.
    fn close_write(&self);
    /// Fails reads that wait longer than `t` (None: wait forever).
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// The peer, for messages.
    fn peer(&self) -> String;
    /// Sends `head` and then up to `len` bytes of `file` from `offset`,
    /// without copying the file's bytes through user space where the
    /// transport can. Returns how many file bytes went (fewer if the file
    /// shrank: the caller sends the rest from memory), or `None` if the
    /// transport cannot (the caller writes everything from memory).
    fn send_file(&mut self, _head: &[u8], _file: &File, _offset: u64, _len: usize) -> Option<io::Result<usize>> {
        None
    }
    /// Applies the socket options of data connections.
    fn set_options(&self, _o: &SocketOptions) -> io::Result<()> {
        Ok(())
    }
    /// The bytes one connection can have unacknowledged in flight as the
    /// kernel sizes its send buffer now (0 where unknown).
    fn send_window(&self) -> u64 {
        0
    }
}

/// Options for the sockets of data connections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SocketOptions {
    /// SO_SNDBUF and SO_RCVBUF, bytes; 0 keeps the kernel's autotuning.
    pub buffer: u32,
    /// TCP congestion control algorithm (TCP_CONGESTION), e.g. `cubic`;
    /// empty keeps the system's default.
    pub congestion: String,
}

fn setsockopt(fd: RawFd, level: libc::c_int, name: libc::c_int, value: &[u8]) -> io::Result<()> {
    // SAFETY: `value` is valid for reads of its length during the call.
    let r = unsafe { libc::setsockopt(fd, level, name, value.as_ptr().cast(), value.len() as libc::socklen_t) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn set_socket_options(fd: RawFd, o: &SocketOptions) -> io::Result<()> {
    if o.buffer > 0 {
        let v = (o.buffer as libc::c_int).to_ne_bytes();
        setsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, &v)?;
        setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, &v)?;
    }
    if !o.congestion.is_empty() {
        setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_CONGESTION, o.congestion.as_bytes()).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "congestion control '{}' is not available here ({e}); see /proc/sys/net/ipv4/tcp_available_congestion_control",
                    o.congestion
                ),
            )
        })?;
    }
    Ok(())
}

/// Half of SO_SNDBUF: Linux doubles the size asked for and counts its own
/// bookkeeping in it, so about half carries data.
fn socket_send_window(fd: RawFd) -> u64 {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for writes and describe an int.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, (&mut v as *mut libc::c_int).cast(), &mut len) };
    if r < 0 {
        return 0;
    }
    v.max(0) as u64 / 2
}

/// `send_file` for sockets: the head with MSG_MORE (so it shares a packet
/// with the data), then sendfile(2), which hands page-cache pages to the
/// socket.
fn socket_send_file(fd: RawFd, head: &[u8], file: &File, offset: u64, len: usize) -> io::Result<usize> {
    let mut sent = 0;
    while sent < head.len() {
        let rest = &head[sent..];
        // SAFETY: `rest` is valid for reads of its length during the call.
        let n = unsafe { libc::send(fd, rest.as_ptr().cast(), rest.len(), libc::MSG_MORE | libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
    }
    let mut off = offset as libc::off_t;
    let end = offset + len as u64;
    while (off as u64) < end {
        let want = (end - off as u64) as usize;
        // SAFETY: both descriptors are open; `off` is a valid pointer the kernel advances.
        let n = unsafe { libc::sendfile(fd, file.as_raw_fd(), &mut off, want) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break; // the file shrank
        }
    }
    Ok((off as u64 - offset) as usize)
}

/// The methods every socket type implements the same way.
macro_rules! socket_transport {
    ($t:ty) => {
        fn split(&self) -> io::Result<Box<dyn Transport>> {
            Ok(Box::new(self.try_clone()?))
        }
        fn close(&self) {
            let _ = self.shutdown(Shutdown::Both);
        }
        fn close_write(&self) {
            let _ = self.shutdown(Shutdown::Write);
        }
        fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
            <$t>::set_read_timeout(self, t)
        }
    };
}

impl Transport for TcpStream {
    socket_transport!(TcpStream);
    fn peer(&self) -> String {
        self.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into())
    }
    fn send_file(&mut self, head: &[u8], file: &File, offset: u64, len: usize) -> Option<io::Result<usize>> {
        Some(socket_send_file(self.as_raw_fd(), head, file, offset, len))
    }
    fn set_options(&self, o: &SocketOptions) -> io::Result<()> {
        set_socket_options(self.as_raw_fd(), o)
    }
    fn send_window(&self) -> u64 {
        socket_send_window(self.as_raw_fd())
    }
}

/// A socket pair joins two engines in one process (local copies).
impl Transport for UnixStream {
    socket_transport!(UnixStream);
    fn peer(&self) -> String {
        "local".into()
    }
}

/// How long to wait for a TCP connection to be accepted.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens a TCP connection to `addr` (`host:port`) with the options data
/// transfer wants: no Nagle delay.
pub fn connect_tcp(addr: &str) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address"));
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// How long a connection that ends in an error waits for the peer to hang up.
const LINGER: Duration = Duration::from_secs(2);

/// Stops sending and reads until the peer hangs up (or a short while
/// passes). Use it after sending an error: closing with the peer's messages
/// unread would reset the connection and could destroy the error message
/// before the peer reads it.
pub fn linger(t: &dyn Transport) {
    t.close_write();
    let Ok(mut r) = t.split() else { return };
    let _ = r.set_read_timeout(Some(LINGER));
    let deadline = std::time::Instant::now() + LINGER;
    let mut buf = [0u8; 16 * 1024];
    while std::time::Instant::now() < deadline && matches!(r.read(&mut buf), Ok(n) if n > 0) {}
}
