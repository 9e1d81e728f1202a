//! What a server counts, and `/metrics`, where Prometheus reads it
//! (`--metrics ADDR`): connections and why any were refused, sessions by
//! kind, the files and bytes received and sent, and a sink's steps. Counters go up as the
//! server works; bytes still moving in running sessions are added when
//! the page is asked for, so a scrape during a transfer sees its progress.
//! Labels take a few fixed values only (no paths, peers or names).

use dmover_engine::progress::Progress;
use dmover_engine::recv::Intake;
use prometheus::{Encoder, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How a connection ended its handshake: the `outcome` label.
#[derive(Debug, Clone, Copy)]
pub enum Outcome {
    Authenticated,
    /// It proved no credential this server knows.
    BadCredential,
    /// It did not follow the handshake.
    Malformed,
    /// It did not authenticate in time.
    Timeout,
    /// It authenticated while `--max-connections` were being served.
    Busy,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Authenticated => "authenticated",
            Outcome::BadCredential => "bad_credential",
            Outcome::Malformed => "malformed",
            Outcome::Timeout => "timeout",
            Outcome::Busy => "busy",
        }
    }
}

/// What a session does: the `kind` label.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Receive,
    Send,
    Push,
    Stream,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Receive => "receive",
            Kind::Send => "send",
            Kind::Push => "push",
            Kind::Stream => "stream",
        }
    }
}

/// A server's counters.
pub struct Metrics {
    registry: Registry,
    connections: IntCounterVec,
    refused_requests: IntCounter,
    sessions: IntCounterVec,
    active: IntGaugeVec,
    received_bytes: IntCounter,
    received_files: IntCounter,
    sent_bytes: IntCounter,
    sent_files: IntCounter,
    resent_blocks: IntCounter,
    streamed_bytes: IntCounter,
    damaged_stream_blocks: IntCounter,
    steps: IntCounterVec,
    /// Payload bytes a sink's streams take off their data connections.
    streamed: AtomicU64,
    /// What receiving sessions take off the network (shared with them).
    intake: Arc<Intake>,
    /// Sending sessions still running, and what ended ones sent.
    sending: Mutex<Sending>,
}

#[derive(Default)]
struct Sending {
    running: Vec<Arc<Progress>>,
    ended: u64,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("a valid metric");
            registry.register(Box::new(c.clone())).expect("registered once");
            c
        };
        let family = |name: &str, help: &str, label: &str| {
            let c = IntCounterVec::new(Opts::new(name, help), &[label]).expect("a valid metric");
            registry.register(Box::new(c.clone())).expect("registered once");
            c
        };
        let connections = family(
            "dmover_connections_total",
            "Connections that finished their handshake, by outcome (authenticated, bad_credential, malformed, timeout, busy).",
            "outcome",
        );
        let sessions = family("dmover_sessions_total", "Transfer sessions opened, by kind (receive, send, push, stream).", "kind");
        let active = IntGaugeVec::new(Opts::new("dmover_sessions_active", "Transfer sessions running now, by kind."), &["kind"])
            .expect("a valid metric");
        registry.register(Box::new(active.clone())).expect("registered once");
        let steps = family(
            "dmover_sink_steps_total",
            "Steps a sink saved, by whether all of the step is here (complete=\"true\") or part of it went to another sink.",
            "complete",
        );
        for complete in ["true", "false"] {
            steps.with_label_values(&[complete]);
        }
        for o in [Outcome::Authenticated, Outcome::BadCredential, Outcome::Malformed, Outcome::Timeout, Outcome::Busy] {
            connections.with_label_values(&[o.label()]);
        }
        for k in [Kind::Receive, Kind::Send, Kind::Push, Kind::Stream] {
            sessions.with_label_values(&[k.label()]);
            active.with_label_values(&[k.label()]);
        }
        Metrics {
            refused_requests: counter(
                "dmover_refused_requests_total",
                "Requests refused (bad path, no such export, not allowed, bad parameters).",
            ),
            received_bytes: counter("dmover_received_bytes_total", "Payload bytes taken off data connections by receiving sessions."),
            received_files: counter("dmover_received_files_total", "Files received and committed."),
            sent_bytes: counter("dmover_sent_bytes_total", "Payload bytes written to data connections by sending sessions."),
            sent_files: counter("dmover_sent_files_total", "Files sent and confirmed by their destination."),
            resent_blocks: counter("dmover_resent_blocks_total", "Blocks sent again after a damaged or lost copy."),
            streamed_bytes: counter("dmover_sink_received_bytes_total", "Payload bytes a sink took off its producers' data connections."),
            damaged_stream_blocks: counter("dmover_sink_damaged_blocks_total", "Blocks a sink received damaged and asked for again."),
            steps,
            streamed: AtomicU64::new(0),
            connections,
            sessions,
            active,
            registry,
            intake: Arc::default(),
            sending: Mutex::default(),
        }
    }

    /// What receiving sessions take in, for them to count into.
    pub fn intake(&self) -> Arc<Intake> {
        self.intake.clone()
    }

    pub fn connection(&self, o: Outcome) {
        self.connections.with_label_values(&[o.label()]).inc();
    }

    pub fn refused_request(&self) {
        self.refused_requests.inc();
    }

    /// Counts a session of `kind`, running until the guard is dropped.
    pub fn session(&self, kind: Kind) -> Running<'_> {
        self.sessions.with_label_values(&[kind.label()]).inc();
        self.active.with_label_values(&[kind.label()]).inc();
        Running { metrics: self, kind, progress: None }
    }

    /// Counts a sending session whose bytes `progress` counts.
    pub fn sending(&self, kind: Kind, progress: Arc<Progress>) -> Running<'_> {
        self.sending.lock().expect("sending lock").running.push(progress.clone());
        let mut running = self.session(kind);
        running.progress = Some(progress);
        running
    }

    pub fn received(&self, files: u64) {
        self.received_files.inc_by(files);
    }

    pub fn sent(&self, files: u64, resent_blocks: u64) {
        self.sent_files.inc_by(files);
        self.resent_blocks.inc_by(resent_blocks);
    }

    /// Where a sink's streams count the bytes they take in.
    pub fn streamed(&self) -> &AtomicU64 {
        &self.streamed
    }

    pub fn damaged_stream_block(&self) {
        self.damaged_stream_blocks.inc();
    }

    pub fn step_saved(&self, complete: bool) {
        self.steps.with_label_values(&[if complete { "true" } else { "false" }]).inc();
    }

    /// The page in Prometheus' text format (version 0.0.4).
    pub fn render(&self) -> Vec<u8> {
        // Bring the byte counters up to what running sessions have moved
        // (they only grow, so a counter never goes back).
        let sent = {
            let s = self.sending.lock().expect("sending lock");
            s.ended + s.running.iter().map(|p| p.snapshot().sent_bytes).sum::<u64>()
        };
        catch_up(&self.sent_bytes, sent);
        catch_up(&self.received_bytes, self.intake.received());
        catch_up(&self.streamed_bytes, self.streamed.load(Ordering::Relaxed));
        let mut page = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut page).expect("text encoding into memory");
        page
    }
}

