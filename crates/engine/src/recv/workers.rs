//! The receiving end's workers, on the per-block path: a reader per data
//! connection, the disk writers and the committer. They do the I/O and
//! report what they did to the owner thread as events; they decide
//! nothing about the protocol beyond admitting a block through its file's
//! [`Gate`](dmover_proto::session::receive::Gate).

use crate::error::{classify, Error};
use crate::halt::Halt;
use crate::journal::Journal;
use crate::pool::{Block, Pool};
use crate::storage::{write_sparse, Attrs, Digest, Store, WriteFile};
use crate::transport::Transport;
use crate::wire::{FrameReader, Incoming};
use crossbeam_channel::{Receiver, Sender};
use dmover_proto::digest::{zeros_sum, Sum};
use dmover_proto::frame::{FileMeta, TransferFlags, TransferOptions};
use dmover_proto::phase::OnData;
use dmover_proto::session::receive::{check_header, Event, Gate};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use super::Receiving;

/// How often an idle committer looks at the stop flag.
const POLL: Duration = Duration::from_millis(50);
/// Verified files the committer makes durable and renames together, at
/// most: enough that small files share their syncs, few enough that the
/// first of them is confirmed without a long wait.
const COMMIT_BATCH: usize = 256;
/// How long renamed files wait for the next batch, so that one round of
/// syncs makes their names and the next batch durable, before their names
/// are synced on their own.
const SYNC_MERGE: Duration = Duration::from_millis(2);

/// What the owner thread hears.
pub(super) enum Input {
    /// An event for the session.
    Session(Event),
    /// Events for the session, in order.
    Batch(Vec<Event>),
    /// A data connection attached.
    Stream(Box<dyn Transport>),
    /// A data connection the sender asked for was dialed (or could not be).
    Dialed(crate::Result<Box<dyn Transport>>),
    /// A data connection broke, or its peer broke a rule: the session ends.
    Broken(crate::Error),
    /// The control connection broke or ended: the session ends.
    ControlLost(crate::Error),
}

/// What the owner shares with the workers.
pub(super) struct Shared {
    pub options: TransferOptions,
    pub block_size: u64,
    pub store: Store,
    /// Where journals go: `store`, or the local storage it names.
    pub state: Store,
    pub dest_dir: PathBuf,
    /// What received files keep besides content.
    pub keep: super::keep::Keep,
    /// Files whose blocks may be written, by id: the owner adds and
    /// removes them, data connections look them up for each block.
    pub slots: RwLock<HashMap<u64, Arc<Slot>>>,
    /// The owner's event channel; every worker sends, the owner waits.
    pub events: Sender<Input>,
    /// Verified files with their digests, for the committer; the owner sends.
    pub commits: Sender<(Arc<Slot>, Sum)>,
    pub pool: Arc<Pool>,
    /// Blocks waiting in the writers' queues.
    pub queued: AtomicUsize,
    /// The session is over: workers stop reporting broken connections.
    pub stop: Halt,
    /// Payload bytes taken off the data connections (for the sender's tuner).
    pub received: AtomicU64,
    /// Data connections being read now: the owner counts each it attaches,
    /// its reading thread uncounts it when it ends.
    pub streams: AtomicUsize,
    /// Counts this session in its server's intake while it runs.
    pub receiving: Receiving,
}

impl Shared {
    fn report(&self, e: Event) {
        // The owner outlives the workers' usefulness: after it stops, what
        // they report is not needed.
        let _ = self.events.send(Input::Session(e));
    }

    fn failed(&self, id: u64, e: &std::io::Error) {
        self.report(Event::Failed { id, kind: classify(e), message: e.to_string() });
    }
}

/// Where a file goes (empty paths when nothing is kept, `--discard`).
#[derive(Default)]
pub(super) struct Paths {
    pub meta: Option<FileMeta>,
    pub temp: PathBuf,
    pub dest: PathBuf,
    pub journal: Option<PathBuf>,
    /// An earlier run of this transfer may have left a partial file
    /// under the temporary name.
    pub resuming: bool,
}

