//! The process manager (`dmover run`).
//!
//! It lists the sources with the engine's walker in a thread (a directory
//! tree, or the objects below a key prefix of an S3 bucket), streaming the
//! files into a bounded queue (the list is never held whole) and giving each
//! its destination host by a hash of its path — as even as round-robin over
//! many files, and the same in every retry and every run, so that a file
//! sent again resumes its partial copy and never leaves a second one on
//! another host — and hands them
//! out in batches to transfer agents that connect back over the
//! authenticated [`channel`](crate::channel). Each agent asks for as many
//! files as it has room for and reports each file's outcome; the manager
//! keeps, per agent, the files it holds. A failed file goes back to the
//! queue for another agent (up to the job's `attempts`); when an agent's
//! connection ends before the job does, everything it held goes back to the
//! queue. The job is finished when the list is complete, the queue is empty
//! and no agent holds a file; then each agent is told so on its next request.
//!
//! Inside a Slurm allocation the agents are one `srun` step of
//! `dmover agent`, one per task on every node; without one they are threads
//! of this process ([`Launch`]).
//!
//! Walltime: inside an allocation the manager asks Slurm how much time is
//! left. `checkpoint_before` that end it stops handing out files, lets the
//! agents finish the ones they hold (each confirmed file is on the done
//! list at once), and ends the run as `checkpointed`; if the job file asks
//! for it, it submits the job's batch script again, and the next run sends
//! only what is not on the done list. Every confirmed file is appended to the
//! done list, so a re-run sends only the rest; progress and the final
//! report go to the [state directory](crate::state).

use crate::agent::{self, AgentSpec};
use crate::channel::{Channel, FileResult, ToAgent, ToManager, WorkItem};
use crate::jobfile::spec_path;
use crate::state::{
    AgentReport, AgentState, Check, DoneList, FailureReport, FileError, JobReport, JobState, Rate, Rates, RunRecord, Share, StateDir,
};
use crate::Plan;
use crossbeam_channel::{Receiver, TryRecvError};
use dmover_engine::history::History;
use dmover_engine::source::{self, Event};
use dmover_engine::{Error, Result};
use dmover_proto::digest::block_sum;
use dmover_proto::ErrorKind;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Files the walker may list ahead of the agents.
const LIST_AHEAD: usize = 4096;
/// Most files handed to an agent at once, whatever it asks for.
const MAX_BATCH: u32 = 1024;
/// Connections that may be in the handshake at once (agents connect once each).
/// An agent turned away tries again.
const MAX_UNAUTHENTICATED: usize = 256;
/// How often the progress file is rewritten.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);
/// An agent silent this long is taken for lost (agents ask at least every
/// few hundred milliseconds while they hold files).
const AGENT_SILENCE: Duration = Duration::from_secs(120);
/// How long agents may take to connect after they were started.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long finished agents may take to say goodbye, and the agents' step to end.
const END_WAIT: Duration = Duration::from_secs(30);

/// How the agents are started.
pub enum Launch {
    /// One `srun` step of `exe agent --manager ADDR JOB` (inside an allocation).
    Srun { exe: PathBuf },
    /// This many agents as threads of this process.
    Threads(u32),
}

/// A file waiting for an agent, or held by one.
struct Pending {
    item: WorkItem,
    /// Agents that tried it and failed.
    attempts: u32,
    /// The agent that last failed it or was lost with it: given to it again
    /// only when no other agent runs.
    avoid: Option<u32>,
}

struct AgentBook {
    /// Its counts and its state.
    report: AgentReport,
    /// Files it holds, by path.
    held: HashMap<String, Pending>,
    /// Transfer ids of the engine sessions it reported open.
    transfers: Vec<[u8; 16]>,
    /// Bytes it said it has sent, as they went.
    sent_bytes: u64,
}

