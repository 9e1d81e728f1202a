//! The job file: what a user writes to describe a batch transfer, and the
//! checks made before anything runs or is submitted.
//!
//! A job file is TOML (see the README for a full example). It names, as
//! DMOVER's batch script did, a source root and relative globs, destination
//! hosts and a destination root, and the parallelism; then the Slurm
//! resources and which transfer agent to run. Parsing is strict: an unknown
//! key, a missing field or a value of the wrong type is an error that names
//! the line. [`JobFile`] is what the user typed; the resolved, checked
//! form is [`crate::Plan`].

use dmover_engine::session::{self, Credential};
use dmover_engine::source::{self, Event};
use dmover_engine::storage::Storage;
use dmover_engine::Error;
use dmover_proto::ErrorKind;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// A job file as written.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    /// Absolute directory the sources are relative to (DMOVER's SrcDirRoot),
    /// or the objects below a key prefix of an S3 bucket, `s3://BUCKET[/prefix]`.
    pub source_root: String,
    /// URL of the S3 server of an `s3://` source_root (else AWS_ENDPOINT_URL,
    /// the profile's endpoint_url, or AWS itself), as `dmover cp --s3-endpoint`.
    pub s3_endpoint: Option<String>,
    /// Files, directories or globs below `source_root` (SrcRelPath); each
    /// file keeps its path below `source_root` at the destination.
    pub sources: Vec<String>,
    /// `host[:port]` of each destination server (`dmover serve`); files are
    /// spread over them by a hash of their path.
    pub dest_hosts: Vec<String>,
    /// `EXPORT/path` on every destination host (DestDirRoot).
    pub dest_root: String,
    /// File with the servers' token (else the DMOVER_TOKEN environment variable).
    pub token_file: Option<String>,
    /// File with the page token the job's metrics and status page ask for
    /// (`dmover run --metrics`, `dmover status --web`): needed off
    /// loopback, and never the servers' token.
    pub metrics_token_file: Option<String>,
    /// Reach `dest_hosts` over ssh (`[user@]host` each; `dest_root` a path
    /// there, absolute or relative to the home directory) instead of
    /// `dmover serve` on them.
    pub ssh: Option<Ssh>,
    /// `native` (dmover's engine) or a command template such as
    /// `rsync -a {src} {dst}`.
    #[serde(default = "native")]
    pub agent: String,
    #[serde(default)]
    pub transfer: Transfer,
    #[serde(default)]
    pub slurm: Slurm,
}

fn native() -> String {
    NATIVE.to_string()
}

/// How agents reach destination hosts over ssh, as `dmover cp` does with
/// `--ssh` and `--remote-dmover`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Ssh {
    /// The ssh command, with its options.
    pub command: String,
    /// The dmover to run on the hosts.
    pub remote_dmover: String,
}

impl Default for Ssh {
    fn default() -> Ssh {
        Ssh { command: "ssh".into(), remote_dmover: "dmover".into() }
    }
}

/// The agent kind that sends with dmover's own engine.
pub const NATIVE: &str = "native";

/// How each transfer agent moves its files.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Transfer {
    /// Data connections from each agent to each destination host.
    pub streams: u32,
    /// Files each agent reads and sends at once.
    pub concurrency: u32,
    /// Send every file, also those whose size and mtime match at the
    /// destination (which are skipped otherwise).
    pub ignore_times: bool,
    /// Skip files whose size and mtime match at the destination: what a
    /// job does unless `ignore_times` (kept for job files that say it).
    pub sync: bool,
    /// Skip files whose content matches at the destination, instead of
    /// those whose size and mtime match.
    pub checksum: bool,
    /// Block size (the unit of sending and checksumming), e.g. `1M`.
    pub block_size: String,
    /// Staging memory of each agent, e.g. `64M`.
    pub staging: String,
    /// Sending rate limit of each agent in bytes per second (`0`: none).
    pub bwlimit: String,
    /// Agents that may try a file before it is reported failed.
    pub attempts: u32,
}

