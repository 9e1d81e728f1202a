//! Frames and messages.
//!
//! A frame is an 8-byte header — kind (u8), flags (u8: zero, but for a data
//! frame's [`DataHeader::sparse`]), reserved (u16, zero), body length (u32)
//! — then the body. All integers are big-endian. Strings are a u32 length
//! and UTF-8 bytes. A data frame's body is a 32-byte [`DataHeader`] followed
//! by the block's bytes; every other kind carries one [`Msg`]. [`Msg::encode`] cannot fail; [`decode`] returns `Ok(None)` while
//! the input is incomplete and an error for anything malformed.

use crate::auth::{ChallengeBytes, HelloKey, KeyId, ProofTag};
use crate::digest::Sum;
use crate::record::Protection;

/// First bytes of a `Hello`: protocol name and version.
pub const MAGIC: [u8; 8] = *b"DMOVER\0\x08";
pub const HEADER_LEN: usize = 8;
pub const DATA_HEADER_LEN: usize = 32;
/// Largest control message body. Big enough for a plan of 64k ranges.
pub const MAX_CONTROL_BODY: u32 = 1 << 20;
/// Largest block a data frame may carry.
pub const MAX_BLOCK: u32 = 64 << 20;

/// Most blocks one file may have. A receiver keeps the 16-byte checksum of
/// each block of a file that has arrived until the file is verified (about
/// 70 MiB once every block of a file this large has come; nothing for the
/// blocks that have not), so this bounds what one file can cost it: 4 TiB
/// files at the default 1 MiB blocks, 256 TiB at [`MAX_BLOCK`].
pub const MAX_FILE_BLOCKS: u64 = 1 << 22;

/// Most blocks one `Hole` may stand for: a receiver takes a hole's blocks
/// together, so this bounds what one message costs it.
pub const MAX_HOLE_BLOCKS: u64 = 1024;

/// The number of blocks of `block_size` bytes in a file of `size` bytes, or
/// why a receiver refuses such a file (more than [`MAX_FILE_BLOCKS`]).
pub fn file_blocks(size: u64, block_size: u64) -> Result<u64, String> {
    let blocks = size.div_ceil(block_size.max(1));
    if blocks > MAX_FILE_BLOCKS {
        return Err(format!(
            "{size} bytes make {blocks} blocks of {block_size} bytes, more than the {MAX_FILE_BLOCKS} a file may have; \
             send it with a larger --block-size (at most 64M)"
        ));
    }
    Ok(blocks)
}

/// Frame kind of a data frame.
pub const KIND_DATA: u8 = 64;
/// The flag of a data frame whose block lies partly in a hole
/// ([`DataHeader::sparse`]); a data frame with any other flag is refused.
pub const DATA_SPARSE: u8 = 1;

/// Why a frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame of kind {kind} is {len} bytes, more than the {max} allowed")]
    TooLong { kind: u8, len: u32, max: u32 },
    #[error("frame of kind {0} is truncated")]
    Truncated(u8),
    #[error("frame of kind {0} has {1} bytes left over")]
    Trailing(u8, usize),
    #[error("invalid UTF-8 in a string")]
    Utf8,
    #[error("invalid value {1} in field {0}")]
    Invalid(&'static str, u64),
    #[error("not a dmover peer (bad magic)")]
    BadMagic,
    #[error("the peer speaks dmover protocol version {0}, this end speaks version {v}: run the same dmover release at both ends", v = MAGIC[7])]
    Version(u8),
}

/// Error classes shared by both ends. The numeric value is also the exit
/// code of `dmover cp` for that class; reports (serde) spell it by
/// [`ErrorKind::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[repr(u8)]
pub enum ErrorKind {
    #[serde(rename = "internal")]
    Internal = 1,
    #[serde(rename = "usage")]
    Usage = 2,
    #[serde(rename = "not-found")]
    NotFound = 3,
    #[serde(rename = "permission-denied")]
    Permission = 4,
    #[serde(rename = "no-space")]
    NoSpace = 5,
    #[serde(rename = "unreachable")]
    Unreachable = 6,
    #[serde(rename = "auth-failed")]
    Auth = 7,
    #[serde(rename = "refused")]
    Refused = 8,
    #[serde(rename = "source-changed")]
    SourceChanged = 9,
    #[serde(rename = "verify-failed")]
    Verify = 10,
}

impl ErrorKind {
    pub fn from_u8(v: u8) -> ErrorKind {
        use ErrorKind::*;
        match v {
            2 => Usage,
            3 => NotFound,
            4 => Permission,
            5 => NoSpace,
            6 => Unreachable,
            7 => Auth,
            8 => Refused,
            9 => SourceChanged,
            10 => Verify,
            _ => Internal,
        }
    }

    /// A short name used in reports.
    pub fn name(self) -> &'static str {
        use ErrorKind::*;
        match self {
            Internal => "internal",
            Usage => "usage",
            NotFound => "not-found",
            Permission => "permission-denied",
            NoSpace => "no-space",
            Unreachable => "unreachable",
            Auth => "auth-failed",
            Refused => "refused",
            SourceChanged => "source-changed",
            Verify => "verify-failed",
        }
    }

    /// Whether retrying the same operation may succeed.
    pub fn is_transient(self) -> bool {
        matches!(self, ErrorKind::Unreachable)
    }
}

/// Per-transfer options both ends must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferOptions {
    /// Identifies the transfer across runs, so a re-run resumes it.
    pub transfer_id: [u8; 16],
    pub block_size: u32,
    pub flags: TransferFlags,
    /// Socket buffer size (SO_SNDBUF and SO_RCVBUF) for the data
    /// connections at both ends; 0 leaves the system's autotuning on.
    pub tcp_buffer: u32,
}

bitflags::bitflags! {
    /// What a transfer does besides copying files as they are. A bit
    /// this release does not know is refused when decoded.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub struct TransferFlags: u32 {
        /// Skip files whose size and mtime (or content) match at the
        /// destination: the quick check `dmover cp` and jobs make unless
        /// told `--ignore-times`.
        const SYNC = 1;
        /// With SYNC: compare content digests rather than mtimes.
        const CHECKSUM = 2;
        /// The receiver verifies and discards data (memory-to-memory benchmark).
        const DISCARD = 4;
        /// The sender generates data instead of reading files (benchmark).
        const GENERATE = 8;
        /// The sources are one file or one directory; if the destination
        /// is not an existing directory, a lone file (a path with no `/`)
        /// is written as the destination itself, as `cp a b` does.
        const DEST_MAY_BE_FILE = 16;
        /// The receiver confirms files without making them durable first
        /// (scratch space): no file-system sync before a file is confirmed.
        const NO_FSYNC = 32;
        /// The data connections carry integrity only, not confidentiality
        /// (`--no-encrypt`): a server opening them for a third-party copy
        /// asks for that protection.
        const NO_ENCRYPT = 64;
        /// Symlinks are copied as symlinks (`--links`): the sender
        /// announces each with its target; without it they are skipped.
        const LINKS = 128;
        /// Permission bits are kept whole (`--perms`): the receiver does
        /// not clear those its umask would.
        const PERMS = 256;
        /// Names that share an inode at the source share one at the
        /// destination (`--hard-links`): the sender sends the first name
        /// of each group as a file and the others as `HardLink`; a
        /// receiver refuses `HardLink` in a transfer without it.
        const HARD_LINKS = 512;
        /// Owners are kept (`--owner`): the receiver sets each file's
        /// user, where it may.
        const OWNER = 1024;
        /// Groups are kept (`--group`).
        const GROUP = 2048;
        /// Extended attributes are kept (`--xattrs`): the sender announces
        /// them, the receiver sets those its rules allow.
        const XATTRS = 4096;
        /// POSIX ACLs are kept (`--acls`), as their extended attributes.
        const ACLS = 8192;
        /// Owners and groups are kept as numbers (`--numeric-ids`), not
        /// mapped by name.
        const NUMERIC_IDS = 16384;
        /// With OWNER, GROUP, DEVICES or SPECIALS from `--archive`: a
        /// receiver that may not set owners (or make devices or specials)
        /// leaves them, rather than refusing the transfer.
        const IF_ALLOWED = 32768;
        /// Character and block devices are copied as devices (`--devices`).
        const DEVICES = 65536;
        /// FIFOs and sockets are copied as such (`--specials`).
        const SPECIALS = 131072;
        /// The sender takes each symlink inside a source as what it leads
        /// to (`--copy-links`), where its storage is not confined.
        const COPY_LINKS = 262144;
        /// The receiver passes over symlinks that lead out of the tree
        /// copied: absolute ones, and relative ones that climb above it
        /// (`--safe-links`).
        const SAFE_LINKS = 524288;
    }
}

