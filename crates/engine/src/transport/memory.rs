//! Memory: a byte stream between two threads of one process, for the two
//! engines of a local copy (local paths and object stores).
//!
//! A large write (a block with its header) hands its bytes over where they
//! lie: the writer waits while the reader copies them from the writer's
//! buffer straight into its own. Each byte is copied once and no system
//! call is made, where a socket pair copies each byte twice (into the
//! kernel, then out) and makes a call for each read and each write. Small
//! writes (messages) are copied into a bounded buffer and return at once,
//! as on a socket, so that two ends that both write before they read
//! carry on. A large write thus waits for its reader as a socket's write
//! waits once the socket's buffer is full.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Transport;

/// Slices one write offers at most (a vectored write of more writes the
/// first ones and says so).
const MAX_SLICES: usize = 4;
/// Writes of at most this many bytes are buffered; larger ones are handed over in place.
const SMALL_WRITE: usize = 64 * 1024;
/// Bytes of small writes a direction holds for its reader, at most.
const BUFFER: usize = 256 * 1024;

/// Two ends of a stream, each reading what the other writes.
pub fn pair() -> (Memory, Memory) {
    let (ab, ba) = (Arc::new(Direction::default()), Arc::new(Direction::default()));
    let a = Memory { end: Arc::new(End { tx: ab.clone(), rx: ba.clone() }) };
    let b = Memory { end: Arc::new(End { tx: ba, rx: ab }) };
    (a, b)
}

/// One end of a [`pair`]; [`Transport::split`] gives more handles to it.
/// The end closes when the last of them is dropped.
pub struct Memory {
    end: Arc<End>,
}

struct End {
    /// Where this end writes.
    tx: Arc<Direction>,
    /// Where this end reads.
    rx: Arc<Direction>,
}

impl End {
    fn close(&self) {
        self.tx.update(|s| s.write_closed = true);
        self.rx.update(|s| s.read_closed = true);
    }
}

impl Drop for End {
    fn drop(&mut self) {
        self.close();
    }
}

/// One direction: the bytes a writer offers now, for its reader.
#[derive(Default)]
struct Direction {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Small writes not yet read; they come before the offer.
    buffered: VecDeque<u8>,
    /// The slices of the large write under way, and the bytes the reader took from them.
    offer: Option<Offer>,
    /// No more bytes come: the reader sees the end of the stream once it has taken the offer.
    write_closed: bool,
    /// Nobody reads any more: writes fail.
    read_closed: bool,
    read_timeout: Option<Duration>,
}

/// Slices borrowed from a writer that waits in [`Memory::write_vectored`]
/// until the offer is withdrawn.
struct Offer {
    slices: [(*const u8, usize); MAX_SLICES],
    count: usize,
    /// Bytes taken, from the start of the first slice.
    taken: usize,
    total: usize,
}

// SAFETY: the pointers are only read under the direction's lock while the
// offer is up, and the writer they borrow from withdraws the offer under
// that lock before it returns, so they never outlive what they point into.
unsafe impl Send for Offer {}

impl Offer {
    /// Copies what is left of the offer into `buf`, as much as fits.
    fn take_into(&mut self, buf: &mut [u8]) -> usize {
        let mut copied = 0;
        let mut skip = self.taken;
        for &(ptr, len) in &self.slices[..self.count] {
            if skip >= len {
                skip -= len;
                continue;
            }
            let n = (len - skip).min(buf.len() - copied);
            // SAFETY: see `impl Send for Offer`; `skip + n <= len`.
            let src = unsafe { std::slice::from_raw_parts(ptr.add(skip), n) };
            buf[copied..copied + n].copy_from_slice(src);
            copied += n;
            skip = 0;
            if copied == buf.len() {
                break;
            }
        }
        self.taken += copied;
        copied
    }
}

impl Direction {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; a poisoned one still holds sound state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.lock());
        self.changed.notify_all();
    }

    fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(g).unwrap_or_else(|e| e.into_inner())
    }
}

fn broken() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "the other end of the local stream is closed")
}

