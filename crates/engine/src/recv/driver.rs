//! The receiving end's owner thread: it holds the session
//! (`dmover_proto::session::receive::Receive`) and everything only it
//! changes — the control connection's writing half, the data connections,
//! the destination's layout — and is fed by one event channel: control
//! messages (from a thread reading the control connection), data
//! connections as they attach, and what the workers did. It carries out
//! the session's actions; the per-file decisions that need the disk (is
//! the file already there? a partial file to resume?) are made here, the
//! per-block work is the workers'.

use super::workers::{self, FileIo, Input, Paths, Shared, Slot, WriteJob};
use super::{Layout, Prepared, Receiving, RecvSummary, MAX_DIALED_STREAMS, WRITE_QUEUE};
use crate::error::{Error, Result};
use crate::halt::Halt;
use crate::journal::{self, Journal};
use crate::pool::{Pool, MIN_BLOCKS};
use crate::storage::{check_not_reserved, digest_of, Kind, Stat};
use crate::transport::{Connector, SocketOptions, Transport};
use crate::wire::{ping_interval, FrameReader, FrameWriter, Incoming};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use dmover_proto::digest::Sum;
use dmover_proto::frame::{FileMeta, TransferFlags};
use dmover_proto::phase::{ToReceiver, ToSender};
use dmover_proto::session::receive::{self, Action, Event, NameCheck, Outcome, Receive, Subject};
use dmover_proto::ErrorKind;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// Runs a prepared receiving end until the sender finishes or the session
/// fails; see [`Prepared::run`].
pub(super) fn run(p: Prepared, control: Box<dyn Transport>, streams: Receiver<Box<dyn Transport>>) -> Result<RecvSummary> {
    let Prepared { cfg, dial, dest_dir, may_be_file, layout, keep, mut made } = p;
    made.keep();
    let opts = cfg.options;
    let block_size = opts.block_size as u64;
    let peer = control.peer();
    control.set_read_timeout(Some(cfg.idle_timeout)).map_err(|e| Error::network(&peer, &e))?;
    let ctl = FrameWriter::new(control.split().map_err(|e| Error::network(&peer, &e))?);
    let (events, inputs) = crossbeam_channel::unbounded::<Input>();
    let (commits, verified) = crossbeam_channel::unbounded::<(Arc<Slot>, Sum)>();
    let sh = Arc::new(Shared {
        options: opts,
        block_size,
        state: super::state_store(&cfg.store),
        store: cfg.store,
        dest_dir,
        keep,
        slots: RwLock::new(HashMap::new()),
        events,
        commits,
        pool: Pool::new(cfg.staging, block_size as usize, MIN_BLOCKS),
        queued: AtomicUsize::new(0),
        stop: Halt::default(),
        received: AtomicU64::new(0),
        streams: AtomicUsize::new(0),
        receiving: Receiving::new(cfg.intake),
    });
    sh.receiving.0.watch(&sh);
    // One queue per writer, and a file's blocks always go to the same
    // writer: writers to one file would only contend for its inode lock.
    let mut wtx = Vec::new();
    let mut threads = Vec::new();
    for _ in 0..cfg.writers.max(1) {
        let (tx, rx) = crossbeam_channel::bounded::<WriteJob>(WRITE_QUEUE);
        wtx.push(tx);
        let sh = sh.clone();
        threads.push(std::thread::spawn(move || workers::writer(&sh, rx)));
    }
    {
        let sh = sh.clone();
        threads.push(std::thread::spawn(move || workers::committer(&sh, &verified)));
    }
    {
        let sh = sh.clone();
        threads.push(std::thread::spawn(move || loop {
            crossbeam_channel::select! {
                recv(streams) -> c => match c {
                    Ok(c) => drop(sh.events.send(Input::Stream(c))),
                    Err(_) => return,
                },
                recv(sh.stop.woken()) -> _ => return,
            }
        }));
    }
    let ctl_handle = control.split().map_err(|e| Error::network(&peer, &e))?;
    {
        let events = sh.events.clone();
        std::thread::spawn(move || read_control(control, &events));
    }
    // dmover's own names are taken from no sender, whatever else the caller takes.
    let accept: NameCheck = match cfg.accept {
        Some(takes) => Arc::new(move |name: &str| check_not_reserved(name).and_then(|()| takes(name))),
        None => Arc::new(check_not_reserved),
    };
    let discard = opts.flags.contains(TransferFlags::DISCARD);
    let session = Receive::new(receive::Config { block_size, discard, accept: Some(accept) });
    let mut owner = Owner {
        sh: sh.clone(),
        session,
        ctl,
        ping_every: ping_interval(cfg.idle_timeout),
        peer,
        wtx: wtx.into(),
        conns: Vec::new(),
        fatal: None,
        dest_label: cfg.dest,
        may_be_file,
        layout,
        dirs: HashSet::new(),
        empty_tops: HashMap::new(),
        dir_attrs: Vec::new(),
        preparing: HashMap::new(),
        queue_capacity: WRITE_QUEUE * cfg.writers.max(1),
        dial,
        dialing: 0,
        write_errors: cfg.write_errors,
    };
    let result = owner.run(&inputs);
    if result.as_ref().is_err_and(|e| e.kind != ErrorKind::Unreachable) {
        crate::transport::linger(ctl_handle.as_ref());
    }
    sh.stop.raise();
    owner.conns.iter().for_each(|c| c.close());
    sh.pool.close();
    // Nothing more is admitted; writers finish what is queued, so
    // completed blocks reach the journal.
    sh.slots.write().expect("slots lock").clear();
    let Owner { wtx, layout, .. } = owner;
    drop(wtx);
    for t in threads {
        let _ = t.join();
    }
    // Nothing more is written: let the next run of this transfer in.
    drop(layout);
    result
}