/// A file's open temporary file and journal.
pub(super) struct FileIo {
    file: Option<Arc<dyn WriteFile>>,
    journal: Option<Journal>,
    /// Create the temporary file afresh (and a new journal) when first
    /// opened; once opened (or for a resumed file), it is never created again.
    fresh: bool,
    /// The temporary file was created by this run: where no block was
    /// written, it holds nothing (a hole).
    created: bool,
    /// Removed: nothing more is written.
    closed: bool,
    /// Created under its final name (an empty file): nothing to rename.
    placed: bool,
}

impl FileIo {
    /// A file to create afresh.
    pub fn fresh() -> FileIo {
        FileIo { file: None, journal: None, fresh: true, created: false, closed: false, placed: false }
    }

    /// The partial file of an earlier run, taken up again, with its journal
    /// if it could be opened.
    pub fn resumed(file: Box<dyn WriteFile>, journal: Option<Journal>) -> FileIo {
        FileIo { file: Some(file.into()), journal, fresh: false, created: false, closed: false, placed: false }
    }
}

/// A file open for its blocks.
pub(super) struct Slot {
    pub id: u64,
    pub gate: Gate,
    pub paths: Paths,
    /// Taken by its writer for each block, by the committer, and by the
    /// owner to rewrite the journal or remove the file.
    pub io: Mutex<FileIo>,
}

impl Slot {
    /// The file's temporary name, open: created afresh (with a new journal)
    /// when first opened for a fresh file; the partial file of an earlier
    /// run when resuming (taken up again when the file was looked at).
    fn open(&self, sh: &Shared, io: &mut FileIo) -> std::io::Result<Arc<dyn WriteFile>> {
        if let Some(f) = &io.file {
            return Ok(f.clone());
        }
        if !io.fresh {
            return Err(std::io::Error::new(std::io::ErrorKind::NotFound, "the partial file is no longer open"));
        }
        log::debug!("{}: new partial file", sh.store.display(&self.paths.temp));
        let f: Arc<dyn WriteFile> = sh.store.create_for(&self.paths.temp, &self.paths.dest)?.into();
        if let (Some(jp), Some(meta)) = (&self.paths.journal, &self.paths.meta) {
            io.journal = Some(Journal::create(sh.state.as_ref(), jp, meta, sh.block_size as u32)?);
        }
        io.fresh = false;
        io.created = true;
        io.file = Some(f.clone());
        Ok(f)
    }

    /// The file to commit, with `attrs` set: an empty file never opened
    /// is created under its final name if nothing has it
    /// ([`Storage::create_empty`](crate::storage::Storage::create_empty)),
    /// saving a rename; any other file is its temporary file.
    fn finished(&self, sh: &Shared, io: &mut FileIo, attrs: &Attrs) -> std::io::Result<Arc<dyn WriteFile>> {
        let empty = self.paths.meta.as_ref().is_some_and(|m| m.size == 0);
        if empty && io.fresh && io.file.is_none() {
            if let Some(f) = sh.store.create_empty(&self.paths.dest, attrs)? {
                // A partial file an earlier run of this transfer left goes,
                // as a rename would have taken its name. A fresh run leaves
                // what it finds there (another transfer's, or planted): a
                // search for a name that is not there costs more than the
                // rename this saves.
                if self.paths.resuming {
                    sh.store.remove(&self.paths.temp)?;
                }
                let f: Arc<dyn WriteFile> = f.into();
                io.fresh = false;
                io.placed = true;
                io.file = Some(f.clone());
                return Ok(f);
            }
        }
        let f = self.open(sh, io)?;
        f.set_attrs(attrs)?;
        Ok(f)
    }

    /// Rewrites the journal to hold exactly `held`.
    pub fn rejournal(&self, sh: &Shared, held: &[(u64, Sum)]) {
        let (Some(jp), Some(meta)) = (&self.paths.journal, &self.paths.meta) else { return };
        let mut io = self.io.lock().expect("file lock");
        io.journal = None;
        if let Ok(mut j) = Journal::create(sh.state.as_ref(), jp, meta, sh.block_size as u32) {
            for (b, s) in held {
                let _ = j.record(*b, s);
            }
            io.journal = Some(j);
        }
    }

    /// Stops writing the file and removes its partial file and journal.
    pub fn remove(&self, sh: &Shared) {
        let mut io = self.io.lock().expect("file lock");
        io.closed = true;
        io.file = None;
        io.journal = None;
        if !self.paths.temp.as_os_str().is_empty() {
            let _ = sh.store.remove(&self.paths.temp);
        }
        if let Some(j) = &self.paths.journal {
            let _ = sh.state.remove(j);
        }
    }
}

