//! Transports: the one small interface every byte stream implements, and
//! the layers stacked on it.
//!
//! A [`Transport`] is a reliable, ordered byte stream that can be split into a
//! reading half and a writing half and shut down from any thread. A
//! connection is a stack of transports:
//!
//! ```text
//!   frames (wire::FrameReader / FrameWriter)
//!   ─────────────────────────────────────────
//!   layers: each a Transport wrapping the one below
//!     Paced            --bwlimit: writes wait for a transfer-wide rate
//!     Sealed           every byte in sealed records (after the handshake)
//!   ─────────────────────────────────────────
//!   one byte stream: TcpStream (the network)
//!                    or Memory (two engines in one process: a local copy)
//!                    or Piped (a program that carries it, such as ssh)
//!                    or Channel (one of several over a pipe: mux)
//! ```
//!
//! At the bottom is exactly one byte stream: TCP between hosts, or one end
//! of an in-memory pair for a local copy. Every layer above is itself a
//! `Transport` that holds the one below and passes on what it does not
//! change (splitting, closing, socket options, the peer's name), so the
//! code that reads and writes frames never knows how many layers there
//! are. [`Sealed`] goes on every connection between hosts once its
//! handshake is done (see `handshake`); [`Layers`] is what the sender adds
//! on each of its data connections: the rate limit ([`Paced`]).

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::io::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dmover_proto::frame::{TransferFlags, TransferOptions};
use dmover_proto::record::Protection;
use rustix::net::sockopt;

pub mod memory;
pub mod mux;
mod piped;
mod sealed;
pub use mux::{Channel, Mux};
pub use piped::Piped;
pub use sealed::Sealed;

/// Opens one more data connection, authenticated and attached to the same session.
pub type Connector = Arc<dyn Fn() -> crate::error::Result<Box<dyn Transport>> + Send + Sync>;

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
    /// Applies the socket options of data connections.
    fn set_options(&self, _o: &SocketOptions) -> io::Result<()> {
        Ok(())
    }
    /// The bytes one connection can have unacknowledged in flight as the
    /// kernel sizes its send buffer now (0 where unknown).
    fn send_window(&self) -> u64 {
        0
    }
    /// Writes `head`, then `data`, whole. A layer that changes the bytes
    /// it carries (the sealing layer) may change them where they lie in
    /// `data`, which afterwards holds something else: for a block the
    /// caller sends once and then drops.
    fn write_consuming(&mut self, head: &[u8], data: &mut [u8]) -> io::Result<()> {
        write_all_vectored(self, head, data)
    }
}

/// Writes `a` then `b`, whole, in vectored writes.
pub(crate) fn write_all_vectored<W: Write + ?Sized>(w: &mut W, a: &[u8], b: &[u8]) -> io::Result<()> {
    write_all_slices(w, &mut [IoSlice::new(a), IoSlice::new(b)])
}