/// Everything the agents' threads and the main loop share, under one lock.
struct Book {
    /// Files the walk listed and no agent took yet.
    listed: Receiver<WorkItem>,
    walk_done: bool,
    /// Past the checkpoint: no more files are handed out.
    draining: bool,
    /// Files to give out again, before new ones.
    retry: VecDeque<Pending>,
    agents: Vec<AgentBook>,
    done: DoneList,
    report: JobReport,
    nodes: BTreeMap<String, Share>,
    hosts: BTreeMap<String, Share>,
    /// Each agent session that ended normally had matching set digests.
    digests_match: bool,
    /// Bytes moved in this run (sent or found already there).
    moved_bytes: u64,
    moved_files: u64,
    /// Bytes the agents have sent, as they went (the timeline's).
    sent_bytes: u64,
}

impl Book {
    fn finished(&self) -> bool {
        self.walk_done && self.listed.is_empty() && self.retry.is_empty() && self.agents.iter().all(|a| a.held.is_empty())
    }

    /// Agents may stop: the job is finished, or drained at a checkpoint.
    fn stop_agents(&self) -> bool {
        self.finished() || (self.draining && self.agents.iter().all(|a| a.held.is_empty()))
    }

    fn running_agents(&self) -> usize {
        self.agents.iter().filter(|a| a.report.state == AgentState::Running).count()
    }

    /// Up to `want` files for agent `id`: files to retry first (not ones it
    /// failed, while another agent runs), then newly listed ones.
    fn take_work(&mut self, id: u32, want: usize) -> Vec<WorkItem> {
        if self.draining {
            return Vec::new();
        }
        let others = self.agents.iter().any(|a| a.report.id != id && a.report.state == AgentState::Running);
        let mut out = Vec::new();
        let mut i = 0;
        while out.len() < want && i < self.retry.len() {
            if others && self.retry[i].avoid == Some(id) {
                i += 1;
                continue;
            }
            out.push(self.retry.remove(i).expect("index checked"));
        }
        while out.len() < want {
            match self.listed.try_recv() {
                Ok(item) => out.push(Pending { item, attempts: 0, avoid: None }),
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => break,
            }
        }
        let agent = &mut self.agents[id as usize];
        out.into_iter()
            .map(|p| {
                let item = p.item.clone();
                agent.held.insert(p.item.path.clone(), p);
                item
            })
            .collect()
    }

    /// Records what agent `id` reports.
    fn apply(&mut self, id: u32, results: Vec<FileResult>, attempts: u32) {
        for r in results {
            let Some(mut p) = self.agents[id as usize].held.remove(&r.path) else {
                log::warn!("agent {id} reported {:?}, which it did not hold", r.path);
                continue;
            };
            match r.error {
                None => {
                    let size = p.item.size;
                    let rep = &mut self.report;
                    rep.done_files += 1;
                    rep.done_bytes += size;
                    if r.skipped {
                        rep.skipped_files += 1;
                        rep.skipped_bytes += size;
                    }
                    self.moved_files += 1;
                    self.moved_bytes += size;
                    let a = &mut self.agents[id as usize].report;
                    a.files += 1;
                    a.bytes += size;
                    let node = self.nodes.entry(a.node.clone()).or_insert_with(|| Share { name: a.node.clone(), ..Default::default() });
                    node.count += 1;
                    node.bytes += size;
                    if let Some(h) = r.host {
                        let host = self.hosts.entry(h.clone()).or_insert_with(|| Share { name: h, ..Default::default() });
                        host.count += 1;
                        host.bytes += size;
                    }
                    if let Err(e) = self.done.add(&p.item.path).and_then(|()| self.done.flush()) {
                        log::warn!("{e}: a re-run may send this file again");
                    }
                }
                // The agent's session moved nothing (its destination turned
                // it away): the file goes to another agent, its attempts untouched.
                Some(f) if r.untried => {
                    log::info!("{}: {} (not tried); giving it to another agent", p.item.path, f.message);
                    p.avoid = Some(id);
                    self.report.requeued_files += 1;
                    self.retry.push_back(p);
                }
                Some(f) => {
                    p.attempts += 1;
                    if p.attempts < attempts {
                        log::info!("{}: {} (attempt {} of {attempts}); giving it to another agent", p.item.path, f.message, p.attempts);
                        p.avoid = Some(id);
                        self.report.retried_files += 1;
                        self.retry.push_back(p);
                    } else {
                        log::warn!("{}: {} (after {} attempts)", p.item.path, f.message, p.attempts);
                        self.report.failed_files += 1;
                        let error = FileError { path: p.item.path, kind: f.kind, message: f.message };
                        self.report.failures.push(FailureReport { error, attempts: p.attempts });
                    }
                }
            }
        }
    }

