//! The sending end's workers, on the per-block path: the walker, the
//! readers, one thread per data connection and one per control
//! connection's reading half. They do the I/O and report what they did to
//! the owner thread as events; they decide nothing about the protocol
//! beyond reading the blocks a [`Read`] names. The tuner reaches them
//! through [`Tunable`].

use super::{Attaching, Files, MoreStreams, AHEAD_PER_STREAM, ATTACH_WAIT, DIAL_WAIT, POLL};
use crate::error::{classify, Error, Result};
use crate::halt::Halt;
use crate::ids;
use crate::pool::{Block, Pool};
use crate::progress::Progress;
use crate::source::{self, Entry, LinkGroups, LinkName};
use crate::storage::{digest_of, read_block, DataMap, Extent, Keeps, ReadFile, Storage, Store, Xattr, ACL_XATTRS};
use crate::transport::{Layers, Transport};
use crate::tuning::{Meter, Tunable};
use crate::wire::{FrameReader, FrameWriter, Incoming};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use dmover_proto::digest::{block_sum, zeros_sum, Sum};
use dmover_proto::frame::{
    DataHeader, FileError, FileMeta, Owner, TransferFlags, TransferOptions, MAX_XATTRS, MAX_XATTR_NAME, MAX_XATTR_VALUE,
};
use dmover_proto::phase::{OnData, ToSender};
use dmover_proto::session::send::{Event, Read};
use dmover_proto::ErrorKind;
use dmover_tune::ServerLoad;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the owner thread hears.
pub(super) enum Input {
    /// An event for the session.
    Session(Event),
    /// Events for the session, in order (what one read of a control connection brought).
    Batch(Vec<Event>),
    /// A connection broke: the transfer ends.
    Broken(Error),
}

/// What the walker hands the owner: a file, the host it is pinned to, and
/// its digest (with `--checksum`); or a source it could not list.
pub(super) enum Walked {
    File {
        entry: Entry,
        pinned: Option<usize>,
        digest: Option<Sum>,
        /// It has other names, walked later (hard links kept).
        linked: bool,
    },
    /// Another name of `first`, a file walked earlier (hard links kept),
    /// found at `source`.
    HardLink {
        path: String,
        first: String,
        source: PathBuf,
    },
    /// A directory's attributes, for every host.
    Dir(FileMeta),
    Error(Error),
    /// Something the transfer does not copy (a symlink without
    /// `--links`, a device without `--devices`, …), and why.
    PassedOver(FileError),
}

/// A file being sent, as the readers see it.
pub(super) struct Source {
    pub id: u64,
    /// Where to read it.
    pub path: PathBuf,
    /// The source's name in messages.
    pub label: String,
    pub meta: FileMeta,
    /// Inode change time when listed (see [`Entry::ctime`]).
    pub ctime: (i64, i64),
    /// Settled or abandoned: readers skip what is left of it.
    pub done: AtomicBool,
}

/// Where a data stream's connection comes from.
enum StreamConn {
    Open(Box<dyn Transport>),
    /// One of those still attaching when the transfer started.
    Attaching(Receiver<Result<Box<dyn Transport>>>),
    /// A new one (the tuner added the stream).
    Another,
}

/// A chunk to read, for the readers.
pub(super) struct Job {
    pub source: Arc<Source>,
    pub read: Read,
}

/// What waits for a data stream.
enum Outgoing {
    /// A block read and checksummed; `data` also holds the block's place
    /// in the staging budget until it is sent. A sparse block's pages of
    /// zeros are left out (`data` holds the others, `prefix` its length
    /// and bitmap: [`dmover_proto::packed`]); `prefix` is empty otherwise.
    Block { header: DataHeader, prefix: Vec<u8>, data: Block },
    /// Blocks that lie in a hole of their file: one `Hole`, without bytes.
    Hole { id: u64, offset: u64, len: u64 },
}

