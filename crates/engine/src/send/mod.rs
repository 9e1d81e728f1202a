//! The sending end of a transfer.
//!
//! The protocol's rules and the state of every file announced and not yet
//! settled live in a sans-I/O session (`dmover_proto::session::send`):
//! which host a file goes to and the announcement window, the plan each
//! file got, re-requests and their budget, digests, outcomes and totals.
//! This module runs it:
//!
//! * [`driver`]: one owner thread holds the session and the control
//!   connections' writing halves, and is fed by one event channel (control
//!   messages, chunks read, failures, probes); it takes the next walked
//!   file only when the session has room for it. It carries out the
//!   session's decisions: messages to the receivers, chunks to read, files
//!   settled (reported to the caller's hook and the progress counters).
//! * [`workers`]: the I/O, which reports back to the owner as events. The
//!   walker lists the sources (or takes the files the caller feeds,
//!   [`Files::Feed`]) and, with `--checksum`, computes each file's digest;
//!   `concurrency` reader threads read chunks of up to [`CHUNK_BLOCKS`]
//!   blocks into staging blocks, checksum each block and queue it for its
//!   host (several readers can read chunks of one large file at once); a
//!   host's queue holds at most [`AHEAD_PER_STREAM`] blocks per stream, so
//!   the few blocks in use are reused while still in the CPU's cache; one
//!   thread per data connection writes queued blocks to the network (any
//!   block can take any stream, so a large file is striped over all of
//!   them and small files share them); and a thread per control
//!   connection reads the receiver's messages for the owner.
//!
//! Up to [`WINDOW`] files per host are announced ahead of what is settled,
//! so thousands of small files cost no round trip each, only one pipelined
//! announcement. A source that changes while it is read is abandoned and
//! reported, never committed.
//!
//! With a tuner ([`crate::tuning`]) and a way to get connections
//! ([`MoreStreams`]: open them, or ask the receiver to dial them), the set
//! of data streams changes during the transfer: a new stream joins the
//! host's queue, a dropped one finishes its block and says `StreamEnd`.

mod driver;
mod workers;

use crate::error::Result;
use crate::progress::Progress;
use crate::source::Entry;
use crate::storage::Store;
use crate::transport::{Connector, Transport};
use crossbeam_channel::Receiver;
use dmover_proto::frame::{FileError, FileMeta, Stats, TransferOptions};
use std::sync::Arc;
use std::time::Duration;

/// Files announced to one host and not yet settled. Bounds the sender's
/// bookkeeping and the receiver's open state, while keeping enough
/// announcements ahead to hide the round trip.
pub const WINDOW: usize = 1024;
/// Blocks per read job: a large file is read by several readers at once in
/// chunks of this many blocks. A chunk's blocks that lie in a hole go as
/// one `Hole`, which may stand for no more than `MAX_HOLE_BLOCKS`.
pub const CHUNK_BLOCKS: u64 = 16;
const _: () = assert!(CHUNK_BLOCKS <= dmover_proto::frame::MAX_HOLE_BLOCKS);
/// Blocks a host's queue may hold per open stream before readers wait:
/// enough that a stream finds its next block waiting, few enough that the
/// staging blocks in use are reused while still in the CPU's cache.
const AHEAD_PER_STREAM: usize = 2;
/// Entries the walker may list ahead of the owner announcing them.
const WALK_AHEAD: usize = 4096;
/// How long the control connections are still read after a data
/// connection was lost, for the receiver's reason.
const REASON_WAIT: Duration = Duration::from_secs(2);
/// How often idle threads look at the stop flag.
const POLL: Duration = Duration::from_millis(50);

/// Makes one stream tuner (one per destination host).
pub type TunerFactory = Arc<dyn Fn() -> Box<dyn dmover_tune::Tuner> + Send + Sync>;

/// How a sender gets another data connection to a host while sending.
#[derive(Clone)]
pub enum MoreStreams {
    /// It opens one itself (an upload, a push, a local copy).
    Connect(Connector),
    /// It asks the receiver with `Dial`, and the connection the receiver
    /// dials arrives here (a server sending for a client: a download).
    Ask(Receiver<Box<dyn Transport>>),
}

