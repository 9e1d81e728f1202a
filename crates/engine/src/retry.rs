//! Retrying a transfer after transient network errors.
//!
//! A retry re-runs the whole attempt: the receiver's resume state (the
//! transfer marker and the journals of partial files) makes the re-run send
//! only what is missing, so one mechanism serves both automatic retries and
//! a user re-running an interrupted command.

use crate::error::Result;
use dmover_proto::frame::Stats;
use std::time::Duration;

/// Wait before retry `n` (0-based): 0.5 s, doubling, at most 8 s.
pub fn backoff(n: u32) -> Duration {
    Duration::from_millis(500u64 << n.min(4))
}

/// Runs `attempt` until it succeeds, fails for a reason a retry cannot fix,
/// or `retries` retries are used up. The result counts the retries.
pub fn with_retries(retries: u32, mut attempt: impl FnMut(u32) -> Result<Stats>) -> Result<Stats> {
    let mut n = 0;
    loop {
        match attempt(n) {
            Ok(mut s) => {
                s.retries = n as u64;
                return Ok(s);
            }
            Err(e) if e.is_transient() && n < retries => {
                let wait = backoff(n);
                log::warn!("{e}; retrying in {:.1} s ({} of {retries})", wait.as_secs_f64(), n + 1);
                std::thread::sleep(wait);
                n += 1;
            }
            Err(e) => return Err(e),
        }
    }
}
