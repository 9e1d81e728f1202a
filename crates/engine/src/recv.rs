//! The receiving end of a transfer.
//!
//! One control connection carries announcements in and plans and
//! confirmations out; any number of data connections (they may attach at
//! any time) carry blocks in. Threads:
//!
//! * the control thread (the caller's) decides for each announced file what
//!   to ask for — nothing if it is already there (`--sync`, or a resumed
//!   transfer), the missing blocks of a journaled partial file, or all;
//! * one thread per data connection reads a block into a staging block,
//!   checks its checksum (a bad block is asked for again) and queues it;
//! * writer threads write blocks at their offsets into the file's temporary
//!   name, journal them and, when the last block and the sender's digest are
//!   in, verify the digest and hand the file to the committer;
//! * the committer thread takes verified files in batches: it sets each
//!   one's mode and mtime, makes their data durable, renames them into place,
//!   makes the names durable, and only then confirms them (`Done`). One
//!   file-system sync serves a whole batch's data and the names of the batch
//!   before it, so many small files cost a few syncs, not two each
//!   (`--no-fsync` skips the syncs). The writers have the kernel start
//!   writing each block back as soon as it is written, so a sync finds
//!   little left to do.
//!
//! Staging blocks come from one pool, so a slow disk stalls the network
//! readers (and through TCP, the sender) instead of growing memory. Each
//! writer's queue holds at most [`WRITE_QUEUE`] blocks: when the writers
//! fall behind, the readers wait rather than fill the whole pool, so the
//! few blocks in use are reused while still in the CPU's cache. How full
//! those queues are is what the sender's tuner hears as "staged".

use crate::error::{Error, Result};
use crate::journal::{self, Journal};
use crate::pool::{Block, Pool};
use crate::source::{PART_SUFFIX, STATE_DIR};
use crate::storage::{digest_of, Attrs, Store, WriteFile};
use crate::transport::{SocketOptions, Transport};
use crate::wire::{FrameReader, FrameWriter, Incoming};
use crossbeam_channel::{Receiver, Sender};
use dmover_proto::digest::{file_digest, SetDigest, Sum};
use dmover_proto::frame::{FileMeta, TransferOptions};
use dmover_proto::phase::{OnData, ToReceiver, ToSender};
use dmover_proto::{ErrorKind, Msg};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What one server takes in across all of its receiving sessions, reported
/// to each sender's tuner so that transfers sharing the server can balance.
#[derive(Debug, Default)]
pub struct Intake {
    /// Payload bytes taken off data connections, all sessions.
    received: AtomicU64,
    /// Sessions receiving now.
    transfers: AtomicU32,
}

/// Counts a session among those receiving while it lives.
struct Receiving(Arc<Intake>);

impl Receiving {
    fn new(intake: Arc<Intake>) -> Receiving {
        intake.transfers.fetch_add(1, Ordering::Relaxed);
        Receiving(intake)
    }
}

