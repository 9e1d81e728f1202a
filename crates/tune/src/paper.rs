//! The MI, MI+ and AIMD modes of Ito et al., "Automatic parameter
//! configuration mechanism for data transfer protocol GridFTP".
//!
//! Each mode sends fixed-size chunks with N streams, measures the chunk's
//! goodput `G = X/T` and the round-trip time `R`, and asks whether the socket
//! buffers are the bottleneck: `G > η·N·W/R`.
//!
//! * MI: while they are, `N ← γ·N`; once they are not, N stays.
//! * MI+: as MI, then N becomes the count that maximises the steady-state
//!   model of eq. (1) (with the link rate estimated by the last goodput)
//!   and stays.
//! * AIMD: if they are, `N ← N + α`, else `N ← N·(1−β)`, for every chunk.

use crate::{model, Observation, Tuner};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Mi,
    MiPlus,
    Aimd,
}

/// The paper's parameters; the defaults are its section 4 values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// Initial streams (N0).
    pub n0: usize,
    /// Multiplicative increase factor of MI and MI+ (γ > 1).
    pub gamma: f64,
    /// Control parameter of the bottleneck test (0 < η ≤ 1).
    pub eta: f64,
    /// Additive increase of AIMD (α).
    pub alpha: f64,
    /// Multiplicative decrease of AIMD (0 < β < 1).
    pub beta: f64,
    /// Chunk size X, bytes: one decision per chunk.
    pub chunk: u64,
    /// Most streams any mode opens.
    pub max_streams: usize,
}

impl Default for Params {
    fn default() -> Params {
        Params { n0: 1, gamma: 2.0, eta: 0.8, alpha: 1.0, beta: 0.5, chunk: 100_000_000, max_streams: 64 }
    }
}

pub struct Paper {
    mode: Mode,
    p: Params,
    n: usize,
    /// Start of the chunk being measured: (time, delivered bytes).
    chunk_start: Option<(Duration, u64)>,
    /// MI and MI+ have stopped adjusting.
    settled: bool,
}

impl Paper {
    pub fn new(mode: Mode, p: Params) -> Paper {
        Paper { mode, p, n: p.n0.clamp(1, p.max_streams.max(1)), chunk_start: None, settled: false }
    }

    fn clamp(&self, n: f64) -> usize {
        (n.round() as usize).clamp(1, self.p.max_streams.max(1))
    }
}

