//! Transports: the one small interface every byte stream implements.
//!
//! A [`Transport`] is a reliable, ordered byte stream that can be split into a
//! reading half and a writing half and shut down from any thread. TCP is the
//! network transport; a Unix socket pair connects two engines in one process
//! (local-to-local copies). Encryption or rate limits would be layers that
//! wrap a `Transport`.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// A byte stream between two dmover endpoints.
pub trait Transport: Read + Write + Send + Sync + 'static {
    /// A second handle to the same stream, for reading while another thread writes.
    fn split(&self) -> io::Result<Box<dyn Transport>>;
    /// Ends the stream in both directions; blocked reads and writes return.
    fn close(&self);
    /// Fails reads that wait longer than `t` (None: wait forever).
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// The peer, for messages.
    fn peer(&self) -> String;
}

impl Transport for TcpStream {
    fn split(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn close(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
    fn peer(&self) -> String {
        self.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into())
    }
}

impl Transport for UnixStream {
    fn split(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn close(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }
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