/// Blocks for a writer.
pub(super) struct WriteJob {
    slot: Arc<Slot>,
    /// The first block.
    block: u64,
    bytes: Bytes,
}

/// What the blocks of a [`WriteJob`] hold.
enum Bytes {
    /// One block, with its checksum; `sparse` if it lies partly in a hole
    /// of its source, so that its pages of zeros are left holes.
    Data { data: Block, sum: Sum, sparse: bool },
    /// Zeros, this many bytes: whole blocks that lie in a hole of their
    /// source (`Hole`).
    Zeros(u64),
}

impl WriteJob {
    /// Each block with its checksum.
    fn sums(&self, block_size: u64) -> Vec<(u64, Sum)> {
        match &self.bytes {
            Bytes::Data { sum, .. } => vec![(self.block, *sum)],
            Bytes::Zeros(len) => (0..len.div_ceil(block_size))
                .map(|i| (self.block + i, zeros_sum((len - i * block_size).min(block_size) as usize)))
                .collect(),
        }
    }
}

/// The length and bitmap of a sparse block whose frame carries `wire`
/// bytes after its data header: None if the length passes `block_size`, or
/// the bitmap and the bytes that follow it disagree.
fn sparse_prefix(r: &mut FrameReader, block_size: u64, wire: u32, received: &[&AtomicU64]) -> crate::error::Result<Option<(u32, Vec<u8>)>> {
    let mut len = [0u8; 4];
    if wire < 4 {
        return Ok(None);
    }
    r.read_exact(&mut len, received)?;
    let len = u32::from_be_bytes(len);
    let bitmap_len = dmover_proto::packed::bitmap_len(len as usize);
    if len == 0 || u64::from(len) > block_size || 4 + bitmap_len > wire as usize {
        return Ok(None);
    }
    let mut bitmap = vec![0; bitmap_len];
    r.read_exact(&mut bitmap, received)?;
    let packed = wire as usize - 4 - bitmap_len;
    Ok((packed == dmover_proto::packed::packed_len(len as usize, &bitmap)).then_some((len, bitmap)))
}

/// Reads blocks from one data connection until it ends, and queues them
/// for the writers (each file's blocks to one writer).
pub(super) fn data_stream(sh: &Shared, conn: Box<dyn Transport>, wtx: &[Sender<WriteJob>]) {
    let mut r = FrameReader::new(conn);
    let broken = |e: Error| {
        if !sh.stop.is_raised() {
            let _ = sh.events.send(Input::Broken(e));
        }
    };
    loop {
        let h = match r.read::<OnData>() {
            Ok(Incoming::Data(h)) => h,
            Ok(Incoming::Msg(OnData::Hole { id, offset, len })) => match hole(sh, id, offset, len, wtx) {
                Ok(true) => continue,
                Ok(false) => return,
                Err(m) => return broken(Error::protocol(r.peer(), m)),
            },
            Ok(Incoming::Msg(OnData::Ping {})) => continue,
            Ok(Incoming::Msg(OnData::StreamEnd {})) => return,
            Err(e) => return broken(e),
        };
        let received = [&sh.received, &sh.receiving.0.received];
        // A sparse block comes without its pages of zeros: its length and
        // bitmap first (dmover_proto::packed).
        let (len, bitmap) = if h.sparse {
            match sparse_prefix(&mut r, sh.block_size, h.len, &received) {
                Ok(Some(got)) => got,
                Ok(None) => return broken(Error::protocol(r.peer(), "a sparse block's length or bitmap is out of bounds")),
                Err(e) => return broken(e),
            }
        } else {
            (h.len, Vec::new())
        };
        if let Err(m) = check_header(sh.block_size, h.offset, len) {
            return broken(Error::protocol(r.peer(), m));
        }
        let Some(mut data) = sh.pool.take(len as usize) else { return };
        let sum = if h.sparse {
            let packed = (h.len - 4) as usize - bitmap.len();
            if let Err(e) = r.read_block(&mut data[..packed], &received) {
                return broken(e);
            }
            if let Err(m) = dmover_proto::packed::unpack(&mut data, &bitmap, packed) {
                return broken(Error::protocol(r.peer(), m));
            }
            dmover_proto::digest::block_sum(&data)
        } else {
            match r.read_block(&mut data, &received) {
                Ok(sum) => sum,
                Err(e) => return broken(e),
            }
        };
        let Some(slot) = sh.slots.read().expect("slots lock").get(&h.file).cloned() else {
            continue; // aborted or failed meanwhile
        };
        let block = match slot.gate.admit(h.file, h.offset, len) {
            Ok(b) => b,
            Err(m) => return broken(Error::protocol(r.peer(), m)),
        };
        if sum != h.sum {
            log::warn!("damaged block {block} of file {} from {}; asking again", h.file, r.peer());
            sh.report(Event::Damaged { id: h.file, block });
            continue;
        }
        if !queue(sh, wtx, WriteJob { slot, block, bytes: Bytes::Data { data, sum, sparse: h.sparse } }) {
            return;
        }
    }
}

