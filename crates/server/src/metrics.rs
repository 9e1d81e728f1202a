//! What a server counts, served with `--metrics ADDR` (by `dmover-web`)
//! as `/metrics` for Prometheus and as the status page of its running
//! sessions: connections and why any were refused, sessions by kind, the
//! files and bytes received and sent, the streams and staging memory of
//! running sessions, each export's write errors, and a sink's steps and
//! its producers' spills and failovers. Counters go up as
//! the server works; bytes still moving in running sessions are added when
//! a page is asked for, so a scrape during a transfer sees its progress.
//! Labels take a few fixed values, and the export names the server was
//! given: never paths, peers or producer names.

use dmover_engine::history::{History, Rates};
use dmover_engine::progress::Progress;
use dmover_engine::recv::{Intake, WriteErrors};
use dmover_proto::frame::ProducerEvents;
use dmover_web::Site;
use prometheus::{Encoder, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

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
    spilled_blocks: IntCounter,
    spilled_bytes: IntCounter,
    failovers: IntCounter,
    write_error_counts: IntCounterVec,
    staging: IntGauge,
    receive_streams: IntGauge,
    send_streams: IntGauge,
    /// Each export's files that failed on its storage, as receiving
    /// sessions count them.
    write_errors: Mutex<BTreeMap<String, Arc<WriteErrors>>>,
    /// Payload bytes a sink's streams take off their data connections.
    streamed: AtomicU64,
    /// What receiving sessions take off the network (shared with them).
    intake: Arc<Intake>,
    /// Sessions running now, and what ended ones sent.
    live: Mutex<Live>,
    started: Instant,
    /// Bytes moved either way over the last minutes, for the status page's
    /// chart and rates.
    history: History,
}

#[derive(Default)]
struct Live {
    sessions: Vec<LiveSession>,
    next: u64,
    /// Bytes sent by sessions that ended.
    ended_sent: u64,
}

/// A running session, as the status page lists it.
struct LiveSession {
    id: u64,
    kind: Kind,
    started: Instant,
    /// What a sending session has sent.
    progress: Option<Arc<Progress>>,
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
        let family = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("a valid metric");
            registry.register(Box::new(c.clone())).expect("registered once");
            c
        };
        let connections = family(
            "dmover_connections_total",
            "Connections that finished their handshake, by outcome (authenticated, bad_credential, malformed, timeout, busy).",
            &["outcome"],
        );
        let sessions = family("dmover_sessions_total", "Transfer sessions opened, by kind (receive, send, push, stream).", &["kind"]);
        let active = IntGaugeVec::new(Opts::new("dmover_sessions_active", "Transfer sessions running now, by kind."), &["kind"])
            .expect("a valid metric");
        registry.register(Box::new(active.clone())).expect("registered once");
        let steps = family(
            "dmover_sink_steps_total",
            "Steps a sink saved, by whether all of the step is here (complete=\"true\") or part of it went to another sink.",
            &["complete"],
        );
        let write_error_counts = family(
            "dmover_write_errors_total",
            "Files that failed on an export's storage while received into it, by export and class (permission, no_space, io).",
            &["export", "kind"],
        );
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("a valid metric");
            registry.register(Box::new(g.clone())).expect("registered once");
            g
        };
        let staging =
            gauge("dmover_staging_bytes", "Staging memory holding blocks in running sessions (receiving and sending) now, in bytes.");
        let receive_streams = gauge(
            "dmover_receive_streams",
            "Data connections receiving sessions read now (divided by dmover_sessions_active{kind=\"receive\"}: streams per session).",
        );
        let send_streams = gauge("dmover_send_streams", "Data connections sending sessions (send and push) write now.");
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
            spilled_blocks: counter(
                "dmover_sink_producer_spilled_blocks_total",
                "Blocks the producers streaming to this sink spilled to their local disk (as they reported it with a step's end).",
            ),
            spilled_bytes: counter("dmover_sink_producer_spilled_bytes_total", "Bytes of those blocks."),
            failovers: counter(
                "dmover_sink_producer_failovers_total",
                "Sinks the producers streaming to this sink gave up for dead (as they reported it with a step's end).",
            ),
            write_error_counts,
            staging,
            receive_streams,
            send_streams,
            write_errors: Mutex::default(),
            streamed: AtomicU64::new(0),
            connections,
            sessions,
            active,
            registry,
            intake: Arc::default(),
            live: Mutex::default(),
            started: Instant::now(),
            history: History::recent(1.0),
        }
    }

    /// Where receiving sessions count the files that fail on `export`'s
    /// storage.
    pub fn write_errors(&self, export: &str) -> Arc<WriteErrors> {
        self.write_errors.lock().expect("write errors lock").entry(export.to_string()).or_default().clone()
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
        self.start(kind, None)
    }

    /// Counts a sending session whose bytes `progress` counts.
    pub fn sending(&self, kind: Kind, progress: Arc<Progress>) -> Running<'_> {
        self.start(kind, Some(progress))
    }

    fn start(&self, kind: Kind, progress: Option<Arc<Progress>>) -> Running<'_> {
        self.sessions.with_label_values(&[kind.label()]).inc();
        self.active.with_label_values(&[kind.label()]).inc();
        let mut live = self.live.lock().expect("live lock");
        let id = live.next;
        live.next += 1;
        live.sessions.push(LiveSession { id, kind, started: Instant::now(), progress });
        Running { metrics: self, id }
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

    /// Counts what a producer reported with a step's end.
    pub fn producer_events(&self, e: &ProducerEvents) {
        // Far beyond any honest report: a producer cannot make a counter wrap.
        const MOST: u64 = 1 << 40;
        self.spilled_blocks.inc_by(e.spilled_blocks.min(MOST));
        self.spilled_bytes.inc_by(e.spilled_bytes.min(MOST));
        self.failovers.inc_by(e.failovers.min(MOST));
    }

    pub fn step_saved(&self, complete: bool) {
        self.steps.with_label_values(&[if complete { "true" } else { "false" }]).inc();
    }

    /// Brings the byte counters up to what running sessions have moved
    /// (they only grow, so a counter never goes back).
    fn catch_up(&self) {
        let (sent, streams, staged) = {
            let live = self.live.lock().expect("live lock");
            let sending: Vec<&Arc<Progress>> = live.sessions.iter().filter_map(|s| s.progress.as_ref()).collect();
            let running: Vec<_> = sending.iter().map(|p| p.snapshot()).collect();
            (
                live.ended_sent + running.iter().map(|p| p.sent_bytes).sum::<u64>(),
                running.iter().map(|p| p.streams).sum::<u64>(),
                sending.iter().map(|p| p.staged_bytes()).sum::<u64>(),
            )
        };
        catch_up(&self.sent_bytes, sent);
        self.send_streams.set(streams as i64);
        catch_up(&self.received_bytes, self.intake.received());
        catch_up(&self.streamed_bytes, self.streamed.load(Ordering::Relaxed));
        for (export, errors) in self.write_errors.lock().expect("write errors lock").iter() {
            for (kind, n) in errors.counts() {
                catch_up(&self.write_error_counts.with_label_values(&[export.as_str(), kind]), n);
            }
        }
        self.staging.set((self.intake.staged_bytes() + staged) as i64);
        self.receive_streams.set(self.intake.streams() as i64);
    }
}

