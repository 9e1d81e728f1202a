//! The queue manager: one background thread per producer that sends what
//! the simulation wrote, keeps track of where every block is, and never
//! lets a block go before a sink has acknowledged it.
//!
//! Everything reaches the manager as an [`Event`] on one channel — blocks
//! and step ends from the writer, acknowledgements and failures from the
//! connections — and only the manager's thread touches its state, so there
//! is no lock to order. Every [`TICK`] it asks the [`Policy`] how many data
//! connections to keep and whether to fetch spilled blocks back.
//!
//! A *link* is a streaming session on one destination: a control
//! connection (the manager writes `StepEnd` and `Ping`; a reader thread
//! turns `Acked`, `Nack` and `StepSaved` into events) and data connections,
//! each a thread that takes blocks from the link's work channel. There is
//! one link per copy wanted ([`Config::replicas`], 1 by default), to the
//! most preferred destinations that are up, and every block goes to each.
//! When any connection of a link fails the link is down: the blocks it had
//! not confirmed stay in memory and go to the link the manager opens to
//! the next destination (failover). A destination that failed is tried
//! again after [`RETRY_DOWN`], once the others have failed too.
//!
//! A step is settled when each of its blocks is acknowledged somewhere and
//! a sink has saved its manifest (`StepSaved`), complete: its `StepEnd`
//! says where each block is, so a sink that took over midway records the
//! blocks its predecessor holds, and the manager then fetches those back
//! and sends them on, so that the step is whole at one sink (`gather`).
//! With replicas, it is settled once `replicas` live sinks hold it whole.
//!
//! While no destination is reachable, blocks waiting in memory go to the
//! spill file, so that nothing the simulation ended sits only in memory.
//! The producer's manifest stays on disk as the stream goes: rewritten
//! atomically (temporary name, then rename) when blocks spill, steps end
//! or sinks acknowledge, in batches at most every [`MANIFEST_EVERY`], by
//! this thread, never the simulation's. A producer killed before close
//! leaves a manifest that `drain` sends from.

use crate::policy::{Decision, Observation, Policy, State};
use crate::spill::Spill;
use crate::{manifest, Config, Report};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use dmover_engine::error::{Error, Result};
use dmover_engine::pool::{self, Pool};
use dmover_engine::session::{expect_session, Conn, Credential, SETUP_TIMEOUT};
use dmover_engine::transport::Transport;
use dmover_engine::wire::{FrameReader, FrameWriter, Incoming};
use dmover_proto::digest::{block_sum, file_digest, Sum};
use dmover_proto::frame::{DataHeader, ProducerEvents, Share, StepBlock, StepInfo};
use dmover_proto::phase::{FromSink, OnData, Open, Request, ToSink};
use dmover_proto::session::receive::MAX_DAMAGED;
use dmover_proto::ErrorKind;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the policy looks at the buffer.
pub const TICK: Duration = Duration::from_millis(50);
/// A control connection with nothing to say sends `Ping` this often, well
/// inside a sink's idle timeout (120 s by default).
const PING_EVERY: Duration = Duration::from_secs(10);
/// How long a destination that failed is left alone.
pub const RETRY_DOWN: Duration = Duration::from_secs(5);
/// How long a data connection waits for work before checking whether it
/// should stop.
const WORK_WAIT: Duration = Duration::from_millis(100);
/// While close waits for delivery it says so this often: how many blocks
/// are still to go and how long it will still wait.
const CLOSE_NOTE_EVERY: Duration = Duration::from_secs(30);
/// The manifest on disk is rewritten, when something changed, at most this
/// often: what a producer killed before close can lose of its bookkeeping.
pub const MANIFEST_EVERY: Duration = Duration::from_millis(500);
/// ... and at most once per this many times its last write took, so that
/// keeping a long stream's manifest takes at most 1/20 of this thread.
const MANIFEST_SHARE: u32 = 20;

/// A block in memory, ready to send: shared between the manager (until
/// enough sinks hold it) and the connections sending it.
pub struct Block {
    pub step: u64,
    pub offset: u64,
    pub sum: Sum,
    pub data: pool::Block,
    /// Where it is in the spill file, if it was read back from there.
    pub spilled_at: Option<u64>,
    /// Fetched back to gather its step at this destination: it goes there
    /// only, and is done once that sink holds it.
    pub gather_to: Option<usize>,
}

/// Everything the manager hears about.
pub enum Event {
    /// The writer filled a slot.
    Block { step: u64, offset: u64, data: pool::Block },
    /// The writer found the ring full and wrote a block to the spill file.
    Spilled { step: u64, offset: u64, len: u32, sum: Sum, at: u64 },
    /// The writer ended a step.
    StepEnd { step: u64, bytes: u64, blocks: u64, metadata: Vec<(String, String)>, records: Vec<(u64, u64)> },
    /// The writer closed the stream.
    Close,
    /// The writer changed the close or ack timeout (`None`: unchanged).
    Timeouts { close: Option<Duration>, ack: Option<Duration> },
    /// The writer changed how many sinks each step goes to.
    Replicas { replicas: usize },
    /// Link `link`'s sink wrote these blocks.
    Acked { link: u64, blocks: Vec<(u64, u64)> },
    /// Link `link`'s sink got this block damaged.
    Nack { link: u64, step: u64, offset: u64 },
    /// Link `link`'s sink saved the step's manifest; `complete` if every
    /// block of the step is there.
    Saved { link: u64, step: u64, complete: bool },
    /// A block of a step, fetched back from the sink that held it, to be
    /// sent to destination `to`.
    Fetched { step: u64, offset: u64, data: pool::Block, to: usize },
    /// Fetching a step's blocks back from `holder` ended.
    Gathered { step: u64, holder: usize, error: Option<Error> },
    /// Link `link`'s sink told its name.
    Named { link: u64, name: String },
    /// Link `link` failed.
    Down { link: u64, error: Error },
}

struct BlockRec {
    len: u32,
    sum: Sum,
    /// The destinations that acknowledged it, first first.
    at: Vec<usize>,
    /// Its place in the spill file, if it went there.
    spilled: Option<u64>,
}

#[derive(Default)]
struct StepState {
    /// Set when the writer ended the step.
    end: Option<StepEnd>,
    blocks: BTreeMap<u64, BlockRec>,
    /// The links its `StepEnd` went on and that have not answered.
    pending: BTreeSet<u64>,
    /// The destinations that saved its manifest, and whether it says the
    /// step is complete there.
    saved: BTreeMap<usize, bool>,
    /// Saved split at a sink (some blocks elsewhere) and left so:
    /// gathering it failed while closing (`drain` tries again).
    left_split: bool,
    /// A block of it arrived damaged at a sink [`MAX_DAMAGED`] times and
    /// was given up (kept in the spill file): this run never ends the step.
    damaged: bool,
    /// Read from the manifest of a producer that stopped before the step
    /// was whole (not ended, or blocks that were only in its memory):
    /// nothing of it can be sent (`drain`).
    lost: bool,
}