/// Takes a hole: blocks that read as zeros, whose checksums this end
/// knows. False once the writers are gone; an error if the hole is not
/// whole blocks of its file.
fn hole(sh: &Shared, id: u64, offset: u64, len: u64, wtx: &[Sender<WriteJob>]) -> Result<bool, String> {
    let Some(slot) = sh.slots.read().expect("slots lock").get(&id).cloned() else {
        return Ok(true); // aborted or failed meanwhile
    };
    let blocks = slot.gate.admit_hole(id, offset, len)?;
    Ok(queue(sh, wtx, WriteJob { slot, block: blocks.start, bytes: Bytes::Zeros(len) }))
}

/// Hands blocks to their file's writer (one writer takes all of a file's
/// blocks), or reports them written at once where nothing is kept
/// (`--discard`). False once the writers are gone.
fn queue(sh: &Shared, wtx: &[Sender<WriteJob>], job: WriteJob) -> bool {
    if sh.options.flags.contains(TransferFlags::DISCARD) {
        let id = job.slot.id;
        let written = job.sums(sh.block_size).into_iter().map(|(block, sum)| Event::Written { id, block, sum }).collect();
        let _ = sh.events.send(Input::Batch(written));
        return true;
    }
    let w = &wtx[(job.slot.id % wtx.len() as u64) as usize];
    sh.queued.fetch_add(1, Ordering::Relaxed);
    w.send(job).is_ok()
}

/// Writes queued blocks at their offsets and journals them; zeros are
/// left (or made) a hole.
pub(super) fn writer(sh: &Shared, rx: Receiver<WriteJob>) {
    for job in rx {
        sh.queued.fetch_sub(1, Ordering::Relaxed);
        let slot = &job.slot;
        let (handle, created) = {
            let mut io = slot.io.lock().expect("file lock");
            if io.closed {
                continue;
            }
            match slot.open(sh, &mut io) {
                Ok(f) => (f, io.created),
                Err(e) => {
                    sh.failed(slot.id, &e);
                    continue;
                }
            }
        };
        let off = job.block * sh.block_size;
        let written = match &job.bytes {
            Bytes::Data { data, sparse, .. } => {
                if *sparse {
                    write_sparse(handle.as_ref(), data, off, created)
                } else {
                    handle.write_all_at(data, off)
                }
            }
            .and_then(|()| {
                // Durable files are synced before they are confirmed: have
                // the kernel start on it now, while the rest of the data arrives.
                if sh.options.flags.contains(TransferFlags::NO_FSYNC) {
                    Ok(())
                } else {
                    handle.write_back(off, data.len() as u64)
                }
            }),
            Bytes::Zeros(len) => handle.write_zeros(off, *len, created),
        };
        if let Err(e) = written {
            sh.failed(slot.id, &e);
            continue;
        }
        let sums = job.sums(sh.block_size);
        drop(job.bytes);
        {
            let mut io = slot.io.lock().expect("file lock");
            if io.closed {
                continue;
            }
            if let Some(j) = io.journal.as_mut() {
                if let Err(e) = sums.iter().try_for_each(|(block, sum)| j.record(*block, sum)) {
                    log::warn!("cannot journal {}: {e}", sh.store.display(&slot.paths.temp));
                    io.journal = None;
                }
            }
        }
        let written = sums.into_iter().map(|(block, sum)| Event::Written { id: slot.id, block, sum }).collect();
        let _ = sh.events.send(Input::Batch(written));
    }
}

