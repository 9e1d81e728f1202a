//! The batch script `dmover submit` gives to `sbatch`, and the submission.
//!
//! The script is short on purpose: `#SBATCH` lines for the resources the
//! job file asks for (flags on the command line override them), the output
//! file in the job's state directory, and one line that runs the process
//! manager, `dmover run JOB`, which starts the agents with `srun` itself.

use crate::jobfile::{check_line, Slurm};
use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// Quotes `s` for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"/._-+=:,@".contains(&b)) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Quotes `s` for an `#SBATCH` line: sbatch splits those at white space
/// and understands double quotes and backslashes (not single quotes). The
/// value must have passed [`check_line`](crate::jobfile::check_line).
pub fn sbatch_quote(s: &str) -> String {
    if !s.is_empty() && !s.contains(|c: char| c.is_whitespace() || c == '"' || c == '\\') {
        return s.to_string();
    }
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Renders the batch script for the job file at `job` (absolute), run by
/// the `dmover` binary at `exe`, with the state directory `state`; the
/// manager serves its pages on `metrics` if given. Every value that goes
/// on a line of its own is checked with [`check_line`](crate::jobfile::check_line) (the Slurm values
/// were checked where they were read, naming their key or flag; the job
/// file's path is checked here); the `exec` line's words are quoted.
pub fn render(job: &Path, exe: &Path, state: &Path, slurm: &Slurm, metrics: Option<&str>) -> Result<String> {
    check_line(&job.display().to_string()).map_err(|m| {
        Error::new(ErrorKind::Usage, "the job file's path", m).advised("rename the job file (or its directory) without control characters")
    })?;
    for (key, value) in [("slurm.partition", &slurm.partition), ("slurm.time", &slurm.time), ("slurm.account", &slurm.account)] {
        if let Some(v) = value {
            check_line(v).map_err(|m| Error::new(ErrorKind::Usage, key, m))?;
        }
    }
    let name = job.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "job".into());
    let mut s = String::from("#!/bin/bash\n");
    s += &format!("#SBATCH --job-name={}\n", sbatch_quote(&format!("dmover-{name}")));
    s += &format!("#SBATCH --nodes={}\n", slurm.nodes);
    s += &format!("#SBATCH --ntasks-per-node={}\n", slurm.tasks_per_node);
    if let Some(p) = &slurm.partition {
        s += &format!("#SBATCH --partition={}\n", sbatch_quote(p));
    }
    if let Some(t) = &slurm.time {
        s += &format!("#SBATCH --time={}\n", sbatch_quote(t));
    }
    if let Some(a) = &slurm.account {
        s += &format!("#SBATCH --account={}\n", sbatch_quote(a));
    }
    s += &format!("#SBATCH --output={}\n", sbatch_quote(&state.join("slurm-%j.out").display().to_string()));
    s += &format!("# Made by `dmover submit` from {}.\n", job.display());
    s += "# The process manager runs here and starts one transfer agent per task\n";
    s += "# on every node with srun; `dmover status` shows its progress.\n";
    let metrics = metrics.map(|m| format!(" --metrics {}", shell_quote(m))).unwrap_or_default();
    s += &format!("exec {} run{metrics} {}\n", shell_quote(&exe.display().to_string()), shell_quote(&job.display().to_string()));
    Ok(s)
}

/// The batch script as submitted, kept in the state directory so that a
/// job can submit itself again.
pub const SCRIPT: &str = "job.sbatch";

