//! `dmover submit`, `dmover run`, `dmover status` and the hidden
//! `dmover agent`: the command-line side of batch jobs. The job file is
//! read and resolved into a [`Plan`] here (source and destination URLs,
//! sizes and token parsed as `dmover cp` parses them, an S3 source opened
//! as `cp` opens one); everything else is in `dmover-job`.

use crate::cp::{parse_block_size, parse_staging};
use crate::location::{self, Location, S3Args};
use crate::sizes::parse_size;
use crate::ssh::SshOptions;
use crate::TokenArgs;
use clap::Args;
use dmover_engine::session::Credential;
use dmover_engine::storage::{self, Store};
use dmover_engine::{Error, Result};
use dmover_job::agent::{self, AgentSpec};
use dmover_job::jobfile::{self, JobFile};
use dmover_job::manager::{self, Launch};
use dmover_job::state::{JobState, StateDir};
use dmover_job::{sbatch, Plan};
use dmover_proto::ErrorKind;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct SubmitArgs {
    /// The job file (TOML).
    pub job: PathBuf,
    /// Print the batch script instead of submitting it.
    #[arg(long)]
    pub dry_run: bool,
    /// Nodes to allocate (overrides slurm.nodes).
    #[arg(short = 'N', long)]
    pub nodes: Option<u32>,
    /// Transfer agents per node (overrides slurm.tasks_per_node).
    #[arg(long)]
    pub ntasks_per_node: Option<u32>,
    /// Partition (overrides slurm.partition).
    #[arg(short, long)]
    pub partition: Option<String>,
    /// Time limit, e.g. 01:00:00 (overrides slurm.time).
    #[arg(short, long)]
    pub time: Option<String>,
    /// Account to charge (overrides slurm.account).
    #[arg(short = 'A', long)]
    pub account: Option<String>,
    /// Have the manager serve the job's metrics and status page on ADDR
    /// (as `dmover run --metrics`; off loopback they need the job file's
    /// metrics_token_file).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
}

#[derive(Args)]
pub struct RunArgs {
    /// The job file (TOML).
    pub job: PathBuf,
    /// Print the final report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Serve the job's Prometheus metrics at http://ADDR/metrics and its
    /// status page at http://ADDR/ while it runs: a port (on loopback), or
    /// HOST:PORT (off loopback both need the job file's metrics_token_file).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
}

#[derive(Args)]
pub struct StatusArgs {
    /// The job file, or its state directory.
    pub job: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Serve a live status page of the job at http://ADDR/ (its metrics at
    /// /metrics) until interrupted: a port (on loopback), or HOST:PORT (off
    /// loopback it needs a page token: open it as /#token=TOKEN).
    #[arg(long, value_name = "ADDR", conflicts_with = "json")]
    pub web: Option<String>,
    /// File holding the page token the page asks for (else the job file's
    /// metrics_token_file): a token of its own, never the servers'.
    #[arg(long, value_name = "FILE", requires = "web")]
    pub web_token_file: Option<PathBuf>,
}

#[derive(Args)]
pub struct AgentArgs {
    /// The manager's HOST:PORT.
    #[arg(long)]
    pub manager: String,
    /// The job file.
    pub job: PathBuf,
}

fn usage(subject: impl Into<String>, message: impl Into<String>) -> Error {
    Error::new(ErrorKind::Usage, subject, message)
}

/// Where to read about job files: the advice given with a mistake in one.
const JOB_DOCS: &str = "the job file's keys and values are described in docs/CLI.md, section \"Batch jobs\"";

/// A mistake in the job file.
fn job_error(subject: impl Into<String>, message: impl Into<String>) -> Error {
    usage(subject, message).advised(JOB_DOCS)
}