/// The blocks queued for one host's data streams.
pub(super) struct HostQueue {
    tx: Sender<Outgoing>,
    rx: Receiver<Outgoing>,
    /// How to get more streams (None: the set is fixed).
    pub more: Option<MoreStreams>,
    /// Streams connected and running.
    open: AtomicU64,
    /// `Finish` went to this host: every file has ended.
    pub finished: AtomicBool,
    /// Readers wait on `room_freed` while the queue holds
    /// [`AHEAD_PER_STREAM`] blocks per open stream; a stream signals it each
    /// time it takes a block, and when it starts. The lock guards nothing
    /// but that wait.
    room: Mutex<()>,
    room_freed: Condvar,
}

impl HostQueue {
    pub fn new(more: Option<MoreStreams>) -> HostQueue {
        let (tx, rx) = crossbeam_channel::unbounded();
        HostQueue {
            tx,
            rx,
            more,
            open: AtomicU64::new(0),
            finished: AtomicBool::new(false),
            room: Mutex::default(),
            room_freed: Condvar::new(),
        }
    }

    /// Waits while the queue is full (or until `stopped`).
    fn wait_for_room(&self, stopped: impl Fn() -> bool) {
        let mut g = self.room.lock().expect("room lock");
        loop {
            let open = self.open.load(Ordering::SeqCst) as usize;
            if open == 0 || self.tx.len() < AHEAD_PER_STREAM * open || stopped() {
                return;
            }
            g = self.room_freed.wait_timeout(g, POLL).expect("room lock").0;
        }
    }

    /// Wakes a reader waiting for room: a stream took a block, which
    /// makes room for one (waking them all, most would find none).
    fn took_one(&self) {
        drop(self.room.lock().expect("room lock"));
        self.room_freed.notify_one();
    }

    /// Counts a stream that starts, and wakes the readers waiting: its
    /// share of the queue is room for several.
    fn stream_opened(&self) {
        self.open.fetch_add(1, Ordering::SeqCst);
        drop(self.room.lock().expect("room lock"));
        self.room_freed.notify_all();
    }
}

/// The threads that come and go while sending (data streams and readers)
/// and every open data connection.
#[derive(Default)]
pub(super) struct Crew {
    /// One lock, because the tuner resizes the crew while streams register
    /// their connections and leave, and the owner closes them all on a
    /// fatal error. Held only to change the lists, never across I/O.
    state: Mutex<CrewState>,
}

#[derive(Default)]
struct CrewState {
    /// Per host: the streams wanted, newest last; each one's flag tells it to stop.
    streams: HashMap<usize, Vec<Arc<AtomicBool>>>,
    /// Readers wanted, newest last, likewise.
    readers: Vec<Arc<AtomicBool>>,
    /// Open data connections by stream id, with their host.
    conns: HashMap<u64, (usize, Box<dyn Transport>)>,
    next_stream: u64,
    /// Every thread started, joined at the end.
    threads: Vec<JoinHandle<()>>,
}

impl Crew {
    /// Closes every data connection (their streams then end).
    pub fn close_all(&self) {
        self.state.lock().expect("crew lock").conns.values().for_each(|c| c.1.close());
    }

    /// Waits for every stream and reader thread (they end once the transfer stops).
    pub fn join(&self) {
        loop {
            let threads = std::mem::take(&mut self.state.lock().expect("crew lock").threads);
            if threads.is_empty() {
                return;
            }
            for t in threads {
                let _ = t.join();
            }
        }
    }
}

/// Grows or shrinks a set of threads, given by their stop flags (newest
/// last), to `n` (at least one): the newest are told to stop; `start` runs
/// a new one with its flag.
fn resize(flags: &mut Vec<Arc<AtomicBool>>, n: usize, mut start: impl FnMut(Arc<AtomicBool>)) {
    while flags.len() > n.max(1) {
        flags.pop().expect("a thread").store(true, Ordering::SeqCst);
    }
    while flags.len() < n {
        let flag = Arc::new(AtomicBool::new(false));
        flags.push(flag.clone());
        start(flag);
    }
}

