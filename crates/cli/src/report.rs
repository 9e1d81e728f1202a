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
    /// Files (and their bytes) this copy put in place at the destination,
    /// verified and durable: kept whatever failed besides.
    pub committed_files: u64,
    pub committed_bytes: u64,
    /// Files that are not at the destination because they failed (listed
    /// in `errors`, the first hundred, and counted here all).
    pub failed_files: u64,
    pub sent_bytes: u64,
    pub seconds: f64,
    #[serde(flatten)]
    pub rate: Rate,
    pub retries: u64,
    pub resent_blocks: u64,
    #[serde(serialize_with = "shares_by_host")]
    pub hosts: Vec<Share>,
    pub errors: Vec<FileError>,
    /// Failed files beyond those `errors` lists.
    pub errors_not_listed: u64,
    /// What was not copied because the copy does not take its kind (a
    /// symlink without `--links`, a device without `--devices`, a symlink
    /// leading out of the tree with `--safe-links`), and why.
    pub passed_over: Vec<FileError>,
    pub check: Check,
    /// Streams, goodput and round-trip time over time, when a tuner ran.
    pub timeline: Vec<TunePointReport>,
}

impl Report {
    pub fn from_stats(s: &Stats, flags: TransferFlags) -> Report {
        let seconds = s.nanos as f64 / 1e9;
        let check = Check::new(!s.errors.is_empty(), (s.files, s.bytes), (s.dest_files, s.dest_bytes), s.digests_match);
        let (there_files, there_bytes) =
            s.hosts.iter().fold((0u64, 0u64), |(f, b), h| (f.saturating_add(h.count), b.saturating_add(h.bytes)));
        Report {
            ok: check.passed,
            files: s.files,
            bytes: s.bytes,
            skipped_files: s.skipped_files,
            skipped_bytes: s.skipped_bytes,
            skipped_because: skip_reason(flags),
            committed_files: there_files.saturating_sub(s.skipped_files),
            committed_bytes: there_bytes.saturating_sub(s.skipped_bytes),
            failed_files: (s.errors.len() as u64).saturating_add(s.errors_not_listed),
            sent_bytes: s.sent_bytes,
            seconds,
            rate: Rate::new(s.files, s.bytes, seconds),
            retries: s.retries,
            resent_blocks: s.resent_blocks,
            hosts: s.hosts.clone(),
            errors: s.errors.clone(),
            errors_not_listed: s.errors_not_listed,
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
            "{} files, {} in {:.2} s ({}/s, {:.1} files/s)",
            self.files,
            human(self.bytes),
            self.seconds,
            human((self.rate.mb_per_s * 1e6) as u64),
            self.rate.files_per_s
        );
        if self.skipped_files > 0 {
            s += &format!("; {} files ({}) already there ({})", self.skipped_files, human(self.skipped_bytes), self.skipped_because);
        }
        if self.failed_files > 0 {
            s += &format!("; {} files ({}) committed, {} failed", self.committed_files, human(self.committed_bytes), self.failed_files);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What a host holds less what was already there is what the copy
    /// committed; every failure counts, listed or not, and the summary
    /// says both.
    #[test]
    fn a_report_counts_what_was_committed_and_what_failed() {
        let failed = FileError { path: "big".into(), kind: ErrorKind::NoSpace, message: "No space left on device".into() };
        let s = Stats {
            files: 110,
            bytes: 1000,
            skipped_files: 3,
            skipped_bytes: 30,
            hosts: vec![Share { name: "h".into(), count: 8, bytes: 100 }],
            errors: vec![failed],
            errors_not_listed: 101,
            ..Stats::default()
        };
        let r = Report::from_stats(&s, TransferFlags::SYNC);
        assert_eq!((r.committed_files, r.committed_bytes, r.failed_files), (5, 70, 102));
        assert_eq!(r.exit_code(), ErrorKind::NoSpace as i32);
        assert!(r.summary().contains("5 files (70 B) committed, 102 failed"), "{}", r.summary());
        let j: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!((&j["committed_files"], &j["failed_files"], &j["errors_not_listed"]), (&5.into(), &102.into(), &101.into()));
    }
}
