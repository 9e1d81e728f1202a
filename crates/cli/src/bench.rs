//! `dmover bench`: throughput between this host and a server with N
//! streams — memory to memory (generated data, verified and discarded at
//! the receiver: the network and protocol alone), or disk to disk.

use crate::location::Location;
use crate::report::Report;
use crate::sizes::parse_size;
use crate::streams::StreamArgs;
use crate::TokenArgs;
use clap::Args;
use dmover_engine::progress::Progress;
use dmover_engine::send::{self, Files, SendConfig};
use dmover_engine::session::{self, Credential};
use dmover_engine::storage;
use dmover_engine::{Error, Result};
use dmover_proto::frame::{TransferFlags, TransferOptions};
use dmover_proto::ErrorKind;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct BenchArgs {
    /// The server: dmover://HOST[:PORT]/EXPORT[/dir]
    pub url: String,
    #[command(flatten)]
    pub net: StreamArgs,
    /// Bytes to send.
    #[arg(long, default_value = "4G")]
    pub size: String,
    /// Block size.
    #[arg(long, default_value = "1M")]
    pub block_size: String,
    /// Staging memory.
    #[arg(long, default_value = "64M")]
    pub staging: String,
    /// Read a real file and write it at the server (disk to disk).
    #[arg(long)]
    pub disk: bool,
    /// Print a JSON report.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub token: TokenArgs,
}

pub fn run(a: BenchArgs) -> Result<i32> {
    let usage = |m: String| Error::new(ErrorKind::Usage, "", m);
    let size = parse_size(&a.size).map_err(usage)?;
    let block_size = parse_size(&a.block_size).map_err(usage)?;
    let staging = parse_size(&a.staging).map_err(usage)?;
    let Location::Remote { hosts, path } = Location::parse(&a.url)? else {
        return Err(Error::new(ErrorKind::Usage, &a.url, "bench needs a dmover:// URL"));
    };
    let cred = Credential::token(&a.token.token()?);
    let mut flags = TransferFlags::empty();
    let mut scratch = None;
    let files = if a.disk {
        let dir = std::env::temp_dir().join(format!("dmover-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(dir.display().to_string(), &e))?;
        let file = dir.join("dmover-bench.dat");
        write_random(&file, size)?;
        scratch = Some(dir);
        Files::Walk { store: storage::local(), specs: vec![file.display().to_string()] }
    } else {
        flags |= TransferFlags::GENERATE | TransferFlags::DISCARD;
        Files::Generate { name: "dmover-bench.dat".into(), size }
    };
    let socket = a.net.socket()?;
    let options = TransferOptions {
        transfer_id: dmover_engine::handshake::random(),
        block_size: block_size as u32,
        flags,
        tcp_buffer: socket.buffer,
    };
    let progress = Arc::new(Progress::default());
    let started = Instant::now();
    let creds: Vec<_> = hosts.iter().map(|h| (h.clone(), cred.clone())).collect();
    let links = session::receive_links(&creds, &path, options, a.net.initial(), &socket)?;
    let tuner = a.net.tuner_factory();
    let cfg = SendConfig { options, concurrency: 4, staging, idle_timeout: Duration::from_secs(120), progress, bwlimit: 0, tuner };
    let stats = send::send(files, links, cfg);
    if let Some(d) = scratch {
        let _ = std::fs::remove_dir_all(d);
    }
    let mut stats = stats?;
    stats.nanos = started.elapsed().as_nanos() as u64;
    let r = Report::from_stats(&stats, flags);
    if a.json {
        outln!("{}", r.to_json());
    } else {
        let mode = if a.disk { "disk to disk" } else { "memory to memory" };
        let streams = match (a.net.tuner(), stats.timeline.last()) {
            (Some(m), Some(p)) => format!("{} streams at the end ({} tuner)", p.streams, m.build().name()),
            _ => format!("{} streams", a.net.initial()),
        };
        outln!("{mode}, {streams}: {:.1} MB/s ({:.2} Gbit/s), {:.2} s", r.rate.mb_per_s, r.rate.mb_per_s * 8.0 / 1000.0, r.seconds);
    }
    Ok(r.exit_code())
}

fn write_random(path: &std::path::Path, size: u64) -> Result<()> {
    let io = |e: std::io::Error| Error::io(path.display().to_string(), &e);
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = size;
    while left > 0 {
        send::fill_random(&mut x, &mut buf);
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n]).map_err(io)?;
        left -= n as u64;
    }
    f.flush().map_err(io)
}