/// What the owner shares with the workers.
pub(super) struct Shared {
    pub options: TransferOptions,
    pub block_size: u64,
    /// Blocks are made up (benchmarks), not read.
    pub generate: bool,
    /// Where the files are read from.
    pub store: Store,
    pub progress: Arc<Progress>,
    pub pool: Arc<Pool>,
    /// The owner's event channel; every worker sends, the owner waits.
    pub events: Sender<Input>,
    /// Chunks to read; the owner sends, the readers take.
    pub jobs: Receiver<Job>,
    pub hosts: Vec<HostQueue>,
    pub crew: Crew,
    /// The transfer is over (or failed): workers stop.
    pub stop: Halt,
    /// Payload bytes written to data connections.
    pub sent: AtomicU64,
    /// Put on every data connection as its stream starts.
    pub layers: Layers,
    pub ping_every: Duration,
    /// Control-channel measurements per host (the control readers fill them).
    pub meters: Vec<Meter>,
    pub started: Instant,
}

impl Shared {
    pub fn stopped(&self) -> bool {
        self.stop.is_raised()
    }

    fn report(&self, e: Event) {
        // After the owner stops, what workers report is not needed.
        let _ = self.events.send(Input::Session(e));
    }

    /// Reports a broken connection, unless the transfer is stopping anyway.
    fn broken(&self, e: Error) {
        if !self.stopped() {
            let _ = self.events.send(Input::Broken(e));
        }
    }

    /// Runs a data stream to `host` in its own thread, on its connection.
    fn start_stream(self: &Arc<Self>, st: &mut CrewState, host: usize, conn: StreamConn, retire: Arc<AtomicBool>) {
        let sh = self.clone();
        let t = std::thread::spawn(move || {
            let conn = match conn {
                StreamConn::Open(c) => c,
                StreamConn::Attaching(conns) => match sh.attached(&conns) {
                    Some(Ok(c)) => c,
                    // After `Finish` the receiver may end the session before
                    // every connection attached (nothing was left to send):
                    // the control connection's word settles the transfer. With
                    // blocks still queued for the host (a connection refused,
                    // the server busy), no stream may be left to send them:
                    // the transfer fails, and is tried again, rather than wait.
                    Some(Err(e)) if sh.hosts[host].finished.load(Ordering::SeqCst) && sh.hosts[host].rx.is_empty() => {
                        log::debug!("a data connection to host {host} did not attach after Finish: {e}");
                        return;
                    }
                    Some(Err(e)) => return sh.broken(e),
                    None => return,
                },
                StreamConn::Another => match sh.another_stream(host) {
                    Some(Ok(c)) => c,
                    failed => {
                        match failed {
                            Some(Err(e)) if !sh.stopped() => log::warn!("could not open another stream: {e}"),
                            _ => {}
                        }
                        let mut st = sh.crew.state.lock().expect("crew lock");
                        st.streams.entry(host).or_default().retain(|f| !Arc::ptr_eq(f, &retire));
                        return;
                    }
                },
            };
            let conn = sh.layers.wrap(conn);
            let id = {
                let mut st = sh.crew.state.lock().expect("crew lock");
                let id = st.next_stream;
                st.next_stream += 1;
                match conn.split() {
                    Ok(c) => st.conns.insert(id, (host, c)),
                    Err(e) => {
                        drop(st);
                        return sh.broken(Error::network(conn.peer(), &e));
                    }
                };
                id
            };
            let q = &sh.hosts[host];
            if sh.stopped() && q.rx.is_empty() {
                conn.close();
            } else {
                q.stream_opened();
                sh.progress.streams.fetch_add(1, Ordering::Relaxed);
                data_stream(&sh, host, conn, &retire);
                sh.progress.streams.fetch_sub(1, Ordering::Relaxed);
                q.open.fetch_sub(1, Ordering::SeqCst);
            }
            sh.crew.state.lock().expect("crew lock").conns.remove(&id);
        });
        st.threads.push(t);
    }

