//! The memory the parts of uploads and the reads of objects share.
//!
//! The parts held in memory, being filled and being sent, of all the files
//! being written here take at most
//! [`Options::staging`](super::Options::staging) (at least one first part, at
//! most [`MAX_PARTS_IN_FLIGHT`]), and one part more while a part is read back
//! from a file (below). A writer whose part needs more waits while parts
//! being sent will free some (back-pressure on the engine's writer, and
//! through it on the network). Blocks from several streams and readers arrive
//! out of order, so several parts of a file fill at once, each slowly; a
//! writer never waits for those to complete (they may need its own later
//! blocks). Parts being filled take at most a quarter of the bound in memory,
//! so that most of it holds parts being sent, many at once (each waits a
//! round trip for the server's answer); beyond that share, or when the bound
//! is taken, a part fills in an unnamed file of the state directory instead,
//! and is read back to be sent (where no such file can be made, the part
//! stays in memory, beyond the bound, with a warning). Each part's buffer is
//! made at its final capacity and handed to the SDK as it is, never copied.

use super::part::FIRST_PART;
use std::sync::{Arc, Condvar, Mutex};

/// Memory the parts and reads take at most, in first parts, however large
/// [`Options::staging`](super::Options::staging) is.
pub(super) const MAX_PARTS_IN_FLIGHT: u64 = 16;

/// The memory the parts of a storage's uploads hold in memory (being
/// filled or being sent), and the bytes of the objects it reads, kept
/// within a bound. A read takes its memory only if it fits at once (see
/// a read's `Stream`).
///
/// A writer that needs more waits while parts are being sent: each send
/// ends (taken, failed or timed out) and frees its part. It never waits
/// for parts still being filled, which may need that writer's own later
/// blocks (a file's blocks are written by one thread, in the order they
/// arrive): such a part goes to a file instead. A part is sent from
/// memory; one read back from a file waits for room as a writer does,
/// and takes its memory beyond the bound only when nothing else is being
/// sent, so the parts held never exceed the bound by more than one part.
pub(super) struct Budget {
    pub(super) bound: u64,
    held: Mutex<Held>,
    /// Signalled when memory is given back.
    freed: Condvar,
}

/// What a [`Budget`] has handed out.
#[derive(Default)]
struct Held {
    bytes: u64,
    /// Of those, the bytes of parts being filled in memory.
    filling: u64,
    /// Parts being sent.
    sending: usize,
}

impl Budget {
    /// A budget of `bound` bytes, none handed out.
    pub(super) fn new(bound: u64) -> Budget {
        Budget { bound, held: Mutex::new(Held::default()), freed: Condvar::new() }
    }

    /// A lease of no memory yet.
    pub(super) fn lease(self: &Arc<Self>) -> Lease {
        Lease { budget: self.clone(), bytes: 0, holds: Holds::Window }
    }

    /// The most parts being filled may hold in memory: a quarter of the
    /// bound (one first part at least); see the module's comment.
    fn filling_share(&self) -> u64 {
        (self.bound / 4).max(FIRST_PART)
    }

    /// Takes `n` bytes if they fit now (for an object being read).
    pub(super) fn try_take(self: &Arc<Self>, n: u64) -> Option<Lease> {
        let mut h = self.held.lock().expect("budget lock");
        (h.bytes + n <= self.bound).then(|| {
            h.bytes += n;
            Lease { budget: self.clone(), bytes: n, holds: Holds::Window }
        })
    }

    /// Takes `len` bytes to send a part read back from a file: once they
    /// fit, or nothing else is being sent.
    pub(super) fn take_to_send(self: &Arc<Self>, len: u64) -> Lease {
        let mut h = self.held.lock().expect("budget lock");
        while h.bytes + len > self.bound && h.sending > 0 {
            h = self.freed.wait(h).expect("budget lock");
        }
        h.bytes += len;
        h.sending += 1;
        Lease { budget: self.clone(), bytes: len, holds: Holds::Sending }
    }
}

