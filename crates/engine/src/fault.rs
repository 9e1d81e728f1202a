//! Fault injection for the test suite.
//!
//! Compiled in only with the `fault-injection` feature, which is off by
//! default and which the `dmover` binary's test builds turn on (see
//! `crates/cli/Cargo.toml`). Even then nothing happens unless asked for:
//!
//! * `DMOVER_FAULT_CORRUPT_EVERY=N`: the sending end flips one bit in every
//!   Nth data block after checksumming it, as a damaged link would. The
//!   receiver must notice and ask for the block again.
//!
//! Without the feature every hook is a constant no-op.

/// Damages `block` in flight if a fault was asked for; true if it did (the
/// caller must then send these bytes, not the file's).
#[cfg(feature = "fault-injection")]
pub fn corrupt_in_flight(block: &mut [u8]) -> bool {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    /// Every how many blocks one is damaged (0: never).
    static EVERY: OnceLock<u64> = OnceLock::new();
    /// Blocks sent so far by this process.
    static SENT: AtomicU64 = AtomicU64::new(0);
    let every = *EVERY.get_or_init(|| std::env::var("DMOVER_FAULT_CORRUPT_EVERY").ok().and_then(|v| v.parse().ok()).unwrap_or(0));
    if every == 0 || block.is_empty() {
        return false;
    }
    let n = SENT.fetch_add(1, Ordering::Relaxed) + 1;
    if !n.is_multiple_of(every) {
        return false;
    }
    let at = (n as usize).wrapping_mul(7919) % block.len();
    block[at] ^= 1 << (n % 8);
    log::debug!("fault injection: damaged block {n} at byte {at}");
    true
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn corrupt_in_flight(_block: &mut [u8]) -> bool {
    false
}
