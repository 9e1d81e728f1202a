//! The sending end of a transfer, as a state machine.
//!
//! [`Send`] holds the rules of the sending end and the state of each file
//! announced and not yet settled: which host it went to, the plan the
//! receiver gave it, the checksums of the blocks read so far, the digest
//! announced with `FileEnd`, and how often each block was asked for again.
//! Its driver offers it files as the walk finds them ([`Event::Offer`]) and
//! feeds it what happened — control messages from each receiver, chunks of
//! a file read, a file that could not be read, probes due — and carries out
//! the [`Action`]s it yields: messages to send on a host's control
//! connection, chunks to read, files settled, the transfer complete.
//!
//! The session decides where each file goes: round-robin over the hosts
//! (or the host it is pinned to), keeping at most [`Config::window`] files
//! per host announced and not settled, so that plans come back while
//! earlier files stream. Data does not pass through it: a read action
//! names the blocks to read and which of them to send; the session hears
//! only the checksums, once a chunk is read and queued.
//!
//! The session says `Finish` as soon as the walk is over and every file
//! has ended (`FileEnd` went out, or it is settled), while the last blocks
//! and confirmations are still on their way: a receiver confirms the end
//! (`Finished`) once it has settled every file, so the end costs no round
//! trip of its own. Nothing follows `Finish` on a control connection, so a
//! block asked for again after it that cannot be read ends the session.
//!
//! A destination that runs out of space fails the file it stopped
//! (`Failed`, class no space); the files in flight there run their
//! course, and may fit, but nothing more is announced to that host: a file
//! only it could take fails unannounced. A receiver that passes a file
//! over by the transfer's rules says why in its `Plan`: the file is listed
//! with what the walk passed over, and is no longer a file of the transfer.
//!
//! Hard links: a file offered as having other names is announced right
//! after `Linked`, and each other name offered
//! ([`Event::OfferLink`]) waits until that file is settled; it then goes
//! as `HardLink` to the host that holds the file, or fails with it. What
//! the session keeps for this is the name and host of each file offered
//! as having other names, and the names waiting for one.
//!
//! Every number a receiver gives is checked: a plan, re-request or
//! confirmation for a file it was not sent or that is settled, a plan
//! twice or with blocks outside its file, a confirmation before the file
//! ended, a block asked for more often than a receiver may ask
//! ([`NACK_BUDGET`]), totals before the end, before every file sent to it
//! was settled, or larger than what it was offered: each ends the session
//! with a protocol violation. Messages
//! about a file this end gave up on (it could not be read) are late, not
//! lies, and are ignored.

use crate::digest::{file_digest, SetDigest, Sum};
use crate::frame::{FileError, FileMeta, MAX_LISTED_ERRORS};
use crate::phase::{ToReceiver, ToSender};
use crate::session::receive::MAX_DAMAGED;
use crate::ErrorKind;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// Times a receiver may ask for one block again: each time it arrives
/// damaged until the receiver gives the file up ([`MAX_DAMAGED`]), and once
/// more when a block kept from an earlier run disagrees with the digest.
pub const NACK_BUDGET: u32 = MAX_DAMAGED;

/// How the session sends.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Destination hosts (at least one).
    pub hosts: usize,
    /// Bytes per block (not zero).
    pub block_size: u64,
    /// Files announced to one host and not yet settled, at most.
    pub window: usize,
    /// Blocks per read action (not zero): a large file is read in chunks
    /// of this many blocks, several at once.
    pub chunk_blocks: u64,
}