    /// A new data connection to `host`: opened here, or asked of the
    /// receiver and taken as it attaches
    /// (None: the set is fixed, or the transfer stopped first).
    fn another_stream(&self, host: usize) -> Option<Result<Box<dyn Transport>>> {
        match self.hosts[host].more.as_ref()? {
            MoreStreams::Connect(c) => Some(c()),
            MoreStreams::Ask(attached) => {
                self.report(Event::Dial { host });
                self.arrival(attached, DIAL_WAIT, "the receiver dialed no data connection")
            }
        }
    }

    /// A data connection still attaching when the transfer started, once
    /// it has (None: the transfer stopped first).
    fn attached(&self, conns: &Receiver<Result<Box<dyn Transport>>>) -> Option<Result<Box<dyn Transport>>> {
        self.arrival(conns, ATTACH_WAIT, "a data connection did not attach").map(|c| c.and_then(|c| c))
    }

    /// What arrives on `conns` within `limit` (`late` says what did not),
    /// or None once the transfer stops: a stream waiting for its connection
    /// never holds up the end.
    fn arrival<T>(&self, conns: &Receiver<T>, limit: Duration, late: &str) -> Option<Result<T>> {
        let deadline = Instant::now() + limit;
        while !self.stopped() {
            match conns.recv_timeout(POLL) {
                Ok(c) => return Some(Ok(c)),
                Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(RecvTimeoutError::Timeout) => {
                    return Some(Err(Error::new(ErrorKind::Unreachable, "", format!("{late} within {} s", limit.as_secs()))))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Some(Err(Error::new(ErrorKind::Unreachable, "", format!("{late}: the session ended"))));
                }
            }
        }
        None
    }

    /// Starts the data streams given at the start: on their connections,
    /// and on those still attaching as they come.
    pub fn start_streams(self: &Arc<Self>, host: usize, conns: Vec<Box<dyn Transport>>, attaching: Option<Attaching>) {
        let mut st = self.crew.state.lock().expect("crew lock");
        let attaching = attaching.map_or(Vec::new(), |a| vec![a.conns; a.count]);
        let conns = conns.into_iter().map(StreamConn::Open).chain(attaching.into_iter().map(StreamConn::Attaching));
        for c in conns {
            let flag = Arc::new(AtomicBool::new(false));
            st.streams.entry(host).or_default().push(flag.clone());
            self.start_stream(&mut st, host, c, flag);
        }
    }

    /// Starts or stops reader threads until `n` are wanted.
    pub fn set_readers(self: &Arc<Self>, n: usize) {
        let mut st = self.crew.state.lock().expect("crew lock");
        let CrewState { readers, threads, .. } = &mut *st;
        resize(readers, n, |flag| {
            let sh = self.clone();
            threads.push(std::thread::spawn(move || reader(&sh, &flag)));
        });
    }
}

impl Tunable for Arc<Shared> {
    fn hosts(&self) -> usize {
        self.hosts.len()
    }

    fn can_add_streams(&self, host: usize) -> bool {
        self.hosts[host].more.is_some()
    }

    fn open_streams(&self, host: usize) -> usize {
        self.hosts[host].open.load(Ordering::SeqCst) as usize
    }

    /// Opens or drops streams to `host` until `n` are wanted.
    fn set_streams(&self, host: usize, n: usize) {
        if self.hosts[host].more.is_none() {
            return;
        }
        let mut st = self.crew.state.lock().expect("crew lock");
        let mut flags = st.streams.remove(&host).unwrap_or_default();
        // Once every file has ended, a new stream could only arrive after
        // the last blocks: none is opened.
        let n = if self.hosts[host].finished.load(Ordering::SeqCst) { n.min(flags.len()) } else { n };
        resize(&mut flags, n, |flag| self.start_stream(&mut st, host, StreamConn::Another, flag));
        st.streams.insert(host, flags);
    }

    /// Reader threads running or wanted.
    fn readers(&self) -> usize {
        self.crew.state.lock().expect("crew lock").readers.len()
    }