impl Default for Transfer {
    fn default() -> Transfer {
        Transfer {
            streams: 4,
            concurrency: 8,
            ignore_times: false,
            sync: false,
            checksum: false,
            block_size: "1M".into(),
            staging: "64M".into(),
            bwlimit: "0".into(),
            attempts: 3,
        }
    }
}

/// The Slurm allocation the job asks for.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Slurm {
    /// Nodes, each running `tasks_per_node` transfer agents.
    pub nodes: u32,
    pub tasks_per_node: u32,
    /// Partition (the site's default if absent).
    pub partition: Option<String>,
    /// Time limit in a Slurm format: `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`,
    /// `D-HH:MM` or `D-HH:MM:SS` (the partition's default if absent).
    pub time: Option<String>,
    /// Account to charge, if the site wants one.
    pub account: Option<String>,
    /// How long before the allocation's end the manager stops handing out
    /// files and lets the agents finish theirs (a Slurm time; default a
    /// tenth of the time left when the run starts, between 30 s and 10
    /// minutes).
    pub checkpoint_before: Option<String>,
    /// Submit the job again when it stopped at a checkpoint, to finish.
    pub resubmit: bool,
}

impl Default for Slurm {
    fn default() -> Slurm {
        Slurm { nodes: 1, tasks_per_node: 1, partition: None, time: None, account: None, checkpoint_before: None, resubmit: false }
    }
}

fn usage(subject: impl Into<String>, message: impl Into<String>) -> Error {
    Error::new(ErrorKind::Usage, subject, message)
}

