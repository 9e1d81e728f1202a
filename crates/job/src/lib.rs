//! Queue-oriented transfers: a transfer described in a job file, run as a
//! batch job by a process manager that keeps transfer agents busy on every
//! node of the allocation.
//!
//! The design follows DMOVER's trio — batch script, process manager,
//! transfer agent — on Slurm:
//!
//! * [`jobfile`] — the job file (TOML) and the checks made before anything
//!   runs or is submitted;
//! * [`sbatch`] — the batch script `dmover submit` renders and submits;
//! * [`manager`] — `dmover run`: streams the file list from the engine's
//!   walker (over a directory, or the objects below a key prefix of an S3
//!   bucket), hands files to long-lived agents in batches, re-queues a failed
//!   file or a lost agent's files to other agents, stops at a checkpoint
//!   before the allocation's time runs out (and may resubmit the job), and
//!   keeps the state directory up to date;
//! * [`agent`] — a transfer agent: pulls files from the manager and sends
//!   them with the engine to the destination hosts the manager chose, reporting
//!   each file's outcome;
//! * [`command`] — the external transfer agent: a command such as `cp`,
//!   `rsync` or `globus-url-copy` run per file;
//! * [`channel`] — the authenticated manager–agent connection;
//! * [`state`] — the state directory: progress, done list, final report;
//! * [`page`] — the job's status page and Prometheus metrics, read from
//!   the state directory.
//!
//! Inside a Slurm allocation the agents are one `srun` step (one agent per
//! task); without one they run as threads of `dmover run` itself. Nothing
//! here talks to the scheduler except through its commands (`sbatch`,
//! `srun`); nothing here moves bytes except through the engine.

pub mod agent;
pub mod channel;
pub mod command;
pub mod jobfile;
pub mod manager;
pub mod page;
pub mod sbatch;
pub mod state;

pub use jobfile::JobFile;

use dmover_engine::session::Credential;
use dmover_engine::storage::Store;
use dmover_proto::frame::{TransferFlags, TransferOptions};
use std::path::PathBuf;

/// A job resolved and checked: what the manager and agents act on.
#[derive(Clone)]
pub struct Plan {
    /// The job file (absolute), for messages and for the agents' command line.
    pub job: PathBuf,
    /// Where progress, the done list and the report go.
    pub state_dir: PathBuf,
    /// Where the sources are read: the file system, or an S3 bucket.
    pub source: Store,
    /// The source root in `source`: a canonical directory, or a key prefix
    /// (empty for the whole bucket).
    pub source_root: PathBuf,
    pub sources: Vec<String>,
    /// Each destination host as the job file names it (`host:port` of a
    /// server, or a host reached over ssh, or for a command agent the hosts
    /// as written): how reports name it.
    pub hosts: Vec<String>,
    /// `EXPORT/path` on the destination servers (for a command agent: the
    /// root of `{dst}`).
    pub dest: String,
    /// The address of each destination host's server, in the order of
    /// `hosts`, with how to authenticate there (empty for a command agent,
    /// and until the remote ends of hosts reached over ssh are started).
    pub creds: Vec<(String, Credential)>,
    pub streams: u32,
    pub concurrency: u32,
    pub block_size: u64,
    pub staging: u64,
    pub bwlimit: u64,
    /// Send every file, also those already at the destination (else the
    /// quick check skips those of the same size and mtime).
    pub ignore_times: bool,
    /// Compare content, not size and mtime, to skip a file.
    pub checksum: bool,
    /// Agents that may try a file before it is reported failed.
    pub attempts: u32,
    /// Agents to run without Slurm (the job file's tasks per node).
    pub local_agents: u32,
    /// The external agent's command; None for the native agent.
    pub command: Option<jobfile::AgentCommand>,
    /// Seconds before the allocation's end to stop at a checkpoint (None:
    /// a tenth of the time left at the start, between 30 s and 10 minutes).
    pub checkpoint_before: Option<u64>,
    /// Submit the job again after a checkpoint.
    pub resubmit: bool,
}

impl Plan {
    /// The engine's transfer options for one agent session.
    pub fn options(&self, transfer_id: [u8; 16]) -> TransferOptions {
        let mut flags = TransferFlags::empty();
        if !self.ignore_times {
            flags |= TransferFlags::SYNC;
        }
        if self.checksum {
            flags |= TransferFlags::CHECKSUM;
        }
        TransferOptions { transfer_id, block_size: self.block_size as u32, flags, tcp_buffer: 0 }
    }
}

/// This machine's name (the node's, inside an allocation).
pub fn hostname() -> String {
    if let Ok(n) = std::env::var("SLURMD_NODENAME") {
        if !n.is_empty() {
            return n;
        }
    }
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is valid for writes of its length; the name is NUL-terminated or truncated.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}
