//! The receiving end of a transfer, as a state machine.
//!
//! [`Receive`] holds the rules of the receiving end and the state of each
//! file in flight: what was announced, which blocks are held, whether the
//! sender's digest came, whether the file is being committed. Its driver
//! feeds it [`Event`]s — control messages from the sender, and what its
//! workers did: the local checks for an announced file, a block that
//! arrived damaged, a block written, a file committed, a file that failed —
//! and carries out the [`Action`]s it yields: messages to send (plans,
//! re-requests, confirmations), files to prepare, open, commit or remove.
//!
//! Data does not pass through the session. When a file may be written the
//! session hands its driver the file's [`Gate`], which the data path uses
//! to admit a block (within the announced size, of the right length)
//! without asking; the session hears of each block only once it is
//! written. Every number the sender gives is checked: a block outside its
//! file, a file announced twice, more files in flight than any sender keeps
//! ([`MAX_OPEN_FILES`]), an end before its plan, are protocol violations
//! that end the session; a path or a size this end will not take fails
//! that file alone. What the session keeps of a file grows with the blocks
//! that arrive (their checksums, until the file is verified), never with
//! the size the sender announced: announcing files of the most blocks a
//! file may have ([`MAX_FILE_BLOCKS`](crate::frame::MAX_FILE_BLOCKS)) costs
//! this end a few hundred bytes each.
//!
//! The sender says `Finish` as soon as every file it announced has ended
//! (its last blocks may still be on their way), not once every file is
//! confirmed: the session confirms the end with its totals (`Finished`)
//! once every file in flight is settled, so the end costs no round trip
//! of its own. A `Finish` while a file has not ended, and an announcement
//! or a second `Finish` after it, are protocol violations.
//!
//! Hard links: a file the sender said has other names (`Linked`, right
//! before its announcement) is
//! remembered by its name once settled here (received, or found already
//! present), and only such a file may be given another name
//! (`HardLink`): the receiver never makes a link to a file this
//! transfer did not settle. What is remembered grows with such files only.

use crate::digest::{file_digest, SetDigest, Sum};
use crate::frame::{file_blocks, FileMeta, MAX_HOLE_BLOCKS, MAX_ID_NAME, MAX_XATTRS, MAX_XATTR_NAME, MAX_XATTR_VALUE};
use crate::phase::{ToReceiver, ToSender};
use crate::ErrorKind;
use held::Held;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

mod held;

/// Says why an announced name is not taken, if it is not.
pub type NameCheck = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// Files announced and not yet settled, at most. A sender keeps 1,024 in
/// flight per destination host; the rest of the room is for senders that
/// keep more, while a sender that lies cannot grow this end's state
/// without bound.
pub const MAX_OPEN_FILES: usize = 4096;

/// Times one block may arrive damaged before its file fails verification:
/// a link that damages a block this often will not deliver it.
pub const MAX_DAMAGED: u32 = 8;

/// How the session receives.
#[derive(Clone)]
pub struct Config {
    /// Bytes per block (not zero).
    pub block_size: u64,
    /// Check blocks and digests but keep nothing (`--discard`): no file is
    /// prepared or committed.
    pub discard: bool,
    /// Which announced names to take (None: any relative path).
    pub accept: Option<NameCheck>,
}

/// What the data path needs to admit a block of one file on its own: the
/// file's announced size and the block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gate {
    size: u64,
    block_size: u64,
}

impl Gate {
    /// The file's announced size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// How many blocks the file has.
    pub fn blocks(&self) -> u64 {
        self.size.div_ceil(self.block_size)
    }

    /// The block a data frame at `offset` of `len` bytes is, if it is a
    /// whole block of the file: it starts on a block boundary inside the
    /// file and is as long as the block (the last one may be shorter), so
    /// writing it never reaches past the announced size.
    pub fn admit(&self, file: u64, offset: u64, len: u32) -> Result<u64, String> {
        check_header(self.block_size, offset, len)?;
        let block = offset / self.block_size;
        let expect = self.size.saturating_sub(offset).min(self.block_size);
        if offset >= self.size || u64::from(len) != expect {
            return Err(format!("block {block} of file {file} has the wrong length"));
        }
        Ok(block)
    }

