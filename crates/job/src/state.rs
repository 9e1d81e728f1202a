//! The state directory of a job (`NAME.dmover/` beside `NAME.toml`).
//!
//! * `progress.json` — rewritten (atomically) about twice a second while
//!   the job runs, and once more at the end: a [`JobReport`] with
//!   `state = "running"` ([`JobState::Running`]);
//! * `done.list` — one JSON string per line, the path of every file
//!   confirmed at the destination, appended as they are confirmed; a re-run
//!   of the job never sends these again;
//! * `report.json` and `report.txt` — the final report and its human summary;
//! * `runs.jsonl` — one line per run of the job (a job that stops at a
//!   checkpoint and is resubmitted has several): its Slurm job id, how it
//!   ended, the files it sent and the job it resubmitted;
//! * `job.sbatch` — the batch script as submitted (to submit it again);
//! * `slurm-JOBID.out` — the batch job's output, when submitted.
//!
//! `dmover status` reads these files and nothing else.

pub use dmover_engine::history::{Point, Rates};
pub use dmover_engine::progress::{Check, Rate};
use dmover_engine::{Error, Result};
pub use dmover_proto::frame::{FileError, Share};
use dmover_proto::path::printable;
use dmover_proto::ErrorKind;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

pub const PROGRESS: &str = "progress.json";
pub const DONE: &str = "done.list";
pub const REPORT: &str = "report.json";
pub const SUMMARY: &str = "report.txt";
pub const RUNS: &str = "runs.jsonl";

/// Where a job stands: running, or how its run ended. Reports spell it in
/// lower case (`"running"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    #[default]
    Running,
    /// Every file confirmed at the destination.
    Finished,
    /// Stopped before the time limit; a later run sends the rest.
    Checkpointed,
    Failed,
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            JobState::Running => "running",
            JobState::Finished => "finished",
            JobState::Checkpointed => "checkpointed",
            JobState::Failed => "failed",
        })
    }
}

/// Where a transfer agent stands. Reports spell it in lower case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AgentState {
    Running,
    Finished,
    /// Its connection ended before the job did.
    Lost,
}

/// One run of a job, as `runs.jsonl` records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunRecord {
    pub slurm_job_id: Option<String>,
    /// How the run ended: finished, checkpointed or failed.
    pub state: JobState,
    pub seconds: f64,
    /// Files this run confirmed at the destination.
    pub files: u64,
    pub bytes: u64,
    pub resubmitted_as: Option<String>,
}

/// One transfer agent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AgentReport {
    pub id: u32,
    pub node: String,
    /// Its Slurm task number (SLURM_PROCID), or its thread number.
    pub task: u32,
    pub pid: u32,
    pub state: AgentState,
    pub files: u64,
    pub bytes: u64,
    /// Why a lost agent stopped, when it could say so before it exited.
    #[serde(default)]
    pub error: Option<String>,
}

/// A file that could not be moved.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FailureReport {
    #[serde(flatten)]
    pub error: FileError,
    /// Agents that tried it.
    pub attempts: u32,
}

/// Progress while the job runs, and its report at the end.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct JobReport {
    pub state: JobState,
    pub job: String,
    pub slurm_job_id: Option<String>,
    /// Unix time the run started and the report was written.
    pub started_unix: u64,
    pub updated_unix: u64,
    pub seconds: f64,
    /// The file list is complete (so the totals are final).
    pub walk_done: bool,
    pub total_files: u64,
    pub total_bytes: u64,
    /// Confirmed at the destination, in this run or an earlier one.
    pub done_files: u64,
    pub done_bytes: u64,
    /// Of those, found already there (same size and mtime, or content)
    /// in this run.
    pub skipped_files: u64,
    pub skipped_bytes: u64,
    /// Of those, confirmed by an earlier run of the job (not sent again).
    pub earlier_files: u64,
    pub earlier_bytes: u64,
    pub failed_files: u64,
    /// Files given to another agent after a failure.
    pub retried_files: u64,
    /// Files given to another agent because theirs was lost.
    pub requeued_files: u64,
    /// Rate of what this run moved.
    #[serde(flatten)]
    pub rate: Rate,
    /// What this run had moved, over time (at most a few hundred points,
    /// spanning the whole run): files confirmed, and bytes as the agents
    /// sent them (not as files were confirmed, which made a large file a
    /// spike).
    #[serde(default)]
    pub timeline: Vec<Point>,
    pub nodes: Vec<Share>,
    pub hosts: Vec<Share>,
    pub agents: Vec<AgentReport>,
    pub failures: Vec<FailureReport>,
    pub check: Check,
    /// Why the job stopped, if it did not finish.
    pub error: Option<String>,
    /// The Slurm job submitted to go on after a checkpoint.
    pub resubmitted_as: Option<String>,
    /// The rate now and at its peak, from the timeline.
    #[serde(default)]
    pub rates: Rates,
}