/// Reads the control connection for the owner, up to the sender's last
/// word (`Finish`, or an error): what follows belongs to whoever opened the
/// connection (a server's report, at a client that downloads). What one
/// read brought goes to the owner together, so that its replies go out
/// together.
fn read_control(control: Box<dyn Transport>, events: &Sender<Input>) {
    let mut r = FrameReader::new(control);
    let mut batch = Vec::new();
    loop {
        let lost = match r.read::<ToReceiver>() {
            Ok(Incoming::Msg(m)) => {
                let last = matches!(m, ToReceiver::Finish { .. } | ToReceiver::Error { .. });
                batch.push(Event::Control(m));
                if !last && r.buffered() > 0 {
                    continue;
                }
                if events.send(Input::Batch(std::mem::take(&mut batch))).is_err() || last {
                    return;
                }
                continue;
            }
            Ok(Incoming::Data(_)) => Error::protocol(r.peer(), "data frame on the control connection"),
            Err(e) => e,
        };
        let _ = events.send(Input::Batch(batch));
        let _ = events.send(Input::ControlLost(lost));
        return;
    }
}

/// The owner thread's state.
struct Owner {
    sh: Arc<Shared>,
    session: Receive,
    /// The control connection's writing half.
    ctl: FrameWriter,
    /// How often the control connection says something (see
    /// [`FrameWriter::keep_alive`]).
    ping_every: Duration,
    /// The control connection's peer, for messages.
    peer: String,
    /// The writers' queues, for data connections that attach.
    wtx: Arc<[Sender<WriteJob>]>,
    /// Every data connection, to close them when the session ends.
    conns: Vec<Box<dyn Transport>>,
    /// The first fatal error, once the sender was told.
    fatal: Option<Error>,
    /// The destination as the user named it (for messages).
    dest_label: String,
    may_be_file: bool,
    /// Settled before the session or by the first announcement.
    layout: Option<Layout>,
    /// Directories known to exist below the destination.
    dirs: HashSet<PathBuf>,
    /// Whether each directory at the top of the destination that names
    /// announced went into held nothing when the first of them came (see
    /// [`looks`](Owner::looks)).
    empty_tops: HashMap<String, bool>,
    /// The transfer's directories, to be given their modes and mtimes at
    /// the end, when their files are in (one entry per directory).
    dir_attrs: Vec<FileMeta>,
    /// Files looked at and to be received, until the session opens them.
    preparing: HashMap<u64, (Paths, FileIo)>,
    /// Blocks the writers' queues hold at most.
    queue_capacity: usize,
    /// How to dial a data connection the sender asks for.
    dial: Option<Connector>,
    /// Dials under way.
    dialing: usize,
    /// Where files that fail on the storage are counted.
    write_errors: Arc<super::WriteErrors>,
}

