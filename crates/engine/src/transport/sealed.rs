//! The sealing layer: every byte an authenticated connection carries, in
//! sealed records (see `dmover_proto::record`).
//!
//! Writes are cut into records of at most `MAX_RECORD` bytes, sealed in
//! place in one buffer and sent with one system call for up to
//! [`WRITE_BATCH`] records; a write returns once all it was given is sent
//! (a block is written whole, as a layer above it expects). A block sent
//! once and dropped ([`Transport::write_consuming`]) is sealed where it
//! lies instead, each record's header and tag written beside it.
//!
//! Reads take whatever the socket has into a buffer, open each record in
//! place once it is whole, and hand out its payload; nothing is handed out before its record's tag is checked. A
//! read whose buffer can take a whole record's payload takes it there
//! straight from the socket, and into the reader's own buffer only the next
//! record's header: a block comes in without being copied once more. A
//! read that times out keeps what it has of a record, so the next read goes
//! on.
//!
//! The reading and writing halves of one connection (see
//! [`Transport::split`]) share one sealer and one opener, each behind its
//! own lock: a record's number is taken and its bytes written under the
//! same lock, so records go out in the order of their numbers whatever
//! thread writes them.

use super::{write_all_slices, SocketOptions, Transport};
use dmover_proto::record::{Opener, RecordError, Sealer, HEADER, MAX_RECORD, TAG};
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Records sealed together and written with one system call.
pub const WRITE_BATCH: usize = 4;
/// The largest record on the wire.
const RECORD: usize = HEADER + MAX_RECORD + TAG;
/// What a reader holds of what it read: a whole record, and room for the
/// start of the next one to come in the same read.
const READ_BUFFER: usize = RECORD + 4096;

/// A transport whose bytes travel in sealed records.
pub struct Sealed {
    inner: Box<dyn Transport>,
    tx: Arc<Mutex<Tx>>,
    rx: Arc<Mutex<Rx>>,
}

struct Tx {
    sealer: Sealer,
    /// Records being sealed and written.
    buf: Vec<u8>,
    /// A write failed part way: the stream is cut inside a record.
    broken: bool,
}

struct Rx {
    opener: Opener,
    /// Bytes from the socket: `buf[start..end]`, where the first record
    /// may already be open (then `plain` is its payload not yet read).
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    plain: std::ops::Range<usize>,
    /// A record failed its check: nothing more is read.
    broken: Option<RecordError>,
}

impl Sealed {
    /// `inner` with its bytes sealed by `sealer` and opened by `opener`.
    /// `early` holds bytes already read from `inner` that follow the
    /// handshake (a client may send its first request right away).
    pub fn new(inner: Box<dyn Transport>, sealer: Sealer, opener: Opener, early: &[u8]) -> Sealed {
        let mut buf = vec![0u8; READ_BUFFER.max(early.len())].into_boxed_slice();
        buf[..early.len()].copy_from_slice(early);
        let rx = Rx { opener, buf, start: 0, end: early.len(), plain: 0..0, broken: None };
        let tx = Tx { sealer, buf: Vec::new(), broken: false };
        Sealed { inner, tx: Arc::new(Mutex::new(tx)), rx: Arc::new(Mutex::new(rx)) }
    }
}