/// What happened, for the session to hear.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A file to send, pinned to a host or not (None, or a host out of
    /// range: the next host with room); `linked`: it has other names, to
    /// be offered later ([`Event::OfferLink`]). Files and other names are
    /// numbered 1, 2, 3… in the order they are offered; offer one only
    /// while [`Send::wants_file`] says so.
    Offer { meta: FileMeta, digest: Option<Sum>, pinned: Option<usize>, linked: bool },
    /// Another name of `first`, a file offered earlier as `linked`: sent
    /// as a hard link to the host that holds that file once it is settled
    /// there, or failed with it; `subject` names it in an error, as the
    /// user knows it (empty: its name).
    OfferLink { path: String, first: String, subject: String },
    /// The walk could not list or read this source; it is counted as failed.
    WalkError(FileError),
    /// The walk passed over something the transfer does not copy.
    PassedOver(FileError),
    /// A directory of the transfer (not empty: an empty one is offered as
    /// a file), whose mode and mtime every host is told, to give it once
    /// its files are in.
    Dir(FileMeta),
    /// Nothing more will be offered.
    WalkDone,
    /// The chunk of file `id` starting at block `first` (of a
    /// [`Action::Read`] that was not a resend) is read, its blocks queued,
    /// with these checksums. `kept`: the digest the storage keeps with the
    /// file (an object store does), which what was read must match.
    Read { id: u64, first: u64, sums: Vec<Sum>, kept: Option<Sum> },
    /// File `id` could not be read (or changed while it was read);
    /// `subject` names it as the user knows it.
    ReadFailed { id: u64, kind: ErrorKind, subject: String, message: String },
    /// A control message from `host`'s receiver.
    Control { host: usize, msg: ToSender },
    /// Time to measure `host`'s control connection with an echo stamped `stamp`.
    Probe { host: usize, stamp: u64 },
    /// The tuner wants one more data connection to `host`, which `host` dials.
    Dial { host: usize },
}

/// A chunk of a file to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub id: u64,
    pub host: usize,
    /// Blocks `first..end` are read (each checksummed for the file's digest).
    pub first: u64,
    pub end: u64,
    /// The blocks to send, as ranges of block numbers; the others are
    /// only read for the digest.
    pub send: Arc<[(u64, u64)]>,
    /// Asked for again: nothing is reported once it is read.
    pub resend: bool,
}

impl Read {
    /// Whether block `b` is to be sent.
    pub fn sends(&self, b: u64) -> bool {
        self.send.iter().any(|(a, e)| (*a..*e).contains(&b))
    }
}

/// How a file was settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Sent and confirmed with the digest of the blocks read.
    Sent,
    /// Already complete at the destination.
    Skipped,
    /// The receiver does not take it, by the transfer's rules, and says
    /// why (not an error; not at the destination).
    PassedOver(FileError),
    Failed(FileError),
}

/// What the driver is to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send this on `host`'s control connection.
    Send { host: usize, msg: ToReceiver },
    /// Read a chunk of a file and queue the blocks to send for its host.
    Read(Read),
    /// File `id` is settled: nothing more is read or sent for it.
    Settle { id: u64, host: usize, meta: FileMeta, outcome: Outcome },
    /// Every host confirmed the end of the transfer. The session is over.
    Complete(Summary),
    /// `host`'s receiver broke a rule of the protocol. The session is over.
    Violation { host: usize, why: String },
    /// `host`'s receiver ended the transfer with an error. The session is over.
    PeerFailed { host: usize, kind: ErrorKind, message: String },
    /// A block of file `id` asked for again after `Finish` could not be
    /// read: the receiver cannot be told to give the file up, so the
    /// session is over (a later attempt sends the file afresh).
    Unreadable { host: usize, kind: ErrorKind, subject: String, message: String },
}

/// What one host was offered, and what it confirmed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostTotals {
    /// Files and bytes announced to it.
    pub offered_files: u64,
    pub offered_bytes: u64,
    /// Files and bytes it holds now (sent or skipped), and their set digest.
    pub files: u64,
    pub bytes: u64,
    pub set: SetDigest,
    /// What its `Finished` said: files, bytes, set digest.
    pub confirmed: Option<(u64, u64, u128)>,
}