    /// Agent `id` is gone: its files go back to the queue.
    fn lose(&mut self, id: u32) {
        let a = &mut self.agents[id as usize];
        if a.report.state != AgentState::Running {
            return;
        }
        a.report.state = AgentState::Lost;
        let held: Vec<Pending> = a.held.drain().map(|(_, p)| p).collect();
        log::warn!("agent {id} on {} lost with {} files; giving them to the others", a.report.node, held.len());
        self.report.requeued_files += held.len() as u64;
        for mut p in held {
            p.avoid = Some(id);
            self.retry.push_back(p);
        }
    }
}

/// The manager's shared state.
struct Manager {
    plan: Plan,
    /// The run's token: agents prove they know it.
    token: Vec<u8>,
    /// Signalled on every change of the book.
    book: Mutex<Book>,
    changed: Condvar,
    started: Instant,
    /// What this run moved, over time (the report's timeline).
    timeline: History,
}

impl Manager {
    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().expect("book lock")
    }

    /// The report as of now.
    fn snapshot(&self, b: &Book, state: JobState) -> JobReport {
        let seconds = self.started.elapsed().as_secs_f64();
        let mut r = b.report.clone();
        r.state = state;
        r.updated_unix = now_unix();
        r.seconds = seconds;
        r.walk_done = b.walk_done;
        r.rate = Rate::new(b.moved_files, b.moved_bytes, seconds);
        // Bytes as they move, and those found already there, so that a large
        // file is a steady rate rather than a spike when it settles.
        r.timeline = self.timeline.note(b.sent_bytes + r.skipped_bytes, b.moved_files);
        r.rates = Rates::of(&r.timeline);
        r.nodes = b.nodes.values().cloned().collect();
        r.hosts = b.hosts.values().cloned().collect();
        r.agents = b.agents.iter().map(|a| a.report.clone()).collect();
        // digests_match: every agent session that ended normally found the
        // destination's set digest equal to the source's.
        let failed_or_unlisted = !b.walk_done || !r.failures.is_empty();
        r.check = Check::new(failed_or_unlisted, (r.total_files, r.total_bytes), (r.done_files, r.done_bytes), b.digests_match);
        r
    }
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Runs the job to its end and returns the final report (also written to
/// the state directory). `Err` only when the job could not run at all.
pub fn run(plan: Plan, launch: Launch) -> Result<JobReport> {
    let state = StateDir::new(&plan.state_dir);
    state.create()?;
    state.clear_report();
    let earlier = state.load_done()?;
    let token: [u8; 32] = dmover_engine::handshake::random();
    let token = hex::encode(token).into_bytes();
    let (tx, listed) = crossbeam_channel::bounded::<WorkItem>(LIST_AHEAD);
    let report = JobReport {
        state: JobState::Running,
        job: plan.job.display().to_string(),
        slurm_job_id: std::env::var("SLURM_JOB_ID").ok(),
        started_unix: now_unix(),
        ..Default::default()
    };
    let mgr = Arc::new(Manager {
        book: Mutex::new(Book {
            listed,
            walk_done: false,
            draining: false,
            retry: VecDeque::new(),
            agents: Vec::new(),
            done: state.done_writer()?,
            report,
            nodes: BTreeMap::new(),
            hosts: BTreeMap::new(),
            digests_match: true,
            moved_bytes: 0,
            moved_files: 0,
            sent_bytes: 0,
        }),
        changed: Condvar::new(),
        started: Instant::now(),
        timeline: History::default(),
        token,
        plan,
    });
    {
        let mgr = mgr.clone();
        std::thread::spawn(move || list(&mgr, tx, earlier));
    }
    let in_slurm = matches!(launch, Launch::Srun { .. });
    let bind = if in_slurm { "0.0.0.0:0" } else { "127.0.0.1:0" };
    let listener = TcpListener::bind(bind).map_err(|e| Error::io(bind, &e))?;
    let port = listener.local_addr().map_err(|e| Error::io(bind, &e))?.port();
    let addr = if in_slurm { format!("{}:{port}", crate::hostname()) } else { format!("127.0.0.1:{port}") };
    {
        let mgr = mgr.clone();
        std::thread::spawn(move || accept(&mgr, listener));
    }
    let checkpoint = match &launch {
        Launch::Srun { .. } => checkpoint_at(mgr.plan.checkpoint_before),
        Launch::Threads(_) => None,
    };
    let mut agents = start_agents(&mgr, &launch, &addr)?;
    let outcome = supervise(&mgr, &state, &mut agents, checkpoint);
    let final_state = match &outcome {
        Ok(Ended::Finished) => JobState::Finished,
        Ok(Ended::Checkpointed) => JobState::Checkpointed,
        Err(_) => JobState::Failed,
    };
    let mut b = mgr.lock();
    if let Err(e) = b.done.flush() {
        log::warn!("{e}");
    }
    let mut r = mgr.snapshot(&b, final_state);
    let sent = (b.moved_files, b.moved_bytes);
    drop(b);
    if let Err(e) = &outcome {
        r.error = Some(e.to_string());
    }
    if !r.check.passed && r.state == JobState::Finished {
        r.state = JobState::Failed;
    }
    agents.end();
    if r.state == JobState::Finished {
        finish_lost_transfers(&mgr);
    }
    if r.state == JobState::Checkpointed && mgr.plan.resubmit {
        match state.script() {
            Some(script) => match crate::sbatch::submit(&script) {
                Ok(id) => {
                    log::warn!("checkpointed; submitted the job again as {id}");
                    r.resubmitted_as = Some(id);
                }
                Err(e) => r.error = Some(format!("could not submit the job again: {e}")),
            },
            None => {
                r.error = Some(format!("no {} in the state directory to submit again (submit with `dmover submit`)", crate::sbatch::SCRIPT))
            }
        }
    }
    state.add_run(&RunRecord {
        slurm_job_id: r.slurm_job_id.clone(),
        state: r.state,
        seconds: r.seconds,
        files: sent.0,
        bytes: sent.1,
        resubmitted_as: r.resubmitted_as.clone(),
    })?;
    state.write_report(&r)?;
    Ok(r)
}

/// Finishes the transfers of the agents that were lost, at every
/// destination, so that the markers they left in `.dmover-partial/` go away
/// (every file is confirmed by now, sent by the other agents).
fn finish_lost_transfers(mgr: &Manager) {
    let lost: Vec<(u32, [u8; 16])> = mgr
        .lock()
        .agents
        .iter()
        .filter(|a| a.report.state == AgentState::Lost)
        .flat_map(|a| a.transfers.iter().map(move |t| (a.report.id, *t)))
        .collect();
    for (id, t) in lost {
        match agent::finish_transfer(&mgr.plan, t) {
            Ok(()) => log::info!("finished the transfer of lost agent {id} at the destinations"),
            Err(e) => log::warn!("could not finish the transfer of lost agent {id} ({e}): its marker stays in .dmover-partial/"),
        }
    }
}

/// How a run ended, when it did not fail.
enum Ended {
    Finished,
    Checkpointed,
}

/// When to stop handing out work: `before` seconds (by default a tenth of
/// the time left, between 30 s and 10 minutes) before the allocation ends,
/// as Slurm tells it; None when the time is unlimited or unknown.
fn checkpoint_at(before: Option<u64>) -> Option<Instant> {
    let id = std::env::var("SLURM_JOB_ID").ok()?;
    let out = Command::new("squeue").args(["-h", "-j", &id, "-o", "%L"]).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let Ok(left) = crate::jobfile::parse_time(text.trim()) else {
        log::info!("time left in job {id}: {:?}; no checkpoint", text.trim());
        return None;
    };
    let before = before.unwrap_or((left / 10).clamp(30, 600));
    let after = Duration::from_secs(left.saturating_sub(before));
    log::info!("{left} s left in job {id}: checkpoint in {} s", after.as_secs());
    Some(Instant::now() + after)
}

/// The walker's thread: lists the files, skipping those an earlier run
/// confirmed and any listed twice by overlapping sources.
fn list(mgr: &Manager, tx: crossbeam_channel::Sender<WorkItem>, earlier: HashSet<String>) {
    let root = &mgr.plan.source_root;
    let specs: Vec<String> = mgr.plan.sources.iter().map(|s| spec_path(root, s)).collect();
    // Only overlapping sources can list a file twice; one walk never does,
    // and then no set of names is kept.
    let overlap = mgr.plan.sources.len() > 1;
    let mut seen = HashSet::new();
    let hosts = mgr.plan.hosts.len().max(1) as u128;
    source::walk(mgr.plan.source.as_ref(), &specs, &mut |ev| match ev {
        Event::File(e) => {
            let rel = e.path.strip_prefix(root).map(|p| dmover_proto::path::from_path(p).into_owned()).unwrap_or(e.meta.path.clone());
            if overlap && !seen.insert(rel.clone()) {
                return true;
            }
            let host = (u128::from_be_bytes(block_sum(rel.as_bytes())) % hosts) as u32;
            let item = WorkItem {
                path: rel,
                size: e.meta.size,
                mtime_s: e.meta.mtime_s,
                mtime_ns: e.meta.mtime_ns,
                mode: e.meta.mode,
                ctime: e.ctime,
                host,
            };
            let mut b = mgr.lock();
            b.report.total_files += 1;
            b.report.total_bytes += item.size;
            if earlier.contains(&item.path) {
                b.report.done_files += 1;
                b.report.done_bytes += item.size;
                b.report.earlier_files += 1;
                b.report.earlier_bytes += item.size;
                return true;
            }
            drop(b);
            mgr.changed.notify_all();
            tx.send(item).is_ok()
        }
        Event::Error(e) => {
            log::warn!("{e}");
            let mut b = mgr.lock();
            b.report.failed_files += 1;
            let error = FileError { path: e.subject.clone(), kind: e.kind, message: e.message };
            b.report.failures.push(FailureReport { error, attempts: 0 });
            true
        }
        Event::Link(e) => {
            log::warn!("{}: symbolic link skipped", dmover_proto::path::printable(&e.meta.path));
            true
        }
        Event::Special(e) => {
            log::warn!("{}: device, FIFO or socket skipped", dmover_proto::path::printable(&e.meta.path));
            true
        }
        // A job's agents make directories as their files need them.
        Event::Dir(_) => true,
    });
    drop(tx);
    mgr.lock().walk_done = true;
    mgr.changed.notify_all();
}

fn accept(mgr: &Arc<Manager>, listener: TcpListener) {
    // Connections not yet authenticated; beyond MAX_UNAUTHENTICATED new
    // ones are closed at once, so a flood cannot pile up threads.
    let pending = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        if pending.load(Ordering::SeqCst) >= MAX_UNAUTHENTICATED {
            log::warn!("refused {peer}: too many connections waiting to authenticate");
            continue;
        }
        let _ = conn.set_nodelay(true);
        pending.fetch_add(1, Ordering::SeqCst);
        let (mgr, pending) = (mgr.clone(), pending.clone());
        std::thread::spawn(move || {
            let c = Channel::accept(Box::new(conn), &mgr.token);
            pending.fetch_sub(1, Ordering::SeqCst);
            match c {
                Ok(c) => serve_agent(&mgr, c),
                Err(e) => log::warn!("refused {peer}: {e}"),
            }
        });
    }
}

