//! In-situ streaming: a running simulation hands its output to dmover and
//! goes on computing while the data moves to an analysis site.
//!
//! The simulation [`Stream::open`]s a stream, [`Stream::write`]s its arrays
//! (each call copies into a circular buffer in memory and returns),
//! attaches key/value metadata with [`Stream::write_metadata`] (variable
//! names, dimensions, anything a post-processor needs), marks the end of
//! each time step with [`Stream::end_step`], and finally
//! [`Stream::close`]s, which sends whatever is left and returns a
//! [`Report`]. Behind it:
//!
//! * the circular buffer — block-sized slots under a fixed memory budget,
//!   the engine's staging [`Pool`] taken from by a writer that fills one
//!   block at a time. A write waits for a free slot only up to
//!   [`Config::max_wait`]; past that, the block goes to the spill file.
//!   Slots come back as sinks acknowledge their blocks, in any order, so
//!   one slow block does not hold back the others, and a block stays in
//!   memory until it is safe somewhere (which is what lets a dead sink's
//!   unacknowledged blocks go to the next one).
//! * [`spill`] — the spill file on local disk; spilled blocks are sent
//!   when bandwidth is free, or at close. No byte is dropped.
//! * [`policy`] — the queue manager's policy (the paper's states A, B and
//!   C): how many connections, and when to fetch spilled blocks back.
//! * [`manager`] — the queue manager thread: sends blocks to the first
//!   destination that takes them (a `dmover sink`; the first k, for k
//!   replicas), keeps each block until it is acknowledged (by k sinks),
//!   fails over to the next destination when a sink dies, makes a step
//!   that failover split whole at one sink, and records where every block
//!   is in a manifest it keeps on disk as the stream goes.
//! * [`manifest`] — that manifest, which [`drain`] reads, also when the
//!   producer was killed before close.
//! * [`ffi`] — the C ABI (`include/dmover_stream.h`), used from C, C++ and
//!   Fortran.
//!
//! Connections use dmover's protocol: the same token handshake, frames
//! and per-block XXH3-128 checksums as file transfers (`docs/PROTOCOL.md`).
//! This crate does not receive streams; `dmover sink` does.

pub mod ffi;
pub mod manager;
pub mod manifest;
pub mod policy;
pub mod spill;

use dmover_engine::error::{Error, Result};
use dmover_engine::pool::{Block, Pool};
use dmover_engine::session::Credential;
use dmover_proto::digest::block_sum;
pub use dmover_proto::frame::Share;
use dmover_proto::ErrorKind;
use manager::{Event, Manager};
use spill::Spill;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Buffer size of the paper's runs: 80 MB per producer.
pub const DEFAULT_BUFFER: u64 = 80 << 20;
/// Block size of the paper's runs, and dmover's.
pub const DEFAULT_BLOCK: u32 = 1 << 20;
/// Data connections a producer opens at most, by default.
pub const DEFAULT_MAX_STREAMS: usize = 8;
/// How long a sink may leave everything unacknowledged before it is taken
/// for dead, by default: long enough for 8 connections each sending a 1 MiB
/// block over a 1 Mbit/s path.
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(90);
/// How long close waits for undelivered blocks before leaving them in the
/// spill file, by default.
pub const DEFAULT_CLOSE_TIMEOUT: Duration = Duration::from_secs(600);