/// The outcome of the session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Files and bytes announced.
    pub files: u64,
    pub bytes: u64,
    pub skipped_files: u64,
    pub skipped_bytes: u64,
    /// Blocks sent again because a receiver asked.
    pub resent_blocks: u64,
    /// The first [`MAX_LISTED_ERRORS`] files that failed.
    pub errors: Vec<FileError>,
    /// Files that failed beyond those listed.
    pub errors_not_listed: u64,
    /// What the walk or a receiver passed over, and why (not errors).
    pub passed_over: Vec<FileError>,
    pub hosts: Vec<HostTotals>,
}

impl Summary {
    /// Counts a failed file, and lists it while the list has room.
    fn add_error(&mut self, e: FileError) {
        if self.errors.len() < MAX_LISTED_ERRORS {
            self.errors.push(e);
        } else {
            self.errors_not_listed = self.errors_not_listed.saturating_add(1);
        }
    }

    /// Whether every host confirmed the set of files this end counts as there.
    pub fn digests_match(&self) -> bool {
        self.hosts.iter().all(|h| h.confirmed.is_some_and(|c| c.2 == h.set.0))
    }
}

/// Where a file announced and not settled is.
#[derive(Debug)]
enum Stage {
    /// Waiting for its plan.
    Announced,
    /// Planned: chunks are being read.
    Reading { sums: Vec<Sum>, chunks_left: u64 },
    /// Every chunk read; `FileEnd` went out with this digest.
    Ended(Sum),
}

#[derive(Debug)]
struct File {
    host: usize,
    meta: FileMeta,
    blocks: u64,
    stage: Stage,
    /// Times each block was asked for again.
    nacks: HashMap<u64, u32>,
    /// It has other names, waiting for it to be settled.
    linked: bool,
}

/// What is offered and waits for room at its host.
#[derive(Debug)]
enum Offered {
    File {
        id: u64,
        meta: FileMeta,
        digest: Option<Sum>,
        pinned: Option<usize>,
        linked: bool,
    },
    /// Another name of `first`, settled at `host`.
    Link {
        id: u64,
        path: String,
        first: String,
        host: usize,
    },
}

/// A file offered as having other names, by its name.
#[derive(Debug)]
enum Group {
    /// Not settled yet: these names (id, path, subject) wait for it.
    Pending(Vec<(u64, String, String)>),
    /// Settled at this host.
    At(usize),
    /// It failed at this host: its other names fail with it.
    Failed(usize, FileError),
}

/// What a hard link is, as a file of the transfer: a name with no data.
fn link_meta(path: String) -> FileMeta {
    FileMeta { path, size: 0, mtime_s: 0, mtime_ns: 0, mode: 0, ..Default::default() }
}

/// The sending end of one transfer. See the module's documentation.
pub struct Send {
    cfg: Config,
    /// Offered and not yet announced (the first waits for room).
    offers: VecDeque<Offered>,
    /// The id of the last file or name offered.
    offered: u64,
    /// Files offered as having other names, by name.
    groups: HashMap<String, Group>,
    /// Names waiting in [`Group::Pending`].
    waiting: usize,
    /// The host the next unpinned file tries first.
    next_host: usize,
    files: HashMap<u64, File>,
    /// Files in flight per host.
    in_flight: Vec<usize>,
    /// Hosts whose destination ran out of space: nothing more is
    /// announced to them.
    full: Vec<bool>,
    /// Files this end gave up on: what a receiver still says of them is late.
    abandoned: HashSet<u64>,
    walk_done: bool,
    /// `Finish` went out to every host: every file had ended.
    finishing: bool,
    summary: Summary,
    out: VecDeque<Action>,
    /// Complete, or ended by an error: nothing more is heard.
    over: bool,
}

