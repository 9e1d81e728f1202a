//! Reading objects.
//!
//! Reads: each range a reader opens (a chunk of a large file, or a file)
//! is asked for with one GET, and its body is read as it arrives, a batch
//! at a time; a few batches wait for the reader, within the same bound
//! (one block per GET where it has no room), and the connection's flow
//! control holds the server back beyond them. Bytes in flight thus keep
//! flowing while the reader is busy, with no round trip between pieces.

use super::budget::Lease;
use super::metadata::answered;
use super::{io_error, status, Inner};
use crate::error::Damaged;
use crate::storage::{Digest, ReadFile, Stat};
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use std::io;
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;

/// Bytes a read's GET hands its reader at once (see [`Stream`]): the
/// pieces its body arrives in, gathered, so that the reader is woken once
/// per batch rather than per piece.
const BATCH: u64 = 1 << 20;
/// Batches a GET holds for its reader at most.
const BATCHES_AHEAD: usize = 2;
/// The memory a read's GET takes of the storage's bound: the batches
/// waiting, the one being gathered and the one being read.
const STREAM_MEMORY: u64 = (BATCHES_AHEAD as u64 + 2) * BATCH;
/// The bytes a GET asks for when the memory bound has no room for a
/// stream's batches: a block, as the reader asks for it.
const BLOCK_WINDOW: u64 = 1 << 20;

/// The size of the whole object a GET of a range of it answered.
pub(super) fn total_size(r: &aws_sdk_s3::operation::get_object::GetObjectOutput) -> u64 {
    let whole = r.content_range().and_then(|c| c.rsplit_once('/')).and_then(|(_, n)| n.parse().ok());
    whole.unwrap_or(r.content_length().unwrap_or(0) as u64)
}

/// An object open for reading: a ranged GET of the version seen when
/// opened, its body handed to the reader as it arrives.
pub(super) struct S3Read {
    inner: Arc<Inner>,
    key: String,
    pub(super) stat: Stat,
    etag: Option<String>,
    digest: Option<Digest>,
    /// Where reading is meant to end: no GET asks for bytes past it.
    end: u64,
    window: Mutex<Window>,
}

/// The bytes the reader was last handed, and the GET under way that
/// hands it the bytes after them.
struct Window {
    /// The offset of the first byte of `data`.
    start: u64,
    data: Body,
    /// The memory `data` takes, where it is an object a listing fetched.
    held: Option<Lease>,
    stream: Option<Stream>,
}

