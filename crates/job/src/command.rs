//! The external transfer agent: a site's own tool — `cp`, `rsync`,
//! `globus-url-copy` — run once per file from the job's command template,
//! as DMOVER's transfer agent wrapped its grid client.
//!
//! `concurrency` worker threads take files from a channel and run the
//! command directly (no shell, so file names need no quoting). When the
//! destination is on this machine's (shared) file system (the template has
//! no `{host}`), the agent makes the parent directory first, makes empty
//! directories itself, and checks the copy's size afterwards; otherwise the
//! command's exit status is all it has to go by. Each outcome is reported
//! like the native agent's.

use crate::channel::{Failure, FileResult, WorkItem};
use crate::jobfile::AgentCommand;
use crate::Plan;
use crossbeam_channel::Sender;
use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Longest part of a failed command's stderr kept in its error message.
const STDERR_TAIL: usize = 400;

/// Worker threads running the command for each file fed to them.
pub struct Runner {
    pub feed: Sender<WorkItem>,
    workers: Vec<JoinHandle<()>>,
}

impl Runner {
    /// Starts `plan.concurrency` workers; `report` hears of each file's outcome.
    pub fn start(plan: &Plan, cmd: &AgentCommand, report: Arc<dyn Fn(FileResult) + Send + Sync>) -> Runner {
        let (feed, files) = crossbeam_channel::unbounded::<WorkItem>();
        let workers = (0..plan.concurrency.max(1))
            .map(|_| {
                let (files, plan, cmd, report) = (files.clone(), plan.clone(), cmd.clone(), report.clone());
                std::thread::spawn(move || {
                    for item in files {
                        let host = plan.hosts.get(item.host as usize).cloned().unwrap_or_default();
                        let outcome = copy_one(&plan, &cmd, &item, &host);
                        let host = (!host.is_empty()).then_some(host);
                        let error = outcome.err().map(|e| Failure::of(&e));
                        report(FileResult { path: item.path, host, skipped: false, error, untried: false });
                    }
                })
            })
            .collect();
        Runner { feed, workers }
    }

    /// Closes the feed and waits for the files in hand.
    pub fn end(self) {
        drop(self.feed);
        for w in self.workers {
            let _ = w.join();
        }
    }
}

/// Runs the command for one file.
fn copy_one(plan: &Plan, cmd: &AgentCommand, item: &WorkItem, host: &str) -> Result<()> {
    let src = plan.source_root.join(&item.path);
    let dst = format!("{}/{}", plan.dest.trim_end_matches('/'), item.path);
    let local = !cmd.uses_host();
    let io = |e: std::io::Error| Error::io(dst.as_str(), &e);
    if item.mode & dmover_proto::frame::FileMeta::TYPE == dmover_proto::frame::FileMeta::DIR {
        if !local {
            return Err(Error::new(ErrorKind::Usage, &item.path, "an empty directory cannot be sent by a command agent with {host}"));
        }
        return std::fs::create_dir_all(&dst).map_err(io);
    }
    if local {
        if let Some(parent) = std::path::Path::new(&dst).parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
    }
    let argv = cmd.argv(&src.to_string_lossy(), &dst, &item.path, host);
    let out = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| Error::new(ErrorKind::NotFound, &argv[0], format!("cannot run the agent command: {e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let err = err.trim();
        let mut start = err.len().saturating_sub(STDERR_TAIL);
        while !err.is_char_boundary(start) {
            start += 1;
        }
        let tail = &err[start..];
        return Err(Error::new(ErrorKind::Internal, &item.path, format!("`{}` failed ({}): {}", argv[0], out.status, tail)));
    }
    if local {
        let got = std::fs::metadata(&dst).map_err(io)?.len();
        if got != item.size {
            return Err(Error::new(
                ErrorKind::Verify,
                dst.as_str(),
                format!("`{}` left {got} bytes of {} at the destination", argv[0], item.size),
            ));
        }
    }
    Ok(())
}
