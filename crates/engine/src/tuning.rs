//! Runs a stream tuner against a live transfer, in whichever direction it
//! goes: the tuner runs at the sending end, which is where blocks wait for
//! streams. An upload's client, a local copy and a third-party copy's
//! source server open their streams themselves; a server sending to a
//! client (a download) asks the client to dial each new one (`Dial`), and
//! runs the tuner the client chose ([`requested`]). Either way the timeline
//! goes back to the client in the report.
//!
//! Every [`TICK`] the tuning thread has an `Echo` sent on each host's control
//! connection; the receiver answers at once with the bytes it has taken off
//! the network and how full its write queues are. The answers give the round-trip
//! time `R` (mean of the last ten) and the delivered bytes; the sender adds
//! whether any block is waiting for a stream and the socket buffer `W`.
//! Each host's tuner (a pure policy from `dmover-tune`) sees that and may
//! ask for another stream count, which the sender applies at once; the
//! reader policy sees the whole transfer and may ask for more readers when
//! the source holds it back. Every decision, and a point every second, goes
//! into the timeline of the report.

use dmover_proto::frame::{EngineParams, TunePoint, TunerMode};
use dmover_tune::readers::{self, Readers};
use dmover_tune::{auto, paper, Mode, Observation, RttWindow, ServerLoad, Tuner};
use std::sync::Mutex;
use std::time::Duration;

/// How often the tuner measures.
pub const TICK: Duration = Duration::from_millis(50);
/// A timeline point at least this often.
const POINT_EVERY: Duration = Duration::from_secs(1);
/// Ticks over which the share of starved moments is taken.
const STARVED_TICKS: usize = 20;

/// Bounds of the chunk a client asks the mi, mi+ and aimd tuners to decide on.
const CHUNK_BOUNDS: (u64, u64) = (64 << 10, 1 << 40);

/// How a client names its tuner to a server that sends for it.
pub fn wire_mode(m: &Mode) -> TunerMode {
    match m {
        Mode::Auto(_) => TunerMode::Auto,
        Mode::Paper(paper::Mode::Mi, _) => TunerMode::Mi,
        Mode::Paper(paper::Mode::MiPlus, _) => TunerMode::MiPlus,
        Mode::Paper(paper::Mode::Aimd, _) => TunerMode::Aimd,
    }
}

/// The tuner a client asked a server to run for it (None: a fixed count),
/// starting at the client's streams, opening at most `most` streams to a
/// host, deciding on a chunk held to [`CHUNK_BOUNDS`].
pub fn requested(p: &EngineParams, most: usize) -> Option<Mode> {
    let n0 = p.streams as usize;
    let chunk = p.tune_chunk.clamp(CHUNK_BOUNDS.0, CHUNK_BOUNDS.1);
    let (a, b) = (auto::Params::default(), paper::Params::default());
    let paper = |m| Mode::Paper(m, paper::Params { n0, chunk, max_streams: b.max_streams.min(most), ..b });
    Some(match p.tuner {
        TunerMode::Fixed => return None,
        TunerMode::Auto => Mode::Auto(auto::Params { n0, max_streams: a.max_streams.min(most), ..a }),
        TunerMode::Mi => paper(paper::Mode::Mi),
        TunerMode::MiPlus => paper(paper::Mode::MiPlus),
        TunerMode::Aimd => paper(paper::Mode::Aimd),
    })
}

/// One host's control-channel measurements, fed by `Echo` answers.
#[derive(Default)]
pub struct Meter {
    state: Mutex<MeterState>,
}

#[derive(Default)]
struct MeterState {
    rtt: RttWindow,
    /// When the last answer came, and what it said.
    at: Duration,
    delivered: u64,
    staged: u8,
    server: ServerLoad,
    /// An answer came since the tuner last looked.
    fresh: bool,
}

impl Meter {
    /// Records an `Echo` answer that arrived at `now` (time since the start).
    pub fn echo(&self, now: Duration, stamp_us: u64, delivered: u64, staged: u8, server: ServerLoad) {
        let mut m = self.state.lock().expect("meter lock");
        m.rtt.push(now.saturating_sub(Duration::from_micros(stamp_us)));
        m.at = now;
        m.delivered = m.delivered.max(delivered);
        m.staged = staged;
        m.server = server;
        m.fresh = true;
    }
}

