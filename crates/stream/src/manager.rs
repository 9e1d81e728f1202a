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
//! each a thread that takes blocks from a shared work channel. When any of
//! them fails the link is down: its unacknowledged blocks go back to the
//! front of the queue and the manager opens a link to the next destination
//! (failover). A destination that failed is tried again after
//! [`RETRY_DOWN`], once the others have failed too.
//!
//! A step is settled when each of its blocks is acknowledged somewhere and
//! the current destination has saved its manifest (`StepSaved`); its
//! `StepEnd` says where each block is, so a sink that took over midway
//! records the blocks its predecessor holds.
//!
//! While no destination is reachable, blocks waiting in memory go to the
//! spill file, so that nothing the simulation ended sits only in memory.
//! The producer's manifest stays on disk as the stream goes: rewritten
//! atomically (temporary name, then rename) when blocks spill, steps end
//! or sinks acknowledge, in batches at most every [`MANIFEST_EVERY`], by
//! this thread, never the simulation's. A producer killed before close
//! leaves a manifest that `drain` sends from.

use crate::policy::{Decision, Observation, Policy, State};
use crate::ring::{Ring, Slot};
use crate::spill::Spill;
use crate::{manifest, Config, DestinationReport, Report};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use dmover_engine::error::{Error, Result};
use dmover_engine::session::{expect_session, Conn, Credential, SETUP_TIMEOUT};
use dmover_engine::transport::Transport;
use dmover_engine::wire::{FrameReader, FrameWriter, Incoming};
use dmover_proto::digest::{block_sum, file_digest, Sum};
use dmover_proto::frame::{DataHeader, StepBlock, StepInfo};
use dmover_proto::phase::{FromSink, OnData, Open, Request, ToSink};
use dmover_proto::session::receive::MAX_DAMAGED;
use dmover_proto::ErrorKind;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
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
/// The manifest on disk is rewritten, when something changed, at most this
/// often: what a producer killed before close can lose of its bookkeeping.
pub const MANIFEST_EVERY: Duration = Duration::from_millis(500);
/// ... and at most once per this many times its last write took, so that
/// keeping a long stream's manifest takes at most 1/20 of this thread.
const MANIFEST_SHARE: u32 = 20;

/// A block in memory, ready to send: shared between the manager (until
/// acknowledged) and the connection sending it.
pub struct Block {
    pub step: u64,
    pub offset: u64,
    pub sum: Sum,
    pub data: Slot,
    /// Where it is in the spill file, if it was read back from there.
    pub spilled_at: Option<u64>,
}

/// Everything the manager hears about.
pub enum Event {
    /// The writer filled a slot.
    Block { step: u64, offset: u64, data: Slot },
    /// The writer found the ring full and wrote a block to the spill file.
    Spilled { step: u64, offset: u64, len: u32, sum: Sum, at: u64 },
    /// The writer ended a step.
    StepEnd { step: u64, bytes: u64, blocks: u64, metadata: Vec<(String, String)>, records: Vec<(u64, u64)> },
    /// The writer closed the stream.
    Close,
    /// The writer changed the close or ack timeout (`None`: unchanged).
    Timeouts { close: Option<Duration>, ack: Option<Duration> },
    /// Link `link`'s sink wrote these blocks.
    Acked { link: u64, blocks: Vec<(u64, u64)> },
    /// Link `link`'s sink got this block damaged.
    Nack { link: u64, step: u64, offset: u64 },
    /// Link `link`'s sink saved the step's manifest; `complete` if every
    /// block of the step is there.
    Saved { link: u64, step: u64, complete: bool },
    /// A block of a split step, fetched back from the sink that held it.
    Fetched { step: u64, offset: u64, data: Slot },
    /// Fetching a split step's blocks back from `holder` ended.
    Gathered { step: u64, holder: usize, error: Option<Error> },
    /// Link `link`'s sink told its name.
    Named { link: u64, name: String },
    /// Link `link` failed.
    Down { link: u64, error: Error },
}