/// How to open a stream.
#[derive(Clone, Debug)]
pub struct Config {
    /// This producer's name: one path component of letters, digits, `.`,
    /// `_` and `-` (sinks file its steps under it), e.g. `gtc-rank17`.
    pub producer: String,
    /// Sinks as `host:port`, in order of preference; the later ones are
    /// alternates that take over when the earlier ones fail.
    pub destinations: Vec<String>,
    /// The sinks' shared token, or this producer's own credential
    /// (`dmover token --producer NAME`).
    pub token: Vec<u8>,
    /// Where overflowing blocks and the manifest go.
    pub spill_dir: PathBuf,
    /// Memory for the circular buffer, bytes.
    pub buffer: u64,
    /// Block size, bytes: writes are cut into blocks of this size.
    pub block_size: u32,
    /// Longest a write waits for room in the buffer before spilling.
    pub max_wait: Duration,
    /// Most data connections at once.
    pub max_streams: usize,
    /// Longest close waits for delivery before leaving blocks in the spill file.
    pub close_timeout: Duration,
    /// A sink that acknowledges nothing for this long while it has blocks
    /// or step ends to confirm is taken for dead (it hangs): failover.
    pub ack_timeout: Duration,
    /// How many sinks each step goes to, whole (1 to the number of
    /// destinations): the first `replicas` destinations that are up each
    /// get every block, a block's slot is freed only when that many hold
    /// it, and when one fails the next destination takes its place and
    /// gets a copy of what it held.
    pub replicas: usize,
    /// Keep the producer's manifest after a close that delivered
    /// everything (by default it is removed then, as the spill file is:
    /// the sinks' manifests and the report say where each step is).
    /// `DMOVER_KEEP_MANIFEST=1` sets it.
    pub keep_manifest: bool,
}

impl Config {
    /// A configuration with the defaults: 80 MiB buffer, 1 MiB blocks, no
    /// waiting in `write`, up to 8 connections.
    pub fn new(producer: &str, destinations: &[&str], token: &[u8], spill_dir: impl Into<PathBuf>) -> Config {
        Config {
            producer: producer.to_string(),
            destinations: destinations.iter().map(|d| d.to_string()).collect(),
            token: token.to_vec(),
            spill_dir: spill_dir.into(),
            buffer: DEFAULT_BUFFER,
            block_size: DEFAULT_BLOCK,
            max_wait: Duration::ZERO,
            max_streams: DEFAULT_MAX_STREAMS,
            close_timeout: DEFAULT_CLOSE_TIMEOUT,
            ack_timeout: DEFAULT_ACK_TIMEOUT,
            replicas: 1,
            keep_manifest: false,
        }
    }

    fn check(&self) -> Result<()> {
        let usage = |m: String| Err(Error::new(ErrorKind::Usage, &self.producer, m));
        let p = &self.producer;
        if p.is_empty() || p.len() > 64 || p.starts_with('.') || !p.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
            return usage("a producer name is 1 to 64 letters, digits, '.', '_' or '-', not starting with '.'".into());
        }
        if self.destinations.is_empty() {
            return usage("no destination: give at least one sink as host:port".into());
        }
        if let Some(d) = self.destinations.iter().find(|d| !is_host_port(d)) {
            let msg = format!("sink address {d:?} is not host:port");
            return Err(Error::new(ErrorKind::Usage, &self.producer, msg)
                .advised("give every sink with its port, as `dmover sink --listen` shows it, e.g. \"ana1:7460\""));
        }
        if self.replicas == 0 || self.replicas > self.destinations.len() {
            let msg = format!("{} replicas with {} destinations", self.replicas, self.destinations.len());
            return Err(Error::new(ErrorKind::Usage, &self.producer, msg).advised(
                "ask for 1 copy of each step up to one per destination, and give a spare destination to take over a dead one's copies",
            ));
        }
        if !(4096..=dmover_proto::frame::MAX_BLOCK).contains(&self.block_size) {
            return usage(format!("block size {} is outside 4 KiB..64 MiB", self.block_size));
        }
        if self.buffer < 2 * self.block_size as u64 {
            return usage(format!("a buffer of {} bytes holds fewer than two blocks of {}", self.buffer, self.block_size));
        }
        if !self.spill_dir.is_dir() {
            return Err(Error::new(ErrorKind::NotFound, self.spill_dir.display().to_string(), "the spill directory does not exist"));
        }
        Ok(())
    }

    /// The credential this producer authenticates with: its own, derived
    /// from the sinks' token, or the one it was given for its name.
    fn credential(&self) -> Result<Credential> {
        let (key_id, secret) = dmover_proto::auth::producer_credential(&self.token, &self.producer)
            .map_err(|m| Error::new(ErrorKind::Usage, &self.producer, m).advised("give each producer the credential made for its name"))?;
        Ok(Credential { key_id, secret, via: None, control: None })
    }
}