struct StepEnd {
    bytes: u64,
    blocks: u64,
    metadata: Vec<(String, String)>,
    records: Vec<(u64, u64)>,
}

struct Destination {
    addr: String,
    /// The sink's name, as it told it (`Identify`); its address until then.
    name: String,
    /// Not tried again before this.
    down_until: Option<Instant>,
    /// Its link failed and none has been opened to it since: what it holds
    /// does not count as a copy (a new one is made elsewhere).
    failed: bool,
    blocks: u64,
    bytes: u64,
}

/// A streaming session on one destination.
struct Link {
    id: u64,
    dest: usize,
    session: [u8; 16],
    control: FrameWriter,
    /// Blocks for the data connections; they take from `work_rx`.
    work: Sender<Arc<Block>>,
    work_rx: Receiver<Arc<Block>>,
    /// Blocks handed to this link and not yet acknowledged.
    sent: HashSet<(u64, u64)>,
    /// Step ends sent on this link and not yet saved.
    unconfirmed: usize,
    /// One stop flag per data connection, oldest first.
    streams: Vec<Arc<AtomicBool>>,
    next_index: u32,
    /// When the sink last acknowledged something (or the link opened).
    last_ack: Instant,
}

impl Destination {
    fn new(addr: &str, name: &str) -> Destination {
        Destination { addr: addr.to_string(), name: name.to_string(), down_until: None, failed: false, blocks: 0, bytes: 0 }
    }
}

impl Link {
    fn close(&mut self) {
        for s in &self.streams {
            s.store(true, Ordering::Relaxed);
        }
        self.control.close();
    }
}

pub struct Manager {
    cfg: Config,
    cred: Credential,
    ring: Arc<Pool>,
    spill: Arc<Spill>,
    events: Sender<Event>,
    rx: Receiver<Event>,
    /// Blocks in ring slots that not enough sinks hold yet, by (step, offset).
    memory: BTreeMap<(u64, u64), Arc<Block>>,
    /// Blocks in memory to hand to links, oldest first.
    fresh: VecDeque<(u64, u64)>,
    /// Spilled blocks to send (not read back yet), oldest first.
    spilled: VecDeque<(u64, u64)>,
    steps: BTreeMap<u64, StepState>,
    /// Times each block in flight arrived damaged (`Nack`).
    damage: HashMap<(u64, u64), u32>,
    /// The step whose blocks are being fetched back, if any.
    gathering: Option<u64>,
    dests: Vec<Destination>,
    /// One link per sink taking copies: `replicas` of them when enough
    /// destinations are up, the most preferred first.
    links: Vec<Link>,
    /// The last try to open links left fewer than `replicas`: no other
    /// destination takes the stream now.
    short_of_sinks: bool,
    links_opened: u64,
    policy: Policy,
    start: Instant,
    spilled_since: usize,
    /// Blocks and bytes spilled since the writer last found room in the
    /// buffer (`None` while it does): a spell of spilling is logged when it
    /// starts and when it ends.
    spilling: Option<(u64, u64)>,
    closing: Option<Instant>,
    /// When close last said what it waits for.
    close_noted: Option<Instant>,
    report: Report,
    /// The spills and failovers of `report` told to a sink so far.
    events_told: ProducerEvents,
    /// The producer's manifest on disk, and whether it changed since it
    /// was last written, when, and how long to wait before the next write.
    manifest_path: PathBuf,
    manifest_dirty: bool,
    manifest_written: Instant,
    manifest_every: Duration,
}

impl Manager {
    pub fn new(cfg: Config, cred: Credential, ring: Arc<Pool>, spill: Arc<Spill>, events: Sender<Event>, rx: Receiver<Event>) -> Manager {
        let dests = cfg.destinations.iter().map(|a| Destination::new(a, a)).collect();
        let manifest_path = manifest::beside(spill.path());
        Manager {
            cred,
            policy: Policy::new(cfg.max_streams),
            cfg,
            ring,
            spill,
            events,
            rx,
            memory: BTreeMap::new(),
            fresh: VecDeque::new(),
            spilled: VecDeque::new(),
            steps: BTreeMap::new(),
            damage: HashMap::new(),
            gathering: None,
            dests,
            links: Vec::new(),
            short_of_sinks: false,
            links_opened: 0,
            start: Instant::now(),
            spilled_since: 0,
            spilling: None,
            closing: None,
            close_noted: None,
            report: Report::default(),
            events_told: ProducerEvents::default(),
            manifest_path,
            manifest_dirty: false,
            manifest_written: Instant::now(),
            manifest_every: MANIFEST_EVERY,
        }
    }

    /// Opens the first links (one per copy, see [`Config::replicas`]);
    /// fails if no destination takes the stream.
    pub fn connect_first(&mut self) -> Result<()> {
        let mut first_error = None;
        for d in 0..self.dests.len() {
            if self.links.len() >= self.cfg.replicas {
                break;
            }
            if let Err(e) = self.open_link(d) {
                log::warn!("stream {}: {e}", self.cfg.producer);
                self.dests[d].down_until = Some(Instant::now() + RETRY_DOWN);
                first_error.get_or_insert(e);
            }
        }
        self.short_of_sinks = self.links.len() < self.cfg.replicas;
        match first_error {
            Some(e) if self.links.is_empty() => Err(e),
            _ if self.links.is_empty() => Err(Error::new(ErrorKind::Usage, "", "no destination given")),
            _ => Ok(()),
        }
    }

    /// A manager for what a producer's manifest (at `path`, rewritten as
    /// the drain goes) says is undelivered: its blocks in the spill file go
    /// to the destinations, and the steps whose manifest no sink saved get
    /// their `StepEnd` (`drain`). It runs as if the writer had closed.
    /// Steps the producer left unfinished (not ended, or with blocks that
    /// were only in its memory when it stopped) are lost: kept in the
    /// manifest, never sent.
    pub fn resume(mut self, manifest: &manifest::Manifest, path: &Path) -> Result<Manager> {
        self.manifest_path = path.to_path_buf();
        for (name, addr) in &manifest.sinks {
            match self.dests.iter().position(|d| d.addr == *addr) {
                Some(i) => self.dests[i].name = name.clone(),
                None => self.dests.push(Destination::new(addr, name)),
            }
        }
        for s in &manifest.steps {
            let step = s.step;
            let lost = s.lost();
            let mut st = StepState { lost, ..StepState::default() };
            for b in &s.blocks {
                let mut rec = BlockRec { len: b.len, sum: b.xxh3, at: Vec::new(), spilled: None };
                match &b.place {
                    manifest::Place::At { at } => {
                        for sink in std::iter::once(at).chain(&b.copies) {
                            let d = self.dest_index(sink);
                            rec.at.push(d);
                        }
                    }
                    // A lost step's spilled blocks go with the spill file.
                    _ if lost => {}
                    manifest::Place::Spilled { spill_offset, .. } => {
                        self.spilled.push_back((step, b.offset));
                        rec.spilled = Some(*spill_offset);
                    }
                    manifest::Place::Undelivered { .. } => unreachable!("a step with an undelivered block is lost"),
                }
                st.blocks.insert(b.offset, rec);
            }
            st.end = s.ended.then(|| StepEnd {
                bytes: s.bytes,
                blocks: st.blocks.len() as u64,
                metadata: s.metadata.clone().into_iter().collect(),
                records: s.records.clone(),
            });
            for sink in s.manifest_at.iter().chain(&s.complete_at) {
                let d = self.dest_index(sink);
                st.saved.insert(d, st.blocks.values().all(|b| b.at.contains(&d)));
            }
            self.report.steps += 1;
            self.report.bytes += s.bytes;
            self.report.blocks += st.blocks.len() as u64;
            self.steps.insert(step, st);
        }
        self.closing = Some(Instant::now());
        Ok(self)
    }

