//! The sending end's owner thread: it holds the session
//! (`dmover_proto::session::send::Send`) and everything only it changes —
//! the control connections' writing halves, the files in flight as the
//! readers see them, the first fatal error — and is fed by one event
//! channel: control messages (from a thread reading each control
//! connection), chunks read or failed, probes, broken connections. It takes
//! the next walked file only while the session has room for one, and
//! carries out the session's actions; the per-block work is the workers'.

use super::workers::{self, Crew, HostQueue, Input, Job, Shared, Source, Walked};
use super::{fill_block, Files, HostLink, SendConfig, SettleHook, Settled, CHUNK_BLOCKS, REASON_WAIT, WALK_AHEAD, WINDOW};
use crate::error::{Error, Result};
use crate::halt::Halt;
use crate::pool::{Pool, MIN_BLOCKS};
use crate::progress::Progress;
use crate::storage;
use crate::transport::{Layers, Transport};
use crate::tuning::{self, Meter};
use crate::wire::{ping_interval, FrameWriter};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use dmover_proto::frame::{FileError, Share, Stats};
use dmover_proto::phase::ToReceiver;
use dmover_proto::session::send::{self, Action, Event, Outcome, Send, Summary};
use dmover_proto::ErrorKind;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Sends the files to the hosts; see [`super::send`].
pub(super) fn run(files: Files, links: Vec<HostLink>, cfg: SendConfig) -> Result<Stats> {
    let started = Instant::now();
    let n = links.len();
    assert!(n > 0, "send needs a destination");
    let block_size = cfg.options.block_size as u64;
    let streams: usize = links.iter().map(|l| l.data.len() + l.attaching.as_ref().map_or(0, |a| a.count)).sum();
    let generate = matches!(files, Files::Generate { .. });
    let hook = match &files {
        Files::Feed { settled, .. } => Some(settled.clone()),
        _ => None,
    };
    let store = match &files {
        Files::Walk { store, .. } | Files::Feed { store, .. } => store.clone(),
        Files::Generate { .. } => storage::local(),
    };
    let min_blocks = (streams + cfg.concurrency).max(MIN_BLOCKS);
    let pool = if generate {
        Pool::with_fill(cfg.staging, block_size as usize, min_blocks, fill_block)
    } else {
        Pool::new(cfg.staging, block_size as usize, min_blocks)
    };
    cfg.progress.watch_pool(&pool);
    let mut ctl = Vec::new();
    let mut controls = Vec::new();
    let mut peers = Vec::new();
    let mut hosts = Vec::new();
    for l in &links {
        let split = |t: &dyn Transport| t.split().map_err(|e| Error::network(&l.name, &e));
        l.control.set_read_timeout(Some(cfg.idle_timeout)).map_err(|e| Error::network(&l.name, &e))?;
        ctl.push(FrameWriter::new(split(l.control.as_ref())?));
        controls.push(split(l.control.as_ref())?);
        peers.push(l.control.peer().to_string());
        hosts.push(HostQueue::new(if cfg.tuner.is_some() { l.more.clone() } else { None }));
    }
    let (events, inputs) = crossbeam_channel::unbounded::<Input>();
    let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
    let sh = Arc::new(Shared {
        options: cfg.options,
        block_size,
        generate,
        store: store.clone(),
        progress: cfg.progress.clone(),
        pool,
        events,
        jobs: jobs_rx,
        hosts,
        crew: Crew::default(),
        stop: Halt::default(),
        sent: AtomicU64::new(0),
        layers: Layers::new(cfg.bwlimit),
        ping_every: ping_interval(cfg.idle_timeout),
        meters: (0..n).map(|_| Meter::default()).collect(),
        started,
    });

    let mut control_readers = Vec::new();
    let mut names = Vec::new();
    // Each control reader says when it is done (see the end of the run).
    let (reader_done, readers_done) = crossbeam_channel::unbounded::<usize>();
    for (host, l) in links.into_iter().enumerate() {
        sh.start_streams(host, l.data, l.attaching);
        let (sh2, done) = (sh.clone(), reader_done.clone());
        let control = l.control;
        control_readers.push(std::thread::spawn(move || {
            workers::read_control(&sh2, host, control);
            let _ = done.send(host);
        }));
        names.push(l.name);
    }
    drop(reader_done);
    sh.set_readers(cfg.concurrency);
    let tuner = cfg.tuner.filter(|_| sh.hosts.iter().any(|q| q.more.is_some())).map(|make| {
        let sh = sh.clone();
        std::thread::spawn(move || tuning::run(&sh, &*make))
    });
    let (walk_tx, walk_rx) = crossbeam_channel::bounded::<Walked>(WALK_AHEAD);
    let flags = cfg.options.flags;
    let walker = std::thread::spawn(move || workers::walk(files, store, flags, block_size, &walk_tx));

    let session = Send::new(send::Config { hosts: n, block_size, window: WINDOW, chunk_blocks: CHUNK_BLOCKS });
    let mut owner = Owner {
        sh: sh.clone(),
        session,
        ctl,
        queued: vec![false; n],
        controls,
        peers,
        sources: HashMap::new(),
        offered: 0,
        jobs: jobs_tx,
        hook,
        fatal: None,
        summary: None,
    };
    let walked = owner.run(&inputs, walk_rx);
    // After a stop the walker ends by itself at its next entry (a feed's
    // walker when its owner closes the feed): do not wait for it.
    if walked {
        let _ = walker.join();
    }
    // Stop everything: streams drain their queues first when all went well.
    sh.stop.raise();
    sh.pool.close();
    let timeline = tuner.and_then(|t| t.join().ok()).unwrap_or_default();
    sh.crew.join();
    // The data connections are done; the control connections stay open for
    // whoever owns them (a server reports on its client's control connection).
    sh.crew.close_all();
    if owner.fatal.as_ref().is_some_and(|e| e.kind == ErrorKind::Unreachable) {
        // A receiver that lost its data connections says why on its control
        // connection: its reader waits REASON_WAIT for that (a read already
        // waiting keeps the timeout it began with), then the connection is
        // cut, so that a receiver still waiting for data (its server busy,
        // refusing the connections) cannot hold this end up.
        let mut left: HashSet<usize> = (0..control_readers.len()).collect();
        let deadline = Instant::now() + REASON_WAIT;
        while !left.is_empty() {
            match readers_done.recv_deadline(deadline) {
                Ok(host) => drop(left.remove(&host)),
                Err(_) => break,
            }
        }
        for host in left {
            owner.controls[host].close();
        }
    }
    for t in control_readers {
        let _ = t.join();
    }
    // What the receivers said meanwhile: the reason for a lost connection.
    for input in inputs.try_iter() {
        owner.hear(input);
    }
    if let Some(e) = owner.fatal.take() {
        return Err(e);
    }
    let s = owner.summary.take().expect("a session that ends without an error is complete");
    let confirmed = s.hosts.iter().flat_map(|h| h.confirmed);
    let (dest_files, dest_bytes) = confirmed.fold((0, 0), |a, c| (a.0 + c.0, a.1 + c.1));
    Ok(Stats {
        files: s.files,
        bytes: s.bytes,
        skipped_files: s.skipped_files,
        skipped_bytes: s.skipped_bytes,
        sent_bytes: sh.sent.load(Ordering::Relaxed),
        retries: 0,
        resent_blocks: s.resent_blocks,
        nanos: started.elapsed().as_nanos() as u64,
        hosts: names.into_iter().zip(&s.hosts).map(|(name, h)| Share { name, count: h.files, bytes: h.bytes }).collect(),
        dest_files,
        dest_bytes,
        digests_match: s.digests_match(),
        errors: s.errors,
        errors_not_listed: s.errors_not_listed,
        passed_over: s.passed_over,
        timeline,
    })
}