impl Send {
    pub fn new(cfg: Config) -> Send {
        assert!(
            cfg.hosts > 0 && cfg.block_size > 0 && cfg.window > 0 && cfg.chunk_blocks > 0,
            "a send session needs hosts, blocks, a window and chunks"
        );
        Send {
            cfg,
            offers: VecDeque::new(),
            offered: 0,
            groups: HashMap::new(),
            waiting: 0,
            next_host: 0,
            files: HashMap::new(),
            in_flight: vec![0; cfg.hosts],
            full: vec![false; cfg.hosts],
            abandoned: HashSet::new(),
            walk_done: false,
            finishing: false,
            summary: Summary { hosts: vec![HostTotals::default(); cfg.hosts], ..Summary::default() },
            out: VecDeque::new(),
            over: false,
        }
    }

    /// The next thing to do, if any.
    pub fn poll(&mut self) -> Option<Action> {
        self.out.pop_front()
    }

    /// Whether the session takes another file now: none waits for room,
    /// and the walk is not over.
    pub fn wants_file(&self) -> bool {
        self.offers.is_empty() && !self.walk_done && !self.over
    }

    /// Files announced to `host` and not yet settled.
    pub fn in_flight(&self, host: usize) -> usize {
        self.in_flight[host]
    }

    /// Whether the session is over (complete, or ended by an error).
    pub fn is_over(&self) -> bool {
        self.over
    }

    /// Hears what happened.
    pub fn handle(&mut self, e: Event) {
        if self.over {
            return;
        }
        match e {
            Event::Offer { meta, digest, pinned, linked } => {
                self.offered += 1;
                if linked {
                    self.groups.insert(meta.path.clone(), Group::Pending(Vec::new()));
                }
                self.offers.push_back(Offered::File { id: self.offered, meta, digest, pinned, linked });
                self.announce_waiting();
            }
            Event::OfferLink { path, first, subject } => {
                self.offered += 1;
                let id = self.offered;
                match self.groups.get_mut(&first) {
                    Some(Group::Pending(names)) => {
                        names.push((id, path, subject));
                        self.waiting += 1;
                    }
                    Some(Group::At(host)) => {
                        let host = *host;
                        self.offers.push_back(Offered::Link { id, path, first, host });
                        self.announce_waiting();
                    }
                    Some(Group::Failed(host, e)) => {
                        let (host, e) = (*host, e.clone());
                        self.fail_name(id, path, subject, &first, host, &e);
                    }
                    None => {
                        let e = FileError { path: first.clone(), kind: ErrorKind::Internal, message: "it was not sent".into() };
                        self.fail_name(id, path, subject, &first, 0, &e);
                    }
                }
            }
            Event::WalkError(e) => self.summary.add_error(e),
            Event::PassedOver(e) => self.summary.passed_over.push(e),
            Event::Dir(meta) if !self.walk_done => {
                for host in 0..self.cfg.hosts {
                    self.out.push_back(Action::Send { host, msg: ToReceiver::Dir { meta: meta.clone() } });
                }
            }
            Event::Dir(_) => {}
            Event::WalkDone => {
                self.walk_done = true;
                self.finish_if_ended();
            }
            Event::Read { id, first, sums, kept } => self.read(id, first, sums, kept),
            Event::ReadFailed { id, kind, subject, message } => {
                let Some(f) = self.files.get(&id) else { return };
                let host = f.host;
                if self.finishing {
                    // Nothing may follow `Finish` on a control connection.
                    return self.end(Action::Unreadable { host, kind, subject, message });
                }
                self.abandoned.insert(id);
                self.out.push_back(Action::Send { host, msg: ToReceiver::Abort { id, kind, message: message.clone() } });
                self.fail(id, subject, kind, message);
            }
            Event::Control { host, msg } => self.control(host, msg),
            Event::Probe { host, stamp } => {
                // Nothing may follow `Finish` on a control connection.
                if !self.finishing && host < self.cfg.hosts {
                    let msg = ToReceiver::Echo { stamp, received: 0, staged: 0, server_received: 0, transfers: 0 };
                    self.out.push_back(Action::Send { host, msg });
                }
            }
            Event::Dial { host } => {
                if !self.finishing && host < self.cfg.hosts {
                    self.out.push_back(Action::Send { host, msg: ToReceiver::Dial {} });
                }
            }
        }
    }

