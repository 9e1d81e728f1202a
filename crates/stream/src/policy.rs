//! The queue manager's policy: how many data connections to keep open and
//! when to fetch spilled blocks back, from the state of the buffer.
//!
//! It follows the three states of the threaded-buffer design (Bhat et al.):
//!
//! * **A — generation outruns the network.** The ring is full or the writer
//!   spilled since the last look: every connection allowed is used
//!   (`max_streams`), and stays in use for [`HOLD`] after the last overflow.
//! * **B — generation and network are close.** Blocks accumulate between
//!   looks: the manager sends everything that accumulated, with about one
//!   connection per [`BLOCKS_PER_STREAM`] blocks waiting. It widens at once
//!   when the backlog grows and narrows one connection at a time once the
//!   backlog has stayed below the current width for [`NARROW_AFTER`], so a
//!   momentary dip does not tear connections down.
//! * **C — the network outruns generation.** Nothing is waiting: blocks go
//!   one by one as they fill, on as few connections as that needs (narrowing
//!   as in B). This is when bandwidth is free, so spilled blocks are read
//!   back and sent now, never taking more than half the ring, so that the
//!   simulation keeps room to write.
//!
//! The paper sends each batch as one multi-threaded transfer and starts the
//! next when it ends. Here blocks flow to the connections continuously and
//! the batch is whatever waits at each look: a barrier at the end of each
//! batch would idle the link while the slowest connection finishes.
//!
//! The policy does no I/O and reads no clock: time comes in with each
//! [`Observation`], so its tests are exact.

use std::time::Duration;

/// Blocks waiting per connection before the manager opens another.
pub const BLOCKS_PER_STREAM: usize = 2;
/// How long the backlog must stay low before a connection is dropped.
pub const NARROW_AFTER: Duration = Duration::from_millis(500);
/// How long state A lasts after the last overflow.
pub const HOLD: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Generation outruns the network: overflow, all connections.
    A,
    /// Generation and network are close: batches, connections follow the backlog.
    B,
    /// The network outruns generation: block by block; spilled blocks go now.
    C,
}

/// What the queue manager sees, as of `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    /// Time since the stream opened.
    pub now: Duration,
    /// Blocks ready and not yet taken by a connection.
    pub backlog: usize,
    /// Slots in the ring, and how many are free.
    pub slots: usize,
    pub free: usize,
    /// Blocks the writer spilled since the previous observation.
    pub spilled: usize,
    /// Spilled blocks not yet delivered.
    pub spill_pending: usize,
}

/// What to do until the next observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub state: State,
    /// Data connections to keep open.
    pub streams: usize,
    /// Spilled blocks to read back and send now.
    pub fetch: usize,
}

#[derive(Debug, Clone)]
pub struct Policy {
    max_streams: usize,
    streams: usize,
    /// When state A was last entered or renewed.
    overflow_at: Option<Duration>,
    /// Since when the backlog has wanted fewer connections than are open.
    low_since: Option<Duration>,
}

impl Policy {
    pub fn new(max_streams: usize) -> Policy {
        Policy { max_streams: max_streams.max(1), streams: 1, overflow_at: None, low_since: None }
    }

    /// Connections open now.
    pub fn streams(&self) -> usize {
        self.streams
    }

