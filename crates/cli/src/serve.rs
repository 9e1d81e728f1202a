//! `dmover serve`: parses the server's flags, opens the exports (a
//! directory, or an S3 bucket or a prefix in one), binds, and runs the
//! server until SIGTERM or SIGINT.

use crate::location::{Location, S3Args};
use crate::sizes::parse_size;
use clap::Args;
use dmover_engine::storage::{self, s3, Store};
use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct ServeArgs {
    /// Address to listen on (loopback unless you say otherwise).
    #[arg(long, default_value = "127.0.0.1:7450")]
    pub listen: String,
    /// What to serve under NAME (repeatable): a directory, or
    /// s3://BUCKET[/prefix] for the objects of a bucket below the prefix.
    #[arg(long = "export", value_name = "NAME=DIR|s3://BUCKET[/prefix]", required = true)]
    pub exports: Vec<String>,
    /// Where bucket exports keep the resume state of uploads into them
    /// (journals, records of multipart uploads), each in a directory named
    /// after its export [default: $XDG_CACHE_HOME/dmover/serve, else
    /// ~/.cache/dmover/serve].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    #[command(flatten)]
    pub s3: S3Args,
    #[command(flatten)]
    pub daemon: DaemonArgs,
    /// Staging memory of each receiving transfer.
    #[arg(long, default_value = "64M")]
    pub staging: String,
    /// Seconds a ticket for a third-party copy into this server lives
    /// unless the client renews it; the transfer it opened ends with it.
    #[arg(long, value_name = "SECS", default_value_t = dmover_server::TICKET_LIFETIME.as_secs(), value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub ticket_lifetime: u64,
    /// Where third-party copies from this server may go (repeatable): a
    /// host, an address or a network (ADDR/BITS), each with :PORT or any
    /// port ([ADDR]:PORT, [ADDR/BITS]:PORT for IPv6). Without it: any address but loopback,
    /// link-local, unspecified, multicast and broadcast ones; with it, only
    /// those listed.
    #[arg(long, value_name = "HOST[:PORT]|ADDR/BITS[:PORT]")]
    pub push_to: Vec<String>,
    /// Let clients set owners and groups (--owner, --group) in export
    /// NAME (repeatable), and extended attributes outside user.* (file
    /// capabilities among them): for a server run as root that restores
    /// trees for their owners. Without it a copy asking for owners is
    /// refused (one with --archive keeps the server's).
    #[arg(long, value_name = "NAME")]
    pub allow_owners: Vec<String>,
}

/// The flags every daemon (`serve`, `sink`) takes.
#[derive(Args)]
pub struct DaemonArgs {
    /// File holding the shared token clients must prove they know.
    #[arg(long, value_name = "FILE")]
    pub token_file: PathBuf,
    /// Most connections served at once.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Seconds a silent connection is kept (at least 2: peers ping every second).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(2..))]
    pub idle_timeout: u64,
    /// Seconds running transfers may go on after SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub grace: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics and a status page
    /// of the running sessions at http://ADDR/: a port (on loopback), or
    /// HOST:PORT (e.g. 0.0.0.0:9464; off loopback both need
    /// --metrics-token-file).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// File holding the page token: the read-only credential the metrics
    /// and the status page ask for (as `Authorization: Bearer TOKEN`), on
    /// any address if given, and needed off loopback. A token of its own
    /// (`dmover token FILE`), never --token-file's.
    #[arg(long, value_name = "FILE", requires = "metrics")]
    pub metrics_token_file: Option<PathBuf>,
}

impl DaemonArgs {
    /// The token, checked.
    pub fn token(&self) -> Result<Vec<u8>> {
        dmover_engine::session::read_token(&self.token_file)
    }

    /// A server configuration with these flags and no exports.
    pub fn config(&self) -> Result<dmover_server::Config> {
        Ok(dmover_server::Config {
            exports: HashMap::new(),
            allow_owners: Default::default(),
            token: self.token()?,
            max_connections: self.max_connections.max(1),
            idle_timeout: Duration::from_secs(self.idle_timeout),
            grace: Duration::from_secs(self.grace),
            staging: 1 << 20,
            writers: 1,
            sink: None,
            ticket_lifetime: dmover_server::TICKET_LIFETIME,
            push_to: Default::default(),
            metrics: Arc::default(),
        })
    }

    /// The address `--metrics` asks for, bound with the page token (None
    /// without the flag); `data` is the server's token.
    pub fn pages(&self, data: &[u8]) -> Result<Option<crate::web::Pages>> {
        let Some(addr) = &self.metrics else { return Ok(None) };
        let token = self.metrics_token_file.as_deref().map(|f| crate::web::page_token(f, Some(data))).transpose()?;
        crate::web::bind("--metrics", addr, token.as_deref(), "--metrics-token-file FILE").map(Some)
    }
}