    /// The blocks a hole of `len` bytes at `offset` stands for (`Hole`),
    /// if they are whole blocks of the file: it starts on a block boundary
    /// and ends on one, or at the file's end, within the announced size,
    /// and covers at most [`MAX_HOLE_BLOCKS`] blocks.
    pub fn admit_hole(&self, file: u64, offset: u64, len: u64) -> Result<std::ops::Range<u64>, String> {
        let bs = self.block_size;
        let end = offset
            .checked_add(len)
            .filter(|&end| len > 0 && end <= self.size && offset.is_multiple_of(bs) && (end.is_multiple_of(bs) || end == self.size));
        let Some(end) = end else {
            return Err(format!("a hole of {len} bytes at {offset} is not whole blocks of file {file}"));
        };
        let blocks = offset / bs..end.div_ceil(bs);
        if blocks.end - blocks.start > MAX_HOLE_BLOCKS {
            return Err(format!(
                "a hole of {} blocks of file {file}, more than the {MAX_HOLE_BLOCKS} one hole may be",
                blocks.end - blocks.start
            ));
        }
        Ok(blocks)
    }
}

/// Whether a data frame's header can be a block at all, before its file is
/// known: no longer than a block and on a block boundary.
pub fn check_header(block_size: u64, offset: u64, len: u32) -> Result<(), String> {
    if u64::from(len) > block_size || !offset.is_multiple_of(block_size) {
        return Err(format!("bad block: offset {offset} length {len}"));
    }
    Ok(())
}

/// What happened, for the session to hear.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A control message from the sender.
    Control(ToReceiver),
    /// The driver looked at the destination for an announced file
    /// ([`Action::Prepare`]).
    Prepared { id: u64, outcome: Outcome },
    /// A block the file's gate admitted arrived with a checksum that does
    /// not match its data.
    Damaged { id: u64, block: u64 },
    /// A block the file's gate admitted is written (and journaled) with
    /// this checksum.
    Written { id: u64, block: u64, sum: Sum },
    /// A file sent to [`Action::Commit`] is in place and durable.
    Committed { id: u64 },
    /// Writing or committing a file failed at this end.
    Failed { id: u64, kind: ErrorKind, message: String },
}

/// What the destination says about an announced file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Receive it. Its partial file from an earlier run already holds
    /// these blocks (from that run's journal; empty for a fresh file).
    Receive { held: Vec<(u64, Sum)> },
    /// The destination holds it already (`--sync` or a resumed run): skip.
    Present,
    /// This end does not take it, by the transfer's own rules, and says
    /// why: not an error, and not at the destination (a symlink leading
    /// out of the tree with `--safe-links`, a device asked for only where
    /// this end may make one).
    PassedOver(String),
    /// It is an empty directory, now made.
    Made,
    /// It cannot be received here.
    Refused { kind: ErrorKind, message: String },
}

/// What a file failure is about, as the sender will read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// Said as is (a name that is not taken, printable).
    Said(String),
    /// A path within the transfer, for the driver to name as the user
    /// knows it (the export path, or the local one).
    Path(String),
}

/// What the driver is to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send this to the sender on the control connection.
    Send(ToSender),
    /// Look at the destination for this file (already there? a partial
    /// file to resume? make the directory) and answer with
    /// [`Event::Prepared`].
    Prepare { id: u64, meta: FileMeta, digest: Option<Sum> },
    /// Make `path` another name of `first`, a file this transfer settled
    /// (a hard link; already there when `look` finds it so), and answer
    /// with [`Event::Prepared`]: [`Outcome::Made`], [`Outcome::Present`]
    /// or [`Outcome::Refused`].
    HardLink { id: u64, path: String, first: String },
    /// Blocks of this file may be written from now on, as `gate` admits.
    Open { id: u64, gate: Gate },
    /// The journal of this file's partial file is to hold exactly these
    /// blocks (the others are asked for again).
    Rejournal { id: u64, held: Vec<(u64, Sum)> },
    /// Every block is written and the digest matches: put the file in
    /// place durably and answer with [`Event::Committed`].
    Commit { id: u64, digest: Sum },
    /// The file is settled: forget it.
    Close { id: u64 },
    /// Stop writing this file and remove its partial file and journal.
    Remove { id: u64 },
    /// Give this directory its mode and mtime once the transfer's files
    /// are in (before answering [`Action::Finish`]); where it does not
    /// exist (its files went to another host), nothing is to be done.
    Dir { meta: FileMeta },
    /// Tell the sender that this file failed here.
    Refuse { id: u64, kind: ErrorKind, subject: Subject, message: String },
    /// Answer the sender's echo with this end's counters.
    Echo { stamp: u64 },
    /// The sender asks for one more data connection: dial it, if this end
    /// dials them and holds fewer than it allows.
    Dial,
    /// The sender is finished and every file it announced is settled:
    /// confirm with these totals. The session is over.
    Finish(Totals),
    /// The sender broke a rule of the protocol. The session is over.
    Violation(String),
    /// The sender ended the transfer with an error. The session is over.
    PeerFailed { kind: ErrorKind, message: String },
}