    /// Announces offered files while their host has room, in the order
    /// offered. One that only hosts out of space could take fails unsent.
    fn announce_waiting(&mut self) {
        while let Some(offer) = self.offers.front() {
            let hosts = self.cfg.hosts;
            let pinned = match offer {
                Offered::File { pinned, .. } => pinned.filter(|h| *h < hosts),
                Offered::Link { host, .. } => Some(*host),
            };
            let start = pinned.unwrap_or(self.next_host);
            let mut takers =
                (0..hosts).map(|i| (start + i) % hosts).filter(|h| pinned.is_none_or(|p| p == *h) && !self.full[*h]).peekable();
            if takers.peek().is_none() {
                let offer = self.offers.pop_front().expect("looked at above");
                self.fail_unsent(offer, start);
                continue;
            }
            let Some(host) = takers.find(|h| self.in_flight[*h] < self.cfg.window) else {
                return;
            };
            let offer = self.offers.pop_front().expect("looked at above");
            if pinned.is_none() {
                self.next_host = (host + 1) % hosts;
            }
            self.in_flight[host] += 1;
            let (id, meta, digest, linked) = match offer {
                Offered::File { id, meta, digest, linked, .. } => (id, meta, digest, linked),
                Offered::Link { id, path, first, .. } => {
                    self.summary.hosts[host].offered_files += 1;
                    self.summary.files += 1;
                    self.out.push_back(Action::Send { host, msg: ToReceiver::HardLink { id, path: path.clone(), first } });
                    let f = File { host, meta: link_meta(path), blocks: 0, stage: Stage::Announced, nacks: HashMap::new(), linked: false };
                    self.files.insert(id, f);
                    continue;
                }
            };
            let h = &mut self.summary.hosts[host];
            h.offered_files += 1;
            h.offered_bytes = h.offered_bytes.saturating_add(meta.size);
            self.summary.files += 1;
            self.summary.bytes = self.summary.bytes.saturating_add(meta.size);
            let blocks = meta.size.div_ceil(self.cfg.block_size);
            if linked {
                self.out.push_back(Action::Send { host, msg: ToReceiver::Linked { id } });
            }
            self.out.push_back(Action::Send { host, msg: ToReceiver::Announce { id, meta: meta.clone(), digest } });
            self.files.insert(id, File { host, meta, blocks, stage: Stage::Announced, nacks: HashMap::new(), linked });
        }
    }

    fn read(&mut self, id: u64, first: u64, chunk: Vec<Sum>, kept: Option<Sum>) {
        let Some(f) = self.files.get_mut(&id) else { return };
        let host = f.host;
        let Stage::Reading { sums, chunks_left } = &mut f.stage else { return };
        let start = (first as usize).min(sums.len());
        let end = (start + chunk.len()).min(sums.len());
        sums[start..end].copy_from_slice(&chunk[..end - start]);
        *chunks_left -= 1;
        if *chunks_left > 0 {
            return;
        }
        let digest = file_digest(sums.iter());
        if kept.is_some_and(|k| k != digest) {
            let message = "what was read differs from the digest stored with the file".to_string();
            self.abandoned.insert(id);
            self.out.push_back(Action::Send { host, msg: ToReceiver::Abort { id, kind: ErrorKind::Verify, message: message.clone() } });
            let subject = f.meta.path.clone();
            return self.fail(id, subject, ErrorKind::Verify, message);
        }
        f.stage = Stage::Ended(digest);
        self.out.push_back(Action::Send { host, msg: ToReceiver::FileEnd { id, digest } });
        self.finish_if_ended();
    }

