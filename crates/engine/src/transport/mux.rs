//! Several connections over one byte stream: the pipe of the `ssh` that
//! started a host's remote end carries the client's control connections
//! to it, each authenticated and sealed like any connection (the sealing
//! layer goes on a [`Channel`] as on a TCP stream).
//!
//! On the pipe, every frame is a channel number and a length (4 bytes
//! each, big-endian), then that many bytes; a length of 0 ends the
//! sender's direction of the channel. The side that opens channels (the
//! client, [`Mux::opener`]) numbers them upwards from 1; the other
//! ([`Mux::acceptor`]) takes a frame for a number above any it has seen as
//! a new channel, hands it out, and ignores frames for channels it has
//! ended. Everything a peer says is bounded: frames of at most
//! [`MAX_FRAME`] bytes, at most [`MAX_CHANNELS`] channels open at once (a
//! channel beyond is ended at once), and at most [`CHANNEL_BUFFER`] bytes
//! held for a channel whose reader is behind: the pipe waits for it.
//!
//! One thread per pipe reads it and hands each frame's bytes to its
//! channel; writers take the pipe's lock for one frame at a time. When the
//! pipe ends, every channel reads its end. The opener sends an empty frame
//! of channel 0 every [`KEEPALIVE`]; the acceptor takes a pipe silent for
//! [`SILENCE`] for ended.

use super::Transport;
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The largest frame payload on the pipe.
pub const MAX_FRAME: usize = 64 * 1024;
/// Channels one pipe may have open at once.
pub const MAX_CHANNELS: usize = 64;
/// Bytes received and not yet read that one channel may hold.
pub const CHANNEL_BUFFER: usize = 4 << 20;
/// A frame's header: channel number, payload length.
const HEADER: usize = 8;
/// How often the opener says it is there (channel 0, length 0) on a pipe
/// with nothing else to carry.
pub const KEEPALIVE: Duration = Duration::from_secs(1);
/// How long the acceptor waits without a frame before it takes the pipe
/// for dead (the link died, and ssh may not notice while data it holds
/// for the client cannot go out).
pub const SILENCE: Duration = Duration::from_secs(15);

/// One end of a pipe that carries channels (its clones are the same end).
#[derive(Clone)]
pub struct Mux {
    shared: Arc<Shared>,
}

struct Shared {
    /// The pipe's writing end (None once closed); a writer holds the lock
    /// for one whole frame.
    out: Mutex<Option<Box<dyn Write + Send>>>,
    /// The open channels; the reading thread and the channels' handles
    /// change it, never while holding a channel's own lock.
    table: Mutex<Table>,
    /// The far end, for messages.
    peer: String,
    /// This end accepts channels (else it opens them).
    acceptor: bool,
    /// The acceptor's way of handing out channels; dropped when the pipe
    /// ends or falls silent, which ends the receiver.
    accept: Mutex<Option<crossbeam_channel::Sender<Box<dyn Transport>>>>,
    /// When the last frame arrived.
    heard: Mutex<Instant>,
}

#[derive(Default)]
struct Table {
    open: HashMap<u32, Arc<Chan>>,
    /// The opener: the number of the last channel opened. The acceptor:
    /// the highest number seen.
    last: u32,
    /// The pipe's reading end has ended: no channel receives any more.
    ended: bool,
}

/// One channel's received bytes, shared by its handles and the reading thread.
struct Chan {
    id: u32,
    state: Mutex<ChanState>,
    /// Signalled when bytes arrive, when they are read (room for more), and
    /// when the channel ends.
    changed: Condvar,
}

#[derive(Default)]
struct ChanState {
    chunks: VecDeque<Vec<u8>>,
    /// Bytes of the front chunk already read.
    taken: usize,
    /// Bytes held, not yet read.
    held: usize,
    /// The peer ended its direction (or the pipe ended).
    eof: bool,
    /// This side sent its end.
    sent_end: bool,
    /// This side closed the channel: reads end, what arrives is dropped.
    closed: bool,
    timeout: Option<Duration>,
}

impl Mux {
    /// The client's end: opens channels with [`Mux::open`].
    pub fn opener(reader: impl Read + Send + 'static, writer: impl Write + Send + 'static, peer: String) -> Mux {
        Mux::start(reader, writer, peer, None)
    }

    /// The remote end's end: the channels the peer opens come out of the
    /// receiver, which ends when the pipe does.
    pub fn acceptor(
        reader: impl Read + Send + 'static,
        writer: impl Write + Send + 'static,
        peer: String,
    ) -> crossbeam_channel::Receiver<Box<dyn Transport>> {
        let (tx, rx) = crossbeam_channel::unbounded();
        Mux::start(reader, writer, peer, Some(tx));
        rx
    }