/// Reads the job file and resolves it into a plan; checks nothing outside
/// the file but the token and the source root's existence (for a bucket:
/// that it is there and takes the credentials).
fn load(path: &Path) -> Result<(JobFile, Plan)> {
    let job_path = std::path::absolute(path).map_err(|e| Error::io(path.display().to_string(), &e))?;
    let job = JobFile::load(&job_path).map_err(|e| if e.kind == ErrorKind::Usage { e.advised(JOB_DOCS) } else { e })?;
    let subject = job_path.display().to_string();
    let command = job.command().map_err(|m| job_error(&subject, m))?;
    let (hosts, dest, creds) = if command.is_some() {
        // The command's own destinations: taken as written.
        (job.dest_hosts.clone(), job.dest_root.clone(), Vec::new())
    } else if job.ssh.is_some() {
        // Reached when the remote ends are started (see `reach`).
        let (_, dest) = ssh_location(&job).map_err(|e| job_error(&subject, format!("dest_hosts / dest_root: {}", e.message)))?;
        (job.dest_hosts.clone(), dest, Vec::new())
    } else {
        if let Some(h) = job.dest_hosts.iter().find(|h| h.contains([',', '/'])) {
            return Err(job_error(&subject, format!("dest_hosts: {h:?} is not host or host:port (one host per list entry)")));
        }
        let url = format!("dmover://{}/{}", job.dest_hosts.join(","), job.dest_root);
        let (hosts, dest) = match Location::parse(&url) {
            Ok(Location::Remote { hosts, path }) => (hosts, path.trim_end_matches('/').to_string()),
            Ok(Location::Local(_) | Location::Ssh { .. } | Location::S3 { .. }) => unreachable!("a dmover:// URL"),
            Err(e) => return Err(job_error(&subject, format!("dest_hosts / dest_root: {}", e.message))),
        };
        let token = match &job.token_file {
            Some(f) => dmover_engine::session::read_token(Path::new(f))?,
            None => TokenArgs { token_file: None }.token().map_err(|_| {
                usage(&subject, "no token")
                    .advised("set token_file in the job file or export DMOVER_TOKEN (it is passed on to the batch job)")
            })?,
        };
        let cred = Credential::token(&token);
        let creds = hosts.iter().map(|h| (h.clone(), cred.clone())).collect();
        (hosts, dest, creds)
    };
    let t = &job.transfer;
    let size = |key: &str, v: &str, parse: fn(&str) -> std::result::Result<u64, String>| {
        parse(v).map_err(|m| job_error(&subject, format!("transfer.{key} = {v:?}: {m}")))
    };
    let staging = size("staging", &t.staging, parse_staging)?;
    let (source, source_root) = source(&job, &subject, staging)?;
    let plan = Plan {
        state_dir: jobfile::state_dir(&job_path),
        job: job_path,
        source,
        source_root,
        sources: job.sources.clone(),
        hosts,
        dest,
        creds,
        streams: t.streams,
        concurrency: t.concurrency,
        block_size: size("block_size", &t.block_size, parse_block_size)?,
        staging,
        bwlimit: size("bwlimit", &t.bwlimit, parse_size)?,
        ignore_times: t.ignore_times,
        checksum: t.checksum,
        attempts: t.attempts,
        local_agents: job.slurm.tasks_per_node,
        command,
        // Checked when the job file was parsed.
        checkpoint_before: job.slurm.checkpoint_before.as_deref().and_then(|t| jobfile::parse_time(t).ok()),
        resubmit: job.slurm.resubmit,
    };
    Ok((job, plan))
}

/// Where the job's sources are read, and their root there: a canonical
/// directory of the file system, or a key prefix of an S3 bucket reached as
/// `dmover cp` reaches one (which checks that the bucket is there and takes
/// the credentials).
fn source(job: &JobFile, subject: &str, staging: u64) -> Result<(Store, PathBuf)> {
    if !job.s3_source() {
        let root = Path::new(&job.source_root).canonicalize().map_err(|e| {
            Error::new(ErrorKind::NotFound, &job.source_root, format!("source_root: {e}"))
                .advised("check the path: it must be a directory visible from every node")
        })?;
        return Ok((storage::local(), root));
    }
    match Location::parse(&job.source_root) {
        Ok(Location::S3 { bucket, path }) => {
            let s3 = S3Args { s3_endpoint: job.s3_endpoint.clone() };
            let store = s3.open(&bucket, staging).map_err(|e| match e.kind {
                ErrorKind::Unreachable => e.advised(
                    "check s3_endpoint in the job file (else AWS_ENDPOINT_URL), and that the S3 server runs \
                     and answers there from every node",
                ),
                _ => e,
            })?;
            Ok((store, PathBuf::from(path.trim_end_matches('/'))))
        }
        Ok(_) => unreachable!("an s3:// URL"),
        Err(e) => Err(job_error(subject, format!("source_root = {:?}: {}", job.source_root, e.message))),
    }
}