/// Parameters of a sending side's engine, sent when a server sends for a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineParams {
    pub streams: u32,
    pub concurrency: u32,
    pub staging: u64,
    pub retries: u32,
    /// Bytes per second the sender may send in all (0: no limit).
    pub bwlimit: u64,
    /// The stream tuner the sender runs; `streams` is where it starts.
    pub tuner: TunerMode,
    /// Bytes per decision of the mi, mi+ and aimd tuners.
    pub tune_chunk: u64,
}

/// Which stream tuner a server sending for a client runs (the client's
/// `--streams` and `--tune`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TunerMode {
    /// A fixed count of streams.
    #[default]
    Fixed = 0,
    /// dmover's own tuner.
    Auto = 1,
    Mi = 2,
    MiPlus = 3,
    Aimd = 4,
}

impl TunerMode {
    fn from_u8(v: u8) -> Option<TunerMode> {
        [TunerMode::Fixed, TunerMode::Auto, TunerMode::Mi, TunerMode::MiPlus, TunerMode::Aimd].into_iter().find(|m| *m as u8 == v)
    }
}

/// What a file announcement says about the file.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FileMeta {
    /// Path relative to the transfer's destination directory.
    pub path: String,
    pub size: u64,
    pub mtime_s: i64,
    pub mtime_ns: u32,
    /// Permission bits, and [`FileMeta::DIR`] for a directory or
    /// [`FileMeta::LINK`] for a symlink.
    pub mode: u32,
    /// A symlink's target, spelled as paths are ([`crate::path`]): present
    /// exactly when the mode says symlink. It is data, never followed.
    pub target: Option<String>,
    /// Owner and group, when the transfer keeps them (`--owner`, `--group`).
    pub owner: Option<Owner>,
    /// Extended attributes, when the transfer keeps them (`--xattrs`;
    /// POSIX ACLs, `system.posix_acl_*`, with `--acls`).
    pub xattrs: Vec<Xattr>,
    /// A device's number (as `st_rdev`): character and block devices only.
    pub rdev: u64,
}

/// Who owns a file: ids, and the names they have at the sending end
/// (empty where the id has none), by which the receiver maps them to its
/// own ids unless the transfer keeps ids as numbers (`--numeric-ids`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
    pub user: String,
    pub group: String,
}

/// One extended attribute: its whole name (namespace included, as
/// `user.comment`) and value, both bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Xattr {
    pub name: Vec<u8>,
    pub value: Vec<u8>,
}

/// Most extended attributes one file may carry.
pub const MAX_XATTRS: usize = 256;
/// Longest extended attribute name (the kernel's XATTR_NAME_MAX).
pub const MAX_XATTR_NAME: usize = 255;
/// Largest extended attribute value (the kernel's XATTR_SIZE_MAX).
pub const MAX_XATTR_VALUE: usize = 64 << 10;
/// Longest user or group name.
pub const MAX_ID_NAME: usize = 256;

impl FileMeta {
    /// File type bits of a mode (as in st_mode).
    pub const TYPE: u32 = 0o170000;
    /// The type of a directory: an announced empty directory carries it.
    pub const DIR: u32 = 0o040000;
    /// The type of a symlink.
    pub const LINK: u32 = 0o120000;
    /// The type of a regular file (its mode may also carry no type).
    pub const FILE: u32 = 0o100000;
    /// The types of a FIFO, a character device, a block device, a socket.
    pub const FIFO: u32 = 0o010000;
    pub const CHAR: u32 = 0o020000;
    pub const BLOCK: u32 = 0o060000;
    pub const SOCKET: u32 = 0o140000;

    /// Whether this announces a directory rather than a file.
    pub fn is_dir(&self) -> bool {
        self.mode & Self::TYPE == Self::DIR
    }

    /// Whether this announces a symlink (its target in [`FileMeta::target`]).
    pub fn is_link(&self) -> bool {
        self.mode & Self::TYPE == Self::LINK
    }

    /// Whether this announces a device, FIFO or socket (no data; a
    /// device's number in [`FileMeta::rdev`]).
    pub fn is_special(&self) -> bool {
        [Self::FIFO, Self::CHAR, Self::BLOCK, Self::SOCKET].contains(&(self.mode & Self::TYPE))
    }

    /// Whether this announces a character or block device.
    pub fn is_device(&self) -> bool {
        [Self::CHAR, Self::BLOCK].contains(&(self.mode & Self::TYPE))
    }

    /// Whether the mode's type is one dmover knows: none (a regular
    /// file), a regular file, directory, symlink, device, FIFO or socket.
    pub fn known_type(&self) -> bool {
        [0, Self::FILE, Self::DIR, Self::LINK].contains(&(self.mode & Self::TYPE)) || self.is_special()
    }

    fn write(&self, w: &mut W) {
        w.str(&self.path);
        w.u64(self.size);
        w.i64(self.mtime_s);
        w.u32(self.mtime_ns);
        w.u32(self.mode);
        if self.is_link() {
            w.str(self.target.as_deref().unwrap_or_default());
        }
        w.u8(u8::from(self.owner.is_some()) | u8::from(!self.xattrs.is_empty()) << 1 | u8::from(self.rdev != 0) << 2);
        if let Some(o) = &self.owner {
            w.u32(o.uid);
            w.u32(o.gid);
            w.str(&o.user);
            w.str(&o.group);
        }
        if !self.xattrs.is_empty() {
            w.u32(self.xattrs.len() as u32);
            for x in &self.xattrs {
                w.blob(&x.name);
                w.blob(&x.value);
            }
        }
        if self.rdev != 0 {
            w.u64(self.rdev);
        }
    }

    fn read(r: &mut R) -> Result<FileMeta, DecodeError> {
        let mut m =
            FileMeta { path: r.str()?, size: r.u64()?, mtime_s: r.i64()?, mtime_ns: r.u32()?, mode: r.u32()?, ..Default::default() };
        if m.is_link() {
            m.target = Some(r.str()?);
        }
        let more = r.u8()?;
        if more & !7 != 0 {
            return Err(DecodeError::Invalid("file attributes", more as u64));
        }
        if more & 1 != 0 {
            m.owner = Some(Owner { uid: r.u32()?, gid: r.u32()?, user: r.str()?, group: r.str()? });
        }
        if more & 2 != 0 {
            let n = r.count(8)?;
            m.xattrs = (0..n).map(|_| Ok(Xattr { name: r.blob()?, value: r.blob()? })).collect::<Result<_, _>>()?;
        }
        if more & 4 != 0 {
            m.rdev = r.u64()?;
        }
        Ok(m)
    }
}

/// A destination host of a third-party transfer, with the ticket that
/// host issued (its secret wrapped under the session key of the connection
/// this message travels on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TicketedHost {
    pub addr: String,
    pub key_id: KeyId,
    pub wrapped_secret: [u8; 32],
}

/// One part's share of what was moved: a destination host's of a transfer,
/// a node's or host's of a job, a sink's of a stream.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Share {
    /// The host, node or sink.
    pub name: String,
    /// Files, or blocks for a stream.
    #[serde(rename = "files")]
    pub count: u64,
    pub bytes: u64,
}

/// One point of a tuned transfer's timeline: what the sender to one host
/// measured and ran at time `t_ms` after the start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TunePoint {
    pub t_ms: u64,
    /// Index of the destination host.
    pub host: u32,
    /// Data connections open.
    pub streams: u32,
    /// Reader threads (files or chunks read at once).
    pub concurrency: u32,
    /// Goodput since the previous point, bytes per second.
    pub goodput: u64,
    /// Mean control-channel round trip, microseconds.
    pub rtt_us: u64,
}

/// One block of a streamed step and where it lives: `at` is the address
/// of the destination that acknowledged it, as the producer names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepBlock {
    /// Byte offset in the step (a multiple of the block size).
    pub offset: u64,
    pub len: u32,
    pub sum: Sum,
    pub at: String,
}

