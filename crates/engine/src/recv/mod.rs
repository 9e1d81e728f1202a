//! The receiving end of a transfer.
//!
//! One control connection carries announcements in and plans and
//! confirmations out; any number of data connections (they may attach at
//! any time) carry blocks in. The protocol's rules and the state of every
//! file in flight live in a sans-I/O session
//! (`dmover_proto::session::receive`); this module runs it:
//!
//! * [`driver`]: one owner thread holds the session and is fed by one
//!   event channel. It looks at the destination for each announced file —
//!   nothing to ask for if it is already there (the quick check, SYNC,
//!   or a resumed transfer; never in a destination that held nothing when
//!   the transfer began), the missing blocks of a journaled partial file, or all —
//!   and carries out the session's decisions: replies, files opened for
//!   writing, re-journaled, committed or removed.
//! * [`workers`]: the I/O, which reports back to the owner as events. One
//!   thread per data connection reads a block into a staging block, admits
//!   it through its file's gate, checks its checksum (a damaged block is
//!   reported, and asked for again) and queues it for a writer; writer
//!   threads write blocks at their offsets into the file's temporary name
//!   and journal them; the committer takes verified files in batches: it
//!   sets each one's mode and mtime, makes their data durable, renames them
//!   into place, makes the names durable, and only then reports them
//!   committed (and the owner confirms them, `Done`). A batch's files and
//!   the directories the batch before it was renamed into are synced all at
//!   once, each on its own (not the whole file system, which would wait for
//!   other programs' writes), so the file system commits them together;
//!   a batch of many empty files instead takes one sync of each file
//!   system they are on (`--no-fsync` skips the syncs). Into an object
//!   store, whose commit is a request durable once answered, the committer
//!   instead keeps that store's number of commits in flight, each file
//!   committed as soon as it is verified. The writers have
//!   the kernel start writing each block back as soon as it is written,
//!   so a sync finds little left to do.
//!
//! In a download the receiving end (the client) dials the data
//! connections: when the sender's tuner wants another stream it says
//! `Dial`, and the owner dials one more (up to [`MAX_DIALED_STREAMS`]).
//!
//! Blocks never pass through the owner: it hears of each one only once it
//! is written. Staging blocks come from one pool, so a slow disk stalls
//! the network readers (and through TCP, the sender) instead of growing
//! memory. Each writer's queue holds at most [`WRITE_QUEUE`] blocks: when
//! the writers fall behind, the readers wait rather than fill the whole
//! pool, so the few blocks in use are reused while still in the CPU's
//! cache. How full those queues are is what the sender's tuner hears as
//! "staged".

mod driver;
mod keep;
mod workers;

use crate::error::{Error, Result};
use crate::source::STATE_DIR;
use crate::storage::Store;
use crate::transport::{Connector, Transport};
use crossbeam_channel::Receiver;
use dmover_proto::frame::{TransferFlags, TransferOptions};
use dmover_proto::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

pub use dmover_proto::session::receive::{NameCheck, MAX_DAMAGED};

/// What one server takes in across all of its receiving sessions, reported
/// to each sender's tuner so that transfers sharing the server can balance
/// (and to the server's metrics).
#[derive(Debug, Default)]
pub struct Intake {
    /// Payload bytes taken off data connections, all sessions.
    received: AtomicU64,
    /// Sessions receiving now.
    transfers: AtomicU32,
    /// The sessions receiving now, for what they hold (dead ones are
    /// pruned as sessions start).
    live: Mutex<Vec<Weak<workers::Shared>>>,
}

impl Intake {
    /// Payload bytes taken off data connections so far, all sessions.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    fn live(&self) -> Vec<Arc<workers::Shared>> {
        self.live.lock().expect("intake lock").iter().filter_map(Weak::upgrade).collect()
    }

    /// Staging memory the receiving sessions hold now, in bytes.
    pub fn staged_bytes(&self) -> u64 {
        self.live().iter().map(|s| s.pool.in_use_bytes()).sum()
    }

    /// Data connections the receiving sessions read now.
    pub fn streams(&self) -> u64 {
        self.live().iter().map(|s| s.streams.load(Ordering::Relaxed) as u64).sum()
    }

    fn watch(&self, session: &Arc<workers::Shared>) {
        let mut live = self.live.lock().expect("intake lock");
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(session));
    }
}

/// Files that failed on the receiving end's storage, by class (a path
/// refused as outside the destination is not a storage error).
#[derive(Debug, Default)]
pub struct WriteErrors {
    permission: AtomicU64,
    no_space: AtomicU64,
    other: AtomicU64,
}