impl JobFile {
    /// Reads and parses a job file; every syntax error, unknown key and
    /// missing field is reported with its line.
    pub fn load(path: &Path) -> Result<JobFile, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path.display().to_string(), &e))?;
        JobFile::parse(&text).map_err(|m| usage(path.display().to_string(), m))
    }

    /// Parses and checks the fields that need nothing outside the text.
    pub fn parse(text: &str) -> Result<JobFile, String> {
        let job: JobFile = toml::from_str(text).map_err(|e| match e.span() {
            // One line: where, then what (toml's own message is a multi-line picture).
            Some(span) if !e.message().starts_with("missing field") => {
                let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                format!("line {line}: {}", e.message())
            }
            _ => e.message().to_string(),
        })?;
        job.check()?;
        Ok(job)
    }

    /// Whether the sources are objects of an S3 bucket.
    pub fn s3_source(&self) -> bool {
        self.source_root.starts_with(dmover_engine::storage::S3_SCHEME)
    }

    fn check(&self) -> Result<(), String> {
        if !self.source_root.starts_with('/') && !self.s3_source() {
            return Err(format!(
                "source_root = {:?}: give an absolute path (the agents run on other nodes) or s3://BUCKET[/prefix]",
                self.source_root
            ));
        }
        if self.s3_endpoint.is_some() && !self.s3_source() {
            return Err("s3_endpoint is for a source_root in S3 (s3://BUCKET[/prefix]); remove it".into());
        }
        if self.source_root.contains(['*', '?', '[', '{']) {
            return Err(format!(
                "source_root = {:?}: the root may not contain glob characters; put the pattern in sources",
                self.source_root
            ));
        }
        if self.sources.is_empty() {
            return Err("sources is empty: name at least one file, directory or glob below source_root".into());
        }
        for s in &self.sources {
            if s.starts_with('/') || s.split('/').any(|c| c == "..") || s.contains('\0') {
                return Err(format!("sources: {s:?} must be relative to source_root, without '..'"));
            }
        }
        let command = self.command().map_err(|m| format!("agent = {:?}: {m}", self.agent))?;
        match &command {
            None => {
                if self.dest_hosts.is_empty() {
                    return Err("dest_hosts is empty: name at least one destination server (host or host:port)".into());
                }
                if self.ssh.is_none() && (self.dest_root.is_empty() || self.dest_root.starts_with('/')) {
                    return Err(format!("dest_root = {:?}: give EXPORT/path as the destination servers export it", self.dest_root));
                }
            }
            Some(_) if self.ssh.is_some() => {
                return Err("[ssh] is for the native agent; a command agent reaches its hosts its own way".into());
            }
            Some(_) if self.s3_source() => {
                return Err(format!(
                    "agent = {:?}: a command agent is given each file as a local path ({{src}}), and source_root {:?} \
                     is in S3; use agent = \"native\", or copy the objects to a file system first",
                    self.agent, self.source_root
                ));
            }
            Some(c) => {
                if c.uses_host() && self.dest_hosts.is_empty() {
                    return Err("dest_hosts is empty, but the agent command uses {host}".into());
                }
                if self.dest_root.is_empty() {
                    return Err("dest_root is empty: give the directory {dst} paths are made in".into());
                }
            }
        }
        let t = &self.transfer;
        if !(1..=64).contains(&t.streams) {
            return Err(format!("transfer.streams = {}: must be between 1 and 64", t.streams));
        }
        if !(1..=64).contains(&t.concurrency) {
            return Err(format!("transfer.concurrency = {}: must be between 1 and 64", t.concurrency));
        }
        if t.ignore_times && (t.sync || t.checksum) {
            let other = if t.sync { "sync" } else { "checksum" };
            return Err(format!(
                "transfer.ignore_times sends every file, and transfer.{other} skips some: choose one (remove transfer.{other})"
            ));
        }
        if t.attempts == 0 {
            return Err("transfer.attempts must be at least 1".into());
        }
        let s = &self.slurm;
        if s.nodes == 0 || s.tasks_per_node == 0 {
            return Err("slurm.nodes and slurm.tasks_per_node must be at least 1".into());
        }
        for (key, value) in [("slurm.partition", &s.partition), ("slurm.account", &s.account)] {
            if let Some(v) = value {
                check_line(v).map_err(|m| format!("{key} = {m}"))?;
            }
        }
        let limit = match &s.time {
            Some(time) => Some(parse_time(time).map_err(|m| format!("slurm.time = {time:?}: {m}"))?),
            None => None,
        };
        if let Some(c) = &s.checkpoint_before {
            let before = parse_time(c).map_err(|m| format!("slurm.checkpoint_before = {c:?}: {m}"))?;
            if limit.is_some_and(|l| before >= l) {
                return Err(format!("slurm.checkpoint_before = {c:?} is not shorter than slurm.time"));
            }
        }
        Ok(())
    }

    /// The external agent's command, or None for the native agent.
    pub fn command(&self) -> Result<Option<AgentCommand>, String> {
        if self.agent == NATIVE {
            return Ok(None);
        }
        AgentCommand::parse(&self.agent).map(Some)
    }
}

/// An external transfer agent: a command template run once per file, as
/// DMOVER's transfer agent wrapped `globus-url-copy`. The template is split
/// at white space (no shell runs it); in each word `{src}` becomes the
/// source file's absolute path, `{dst}` its path below `dest_root`, `{rel}`
/// its path below the roots and `{host}` the file's destination host (one
/// of `dest_hosts`, chosen by the manager).
#[derive(Debug, Clone, PartialEq)]
pub struct AgentCommand {
    pub words: Vec<String>,
}

impl AgentCommand {
    pub fn parse(template: &str) -> Result<AgentCommand, String> {
        let words: Vec<String> = template.split_whitespace().map(str::to_string).collect();
        if words.is_empty() {
            return Err("empty command; use \"native\" or a template such as \"rsync -a {src} {dst}\"".into());
        }
        if !template.contains("{src}") || !template.contains("{dst}") {
            return Err("a command template needs both {src} and {dst}, e.g. \"cp {src} {dst}\"".into());
        }
        if words[0].contains('{') {
            return Err("the first word must be the program to run".into());
        }
        Ok(AgentCommand { words })
    }

    /// Whether the destination is on another host (`{host}`); otherwise
    /// `{dst}` is a path on this machine's (shared) file system.
    pub fn uses_host(&self) -> bool {
        self.words.iter().any(|w| w.contains("{host}"))
    }