impl JobReport {
    /// The exit code: 0 when the check passed, else the first failure's
    /// class, else 10 (verification failed).
    pub fn exit_code(&self) -> i32 {
        if self.check.passed || (self.state == JobState::Checkpointed && self.resubmitted_as.is_some()) {
            return 0;
        }
        if let Some(f) = self.failures.first() {
            return f.error.kind as i32;
        }
        ErrorKind::Verify as i32
    }

    /// The human summary.
    pub fn summary(&self) -> String {
        let h = dmover_engine::progress::human;
        // Names and messages came from agents, servers and file systems: escaped.
        let mut s = format!("job {}: {} after {:.1} s", printable(&self.job), self.state, self.seconds);
        if let Some(id) = &self.slurm_job_id {
            s += &format!(" (Slurm job {id})");
        }
        let more = if self.walk_done { "" } else { "+ (still listing)" };
        s += &format!(
            "\nfiles: {}/{}{more} done, {} of {}; {} failed; {}/s, {:.1} files/s",
            self.done_files,
            self.total_files,
            h(self.done_bytes),
            h(self.total_bytes),
            self.failed_files,
            h((self.rate.mb_per_s * 1e6) as u64),
            self.rate.files_per_s
        );
        if let Some(line) = sparkline(&self.timeline) {
            let (now, peak) = (h(self.rates.now_bytes_per_s as u64), h(self.rates.peak_bytes_per_s as u64));
            s += &format!("\nrate over the run: {line} (peak {peak}/s");
            s += &if self.state == JobState::Running { format!(", now {now}/s)") } else { ")".into() };
        }
        if self.earlier_files > 0 {
            s += &format!("\n  done by an earlier run: {} files, {}", self.earlier_files, h(self.earlier_bytes));
        }
        if self.skipped_files > 0 {
            s += &format!("\n  already at the destination: {} files, {}", self.skipped_files, h(self.skipped_bytes));
        }
        if self.retried_files + self.requeued_files > 0 {
            s += &format!("\n  given to another agent: {} after a failure, {} from lost agents", self.retried_files, self.requeued_files);
        }
        let shares = |title: &str, v: &[Share]| {
            let total: u64 = v.iter().map(|x| x.count).sum::<u64>().max(1);
            let mut s = format!("\n{title}:");
            for x in v {
                s += &format!(
                    "\n  {}: {} files ({:.0}%), {}",
                    printable(&x.name),
                    x.count,
                    100.0 * x.count as f64 / total as f64,
                    h(x.bytes)
                );
            }
            s
        };
        if !self.nodes.is_empty() {
            s += &shares("nodes", &self.nodes);
        }
        if !self.hosts.is_empty() {
            s += &shares("destination hosts", &self.hosts);
        }
        let lost: Vec<&AgentReport> = self.agents.iter().filter(|a| a.state == AgentState::Lost).collect();
        s += &format!("\nagents: {} ({} lost)", self.agents.len(), lost.len());
        for a in lost {
            s += &format!("\n  lost: agent {} on {} (task {}, pid {}) after {} files", a.id, printable(&a.node), a.task, a.pid, a.files);
            if let Some(e) = &a.error {
                s += &format!(": {}", printable(e));
            }
        }
        for f in self.failures.iter().take(20) {
            let e = &f.error;
            s += &format!("\nfailed: {} ({}, {} attempts): {}", printable(&e.path), e.kind.name(), f.attempts, printable(&e.message));
        }
        if self.failures.len() > 20 {
            s += &format!("\n  ... and {} more failures (see report.json)", self.failures.len() - 20);
        }
        if let Some(e) = &self.error {
            s += &format!("\nstopped: {}", printable(e));
        }
        if self.state == JobState::Checkpointed {
            let left = self.total_files.saturating_sub(self.done_files + self.failed_files);
            s += &format!("\ncheckpointed before the time limit with {left} files left");
            s += &match &self.resubmitted_as {
                Some(id) => format!("; resubmitted as Slurm job {id}"),
                None => "; run the job again to send them".into(),
            };
        }
        if !matches!(self.state, JobState::Running | JobState::Checkpointed) {
            s += if self.check.passed {
                "\ncheck: passed (every file verified at the destination)"
            } else {
                "\ncheck: FAILED (re-run the job to send what is missing)"
            };
        }
        s
    }
}

