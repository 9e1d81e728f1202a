//! `dmover sink`: the daemon that receives streams from running simulations
//! (see `dmover_server::sink`), with the server's authentication, connection
//! limits and shutdown.

use clap::Args;
use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use dmover_server::sink::{Hooks, SinkConfig};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub struct SinkArgs {
    /// Address to listen on (loopback unless you say otherwise).
    #[arg(long, default_value = "127.0.0.1:7460")]
    pub listen: String,
    /// Directory the steps go to: DIR/PRODUCER/step-NNNNNN.{dat,json}.
    #[arg(long, value_name = "DIR")]
    pub dir: PathBuf,
    /// Shell command run with a step's manifest as its last argument when
    /// the step is complete here (also in DMOVER_MANIFEST).
    #[arg(long, value_name = "CMD")]
    pub hook: Option<String>,
    /// This sink's name in every manifest, its own and its producers'
    /// (default: the address it listens on; HOST:PORT if that is 0.0.0.0 or [::]).
    #[arg(long)]
    pub name: Option<String>,
    #[command(flatten)]
    pub daemon: crate::serve::DaemonArgs,
}

pub fn run(a: SinkArgs) -> Result<i32> {
    let cfg = a.daemon.config()?;
    std::fs::create_dir_all(&a.dir).map_err(|e| Error::io(a.dir.display().to_string(), &e))?;
    let dir = a.dir.canonicalize().map_err(|e| Error::io(a.dir.display().to_string(), &e))?;
    if !dir.is_dir() {
        return Err(Error::new(ErrorKind::Usage, dir.display().to_string(), "not a directory"));
    }
    let listener = crate::serve::bind(&a.listen)?;
    let pages = a.daemon.pages(&cfg.token)?;
    let addr = listener.local_addr().map_err(|e| Error::io(&a.listen, &e))?;
    // Listening on every interface, the address names no one sink: the
    // host's name does.
    let default = || if addr.ip().is_unspecified() { format!("{}:{}", dmover_job::hostname(), addr.port()) } else { addr.to_string() };
    let name = a.name.unwrap_or_else(default);
    log::info!("sink {name}: streams go to {}", dir.display());
    let store = dmover_engine::storage::export("sink", &dir).map_err(|e| Error::io(dir.display().to_string(), &e))?;
    let hooks = a.hook.map(|cmd| Arc::new(Hooks::new(cmd, store.clone(), dir.clone())));
    if let Some(h) = &hooks {
        let n = h.catch_up();
        if n > 0 {
            log::info!("running the hooks of {n} complete steps whose hook had not run");
        }
    }
    let cfg = dmover_server::Config { sink: Some(Arc::new(SinkConfig { dir, store, hooks, name })), ..cfg };
    crate::serve::run_server(listener, pages, cfg)
}