/// How long a stream asked of the receiver may take to attach: a few
/// round trips (connect, authenticate, attach), on a slow link.
pub const DIAL_WAIT: Duration = Duration::from_secs(10);

/// How long a data connection still attaching when the transfer starts
/// may take to arrive (see [`Attaching`]).
pub const ATTACH_WAIT: Duration = Duration::from_secs(30);

/// One destination: its control connection and data connections,
/// authenticated and attached to a receiving session (or on their way).
pub struct HostLink {
    pub name: String,
    pub control: Box<dyn Transport>,
    /// Data connections attached.
    pub data: Vec<Box<dyn Transport>>,
    /// Data connections still attaching: the transfer starts without them.
    pub attaching: Option<Attaching>,
    /// How to get more data connections while sending (None: the set is fixed).
    pub more: Option<MoreStreams>,
}

/// Data connections that attach while the transfer starts, so that the
/// first announcements and plans cross while they are set up: `count` of
/// them arrive on `conns` (an error instead ends the transfer), each within
/// [`ATTACH_WAIT`]. Blocks read meanwhile wait in the host's queue.
pub struct Attaching {
    pub count: usize,
    pub conns: Receiver<Result<Box<dyn Transport>>>,
}

/// How a file was settled.
#[derive(Debug, Clone, Copy)]
pub enum Settled<'a> {
    /// Sent and verified at the destination.
    Sent,
    /// Already complete at the destination (sync, or a resumed transfer).
    Skipped,
    /// Not taken by the receiver, by the transfer's rules (a symlink
    /// leading out of the tree with `--safe-links`): not at the
    /// destination, and not an error.
    PassedOver(&'a FileError),
    Failed(&'a FileError),
}

/// Hears of each file once it is settled: its attributes (the name is its
/// destination name), the index of the host it went to, and the outcome.
/// Called from the sending end's owner thread; keep it short.
pub type SettleHook = Arc<dyn Fn(&FileMeta, usize, Settled<'_>) + Send + Sync>;

/// A file fed to a transfer, and the host it must go to (an index into
/// the links; None: the next host with room, round-robin). A caller that
/// may send a file again pins it, so that every attempt lands in the same
/// place (and resumes there).
pub struct FedFile {
    pub entry: Entry,
    pub host: Option<usize>,
}

/// What to send.
pub enum Files {
    /// Files found by walking `specs` under `root`.
    Walk { store: Store, specs: Vec<String> },
    /// Files of `store` the caller hands over while the transfer runs; the
    /// transfer ends once the channel is closed and every file is settled.
    /// `settled` hears of each file's outcome, so the caller can hand out
    /// more work or give a failed file to someone else.
    Feed { store: Store, entries: Receiver<FedFile>, settled: SettleHook },
    /// One file of `size` bytes made up in memory (benchmarks).
    Generate { name: String, size: u64 },
}

/// Sends the files to the hosts and returns the outcome once every host has
/// confirmed the end of the transfer.
pub fn send(files: Files, links: Vec<HostLink>, cfg: SendConfig) -> Result<Stats> {
    driver::run(files, links, cfg)
}

pub struct SendConfig {
    pub options: TransferOptions,
    /// Reader threads: files (or chunks of a large file) read at once.
    pub concurrency: usize,
    /// Staging memory shared by all streams of this transfer.
    pub staging: u64,
    pub idle_timeout: Duration,
    pub progress: Arc<Progress>,
    /// Bytes per second for all streams together (0: no limit).
    pub bwlimit: u64,
    /// Makes a tuner for the streams of each host that has a connector.
    pub tuner: Option<TunerFactory>,
}

/// Fills `b` with incompressible bytes from a xorshift generator whose
/// state is `x` (benchmark data: fast, not cryptographic).
pub fn fill_random(x: &mut u64, b: &mut [u8]) {
    for c in b.chunks_mut(8) {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
}

/// Fill for generated blocks: each block gets its own sequence.
fn fill_block(b: &mut [u8]) {
    fill_random(&mut (0x2545_f491_4f6c_dd1d ^ b.as_ptr() as u64), b);
}
