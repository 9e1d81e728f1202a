//! A simulated bottleneck link for testing tuners deterministically.
//!
//! A fluid model, stepped every [`STEP`]: each stream keeps
//! `min(cwnd, W, loss window)` bytes in flight; a new stream sends nothing
//! for two round trips (connection and authentication) and then doubles its
//! congestion window every round trip from ten packets. While the bytes in
//! flight fit in the bandwidth-delay product the link is idle part of the
//! time; up to the queue's size more only lengthens the round trip; beyond
//! it, drops hold the goodput to the loss-limited rate of [`crate::model`].
//! Several transfers can share the link, all to one receiving server: the
//! rate is split in proportion to their bytes in flight, each share
//! wobbling by up to [`Link::jitter`] as real congestion control makes it.

use crate::{model, Observation, ServerLoad, Tuner};
use std::time::Duration;

/// Simulation step.
pub const STEP: Duration = Duration::from_millis(10);
/// How often a tuner observes.
pub const OBSERVE_EVERY: Duration = Duration::from_millis(50);
const MSS: f64 = 1448.0;

#[derive(Debug, Clone)]
pub struct Link {
    /// Bottleneck rate, bytes/s.
    pub rate: f64,
    /// Round-trip propagation delay.
    pub base_rtt: Duration,
    /// Drop-tail queue, bytes.
    pub queue: f64,
    /// Socket buffer of every stream, bytes (W).
    pub window: u64,
    /// Random loss probability per packet (0: none).
    pub loss: f64,
    /// Standard deviation of each transfer's share of a shared link,
    /// relative, wandering with a time constant of [`JITTER_TIME`] (0: none).
    pub jitter: f64,
}

/// Time constant of the shares' wobble.
pub const JITTER_TIME: Duration = Duration::from_secs(1);

impl Link {
    pub fn new(rate_mbit: f64, base_rtt: Duration, queue_packets: u32, window: u64) -> Link {
        Link { rate: rate_mbit * 1e6 / 8.0, base_rtt, queue: queue_packets as f64 * model::PACKET, window, loss: 0.0, jitter: 0.0 }
    }

    /// Per-stream ceiling on the window set by random loss (Mathis et al.).
    fn loss_window(&self) -> f64 {
        if self.loss > 0.0 {
            1.22 * MSS / self.loss.sqrt()
        } else {
            f64::INFINITY
        }
    }
}

struct Stream {
    age: Duration,
    cwnd: f64,
}

/// One simulated transfer: a tuner and its streams.
struct Flow<'a> {
    tuner: &'a mut dyn Tuner,
    /// When the transfer starts; its clock and trace count from there.
    start: Duration,
    target: usize,
    streams: Vec<Stream>,
    delivered: f64,
    /// Relative deviation of its share now.
    wobble: f64,
    trace: Trace,
}

/// What happened to one transfer, step by step.
#[derive(Debug, Default, Clone)]
pub struct Trace {
    /// (time, target streams, open streams, goodput bytes/s) per step.
    pub steps: Vec<(Duration, usize, usize, f64)>,
    /// (time, new stream count) per decision.
    pub changes: Vec<(Duration, usize)>,
}

impl Trace {
    /// The stream counts the tuner chose, in order.
    pub fn decisions(&self) -> impl Iterator<Item = usize> + '_ {
        self.changes.iter().map(|c| c.1)
    }

    pub fn final_streams(&self) -> usize {
        self.steps.last().map_or(0, |s| s.1)
    }

    /// Mean goodput in Mbit/s between `from` and `to`.
    pub fn goodput_mbit_between(&self, from: Duration, to: Duration) -> f64 {
        let sel: Vec<f64> = self.steps.iter().filter(|s| s.0 >= from && s.0 < to).map(|s| s.3).collect();
        if sel.is_empty() {
            return 0.0;
        }
        sel.iter().sum::<f64>() / sel.len() as f64 * 8.0 / 1e6
    }

    pub fn goodput_mbit_after(&self, from: Duration) -> f64 {
        self.goodput_mbit_between(from, Duration::MAX)
    }
}

/// A change of the link during a run.
pub struct Event {
    pub at: Duration,
    pub rate_mbit: f64,
}

/// Runs one tuned transfer over `link` for `length`.
pub fn run(tuner: &mut dyn Tuner, link: &mut Link, length: Duration) -> Trace {
    run_shared(vec![(tuner, Duration::ZERO)], link, length, &[]).pop().expect("one trace")
}

