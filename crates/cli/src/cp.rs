//! `dmover cp`: plans a copy from the command line and runs it in the right
//! direction — local to local, upload, download, or third party — with
//! automatic retries, a live progress display and a final report.

use crate::location::{self, Hosts, Location, S3Args};
use crate::report::{self, ProgressDisplay};
use crate::sizes::parse_size;
use crate::ssh::SshOptions;
use crate::streams::StreamArgs;
use crate::TokenArgs;
use clap::Args;
use dmover_engine::progress::Progress;
use dmover_engine::recv::{self, RecvConfig};
use dmover_engine::retry::with_retries;
use dmover_engine::send::{self, Files, HostLink, MoreStreams, SendConfig};
use dmover_engine::session;
use dmover_engine::storage::{self, s3, Store};
use dmover_engine::transport::{memory, Connector, Transport};
use dmover_engine::{Error, Result};
use dmover_proto::frame::{EngineParams, Stats, TransferFlags, TransferOptions};
use dmover_proto::path::printable;
use dmover_proto::ErrorKind;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Idle timeout of the client's own connections.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Disk writer threads when the client receives.
const WRITERS: usize = 2;

#[derive(Args, Clone)]
pub struct CpArgs {
    /// Sources (files, directories, globs) then the destination.
    #[arg(required = true, value_name = "SRC... DEST")]
    pub paths: Vec<String>,
    #[command(flatten)]
    pub net: StreamArgs,
    /// Files (or chunks of large files) read and sent at once.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub concurrency: u32,
    /// Size of a block (the unit of sending and checksumming).
    #[arg(long, default_value = "1M", value_parser = parse_block_size)]
    pub block_size: u64,
    /// Staging memory per transfer, shared by its streams.
    #[arg(long, default_value = "64M", value_parser = parse_staging)]
    pub staging: u64,
    /// Send every file, also those whose size and modification time match
    /// at the destination (rsync's and rclone's --ignore-times).
    #[arg(short = 'I', long, conflicts_with_all = ["sync", "checksum"])]
    pub ignore_times: bool,
    /// Skip files whose size and modification time match at the
    /// destination: what a copy does without --ignore-times (kept for
    /// scripts that name it).
    #[arg(long)]
    pub sync: bool,
    /// Copy symlinks as symlinks, their targets as they are (without it,
    /// symlinks inside a directory are skipped with a warning).
    #[arg(short = 'l', long)]
    pub links: bool,
    /// Keep hard links: names that share a file at the source share one
    /// at the destination, its data sent once (without it, each name
    /// arrives as a copy of its own). Not part of -a, as in rsync.
    #[arg(short = 'H', long)]
    pub hard_links: bool,
    /// Keep permission bits whole (without it, the receiving end's umask
    /// clears bits from them, as for new files). rsync's `-p`; here `-p`
    /// is `--streams`, as in globus-url-copy.
    #[arg(long)]
    pub perms: bool,
    /// Copy what each symlink inside a source leads to, as rsync's -L
    /// (local sources only: a server never follows one in an export).
    #[arg(short = 'L', long)]
    pub copy_links: bool,
    /// Pass over symlinks that lead out of the tree copied: absolute ones
    /// and relative ones that climb above it (checked where they arrive).
    #[arg(long)]
    pub safe_links: bool,
    /// Keep each file's owner (where the receiving end may set it: as root
    /// locally; at a server, in an export that allows it).
    #[arg(short = 'o', long)]
    pub owner: bool,
    /// Keep each file's group (locally, one the receiving user is in).
    #[arg(short = 'g', long)]
    pub group: bool,
    /// Keep owners and groups as numbers, rather than mapping them by name.
    #[arg(long)]
    pub numeric_ids: bool,
    /// Keep extended attributes (user.*; trusted.* and security.* where
    /// the receiving end may set them).
    #[arg(short = 'X', long)]
    pub xattrs: bool,
    /// Keep POSIX ACLs (access and default); implies --perms.
    #[arg(short = 'A', long)]
    pub acls: bool,
    /// Copy character and block devices as devices (made as root only).
    #[arg(long)]
    pub devices: bool,
    /// Copy FIFOs and sockets as such.
    #[arg(long)]
    pub specials: bool,
    /// --devices --specials.
    #[arg(short = 'D')]
    pub devices_and_specials: bool,
    /// Archive: `--links --perms --owner --group --devices --specials`, as
    /// `rsync -a` (times are always kept), owners, groups, devices and
    /// specials only where the receiving end may set or make them.
    #[arg(short = 'a', long)]
    pub archive: bool,
    /// Skip files whose content matches at the destination (compared by
    /// checksums of both ends), instead of those whose size and
    /// modification time match.
    #[arg(short = 'c', long)]
    pub checksum: bool,
    /// Confirm files without making them durable first (scratch space):
    /// faster for many small files, but a crash of the destination's machine
    /// can lose files the report counted.
    #[arg(long)]
    pub no_fsync: bool,
    /// Limit the sending rate, in bytes per second (e.g. 10M).
    #[arg(long, value_name = "RATE", default_value = "0", value_parser = parse_size)]
    pub bwlimit: u64,
    /// Retries after a transient network error.
    #[arg(long, default_value_t = 5)]
    pub retries: u32,
    /// Print a JSON report on stdout at the end.
    #[arg(long)]
    pub json: bool,
    /// No progress display.
    #[arg(short, long)]
    pub quiet: bool,
    #[command(flatten)]
    pub token: TokenArgs,
    #[command(flatten)]
    pub ssh: SshOptions,
    #[command(flatten)]
    pub s3: S3Args,
}

