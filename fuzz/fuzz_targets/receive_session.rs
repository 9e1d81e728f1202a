//! The receiving end's session (`dmover_proto::session::receive`) driven
//! by arbitrary events, with no socket: control messages with any numbers
//! in them, data frames with any header, and the driver's own reports
//! (prepared, written, damaged, committed, failed) about any file, in any
//! order. Every action is checked by the session's audit, every data frame
//! the driver admits through a file's gate must lie inside the file's
//! announced size, and the session's state must stay bounded: files are
//! announced at sizes up to and past the most blocks a file may have
//! ([`MAX_FILE_BLOCKS`]), which must cost the session nothing until their
//! blocks arrive (libFuzzer's memory limit catches one that sizes anything
//! from them), and blocks arrive at the ends of such files. Hard links are
//! announced to names in flight, settled or never announced, with files
//! said to have other names or not: the audit refuses a link made to any
//! but a file settled as one with other names.
#![no_main]

use dmover_proto::digest::Sum;
use dmover_proto::frame::{FileMeta, MAX_FILE_BLOCKS};
use dmover_proto::phase::ToReceiver;
use dmover_proto::session::audit::Audit;
use dmover_proto::session::receive::{check_header, Action, Config, Event, Gate, Outcome, Receive, MAX_OPEN_FILES};
use dmover_proto::ErrorKind;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;

/// Ids and blocks come from a small range most of the time, so that
/// events meet the files they are about.
fn small(u: &mut Unstructured) -> Result<u64> {
    Ok(if u.ratio(7, 8)? { u.int_in_range(0..=7)? } else { u.arbitrary()? })
}

fn sum(u: &mut Unstructured) -> Result<Sum> {
    // Few distinct sums, so that digests sometimes match.
    Ok([u.int_in_range(0..=3)?; 16])
}

fn kind(u: &mut Unstructured) -> Result<ErrorKind> {
    Ok(ErrorKind::from_u8(u.arbitrary()?))
}

fn event(u: &mut Unstructured, sizes: &HashMap<u64, u64>, gates: &HashMap<u64, Gate>, block_size: u64) -> Result<Option<Event>> {
    let id = small(u)?;
    Ok(Some(match u.int_in_range(0..=15)? {
        0 | 1 => {
            let path = if u.ratio(7, 8)? { format!("d/{id}") } else { u.arbitrary()? };
            // Small, around the most blocks a file may have, or past any limit.
            let size = match u.int_in_range(0..=7)? {
                0..=5 => u.int_in_range(0..=64)?,
                6 => MAX_FILE_BLOCKS * block_size - block_size + u.int_in_range(0..=2 * block_size)?,
                _ => u.arbitrary::<u64>()? | 1 << 63,
            };
            let meta = FileMeta { path, size, mtime_s: 0, mtime_ns: 0, mode: u.arbitrary()?, ..Default::default() };
            let digest = if u.arbitrary()? { Some(sum(u)?) } else { None };
            Event::Control(ToReceiver::Announce { id, meta, digest })
        }
        2 => Event::Control(ToReceiver::FileEnd { id, digest: sum(u)? }),
        3 => Event::Control(ToReceiver::Abort { id, kind: kind(u)?, message: String::new() }),
        4 => Event::Control(ToReceiver::Finish { files: u.arbitrary()?, bytes: u.arbitrary()?, set_digest: u.arbitrary()? }),
        5 => Event::Control(ToReceiver::Echo { stamp: u.arbitrary()?, received: 0, staged: 0, server_received: 0, transfers: 0 }),
        6 => Event::Control(ToReceiver::Error { kind: kind(u)?, message: String::new() }),
        7 => {
            let outcome = match u.int_in_range(0..=4)? {
                0 => Outcome::Present,
                1 => Outcome::Made,
                2 => Outcome::Refused { kind: kind(u)?, message: String::new() },
                3 => Outcome::PassedOver("passed over".into()),
                _ => {
                    let mut held = Vec::new();
                    for _ in 0..u.int_in_range(0..=4)? {
                        held.push((small(u)?, sum(u)?));
                    }
                    Outcome::Receive { held }
                }
            };
            Event::Prepared { id, outcome }
        }
        // A data frame with any header, admitted by the file's gate as the
        // engine's data connections do.
        8..=10 => {
            let offset = match u.int_in_range(0..=7)? {
                0..=5 => small(u)?.wrapping_mul(block_size),
                // The last block of the file, or one near it.
                6 => sizes
                    .get(&id)
                    .map_or(0, |s| s.saturating_sub(1) / block_size * block_size)
                    .saturating_sub(small(u)?.saturating_mul(block_size)),
                _ => u.arbitrary()?,
            };
            let len: u32 = if u.ratio(3, 4)? { u.int_in_range(0..=block_size as u32)? } else { u.arbitrary()? };
            if check_header(block_size, offset, len).is_err() {
                return Ok(None);
            }
            let Some(gate) = gates.get(&id) else { return Ok(None) };
            let Ok(block) = gate.admit(id, offset, len) else { return Ok(None) };
            assert!(offset + u64::from(len) <= sizes[&id], "a write past the end of file {id} admitted");
            if u.ratio(1, 8)? {
                Event::Damaged { id, block }
            } else {
                Event::Written { id, block, sum: sum(u)? }
            }
        }
        11 => Event::Written { id, block: small(u)?, sum: sum(u)? },
        12 => Event::Committed { id },
        13 => Event::Control(ToReceiver::Linked { id }),
        14 => {
            let first = if u.ratio(7, 8)? { format!("d/{}", small(u)?) } else { u.arbitrary()? };
            Event::Control(ToReceiver::HardLink { id, path: format!("d/link{id}"), first })
        }
        _ => Event::Failed { id, kind: kind(u)?, message: String::new() },
    }))
}

fn run(u: &mut Unstructured) -> Result<()> {
    let block_size = u.int_in_range(1..=16)?;
    let discard = u.ratio(1, 4)?;
    let mut rx = Receive::new(Config { block_size, discard, accept: None });
    let mut audit = Audit::new(discard);
    let mut sizes = HashMap::new();
    let mut gates = HashMap::new();
    while !u.is_empty() {
        let Some(e) = event(u, &sizes, &gates, block_size)? else { continue };
        if let Event::Control(ToReceiver::Announce { id, meta, .. }) = &e {
            if !rx.is_over() && !gates.contains_key(id) {
                sizes.insert(*id, meta.size);
            }
        }
        audit.event(&e);
        rx.handle(e);
        assert!(rx.open_files() <= MAX_OPEN_FILES);
        while let Some(a) = rx.poll() {
            audit.action(&a).unwrap_or_else(|e| panic!("{e}"));
            match a {
                Action::Open { id, gate } => {
                    gates.insert(id, gate);
                }
                Action::Close { id } | Action::Remove { id } => {
                    gates.remove(&id);
                }
                _ => {}
            }
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