    fn start(
        reader: impl Read + Send + 'static,
        writer: impl Write + Send + 'static,
        peer: String,
        accept: Option<crossbeam_channel::Sender<Box<dyn Transport>>>,
    ) -> Mux {
        let acceptor = accept.is_some();
        let shared = Arc::new(Shared {
            out: Mutex::new(Some(Box::new(writer))),
            table: Mutex::default(),
            peer,
            acceptor,
            accept: Mutex::new(accept),
            heard: Mutex::new(Instant::now()),
        });
        let sh = shared.clone();
        std::thread::spawn(move || sh.read_pipe(reader));
        let sh = shared.clone();
        if acceptor {
            std::thread::spawn(move || sh.watch_silence());
        } else {
            std::thread::spawn(move || {
                while sh.frame(0, &[]).is_ok() {
                    std::thread::sleep(KEEPALIVE);
                }
            });
        }
        Mux { shared }
    }

    /// A new channel to the peer.
    pub fn open(&self) -> io::Result<Channel> {
        let mut t = self.shared.table.lock().expect("channel table lock");
        if t.ended {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, format!("the pipe to {} has ended", self.shared.peer)));
        }
        t.last += 1;
        let id = t.last;
        let chan = Arc::new(Chan::new(id));
        t.open.insert(id, chan.clone());
        Ok(Channel::new(&self.shared, chan))
    }

    /// Closes the pipe's writing end: the peer reads the end of the pipe.
    /// False if a write stuck on the pipe holds it: then only ending the
    /// program at the other end of the pipe ends it.
    pub fn close(&self) -> bool {
        match self.shared.out.try_lock() {
            Ok(mut out) => {
                out.take();
                true
            }
            Err(_) => false,
        }
    }
}

impl Chan {
    fn new(id: u32) -> Chan {
        Chan { id, state: Mutex::default(), changed: Condvar::new() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ChanState> {
        self.state.lock().expect("channel lock")
    }

    /// Marks the peer's direction ended; true if this side's is too.
    fn peer_ended(&self) -> bool {
        let mut s = self.lock();
        s.eof = true;
        self.changed.notify_all();
        s.sent_end
    }
}

impl Shared {
    /// Writes one frame.
    fn frame(&self, id: u32, payload: &[u8]) -> io::Result<()> {
        let mut out = self.out.lock().expect("pipe lock");
        let w = out.as_mut().ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "the pipe was closed"))?;
        let mut header = [0u8; HEADER];
        header[..4].copy_from_slice(&id.to_be_bytes());
        header[4..].copy_from_slice(&(payload.len() as u32).to_be_bytes());
        let written = w.write_all(&header).and_then(|_| w.write_all(payload)).and_then(|_| w.flush());
        if written.is_err() {
            // Cut inside a frame: nothing more can follow.
            out.take();
        }
        written
    }

    /// Sends `chan`'s end once; forgets the channel once both directions ended.
    fn end(&self, chan: &Chan) {
        let both = {
            let mut s = chan.lock();
            if std::mem::replace(&mut s.sent_end, true) {
                return;
            }
            s.eof
        };
        let _ = self.frame(chan.id, &[]);
        if both {
            self.table.lock().expect("channel table lock").open.remove(&chan.id);
        }
    }

    /// Reads frames until the pipe ends, handing each to its channel.
    fn read_pipe(self: &Arc<Self>, mut r: impl Read) {
        if let Err(e) = self.demux(&mut r) {
            log::warn!("the pipe to {}: {e}", self.peer);
        }
        self.end_all();
    }

    /// Ends every channel and the acceptor's receiver: the pipe is gone.
    fn end_all(&self) {
        self.accept.lock().expect("accept lock").take();
        let mut t = self.table.lock().expect("channel table lock");
        t.ended = true;
        for chan in std::mem::take(&mut t.open).into_values() {
            chan.peer_ended();
        }
    }

    /// Ends everything once no frame has come for [`SILENCE`].
    fn watch_silence(&self) {
        loop {
            let quiet = self.heard.lock().expect("heard lock").elapsed();
            if self.table.lock().expect("channel table lock").ended {
                return;
            }
            if quiet >= SILENCE {
                log::warn!("nothing from {} for {} s: the pipe is taken for dead", self.peer, quiet.as_secs());
                return self.end_all();
            }
            std::thread::sleep(KEEPALIVE);
        }
    }