impl Config {
    /// Sets the close and ack timeouts from `DMOVER_CLOSE_TIMEOUT` and
    /// `DMOVER_ACK_TIMEOUT` (seconds), and the replicas from
    /// `DMOVER_REPLICAS`, where set: what the C, Fortran and Python
    /// bindings start from.
    pub fn options_from_env(&mut self) -> Result<()> {
        for (var, field) in [("DMOVER_CLOSE_TIMEOUT", &mut self.close_timeout), ("DMOVER_ACK_TIMEOUT", &mut self.ack_timeout)] {
            if let Ok(v) = std::env::var(var) {
                *field = seconds(&v).map_err(|m| Error::new(ErrorKind::Usage, var, format!("{v:?}: {m}")))?;
            }
        }
        if let Ok(v) = std::env::var("DMOVER_KEEP_MANIFEST") {
            self.keep_manifest = match v.trim() {
                "1" | "true" | "yes" => true,
                "0" | "false" | "no" | "" => false,
                _ => return Err(Error::new(ErrorKind::Usage, "DMOVER_KEEP_MANIFEST", format!("{v:?} is not 1 or 0"))),
            };
        }
        if let Ok(v) = std::env::var("DMOVER_REPLICAS") {
            self.replicas =
                v.trim().parse().map_err(|_| Error::new(ErrorKind::Usage, "DMOVER_REPLICAS", format!("{v:?} is not a number")))?;
        }
        Ok(())
    }
}

/// Parses a timeout in seconds (fractions allowed), from 1 ms to a week.
pub fn seconds(text: &str) -> std::result::Result<Duration, String> {
    let s: f64 = text.trim().parse().map_err(|_| "not a number of seconds".to_string())?;
    if !(0.001..=604_800.0).contains(&s) {
        return Err("a timeout is 0.001 to 604800 seconds".into());
    }
    Ok(Duration::from_secs_f64(s))
}

/// Whether `addr` is `host:port` (`[v6]:port` for IPv6) with a port from 1
/// to 65535: what a sink's address must be, there being no default port.
fn is_host_port(addr: &str) -> bool {
    match addr.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && !host.contains(['/', ' ']) && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

/// The token from the environment: `DMOVER_TOKEN`, else the file named by
/// `DMOVER_TOKEN_FILE` (what the C and Python bindings use).
pub fn token_from_env() -> Result<Vec<u8>> {
    if let Ok(t) = std::env::var("DMOVER_TOKEN") {
        if !t.trim().is_empty() {
            return Ok(t.trim().as_bytes().to_vec());
        }
    }
    if let Ok(f) = std::env::var("DMOVER_TOKEN_FILE") {
        return dmover_engine::session::read_token(std::path::Path::new(&f));
    }
    Err(Error::new(ErrorKind::Usage, "", "no token: set DMOVER_TOKEN or DMOVER_TOKEN_FILE"))
}

impl Report {
    /// The error to report for blocks left undelivered at close, if any:
    /// where they are, and how to send them once a sink is up.
    pub fn undelivered(&self) -> Option<Error> {
        if self.undelivered_blocks == 0 {
            return None;
        }
        let spill = self.spill_file.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "the spill file".into());
        let manifest = self.manifest.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "the manifest".into());
        if let Some((step, offset)) = self.damaged.first() {
            let msg = format!(
                "{} blocks arrived damaged at the sink every time they were sent ({} times; the first: step {step}, offset {offset}), \
                 so neither they nor their steps were acknowledged; they and the other {} undelivered blocks are in {spill} and \
                 {manifest} says where each block is",
                self.damaged.len(),
                dmover_proto::session::receive::MAX_DAMAGED,
                self.undelivered_blocks - self.damaged.len() as u64
            );
            let advice =
                format!("the network path to the sink damages data; once it is repaired, send them with `dmover drain {manifest}`");
            return Some(Error::new(ErrorKind::Verify, "", msg).advised(advice));
        }
        let msg =
            format!("{} blocks were not delivered; they are in {spill} and {manifest} says where each block is", self.undelivered_blocks);
        Some(Error::new(ErrorKind::Unreachable, "", msg).advised(format!("once a sink is up, send them with `dmover drain {manifest}`")))
    }
}