/// Commits verified files in batches until the session stops (and what was
/// verified before it stopped), as a pipeline: a batch's files get their
/// mode and mtime and are made durable (their own data and attributes, not
/// the whole file system's, so other writers' dirty data does not hold
/// them up), together with the directories the batch before it was renamed
/// into, which are then reported committed; then the batch is renamed into
/// place and waits for the next round. A batch waits for the next one at
/// most [`SYNC_MERGE`]; then a round of its names alone follows. A storage
/// that takes several commits at once commits each file as it comes
/// instead ([`commit_each`]).
pub(super) fn committer(sh: &Shared, verified: &Receiver<(Arc<Slot>, Sum)>) {
    let threads = sh.store.features().commits_at_once;
    if threads > 1 {
        std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(|| commit_each(sh, verified));
            }
            commit_each(sh, verified);
        });
        return;
    }
    let durable = !sh.options.flags.contains(TransferFlags::NO_FSYNC);
    // Without syncs there is nothing to merge: confirm at once.
    let merge = if durable { SYNC_MERGE } else { Duration::ZERO };
    let mut names = DurableNames::default();
    let mut renamed: Vec<Arc<Slot>> = Vec::new();
    loop {
        let first = if renamed.is_empty() {
            match next_verified(sh, verified) {
                Next::File(v) => Some(v),
                Next::Over => return,
                Next::Idle => continue,
            }
        } else {
            verified.recv_timeout(merge).ok()
        };
        let batch: Vec<(Arc<Slot>, Sum)> = first.into_iter().chain(verified.try_iter()).take(COMMIT_BATCH).collect();
        let mut ready = prepare_commit(sh, batch);
        if durable {
            let dirs = names.dirs_to_sync(&sh.dest_dir, &renamed);
            let (synced, dirs_synced) = make_durable(sh, ready, &dirs);
            ready = synced;
            if let Err(e) = dirs_synced {
                log::warn!("{}: cannot make the received files' names durable: {e}", sh.store.display(&sh.dest_dir));
                for s in renamed.drain(..) {
                    sh.failed(s.id, &e);
                }
            }
        }
        report_committed(sh, std::mem::take(&mut renamed));
        renamed = rename_into_place(sh, ready);
    }
}

/// What the committer found waiting.
enum Next {
    File((Arc<Slot>, Sum)),
    /// The session is over and every verified file was taken.
    Over,
    /// Nothing yet: look again.
    Idle,
}

/// The next verified file, waiting up to [`POLL`]. Once the session stops,
/// what was verified is still taken.
fn next_verified(sh: &Shared, verified: &Receiver<(Arc<Slot>, Sum)>) -> Next {
    crossbeam_channel::select! {
        recv(verified) -> v => match v {
            Ok(v) => Next::File(v),
            Err(_) => Next::Over,
        },
        recv(sh.stop.woken()) -> _ => match verified.try_recv() {
            Ok(v) => Next::File(v),
            Err(_) => Next::Over,
        },
        default(POLL) => Next::Idle,
    }
}

/// Commits verified files one at a time as they come, until the session
/// stops: one of the threads of a storage whose commit is a request to a
/// server ([`Features::commits_at_once`](crate::storage::Features::commits_at_once)
/// above one: an object store's PUT), durable once answered and with no
/// names to make durable after it. Threads that each take the next file
/// keep that many requests in flight all the time, where a batch would
/// wait for its slowest request before the next batch starts.
fn commit_each(sh: &Shared, verified: &Receiver<(Arc<Slot>, Sum)>) {
    let durable = !sh.options.flags.contains(TransferFlags::NO_FSYNC);
    loop {
        let v = match next_verified(sh, verified) {
            Next::File(v) => v,
            Next::Over => return,
            Next::Idle => continue,
        };
        let mut ready = prepare_commit(sh, vec![v]);
        if durable {
            ready = make_durable(sh, ready, &[]).0;
        }
        report_committed(sh, rename_into_place(sh, ready));
    }
}

