//! The sending end of a transfer.
//!
//! Files flow through four stages, each in its own threads, joined by
//! channels and bounded by the staging pool and an announcement window:
//!
//! 1. the walker lists the sources and streams entries as it finds them
//!    (or the caller feeds files while the transfer runs, [`Files::Feed`]);
//! 2. the announcer (the caller's thread) gives each file an id and a host
//!    (round-robin over the destination hosts, skipping a host whose window
//!    is full) and announces it on that host's control connection, up to
//!    [`WINDOW`] files ahead — so thousands of small files cost no round trip
//!    each, only one pipelined announcement;
//! 3. when a host's plan for a file arrives, its blocks become read jobs of
//!    up to [`CHUNK_BLOCKS`] blocks; `concurrency` reader threads read them
//!    into staging blocks, checksum each block and queue it for its host
//!    (several readers can read chunks of one large file at once); a host's
//!    queue holds at most [`AHEAD_PER_STREAM`] blocks per stream, so the few
//!    blocks in use are reused while still in the CPU's cache;
//! 4. one thread per data connection writes queued blocks to the network;
//!    any block can take any stream, so a large file is striped over all of
//!    them and small files share them.
//!
//! After a file's last block the sender announces its digest; the receiver
//! confirms it (or asks for damaged blocks again). A source that changes
//! while it is read is abandoned and reported, never committed.
//!
//! With a tuner ([`crate::tuning`]) and a way to open connections, the set
//! of data streams changes during the transfer: a new stream joins the
//! host's queue, a dropped one finishes its block and says `StreamEnd`.

use crate::error::{Error, Result};
use crate::pool::{Block, Pool};
use crate::progress::Progress;
use crate::recv::{ping_interval, Pinger};
use crate::source::{self, Entry, Event};
use crate::storage::{self, digest_of, read_block, ReadFile, Store};
use crate::transport::{Layers, Transport};
use crate::tuning::{self, Meter};
use crate::wire::{FrameReader, FrameWriter};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use dmover_proto::digest::{block_sum, file_digest, SetDigest, Sum};
use dmover_proto::frame::{DataHeader, FileError, FileMeta, HostShare, Stats, TransferOptions};
use dmover_proto::phase::{OnData, ToReceiver, ToSender};
use dmover_proto::ErrorKind;
use dmover_tune::ServerLoad;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Files announced to one host and not yet settled. Bounds the sender's
/// bookkeeping and the receiver's open state, while keeping enough
/// announcements ahead to hide the round trip.
pub const WINDOW: usize = 1024;
/// Blocks per read job: a large file is read by several readers at once in
/// chunks of this many blocks.
pub const CHUNK_BLOCKS: u64 = 16;
/// Blocks a host's queue may hold per open stream before readers wait:
/// enough that a stream finds its next block waiting, few enough that the
/// staging blocks in use are reused while still in the CPU's cache.
const AHEAD_PER_STREAM: usize = 2;
/// Entries the walker may list ahead of the announcer.
const WALK_AHEAD: usize = 4096;
/// How long the control connections are still read after a data
/// connection was lost, for the receiver's reason.
const REASON_WAIT: Duration = Duration::from_secs(2);
/// How often idle threads look at the stop flag.
const POLL: Duration = Duration::from_millis(50);

/// Makes one stream tuner (one per destination host).
pub type TunerFactory = Arc<dyn Fn() -> Box<dyn dmover_tune::Tuner> + Send + Sync>;

/// Opens one more data connection, authenticated and attached to the same session.
pub type Connector = Arc<dyn Fn() -> Result<Box<dyn Transport>> + Send + Sync>;

/// One destination: its control connection and data connections, already
/// authenticated and attached to a receiving session.
pub struct HostLink {
    pub name: String,
    pub control: Box<dyn Transport>,
    pub data: Vec<Box<dyn Transport>>,
    /// How to open more data connections while sending (None: the set is fixed).
    pub connect: Option<Connector>,
}

/// How a file was settled.
#[derive(Debug, Clone, Copy)]
pub enum Settled<'a> {
    /// Sent and verified at the destination.
    Sent,
    /// Already complete at the destination (sync, or a resumed transfer).
    Skipped,
    Failed(&'a FileError),
}