/// What a stream did, returned by [`Stream::close`].
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub steps: u64,
    /// Bytes written by the simulation.
    pub bytes: u64,
    pub blocks: u64,
    /// Blocks (and their bytes) that went to the spill file because the
    /// buffer was full; all are sent later unless counted as undelivered.
    pub spilled_blocks: u64,
    pub spilled_bytes: u64,
    /// Blocks sent again: after a failover or a damaged arrival.
    pub resent_blocks: u64,
    /// Blocks (step, offset) that arrived damaged at a sink every time they
    /// were sent, [`MAX_DAMAGED`](dmover_proto::session::receive::MAX_DAMAGED)
    /// times: never acknowledged, kept in the spill file, their steps not
    /// ended (counted in `undelivered_blocks` too).
    pub damaged: Vec<(u64, u64)>,
    /// Times a destination failed and the next one took over.
    pub failovers: u64,
    /// Blocks no sink acknowledged by the close timeout (they are in the spill file).
    pub undelivered_blocks: u64,
    /// Steps whose manifest no sink confirmed.
    pub unsaved_steps: u64,
    /// Steps that cannot be sent, ever (`drain` only): the producer stopped
    /// before they were whole, so some of their bytes were only in its memory.
    pub lost_steps: Vec<u64>,
    /// Steps whose blocks failover left on more than one sink and that could
    /// not be gathered to one (a sink holding some was down): every block
    /// is safe, but no sink has the whole step, so no hook ran for it.
    /// `drain` gathers them once those sinks are up.
    pub split_steps: Vec<u64>,
    /// For each step, the sinks that saved it whole (its copies).
    pub complete_at: BTreeMap<u64, Vec<String>>,
    /// Most data connections open at once.
    pub max_streams: usize,
    /// Policy looks spent in states A, B and C.
    pub ticks_a: u64,
    pub ticks_b: u64,
    pub ticks_c: u64,
    pub seconds: f64,
    /// The producer's manifest, where every block is; `None` once a close
    /// that delivered everything removed it (see [`Config::keep_manifest`]).
    pub manifest: Option<PathBuf>,
    /// The spill file, if it still holds undelivered blocks.
    pub spill_file: Option<PathBuf>,
    /// Each sink's share: its address, the blocks it acknowledged and their bytes.
    pub destinations: Vec<Share>,
}

/// Fewest slots the circular buffer has, whatever its size: one being
/// filled and one being sent.
pub const MIN_SLOTS: usize = 2;

/// The block being filled: a ring slot, or (the ring being full) the
/// spill block.
enum Filling {
    Ring(Block),
    Spill,
}

/// An open stream. Writing is single-threaded (`&mut self`); the sending
/// happens on the queue manager's thread.
pub struct Stream {
    ring: Arc<Pool>,
    spill: Arc<Spill>,
    /// To the queue manager; it stops when the writer sends `Close`.
    events: crossbeam_channel::Sender<Event>,
    manager: Option<JoinHandle<Result<Report>>>,
    max_wait: Duration,
    block_size: usize,
    /// How many destinations there are: the most replicas.
    destinations: usize,
    step: u64,
    /// Bytes written in this step.
    step_bytes: u64,
    blocks: u64,
    filling: Option<Filling>,
    /// Holds a block bound for the spill file (allocated on first overflow).
    spill_block: Vec<u8>,
    metadata: Vec<(String, String)>,
    records: Vec<(u64, u64)>,
}