    fn set_readers(&self, n: usize) {
        Shared::set_readers(self, n)
    }

    fn stopped(&self) -> bool {
        Shared::stopped(self)
    }

    fn pause(&self, d: Duration) {
        let _ = self.stop.woken().recv_timeout(d);
    }

    fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Asks the owner to send an `Echo` probe to `host` (its session knows
    /// whether anything may still be sent there).
    fn probe(&self, host: usize, stamp: u64) {
        self.report(Event::Probe { host, stamp });
    }

    /// Whether no block waits for `host`'s streams.
    fn starved(&self, host: usize) -> bool {
        self.hosts[host].rx.is_empty()
    }

    /// What one data connection to `host` can have in flight (W).
    fn window(&self, host: usize) -> u64 {
        let w = self.crew.state.lock().expect("crew lock").conns.values().find(|c| c.0 == host).map_or(0, |c| c.1.send_window());
        match self.options.tcp_buffer {
            0 => w,
            b if w == 0 => b as u64,
            b => w.min(b as u64),
        }
    }

    fn meter(&self, host: usize) -> &Meter {
        &self.meters[host]
    }
}

/// Lists the files to send into `tx` (in its own thread), each with its
/// digest when `--checksum` asks for one, symlinks where the transfer
/// keeps them (`--links`), and the other names of a file with more than one
/// as such where it keeps hard links (`--hard-links`). Ends when the
/// sources are listed (or the feed is closed), or when the owner stops
/// taking files.
pub(super) fn walk(files: Files, store: Store, flags: TransferFlags, block_size: u64, tx: &Sender<Walked>) {
    let with_digest = flags.contains(TransferFlags::CHECKSUM) && !matches!(files, Files::Generate { .. });
    let links = flags.contains(TransferFlags::LINKS);
    let digest = |e: &Entry| if with_digest && !e.meta.is_link() { digest_of(store.as_ref(), &e.path, block_size).ok() } else { None };
    let mut groups = flags.contains(TransferFlags::HARD_LINKS).then(LinkGroups::default);
    let mut file = |mut entry: Entry, pinned| {
        let linked = match groups.as_mut().map(|g| g.name(&entry)) {
            Some(LinkName::Another(first)) => {
                return tx.send(Walked::HardLink { path: entry.meta.path, first, source: entry.path }).is_ok();
            }
            Some(LinkName::First) => true,
            _ => false,
        };
        let digest = digest(&entry);
        describe(store.as_ref(), flags, &mut entry);
        tx.send(Walked::File { entry, pinned, digest, linked }).is_ok()
    };
    // Said in the log as it happens, and listed in the report.
    let passed_over = |e: Entry, why: &str| {
        log::warn!("{}: {why}", dmover_proto::path::printable(&e.meta.path));
        tx.send(Walked::PassedOver(FileError { path: e.meta.path, kind: ErrorKind::Refused, message: why.into() })).is_ok()
    };
    match files {
        Files::Walk { store, specs } => {
            source::walk_following(store.as_ref(), &specs, flags.contains(TransferFlags::COPY_LINKS), &mut |ev| match ev {
                source::Event::File(e) => file(e, None),
                source::Event::Error(e) => {
                    log::info!("{e}");
                    tx.send(Walked::Error(e)).is_ok()
                }
                source::Event::Dir(mut e) => {
                    describe(store.as_ref(), flags, &mut e);
                    tx.send(Walked::Dir(e.meta)).is_ok()
                }
                source::Event::Link(e) if links => file(e, None),
                source::Event::Special(e)
                    if flags.contains(if e.meta.is_device() { TransferFlags::DEVICES } else { TransferFlags::SPECIALS }) =>
                {
                    file(e, None)
                }
                source::Event::Special(e) if e.meta.is_device() => passed_over(e, "device skipped (--devices copies it as one)"),
                source::Event::Special(e) => passed_over(e, "FIFO or socket skipped (--specials copies it as one)"),
                source::Event::Link(e) => passed_over(e, "symbolic link skipped (--links copies it as one)"),
            })
        }
        Files::Feed { entries, .. } => {
            for f in entries {
                if !file(f.entry, f.host) {
                    return;
                }
            }
        }
        Files::Generate { name, size } => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let meta = FileMeta { path: name, size, mtime_s: now.as_secs() as i64, mtime_ns: 0, mode: 0o644, ..Default::default() };
            let entry = Entry { path: PathBuf::new(), meta, ctime: (0, 0), owner: None, inode: None };
            let _ = tx.send(Walked::File { entry, pinned: None, digest: None, linked: false });
        }
    }
}