impl Write for Memory {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let offered = || bufs.iter().filter(|b| !b.is_empty()).take(MAX_SLICES);
        let mut offer = Offer { slices: [(std::ptr::null(), 0); MAX_SLICES], count: 0, taken: 0, total: 0 };
        for b in offered() {
            offer.slices[offer.count] = (b.as_ptr(), b.len());
            offer.count += 1;
            offer.total += b.len();
        }
        if offer.total == 0 {
            return Ok(0);
        }
        let d = &self.end.tx;
        let mut s = d.lock();
        let small = offer.total <= SMALL_WRITE;
        // Bytes go out in the order of the writes: a write waits for the
        // large write under way (another handle's), and a small one for room.
        while !(s.write_closed || s.read_closed) && (s.offer.is_some() || (small && s.buffered.len() + offer.total > BUFFER)) {
            s = d.wait(s);
        }
        if s.write_closed || s.read_closed {
            return Err(broken());
        }
        if small {
            for b in offered() {
                s.buffered.extend(b.iter());
            }
            drop(s);
            d.changed.notify_all();
            return Ok(offer.total);
        }
        s.offer = Some(offer);
        d.changed.notify_all();
        while s.offer.as_ref().is_some_and(|o| o.taken < o.total) && !(s.write_closed || s.read_closed) {
            s = d.wait(s);
        }
        // Withdrawn before returning: the reader never sees these slices again.
        let taken = s.offer.take().map_or(0, |o| o.taken);
        drop(s);
        d.changed.notify_all();
        if taken == 0 {
            return Err(broken());
        }
        Ok(taken)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for Memory {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let d = &self.end.rx;
        let mut s = d.lock();
        let deadline = s.read_timeout.map(|t| Instant::now() + t);
        loop {
            if s.read_closed {
                return Ok(0);
            }
            if !s.buffered.is_empty() || s.offer.as_ref().is_some_and(|o| o.taken < o.total) {
                let n = take(&mut s, buf);
                drop(s);
                d.changed.notify_all();
                return Ok(n);
            }
            if s.write_closed {
                return Ok(0);
            }
            s = match deadline {
                None => d.wait(s),
                Some(at) => {
                    let left = at.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::Error::new(io::ErrorKind::WouldBlock, "nothing received within the timeout"));
                    }
                    d.changed.wait_timeout(s, left).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
    }
}

/// Copies into `buf` what the buffer holds, then what is left of the offer, as much as fits.
fn take(s: &mut State, buf: &mut [u8]) -> usize {
    let (a, b) = s.buffered.as_slices();
    let mut n = 0;
    for part in [a, b] {
        let k = part.len().min(buf.len() - n);
        buf[n..n + k].copy_from_slice(&part[..k]);
        n += k;
    }
    s.buffered.drain(..n);
    if let Some(o) = s.offer.as_mut() {
        n += o.take_into(&mut buf[n..]);
    }
    n
}

impl Transport for Memory {
    fn split(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(Memory { end: self.end.clone() }))
    }
    fn close(&self) {
        self.end.close();
    }
    fn close_write(&self) {
        self.end.tx.update(|s| s.write_closed = true);
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.end.rx.update(|s| s.read_timeout = t);
        Ok(())
    }
    fn peer(&self) -> String {
        "local".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_cross_in_both_directions_and_end_when_closed() {
        let (a, b) = pair();
        let data: Vec<u8> = (0..3_000_017u32).map(|i| (i * 7) as u8).collect();
        let expect = data.clone();
        let mut w = a.split().unwrap();
        let writer = std::thread::spawn(move || {
            w.write_all(&data).unwrap();
            super::super::write_all_slices(&mut w, &mut [IoSlice::new(b"he"), IoSlice::new(b""), IoSlice::new(b"llo")]).unwrap();
            w.close_write();
        });
        let mut r = b.split().unwrap();
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        writer.join().unwrap();
        assert_eq!(got.len(), expect.len() + 5);
        assert!(got[..expect.len()] == expect[..] && &got[expect.len()..] == b"hello");
        // The other direction still works.
        let mut b = b;
        let back = std::thread::spawn(move || b.write_all(b"back"));
        let (mut a, mut four) = (a, [0u8; 4]);
        a.read_exact(&mut four).unwrap();
        back.join().unwrap().unwrap();
        assert_eq!(&four, b"back");
    }

    #[test]
    fn writes_fail_and_reads_end_once_the_other_end_is_gone() {
        let (a, b) = pair();
        let mut w = a.split().unwrap();
        // A writer blocked in a large write is released when its reader goes.
        let blocked = std::thread::spawn(move || w.write(&vec![1; SMALL_WRITE + 1]));
        std::thread::sleep(Duration::from_millis(50));
        drop(b);
        assert_eq!(blocked.join().unwrap().unwrap_err().kind(), io::ErrorKind::BrokenPipe);
        let mut a = a;
        assert_eq!(a.read(&mut [0u8; 8]).unwrap(), 0);
    }

    #[test]
    fn small_writes_return_before_they_are_read() {
        let (mut a, mut b) = pair();
        // Both ends write before either reads, as two engines' first messages may.
        a.write_all(&[1; 1000]).unwrap();
        b.write_all(&[2; 1000]).unwrap();
        let (mut x, mut y) = ([0u8; 1000], [0u8; 1000]);
        a.read_exact(&mut x).unwrap();
        b.read_exact(&mut y).unwrap();
        assert!(x.iter().all(|&v| v == 2) && y.iter().all(|&v| v == 1));
        // A vectored write takes its first slices that hold something, and says how much.
        let parts: Vec<Vec<u8>> = (0..12u8).map(|i| vec![i; if i % 2 == 0 { 0 } else { 10 + i as usize }]).collect();
        let slices: Vec<IoSlice> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let n = a.write_vectored(&slices).unwrap();
        assert_eq!(n, 11 + 13 + 15 + 17);
        let mut got = vec![0u8; n];
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        b.read_exact(&mut got).unwrap();
        b.set_read_timeout(None).unwrap();
        assert_eq!(got, [vec![1u8; 11], vec![3; 13], vec![5; 15], vec![7; 17]].concat());
        // A large write waits for its reader: the bytes written before it come first.
        a.write_all(b"head").unwrap();
        let big: Vec<u8> = (0..SMALL_WRITE * 3).map(|i| i as u8).collect();
        let expect = big.clone();
        let writer = std::thread::spawn(move || {
            a.write_all(&big).unwrap();
            a
        });
        let mut got = vec![0u8; 4 + expect.len()];
        b.read_exact(&mut got).unwrap();
        writer.join().unwrap();
        assert!(&got[..4] == b"head" && got[4..] == expect[..]);
    }

    #[test]
    fn reads_time_out_and_close_ends_them() {
        let (mut a, b) = pair();
        a.set_read_timeout(Some(Duration::from_millis(30))).unwrap();
        assert_eq!(a.read(&mut [0u8; 8]).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        a.set_read_timeout(None).unwrap();
        let c = a.split().unwrap();
        let reader = std::thread::spawn(move || a.read(&mut [0u8; 8]).unwrap());
        std::thread::sleep(Duration::from_millis(30));
        c.close();
        assert_eq!(reader.join().unwrap(), 0);
        drop(b);
    }
}
