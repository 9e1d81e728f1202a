//! The staging pool: a fixed number of blocks under a memory budget.
//!
//! Readers take a block, fill it and pass it on; whoever consumes it (the
//! network sender, the disk writer) drops it, which returns it to the pool.
//! When the pool runs dry the taker waits until it has refilled to its low
//! water mark (a quarter of the blocks), so a stalled consumer turns into
//! back-pressure on the producer rather than into memory, and producers
//! resume in bursts rather than one block at a time. Memory in use never
//! exceeds `blocks × block_size`, whatever the data size or file count.
//!
//! The streaming library's circular buffer is a pool too, taken from
//! differently: the simulation's writer fills an empty block
//! ([`Pool::take_before`], [`Block::fill`]) and waits only until a
//! deadline, never for a low water mark, since it must not wait for more
//! than one block; blocks come back as sinks acknowledge them, in any
//! order.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// Fewest blocks a transfer's pool holds, whatever the budget: enough for
/// every stream and reader to have one in hand.
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
    /// Takers waiting in `take_before`.
    waiting: usize,
}

impl Pool {
    /// A pool of `budget / block_size` blocks (at least `min_blocks`, and
    /// at least one).
    pub fn new(budget: u64, block_size: usize, min_blocks: usize) -> Arc<Pool> {
        let blocks = ((budget / block_size as u64) as usize).max(min_blocks).max(1);
        Arc::new(Pool {
            block_size,
            blocks,
            low_water: (blocks / 4).max(1),
            state: Mutex::new(PoolState { free: Vec::new(), unallocated: blocks, draining: false, closed: false, waiting: 0 }),
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

    /// An empty block to [`fill`](Block::fill), waiting until `deadline` at
    /// most (not for the low water mark); `None` if none is free by then,
    /// or the pool is closed.
    pub fn take_before(self: &Arc<Pool>, deadline: Instant) -> Option<Block> {
        let mut s = self.state.lock().expect("pool lock");
        loop {
            if s.closed {
                return None;
            }
            if let Some(b) = self.take_empty(&mut s) {
                return Some(b);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s.waiting += 1;
            s = self.freed.wait_timeout(s, deadline - now).expect("pool lock").0;
            s.waiting -= 1;
        }
    }

    /// An empty block, only if more than `keep` others stay free.
    pub fn take_sparing(self: &Arc<Pool>, keep: usize) -> Option<Block> {
        let mut s = self.state.lock().expect("pool lock");
        if s.closed || s.free.len() + s.unallocated <= keep {
            return None;
        }
        self.take_empty(&mut s)
    }

    /// Bytes of staging memory handed out now (whole blocks).
    pub fn in_use_bytes(&self) -> u64 {
        (self.blocks - self.free()) as u64 * self.block_size as u64
    }

    /// Blocks free now.
    pub fn free(&self) -> usize {
        let s = self.state.lock().expect("pool lock");
        s.free.len() + s.unallocated
    }

    fn take_empty(self: &Arc<Pool>, s: &mut PoolState) -> Option<Block> {
        let data = match s.free.pop() {
            Some(mut v) => {
                v.clear();
                v
            }
            None if s.unallocated > 0 => {
                s.unallocated -= 1;
                Vec::with_capacity(self.block_size)
            }
            None => return None,
        };
        Some(Block { data, pool: self.clone() })
    }

    /// Wakes every taker and refuses blocks from now on (the transfer is over).
    pub fn close(&self) {
        self.state.lock().expect("pool lock").closed = true;
        self.freed.notify_all();
    }

    fn give_back(&self, v: Vec<u8>) {
        let mut s = self.state.lock().expect("pool lock");
        s.free.push(v);
        if s.waiting > 0 {
            self.freed.notify_all();
        }
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

impl Block {
    /// Room left before the block is full.
    pub fn room(&self) -> usize {
        self.pool.block_size - self.data.len()
    }

    /// Appends as much of `src` as fits; returns how much.
    pub fn fill(&mut self, src: &[u8]) -> usize {
        let n = src.len().min(self.room());
        self.data.extend_from_slice(&src[..n]);
        n
    }

    /// Makes the block `len` bytes long (at most the block size), zeros
    /// added, e.g. to read a block back into it.
    pub fn resize(&mut self, len: usize) {
        assert!(len <= self.pool.block_size, "a block holds at most {} bytes", self.pool.block_size);
        self.data.resize(len, 0);
    }
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

    /// Waits until `taker` is parked in `take`, waiting for the low water
    /// mark (the pool drains: set under the lock just before the wait, so
    /// seen only once the taker waits), or has returned: `true` if parked.
    fn parked(p: &Pool, taker: &std::thread::JoinHandle<usize>) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if p.state.lock().unwrap().draining {
                return true;
            }
            if taker.is_finished() {
                return false;
            }
            assert!(Instant::now() < deadline, "a taker of an empty pool neither waited nor returned in 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn never_hands_out_more_than_its_blocks() {
        let p = Pool::new(8 * 1024, 1024, 0);
        assert_eq!(p.blocks(), 8);
        let mut held: Vec<Block> = (0..8).map(|_| p.take(1024).unwrap()).collect();
        let p2 = p.clone();
        let t = std::thread::spawn(move || p2.take(10).unwrap().len());
        assert!(parked(&p, &t), "a ninth block was handed out with all 8 out");
        held.pop();
        let (draining, free) = p.state.lock().map(|s| (s.draining, s.free.len())).unwrap();
        assert!(draining && free == 1, "with {free} block back, below the low water mark of 2, the pool stopped draining");
        // Still draining, so the taker, even if woken, waits on.
        assert!(!t.is_finished(), "woke before the low water mark");
        held.pop();
        assert_eq!(t.join().unwrap(), 10);
        assert_eq!(p.free() + held.len(), p.blocks(), "blocks free and held, the taker's back: more than the pool's {}", p.blocks());
    }

    #[test]
    fn resumes_at_low_water() {
        let p = Pool::new(8 * 1024, 1024, 0);
        let mut held: Vec<Block> = (0..8).map(|_| p.take(1024).unwrap()).collect();
        let p2 = p.clone();
        let t = std::thread::spawn(move || p2.take(10).unwrap().len());
        assert!(parked(&p, &t), "a ninth block was handed out with all 8 out");
        held.truncate(6);
        assert_eq!(t.join().unwrap(), 10);
    }

    #[test]
    fn a_full_pool_makes_a_writer_wait_until_its_deadline_then_gives_up() {
        let p = Pool::new(4096, 1024, 0);
        let held: Vec<Block> = (0..4).map(|_| p.take_before(Instant::now()).unwrap()).collect();
        let t0 = Instant::now();
        assert!(p.take_before(t0 + Duration::from_millis(30)).is_none());
        assert!(t0.elapsed() >= Duration::from_millis(30));
        let p2 = p.clone();
        let waiter = std::thread::spawn(move || p2.take_before(Instant::now() + Duration::from_secs(10)).map(|b| b.room()));
        std::thread::sleep(Duration::from_millis(20));
        drop(held);
        assert_eq!(waiter.join().unwrap(), Some(1024));
    }

    #[test]
    fn blocks_fill_to_the_block_size_and_come_back_empty() {
        let p = Pool::new(2048, 1024, 0);
        let mut b = p.take_before(Instant::now()).unwrap();
        assert_eq!(b.fill(&[7; 1000]), 1000);
        assert_eq!(b.fill(&[8; 100]), 24);
        assert_eq!(b.len(), 1024);
        assert_eq!(p.free(), 1);
        assert!(p.take_sparing(1).is_none());
        drop(b);
        assert_eq!(p.free(), 2);
        assert_eq!(p.take_before(Instant::now()).unwrap().len(), 0);
    }
}