    /// The index of the destination a manifest names (by its name, or by
    /// its address in manifests that named sinks so), added if the
    /// configuration does not have it.
    fn dest_index(&mut self, sink: &str) -> usize {
        let by_name = self.dests.iter().position(|d| d.name == sink);
        if let Some(i) = by_name.or_else(|| self.dests.iter().position(|d| d.addr == sink)) {
            return i;
        }
        self.dests.push(Destination::new(sink, sink));
        self.dests.len() - 1
    }

    /// Takes the name a destination's sink told: unless it is empty or
    /// already names another destination, in which case the sink keeps
    /// being named by its address.
    fn name_destination(&mut self, dest: usize, name: String) {
        let taken = self.dests.iter().enumerate().any(|(i, d)| i != dest && (d.name == name || d.addr == name));
        if name.is_empty() || taken {
            log::warn!(
                "stream {}: sink {} calls itself {name:?}, which names another sink; naming it by its address",
                self.cfg.producer,
                self.dests[dest].addr
            );
            return;
        }
        if self.dests[dest].name != name {
            self.dests[dest].name = name;
            self.manifest_dirty = true;
        }
    }

    /// Runs until the writer closes and everything is delivered (or the
    /// close timeout passes); returns the report.
    pub fn run(mut self) -> Result<Report> {
        let mut last_tick = Instant::now();
        loop {
            match self.rx.recv_timeout(TICK) {
                Ok(ev) => self.handle(ev)?,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => self.closing = self.closing.or(Some(Instant::now())),
            }
            if last_tick.elapsed() >= TICK {
                last_tick = Instant::now();
                self.tick()?;
            }
            self.dispatch();
            if self.closing.is_some() && self.settled() {
                break;
            }
            self.note_close_wait();
            if self.closing.is_some_and(|t| t.elapsed() >= self.cfg.close_timeout) {
                log::warn!("stream {}: close timeout; keeping what is undelivered in the spill file", self.cfg.producer);
                self.spill_memory()?;
                break;
            }
        }
        for mut l in self.links.drain(..) {
            l.close();
        }
        self.finish()
    }

    /// The link with id `id`, if it is up.
    fn link_index(&self, id: u64) -> Option<usize> {
        self.links.iter().position(|l| l.id == id)
    }

    fn handle(&mut self, ev: Event) -> Result<()> {
        match ev {
            Event::Block { step, offset, data } => {
                let sum = block_sum(&data);
                let len = data.len() as u32;
                self.steps.entry(step).or_default().blocks.insert(offset, BlockRec { len, sum, at: Vec::new(), spilled: None });
                self.report.blocks += 1;
                let b = Block { step, offset, sum, data, spilled_at: None, gather_to: None };
                self.memory.insert((step, offset), Arc::new(b));
                self.fresh.push_back((step, offset));
                if let Some((blocks, bytes)) = self.spilling.take() {
                    log::info!(
                        "stream {}: the buffer has room again after {blocks} blocks ({}) went to {}; they are sent from there",
                        self.cfg.producer,
                        dmover_engine::progress::human(bytes),
                        self.spill.path().display()
                    );
                }
            }
            Event::Spilled { step, offset, len, sum, at } => {
                self.note_spill(len as u64, "the buffer is full");
                let rec = BlockRec { len, sum, at: Vec::new(), spilled: Some(at) };
                self.steps.entry(step).or_default().blocks.insert(offset, rec);
                self.spilled.push_back((step, offset));
                self.spilled_since += 1;
                self.report.blocks += 1;
                self.report.spilled_blocks += 1;
                self.report.spilled_bytes += len as u64;
                self.manifest_dirty = true;
            }
            Event::StepEnd { step, bytes, blocks, metadata, records } => {
                self.report.steps += 1;
                self.report.bytes += bytes;
                self.steps.entry(step).or_default().end = Some(StepEnd { bytes, blocks, metadata, records });
                self.manifest_dirty = true;
                self.end_steps();
            }
            Event::Close => self.closing = Some(Instant::now()),
            Event::Timeouts { close, ack } => {
                self.cfg.close_timeout = close.unwrap_or(self.cfg.close_timeout);
                self.cfg.ack_timeout = ack.unwrap_or(self.cfg.ack_timeout);
            }
            Event::Replicas { replicas } => {
                // More links open at the next tick; blocks and steps get their copies.
                self.cfg.replicas = replicas;
                self.short_of_sinks = false;
                self.fresh = self.memory.keys().copied().collect();
                self.end_steps();
            }
            Event::Acked { link, blocks } => {
                let Some(i) = self.link_index(link) else { return Ok(()) };
                self.links[i].last_ack = Instant::now();
                let dest = self.links[i].dest;
                for key in blocks {
                    if !self.links[i].sent.remove(&key) {
                        continue;
                    }
                    let Some(rec) = self.steps.get_mut(&key.0).and_then(|s| s.blocks.get_mut(&key.1)) else { continue };
                    if !rec.at.contains(&dest) {
                        rec.at.push(dest);
                    }
                    self.dests[dest].blocks += 1;
                    self.dests[dest].bytes += rec.len as u64;
                    self.manifest_dirty = true;
                    if self.done_with(key) {
                        self.memory.remove(&key);
                    }
                }
                self.end_steps();
            }
            Event::Nack { link, step, offset } => {
                let Some(i) = self.link_index(link) else { return Ok(()) };
                let l = &mut self.links[i];
                l.last_ack = Instant::now();
                let Some(b) = self.memory.get(&(step, offset)).filter(|_| l.sent.contains(&(step, offset))) else { return Ok(()) };
                let times = self.damage.entry((step, offset)).or_insert(0);
                *times += 1;
                if *times < MAX_DAMAGED {
                    self.report.resent_blocks += 1;
                    let _ = l.work.send(b.clone());
                } else {
                    let sink = self.dests[l.dest].name.clone();
                    self.give_up_damaged(step, offset, &sink)?;
                }
            }
            Event::Saved { link, step, complete } => {
                let Some(i) = self.link_index(link) else { return Ok(()) };
                let l = &mut self.links[i];
                l.last_ack = Instant::now();
                let dest = l.dest;
                if let Some(s) = self.steps.get_mut(&step) {
                    if s.pending.remove(&link) {
                        l.unconfirmed -= 1;
                    }
                    s.saved.insert(dest, complete);
                    self.manifest_dirty = true;
                }
            }
            Event::Fetched { step, offset, data, to } => {
                let sum = block_sum(&data);
                let Some(rec) = self.steps.get(&step).and_then(|s| s.blocks.get(&offset)) else { return Ok(()) };
                if rec.sum != sum || rec.len as usize != data.len() {
                    log::warn!("stream {}: step {step}, block at offset {offset} came back damaged; not gathering it", self.cfg.producer);
                    return Ok(());
                }
                if let std::collections::btree_map::Entry::Vacant(e) = self.memory.entry((step, offset)) {
                    e.insert(Arc::new(Block { step, offset, sum, data, spilled_at: None, gather_to: Some(to) }));
                    self.fresh.push_back((step, offset));
                }
            }
            Event::Gathered { step, holder, error } => {
                self.gathering = None;
                if let Some(e) = error {
                    log::warn!("stream {}: cannot gather step {step} from {}: {e}", self.cfg.producer, self.dests[holder].name);
                    self.dests[holder].down_until = Some(Instant::now() + RETRY_DOWN);
                    if self.closing.is_some() {
                        self.steps.get_mut(&step).expect("gathered steps exist").left_split = true;
                    }
                }
            }
            Event::Named { link, name } => {
                if let Some(i) = self.link_index(link) {
                    let dest = self.links[i].dest;
                    self.name_destination(dest, name);
                }
            }
            // Events from a link that is gone are ignored: its blocks were requeued.
            Event::Down { link, error } => {
                if let Some(i) = self.link_index(link) {
                    self.link_down(i, error);
                }
            }
        }
        Ok(())
    }