/// What the receiving end confirmed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub files: u64,
    pub bytes: u64,
    pub set: SetDigest,
    /// Files given up here (refused, or failed to be written): not in
    /// the sender's hands to count, and never in `Finished`.
    pub failed: u64,
    /// A file failed for want of space: what a re-run, once space is
    /// freed, may send.
    pub out_of_space: bool,
}

impl Totals {
    fn add(&mut self, path: &str, size: u64, digest: &Sum) {
        // Saturating: a sender may claim sizes whose sum does not fit.
        self.files = self.files.saturating_add(1);
        self.bytes = self.bytes.saturating_add(size);
        self.set.add(path, size, digest);
    }
}

/// Where a file in flight is.
#[derive(Debug)]
enum Stage {
    /// Announced; the driver is looking at the destination.
    Preparing,
    /// Planned; blocks are coming.
    Receiving,
    /// Verified; the driver is committing it with this digest.
    Committing(Sum),
}

/// A file announced and not yet settled.
#[derive(Debug)]
struct File {
    meta: FileMeta,
    blocks: u64,
    stage: Stage,
    /// The blocks written, with their checksums: kept by what has arrived,
    /// never sized from the announced size.
    held: Held,
    /// Blocks taken from an earlier run's journal, suspect if the digest
    /// does not match (asked for again once).
    journaled: Vec<u64>,
    /// Blocks that arrived damaged, and how often.
    damaged: HashMap<u64, u32>,
    /// The sender's digest, once it sent `FileEnd`.
    end: Option<Sum>,
    /// The sender said the file has other names (`Linked`).
    linked: bool,
}

impl File {
    fn new(meta: FileMeta, blocks: u64) -> File {
        File {
            meta,
            blocks,
            stage: Stage::Preparing,
            held: Held::default(),
            journaled: Vec::new(),
            damaged: HashMap::new(),
            end: None,
            linked: false,
        }
    }

    /// Whether every block is held.
    fn complete(&self) -> bool {
        self.held.count() == self.blocks
    }
}

/// The receiving end of one transfer. See the module's documentation.
pub struct Receive {
    cfg: Config,
    files: HashMap<u64, File>,
    out: VecDeque<Action>,
    totals: Totals,
    /// Names of the files settled here that the sender said have other
    /// names: the only files a `HardLink` may name.
    linkable: HashSet<String>,
    /// The file the next announcement is of has other names, if it is this one.
    linked_next: Option<u64>,
    /// The sender said `Finish`: the session ends once no file is in flight.
    finishing: bool,
    /// Finished, failed or broken: nothing more is heard.
    over: bool,
}

/// Refuses an announced directory or symlink that claims data, and a
/// symlink whose target is empty, longer than a path may be, holds a NUL
/// or is badly spelled (the target itself is data: never checked for
/// where it leads).
fn check_kind(meta: &FileMeta) -> Result<(), &'static str> {
    if !meta.known_type() {
        return Err("a file of a type dmover does not know");
    }
    if (meta.is_dir() || meta.is_link() || meta.is_special()) && meta.size != 0 {
        return Err("a directory, symlink, device, FIFO or socket carries no data");
    }
    if meta.rdev != 0 && !meta.is_device() {
        return Err("only a device has a device number");
    }
    if meta.is_link() {
        match meta.target.as_deref().map(crate::path::to_bytes) {
            Some(Ok(t)) if !t.is_empty() && t.len() <= crate::path::MAX_PATH && !t.contains(&0) => {}
            _ => return Err("a symlink's target must be 1 to 4,096 bytes, without NUL, spelled as paths are"),
        }
    }
    if let Some(o) = &meta.owner {
        if [&o.user, &o.group].iter().any(|n| n.len() > MAX_ID_NAME || n.contains('\0')) {
            return Err("a user or group name must be at most 256 bytes, without NUL");
        }
    }
    if meta.xattrs.len() > MAX_XATTRS {
        return Err("a file may carry at most 256 extended attributes");
    }
    for x in &meta.xattrs {
        if x.name.is_empty() || x.name.len() > MAX_XATTR_NAME || x.name.contains(&0) || x.value.len() > MAX_XATTR_VALUE {
            return Err("an extended attribute's name must be 1 to 255 bytes without NUL, its value at most 64 KiB");
        }
    }
    Ok(())
}

