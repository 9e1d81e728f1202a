//! `dmover drain`: sends what a stream from a simulation left undelivered
//! (blocks in its spill file, steps whose manifest no sink saved), from the
//! producer's manifest, once a sink is back — after a close that timed
//! out, or after the producer was killed (see `dmover_stream::drain`).

use clap::Args;
use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct DrainArgs {
    /// The producer's manifest: SPILL_DIR/PRODUCER.PID.manifest.json, beside its spill file.
    pub manifest: PathBuf,
    #[command(flatten)]
    pub token: crate::TokenArgs,
    /// Seconds to keep trying before giving up on what is left.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
}

/// Lost steps named in drain's error; the rest are counted.
const SHOW_LOST: usize = 10;

pub fn run(a: DrainArgs) -> Result<i32> {
    let r = dmover_stream::drain(&a.manifest, &a.token.token()?, Duration::from_secs(a.timeout))?;
    let sent: Vec<String> = r
        .destinations
        .iter()
        .filter(|d| d.count > 0)
        .map(|d| format!("{}: {} blocks", dmover_proto::path::printable(&d.name), d.count))
        .collect();
    outln!("dmover: drained {} steps; sent {}", r.steps, if sent.is_empty() { "nothing".into() } else { sent.join(", ") });
    if !r.damaged.is_empty() {
        return Err(r.undelivered().expect("blocks given up as damaged are undelivered"));
    }
    if r.undelivered_blocks > 0 || r.unsaved_steps > 0 {
        let msg = format!(
            "{} blocks undelivered and {} steps unsaved; they stay in {} (run drain again when a sink is up)",
            r.undelivered_blocks,
            r.unsaved_steps,
            r.spill_file.map(|p| p.display().to_string()).unwrap_or_else(|| "the spill file".into())
        );
        return Err(Error::new(ErrorKind::Unreachable, a.manifest.display().to_string(), msg));
    }
    if !r.split_steps.is_empty() {
        let msg = format!("steps {:?} are split between sinks and could not be gathered to one, so no hook ran for them", r.split_steps);
        return Err(Error::new(ErrorKind::Unreachable, a.manifest.display().to_string(), msg)
            .advised("every block is safe at a sink; run drain again when the sinks its manifest names are up"));
    }
    if !r.lost_steps.is_empty() {
        let mut steps: Vec<String> = r.lost_steps.iter().take(SHOW_LOST).map(u64::to_string).collect();
        if r.lost_steps.len() > SHOW_LOST {
            steps.push(format!("and {} more", r.lost_steps.len() - SHOW_LOST));
        }
        let msg = format!(
            "everything else was delivered, but not these steps, which the producer stopped before they were whole: {}",
            steps.join(", ")
        );
        let advice = "part of each was only in the producer's memory; rerun the simulation from a checkpoint to produce them again";
        return Err(Error::new(ErrorKind::Verify, a.manifest.display().to_string(), msg).advised(advice));
    }
    Ok(0)
}
