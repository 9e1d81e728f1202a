//! A transfer agent (`dmover agent`, one per Slurm task).
//!
//! An agent is long-lived: it connects to the manager once, then runs an
//! engine session to the destination hosts (one control connection and
//! `streams` data connections to each) — or, with a command template,
//! [`crate::command`]'s workers — and feeds it the files it pulls from the
//! manager, a batch at a time, keeping up to a window of files in flight;
//! each file goes to the host the manager chose for it. The engine reads
//! the files from the job's source storage (the file system, or an S3
//! bucket reached with the agent's own credentials). The
//! engine tells it each file's outcome as the file settles
//! ([`dmover_engine::send::Files::Feed`]); the agent passes the outcomes on
//! with its next request. If the session fails (a destination restarted, a
//! network error), the files it held are reported failed, so the manager
//! gives them to other agents (untried, costing no attempt, when the
//! session moved nothing), and the agent opens a new session after a
//! backoff; after [`OPEN_RETRIES`] failed openings in a row (a session
//! that moved nothing counts as one) it gives up
//! and exits.

use crate::channel::{Channel, Failure, FileResult, ToAgent, ToManager, WorkItem};
use crate::command::Runner;
use crate::Plan;
use crossbeam_channel::Sender;
use dmover_engine::progress::Progress;
use dmover_engine::retry::backoff;
use dmover_engine::send::{self, FedFile, Files, SendConfig, SettleHook, Settled};
use dmover_engine::session;
use dmover_engine::source::Entry;
use dmover_engine::transport::SocketOptions;
use dmover_engine::{Error, Result};
use dmover_proto::frame::{FileMeta, Stats};
use dmover_proto::ErrorKind;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The environment variable that carries the run's token to the agents.
pub const TOKEN_ENV: &str = "DMOVER_AGENT_TOKEN";
/// Longest wait between two requests to the manager.
const POLL: Duration = Duration::from_millis(200);
/// How long the manager may take to answer.
const MANAGER_TIMEOUT: Duration = Duration::from_secs(60);
/// Idle timeout of the agent's connections to the destinations.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Failed session openings in a row after which the agent gives up.
const OPEN_RETRIES: u32 = 5;

/// Where an agent reports and who it is.
pub struct AgentSpec {
    /// The manager's `host:port`.
    pub manager: String,
    /// The run's token.
    pub token: Vec<u8>,
    /// The node it runs on, and its task number there.
    pub node: String,
    pub task: u32,
}

/// Files in flight and outcomes not yet reported; the engine's threads
/// (through the settle hook) and the agent's loop share it.
#[derive(Default)]
struct Held {
    files: HashMap<String, WorkItem>,
    results: Vec<FileResult>,
    /// The open session has settled a file (sent, skipped or failed).
    settled_any: bool,
}

struct Book {
    held: Mutex<Held>,
    /// Signalled when an outcome arrives.
    settled: Condvar,
}

impl Book {
    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().expect("held lock")
    }

    /// Every file held fails with `e` (its session ended): untried if the
    /// session settled none and could not reach its destination (a server
    /// busy with other agents' connections, say), so that they cost no
    /// attempt of their own. Returns whether the session had settled any.
    fn fail_all(&self, e: &Error) -> bool {
        let mut h = self.lock();
        let untried = !h.settled_any && e.kind == ErrorKind::Unreachable;
        let failed: Vec<String> = h.files.drain().map(|(p, _)| p).collect();
        for path in failed {
            h.results.push(FileResult { path, host: None, skipped: false, error: Some(Failure::of(e)), untried });
        }
        std::mem::take(&mut h.settled_any)
    }
}

/// What the agent feeds its files to.
enum Session {
    /// An engine session to the destination hosts.
    Native { feed: Sender<FedFile>, engine: JoinHandle<Result<Stats>> },
    /// Workers running the agent command.
    Command(Runner),
}

impl Session {
    /// Whether it ended by itself (an engine session that failed).
    fn ended(&self) -> bool {
        match self {
            Session::Native { engine, .. } => engine.is_finished(),
            Session::Command(_) => false,
        }
    }

    /// Hands it a file; false if it can take no more.
    fn give(&self, plan: &Plan, w: &WorkItem) -> bool {
        match self {
            Session::Native { feed, .. } => feed.send(FedFile { entry: entry(plan, w), host: Some(w.host as usize) }).is_ok(),
            Session::Command(r) => r.feed.send(w.clone()).is_ok(),
        }
    }

    /// Closes the feed and waits for the outcome: whether the destination's
    /// set digests matched the source's (command agents have none to compare).
    fn end(self) -> Result<bool> {
        match self {
            Session::Native { feed, engine } => {
                drop(feed);
                let stats = engine.join().unwrap_or_else(|_| Err(Error::internal("the engine panicked")))?;
                Ok(stats.digests_match)
            }
            Session::Command(r) => {
                r.end();
                Ok(true)
            }
        }
    }
}