impl Receive {
    pub fn new(cfg: Config) -> Receive {
        assert!(cfg.block_size > 0, "a block size of zero");
        Receive {
            cfg,
            files: HashMap::new(),
            out: VecDeque::new(),
            totals: Totals::default(),
            linkable: HashSet::new(),
            linked_next: None,
            finishing: false,
            over: false,
        }
    }

    /// The next thing to do, if any.
    pub fn poll(&mut self) -> Option<Action> {
        self.out.pop_front()
    }

    /// Files announced and not yet settled.
    pub fn open_files(&self) -> usize {
        self.files.len()
    }

    /// Whether the session is over (finished, or ended by an error).
    pub fn is_over(&self) -> bool {
        self.over
    }

    /// Hears what happened.
    pub fn handle(&mut self, e: Event) {
        if self.over {
            return;
        }
        match e {
            Event::Control(m) => self.control(m),
            Event::Prepared { id, outcome } => self.prepared(id, outcome),
            Event::Damaged { id, block } => self.damaged(id, block),
            Event::Written { id, block, sum } => self.written(id, block, sum),
            Event::Committed { id } => {
                if let Some(File { stage: Stage::Committing(digest), .. }) = self.files.get(&id) {
                    let digest = *digest;
                    self.confirm(id, digest);
                }
            }
            Event::Failed { id, kind, message } => {
                if self.files.contains_key(&id) {
                    self.fail_file(id, kind, message);
                }
            }
        }
        if self.finishing && !self.over && self.files.is_empty() {
            self.end(Action::Finish(self.totals));
        }
    }

    fn control(&mut self, m: ToReceiver) {
        match m {
            ToReceiver::Announce { id, meta, digest } => self.announce(id, meta, digest),
            ToReceiver::Dir { meta } => self.dir(meta),
            ToReceiver::Linked { id } => self.linked_next = Some(id),
            ToReceiver::HardLink { id, path, first } => self.hard_link(id, path, first),
            ToReceiver::FileEnd { id, digest } => {
                // An end for a file no longer here is late (the file was
                // aborted or failed meanwhile).
                let Some(f) = self.files.get_mut(&id) else { return };
                match f.stage {
                    Stage::Preparing => return self.violate(format!("file {id} ended before it was planned")),
                    Stage::Committing(_) => return self.violate(format!("file {id} ended twice")),
                    Stage::Receiving if f.end.is_some() => return self.violate(format!("file {id} ended twice")),
                    Stage::Receiving => f.end = Some(digest),
                }
                if f.complete() {
                    self.verify(id);
                }
            }
            ToReceiver::Abort { id, .. } => {
                if self.files.remove(&id).is_some() {
                    self.out.push_back(Action::Remove { id });
                }
            }
            ToReceiver::Finish { .. } => self.finish(),
            ToReceiver::Echo { stamp, .. } => self.out.push_back(Action::Echo { stamp }),
            ToReceiver::Dial {} => self.out.push_back(Action::Dial),
            ToReceiver::Ping {} => {}
            ToReceiver::Error { kind, message } => self.end(Action::PeerFailed { kind, message }),
        }
    }

    /// The sender has ended every file: the session ends once those in
    /// flight are settled (see [`Receive::handle`]).
    fn finish(&mut self) {
        if self.finishing {
            return self.violate("finished twice".into());
        }
        let unended = self.files.iter().find(|(_, f)| !matches!(f.stage, Stage::Committing(_)) && f.end.is_none());
        if let Some((id, _)) = unended {
            return self.violate(format!("finished before file {id} ended"));
        }
        self.finishing = true;
    }

    /// A directory's attributes, for the driver to keep until the end. A
    /// name that is refused is dropped: its files are refused on their own.
    fn dir(&mut self, meta: FileMeta) {
        if self.finishing {
            return self.violate("a directory announced after the end".into());
        }
        if !meta.is_dir() || meta.size != 0 {
            return self.violate(format!("{}: announced as a directory, with a mode or size of a file", meta.path.escape_debug()));
        }
        let taken = self.cfg.accept.as_ref().is_none_or(|accept| accept(&meta.path).is_ok());
        if !meta.path.is_empty() && crate::path::check_relative(&meta.path).is_ok() && taken {
            self.out.push_back(Action::Dir { meta });
        }
    }