    fn control(&mut self, host: usize, msg: ToSender) {
        if host >= self.cfg.hosts {
            return self.violate(host, format!("a message from host {host}, of {}", self.cfg.hosts));
        }
        match msg {
            ToSender::Plan { id, skip: true, passed_over, .. } if !passed_over.is_empty() => self.passed_over(host, id, passed_over),
            ToSender::Plan { id, skip, ranges, .. } => self.plan(host, id, skip, ranges),
            ToSender::Nack { id, block } => self.nack(host, id, block),
            ToSender::Done { id, digest } => self.done(host, id, digest),
            ToSender::Failed { id, kind, subject, message } => {
                if self.about(host, id, "failure").is_some() {
                    // Every later file would fail there too: the files in
                    // flight run their course, and no more are announced.
                    self.full[host] |= kind == ErrorKind::NoSpace;
                    self.fail(id, subject, kind, message);
                }
            }
            ToSender::Finished { files, bytes, set_digest } => self.finished(host, files, bytes, set_digest),
            ToSender::Error { kind, message } => self.end(Action::PeerFailed { host, kind, message }),
            // Measurements and keep-alives: the driver's, not the protocol's.
            ToSender::Echo { .. } | ToSender::Ping {} => {}
        }
    }

    /// The file a receiver's message is about, if the message still matters:
    /// None if it is late (the file was abandoned here) or a lie (the
    /// session is then over).
    fn about(&mut self, host: usize, id: u64, what: &str) -> Option<&mut File> {
        if self.abandoned.contains(&id) {
            return None;
        }
        let why = match self.files.get(&id) {
            Some(f) if f.host == host => None,
            Some(f) => Some(format!("{what} for {}, which was sent to another host", f.meta.path)),
            None if id == 0 || id > self.offered => Some(format!("{what} for file {id}, which was never announced")),
            None => Some(format!("{what} for file {id}, which is settled")),
        };
        if let Some(why) = why {
            self.violate(host, why);
            return None;
        }
        self.files.get_mut(&id)
    }

    fn plan(&mut self, host: usize, id: u64, skip: bool, ranges: Vec<(u64, u64)>) {
        let chunk_blocks = self.cfg.chunk_blocks;
        let Some(f) = self.about(host, id, "a plan") else { return };
        if !matches!(f.stage, Stage::Announced) {
            let why = format!("a second plan for {}", f.meta.path);
            return self.violate(host, why);
        }
        if skip {
            let f = self.files.remove(&id).expect("looked up above");
            self.summary.skipped_files += 1;
            self.summary.skipped_bytes = self.summary.skipped_bytes.saturating_add(f.meta.size);
            return self.settle(id, f, Outcome::Skipped, &[0; 16]);
        }
        if ranges.iter().any(|(a, e)| a >= e || *e > f.blocks) {
            let why = format!("plan for {} asks for blocks past its end", f.meta.path);
            return self.violate(host, why);
        }
        let blocks = f.blocks;
        let chunks = blocks.div_ceil(chunk_blocks);
        if chunks == 0 {
            let digest = file_digest(&[]);
            f.stage = Stage::Ended(digest);
            self.out.push_back(Action::Send { host, msg: ToReceiver::FileEnd { id, digest } });
            return self.finish_if_ended();
        }
        f.stage = Stage::Reading { sums: vec![[0; 16]; blocks as usize], chunks_left: chunks };
        let send: Arc<[(u64, u64)]> = ranges.into();
        for c in 0..chunks {
            let first = c * chunk_blocks;
            let end = (first + chunk_blocks).min(blocks);
            self.out.push_back(Action::Read(Read { id, host, first, end, send: send.clone(), resend: false }));
        }
    }