impl WriteErrors {
    fn add(&self, kind: ErrorKind) {
        let counter = match kind {
            ErrorKind::Refused | ErrorKind::Usage | ErrorKind::Verify | ErrorKind::SourceChanged => return,
            ErrorKind::Permission => &self.permission,
            ErrorKind::NoSpace => &self.no_space,
            _ => &self.other,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts by class: `permission`, `no_space` and `io` (any other
    /// failure of the storage).
    pub fn counts(&self) -> [(&'static str, u64); 3] {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [("permission", get(&self.permission)), ("no_space", get(&self.no_space)), ("io", get(&self.other))]
    }
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
    /// The destination directory (or file, see [`TransferFlags::DEST_MAY_BE_FILE`]) in `store`.
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
    /// Where files that fail on `store` are counted.
    pub write_errors: Arc<WriteErrors>,
    /// Which announced names to take (None: any that stays below `dest`).
    pub accept: Option<NameCheck>,
    /// The sender may set owners and groups other than this process's,
    /// and extended attributes outside `user.*` (a local copy; a server's
    /// export whose operator allows it): see [`keep`].
    pub privileged: bool,
}

/// Blocks waiting for one writer, at most.
pub const WRITE_QUEUE: usize = 4;

/// What the receiver committed.
pub use dmover_proto::session::receive::Totals as RecvSummary;

/// Where a transfer's files and resume state go. Settled by the first
/// announcement when the destination may be a file. The state directory and
/// its marker are in the destination's state store.
struct Layout {
    /// The destination file itself, when a lone file is written as DEST.
    dest_file: Option<PathBuf>,
    state_dir: PathBuf,
    /// Exists while this transfer is incomplete.
    marker: PathBuf,
    /// The marker existed: an earlier run of this transfer was interrupted.
    resuming: bool,
    /// The destination directory held nothing when this run began, so no
    /// name announced can be there already (a lone file written as DEST
    /// is always looked for).
    fresh: bool,
    /// This run's place in [`RUNS`], held while it receives.
    _run: Running,
}

impl Layout {
    /// Creates the state directory and marker under `parent`, once no
    /// earlier run of this transfer in this process is still writing there.
    /// An error names the state directory (a symlink planted there is
    /// refused, and the user must see which name is in the way).
    fn settle(store: &Store, parent: &Path, dest_file: Option<PathBuf>, transfer_id: &[u8; 16]) -> Result<Layout> {
        if store.stat_followed(parent).is_ok_and(|s| !s.is_dir()) {
            return Err(not_a_directory(store.display(parent)));
        }
        let state = state_store(store);
        let state_dir = parent.join(STATE_DIR);
        let marker = state_dir.join(format!("transfer-{}", hex::encode(transfer_id)));
        let err = |e: std::io::Error| Error::io(state.display(&state_dir), &e);
        let run = Running::enter(&state, &marker).map_err(err)?;
        state.make_dirs(&state_dir).map_err(err)?;
        let resuming = state.stat(&marker).is_ok();
        if !resuming {
            state.create(&marker).map_err(err)?;
        }
        // Asked once, so that a first copy pays no look per file (a request
        // each in an object store); where it cannot be told, files are looked for.
        let fresh = dest_file.is_none() && store.is_empty_dir(parent).unwrap_or(false);
        Ok(Layout { dest_file, state_dir, marker, resuming, fresh, _run: run })
    }

    /// Whether the destination is to be looked at for an announced name
    /// already there: when the transfer skips what it finds (SYNC, the
    /// default quick check) in a destination that held something, and
    /// when it resumes an earlier run.
    fn looks(&self, flags: TransferFlags) -> bool {
        (flags.contains(TransferFlags::SYNC) && !self.fresh) || self.resuming
    }
}

/// The refusal of a destination directory that is a file.
fn not_a_directory(label: String) -> Error {
    Error::new(ErrorKind::Usage, label, "the destination is a file, not a directory")
        .advised("name a directory (one that is missing is made), or, to replace the file, a single source file")
}

/// Where the resume state of transfers into `store` goes (see
/// [`Storage::state_store`](crate::storage::Storage::state_store)); the
/// state directory has the same path in it either way.
fn state_store(store: &Store) -> Store {
    store.state_store().unwrap_or_else(|| store.clone())
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

/// Data connections a receiving end that dials them holds (and dials) at
/// once, at most, however many its sender asks for: as many as a tuner opens.
pub const MAX_DIALED_STREAMS: usize = 64;

/// A receiving end whose destination has been checked, ready to [`run`](Prepared::run).
pub struct Prepared {
    cfg: RecvConfig,
    /// How to dial a data connection the sender asks for (None: it may not ask).
    dial: Option<Connector>,
    dest_dir: PathBuf,
    /// The destination is not a directory (yet) and may receive a lone file.
    may_be_file: bool,
    layout: Option<Layout>,
    /// What received files keep besides content.
    keep: keep::Keep,
    /// What preparing made, undone if the session never runs.
    made: Made,
}

/// What [`prepare`] made that a transfer which never starts (its server
/// cannot be reached, refuses the token) must not leave behind: the
/// destination directories that were not there, and the transfer's marker
/// and state directory unless an earlier run left them. Undone when
/// dropped, unless the receiving end ran.
#[derive(Default)]
struct Made {
    undo: Option<Undo>,
}

/// The storage directories were made in, those made (outermost first)
/// and, in the state's storage, the state directory and marker made.
struct Undo(Store, Vec<PathBuf>, Option<(Store, PathBuf, PathBuf)>);

impl Made {
    /// The directories from `dir` up that are not there, outermost first.
    fn missing(store: &Store, dir: &Path) -> Vec<PathBuf> {
        let mut missing: Vec<PathBuf> =
            dir.ancestors().filter(|d| !d.as_os_str().is_empty()).take_while(|d| store.stat(d).is_err()).map(Path::to_path_buf).collect();
        missing.reverse();
        missing
    }

    /// The receiving end runs: what was made stays.
    fn keep(&mut self) {
        self.undo = None;
    }
}

impl Drop for Made {
    fn drop(&mut self) {
        let Some(Undo(store, dirs, state)) = self.undo.take() else { return };
        if let Some((state, dir, marker)) = state {
            let _ = state.remove(&marker);
            let _ = state.remove_dir(&dir);
        }
        // Innermost first; one that holds anything (another's files) stays.
        for d in dirs.iter().rev() {
            if store.remove_dir(d).is_err() {
                break;
            }
        }
    }
}

/// Checks and prepares the destination, so that problems (a read-only or
/// missing directory, a path outside the export) are reported before a
/// session starts. A destination of the local file system is written
/// confined beneath the directory the user named ([`Storage::beneath`](crate::storage::Storage::beneath)):
/// DEST, or its parent where DEST may be the file itself.
pub fn prepare(mut cfg: RecvConfig) -> Result<Prepared> {
    let block_size = cfg.options.block_size as u64;
    if block_size == 0 || block_size > dmover_proto::frame::MAX_BLOCK as u64 {
        return Err(Error::new(ErrorKind::Usage, "", format!("block size {block_size} is out of range")));
    }
    let mut dest_dir = crate::storage::checked_path(cfg.store.as_ref(), &cfg.dest)?;
    let label = cfg.store.display(&dest_dir);
    // What the transfer asks to keep, checked before anything is made.
    let keep = keep::Keep::new(cfg.options.flags, cfg.store.features().keeps, cfg.privileged, &label)?;
    let may_be_file = cfg.options.flags.contains(TransferFlags::DEST_MAY_BE_FILE)
        && dest_dir.file_name().is_some()
        && !cfg.store.stat_followed(&dest_dir).is_ok_and(|s| s.is_dir());
    let mut layout = None;
    let mut undo = Made::default();
    if !cfg.options.flags.contains(TransferFlags::DISCARD) {
        // Whether DEST is the file or its directory is settled by the first
        // file: until then only its parent is made.
        let (root, name) = match (may_be_file, dest_dir.file_name()) {
            (true, Some(name)) => (dest_dir.parent().map(Path::to_path_buf).unwrap_or_default(), PathBuf::from(name)),
            _ => (dest_dir.clone(), PathBuf::new()),
        };
        let there = cfg.store.stat_followed(&root);
        if there.as_ref().is_ok_and(|s| !s.is_dir()) {
            return Err(not_a_directory(label));
        }
        let made = there.is_err();
        let missing = if made { Made::missing(&cfg.store, &root) } else { Vec::new() };
        let outer = cfg.store.clone();
        cfg.store.make_dirs(&root).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTDIR) => Error::new(ErrorKind::Usage, &label, "a file is in the way of the destination directory")
                .advised("name a destination whose parents are directories, or remove the file in the way"),
            _ => Error::io(&label, &e),
        })?;
        if let Some(beneath) = cfg.store.beneath(&root).map_err(|e| Error::io(&label, &e))? {
            // The committer syncs directories beneath the root only: the
            // name of a root made now is made durable here.
            if let (true, false, Some(up)) = (made, cfg.options.flags.contains(TransferFlags::NO_FSYNC), root.parent()) {
                cfg.store.sync_dir(up).map_err(|e| Error::io(&label, &e))?;
            }
            cfg.store = beneath;
            cfg.dest = dmover_proto::path::from_path(&name).into_owned();
            dest_dir = name;
        }
        undo.undo = Some(Undo(outer, missing, None));
        if !may_be_file {
            let l = Layout::settle(&cfg.store, &dest_dir, None, &cfg.options.transfer_id)?;
            if let (false, Some(u)) = (l.resuming, undo.undo.as_mut()) {
                u.2 = Some((state_store(&cfg.store), l.state_dir.clone(), l.marker.clone()));
            }
            layout = Some(l);
        }
    }
    Ok(Prepared { cfg, dial: None, dest_dir, may_be_file, layout, keep, made: undo })
}

/// Receives one transfer. `control` is the control connection; data
/// connections arrive on `streams`. Returns when the sender finishes (or on
/// a fatal error); partial files stay journaled for a later resume.
pub fn receive(control: Box<dyn Transport>, streams: Receiver<Box<dyn Transport>>, cfg: RecvConfig) -> Result<RecvSummary> {
    prepare(cfg)?.run(control, streams)
}

impl Prepared {
    /// Lets the sender ask for more data connections (`Dial`, when its
    /// tuner adds a stream), which `dial` opens: a download's client.
    pub fn dialing(self, dial: Connector) -> Prepared {
        Prepared { dial: Some(dial), ..self }
    }

    pub fn run(self, control: Box<dyn Transport>, streams: Receiver<Box<dyn Transport>>) -> Result<RecvSummary> {
        driver::run(self, control, streams)
    }
}