    fn demux(self: &Arc<Self>, r: &mut impl Read) -> io::Result<()> {
        let mut header = [0u8; HEADER];
        loop {
            match r.read_exact(&mut header) {
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                r => r?,
            }
            *self.heard.lock().expect("heard lock") = Instant::now();
            let id = u32::from_be_bytes(header[..4].try_into().expect("4 bytes"));
            let len = u32::from_be_bytes(header[4..].try_into().expect("4 bytes")) as usize;
            if len > MAX_FRAME {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a frame of {len} bytes (at most {MAX_FRAME})")));
            }
            let mut payload = vec![0u8; len];
            r.read_exact(&mut payload)?;
            let chan = {
                let mut t = self.table.lock().expect("channel table lock");
                match t.open.get(&id) {
                    Some(c) => Some(c.clone()),
                    None if self.acceptor && id > t.last => {
                        t.last = id;
                        let chan = Arc::new(Chan::new(id));
                        if t.open.len() >= MAX_CHANNELS {
                            log::warn!("{}: more than {MAX_CHANNELS} channels at once; channel {id} is refused", self.peer);
                            drop(t);
                            chan.peer_ended();
                            self.end(&chan);
                            continue;
                        }
                        t.open.insert(id, chan.clone());
                        if let Some(accept) = self.accept.lock().expect("accept lock").as_ref() {
                            let _ = accept.send(Box::new(Channel::new(self, chan.clone())));
                        }
                        Some(chan)
                    }
                    // A keepalive, or a channel that has ended on this side.
                    None => None,
                }
            };
            let Some(chan) = chan else { continue };
            if len == 0 {
                if chan.peer_ended() {
                    self.table.lock().expect("channel table lock").open.remove(&id);
                }
                continue;
            }
            let mut s = chan.lock();
            while s.held >= CHANNEL_BUFFER && !s.closed {
                s = chan.changed.wait(s).expect("channel lock");
            }
            if !s.closed {
                s.held += len;
                s.chunks.push_back(payload);
                chan.changed.notify_all();
            }
        }
    }
}

/// One connection carried by a [`Mux`]. Its handles ([`Transport::split`])
/// share it; when the last is dropped, the channel ends.
pub struct Channel {
    shared: Arc<Shared>,
    chan: Arc<Chan>,
    /// Ends the channel when the last handle goes.
    _last: Arc<EndOnDrop>,
}

struct EndOnDrop {
    shared: Arc<Shared>,
    chan: Arc<Chan>,
}

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        Channel::shut(&self.shared, &self.chan);
    }
}

impl Channel {
    fn new(shared: &Arc<Shared>, chan: Arc<Chan>) -> Channel {
        let last = Arc::new(EndOnDrop { shared: shared.clone(), chan: chan.clone() });
        Channel { shared: shared.clone(), chan, _last: last }
    }

    /// Ends both directions: reads end, what still arrives is dropped.
    fn shut(shared: &Shared, chan: &Chan) {
        {
            let mut s = chan.lock();
            s.closed = true;
            s.eof = true;
            s.chunks.clear();
            s.held = 0;
            chan.changed.notify_all();
        }
        shared.end(chan);
        shared.table.lock().expect("channel table lock").open.remove(&chan.id);
    }
}

impl Read for Channel {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut guard = self.chan.lock();
        let deadline = guard.timeout.map(|t| Instant::now() + t);
        loop {
            let s = &mut *guard;
            if let Some(front) = s.chunks.front() {
                let n = buf.len().min(front.len() - s.taken);
                buf[..n].copy_from_slice(&front[s.taken..s.taken + n]);
                s.taken += n;
                s.held -= n;
                if s.taken == front.len() {
                    s.chunks.pop_front();
                    s.taken = 0;
                }
                self.chan.changed.notify_all();
                return Ok(n);
            }
            if s.eof || buf.is_empty() {
                return Ok(0);
            }
            guard = match deadline {
                None => self.chan.changed.wait(guard).expect("channel lock"),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::Error::new(io::ErrorKind::WouldBlock, "nothing received within the timeout"));
                    }
                    self.chan.changed.wait_timeout(guard, left).expect("channel lock").0
                }
            };
        }
    }
}