    /// Every [`TICK`]: consult the policy, open links while fewer than the
    /// copies wanted are up, gather, ping.
    fn tick(&mut self) -> Result<()> {
        if self.links.len() < self.cfg.replicas {
            self.reconnect();
        }
        if self.links.is_empty() && !self.memory.is_empty() {
            // No destination takes blocks: keep them on disk, not only in
            // memory, and free their slots for the writer.
            let blocks: Vec<Arc<Block>> = std::mem::take(&mut self.memory).into_values().filter(|b| b.gather_to.is_none()).collect();
            self.fresh.clear();
            self.spill_blocks(blocks, true)?;
        }
        self.gather();
        self.keep_manifest();
        let backlog = self.fresh.len() + self.links.iter().map(|l| l.work.len()).max().unwrap_or(0);
        let o = Observation {
            now: self.start.elapsed(),
            backlog,
            slots: self.ring.blocks(),
            free: self.ring.free(),
            spilled: std::mem::take(&mut self.spilled_since),
            spill_pending: self.spilled.len(),
        };
        let mut d: Decision = self.policy.decide(&o);
        if self.closing.is_some() {
            // The writer is done: the whole ring is free for spilled blocks.
            d.fetch = self.spilled.len().min(o.free);
        }
        if self.links.is_empty() {
            // Blocks read back now would only be spilled again.
            d.fetch = 0;
        }
        match d.state {
            State::A => self.report.ticks_a += 1,
            State::B => self.report.ticks_b += 1,
            State::C => self.report.ticks_c += 1,
        }
        self.report.max_streams = self.report.max_streams.max(d.streams);
        self.set_streams(d.streams);
        self.fetch_spilled(d.fetch)?;
        let mut i = 0;
        while i < self.links.len() {
            let l = &mut self.links[i];
            let waiting = !l.sent.is_empty() || l.unconfirmed > 0;
            if waiting && l.last_ack.elapsed() >= self.cfg.ack_timeout {
                let what = format!("acknowledged nothing for {:?}", self.cfg.ack_timeout);
                let e = Error::new(ErrorKind::Unreachable, &self.dests[l.dest].addr, what);
                self.link_down(i, e);
                continue;
            }
            if !waiting {
                l.last_ack = Instant::now();
            }
            if let Err(e) = l.control.keep_alive(PING_EVERY) {
                self.link_down(i, e);
                continue;
            }
            i += 1;
        }
        Ok(())
    }

    /// Whether nothing more is to be done for step `s` with the links up
    /// (what [`settled`](Manager::settled) asks of every step):
    /// saved, whole wherever saved at a sink that is up, no step end
    /// pending and none wanted; or never to be sent again in this run
    /// (lost, damaged, left split).
    fn step_done(&self, s: &StepState) -> bool {
        let up = |d: usize| self.links.iter().any(|l| l.dest == d);
        s.lost
            || s.damaged
            || s.left_split
            || (s.end.is_some()
                && s.pending.is_empty()
                && !s.saved.is_empty()
                && s.saved.iter().all(|(&d, &complete)| complete || !up(d))
                && !self.links.iter().any(|l| self.wants_end(s, l.dest)))
    }

    /// The destinations holding a block that count as copies: not failed.
    fn live_copies(&self, rec: &BlockRec) -> usize {
        rec.at.iter().filter(|&&d| !self.dests[d].failed).count()
    }

    /// Whether a block in memory is where it must be: at the sink it was
    /// fetched back for; or at `replicas` sinks, or, while fewer are up and
    /// no other takes the stream ([`short_of_sinks`](Manager::short_of_sinks)),
    /// at every one that is (its slot would
    /// otherwise stay taken for good; the missing copies are made from the
    /// sinks, as for a dead sink's, once another is up).
    fn done_with(&self, key: (u64, u64)) -> bool {
        let (Some(b), Some(rec)) = (self.memory.get(&key), self.steps.get(&key.0).and_then(|s| s.blocks.get(&key.1))) else {
            return true;
        };
        match b.gather_to {
            Some(d) => rec.at.contains(&d),
            None => {
                self.live_copies(rec) >= self.cfg.replicas
                    || (self.short_of_sinks && !self.links.is_empty() && self.links.iter().all(|l| rec.at.contains(&l.dest)))
            }
        }
    }

    /// Hands the blocks waiting in memory to links: each to as many sinks
    /// not holding it as it needs to reach `replicas` copies, the most
    /// preferred first (a gathered block to its sink only). A block that
    /// fewer sinks than that are up to take waits in memory for another.
    fn dispatch(&mut self) {
        while let Some(key) = self.fresh.pop_front() {
            if self.done_with(key) {
                self.memory.remove(&key);
                continue;
            }
            let Some(b) = self.memory.get(&key) else { continue };
            let Some(rec) = self.steps.get(&key.0).and_then(|s| s.blocks.get(&key.1)) else { continue };
            let sending = self.links.iter().filter(|l| l.sent.contains(&key)).count();
            let mut need = match b.gather_to {
                Some(_) => 1usize.saturating_sub(sending),
                None => self.cfg.replicas.saturating_sub(self.live_copies(rec) + sending),
            };
            let mut taken = false;
            for l in &mut self.links {
                if need == 0 {
                    break;
                }
                if rec.at.contains(&l.dest) || l.sent.contains(&key) || b.gather_to.is_some_and(|d| d != l.dest) {
                    continue;
                }
                l.sent.insert(key);
                let _ = l.work.send(b.clone());
                need -= 1;
                taken = true;
            }
            if b.gather_to.is_some() && !taken && sending == 0 {
                // The sink it was fetched for is gone; gathering starts over.
                self.memory.remove(&key);
            }
        }
    }