/// The job's destination as an ssh location: each host of `dest_hosts`
/// with `dest_root` on it.
fn ssh_location(job: &JobFile) -> Result<(Vec<crate::ssh::SshTarget>, String)> {
    let mut targets = Vec::new();
    let mut path = String::new();
    for h in &job.dest_hosts {
        match crate::ssh::parse(&format!("{h}:{}", job.dest_root))? {
            Some((t, p)) if t.len() == 1 => {
                targets.extend(t);
                path = p;
            }
            _ => return Err(usage(h, "a host reached over ssh is [user@]host, one per list entry")),
        }
    }
    Ok((targets, path.trim_end_matches('/').to_string()))
}

/// Starts a remote end over ssh on each destination host of a job file
/// with `[ssh]`, and gives the plan their addresses and one-time secrets.
/// The remote ends run while the returned value lives.
fn reach(job: &JobFile, plan: &mut Plan) -> Result<Option<location::Hosts>> {
    let Some(ssh) = &job.ssh else { return Ok(None) };
    let options = SshOptions { ssh: ssh.command.clone(), remote_dmover: ssh.remote_dmover.clone(), via_ssh: false };
    let (targets, path) = ssh_location(job)?;
    let mut locations = [Location::Ssh { targets, path }];
    let hosts = location::resolve(&mut locations, &options, &TokenArgs { token_file: None })?;
    let [Location::Remote { hosts: addrs, .. }] = &locations else { unreachable!("resolved to the remote ends") };
    plan.creds = hosts.creds(addrs)?;
    Ok(Some(hosts))
}

/// Loads the job, starts what reaches its hosts, and checks it against the
/// world: sources that match nothing and destinations that do not answer
/// are refused here.
fn load_checked(path: &Path) -> Result<(JobFile, Plan, Option<location::Hosts>)> {
    let (job, mut plan) = load(path)?;
    jobfile::check_sources(plan.source.as_ref(), &plan.source_root, &plan.sources)?;
    let reach = reach(&job, &mut plan)?;
    match &plan.command {
        Some(c) => c.check_program()?,
        None => jobfile::check_hosts(&plan.hosts, &plan.creds, &plan.dest)?,
    }
    Ok((job, plan, reach))
}

pub fn submit(a: SubmitArgs) -> Result<i32> {
    let (job, plan, _reach) = load_checked(&a.job)?;
    let mut slurm = job.slurm.clone();
    slurm.nodes = a.nodes.unwrap_or(slurm.nodes);
    slurm.tasks_per_node = a.ntasks_per_node.unwrap_or(slurm.tasks_per_node);
    if slurm.nodes == 0 || slurm.tasks_per_node == 0 {
        return Err(usage("--nodes/--ntasks-per-node", "must be at least 1"));
    }
    if let Some(p) = a.partition {
        jobfile::check_line(&p).map_err(|m| usage("--partition", m))?;
        slurm.partition = Some(p);
    }
    if let Some(t) = a.time {
        jobfile::parse_time(&t).map_err(|m| usage("--time", format!("{t:?}: {m}")))?;
        slurm.time = Some(t);
    }
    if let Some(acc) = a.account {
        jobfile::check_line(&acc).map_err(|m| usage("--account", m))?;
        slurm.account = Some(acc);
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("the dmover binary", &e))?;
    if let Some(m) = &a.metrics {
        // Checked here (its form, that its host name resolves, and the page
        // token off loopback): a mistake would only show in the batch job's
        // output.
        let off_loopback = std::net::ToSocketAddrs::to_socket_addrs(&crate::web::address(m))
            .map_err(|e| usage(format!("--metrics {m}"), format!("not PORT or HOST:PORT: {e}")))?
            .any(|a| !a.ip().is_loopback());
        if page_token(Some(&job), None)?.is_none() && off_loopback {
            return Err(crate::web::no_page_token(&format!("--metrics {m}"), JOB_PAGE_TOKEN));
        }
    }
    let script = sbatch::render(&plan.job, &exe, &plan.state_dir, &slurm, a.metrics.as_deref())?;
    if a.dry_run {
        out!("{script}");
        return Ok(0);
    }
    StateDir::new(&plan.state_dir).create()?;
    let kept = plan.state_dir.join(sbatch::SCRIPT);
    std::fs::write(&kept, &script).map_err(|e| Error::io(kept.display().to_string(), &e))?;
    let id = sbatch::submit(&script)?;
    outln!("{id}");
    errln!("dmover: submitted batch job {id}; follow it with `dmover status {}`", a.job.display());
    Ok(0)
}