impl Tuner for Paper {
    fn name(&self) -> &'static str {
        match self.mode {
            Mode::Mi => "mi",
            Mode::MiPlus => "mi+",
            Mode::Aimd => "aimd",
        }
    }

    fn initial(&self) -> usize {
        self.n
    }

    fn observe(&mut self, o: &Observation) -> Option<usize> {
        if self.settled {
            return None;
        }
        // A chunk is measured with all of its N streams open.
        if o.streams < self.n {
            self.chunk_start = None;
            return None;
        }
        let (t0, d0) = *self.chunk_start.get_or_insert((o.now, o.delivered));
        let x = o.delivered.saturating_sub(d0);
        if x < self.p.chunk || o.rtt.is_zero() || o.now <= t0 {
            return None;
        }
        self.chunk_start = Some((o.now, o.delivered));
        let g = x as f64 / (o.now - t0).as_secs_f64();
        let r = o.rtt.as_secs_f64();
        let n = self.n as f64;
        let buffer_bound = g > self.p.eta * n * o.window as f64 / r;
        let next = match (self.mode, buffer_bound) {
            (Mode::Mi | Mode::MiPlus, true) => self.clamp(self.p.gamma * n),
            (Mode::Mi, false) => {
                self.settled = true;
                self.n
            }
            (Mode::MiPlus, false) => {
                self.settled = true;
                model::best_streams(g, r, o.window as f64, self.p.max_streams)
            }
            (Mode::Aimd, true) => self.clamp(n + self.p.alpha),
            (Mode::Aimd, false) => self.clamp((n * (1.0 - self.p.beta)).floor()),
        };
        if next == self.n {
            return None;
        }
        self.n = next;
        self.chunk_start = None;
        Some(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{run, Link};

    fn paper_link() -> Link {
        // Section 4: 100 Mbit/s, 10 ms each way, 100-packet queue, W = 64 KiB.
        Link::new(100.0, Duration::from_millis(20), 100, 65536)
    }

    fn params() -> Params {
        Params { chunk: 10_000_000, ..Params::default() }
    }

    #[test]
    fn mi_doubles_until_the_buffers_stop_being_the_bottleneck() {
        let trace = run(&mut Paper::new(Mode::Mi, params()), &mut paper_link(), Duration::from_secs(60));
        let counts: Vec<usize> = trace.decisions().collect();
        assert_eq!(counts, [2, 4, 8], "{counts:?}");
        assert!(trace.goodput_mbit_after(Duration::from_secs(30)) > 88.0, "{}", trace.goodput_mbit_after(Duration::from_secs(30)));
    }

    #[test]
    fn mi_stops_at_once_when_one_stream_fills_the_link() {
        let mut link = Link::new(100.0, Duration::from_millis(20), 100, 4 << 20);
        let trace = run(&mut Paper::new(Mode::Mi, params()), &mut link, Duration::from_secs(20));
        assert_eq!(trace.decisions().count(), 0);
        assert_eq!(trace.final_streams(), 1);
    }

    #[test]
    fn mi_plus_settles_on_the_models_optimum() {
        let trace = run(&mut Paper::new(Mode::MiPlus, params()), &mut paper_link(), Duration::from_secs(60));
        let counts: Vec<usize> = trace.decisions().collect();
        // It overshoots like MI, then comes back to where N·W/R meets the link.
        assert!(counts.contains(&8), "{counts:?}");
        let last = *counts.last().unwrap();
        assert!((4..8).contains(&last), "{counts:?}");
        assert!(trace.goodput_mbit_after(Duration::from_secs(40)) > 85.0);
    }

    #[test]
    fn aimd_adds_one_stream_per_chunk_and_halves_when_buffers_are_not_the_limit() {
        let trace = run(&mut Paper::new(Mode::Aimd, params()), &mut paper_link(), Duration::from_secs(60));
        let counts: Vec<usize> = trace.decisions().collect();
        assert_eq!(counts[..3], [2, 3, 4], "{counts:?}");
        // Somewhere the link saturates and AIMD halves.
        assert!(counts.windows(2).any(|w| w[1] < w[0]), "{counts:?}");
    }

    #[test]
    fn a_chunk_is_only_timed_once_all_its_streams_are_open() {
        let mut t = Paper::new(Mode::Mi, Params { chunk: 1000, ..Params::default() });
        let o = |now_ms: u64, delivered: u64, streams: usize| Observation {
            now: Duration::from_millis(now_ms),
            delivered,
            rtt: Duration::from_millis(20),
            window: 65536,
            streams,
            starved: 0.0,
            staged: 0.0,
            ..Default::default()
        };
        assert_eq!(t.observe(&o(0, 0, 1)), None);
        // 1,000 bytes in 10 ms: far more than one 64 KiB window per 20 ms? no: 100 kB/s < 0.8 · 3.3 MB/s.
        assert_eq!(t.observe(&o(10, 1000, 1)), None);
        assert_eq!(t.name(), "mi");
        let mut t = Paper::new(Mode::Mi, Params { chunk: 100_000, ..Params::default() });
        assert_eq!(t.observe(&o(0, 0, 1)), None);
        // 3.2 MB/s > 0.8 · 65536/0.02 = 2.6 MB/s: double.
        assert_eq!(t.observe(&o(50, 160_000, 1)), Some(2));
        // Until the second stream is open nothing is timed.
        assert_eq!(t.observe(&o(500, 10_000_000, 1)), None);
        assert_eq!(t.observe(&o(600, 10_000_000, 2)), None);
        assert_eq!(t.observe(&o(650, 10_320_000, 2)), Some(4));
    }
}
