//! The circular buffer: a fixed ring of block-sized slots in memory.
//!
//! The simulation's writes are copied into the slot being filled (the
//! paper's *write position*); a full slot goes to the queue manager, which
//! sends it and keeps it until the sink acknowledges it; then the slot is
//! free again. The oldest slot not yet acknowledged is the paper's *send
//! position*. Slots come back as acknowledgements arrive, in any order, so
//! one slow block on one connection does not hold back the others, and a
//! block stays in memory until it is safe somewhere (which is what lets a
//! dead sink's unacknowledged blocks go to the next one).
//!
//! Memory never exceeds `slots × block_size`; slots are allocated on first
//! use. Unlike the engine's staging pool, a taker waits only until a
//! deadline (the writer's blocking bound) and then spills, and there is no
//! low water mark: the writer must not wait for more than one slot.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// Fewest slots a ring has, whatever the buffer size: one being filled and
/// one being sent.
pub const MIN_SLOTS: usize = 2;

pub struct Ring {
    block_size: usize,
    slots: usize,
    /// Free slots and the count not yet allocated; the writer waits on `freed`.
    state: Mutex<Free>,
    /// Signalled when a slot comes back.
    freed: Condvar,
}

struct Free {
    slots: Vec<Vec<u8>>,
    unallocated: usize,
}

impl Free {
    fn count(&self) -> usize {
        self.slots.len() + self.unallocated
    }
}

impl Ring {
    /// A ring of `buffer / block_size` slots (at least [`MIN_SLOTS`]).
    pub fn new(buffer: u64, block_size: usize) -> Arc<Ring> {
        let slots = ((buffer / block_size as u64) as usize).max(MIN_SLOTS);
        Arc::new(Ring { block_size, slots, state: Mutex::new(Free { slots: Vec::new(), unallocated: slots }), freed: Condvar::new() })
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Slots free now.
    pub fn free(&self) -> usize {
        self.state.lock().expect("ring lock").count()
    }

    /// An empty slot, waiting until `deadline` at most; `None` if the ring
    /// is still full then.
    pub fn take(self: &Arc<Ring>, deadline: Instant) -> Option<Slot> {
        let mut s = self.state.lock().expect("ring lock");
        loop {
            if let Some(v) = self.pop(&mut s) {
                return Some(v);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s = self.freed.wait_timeout(s, deadline - now).expect("ring lock").0;
        }
    }

    /// An empty slot, only if at least `keep` others stay free.
    pub fn take_sparing(self: &Arc<Ring>, keep: usize) -> Option<Slot> {
        let mut s = self.state.lock().expect("ring lock");
        if s.count() <= keep {
            return None;
        }
        self.pop(&mut s)
    }

    fn pop(self: &Arc<Ring>, s: &mut Free) -> Option<Slot> {
        let data = match s.slots.pop() {
            Some(v) => v,
            None if s.unallocated > 0 => {
                s.unallocated -= 1;
                Vec::with_capacity(self.block_size)
            }
            None => return None,
        };
        Some(Slot { data, ring: self.clone() })
    }
}

/// A slot on loan from the ring; dropping it frees it. It derefs to its
/// filled bytes, which never exceed the block size.
pub struct Slot {
    data: Vec<u8>,
    ring: Arc<Ring>,
}

impl Slot {
    /// Room left before the slot is full.
    pub fn room(&self) -> usize {
        self.ring.block_size - self.data.len()
    }

    /// Copies as much of `src` as fits; returns how much.
    pub fn fill(&mut self, src: &[u8]) -> usize {
        let n = src.len().min(self.room());
        self.data.extend_from_slice(&src[..n]);
        n
    }

    /// The slot's whole capacity, for reading a block back into it.
    pub fn resize(&mut self, len: usize) {
        assert!(len <= self.ring.block_size, "a slot holds at most one block");
        self.data.resize(len, 0);
    }
}

impl Deref for Slot {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.data
    }
}

impl DerefMut for Slot {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut v = std::mem::take(&mut self.data);
        v.clear();
        self.ring.state.lock().expect("ring lock").slots.push(v);
        self.ring.freed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn full_ring_waits_until_the_deadline_then_gives_up() {
        let r = Ring::new(4096, 1024);
        let held: Vec<Slot> = (0..4).map(|_| r.take(Instant::now()).unwrap()).collect();
        let t0 = Instant::now();
        assert!(r.take(t0 + Duration::from_millis(30)).is_none());
        assert!(t0.elapsed() >= Duration::from_millis(30));
        let r2 = r.clone();
        let waiter = std::thread::spawn(move || r2.take(Instant::now() + Duration::from_secs(10)).map(|s| s.room()));
        std::thread::sleep(Duration::from_millis(20));
        drop(held);
        assert_eq!(waiter.join().unwrap(), Some(1024));
    }

    #[test]
    fn slots_fill_to_the_block_size_and_come_back_empty() {
        let r = Ring::new(2048, 1024);
        let mut s = r.take(Instant::now()).unwrap();
        assert_eq!(s.fill(&[7; 1000]), 1000);
        assert_eq!(s.fill(&[8; 100]), 24);
        assert_eq!(s.len(), 1024);
        assert_eq!(r.free(), 1);
        assert!(r.take_sparing(1).is_none());
        drop(s);
        assert_eq!(r.free(), 2);
        assert_eq!(r.take(Instant::now()).unwrap().len(), 0);
    }
}