/// The end of a streamed step: what it holds and where each block is.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepInfo {
    pub step: u64,
    pub bytes: u64,
    /// XXH3-128 of the block checksums in offset order (as a file digest).
    pub digest: Sum,
    /// The producer's key/value pairs for this step, in the order given.
    pub metadata: Vec<(String, String)>,
    /// Each write of the step: (offset, length).
    pub records: Vec<(u64, u64)>,
    pub blocks: Vec<StepBlock>,
    /// What befell the producer since it last told a sink (for the
    /// sinks' metrics; the step does not depend on it).
    pub events: ProducerEvents,
}

/// Spills and failovers of a producer, counted since it last reported them
/// (with a `StepEnd`, to one sink).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProducerEvents {
    /// Blocks, and their bytes, written to the producer's spill file
    /// because its memory buffer was full or no sink could take them.
    pub spilled_blocks: u64,
    pub spilled_bytes: u64,
    /// Sinks the producer gave up for dead.
    pub failovers: u64,
}

/// One file that failed, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileError {
    pub path: String,
    pub kind: ErrorKind,
    pub message: String,
}

/// File errors a transfer's report lists, at most; the rest are counted
/// (`Stats::errors_not_listed`). A tree sent to a full disk fails every
/// file left to send, and a report of a hundred paths of 4 KiB with their
/// messages still fits a control message ([`MAX_CONTROL_BODY`]).
pub const MAX_LISTED_ERRORS: usize = 100;

/// The outcome of a transfer, as one end saw it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stats {
    pub files: u64,
    pub bytes: u64,
    pub skipped_files: u64,
    pub skipped_bytes: u64,
    pub sent_bytes: u64,
    pub retries: u64,
    pub resent_blocks: u64,
    pub nanos: u64,
    pub hosts: Vec<Share>,
    pub errors: Vec<FileError>,
    /// What the sender passed over, and why: symlinks, devices, FIFOs and
    /// sockets the transfer does not copy (`--links`, `--devices`,
    /// `--specials`), and what the receiver passed over (a symlink
    /// `--safe-links` refuses, a device it may not make). Not errors: the
    /// transfer may still pass.
    pub passed_over: Vec<FileError>,
    /// File errors beyond those `errors` lists (it lists the first
    /// [`MAX_LISTED_ERRORS`]).
    pub errors_not_listed: u64,
    /// Files and bytes the destination confirmed, and whether the source's
    /// and destination's set digests agree.
    pub dest_files: u64,
    pub dest_bytes: u64,
    pub digests_match: bool,
    /// What a stream tuner measured and decided (empty without one).
    pub timeline: Vec<TunePoint>,
}

/// The kind number of each control message, written once: encoding and
/// decoding both use these.
pub mod kind {
    pub const HELLO: u8 = 1;
    pub const CHALLENGE: u8 = 2;
    pub const PROOF: u8 = 3;
    pub const WELCOME: u8 = 4;
    pub const ERROR: u8 = 5;
    pub const OPEN_CONTROL: u8 = 10;
    pub const OPEN_DATA: u8 = 11;
    pub const RECEIVE: u8 = 14;
    pub const SEND: u8 = 15;
    pub const SESSION_OPENED: u8 = 16;
    pub const GRANT: u8 = 18;
    pub const TICKET: u8 = 19;
    pub const PUSH: u8 = 20;
    pub const PROGRESS: u8 = 21;
    pub const REPORT: u8 = 22;
    pub const LIST: u8 = 23;
    pub const LISTING: u8 = 24;
    pub const RENEW: u8 = 25;
    pub const RENEWED: u8 = 26;
    pub const ANNOUNCE: u8 = 30;
    pub const PLAN: u8 = 31;
    pub const FILE_END: u8 = 32;
    pub const ABORT: u8 = 33;
    pub const NACK: u8 = 34;
    pub const DONE: u8 = 35;
    pub const FAILED: u8 = 36;
    pub const FINISH: u8 = 37;
    pub const FINISHED: u8 = 38;
    pub const PING: u8 = 39;
    pub const ECHO: u8 = 40;
    pub const STREAM_END: u8 = 41;
    pub const STREAM: u8 = 42;
    pub const ACKED: u8 = 43;
    pub const STEP_END: u8 = 44;
    pub const STEP_SAVED: u8 = 45;
    pub const IDENTIFY: u8 = 46;
    pub const IDENTITY: u8 = 47;
    pub const FETCH: u8 = 48;
    pub const DIAL: u8 = 49;
    pub const DIR: u8 = 50;
    pub const HOLE: u8 = 51;
    pub const LINKED: u8 = 52;
    pub const HARD_LINK: u8 = 53;
}

/// A control message. Comments give the direction: C client, S server,
/// Tx the sending end of a transfer, Rx the receiving end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// C→S, first frame: magic, version, which secret, what the records
    /// protect, and Noise message 1.
    Hello { key_id: KeyId, protection: Protection, hello: HelloKey },
    /// S→C: Noise message 2.
    Challenge { challenge: ChallengeBytes },
    /// C→S: the client's proof.
    Proof { proof: ProofTag },
    /// S→C: authenticated.
    Welcome,
    /// Either way: a fatal error for this connection or request.
    Error { kind: ErrorKind, message: String },
    /// C→S: this connection is a control connection.
    OpenControl,
    /// C→S: this connection is data stream `index` of `session`.
    OpenData { session: [u8; 16], index: u32 },
    /// C→S: receive files into `dest` (a directory in an export).
    Receive { dest: String, options: TransferOptions },
    /// C→S: send the files named by `sources` to this connection's client.
    Send { sources: Vec<String>, options: TransferOptions, params: EngineParams },
    /// S→C: a session began; data streams attach to it with `OpenData`.
    SessionOpened { session: [u8; 16] },
    /// C→S: issue a ticket for receiving into `dest`.
    Grant { dest: String },
    /// S→C: the ticket, valid for `lifetime` seconds unless renewed; its
    /// secret is wrapped under this connection's session key.
    Ticket { key_id: KeyId, wrapped_secret: [u8; 32], lifetime: u32 },
    /// C→S: extend a valid ticket's life (it and the session it opened).
    Renew { key_id: KeyId },
    /// S→C: the ticket is valid for `lifetime` more seconds.
    Renewed { lifetime: u32 },
    /// C→S: send `sources` from this server to `dest` on the given hosts (third party).
    Push { sources: Vec<String>, dest: String, hosts: Vec<TicketedHost>, options: TransferOptions, params: EngineParams },
    /// S→C during a push: running totals.
    Progress { files: u64, bytes: u64, total_files: u64, total_bytes: u64, walk_done: bool },
    /// S→C: the end of a push or send.
    Report { stats: Stats },
    /// Tx→Rx: a file will be sent; `digest` is set for content comparison.
    Announce { id: u64, meta: FileMeta, digest: Option<Sum> },
    /// Tx→Rx: a directory of the transfer's and its mode and mtime, which
    /// the receiver gives it once the transfer's files are in (every file
    /// that arrives moves a directory's mtime). Not a file: not counted.
    Dir { meta: FileMeta },
    /// Tx→Rx, right before file `id`'s `Announce` (hard links): the file
    /// has other names, which `HardLink` will announce once it is settled.
    Linked { id: u64 },
    /// Tx→Rx (hard links): `path` is another name of `first`, a file
    /// this transfer settled and said was `Linked`; announced as file `id`,
    /// which carries no data and is confirmed (or refused) at once.
    HardLink { id: u64, path: String, first: String },
    /// Rx→Tx: which blocks of file `id` to send (none and `skip` if
    /// present, or if the receiver passes it over: then `passed_over`
    /// says why, and the file is not at the destination).
    Plan { id: u64, skip: bool, ranges: Vec<(u64, u64)>, passed_over: String },
    /// Tx→Rx: all blocks of `id` were sent; the file's digest.
    FileEnd { id: u64, digest: Sum },
    /// Tx→Rx: file `id` will not be completed.
    Abort { id: u64, kind: ErrorKind, message: String },
    /// Rx→Tx: block `block` of file `id` arrived damaged; send it again.
    Nack { id: u64, block: u64 },
    /// Rx→Tx: file `id` is verified and in place.
    Done { id: u64, digest: Sum },
    /// Rx→Tx: file `id` failed at the receiver; `subject` names where.
    Failed { id: u64, kind: ErrorKind, subject: String, message: String },
    /// Tx→Rx: no more files; totals and the set digest of what was sent.
    Finish { files: u64, bytes: u64, set_digest: u128 },
    /// Rx→Tx: what the receiver committed.
    Finished { files: u64, bytes: u64, set_digest: u128 },
    /// Either way: keeps an idle connection alive.
    Ping,
    /// Tx→Rx on the control connection: a probe the receiver answers at
    /// once with the same `stamp`, the payload bytes it has taken off its
    /// data connections so far (`received`) and how full its staging is
    /// (`staged`, percent), and for the whole server the payload bytes taken
    /// in for all of its transfers (`server_received`) and how many
    /// transfers it is receiving (`transfers`). The sender's tuner measures
    /// round-trip time, goodput and its share of the server from the answers.
    Echo { stamp: u64, received: u64, staged: u8, server_received: u64, transfers: u32 },
    /// Tx→Rx on a data connection: nothing more comes on it (the sender
    /// dropped a stream); the receiver closes it.
    StreamEnd,
    /// Tx→Rx on the control connection, where the receiver dials the data
    /// connections (a download): open one more and attach it to this
    /// session (the sender's tuner adds a stream).
    Dial,
    /// C→S: list the files a source spec names (a path, directory or glob).
    List { path: String },
    /// S→C: some of the listing; `done` on the last batch.
    Listing { entries: Vec<FileMeta>, done: bool },
    /// C→S: open a streaming session for `producer` (a running simulation);
    /// data frames carry (step, offset in the step).
    Stream { producer: String, block_size: u32 },
    /// S→C in a streaming session: these (step, offset) blocks are written.
    Acked { blocks: Vec<(u64, u64)> },
    /// C→S in a streaming session: a step is over and every block of it is
    /// acknowledged somewhere.
    StepEnd { info: StepInfo },
    /// S→C: the step's manifest is written; `complete` if every block is here.
    StepSaved { step: u64, complete: bool },
    /// C→S in a streaming session: what is your name?
    Identify,
    /// S→C: the sink's name, as its manifests write it (`dmover sink --name`).
    Identity { name: String },
    /// C→S in a streaming session: send these (offset, length) blocks of
    /// the step back, as data frames on this connection (to gather a step
    /// that failover split to the sink that holds the rest).
    Fetch { step: u64, blocks: Vec<(u64, u32)> },
    /// Tx→Rx on a data connection: the blocks of file `id` from `offset`
    /// (a block boundary) over `len` bytes (whole blocks, the last one
    /// possibly short at the file's end) lie wholly in a hole of the
    /// source and read as zeros. It stands for their data frames, without
    /// their bytes.
    Hole { id: u64, offset: u64, len: u64 },
}

