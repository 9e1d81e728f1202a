//! Stream tuners: pure policies that choose how many parallel data
//! connections a transfer uses, from what the engine measures.
//!
//! A tuner sees an [`Observation`] every few tens of milliseconds (time is
//! passed in; no tuner reads a clock or does I/O) and may answer with a new
//! stream count. The engine opens or drops connections to match and records
//! every decision. Tuners:
//!
//! * [`paper::Paper`] — the MI, MI+ and AIMD modes of Ito et al., which
//!   compare the goodput of each fixed-size chunk with the socket-buffer
//!   bound `N·W/R`;
//! * [`auto::Auto`] — dmover's default: probes the marginal gain of more or
//!   fewer streams, tells a free link from a shared one by its queueing
//!   delay, holds back when the disks rather than the network are the
//!   bottleneck, and re-probes when the link changes.
//!
//! [`readers::Readers`] tunes the other dimension, the files (or chunks of
//! large files) read at once, when the source rather than the network holds
//! a transfer back. [`model`] has the steady-state goodput model both the
//! MI+ mode and the simulated link of the tests use; [`sim`] is that
//! simulated link.

pub mod auto;
pub mod model;
pub mod paper;
pub mod readers;
pub mod sim;

use std::time::Duration;

/// What the engine measured, as of `now`.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Observation {
    /// Time since the transfer started.
    pub now: Duration,
    /// Payload bytes the receiver has confirmed taking off the network so far.
    pub delivered: u64,
    /// Mean of the last [`RTT_SAMPLES`] control-channel round trips (zero
    /// before the first one).
    pub rtt: Duration,
    /// Effective socket buffer of one data connection, bytes (`W`).
    pub window: u64,
    /// Data connections open now.
    pub streams: usize,
    /// Share of recent moments at which no block was waiting for a stream
    /// (0..1): near 1, the readers (the source disk) are the bottleneck.
    pub starved: f64,
    /// How full the receiver's write queues are (0..1): near 1, its writers (the
    /// destination disk) are the bottleneck.
    pub staged: f64,
    /// What the receiving server takes in for all of its transfers.
    pub server: ServerLoad,
}

/// The receiving server's intake, this transfer's included.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ServerLoad {
    /// Payload bytes taken off the network so far, for all transfers.
    pub delivered: u64,
    /// Transfers receiving now (0: not known).
    pub transfers: usize,
}

/// A policy for the number of streams.
pub trait Tuner: Send {
    /// Short name for reports (`mi`, `mi+`, `aimd`, `auto`).
    fn name(&self) -> &'static str;
    /// Streams to start with.
    fn initial(&self) -> usize;
    /// Takes a measurement; returns a new stream count when it decides to change it.
    fn observe(&mut self, o: &Observation) -> Option<usize>;
}

/// Round trips averaged into `R` (the paper's M).
pub const RTT_SAMPLES: usize = 10;

/// The mean of the last [`RTT_SAMPLES`] round-trip times.
#[derive(Debug, Default, Clone)]
pub struct RttWindow {
    samples: [Duration; RTT_SAMPLES],
    next: usize,
    len: usize,
}

impl RttWindow {
    pub fn push(&mut self, rtt: Duration) {
        self.samples[self.next] = rtt;
        self.next = (self.next + 1) % RTT_SAMPLES;
        self.len = (self.len + 1).min(RTT_SAMPLES);
    }

    /// Zero until the first sample.
    pub fn mean(&self) -> Duration {
        if self.len == 0 {
            return Duration::ZERO;
        }
        self.samples[..self.len].iter().sum::<Duration>() / self.len as u32
    }
}

/// Goodput over measuring windows, each starting once the last change has settled.
#[derive(Debug, Default, Clone)]
pub struct Windows {
    /// Start of the window being measured: (time, delivered, server's delivered).
    start: Option<(Duration, u64, u64)>,
}

/// What one measuring window saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub length: Duration,
    /// This transfer's goodput, bytes/s.
    pub goodput: f64,
    /// Bytes this transfer delivered in the window.
    pub delivered: u64,
    /// Bytes the receiving server took in for all transfers in the window.
    pub server_delivered: u64,
}

impl Window {
    /// This transfer's part of what the server took in (1 when the server
    /// reports nothing).
    pub fn share(&self) -> f64 {
        if self.server_delivered == 0 {
            1.0
        } else {
            self.delivered as f64 / self.server_delivered as f64
        }
    }
}

impl Windows {
    /// Starts over (after a change, or while one is not yet in effect).
    pub fn restart(&mut self) {
        self.start = None;
    }

    /// The window that closes at `o.now`, if one does: windows start
    /// `settle` (and at least 6 round trips) after `changed_at` and last
    /// `window` (and at least 10 round trips).
    pub fn measure(&mut self, o: &Observation, changed_at: Duration, settle: Duration, window: Duration) -> Option<Window> {
        if o.now < changed_at + settle.max(o.rtt * 6) {
            self.start = None;
            return None;
        }
        let (t0, d0, s0) = *self.start.get_or_insert((o.now, o.delivered, o.server.delivered));
        if o.now < t0 + window.max(o.rtt * 10) {
            return None;
        }
        self.start = Some((o.now, o.delivered, o.server.delivered));
        let delivered = o.delivered.saturating_sub(d0);
        let length = o.now - t0;
        Some(Window {
            length,
            goodput: delivered as f64 / length.as_secs_f64(),
            delivered,
            server_delivered: o.server.delivered.saturating_sub(s0),
        })
    }
}

/// Which tuner, by name, with its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    Auto(auto::Params),
    Paper(paper::Mode, paper::Params),
}

impl Mode {
    /// Parses `auto`, `mi`, `mi+` or `aimd` (paper modes with the paper's defaults).
    pub fn parse(name: &str) -> Option<Mode> {
        Some(match name {
            "auto" => Mode::Auto(auto::Params::default()),
            "mi" => Mode::Paper(paper::Mode::Mi, paper::Params::default()),
            "mi+" => Mode::Paper(paper::Mode::MiPlus, paper::Params::default()),
            "aimd" => Mode::Paper(paper::Mode::Aimd, paper::Params::default()),
            _ => return None,
        })
    }

    pub fn build(&self) -> Box<dyn Tuner> {
        match *self {
            Mode::Auto(p) => Box::new(auto::Auto::new(p)),
            Mode::Paper(m, p) => Box::new(paper::Paper::new(m, p)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rtt_window_averages_the_last_ten() {
        let mut w = RttWindow::default();
        assert_eq!(w.mean(), Duration::ZERO);
        w.push(Duration::from_millis(10));
        w.push(Duration::from_millis(20));
        assert_eq!(w.mean(), Duration::from_millis(15));
        for _ in 0..RTT_SAMPLES {
            w.push(Duration::from_millis(40));
        }
        assert_eq!(w.mean(), Duration::from_millis(40));
    }

    #[test]
    fn modes_parse_by_name() {
        for n in ["auto", "mi", "mi+", "aimd"] {
            assert_eq!(Mode::parse(n).expect(n).build().name(), n);
        }
        assert!(Mode::parse("fast").is_none());
    }
}