/// Submits `script` with `sbatch` and returns the job id.
pub fn submit(script: &str) -> Result<String> {
    let mut child =
        Command::new("sbatch").arg("--parsable").stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(
            |e| Error::new(ErrorKind::NotFound, "sbatch", format!("cannot run sbatch: {e}; is Slurm installed here and sbatch on PATH?")),
        )?;
    // An sbatch that refuses may exit before it reads the script: its exit
    // status and stderr say why, not the broken pipe.
    let written = child.stdin.take().expect("piped").write_all(script.as_bytes());
    let out = child.wait_with_output().map_err(|e| Error::io("sbatch", &e))?;
    if out.status.success() {
        written.map_err(|e| Error::io("sbatch", &e))?;
    } else {
        // sbatch's message, one line per reason: joined, so that the error
        // stays one readable line (escaped, a newline would show as `\n`).
        let err = String::from_utf8_lossy(&out.stderr);
        let why = err.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; ");
        return Err(Error::new(ErrorKind::Usage, "sbatch", format!("submission refused: {why}"))
            .advised("check that Slurm answers from this host (`sinfo`), and see the script with `dmover submit JOB --dry-run`"));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // --parsable prints "ID" or "ID;CLUSTER".
    let id = text.trim().split(';').next().unwrap_or("").to_string();
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::new(ErrorKind::Internal, "sbatch", format!("unexpected answer: {:?}", text.trim())));
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_only_what_needs_it() {
        assert_eq!(shell_quote("/a/b-c_d.toml"), "/a/b-c_d.toml");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(sbatch_quote("/a/slurm-%j.out"), "/a/slurm-%j.out");
        assert_eq!(sbatch_quote("a \"b\""), r#""a \"b\"""#);
    }

    #[test]
    fn script_has_the_resources_and_runs_the_manager() {
        let slurm =
            Slurm { nodes: 3, tasks_per_node: 2, partition: Some("debug".into()), time: Some("00:10:00".into()), ..Slurm::default() };
        let s = render(Path::new("/w/my job.toml"), Path::new("/bin/dmover"), Path::new("/w/my job.dmover"), &slurm, Some("0.0.0.0:9464"))
            .unwrap();
        assert!(s.starts_with("#!/bin/bash\n#SBATCH --job-name=\"dmover-my job\"\n"), "{s}");
        for line in ["#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=2", "#SBATCH --partition=debug", "#SBATCH --time=00:10:00"] {
            assert!(s.lines().any(|l| l == line), "{line} missing in\n{s}");
        }
        assert!(s.lines().any(|l| l == "#SBATCH --output=\"/w/my job.dmover/slurm-%j.out\""), "{s}");
        assert!(s.ends_with("exec /bin/dmover run --metrics 0.0.0.0:9464 '/w/my job.toml'\n"), "{s}");
        assert!(!s.contains("--account"));
    }

    /// Regression: a newline in a partition, an account or the job file's
    /// name was written raw into the script, and the line after it ran as
    /// a command in the batch job. Now each is refused, naming what holds it.
    #[test]
    fn values_with_newlines_are_refused_naming_their_key() {
        let injected = "debug\ntouch /tmp/owned";
        let (job, exe, state) = (Path::new("/w/j.toml"), Path::new("/bin/dmover"), Path::new("/w/j.dmover"));
        for key in ["slurm.partition", "slurm.time", "slurm.account"] {
            let mut slurm = Slurm::default();
            match key {
                "slurm.partition" => slurm.partition = Some(injected.into()),
                "slurm.time" => slurm.time = Some(injected.into()),
                _ => slurm.account = Some(injected.into()),
            }
            let e = render(job, exe, state, &slurm, None).expect_err(key);
            assert_eq!((e.kind, e.subject.as_str()), (ErrorKind::Usage, key), "{e}");
            assert!(e.message.contains("control character (\\n)"), "{e}");
        }
        let named = Path::new("/w/a\ntouch /tmp/owned\n.toml");
        let e = render(named, exe, &named.with_extension("dmover"), &Slurm::default(), None).expect_err("job name");
        assert_eq!((e.kind, e.subject.as_str()), (ErrorKind::Usage, "the job file's path"), "{e}");
        assert!(check_line("debug\r").is_err() && check_line("a\x1b[2J").is_err() && check_line("gpu a100").is_ok());
    }
}