/// Adds to an entry's announcement what the transfer keeps besides
/// content, mode and times: its owner and group (`--owner`, `--group`;
/// with their names unless `--numeric-ids`), and its extended attributes
/// (`--xattrs`: all but `system.*`; `--acls`: the ACLs'). Attributes that
/// cannot be read, or that pass the protocol's bounds, are left out with
/// a warning: the file is still sent.
fn describe(store: &dyn Storage, flags: TransferFlags, e: &mut Entry) {
    if let (Some((uid, gid)), true) = (e.owner, flags.intersects(TransferFlags::OWNER | TransferFlags::GROUP)) {
        let named = !flags.contains(TransferFlags::NUMERIC_IDS);
        let (user, group) = if named { (ids::user_name(uid), ids::group_name(gid)) } else { Default::default() };
        e.meta.owner = Some(Owner { uid, gid, user, group });
    }
    if !flags.intersects(TransferFlags::XATTRS | TransferFlags::ACLS) || !store.features().keeps.contains(Keeps::XATTRS) {
        return;
    }
    let name = || dmover_proto::path::printable(&e.meta.path).into_owned();
    match store.xattrs(&e.path) {
        Ok(all) => {
            let acl = |x: &Xattr| ACL_XATTRS.contains(&x.name.as_slice());
            let sent = |x: &Xattr| {
                if acl(x) {
                    flags.contains(TransferFlags::ACLS)
                } else {
                    flags.contains(TransferFlags::XATTRS) && !x.name.starts_with(b"system.")
                }
            };
            let (fit, over): (Vec<Xattr>, Vec<Xattr>) =
                all.into_iter().filter(sent).partition(|x| x.name.len() <= MAX_XATTR_NAME && x.value.len() <= MAX_XATTR_VALUE);
            if !over.is_empty() || fit.len() > MAX_XATTRS {
                log::warn!("{}: extended attributes past the protocol's bounds left out", name());
            }
            e.meta.xattrs = fit.into_iter().take(MAX_XATTRS).collect();
        }
        Err(err) => log::warn!("{}: cannot read its extended attributes: {err}", name()),
    }
}

/// Reads `host`'s control connection for the owner, up to the receiver's
/// last word (`Finished`, or an error). Echo answers go straight to the
/// host's meter, stamped with their time of arrival; what one read brought
/// goes to the owner together.
pub(super) fn read_control(sh: &Shared, host: usize, control: Box<dyn Transport>) {
    let mut r = FrameReader::new(control);
    let mut batch = Vec::new();
    loop {
        let lost = match r.read::<ToSender>() {
            Ok(Incoming::Msg(ToSender::Echo { stamp, received, staged, server_received, transfers })) => {
                let server = ServerLoad { delivered: server_received, transfers: transfers as usize };
                sh.meters[host].echo(sh.started.elapsed(), stamp, received, staged, server);
                None
            }
            Ok(Incoming::Msg(ToSender::Ping {})) => None,
            Ok(Incoming::Msg(msg)) => {
                let last = matches!(msg, ToSender::Finished { .. } | ToSender::Error { .. });
                batch.push(Event::Control { host, msg });
                if last {
                    let _ = sh.events.send(Input::Batch(batch));
                    return;
                }
                None
            }
            Ok(Incoming::Data(_)) => Some(Error::protocol(r.peer(), "data frame on the control connection")),
            Err(e) => Some(e),
        };
        if let Some(lost) = lost {
            let _ = sh.events.send(Input::Batch(batch));
            let _ = sh.events.send(Input::Broken(lost));
            return;
        }
        // What this read brought goes together, before the next read waits.
        if r.buffered() == 0 && !batch.is_empty() && sh.events.send(Input::Batch(std::mem::take(&mut batch))).is_err() {
            return;
        }
    }
}