pub fn parse_block_size(s: &str) -> std::result::Result<u64, String> {
    let v = parse_size(s)?;
    if !(4096..=(64 << 20)).contains(&v) {
        return Err("block size must be between 4K and 64M".into());
    }
    Ok(v)
}

pub fn parse_staging(s: &str) -> std::result::Result<u64, String> {
    let v = parse_size(s)?;
    if !((1 << 20)..=(1 << 40)).contains(&v) {
        return Err("staging must be between 1M and 1T".into());
    }
    Ok(v)
}

/// A copy, planned.
struct Plan {
    sources: Vec<Location>,
    dest: Location,
    options: TransferOptions,
    params: EngineParams,
    /// How to reach and authenticate with each server (the remote ends of
    /// ssh locations run while this lives).
    hosts: Hosts,
    /// The destination path to give the receiver (a directory, or maybe a file: DEST_MAY_BE_FILE).
    dest_path: String,
    /// Where the sources are read and the destination written when this
    /// process does it: the local file system, or an S3 bucket.
    src_store: Store,
    dest_store: Store,
}

pub fn run(a: CpArgs) -> Result<i32> {
    let result = copy(&a);
    // Any fatal error, planning included, gets the JSON failure report.
    if let (Err(e), true) = (&result, a.json) {
        outln!("{}", report::failure_json(e));
    }
    result
}

/// Plans and runs the copy; prints the report of a copy that ran.
fn copy(a: &CpArgs) -> Result<i32> {
    if let [only] = a.paths.as_slice() {
        return Err(Error::new(ErrorKind::Usage, only, "a copy needs a source and a destination, and this is the only path given")
            .advised("name one or more sources, then the destination: dmover cp SRC... DEST"));
    }
    let started = Instant::now();
    let plan = make_plan(a)?;
    let progress = Arc::new(Progress::default());
    let display = ProgressDisplay::start(progress.clone(), !a.quiet, report::skip_reason(plan.options.flags));
    let src_remote = plan.sources[0].is_remote();
    let result = match (src_remote, plan.dest.is_remote()) {
        (false, false) => local_to_local(&plan, a, &progress),
        (false, true) => upload(&plan, a, &progress),
        (true, false) => download(&plan, a, &progress),
        (true, true) => third_party(&plan, a, &progress),
    };
    display.finish();
    let mut stats = result?;
    stats.nanos = started.elapsed().as_nanos() as u64;
    let r = report::Report::from_stats(&stats, plan.options.flags);
    if a.json {
        outln!("{}", r.to_json());
    } else if !a.quiet {
        errln!("{}", r.summary());
    }
    for e in &stats.errors {
        errln!("dmover: error: {}: {}", printable(&e.path), printable(&e.message));
    }
    if stats.errors_not_listed > 0 {
        errln!("dmover: error: {} more files failed (the report lists the first {})", stats.errors_not_listed, stats.errors.len());
    }
    if stats.errors.iter().any(|e| e.kind == ErrorKind::NoSpace) {
        errln!("dmover: the destination ran out of space: the files committed are kept; free space there, then re-run the same command to send the rest");
    }
    Ok(r.exit_code())
}