/// Memory taken from a [`Budget`], given back when dropped.
pub(super) struct Lease {
    budget: Arc<Budget>,
    bytes: u64,
    holds: Holds,
}

/// What a [`Lease`]'s memory holds, as its budget counts it.
#[derive(Clone, Copy, PartialEq)]
enum Holds {
    /// Bytes of an object being read, or nothing yet.
    Window,
    /// A part being filled.
    Filling,
    /// A part being sent.
    Sending,
}

impl Lease {
    /// Takes `n` more bytes for a part being filled if they fit, waiting
    /// while parts being sent may make room; false if the parts being
    /// filled would take more than their share, or if the bytes do not fit
    /// and nothing is being sent.
    pub(super) fn grow(&mut self, n: u64) -> bool {
        let b = self.budget.clone();
        let mut h = b.held.lock().expect("budget lock");
        loop {
            if h.filling + n > b.filling_share() {
                return false;
            }
            if h.bytes + n <= b.bound {
                self.take_filling(&mut h, n);
                return true;
            }
            if h.sending == 0 {
                return false;
            }
            h = b.freed.wait(h).expect("budget lock");
        }
    }

    fn take_filling(&mut self, h: &mut Held, n: u64) {
        h.bytes += n;
        h.filling += n;
        self.bytes += n;
        self.holds = Holds::Filling;
    }

    /// Gives back what it holds beyond `n` bytes.
    pub(super) fn keep(&mut self, n: u64) {
        if n < self.bytes {
            let mut h = self.budget.held.lock().expect("budget lock");
            h.bytes -= self.bytes - n;
            self.bytes = n;
            self.budget.freed.notify_all();
        }
    }

    /// Takes `n` more bytes, beyond the bound if need be.
    pub(super) fn force(&mut self, n: u64) {
        let b = self.budget.clone();
        self.take_filling(&mut b.held.lock().expect("budget lock"), n);
    }

    /// Gives back all it holds.
    pub(super) fn release(&mut self) {
        let mut h = self.budget.held.lock().expect("budget lock");
        h.bytes -= self.bytes;
        match std::mem::replace(&mut self.holds, Holds::Window) {
            Holds::Filling => h.filling -= self.bytes,
            Holds::Sending => h.sending -= 1,
            Holds::Window => {}
        }
        self.bytes = 0;
        self.budget.freed.notify_all();
    }

    /// Counts its part as being sent.
    pub(super) fn sending(&mut self) {
        if self.holds != Holds::Sending {
            let mut h = self.budget.held.lock().expect("budget lock");
            h.sending += 1;
            if self.holds == Holds::Filling {
                h.filling -= self.bytes;
            }
            self.holds = Holds::Sending;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_being_filled_keep_to_their_share_of_memory() {
        let budget = Arc::new(Budget::new(8 * FIRST_PART));
        let held = || {
            let h = budget.held.lock().unwrap();
            (h.bytes / FIRST_PART, h.filling / FIRST_PART, h.sending)
        };
        let (mut a, mut b, mut c) = (budget.lease(), budget.lease(), budget.lease());
        // A quarter of the bound: two first parts fill in memory, not a third.
        assert!(a.grow(FIRST_PART) && b.grow(FIRST_PART));
        assert!(!c.grow(1), "a third part filled in memory");
        assert_eq!(held(), (2, 2, 0));
        // One is sent: the third fills, and the sent one still counts in the bound.
        a.sending();
        assert_eq!(held(), (2, 1, 1));
        assert!(c.grow(FIRST_PART));
        assert_eq!(held(), (3, 2, 1));
        drop((a, b, c));
        assert_eq!(held(), (0, 0, 0));
        // A small bound still fills one first part in memory.
        let small = Arc::new(Budget::new(FIRST_PART));
        assert!(small.lease().grow(FIRST_PART));
    }
}