    /// The command line for one file.
    pub fn argv(&self, src: &str, dst: &str, rel: &str, host: &str) -> Vec<String> {
        self.words.iter().map(|w| w.replace("{src}", src).replace("{dst}", dst).replace("{rel}", rel).replace("{host}", host)).collect()
    }

    /// Checks that the program can be found.
    pub fn check_program(&self) -> Result<(), Error> {
        let prog = &self.words[0];
        let found = if prog.contains('/') {
            Path::new(prog).is_file()
        } else {
            std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file()))
        };
        if found {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::NotFound,
                prog.clone(),
                "the agent command's program is not on PATH; install it or give its full path",
            ))
        }
    }
}

/// Checks that `s` can go on one line of the batch script: a control character
/// (a newline above all) would end its `#SBATCH` or comment line and start
/// another, which the batch job's shell would run as a command. No quoting
/// helps there, so such a value is refused.
pub fn check_line(s: &str) -> Result<(), String> {
    match s.chars().find(|c| c.is_control()) {
        Some(c) => Err(format!(
            "{:?} holds a control character ({}), which would end its line of the batch script; remove it",
            s,
            c.escape_debug()
        )),
        None => Ok(()),
    }
}

/// Seconds in a Slurm time limit (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`,
/// `D-HH:MM`, `D-HH:MM:SS`).
pub fn parse_time(s: &str) -> Result<u64, String> {
    let bad = || "expected MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS".to_string();
    let num = |x: &str| x.parse::<u64>().map_err(|_| bad());
    let (days, rest) = match s.split_once('-') {
        Some((d, r)) => (Some(num(d)?), r),
        None => (None, s),
    };
    let parts: Vec<u64> = rest.split(':').map(num).collect::<Result<_, _>>()?;
    let secs = match (days, parts.as_slice()) {
        (None, [m]) => m * 60,
        (None, [m, s]) => m * 60 + s,
        (None, [h, m, s]) => h * 3600 + m * 60 + s,
        (Some(d), [h]) => d * 86400 + h * 3600,
        (Some(d), [h, m]) => d * 86400 + h * 3600 + m * 60,
        (Some(d), [h, m, s]) => d * 86400 + h * 3600 + m * 60 + s,
        _ => return Err(bad()),
    };
    if secs == 0 {
        return Err("a time limit must be more than zero".into());
    }
    Ok(secs)
}

/// The path of `spec` below `root`, as the walker takes it (`root` is
/// empty for the whole of a bucket).
pub fn spec_path(root: &Path, spec: &str) -> String {
    let root = root.display().to_string();
    let root = root.trim_end_matches('/');
    let spec = if spec == "." { "" } else { spec };
    match (root.is_empty(), spec.is_empty()) {
        (true, _) => spec.to_string(),
        (false, true) => format!("{root}/"),
        (false, false) => format!("{root}/{spec}"),
    }
}

/// Checks that the source root exists in `store` and that every source
/// names at least one file, looking no further than each source's first file.
pub fn check_sources(store: &dyn Storage, root: &Path, sources: &[String]) -> Result<(), Error> {
    let label = store.display(root);
    let advice = "source_root must be a directory visible from every node, or s3://BUCKET/prefix with objects below the prefix";
    let refused = match store.stat(root) {
        Ok(s) if s.is_dir() => None,
        Ok(_) => Some(Error::new(ErrorKind::NotFound, &label, "source_root is not a directory")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Some(Error::new(ErrorKind::NotFound, &label, "source_root: no such directory, nor objects below this prefix"))
        }
        Err(e) => Some(Error::io(&label, &e)),
    };
    if let Some(e) = refused {
        return Err(e.advised(advice));
    }
    for s in sources {
        let mut found = false;
        let mut err = None;
        source::walk(store, &[spec_path(root, s)], &mut |ev| match ev {
            Event::File(_) => {
                found = true;
                false
            }
            Event::Error(e) => {
                err = Some(e);
                false
            }
            Event::Link(_) | Event::Dir(_) | Event::Special(_) => true,
        });
        let nothing = || {
            Error::new(ErrorKind::NotFound, label.clone(), format!("sources: {s:?} matches nothing below it"))
                .advised("check the pattern: sources are relative to source_root")
        };
        match err {
            Some(e) if e.kind == ErrorKind::NotFound => return Err(nothing()),
            Some(e) => return Err(Error::new(e.kind, e.subject, format!("sources: {s:?}: {}", e.message))),
            None if !found => return Err(nothing()),
            None => {}
        }
    }
    Ok(())
}