    /// Reads up to `n` spilled blocks back into free slots and queues them.
    fn fetch_spilled(&mut self, n: usize) -> Result<()> {
        let keep = if self.closing.is_some() { 0 } else { self.ring.blocks() / 2 };
        for _ in 0..n {
            let Some(&(step, offset)) = self.spilled.front() else { break };
            let Some(mut slot) = self.ring.take_sparing(keep) else { break };
            let rec = &self.steps[&step].blocks[&offset];
            let at = rec.spilled.expect("a spilled block is in the spill file");
            slot.resize(rec.len as usize);
            self.spill.read(at, &mut slot).map_err(|e| Error::io(self.spill.path().display().to_string(), &e))?;
            if block_sum(&slot) != rec.sum {
                let msg = format!("step {step}, offset {offset}: the spilled block reads back damaged");
                return Err(Error::new(ErrorKind::Verify, self.spill.path().display().to_string(), msg));
            }
            self.spilled.pop_front();
            let b = Block { step, offset, sum: rec.sum, data: slot, spilled_at: Some(at), gather_to: None };
            self.memory.insert((step, offset), Arc::new(b));
            self.fresh.push_back((step, offset));
        }
        Ok(())
    }

    /// Makes a step whole at a sink that saved it split — failover left
    /// some of its blocks at another sink, or the sink took over a dead
    /// one's copy (see [`Config::replicas`]): its blocks held elsewhere are
    /// fetched back from there (`Fetch`, one sink and one step at a time),
    /// checked, and sent to it like any block; when every block is there
    /// the step ends again, so that the sink's manifest says it is
    /// complete and runs the hook, once (a sink runs the hook only of a
    /// complete step). A sink that cannot be reached is tried again after
    /// [`RETRY_DOWN`]; while closing, the step is left split instead
    /// (`drain` tries again).
    fn gather(&mut self) {
        if self.gathering.is_some() {
            return;
        }
        let now = Instant::now();
        let mut whole = Vec::new();
        'steps: for (&step, s) in &self.steps {
            if s.left_split || s.lost || s.damaged || !s.pending.is_empty() {
                continue;
            }
            for (&to, _) in s.saved.iter().filter(|(&d, &complete)| !complete && self.links.iter().any(|l| l.dest == d)) {
                let missing: Vec<(&u64, &BlockRec)> =
                    s.blocks.iter().filter(|(&o, b)| !b.at.contains(&to) && !self.memory.contains_key(&(step, o))).collect();
                if missing.is_empty() {
                    if s.blocks.values().all(|b| b.at.contains(&to)) {
                        whole.push((step, to));
                    }
                    continue;
                }
                // From a sink that is up, if one holds it; else from any that may be back.
                let usable = |d: &usize| self.dests[*d].down_until.is_none_or(|t| t <= now);
                let pick =
                    |b: &BlockRec| b.at.iter().find(|d| !self.dests[**d].failed).or_else(|| b.at.iter().find(|d| usable(d))).copied();
                let Some(holder) = missing.iter().find_map(|(_, b)| pick(b)) else { continue };
                if !usable(&holder) {
                    continue;
                }
                let blocks: Vec<(u64, u32)> = missing.iter().filter(|(_, b)| b.at.contains(&holder)).map(|(&o, b)| (o, b.len)).collect();
                log::info!(
                    "stream {}: step {step} is not whole at {}; fetching its {} blocks at {}",
                    self.cfg.producer,
                    self.dests[to].name,
                    blocks.len(),
                    self.dests[holder].name
                );
                let fetch = Fetch {
                    addr: self.dests[holder].addr.clone(),
                    cred: self.cred.clone(),
                    producer: self.cfg.producer.clone(),
                    block_size: self.cfg.block_size,
                    step,
                    holder,
                    to,
                    blocks,
                    ring: self.ring.clone(),
                    events: self.events.clone(),
                    setup: self.cfg.ack_timeout.max(SETUP_TIMEOUT),
                };
                self.gathering = Some(step);
                std::thread::spawn(move || fetch.run());
                break 'steps;
            }
        }
        for (step, to) in whole {
            // Every block is there now: the step ends there again.
            self.steps.get_mut(&step).expect("whole steps exist").saved.remove(&to);
        }
        self.end_steps();
    }

    /// Gives up a block that arrived damaged at `sink` [`MAX_DAMAGED`]
    /// times: the path damages it, and sending it again would loop. It
    /// goes to the spill file (freeing its slot) for `drain` to send once
    /// the path is repaired; its step is not ended in this run, and close
    /// reports it ([`Report::damaged`]). Nothing damaged was acknowledged.
    fn give_up_damaged(&mut self, step: u64, offset: u64, sink: &str) -> Result<()> {
        let Some(b) = self.memory.remove(&(step, offset)) else { return Ok(()) };
        for l in &mut self.links {
            l.sent.remove(&(step, offset));
        }
        self.damage.remove(&(step, offset));
        log::warn!(
            "stream {}: step {step}, block at offset {offset} arrived damaged at {sink} {MAX_DAMAGED} times; keeping it in the spill file",
            self.cfg.producer
        );
        self.report.damaged.push((step, offset));
        if let Some(s) = self.steps.get_mut(&step) {
            s.damaged = true;
        }
        self.spill_blocks(vec![b], false)?;
        self.end_steps();
        Ok(())
    }

    /// Sends `StepEnd` on each link for the ended steps its sink should
    /// save: a step no sink saved yet, once each of its blocks is
    /// acknowledged somewhere; and a step fewer than `replicas` sinks that
    /// are up have saved, once each of its blocks is at one that is up (or
    /// on its way), to a sink that has not saved it — it saves the step
    /// split and [`gather`](Manager::gather) makes it whole there. A step
    /// waits while blocks of it are on their way to that sink. Steps go in
    /// order on each link: it stops at the first step still waiting, so
    /// that a sink saves steps, and runs their hooks, in order. A step with
    /// a block given up as damaged is passed over.
    fn end_steps(&mut self) {
        let mut failed = Vec::new();
        for i in 0..self.links.len() {
            let (id, dest) = (self.links[i].id, self.links[i].dest);
            let steps: Vec<u64> = self.steps.keys().copied().collect();
            for step in steps {
                let s = &self.steps[&step];
                if s.lost || s.damaged || s.saved.contains_key(&dest) || s.pending.contains(&id) {
                    continue;
                }
                let Some(end) = &s.end else { break };
                if !self.wants_end(s, dest) {
                    continue;
                }
                let l = &self.links[i];
                let on_the_way = |o: &u64| l.sent.contains(&(step, *o)) || self.memory.contains_key(&(step, *o));
                let ready = s.blocks.len() as u64 == end.blocks
                    && s.blocks.iter().all(|(o, b)| !b.at.is_empty() && (b.at.contains(&dest) || !on_the_way(o)));
                if !ready {
                    break;
                }
                let blocks = s
                    .blocks
                    .iter()
                    .map(|(&offset, b)| {
                        let at = match b.at.contains(&dest) {
                            true => String::new(),
                            false => {
                                let d = b.at.iter().find(|&&d| !self.dests[d].failed).unwrap_or(&b.at[0]);
                                self.dests[*d].name.clone()
                            }
                        };
                        StepBlock { offset, len: b.len, sum: b.sum, at }
                    })
                    .collect();
                let now = self.events();
                let told = self.events_told;
                let info = StepInfo {
                    step,
                    bytes: end.bytes,
                    digest: file_digest(s.blocks.values().map(|b| &b.sum)),
                    metadata: end.metadata.clone(),
                    records: end.records.clone(),
                    blocks,
                    events: ProducerEvents {
                        spilled_blocks: now.spilled_blocks - told.spilled_blocks,
                        spilled_bytes: now.spilled_bytes - told.spilled_bytes,
                        failovers: now.failovers - told.failovers,
                    },
                };
                let l = &mut self.links[i];
                if let Err(e) = l.control.send(ToSink::StepEnd { info }) {
                    failed.push((id, e));
                    break;
                }
                self.events_told = now;
                l.unconfirmed += 1;
                self.steps.get_mut(&step).expect("listed above").pending.insert(id);
            }
        }
        for (id, e) in failed {
            if let Some(i) = self.link_index(id) {
                self.link_down(i, e);
            }
        }
    }

    /// The spills and failovers so far.
    fn events(&self) -> ProducerEvents {
        let r = &self.report;
        ProducerEvents { spilled_blocks: r.spilled_blocks, spilled_bytes: r.spilled_bytes, failovers: r.failovers }
    }

    /// Whether the sink of destination `dest` should save the ended step
    /// `s`, which it has not: no sink has saved it yet; or fewer than
    /// `replicas` sinks that are up have saved it whole (or are saving it,
    /// or gathering it), and each of its blocks is at a sink that is up, to
    /// copy it from.
    fn wants_end(&self, s: &StepState, dest: usize) -> bool {
        if s.lost || s.damaged || s.end.is_none() || s.saved.contains_key(&dest) {
            return false;
        }
        if s.saved.is_empty() {
            return true;
        }
        let live = |d: &usize| !self.dests[*d].failed;
        // A sink that saved it split counts while it is linked, to gather it.
        let linked = |d: &usize| self.links.iter().any(|l| l.dest == *d);
        let saved = s.saved.iter().filter(|&(d, &complete)| if complete { live(d) } else { linked(d) }).count();
        let targets = saved + s.pending.iter().filter(|&&p| self.link_index(p).is_some()).count();
        targets < self.cfg.replicas && s.blocks.values().all(|b| b.at.iter().any(live))
    }

    /// Whether everything is where it can be: nothing waits to be sent to a
    /// sink that is up, and every step is saved (whole at `replicas` sinks,
    /// or at every sink up if fewer are), left split, or cannot be sent.
    fn settled(&self) -> bool {
        let blocks_done = self.memory.iter().all(|(key, b)| {
            let rec = &self.steps[&key.0].blocks[&key.1];
            b.gather_to.is_none() && !rec.at.is_empty() && self.links.iter().all(|l| rec.at.contains(&l.dest))
        });
        blocks_done && self.spilled.is_empty() && self.gathering.is_none() && self.steps.values().all(|s| self.step_done(s))
    }

    /// Opens or closes data connections of each link to reach `n`.
    fn set_streams(&mut self, n: usize) {
        for l in &mut self.links {
            while l.streams.len() > n {
                l.streams.pop().expect("nonempty").store(true, Ordering::Relaxed);
            }
            while l.streams.len() < n {
                let stop = Arc::new(AtomicBool::new(false));
                l.streams.push(stop.clone());
                let ctx = StreamCtx {
                    addr: self.dests[l.dest].addr.clone(),
                    cred: self.cred.clone(),
                    session: l.session,
                    index: l.next_index,
                    link: l.id,
                    work: l.work_rx.clone(),
                    stop,
                    events: self.events.clone(),
                    setup: self.cfg.ack_timeout.max(SETUP_TIMEOUT),
                };
                l.next_index += 1;
                std::thread::spawn(move || ctx.run());
            }
        }
    }

    /// Tears link `i` down: what it had not confirmed goes to the other
    /// links, or to one opened to the next destination (failover).
    fn link_down(&mut self, i: usize, error: Error) {
        let mut l = self.links.remove(i);
        l.close();
        let dest = &mut self.dests[l.dest];
        log::warn!("stream {}: destination {} failed ({error}); failing over", self.cfg.producer, dest.addr);
        dest.down_until = Some(Instant::now() + RETRY_DOWN);
        dest.failed = true;
        self.report.failovers += 1;
        self.report.resent_blocks += l.sent.len() as u64;
        self.damage.clear();
        for s in self.steps.values_mut() {
            s.pending.remove(&l.id);
        }
        // Blocks in memory may now need another sink (oldest first).
        self.fresh = self.memory.keys().copied().collect();
        self.reconnect();
    }

    /// Opens links to the first destinations not recently failed and not
    /// linked already, until there are `replicas` links.
    fn reconnect(&mut self) {
        let now = Instant::now();
        for d in 0..self.dests.len() {
            if self.links.len() >= self.cfg.replicas {
                break;
            }
            if self.links.iter().any(|l| l.dest == d) || self.dests[d].down_until.is_some_and(|t| t > now) {
                continue;
            }
            if let Err(e) = self.open_link(d) {
                log::warn!("stream {}: {e}", self.cfg.producer);
                self.dests[d].down_until = Some(now + RETRY_DOWN);
            }
        }
        let short = self.links.len() < self.cfg.replicas;
        if short && !self.short_of_sinks {
            // Blocks every sink up holds can now be let go (see `done_with`).
            self.fresh = self.memory.keys().copied().collect();
        }
        self.short_of_sinks = short;
        self.end_steps();
    }

    fn open_link(&mut self, dest: usize) -> Result<()> {
        let addr = self.dests[dest].addr.clone();
        let mut c = Conn::control(&addr, &self.cred)?;
        let session =
            expect_session(&addr, c.request(Request::Stream { producer: self.cfg.producer.clone(), block_size: self.cfg.block_size })?)
                .map_err(|e| match e.kind {
                    // A refused stream has nothing to do with exports, which the class's own hint speaks of.
                    ErrorKind::Refused => e.advised("streams go to a `dmover sink`; its message says what it refused"),
                    _ => e,
                })?;
        let t = c.into_transport();
        let split = |t: &dyn Transport| t.split().map_err(|e| Error::network(&addr, &e));
        let reader = FrameReader::new(split(t.as_ref())?);
        let mut control = FrameWriter::new(t);
        // The answer, `Identity`, comes back as an event.
        control.send(ToSink::Identify {})?;
        self.links_opened += 1;
        let id = self.links_opened;
        let (events, block_size) = (self.events.clone(), self.cfg.block_size as u64);
        std::thread::spawn(move || read_control(reader, id, block_size, events));
        let (work, work_rx) = crossbeam_channel::unbounded();
        log::info!("stream {}: sending to {addr}", self.cfg.producer);
        self.links.push(Link {
            id,
            dest,
            session,
            control,
            work,
            work_rx,
            sent: HashSet::new(),
            unconfirmed: 0,
            streams: Vec::new(),
            next_index: 0,
            last_ack: Instant::now(),
        });
        self.dests[dest].down_until = None;
        self.dests[dest].failed = false;
        // Blocks in memory may need this sink too (oldest first).
        self.fresh = self.memory.keys().copied().collect();
        self.set_streams(self.policy.streams());
        Ok(())
    }

    /// Writes every block still in memory to the spill file (close timeout).
    fn spill_memory(&mut self) -> Result<()> {
        let blocks: Vec<Arc<Block>> = std::mem::take(&mut self.memory).into_values().filter(|b| b.gather_to.is_none()).collect();
        self.spill_blocks(blocks, false)
    }

    /// Puts blocks from memory in the spill file (those read back from it
    /// are there already) and drops them, which frees their slots; with
    /// `resend`, they are sent from there once a destination takes them.
    fn spill_blocks(&mut self, blocks: Vec<Arc<Block>>, resend: bool) -> Result<()> {
        for b in blocks {
            let at = match b.spilled_at {
                Some(at) => at,
                None => {
                    let at = self
                        .spill
                        .append(b.step, b.offset, b.sum, &b.data)
                        .map_err(|e| Error::io(self.spill.path().display().to_string(), &e))?;
                    self.report.spilled_blocks += 1;
                    self.report.spilled_bytes += b.data.len() as u64;
                    self.note_spill(b.data.len() as u64, if resend { "no sink is up" } else { "close timed out" });
                    at
                }
            };
            if let Some(rec) = self.steps.get_mut(&b.step).and_then(|s| s.blocks.get_mut(&b.offset)) {
                rec.spilled = Some(at);
            }
            if resend {
                self.spilled.push_back((b.step, b.offset));
            }
        }
        // Oldest first, as the writer spilled them.
        self.spilled.make_contiguous().sort_unstable();
        self.manifest_dirty = true;
        Ok(())
    }

    /// Counts a block that went to the spill file (`why`), saying so at the
    /// first of a spell: spilling costs disk space and time, and a user who
    /// sees nothing cannot tell a slow sink from a fast one.
    fn note_spill(&mut self, bytes: u64, why: &str) {
        match &mut self.spilling {
            Some((b, n)) => {
                *b += 1;
                *n += bytes;
            }
            None => {
                self.spilling = Some((1, bytes));
                let sinks = match self.links.len() {
                    0 => "no sink is connected".to_string(),
                    n => format!("{n} sink(s) connected"),
                };
                log::warn!(
                    "stream {}: {why} ({sinks}): blocks go to {} until a sink takes them",
                    self.cfg.producer,
                    self.spill.path().display()
                );
            }
        }
    }

    /// While close waits for delivery, says every [`CLOSE_NOTE_EVERY`] how
    /// many blocks are still to go and how long it will still wait, so a
    /// close that waits on absent sinks is not silent.
    fn note_close_wait(&mut self) {
        let Some(since) = self.closing else { return };
        if self.close_noted.is_some_and(|t| t.elapsed() < CLOSE_NOTE_EVERY) || since.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.close_noted = Some(Instant::now());
        let left = self.cfg.close_timeout.saturating_sub(since.elapsed()).as_secs_f64();
        let to_go = self.undelivered();
        let msg = format!(
            "stream {}: close waits for {to_go} block(s) and their steps to reach a sink; it gives up in {left:.0} s and keeps them in {}",
            self.cfg.producer,
            self.spill.path().display()
        );
        if self.links.is_empty() {
            log::warn!("{msg} (no sink is connected)");
        } else {
            log::info!("{msg}");
        }
    }

    /// Blocks of steps not lost that no sink has acknowledged.
    fn undelivered(&self) -> u64 {
        self.steps.values().filter(|s| !s.lost).map(|s| s.blocks.values().filter(|b| b.at.is_empty()).count() as u64).sum()
    }

    /// Rewrites the manifest on disk if it changed and the last write is
    /// old enough (see [`MANIFEST_EVERY`]). A failed write is logged and
    /// tried again at the next tick; the stream goes on.
    fn keep_manifest(&mut self) {
        if !self.manifest_dirty || self.manifest_written.elapsed() < self.manifest_every {
            return;
        }
        let started = Instant::now();
        if let Err(e) = self.write_manifest() {
            log::warn!("stream {}: cannot write {}: {e}", self.cfg.producer, self.manifest_path.display());
        }
        self.manifest_every = MANIFEST_EVERY.max(started.elapsed() * MANIFEST_SHARE);
    }

    fn write_manifest(&mut self) -> std::io::Result<()> {
        self.manifest_written = Instant::now();
        self.manifest().write(&self.manifest_path)?;
        self.manifest_dirty = false;
        Ok(())
    }

    /// Writes the manifest and completes the report.
    fn finish(mut self) -> Result<Report> {
        let undelivered = self.undelivered();
        self.report.undelivered_blocks = undelivered;
        self.report.unsaved_steps = self.steps.values().filter(|s| !s.lost && s.saved.is_empty()).count() as u64;
        self.report.lost_steps = self.steps.iter().filter(|(_, s)| s.lost).map(|(&step, _)| step).collect();
        self.report.split_steps =
            self.steps.iter().filter(|(_, s)| !s.saved.is_empty() && !s.saved.values().any(|&c| c)).map(|(&step, _)| step).collect();
        self.report.complete_at = self
            .steps
            .iter()
            .map(|(&step, s)| (step, s.saved.iter().filter(|(_, &c)| c).map(|(&d, _)| self.dests[d].name.clone()).collect()))
            .collect();
        if undelivered == 0 {
            self.spill.remove();
        } else {
            self.report.spill_file = Some(self.spill.path().to_path_buf());
        }
        self.report.seconds = self.start.elapsed().as_secs_f64();
        self.report.destinations = self.dests.iter().map(|d| Share { name: d.addr.clone(), count: d.blocks, bytes: d.bytes }).collect();
        let r = &self.report;
        let clean = undelivered == 0 && r.unsaved_steps == 0 && r.lost_steps.is_empty() && r.split_steps.is_empty() && r.damaged.is_empty();
        if clean && !self.cfg.keep_manifest {
            match std::fs::remove_file(&self.manifest_path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(self.manifest_path.display().to_string(), &e)),
            }
        } else {
            self.write_manifest().map_err(|e| Error::io(self.manifest_path.display().to_string(), &e))?;
            self.report.manifest = Some(self.manifest_path.clone());
        }
        Ok(self.report)
    }

    /// Where every block of every step is.
    fn manifest(&self) -> manifest::Manifest {
        let name = |d: &usize| self.dests[*d].name.clone();
        let steps = self
            .steps
            .iter()
            .map(|(&step, s)| {
                let blocks = s
                    .blocks
                    .iter()
                    .map(|(&offset, b)| {
                        // Sinks that saved the step whole first.
                        let mut at = b.at.clone();
                        at.sort_by_key(|d| !s.saved.get(d).copied().unwrap_or(false));
                        let (place, copies) = match (at.split_first(), b.spilled) {
                            (Some((first, rest)), _) => (manifest::Place::At { at: name(first) }, rest.iter().map(name).collect()),
                            (None, Some(at)) => {
                                (manifest::Place::Spilled { spill: self.spill.path().to_path_buf(), spill_offset: at }, Vec::new())
                            }
                            (None, None) => (manifest::Place::Undelivered { undelivered: true }, Vec::new()),
                        };
                        manifest::Block { offset, len: b.len, xxh3: b.sum, place, copies }
                    })
                    .collect();
                let (bytes, metadata, records) = match &s.end {
                    Some(e) => (e.bytes, e.metadata.iter().cloned().collect(), e.records.clone()),
                    None => Default::default(),
                };
                // The first sink that saved it whole, else the first that saved it.
                let manifest_at = s.saved.iter().find(|(_, &c)| c).or_else(|| s.saved.iter().next()).map(|(d, _)| name(d));
                let complete_at = s.saved.iter().filter(|(_, &c)| c).map(|(d, _)| name(d)).collect();
                manifest::Step { step, ended: s.end.is_some(), bytes, metadata, records, manifest_at, complete_at, blocks }
            })
            .collect();
        manifest::Manifest {
            producer: self.cfg.producer.clone(),
            block_size: self.cfg.block_size,
            replicas: self.cfg.replicas,
            destinations: self.cfg.destinations.clone(),
            sinks: self.dests.iter().map(|d| (d.name.clone(), d.addr.clone())).collect(),
            spill: self.spill.path().to_path_buf(),
            steps,
        }
    }
}