fn refused(e: RecordError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

impl Rx {
    /// The whole record at the start of the buffer, if it has arrived:
    /// opened, with `plain` set to its payload.
    fn open_next(&mut self, peer: &dyn Fn() -> String) -> io::Result<bool> {
        let have = self.end - self.start;
        if have < HEADER {
            return Ok(false);
        }
        let header: [u8; HEADER] = self.buf[self.start..self.start + HEADER].try_into().expect("a header");
        let len = Opener::payload_len(header).map_err(|e| self.fail(e, peer))?;
        let whole = HEADER + len + TAG;
        if have < whole {
            // Make room for the rest of the record behind what we have.
            if self.start + whole > self.buf.len() {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            return Ok(false);
        }
        let at = self.start;
        self.start += whole;
        match self.opener.open(&mut self.buf[at..at + whole]) {
            Ok(_) => {
                self.plain = at + HEADER..at + HEADER + len;
                Ok(true)
            }
            Err(e) => Err(self.fail(e, peer)),
        }
    }

    /// Reads the record whose header is at the start of the buffer (and
    /// nothing of it beyond) with its payload straight into `out`, which
    /// can take it; the next record's header, as far as it comes with it,
    /// into the buffer. Returns the payload's length once its tag is
    /// checked. If the socket fails part way, what came of the record goes
    /// back into the buffer, for the next read to go on from.
    fn read_into(&mut self, inner: &mut dyn Transport, out: &mut [u8], len: usize) -> io::Result<usize> {
        let header: [u8; HEADER] = self.buf[self.start..self.start + HEADER].try_into().expect("a header");
        let came = &self.buf[self.start + HEADER..self.end];
        let mut got = came.len().min(len);
        out[..got].copy_from_slice(&came[..got]);
        let mut tag = [0u8; TAG];
        let mut tag_got = came.len() - got;
        tag[..tag_got].copy_from_slice(&came[got..]);
        (self.start, self.end) = (0, 0);
        while got < len || tag_got < TAG {
            let mut parts =
                [IoSliceMut::new(&mut out[got..len]), IoSliceMut::new(&mut tag[tag_got..]), IoSliceMut::new(&mut self.buf[..HEADER])];
            let n = match inner.read_vectored(&mut parts) {
                Ok(n) if n > 0 => n,
                failed => {
                    let e = failed
                        .err()
                        .unwrap_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "the connection ended inside a record"));
                    // Put back what came, in the order it came.
                    let at = HEADER + got;
                    self.buf[..HEADER].copy_from_slice(&header);
                    self.buf[HEADER..at].copy_from_slice(&out[..got]);
                    self.buf[at..at + tag_got].copy_from_slice(&tag[..tag_got]);
                    self.end = at + tag_got;
                    return Err(e);
                }
            };
            let to_payload = n.min(len - got);
            got += to_payload;
            let to_tag = (n - to_payload).min(TAG - tag_got);
            tag_got += to_tag;
            self.end = n - to_payload - to_tag;
        }
        match self.opener.open_parts(header, &mut out[..len], tag) {
            Ok(()) => Ok(len),
            Err(e) => Err(self.fail(e, &|| inner.peer())),
        }
    }

    /// Refuses the rest of the connection, and says so in the log: a
    /// record that fails is an attack or a broken path, whoever reads it.
    fn fail(&mut self, e: RecordError, peer: &dyn Fn() -> String) -> io::Error {
        log::warn!("{}: {e}", peer());
        self.broken = Some(e.clone());
        refused(e)
    }
}

impl Read for Sealed {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let mut rx = self.rx.lock().expect("record reader lock");
        loop {
            if !rx.plain.is_empty() {
                let n = out.len().min(rx.plain.len());
                let from = rx.plain.start;
                out[..n].copy_from_slice(&rx.buf[from..from + n]);
                rx.plain.start += n;
                return Ok(n);
            }
            if let Some(e) = &rx.broken {
                return Err(refused(e.clone()));
            }
            if out.is_empty() || rx.open_next(&|| self.inner.peer())? {
                if out.is_empty() {
                    return Ok(0);
                }
                continue;
            }
            let have = rx.end - rx.start;
            if have >= HEADER {
                let header: [u8; HEADER] = rx.buf[rx.start..rx.start + HEADER].try_into().expect("a header");
                // Announced lengths were checked by open_next.
                let len = Opener::payload_len(header).map_err(refused)?;
                if len > 0 && len <= out.len() {
                    return rx.read_into(&mut *self.inner, out, len);
                }
            } else {
                // Less than a header (a few bytes at most): to the front.
                let (start, end) = (rx.start, rx.end);
                rx.buf.copy_within(start..end, 0);
                (rx.start, rx.end) = (0, have);
            }
            let end = rx.end;
            // A caller that can take a whole record takes the next one
            // straight (above): read only up to its header.
            let until = if out.len() >= MAX_RECORD && end < HEADER { HEADER } else { rx.buf.len() };
            match self.inner.read(&mut rx.buf[end..until]) {
                Ok(0) if rx.start == rx.end => return Ok(0),
                Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection ended inside a record")),
                Ok(n) => rx.end += n,
                Err(e) => return Err(e),
            }
        }
    }
}

