//! The staging pool: a fixed number of blocks under a memory budget.
//!
//! Readers take a block, fill it and pass it on; whoever consumes it (the
//! network sender, the disk writer) drops it, which returns it to the pool.
//! When the pool runs dry the taker waits until it has refilled to its low
//! water mark (a quarter of the blocks), so a stalled consumer turns into
//! back-pressure on the producer rather than into memory, and producers
//! resume in bursts rather than one block at a time. Memory in use never
//! exceeds `blocks × block_size`, whatever the data size or file count.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex};

/// Fewest blocks a pool holds, whatever the budget: enough for every stream
/// and reader to have one in hand.
pub const MIN_BLOCKS: usize = 4;

pub struct Pool {
    block_size: usize,
    blocks: usize,
    low_water: usize,
    /// Free blocks and the count not yet allocated; takers wait on `freed`.
    state: Mutex<PoolState>,
    /// Signalled by `give_back` when a taker may proceed.
    freed: Condvar,
    /// Fill for blocks that are handed out without being overwritten (benchmarks).
    fill: Option<fn(&mut [u8])>,
}

struct PoolState {
    free: Vec<Vec<u8>>,
    unallocated: usize,
    /// Set while takers wait for the low water mark.
    draining: bool,
    /// Set by `close`: takers get nothing from now on.
    closed: bool,
}

impl Pool {
    /// A pool of `budget / block_size` blocks (at least `min_blocks`).
    pub fn new(budget: u64, block_size: usize, min_blocks: usize) -> Arc<Pool> {
        let blocks = ((budget / block_size as u64) as usize).max(min_blocks).max(MIN_BLOCKS);
        Arc::new(Pool {
            block_size,
            blocks,
            low_water: (blocks / 4).max(1),
            state: Mutex::new(PoolState { free: Vec::new(), unallocated: blocks, draining: false, closed: false }),
            freed: Condvar::new(),
            fill: None,
        })
    }

    /// A pool whose blocks are filled once by `fill` when allocated.
    pub fn with_fill(budget: u64, block_size: usize, min_blocks: usize, fill: fn(&mut [u8])) -> Arc<Pool> {
        let p = Pool::new(budget, block_size, min_blocks);
        let p = Arc::try_unwrap(p).ok().expect("fresh pool");
        Arc::new(Pool { fill: Some(fill), ..p })
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Takes a block of `len` bytes (at most the block size), waiting if none
    /// is free; `None` once the pool is closed.
    pub fn take(self: &Arc<Pool>, len: usize) -> Option<Block> {
        assert!(len <= self.block_size, "block of {len} bytes from a pool of {}", self.block_size);
        let mut s = self.state.lock().expect("pool lock");
        loop {
            if s.closed {
                return None;
            }
            if !s.draining {
                if let Some(mut v) = s.free.pop() {
                    v.truncate(len);
                    v.resize(len, 0);
                    return Some(Block { data: v, pool: self.clone() });
                }
                if s.unallocated > 0 {
                    s.unallocated -= 1;
                    drop(s);
                    let mut v = vec![0u8; self.block_size];
                    if let Some(f) = self.fill {
                        f(&mut v);
                    }
                    v.truncate(len);
                    return Some(Block { data: v, pool: self.clone() });
                }
                s.draining = true;
            }
            s = self.freed.wait(s).expect("pool lock");
        }
    }

    /// Wakes every taker and refuses blocks from now on (the transfer is over).
    pub fn close(&self) {
        self.state.lock().expect("pool lock").closed = true;
        self.freed.notify_all();
    }

    fn give_back(&self, v: Vec<u8>) {
        let mut s = self.state.lock().expect("pool lock");
        s.free.push(v);
        if s.draining && s.free.len() >= self.low_water {
            s.draining = false;
            self.freed.notify_all();
        }
    }
}

/// A block on loan from a [`Pool`]; dropping it returns it.
pub struct Block {
    data: Vec<u8>,
    pool: Arc<Pool>,
}

impl Deref for Block {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.data
    }
}

impl DerefMut for Block {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.data);
        self.pool.give_back(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn never_hands_out_more_than_its_blocks() {
        let p = Pool::new(8 * 1024, 1024, 0);
        assert_eq!(p.blocks(), 8);
        let mut held: Vec<Block> = (0..8).map(|_| p.take(1024).unwrap()).collect();
        let p2 = p.clone();
        let t = std::thread::spawn(move || p2.take(10).unwrap().len());
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished(), "a ninth block was handed out");
        held.pop();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished(), "woke before the low water mark");
        held.pop();
        assert_eq!(t.join().unwrap(), 10);
    }

    #[test]
    fn resumes_at_low_water() {
        let p = Pool::new(8 * 1024, 1024, 0);
        let mut held: Vec<Block> = (0..8).map(|_| p.take(1024).unwrap()).collect();
        let p2 = p.clone();
        let t = std::thread::spawn(move || p2.take(10).unwrap().len());
        std::thread::sleep(Duration::from_millis(20));
        held.truncate(6);
        assert_eq!(t.join().unwrap(), 10);
    }
}