/// What the tuning thread needs of a sending transfer.
pub(crate) trait Tunable {
    /// Destination hosts, by index.
    fn hosts(&self) -> usize;
    /// Whether streams to `host` can be opened and dropped.
    fn can_add_streams(&self, host: usize) -> bool;
    /// Data streams to `host` running now.
    fn open_streams(&self, host: usize) -> usize;
    /// Opens or drops streams to `host` until `n` are wanted.
    fn set_streams(&self, host: usize, n: usize);
    /// Reader threads running or wanted.
    fn readers(&self) -> usize;
    /// Starts or stops reader threads until `n` are wanted.
    fn set_readers(&self, n: usize);
    fn stopped(&self) -> bool;
    /// Waits `d`, or less if the transfer stops meanwhile.
    fn pause(&self, d: Duration);
    /// Time since the transfer started.
    fn elapsed(&self) -> Duration;
    /// Sends an `Echo` probe stamped `stamp` (µs since the start) to `host`.
    fn probe(&self, host: usize, stamp: u64);
    /// Whether no block waits for `host`'s streams.
    fn starved(&self, host: usize) -> bool;
    /// What one data connection to `host` can have in flight (W).
    fn window(&self, host: usize) -> u64;
    /// `host`'s measurements from its `Echo` answers.
    fn meter(&self, host: usize) -> &Meter;
}

struct Host {
    index: usize,
    tuner: Box<dyn Tuner>,
    starved: [bool; STARVED_TICKS],
    tick: usize,
    /// The last timeline point: (time, delivered).
    last_point: (Duration, u64),
}

/// Tunes every host that can open streams until the transfer stops; returns the timeline.
pub(crate) fn run(sh: &dyn Tunable, make: &(dyn Fn() -> Box<dyn Tuner> + Send + Sync)) -> Vec<TunePoint> {
    let mut hosts: Vec<Host> = (0..sh.hosts())
        .filter(|&h| sh.can_add_streams(h))
        .map(|index| Host { index, tuner: make(), starved: [false; STARVED_TICKS], tick: 0, last_point: (Duration::ZERO, 0) })
        .collect();
    let mut timeline = Vec::new();
    for h in &hosts {
        sh.set_streams(h.index, h.tuner.initial());
    }
    let mut readers = Readers::new(sh.readers(), readers::Params::default());
    while !sh.stopped() {
        sh.pause(TICK);
        let now = sh.elapsed();
        let mut whole: Option<Observation> = None;
        for h in &mut hosts {
            sh.probe(h.index, now.as_micros() as u64);
            h.starved[h.tick % STARVED_TICKS] = sh.starved(h.index);
            h.tick += 1;
            let (o, fresh) = {
                let mut m = sh.meter(h.index).state.lock().expect("meter lock");
                let o = Observation {
                    now: m.at,
                    delivered: m.delivered,
                    rtt: m.rtt.mean(),
                    window: sh.window(h.index),
                    streams: sh.open_streams(h.index),
                    starved: h.starved.iter().filter(|s| **s).count() as f64 / STARVED_TICKS as f64,
                    staged: m.staged as f64 / 100.0,
                    server: m.server,
                };
                (o, std::mem::take(&mut m.fresh))
            };
            whole = Some(whole.map_or(o, |w| Observation {
                delivered: w.delivered + o.delivered,
                starved: w.starved.min(o.starved),
                staged: w.staged.max(o.staged),
                ..w
            }));
            if !fresh {
                continue;
            }
            let decision = h.tuner.observe(&o);
            if let Some(n) = decision {
                log::info!("{}: {} streams (R {:?}, W {} bytes)", h.tuner.name(), n, o.rtt, o.window);
                sh.set_streams(h.index, n);
            }
            if decision.is_some() || o.now >= h.last_point.0 + POINT_EVERY {
                let dt = (o.now - h.last_point.0).as_secs_f64();
                let goodput = if dt > 0.0 { (o.delivered - h.last_point.1) as f64 / dt } else { 0.0 };
                timeline.push(TunePoint {
                    t_ms: o.now.as_millis() as u64,
                    host: h.index as u32,
                    streams: decision.unwrap_or(o.streams) as u32,
                    concurrency: sh.readers() as u32,
                    goodput: goodput as u64,
                    rtt_us: o.rtt.as_micros() as u64,
                });
                h.last_point = (o.now, o.delivered);
            }
        }
        if let Some(n) = whole.and_then(|o| readers.observe(&Observation { now, ..o })) {
            log::info!("{n} readers");
            sh.set_readers(n);
        }
    }
    timeline
}
