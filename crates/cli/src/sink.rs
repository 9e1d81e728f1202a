//! `dmover sink`: the daemon that receives streams from running simulations
//! (see `dmover_server::sink`), with the server's authentication, connection
//! limits and shutdown.

use clap::Args;
use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use dmover_server::sink::SinkConfig;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
    /// This sink's name in manifests (default: the address it listens on).
    #[arg(long)]
    pub name: Option<String>,
    /// File holding the shared token producers must prove they know.
    #[arg(long, value_name = "FILE")]
    pub token_file: PathBuf,
    /// Most connections served at once.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Seconds a silent control connection is kept.
    #[arg(long, default_value_t = 120)]
    pub idle_timeout: u64,
    /// Seconds running streams may go on after SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub grace: u64,
}

pub fn run(a: SinkArgs) -> Result<i32> {
    let token = crate::read_token(&a.token_file)?;
    crate::serve::warn_if_readable(&a.token_file);
    std::fs::create_dir_all(&a.dir).map_err(|e| Error::io(a.dir.display().to_string(), &e))?;
    let dir = a.dir.canonicalize().map_err(|e| Error::io(a.dir.display().to_string(), &e))?;
    if !dir.is_dir() {
        return Err(Error::new(ErrorKind::Usage, dir.display().to_string(), "not a directory"));
    }
    let listener = crate::serve::bind(&a.listen)?;
    let addr = listener.local_addr().map_err(|e| Error::io(&a.listen, &e))?;
    let name = a.name.unwrap_or_else(|| addr.to_string());
    log::info!("sink {name}: streams go to {}", dir.display());
    let cfg = dmover_server::Config {
        exports: HashMap::new(),
        token,
        max_connections: a.max_connections.max(1),
        idle_timeout: Duration::from_secs(a.idle_timeout.max(1)),
        grace: Duration::from_secs(a.grace),
        staging: 1 << 20,
        writers: 1,
        sink: Some(Arc::new(SinkConfig { dir, hook: a.hook, name })),
    };
    crate::serve::run_server(listener, cfg)
}