/// Checks that every destination host answers, accepts its credential and
/// would take files into `dest` (`EXPORT/path`): the export exists and the
/// path stays inside it. It asks each host for a ticket to receive there,
/// which checks exactly that, and lets the ticket expire unused. `hosts`
/// name the hosts of `creds` in messages.
pub fn check_hosts(hosts: &[String], creds: &[(String, Credential)], dest: &str) -> Result<(), Error> {
    let checks: Vec<_> = creds
        .iter()
        .map(|(addr, cred)| {
            let (addr, cred, dest) = (addr.clone(), cred.clone(), dest.to_string());
            std::thread::spawn(move || session::grant(&addr, &cred, &dest).map(drop))
        })
        .collect();
    for (h, c) in hosts.iter().zip(checks) {
        if let Err(e) = c.join().unwrap_or_else(|_| Err(Error::internal("host check panicked"))) {
            let (what, advice) = match e.kind {
                ErrorKind::Auth => ("does not accept the token".to_string(), "use the token file its `dmover serve --token-file` reads"),
                ErrorKind::Refused => (
                    format!("refuses dest_root {dest:?} ({})", e.message),
                    "dest_root is EXPORT/path, EXPORT being a NAME the server's `dmover serve --export NAME=DIR` gives",
                ),
                _ => (
                    format!("is unreachable ({})", e.message),
                    "check that `dmover serve` runs there and listens on an address the nodes can reach (--listen 0.0.0.0:PORT)",
                ),
            };
            return Err(Error::new(e.kind, h.clone(), format!("destination host {what}")).advised(advice));
        }
    }
    Ok(())
}