fn make_plan(a: &CpArgs) -> Result<Plan> {
    let (dest, sources) = a.paths.split_last().expect("clap requires two paths");
    let mut all = sources.iter().chain([dest]).map(|s| Location::parse(s)).collect::<Result<Vec<_>>>()?;
    let hosts = location::resolve(&mut all, &a.ssh, &a.token)?;
    let dest = all.pop().expect("a destination");
    let sources = all;
    if let Some(Location::Remote { hosts, .. }) = sources.first() {
        if hosts.len() > 1 {
            return Err(Error::new(ErrorKind::Usage, sources[0].path(), "a source names one host; several hosts are for destinations"));
        }
    }
    if sources.windows(2).any(|w| !same_host(&w[0], &w[1])) {
        return Err(Error::new(
            ErrorKind::Usage,
            "",
            "all sources must be on one host (all local, all on the same server, or all in one bucket)",
        ));
    }
    let store = |l: &Location, fetch_listed: bool| match l {
        Location::S3 { bucket, .. } => {
            a.s3.open_with(bucket, &s3::Options { fetch_listed, ..a.s3.options(s3::default_state_dir(bucket), a.staging) })
        }
        _ => Ok(storage::local()),
    };
    let dest_store = store(&dest, false)?;
    let dest_path = dest.path().trim_end_matches('/').to_string();
    // A bucket copied from whole (no glob) has its small objects fetched
    // as it is listed, when they are all to be read: every file is sent
    // (--ignore-times), or the destination holds nothing yet. A server's
    // destination is not asked: its first copy is the one kept fast (a
    // re-run's listing stops fetching once what it fetched goes unread).
    let globbed = sources.iter().any(|s| s.path().split('/').any(dmover_engine::source::is_glob));
    let read_all = matches!(sources[0], Location::S3 { .. })
        && !globbed
        && (a.ignore_times || dest.is_remote() || dest_store.is_empty_dir(Path::new(&dest_path)).unwrap_or(false));
    let src_store = store(&sources[0], read_all)?;
    let mut flags = TransferFlags::empty();
    // The quick check, as rsync and rclone make it: a file already at the
    // destination with the same size and mtime (or content, -c) is not sent.
    if !a.ignore_times {
        flags |= TransferFlags::SYNC;
    }
    if a.checksum {
        flags |= TransferFlags::CHECKSUM;
    }
    if a.no_fsync {
        flags |= TransferFlags::NO_FSYNC;
    }
    if a.links || a.archive {
        flags |= TransferFlags::LINKS;
    }
    if a.perms || a.archive || a.acls {
        flags |= TransferFlags::PERMS;
    }
    for (asked, flag) in [
        (a.owner, TransferFlags::OWNER),
        (a.group, TransferFlags::GROUP),
        (a.numeric_ids, TransferFlags::NUMERIC_IDS),
        (a.xattrs, TransferFlags::XATTRS),
        (a.acls, TransferFlags::ACLS),
        (a.copy_links, TransferFlags::COPY_LINKS),
        (a.safe_links, TransferFlags::SAFE_LINKS),
        (a.devices || a.devices_and_specials, TransferFlags::DEVICES),
        (a.specials || a.devices_and_specials, TransferFlags::SPECIALS),
        (a.hard_links, TransferFlags::HARD_LINKS),
    ] {
        flags.set(flag, asked);
    }
    if a.archive {
        // Kept where the receiving end may set or make them, unless asked for by name.
        let named = TransferFlags::OWNER | TransferFlags::GROUP | TransferFlags::DEVICES | TransferFlags::SPECIALS;
        flags.set(TransferFlags::IF_ALLOWED, !flags.intersects(named));
        flags |= named;
    }
    if a.net.no_encrypt {
        flags |= TransferFlags::NO_ENCRYPT;
    }
    let mut plan = Plan {
        options: TransferOptions {
            transfer_id: transfer_id(&a.paths, a.block_size),
            block_size: a.block_size as u32,
            flags,
            tcp_buffer: a.net.socket()?.buffer,
        },
        params: a.net.params(EngineParams {
            concurrency: a.concurrency,
            staging: a.staging,
            retries: a.retries,
            bwlimit: a.bwlimit,
            ..EngineParams::default()
        }),
        dest_path,
        sources,
        dest,
        hosts,
        src_store,
        dest_store,
    };
    if may_be_file_to_file(&plan) {
        plan.options.flags |= TransferFlags::DEST_MAY_BE_FILE;
    }
    Ok(plan)
}