    /// Whether file `id` may be announced now, and `path` taken: a
    /// choreography the sender broke ends the session, a name this end does
    /// not take fails the file alone. False if it may not.
    fn admit(&mut self, id: u64, path: &str) -> bool {
        if self.finishing {
            self.violate(format!("file {id} announced after the end"));
            return false;
        }
        if self.files.contains_key(&id) {
            self.violate(format!("file {id} announced twice"));
            return false;
        }
        if self.files.len() >= MAX_OPEN_FILES {
            self.violate(format!("more than {MAX_OPEN_FILES} files announced and not settled"));
            return false;
        }
        if let Err(e) = crate::path::check_relative(path) {
            self.refuse(id, ErrorKind::Refused, Subject::Said(path.to_string()), format!("path refused: {e}"));
            return false;
        }
        if let Some(Err(e)) = self.cfg.accept.as_ref().map(|accept| accept(path)) {
            self.refuse(id, ErrorKind::Refused, Subject::Said(path.escape_debug().to_string()), e);
            return false;
        }
        true
    }

    /// Another name of a file this transfer settled: made by the driver,
    /// confirmed at once. One naming a file this transfer did not settle,
    /// or that the sender did not say has other names, is refused.
    fn hard_link(&mut self, id: u64, path: String, first: String) {
        if !self.admit(id, &path) {
            return;
        }
        if path == first || !self.linkable.contains(&first) {
            let message = format!(
                "announced as another name of {}, which this transfer did not receive: \
                 a hard link is made only to a file the same transfer received",
                crate::path::printable(&first)
            );
            return self.refuse(id, ErrorKind::Refused, Subject::Path(path), message);
        }
        let meta = FileMeta { path: path.clone(), size: 0, mtime_s: 0, mtime_ns: 0, mode: 0, ..Default::default() };
        self.files.insert(id, File::new(meta, 0));
        if self.cfg.discard {
            return self.prepared(id, Outcome::Made);
        }
        self.out.push_back(Action::HardLink { id, path, first });
    }

    fn announce(&mut self, id: u64, meta: FileMeta, digest: Option<Sum>) {
        let linked = self.linked_next.take() == Some(id);
        if !self.admit(id, &meta.path) {
            return;
        }
        if let Err(e) = check_kind(&meta) {
            return self.refuse(id, ErrorKind::Refused, Subject::Path(meta.path), e.into());
        }
        let blocks = match file_blocks(meta.size, self.cfg.block_size) {
            Ok(b) => b,
            Err(e) => return self.refuse(id, ErrorKind::Refused, Subject::Path(meta.path), e),
        };
        let f = File { linked, ..File::new(meta, blocks) };
        if self.cfg.discard {
            self.files.insert(id, f);
            return self.plan(id, Vec::new());
        }
        self.out.push_back(Action::Prepare { id, meta: f.meta.clone(), digest });
        self.files.insert(id, f);
    }

    fn prepared(&mut self, id: u64, outcome: Outcome) {
        let Some(f) = self.files.get(&id) else { return };
        if !matches!(f.stage, Stage::Preparing) {
            return;
        }
        match outcome {
            Outcome::Receive { held } => self.plan(id, held),
            Outcome::Present => {
                let f = self.files.remove(&id).expect("looked up above");
                self.totals.add(&f.meta.path, f.meta.size, &[0; 16]);
                self.keep_name(f);
                self.out.push_back(Action::Send(ToSender::Plan { id, skip: true, ranges: vec![], passed_over: String::new() }));
            }
            Outcome::PassedOver(why) => {
                self.files.remove(&id);
                self.out.push_back(Action::Send(ToSender::Plan { id, skip: true, ranges: vec![], passed_over: why }));
            }
            Outcome::Made => {
                let f = self.files.remove(&id).expect("looked up above");
                let digest = file_digest(&[]);
                self.totals.add(&f.meta.path, 0, &digest);
                self.out.push_back(Action::Send(ToSender::Done { id, digest }));
            }
            Outcome::Refused { kind, message } => {
                let f = self.files.remove(&id).expect("looked up above");
                self.refuse(id, kind, Subject::Path(f.meta.path), message);
            }
        }
    }

    /// Opens a prepared file for its blocks and asks for those not held.
    fn plan(&mut self, id: u64, held: Vec<(u64, Sum)>) {
        let f = self.files.get_mut(&id).expect("planned files are in flight");
        f.stage = Stage::Receiving;
        for (b, s) in held {
            if b < f.blocks && f.held.insert(b, s) {
                f.journaled.push(b);
            }
        }
        let gate = Gate { size: f.meta.size, block_size: self.cfg.block_size };
        let ranges = f.held.missing(f.blocks);
        self.out.push_back(Action::Open { id, gate });
        self.out.push_back(Action::Send(ToSender::Plan { id, skip: false, ranges, passed_over: String::new() }));
    }