impl Write for Sealed {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(data)])
    }

    /// Seals what `bufs` hold into records and writes them, up to
    /// [`WRITE_BATCH`] records a system call; returns once all is sent.
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut tx = self.tx.lock().expect("record writer lock");
        if tx.broken {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "an earlier write on this connection failed"));
        }
        let tx = &mut *tx;
        let mut taken = 0;
        let mut pieces = bufs.iter().map(|b| &b[..]).filter(|b| !b.is_empty()).peekable();
        while pieces.peek().is_some() {
            tx.buf.clear();
            while pieces.peek().is_some() && tx.buf.len() + RECORD <= WRITE_BATCH * RECORD {
                let at = tx.buf.len();
                tx.buf.resize(at + HEADER, 0);
                let mut len = 0;
                while len < MAX_RECORD {
                    let Some(p) = pieces.peek_mut() else { break };
                    let n = p.len().min(MAX_RECORD - len);
                    tx.buf.extend_from_slice(&p[..n]);
                    len += n;
                    *p = &p[n..];
                    if p.is_empty() {
                        pieces.next();
                    }
                }
                tx.buf.resize(at + HEADER + len + TAG, 0);
                tx.sealer.seal(&mut tx.buf[at..]).map_err(refused)?;
                taken += len;
            }
            if let Err(e) = self.inner.write_all(&tx.buf) {
                tx.broken = true;
                return Err(e);
            }
        }
        Ok(taken)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Transport for Sealed {
    fn split(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(Sealed { inner: self.inner.split()?, tx: self.tx.clone(), rx: self.rx.clone() }))
    }
    super::passed_on!();

    /// Seals `head` in a record of its own (it is small, and copied) and
    /// `data` in records where it lies, and writes them, up to
    /// [`WRITE_BATCH`] records of `data` a system call.
    fn write_consuming(&mut self, head: &[u8], data: &mut [u8]) -> io::Result<()> {
        let mut tx = self.tx.lock().expect("record writer lock");
        if tx.broken {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "an earlier write on this connection failed"));
        }
        let tx = &mut *tx;
        tx.buf.clear();
        if !head.is_empty() {
            tx.buf.resize(HEADER + head.len() + TAG, 0);
            tx.buf[HEADER..HEADER + head.len()].copy_from_slice(head);
            tx.sealer.seal(&mut tx.buf).map_err(refused)?;
        }
        let mut head_sent = tx.buf.is_empty();
        let mut batches = data.chunks_mut(WRITE_BATCH * MAX_RECORD).peekable();
        while !head_sent || batches.peek().is_some() {
            let batch = batches.next().unwrap_or_default();
            let mut sealed = [([0u8; HEADER], [0u8; TAG]); WRITE_BATCH];
            for (record, parts) in batch.chunks_mut(MAX_RECORD).zip(&mut sealed) {
                *parts = tx.sealer.seal_parts(record).map_err(refused)?;
            }
            let mut slices = [IoSlice::new(&[]); 1 + 3 * WRITE_BATCH];
            let mut k = 0;
            if !head_sent {
                slices[0] = IoSlice::new(&tx.buf);
                (k, head_sent) = (1, true);
            }
            for (record, (header, tag)) in batch.chunks(MAX_RECORD).zip(&sealed) {
                slices[k..k + 3].copy_from_slice(&[IoSlice::new(header), IoSlice::new(record), IoSlice::new(tag)]);
                k += 3;
            }
            if let Err(e) = write_all_slices(&mut *self.inner, &mut slices[..k]) {
                tx.broken = true;
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmover_proto::record::Protection;
    use std::os::unix::net::UnixStream;

    fn pair(p: Protection) -> (Sealed, Sealed, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        let tap = b.try_clone().unwrap();
        let key = [5u8; 32];
        let a = Sealed::new(Box::new(a), Sealer::new(&key, p), Opener::new(&[6; 32], p), &[]);
        let b = Sealed::new(Box::new(b), Sealer::new(&[6; 32], p), Opener::new(&key, p), &[]);
        (a, b, tap)
    }

    #[test]
    fn bytes_cross_in_both_directions_through_split_halves() {
        let (a, b, _) = pair(Protection::Encrypted);
        let data: Vec<u8> = (0..3 * MAX_RECORD * WRITE_BATCH + 17).map(|i| (i * 7) as u8).collect();
        let expect = data.clone();
        let mut w = a.split().unwrap();
        let writer = std::thread::spawn(move || {
            w.write_all(&data).unwrap();
            assert_eq!(w.write_vectored(&[IoSlice::new(b"he"), IoSlice::new(b""), IoSlice::new(b"llo")]).unwrap(), 5);
            w.close_write();
        });
        let mut r = b.split().unwrap();
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        writer.join().unwrap();
        assert_eq!(&got[..expect.len()], &expect[..]);
        assert_eq!(&got[expect.len()..], b"hello");
    }

    #[test]
    fn a_changed_byte_on_the_wire_is_refused_and_nothing_of_its_record_read() {
        let (a, _b, mut tap) = pair(Protection::Authenticated);
        let mut w = a.split().unwrap();
        w.write_all(b"pay 100 to alice").unwrap();
        // Take the record off the wire, change it, and deliver it.
        let mut rec = vec![0u8; HEADER + 16 + TAG];
        tap.read_exact(&mut rec).unwrap();
        assert_eq!(&rec[HEADER..HEADER + 16], b"pay 100 to alice", "--no-encrypt sends the payload in the clear");
        rec[HEADER + 4] = b'9';
        let (x, y) = UnixStream::pair().unwrap();
        let mut r = Sealed::new(
            Box::new(y),
            Sealer::new(&[0; 32], Protection::Authenticated),
            Opener::new(&[5; 32], Protection::Authenticated),
            &[],
        );
        (&x).write_all(&rec).unwrap();
        let mut buf = [0u8; 64];
        let e = r.read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("integrity check"), "{e}");
        assert!(r.read(&mut buf).is_err(), "a connection that failed a check goes on failing");
    }

    #[test]
    fn bytes_read_ahead_during_the_handshake_are_opened_first_however_many() {
        let mut s = Sealer::new(&[5; 32], Protection::Encrypted);
        let mut early = Vec::new();
        for i in 0..3u8 {
            let mut rec = vec![i; HEADER + MAX_RECORD + TAG];
            s.seal(&mut rec).unwrap();
            early.extend_from_slice(&rec);
        }
        let (x, y) = UnixStream::pair().unwrap();
        let mut r =
            Sealed::new(Box::new(y), Sealer::new(&[0; 32], Protection::Encrypted), Opener::new(&[5; 32], Protection::Encrypted), &early);
        drop(x);
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), 3 * MAX_RECORD);
        assert!(got.chunks(MAX_RECORD).enumerate().all(|(i, c)| c.iter().all(|&b| b == i as u8)));
    }

    #[test]
    fn a_huge_announced_record_is_refused_before_it_is_read() {
        let (x, y) = UnixStream::pair().unwrap();
        let mut r =
            Sealed::new(Box::new(y), Sealer::new(&[0; 32], Protection::Encrypted), Opener::new(&[5; 32], Protection::Encrypted), &[]);
        (&x).write_all(&u32::MAX.to_be_bytes()).unwrap();
        let e = r.read(&mut [0u8; 8]).unwrap_err();
        assert!(e.to_string().contains("longer than"), "{e}");
    }

    #[test]
    fn a_read_that_times_out_inside_a_record_goes_on_later() {
        let (a, b, _) = pair(Protection::Encrypted);
        let mut r = b.split().unwrap();
        r.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        // Half a record, by hand: seal one, send its first half.
        let mut rec = vec![0u8; HEADER + 5 + TAG];
        rec[HEADER..HEADER + 5].copy_from_slice(b"later");
        let mut s = Sealer::new(&[5; 32], Protection::Encrypted);
        s.seal(&mut rec).unwrap();
        let mut raw = a.inner.split().unwrap();
        raw.write_all(&rec[..7]).unwrap();
        let e = r.read(&mut [0u8; 8]).unwrap_err();
        assert!(matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut), "{e}");
        raw.write_all(&rec[7..]).unwrap();
        let mut got = [0u8; 5];
        r.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"later");
    }

    /// Reads with a buffer that takes any record whole, as a block's pieces
    /// are read: the wire cut inside headers, payloads and tags, each cut a
    /// timeout of the reader, gives the payloads back whole and in order;
    /// a changed byte in such a record is refused.
    #[test]
    fn records_read_straight_into_the_callers_buffer_go_on_after_timeouts_and_are_checked() {
        for p in [Protection::Encrypted, Protection::Authenticated] {
            let (x, y) = UnixStream::pair().unwrap();
            let mut r = Sealed::new(Box::new(y), Sealer::new(&[0; 32], p), Opener::new(&[5; 32], p), &[]);
            r.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
            let mut s = Sealer::new(&[5; 32], p);
            let (mut wire, mut expect, mut ends) = (Vec::new(), Vec::new(), Vec::new());
            for (i, n) in [MAX_RECORD, 1000, MAX_RECORD, 3].into_iter().enumerate() {
                let payload: Vec<u8> = (0..n).map(|j| (i * 31 + j * 7) as u8).collect();
                let mut rec = vec![0u8; HEADER + n + TAG];
                rec[HEADER..HEADER + n].copy_from_slice(&payload);
                s.seal(&mut rec).unwrap();
                wire.extend_from_slice(&rec);
                expect.extend_from_slice(&payload);
                ends.push(wire.len());
            }
            // Inside the first header, payload and tag; inside the second
            // header; at the end of the second record; inside the third
            // payload and tag; inside the fourth header; the end.
            let r0 = HEADER + MAX_RECORD + TAG;
            let cuts = [2, HEADER + 100, r0 - 8, r0 + 2, ends[1], ends[1] + HEADER + 5000, ends[2] - 1, ends[2] + 3, ends[3]];
            let (mut got, mut buf, mut from) = (Vec::new(), vec![0u8; 4 * MAX_RECORD], 0);
            for cut in cuts {
                (&x).write_all(&wire[from..cut]).unwrap();
                from = cut;
                loop {
                    match r.read(&mut buf) {
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => break,
                        Err(e) => panic!("{p:?}: {e}"),
                    }
                }
            }
            assert!(got == expect, "{p:?}: the payloads came back changed ({} of {} bytes)", got.len(), expect.len());

            let mut rec = vec![9u8; HEADER + MAX_RECORD + TAG];
            s.seal(&mut rec).unwrap();
            rec[HEADER + MAX_RECORD / 2] ^= 1;
            (&x).write_all(&rec).unwrap();
            let e = r.read(&mut buf).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{p:?}: {e}");
            assert!(r.read(&mut buf).is_err(), "{p:?}: a connection that failed a check goes on failing");
        }
    }

    /// Blocks sealed where they lie arrive as written, between ordinary
    /// writes, whatever their size: several batches of records, a short
    /// last record, none at all.
    #[test]
    fn blocks_sealed_where_they_lie_arrive_as_written() {
        for p in [Protection::Encrypted, Protection::Authenticated] {
            let (a, b, _) = pair(p);
            let sizes = [WRITE_BATCH * MAX_RECORD * 2 + 17, MAX_RECORD, 0, 5];
            let blocks: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| (0..n).map(|j| (i + j * 13) as u8).collect()).collect();
            let mut expect = Vec::new();
            for (i, block) in blocks.iter().enumerate() {
                expect.extend_from_slice(format!("head {i}").as_bytes());
                expect.extend_from_slice(block);
            }
            expect.extend_from_slice(b"end");
            let mut w = a.split().unwrap();
            let writer = std::thread::spawn(move || {
                for (i, mut block) in blocks.into_iter().enumerate() {
                    w.write_consuming(format!("head {i}").as_bytes(), &mut block).unwrap();
                }
                w.write_all(b"end").unwrap();
                w.close_write();
            });
            let mut r = b.split().unwrap();
            let mut got = Vec::new();
            r.read_to_end(&mut got).unwrap();
            writer.join().unwrap();
            assert!(got == expect, "{p:?}: {} bytes came of {}", got.len(), expect.len());
        }
    }
}