impl Stream {
    /// Opens a stream: checks the configuration, connects to the first
    /// destination that takes the stream, and starts the queue manager.
    pub fn open(cfg: Config) -> Result<Stream> {
        cfg.check()?;
        let cred = cfg.credential()?;
        let ring = Pool::new(cfg.buffer, cfg.block_size as usize, MIN_SLOTS);
        let spill = Arc::new(Spill::new(&cfg.spill_dir, &cfg.producer));
        let (events, rx) = crossbeam_channel::unbounded();
        let (max_wait, block_size, destinations) = (cfg.max_wait, cfg.block_size as usize, cfg.destinations.len());
        let mut m = Manager::new(cfg, cred, ring.clone(), spill.clone(), events.clone(), rx);
        m.connect_first()?;
        let manager = std::thread::Builder::new()
            .name("dmover-stream".into())
            .spawn(move || m.run())
            .map_err(|e| Error::new(ErrorKind::Internal, "", format!("cannot start the queue manager: {e}")))?;
        Ok(Stream {
            ring,
            spill,
            events,
            manager: Some(manager),
            max_wait,
            block_size,
            destinations,
            step: 0,
            step_bytes: 0,
            blocks: 0,
            filling: None,
            spill_block: Vec::new(),
            metadata: Vec::new(),
            records: Vec::new(),
        })
    }

    /// Changes the close timeout and the ack timeout (see [`Config`]) of
    /// the open stream; `None` leaves one as it is.
    pub fn set_timeouts(&mut self, close: Option<Duration>, ack: Option<Duration>) -> Result<()> {
        self.send(Event::Timeouts { close, ack })
    }

    /// Changes how many sinks each step goes to (see [`Config::replicas`]),
    /// 1 to the number of destinations. Raising it also gives the steps
    /// already sent their new copies.
    pub fn set_replicas(&mut self, replicas: usize) -> Result<()> {
        if replicas == 0 || replicas > self.destinations {
            let msg = format!("{replicas} replicas with {} destinations", self.destinations);
            return Err(Error::new(ErrorKind::Usage, "", msg).advised("ask for 1 copy of each step up to one per destination"));
        }
        self.send(Event::Replicas { replicas })
    }

    /// The step being written (0 first).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Copies `data` into the buffer and returns. Waits for room at most
    /// [`Config::max_wait`] in all; what does not fit then goes to the
    /// spill file.
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        let deadline = Instant::now() + self.max_wait;
        self.records.push((self.step_bytes, data.len() as u64));
        let mut rest = data;
        while !rest.is_empty() {
            let filling = match self.filling.take() {
                Some(f) => f,
                None => match self.ring.take_before(deadline) {
                    Some(s) => Filling::Ring(s),
                    None => {
                        self.spill_block.clear();
                        self.spill_block.reserve_exact(self.block_size);
                        Filling::Spill
                    }
                },
            };
            let (n, full) = match filling {
                Filling::Ring(mut s) => {
                    let n = s.fill(rest);
                    let full = s.room() == 0;
                    self.filling = Some(Filling::Ring(s));
                    (n, full)
                }
                Filling::Spill => {
                    let n = rest.len().min(self.block_size - self.spill_block.len());
                    self.spill_block.extend_from_slice(&rest[..n]);
                    self.filling = Some(Filling::Spill);
                    (n, self.spill_block.len() == self.block_size)
                }
            };
            rest = &rest[n..];
            self.step_bytes += n as u64;
            if full {
                self.hand_over()?;
            }
        }
        Ok(())
    }

    /// Attaches a key/value pair to the current step (kept in order; sinks
    /// put them in the step's manifest).
    pub fn write_metadata(&mut self, key: &str, value: &str) -> Result<()> {
        if key.is_empty() {
            return Err(Error::new(ErrorKind::Usage, "", "a metadata key may not be empty"));
        }
        self.metadata.push((key.to_string(), value.to_string()));
        Ok(())
    }

    /// Ends the current step: its last partial block goes out, and once
    /// every block is acknowledged the sink writes the step's manifest.
    pub fn end_step(&mut self) -> Result<()> {
        if self.filling.is_some() {
            self.hand_over()?;
        }
        let ev = Event::StepEnd {
            step: self.step,
            bytes: self.step_bytes,
            blocks: self.blocks,
            metadata: std::mem::take(&mut self.metadata),
            records: std::mem::take(&mut self.records),
        };
        self.send(ev)?;
        self.step += 1;
        self.step_bytes = 0;
        self.blocks = 0;
        Ok(())
    }

    /// Ends the step if anything was written to it, sends everything left
    /// (spilled blocks included), writes the manifest and reports.
    pub fn close(mut self) -> Result<Report> {
        if self.step_bytes > 0 || !self.metadata.is_empty() || !self.records.is_empty() {
            self.end_step()?;
        }
        self.send(Event::Close)?;
        self.join()
    }

    fn join(&mut self) -> Result<Report> {
        match self.manager.take() {
            Some(h) => h.join().unwrap_or_else(|_| Err(Error::internal("the queue manager panicked"))),
            None => Err(Error::internal("the stream is already closed")),
        }
    }

    fn send(&mut self, ev: Event) -> Result<()> {
        if self.events.send(ev).is_err() {
            // The manager stopped: its error says why.
            return Err(self.join().err().unwrap_or_else(|| Error::internal("the queue manager stopped")));
        }
        Ok(())
    }

    /// Passes the block being filled to the manager (or the spill file).
    fn hand_over(&mut self) -> Result<()> {
        let offset = self.blocks * self.block_size as u64;
        self.blocks += 1;
        let ev = match self.filling.take() {
            Some(Filling::Ring(data)) => Event::Block { step: self.step, offset, data },
            Some(Filling::Spill) => {
                let sum = block_sum(&self.spill_block);
                let at = self
                    .spill
                    .append(self.step, offset, sum, &self.spill_block)
                    .map_err(|e| Error::io(self.spill.path().display().to_string(), &e))?;
                Event::Spilled { step: self.step, offset, len: self.spill_block.len() as u32, sum, at }
            }
            None => return Ok(()),
        };
        self.send(ev)
    }
}

