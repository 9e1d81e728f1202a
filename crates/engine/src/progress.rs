//! Live counters a transfer updates and a display reads.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Running totals; every field is updated by the engine's threads and read
/// by whoever shows progress, without locks.
#[derive(Debug, Default)]
pub struct Progress {
    /// Files and bytes the walk has found so far.
    pub total_files: AtomicU64,
    pub total_bytes: AtomicU64,
    /// Set when the walk is complete (the totals are final).
    pub walk_done: AtomicBool,
    /// Files and bytes confirmed at the destination (including ones already there).
    pub done_files: AtomicU64,
    pub done_bytes: AtomicU64,
    /// Payload bytes written to the network.
    pub sent_bytes: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct Snapshot {
    pub total_files: u64,
    pub total_bytes: u64,
    pub walk_done: bool,
    pub done_files: u64,
    pub done_bytes: u64,
    pub sent_bytes: u64,
}

impl Progress {
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            total_files: self.total_files.load(Ordering::Relaxed),
            total_bytes: self.total_bytes.load(Ordering::Relaxed),
            walk_done: self.walk_done.load(Ordering::Relaxed),
            done_files: self.done_files.load(Ordering::Relaxed),
            done_bytes: self.done_bytes.load(Ordering::Relaxed),
            sent_bytes: self.sent_bytes.load(Ordering::Relaxed),
        }
    }

    /// Sets the counters from a peer's report (a server sending for us).
    pub fn set(&self, s: &Snapshot) {
        self.total_files.store(s.total_files, Ordering::Relaxed);
        self.total_bytes.store(s.total_bytes, Ordering::Relaxed);
        self.walk_done.store(s.walk_done, Ordering::Relaxed);
        self.done_files.store(s.done_files, Ordering::Relaxed);
        self.done_bytes.store(s.done_bytes, Ordering::Relaxed);
    }

    pub(crate) fn add(c: &AtomicU64, v: u64) {
        c.fetch_add(v, Ordering::Relaxed);
    }
}