/// Where a job keeps its state: `NAME.dmover/` beside `NAME.toml`.
pub fn state_dir(job: &Path) -> PathBuf {
    let stem = job.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "job".into());
    job.with_file_name(format!("{stem}.dmover"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmover_engine::storage;

    const MINIMAL: &str = r#"
source_root = "/data"
sources = ["*.h5"]
dest_hosts = ["dtn1"]
dest_root = "scratch/in"
"#;

    #[test]
    fn minimal_job_gets_defaults() {
        let j = JobFile::parse(MINIMAL).unwrap();
        assert_eq!(j.agent, "native");
        assert_eq!(j.transfer, Transfer::default());
        assert_eq!(j.slurm.nodes, 1);
        assert_eq!(j.slurm.tasks_per_node, 1);
    }

    #[test]
    fn unknown_keys_and_missing_fields_name_the_key() {
        let e = JobFile::parse(&format!("{MINIMAL}sorce = 1\n")).unwrap_err();
        assert!(e.contains("unknown field `sorce`"), "{e}");
        let e = JobFile::parse(&format!("{MINIMAL}[slurm]\nnode = 3\n")).unwrap_err();
        assert!(e.contains("unknown field `node`") && e.contains("line"), "{e}");
        let e = JobFile::parse("source_root = \"/d\"\nsources = [\"x\"]\ndest_hosts = [\"h\"]\n").unwrap_err();
        assert!(e.contains("missing field `dest_root`"), "{e}");
        let e = JobFile::parse(&MINIMAL.replace("[\"dtn1\"]", "\"dtn1\"")).unwrap_err();
        assert!(e.contains("dest_hosts") || e.contains("sequence"), "{e}");
    }

    #[test]
    fn bad_values_say_what_to_write() {
        for (from, to, says) in [
            ("\"/data\"", "\"data\"", "absolute"),
            ("[\"*.h5\"]", "[\"../x\"]", "relative"),
            ("[\"*.h5\"]", "[]", "at least one"),
            ("[\"dtn1\"]", "[]", "at least one destination"),
            ("\"scratch/in\"", "\"/scratch\"", "EXPORT/path"),
        ] {
            let e = JobFile::parse(&MINIMAL.replace(from, to)).unwrap_err();
            assert!(e.contains(says), "{to}: {e}");
        }
        let e = JobFile::parse(&format!("{MINIMAL}[slurm]\ntime = \"1:2:3:4\"\n")).unwrap_err();
        assert!(e.contains("HH:MM:SS"), "{e}");
        let e = JobFile::parse(&format!("agent = \"cp {{src}}\"\n{MINIMAL}")).unwrap_err();
        assert!(e.contains("{dst}"), "{e}");
        let e =
            JobFile::parse(&format!("agent = \"rsync {{src}} {{host}}:{{dst}}\"\n{}", MINIMAL.replace("[\"dtn1\"]", "[]"))).unwrap_err();
        assert!(e.contains("{host}"), "{e}");
        let e = JobFile::parse(&format!("{MINIMAL}[transfer]\nstreams = 0\n")).unwrap_err();
        assert!(e.contains("between 1 and 64"), "{e}");
        let e = JobFile::parse(&format!("{MINIMAL}[transfer]\nignore_times = true\nchecksum = true\n")).unwrap_err();
        assert!(e.contains("choose one (remove transfer.checksum)"), "{e}");
        let e = JobFile::parse(&format!("{MINIMAL}[transfer]\nignore_times = true\nsync = true\n")).unwrap_err();
        assert!(e.contains("choose one (remove transfer.sync)"), "{e}");
        JobFile::parse(&format!("{MINIMAL}[transfer]\nchecksum = true\n")).unwrap();
        JobFile::parse(&format!("{MINIMAL}[transfer]\nsync = true\nchecksum = true\n")).unwrap();
        let e = JobFile::parse(&format!("{MINIMAL}[slurm]\ntime = \"10\"\ncheckpoint_before = \"10:00\"\n")).unwrap_err();
        assert!(e.contains("not shorter than slurm.time"), "{e}");
        JobFile::parse(&format!("{MINIMAL}[slurm]\ntime = \"10\"\ncheckpoint_before = \"2:00\"\nresubmit = true\n")).unwrap();
    }

    /// Regression: a newline in slurm.partition or slurm.account went raw
    /// into the batch script (the line after it ran as a command).
    #[test]
    fn slurm_values_with_control_characters_are_refused_naming_the_key() {
        for key in ["partition", "account"] {
            let e = JobFile::parse(&format!("{MINIMAL}[slurm]\n{key} = \"debug\\ntouch /tmp/owned\"\n")).unwrap_err();
            assert!(e.starts_with(&format!("slurm.{key} = ")) && e.contains("control character (\\n)"), "{e}");
            JobFile::parse(&format!("{MINIMAL}[slurm]\n{key} = \"gpu a100\"\n")).unwrap();
        }
    }

    #[test]
    fn command_agents_take_local_roots_and_fill_their_templates() {
        let j = JobFile::parse(&format!("agent = \"cp -p {{src}} {{dst}}\"\n{}", MINIMAL.replace("\"scratch/in\"", "\"/archive/in\"")))
            .unwrap();
        let c = j.command().unwrap().unwrap();
        assert!(!c.uses_host());
        assert_eq!(c.argv("/data/a b", "/archive/in/a b", "a b", ""), ["cp", "-p", "/data/a b", "/archive/in/a b"]);
        let c = AgentCommand::parse("globus-url-copy file://{src} gsiftp://{host}{dst}").unwrap();
        assert!(c.uses_host());
        assert_eq!(c.argv("/d/x", "/in/x", "x", "dtn1")[2], "gsiftp://dtn1/in/x");
        assert!(AgentCommand::parse("{src} {dst}").is_err());
        AgentCommand::parse("sh -c {src}{dst}").unwrap().check_program().unwrap();
        let e = AgentCommand::parse("no-such-program-here {src} {dst}").unwrap().check_program().unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
    }

    #[test]
    fn slurm_times() {
        assert_eq!(parse_time("30"), Ok(1800));
        assert_eq!(parse_time("5:30"), Ok(330));
        assert_eq!(parse_time("01:00:00"), Ok(3600));
        assert_eq!(parse_time("2-3"), Ok(2 * 86400 + 3 * 3600));
        assert_eq!(parse_time("1-00:01"), Ok(86400 + 60));
        assert_eq!(parse_time("1-0:0:5"), Ok(86405));
        assert!(parse_time("").is_err());
        assert!(parse_time("0").is_err());
        assert!(parse_time("1:x").is_err());
        assert!(parse_time("1:2:3:4").is_err());
    }

    #[test]
    fn sources_are_checked_against_the_tree() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("run/sub")).unwrap();
        std::fs::write(t.path().join("run/sub/a.h5"), b"x").unwrap();
        let local = storage::local();
        check_sources(local.as_ref(), t.path(), &["run/**/*.h5".into(), "run".into(), "".into()]).unwrap();
        let e = check_sources(local.as_ref(), t.path(), &["run/*.h5".into()]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
        assert!(e.message.contains("matches nothing"), "{e}");
        let e = check_sources(local.as_ref(), t.path(), &["nope".into()]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
        let e = check_sources(local.as_ref(), &t.path().join("missing"), &["x".into()]).unwrap_err();
        assert!(e.message.contains("source_root"), "{e}");
        let e = check_sources(local.as_ref(), &t.path().join("run/sub/a.h5"), &["x".into()]).unwrap_err();
        assert!(e.message.contains("not a directory"), "{e}");
    }

    #[test]
    fn spec_paths_join_the_root_or_stand_alone_in_a_whole_bucket() {
        assert_eq!(spec_path(Path::new("/data/"), "run/*.h5"), "/data/run/*.h5");
        assert_eq!(spec_path(Path::new("/data"), "."), "/data/");
        assert_eq!(spec_path(Path::new("/data"), ""), "/data/");
        assert_eq!(spec_path(Path::new("pre/fix"), "a"), "pre/fix/a");
        assert_eq!(spec_path(Path::new(""), "a/**"), "a/**");
        assert_eq!(spec_path(Path::new(""), "."), "");
    }

    #[test]
    fn s3_sources_take_the_native_agent_only() {
        let s3 = MINIMAL.replace("\"/data\"", "\"s3://bucket/run\"");
        let j = JobFile::parse(&format!("s3_endpoint = \"http://s3.example:9000\"\n{s3}")).unwrap();
        assert!(j.s3_source());
        assert_eq!(j.s3_endpoint.as_deref(), Some("http://s3.example:9000"));
        let e = JobFile::parse(&format!("agent = \"cp {{src}} {{dst}}\"\n{}", s3.replace("\"scratch/in\"", "\"/archive\""))).unwrap_err();
        assert!(e.contains("command agent") && e.contains("s3://bucket/run") && e.contains("native"), "{e}");
        let e = JobFile::parse(&format!("s3_endpoint = \"http://s3.example:9000\"\n{MINIMAL}")).unwrap_err();
        assert!(e.contains("s3_endpoint is for a source_root in S3"), "{e}");
        let e = JobFile::parse(&MINIMAL.replace("\"/data\"", "\"s4://bucket\"")).unwrap_err();
        assert!(e.contains("s3://BUCKET"), "{e}");
    }

    #[test]
    fn state_dir_is_beside_the_job() {
        assert_eq!(state_dir(Path::new("/a/b/move.toml")), PathBuf::from("/a/b/move.dmover"));
    }
}
