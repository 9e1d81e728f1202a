//! Framed I/O over a [`Transport`]: the thin driver between bytes and
//! [`dmover_proto`] frames.

use crate::error::{Error, Result};
use crate::transport::Transport;
use dmover_proto::digest::{BlockHasher, Sum};
use dmover_proto::frame::{DataHeader, DecodeError, Header, DATA_HEADER_LEN, HEADER_LEN, KIND_DATA, MAX_CONTROL_BODY};
use dmover_proto::{Msg, Phase};
use std::io::{self, BufReader, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Read buffer of a frame reader: large enough to take a data header and
/// the start of its block in one read.
const READ_BUFFER: usize = 256 * 1024;

/// Blocks are read (and checksummed) at most this many bytes at a time, so
/// that each piece is checksummed while it is still in the CPU's cache.
pub const PIECE: usize = 256 * 1024;

/// What arrived: a control message of the phase `P`, or a data header
/// whose block must be read next with [`FrameReader::read_block`].
#[derive(Debug)]
pub enum Incoming<P> {
    Msg(P),
    Data(DataHeader),
}

/// Reads frames from the reading half of a transport.
pub struct FrameReader {
    inner: BufReader<Box<dyn Transport>>,
    peer: String,
    body: Vec<u8>,
    /// Largest control body accepted (see [`FrameReader::limit`]).
    max_body: u32,
}

impl FrameReader {
    pub fn new(t: Box<dyn Transport>) -> FrameReader {
        let peer = t.peer();
        FrameReader { inner: BufReader::with_capacity(READ_BUFFER, t), peer, body: Vec::new(), max_body: MAX_CONTROL_BODY }
    }

    /// Refuses control frames longer than `max` bytes (at most the
    /// protocol's limit), e.g. while the peer is not yet authenticated.
    pub fn limit(&mut self, max: u32) {
        self.max_body = max.min(MAX_CONTROL_BODY);
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Bytes received and not yet decoded: zero means the next read waits.
    pub fn buffered(&self) -> usize {
        self.inner.buffer().len()
    }

    /// Gives up the reader, returning the bytes it had read ahead.
    pub fn into_buffered(self) -> Vec<u8> {
        self.inner.buffer().to_vec()
    }

    /// The next frame, a message of the phase `P` or data; connection
    /// errors are `Unreachable`, bad frames and messages that do not belong
    /// to the phase `Internal`.
    pub fn read<P: Phase>(&mut self) -> Result<Incoming<P>> {
        match self.read_frame()? {
            Incoming::Msg(m) => Ok(Incoming::Msg(self.expect(m)?)),
            Incoming::Data(h) => Ok(Incoming::Data(h)),
        }
    }

    /// The message as the phase `P`. Where `P` has no `Error`, an `Error`
    /// from the peer is returned as the error it reports; any other kind
    /// that does not belong to `P` is a protocol error naming both.
    fn expect<P: Phase>(&self, m: Msg) -> Result<P> {
        P::from_msg(m).map_err(|m| match m {
            Msg::Error { kind, message } => Error::new(kind, &self.peer, message),
            m => {
                let mut shown = format!("{m:?}");
                shown.truncate(120);
                Error::protocol(&self.peer, format!("unexpected {shown} in {}", P::NAME))
            }
        })
    }

    fn read_frame(&mut self) -> Result<Incoming<Msg>> {
        let mut h = [0u8; HEADER_LEN];
        self.inner.read_exact(&mut h).map_err(|e| self.net(&e))?;
        let h = Header::parse(&h).map_err(|e| Error::protocol(&self.peer, e))?;
        if h.kind == KIND_DATA {
            let mut d = [0u8; DATA_HEADER_LEN];
            self.inner.read_exact(&mut d).map_err(|e| self.net(&e))?;
            return Ok(Incoming::Data(DataHeader::decode(&h, &d)));
        }
        if h.len > self.max_body {
            let e = DecodeError::TooLong { kind: h.kind, len: h.len, max: self.max_body };
            return Err(Error::protocol(&self.peer, e));
        }
        // The body grows as its bytes arrive: a header alone reserves nothing.
        self.body.clear();
        let read = (&mut self.inner).take(h.len as u64).read_to_end(&mut self.body);
        let n = read.map_err(|e| self.net(&e))?;
        if n < h.len as usize {
            return Err(self.net(&io::ErrorKind::UnexpectedEof.into()));
        }
        let m = h.decode_msg(&self.body).map_err(|e| Error::protocol(&self.peer, e))?;
        Ok(Incoming::Msg(m))
    }

    /// The next frame, which must be a control message of the phase `P`.
    pub fn read_msg<P: Phase>(&mut self) -> Result<P> {
        match self.read_frame()? {
            Incoming::Msg(m) => self.expect(m),
            Incoming::Data(_) => Err(Error::protocol(&self.peer, format!("unexpected data frame in {}", P::NAME))),
        }
    }

    /// Reads `buf.len()` bytes of the frame being read (a sparse block's
    /// length and bitmap), counting them as [`read_block`](Self::read_block) does.
    pub fn read_exact(&mut self, buf: &mut [u8], received: &[&AtomicU64]) -> Result<()> {
        self.inner.read_exact(buf).map_err(|e| self.net(&e))?;
        for r in received {
            r.fetch_add(buf.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Reads the block that follows a data header into `buf` (exactly its
    /// length) and returns its checksum, taken piece by piece as the bytes
    /// arrive (while they are still in the CPU's cache). The bytes are added
    /// to each of the `received` counters as they arrive.
    pub fn read_block(&mut self, buf: &mut [u8], received: &[&AtomicU64]) -> Result<Sum> {
        let mut sum = BlockHasher::new();
        let mut at = 0;
        while at < buf.len() {
            let end = buf.len().min(at + PIECE);
            match self.inner.read(&mut buf[at..end]) {
                Ok(0) => return Err(self.net(&io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => {
                    sum.update(&buf[at..at + n]);
                    at += n;
                    for r in received {
                        r.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.net(&e)),
            }
        }
        Ok(sum.finish())
    }

    fn net(&self, e: &io::Error) -> Error {
        Error::network(&self.peer, e)
    }
}

/// Writes frames to the writing half of a transport, and keeps a quiet
/// connection alive (see [`FrameWriter::keep_alive`]).
pub struct FrameWriter {
    inner: Box<dyn Transport>,
    peer: String,
    /// Encoded messages not yet written (see [`FrameWriter::queue`]).
    pending: Vec<u8>,
    /// When a frame last went out (or the writer was made).
    last_write: Instant,
}

/// How often a connection with nothing to say pings its peer, given this
/// end's idle timeout. The peer's idle timeout is its own setting (`dmover
/// serve --idle-timeout`) and may be much shorter, so pings go at least
/// every second: a quiet control connection must never look idle while
/// data flows.
pub fn ping_interval(idle: Duration) -> Duration {
    (idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// Queued messages are written once they fill a record
/// ([`WRITE_PIECE`]), not only when the writer has nothing more to say: a
/// receiver answering a window of announcements, or a sender announcing
/// one, keeps its peer busy while it goes on, instead of the two taking
/// turns a window at a time.
const QUEUE_LIMIT: usize = WRITE_PIECE;

/// Queued messages go out in writes of at most this many bytes, so that on
/// a sealed connection each is a record of its own: a record is opened
/// only once all of it has arrived, and a new connection delivers a few
/// packets per round trip (TCP slow start). In records of 64 KiB, the
/// first announcements or plans of a transfer would wait two round trips
/// for the rest of their record; in records of a few packets, the peer
/// acts on the first ones while the others are on their way.
const WRITE_PIECE: usize = 4 * 1024;

impl FrameWriter {
    pub fn new(t: Box<dyn Transport>) -> FrameWriter {
        let peer = t.peer();
        FrameWriter { inner: t, peer, pending: Vec::with_capacity(256), last_write: Instant::now() }
    }

    /// Sends `Ping` if nothing went out for `every`, so that the peer's idle
    /// timeout does not fire. Every connection's one keepalive rule: whoever
    /// owns the writer calls this whenever it wakes, and wakes by
    /// [`ping_due`](FrameWriter::ping_due) at the latest.
    pub fn keep_alive(&mut self, every: Duration) -> Result<()> {
        if self.last_write.elapsed() < every {
            return Ok(());
        }
        self.send(Msg::Ping)
    }

    /// When [`keep_alive`](FrameWriter::keep_alive) will next have to ping.
    pub fn ping_due(&self, every: Duration) -> Instant {
        self.last_write + every
    }

    /// Sends one control message (after any queued ones).
    pub fn send(&mut self, m: impl Into<Msg>) -> Result<()> {
        m.into().encode(&mut self.pending);
        self.flush()
    }

    /// Queues a message, to go with others in one write: at the next
    /// [`flush`](FrameWriter::flush) or `send`, or when the queue is full.
    /// Whoever queues must flush before waiting for an answer.
    pub fn queue(&mut self, m: impl Into<Msg>) -> Result<()> {
        m.into().encode(&mut self.pending);
        if self.pending.len() >= QUEUE_LIMIT {
            return self.flush();
        }
        Ok(())
    }

    /// Writes the queued messages, in pieces of [`WRITE_PIECE`] bytes.
    pub fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let r = self.pending.chunks(WRITE_PIECE).try_for_each(|piece| self.inner.write_all(piece));
        self.pending.clear();
        self.last_write = Instant::now();
        r.map_err(|e| Error::network(&self.peer, &e))
    }

    /// Sends one block: header and data in one vectored write where possible.
    pub fn send_block(&mut self, h: &DataHeader, data: &[u8]) -> Result<()> {
        let head = h.encode();
        let r = crate::transport::write_all_vectored(&mut *self.inner, &head, data);
        self.last_write = Instant::now();
        r.map_err(|e| Error::network(&self.peer, &e))
    }

    /// Sends one block the caller drops afterwards, after `prefix` (a
    /// sparse block's length and bitmap, or nothing): the transport may
    /// seal it where it lies (see [`Transport::write_consuming`]).
    pub fn send_block_consuming(&mut self, h: &DataHeader, prefix: &[u8], data: &mut [u8]) -> Result<()> {
        let mut head = [0u8; HEADER_LEN + DATA_HEADER_LEN + dmover_proto::packed::MAX_PREFIX];
        let encoded = h.encode();
        head[..encoded.len()].copy_from_slice(&encoded);
        head[encoded.len()..encoded.len() + prefix.len()].copy_from_slice(prefix);
        let r = self.inner.write_consuming(&head[..encoded.len() + prefix.len()], data);
        self.last_write = Instant::now();
        r.map_err(|e| Error::network(&self.peer, &e))
    }

    /// Closes the underlying transport (both halves).
    pub fn close(&self) {
        self.inner.close()
    }

    /// Ends the sending direction (see [`Transport::close_write`]).
    pub fn close_write(&self) {
        self.inner.close_write()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// Only what goes out counts: flushing nothing does not put a ping off,
    /// so an owner that flushes before every wait still pings.
    #[test]
    fn a_quiet_writer_pings_once_its_interval_passed_whatever_it_flushed() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut w = FrameWriter::new(Box::new(a));
        let every = Duration::from_millis(30);
        w.keep_alive(every).unwrap();
        b.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 64];
        assert!((&b).read(&mut buf).is_err(), "pinged before its interval");
        std::thread::sleep(every);
        w.flush().unwrap();
        assert!(w.ping_due(every) <= Instant::now(), "an empty flush put the ping off");
        w.keep_alive(every).unwrap();
        let n = (&b).read(&mut buf).unwrap();
        assert_eq!(n, HEADER_LEN, "one ping, a header with no body");
        w.keep_alive(every).unwrap();
        assert!((&b).read(&mut buf).is_err(), "pinged again at once");
    }
}