/// Turns the sink's answers on a control connection into events.
fn read_control(mut r: FrameReader, link: u64, block_size: u64, events: Sender<Event>) {
    loop {
        let ev = match r.read_msg::<FromSink>() {
            Ok(FromSink::Acked { blocks }) => Event::Acked { link, blocks },
            Ok(FromSink::Nack { id, block }) => Event::Nack { link, step: id, offset: block * block_size },
            Ok(FromSink::StepSaved { step, complete }) => Event::Saved { link, step, complete },
            Ok(FromSink::Identity { name }) => Event::Named { link, name },
            Ok(FromSink::Ping {}) => continue,
            Ok(FromSink::Error { kind, message }) => Event::Down { link, error: Error::new(kind, r.peer(), message) },
            Err(error) => Event::Down { link, error },
        };
        let down = matches!(ev, Event::Down { .. });
        if events.send(ev).is_err() || down {
            return;
        }
    }
}

/// Fetches blocks of a split step back from the sink that holds them
/// (`Fetch` in a session of its own there), into ring slots, for the
/// manager to send to the sink that holds the rest.
struct Fetch {
    addr: String,
    cred: Credential,
    producer: String,
    block_size: u32,
    step: u64,
    holder: usize,
    /// The destination the blocks go to.
    to: usize,
    blocks: Vec<(u64, u32)>,
    ring: Arc<Pool>,
    events: Sender<Event>,
    setup: Duration,
}