    /// The receiver passed file `id` over, saying why: listed with what
    /// the walk passed over, and no longer counted as a file of the
    /// transfer (it is not at the destination, and not an error).
    fn passed_over(&mut self, host: usize, id: u64, why: String) {
        let Some(f) = self.about(host, id, "a plan") else { return };
        if !matches!(f.stage, Stage::Announced) {
            let why = format!("a second plan for {}", f.meta.path);
            return self.violate(host, why);
        }
        let f = self.files.remove(&id).expect("looked up above");
        self.summary.files -= 1;
        self.summary.bytes = self.summary.bytes.saturating_sub(f.meta.size);
        let e = FileError { path: f.meta.path.clone(), kind: ErrorKind::Refused, message: why };
        self.summary.passed_over.push(e.clone());
        self.in_flight[host] -= 1;
        self.release_names(f.linked, &f.meta.path, host, Some(&e));
        self.out.push_back(Action::Settle { id, host, meta: f.meta, outcome: Outcome::PassedOver(e) });
        self.announce_waiting();
        self.finish_if_ended();
    }

    fn nack(&mut self, host: usize, id: u64, block: u64) {
        let Some(f) = self.about(host, id, "a re-request") else { return };
        let why = if matches!(f.stage, Stage::Announced) {
            Some(format!("a re-request for {} before its plan", f.meta.path))
        } else if block >= f.blocks {
            Some(format!("a re-request for block {block} of {}, past its end", f.meta.path))
        } else {
            let n = f.nacks.entry(block).or_insert(0);
            *n += 1;
            (*n > NACK_BUDGET).then(|| format!("block {block} of {} asked for more than {NACK_BUDGET} times", f.meta.path))
        };
        if let Some(why) = why {
            return self.violate(host, why);
        }
        self.summary.resent_blocks += 1;
        let send: Arc<[(u64, u64)]> = Arc::new([(block, block + 1)]);
        self.out.push_back(Action::Read(Read { id, host, first: block, end: block + 1, send, resend: true }));
    }

    fn done(&mut self, host: usize, id: u64, digest: Sum) {
        let Some(f) = self.about(host, id, "a confirmation") else { return };
        let ours = match f.stage {
            Stage::Ended(d) => d,
            // An empty directory is made and confirmed without a plan.
            Stage::Announced if f.blocks == 0 => file_digest(&[]),
            _ => {
                let why = format!("a confirmation of {} before it ended", f.meta.path);
                return self.violate(host, why);
            }
        };
        if ours != digest {
            return self.fail(id, String::new(), ErrorKind::Verify, "the destination's digest differs from the source's".into());
        }
        let f = self.files.remove(&id).expect("looked up above");
        self.settle(id, f, Outcome::Sent, &digest);
    }