/// Reports files in place and durable as committed (but for those the
/// sender aborted meanwhile), and drops their journals.
fn report_committed(sh: &Shared, placed: Vec<Arc<Slot>>) {
    let mut committed = Vec::with_capacity(placed.len());
    for s in placed {
        if s.io.lock().expect("file lock").closed {
            continue; // aborted by the sender meanwhile: it counts the file as failed
        }
        log::debug!("{}: committed", sh.store.display(&s.paths.dest));
        if let Some(j) = &s.paths.journal {
            let _ = sh.state.remove(j);
        }
        committed.push(Event::Committed { id: s.id });
    }
    if !committed.is_empty() {
        let _ = sh.events.send(Input::Batch(committed));
    }
}

/// Files of a batch with their attributes set, open, ready to be made
/// durable and renamed into place.
type Ready = Vec<(Arc<Slot>, Arc<dyn WriteFile>)>;

/// Files with data one committer makes durable at once, at most: their
/// syncs wait on the disk, not the processor, and the file system commits
/// those that wait together in one journal transaction; a server runs a
/// committer per session, so each thread counts.
const SYNC_THREADS: usize = 4;

/// Empty files and directories one committer makes durable at once, at
/// most: their syncs write no data, only wait for the journal, and the more
/// wait together the fewer commits they take.
const METADATA_SYNC_THREADS: usize = 32;

/// Empty files in a batch from which one sync of each file system they
/// are on ([`Storage::sync_file_systems`](crate::storage::Storage::sync_file_systems))
/// makes them and the batch's directories durable, instead of a sync
/// each: each of those waits for a journal commit and a flush of the
/// device's cache, which one call pays once. The price: a file system's
/// sync also writes back what other writers left dirty on it.
const SYNC_FILE_SYSTEM_AT: usize = 32;