/// Serves one agent's connection until it says goodbye or is lost.
fn serve_agent(mgr: &Manager, mut c: Channel) {
    let id = match c.set_timeout(Some(AGENT_SILENCE)).and_then(|()| c.recv::<ToManager>()) {
        Ok(ToManager::Hello { node, task, pid }) => {
            let mut b = mgr.lock();
            let id = b.agents.len() as u32;
            log::info!("agent {id}: task {task} on {node}, pid {pid}");
            b.agents.push(AgentBook {
                report: AgentReport { id, node, task, pid, state: AgentState::Running, files: 0, bytes: 0, error: None },
                held: HashMap::new(),
                transfers: Vec::new(),
                sent_bytes: 0,
            });
            id
        }
        Ok(m) => {
            log::warn!("{}: expected hello, got {m:?}", c.peer());
            return;
        }
        Err(e) => {
            log::warn!("{e}");
            return;
        }
    };
    mgr.changed.notify_all();
    let mut answer = ToAgent::Welcome { agent: id };
    loop {
        if let Err(e) = c.send(&answer) {
            log::warn!("agent {id}: {e}");
            break;
        }
        match c.recv::<ToManager>() {
            Ok(ToManager::Sync { results, want, session, sent_bytes }) => {
                let mut b = mgr.lock();
                let a = &mut b.agents[id as usize];
                if let Some(t) = session.filter(|t| !a.transfers.contains(t)) {
                    a.transfers.push(t);
                }
                let more = sent_bytes.saturating_sub(a.sent_bytes);
                a.sent_bytes += more;
                b.sent_bytes += more;
                b.apply(id, results, mgr.plan.attempts);
                let files = b.take_work(id, want.min(MAX_BATCH) as usize);
                let finished = files.is_empty() && b.stop_agents();
                drop(b);
                mgr.changed.notify_all();
                answer = ToAgent::Work { files, finished };
            }
            Ok(ToManager::Bye { digests_match }) => {
                let mut b = mgr.lock();
                b.digests_match &= digests_match;
                let a = &mut b.agents[id as usize];
                if a.held.is_empty() {
                    a.report.state = AgentState::Finished;
                } else {
                    b.lose(id);
                }
                drop(b);
                mgr.changed.notify_all();
                return;
            }
            Ok(ToManager::Stopping { error }) => {
                log::warn!("agent {id} stops: {}", error.message);
                mgr.lock().agents[id as usize].report.error = Some(error.message);
                break;
            }
            Ok(m) => {
                log::warn!("agent {id}: unexpected {m:?}");
                break;
            }
            Err(e) => {
                log::warn!("agent {id}: {e}");
                break;
            }
        }
    }
    c.close();
    mgr.lock().lose(id);
    mgr.changed.notify_all();
}