/// Where a block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// In the ring, not yet acknowledged.
    Memory,
    /// In the spill file at this offset, not yet delivered.
    Spilled(u64),
    /// Acknowledged by this destination.
    At(usize),
}

struct BlockRec {
    len: u32,
    sum: Sum,
    place: Place,
}

#[derive(Default)]
struct StepState {
    /// Set when the writer ended the step.
    end: Option<StepEnd>,
    blocks: BTreeMap<u64, BlockRec>,
    /// The link its `StepEnd` went on, if any.
    end_sent: Option<u64>,
    /// Where its manifest was saved.
    saved: Option<usize>,
    /// That manifest says every block is there.
    complete: bool,
    /// Saved split (some blocks at another sink) and left so: gathering it
    /// failed while closing (`drain` tries again).
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
    /// One stop flag per data connection, oldest first.
    streams: Vec<Arc<AtomicBool>>,
    next_index: u32,
    last_control: Instant,
    /// When the sink last acknowledged something (or the link opened).
    last_ack: Instant,
}

impl Destination {
    fn new(addr: &str, name: &str) -> Destination {
        Destination { addr: addr.to_string(), name: name.to_string(), down_until: None, blocks: 0, bytes: 0 }
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
    ring: Arc<Ring>,
    spill: Arc<Spill>,
    events: Sender<Event>,
    rx: Receiver<Event>,
    /// Blocks ready and waiting for a link, oldest first.
    queue: VecDeque<Arc<Block>>,
    /// Blocks handed to the current link and not yet acknowledged.
    inflight: HashMap<(u64, u64), Arc<Block>>,
    /// Spilled blocks not yet delivered (and not read back), oldest first.
    spilled: VecDeque<(u64, u64)>,
    steps: BTreeMap<u64, StepState>,
    /// Ended steps whose `StepEnd` has not gone on the current link.
    unsent: BTreeSet<u64>,
    /// Steps whose `StepEnd` went on the current link and is not yet saved.
    unconfirmed: usize,
    /// Times each block in flight arrived damaged (`Nack`).
    damage: HashMap<(u64, u64), u32>,
    /// The split step whose blocks are being fetched back, if any.
    gathering: Option<u64>,
    dests: Vec<Destination>,
    link: Option<Link>,
    links_opened: u64,
    policy: Policy,
    start: Instant,
    spilled_since: usize,
    closing: Option<Instant>,
    report: Report,
    /// The producer's manifest on disk, and whether it changed since it
    /// was last written, when, and how long to wait before the next write.
    manifest_path: PathBuf,
    manifest_dirty: bool,
    manifest_written: Instant,
    manifest_every: Duration,
}

impl Manager {
    pub fn new(cfg: Config, cred: Credential, ring: Arc<Ring>, spill: Arc<Spill>, events: Sender<Event>, rx: Receiver<Event>) -> Manager {
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
            queue: VecDeque::new(),
            inflight: HashMap::new(),
            spilled: VecDeque::new(),
            steps: BTreeMap::new(),
            unsent: BTreeSet::new(),
            unconfirmed: 0,
            damage: HashMap::new(),
            gathering: None,
            dests,
            link: None,
            links_opened: 0,
            start: Instant::now(),
            spilled_since: 0,
            closing: None,
            report: Report::default(),
            manifest_path,
            manifest_dirty: false,
            manifest_written: Instant::now(),
            manifest_every: MANIFEST_EVERY,
        }
    }