pub fn run(a: ServeArgs) -> Result<i32> {
    let usage = |subject: &str, msg: String| Error::new(ErrorKind::Usage, subject, msg);
    let staging = parse_size(&a.staging).map_err(|m| usage("--staging", m))?;
    let mut exports = HashMap::new();
    for e in &a.exports {
        let (name, what) = e.split_once('=').ok_or_else(|| usage(e, "an export is NAME=DIR or NAME=s3://BUCKET[/prefix]".into()))?;
        if name.is_empty() || name.contains(['/', '\0']) || name == "." || name == ".." {
            return Err(usage(e, "an export name is one path component".into()));
        }
        if exports.contains_key(name) {
            return Err(usage(name, "exported twice".into()));
        }
        let root = if what.starts_with(storage::S3_SCHEME) { bucket(&a, name, what, staging)? } else { directory(name, what)? };
        exports.insert(name.to_string(), root);
    }
    if let Some(name) = a.allow_owners.iter().find(|n| !exports.contains_key(n.as_str())) {
        return Err(usage(name, "--allow-owners names an export this server does not have".into()));
    }
    let allow_owners = a.allow_owners.iter().cloned().collect();
    let ticket_lifetime = Duration::from_secs(a.ticket_lifetime);
    let push_to = dmover_server::push_to::PushTo::parse(&a.push_to).map_err(|m| usage("", m))?;
    let cfg = dmover_server::Config {
        exports,
        allow_owners,
        staging: staging.max(1 << 20),
        writers: 2,
        ticket_lifetime,
        push_to,
        ..a.daemon.config()?
    };
    let names: Vec<String> = cfg.exports.keys().cloned().collect();
    let listener = bind(&a.listen)?;
    let pages = a.daemon.pages(&cfg.token)?;
    log::info!("serving {names:?} on {}", listener.local_addr().map_err(|e| Error::io(&a.listen, &e))?);
    run_server(listener, pages, cfg)
}

/// The export `name` of directory `dir`.
fn directory(name: &str, dir: &str) -> Result<Store> {
    if std::path::Path::new(dir).metadata().is_ok_and(|m| !m.is_dir()) {
        return Err(Error::new(ErrorKind::Usage, dir, "not a directory"));
    }
    storage::export(name, std::path::Path::new(dir)).map_err(|err| Error::io(dir, &err))
}

/// The export `name` of the objects `url` (`s3://BUCKET[/prefix]`) names,
/// with its resume state in `STATE_DIR/NAME`; fails unless the bucket is
/// there and takes the credentials.
fn bucket(a: &ServeArgs, name: &str, url: &str, staging: u64) -> Result<Store> {
    let Location::S3 { bucket, path } = Location::parse(url)? else { unreachable!("an s3:// URL") };
    let state = a.state_dir.clone().unwrap_or_else(|| s3::cache_dir().join("serve")).join(name);
    let o = s3::Options { prefix: path, label: Some(name.to_string()), ..a.s3.options(state.clone(), staging) };
    let store = s3::S3::open(&bucket, &o)?;
    log::info!("export {name}: {url}, its resume state in {}", state.display());
    Ok(Arc::new(store))
}

/// Binds the listening socket.
pub fn bind(listen: &str) -> Result<std::net::TcpListener> {
    std::net::TcpListener::bind(listen).map_err(|e| Error::new(ErrorKind::Usage, listen, format!("cannot listen: {e}")))
}

/// Runs a server on `listener` until SIGTERM or SIGINT, with its metrics
/// and status page on `pages` if given.
pub fn run_server(listener: std::net::TcpListener, pages: Option<crate::web::Pages>, cfg: dmover_server::Config) -> Result<i32> {
    let addr = listener.local_addr().map_err(|e| Error::io("listener", &e))?;
    let (shutdown, signal) = dmover_server::shutdown_pair().map_err(|e| Error::io("signal pipe", &e))?;
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT])
        .map_err(|e| Error::io("signals", &e))?;
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            log::info!("signal {sig} received");
            shutdown.trigger();
        }
    });
    outln!("dmover: listening on {addr}");
    if let Some(p) = pages {
        outln!("{}", p.serve(cfg.metrics.clone())?);
    }
    dmover_server::run(listener, cfg, signal, None).map_err(|e| Error::io("server", &e))?;
    log::info!("stopped");
    Ok(0)
}