/// Where a job's pages take their token from (`dmover run`, `submit`).
const JOB_PAGE_TOKEN: &str = "metrics_token_file in the job file";

/// The page token a job's pages ask for: from `file` if given, else the
/// job file's `metrics_token_file`. Refused if it is the job's data token
/// (the job file's `token_file`, else DMOVER_TOKEN).
fn page_token(job: Option<&JobFile>, file: Option<&Path>) -> Result<Option<Vec<u8>>> {
    let Some(file) = file.or_else(|| job?.metrics_token_file.as_deref().map(Path::new)) else { return Ok(None) };
    let data = match job.and_then(|j| j.token_file.as_deref()) {
        Some(f) => dmover_engine::session::read_token(Path::new(f)).ok(),
        None => TokenArgs { token_file: None }.token().ok(),
    };
    crate::web::page_token(file, data.as_deref()).map(Some)
}

/// Serves the pages of the job whose state directory is `dir` on `addr`,
/// asking for `token` (`token_flag` says how to give one); returns the
/// line that says where.
fn serve_pages(flag: &str, addr: &str, dir: &Path, token: Option<Vec<u8>>, token_flag: &str) -> Result<String> {
    let pages = crate::web::bind(flag, addr, token.as_deref(), token_flag)?;
    pages.serve(std::sync::Arc::new(dmover_job::page::JobPage::new(StateDir::new(dir))))
}

pub fn run(a: RunArgs) -> Result<i32> {
    let (job, plan, _reach) = load_checked(&a.job)?;
    if let Some(m) = &a.metrics {
        // On stderr: stdout is the report's (--json).
        let token = page_token(Some(&job), None)?;
        errln!("{}", serve_pages("--metrics", m, &plan.state_dir, token, JOB_PAGE_TOKEN)?);
    }
    let launch = if std::env::var_os("SLURM_JOB_ID").is_some() {
        Launch::Srun { exe: std::env::current_exe().map_err(|e| Error::io("the dmover binary", &e))? }
    } else {
        Launch::Threads(plan.local_agents)
    };
    let report = manager::run(plan, launch)?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report).expect("a report serializes"));
    }
    errln!("{}", report.summary());
    Ok(report.exit_code())
}

pub fn status(a: StatusArgs) -> Result<i32> {
    let dir = if a.job.is_dir() { a.job.clone() } else { jobfile::state_dir(&a.job) };
    if let Some(addr) = &a.web {
        let job = if a.job.is_dir() { None } else { Some(JobFile::load(&a.job)?) };
        let token = page_token(job.as_ref(), a.web_token_file.as_deref())?;
        outln!("{}", serve_pages("--web", addr, &dir, token, &format!("--web-token-file FILE or {JOB_PAGE_TOKEN}"))?);
        let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT])
            .map_err(|e| Error::io("signals", &e))?;
        signals.forever().next();
        return Ok(0);
    }
    let state = StateDir::new(&dir);
    let r = state.read()?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&r).expect("a report serializes"));
        return Ok(0);
    }
    outln!("{}", r.summary());
    let runs = state.runs();
    if runs.len() > 1 {
        outln!("runs:");
        for (i, run) in runs.iter().enumerate() {
            let id = run.slurm_job_id.as_deref().map(|id| format!(" (Slurm job {id})")).unwrap_or_default();
            let next = run.resubmitted_as.as_deref().map(|id| format!("; resubmitted as {id}")).unwrap_or_default();
            outln!("  {}{id}: {} after {:.1} s, {} files sent{next}", i + 1, run.state, run.seconds, run.files);
        }
    }
    if r.state == JobState::Running {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let age = now.saturating_sub(r.updated_unix);
        if age > 10 {
            outln!("(last update {age} s ago: the manager may have stopped; `squeue` or slurm-*.out in {} say more)", dir.display());
        }
    }
    Ok(0)
}

pub fn agent(a: AgentArgs) -> Result<i32> {
    let (job, mut plan) = load(&a.job)?;
    let _reach = reach(&job, &mut plan)?;
    let token = std::env::var(agent::TOKEN_ENV)
        .map_err(|_| usage(agent::TOKEN_ENV, "not set: agents are started by `dmover run`, which sets it"))?;
    let task = std::env::var("SLURM_PROCID").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let spec = AgentSpec { manager: a.manager, token: token.into_bytes(), node: dmover_job::hostname(), task };
    agent::run(&spec, &plan)?;
    Ok(0)
}