fn reader(sh: &Arc<Shared>, retire: &AtomicBool) {
    while !retire.load(Ordering::SeqCst) {
        let job = crossbeam_channel::select! {
            recv(sh.jobs) -> j => match j {
                Ok(j) => j,
                Err(_) => return,
            },
            recv(sh.stop.woken()) -> _ => return,
            default(POLL) => continue,
        };
        if sh.stopped() {
            return;
        }
        let s = &job.source;
        if s.done.load(Ordering::SeqCst) {
            continue;
        }
        match read_chunk(sh, &job) {
            Ok(Some((sums, kept))) => sh.report(Event::Read { id: s.id, first: job.read.first, sums, kept }),
            Ok(None) => {}
            Err((kind, message)) => {
                // The rest of the file is not worth reading.
                s.done.store(true, Ordering::SeqCst);
                sh.report(Event::ReadFailed { id: s.id, kind, subject: s.label.clone(), message });
            }
        }
    }
}

/// A chunk's block checksums, and the digest kept with its file.
type ChunkRead = (Vec<Sum>, Option<Sum>);

/// Reads (and queues) the blocks of one chunk; returns their checksums and
/// the digest the storage keeps with the file (if it keeps one for this
/// block size), unless it was a resend or the transfer stopped. Errors
/// concern the file, not the transfer.
fn read_chunk(sh: &Shared, job: &Job) -> std::result::Result<Option<ChunkRead>, (ErrorKind, String)> {
    let (s, r) = (&job.source, &job.read);
    let file = if sh.generate {
        None
    } else {
        let range = r.first * sh.block_size..r.end * sh.block_size;
        let file: Arc<dyn ReadFile> = sh.store.open_range(&s.path, range).map_err(|e| (classify(&e), e.to_string()))?.into();
        unchanged(file.as_ref(), s)?;
        Some(file)
    };
    let q = &sh.hosts[r.host];
    let mut holes = file.as_ref().map(|f| DataMap::new(f.as_ref()));
    // Blocks to send that lie in a hole, not yet queued: (offset, bytes).
    let mut hole: Option<(u64, u64)> = None;
    let queue_hole = |hole: &mut Option<(u64, u64)>| {
        let Some((offset, len)) = hole.take() else { return true };
        q.wait_for_room(|| sh.stopped());
        q.tx.send(Outgoing::Hole { id: s.id, offset, len }).is_ok()
    };
    let mut sums = Vec::with_capacity((r.end - r.first) as usize);
    for b in r.first..r.end {
        let off = b * sh.block_size;
        let len = (s.meta.size - off).min(sh.block_size) as usize;
        let extent = match holes.as_mut() {
            Some(holes) => holes.extent(off, len as u64).map_err(|e| (classify(&e), e.to_string()))?,
            None => Extent::Data,
        };
        let in_hole = extent == Extent::Hole;
        // A hole goes as one message for as many blocks as follow each other.
        if (!in_hole || !r.sends(b)) && !queue_hole(&mut hole) {
            return Ok(None);
        }
        if in_hole {
            sums.push(zeros_sum(len));
            if r.sends(b) {
                hole.get_or_insert((off, 0)).1 += len as u64;
            }
            continue;
        }
        q.wait_for_room(|| sh.stopped());
        let Some(mut data) = sh.pool.take(len) else { return Ok(None) };
        let sum = match &file {
            Some(file) => {
                let (n, sum) = read_block(file.as_ref(), &mut data, off).map_err(|e| (classify(&e), e.to_string()))?;
                if n < len {
                    return Err((ErrorKind::SourceChanged, "the file shrank while it was read".into()));
                }
                sum
            }
            None => block_sum(&data),
        };
        sums.push(sum);
        if r.sends(b) {
            let mut header = DataHeader { file: s.id, offset: off, sum, len: len as u32, sparse: false };
            let mut prefix = Vec::new();
            if extent == Extent::Mixed {
                if let Some((p, packed)) = dmover_proto::packed::pack(&mut data) {
                    data.resize(packed);
                    header.len = (p.len() + packed) as u32;
                    header.sparse = true;
                    prefix = p;
                }
            }
            if q.tx.send(Outgoing::Block { header, prefix, data }).is_err() {
                return Ok(None);
            }
        }
    }
    if !queue_hole(&mut hole) {
        return Ok(None);
    }
    if let Some(file) = &file {
        unchanged(file.as_ref(), s)?;
    }
    let kept = file.as_ref().and_then(|f| f.digest()).filter(|d| d.block_size == sh.block_size).map(|d| d.sum);
    Ok((!r.resend).then_some((sums, kept)))
}