impl Fetch {
    fn run(self) {
        let error = self.fetch().err();
        let _ = self.events.send(Event::Gathered { step: self.step, holder: self.holder, error });
    }

    fn fetch(&self) -> Result<()> {
        let mut c = Conn::control(&self.addr, &self.cred)?;
        expect_session(&self.addr, c.request(Request::Stream { producer: self.producer.clone(), block_size: self.block_size })?)?;
        let t = c.into_transport();
        let mut r = FrameReader::new(t.split().map_err(|e| Error::network(&self.addr, &e))?);
        let mut w = FrameWriter::new(t);
        w.send(ToSink::Fetch { step: self.step, blocks: self.blocks.clone() })?;
        let mut buf = vec![0u8; self.block_size as usize];
        for _ in 0..self.blocks.len() {
            let h = match r.read::<FromSink>()? {
                Incoming::Data(h) => h,
                Incoming::Msg(FromSink::Error { kind, message }) => return Err(Error::new(kind, &self.addr, message)),
                Incoming::Msg(m) => return Err(Error::protocol(&self.addr, format!("{m:?} instead of a block of step {}", self.step))),
            };
            if h.file != self.step || h.len > self.block_size {
                return Err(Error::protocol(
                    &self.addr,
                    format!("a block of {} bytes of step {} instead of step {}", h.len, h.file, self.step),
                ));
            }
            let data = &mut buf[..h.len as usize];
            r.read_block(data, &[])?;
            let mut slot = self.slot()?;
            slot.fill(data);
            if self.events.send(Event::Fetched { step: self.step, offset: h.offset, data: slot, to: self.to }).is_err() {
                break;
            }
        }
        w.close();
        Ok(())
    }