fn same_host(a: &Location, b: &Location) -> bool {
    match (a, b) {
        (Location::Local(_), Location::Local(_)) => true,
        (Location::Remote { hosts: x, .. }, Location::Remote { hosts: y, .. }) => x == y,
        (Location::S3 { bucket: x, .. }, Location::S3 { bucket: y, .. }) => x == y,
        _ => false,
    }
}

/// Identifies this copy, so that re-running the same command resumes it.
fn transfer_id(paths: &[String], block_size: u64) -> [u8; 16] {
    let mut s = paths.join("\0");
    s.push_str(&format!("\0{block_size}"));
    if let Ok(cwd) = std::env::current_dir() {
        s.push_str(&format!("\0{}", cwd.display()));
    }
    dmover_proto::digest::block_sum(s.as_bytes())
}

/// One source that may be a single file, and a destination that does not
/// say it is a directory: the receiver writes a lone file as DEST itself
/// unless DEST is an existing directory.
fn may_be_file_to_file(p: &Plan) -> bool {
    let [src] = p.sources.as_slice() else { return false };
    let sp = src.path();
    !(sp.ends_with('/') || sp.contains(['*', '?', '[', '{']) || p.dest.path().ends_with('/'))
}

fn specs(p: &Plan) -> Vec<String> {
    p.sources.iter().map(|s| s.path().to_string()).collect()
}

fn send_config(p: &Plan, progress: &Arc<Progress>, tuner: Option<send::TunerFactory>) -> SendConfig {
    SendConfig {
        options: p.options,
        concurrency: p.params.concurrency as usize,
        staging: p.params.staging,
        idle_timeout: IDLE_TIMEOUT,
        progress: progress.clone(),
        bwlimit: p.params.bwlimit,
        tuner,
    }
}

fn recv_config(p: &Plan) -> RecvConfig {
    RecvConfig {
        store: p.dest_store.clone(),
        dest: p.dest_path.clone(),
        options: p.options,
        staging: p.params.staging,
        writers: WRITERS,
        idle_timeout: IDLE_TIMEOUT,
        intake: Default::default(),
        write_errors: Default::default(),
        accept: None,
        privileged: true,
    }
}