/// Sends what an earlier stream left undelivered — closed, or killed before
/// close: the blocks its manifest (`SPILL_DIR/PRODUCER.PID.manifest.json`)
/// places in the spill file, and the steps whose manifest no sink saved.
/// Connects to the first destination that takes the stream — trying
/// again, while none is reachable, until `close_timeout` has passed —
/// waits for delivery within the same `close_timeout`, and rewrites the
/// manifest; the spill file is removed once everything in it that can be
/// sent is delivered. Steps the producer did not finish are reported in
/// [`Report::lost_steps`] and not sent.
pub fn drain(manifest: &Path, token: &[u8], close_timeout: Duration) -> Result<Report> {
    let subject = manifest.display().to_string();
    if manifest.to_string_lossy().ends_with(manifest::SPILL_SUFFIX) {
        return Err(not_a_manifest(manifest, "it is a spill file"));
    }
    let bytes = std::fs::read(manifest).map_err(|e| Error::io(&subject, &e))?;
    let m: manifest::Manifest = serde_json::from_slice(&bytes).map_err(|e| not_a_manifest(manifest, &e.to_string()))?;
    let dir = manifest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut cfg = Config::new(&m.producer, &m.destinations.iter().map(String::as_str).collect::<Vec<_>>(), token, dir);
    cfg.block_size = m.block_size;
    cfg.replicas = m.replicas;
    cfg.close_timeout = close_timeout;
    // Drain rewrites the manifest it was given: the record of where each block went.
    cfg.keep_manifest = true;
    cfg.check()?;
    let cred = cfg.credential()?;
    let spill = match Spill::open(&m.spill) {
        Ok(s) => s,
        // Nothing left to read from it: every block is at a sink, or lost.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !m.steps.iter().any(|s| s.sendable_from_spill()) => Spill::at(&m.spill),
        Err(e) => return Err(Error::io(m.spill.display().to_string(), &e)),
    };
    let ring = Pool::new(cfg.buffer, cfg.block_size as usize, MIN_SLOTS);
    let (events, rx) = crossbeam_channel::unbounded();
    let deadline = Instant::now() + close_timeout;
    let mut mgr = Manager::new(cfg, cred, ring, Arc::new(spill), events, rx).resume(&m, manifest)?;
    let mut pause = Duration::from_secs(1);
    loop {
        match mgr.connect_first() {
            Ok(()) => break,
            Err(e) if e.is_transient() && Instant::now() < deadline => {
                let wait = pause.min(deadline.saturating_duration_since(Instant::now()));
                log::warn!("stream {}: no sink reachable; trying again in {:.0} s", m.producer, wait.as_secs_f64());
                std::thread::sleep(wait);
                pause = (pause * 2).min(DRAIN_RETRY_MAX);
            }
            Err(e) => return Err(e),
        }
    }
    mgr.run()
}