struct W<'a>(&'a mut Vec<u8>);

impl W<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v)
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_be_bytes())
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_be_bytes())
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_be_bytes())
    }
    fn u128(&mut self, v: u128) {
        self.0.extend_from_slice(&v.to_be_bytes())
    }
    fn bytes(&mut self, v: &[u8]) {
        self.0.extend_from_slice(v)
    }
    fn str(&mut self, v: &str) {
        self.blob(v.as_bytes());
    }
    /// Bytes, after their length.
    fn blob(&mut self, v: &[u8]) {
        self.u32(v.len() as u32);
        self.bytes(v);
    }
    fn strs(&mut self, v: &[String]) {
        self.u32(v.len() as u32);
        v.iter().for_each(|s| self.str(s));
    }
    fn options(&mut self, o: &TransferOptions) {
        self.bytes(&o.transfer_id);
        self.u32(o.block_size);
        self.u32(o.flags.bits());
        self.u32(o.tcp_buffer);
    }
    fn params(&mut self, p: &EngineParams) {
        self.u32(p.streams);
        self.u32(p.concurrency);
        self.u64(p.staging);
        self.u32(p.retries);
        self.u64(p.bwlimit);
        self.u8(p.tuner as u8);
        self.u64(p.tune_chunk);
    }
}

struct R<'a> {
    buf: &'a [u8],
    kind: u8,
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated(self.kind));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        Ok(self.take(N)?.try_into().expect("length checked"))
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.arr()?))
    }
    fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.arr()?))
    }
    fn u128(&mut self) -> Result<u128, DecodeError> {
        Ok(u128::from_be_bytes(self.arr()?))
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        String::from_utf8(self.blob()?).map_err(|_| DecodeError::Utf8)
    }
    fn blob(&mut self) -> Result<Vec<u8>, DecodeError> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    /// A count of items, each at least `min_item` bytes: bounded by what is left.
    fn count(&mut self, min_item: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item) > self.buf.len() {
            return Err(DecodeError::Truncated(self.kind));
        }
        Ok(n)
    }
    fn strs(&mut self) -> Result<Vec<String>, DecodeError> {
        let n = self.count(4)?;
        (0..n).map(|_| self.str()).collect()
    }
    fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::Invalid("bool", v as u64)),
        }
    }
    fn kind(&mut self) -> Result<ErrorKind, DecodeError> {
        Ok(ErrorKind::from_u8(self.u8()?))
    }
    fn flags(&mut self) -> Result<TransferFlags, DecodeError> {
        let bits = self.u32()?;
        TransferFlags::from_bits(bits).ok_or(DecodeError::Invalid("transfer flags", bits as u64))
    }
    fn options(&mut self) -> Result<TransferOptions, DecodeError> {
        Ok(TransferOptions { transfer_id: self.arr()?, block_size: self.u32()?, flags: self.flags()?, tcp_buffer: self.u32()? })
    }
    fn params(&mut self) -> Result<EngineParams, DecodeError> {
        Ok(EngineParams {
            streams: self.u32()?,
            concurrency: self.u32()?,
            staging: self.u64()?,
            retries: self.u32()?,
            bwlimit: self.u64()?,
            tuner: {
                let v = self.u8()?;
                TunerMode::from_u8(v).ok_or(DecodeError::Invalid("tuner", v as u64))?
            },
            tune_chunk: self.u64()?,
        })
    }
}

impl Msg {
    /// The frame kind of this message.
    pub fn kind(&self) -> u8 {
        use Msg::*;
        match self {
            Hello { .. } => kind::HELLO,
            Challenge { .. } => kind::CHALLENGE,
            Proof { .. } => kind::PROOF,
            Welcome => kind::WELCOME,
            Error { .. } => kind::ERROR,
            OpenControl => kind::OPEN_CONTROL,
            OpenData { .. } => kind::OPEN_DATA,
            Receive { .. } => kind::RECEIVE,
            Send { .. } => kind::SEND,
            SessionOpened { .. } => kind::SESSION_OPENED,
            Grant { .. } => kind::GRANT,
            Ticket { .. } => kind::TICKET,
            Renew { .. } => kind::RENEW,
            Renewed { .. } => kind::RENEWED,
            Push { .. } => kind::PUSH,
            Progress { .. } => kind::PROGRESS,
            Report { .. } => kind::REPORT,
            Announce { .. } => kind::ANNOUNCE,
            Dir { .. } => kind::DIR,
            Linked { .. } => kind::LINKED,
            HardLink { .. } => kind::HARD_LINK,
            Plan { .. } => kind::PLAN,
            FileEnd { .. } => kind::FILE_END,
            Abort { .. } => kind::ABORT,
            Nack { .. } => kind::NACK,
            Done { .. } => kind::DONE,
            Failed { .. } => kind::FAILED,
            Finish { .. } => kind::FINISH,
            Finished { .. } => kind::FINISHED,
            Ping => kind::PING,
            Echo { .. } => kind::ECHO,
            StreamEnd => kind::STREAM_END,
            Dial => kind::DIAL,
            List { .. } => kind::LIST,
            Listing { .. } => kind::LISTING,
            Stream { .. } => kind::STREAM,
            Acked { .. } => kind::ACKED,
            StepEnd { .. } => kind::STEP_END,
            StepSaved { .. } => kind::STEP_SAVED,
            Identify => kind::IDENTIFY,
            Identity { .. } => kind::IDENTITY,
            Fetch { .. } => kind::FETCH,
            Hole { .. } => kind::HOLE,
        }
    }