/// The owner thread's state.
struct Owner {
    sh: Arc<Shared>,
    session: Send,
    /// Each host's control connection's writing half.
    ctl: Vec<FrameWriter>,
    /// Hosts with messages queued and not yet written.
    queued: Vec<bool>,
    /// The control connections, to close them on a fatal error (they
    /// outlive a successful send).
    controls: Vec<Box<dyn Transport>>,
    /// Each control connection's peer, for messages.
    peers: Vec<String>,
    /// Files offered and not settled, by the session's numbering.
    sources: HashMap<u64, Arc<Source>>,
    offered: u64,
    jobs: Sender<Job>,
    /// Told of each settled file (fed transfers).
    hook: Option<SettleHook>,
    fatal: Option<Error>,
    summary: Option<Summary>,
}

/// What the owner takes next.
enum Next {
    Input(Input),
    Walked(Walked),
    WalkEnd,
    /// Nothing came before a control connection was due to ping.
    Idle,
}

impl Owner {
    /// Runs until every host confirmed the end or the transfer failed;
    /// returns whether the walk ended.
    fn run(&mut self, inputs: &Receiver<Input>, walk: Receiver<Walked>) -> bool {
        let mut walk = Some(walk);
        while self.summary.is_none() && !self.sh.stopped() {
            match self.next(inputs, walk.as_ref()) {
                Next::Input(i) => self.hear(i),
                Next::Walked(Walked::File { entry, pinned, digest, linked }) => {
                    self.offered += 1;
                    let label = self.sh.store.display(&entry.path);
                    let source = Source {
                        id: self.offered,
                        path: entry.path,
                        label,
                        meta: entry.meta.clone(),
                        ctime: entry.ctime,
                        done: AtomicBool::new(false),
                    };
                    self.sources.insert(self.offered, Arc::new(source));
                    self.session_event(Event::Offer { meta: entry.meta, digest, pinned, linked });
                }
                Next::Walked(Walked::HardLink { path, first, source }) => {
                    self.offered += 1;
                    let subject = self.sh.store.display(&source);
                    self.session_event(Event::OfferLink { path, first, subject });
                }
                Next::Walked(Walked::Dir(meta)) => self.session_event(Event::Dir(meta)),
                Next::Walked(Walked::PassedOver(e)) => self.session_event(Event::PassedOver(e)),
                Next::Walked(Walked::Error(e)) => {
                    let e = FileError { path: e.subject, kind: e.kind, message: e.message };
                    self.session_event(Event::WalkError(e));
                }
                Next::WalkEnd => {
                    walk = None;
                    self.sh.progress.walk_done.store(true, Ordering::Relaxed);
                    self.session_event(Event::WalkDone);
                }
                Next::Idle => {}
            }
            // However long a run of inputs lasts, the receivers hear from us.
            self.keep_alive();
        }
        self.flush();
        walk.is_none()
    }