/// Runs several tuned transfers, each from its start time, over one `link`
/// until `length`, applying `events`.
pub fn run_shared(tuners: Vec<(&mut dyn Tuner, Duration)>, link: &mut Link, length: Duration, events: &[Event]) -> Vec<Trace> {
    let mut flows: Vec<Flow> = tuners
        .into_iter()
        .map(|(t, start)| {
            let target = t.initial();
            Flow { tuner: t, start, target, streams: Vec::new(), delivered: 0.0, wobble: 0.0, trace: Trace::default() }
        })
        .collect();
    let mut now = Duration::ZERO;
    let mut rtt = link.base_rtt;
    let mut next_observation = Duration::ZERO;
    let mut random = 0x9e37_79b9_7f4a_7c15u64;
    let keep = (-STEP.as_secs_f64() / JITTER_TIME.as_secs_f64()).exp();
    while now < length {
        for e in events.iter().filter(|e| e.at >= now && e.at < now + STEP) {
            link.rate = e.rate_mbit * 1e6 / 8.0;
        }
        // Streams open (after two round trips) and close to match the targets.
        for f in flows.iter_mut().filter(|f| f.start <= now) {
            f.streams.truncate(f.target);
            while f.streams.len() < f.target {
                f.streams.push(Stream { age: Duration::ZERO, cwnd: 10.0 * MSS });
            }
        }
        let cap = (link.window as f64).min(link.loss_window());
        let opening = 2 * rtt;
        for f in &mut flows {
            // xorshift64, mapped to a uniform deviate of unit variance.
            random ^= random << 13;
            random ^= random >> 7;
            random ^= random << 17;
            let u = (random >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            f.wobble = keep * f.wobble + (1.0 - keep * keep).sqrt() * link.jitter * 3f64.sqrt() * u;
        }
        let inflight: Vec<f64> =
            flows.iter().map(|f| f.streams.iter().filter(|s| s.age >= opening).map(|s| s.cwnd.min(cap)).sum()).collect();
        let weight: Vec<f64> = flows.iter().zip(&inflight).map(|(f, b)| b * (1.0 + f.wobble).max(0.1)).collect();
        let weights: f64 = weight.iter().sum();
        let open: Vec<usize> = flows.iter().map(|f| f.streams.iter().filter(|s| s.age >= opening).count()).collect();
        let total: f64 = inflight.iter().sum();
        let bdp = link.rate * link.base_rtt.as_secs_f64();
        let (rate, r) = if total <= bdp {
            (total / link.base_rtt.as_secs_f64(), link.base_rtt)
        } else if total <= bdp + link.queue {
            (link.rate, Duration::from_secs_f64(total / link.rate))
        } else {
            let r = link.base_rtt + Duration::from_secs_f64(link.queue / link.rate);
            let n: usize = open.iter().sum();
            (link.rate.min(model::loss_limited(link.rate, r.as_secs_f64(), n as f64)), r)
        };
        rtt = r;
        for (i, f) in flows.iter_mut().enumerate().filter(|(_, f)| f.start <= now) {
            let share = if weights > 0.0 { rate * weight[i] / weights } else { 0.0 };
            f.delivered += share * STEP.as_secs_f64();
            f.trace.steps.push((now - f.start, f.target, open[i], share));
            for s in &mut f.streams {
                if s.age >= opening {
                    // Slow start: double every round trip.
                    s.cwnd = (s.cwnd * 2f64.powf(STEP.as_secs_f64() / r.as_secs_f64())).min(cap.min(1e12));
                }
                s.age += STEP;
            }
        }
        now += STEP;
        if now >= next_observation {
            next_observation = now + OBSERVE_EVERY;
            let started = |f: &&mut Flow| f.start <= now;
            let server = ServerLoad {
                delivered: flows.iter_mut().filter(started).map(|f| f.delivered as u64).sum(),
                transfers: flows.iter_mut().filter(started).count(),
            };
            for (i, f) in flows.iter_mut().enumerate().filter(|(_, f)| f.start <= now) {
                let o = Observation {
                    now: now - f.start,
                    delivered: f.delivered as u64,
                    rtt: r,
                    window: link.window,
                    streams: open[i],
                    starved: 0.0,
                    staged: 0.0,
                    server,
                };
                if let Some(n) = f.tuner.observe(&o) {
                    f.target = n.max(1);
                    f.trace.changes.push((now - f.start, f.target));
                }
            }
        }
    }
    flows.into_iter().map(|f| f.trace).collect()
}