impl Drop for Receiving {
    fn drop(&mut self) {
        self.0.transfers.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where and how to receive.
pub struct RecvConfig {
    /// Where files go: an export (every path confined beneath it), or the
    /// local file system.
    pub store: Store,
    /// The destination directory (or file, see [`DEST_MAY_BE_FILE`]) in `store`.
    pub dest: String,
    pub options: TransferOptions,
    /// Staging memory for blocks between network and disk.
    pub staging: u64,
    /// Threads writing to disk.
    pub writers: usize,
    /// A control connection silent this long is considered dead.
    pub idle_timeout: Duration,
    /// The intake of the server this session belongs to (a fresh one for a
    /// receiver of its own).
    pub intake: Arc<Intake>,
    /// Which announced names to take (None: any that stays below `dest`).
    pub accept: Option<NameCheck>,
}

/// Says why an announced name is not taken, if it is not.
pub type NameCheck = Arc<dyn Fn(&str) -> std::result::Result<(), String> + Send + Sync>;

/// How often idle threads look at the stop flag.
const POLL: Duration = Duration::from_millis(50);
/// Times one block may arrive damaged before its file fails verification:
/// a link that damages a block this often will not deliver it.
pub const MAX_DAMAGED: u32 = 8;
/// Blocks waiting for one writer, at most.
pub const WRITE_QUEUE: usize = 4;
/// Verified files the committer makes durable and renames together, at
/// most: enough that small files share their syncs, few enough that the
/// first of them is confirmed without a long wait.
const COMMIT_BATCH: usize = 256;
/// How long renamed files wait for the next batch, so that one sync makes
/// their names and the next batch's data durable, before they are synced
/// on their own.
const SYNC_MERGE: Duration = Duration::from_millis(2);

/// Flag in [`TransferOptions::flags`]: the sources are one file or one
/// directory; if `dest` is not an existing directory, a lone file (a path
/// with no `/`) is written as `dest` itself, as `cp a b` does.
pub const DEST_MAY_BE_FILE: u32 = 16;

/// What the receiver committed.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecvSummary {
    pub files: u64,
    pub bytes: u64,
    pub set: SetDigest,
}

/// Sends `Ping` on a shared control writer every `every` until dropped, so
/// the peer's idle timeout does not fire during long quiet stretches.
pub struct Pinger {
    stop: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

impl Pinger {
    pub fn start(ctl: Arc<Mutex<FrameWriter>>, every: Duration) -> Pinger {
        let stop = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let s = stop.clone();
        std::thread::spawn(move || {
            let (lock, cv) = &*s;
            let mut stopped = lock.lock().expect("pinger lock");
            loop {
                let (g, _) = cv.wait_timeout(stopped, every).expect("pinger lock");
                stopped = g;
                if *stopped || ctl.lock().expect("control lock").send(Msg::Ping).is_err() {
                    return;
                }
            }
        });
        Pinger { stop }
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        *self.stop.0.lock().expect("pinger lock") = true;
        self.stop.1.notify_all();
    }
}

/// How often an endpoint pings its peer, given its own idle timeout. The
/// peer's idle timeout is its own setting (`dmover serve --idle-timeout`)
/// and may be much shorter, so pings go at least every second: a quiet
/// control connection must never look idle while data flows.
pub fn ping_interval(idle: Duration) -> Duration {
    (idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

struct RecvFile {
    meta: FileMeta,
    final_path: PathBuf,
    temp_path: PathBuf,
    journal_path: Option<PathBuf>,
    have: Vec<bool>,
    sums: Vec<Sum>,
    missing: u64,
    /// Blocks taken from a journal of an earlier run (suspect if the digest fails).
    journaled: Vec<u64>,
    resets: u8,
    /// Blocks that arrived damaged, and how often.
    damaged: HashMap<u64, u32>,
    end: Option<Sum>,
    file: Option<Arc<dyn WriteFile>>,
    journal: Option<Journal>,
    /// Truncate the temporary file when first opened.
    fresh: bool,
    /// Its digest matched; the committer has it.
    verified: bool,
    done: bool,
}

impl RecvFile {
    /// A file of `blocks` blocks of which nothing has arrived yet.
    fn new(meta: FileMeta, blocks: u64) -> RecvFile {
        let n = blocks as usize;
        RecvFile {
            meta,
            final_path: PathBuf::new(),
            temp_path: PathBuf::new(),
            journal_path: None,
            have: vec![false; n],
            sums: vec![[0; 16]; n],
            missing: blocks,
            journaled: Vec::new(),
            resets: 0,
            damaged: HashMap::new(),
            end: None,
            file: None,
            journal: None,
            fresh: true,
            verified: false,
            done: false,
        }
    }
}

/// A file whose digest matched, to be committed.
struct Verified {
    id: u64,
    file: Arc<Mutex<RecvFile>>,
    digest: Sum,
}

struct WriteJob {
    id: u64,
    file: Arc<Mutex<RecvFile>>,
    block: u64,
    sum: Sum,
    data: Block,
}

struct Shared {
    options: TransferOptions,
    /// Verified files, for the committer; writers and the control thread send.
    commits: Sender<Verified>,
    block_size: u64,
    store: Store,
    /// The destination as the user named it (for messages).
    dest_label: String,
    dest_dir: PathBuf,
    may_be_file: bool,
    /// Settled before the session or by the first announcement; the control thread sets it.
    layout: Mutex<Option<Layout>>,
    /// Files announced and not yet done; taken by control, data and writer threads.
    files: Mutex<HashMap<u64, Arc<Mutex<RecvFile>>>>,
    /// Control connection's writing half; every thread that replies takes it.
    ctl: Arc<Mutex<FrameWriter>>,
    pool: Arc<Pool>,
    /// Blocks waiting in the writers' queues, and how many those hold at most.
    queued: AtomicUsize,
    queue_capacity: usize,
    /// Directories known to exist below the destination.
    dirs: Mutex<HashSet<PathBuf>>,
    /// Committed files; updated by whoever finalizes a file.
    totals: Mutex<RecvSummary>,
    /// The first fatal error; set by [`Shared::fail`] once the sender was told.
    fatal: Mutex<Option<Error>>,
    stop: AtomicBool,
    /// Every data connection, to close them when the session ends.
    conns: Mutex<Vec<Box<dyn Transport>>>,
    /// Payload bytes taken off the data connections (for the sender's tuner).
    received: AtomicU64,
    /// Counts this session in its server's intake while it runs.
    receiving: Receiving,
    accept: Option<NameCheck>,
}

impl Shared {
    // Each of these takes the control lock for the write alone: `fail`
    // takes it again to say why, so it must be released first (a guard
    // kept alive through `if let` deadlocked the session when a reply
    // failed on a lost connection).
    fn reply(&self, m: ToSender) {
        let sent = self.ctl.lock().expect("control lock").send(m);
        if let Err(e) = sent {
            self.fail(e);
        }
    }

    /// A reply from the control thread, which flushes when its input runs dry.
    fn queue(&self, m: ToSender) {
        let queued = self.ctl.lock().expect("control lock").queue(m);
        if let Err(e) = queued {
            self.fail(e);
        }
    }

    fn flush(&self) {
        let flushed = self.ctl.lock().expect("control lock").flush();
        if let Err(e) = flushed {
            self.fail(e);
        }
    }

    /// Ends the session: tells the sender why (best effort) and closes every connection.
    ///
    /// The fatal lock is held until the reason is on the wire: the control
    /// thread ends the session (and hangs up) as soon as it sees the fatal
    /// error, and it must not shut the connection before the reason went
    /// out, or the sender reads the end of the stream instead of the reason.
    fn fail(&self, e: Error) {
        let mut f = self.fatal.lock().expect("fatal lock");
        // A lost connection during our own shutdown is no error; and a real
        // cause (a full disk) beats a lost connection, whichever came first.
        let lost = e.kind == ErrorKind::Unreachable;
        let first = match &*f {
            None => !lost || !self.stop.load(Ordering::SeqCst),
            Some(old) => old.kind == ErrorKind::Unreachable && !lost,
        };
        self.stop.store(true, Ordering::SeqCst);
        self.conns.lock().expect("conns lock").iter().for_each(|c| c.close());
        if let Ok(mut w) = self.ctl.lock() {
            if first && !lost {
                // Say why, and leave the connection readable: closing it
                // with the sender's messages unread would reset it and could
                // destroy our message before the sender reads it.
                let _ = w.send(ToSender::Error { kind: e.kind, message: e.to_string() });
                w.close_write();
            } else {
                w.close();
            }
        }
        if first {
            *f = Some(e);
        }
    }

    fn discard(&self) -> bool {
        self.options.has(TransferOptions::DISCARD)
    }

    /// How to name `rel` (a path within the transfer) in messages: the
    /// export path at a server, the local path at a client.
    fn name(&self, rel: &str) -> String {
        if self.store.is_confined() {
            self.store.display(Path::new(&dmover_proto::path::join(&self.dest_label, rel)))
        } else {
            self.dest_dir.join(rel).display().to_string()
        }
    }
}

/// Where a transfer's files and resume state go. Settled by the first
/// announcement when the destination may be a file.
struct Layout {
    /// The destination file itself, when a lone file is written as DEST.
    dest_file: Option<PathBuf>,
    state_dir: PathBuf,
    /// Exists while this transfer is incomplete.
    marker: PathBuf,
    /// The marker existed: an earlier run of this transfer was interrupted.
    resuming: bool,
    /// This run's place in [`RUNS`], held while it receives.
    _run: Running,
}

impl Layout {
    /// Creates the state directory and marker under `parent`, once no
    /// earlier run of this transfer in this process is still writing there.
    fn settle(store: &Store, parent: &Path, dest_file: Option<PathBuf>, transfer_id: &[u8; 16]) -> std::io::Result<Layout> {
        let state_dir = parent.join(STATE_DIR);
        let marker = state_dir.join(format!("transfer-{}", hex::encode(transfer_id)));
        let run = Running::enter(store, &marker)?;
        store.make_dirs(&state_dir)?;
        let resuming = store.stat(&marker).is_ok();
        if !resuming {
            store.create(&marker)?;
        }
        Ok(Layout { dest_file, state_dir, marker, resuming, _run: run })
    }
}

/// The runs of transfers receiving in this process, by marker path; a run
/// that ends signals the condition variable. A re-run started right after
/// an interrupted one (its sender gone, its writers still emptying their
/// queues) must not write the same partial files at the same time, so it
/// waits until the earlier run has stopped writing. (Per process: several
/// servers writing one transfer into a shared file system are one run,
/// each sending its own files.)
static RUNS: (Mutex<Vec<String>>, std::sync::Condvar) = (Mutex::new(Vec::new()), std::sync::Condvar::new());

/// How long a run waits for an earlier run of the same transfer to finish
/// writing.
const RUN_WAIT: Duration = Duration::from_secs(30);

/// A run's entry in [`RUNS`] (its marker's name), removed when dropped.
struct Running(String);

impl Running {
    fn enter(store: &Store, marker: &Path) -> std::io::Result<Running> {
        let marker = store.display(marker);
        let (lock, cv) = &RUNS;
        let deadline = std::time::Instant::now() + RUN_WAIT;
        let mut runs = lock.lock().expect("runs lock");
        if runs.contains(&marker) {
            log::info!("{marker}: waiting for an earlier run of this transfer to finish writing");
        }
        while runs.contains(&marker) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                let msg = format!("an earlier run of this transfer is still writing here after {} s", RUN_WAIT.as_secs());
                return Err(std::io::Error::new(std::io::ErrorKind::WouldBlock, msg));
            }
            runs = cv.wait_timeout(runs, left).expect("runs lock").0;
        }
        runs.push(marker.clone());
        Ok(Running(marker))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let (lock, cv) = &RUNS;
        lock.lock().expect("runs lock").retain(|p| *p != self.0);
        cv.notify_all();
    }
}

/// A receiving end whose destination has been checked, ready to [`run`](Prepared::run).
pub struct Prepared {
    cfg: RecvConfig,
    dest_dir: PathBuf,
    /// The destination is not a directory (yet) and may receive a lone file.
    may_be_file: bool,
    layout: Option<Layout>,
}

/// Checks and prepares the destination, so that problems (a read-only or
/// missing directory, a path outside the export) are reported before a
/// session starts.
pub fn prepare(cfg: RecvConfig) -> Result<Prepared> {
    let block_size = cfg.options.block_size as u64;
    if block_size == 0 || block_size > dmover_proto::frame::MAX_BLOCK as u64 {
        return Err(Error::new(ErrorKind::Usage, "", format!("block size {block_size} is out of range")));
    }
    crate::storage::check_path(cfg.store.as_ref(), &cfg.dest)?;
    let dest_dir = PathBuf::from(&cfg.dest);
    let label = cfg.store.display(&dest_dir);
    let may_be_file = cfg.options.has(DEST_MAY_BE_FILE) && !cfg.store.stat_followed(&dest_dir).is_ok_and(|s| s.is_dir());
    let mut layout = None;
    if !cfg.options.has(TransferOptions::DISCARD) {
        if may_be_file {
            // Whether DEST is the file or its directory is settled by the first file.
            let parent = dest_dir.parent().map(Path::to_path_buf).unwrap_or_default();
            cfg.store.make_dirs(&parent).map_err(|e| Error::io(&label, &e))?;
        } else {
            cfg.store.make_dirs(&dest_dir).map_err(|e| Error::io(&label, &e))?;
            layout = Some(Layout::settle(&cfg.store, &dest_dir, None, &cfg.options.transfer_id).map_err(|e| Error::io(&label, &e))?);
        }
    }
    Ok(Prepared { cfg, dest_dir, may_be_file, layout })
}

/// Receives one transfer. `control` is the control connection; data
/// connections arrive on `streams`. Returns when the sender finishes (or on
/// a fatal error); partial files stay journaled for a later resume.
pub fn receive(control: Box<dyn Transport>, streams: Receiver<Box<dyn Transport>>, cfg: RecvConfig) -> Result<RecvSummary> {
    prepare(cfg)?.run(control, streams)
}

impl Prepared {
    pub fn run(self, control: Box<dyn Transport>, streams: Receiver<Box<dyn Transport>>) -> Result<RecvSummary> {
        let Prepared { cfg, dest_dir, may_be_file, layout } = self;
        let opts = cfg.options;
        let block_size = opts.block_size as u64;
        control.set_read_timeout(Some(cfg.idle_timeout)).map_err(|e| Error::network(control.peer(), &e))?;
        let ctl = Arc::new(Mutex::new(FrameWriter::new(control.split().map_err(|e| Error::network(control.peer(), &e))?)));
        let (commits, verified) = crossbeam_channel::unbounded::<Verified>();
        let sh = Arc::new(Shared {
            options: opts,
            commits,
            block_size,
            store: cfg.store,
            dest_label: cfg.dest.clone(),
            dest_dir,
            may_be_file,
            layout: Mutex::new(layout),
            files: Mutex::new(HashMap::new()),
            ctl: ctl.clone(),
            pool: Pool::new(cfg.staging, block_size as usize, 4),
            queued: AtomicUsize::new(0),
            queue_capacity: WRITE_QUEUE * cfg.writers.max(1),
            dirs: Mutex::new(HashSet::new()),
            totals: Mutex::new(RecvSummary::default()),
            fatal: Mutex::new(None),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            received: AtomicU64::new(0),
            receiving: Receiving::new(cfg.intake),
            accept: cfg.accept,
        });
        let _pinger = Pinger::start(ctl, ping_interval(cfg.idle_timeout));
        // One queue per writer, and a file's blocks always go to the same
        // writer: writers to one file would only contend for its inode lock.
        let mut wtx = Vec::new();
        let mut threads = Vec::new();
        for _ in 0..cfg.writers.max(1) {
            let (tx, rx) = crossbeam_channel::bounded::<WriteJob>(WRITE_QUEUE);
            wtx.push(tx);
            let sh = sh.clone();
            threads.push(std::thread::spawn(move || writer(&sh, rx)));
        }
        {
            let sh = sh.clone();
            threads.push(std::thread::spawn(move || committer(&sh, &verified)));
        }
        let wtx: Arc<[Sender<WriteJob>]> = wtx.into();
        {
            let (sh, wtx) = (sh.clone(), wtx.clone());
            threads.push(std::thread::spawn(move || loop {
                let conn = match streams.recv_timeout(POLL) {
                    Ok(c) => c,
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) if !sh.stop.load(Ordering::SeqCst) => continue,
                    Err(_) => return,
                };
                {
                    let socket = SocketOptions { buffer: opts.tcp_buffer, ..SocketOptions::default() };
                    if let Err(e) = conn.set_options(&socket) {
                        log::warn!("{}: socket options: {e}", conn.peer());
                    }
                    match conn.split() {
                        Ok(c) => sh.conns.lock().expect("conns lock").push(c),
                        Err(e) => sh.fail(Error::network(conn.peer(), &e)),
                    }
                    let (sh, wtx) = (sh.clone(), wtx.clone());
                    std::thread::spawn(move || data_stream(&sh, conn, wtx));
                }
            }));
        }
        drop(wtx);
        let ctl_handle = control.split().map_err(|e| Error::network(control.peer(), &e))?;
        let mut reader = FrameReader::new(control);
        let result = control_loop(&sh, &mut reader);
        if result.as_ref().is_err_and(|e| e.kind != ErrorKind::Unreachable) {
            crate::transport::linger(ctl_handle.as_ref());
        }
        sh.stop.store(true, Ordering::SeqCst);
        sh.conns.lock().expect("conns lock").iter().for_each(|c| c.close());
        sh.pool.close();
        drop(reader);
        // Writers finish what is queued, so completed blocks reach the journal.
        sh.files.lock().expect("files lock").clear();
        for t in threads {
            let _ = t.join();
        }
        // Nothing more is written: let the next run of this transfer in.
        drop(sh.layout.lock().expect("layout lock").take());
        let fatal = sh.fatal.lock().expect("fatal lock").take();
        match (result, fatal) {
            (Ok(s), None) => Ok(s),
            (Err(e), Some(f)) if e.kind == ErrorKind::Unreachable => Err(f),
            (Err(e), _) | (Ok(_), Some(e)) => Err(e),
        }
    }
}

fn control_loop(sh: &Arc<Shared>, r: &mut FrameReader) -> Result<RecvSummary> {
    loop {
        // Replies go out together once the announcements received so far are answered.
        if r.buffered() == 0 {
            sh.flush();
        }
        let m = match r.read::<ToReceiver>() {
            Ok(Incoming::Msg(m)) => m,
            Ok(Incoming::Data(_)) => return Err(Error::protocol(r.peer(), "data frame on the control connection")),
            Err(e) => return Err(e),
        };
        match m {
            ToReceiver::Announce { id, meta, digest } => announce(sh, id, meta, digest),
            ToReceiver::FileEnd { id, digest } => {
                let f = sh.files.lock().expect("files lock").get(&id).cloned();
                if let Some(f) = f {
                    let mut g = f.lock().expect("file lock");
                    g.end = Some(digest);
                    if g.missing == 0 {
                        finalize(sh, id, &f, &mut g);
                    }
                }
            }
            ToReceiver::Abort { id, .. } => {
                // Take the file out before locking it: the lock order is file, then files.
                let f = sh.files.lock().expect("files lock").remove(&id);
                if let Some(f) = f {
                    let mut g = f.lock().expect("file lock");
                    g.done = true;
                    remove_partial(sh, &g);
                }
            }
            ToReceiver::Finish { .. } => {
                // A sender that lost its data connections to our failure
                // may still say it has finished: the transfer is not
                // complete, and its resume state stays.
                if let Some(e) = sh.fatal.lock().expect("fatal lock").take() {
                    return Err(e);
                }
                sh.stop.store(true, Ordering::SeqCst);
                if let Some(l) = sh.layout.lock().expect("layout lock").as_ref() {
                    let _ = sh.store.remove(&l.marker);
                    let _ = sh.store.remove_dir(&l.state_dir);
                }
                let t = *sh.totals.lock().expect("totals lock");
                sh.ctl.lock().expect("control lock").send(ToSender::Finished { files: t.files, bytes: t.bytes, set_digest: t.set.0 })?;
                return Ok(t);
            }
            ToReceiver::Ping {} => {}
            ToReceiver::Echo { stamp, .. } => {
                let intake = &sh.receiving.0;
                sh.queue(ToSender::Echo {
                    stamp,
                    received: sh.received.load(Ordering::Relaxed),
                    staged: (sh.queued.load(Ordering::Relaxed) * 100 / sh.queue_capacity).min(100) as u8,
                    server_received: intake.received.load(Ordering::Relaxed),
                    transfers: intake.transfers.load(Ordering::Relaxed),
                });
            }
            ToReceiver::Error { kind, message } => return Err(Error::new(kind, r.peer(), message)),
        }
        if let Some(e) = sh.fatal.lock().expect("fatal lock").take() {
            return Err(e);
        }
    }
}

fn temp_name(final_path: &Path) -> PathBuf {
    let name = final_path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    final_path.with_file_name(format!(".{name}{PART_SUFFIX}"))
}

/// Coalesces the blocks not in `have` into ranges.
fn missing_ranges(have: &[bool]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (i, h) in have.iter().enumerate() {
        let i = i as u64;
        if !h {
            match out.last_mut() {
                Some((_, e)) if *e == i => *e += 1,
                _ => out.push((i, i + 1)),
            }
        }
    }
    out
}

fn announce(sh: &Arc<Shared>, id: u64, meta: FileMeta, digest: Option<Sum>) {
    let fail = |subject: String, e: Error| {
        if e.kind == ErrorKind::Refused {
            log::warn!("refused {subject}: {}", e.message);
        }
        sh.queue(ToSender::Failed { id, kind: e.kind, subject, message: e.message })
    };
    if let Err(e) = dmover_proto::path::check_relative(&meta.path) {
        return fail(meta.path.clone(), Error::new(ErrorKind::Refused, "", format!("path refused: {e}")));
    }
    if let Some(Err(e)) = sh.accept.as_ref().map(|accept| accept(&meta.path)) {
        return fail(meta.path.escape_debug().to_string(), Error::new(ErrorKind::Refused, "", e));
    }
    let blocks = match dmover_proto::frame::file_blocks(meta.size, sh.block_size) {
        Ok(b) => b,
        Err(e) => return fail(sh.name(&meta.path), Error::new(ErrorKind::Refused, "", e)),
    };
    if sh.discard() {
        return plan(sh, id, RecvFile::new(meta, blocks));
    }
    let lone = !meta.path.contains('/');
    let (dest_file, state_dir, resuming) = {
        let mut l = sh.layout.lock().expect("layout lock");
        if l.is_none() {
            let (parent, dest_file) = if sh.may_be_file && lone {
                (sh.dest_dir.parent().map(Path::to_path_buf).unwrap_or_default(), Some(sh.dest_dir.clone()))
            } else {
                (sh.dest_dir.clone(), None)
            };
            match Layout::settle(&sh.store, &parent, dest_file, &sh.options.transfer_id) {
                Ok(x) => *l = Some(x),
                // Nothing can be received here: end the transfer with the reason.
                Err(e) => return sh.fail(Error::io(sh.name(""), &e)),
            }
        }
        let l = l.as_ref().expect("settled above");
        (l.dest_file.clone(), l.state_dir.clone(), l.resuming)
    };
    let final_path = match (&dest_file, lone) {
        (Some(p), true) => p.clone(),
        _ => match prepare_parent(sh, &meta.path) {
            Ok(p) => p,
            Err(e) => return fail(sh.name(&meta.path), e),
        },
    };
    let look = sh.options.has(TransferOptions::SYNC) || resuming;
    if meta.is_dir() {
        return make_dir(sh, id, &meta, &final_path, look);
    }
    // Already there?
    if look {
        if let Ok(m) = sh.store.stat(&final_path) {
            let same = m.is_file()
                && m.size == meta.size
                && if let (Some(d), true) = (digest, sh.options.has(TransferOptions::CHECKSUM)) {
                    digest_of(sh.store.as_ref(), &final_path, sh.block_size).is_ok_and(|x| x == d)
                } else {
                    m.mtime == (meta.mtime_s, meta.mtime_ns)
                };
            if same {
                // A partial file an interrupted later run left for it is stale.
                let _ = sh.store.remove(&temp_name(&final_path));
                let _ = sh.store.remove(&journal::path_for(&state_dir, &meta.path));
                return already_there(sh, id, &meta);
            }
        }
    }
    let mut f = RecvFile::new(meta, blocks);
    f.temp_path = temp_name(&final_path);
    f.final_path = final_path;
    if blocks > 1 {
        let jp = journal::path_for(&state_dir, &f.meta.path);
        if is_own_partial(sh, &f.temp_path) {
            if let Some(recs) = journal::load(sh.store.as_ref(), &jp, &f.meta, sh.block_size as u32, blocks) {
                for (b, s) in recs {
                    if !f.have[b as usize] {
                        f.have[b as usize] = true;
                        f.sums[b as usize] = s;
                        f.journaled.push(b);
                        f.missing -= 1;
                    }
                }
                f.fresh = false;
                f.journal = Journal::append(sh.store.as_ref(), &jp).ok();
                log::debug!("{}: resumed, {} blocks missing", f.meta.path, f.missing);
            }
        }
        f.journal_path = Some(jp);
    }
    plan(sh, id, f);
}

/// Whether `temp` is a partial file this end could have written: a regular
/// file with no other name. Anything else (a symlink or a hard link planted
/// there) is not resumed but replaced, so nothing is written through it.
fn is_own_partial(sh: &Shared, temp: &Path) -> bool {
    sh.store.stat(temp).is_ok_and(|m| m.is_file() && m.nlink == 1)
}

/// Registers an announced file and asks for the blocks it still lacks.
fn plan(sh: &Arc<Shared>, id: u64, f: RecvFile) {
    let ranges = missing_ranges(&f.have);
    sh.files.lock().expect("files lock").insert(id, Arc::new(Mutex::new(f)));
    sh.queue(ToSender::Plan { id, skip: false, ranges });
}

/// Resolves `rel`'s final path and makes its parent directory exist, with
/// no symlink on the way (in an export).
///
/// Known directories are remembered only to save making them again: every
/// later operation resolves its path beneath the export afresh, so a
/// directory swapped for a symlink since then is refused, never followed.
fn prepare_parent(sh: &Shared, rel: &str) -> Result<PathBuf> {
    let final_path = sh.dest_dir.join(rel);
    let parent = final_path.parent().expect("a joined path has a parent").to_path_buf();
    if parent != sh.dest_dir && !sh.dirs.lock().expect("dirs lock").contains(&parent) {
        sh.store.make_dirs(&parent).map_err(|e| Error::io(sh.name(rel), &e))?;
        sh.dirs.lock().expect("dirs lock").insert(parent);
    }
    Ok(final_path)
}

fn data_stream(sh: &Arc<Shared>, conn: Box<dyn Transport>, wtx: Arc<[Sender<WriteJob>]>) {
    let mut r = FrameReader::new(conn);
    loop {
        let h = match r.read::<OnData>() {
            Ok(Incoming::Data(h)) => h,
            Ok(Incoming::Msg(OnData::Ping {})) => continue,
            Ok(Incoming::Msg(OnData::StreamEnd {})) => return,
            Err(e) => {
                if !sh.stop.load(Ordering::SeqCst) {
                    sh.fail(e);
                }
                return;
            }
        };
        if h.len as u64 > sh.block_size || h.offset % sh.block_size != 0 {
            return sh.fail(Error::protocol(r.peer(), format!("bad block: offset {} length {}", h.offset, h.len)));
        }
        let Some(mut data) = sh.pool.take(h.len as usize) else { return };
        let sum = match r.read_block(&mut data, &[&sh.received, &sh.receiving.0.received]) {
            Ok(sum) => sum,
            Err(e) => {
                if !sh.stop.load(Ordering::SeqCst) {
                    sh.fail(e);
                }
                return;
            }
        };
        let Some(file) = sh.files.lock().expect("files lock").get(&h.file).cloned() else {
            continue; // aborted or failed meanwhile
        };
        let block = h.offset / sh.block_size;
        {
            let g = file.lock().expect("file lock");
            let expect = g.meta.size.saturating_sub(h.offset).min(sh.block_size);
            if block as usize >= g.have.len() || h.len as u64 != expect {
                drop(g);
                return sh.fail(Error::protocol(r.peer(), format!("block {block} of file {} has the wrong length", h.file)));
            }
        }
        if sum != h.sum {
            let mut g = file.lock().expect("file lock");
            if g.done {
                continue;
            }
            let n = g.damaged.entry(block).or_insert(0);
            *n += 1;
            if *n >= MAX_DAMAGED {
                let e = Error::new(ErrorKind::Verify, "", format!("block {block} arrived damaged {MAX_DAMAGED} times"));
                file_failed(sh, h.file, &mut g, e);
                continue;
            }
            drop(g);
            log::warn!("damaged block {block} of file {} from {}; asking again", h.file, r.peer());
            sh.reply(ToSender::Nack { id: h.file, block });
            continue;
        }
        if sh.discard() {
            drop(data);
            mark_written(sh, h.file, &file, block, h.sum);
            continue;
        }
        let w = &wtx[(h.file % wtx.len() as u64) as usize];
        sh.queued.fetch_add(1, Ordering::Relaxed);
        if w.send(WriteJob { id: h.file, file, block, sum: h.sum, data }).is_err() {
            return;
        }
    }
}

fn writer(sh: &Arc<Shared>, rx: Receiver<WriteJob>) {
    for job in rx {
        sh.queued.fetch_sub(1, Ordering::Relaxed);
        let handle = {
            let mut g = job.file.lock().expect("file lock");
            if g.done {
                continue;
            }
            match open_temp(sh, &mut g) {
                Ok(f) => f,
                Err(e) => {
                    let e = Error::io("", &e);
                    file_failed(sh, job.id, &mut g, e);
                    continue;
                }
            }
        };
        let off = job.block * sh.block_size;
        let written = handle.write_all_at(&job.data, off).and_then(|()| {
            // Durable files are synced before they are confirmed: have the
            // kernel start on it now, while the rest of the data arrives.
            if sh.options.has(TransferOptions::NO_FSYNC) {
                Ok(())
            } else {
                handle.write_back(off, job.data.len() as u64)
            }
        });
        if let Err(e) = written {
            let mut g = job.file.lock().expect("file lock");
            let e = Error::io("", &e);
            file_failed(sh, job.id, &mut g, e);
            continue;
        }
        drop(job.data);
        mark_written(sh, job.id, &job.file, job.block, job.sum);
    }
}

/// The file's temporary name, open: created afresh (with a new journal)
/// for a fresh file, the partial file of an earlier run when resuming.
fn open_temp(sh: &Shared, g: &mut RecvFile) -> std::io::Result<Arc<dyn WriteFile>> {
    if let Some(f) = &g.file {
        return Ok(f.clone());
    }
    let f: Arc<dyn WriteFile> = if g.fresh {
        log::debug!("{}: new partial file", g.temp_path.display());
        sh.store.create(&g.temp_path)?.into()
    } else {
        let gone = || std::io::Error::new(std::io::ErrorKind::NotFound, "the partial file of an earlier run is gone");
        sh.store.reopen(&g.temp_path)?.ok_or_else(gone)?.into()
    };
    if g.fresh {
        if let Some(jp) = &g.journal_path {
            g.journal = Some(Journal::create(sh.store.as_ref(), jp, &g.meta, sh.block_size as u32)?);
        }
    }
    g.fresh = false;
    g.file = Some(f.clone());
    Ok(f)
}

fn mark_written(sh: &Arc<Shared>, id: u64, file: &Arc<Mutex<RecvFile>>, block: u64, sum: Sum) {
    let mut g = file.lock().expect("file lock");
    if g.done || g.have[block as usize] {
        return;
    }
    g.have[block as usize] = true;
    g.sums[block as usize] = sum;
    g.missing -= 1;
    if let Some(j) = g.journal.as_mut() {
        if let Err(e) = j.record(block, &sum) {
            log::warn!("cannot journal {}: {e}", g.meta.path);
            g.journal = None;
        }
    }
    if g.missing == 0 && g.end.is_some() {
        finalize(sh, id, file, &mut g);
    }
}

/// A file failed at this end: its partial state goes, and the sender is
/// told — or, when the disk is full, the whole transfer ends (every later
/// file would fail the same way).
fn file_failed(sh: &Arc<Shared>, id: u64, g: &mut RecvFile, e: Error) {
    g.done = true;
    g.file = None;
    remove_partial(sh, g);
    sh.files.lock().expect("files lock").remove(&id);
    let subject = sh.name(&g.meta.path);
    if e.kind == ErrorKind::NoSpace {
        return sh.fail(Error { subject, ..e });
    }
    sh.reply(ToSender::Failed { id, kind: e.kind, subject, message: e.message });
}

/// Tells the sender to skip a file (or empty directory) the destination
/// already holds, and counts it as confirmed.
fn already_there(sh: &Arc<Shared>, id: u64, meta: &FileMeta) {
    log::debug!("{}: already there", meta.path);
    let mut t = sh.totals.lock().expect("totals lock");
    t.files += 1;
    t.bytes += meta.size;
    t.set.add(&meta.path, meta.size, &[0; 16]);
    drop(t);
    sh.queue(ToSender::Plan { id, skip: true, ranges: vec![] });
}

/// Creates a directory that was empty at the source, with its mode. When
/// `look` (`--sync`, or a resumed run) and it is already there with that
/// mode, it is skipped like an unchanged file, untouched.
fn make_dir(sh: &Arc<Shared>, id: u64, meta: &FileMeta, path: &Path, look: bool) {
    let mode = dmover_proto::frame::permission_bits(meta.mode);
    if look && sh.store.stat(path).is_ok_and(|m| m.is_dir() && m.mode == mode) {
        return already_there(sh, id, meta);
    }
    if let Err(e) = sh.store.make_dir(path, mode) {
        return sh.queue(ToSender::Failed { id, kind: crate::error::classify(&e), subject: sh.name(&meta.path), message: e.to_string() });
    }
    let digest = file_digest(&[]);
    let mut t = sh.totals.lock().expect("totals lock");
    t.files += 1;
    t.set.add(&meta.path, 0, &digest);
    drop(t);
    sh.queue(ToSender::Done { id, digest });
}

fn remove_partial(sh: &Shared, g: &RecvFile) {
    if !g.temp_path.as_os_str().is_empty() {
        let _ = sh.store.remove(&g.temp_path);
    }
    if let Some(j) = &g.journal_path {
        let _ = sh.store.remove(j);
    }
}

/// Verifies a complete file and hands it to the committer.
fn finalize(sh: &Arc<Shared>, id: u64, file: &Arc<Mutex<RecvFile>>, g: &mut RecvFile) {
    if g.done || g.verified {
        return;
    }
    let digest = file_digest(&g.sums);
    if Some(digest) != g.end {
        if g.resets == 0 && !g.journaled.is_empty() {
            // Blocks kept from an earlier run disagree with the source: fetch them again.
            log::warn!("{}: resumed blocks do not match the source; fetching them again", g.meta.path);
            g.resets += 1;
            let suspects = std::mem::take(&mut g.journaled);
            for b in &suspects {
                g.have[*b as usize] = false;
            }
            g.missing += suspects.len() as u64;
            if let Some(jp) = &g.journal_path {
                g.journal = None;
                if let Ok(mut j) = Journal::create(sh.store.as_ref(), jp, &g.meta, sh.block_size as u32) {
                    for (b, s) in g.have.iter().zip(&g.sums).enumerate().filter(|(_, (h, _))| **h).map(|(b, (_, s))| (b, *s)) {
                        let _ = j.record(b as u64, &s);
                    }
                    g.journal = Some(j);
                }
            }
            for b in suspects {
                sh.reply(ToSender::Nack { id, block: b });
            }
            return;
        }
        return file_failed(sh, id, g, Error::new(ErrorKind::Verify, "", "checksum mismatch"));
    }
    if sh.discard() {
        confirm(sh, id, g, digest);
        return sh.flush();
    }
    g.verified = true;
    // The committer lives as long as the session, so the channel is open.
    let _ = sh.commits.send(Verified { id, file: file.clone(), digest });
}

/// Counts a committed file and confirms it to the sender.
fn confirm(sh: &Shared, id: u64, g: &mut RecvFile, digest: Sum) {
    g.done = true;
    sh.files.lock().expect("files lock").remove(&id);
    let mut t = sh.totals.lock().expect("totals lock");
    t.files += 1;
    t.bytes += g.meta.size;
    t.set.add(&g.meta.path, g.meta.size, &digest);
    drop(t);
    sh.queue(ToSender::Done { id, digest });
}

/// Commits verified files in batches until the session stops (and what was
/// verified before it stopped), as a pipeline with one file-system sync per
/// batch: a batch's files get their mode and mtime, then the sync makes
/// their data durable (and the names of the batch renamed before it, which
/// are confirmed now), then they are renamed into place and wait for the
/// next sync. A batch waits for the next one at most [`SYNC_MERGE`]; then
/// a sync of their names follows.
fn committer(sh: &Arc<Shared>, verified: &Receiver<Verified>) {
    // Without syncs there is nothing to merge: confirm at once.
    let merge = if sh.options.has(TransferOptions::NO_FSYNC) { Duration::ZERO } else { SYNC_MERGE };
    let mut renamed: Vec<Verified> = Vec::new();
    loop {
        let first = if renamed.is_empty() {
            match verified.recv_timeout(POLL) {
                Ok(v) => Some(v),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) if !sh.stop.load(Ordering::SeqCst) => continue,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) if !verified.is_empty() => continue,
                Err(_) => return,
            }
        } else {
            verified.recv_timeout(merge).ok()
        };
        let batch: Vec<Verified> = first.into_iter().chain(verified.try_iter()).take(COMMIT_BATCH).collect();
        let ready = prepare_commit(sh, batch);
        if let Err(e) = sync(sh) {
            log::warn!("{}: cannot make the received files durable: {e}", sh.name(""));
            for v in renamed.drain(..).chain(ready.into_iter().map(|(v, _)| v)) {
                let mut g = v.file.lock().expect("file lock");
                file_failed(sh, v.id, &mut g, Error::io("", &e));
            }
            continue;
        }
        for v in renamed.drain(..) {
            let mut g = v.file.lock().expect("file lock");
            if g.done {
                continue; // aborted by the sender meanwhile: it counts the file as failed
            }
            log::debug!("{}: committed", g.final_path.display());
            if let Some(j) = &g.journal_path {
                let _ = sh.store.remove(j);
            }
            confirm(sh, v.id, &mut g, v.digest);
        }
        sh.flush();
        renamed = rename_into_place(sh, ready);
    }
}