impl Write for Channel {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.chan.lock().sent_end {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the connection was closed for writing"));
        }
        for piece in buf.chunks(MAX_FRAME) {
            self.shared.frame(self.chan.id, piece)?;
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for Channel {
    fn split(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(Channel { shared: self.shared.clone(), chan: self.chan.clone(), _last: self._last.clone() }))
    }
    fn close(&self) {
        Channel::shut(&self.shared, &self.chan);
    }
    fn close_write(&self) {
        self.shared.end(&self.chan);
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.chan.lock().timeout = t;
        Ok(())
    }
    fn peer(&self) -> String {
        self.shared.peer.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// An opener and an acceptor joined by a socket pair, as by ssh.
    fn pipe() -> (Mux, crossbeam_channel::Receiver<Box<dyn Transport>>, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        let opener = Mux::opener(a.try_clone().unwrap(), a, "remote".into());
        let tap = b.try_clone().unwrap();
        let channels = Mux::acceptor(b.try_clone().unwrap(), b, "client".into());
        (opener, channels, tap)
    }

    fn echo(mut t: Box<dyn Transport>) {
        std::thread::spawn(move || {
            let mut w = t.split().unwrap();
            let mut buf = vec![0u8; 100_000];
            loop {
                match t.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => w.write_all(&buf[..n]).unwrap(),
                }
            }
            w.close_write();
        });
    }

    #[test]
    fn channels_carry_their_own_bytes_at_once_and_end_one_by_one() {
        let (mux, channels, _tap) = pipe();
        std::thread::spawn(move || channels.into_iter().for_each(echo));
        let mut chans: Vec<Channel> = (0..5).map(|_| mux.open().unwrap()).collect();
        let data: Vec<Vec<u8>> = (0..5u8).map(|i| (0..200_000u32).map(|j| (j as u8) ^ i).collect()).collect();
        let readers: Vec<_> = chans
            .iter()
            .map(|c| {
                let mut r = c.split().unwrap();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    r.read_to_end(&mut got).unwrap();
                    got
                })
            })
            .collect();
        for (c, d) in chans.iter_mut().zip(&data) {
            c.write_all(d).unwrap();
            c.close_write();
        }
        for (r, d) in readers.into_iter().zip(&data) {
            assert!(r.join().unwrap() == *d, "a channel's bytes came back changed");
        }
        assert!(chans[0].write_all(b"more").is_err(), "a channel closed for writing still took bytes");
    }

    #[test]
    fn reads_time_out_and_the_end_of_the_pipe_ends_every_channel() {
        let (mux, channels, tap) = pipe();
        let mut c = mux.open().unwrap();
        c.write_all(b"hello").unwrap();
        let mut far = channels.recv().unwrap();
        let mut got = [0u8; 5];
        far.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        assert_eq!(c.read(&mut got).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        c.set_read_timeout(None).unwrap();
        tap.shutdown(std::net::Shutdown::Both).unwrap();
        assert_eq!(c.read(&mut got).unwrap(), 0, "the pipe ended but the channel did not");
        assert!(mux.open().is_err(), "a channel opened on a pipe that has ended");
    }

    #[test]
    fn a_peer_is_held_to_the_frame_size_and_the_number_of_channels() {
        let (a, b) = UnixStream::pair().unwrap();
        let channels = Mux::acceptor(b.try_clone().unwrap(), b, "client".into());
        let frame = |id: u32, body: &[u8]| {
            let mut f = id.to_be_bytes().to_vec();
            f.extend_from_slice(&(body.len() as u32).to_be_bytes());
            f.extend_from_slice(body);
            f
        };
        for id in 1..=MAX_CHANNELS as u32 + 1 {
            (&a).write_all(&frame(id, b"x")).unwrap();
        }
        let held: Vec<_> = (0..MAX_CHANNELS).map(|_| channels.recv_timeout(Duration::from_secs(5)).unwrap()).collect();
        // The channel beyond the limit is ended at once: its end frame comes back.
        let mut back = [0u8; HEADER];
        (&a).read_exact(&mut back).unwrap();
        assert_eq!(back, frame(MAX_CHANNELS as u32 + 1, b"")[..], "the channel beyond the limit was not refused");
        assert!(channels.try_recv().is_err());
        // A frame longer than allowed ends the pipe, and every channel with it.
        (&a).write_all(&(1u32).to_be_bytes()).unwrap();
        (&a).write_all(&(MAX_FRAME as u32 + 1).to_be_bytes()).unwrap();
        let mut first = held.into_iter().next().unwrap();
        let mut buf = [0u8; 4];
        assert_eq!(first.read(&mut buf).unwrap(), 1);
        assert_eq!(first.read(&mut buf).unwrap(), 0, "the pipe carried a frame beyond the limit");
        assert!(channels.recv_timeout(Duration::from_secs(5)).is_err(), "the channels did not end with the pipe");
    }
}
