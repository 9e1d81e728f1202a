//! A job's web pages (`dmover status JOB --web ADDR`, and the manager's own
//! with `dmover run --metrics ADDR`): the status page's data and the
//! Prometheus metrics, both read from the state directory as `dmover
//! status` reads it, so a page served from a login node shows a job whose
//! manager runs on a compute node.
//!
//! Labels name nodes of the allocation and destination hosts of the job
//! file: a bounded set, never files.

use crate::state::{AgentState, JobReport, JobState, StateDir};
use dmover_web::Site;
use prometheus::{Encoder, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};
use serde_json::{json, Value};

/// The pages of the job whose state directory is `state`.
pub struct JobPage {
    state: StateDir,
}

impl JobPage {
    pub fn new(state: StateDir) -> JobPage {
        JobPage { state }
    }
}

impl Site for JobPage {
    fn status(&self) -> Value {
        match self.state.read() {
            Ok(r) => json!({ "kind": "job", "report": r, "runs": self.state.runs() }),
            Err(e) => json!({ "kind": "waiting", "message": e.to_string() }),
        }
    }

    fn metrics(&self) -> Vec<u8> {
        let registry = Registry::new();
        let started = self.state.read().ok();
        single(&registry, "dmover_job_started", "Whether the job has recorded progress (1) or not yet (0).", started.is_some() as i64);
        if let Some(r) = started {
            describe(&registry, &r);
        }
        let mut page = Vec::new();
        TextEncoder::new().encode(&registry.gather(), &mut page).expect("text encoding into memory");
        page
    }
}

fn gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("a valid metric");
    registry.register(Box::new(g.clone())).expect("registered once");
    g
}

/// A gauge without labels, set to `value`.
fn single(registry: &Registry, name: &str, help: &str, value: i64) {
    let g = IntGauge::new(name, help).expect("a valid metric");
    g.set(value);
    registry.register(Box::new(g)).expect("registered once");
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("a valid metric");
    registry.register(Box::new(c.clone())).expect("registered once");
    c
}

/// The job's figures as metrics.
fn describe(registry: &Registry, r: &JobReport) {
    let state = gauge(registry, "dmover_job_state", "1 for the state the job is in (running, finished, checkpointed, failed).", &["state"]);
    for s in [JobState::Running, JobState::Finished, JobState::Checkpointed, JobState::Failed] {
        state.with_label_values(&[&s.to_string()]).set((s == r.state) as i64);
    }
    single(
        registry,
        "dmover_job_listing_complete",
        "Whether every source file has been listed (so the totals are final).",
        r.walk_done as i64,
    );
    single(
        registry,
        "dmover_job_check_passed",
        "Whether the completion check passed (every file verified at the destination).",
        r.check.passed as i64,
    );
    let files = gauge(registry, "dmover_job_files", "Files of the job: listed, done (confirmed at the destination, by any run), failed, skipped (already there), earlier (done by an earlier run).", &["status"]);
    let bytes = gauge(
        registry,
        "dmover_job_bytes",
        "Bytes of the job's files: listed, done, skipped, earlier (as for dmover_job_files).",
        &["status"],
    );
    for (status, f, b) in [
        ("listed", r.total_files, Some(r.total_bytes)),
        ("done", r.done_files, Some(r.done_bytes)),
        ("failed", r.failed_files, None),
        ("skipped", r.skipped_files, Some(r.skipped_bytes)),
        ("earlier", r.earlier_files, Some(r.earlier_bytes)),
    ] {
        files.with_label_values(&[status]).set(f as i64);
        if let Some(b) = b {
            bytes.with_label_values(&[status]).set(b as i64);
        }
    }
    let again = counter(
        registry,
        "dmover_job_reassigned_files_total",
        "Files given to another agent, after a failure (retried) or because their agent was lost (requeued).",
        &["reason"],
    );
    again.with_label_values(&["retried"]).inc_by(r.retried_files);
    again.with_label_values(&["requeued"]).inc_by(r.requeued_files);
    let agents = gauge(registry, "dmover_job_agents", "Transfer agents by state (running, finished, lost).", &["state"]);
    for s in [AgentState::Running, AgentState::Finished, AgentState::Lost] {
        let n = r.agents.iter().filter(|a| a.state == s).count();
        let name = serde_json::to_value(s).expect("a state serializes");
        agents.with_label_values(&[name.as_str().unwrap_or_default()]).set(n as i64);
    }
    let by_part = [
        (
            "node",
            "Files this run confirmed, by the node that sent them.",
            "Bytes this run confirmed, by the node that sent them.",
            &r.nodes,
        ),
        ("host", "Files this run confirmed, by destination host.", "Bytes this run confirmed, by destination host.", &r.hosts),
    ];
    for (part, files_help, bytes_help, shares) in by_part {
        let f = counter(registry, &format!("dmover_job_{part}_files_total"), files_help, &[part]);
        let b = counter(registry, &format!("dmover_job_{part}_bytes_total"), bytes_help, &[part]);
        for s in shares.iter() {
            f.with_label_values(&[&s.name]).inc_by(s.count);
            b.with_label_values(&[&s.name]).inc_by(s.bytes);
        }
    }
    let elapsed = prometheus::Gauge::new("dmover_job_elapsed_seconds", "Seconds this run of the job has been going (or went).")
        .expect("a valid metric");
    elapsed.set(r.seconds);
    registry.register(Box::new(elapsed)).expect("registered once");
    single(
        registry,
        "dmover_job_updated_timestamp_seconds",
        "Unix time of the manager's last progress record (stale while running: the manager stopped).",
        r.updated_unix as i64,
    );
}