/// Files an agent keeps in flight: enough for every reader and stream to
/// have work while the next batch is on its way, few enough that a lost
/// agent leaves little to redo.
fn window(plan: &Plan) -> usize {
    (2 * plan.concurrency as usize * plan.hosts.len().max(1)).clamp(8, 256)
}

/// Opens a session whose bytes count in `progress` (the agent's, over all
/// its sessions): as the engine sends them, or a file's size when a
/// command has sent it.
fn open_session(plan: &Plan, book: &Arc<Book>, transfer_id: [u8; 16], progress: &Arc<Progress>) -> Result<Session> {
    if let Some(cmd) = &plan.command {
        let (b, progress) = (book.clone(), progress.clone());
        let report = Arc::new(move |r: FileResult| {
            let mut h = b.lock();
            if let Some(w) = h.files.remove(&r.path) {
                h.settled_any = true;
                if r.error.is_none() && !r.skipped {
                    Progress::add(&progress.sent_bytes, w.size);
                }
                h.results.push(r);
            }
            drop(h);
            b.settled.notify_all();
        });
        return Ok(Session::Command(Runner::start(plan, cmd, report)));
    }
    let options = plan.options(transfer_id);
    let links = session::receive_links(&plan.creds, &plan.dest, options, plan.streams as usize, &SocketOptions::default())?;
    let (feed, entries) = crossbeam_channel::unbounded();
    let (b, hosts) = (book.clone(), plan.hosts.clone());
    let settled: SettleHook = Arc::new(move |meta: &FileMeta, host: usize, how: Settled<'_>| {
        let mut h = b.lock();
        if h.files.remove(&meta.path).is_none() {
            return;
        }
        let (skipped, error) = match how {
            Settled::Sent => (false, None),
            Settled::Skipped => (true, None),
            // A job lists no symlinks or devices for a receiver to pass
            // over; a file one passes over anyway is not at the destination.
            Settled::Failed(e) | Settled::PassedOver(e) => {
                (false, Some(Failure { kind: e.kind, message: format!("{}: {}", e.path, e.message) }))
            }
        };
        h.settled_any = true;
        h.results.push(FileResult { path: meta.path.clone(), host: hosts.get(host).cloned(), skipped, error, untried: false });
        drop(h);
        b.settled.notify_all();
    });
    let cfg = SendConfig {
        options,
        concurrency: plan.concurrency as usize,
        staging: plan.staging,
        idle_timeout: IDLE_TIMEOUT,
        progress: progress.clone(),
        bwlimit: plan.bwlimit,
        tuner: None,
    };
    let store = plan.source.clone();
    let engine = std::thread::spawn(move || send::send(Files::Feed { store, entries, settled }, links, cfg));
    Ok(Session::Native { feed, engine })
}