/// Columns of the rate's sparkline at most.
const SPARK_COLUMNS: usize = 40;

/// The rate over a timeline as a line of block characters, one column per
/// stretch of the run (a column's height is the bytes moved in it); None
/// with too few points to draw. The figures beside it are the report's
/// [`Rates`], as everywhere else.
fn sparkline(timeline: &[Point]) -> Option<String> {
    let (first, last) = (timeline.first()?, timeline.last()?);
    let span = last.t - first.t;
    if timeline.len() < 3 || span <= 0.0 {
        return None;
    }
    let columns = (timeline.len() - 1).min(SPARK_COLUMNS);
    let width = span / columns as f64;
    // Bytes moved in each column, spread over the points that fall in it.
    let mut moved = vec![0f64; columns];
    for w in timeline.windows(2) {
        let column = (((w[1].t - first.t) / width).ceil() as usize).clamp(1, columns) - 1;
        moved[column] += w[1].bytes.saturating_sub(w[0].bytes) as f64;
    }
    let peak = moved.iter().copied().fold(0.0, f64::max);
    if peak <= 0.0 {
        return None;
    }
    const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    Some(moved.iter().map(|m| BARS[((m / peak) * 7.0).round() as usize]).collect())
}

/// The state directory of a job.
pub struct StateDir {
    pub dir: PathBuf,
}

impl StateDir {
    pub fn new(dir: &Path) -> StateDir {
        StateDir { dir: dir.to_path_buf() }
    }

    /// Creates the directory if needed.
    pub fn create(&self) -> Result<()> {
        fs::create_dir_all(&self.dir).map_err(|e| Error::io(self.dir.display().to_string(), &e))
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The paths an earlier run confirmed (a torn last line is ignored).
    pub fn load_done(&self) -> Result<HashSet<String>> {
        let p = self.path(DONE);
        let f = match File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashSet::new()),
            Err(e) => return Err(Error::io(p.display().to_string(), &e)),
        };
        let mut done = HashSet::new();
        for line in BufReader::new(f).lines() {
            let line = line.map_err(|e| Error::io(p.display().to_string(), &e))?;
            if let Ok(path) = serde_json::from_str::<String>(&line) {
                done.insert(path);
            }
        }
        Ok(done)
    }

    /// Opens the done list for appending.
    pub fn done_writer(&self) -> Result<DoneList> {
        let p = self.path(DONE);
        let f = OpenOptions::new().create(true).append(true).open(&p).map_err(|e| Error::io(p.display().to_string(), &e))?;
        Ok(DoneList { out: BufWriter::new(f) })
    }

    /// Writes `name` atomically (a temporary file renamed into place).
    fn write_atomic(&self, name: &str, data: &[u8]) -> Result<()> {
        let p = self.path(name);
        let tmp = self.path(&format!(".{name}.tmp"));
        let io = |e: std::io::Error| Error::io(p.display().to_string(), &e);
        fs::write(&tmp, data).map_err(io)?;
        fs::rename(&tmp, &p).map_err(io)
    }

    pub fn write_progress(&self, r: &JobReport) -> Result<()> {
        self.write_atomic(PROGRESS, &serde_json::to_vec_pretty(r).expect("a report serializes"))
    }

    /// Writes the final report, its summary, and the progress file once more.
    pub fn write_report(&self, r: &JobReport) -> Result<()> {
        self.write_progress(r)?;
        self.write_atomic(REPORT, &serde_json::to_vec_pretty(r).expect("a report serializes"))?;
        self.write_atomic(SUMMARY, format!("{}\n", r.summary()).as_bytes())
    }

    /// Appends a run's record to `runs.jsonl`.
    pub fn add_run(&self, r: &RunRecord) -> Result<()> {
        let p = self.path(RUNS);
        let mut f = OpenOptions::new().create(true).append(true).open(&p).map_err(|e| Error::io(p.display().to_string(), &e))?;
        let line = serde_json::to_string(r).expect("a record serializes");
        writeln!(f, "{line}").map_err(|e| Error::io(p.display().to_string(), &e))
    }

    /// The runs recorded so far (a torn or unreadable line is skipped).
    pub fn runs(&self) -> Vec<RunRecord> {
        let Ok(text) = fs::read_to_string(self.path(RUNS)) else { return Vec::new() };
        text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }

    /// The batch script kept at submission, if any.
    pub fn script(&self) -> Option<String> {
        fs::read_to_string(self.path(crate::sbatch::SCRIPT)).ok()
    }

    /// A report from an earlier run is stale once a new run starts.
    pub fn clear_report(&self) {
        let _ = fs::remove_file(self.path(REPORT));
        let _ = fs::remove_file(self.path(SUMMARY));
    }

    /// The final report if the job ended, else its latest progress.
    pub fn read(&self) -> Result<JobReport> {
        for name in [REPORT, PROGRESS] {
            let p = self.path(name);
            match fs::read(&p) {
                Ok(b) => {
                    return serde_json::from_slice(&b)
                        .map_err(|e| Error::new(ErrorKind::Internal, p.display().to_string(), format!("unreadable: {e}")))
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io(p.display().to_string(), &e)),
            }
        }
        Err(Error::new(
            ErrorKind::NotFound,
            self.dir.display().to_string(),
            "no progress recorded: the job has not started yet (or ran from another directory)",
        ))
    }
}

