//! The options that shape data connections, shared by `cp` and `bench`:
//! how many streams (a number, or `auto`), which tuner chooses them, and
//! the TCP socket buffer and congestion control of each connection, and
//! whether data connections are encrypted.

use crate::sizes::parse_size;
use clap::Args;
use dmover_engine::send::TunerFactory;
use dmover_engine::transport::SocketOptions;
use dmover_engine::tuning;
use dmover_engine::{Error, Result};
use dmover_proto::frame::{EngineParams, TunerMode};
use dmover_proto::record::Protection;
use dmover_proto::ErrorKind;
use dmover_tune::{paper, Mode};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Streams {
    Auto,
    Fixed(u32),
}

fn parse_streams(s: &str) -> std::result::Result<Streams, String> {
    if s == "auto" {
        return Ok(Streams::Auto);
    }
    match s.parse::<u32>() {
        Ok(n) if (1..=64).contains(&n) => Ok(Streams::Fixed(n)),
        _ => Err("give a number of streams from 1 to 64, or 'auto'".into()),
    }
}

fn parse_mode(s: &str) -> std::result::Result<Mode, String> {
    Mode::parse(s).ok_or_else(|| "the tuners are auto, mi, mi+ and aimd".into())
}

#[derive(Args, Clone)]
pub struct StreamArgs {
    /// Data connections per host: a number (1-64), or 'auto' to let the
    /// tuner choose and change them while sending, in every direction (in a
    /// download the server tunes, and this side dials what it asks for).
    #[arg(short = 'p', long, default_value = "auto", value_parser = parse_streams)]
    pub streams: Streams,
    /// The tuner behind auto: 'auto' (dmover's own), or the paper modes
    /// 'mi', 'mi+' and 'aimd'; with --streams N, N is where it starts.
    #[arg(long, value_name = "MODE", value_parser = parse_mode)]
    pub tune: Option<Mode>,
    /// Chunk of the mi, mi+ and aimd tuners: one decision per chunk sent.
    #[arg(long, value_name = "SIZE", default_value = "100M", value_parser = parse_size)]
    pub tune_chunk: u64,
    /// TCP socket buffer of each data connection, at both ends (SO_SNDBUF and
    /// SO_RCVBUF); by default the kernel sizes it.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub tcp_bs: Option<u64>,
    /// TCP congestion control of the data connections this side sends on
    /// (e.g. cubic, reno, bbr; see /proc/sys/net/ipv4/tcp_available_congestion_control).
    #[arg(long, value_name = "ALG")]
    pub congestion: Option<String>,
    /// Data connections carry integrity only: every byte is still checked
    /// against a keyed tag, but travels unencrypted (trusted networks).
    /// Control connections are always encrypted.
    #[arg(long)]
    pub no_encrypt: bool,
}

impl StreamArgs {
    /// Makes the tuners where this side sends (None: a fixed count).
    pub fn tuner_factory(&self) -> Option<TunerFactory> {
        let mode = self.tuner()?;
        Some(Arc::new(move || mode.build()))
    }

    /// The tuner to run at the sending end, or None for a fixed count.
    pub fn tuner(&self) -> Option<Mode> {
        let mode = match (self.streams, self.tune) {
            (Streams::Fixed(_), None) => return None,
            (Streams::Auto, None) => Mode::parse("auto").expect("a known mode"),
            (_, Some(m)) => m,
        };
        let n0 = |d: usize| match self.streams {
            Streams::Fixed(n) => n as usize,
            Streams::Auto => d,
        };
        Some(match mode {
            Mode::Auto(p) => Mode::Auto(dmover_tune::auto::Params { n0: n0(p.n0), ..p }),
            Mode::Paper(m, p) => Mode::Paper(m, paper::Params { n0: n0(p.n0), chunk: self.tune_chunk, ..p }),
        })
    }

    /// Streams to open first.
    pub fn initial(&self) -> usize {
        match (self.tuner(), self.streams) {
            (Some(m), _) => m.build().initial(),
            (None, Streams::Fixed(n)) => n as usize,
            (None, Streams::Auto) => unreachable!("auto always has a tuner"),
        }
    }

    /// What a server that sends for this client (a download, or the source
    /// of a third-party copy) is to run: where to start and which tuner.
    pub fn params(&self, p: EngineParams) -> EngineParams {
        let tuner = self.tuner().map_or(TunerMode::Fixed, |m| tuning::wire_mode(&m));
        EngineParams { streams: self.initial() as u32, tuner, tune_chunk: self.tune_chunk, ..p }
    }

    pub fn socket(&self) -> Result<SocketOptions> {
        let buffer = match self.tcp_bs {
            None => 0,
            Some(b) if (4096..=(256 << 20)).contains(&b) => b as u32,
            Some(_) => return Err(Error::new(ErrorKind::Usage, "", "--tcp-bs must be between 4K and 256M")),
        };
        let protection = if self.no_encrypt { Protection::Authenticated } else { Protection::Encrypted };
        Ok(SocketOptions { protection, buffer, congestion: self.congestion.clone().unwrap_or_default() })
    }
}
