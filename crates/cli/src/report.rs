//! What the user sees: the live progress line while a transfer runs, and the
//! report at the end (a human summary, or JSON with `--json`).

use dmover_engine::progress::{human, Check, Progress, Rate};
use dmover_proto::frame::{FileError, Share, Stats, TransferFlags};
use dmover_proto::path::printable;
use dmover_proto::ErrorKind;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Serialize, Serializer};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A point of a tuned transfer's timeline.
#[derive(Serialize)]
pub struct TunePointReport {
    pub t: f64,
    pub host: String,
    pub streams: u32,
    pub concurrency: u32,
    pub goodput_mbit: f64,
    pub rtt_ms: f64,
}

#[derive(Serialize)]
pub struct Report {
    pub ok: bool,
    pub files: u64,
    pub bytes: u64,
    /// Files and bytes found already at the destination, and not sent.
    pub skipped_files: u64,
    pub skipped_bytes: u64,
    /// How those were found the same: [`skip_reason`].
    pub skipped_because: &'static str,
    pub sent_bytes: u64,
    pub seconds: f64,
    #[serde(flatten)]
    pub rate: Rate,
    pub retries: u64,
    pub resent_blocks: u64,
    #[serde(serialize_with = "shares_by_host")]
    pub hosts: Vec<Share>,
    pub errors: Vec<FileError>,
    /// What was not copied because the copy does not take its kind (a
    /// symlink without `--links`, a device without `--devices`), and why.
    pub passed_over: Vec<FileError>,
    pub check: Check,
    /// Streams, goodput and round-trip time over time, when a tuner ran.
    pub timeline: Vec<TunePointReport>,
}

impl Report {
    pub fn from_stats(s: &Stats, flags: TransferFlags) -> Report {
        let seconds = s.nanos as f64 / 1e9;
        let check = Check::new(!s.errors.is_empty(), (s.files, s.bytes), (s.dest_files, s.dest_bytes), s.digests_match);
        Report {
            ok: check.passed,
            files: s.files,
            bytes: s.bytes,
            skipped_files: s.skipped_files,
            skipped_bytes: s.skipped_bytes,
            skipped_because: skip_reason(flags),
            sent_bytes: s.sent_bytes,
            seconds,
            rate: Rate::new(s.files, s.bytes, seconds),
            retries: s.retries,
            resent_blocks: s.resent_blocks,
            hosts: s.hosts.clone(),
            errors: s.errors.clone(),
            passed_over: s.passed_over.clone(),
            check,
            timeline: s
                .timeline
                .iter()
                .map(|p| TunePointReport {
                    t: p.t_ms as f64 / 1e3,
                    host: s.hosts.get(p.host as usize).map(|h| h.name.clone()).unwrap_or_default(),
                    streams: p.streams,
                    concurrency: p.concurrency,
                    goodput_mbit: p.goodput as f64 * 8.0 / 1e6,
                    rtt_ms: p.rtt_us as f64 / 1e3,
                })
                .collect(),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report serializes")
    }

    /// The exit code: the first file error's class, or 10 if the check failed.
    pub fn exit_code(&self) -> i32 {
        if let Some(e) = self.errors.first() {
            return e.kind as i32;
        }
        if !self.check.passed {
            return ErrorKind::Verify as i32;
        }
        0
    }

    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} files, {} in {:.2} s ({:.1} MB/s, {:.1} files/s)",
            self.files,
            human(self.bytes),
            self.seconds,
            self.rate.mb_per_s,
            self.rate.files_per_s
        );
        if self.skipped_files > 0 {
            s += &format!("; {} files ({}) already there ({})", self.skipped_files, human(self.skipped_bytes), self.skipped_because);
        }
        if self.retries > 0 {
            s += &format!("; {} retries", self.retries);
        }
        if let Some(first) = self.passed_over.first() {
            let n = self.passed_over.len();
            s += &format!("; {n} passed over (not copied), e.g. {}: {}", printable(&first.path), printable(&first.message));
        }
        if self.hosts.len() > 1 {
            for h in &self.hosts {
                // The name came from a server (a third-party copy's report).
                s += &format!("\n  {}: {} files, {}", printable(&h.name), h.count, human(h.bytes));
            }
        }
        s += if self.check.passed { "\ncheck: passed (every file verified at the destination)" } else { "\ncheck: FAILED" };
        s
    }
}

/// Why a file found at the destination was not sent: the same content
/// (`-c`), else the same size and modification time (the quick check, and
/// a resumed run's files that an earlier run finished).
pub fn skip_reason(flags: TransferFlags) -> &'static str {
    if flags.contains(TransferFlags::CHECKSUM) {
        "same content"
    } else {
        "same size and time"
    }
}

/// Each destination host's share as `--json` spells it: its name under `host`.
fn shares_by_host<S: Serializer>(hosts: &[Share], s: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Host<'a> {
        host: &'a str,
        files: u64,
        bytes: u64,
    }
    s.collect_seq(hosts.iter().map(|h| Host { host: &h.name, files: h.count, bytes: h.bytes }))
}

/// The JSON report of a transfer that ended with a fatal error.
pub fn failure_json(e: &dmover_engine::Error) -> String {
    let v = serde_json::json!({
        "ok": false,
        "error": { "kind": e.kind, "subject": e.subject, "message": e.message, "exit_code": e.kind as i32 },
    });
    serde_json::to_string_pretty(&v).expect("a report serializes")
}

/// The progress line on stderr, redrawn from the engine's counters; shown
/// only on a terminal.
pub struct ProgressDisplay {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ProgressDisplay {
    /// Shows `p`, naming files found already there as `skip_reason` says.
    pub fn start(p: Arc<Progress>, wanted: bool, skip_reason: &'static str) -> ProgressDisplay {
        let stop = Arc::new(AtomicBool::new(false));
        if !wanted || !std::io::stderr().is_terminal() {
            return ProgressDisplay { stop, thread: None };
        }
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template("{bytes}/{total_bytes} {wide_bar} {binary_bytes_per_sec} ETA {eta} {msg}")
                    .expect("a valid template"),
            );
            while !s.load(Ordering::Relaxed) {
                let x = p.snapshot();
                if x.total_files == 0 {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                bar.set_length(x.total_bytes);
                bar.set_position(x.done_bytes.max(x.sent_bytes.min(x.total_bytes)));
                let more = if x.walk_done { "" } else { "+" };
                let skipped = match x.skipped_files {
                    0 => String::new(),
                    n => format!(", {n} ({}) already there ({skip_reason})", human(x.skipped_bytes)),
                };
                bar.set_message(format!("{}/{}{more} files{skipped}", x.done_files, x.total_files));
                std::thread::sleep(Duration::from_millis(200));
            }
            bar.finish_and_clear();
        });
        ProgressDisplay { stop, thread: Some(thread) }
    }

    pub fn finish(self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread {
            let _ = t.join();
        }
    }
}