    /// A free slot, leaving half the ring to the writer; waits for one up
    /// to the setup time.
    fn slot(&self) -> Result<pool::Block> {
        let deadline = Instant::now() + self.setup;
        loop {
            if let Some(s) = self.ring.take_sparing(self.ring.blocks() / 2) {
                return Ok(s);
            }
            if Instant::now() >= deadline {
                return Err(Error::new(ErrorKind::Unreachable, &self.addr, "no room in the buffer to gather a split step"));
            }
            std::thread::sleep(WORK_WAIT);
        }
    }
}

/// One data connection of a link.
struct StreamCtx {
    addr: String,
    cred: Credential,
    session: [u8; 16],
    index: u32,
    link: u64,
    work: Receiver<Arc<Block>>,
    /// Set by the manager to drop this connection (narrowing, or the link is gone).
    stop: Arc<AtomicBool>,
    events: Sender<Event>,
    /// How long setting the connection up may wait for the sink: never less
    /// than the ack timeout, so that a hung sink is failed over by the ack
    /// timeout and not sooner by a new connection's setup.
    setup: Duration,
}

impl StreamCtx {
    fn run(self) {
        if let Err(error) = self.send_blocks() {
            if !self.stop.load(Ordering::Relaxed) {
                let _ = self.events.send(Event::Down { link: self.link, error });
            }
        }
    }

    fn send_blocks(&self) -> Result<()> {
        let mut c = Conn::open_within(&self.addr, &self.cred, self.setup)?;
        expect_session(&self.addr, c.request(Open::OpenData { session: self.session, index: self.index })?)?;
        let mut w = FrameWriter::new(c.into_transport());
        while !self.stop.load(Ordering::Relaxed) {
            match self.work.recv_timeout(WORK_WAIT) {
                Ok(b) => {
                    let h = DataHeader { file: b.step, offset: b.offset, sum: b.sum, len: b.data.len() as u32, sparse: false };
                    match dmover_engine::fault::damaged_copy(&b.data) {
                        Some(damaged) => w.send_block(&h, &damaged)?,
                        None => w.send_block(&h, &b.data)?,
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let _ = w.send(OnData::StreamEnd {});
        Ok(())
    }
}
