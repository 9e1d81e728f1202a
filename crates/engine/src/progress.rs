//! Live counters a transfer updates and a display reads.

use crate::pool::Pool;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

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
    /// Of those, files and bytes found already there (not sent), where
    /// this process sends.
    pub skipped_files: AtomicU64,
    pub skipped_bytes: AtomicU64,
    /// Payload bytes written to the network.
    pub sent_bytes: AtomicU64,
    /// Data connections sending now.
    pub streams: AtomicU64,
    /// The sending end's staging pool, while it runs (read on demand: the
    /// blocks' own path pays nothing for it).
    pool: Mutex<Weak<Pool>>,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct Snapshot {
    pub total_files: u64,
    pub total_bytes: u64,
    pub walk_done: bool,
    pub done_files: u64,
    pub done_bytes: u64,
    pub skipped_files: u64,
    pub skipped_bytes: u64,
    pub sent_bytes: u64,
    pub streams: u64,
}

impl Progress {
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            total_files: self.total_files.load(Ordering::Relaxed),
            total_bytes: self.total_bytes.load(Ordering::Relaxed),
            walk_done: self.walk_done.load(Ordering::Relaxed),
            done_files: self.done_files.load(Ordering::Relaxed),
            done_bytes: self.done_bytes.load(Ordering::Relaxed),
            skipped_files: self.skipped_files.load(Ordering::Relaxed),
            skipped_bytes: self.skipped_bytes.load(Ordering::Relaxed),
            sent_bytes: self.sent_bytes.load(Ordering::Relaxed),
            streams: self.streams.load(Ordering::Relaxed),
        }
    }

    /// Staging memory the sending end holds now, in bytes.
    pub fn staged_bytes(&self) -> u64 {
        self.pool.lock().expect("progress pool lock").upgrade().map_or(0, |p| p.in_use_bytes())
    }

    pub(crate) fn watch_pool(&self, pool: &Arc<Pool>) {
        *self.pool.lock().expect("progress pool lock") = Arc::downgrade(pool);
    }

    /// Sets the counters from a peer's report (a server sending for us).
    pub fn set(&self, s: &Snapshot) {
        self.total_files.store(s.total_files, Ordering::Relaxed);
        self.total_bytes.store(s.total_bytes, Ordering::Relaxed);
        self.walk_done.store(s.walk_done, Ordering::Relaxed);
        self.done_files.store(s.done_files, Ordering::Relaxed);
        self.done_bytes.store(s.done_bytes, Ordering::Relaxed);
        self.skipped_files.store(s.skipped_files, Ordering::Relaxed);
        self.skipped_bytes.store(s.skipped_bytes, Ordering::Relaxed);
    }

    /// Adds `v` to counter `c`.
    pub fn add(c: &AtomicU64, v: u64) {
        c.fetch_add(v, Ordering::Relaxed);
    }
}

/// The completion check of a transfer or a job: the source list
/// reconciled against what the destination confirmed.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Check {
    pub passed: bool,
    pub source_files: u64,
    pub source_bytes: u64,
    pub dest_files: u64,
    pub dest_bytes: u64,
    pub digests_match: bool,
}

impl Check {
    /// Passed when nothing failed, every file and byte listed was confirmed
    /// and the set digests matched.
    pub fn new(failures: bool, source: (u64, u64), dest: (u64, u64), digests_match: bool) -> Check {
        Check {
            passed: !failures && source == dest && digests_match,
            source_files: source.0,
            source_bytes: source.1,
            dest_files: dest.0,
            dest_bytes: dest.1,
            digests_match,
        }
    }
}

/// How fast a transfer or a job moved what it moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rate {
    pub mb_per_s: f64,
    pub files_per_s: f64,
}

impl Rate {
    /// `files` and `bytes` moved in `seconds`; zero when no time passed.
    pub fn new(files: u64, bytes: u64, seconds: f64) -> Rate {
        if seconds > 0.0 {
            Rate { mb_per_s: bytes as f64 / 1e6 / seconds, files_per_s: files as f64 / seconds }
        } else {
            Rate::default()
        }
    }
}

/// A byte count for people: `512 B`, `1.5 MiB`.
pub fn human(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}