/// Makes each file of a batch durable, and the names in `dirs`: the empty
/// files and the directories by one sync of each file system they are on
/// when there are [`SYNC_FILE_SYSTEM_AT`] such files and the storage can,
/// else on up to [`METADATA_SYNC_THREADS`] threads; then the files with
/// data on up to [`SYNC_THREADS`]. A file system's sync that fails (it
/// reports what any file on it failed to write back: another file's full
/// disk) fails no file: each is then synced on its own, and learns its own
/// outcome. Returns the files that were made durable (the others are
/// reported failed) and whether every directory was.
fn make_durable(sh: &Shared, ready: Ready, dirs: &[PathBuf]) -> (Ready, std::io::Result<()>) {
    enum Job<'a> {
        File(usize, &'a Arc<dyn WriteFile>),
        Dir(&'a Path),
    }
    let (mut light, mut heavy): (Vec<Job>, Vec<Job>) = (dirs.iter().map(|d| Job::Dir(d)).collect(), Vec::new());
    for (i, (s, f)) in ready.iter().enumerate() {
        let empty = s.paths.meta.as_ref().is_some_and(|m| m.size == 0);
        if empty { &mut light } else { &mut heavy }.push(Job::File(i, f));
    }
    let mut files: Vec<Option<std::io::Result<()>>> = ready.iter().map(|_| None).collect();
    let mut dirs_synced = Ok(());
    // One sync of each file system the empty files and directories are
    // on, when the empty files are many.
    if light.len() - dirs.len() >= SYNC_FILE_SYSTEM_AT {
        let places: BTreeSet<&Path> = light
            .iter()
            .filter_map(|j| match j {
                Job::File(i, _) => ready[*i].0.paths.dest.parent(),
                Job::Dir(d) => Some(*d),
            })
            .collect();
        match sh.store.sync_file_systems(&places.into_iter().collect::<Vec<_>>()) {
            Ok(true) => {
                for j in light.drain(..) {
                    if let Job::File(i, _) = j {
                        files[i] = Some(Ok(()));
                    }
                }
            }
            Ok(false) => {}
            Err(e) => log::debug!("{}: cannot sync its file system ({e}): syncing each file", sh.store.display(&sh.dest_dir)),
        }
    }
    let sync = |j: &Job| match j {
        Job::File(_, f) => f.sync(),
        Job::Dir(d) => sh.store.sync_dir(d),
    };
    for (jobs, threads) in [(light, METADATA_SYNC_THREADS), (heavy, SYNC_THREADS)] {
        for (j, r) in jobs.iter().zip(at_once(&jobs, threads, sync)) {
            match j {
                &Job::File(i, _) => files[i] = Some(r),
                Job::Dir(_) => dirs_synced = dirs_synced.and(r),
            }
        }
    }
    let mut synced = Vec::with_capacity(ready.len());
    for ((s, f), r) in ready.into_iter().zip(files) {
        match r.expect("every file was synced") {
            Ok(()) => synced.push((s, f)),
            Err(e) => sh.failed(s.id, &e),
        }
    }
    (synced, dirs_synced)
}

/// The directories whose own names are known to be durable: their parent
/// was synced after they were seen.
#[derive(Default)]
struct DurableNames {
    known: HashSet<PathBuf>,
}

impl DurableNames {
    /// The directories to sync so that the names of `renamed` are durable:
    /// each file's directory, and every directory on the way up to the
    /// destination (the destination's own name included) whose name is not
    /// known to be durable yet.
    fn dirs_to_sync(&mut self, dest_dir: &Path, renamed: &[Arc<Slot>]) -> Vec<PathBuf> {
        let mut dirs = BTreeSet::new();
        for s in renamed {
            let Some(parent) = s.paths.dest.parent() else { continue };
            dirs.insert(parent.to_path_buf());
            let mut dir = parent;
            while dir.starts_with(dest_dir) && !self.known.contains(dir) {
                let Some(up) = dir.parent() else { break };
                self.known.insert(dir.to_path_buf());
                dirs.insert(up.to_path_buf());
                dir = up;
            }
        }
        dirs.into_iter().collect()
    }
}

/// Sets mode and mtime on each file of a batch (opening, first, a file
/// none of whose blocks were written in this run: an empty file, made
/// under its final name where nothing has it, or one resumed with every
/// block already on disk; afresh only if it is fresh, so a resumed file
/// keeps its blocks). Returns the files ready for their data to be made
/// durable.
///
/// One thread does the whole batch: making an empty file is the file
/// system's work under its directory's lock, and a second thread on it
/// mostly spun on that lock (bench/DURABILITY.md).
fn prepare_commit(sh: &Shared, batch: Vec<(Arc<Slot>, Sum)>) -> Ready {
    let prepare = |(s, sum): (Arc<Slot>, Sum)| {
        let meta = s.paths.meta.as_ref()?;
        let attrs = Attrs { digest: Some(Digest { block_size: sh.block_size, sum }), ..sh.keep.attrs(meta) };
        let opened = {
            let mut io = s.io.lock().expect("file lock");
            if io.closed {
                return None;
            }
            s.finished(sh, &mut io, &attrs)
        };
        match opened {
            Ok(f) => Some((s, f)),
            Err(e) => {
                sh.failed(s.id, &e);
                None
            }
        }
    };
    batch.into_iter().filter_map(prepare).collect()
}

/// Renames each file of a batch into place (an empty file made under its
/// final name is there already), as many at once as the storage takes;
/// returns those in place.
fn rename_into_place(sh: &Shared, ready: Ready) -> Vec<Arc<Slot>> {
    let commit = |(s, f): &(Arc<Slot>, Arc<dyn WriteFile>)| {
        let committed = {
            let mut io = s.io.lock().expect("file lock");
            io.file = None;
            io.journal = None;
            if io.placed {
                Ok(())
            } else {
                f.commit(&s.paths.dest, None)
            }
        };
        match committed {
            Ok(()) => Some(s.clone()),
            Err(e) => {
                sh.failed(s.id, &e);
                None
            }
        }
    };
    at_once(&ready, sh.store.features().commits_at_once, commit).into_iter().flatten().collect()
}

/// Runs `job` on each of `items` on up to `threads` threads (this one
/// among them), each taking the next item; returns the results in order.
fn at_once<T: Sync, R: Send + Sync>(items: &[T], threads: usize, job: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = threads.min(items.len());
    if threads <= 1 {
        return items.iter().map(job).collect();
    }
    let results: Vec<OnceLock<R>> = items.iter().map(|_| OnceLock::new()).collect();
    let next = AtomicUsize::new(0);
    let work = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(item) = items.get(i) else { return };
        let _ = results[i].set(job(item));
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
    results.into_iter().map(|r| r.into_inner().expect("every item was taken")).collect()
}