/// Finishes transfer `transfer_id` at every destination host without
/// sending a file: each receiver then removes the transfer's marker from
/// `.dmover-partial/`, where an agent lost in the middle of it left it.
pub fn finish_transfer(plan: &Plan, transfer_id: [u8; 16]) -> Result<()> {
    let options = plan.options(transfer_id);
    let links = session::receive_links(&plan.creds, &plan.dest, options, 1, &SocketOptions::default())?;
    // No file will come: the feed is closed from the start.
    let (_, entries) = crossbeam_channel::unbounded();
    let settled: SettleHook = Arc::new(|_: &FileMeta, _: usize, _: Settled<'_>| {});
    let cfg = SendConfig {
        options,
        concurrency: 1,
        staging: plan.staging,
        idle_timeout: IDLE_TIMEOUT,
        progress: Arc::new(Progress::default()),
        bwlimit: 0,
        tuner: None,
    };
    send::send(Files::Feed { store: plan.source.clone(), entries, settled }, links, cfg).map(drop)
}

fn entry(plan: &Plan, w: &WorkItem) -> Entry {
    Entry {
        // A spelling the manager made (a bad one names no file, and fails).
        path: plan.source_root.join(dmover_proto::path::to_path(&w.path).unwrap_or_else(|_| w.path.clone().into())),
        meta: FileMeta { path: w.path.clone(), size: w.size, mtime_s: w.mtime_s, mtime_ns: w.mtime_ns, mode: w.mode, ..Default::default() },
        ctime: w.ctime,
        owner: None,
        inode: None,
    }
}

/// Runs an agent until the manager says the job is finished.
pub fn run(spec: &AgentSpec, plan: &Plan) -> Result<()> {
    // A manager busy with many agents at once may turn one away: try again.
    let mut tries = 0;
    let mut chan = loop {
        match Channel::connect(&spec.manager, &spec.token) {
            Ok(c) => break c,
            Err(e) if e.is_transient() && tries < OPEN_RETRIES => {
                log::info!("{e}; connecting again");
                std::thread::sleep(backoff(tries));
                tries += 1;
            }
            Err(e) => return Err(e),
        }
    };
    chan.set_timeout(Some(MANAGER_TIMEOUT))?;
    let hello = ToManager::Hello { node: spec.node.clone(), task: spec.task, pid: std::process::id() };
    let id = match chan.request(&hello)? {
        ToAgent::Welcome { agent } => agent,
        m => return Err(Error::protocol(chan.peer(), format!("expected welcome, got {m:?}"))),
    };
    log::info!("agent {id} (task {} on {}) connected to {}", spec.task, spec.node, spec.manager);
    let book = Arc::new(Book { held: Mutex::default(), settled: Condvar::new() });
    let window = window(plan);
    let mut session: Option<Session> = None;
    // The transfer id of the open engine session, reported to the manager.
    let mut transfer: Option<[u8; 16]> = None;
    let mut failed_opens = 0u32;
    let mut next_open = Instant::now();
    let mut digests_match = true;
    let progress = Arc::new(Progress::default());
    loop {
        // A session that ended by itself failed: its files go back.
        if session.as_ref().is_some_and(Session::ended) {
            let e = match session.take().expect("checked").end() {
                Ok(_) => Error::internal("the engine session ended early"),
                Err(e) => e,
            };
            log::warn!("agent {id}: session ended: {e}");
            transfer = None;
            // A session that moved nothing counts as a failed opening: an
            // agent whose destination keeps turning it away stops.
            if book.fail_all(&e) {
                failed_opens = 0;
                next_open = Instant::now() + backoff(0);
            } else {
                failed_opens += 1;
                if failed_opens >= OPEN_RETRIES {
                    let _ = chan.send(&ToManager::Stopping { error: Failure::of(&e) });
                    return Err(e);
                }
                next_open = Instant::now() + backoff(failed_opens - 1);
            }
        }
        let (results, held) = {
            let mut h = book.lock();
            (std::mem::take(&mut h.results), h.files.len())
        };
        // No work is asked for while a failed session is backing off.
        let want = if session.is_some() || Instant::now() >= next_open { window.saturating_sub(held) } else { 0 };
        let sent_bytes = progress.sent_bytes.load(std::sync::atomic::Ordering::Relaxed);
        let (files, finished) = match chan.request(&ToManager::Sync { results, want: want as u32, session: transfer, sent_bytes })? {
            ToAgent::Work { files, finished } => (files, finished),
            m => return Err(Error::protocol(chan.peer(), format!("expected work, got {m:?}"))),
        };
        // Sessions open when there is work: an agent with nothing to do
        // (a re-run, a small job) touches no destination.
        if !files.is_empty() && session.is_none() {
            let transfer_id = dmover_engine::handshake::random();
            match open_session(plan, &book, transfer_id, &progress) {
                Ok(s) => {
                    transfer = plan.command.is_none().then_some(transfer_id);
                    session = Some(s);
                }
                Err(e) => {
                    failed_opens += 1;
                    log::warn!("agent {id}: {e} ({failed_opens} of {OPEN_RETRIES} tries)");
                    if failed_opens >= OPEN_RETRIES || !e.is_transient() {
                        // The manager gives what this agent holds to the
                        // others, and reports why it stopped.
                        let _ = chan.send(&ToManager::Stopping { error: Failure::of(&e) });
                        return Err(e);
                    }
                    next_open = Instant::now() + backoff(failed_opens - 1);
                }
            }
        }
        for w in files {
            book.lock().files.insert(w.path.clone(), w.clone());
            let given = session.as_ref().is_some_and(|s| s.give(plan, &w));
            if !given {
                // No session to take it: hand the file back at once.
                let e = Error::new(ErrorKind::Unreachable, &w.path, "the agent could not reach the destination");
                let mut h = book.lock();
                h.files.remove(&w.path);
                h.results.push(FileResult { path: w.path, host: None, skipped: false, error: Some(Failure::of(&e)), untried: true });
            }
        }
        if finished {
            if let Some(s) = session.take() {
                match s.end() {
                    Ok(matched) => digests_match &= matched,
                    Err(e) => {
                        log::warn!("agent {id}: the last session did not end cleanly: {e}");
                        digests_match = false;
                    }
                }
            }
            chan.send(&ToManager::Bye { digests_match })?;
            log::info!("agent {id} done");
            return Ok(());
        }
        // Ask again when outcomes are waiting and room is low, or after a while.
        let h = book.lock();
        let ready = |h: &Held| !h.results.is_empty() && h.files.len() <= window / 2;
        if !ready(&h) {
            let _ = book.settled.wait_timeout_while(h, POLL, |h| !ready(h)).expect("held lock");
        }
    }
}