    /// The next thing to do: what the workers and receivers said first; a
    /// walked file only while the session takes one. Before waiting, the
    /// messages queued go out together; the wait ends when a control
    /// connection is due to ping (see [`FrameWriter::keep_alive`]).
    fn next(&mut self, inputs: &Receiver<Input>, walk: Option<&Receiver<Walked>>) -> Next {
        if let Ok(i) = inputs.try_recv() {
            return Next::Input(i);
        }
        let walk = walk.filter(|_| self.session.wants_file());
        if let Some(w) = walk {
            match w.try_recv() {
                Ok(x) => return Next::Walked(x),
                Err(TryRecvError::Disconnected) => return Next::WalkEnd,
                Err(TryRecvError::Empty) => {}
            }
        }
        self.flush();
        let every = self.sh.ping_every;
        let hosts = 0..self.ctl.len();
        let due = hosts.filter(|&h| self.pings(h)).map(|h| self.ctl[h].ping_due(every)).min();
        let due = due.unwrap_or_else(|| Instant::now() + every);
        let held = "the owner holds a sender";
        match walk {
            None => match inputs.recv_deadline(due) {
                Ok(i) => Next::Input(i),
                Err(RecvTimeoutError::Timeout) => Next::Idle,
                Err(RecvTimeoutError::Disconnected) => unreachable!("{held}"),
            },
            Some(w) => crossbeam_channel::select! {
                recv(inputs) -> i => Next::Input(i.expect(held)),
                recv(w) -> x => x.map_or(Next::WalkEnd, Next::Walked),
                default(due.saturating_duration_since(Instant::now())) => Next::Idle,
            },
        }
    }

    /// Whether `host`'s control connection is kept alive: until `Finish`
    /// goes to it, after which nothing more may.
    fn pings(&self, host: usize) -> bool {
        !self.sh.hosts[host].finished.load(Ordering::SeqCst)
    }

    /// Pings each host whose control connection was quiet for a while.
    fn keep_alive(&mut self) {
        if self.sh.stopped() {
            return;
        }
        for host in 0..self.ctl.len() {
            if !self.pings(host) {
                continue;
            }
            if let Err(e) = self.ctl[host].keep_alive(self.sh.ping_every) {
                self.fail(e);
            }
        }
    }

    fn hear(&mut self, i: Input) {
        match i {
            Input::Session(e) => self.session_event(e),
            Input::Batch(es) => es.into_iter().for_each(|e| self.session_event(e)),
            Input::Broken(e) => self.fail(e),
        }
    }