/// The agents as started: a child `srun`, or threads.
struct Agents {
    srun: Option<Child>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Agents {
    /// Whether every agent process or thread has ended.
    fn all_ended(&mut self) -> bool {
        match &mut self.srun {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            None => self.threads.iter().all(|t| t.is_finished()),
        }
    }

    /// Waits a while for the agents to end, then stops the step.
    fn end(&mut self) {
        let deadline = Instant::now() + END_WAIT;
        while !self.all_ended() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Some(c) = &mut self.srun {
            if matches!(c.try_wait(), Ok(None)) {
                log::warn!("the agents' step did not end; stopping it");
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn start_agents(mgr: &Arc<Manager>, launch: &Launch, addr: &str) -> Result<Agents> {
    match launch {
        Launch::Srun { exe } => {
            let child = Command::new("srun")
                .args(["--kill-on-bad-exit=0", "--job-name=dmover-agents"])
                .arg(exe)
                .args(["agent", "--manager", addr])
                .arg(&mgr.plan.job)
                .env(agent::TOKEN_ENV, String::from_utf8_lossy(&mgr.token).into_owned())
                .spawn()
                .map_err(|e| Error::new(ErrorKind::NotFound, "srun", format!("cannot start the agents with srun: {e}")))?;
            Ok(Agents { srun: Some(child), threads: Vec::new() })
        }
        Launch::Threads(n) => {
            let threads = (0..*n)
                .map(|task| {
                    let spec = AgentSpec { manager: addr.to_string(), token: mgr.token.clone(), node: crate::hostname(), task };
                    let plan = mgr.plan.clone();
                    std::thread::spawn(move || {
                        if let Err(e) = agent::run(&spec, &plan) {
                            log::warn!("agent {task}: {e}");
                        }
                    })
                })
                .collect();
            Ok(Agents { srun: None, threads })
        }
    }
}

/// Waits until the job is finished or drained at the checkpoint (and the
/// agents have said goodbye), or cannot go on; rewrites the progress file as
/// it goes.
fn supervise(mgr: &Manager, state: &StateDir, agents: &mut Agents, checkpoint: Option<Instant>) -> Result<Ended> {
    let started = Instant::now();
    let mut finished_at: Option<Instant> = None;
    let mut last_progress = Instant::now() - PROGRESS_EVERY;
    loop {
        let b = mgr.lock();
        let (mut b, _) = mgr.changed.wait_timeout(b, Duration::from_millis(100)).expect("book lock");
        if last_progress.elapsed() >= PROGRESS_EVERY {
            // The done list reaches the file at least as often as the progress.
            if let Err(e) = b.done.flush() {
                log::warn!("{e}");
            }
            let r = mgr.snapshot(&b, JobState::Running);
            if let Err(e) = state.write_progress(&r) {
                log::warn!("{e}");
            }
            last_progress = Instant::now();
        }
        if checkpoint.is_some_and(|c| Instant::now() >= c) && !b.draining && !b.finished() {
            log::warn!("the time limit is near: checkpointing (the agents finish the files they hold)");
            b.draining = true;
        }
        let finished = b.finished();
        let stopping = b.stop_agents();
        let running = b.running_agents();
        let connected = b.agents.len();
        let left = b.report.total_files.saturating_sub(b.report.done_files + b.report.failed_files);
        drop(b);
        if stopping {
            let at = *finished_at.get_or_insert_with(Instant::now);
            if running == 0 || at.elapsed() > END_WAIT {
                return Ok(if finished { Ended::Finished } else { Ended::Checkpointed });
            }
            continue;
        }
        if running == 0 && agents.all_ended() {
            let last = mgr.lock().agents.iter().rev().find_map(|a| a.report.error.clone());
            let msg = match last {
                Some(e) => format!("every transfer agent ended with {left} files left; the last error: {e}"),
                None => format!("every transfer agent ended with {left} files left"),
            };
            let advice = "fix the cause, then re-run the job to send the rest (`dmover status` lists each agent's last error)";
            return Err(Error::new(ErrorKind::Unreachable, "", msg).advised(advice));
        }
        if connected == 0 && started.elapsed() > START_TIMEOUT {
            let msg = format!(
                "no transfer agent connected within {} s; see the agents' messages above (can the nodes reach this host?)",
                START_TIMEOUT.as_secs()
            );
            return Err(Error::new(ErrorKind::Unreachable, "", msg));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Failure;

    fn item(p: &str) -> WorkItem {
        WorkItem { path: p.into(), size: 10, mtime_s: 0, mtime_ns: 0, mode: 0o644, ctime: (0, 0), host: 0 }
    }

    fn book(dir: &std::path::Path, files: &[&str]) -> Book {
        let (tx, listed) = crossbeam_channel::unbounded();
        for f in files {
            tx.send(item(f)).unwrap();
        }
        Book {
            listed,
            walk_done: true,
            draining: false,
            retry: VecDeque::new(),
            agents: Vec::new(),
            done: StateDir::new(dir).done_writer().unwrap(),
            report: JobReport { total_files: files.len() as u64, total_bytes: 10 * files.len() as u64, ..Default::default() },
            nodes: BTreeMap::new(),
            hosts: BTreeMap::new(),
            digests_match: true,
            moved_bytes: 0,
            moved_files: 0,
            sent_bytes: 0,
        }
    }

    fn add_agent(b: &mut Book, node: &str) -> u32 {
        let id = b.agents.len() as u32;
        let report = AgentReport { id, node: node.into(), task: id, pid: 1, state: AgentState::Running, files: 0, bytes: 0, error: None };
        b.agents.push(AgentBook { report, held: HashMap::new(), transfers: Vec::new(), sent_bytes: 0 });
        id
    }

    fn ok(p: &str) -> FileResult {
        FileResult { path: p.into(), host: Some("h1".into()), skipped: false, error: None, untried: false }
    }

    fn failed(p: &str) -> FileResult {
        FileResult {
            path: p.into(),
            host: None,
            skipped: false,
            error: Some(Failure { kind: ErrorKind::Verify, message: "damaged".into() }),
            untried: false,
        }
    }

    #[test]
    fn a_file_given_back_untried_keeps_its_attempts() {
        let t = tempfile::tempdir().unwrap();
        let mut b = book(t.path(), &["a"]);
        let (x, y) = (add_agent(&mut b, "n1"), add_agent(&mut b, "n2"));
        for i in 0..6 {
            // The other agent is preferred for it each time.
            let who = if i % 2 == 0 { x } else { y };
            assert_eq!(b.take_work(who, 1), [item("a")]);
            b.apply(who, vec![FileResult { untried: true, ..failed("a") }], 2);
        }
        assert_eq!((b.report.failed_files, b.report.retried_files, b.report.requeued_files), (0, 0, 6));
        // It still has both attempts.
        assert_eq!(b.take_work(x, 1), [item("a")]);
        b.apply(x, vec![failed("a")], 2);
        assert_eq!(b.report.failed_files, 0, "one attempt of two used");
        assert_eq!(b.take_work(y, 1), [item("a")]);
        b.apply(y, vec![ok("a")], 2);
        assert!(b.finished());
    }

    #[test]
    fn a_failed_file_goes_to_another_agent_until_attempts_run_out() {
        let t = tempfile::tempdir().unwrap();
        let mut b = book(t.path(), &["a", "b"]);
        let (x, y) = (add_agent(&mut b, "n1"), add_agent(&mut b, "n2"));
        assert_eq!(b.take_work(x, 1), [item("a")]);
        b.apply(x, vec![failed("a")], 2);
        assert_eq!(b.report.retried_files, 1);
        // x failed "a": it gets the next new file, y gets "a".
        assert_eq!(b.take_work(x, 5), [item("b")]);
        assert_eq!(b.take_work(y, 5), [item("a")]);
        b.apply(y, vec![failed("a")], 2);
        assert_eq!(b.report.failed_files, 1, "two attempts used up");
        assert_eq!(b.report.failures[0].attempts, 2);
        assert_eq!(b.report.failures[0].error.kind, ErrorKind::Verify);
        b.apply(x, vec![ok("b")], 2);
        assert!(b.finished());
        assert_eq!((b.report.done_files, b.nodes["n1"].count, b.hosts["h1"].count), (1, 1, 1));
    }

    #[test]
    fn a_lost_agents_files_go_to_the_others_and_the_job_waits_for_them() {
        let t = tempfile::tempdir().unwrap();
        let mut b = book(t.path(), &["a", "b", "c"]);
        let (x, y) = (add_agent(&mut b, "n1"), add_agent(&mut b, "n2"));
        assert_eq!(b.take_work(x, 2).len(), 2);
        assert_eq!(b.take_work(y, 1), [item("c")]);
        b.apply(y, vec![ok("c")], 3);
        assert!(!b.finished(), "x still holds files");
        b.lose(x);
        assert_eq!((b.report.requeued_files, b.running_agents()), (2, 1));
        assert!(!b.finished());
        let mut again = b.take_work(y, 5);
        again.sort_by(|p, q| p.path.cmp(&q.path));
        assert_eq!(again, [item("a"), item("b")]);
        b.apply(y, vec![ok("a"), ok("b"), ok("unknown")], 3);
        assert!(b.finished());
        assert_eq!(b.report.done_files, 3);
        b.done.flush().unwrap();
        assert_eq!(StateDir::new(t.path()).load_done().unwrap().len(), 3);
    }

    #[test]
    fn at_a_checkpoint_no_more_work_goes_out_and_agents_stop_once_drained() {
        let t = tempfile::tempdir().unwrap();
        let mut b = book(t.path(), &["a", "b", "c"]);
        let x = add_agent(&mut b, "n1");
        assert_eq!(b.take_work(x, 1), [item("a")]);
        b.draining = true;
        assert!(b.take_work(x, 5).is_empty());
        assert!(!b.stop_agents(), "agent x still holds a file");
        b.apply(x, vec![ok("a")], 3);
        assert!(b.stop_agents() && !b.finished(), "drained, not finished: b and c are left");
    }

    #[test]
    fn the_last_agent_gets_a_file_it_failed_before() {
        let t = tempfile::tempdir().unwrap();
        let mut b = book(t.path(), &["a"]);
        let (x, y) = (add_agent(&mut b, "n1"), add_agent(&mut b, "n2"));
        assert_eq!(b.take_work(x, 1), [item("a")]);
        b.apply(x, vec![failed("a")], 3);
        assert!(b.take_work(x, 1).is_empty(), "another agent runs");
        b.lose(y);
        assert_eq!(b.take_work(x, 1), [item("a")], "no other agent left");
    }
}