/// Sets mode and mtime on each file of a batch (opening, first, a file
/// none of whose blocks were written in this run: an empty file, or one
/// resumed with every block already on disk; afresh only if it is fresh,
/// so a resumed file keeps its blocks). Returns the files ready for their
/// data to be made durable.
fn prepare_commit(sh: &Arc<Shared>, batch: Vec<Verified>) -> Vec<(Verified, Arc<dyn WriteFile>)> {
    let mut ready = Vec::with_capacity(batch.len());
    for v in batch {
        let mut g = v.file.lock().expect("file lock");
        if g.done {
            continue;
        }
        let attrs = Attrs { mode: dmover_proto::frame::permission_bits(g.meta.mode), mtime: Some((g.meta.mtime_s, g.meta.mtime_ns)) };
        match open_temp(sh, &mut g).and_then(|f| f.set_attrs(&attrs).map(|()| f)) {
            Ok(f) => {
                drop(g);
                ready.push((v, f));
            }
            Err(e) => file_failed(sh, v.id, &mut g, Error::io("", &e)),
        }
    }
    ready
}

/// Makes everything written so far durable, unless the transfer asked not to.
fn sync(sh: &Shared) -> std::io::Result<()> {
    if sh.options.has(TransferOptions::NO_FSYNC) {
        return Ok(());
    }
    // The state directory is beside the files (the destination directory,
    // or the directory of a lone destination file).
    let state_dir = sh.layout.lock().expect("layout lock").as_ref().map(|l| l.state_dir.clone());
    sh.store.sync(state_dir.as_deref().unwrap_or(&sh.dest_dir))
}

/// Renames each file of a batch into place; returns those renamed.
fn rename_into_place(sh: &Arc<Shared>, ready: Vec<(Verified, Arc<dyn WriteFile>)>) -> Vec<Verified> {
    let mut renamed = Vec::with_capacity(ready.len());
    for (v, f) in ready {
        let mut g = v.file.lock().expect("file lock");
        g.file = None;
        g.journal = None;
        match sh.store.commit(f.as_ref(), &g.temp_path, &g.final_path, None) {
            Ok(()) => {
                drop(g);
                renamed.push(v);
            }
            Err(e) => file_failed(sh, v.id, &mut g, Error::io("", &e)),
        }
    }
    renamed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_coalesce() {
        assert_eq!(missing_ranges(&[true, false, false, true, false]), vec![(1, 3), (4, 5)]);
        assert_eq!(missing_ranges(&[]), vec![]);
    }
}