/// Both ends in this process, joined by in-memory streams: local paths and S3 buckets.
fn local_to_local(p: &Plan, a: &CpArgs, progress: &Arc<Progress>) -> Result<Stats> {
    let (ctl_a, ctl_b) = memory::pair();
    let (tx, rx) = crossbeam_channel::unbounded::<Box<dyn Transport>>();
    // A stream: one end sends, the other goes to the receiver. The tuner
    // opens more the same way.
    let connect: Connector = Arc::new(move || {
        let (x, y) = memory::pair();
        // The receiver takes connections until the transfer ends.
        let _ = tx.send(Box::new(y));
        Ok(Box::new(x) as Box<dyn Transport>)
    });
    let data = (0..a.net.initial()).map(|_| connect()).collect::<Result<Vec<_>>>()?;
    let prepared = recv::prepare(recv_config(p))?;
    let receiver = std::thread::spawn(move || prepared.run(Box::new(ctl_b), rx));
    let more = Some(MoreStreams::Connect(connect));
    let link = HostLink { name: "localhost".into(), control: Box::new(ctl_a), data, attaching: None, more };
    let sent = send::send(
        Files::Walk { store: p.src_store.clone(), specs: specs(p) },
        vec![link],
        send_config(p, progress, a.net.tuner_factory()),
    );
    let received = receiver.join().unwrap_or_else(|_| Err(Error::internal("receiver panicked")));
    match (sent, received) {
        (Ok(stats), Ok(_)) => Ok(stats),
        // When the receiver fails, the sender only sees the connection go: report the cause.
        (_, Err(e)) if e.kind != ErrorKind::Unreachable => Err(e),
        (Err(e), _) | (_, Err(e)) => Err(e),
    }
}

fn remote_parts(l: &Location) -> (&[String], &str) {
    match l {
        Location::Remote { hosts, path } => (hosts, path),
        Location::Local(_) | Location::Ssh { .. } | Location::S3 { .. } => unreachable!("checked and resolved by the caller"),
    }
}

fn upload(p: &Plan, a: &CpArgs, progress: &Arc<Progress>) -> Result<Stats> {
    let (hosts, _) = remote_parts(&p.dest);
    let creds = p.hosts.creds(hosts)?;
    let socket = a.net.socket()?;
    let stats = with_retries(a.retries, |_| {
        let links = session::receive_links(&creds, &p.dest_path, p.options, a.net.initial(), &socket)?;
        send::send(Files::Walk { store: p.src_store.clone(), specs: specs(p) }, links, send_config(p, progress, a.net.tuner_factory()))
    })?;
    Ok(Stats { sent_bytes: progress.snapshot().sent_bytes, ..stats })
}

fn download(p: &Plan, a: &CpArgs, progress: &Arc<Progress>) -> Result<Stats> {
    let (hosts, _) = remote_parts(&p.sources[0]);
    let cred = p.hosts.cred(&hosts[0])?;
    let socket = a.net.socket()?;
    with_retries(a.retries, |_| {
        let cfg = RecvConfig { accept: Some(crate::names::expected(&specs(p))), ..recv_config(p) };
        session::download(&hosts[0], &cred, specs(p), p.params, &socket, cfg, progress)
    })
}

fn third_party(p: &Plan, a: &CpArgs, progress: &Arc<Progress>) -> Result<Stats> {
    let (src_hosts, _) = remote_parts(&p.sources[0]);
    let (dest_hosts, _) = remote_parts(&p.dest);
    let src = (src_hosts[0].clone(), p.hosts.cred(&src_hosts[0])?);
    let dests = p.hosts.creds(dest_hosts)?;
    if let Some((host, _)) = dests.iter().find(|(_, c)| !c.direct()) {
        let msg = format!("{host} can be reached only through ssh, so the source host cannot deliver to it directly");
        return Err(Error::new(ErrorKind::Usage, p.dest.path(), msg)
            .advised("copy through a local directory: first from the source, then to the destination"));
    }
    // Each attempt asks the destinations for fresh tickets (a ticket opens
    // one session), so the retries of a third-party copy are the client's:
    // the source server tries once and says why it stopped.
    with_retries(a.retries, |_| session::push(&src, &dests, specs(p), &p.dest_path, p.options, p.params, progress))
}
