//! `dmover-faulty`: the `dmover` command with a fault injector installed,
//! for the end-to-end tests (see `crates/engine/src/fault.rs`). It needs
//! this package's `fault-injection` feature, which only its tests turn on
//! (`Cargo.toml`): `cargo build` and `cargo install` do not make it.
//! Nothing is injected unless asked for:
//!
//! * `DMOVER_FAULT_CORRUPT_EVERY=N`: the sending end flips one bit in every
//!   Nth data block after checksumming it, as a damaged link would. The
//!   receiver must notice and ask for the block again.

use std::sync::atomic::{AtomicU64, Ordering};

fn main() {
    let every: u64 = std::env::var("DMOVER_FAULT_CORRUPT_EVERY").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    if every > 0 {
        /// Blocks sent so far by this process.
        static SENT: AtomicU64 = AtomicU64::new(0);
        dmover_engine::fault::install(Box::new(move |block: &mut [u8]| {
            if block.is_empty() {
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
        }));
    }
    dmover_cli::main()
}
