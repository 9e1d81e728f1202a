//! `dmover`: a parallel data mover for scientific data sets.
//!
//! Subcommands: `serve` (the daemon), `sink` (the daemon that receives
//! streams from running simulations), `drain` (send what such a stream
//! left undelivered), `cp` (copy files between local paths
//! and servers), `ls` (list what a server path names), `bench` (network and
//! disk throughput between two endpoints), `token` (make a shared secret),
//! and the batch-job commands `submit`, `run` and `status` (with `agent`,
//! which `run` starts on the nodes). Errors are printed as one line and
//! mapped to the exit codes documented in docs/CLI.md.
//!
//! The command is this library's [`main`], run by the `dmover` binary
//! (`src/main.rs`) and by the test suite's `dmover-faulty`
//! (`src/bin/dmover-faulty.rs`).

/// Prints to stdout like `print!`, through [`write_stdout`]: a reader that
/// has gone away ends the output quietly instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => { $crate::write_stdout(format_args!($($arg)*)) };
}

/// Prints a line to stdout like `println!`, through [`write_stdout`].
macro_rules! outln {
    ($($arg:tt)*) => { $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// Prints a line to stderr like `eprintln!`, except that a stderr whose
/// reader has gone away (`dmover run JOB 2>&1 | head -2`) drops the line
/// instead of panicking: the command still ends with its own exit code.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod bench;
mod cp;
mod drain;
mod job;
mod location;
mod ls;
mod names;
mod remote;
mod report;
mod serve;
mod sink;
mod sizes;
mod ssh;
mod streams;
mod web;

use clap::{Args, Parser, Subcommand};
use dmover_engine::Error;
use dmover_proto::path::printable;
use dmover_proto::ErrorKind;
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "dmover", version = env!("DMOVER_VERSION"), about = "Parallel data mover for large scientific data sets")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve directories to dmover clients.
    Serve(serve::ServeArgs),
    /// Receive streams from running simulations (dmover-stream producers).
    Sink(sink::SinkArgs),
    /// Send what a stream from a simulation left undelivered, from its manifest.
    Drain(drain::DrainArgs),
    /// Copy files and directories: SRC... DEST.
    Cp(cp::CpArgs),
    /// List the files a server path, directory or glob names.
    Ls(ls::LsArgs),
    /// Measure throughput to a server (memory to memory, or disk to disk).
    Bench(bench::BenchArgs),
    /// Write a new random token to FILE (mode 0600); with --producer, a
    /// producer's credential for a sink instead.
    Token {
        /// Where to write the token.
        file: PathBuf,
        /// Write the credential of the producer NAME, made from the sink's
        /// token (--token-file or DMOVER_TOKEN): it lets its holder stream
        /// to the sink under that name only.
        #[arg(long, value_name = "NAME")]
        producer: Option<String>,
        #[command(flatten)]
        token: TokenArgs,
    },
    /// Check a job file and submit it to Slurm as a batch job (--dry-run: print the script).
    Submit(job::SubmitArgs),
    /// Run a job: the process manager and its transfer agents (inside an allocation, or on this machine).
    Run(job::RunArgs),
    /// Show the progress or the final report of a job.
    Status(job::StatusArgs),
    /// A transfer agent of a running job (started by `dmover run`).
    #[command(hide = true)]
    Agent(job::AgentArgs),
    /// The far end of a [user@]host:path location (started by dmover over ssh).
    #[command(hide = true)]
    Remote(remote::RemoteArgs),
}

/// Options shared by commands that talk to servers.
#[derive(Args, Clone)]
pub struct TokenArgs {
    /// File holding the token (else the DMOVER_TOKEN environment variable).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
}

impl TokenArgs {
    /// The token, from the file or the environment.
    pub fn token(&self) -> Result<Vec<u8>, Error> {
        if let Some(f) = &self.token_file {
            return dmover_engine::session::read_token(f);
        }
        match std::env::var("DMOVER_TOKEN") {
            Ok(t) if !t.trim().is_empty() => Ok(t.trim().as_bytes().to_vec()),
            _ => Err(Error::new(ErrorKind::Usage, "", "no token: pass --token-file FILE or set DMOVER_TOKEN")),
        }
    }
}

/// Writes a new token to `file`, or with `producer` that producer's
/// credential made from the sink's token.
fn write_token(file: &std::path::Path, producer: Option<&str>, token: &TokenArgs) -> Result<(), Error> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let text = match producer {
        Some(name) => {
            dmover_server::sink::check_producer(name)?;
            dmover_proto::auth::producer_credential_text(&token.token()?, name)
        }
        None => hex::encode(dmover_engine::handshake::random::<32>()),
    };
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(file).map_err(|e| match e.kind() {
        // Never overwrite a token: servers and jobs may be using it.
        std::io::ErrorKind::AlreadyExists => {
            Error::new(ErrorKind::Usage, file.display().to_string(), "already exists; dmover token does not overwrite a file")
                .advised("remove it first to make a new token, or keep using it")
        }
        _ => Error::io(file.display().to_string(), &e),
    })?;
    writeln!(f, "{text}").map_err(|e| Error::io(file.display().to_string(), &e))
}

/// Runs the command named on the command line and exits with its status.
pub fn main() -> ! {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { ErrorKind::Usage as i32 } else { 0 };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    let level = if matches!(cli.cmd, Cmd::Serve(_) | Cmd::Sink(_)) { "info" } else { "warn" };
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("DMOVER_LOG", level))
        .format(|buf, r| writeln!(buf, "[{} {:<5}] {}", buf.timestamp_millis(), r.level(), printable(&r.args().to_string())))
        .init();
    raise_fd_limit();
    let r = match cli.cmd {
        Cmd::Serve(a) => serve::run(a),
        Cmd::Sink(a) => sink::run(a),
        Cmd::Drain(a) => drain::run(a),
        Cmd::Cp(a) => cp::run(a),
        Cmd::Ls(a) => ls::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Token { file, producer, token } => write_token(&file, producer.as_deref(), &token).map(|()| 0),
        Cmd::Submit(a) => job::submit(a),
        Cmd::Run(a) => job::run(a),
        Cmd::Status(a) => job::status(a),
        Cmd::Agent(a) => job::agent(a),
        Cmd::Remote(a) => remote::remote(a),
    };
    match r {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            errln!("dmover: error: {}", printable(&format!("{e} ({})", e.hint())));
            std::process::exit(e.kind as i32);
        }
    }
}

/// Set once stdout could not be written: the rest of the output is dropped.
static STDOUT_GONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Writes `args` to stdout and flushes it. When the reader has gone away
/// (`dmover status JOB | head -2`) the rest of the output is dropped and the
/// command carries on to its usual end and exit code, as if it had been
/// read; any other write error is said once on stderr.
fn write_stdout(args: std::fmt::Arguments) {
    use std::sync::atomic::Ordering;
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        STDOUT_GONE.store(true, Ordering::Relaxed);
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            let _ = writeln!(std::io::stderr(), "dmover: warning: cannot write the output to stdout ({e}); the rest of it is dropped");
        }
    }
}

/// Many files in flight need many descriptors: raise the soft limit to the hard one.
fn raise_fd_limit() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write the struct passed by pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max.min(65536);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}