    /// Opens the first link; fails if no destination takes the stream.
    pub fn connect_first(&mut self) -> Result<()> {
        let mut first_error = None;
        for d in 0..self.dests.len() {
            match self.open_link(d) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    log::warn!("stream {}: {e}", self.cfg.producer);
                    first_error.get_or_insert(e);
                }
            }
        }
        Err(first_error.unwrap_or_else(|| Error::new(ErrorKind::Usage, "", "no destination given")))
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
                let place = match &b.place {
                    manifest::Place::At { at } => Place::At(self.dest_index(at)),
                    // A lost step's spilled blocks go with the spill file.
                    _ if lost => Place::Memory,
                    manifest::Place::Spilled { spill_offset, .. } => {
                        self.spilled.push_back((step, b.offset));
                        Place::Spilled(*spill_offset)
                    }
                    manifest::Place::Undelivered { .. } => unreachable!("a step with an undelivered block is lost"),
                };
                st.blocks.insert(b.offset, BlockRec { len: b.len, sum: b.xxh3, place });
            }
            st.end = s.ended.then(|| StepEnd {
                bytes: s.bytes,
                blocks: st.blocks.len() as u64,
                metadata: s.metadata.clone().into_iter().collect(),
                records: s.records.clone(),
            });
            st.saved = s.manifest_at.as_deref().map(|a| self.dest_index(a));
            st.complete = st.saved.is_some_and(|d| st.blocks.values().all(|b| b.place == Place::At(d)));
            if st.saved.is_none() && !lost {
                self.unsent.insert(step);
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
            if self.closing.is_some_and(|t| t.elapsed() >= self.cfg.close_timeout) {
                log::warn!("stream {}: close timeout; keeping what is undelivered in the spill file", self.cfg.producer);
                self.spill_memory()?;
                break;
            }
        }
        if let Some(mut l) = self.link.take() {
            l.close();
        }
        self.finish()
    }

    fn handle(&mut self, ev: Event) -> Result<()> {
        let current = self.link.as_ref().map(|l| l.id);
        match ev {
            Event::Block { step, offset, data } => {
                let sum = block_sum(&data);
                let len = data.len() as u32;
                self.steps.entry(step).or_default().blocks.insert(offset, BlockRec { len, sum, place: Place::Memory });
                self.report.blocks += 1;
                self.queue.push_back(Arc::new(Block { step, offset, sum, data, spilled_at: None }));
            }
            Event::Spilled { step, offset, len, sum, at } => {
                self.steps.entry(step).or_default().blocks.insert(offset, BlockRec { len, sum, place: Place::Spilled(at) });
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
                self.unsent.insert(step);
                self.manifest_dirty = true;
                self.end_steps()?;
            }
            Event::Close => self.closing = Some(Instant::now()),
            Event::Timeouts { close, ack } => {
                self.cfg.close_timeout = close.unwrap_or(self.cfg.close_timeout);
                self.cfg.ack_timeout = ack.unwrap_or(self.cfg.ack_timeout);
            }
            Event::Acked { link, blocks } if Some(link) == current => {
                let l = self.link.as_mut().expect("current link");
                l.last_ack = Instant::now();
                let dest = l.dest;
                for key in blocks {
                    let Some(b) = self.inflight.remove(&key) else { continue };
                    if let Some(rec) = self.steps.get_mut(&b.step).and_then(|s| s.blocks.get_mut(&b.offset)) {
                        rec.place = Place::At(dest);
                    }
                    self.dests[dest].blocks += 1;
                    self.dests[dest].bytes += b.data.len() as u64;
                    self.manifest_dirty = true;
                }
                self.end_steps()?;
            }
            Event::Nack { link, step, offset } if Some(link) == current => {
                let l = self.link.as_mut().expect("current link");
                l.last_ack = Instant::now();
                let Some(b) = self.inflight.get(&(step, offset)) else { return Ok(()) };
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
            Event::Saved { link, step, complete } if Some(link) == current => {
                let l = self.link.as_mut().expect("current link");
                l.last_ack = Instant::now();
                let dest = l.dest;
                if let Some(s) = self.steps.get_mut(&step) {
                    if s.end_sent == Some(link) && s.saved.is_none() {
                        self.unconfirmed -= 1;
                    }
                    s.saved = Some(dest);
                    s.complete = complete;
                    self.manifest_dirty = true;
                }
            }
            Event::Fetched { step, offset, data } => {
                let sum = block_sum(&data);
                let Some(rec) = self.steps.get_mut(&step).and_then(|s| s.blocks.get_mut(&offset)) else { return Ok(()) };
                if rec.sum != sum || rec.len as usize != data.len() || !matches!(rec.place, Place::At(_)) {
                    log::warn!("stream {}: step {step}, block at offset {offset} came back damaged; not gathering it", self.cfg.producer);
                    return Ok(());
                }
                rec.place = Place::Memory;
                self.queue.push_back(Arc::new(Block { step, offset, sum, data, spilled_at: None }));
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
            Event::Named { link, name } if Some(link) == current => {
                let dest = self.link.as_ref().expect("current link").dest;
                self.name_destination(dest, name);
            }
            Event::Down { link, error } if Some(link) == current => self.link_down(error),
            // Events from a link that is gone: its blocks were requeued.
            Event::Acked { .. } | Event::Nack { .. } | Event::Saved { .. } | Event::Named { .. } | Event::Down { .. } => {}
        }
        Ok(())
    }

    /// Every [`TICK`]: consult the policy, reopen a link if none, ping.
    fn tick(&mut self) -> Result<()> {
        if self.link.is_none() {
            self.reconnect();
        }
        if self.link.is_none() && !self.queue.is_empty() {
            // No destination takes blocks: keep them on disk, not only in
            // memory, and free their slots for the writer.
            let blocks: Vec<Arc<Block>> = self.queue.drain(..).collect();
            self.spill_blocks(blocks, true)?;
        }
        self.gather();
        self.keep_manifest();
        let backlog = self.queue.len() + self.link.as_ref().map_or(0, |l| l.work.len());
        let o = Observation {
            now: self.start.elapsed(),
            backlog,
            slots: self.ring.slots(),
            free: self.ring.free(),
            spilled: std::mem::take(&mut self.spilled_since),
            spill_pending: self.spilled.len(),
        };
        let mut d: Decision = self.policy.decide(&o);
        if self.closing.is_some() {
            // The writer is done: the whole ring is free for spilled blocks.
            d.fetch = self.spilled.len().min(o.free);
        }
        if self.link.is_none() {
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
        let waiting = !self.inflight.is_empty() || self.unconfirmed > 0;
        if let Some(l) = &mut self.link {
            if waiting && l.last_ack.elapsed() >= self.cfg.ack_timeout {
                let what = format!("acknowledged nothing for {:?}", self.cfg.ack_timeout);
                let e = Error::new(ErrorKind::Unreachable, &self.dests[l.dest].addr, what);
                self.link_down(e);
                return Ok(());
            }
            if !waiting {
                l.last_ack = Instant::now();
            }
            if l.last_control.elapsed() >= PING_EVERY {
                l.last_control = Instant::now();
                if let Err(e) = l.control.send(ToSink::Ping {}) {
                    self.link_down(e);
                }
            }
        }
        Ok(())
    }

    /// Hands every waiting block to the current link.
    fn dispatch(&mut self) {
        let Some(l) = &self.link else { return };
        while let Some(b) = self.queue.pop_front() {
            self.inflight.insert((b.step, b.offset), b.clone());
            if l.work.send(b).is_err() {
                break;
            }
        }
    }

    /// Reads up to `n` spilled blocks back into free slots and queues them.
    fn fetch_spilled(&mut self, n: usize) -> Result<()> {
        let keep = if self.closing.is_some() { 0 } else { self.ring.slots() / 2 };
        for _ in 0..n {
            let Some(&(step, offset)) = self.spilled.front() else { break };
            let Some(mut slot) = self.ring.take_sparing(keep) else { break };
            let rec = &self.steps[&step].blocks[&offset];
            let Place::Spilled(at) = rec.place else { unreachable!("a spilled block is in the spill file") };
            slot.resize(rec.len as usize);
            self.spill.read(at, &mut slot).map_err(|e| Error::io(self.spill.path().display().to_string(), &e))?;
            if block_sum(&slot) != rec.sum {
                let msg = format!("step {step}, offset {offset}: the spilled block reads back damaged");
                return Err(Error::new(ErrorKind::Verify, self.spill.path().display().to_string(), msg));
            }
            self.spilled.pop_front();
            self.queue.push_back(Arc::new(Block { step, offset, sum: rec.sum, data: slot, spilled_at: Some(at) }));
        }
        Ok(())
    }

    /// Makes a step that failover split whole again at the sink this
    /// producer sends to: once the step is saved split, its blocks at other
    /// sinks are fetched back from them (`Fetch`, one sink and one step at a
    /// time) and sent here like any block, and when every block is here the
    /// step ends again, so that this sink's manifest says it is complete
    /// and runs the hook, once (a sink runs the hook only of a complete
    /// step). A sink that cannot be reached is tried again after
    /// [`RETRY_DOWN`]; while closing, the step is left split instead
    /// (`drain` tries again).
    fn gather(&mut self) {
        let Some(cur) = self.link.as_ref().map(|l| l.dest) else { return };
        if self.gathering.is_some() {
            return;
        }
        let now = Instant::now();
        let mut whole = Vec::new();
        for (&step, s) in &self.steps {
            if s.saved.is_none() || s.complete || s.left_split || s.lost || s.damaged {
                continue;
            }
            let elsewhere = |d: usize| s.blocks.values().filter(move |b| b.place == Place::At(d)).count();
            let holder = s.blocks.values().find_map(|b| match b.place {
                Place::At(d) if d != cur => Some(d),
                _ => None,
            });
            match holder {
                Some(h) if self.dests[h].down_until.is_some_and(|t| t > now) => continue,
                Some(h) => {
                    let blocks: Vec<(u64, u32)> =
                        s.blocks.iter().filter(|(_, b)| b.place == Place::At(h)).map(|(&offset, b)| (offset, b.len)).collect();
                    log::info!(
                        "stream {}: step {step} is split; gathering its {} blocks at {} to {}",
                        self.cfg.producer,
                        elsewhere(h),
                        self.dests[h].name,
                        self.dests[cur].name
                    );
                    let fetch = Fetch {
                        addr: self.dests[h].addr.clone(),
                        cred: self.cred.clone(),
                        producer: self.cfg.producer.clone(),
                        block_size: self.cfg.block_size,
                        step,
                        holder: h,
                        blocks,
                        ring: self.ring.clone(),
                        events: self.events.clone(),
                        setup: self.cfg.ack_timeout.max(SETUP_TIMEOUT),
                    };
                    self.gathering = Some(step);
                    std::thread::spawn(move || fetch.run());
                    break;
                }
                // Every block is here (or on its way): end the step again.
                None if s.blocks.values().all(|b| b.place == Place::At(cur)) => whole.push(step),
                None => {}
            }
        }
        for step in whole {
            let s = self.steps.get_mut(&step).expect("whole steps exist");
            s.saved = None;
            s.end_sent = None;
            self.unsent.insert(step);
        }
        if !self.unsent.is_empty() {
            let _ = self.end_steps();
        }
    }

    /// Gives up a block that arrived damaged at `sink` [`MAX_DAMAGED`]
    /// times: the path damages it, and sending it again would loop. It
    /// goes to the spill file (freeing its slot) for `drain` to send once
    /// the path is repaired; its step is not ended in this run, and close
    /// reports it ([`Report::damaged`]). Nothing damaged was acknowledged.
    fn give_up_damaged(&mut self, step: u64, offset: u64, sink: &str) -> Result<()> {
        let Some(b) = self.inflight.remove(&(step, offset)) else { return Ok(()) };
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
        self.end_steps()
    }

    /// Sends `StepEnd` for the ended steps whose blocks are all
    /// acknowledged, in step order: it stops at the first step still waiting
    /// for a block, so that a sink saves steps, and runs their hooks, in
    /// order. A step with a block given up as damaged is passed over.
    fn end_steps(&mut self) -> Result<()> {
        let Some(l) = &mut self.link else { return Ok(()) };
        let mut failed = None;
        let mut sent = Vec::new();
        for &step in &self.unsent {
            let s = self.steps.get_mut(&step).expect("unsent steps exist");
            if s.damaged {
                continue;
            }
            let Some(end) = &s.end else { break };
            if s.blocks.len() as u64 != end.blocks || !s.blocks.values().all(|b| matches!(b.place, Place::At(_))) {
                break;
            }
            let blocks = s
                .blocks
                .iter()
                .map(|(&offset, b)| {
                    let Place::At(d) = b.place else { unreachable!("checked above") };
                    let at = if d == l.dest { String::new() } else { self.dests[d].name.clone() };
                    StepBlock { offset, len: b.len, sum: b.sum, at }
                })
                .collect();
            let info = StepInfo {
                step,
                bytes: end.bytes,
                digest: file_digest(s.blocks.values().map(|b| &b.sum)),
                metadata: end.metadata.clone(),
                records: end.records.clone(),
                blocks,
            };
            if let Err(e) = l.control.send(ToSink::StepEnd { info }) {
                failed = Some(e);
                break;
            }
            l.last_control = Instant::now();
            s.end_sent = Some(l.id);
            self.unconfirmed += 1;
            sent.push(step);
        }
        for step in sent {
            self.unsent.remove(&step);
        }
        if let Some(e) = failed {
            self.link_down(e);
        }
        Ok(())
    }

    fn settled(&self) -> bool {
        self.queue.is_empty()
            && self.inflight.is_empty()
            && self.spilled.is_empty()
            && self.gathering.is_none()
            && self.steps.values().all(|s| s.lost || s.damaged || (s.end.is_some() && s.saved.is_some() && (s.complete || s.left_split)))
    }

    /// Opens or closes data connections of the current link to reach `n`.
    fn set_streams(&mut self, n: usize) {
        let Some(l) = &mut self.link else { return };
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

    /// Tears the current link down and requeues what it had not confirmed.
    fn link_down(&mut self, error: Error) {
        let Some(mut l) = self.link.take() else { return };
        l.close();
        let dest = &mut self.dests[l.dest];
        log::warn!("stream {}: destination {} failed ({error}); failing over", self.cfg.producer, dest.addr);
        dest.down_until = Some(Instant::now() + RETRY_DOWN);
        self.report.failovers += 1;
        self.damage.clear();
        let mut back: Vec<Arc<Block>> = self.inflight.drain().map(|(_, b)| b).collect();
        back.sort_by_key(|b| (b.step, b.offset));
        self.report.resent_blocks += back.len() as u64;
        for b in back.into_iter().rev() {
            self.queue.push_front(b);
        }
        self.unconfirmed = 0;
        for (&step, s) in self.steps.iter_mut() {
            if s.end_sent == Some(l.id) && s.saved.is_none() {
                s.end_sent = None;
                self.unsent.insert(step);
            }
        }
        self.reconnect();
    }

    /// Opens a link to the first destination not recently failed.
    fn reconnect(&mut self) {
        let now = Instant::now();
        for d in 0..self.dests.len() {
            if self.dests[d].down_until.is_some_and(|t| t > now) {
                continue;
            }
            match self.open_link(d) {
                Ok(()) => {
                    let _ = self.end_steps();
                    return;
                }
                Err(e) => {
                    log::warn!("stream {}: {e}", self.cfg.producer);
                    self.dests[d].down_until = Some(now + RETRY_DOWN);
                }
            }
        }
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
        self.link = Some(Link {
            id,
            dest,
            session,
            control,
            work,
            work_rx,
            streams: Vec::new(),
            next_index: 0,
            last_control: Instant::now(),
            last_ack: Instant::now(),
        });
        self.dests[dest].down_until = None;
        self.set_streams(self.policy.streams());
        Ok(())
    }

    /// Writes every block still in memory to the spill file (close timeout).
    fn spill_memory(&mut self) -> Result<()> {
        let blocks: Vec<Arc<Block>> = self.queue.drain(..).chain(self.inflight.drain().map(|(_, b)| b)).collect();
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
                    at
                }
            };
            if let Some(rec) = self.steps.get_mut(&b.step).and_then(|s| s.blocks.get_mut(&b.offset)) {
                rec.place = Place::Spilled(at);
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
        let mut undelivered = 0;
        for s in self.steps.values().filter(|s| !s.lost) {
            undelivered += s.blocks.values().filter(|b| !matches!(b.place, Place::At(_))).count() as u64;
        }
        self.report.undelivered_blocks = undelivered;
        self.report.unsaved_steps = self.steps.values().filter(|s| !s.lost && s.saved.is_none()).count() as u64;
        self.report.lost_steps = self.steps.iter().filter(|(_, s)| s.lost).map(|(&step, _)| step).collect();
        self.report.split_steps = self.steps.iter().filter(|(_, s)| s.saved.is_some() && !s.complete).map(|(&step, _)| step).collect();
        if undelivered == 0 {
            self.spill.remove();
        } else {
            self.report.spill_file = Some(self.spill.path().to_path_buf());
        }
        self.report.seconds = self.start.elapsed().as_secs_f64();
        self.report.destinations =
            self.dests.iter().map(|d| DestinationReport { addr: d.addr.clone(), blocks: d.blocks, bytes: d.bytes }).collect();
        self.write_manifest().map_err(|e| Error::io(self.manifest_path.display().to_string(), &e))?;
        self.report.manifest = self.manifest_path.clone();
        Ok(self.report)
    }

    /// Where every block of every step is.
    fn manifest(&self) -> manifest::Manifest {
        let steps = self
            .steps
            .iter()
            .map(|(&step, s)| {
                let blocks = s
                    .blocks
                    .iter()
                    .map(|(&offset, b)| {
                        let place = match b.place {
                            Place::At(d) => manifest::Place::At { at: self.dests[d].name.clone() },
                            Place::Spilled(at) => manifest::Place::Spilled { spill: self.spill.path().to_path_buf(), spill_offset: at },
                            Place::Memory => manifest::Place::Undelivered { undelivered: true },
                        };
                        manifest::Block { offset, len: b.len, xxh3: b.sum, place }
                    })
                    .collect();
                let (bytes, metadata, records) = match &s.end {
                    Some(e) => (e.bytes, e.metadata.iter().cloned().collect(), e.records.clone()),
                    None => Default::default(),
                };
                let manifest_at = s.saved.map(|d| self.dests[d].name.clone());
                manifest::Step { step, ended: s.end.is_some(), bytes, metadata, records, manifest_at, blocks }
            })
            .collect();
        manifest::Manifest {
            producer: self.cfg.producer.clone(),
            block_size: self.cfg.block_size,
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
    blocks: Vec<(u64, u32)>,
    ring: Arc<Ring>,
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
            if self.events.send(Event::Fetched { step: self.step, offset: h.offset, data: slot }).is_err() {
                break;
            }
        }
        w.close();
        Ok(())
    }

    /// A free slot, leaving half the ring to the writer; waits for one up
    /// to the setup time.
    fn slot(&self) -> Result<Slot> {
        let deadline = Instant::now() + self.setup;
        loop {
            if let Some(s) = self.ring.take_sparing(self.ring.slots() / 2) {
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
                    let h = DataHeader { file: b.step, offset: b.offset, sum: b.sum, len: b.data.len() as u32 };
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