    /// Gives the session an event and carries out what it says.
    fn session_event(&mut self, e: Event) {
        self.session.handle(e);
        while let Some(a) = self.session.poll() {
            self.act(a);
        }
    }

    fn act(&mut self, a: Action) {
        match a {
            // Nothing more goes out once the transfer failed.
            Action::Send { .. } | Action::Read(_) if self.sh.stopped() => {}
            Action::Send { host, msg } => {
                match &msg {
                    ToReceiver::Announce { meta, .. } => {
                        Progress::add(&self.sh.progress.total_files, 1);
                        Progress::add(&self.sh.progress.total_bytes, meta.size);
                    }
                    ToReceiver::HardLink { .. } => Progress::add(&self.sh.progress.total_files, 1),
                    _ => {}
                }
                if let ToReceiver::Finish { .. } = msg {
                    // Marked before `Finish` is queued: no ping follows it.
                    self.sh.hosts[host].finished.store(true, Ordering::SeqCst);
                }
                let probe = matches!(msg, ToReceiver::Echo { .. });
                let w = &mut self.ctl[host];
                // A probe goes at once: its answer times the round trip.
                let written = if probe { w.send(msg) } else { w.queue(msg) };
                self.queued[host] |= !probe;
                if let Err(e) = written {
                    self.fail(e);
                }
            }
            Action::Read(read) => {
                let source = self.sources.get(&read.id).expect("files read are in flight").clone();
                // The readers live as long as the owner, so the channel is open.
                let _ = self.jobs.send(Job { source, read });
            }
            Action::Settle { id, host, meta, outcome } => {
                if let Some(s) = self.sources.remove(&id) {
                    s.done.store(true, Ordering::SeqCst);
                }
                let how = match &outcome {
                    Outcome::Sent => Settled::Sent,
                    Outcome::Skipped => Settled::Skipped,
                    Outcome::PassedOver(e) => {
                        log::info!("{}: {}", e.path, e.message);
                        Settled::PassedOver(e)
                    }
                    Outcome::Failed(e) => {
                        log::info!("{}: {}", e.path, e.message);
                        Settled::Failed(e)
                    }
                };
                if !matches!(how, Settled::Failed(_)) {
                    Progress::add(&self.sh.progress.done_files, 1);
                    Progress::add(&self.sh.progress.done_bytes, meta.size);
                }
                if matches!(how, Settled::Skipped) {
                    Progress::add(&self.sh.progress.skipped_files, 1);
                    Progress::add(&self.sh.progress.skipped_bytes, meta.size);
                }
                if let Some(hook) = &self.hook {
                    hook(&meta, host, how);
                }
            }
            Action::Complete(s) => self.summary = Some(s),
            Action::Violation { host, why } => self.fail(Error::protocol(&self.peers[host], why)),
            Action::PeerFailed { host, kind, message } => self.fail(Error::new(kind, &self.peers[host], message)),
            Action::Unreadable { host, kind, subject, message } => {
                let message = format!("{message} (a block {} asked for again after the end of the transfer)", self.peers[host]);
                self.fail(Error::new(kind, subject, message));
            }
        }
    }

    /// Writes the messages queued for each host.
    fn flush(&mut self) {
        for host in 0..self.ctl.len() {
            if std::mem::take(&mut self.queued[host]) {
                let flushed = self.ctl[host].flush();
                if let Err(e) = flushed {
                    self.fail(e);
                }
            }
        }
    }

    /// Ends the transfer with `e`. The first error wins, except that a lost
    /// connection gives way to the reason the peer gave for closing it; a
    /// connection lost once the transfer is stopping is no error.
    fn fail(&mut self, e: Error) {
        let lost = e.kind == ErrorKind::Unreachable;
        if lost && self.sh.stopped() {
            return;
        }
        if self.fatal.as_ref().is_none_or(|old| old.kind == ErrorKind::Unreachable && !lost) {
            self.fatal = Some(e);
        }
        self.sh.stop.raise();
        self.sh.crew.close_all();
        if lost {
            // A receiver that fails closes the data connections first and
            // says why on the control connection: read on there a little
            // longer rather than cut the reason off.
            self.controls.iter().for_each(|c| {
                let _ = c.set_read_timeout(Some(REASON_WAIT));
            });
        } else {
            self.controls.iter().for_each(|c| c.close());
        }
        self.sh.pool.close();
    }
}