fn catch_up(c: &IntCounter, total: u64) {
    if let Some(more) = total.checked_sub(c.get()).filter(|&d| d > 0) {
        c.inc_by(more);
    }
}

/// A running session's place in [`Metrics`], given back when dropped.
pub struct Running<'a> {
    metrics: &'a Metrics,
    kind: Kind,
    progress: Option<Arc<Progress>>,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.metrics.active.with_label_values(&[self.kind.label()]).dec();
        if let Some(p) = self.progress.take() {
            let mut s = self.metrics.sending.lock().expect("sending lock");
            s.running.retain(|r| !Arc::ptr_eq(r, &p));
            s.ended += p.snapshot().sent_bytes;
        }
    }
}

/// Requests a metrics page serves at once; more wait to be accepted.
const MAX_REQUESTS: usize = 8;
/// Time a client has to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest request head read.
const MAX_HEAD: usize = 8 << 10;

/// Serves `GET /metrics` on `listener` from a thread of its own, for as
/// long as the process runs.
pub fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let busy = Arc::new(AtomicUsize::new(0));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            if busy.fetch_add(1, Ordering::SeqCst) >= MAX_REQUESTS {
                busy.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            let (metrics, busy) = (metrics.clone(), busy.clone());
            std::thread::spawn(move || {
                if let Err(e) = answer(conn, &metrics) {
                    log::debug!("metrics request: {e}");
                }
                busy.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
}

/// Reads one request and answers it: the page for `GET /metrics`, an
/// error otherwise.
fn answer(mut conn: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    conn.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    conn.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            return reply(&mut conn, "431 Request Header Fields Too Large", "text/plain", b"request head too long\n");
        }
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    match (method, path) {
        (b"GET", b"/metrics") => reply(&mut conn, "200 OK", "text/plain; version=0.0.4; charset=utf-8", &metrics.render()),
        (b"GET", _) => reply(&mut conn, "404 Not Found", "text/plain", b"not found: the metrics are at /metrics\n"),
        _ => reply(&mut conn, "405 Method Not Allowed", "text/plain", b"only GET is served\n"),
    }
}

fn reply(conn: &mut TcpStream, status: &str, content_type: &str, body: &[u8]) -> std::io::Result<()> {
    let head = format!("HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    conn.write_all(head.as_bytes())?;
    conn.write_all(body)
}