impl Owner {
    fn run(&mut self, inputs: &Receiver<Input>) -> Result<RecvSummary> {
        loop {
            let input = match inputs.try_recv() {
                Ok(i) => i,
                Err(TryRecvError::Empty) => {
                    // Replies go out together once what came so far is answered.
                    self.flush();
                    if let Some(e) = self.fatal.take() {
                        return Err(e);
                    }
                    match inputs.recv_deadline(self.ctl.ping_due(self.ping_every)) {
                        Ok(i) => i,
                        Err(RecvTimeoutError::Timeout) => {
                            self.keep_alive();
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => unreachable!("the owner holds a sender"),
                    }
                }
                Err(TryRecvError::Disconnected) => unreachable!("the owner holds a sender"),
            };
            let end = match input {
                Input::Session(e) => self.hear(e),
                Input::Batch(es) => es.into_iter().find_map(|e| self.hear(e)),
                Input::Stream(c) => {
                    self.attach(c);
                    None
                }
                Input::Dialed(c) => {
                    self.dialing -= 1;
                    match c {
                        Ok(c) => self.attach(c),
                        Err(e) => log::warn!("could not dial the data connection the sender asked for: {e}"),
                    }
                    None
                }
                Input::Broken(e) => {
                    self.fail(e);
                    None
                }
                Input::ControlLost(e) => Some(Err(e)),
            };
            if let Some(end) = end {
                return end;
            }
            // However long a run of inputs lasts, the sender hears from us.
            self.keep_alive();
            if let Some(e) = self.fatal.take() {
                return Err(e);
            }
        }
    }

    /// Gives the session an event and carries out what it says; returns
    /// the session's result when it ends.
    fn hear(&mut self, e: Event) -> Option<Result<RecvSummary>> {
        self.session.handle(e);
        while let Some(a) = self.session.poll() {
            if let Some(end) = self.act(a) {
                return Some(end);
            }
            if let Some(e) = self.fatal.take() {
                return Some(Err(e));
            }
        }
        None
    }

    /// Carries out one action; returns the session's result when it ends.
    fn act(&mut self, a: Action) -> Option<Result<RecvSummary>> {
        match a {
            Action::Send(m) => self.queue(m),
            Action::Prepare { id, meta, digest } => {
                if let Some(outcome) = self.look(id, &meta, digest) {
                    self.session.handle(Event::Prepared { id, outcome });
                }
            }
            Action::HardLink { id, path, first } => {
                let outcome = self.hard_link(&path, &first);
                self.session.handle(Event::Prepared { id, outcome });
            }
            Action::Open { id, gate } => {
                let (paths, io) = self.preparing.remove(&id).unwrap_or_else(|| (Paths::default(), FileIo::fresh()));
                let slot = Arc::new(Slot { id, gate, paths, io: Mutex::new(io) });
                self.sh.slots.write().expect("slots lock").insert(id, slot);
            }
            Action::Rejournal { id, held } => {
                if let Some(slot) = self.slot(id) {
                    slot.rejournal(&self.sh, &held);
                }
            }
            Action::Commit { id, digest } => {
                if let Some(slot) = self.slot(id) {
                    // The committer lives as long as the session, so the channel is open.
                    let _ = self.sh.commits.send((slot, digest));
                }
            }
            Action::Close { id } => {
                self.sh.slots.write().expect("slots lock").remove(&id);
            }
            Action::Remove { id } => {
                let slot = self.sh.slots.write().expect("slots lock").remove(&id);
                if let Some(slot) = slot {
                    slot.remove(&self.sh);
                }
            }
            Action::Refuse { id, kind, subject, message } => {
                self.write_errors.add(kind);
                let subject = match subject {
                    Subject::Said(s) => s,
                    Subject::Path(p) => self.name(&p),
                };
                if kind == ErrorKind::Refused {
                    log::warn!("refused {subject}: {message}");
                }
                self.queue(ToSender::Failed { id, kind, subject, message });
            }
            Action::Echo { stamp } => {
                let intake = &self.sh.receiving.0;
                self.queue(ToSender::Echo {
                    stamp,
                    received: self.sh.received.load(Ordering::Relaxed),
                    staged: (self.sh.queued.load(Ordering::Relaxed) * 100 / self.queue_capacity).min(100) as u8,
                    server_received: intake.received.load(Ordering::Relaxed),
                    transfers: intake.transfers.load(Ordering::Relaxed),
                });
            }
            Action::Dial => self.dial(),
            Action::Dir { meta } => self.dir_attrs.push(meta),
            Action::Finish(t) => return Some(self.finish(t)),
            Action::Violation(why) => self.fail(Error::protocol(&self.peer, why)),
            Action::PeerFailed { kind, message } => return Some(Err(Error::new(kind, &self.peer, message))),
        }
        None
    }

    fn slot(&self, id: u64) -> Option<Arc<Slot>> {
        self.sh.slots.read().expect("slots lock").get(&id).cloned()
    }

    /// The sender is finished: the totals are confirmed, and the
    /// transfer's resume state goes, unless a file failed here for want of
    /// space: then the transfer is incomplete, and its next run, once
    /// space is freed, looks at what this one committed before it sends
    /// anything again.
    fn finish(&mut self, t: RecvSummary) -> Result<RecvSummary> {
        self.sh.stop.raise();
        self.give_dirs_their_attrs();
        if let Some(l) = self.layout.as_ref().filter(|_| !t.out_of_space) {
            let _ = self.sh.state.remove(&l.marker);
            let _ = self.sh.state.remove_dir(&l.state_dir);
        }
        self.ctl.send(ToSender::Finished { files: t.files, bytes: t.bytes, set_digest: t.set.0 })?;
        Ok(t)
    }

    /// Gives the transfer's directories their modes and mtimes, now that
    /// every file is in (each file that arrived moved its directory's
    /// mtime), children before parents, and makes that durable. A
    /// directory that is not here (its files went to another host) is
    /// passed over; one that cannot be set is a warning.
    fn give_dirs_their_attrs(&mut self) {
        let dirs = std::mem::take(&mut self.dir_attrs);
        let mut set = Vec::new();
        for meta in dirs.iter().rev() {
            let Ok(rel) = dmover_proto::path::to_path(&meta.path) else { continue };
            let path = self.sh.dest_dir.join(rel);
            match self.sh.store.set_dir_attrs(&path, &self.sh.keep.attrs(meta)) {
                Ok(()) => set.push(path),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => log::warn!("{}: cannot set the directory's mode and time: {e}", self.name(&meta.path)),
            }
        }
        if set.is_empty() || self.sh.options.flags.contains(TransferFlags::NO_FSYNC) {
            return;
        }
        let synced = self.sh.store.sync_file_systems(&[self.sh.dest_dir.as_path()]).unwrap_or(false);
        for dir in set.iter().filter(|_| !synced) {
            if let Err(e) = self.sh.store.sync_dir(dir) {
                log::warn!("{}: cannot make the directory's mode and time durable: {e}", self.sh.store.display(dir));
            }
        }
    }

    /// Takes a data connection that attached: its reader thread starts.
    fn attach(&mut self, conn: Box<dyn Transport>) {
        if self.sh.stop.is_raised() {
            return;
        }
        let socket = SocketOptions { buffer: self.sh.options.tcp_buffer, ..SocketOptions::default() };
        if let Err(e) = conn.set_options(&socket) {
            log::warn!("{}: socket options: {e}", conn.peer());
        }
        match conn.split() {
            Ok(c) => self.conns.push(c),
            Err(e) => return self.fail(Error::network(conn.peer(), &e)),
        }
        let (sh, wtx) = (self.sh.clone(), self.wtx.clone());
        sh.streams.fetch_add(1, Ordering::SeqCst);
        std::thread::spawn(move || {
            workers::data_stream(&sh, conn, &wtx);
            sh.streams.fetch_sub(1, Ordering::SeqCst);
        });
    }

    /// Dials the data connection the sender asked for, in its own thread,
    /// unless this end does not dial or holds its most already.
    fn dial(&mut self) {
        let Some(dial) = self.dial.clone() else {
            return log::debug!("the sender asked for a data connection, which this end does not dial");
        };
        if self.sh.stop.is_raised() || self.dialing + self.sh.streams.load(Ordering::SeqCst) >= MAX_DIALED_STREAMS {
            return;
        }
        self.dialing += 1;
        let events = self.sh.events.clone();
        std::thread::spawn(move || {
            let _ = events.send(Input::Dialed(dial()));
        });
    }

    /// A reply, sent when the owner runs out of things to do.
    fn queue(&mut self, m: ToSender) {
        let queued = self.ctl.queue(m);
        if let Err(e) = queued {
            self.fail(e);
        }
    }

    fn flush(&mut self) {
        let flushed = self.ctl.flush();
        if let Err(e) = flushed {
            self.fail(e);
        }
    }

    fn keep_alive(&mut self) {
        if self.sh.stop.is_raised() {
            return;
        }
        if let Err(e) = self.ctl.keep_alive(self.ping_every) {
            self.fail(e);
        }
    }

    /// Ends the session: tells the sender why (best effort) and closes every connection.
    fn fail(&mut self, e: Error) {
        // A lost connection during our own shutdown is no error; and a real
        // cause (a full disk) beats a lost connection, whichever came first.
        let lost = e.kind == ErrorKind::Unreachable;
        let first = match &self.fatal {
            None => !lost || !self.sh.stop.is_raised(),
            Some(old) => old.kind == ErrorKind::Unreachable && !lost,
        };
        self.sh.stop.raise();
        self.conns.iter().for_each(|c| c.close());
        if first && !lost {
            // Say why, and leave the connection readable: closing it with
            // the sender's messages unread would reset it and could destroy
            // our message before the sender reads it.
            let _ = self.ctl.send(ToSender::Error { kind: e.kind, message: e.to_string() });
            self.ctl.close_write();
        } else {
            self.ctl.close();
        }
        if first {
            self.fatal = Some(e);
        }
    }

    /// How to name `rel` (a path within the transfer) in messages: the
    /// export path at a server, the local path at a client.
    fn name(&self, rel: &str) -> String {
        if self.sh.store.features().confined {
            crate::storage::display_spelled(self.sh.store.as_ref(), &dmover_proto::path::join(&self.dest_label, rel))
        } else {
            match dmover_proto::path::to_path(rel) {
                Ok(p) => self.sh.store.display(&self.sh.dest_dir.join(p)),
                Err(_) => dmover_proto::path::printable(rel).into_owned(),
            }
        }
    }

    /// Looks at the destination for an announced file: whether it is
    /// there already, which blocks a partial file of an earlier run holds,
    /// or makes an empty directory. None if nothing can be received here
    /// at all (the session then ends).
    fn look(&mut self, id: u64, meta: &FileMeta, digest: Option<Sum>) -> Option<Outcome> {
        let sh = self.sh.clone();
        let lone = !meta.path.contains('/');
        if self.layout.is_none() {
            let (parent, dest_file) = if self.may_be_file && lone {
                (sh.dest_dir.parent().map(Path::to_path_buf).unwrap_or_default(), Some(sh.dest_dir.clone()))
            } else {
                (sh.dest_dir.clone(), None)
            };
            match Layout::settle(&sh.store, &parent, dest_file, &sh.options.transfer_id) {
                Ok(l) => {
                    self.layout = Some(l);
                }
                Err(e) => {
                    self.fail(e);
                    return None;
                }
            }
        }
        // Before its parents are made, which would fill the directory it asks about.
        let look = self.looks(&meta.path);
        let l = self.layout.as_ref().expect("settled above");
        let (state_dir, resuming) = (l.state_dir.clone(), l.resuming);
        let final_path = match (&l.dest_file, lone) {
            (Some(p), true) => p.clone(),
            _ => match self.prepare_parent(&meta.path) {
                Ok(p) => p,
                Err(e) => return Some(Outcome::Refused { kind: e.kind, message: e.message }),
            },
        };
        if meta.is_dir() {
            let made = make_dir(&sh, meta, &final_path, look);
            if matches!(made, Outcome::Made | Outcome::Present) {
                // Its mtime, once the directories below it are made.
                self.dir_attrs.push(meta.clone());
            }
            return Some(made);
        }
        if meta.is_link() {
            return Some(make_link(&sh, meta, &final_path, look));
        }
        if meta.is_special() {
            return Some(make_node(&sh, meta, &final_path, look));
        }
        // Already there?
        if look {
            if let Ok(m) = sh.store.stat(&final_path) {
                let same = m.is_file()
                    && m.size == meta.size
                    && if let (Some(d), true) = (digest, sh.options.flags.contains(TransferFlags::CHECKSUM)) {
                        digest_of(sh.store.as_ref(), &final_path, sh.block_size).is_ok_and(|x| x == d)
                    } else {
                        m.mtime == (meta.mtime_s, meta.mtime_ns)
                    };
                if same {
                    // A partial file an interrupted later run of this
                    // transfer left for it is stale. A fresh run leaves what
                    // it finds: a search for a name that is not there costs
                    // as much as the look itself.
                    if resuming {
                        let _ = sh.store.remove(&temp_name(&final_path));
                        let _ = sh.state.remove(&journal::path_for(&state_dir, &meta.path));
                    }
                    log::debug!("{}: already there", meta.path);
                    return Some(Outcome::Present);
                }
            }
        }
        let blocks = meta.size.div_ceil(sh.block_size);
        let mut paths = Paths { meta: Some(meta.clone()), temp: temp_name(&final_path), dest: final_path, journal: None, resuming };
        let mut held = Vec::new();
        let mut io = FileIo::fresh();
        if blocks > 1 {
            let jp = journal::path_for(&state_dir, &meta.path);
            if let Some(recs) = journal::load(sh.state.as_ref(), &jp, meta, sh.block_size as u32, blocks) {
                // Only a partial file this end created is taken up again
                // (never one planted there), and only the blocks it holds.
                if let Ok(Some(file)) = sh.store.reopen(&paths.temp) {
                    let bs = sh.block_size;
                    held = recs.into_iter().filter(|(b, _)| file.holds(b * bs, bs.min(meta.size - b * bs))).collect();
                    log::debug!("{}: resumed, {} of {blocks} blocks held", meta.path, held.len());
                    io = FileIo::resumed(file, Journal::append(sh.state.as_ref(), &jp).ok());
                }
            }
            paths.journal = Some(jp);
        }
        self.preparing.insert(id, (paths, io));
        Some(Outcome::Receive { held })
    }

    /// Whether the destination is to be looked at for `rel` already there
    /// ([`Layout::looks`]). Not below a directory at the top of the
    /// destination that held nothing when the first name below it came
    /// (the `DEST/dir` a copy of `dir` makes, new or empty): asked once per
    /// such directory, before anything of this transfer is made in it, so
    /// that a first copy into a destination holding other things pays no
    /// look per file either.
    fn looks(&mut self, rel: &str) -> bool {
        let l = self.layout.as_ref().expect("settled before any name is looked at");
        if !l.looks(self.sh.options.flags) {
            return false;
        }
        let Some((top, _)) = rel.split_once('/').filter(|_| !l.resuming && l.dest_file.is_none()) else {
            return true;
        };
        let sh = &self.sh;
        let empty = self.empty_tops.entry(top.to_string()).or_insert_with(|| {
            dmover_proto::path::to_path(top).is_ok_and(|p| sh.store.is_empty_dir(&sh.dest_dir.join(p)).unwrap_or(false))
        });
        !*empty
    }

    /// Makes `rel` another name of `first`, a file this transfer settled
    /// (the session checked that), after `first` took its final name: both
    /// resolved beneath the destination as every name is, and the new
    /// name made durable unless the transfer syncs nothing. When the quick
    /// check (SYNC) or a resumed run finds `rel` a name of that file already (where the
    /// storage has no inodes, a copy of the same size and mtime), it is
    /// skipped like an unchanged file. Only a transfer that keeps hard
    /// links (`--hard-links`) makes any.
    fn hard_link(&mut self, rel: &str, first: &str) -> Outcome {
        let refused = |kind, message: String| Outcome::Refused { kind, message };
        let sh = self.sh.clone();
        if !sh.options.flags.contains(TransferFlags::HARD_LINKS) {
            let why = "another name of a file (a hard link), and this transfer does not keep hard links (--hard-links)";
            return refused(ErrorKind::Refused, why.into());
        }
        let Some(l) = &self.layout else {
            return refused(ErrorKind::Internal, "a hard link before any file".into());
        };
        let dest_file = l.dest_file.clone();
        let look = self.looks(rel);
        let first_path = match (&dest_file, first.contains('/')) {
            (Some(p), false) => p.clone(),
            _ => match dmover_proto::path::to_path(first) {
                Ok(p) => sh.dest_dir.join(p),
                Err(e) => return refused(ErrorKind::Refused, e.to_string()),
            },
        };
        let path = match (&dest_file, rel.contains('/')) {
            (Some(p), false) => p.clone(),
            _ => match self.prepare_parent(rel) {
                Ok(p) => p,
                Err(e) => return refused(e.kind, e.message),
            },
        };
        let file = |p: &Path| sh.store.stat(p).ok().filter(|s| s.is_file());
        let same = |a: Stat, b: Stat| match (a.inode, b.inode) {
            (Some(a), Some(b)) => a == b,
            (None, None) => (a.size, a.mtime) == (b.size, b.mtime),
            _ => false,
        };
        if look && file(&path).zip(file(&first_path)).is_some_and(|(a, b)| same(a, b)) {
            return Outcome::Present;
        }
        let made = sh.store.hard_link(&first_path, &path).and_then(|()| match path.parent() {
            Some(dir) if !sh.options.flags.contains(TransferFlags::NO_FSYNC) => sh.store.sync_dir(dir),
            _ => Ok(()),
        });
        match made {
            Ok(()) => Outcome::Made,
            Err(e) => refused(crate::error::classify(&e), e.to_string()),
        }
    }

    /// Resolves `rel`'s final path and makes its parent directory exist, with
    /// no symlink on the way (in an export).
    ///
    /// Known directories are remembered only to save making them again: every
    /// later operation resolves its path beneath the export afresh, so a
    /// directory swapped for a symlink since then is refused, never followed.
    fn prepare_parent(&mut self, rel: &str) -> Result<PathBuf> {
        let rel_path = dmover_proto::path::to_path(rel).map_err(|e| Error::new(ErrorKind::Refused, self.name(rel), e.to_string()))?;
        let final_path = self.sh.dest_dir.join(rel_path);
        let parent = final_path.parent().expect("a joined path has a parent").to_path_buf();
        if parent != self.sh.dest_dir && !self.dirs.contains(&parent) {
            self.sh.store.make_dirs(&parent).map_err(|e| Error::io(self.name(rel), &e))?;
            self.dirs.insert(parent);
        }
        Ok(final_path)
    }
}

/// Creates a directory that was empty at the source, with its mode (as
/// [`Keep::mode`](super::keep::Keep::mode) gives it). When `look` (the quick
/// check, or a resumed run) and it is already there with that mode, it is skipped
/// like an unchanged file, untouched.
fn make_dir(sh: &Shared, meta: &FileMeta, path: &Path, look: bool) -> Outcome {
    let mode = sh.keep.mode(meta);
    if look && sh.store.stat(path).is_ok_and(|m| m.is_dir() && m.mode == mode) {
        return Outcome::Present;
    }
    match sh.store.make_dir(path, mode) {
        Ok(()) => Outcome::Made,
        Err(e) => Outcome::Refused { kind: crate::error::classify(&e), message: e.to_string() },
    }
}

/// Makes a symlink with its target (data: stored as sent, never followed)
/// and modification time, replacing whatever had the name. When `look`
/// and a symlink with that target is there already, it is skipped like an
/// unchanged file, untouched. (The session checked the target's spelling.)
/// Only a transfer that asked for symlinks (`--links`) takes any.
fn make_link(sh: &Shared, meta: &FileMeta, path: &Path, look: bool) -> Outcome {
    if !sh.options.flags.contains(TransferFlags::LINKS) {
        return Outcome::Refused {
            kind: ErrorKind::Refused,
            message: "a symlink, and this transfer does not copy symlinks (--links)".into(),
        };
    }
    let target = match meta.target.as_deref().map(dmover_proto::path::to_bytes) {
        Some(Ok(t)) => t,
        _ => return Outcome::Refused { kind: ErrorKind::Refused, message: "a symlink without a target".into() },
    };
    if sh.options.flags.contains(TransferFlags::SAFE_LINKS) && !super::keep::stays_inside(&meta.path, &target) {
        let why = "symbolic link leading out of the tree skipped (--safe-links)";
        log::info!("{}: {why}", dmover_proto::path::printable(&meta.path));
        return Outcome::PassedOver(why.into());
    }
    if look && sh.store.read_link(path).is_ok_and(|t| t == *target) {
        return Outcome::Present;
    }
    match sh.store.make_link(path, &target, &sh.keep.attrs(meta)) {
        Ok(()) => Outcome::Made,
        Err(e) => Outcome::Refused { kind: crate::error::classify(&e), message: e.to_string() },
    }
}

/// Makes a device, FIFO or socket with its mode, owner and time,
/// replacing whatever had the name; one the receiving end may not make is
/// refused, or passed over (saying why) if the transfer asked for it only
/// where allowed (`--archive`). When `look` and one of that type (and
/// device number) is there already, it is skipped, untouched.
fn make_node(sh: &Shared, meta: &FileMeta, path: &Path, look: bool) -> Outcome {
    match sh.keep.makes(meta) {
        Ok(()) => {}
        Err((true, why)) => {
            log::info!("{}: skipped: {why}", dmover_proto::path::printable(&meta.path));
            let what = if meta.is_device() { "device" } else { "FIFO or socket" };
            return Outcome::PassedOver(format!("{what} skipped: {why}"));
        }
        Err((false, why)) => return Outcome::Refused { kind: ErrorKind::Refused, message: why.into() },
    }
    let kind = meta.mode & FileMeta::TYPE;
    let there = |m: crate::storage::Stat| m.kind == Kind::Special(kind) && m.rdev == meta.rdev;
    if look && sh.store.stat(path).is_ok_and(there) {
        return Outcome::Present;
    }
    let attrs = sh.keep.attrs(meta);
    match sh.store.make_node(path, kind | attrs.mode, meta.rdev, &attrs) {
        Ok(()) => Outcome::Made,
        Err(e) => Outcome::Refused { kind: crate::error::classify(&e), message: e.to_string() },
    }
}

fn temp_name(final_path: &Path) -> PathBuf {
    final_path.with_file_name(crate::source::part_name(final_path.file_name().unwrap_or_default()))
}