    fn finished(&mut self, host: usize, files: u64, bytes: u64, set: u128) {
        let h = &self.summary.hosts[host];
        let why = if !self.finishing {
            Some("totals before the end of the transfer".to_string())
        } else if h.confirmed.is_some() {
            Some("totals twice".to_string())
        } else if self.in_flight[host] > 0 {
            Some(format!("totals before {} of the files sent to it were settled", self.in_flight[host]))
        } else if files > h.offered_files || bytes > h.offered_bytes {
            Some(format!(
                "totals of {files} files and {bytes} bytes, more than the {} files and {} bytes offered",
                h.offered_files, h.offered_bytes
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return self.violate(host, why);
        }
        self.summary.hosts[host].confirmed = Some((files, bytes, set));
        if self.summary.hosts.iter().all(|h| h.confirmed.is_some()) {
            let summary = self.summary.clone();
            self.end(Action::Complete(summary));
        }
    }

    /// File `id` failed; `subject` names where (empty: the file's name).
    fn fail(&mut self, id: u64, subject: String, kind: ErrorKind, message: String) {
        let f = self.files.remove(&id).expect("failed files are in flight");
        let path = if subject.is_empty() { f.meta.path.clone() } else { subject };
        let e = FileError { path, kind, message };
        self.summary.add_error(e.clone());
        let host = f.host;
        self.in_flight[host] -= 1;
        self.release_names(f.linked, &f.meta.path, host, Some(&e));
        self.out.push_back(Action::Settle { id, host, meta: f.meta, outcome: Outcome::Failed(e) });
        self.announce_waiting();
        self.finish_if_ended();
    }

    /// An offer no host can take fails unannounced: its host (`host`, or
    /// every host) ran out of space. Its other names fail with it.
    fn fail_unsent(&mut self, offer: Offered, host: usize) {
        let message = "not sent: the destination ran out of space".to_string();
        let (id, meta, linked) = match offer {
            Offered::File { id, meta, linked, .. } => (id, meta, linked),
            Offered::Link { id, path, .. } => (id, link_meta(path), false),
        };
        let e = FileError { path: meta.path.clone(), kind: ErrorKind::NoSpace, message };
        self.summary.add_error(e.clone());
        // Counted where the file would have gone; it never was in flight.
        self.summary.files += 1;
        self.summary.bytes = self.summary.bytes.saturating_add(meta.size);
        self.release_names(linked, &meta.path, host, Some(&e));
        self.out.push_back(Action::Settle { id, host, meta, outcome: Outcome::Failed(e) });
        self.finish_if_ended();
    }

    /// Counts a file as at its host (sent or skipped) and settles it.
    fn settle(&mut self, id: u64, f: File, outcome: Outcome, digest: &Sum) {
        let host = f.host;
        let h = &mut self.summary.hosts[host];
        h.files += 1;
        h.bytes = h.bytes.saturating_add(f.meta.size);
        h.set.add(&f.meta.path, f.meta.size, digest);
        self.in_flight[host] -= 1;
        self.release_names(f.linked, &f.meta.path, host, None);
        self.out.push_back(Action::Settle { id, host, meta: f.meta, outcome });
        self.announce_waiting();
        self.finish_if_ended();
    }

    /// The other names of a settled file (`first`, at `host`, if it was
    /// offered as `linked`) that waited for it go to its host, or fail with
    /// it (`failed`), and later ones will.
    fn release_names(&mut self, linked: bool, first: &str, host: usize, failed: Option<&FileError>) {
        if !linked {
            return;
        }
        let state = match failed {
            Some(e) => Group::Failed(host, e.clone()),
            None => Group::At(host),
        };
        let Some(Group::Pending(names)) = self.groups.insert(first.to_string(), state) else { return };
        self.waiting -= names.len();
        for (id, path, subject) in names {
            match failed {
                Some(e) => self.fail_name(id, path, subject, first, host, e),
                None => self.offers.push_back(Offered::Link { id, path, first: first.to_string(), host }),
            }
        }
    }

    /// Another name of `first` (`path`, named `subject` in the error, or
    /// by its name) fails as `first` did (`e`), unannounced.
    fn fail_name(&mut self, id: u64, path: String, subject: String, first: &str, host: usize, e: &FileError) {
        let message = format!("another name of {}, which failed: {}", crate::path::printable(first), e.message);
        let subject = if subject.is_empty() { path.clone() } else { subject };
        let e = FileError { path: subject, kind: e.kind, message };
        self.summary.add_error(e.clone());
        self.out.push_back(Action::Settle { id, host, meta: link_meta(path), outcome: Outcome::Failed(e) });
    }

    /// Once the walk is over and every file has ended (or is settled),
    /// tells each host the transfer is over, with what it should hold once
    /// the files in flight are settled.
    fn finish_if_ended(&mut self) {
        let ended = self.files.values().all(|f| matches!(f.stage, Stage::Ended(_)));
        if !self.walk_done || self.finishing || !self.offers.is_empty() || self.waiting > 0 || !ended {
            return;
        }
        self.finishing = true;
        for (host, h) in self.summary.hosts.iter().enumerate() {
            let msg = ToReceiver::Finish { files: h.files, bytes: h.bytes, set_digest: h.set.0 };
            self.out.push_back(Action::Send { host, msg });
        }
    }

    fn violate(&mut self, host: usize, why: String) {
        self.end(Action::Violation { host, why });
    }

    fn end(&mut self, last: Action) {
        self.out.push_back(last);
        self.files.clear();
        self.offers.clear();
        self.over = true;
    }
}

#[cfg(test)]
mod tests;