/// Writes what `slices` hold, whole, in vectored writes.
pub(crate) fn write_all_slices<W: Write + ?Sized>(w: &mut W, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match w.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Options for data connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketOptions {
    /// What the connection's records protect: encrypted (the default), or
    /// integrity only (`--no-encrypt`).
    pub protection: Protection,
    /// SO_SNDBUF and SO_RCVBUF, bytes; 0 keeps the kernel's autotuning.
    pub buffer: u32,
    /// TCP congestion control algorithm (TCP_CONGESTION), e.g. `cubic`;
    /// empty keeps the system's default.
    pub congestion: String,
}

impl SocketOptions {
    /// The options of the data connections a server opens for a
    /// third-party copy, as its client gave them.
    pub fn of(o: &TransferOptions) -> SocketOptions {
        let protection = if o.flags.contains(TransferFlags::NO_ENCRYPT) { Protection::Authenticated } else { Protection::Encrypted };
        SocketOptions { protection, buffer: o.tcp_buffer, ..SocketOptions::default() }
    }
}

impl Default for SocketOptions {
    fn default() -> SocketOptions {
        SocketOptions { protection: Protection::Encrypted, buffer: 0, congestion: String::new() }
    }
}

/// Sets the socket buffers and the congestion control `o` asks for.
fn set_socket_options(fd: impl AsFd, o: &SocketOptions) -> io::Result<()> {
    if o.buffer > 0 {
        sockopt::set_socket_send_buffer_size(&fd, o.buffer as usize)?;
        sockopt::set_socket_recv_buffer_size(&fd, o.buffer as usize)?;
    }
    if !o.congestion.is_empty() {
        sockopt::set_tcp_congestion(&fd, &o.congestion).map_err(|e| {
            let e = io::Error::from(e);
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
fn socket_send_window(fd: impl AsFd) -> u64 {
    sockopt::socket_send_buffer_size(fd).map_or(0, |v| v as u64 / 2)
}

/// The methods a layer passes on unchanged to the transport below it
/// (its field `inner`).
macro_rules! passed_on {
    () => {
        fn close(&self) {
            self.inner.close()
        }
        fn close_write(&self) {
            self.inner.close_write()
        }
        fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
            self.inner.set_read_timeout(t)
        }
        fn peer(&self) -> String {
            self.inner.peer()
        }
        fn set_options(&self, o: &SocketOptions) -> io::Result<()> {
            self.inner.set_options(o)
        }
        fn send_window(&self) -> u64 {
            self.inner.send_window()
        }
    };
}
use passed_on;

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
    fn set_options(&self, o: &SocketOptions) -> io::Result<()> {
        set_socket_options(self, o)
    }
    fn send_window(&self) -> u64 {
        socket_send_window(self)
    }
}

/// A Unix socket: one end of a pair joins two engines in one process with
/// the kernel's buffering between them (the engine's tests).
impl Transport for UnixStream {
    socket_transport!(UnixStream);
    fn peer(&self) -> String {
        "local".into()
    }
}

/// A transfer-wide rate limit: every connection paced by one `Pacer` waits
/// so that the bytes they have all written, counted from the first of them,
/// stay within `rate` bytes per second on average. (Counting from the
/// pacer's creation would let the time spent setting connections up go out
/// as one burst.)
pub struct Pacer {
    /// Bytes per second.
    rate: u64,
    /// When the first byte was written.
    started: std::sync::OnceLock<Instant>,
    /// Bytes that have been given a time slot.
    granted: AtomicU64,
}

impl Pacer {
    /// A pacer for `rate` bytes per second (more than 0).
    pub fn new(rate: u64) -> Pacer {
        assert!(rate > 0, "a pacer needs a rate");
        Pacer { rate, started: std::sync::OnceLock::new(), granted: AtomicU64::new(0) }
    }

    /// Waits until `n` more bytes keep the average rate under the limit,
    /// and counts them as sent.
    fn take(&self, n: u64) {
        let total = self.granted.fetch_add(n, Ordering::Relaxed) + n;
        let due = Duration::from_secs_f64(total as f64 / self.rate as f64);
        let now = self.started.get_or_init(Instant::now).elapsed();
        if due > now {
            std::thread::sleep(due - now);
        }
    }

    /// Gives back `n` bytes taken and not sent after all.
    fn give_back(&self, n: u64) {
        self.granted.fetch_sub(n, Ordering::Relaxed);
    }

    /// Waits for `n` bytes as [`take`](Pacer::take) does, runs `write`
    /// (which sends at most `n`) and gives back what it did not send.
    fn write(&self, n: usize, write: impl FnOnce() -> io::Result<usize>) -> io::Result<usize> {
        self.take(n as u64);
        let r = write();
        let sent = r.as_ref().map_or(0, |&k| k.min(n));
        self.give_back((n - sent) as u64);
        r
    }
}

/// A layer that paces what is written through it against a [`Pacer`],
/// which may be shared with other connections (`--bwlimit` is the rate of
/// a whole transfer, whatever the number of its streams). Reads pass
/// through unpaced.
pub struct Paced {
    inner: Box<dyn Transport>,
    pacer: Arc<Pacer>,
}

impl Paced {
    /// `inner` with its writes paced by `pacer`.
    pub fn new(inner: Box<dyn Transport>, pacer: Arc<Pacer>) -> Paced {
        Paced { inner, pacer }
    }
}

impl Read for Paced {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf)
    }
}

impl Write for Paced {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.pacer.write(buf.len(), || self.inner.write(buf))
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let n = bufs.iter().map(|b| b.len()).sum();
        self.pacer.write(n, || self.inner.write_vectored(bufs))
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Transport for Paced {
    fn split(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(Paced::new(self.inner.split()?, self.pacer.clone())))
    }
    passed_on!();
}

/// The layers a sender puts on each of its data connections, the same for
/// all connections of one transfer (those it starts with and those it
/// opens while sending).
pub struct Layers {
    /// Paces every data connection of the transfer together (none: no limit).
    pacer: Option<Arc<Pacer>>,
}

impl Layers {
    /// Layers for a transfer limited to `bwlimit` bytes per second over all
    /// its data connections (0: no limit), counted from the first byte written.
    pub fn new(bwlimit: u64) -> Layers {
        Layers { pacer: (bwlimit > 0).then(|| Arc::new(Pacer::new(bwlimit))) }
    }

    /// `t` with the layers on top.
    pub fn wrap(&self, t: Box<dyn Transport>) -> Box<dyn Transport> {
        match &self.pacer {
            Some(p) => Box::new(Paced::new(t, p.clone())),
            None => t,
        }
    }
}

/// How long to wait for a TCP connection to be accepted.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens a TCP connection to `addr` (`host:port`) with the options data
/// transfer wants: no Nagle delay.
pub fn connect_tcp(addr: &str) -> io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(unknown_host)?.collect();
    if addrs.is_empty() {
        return Err(io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address")));
    }
    connect_any(&addrs)
}

/// A host name the resolver says has no address at all (glibc's
/// EAI_NONAME and EAI_NODATA) as `NotFound`, which no retry cures; a
/// resolver that could not be asked (EAI_AGAIN) stays as it was, for a
/// retry.
fn unknown_host(e: io::Error) -> io::Error {
    let said = e.to_string();
    if ["Name or service not known", "No address associated with hostname"].iter().any(|m| said.contains(m)) {
        io::Error::new(io::ErrorKind::NotFound, format!("the host name does not resolve ({said})"))
    } else {
        e
    }
}

/// Opens a TCP connection, as [`connect_tcp`] does, to the first of
/// `addrs` that accepts one.
pub fn connect_any(addrs: &[SocketAddr]) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address to connect to");
    for a in addrs {
        match TcpStream::connect_timeout(a, CONNECT_TIMEOUT) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A connected pair of TCP sockets on loopback.
    fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = connect_tcp(&l.local_addr().unwrap().to_string()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// Reads `t` to its end in another thread; the join gives the bytes.
    fn drain(mut t: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            t.read_to_end(&mut v).unwrap();
            v
        })
    }

    #[test]
    fn paced_connections_share_one_transfer_wide_rate() {
        const RATE: u64 = 4 << 20;
        let layers = Layers::new(RATE);
        let started = Instant::now();
        let mut writers = Vec::new();
        let mut readers = Vec::new();
        for _ in 0..2 {
            let (a, b) = UnixStream::pair().unwrap();
            readers.push(drain(b));
            let mut w = layers.wrap(Box::new(a));
            writers.push(std::thread::spawn(move || {
                for _ in 0..16 {
                    w.write_all(&[7u8; 64 << 10]).unwrap();
                }
                w.close_write();
            }));
        }
        writers.into_iter().for_each(|w| w.join().unwrap());
        let took = started.elapsed();
        let got: usize = readers.into_iter().map(|r| r.join().unwrap().len()).sum();
        assert_eq!(got, 2 << 20);
        // 2 MiB at 4 MiB/s: the last write may start at 0.5 s, not before.
        assert!(took >= Duration::from_millis(490), "2 MiB in {took:?} at {RATE} B/s");
        assert!(took < Duration::from_secs(3), "2 MiB in {took:?} at {RATE} B/s");
    }

    #[test]
    fn without_a_limit_there_is_no_layer() {
        let (a, _b) = UnixStream::pair().unwrap();
        let t: Box<dyn Transport> = Box::new(a);
        let bottom = &*t as *const dyn Transport as *const u8;
        let t = Layers::new(0).wrap(t);
        assert_eq!(&*t as *const dyn Transport as *const u8, bottom);
    }

    #[test]
    fn socket_options_are_set_and_refused_by_name() {
        let (a, _b) = tcp_pair();
        let t: Box<dyn Transport> = Layers::new(1 << 20).wrap(Box::new(a));
        t.set_options(&SocketOptions { buffer: 64 << 10, ..Default::default() }).unwrap();
        // Linux doubles the size asked for; half of it is the window.
        assert_eq!(t.send_window(), 64 << 10);
        let e = t.set_options(&SocketOptions { congestion: "no-such-algorithm".into(), ..Default::default() }).unwrap_err();
        assert!(e.to_string().contains("congestion control 'no-such-algorithm' is not available here"), "{e}");
    }
}