    pub fn decide(&mut self, o: &Observation) -> Decision {
        if o.spilled > 0 || o.free == 0 {
            self.overflow_at = Some(o.now);
        }
        let overflowing = self.overflow_at.is_some_and(|t| o.now.saturating_sub(t) < HOLD);
        let state = if overflowing {
            State::A
        } else if o.backlog > 0 {
            State::B
        } else {
            State::C
        };
        let want = match state {
            State::A => self.max_streams,
            _ => o.backlog.div_ceil(BLOCKS_PER_STREAM).clamp(1, self.max_streams),
        };
        if want >= self.streams {
            self.streams = want;
            self.low_since = None;
        } else {
            let since = *self.low_since.get_or_insert(o.now);
            if o.now.saturating_sub(since) >= NARROW_AFTER {
                self.streams -= 1;
                self.low_since = if self.streams > want { Some(o.now) } else { None };
            }
        }
        let fetch = if state == State::C { o.spill_pending.min(o.free.saturating_sub(o.slots / 2)) } else { 0 };
        Decision { state, streams: self.streams, fetch }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(ms: u64, backlog: usize, free: usize) -> Observation {
        Observation { now: Duration::from_millis(ms), backlog, slots: 80, free, spilled: 0, spill_pending: 0 }
    }

    #[test]
    fn state_c_sends_block_by_block_on_one_connection() {
        let mut p = Policy::new(8);
        let d = p.decide(&obs(0, 0, 80));
        assert_eq!(d, Decision { state: State::C, streams: 1, fetch: 0 });
        assert_eq!(p.decide(&obs(50, 1, 79)).streams, 1);
    }

    #[test]
    fn state_b_widens_at_once_with_the_backlog_and_caps_at_the_maximum() {
        let mut p = Policy::new(8);
        let d = p.decide(&obs(0, 6, 70));
        assert_eq!((d.state, d.streams), (State::B, 3));
        assert_eq!(p.decide(&obs(50, 11, 60)).streams, 6);
        assert_eq!(p.decide(&obs(100, 40, 30)).streams, 8);
    }

    #[test]
    fn narrowing_waits_for_a_lasting_low_backlog_and_goes_one_at_a_time() {
        let mut p = Policy::new(8);
        p.decide(&obs(0, 16, 60));
        assert_eq!(p.streams(), 8);
        // A dip shorter than NARROW_AFTER changes nothing.
        assert_eq!(p.decide(&obs(100, 2, 70)).streams, 8);
        assert_eq!(p.decide(&obs(400, 16, 60)).streams, 8);
        // A lasting low backlog drops one connection per NARROW_AFTER.
        assert_eq!(p.decide(&obs(500, 0, 80)).streams, 8);
        assert_eq!(p.decide(&obs(999, 0, 80)).streams, 8);
        assert_eq!(p.decide(&obs(1000, 0, 80)).streams, 7);
        assert_eq!(p.decide(&obs(1400, 0, 80)).streams, 7);
        assert_eq!(p.decide(&obs(1500, 0, 80)).streams, 6);
        let mut t = 1500;
        while p.streams() > 1 {
            t += 500;
            p.decide(&obs(t, 0, 80));
        }
        assert_eq!(t, 4000, "from 8 to 1 in seven steps of NARROW_AFTER");
        assert_eq!(p.decide(&obs(t + 5000, 0, 80)).streams, 1);
    }

    #[test]
    fn overflow_is_state_a_with_every_connection_until_hold_passes() {
        let mut p = Policy::new(4);
        let d = p.decide(&Observation { spilled: 3, spill_pending: 3, ..obs(0, 2, 0) });
        assert_eq!(d, Decision { state: State::A, streams: 4, fetch: 0 });
        // Still A within HOLD even with nothing waiting, and nothing is fetched.
        let d = p.decide(&Observation { spill_pending: 3, ..obs(900, 0, 80) });
        assert_eq!((d.state, d.streams, d.fetch), (State::A, 4, 0));
        // After HOLD: C, and the spilled blocks come back while half the ring stays free.
        let d = p.decide(&Observation { spill_pending: 3, ..obs(1000, 0, 80) });
        assert_eq!((d.state, d.fetch), (State::C, 3));
        let d = p.decide(&Observation { spill_pending: 100, ..obs(1050, 0, 50) });
        assert_eq!(d.fetch, 10);
        let d = p.decide(&Observation { spill_pending: 100, ..obs(1100, 0, 40) });
        assert_eq!(d.fetch, 0);
        // A full ring is an overflow too.
        assert_eq!(p.decide(&obs(1200, 30, 0)).state, State::A);
    }

    #[test]
    fn spilled_blocks_wait_while_data_is_waiting() {
        let mut p = Policy::new(4);
        let d = p.decide(&Observation { spill_pending: 5, ..obs(0, 3, 77) });
        assert_eq!((d.state, d.fetch), (State::B, 0));
    }
}