/// The error for a file given to `drain` that is not a producer's manifest
/// (`why`): what drain needs, and where that is if the file is a spill file.
fn not_a_manifest(file: &Path, why: &str) -> Error {
    let msg = format!("not a stream manifest ({why})");
    let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let advice = if name.ends_with(manifest::SPILL_SUFFIX) {
        let beside = manifest::beside(file);
        let state = if beside.is_file() { "" } else { " (it is not there: was the spill file moved?)" };
        format!("drain takes the producer's manifest, not its spill file: `dmover drain {}`{state}", beside.display())
    } else {
        "drain takes a producer's manifest, SPILL_DIR/PRODUCER.PID.manifest.json, beside its spill file PRODUCER.PID.spill".into()
    };
    Error::new(ErrorKind::Usage, file.display().to_string(), msg).advised(advice)
}

/// Sends the library's warnings (a stream that starts spilling, a close
/// that waits on absent sinks, a sink given up) to standard error, as
/// `[dmover-stream LEVEL] message`, at the level `DMOVER_LOG` names
/// (`error`, `warn` — the default —, `info`, `debug`, `trace`, or `off`).
/// For programs that are not `dmover` itself: the C library and the Python
/// module call it when a stream opens; a program that installed a logger of
/// its own keeps it. (Not `env_logger`: a library linked into simulations
/// stays small.)
pub fn log_to_stderr() {
    struct Stderr;
    impl log::Log for Stderr {
        fn enabled(&self, m: &log::Metadata) -> bool {
            m.level() <= log::max_level()
        }
        fn log(&self, r: &log::Record) {
            if self.enabled(r.metadata()) {
                eprintln!("[dmover-stream {}] {}", r.level(), r.args());
            }
        }
        fn flush(&self) {}
    }
    let level = std::env::var("DMOVER_LOG").ok().and_then(|l| l.trim().parse().ok()).unwrap_or(log::LevelFilter::Warn);
    if log::set_logger(&Stderr).is_ok() {
        log::set_max_level(level);
    }
}

/// Longest pause between two tries of a drain to reach a sink.
const DRAIN_RETRY_MAX: Duration = Duration::from_secs(10);

impl Drop for Stream {
    /// A stream dropped without `close` still delivers what it holds.
    fn drop(&mut self) {
        if self.manager.is_some() {
            let _ = self.events.send(Event::Close);
            let _ = self.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_configurations_are_refused_before_connecting() {
        let dir = tempfile::tempdir().unwrap();
        let ok = Config::new("gtc-1", &["127.0.0.1:1"], b"token-token-token", dir.path());
        assert!(ok.check().is_ok());
        for (c, what) in [
            (Config { producer: "../x".into(), ..ok.clone() }, "name with a slash"),
            (Config { producer: ".hidden".into(), ..ok.clone() }, "name with a leading dot"),
            (Config { producer: String::new(), ..ok.clone() }, "empty name"),
            (Config { destinations: vec![], ..ok.clone() }, "no destination"),
            (Config { destinations: vec!["ana1".into()], ..ok.clone() }, "address without a port"),
            (Config { destinations: vec!["127.0.0.1:1".into(), "ana1:".into()], ..ok.clone() }, "alternate with an empty port"),
            (Config { destinations: vec![":7460".into()], ..ok.clone() }, "address without a host"),
            (Config { block_size: 100, ..ok.clone() }, "tiny block"),
            (Config { buffer: DEFAULT_BLOCK as u64, ..ok.clone() }, "buffer of one block"),
            (Config { spill_dir: dir.path().join("missing"), ..ok.clone() }, "missing spill directory"),
        ] {
            assert!(c.check().is_err(), "{what} was accepted");
        }
    }
}