/// The done list, open for appending.
pub struct DoneList {
    out: BufWriter<File>,
}

impl DoneList {
    pub fn add(&mut self, path: &str) -> Result<()> {
        let line = serde_json::to_string(path).expect("a string serializes");
        writeln!(self.out, "{line}").map_err(|e| Error::io(DONE, &e))
    }

    /// Pushes what was appended to the file (not necessarily to the disk).
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|e| Error::io(DONE, &e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn done_list_round_trips_odd_names_and_ignores_a_torn_line() {
        let t = tempfile::tempdir().unwrap();
        let s = StateDir::new(t.path());
        let mut w = s.done_writer().unwrap();
        for p in ["a/b", "new\nline", "quote\"d"] {
            w.add(p).unwrap();
        }
        w.flush().unwrap();
        drop(w);
        let mut f = OpenOptions::new().append(true).open(t.path().join(DONE)).unwrap();
        f.write_all(b"\"torn").unwrap();
        let done = s.load_done().unwrap();
        assert_eq!(done.len(), 3);
        assert!(done.contains("new\nline") && done.contains("quote\"d"));
    }

    #[test]
    fn report_prefers_the_final_one_and_exit_codes_follow_failures() {
        let t = tempfile::tempdir().unwrap();
        let s = StateDir::new(t.path());
        assert_eq!(s.read().unwrap_err().kind, ErrorKind::NotFound);
        let mut r = JobReport { state: JobState::Running, ..Default::default() };
        s.write_progress(&r).unwrap();
        assert_eq!(s.read().unwrap().state, JobState::Running);
        r.state = JobState::Failed;
        let error = FileError { path: "x".into(), kind: ErrorKind::Permission, message: "m".into() };
        r.failures.push(FailureReport { error, attempts: 3 });
        s.write_report(&r).unwrap();
        let text = fs::read_to_string(t.path().join(REPORT)).unwrap();
        assert!(text.contains(r#""state": "failed""#) && text.contains(r#""kind": "permission-denied""#), "{text}");
        let back = s.read().unwrap();
        assert_eq!(back, r);
        assert_eq!(back.exit_code(), 4);
        assert!(fs::read_to_string(t.path().join(SUMMARY)).unwrap().contains("check: FAILED"));
    }

    #[test]
    fn shares_failures_and_rates_are_spelled_as_reports_always_spelled_them() {
        let error = FileError { path: "x".into(), kind: ErrorKind::NotFound, message: "m".into() };
        let r = JobReport {
            rate: Rate::new(4, 3_000_000, 2.0),
            timeline: vec![Point { t: 0.5, bytes: 7, files: 1 }],
            nodes: vec![Share { name: "n1".into(), count: 2, bytes: 5 }],
            failures: vec![FailureReport { error, attempts: 2 }],
            ..Default::default()
        };
        let text = serde_json::to_string(&r).unwrap();
        for part in [
            r#""mb_per_s":1.5,"files_per_s":2.0,"timeline":[{"t":0.5,"bytes":7,"files":1}],"nodes":[{"name":"n1","files":2,"bytes":5}]"#,
            r#""failures":[{"path":"x","kind":"not-found","message":"m","attempts":2}]"#,
        ] {
            assert!(text.contains(part), "{part} not in {text}");
        }
        assert_eq!(serde_json::from_str::<JobReport>(&text).unwrap(), r);
    }

    /// Regression: names and messages from agents and servers were printed
    /// raw by `dmover run` and `dmover status`: an escape sequence and a
    /// forged `check: passed` line reached the terminal.
    #[test]
    fn the_summary_escapes_names_and_messages() {
        let forged = "\x1b[1A\ncheck: passed (every file verified at the destination)";
        let error = FileError { path: format!("x{forged}"), kind: ErrorKind::NotFound, message: forged.into() };
        let share = Share { name: format!("h{forged}"), count: 1, bytes: 1 };
        let agent = AgentReport {
            id: 1,
            node: format!("n{forged}"),
            task: 0,
            pid: 1,
            state: AgentState::Lost,
            files: 0,
            bytes: 0,
            error: Some(forged.into()),
        };
        let r = JobReport {
            job: format!("j{forged}"),
            state: JobState::Failed,
            nodes: vec![share.clone()],
            hosts: vec![share],
            agents: vec![agent],
            failures: vec![FailureReport { error, attempts: 1 }],
            error: Some(forged.into()),
            ..Default::default()
        };
        let s = r.summary();
        assert!(!s.contains('\x1b'), "{s:?}");
        assert!(!s.lines().any(|l| l.starts_with("check: passed")), "{s}");
        assert_eq!(s.matches("\\u{1b}[1A\\ncheck: passed").count(), 8, "{s}");
    }

    #[test]
    fn the_rate_is_drawn_as_a_sparkline() {
        let p = |t: f64, bytes: u64| Point { t, bytes, files: 0 };
        assert_eq!(sparkline(&[]), None);
        assert_eq!(sparkline(&[p(0.0, 0), p(1.0, 10)]), None, "too few points");
        assert_eq!(sparkline(&[p(0.0, 0), p(1.0, 0), p(2.0, 0)]), None, "nothing moved");
        // 1 MB/s, then 2 MB/s, then nothing, then 2 MB/s again.
        let t = [p(0.0, 0), p(1.0, 1_000_000), p(2.0, 3_000_000), p(3.0, 3_000_000), p(4.0, 5_000_000)];
        let line = sparkline(&t).unwrap();
        assert_eq!(line, "▅█▁█");
        // Many points: at most SPARK_COLUMNS columns, the same total height.
        let many: Vec<Point> = (0..=1000).map(|i| p(i as f64, i * 1000)).collect();
        let line = sparkline(&many).unwrap();
        assert_eq!(line, "█".repeat(SPARK_COLUMNS), "an even rate is even");
    }

    #[test]
    fn states_are_spelled_as_reports_always_spelled_them() {
        for (state, name) in [
            (JobState::Running, "running"),
            (JobState::Finished, "finished"),
            (JobState::Checkpointed, "checkpointed"),
            (JobState::Failed, "failed"),
        ] {
            assert_eq!(serde_json::to_value(state).unwrap(), name);
            assert_eq!(state.to_string(), name);
        }
        for (state, name) in [(AgentState::Running, "running"), (AgentState::Finished, "finished"), (AgentState::Lost, "lost")] {
            assert_eq!(serde_json::to_value(state).unwrap(), name);
        }
        let line = r#"{"slurm_job_id":"7","state":"checkpointed","seconds":1.5,"files":2,"bytes":3,"resubmitted_as":"8"}"#;
        let run: RunRecord = serde_json::from_str(line).unwrap();
        assert_eq!(run.state, JobState::Checkpointed);
        assert_eq!(serde_json::to_string(&run).unwrap(), line);
    }
}