    /// Appends this message as one frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[self.kind(), 0, 0, 0, 0, 0, 0, 0]);
        let mut w = W(out);
        use Msg::*;
        match self {
            Hello { key_id, protection, hello } => {
                w.bytes(&MAGIC);
                w.bytes(key_id);
                w.u8(*protection as u8);
                w.bytes(hello);
            }
            Challenge { challenge } => w.bytes(challenge),
            Proof { proof } => w.bytes(proof),
            Welcome | OpenControl | Ping | StreamEnd | Dial | Identify => {}
            Echo { stamp, received, staged, server_received, transfers } => {
                w.u64(*stamp);
                w.u64(*received);
                w.u8(*staged);
                w.u64(*server_received);
                w.u32(*transfers);
            }
            Error { kind, message } | Abort { kind, message, .. } => {
                if let Abort { id, .. } = self {
                    w.u64(*id);
                }
                w.u8(*kind as u8);
                w.str(message);
            }
            Failed { id, kind, subject, message } => {
                w.u64(*id);
                w.u8(*kind as u8);
                w.str(subject);
                w.str(message);
            }
            OpenData { session, index } => {
                w.bytes(session);
                w.u32(*index);
            }
            Grant { dest: path } | List { path } => w.str(path),
            Listing { entries, done } => {
                w.u32(entries.len() as u32);
                for m in entries {
                    m.write(&mut w);
                }
                w.u8(*done as u8);
            }
            Stream { producer, block_size } => {
                w.str(producer);
                w.u32(*block_size);
            }
            Acked { blocks } => {
                w.u32(blocks.len() as u32);
                for (step, offset) in blocks {
                    w.u64(*step);
                    w.u64(*offset);
                }
            }
            StepEnd { info: s } => {
                w.u64(s.step);
                w.u64(s.bytes);
                w.bytes(&s.digest);
                w.u32(s.metadata.len() as u32);
                for (k, v) in &s.metadata {
                    w.str(k);
                    w.str(v);
                }
                w.u32(s.records.len() as u32);
                for (o, l) in &s.records {
                    w.u64(*o);
                    w.u64(*l);
                }
                w.u32(s.blocks.len() as u32);
                for b in &s.blocks {
                    w.u64(b.offset);
                    w.u32(b.len);
                    w.bytes(&b.sum);
                    w.str(&b.at);
                }
                w.u64(s.events.spilled_blocks);
                w.u64(s.events.spilled_bytes);
                w.u64(s.events.failovers);
            }
            StepSaved { step, complete } => {
                w.u64(*step);
                w.u8(*complete as u8);
            }
            Identity { name } => w.str(name),
            Fetch { step, blocks } => {
                w.u64(*step);
                w.u32(blocks.len() as u32);
                for (offset, len) in blocks {
                    w.u64(*offset);
                    w.u32(*len);
                }
            }
            Receive { dest, options } => {
                w.str(dest);
                w.options(options);
            }
            Send { sources, options, params } => {
                w.strs(sources);
                w.options(options);
                w.params(params);
            }
            SessionOpened { session } => w.bytes(session),
            Ticket { key_id, wrapped_secret, lifetime } => {
                w.bytes(key_id);
                w.bytes(wrapped_secret);
                w.u32(*lifetime);
            }
            Renew { key_id } => w.bytes(key_id),
            Renewed { lifetime } => w.u32(*lifetime),
            Push { sources, dest, hosts, options, params } => {
                w.strs(sources);
                w.str(dest);
                w.u32(hosts.len() as u32);
                for h in hosts {
                    w.str(&h.addr);
                    w.bytes(&h.key_id);
                    w.bytes(&h.wrapped_secret);
                }
                w.options(options);
                w.params(params);
            }
            Progress { files, bytes, total_files, total_bytes, walk_done } => {
                w.u64(*files);
                w.u64(*bytes);
                w.u64(*total_files);
                w.u64(*total_bytes);
                w.u8(*walk_done as u8);
            }
            Report { stats: s } => {
                for v in [
                    s.files,
                    s.bytes,
                    s.skipped_files,
                    s.skipped_bytes,
                    s.sent_bytes,
                    s.retries,
                    s.resent_blocks,
                    s.nanos,
                    s.dest_files,
                    s.dest_bytes,
                ] {
                    w.u64(v);
                }
                w.u8(s.digests_match as u8);
                w.u32(s.hosts.len() as u32);
                for h in &s.hosts {
                    w.str(&h.name);
                    w.u64(h.count);
                    w.u64(h.bytes);
                }
                w.u32(s.errors.len() as u32);
                for e in &s.errors {
                    w.str(&e.path);
                    w.u8(e.kind as u8);
                    w.str(&e.message);
                }
                w.u32(s.timeline.len() as u32);
                for p in &s.timeline {
                    w.u64(p.t_ms);
                    w.u32(p.host);
                    w.u32(p.streams);
                    w.u32(p.concurrency);
                    w.u64(p.goodput);
                    w.u64(p.rtt_us);
                }
                w.u32(s.passed_over.len() as u32);
                for e in &s.passed_over {
                    w.str(&e.path);
                    w.u8(e.kind as u8);
                    w.str(&e.message);
                }
                w.u64(s.errors_not_listed);
            }
            Dir { meta } => meta.write(&mut w),
            Linked { id } => w.u64(*id),
            HardLink { id, path, first } => {
                w.u64(*id);
                w.str(path);
                w.str(first);
            }
            Announce { id, meta, digest } => {
                w.u64(*id);
                meta.write(&mut w);
                match digest {
                    Some(d) => {
                        w.u8(1);
                        w.bytes(d);
                    }
                    None => w.u8(0),
                }
            }
            Plan { id, skip, ranges, passed_over } => {
                w.u64(*id);
                w.u8(*skip as u8);
                w.u32(ranges.len() as u32);
                for (a, b) in ranges {
                    w.u64(*a);
                    w.u64(*b);
                }
                w.str(passed_over);
            }
            FileEnd { id, digest } | Done { id, digest } => {
                w.u64(*id);
                w.bytes(digest);
            }
            Nack { id, block } => {
                w.u64(*id);
                w.u64(*block);
            }
            Hole { id, offset, len } => {
                w.u64(*id);
                w.u64(*offset);
                w.u64(*len);
            }
            Finish { files, bytes, set_digest } | Finished { files, bytes, set_digest } => {
                w.u64(*files);
                w.u64(*bytes);
                w.u128(*set_digest);
            }
        }
        let len = (out.len() - start - HEADER_LEN) as u32;
        out[start + 4..start + 8].copy_from_slice(&len.to_be_bytes());
    }

    fn decode_body(kind: u8, body: &[u8]) -> Result<Msg, DecodeError> {
        let mut r = R { buf: body, kind };
        use Msg::*;
        let msg = match kind {
            kind::HELLO => {
                let magic = r.arr::<8>()?;
                if magic[..7] != MAGIC[..7] {
                    return Err(DecodeError::BadMagic);
                }
                if magic[7] != MAGIC[7] {
                    return Err(DecodeError::Version(magic[7]));
                }
                let key_id = r.arr()?;
                let p = r.u8()?;
                let protection = Protection::from_u8(p).ok_or(DecodeError::Invalid("protection", p as u64))?;
                Hello { key_id, protection, hello: r.arr()? }
            }
            kind::CHALLENGE => Challenge { challenge: r.arr()? },
            kind::PROOF => Proof { proof: r.arr()? },
            kind::WELCOME => Welcome,
            kind::ERROR => Error { kind: r.kind()?, message: r.str()? },
            kind::OPEN_CONTROL => OpenControl,
            kind::OPEN_DATA => OpenData { session: r.arr()?, index: r.u32()? },
            kind::RECEIVE => Receive { dest: r.str()?, options: r.options()? },
            kind::SEND => Send { sources: r.strs()?, options: r.options()?, params: r.params()? },
            kind::SESSION_OPENED => SessionOpened { session: r.arr()? },
            kind::GRANT => Grant { dest: r.str()? },
            kind::TICKET => Ticket { key_id: r.arr()?, wrapped_secret: r.arr()?, lifetime: r.u32()? },
            kind::RENEW => Renew { key_id: r.arr()? },
            kind::RENEWED => Renewed { lifetime: r.u32()? },
            kind::PUSH => {
                let sources = r.strs()?;
                let dest = r.str()?;
                let n = r.count(4 + 16 + 32)?;
                let mut hosts = Vec::with_capacity(n);
                for _ in 0..n {
                    hosts.push(TicketedHost { addr: r.str()?, key_id: r.arr()?, wrapped_secret: r.arr()? });
                }
                Push { sources, dest, hosts, options: r.options()?, params: r.params()? }
            }
            kind::PROGRESS => {
                Progress { files: r.u64()?, bytes: r.u64()?, total_files: r.u64()?, total_bytes: r.u64()?, walk_done: r.bool()? }
            }
            kind::REPORT => {
                let mut s = Stats::default();
                for v in [
                    &mut s.files,
                    &mut s.bytes,
                    &mut s.skipped_files,
                    &mut s.skipped_bytes,
                    &mut s.sent_bytes,
                    &mut s.retries,
                    &mut s.resent_blocks,
                    &mut s.nanos,
                    &mut s.dest_files,
                    &mut s.dest_bytes,
                ] {
                    *v = r.u64()?;
                }
                s.digests_match = r.bool()?;
                let n = r.count(4 + 16)?;
                for _ in 0..n {
                    s.hosts.push(Share { name: r.str()?, count: r.u64()?, bytes: r.u64()? });
                }
                let n = r.count(4 + 1 + 4)?;
                for _ in 0..n {
                    s.errors.push(FileError { path: r.str()?, kind: r.kind()?, message: r.str()? });
                }
                let n = r.count(8 + 4 + 4 + 4 + 8 + 8)?;
                for _ in 0..n {
                    s.timeline.push(TunePoint {
                        t_ms: r.u64()?,
                        host: r.u32()?,
                        streams: r.u32()?,
                        concurrency: r.u32()?,
                        goodput: r.u64()?,
                        rtt_us: r.u64()?,
                    });
                }
                let n = r.count(4 + 1 + 4)?;
                for _ in 0..n {
                    s.passed_over.push(FileError { path: r.str()?, kind: r.kind()?, message: r.str()? });
                }
                s.errors_not_listed = r.u64()?;
                Report { stats: s }
            }
            kind::DIR => Dir { meta: FileMeta::read(&mut r)? },
            kind::LINKED => Linked { id: r.u64()? },
            kind::HARD_LINK => HardLink { id: r.u64()?, path: r.str()?, first: r.str()? },
            kind::ANNOUNCE => {
                let id = r.u64()?;
                let meta = FileMeta::read(&mut r)?;
                let digest = if r.bool()? { Some(r.arr()?) } else { None };
                Announce { id, meta, digest }
            }
            kind::PLAN => {
                let id = r.u64()?;
                let skip = r.bool()?;
                let n = r.count(16)?;
                let mut ranges = Vec::with_capacity(n);
                for _ in 0..n {
                    let (a, b) = (r.u64()?, r.u64()?);
                    if a >= b {
                        return Err(DecodeError::Invalid("block range", a));
                    }
                    ranges.push((a, b));
                }
                Plan { id, skip, ranges, passed_over: r.str()? }
            }
            kind::FILE_END => FileEnd { id: r.u64()?, digest: r.arr()? },
            kind::ABORT => Abort { id: r.u64()?, kind: r.kind()?, message: r.str()? },
            kind::NACK => Nack { id: r.u64()?, block: r.u64()? },
            kind::HOLE => Hole { id: r.u64()?, offset: r.u64()?, len: r.u64()? },
            kind::DONE => Done { id: r.u64()?, digest: r.arr()? },
            kind::FAILED => Failed { id: r.u64()?, kind: r.kind()?, subject: r.str()?, message: r.str()? },
            kind::FINISH => Finish { files: r.u64()?, bytes: r.u64()?, set_digest: r.u128()? },
            kind::FINISHED => Finished { files: r.u64()?, bytes: r.u64()?, set_digest: r.u128()? },
            kind::PING => Ping,
            kind::ECHO => Echo { stamp: r.u64()?, received: r.u64()?, staged: r.u8()?, server_received: r.u64()?, transfers: r.u32()? },
            kind::STREAM_END => StreamEnd,
            kind::DIAL => Dial,
            kind::LIST => List { path: r.str()? },
            kind::LISTING => {
                let n = r.count(4 + 8 + 8 + 4 + 4)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    entries.push(FileMeta::read(&mut r)?);
                }
                Listing { entries, done: r.bool()? }
            }
            kind::STREAM => Stream { producer: r.str()?, block_size: r.u32()? },
            kind::ACKED => {
                let n = r.count(16)?;
                let mut blocks = Vec::with_capacity(n);
                for _ in 0..n {
                    blocks.push((r.u64()?, r.u64()?));
                }
                Acked { blocks }
            }
            kind::STEP_END => {
                let mut s = StepInfo { step: r.u64()?, bytes: r.u64()?, digest: r.arr()?, ..StepInfo::default() };
                let n = r.count(8)?;
                for _ in 0..n {
                    s.metadata.push((r.str()?, r.str()?));
                }
                let n = r.count(16)?;
                for _ in 0..n {
                    s.records.push((r.u64()?, r.u64()?));
                }
                let n = r.count(8 + 4 + 16 + 4)?;
                for _ in 0..n {
                    s.blocks.push(StepBlock { offset: r.u64()?, len: r.u32()?, sum: r.arr()?, at: r.str()? });
                }
                s.events = ProducerEvents { spilled_blocks: r.u64()?, spilled_bytes: r.u64()?, failovers: r.u64()? };
                StepEnd { info: s }
            }
            kind::STEP_SAVED => StepSaved { step: r.u64()?, complete: r.bool()? },
            kind::IDENTIFY => Identify,
            kind::IDENTITY => Identity { name: r.str()? },
            kind::FETCH => {
                let step = r.u64()?;
                let n = r.count(12)?;
                let mut blocks = Vec::with_capacity(n);
                for _ in 0..n {
                    blocks.push((r.u64()?, r.u32()?));
                }
                Fetch { step, blocks }
            }
            k => return Err(DecodeError::UnknownKind(k)),
        };
        if !r.buf.is_empty() {
            return Err(DecodeError::Trailing(kind, r.buf.len()));
        }
        Ok(msg)
    }
}