/// The body of a GET, as it arrives: a task of the runtime gathers its
/// pieces into batches of [`BATCH`] bytes and hands them over, at most
/// [`BATCHES_AHEAD`] waiting; past those the socket's flow control holds
/// the server back while the reader is busy.
struct Stream {
    /// The offset of the first byte of the next batch.
    at: u64,
    batches: tokio::sync::mpsc::Receiver<io::Result<Body>>,
    task: JoinHandle<()>,
    /// The memory the batches take ([`STREAM_MEMORY`]), where the bound had room.
    _held: Option<Lease>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The `Range` header of bytes `off..end` (to the object's end for `u64::MAX`).
fn byte_range(off: u64, end: u64) -> String {
    if end == u64::MAX {
        format!("bytes={off}-")
    } else {
        format!("bytes={off}-{}", end - 1)
    }
}

impl S3Read {
    /// Opens object `k` to read `range` of it with one GET of the range:
    /// its answer carries the object's size, ETag and metadata as a HEAD's
    /// would (one with nothing at the start, an empty one say, takes a
    /// HEAD: that range of it cannot be asked for). Where the memory bound
    /// has no room for a stream's batches, the GET asks for one block.
    pub(super) fn open(inner: &Arc<Inner>, k: &str, range: std::ops::Range<u64>) -> io::Result<S3Read> {
        if let Some(f) = inner.listed.take(k) {
            return Ok(S3Read::fetched(inner, k, range, f));
        }
        let off = range.start;
        let held = inner.budget.try_take(STREAM_MEMORY);
        let asked = if held.is_some() { range.end.max(off + 1) } else { range.end.min(off + BLOCK_WINDOW).max(off + 1) };
        let get = inner.client.get_object().bucket(&inner.bucket).key(k).range(byte_range(off, asked));
        let first = inner.rt.block_on(async {
            match get.send().await {
                Ok(r) => {
                    let (stat, etag, digest) = answered(total_size(&r), r.last_modified(), r.metadata(), r.e_tag());
                    Ok(Some((stat, etag, digest, r.body)))
                }
                Err(e) if status(&e) == Some(416) => Ok(None),
                Err(e) => Err(io_error(k, e)),
            }
        })?;
        let (stat, etag, digest, body) = match first {
            Some((stat, etag, digest, body)) => (stat, etag, digest, Some(body)),
            None => {
                let (stat, etag, digest) = inner.head(k)?;
                (stat, etag, digest, None)
            }
        };
        let end = range.end.min(stat.size);
        let window = Window { start: off, data: Body::default(), held: None, stream: None };
        let read = S3Read { inner: inner.clone(), key: k.to_string(), stat, etag, digest, end, window: Mutex::new(window) };
        if let Some(body) = body {
            let len = asked.min(stat.size).saturating_sub(off);
            read.window.lock().expect("read window lock").stream = Some(read.pump(off, len, body, held));
        }
        Ok(read)
    }

    /// Reads `range` of object `k` from what a listing fetched of it: the
    /// version listed, as if opened then.
    fn fetched(inner: &Arc<Inner>, k: &str, range: std::ops::Range<u64>, f: Fetched) -> S3Read {
        let end = range.end.min(f.stat.size);
        let start = range.start.min(end);
        let data = f.data.slice(start..end);
        let mut held = f.held;
        held.keep(data.len());
        let window = Mutex::new(Window { start, data, held: Some(held), stream: None });
        S3Read { inner: inner.clone(), key: k.to_string(), stat: f.stat, etag: f.etag, digest: f.digest, end, window }
    }

    /// Starts the GET of the bytes from `off` for a read of `want` bytes:
    /// to where reading is meant to end (to the read's end for a read past
    /// it, or where the memory bound has no room for a stream's batches).
    fn stream_from(&self, off: u64, want: u64) -> io::Result<Stream> {
        let i = &self.inner;
        let read_end = (off + want).min(self.stat.size);
        let held = i.budget.try_take(STREAM_MEMORY);
        let end = if held.is_some() && off < self.end { self.end } else { read_end };
        let get = i.client.get_object().bucket(&i.bucket).key(&self.key).range(byte_range(off, end));
        let get = get.set_if_match(self.etag.clone());
        let r = i.rt.block_on(get.send()).map_err(|e| match status(&e) {
            Some(412) => io::Error::other(format!("{}: the object was replaced while it was read", self.key)),
            _ => io_error(&self.key, e),
        })?;
        Ok(self.pump(off, end - off, r.body, held))
    }

    /// Hands the `len` bytes of `body`, from offset `at`, to the reader in
    /// batches (see [`Stream`]); a body longer or shorter fails the read.
    fn pump(&self, at: u64, len: u64, mut body: ByteStream, held: Option<Lease>) -> Stream {
        let (tx, batches) = tokio::sync::mpsc::channel(BATCHES_AHEAD);
        let key = self.key.clone();
        let task = self.inner.rt.spawn(async move {
            let (mut got, mut batched, mut batch) = (0, 0, Vec::new());
            let outcome = loop {
                match body.try_next().await {
                    Ok(Some(piece)) => {
                        (got, batched) = (got + piece.len() as u64, batched + piece.len() as u64);
                        batch.push(piece);
                        if got > len {
                            break Err(io::Error::other(format!("{key}: asked for {len} bytes, got more")));
                        }
                        if batched >= BATCH {
                            if tx.send(Ok(Body::of(batch.drain(..)))).await.is_err() {
                                return;
                            }
                            batched = 0;
                        }
                    }
                    Ok(None) if got < len => break Err(io::Error::other(format!("{key}: asked for {len} bytes, got {got}"))),
                    Ok(None) => break Ok(Body::of(batch.drain(..))),
                    Err(e) => break Err(body_error(&key, e)),
                }
            };
            let _ = tx.send(outcome).await;
        });
        Stream { at, batches, task, _held: held }
    }
}

/// The body of a GET of `key` whole, checked against the checksum the
/// server keeps for the object where it sent one.
pub(super) async fn collect(key: &str, body: ByteStream) -> io::Result<Body> {
    body.collect().await.map(|b| Body::of(b.into_segments())).map_err(|e| body_error(key, e))
}

/// What went wrong with the body of a GET of `key`: it differs from the
/// checksum the server keeps for the object, or the connection failed.
fn body_error(key: &str, e: aws_sdk_s3::primitives::ByteStreamError) -> io::Error {
    if std::error::Error::source(&e).is_some_and(|s| s.is::<aws_smithy_checksums::body::validate::Error>()) {
        let msg = format!("{key}: what was read differs from the checksum the server keeps for the object ({})", super::causes(&e));
        return io::Error::other(Damaged(msg));
    }
    io::Error::new(io::ErrorKind::ConnectionReset, format!("{key}: {}", super::causes(&e)))
}

/// What the GET of a whole object answered.
pub(super) struct Fetched {
    pub(super) stat: Stat,
    pub(super) etag: Option<String>,
    pub(super) digest: Option<Digest>,
    pub(super) data: Body,
    pub(super) held: Lease,
}

/// The body of a GET as the chunks it came in, never joined: reading it
/// copies each byte once, into the reader's buffer.
#[derive(Default)]
pub(super) struct Body {
    chunks: Vec<Bytes>,
    len: u64,
}

impl Body {
    fn of(chunks: impl Iterator<Item = Bytes>) -> Body {
        let chunks: Vec<Bytes> = chunks.collect();
        let len = chunks.iter().map(|c| c.len() as u64).sum();
        Body { chunks, len }
    }

    pub(super) fn len(&self) -> u64 {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the bytes from `off` into `buf`, as many as it holds and fit:
    /// how many.
    fn copy_at(&self, mut off: u64, buf: &mut [u8]) -> usize {
        let mut n = 0;
        for c in &self.chunks {
            if n == buf.len() {
                break;
            }
            if off >= c.len() as u64 {
                off -= c.len() as u64;
                continue;
            }
            let piece = &c[off as usize..];
            let k = piece.len().min(buf.len() - n);
            buf[n..n + k].copy_from_slice(&piece[..k]);
            (n, off) = (n + k, 0);
        }
        n
    }

    /// The bytes of `range` (within it), sharing its chunks.
    fn slice(&self, range: std::ops::Range<u64>) -> Body {
        let mut at = 0;
        let mut chunks = Vec::new();
        for c in &self.chunks {
            let (start, end) = (at, at + c.len() as u64);
            at = end;
            let (from, to) = (range.start.max(start), range.end.min(end));
            if from < to {
                chunks.push(c.slice((from - start) as usize..(to - start) as usize));
            }
        }
        Body::of(chunks.into_iter())
    }
}

impl ReadFile for S3Read {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        if off >= self.stat.size || buf.is_empty() {
            return Ok(0);
        }
        let mut w = self.window.lock().expect("read window lock");
        loop {
            if (w.start..w.start + w.data.len()).contains(&off) {
                return Ok(w.data.copy_at(off - w.start, buf));
            }
            // The bytes from `off` come next from the GET under way, or from a new one.
            if w.stream.as_ref().is_none_or(|s| s.at != off) {
                (w.data, w.held, w.stream) = (Body::default(), None, None);
                w.stream = Some(self.stream_from(off, buf.len() as u64)?);
            }
            let s = w.stream.as_mut().expect("a stream from off");
            let batch = s.batches.blocking_recv();
            let at = s.at;
            match batch {
                Some(Ok(data)) if !data.is_empty() => {
                    s.at += data.len();
                    (w.start, w.data) = (at, data);
                }
                Some(Err(e)) => {
                    w.stream = None;
                    return Err(e);
                }
                // The GET is over: the bytes from `off` take a new one.
                Some(Ok(_)) | None => w.stream = None,
            }
        }
    }

    fn stat(&self) -> io::Result<Stat> {
        Ok(self.stat)
    }

    fn digest(&self) -> Option<Digest> {
        self.digest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_reads_across_its_chunks() {
        let whole: Vec<u8> = (0..100u8).collect();
        let body = Body::of([0..7, 7..7, 7..40, 40..41, 41..100].into_iter().map(|r| Bytes::copy_from_slice(&whole[r])));
        assert_eq!(body.len(), 100);
        for (off, len) in [(0, 100), (0, 7), (5, 10), (39, 3), (40, 60), (99, 5), (100, 4), (3, 0)] {
            let mut buf = vec![0; len];
            let n = body.copy_at(off, &mut buf);
            let want = &whole[(off as usize).min(100)..(off as usize + len).min(100)];
            assert_eq!(&buf[..n], want, "{len} bytes from {off}");
        }
        let part = body.slice(5..45);
        assert_eq!(part.len(), 40);
        let mut buf = vec![0; 40];
        assert_eq!(part.copy_at(0, &mut buf), 40);
        assert_eq!(buf, whole[5..45]);
    }
}