/// Hears of each file once it is settled: its attributes (the name is its
/// destination name), the index of the host it went to, and the outcome.
/// Called from the engine's threads; keep it short.
pub type SettleHook = Arc<dyn Fn(&FileMeta, usize, Settled<'_>) + Send + Sync>;

/// A file fed to a transfer, and the host it must go to (an index into
/// the links; None: the next host with room, round-robin). A caller that
/// may send a file again pins it, so that every attempt lands in the same
/// place (and resumes there).
pub struct FedFile {
    pub entry: Entry,
    pub host: Option<usize>,
}

/// What to send.
pub enum Files {
    /// Files found by walking `specs` under `root`.
    Walk { store: Store, specs: Vec<String> },
    /// Files the caller hands over while the transfer runs; the transfer
    /// ends once the channel is closed and every file is settled. `settled`
    /// hears of each file's outcome, so the caller can hand out more work
    /// or give a failed file to someone else.
    Feed { entries: Receiver<FedFile>, settled: SettleHook },
    /// One file of `size` bytes made up in memory (benchmarks).
    Generate { name: String, size: u64 },
}

pub struct SendConfig {
    pub options: TransferOptions,
    /// Reader threads: files (or chunks of a large file) read at once.
    pub concurrency: usize,
    /// Staging memory shared by all streams of this transfer.
    pub staging: u64,
    pub idle_timeout: Duration,
    pub progress: Arc<Progress>,
    /// Bytes per second for all streams together (0: no limit).
    pub bwlimit: u64,
    /// Makes a tuner for the streams of each host that has a connector.
    pub tuner: Option<TunerFactory>,
}

struct SendFile {
    id: u64,
    host: usize,
    path: PathBuf,
    /// The source's name in messages.
    label: String,
    meta: FileMeta,
    /// Inode change time when listed (see [`Entry::ctime`]).
    ctime: (i64, i64),
    blocks: u64,
    st: Mutex<FileState>,
}

#[derive(Default)]
struct FileState {
    sums: Vec<Sum>,
    chunks_left: u64,
    aborted: bool,
}

struct Job {
    file: Arc<SendFile>,
    first: u64,
    end: u64,
    /// Blocks in these ranges are sent; the others only read for the digest.
    send: Arc<Vec<(u64, u64)>>,
    resend: bool,
}

struct Outgoing {
    header: DataHeader,
    /// The block as read (and checksummed); it also holds the block's
    /// place in the staging budget until it is sent.
    data: Block,
}

#[derive(Default)]
struct Tally {
    /// Unsettled files per host.
    outstanding: Vec<usize>,
    /// Per host: what its `Finished` said.
    finished: Vec<Option<(u64, u64, u128)>>,
    shares: Vec<HostShare>,
    files: u64,
    bytes: u64,
    skipped_files: u64,
    skipped_bytes: u64,
    resent_blocks: u64,
    errors: Vec<FileError>,
    /// Per host: the set digest of the files it confirmed.
    sets: Vec<SetDigest>,
}

pub(crate) struct Shared {
    pub(crate) options: TransferOptions,
    block_size: u64,
    generate: bool,
    /// Where the files are read from.
    store: Store,
    progress: Arc<Progress>,
    pool: Arc<Pool>,
    /// Announced, unsettled files; control readers and readers look them up.
    files: Mutex<HashMap<u64, Arc<SendFile>>>,
    /// Counters and per-host state; `changed` is signalled on every update.
    tally: Mutex<Tally>,
    changed: Condvar,
    /// Control writers, one per host; the announcer, readers and control readers share them.
    ctl: Vec<Arc<Mutex<FrameWriter>>>,
    /// Blocks queued for each host's data streams.
    data_tx: Vec<Sender<Outgoing>>,
    data_rx: Vec<Receiver<Outgoing>>,
    jobs_tx: Sender<Job>,
    jobs_rx: Receiver<Job>,
    /// Reader threads wanted, newest last: each one's flag tells it to stop.
    readers: Mutex<Vec<Arc<AtomicBool>>>,
    fatal: Mutex<Option<Error>>,
    stop: AtomicBool,
    /// `Finish` is going out: no more probes.
    finishing: AtomicBool,
    /// The control connections, to close them on a fatal error (they
    /// outlive a successful send).
    controls: Vec<Box<dyn Transport>>,
    /// Each host's data streams.
    pub(crate) streams: Vec<HostStreams>,
    /// Every open data connection by stream id, to close them all at the end or on a fatal error.
    data_conns: Mutex<HashMap<u64, DataConn>>,
    next_stream: AtomicU64,
    /// Stream and reader threads, joined at the end.
    workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    ping_every: Duration,
    /// Control-channel measurements per host.
    pub(crate) meters: Vec<Meter>,
    /// Told of each settled file (fed transfers).
    settled: Option<SettleHook>,
    sent: AtomicU64,
    /// Put on every data connection as its stream starts.
    layers: Layers,
    pub(crate) started: Instant,
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

/// A data connection and the host it goes to.
type DataConn = (usize, Box<dyn Transport>);

/// The data streams to one host.
pub(crate) struct HostStreams {
    connect: Option<Connector>,
    /// Streams wanted, newest last: each one's flag tells it to stop.
    retire: Mutex<Vec<Arc<AtomicBool>>>,
    /// Streams connected and running.
    pub(crate) open: AtomicU64,
    /// Readers wait on `room_freed` while the host's queue is full (see [`AHEAD_PER_STREAM`]);
    /// a stream signals it each time it takes a block.
    room: Mutex<()>,
    room_freed: Condvar,
}

impl HostStreams {
    /// Waits while `queue` holds [`AHEAD_PER_STREAM`] blocks per open stream
    /// (or until `stopped`).
    fn wait_for_room(&self, queue: &Sender<Outgoing>, stopped: impl Fn() -> bool) {
        let mut g = self.room.lock().expect("room lock");
        loop {
            let open = self.open.load(Ordering::SeqCst) as usize;
            if open == 0 || queue.len() < AHEAD_PER_STREAM * open || stopped() {
                return;
            }
            g = self.room_freed.wait_timeout(g, POLL).expect("room lock").0;
        }
    }

    /// Wakes the readers waiting for room (a stream took a block).
    fn took_one(&self) {
        drop(self.room.lock().expect("room lock"));
        self.room_freed.notify_all();
    }
}

impl Shared {
    /// Ends the transfer with `e`. The first error wins, except that a lost
    /// connection gives way to the reason the peer gave for closing it.
    fn fail(&self, e: Error) {
        let e_kind_lost = e.kind == ErrorKind::Unreachable;
        let mut f = self.fatal.lock().expect("fatal lock");
        if f.as_ref().is_none_or(|old| old.kind == ErrorKind::Unreachable && e.kind != ErrorKind::Unreachable) {
            *f = Some(e);
        }
        drop(f);
        self.stop.store(true, Ordering::SeqCst);
        self.data_conns.lock().expect("conns lock").values().for_each(|c| c.1.close());
        if e_kind_lost {
            // A receiver that fails closes the data connections first and
            // says why on the control connection: read on there a little
            // longer rather than cut the reason off.
            self.controls.iter().for_each(|c| {
                let _ = c.set_read_timeout(Some(REASON_WAIT));
            });
        } else {
            self.controls.iter().for_each(|c| c.close());
        }
        self.pool.close();
        let _g = self.tally.lock().expect("tally lock");
        self.changed.notify_all();
    }

    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn queue(&self, host: usize, m: ToReceiver) {
        let queued = self.ctl[host].lock().expect("control lock").queue(m);
        if let Err(e) = queued {
            self.fail(e);
        }
    }

    pub(crate) fn tell(&self, host: usize, m: ToReceiver) {
        let sent = self.ctl[host].lock().expect("control lock").send(m);
        if let Err(e) = sent {
            self.fail(e);
        }
    }

    pub(crate) fn can_add_streams(&self, host: usize) -> bool {
        self.streams[host].connect.is_some()
    }

    /// Runs a data stream to `host` in its own thread, on `conn` or on a new connection.
    fn start_stream(self: &Arc<Self>, host: usize, conn: Option<Box<dyn Transport>>, retire: Arc<AtomicBool>) {
        let sh = self.clone();
        let t = std::thread::spawn(move || {
            let conn = match conn {
                Some(c) => c,
                None => match sh.streams[host].connect.as_ref().map(|c| c()) {
                    Some(Ok(c)) => c,
                    failed => {
                        if let Some(Err(e)) = failed {
                            log::warn!("could not open another stream: {e}");
                        }
                        sh.streams[host].retire.lock().expect("streams lock").retain(|f| !Arc::ptr_eq(f, &retire));
                        return;
                    }
                },
            };
            let conn = sh.layers.wrap(conn);
            let id = sh.next_stream.fetch_add(1, Ordering::Relaxed);
            match conn.split() {
                Ok(c) => {
                    sh.data_conns.lock().expect("conns lock").insert(id, (host, c));
                }
                Err(e) => return sh.fail(Error::network(conn.peer(), &e)),
            }
            if sh.stopped() && sh.data_rx[host].is_empty() {
                conn.close();
            } else {
                sh.streams[host].open.fetch_add(1, Ordering::SeqCst);
                data_stream(&sh, host, conn, &retire);
                sh.streams[host].open.fetch_sub(1, Ordering::SeqCst);
            }
            sh.data_conns.lock().expect("conns lock").remove(&id);
        });
        self.workers.lock().expect("workers lock").push(t);
    }

    /// Starts or stops reader threads until `n` are wanted.
    pub(crate) fn set_readers(self: &Arc<Self>, n: usize) {
        resize(&mut self.readers.lock().expect("readers lock"), n, |flag| {
            let sh = self.clone();
            let t = std::thread::spawn(move || reader(&sh, &flag));
            self.workers.lock().expect("workers lock").push(t);
        });
    }

    /// A file is settled (done, skipped, failed or abandoned).
    fn settle(&self, f: &SendFile, how: Settled<'_>, update: impl FnOnce(&mut Tally)) {
        if self.files.lock().expect("files lock").remove(&f.id).is_none() {
            return; // settled already (a failure reported by both ends)
        }
        if let Some(hook) = &self.settled {
            hook(&f.meta, f.host, how);
        }
        let mut t = self.tally.lock().expect("tally lock");
        t.outstanding[f.host] -= 1;
        update(&mut t);
        drop(t);
        self.changed.notify_all();
    }

    /// Records a file's failure; `path` names where it failed (empty: the file's name).
    fn file_error(&self, f: &SendFile, path: String, kind: ErrorKind, message: String) {
        let path = if path.is_empty() { f.meta.path.clone() } else { path };
        log::info!("{path}: {message}");
        let e = FileError { path, kind, message };
        self.settle(f, Settled::Failed(&e), |t| t.errors.push(e.clone()));
    }
}

impl tuning::Tunable for Arc<Shared> {
    fn hosts(&self) -> usize {
        self.streams.len()
    }

    fn can_add_streams(&self, host: usize) -> bool {
        Shared::can_add_streams(self, host)
    }

    fn open_streams(&self, host: usize) -> usize {
        self.streams[host].open.load(Ordering::SeqCst) as usize
    }

    /// Opens or drops streams to `host` until `n` are wanted.
    fn set_streams(&self, host: usize, n: usize) {
        let hs = &self.streams[host];
        if hs.connect.is_none() {
            return;
        }
        resize(&mut hs.retire.lock().expect("streams lock"), n, |flag| self.start_stream(host, None, flag));
    }

    /// Reader threads running or wanted.
    fn readers(&self) -> usize {
        self.readers.lock().expect("readers lock").len()
    }

    fn set_readers(&self, n: usize) {
        Shared::set_readers(self, n)
    }

    fn stopped(&self) -> bool {
        Shared::stopped(self)
    }

    fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Sends an `Echo` probe to `host`, unless the transfer is ending:
    /// nothing may follow `Finish` on a control connection.
    fn probe(&self, host: usize, stamp: u64) {
        let mut w = self.ctl[host].lock().expect("control lock");
        if self.finishing.load(Ordering::SeqCst) {
            return;
        }
        if let Err(e) = w.send(ToReceiver::Echo { stamp, received: 0, staged: 0, server_received: 0, transfers: 0 }) {
            drop(w);
            self.fail(e);
        }
    }

    /// Whether no block waits for `host`'s streams.
    fn starved(&self, host: usize) -> bool {
        self.data_tx[host].is_empty()
    }

    /// What one data connection to `host` can have in flight (W).
    fn window(&self, host: usize) -> u64 {
        let w = self.data_conns.lock().expect("conns lock").values().find(|c| c.0 == host).map_or(0, |c| c.1.send_window());
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

/// Sends the files to the hosts and returns the outcome once every host has
/// confirmed the end of the transfer.
pub fn send(files: Files, links: Vec<HostLink>, cfg: SendConfig) -> Result<Stats> {
    let started = Instant::now();
    let n = links.len();
    assert!(n > 0, "send needs a destination");
    let block_size = cfg.options.block_size as u64;
    let streams: usize = links.iter().map(|l| l.data.len()).sum();
    let generate = matches!(files, Files::Generate { .. });
    let settled = match &files {
        Files::Feed { settled, .. } => Some(settled.clone()),
        _ => None,
    };
    let store = match &files {
        Files::Walk { store, .. } => store.clone(),
        Files::Feed { .. } | Files::Generate { .. } => storage::local(),
    };
    let min_blocks = streams + cfg.concurrency;
    let pool = if generate {
        Pool::with_fill(cfg.staging, block_size as usize, min_blocks, fill_block)
    } else {
        Pool::new(cfg.staging, block_size as usize, min_blocks)
    };
    let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
    let mut ctl = Vec::new();
    let mut data_tx = Vec::new();
    let mut data_rx = Vec::new();
    let mut controls = Vec::new();
    let mut names = Vec::new();
    let mut host_streams = Vec::new();
    for l in &links {
        let split = |t: &dyn Transport| t.split().map_err(|e| Error::network(&l.name, &e));
        l.control.set_read_timeout(Some(cfg.idle_timeout)).map_err(|e| Error::network(&l.name, &e))?;
        ctl.push(Arc::new(Mutex::new(FrameWriter::new(split(l.control.as_ref())?))));
        controls.push(split(l.control.as_ref())?);
        let (tx, rx) = crossbeam_channel::unbounded::<Outgoing>();
        data_tx.push(tx);
        data_rx.push(rx);
        names.push(l.name.clone());
        let connect = if cfg.tuner.is_some() { l.connect.clone() } else { None };
        host_streams.push(HostStreams {
            connect,
            retire: Mutex::default(),
            open: AtomicU64::new(0),
            room: Mutex::default(),
            room_freed: Condvar::new(),
        });
    }
    let tally = Tally {
        outstanding: vec![0; n],
        finished: vec![None; n],
        sets: vec![SetDigest::default(); n],
        shares: names.iter().map(|h| HostShare { host: h.clone(), ..Default::default() }).collect(),
        ..Default::default()
    };
    let sh = Arc::new(Shared {
        options: cfg.options,
        block_size,
        generate,
        store,
        progress: cfg.progress.clone(),
        pool,
        files: Mutex::new(HashMap::new()),
        tally: Mutex::new(tally),
        changed: Condvar::new(),
        meters: (0..n).map(|_| Meter::default()).collect(),
        settled,
        ctl,
        data_tx,
        data_rx,
        jobs_tx,
        jobs_rx,
        readers: Mutex::default(),
        fatal: Mutex::new(None),
        stop: AtomicBool::new(false),
        finishing: AtomicBool::new(false),
        controls,
        streams: host_streams,
        data_conns: Mutex::new(HashMap::new()),
        next_stream: AtomicU64::new(0),
        workers: Mutex::new(Vec::new()),
        ping_every: ping_interval(cfg.idle_timeout),
        sent: AtomicU64::new(0),
        layers: Layers::new(cfg.bwlimit),
        started,
    });

    let mut readers_of_ctl = Vec::new();
    let _pingers: Vec<Pinger> = sh.ctl.iter().map(|c| Pinger::start(c.clone(), sh.ping_every)).collect();
    for (host, l) in links.into_iter().enumerate() {
        for d in l.data {
            let flag = Arc::new(AtomicBool::new(false));
            sh.streams[host].retire.lock().expect("streams lock").push(flag.clone());
            sh.start_stream(host, Some(d), flag);
        }
        let sh2 = sh.clone();
        let control = l.control;
        readers_of_ctl.push(std::thread::spawn(move || control_reader(&sh2, host, FrameReader::new(control))));
    }
    sh.set_readers(cfg.concurrency);
    let tuner = cfg.tuner.filter(|_| (0..n).any(|h| sh.can_add_streams(h))).map(|make| {
        let sh = sh.clone();
        std::thread::spawn(move || tuning::run(&sh, &*make))
    });

    let result = announce_all(&sh, files);
    let finish = result.and_then(|()| finish(&sh));
    // Stop everything: streams drain their queues first when all went well.
    sh.stop.store(true, Ordering::SeqCst);
    sh.pool.close();
    let timeline = tuner.and_then(|t| t.join().ok()).unwrap_or_default();
    let workers = std::mem::take(&mut *sh.workers.lock().expect("workers lock"));
    for t in workers {
        let _ = t.join();
    }
    // The data connections are done; the control connections stay open for
    // whoever owns them (a server reports on its client's control connection).
    sh.data_conns.lock().expect("conns lock").values().for_each(|c| c.1.close());
    for t in readers_of_ctl {
        let _ = t.join();
    }
    if let Some(e) = sh.fatal.lock().expect("fatal lock").take() {
        return Err(e);
    }
    finish?;
    let t = sh.tally.lock().expect("tally lock");
    let (dest_files, dest_bytes) = t.finished.iter().flatten().fold((0, 0), |a, f| (a.0 + f.0, a.1 + f.1));
    let digests_match = t.finished.iter().zip(&t.sets).all(|(f, s)| f.is_some_and(|f| f.2 == s.0));
    Ok(Stats {
        files: t.files,
        bytes: t.bytes,
        skipped_files: t.skipped_files,
        skipped_bytes: t.skipped_bytes,
        sent_bytes: sh.sent.load(Ordering::Relaxed),
        retries: 0,
        resent_blocks: t.resent_blocks,
        nanos: started.elapsed().as_nanos() as u64,
        hosts: t.shares.clone(),
        errors: t.errors.clone(),
        dest_files,
        dest_bytes,
        digests_match,
        timeline,
    })
}

/// Fills `b` with incompressible bytes from a xorshift generator whose
/// state is `x` (benchmark data: fast, not cryptographic).
pub fn fill_random(x: &mut u64, b: &mut [u8]) {
    for c in b.chunks_mut(8) {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
}

/// Fill for generated blocks: each block gets its own sequence.
fn fill_block(b: &mut [u8]) {
    fill_random(&mut (0x2545_f491_4f6c_dd1d ^ b.as_ptr() as u64), b);
}

/// Walks the sources (in a thread) and announces every file.
fn announce_all(sh: &Arc<Shared>, files: Files) -> Result<()> {
    // Each event with the host it is pinned to, if any.
    let (tx, rx) = crossbeam_channel::bounded::<(Event, Option<usize>)>(WALK_AHEAD);
    let walker = std::thread::spawn(move || match files {
        Files::Walk { store, specs } => source::walk(store.as_ref(), &specs, &mut |ev| tx.send((ev, None)).is_ok()),
        Files::Feed { entries, .. } => {
            for f in entries {
                if tx.send((Event::File(f.entry), f.host)).is_err() {
                    return;
                }
            }
        }
        Files::Generate { name, size } => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let meta = FileMeta { path: name, size, mtime_s: now.as_secs() as i64, mtime_ns: 0, mode: 0o644 };
            let _ = tx.send((Event::File(Entry { path: PathBuf::new(), meta, ctime: (0, 0) }), None));
        }
    });
    let hosts = sh.ctl.len();
    // Hosts with announcements queued and not yet written.
    let mut queued = vec![false; hosts];
    let mut next_id = 0u64;
    let mut rr = 0usize;
    loop {
        // Polled, so that a fatal error ends the wait for a slow walk or feed.
        let (ev, pinned) = match rx.recv_timeout(POLL) {
            Ok(x) => x,
            Err(RecvTimeoutError::Timeout) if !sh.stopped() => continue,
            Err(_) => break,
        };
        if sh.stopped() {
            break;
        }
        match ev {
            Event::File(e) => {
                // The hosts this file may go to, in order of preference.
                let pinned = pinned.filter(|h| *h < hosts);
                let order = |rr: usize| (0..hosts).map(move |i| (rr + i) % hosts).filter(move |h| pinned.is_none_or(|p| p == *h));
                let host = {
                    let mut t = sh.tally.lock().expect("tally lock");
                    loop {
                        if sh.stopped() {
                            break None;
                        }
                        if let Some(h) = order(rr).find(|h| t.outstanding[*h] < WINDOW) {
                            t.outstanding[h] += 1;
                            t.files += 1;
                            t.bytes += e.meta.size;
                            break Some(h);
                        }
                        // Announcements still queued must go out before we wait for answers.
                        drop(t);
                        flush_queued(sh, &mut queued);
                        t = sh.tally.lock().expect("tally lock");
                        if order(rr).any(|h| t.outstanding[h] < WINDOW) {
                            continue;
                        }
                        t = sh.changed.wait(t).expect("tally lock");
                    }
                };
                let Some(host) = host else { break };
                if pinned.is_none() {
                    rr = (host + 1) % hosts;
                }
                Progress::add(&sh.progress.total_files, 1);
                Progress::add(&sh.progress.total_bytes, e.meta.size);
                next_id += 1;
                let blocks = e.meta.size.div_ceil(sh.block_size);
                let label = sh.store.display(&e.path);
                let f = Arc::new(SendFile {
                    id: next_id,
                    host,
                    path: e.path,
                    label,
                    meta: e.meta,
                    ctime: e.ctime,
                    blocks,
                    st: Mutex::default(),
                });
                let digest = if sh.options.has(TransferOptions::CHECKSUM) && !sh.generate {
                    digest_of(sh.store.as_ref(), &f.path, sh.block_size).ok()
                } else {
                    None
                };
                sh.files.lock().expect("files lock").insert(f.id, f.clone());
                sh.queue(host, ToReceiver::Announce { id: f.id, meta: f.meta.clone(), digest });
                queued[host] = true;
            }
            Event::Error(e) => {
                log::info!("{e}");
                let mut t = sh.tally.lock().expect("tally lock");
                t.errors.push(FileError { path: e.subject.clone(), kind: e.kind, message: e.message.clone() });
            }
            Event::SkippedLink(p) => log::warn!("{p}: symbolic link skipped"),
        }
        // Announce in batches, but never keep one back while the walk is busy.
        if rx.is_empty() {
            flush_queued(sh, &mut queued);
        }
    }
    flush_queued(sh, &mut queued);
    drop(rx);
    // After a stop the walker ends by itself at its next entry (a feed's
    // walker when its owner closes the feed): do not wait for it.
    if !sh.stopped() {
        let _ = walker.join();
    }
    sh.progress.walk_done.store(true, Ordering::Relaxed);
    // Wait until every file is settled.
    let mut t = sh.tally.lock().expect("tally lock");
    while !sh.stopped() && t.outstanding.iter().any(|o| *o > 0) {
        t = sh.changed.wait(t).expect("tally lock");
    }
    Ok(())
}

/// Writes the announcements queued for each host.
fn flush_queued(sh: &Shared, queued: &mut [bool]) {
    for (host, q) in queued.iter_mut().enumerate() {
        if std::mem::take(q) {
            let flushed = sh.ctl[host].lock().expect("control lock").flush();
            if let Err(e) = flushed {
                sh.fail(e);
            }
        }
    }
}

/// Tells every host the transfer is over and waits for their totals.
/// Not after a fatal error: `Finish` would tell the receivers that the
/// transfer is complete.
fn finish(sh: &Arc<Shared>) -> Result<()> {
    if sh.stopped() {
        return Ok(());
    }
    for c in &sh.ctl {
        let _g = c.lock().expect("control lock");
        sh.finishing.store(true, Ordering::SeqCst);
    }
    for host in 0..sh.ctl.len() {
        let (files, bytes, set) = {
            let t = sh.tally.lock().expect("tally lock");
            (t.shares[host].files, t.shares[host].bytes, t.sets[host])
        };
        sh.tell(host, ToReceiver::Finish { files, bytes, set_digest: set.0 });
    }
    let mut t = sh.tally.lock().expect("tally lock");
    while !sh.stopped() && t.finished.iter().any(Option::is_none) {
        t = sh.changed.wait(t).expect("tally lock");
    }
    Ok(())
}

fn control_reader(sh: &Arc<Shared>, host: usize, mut r: FrameReader) {
    loop {
        let m = match r.read_msg::<ToSender>() {
            Ok(m) => m,
            Err(e) => {
                let finished = sh.tally.lock().expect("tally lock").finished[host].is_some();
                // After a stop, only a reason the receiver gave still matters.
                if !finished && (!sh.stopped() || e.kind != ErrorKind::Unreachable) {
                    sh.fail(e);
                }
                return;
            }
        };
        let lookup = |id: &u64| sh.files.lock().expect("files lock").get(id).cloned();
        match m {
            ToSender::Plan { id, skip, ranges } => {
                let Some(f) = lookup(&id) else { continue };
                if skip {
                    Progress::add(&sh.progress.done_files, 1);
                    Progress::add(&sh.progress.done_bytes, f.meta.size);
                    sh.settle(&f, Settled::Skipped, |t| {
                        t.skipped_files += 1;
                        t.skipped_bytes += f.meta.size;
                        t.shares[f.host].files += 1;
                        t.shares[f.host].bytes += f.meta.size;
                        t.sets[f.host].add(&f.meta.path, f.meta.size, &[0; 16]);
                    });
                    continue;
                }
                if ranges.iter().any(|(_, e)| *e > f.blocks) {
                    return sh.fail(Error::protocol(r.peer(), format!("plan for {} asks for blocks past its end", f.meta.path)));
                }
                let chunks = f.blocks.div_ceil(CHUNK_BLOCKS);
                {
                    let mut st = f.st.lock().expect("file lock");
                    st.sums = vec![[0; 16]; f.blocks as usize];
                    st.chunks_left = chunks;
                }
                if chunks == 0 {
                    sh.tell(host, ToReceiver::FileEnd { id, digest: file_digest(&[]) });
                    continue;
                }
                let send = Arc::new(ranges);
                for c in 0..chunks {
                    let first = c * CHUNK_BLOCKS;
                    let end = (first + CHUNK_BLOCKS).min(f.blocks);
                    let _ = sh.jobs_tx.send(Job { file: f.clone(), first, end, send: send.clone(), resend: false });
                }
            }
            ToSender::Nack { id, block } => {
                let Some(f) = lookup(&id) else { continue };
                if block >= f.blocks {
                    return sh.fail(Error::protocol(r.peer(), "request for a block past the end of a file"));
                }
                sh.tally.lock().expect("tally lock").resent_blocks += 1;
                let send = Arc::new(vec![(block, block + 1)]);
                let _ = sh.jobs_tx.send(Job { file: f, first: block, end: block + 1, send, resend: true });
            }
            ToSender::Done { id, digest } => {
                let Some(f) = lookup(&id) else { continue };
                let ours = file_digest(&f.st.lock().expect("file lock").sums);
                if ours != digest {
                    sh.file_error(&f, String::new(), ErrorKind::Verify, "the destination's digest differs from the source's".into());
                    continue;
                }
                Progress::add(&sh.progress.done_files, 1);
                Progress::add(&sh.progress.done_bytes, f.meta.size);
                sh.settle(&f, Settled::Sent, |t| {
                    t.shares[f.host].files += 1;
                    t.shares[f.host].bytes += f.meta.size;
                    t.sets[f.host].add(&f.meta.path, f.meta.size, &digest);
                });
            }
            ToSender::Failed { id, kind, subject, message } => {
                let Some(f) = lookup(&id) else { continue };
                f.st.lock().expect("file lock").aborted = true;
                sh.file_error(&f, subject, kind, message);
            }
            ToSender::Finished { files, bytes, set_digest } => {
                let mut t = sh.tally.lock().expect("tally lock");
                t.finished[host] = Some((files, bytes, set_digest));
                drop(t);
                sh.changed.notify_all();
                return;
            }
            ToSender::Ping {} => {}
            ToSender::Echo { stamp, received, staged, server_received, transfers } => {
                let server = ServerLoad { delivered: server_received, transfers: transfers as usize };
                sh.meters[host].echo(sh.started.elapsed(), stamp, received, staged, server)
            }
            ToSender::Error { kind, message } => return sh.fail(Error::new(kind, r.peer(), message)),
        }
    }
}

fn reader(sh: &Arc<Shared>, retire: &AtomicBool) {
    while !retire.load(Ordering::SeqCst) {
        let job = match sh.jobs_rx.recv_timeout(POLL) {
            Ok(j) => j,
            Err(RecvTimeoutError::Timeout) if !sh.stopped() => continue,
            Err(_) => return,
        };
        if sh.stopped() {
            return;
        }
        if let Err((kind, message)) = read_job(sh, &job) {
            let f = &job.file;
            let first = {
                let mut st = f.st.lock().expect("file lock");
                !std::mem::replace(&mut st.aborted, true)
            };
            if first {
                sh.tell(f.host, ToReceiver::Abort { id: f.id, kind, message: message.clone() });
                sh.file_error(f, f.label.clone(), kind, message);
            }
        }
    }
}

/// Reads (and queues) the blocks of one job; on the file's last chunk, sends
/// its digest. Errors concern the file, not the transfer.
fn read_job(sh: &Arc<Shared>, job: &Job) -> std::result::Result<(), (ErrorKind, String)> {
    let f = &job.file;
    if f.st.lock().expect("file lock").aborted {
        return Ok(());
    }
    let file = if sh.generate {
        None
    } else {
        let file: Arc<dyn ReadFile> = sh.store.open(&f.path).map_err(|e| (crate::error::classify(&e), e.to_string()))?.into();
        unchanged(file.as_ref(), f)?;
        Some(file)
    };
    for b in job.first..job.end {
        let off = b * sh.block_size;
        let len = (f.meta.size - off).min(sh.block_size) as usize;
        sh.streams[f.host].wait_for_room(&sh.data_tx[f.host], || sh.stopped());
        let Some(mut data) = sh.pool.take(len) else { return Ok(()) };
        let sum = match &file {
            Some(file) => {
                let (n, sum) = read_block(file.as_ref(), &mut data, off).map_err(|e| (crate::error::classify(&e), e.to_string()))?;
                if n < len {
                    return Err((ErrorKind::SourceChanged, "the file shrank while it was read".into()));
                }
                sum
            }
            None => block_sum(&data),
        };
        f.st.lock().expect("file lock").sums[b as usize] = sum;
        if job.send.iter().any(|(a, e)| (*a..*e).contains(&b)) {
            let header = DataHeader { file: f.id, offset: off, sum, len: len as u32 };
            if sh.data_tx[f.host].send(Outgoing { header, data }).is_err() {
                return Ok(());
            }
        }
    }
    if let Some(file) = &file {
        unchanged(file.as_ref(), f)?;
    }
    if job.resend {
        return Ok(());
    }
    let digest = {
        let mut st = f.st.lock().expect("file lock");
        st.chunks_left -= 1;
        if st.chunks_left > 0 || st.aborted {
            return Ok(());
        }
        file_digest(&st.sums)
    };
    // A storage that keeps a digest with the file (an object store) has it
    // checked end to end: what was read must be what was stored.
    if let Some(kept) = file.as_ref().and_then(|f| f.digest()).filter(|d| d.block_size == sh.block_size) {
        if kept.sum != digest {
            return Err((ErrorKind::Verify, "what was read differs from the digest stored with the file".into()));
        }
    }
    sh.tell(f.host, ToReceiver::FileEnd { id: f.id, digest });
    Ok(())
}

/// Fails if the open file no longer has the size, mtime and change time
/// it was listed with. The change time catches a writer that puts the
/// mtime back afterwards (as `cp -p` or `rsync` into the source would).
fn unchanged(file: &dyn ReadFile, f: &SendFile) -> std::result::Result<(), (ErrorKind, String)> {
    let m = file.stat().map_err(|e| (crate::error::classify(&e), e.to_string()))?;
    let meta = &f.meta;
    if m.size != meta.size || m.mtime != (meta.mtime_s, meta.mtime_ns) || m.ctime != f.ctime {
        return Err((ErrorKind::SourceChanged, "the file changed while it was being copied".into()));
    }
    Ok(())
}

fn data_stream(sh: &Arc<Shared>, host: usize, conn: Box<dyn Transport>, retire: &AtomicBool) {
    let rx = &sh.data_rx[host];
    let mut w = FrameWriter::new(conn);
    let mut last = Instant::now();
    loop {
        if retire.load(Ordering::SeqCst) {
            // Dropped by the tuner: nothing more comes on this connection.
            if w.send(OnData::StreamEnd {}).is_ok() {
                w.close_write();
            }
            return;
        }
        match rx.recv_timeout(POLL) {
            Ok(mut o) => {
                sh.streams[host].took_one();
                crate::fault::corrupt_in_flight(&mut o.data);
                if let Err(e) = w.send_block(&o.header, &o.data) {
                    // Once `Finish` is going out every file is settled: a
                    // block still queued is of a file that failed at the
                    // source, and the receiver, done, may have closed the
                    // connection already.
                    if !sh.stopped() && !sh.finishing.load(Ordering::SeqCst) {
                        sh.fail(e);
                    }
                    return;
                }
                last = Instant::now();
                let n = o.header.len as u64;
                sh.sent.fetch_add(n, Ordering::Relaxed);
                Progress::add(&sh.progress.sent_bytes, n);
            }
            Err(RecvTimeoutError::Timeout) if sh.stopped() => return,
            Err(RecvTimeoutError::Timeout) => {
                if last.elapsed() >= sh.ping_every {
                    if w.send(OnData::Ping {}).is_err() {
                        return;
                    }
                    last = Instant::now();
                }
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}
