//! The sending end's session (`dmover_proto::session::send`) driven by
//! arbitrary events, with no socket: files offered by the walk, chunks read
//! or failed, probes, and control messages from receivers with any numbers
//! in them (plans, re-requests, confirmations, failures and totals about
//! any file), in any order. Every file must settle at most once, every
//! chunk to read must lie inside its file, nothing may go to a host after
//! `Finish`, no host may have more files in flight than the window, a
//! hard link may go only to the host of its file and only once that file
//! is settled there, and nothing may follow the session's end.
#![no_main]

use dmover_proto::digest::{file_digest, Sum};
use dmover_proto::frame::FileMeta;
use dmover_proto::phase::{ToReceiver, ToSender};
use dmover_proto::session::send::{Action, Config, Event, Outcome, Read, Send};
use dmover_proto::ErrorKind;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use std::collections::{HashMap, HashSet};

/// Ids and blocks come from a small range most of the time, so that
/// events meet the files they are about.
fn small(u: &mut Unstructured) -> Result<u64> {
    Ok(if u.ratio(7, 8)? { u.int_in_range(0..=9)? } else { u.arbitrary()? })
}

fn sum(u: &mut Unstructured) -> Result<Sum> {
    // Few distinct sums, so that digests sometimes match.
    Ok([u.int_in_range(0..=3)?; 16])
}

fn kind(u: &mut Unstructured) -> Result<ErrorKind> {
    Ok(ErrorKind::from_u8(u.arbitrary()?))
}

/// What the simulated driver knows.
struct Driver {
    hosts: usize,
    window: usize,
    /// Each offered file's block count, by id.
    blocks: HashMap<u64, u64>,
    offered: u64,
    /// Chunks to read, not yet reported.
    reads: Vec<Read>,
    settled: HashSet<u64>,
    /// Where each file was announced, by name, and those settled there.
    announced: HashMap<String, usize>,
    settled_at: HashSet<String>,
    finished: HashSet<usize>,
    over: bool,
}

impl Driver {
    fn event(&mut self, u: &mut Unstructured, tx: &Send, block_size: u64) -> Result<Option<Event>> {
        Ok(Some(match u.int_in_range(0..=13)? {
            0 | 1 => {
                if !tx.wants_file() {
                    return Ok(None);
                }
                let size: u64 = u.int_in_range(0..=64)?;
                self.offered += 1;
                self.blocks.insert(self.offered, size.div_ceil(block_size));
                let pinned = if u.arbitrary()? { Some(u.int_in_range(0..=3)?) } else { None };
                let meta = FileMeta { path: format!("f{}", self.offered), size, mtime_s: 0, mtime_ns: 0, mode: 0o644, ..Default::default() };
                Event::Offer { meta, digest: None, pinned, linked: u.ratio(1, 3)? }
            }
            // Another name of a file offered (as having other names, or not), or of none.
            12 => {
                if !tx.wants_file() {
                    return Ok(None);
                }
                self.offered += 1;
                self.blocks.insert(self.offered, 0);
                Event::OfferLink { path: format!("l{}", self.offered), first: format!("f{}", small(u)?), subject: String::new() }
            }
            2 => Event::WalkDone,
            // A chunk the session asked for is read, or cannot be.
            3 | 4 => {
                if self.reads.is_empty() {
                    return Ok(None);
                }
                let i = u.int_in_range(0..=self.reads.len() - 1)?;
                let r = self.reads.swap_remove(i);
                if u.ratio(1, 8)? {
                    Event::ReadFailed { id: r.id, kind: kind(u)?, subject: String::new(), message: String::new() }
                } else if r.resend {
                    return Ok(None);
                } else {
                    let sums = (r.first..r.end).map(|_| sum(u)).collect::<Result<Vec<_>>>()?;
                    Event::Read { id: r.id, first: r.first, sums, kept: None }
                }
            }
            5 => Event::Probe { host: u.int_in_range(0..=3)?, stamp: u.arbitrary()? },
            _ => {
                let host = u.int_in_range(0..=self.hosts)?;
                let id = small(u)?;
                let msg = match u.int_in_range(0..=6)? {
                    0 => {
                        let mut ranges = Vec::new();
                        for _ in 0..u.int_in_range(0..=3)? {
                            ranges.push((small(u)?, small(u)?));
                        }
                        let passed_over = if u.ratio(1, 8)? { "passed over".into() } else { String::new() };
                        ToSender::Plan { id, skip: u.ratio(1, 4)?, ranges, passed_over }
                    }
                    1 => ToSender::Nack { id, block: small(u)? },
                    2 => ToSender::Done { id, digest: if u.arbitrary()? { file_digest(&[]) } else { sum(u)? } },
                    3 => ToSender::Failed { id, kind: kind(u)?, subject: String::new(), message: String::new() },
                    4 => ToSender::Finished { files: small(u)?, bytes: small(u)?, set_digest: u.arbitrary()? },
                    5 => ToSender::Error { kind: kind(u)?, message: String::new() },
                    _ => ToSender::Ping {},
                };
                Event::Control { host, msg }
            }
        }))
    }

    fn action(&mut self, tx: &Send, a: Action) {
        assert!(!self.over, "{a:?} after the session ended");
        match a {
            Action::Send { host, msg } => {
                assert!(host < self.hosts && !self.finished.contains(&host), "{msg:?} to host {host}");
                match msg {
                    ToReceiver::Finish { .. } => {
                        self.finished.insert(host);
                    }
                    ToReceiver::Announce { meta, .. } => {
                        self.announced.insert(meta.path, host);
                    }
                    ToReceiver::HardLink { first, .. } => {
                        assert!(self.settled_at.contains(&first), "a hard link to {first}, not settled");
                        assert_eq!(self.announced.get(&first), Some(&host), "a hard link to {first} sent to another host");
                    }
                    _ => {}
                }
                assert!(tx.in_flight(host) <= self.window, "more than the window in flight");
            }
            Action::Read(r) => {
                let blocks = self.blocks[&r.id];
                assert!(r.first < r.end && r.end <= blocks, "a read of blocks {}..{} of {blocks}", r.first, r.end);
                assert!(r.send.iter().all(|(a, e)| a < e && *e <= blocks), "a read sending blocks outside its file");
                self.reads.push(r);
            }
            Action::Settle { id, meta, outcome, .. } => {
                assert!(self.settled.insert(id), "file {id} settled twice");
                if matches!(outcome, Outcome::Sent | Outcome::Skipped) {
                    self.settled_at.insert(meta.path);
                }
                self.reads.retain(|r| r.id != id);
            }
            Action::Complete(_) | Action::Violation { .. } | Action::PeerFailed { .. } | Action::Unreadable { .. } => self.over = true,
        }
    }
}

fn run(u: &mut Unstructured) -> Result<()> {
    let block_size = u.int_in_range(1..=16)?;
    let hosts = u.int_in_range(1..=3)?;
    let window = u.int_in_range(1..=4)?;
    let chunk_blocks = u.int_in_range(1..=4)?;
    let mut tx = Send::new(Config { hosts, block_size, window, chunk_blocks });
    let mut d = Driver {
        hosts,
        window,
        blocks: HashMap::new(),
        offered: 0,
        reads: Vec::new(),
        settled: HashSet::new(),
        announced: HashMap::new(),
        settled_at: HashSet::new(),
        finished: HashSet::new(),
        over: false,
    };
    while !u.is_empty() {
        let Some(e) = d.event(u, &tx, block_size)? else { continue };
        tx.handle(e);
        while let Some(a) = tx.poll() {
            d.action(&tx, a);
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