/// Fails if the open file no longer has the size, mtime and change time
/// it was listed with. The change time catches a writer that puts the
/// mtime back afterwards (as `cp -p` or `rsync` into the source would).
fn unchanged(file: &dyn ReadFile, s: &Source) -> std::result::Result<(), (ErrorKind, String)> {
    let m = file.stat().map_err(|e| (classify(&e), e.to_string()))?;
    let meta = &s.meta;
    if m.size != meta.size || m.mtime != (meta.mtime_s, meta.mtime_ns) || m.ctime != s.ctime {
        return Err((ErrorKind::SourceChanged, "the file changed while it was being copied".into()));
    }
    Ok(())
}

fn data_stream(sh: &Arc<Shared>, host: usize, conn: Box<dyn Transport>, retire: &AtomicBool) {
    let q = &sh.hosts[host];
    let mut w = FrameWriter::new(conn);
    loop {
        if retire.load(Ordering::SeqCst) {
            // Dropped by the tuner: nothing more comes on this connection.
            if w.send(OnData::StreamEnd {}).is_ok() {
                w.close_write();
            }
            return;
        }
        let next = crossbeam_channel::select! {
            recv(q.rx) -> o => o.map_err(|_| RecvTimeoutError::Disconnected),
            // Stopped: what is queued still goes, then the stream ends.
            recv(sh.stop.woken()) -> _ => q.rx.try_recv().map_err(|_| RecvTimeoutError::Timeout),
            default(POLL) => Err(RecvTimeoutError::Timeout),
        };
        match next {
            Ok(o) => {
                q.took_one();
                let sent = match o {
                    Outgoing::Block { header, prefix, mut data } => {
                        crate::fault::corrupt_in_flight(&mut data);
                        w.send_block_consuming(&header, &prefix, &mut data).map(|()| u64::from(header.len))
                    }
                    Outgoing::Hole { id, offset, len } => w.send(OnData::Hole { id, offset, len }).map(|()| 0),
                };
                let n = match sent {
                    Ok(n) => n,
                    Err(e) => {
                        // After `Finish` the receiver's word on the control
                        // connection settles the transfer: `Finished` once
                        // every file is settled (it may close its data
                        // connections with blocks of abandoned files still
                        // on their way), else why it failed.
                        if q.finished.load(Ordering::SeqCst) {
                            log::debug!("a data connection to host {host} closed after Finish: {e}");
                            return;
                        }
                        return sh.broken(e);
                    }
                };
                sh.sent.fetch_add(n, Ordering::Relaxed);
                Progress::add(&sh.progress.sent_bytes, n);
            }
            Err(RecvTimeoutError::Timeout) if sh.stopped() => return,
            Err(RecvTimeoutError::Timeout) => {
                if w.keep_alive(sh.ping_every).is_err() {
                    return;
                }
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}