impl Site for Metrics {
    fn metrics(&self) -> Vec<u8> {
        self.catch_up();
        let mut page = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut page).expect("text encoding into memory");
        page
    }

    fn status(&self) -> Value {
        self.catch_up();
        let received = self.received_bytes.get() + self.streamed_bytes.get();
        let files = self.received_files.get() + self.sent_files.get();
        let history = self.history.note(received + self.sent_bytes.get(), files);
        let sessions: Vec<Value> = {
            let live = self.live.lock().expect("live lock");
            live.sessions
                .iter()
                .map(|s| {
                    let p = s.progress.as_ref().map(|p| p.snapshot());
                    let (bytes, streams) = (p.map(|p| p.sent_bytes), p.map(|p| p.streams));
                    json!({ "kind": s.kind.label(), "seconds": s.started.elapsed().as_secs_f64(), "bytes": bytes, "streams": streams })
                })
                .collect()
        };
        let write_errors: serde_json::Map<String, Value> = {
            let by_export = self.write_errors.lock().expect("write errors lock");
            by_export.iter().map(|(export, e)| (export.clone(), json!(BTreeMap::from(e.counts())))).collect()
        };
        let authenticated = self.connections.with_label_values(&[Outcome::Authenticated.label()]).get();
        let all: u64 = [Outcome::Authenticated, Outcome::BadCredential, Outcome::Malformed, Outcome::Timeout, Outcome::Busy]
            .iter()
            .map(|o| self.connections.with_label_values(&[o.label()]).get())
            .sum();
        json!({
            "kind": "server",
            "seconds": self.started.elapsed().as_secs_f64(),
            "received_bytes": received,
            "sent_bytes": self.sent_bytes.get(),
            "received_files": self.received_files.get(),
            "sent_files": self.sent_files.get(),
            "refused_connections": all - authenticated,
            "refused_requests": self.refused_requests.get(),
            "staging_bytes": self.staging.get(),
            "receive_streams": self.receive_streams.get(),
            "send_streams": self.send_streams.get(),
            "write_errors": write_errors,
            "sessions": sessions,
            "rates": Rates::of(&history),
            "timeline": history,
        })
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
    id: u64,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut live = self.metrics.live.lock().expect("live lock");
        let Some(at) = live.sessions.iter().position(|s| s.id == self.id) else { return };
        let s = live.sessions.swap_remove(at);
        live.ended_sent += s.progress.map(|p| p.snapshot().sent_bytes).unwrap_or(0);
        self.metrics.active.with_label_values(&[s.kind.label()]).dec();
    }
}
