//! How many files (or chunks of large files) a sender reads at once.
//!
//! More readers help when the source is slow per file — many small files,
//! a file system with high latency per request — and the streams wait for
//! blocks to send. While they do (the observation's `starved` share is
//! high) and the receiver is not the bottleneck, this policy tries twice the
//! readers and keeps them if the goodput rises; it backs off after a try
//! that did not pay, and never takes readers away (an idle reader costs a
//! sleeping thread).

use crate::{Observation, Windows};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    pub max: usize,
    /// Share of starved moments above which the readers are the bottleneck.
    pub starved: f64,
    /// Relative goodput gain that keeps a try.
    pub gain: f64,
    pub settle: Duration,
    pub window: Duration,
    /// First wait after a try that did not pay; doubles up to `max_backoff`.
    pub backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for Params {
    fn default() -> Params {
        Params {
            max: 64,
            starved: 0.5,
            gain: 0.05,
            settle: Duration::from_millis(300),
            window: Duration::from_secs(1),
            backoff: Duration::from_secs(2),
            max_backoff: Duration::from_secs(16),
        }
    }
}

pub struct Readers {
    p: Params,
    n: usize,
    /// The count before a try, and its goodput.
    trying: Option<(usize, f64)>,
    changed_at: Duration,
    next_try: Duration,
    backoff: Duration,
    windows: Windows,
}

impl Readers {
    pub fn new(n: usize, p: Params) -> Readers {
        Readers {
            p,
            n: n.clamp(1, p.max),
            trying: None,
            changed_at: Duration::ZERO,
            next_try: Duration::ZERO,
            backoff: p.backoff,
            windows: Windows::default(),
        }
    }

    fn set(&mut self, now: Duration, n: usize) -> Option<usize> {
        self.n = n;
        self.changed_at = now;
        self.windows.restart();
        Some(n)
    }

    /// Takes a measurement; returns a new reader count when it decides to change it.
    pub fn observe(&mut self, o: &Observation) -> Option<usize> {
        let g = self.windows.measure(o, self.changed_at, self.p.settle, self.p.window)?.goodput;
        if let Some((before, g0)) = self.trying.take() {
            if g >= g0 * (1.0 + self.p.gain) {
                self.backoff = self.p.backoff;
                self.next_try = o.now;
            } else {
                self.next_try = o.now + self.backoff;
                self.backoff = (self.backoff * 2).min(self.p.max_backoff);
                return self.set(o.now, before);
            }
        }
        let source_bound = o.starved >= self.p.starved && o.staged < 0.8;
        if source_bound && o.now >= self.next_try && self.n < self.p.max {
            self.trying = Some((self.n, g));
            return self.set(o.now, (self.n * 2).min(self.p.max));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source whose rate grows with readers up to `useful` of them.
    fn run(useful: usize, starved: f64) -> Vec<usize> {
        let mut t = Readers::new(4, Params::default());
        let mut counts = vec![t.n];
        let mut delivered = 0u64;
        for i in 1..=400u64 {
            delivered += 10_000 * t.n.min(useful) as u64;
            let o = Observation {
                now: Duration::from_millis(i * 50),
                delivered,
                rtt: Duration::from_millis(1),
                window: 1 << 20,
                streams: 4,
                starved,
                staged: 0.0,
                ..Default::default()
            };
            if let Some(n) = t.observe(&o) {
                counts.push(n);
            }
        }
        counts
    }

    #[test]
    fn doubles_while_more_readers_deliver_more() {
        let counts = run(16, 0.9);
        assert_eq!(counts[..4], [4, 8, 16, 32], "{counts:?}");
        // 32 did not pay: back to 16, tried again only after a back-off.
        assert_eq!(counts[4], 16, "{counts:?}");
        assert!(counts.len() < 12, "{counts:?}");
    }

    #[test]
    fn leaves_the_readers_alone_when_they_keep_up() {
        assert_eq!(run(64, 0.1), [4]);
    }
}