/// The header of a data frame: which block of which file, and its checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    pub file: u64,
    pub offset: u64,
    pub sum: Sum,
    /// Length of the block that follows.
    pub len: u32,
    /// The block lies partly in a hole of its source: a receiver may leave
    /// its pages of zeros holes.
    pub sparse: bool,
}

impl DataHeader {
    /// The frame header and data header, ready to be followed by the block.
    pub fn encode(&self) -> [u8; HEADER_LEN + DATA_HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN + DATA_HEADER_LEN];
        b[0] = KIND_DATA;
        b[1] = if self.sparse { DATA_SPARSE } else { 0 };
        b[4..8].copy_from_slice(&(self.len + DATA_HEADER_LEN as u32).to_be_bytes());
        b[8..16].copy_from_slice(&self.file.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..40].copy_from_slice(&self.sum);
        b
    }

    /// Decodes the 32 bytes after a data frame's header `h`.
    pub fn decode(h: &Header, b: &[u8; DATA_HEADER_LEN]) -> DataHeader {
        DataHeader {
            file: u64::from_be_bytes(b[0..8].try_into().expect("8 bytes")),
            offset: u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
            sum: b[16..32].try_into().expect("16 bytes"),
            len: h.len - DATA_HEADER_LEN as u32,
            sparse: h.flags & DATA_SPARSE != 0,
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: u8,
    pub flags: u8,
    pub len: u32,
}

impl Header {
    /// Parses and bounds-checks a frame header.
    pub fn parse(b: &[u8; HEADER_LEN]) -> Result<Header, DecodeError> {
        let kind = b[0];
        let len = u32::from_be_bytes(b[4..8].try_into().expect("4 bytes"));
        let max = if kind == KIND_DATA { MAX_BLOCK + DATA_HEADER_LEN as u32 } else { MAX_CONTROL_BODY };
        if len > max {
            return Err(DecodeError::TooLong { kind, len, max });
        }
        if kind == KIND_DATA && len < DATA_HEADER_LEN as u32 {
            return Err(DecodeError::Truncated(kind));
        }
        let flags = b[1];
        if kind == KIND_DATA && flags & !DATA_SPARSE != 0 {
            return Err(DecodeError::Invalid("data frame flags", u64::from(flags)));
        }
        Ok(Header { kind, flags, len })
    }

    /// Decodes the body of a control frame.
    pub fn decode_msg(&self, body: &[u8]) -> Result<Msg, DecodeError> {
        Msg::decode_body(self.kind, body)
    }
}

/// A decoded frame from a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame<'a> {
    Msg(Msg),
    Data(DataHeader, &'a [u8]),
}

/// Decodes one frame from the front of `buf`: `Ok(None)` if more bytes are
/// needed, else the frame and how many bytes it used.
pub fn decode(buf: &[u8]) -> Result<Option<(Frame<'_>, usize)>, DecodeError> {
    let Some(h) = buf.first_chunk::<HEADER_LEN>() else { return Ok(None) };
    let h = Header::parse(h)?;
    let end = HEADER_LEN + h.len as usize;
    if buf.len() < end {
        return Ok(None);
    }
    let body = &buf[HEADER_LEN..end];
    let frame = if h.kind == KIND_DATA {
        let dh = DataHeader::decode(&h, body[..DATA_HEADER_LEN].try_into().expect("checked in parse"));
        Frame::Data(dh, &body[DATA_HEADER_LEN..])
    } else {
        Frame::Msg(h.decode_msg(body)?)
    };
    Ok(Some((frame, end)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_blocks_are_bounded() {
        assert_eq!(file_blocks(0, 1 << 20), Ok(0));
        assert_eq!(file_blocks((1 << 20) + 1, 1 << 20), Ok(2));
        assert_eq!(file_blocks(MAX_FILE_BLOCKS << 20, 1 << 20), Ok(MAX_FILE_BLOCKS));
        assert!(file_blocks((MAX_FILE_BLOCKS << 20) + 1, 1 << 20).is_err());
        assert!(file_blocks(u64::MAX, 1).is_err());
        assert!(file_blocks(u64::MAX, MAX_BLOCK as u64).is_err());
    }

    fn samples() -> Vec<Msg> {
        let meta = FileMeta { path: "d/ü.dat".into(), size: 5, mtime_s: -3, mtime_ns: 7, mode: 0o644, ..Default::default() };
        vec![
            Msg::Hello { key_id: [1; 16], protection: Protection::Authenticated, hello: [2; 48] },
            Msg::Challenge { challenge: [3; 48] },
            Msg::Proof { proof: [5; 16] },
            Msg::Welcome,
            Msg::Error { kind: ErrorKind::Refused, message: "no".into() },
            Msg::OpenControl,
            Msg::OpenData { session: [6; 16], index: 3 },
            Msg::Receive {
                dest: "x".into(),
                options: TransferOptions {
                    transfer_id: [7; 16],
                    block_size: 1 << 20,
                    flags: TransferFlags::SYNC.union(TransferFlags::CHECKSUM),
                    tcp_buffer: 65536,
                },
            },
            Msg::Send {
                sources: vec!["a".into(), "b/*.h5".into()],
                options: TransferOptions::default(),
                params: EngineParams {
                    streams: 4,
                    concurrency: 8,
                    staging: 1 << 26,
                    retries: 5,
                    bwlimit: 7,
                    tuner: TunerMode::MiPlus,
                    tune_chunk: 3 << 20,
                },
            },
            Msg::SessionOpened { session: [8; 16] },
            Msg::Grant { dest: "out".into() },
            Msg::Ticket { key_id: [9; 16], wrapped_secret: [10; 32], lifetime: 600 },
            Msg::Renew { key_id: [9; 16] },
            Msg::Renewed { lifetime: 600 },
            Msg::Push {
                sources: vec!["s".into()],
                dest: "d".into(),
                hosts: vec![TicketedHost { addr: "h:1".into(), key_id: [1; 16], wrapped_secret: [2; 32] }],
                options: TransferOptions::default(),
                params: EngineParams::default(),
            },
            Msg::Progress { files: 1, bytes: 2, total_files: 3, total_bytes: 4, walk_done: true },
            Msg::Report {
                stats: Stats {
                    files: 1,
                    hosts: vec![Share { name: "h".into(), count: 1, bytes: 2 }],
                    errors: vec![FileError { path: "p".into(), kind: ErrorKind::NoSpace, message: "m".into() }],
                    digests_match: true,
                    timeline: vec![TunePoint { t_ms: 1, host: 0, streams: 4, concurrency: 8, goodput: 1 << 30, rtt_us: 20_000 }],
                    passed_over: vec![FileError { path: "l".into(), kind: ErrorKind::Refused, message: "a symlink".into() }],
                    errors_not_listed: 7,
                    ..Stats::default()
                },
            },
            Msg::Announce { id: 11, meta: meta.clone(), digest: None },
            Msg::Announce { id: 12, meta, digest: Some([1; 16]) },
            Msg::Linked { id: 12 },
            Msg::HardLink { id: 13, path: "e/ü-too.dat".into(), first: "d/ü.dat".into() },
            Msg::Plan { id: 13, skip: false, ranges: vec![(0, 4), (9, 10)], passed_over: String::new() },
            Msg::Plan { id: 14, skip: true, ranges: vec![], passed_over: "a symlink leading out of the tree".into() },
            Msg::FileEnd { id: 14, digest: [2; 16] },
            Msg::Abort { id: 15, kind: ErrorKind::SourceChanged, message: "changed".into() },
            Msg::Nack { id: 16, block: 17 },
            Msg::Done { id: 18, digest: [3; 16] },
            Msg::Failed { id: 19, kind: ErrorKind::Permission, subject: "e/d/f".into(), message: "denied".into() },
            Msg::Finish { files: 1, bytes: 2, set_digest: u128::MAX },
            Msg::Finished { files: 1, bytes: 2, set_digest: 5 },
            Msg::Ping,
            Msg::Echo { stamp: 1 << 40, received: 3, staged: 99, server_received: 7, transfers: 2 },
            Msg::StreamEnd,
            Msg::Dial,
            Msg::Dir {
                meta: FileMeta { path: "d/e".into(), size: 0, mtime_s: 9, mtime_ns: 8, mode: FileMeta::DIR | 0o750, ..Default::default() },
            },
            Msg::List { path: "e/*.h5".into() },
            Msg::Listing {
                entries: vec![
                    FileMeta { path: "a".into(), size: 1, mtime_s: 2, mtime_ns: 3, mode: 0o100644, ..Default::default() },
                    FileMeta {
                        path: "l".into(),
                        size: 0,
                        mtime_s: 2,
                        mtime_ns: 3,
                        mode: FileMeta::LINK | 0o777,
                        target: Some("../a\\xff".into()),
                        owner: Some(Owner { uid: 1000, gid: 100, user: "ada".into(), group: String::new() }),
                        ..Default::default()
                    },
                    FileMeta { path: "null".into(), mode: FileMeta::CHAR | 0o666, rdev: 0x103, ..Default::default() },
                    FileMeta {
                        path: "x".into(),
                        mode: 0o100600,
                        xattrs: vec![
                            Xattr { name: b"user.a\xff".to_vec(), value: vec![0, 1, 2] },
                            Xattr { name: b"system.posix_acl_access".to_vec(), value: Vec::new() },
                        ],
                        ..Default::default()
                    },
                ],
                done: true,
            },
            Msg::Stream { producer: "gtc-0".into(), block_size: 1 << 20 },
            Msg::Acked { blocks: vec![(1, 0), (1, 1 << 20)] },
            Msg::StepEnd {
                info: StepInfo {
                    step: 3,
                    bytes: 5,
                    digest: [4; 16],
                    metadata: vec![("var".into(), "phi".into()), ("dims".into(), "2,3".into())],
                    records: vec![(0, 2), (2, 3)],
                    blocks: vec![StepBlock { offset: 0, len: 5, sum: [5; 16], at: "h:1".into() }],
                    events: ProducerEvents { spilled_blocks: 2, spilled_bytes: 3 << 20, failovers: u64::MAX },
                },
            },
            Msg::StepSaved { step: 3, complete: true },
            Msg::Identify,
            Msg::Identity { name: "ana-1".into() },
            Msg::Fetch { step: 4, blocks: vec![(0, 5), (1 << 20, 7)] },
            Msg::Hole { id: 20, offset: 1 << 20, len: (16 << 20) + 4096 },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for m in samples() {
            let mut buf = Vec::new();
            m.encode(&mut buf);
            let (f, used) = decode(&buf).unwrap().unwrap();
            assert_eq!(used, buf.len());
            assert_eq!(f, Frame::Msg(m.clone()));
            for cut in 0..buf.len() {
                assert!(matches!(decode(&buf[..cut]), Ok(None) | Err(_)), "{m:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn data_frame_round_trips() {
        for sparse in [false, true] {
            let h = DataHeader { file: 1, offset: 4096, sum: [7; 16], len: 3, sparse };
            let mut buf = h.encode().to_vec();
            buf.extend_from_slice(b"abc");
            let (f, used) = decode(&buf).unwrap().unwrap();
            assert_eq!(used, buf.len());
            assert_eq!(f, Frame::Data(h, b"abc"));
            buf[1] |= 2;
            assert_eq!(decode(&buf), Err(DecodeError::Invalid("data frame flags", u64::from(buf[1]))), "an unknown flag");
        }
    }

    #[test]
    fn hostile_lengths_are_refused() {
        let buf = [30u8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(decode(&buf), Err(DecodeError::TooLong { .. })));
        // A plan claiming 2^32-1 ranges in a tiny body.
        let mut buf = vec![31u8, 0, 0, 0, 0, 0, 0, 13];
        buf.extend_from_slice(&[0; 8]);
        buf.push(0);
        buf.extend_from_slice(&[0xff; 4]);
        assert_eq!(decode(&buf), Err(DecodeError::Truncated(31)));
    }

    #[test]
    fn unknown_transfer_flags_are_refused() {
        let options = TransferOptions { transfer_id: [0; 16], block_size: 1, flags: TransferFlags::all(), tcp_buffer: 9 };
        let mut buf = Vec::new();
        Msg::Receive { dest: String::new(), options }.encode(&mut buf);
        assert!(matches!(decode(&buf), Ok(Some(_))));
        // The flags are the four bytes before the socket buffer size.
        let at = buf.len() - 8;
        assert_eq!(buf[at..at + 4], TransferFlags::all().bits().to_be_bytes());
        buf[at] |= 0x80;
        assert_eq!(decode(&buf), Err(DecodeError::Invalid("transfer flags", u64::from(TransferFlags::all().bits() | 0x8000_0000))));
    }

    /// The fuzzer's seeds (`fuzz/corpus/frame_decode`) are well-formed
    /// frames of this version of the protocol, so fuzzing starts from
    /// inputs that reach deep into the decoder.
    #[test]
    fn fuzz_seed_corpus_decodes() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/frame_decode");
        let mut seeds = 0;
        for e in std::fs::read_dir(&dir).expect("the seed corpus") {
            let path = e.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            let mut rest = &bytes[..];
            while !rest.is_empty() {
                match decode(rest) {
                    Ok(Some((_, used))) => rest = &rest[used..],
                    other => panic!("{}: {other:?} with {} bytes left", path.display(), rest.len()),
                }
            }
            seeds += 1;
        }
        assert!(seeds >= 8, "only {seeds} seeds in {}", dir.display());
    }

    /// A small xorshift generator: the same frames on every run.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    /// Decoded, waiting for more bytes, refused: what became of the frames
    /// of one kind.
    #[derive(Debug, Default)]
    struct Outcomes {
        decoded: u32,
        more: u32,
        refused: u32,
    }

    /// Frames of every kind the decoder knows — each control message of
    /// [`samples`] and data frames — and of unknown kinds, with a real body
    /// (damaged or not) or random bytes, and with the body's length or a
    /// random one in the header. The decoder never panics; what it decodes
    /// is a frame of the header's kind that uses exactly the header's
    /// length and survives encoding; it refuses every unknown kind; and for
    /// every known kind, data frames included, it both decoded some frames
    /// and refused some.
    #[test]
    fn pseudo_random_frames_of_every_kind_decode_or_are_refused() {
        let mut rng = Rng(0x9e3779b97f4a7c15);
        // Well-formed bodies of each known kind.
        let mut bodies: std::collections::BTreeMap<u8, Vec<Vec<u8>>> = Default::default();
        for m in samples() {
            let mut buf = Vec::new();
            m.encode(&mut buf);
            bodies.entry(m.kind()).or_default().push(buf.split_off(HEADER_LEN));
        }
        for len in [0, 1, 100] {
            let h = DataHeader { file: rng.next(), offset: rng.next(), sum: [3; 16], len, sparse: len == 1 };
            let mut buf = h.encode().to_vec();
            buf.extend(rng.bytes(len as usize));
            bodies.entry(KIND_DATA).or_default().push(buf.split_off(HEADER_LEN));
        }
        let known: Vec<u8> = bodies.keys().copied().collect();
        let mut outcomes: std::collections::BTreeMap<u8, Outcomes> = Default::default();

        for _ in 0..20000 {
            let kind = if rng.below(8) == 0 { rng.next() as u8 } else { known[rng.below(known.len())] };
            let mut body = match bodies.get(&kind) {
                Some(b) if rng.below(3) > 0 => b[rng.below(b.len())].clone(),
                _ => {
                    let n = rng.below(80);
                    rng.bytes(n)
                }
            };
            // Damage: a byte changed, the body cut short, or a byte too many.
            for _ in 0..rng.below(4) {
                match rng.below(3) {
                    0 if !body.is_empty() => {
                        let at = rng.below(body.len());
                        body[at] = rng.next() as u8;
                    }
                    1 => body.truncate(rng.below(body.len() + 1)),
                    _ => body.push(rng.next() as u8),
                }
            }
            let len = match rng.below(10) {
                0 => rng.next() as u32,
                1 => rng.next() as u32 % (MAX_CONTROL_BODY + 2),
                _ => body.len() as u32,
            };
            let mut buf = vec![kind, 0, 0, 0];
            buf.extend_from_slice(&len.to_be_bytes());
            buf.extend_from_slice(&body);
            // Now and then the start of a next frame follows.
            let next = rng.below(4) * rng.below(2);
            buf.extend(rng.bytes(next));

            let o = outcomes.entry(kind).or_default();
            match decode(&buf) {
                Ok(Some((frame, used))) => {
                    o.decoded += 1;
                    assert_eq!(used, HEADER_LEN + len as usize, "kind {kind}: {buf:?}");
                    match frame {
                        Frame::Msg(m) => {
                            assert_eq!(m.kind(), kind, "{m:?} decoded from a frame of kind {kind}");
                            let mut again = Vec::new();
                            m.encode(&mut again);
                            assert_eq!(decode(&again), Ok(Some((Frame::Msg(m.clone()), again.len()))), "{m:?} does not survive encoding");
                        }
                        Frame::Data(h, block) => {
                            assert_eq!(kind, KIND_DATA, "a data frame decoded from a frame of kind {kind}");
                            assert_eq!(h.len as usize, block.len(), "{h:?}");
                            let mut again = h.encode().to_vec();
                            again.extend_from_slice(block);
                            assert_eq!(again[HEADER_LEN..], buf[HEADER_LEN..used], "{h:?} does not survive encoding");
                        }
                    }
                }
                Ok(None) => {
                    o.more += 1;
                    assert!(buf.len() < HEADER_LEN + len as usize, "kind {kind}: asks for more than the {len} bytes of body: {buf:?}");
                }
                Err(_) => o.refused += 1,
            }
            if !known.contains(&kind) {
                assert!(
                    matches!(decode(&buf), Ok(None) | Err(DecodeError::UnknownKind(_) | DecodeError::TooLong { .. })),
                    "unknown kind {kind}: {:?}",
                    decode(&buf)
                );
            }
        }

        let table: String = outcomes.iter().map(|(k, o)| format!("\n  kind {k:3}: {o:?}")).collect();
        for k in &known {
            let o = outcomes.get(k);
            assert!(o.is_some_and(|o| o.decoded > 0 && o.refused > 0), "frames of kind {k} were not both decoded and refused:{table}");
        }
        let unknown: u32 = outcomes.iter().filter(|(k, _)| !known.contains(k)).map(|(_, o)| o.decoded + o.more + o.refused).sum();
        assert!(unknown >= 1000, "only {unknown} frames of unknown kinds:{table}");
    }
}