    fn damaged(&mut self, id: u64, block: u64) {
        let Some(f) = self.files.get_mut(&id) else { return };
        if !matches!(f.stage, Stage::Receiving) {
            return;
        }
        if block >= f.blocks {
            return self.violate(format!("block {block} of file {id} is past its end"));
        }
        let n = f.damaged.entry(block).or_insert(0);
        *n += 1;
        if *n >= MAX_DAMAGED {
            return self.fail_file(id, ErrorKind::Verify, format!("block {block} arrived damaged {MAX_DAMAGED} times"));
        }
        self.out.push_back(Action::Send(ToSender::Nack { id, block }));
    }

    fn written(&mut self, id: u64, block: u64, sum: Sum) {
        // Blocks of a file no longer here, or one already verified, are late.
        let Some(f) = self.files.get_mut(&id) else { return };
        if !matches!(f.stage, Stage::Receiving) {
            return;
        }
        if block >= f.blocks {
            return self.violate(format!("block {block} of file {id} is past its end"));
        }
        if !f.held.insert(block, sum) {
            return; // sent again (it was asked for again, or its sender resent it)
        }
        if f.complete() && f.end.is_some() {
            self.verify(id);
        }
    }

    /// Checks a complete file's digest: commits it if it matches; if not,
    /// asks again for blocks an earlier run left (once), or fails the file.
    fn verify(&mut self, id: u64) {
        let f = self.files.get_mut(&id).expect("verified files are in flight");
        let digest = file_digest(f.held.iter().map(|(_, s)| s));
        if Some(digest) == f.end {
            if self.cfg.discard {
                return self.confirm(id, digest);
            }
            f.stage = Stage::Committing(digest);
            return self.out.push_back(Action::Commit { id, digest });
        }
        if f.journaled.is_empty() {
            return self.fail_file(id, ErrorKind::Verify, "checksum mismatch".into());
        }
        // Blocks kept from an earlier run disagree with the source.
        let suspects = std::mem::take(&mut f.journaled);
        for b in &suspects {
            f.held.remove(*b);
        }
        let held = f.held.iter().map(|(b, s)| (b, *s)).collect();
        self.out.push_back(Action::Rejournal { id, held });
        for block in suspects {
            self.out.push_back(Action::Send(ToSender::Nack { id, block }));
        }
    }

    /// Counts a file as received and confirms it.
    fn confirm(&mut self, id: u64, digest: Sum) {
        let f = self.files.remove(&id).expect("confirmed files are in flight");
        self.totals.add(&f.meta.path, f.meta.size, &digest);
        self.out.push_back(Action::Send(ToSender::Done { id, digest }));
        self.out.push_back(Action::Close { id });
        self.keep_name(f);
    }

    /// Remembers the name of a settled file the sender said has other
    /// names, for `HardLink` to name (a regular file only).
    fn keep_name(&mut self, f: File) {
        if f.linked && !f.meta.is_dir() && !f.meta.is_link() {
            self.linkable.insert(f.meta.path);
        }
    }

    /// A file failed at this end: its partial state goes, and the sender is
    /// told. A full disk fails the file alone, like any other failure: the
    /// files already received stay committed, the others still in flight
    /// may fit once this one's partial file is gone, and the sender
    /// announces nothing more to a destination out of space.
    fn fail_file(&mut self, id: u64, kind: ErrorKind, message: String) {
        let f = self.files.remove(&id).expect("failed files are in flight");
        self.out.push_back(Action::Remove { id });
        self.refuse(id, kind, Subject::Path(f.meta.path), message);
    }

    /// Gives file `id` up, telling the sender why, and counts it.
    fn refuse(&mut self, id: u64, kind: ErrorKind, subject: Subject, message: String) {
        self.totals.failed = self.totals.failed.saturating_add(1);
        self.totals.out_of_space |= kind == ErrorKind::NoSpace;
        self.out.push_back(Action::Refuse { id, kind, subject, message });
    }

    fn violate(&mut self, why: String) {
        self.end(Action::Violation(why));
    }

    fn end(&mut self, last: Action) {
        self.out.push_back(last);
        self.files.clear();
        self.over = true;
    }
}

#[cfg(test)]
mod tests;
