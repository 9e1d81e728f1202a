//! Batch jobs end to end: job files checked before anything runs, the
//! batch script `dmover submit --dry-run` prints, `dmover run` on this
//! machine, and jobs submitted to a real three-node Slurm cluster
//! (tools/slurm-local through dmover-testkit, started here and stopped when
//! the tests end)
//! whose agents send to real `dmover serve` processes. Sources and
//! destinations in S3 are a real S3 server's buckets (versitygw): a job
//! reading a bucket prefix, one delivering into a bucket a server exports,
//! and the job files refused before anything runs.

mod util;

use dmover_proto::ErrorKind;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use util::*;

/// This machine's name: inside the cluster's nodes it names the host side
/// of their bridge, where the test's servers listen.
fn hostname() -> String {
    let out = std::process::Command::new("hostname").output().expect("hostname");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Servers listening on every address, so that the nodes can reach them.
fn public_server(env: &Env, export: &Path) -> Server {
    let mut spec = ServerSpec::new(&env.token, &[("dst", export)], &env.path(&format!("server-{}.log", unique())));
    spec.listen = "0.0.0.0:0".into();
    Server::start(spec)
}

struct Job {
    path: PathBuf,
    state: PathBuf,
}

/// Writes a job file sending `src` to `dst/in` on each of `servers`.
fn write_job(env: &Env, name: &str, src: &Path, servers: &[&Server], extra: &str) -> Job {
    let host = hostname();
    let hosts: Vec<String> = servers.iter().map(|s| format!("\"{host}:{}\"", s.port)).collect();
    let text = format!(
        "source_root = \"{}\"\nsources = [\"**\"]\ndest_hosts = [{}]\ndest_root = \"dst/in\"\ntoken_file = \"{}\"\n{extra}",
        src.display(),
        hosts.join(", "),
        env.token.display()
    );
    let path = env.path(&format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    Job { state: env.path(&format!("{name}.dmover")), path }
}

/// Asserts that every file of `src` arrived, byte for byte with its mode
/// and mtime, at exactly one of `dsts`, and nothing else did.
#[track_caller]
fn assert_spread(src: &Path, dsts: &[PathBuf]) {
    let want = list_files(src);
    let mut seen = std::collections::BTreeMap::new();
    for d in dsts {
        for (k, n) in list_files(d) {
            if k.starts_with(".dmover-partial/") {
                continue;
            }
            assert!(seen.insert(k.clone(), d.clone()).is_none(), "{k} arrived at two destinations");
            let Node::File { size, mode, mtime } = n else { unreachable!() };
            match want.get(&k) {
                Some(Node::File { size: s, mode: m, mtime: t }) => {
                    assert_eq!((size, mode, mtime), (*s, *m, *t), "{k}: size, mode or mtime differs");
                    assert!(same_content(&src.join(&k), &d.join(&k)), "{k}: content differs");
                }
                _ => panic!("{k}: at the destination {} but not in the source", d.display()),
            }
        }
    }
    let missing: Vec<&String> = want.keys().filter(|k| !seen.contains_key(*k)).collect();
    assert!(missing.is_empty(), "{} files never arrived, e.g. {:?}", missing.len(), &missing[..missing.len().min(5)]);
}

fn read_report(path: &Path) -> Option<Value> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

fn node_files(report: &Value) -> std::collections::BTreeMap<String, u64> {
    report["nodes"].as_array().unwrap().iter().map(|n| (n["name"].as_str().unwrap().to_string(), n["files"].as_u64().unwrap())).collect()
}

// ---------------------------------------------------------------------------
// Without Slurm

#[test]
fn job_files_are_checked_before_anything_runs() {
    let env = Env::new();
    let src = env.mkdir("src");
    std::fs::write(src.join("a.dat"), b"data").unwrap();
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let good = write_job(&env, "good", &src, &[&srv], "");
    let base = std::fs::read_to_string(&good.path).unwrap();
    let case = |name: &str, text: String| {
        let p = env.path(&format!("{name}.toml"));
        std::fs::write(&p, text).unwrap();
        dmover(["submit", "--dry-run"]).arg(&p).run()
    };
    let r = case("unknown", format!("{base}[slurm]\nnodes = 2\ncpus = 4\n"));
    r.assert_fails(2, &["unknown.toml", "unknown field `cpus`", "line"]);
    let r = case("missing", base.lines().filter(|l| !l.starts_with("dest_root")).collect::<Vec<_>>().join("\n"));
    r.assert_fails(2, &["missing field `dest_root`"]);
    let r = case("nomatch", base.replace("[\"**\"]", "[\"*.h5\"]"));
    r.assert_fails(3, &["\"*.h5\"", "matches nothing", "check the pattern"]);
    let r = case("unreachable", base.replace(&format!(":{}\"", srv.port), &format!(":{}\"", closed_port())));
    r.assert_fails(6, &["unreachable", "dmover serve"]);
    let r = case("command", format!("agent = \"cp {{src}}\"\n{base}"));
    r.assert_fails(2, &["{dst}"]);
    assert!(!good.state.exists(), "nothing may be created by a refused job");
}

#[test]
fn dry_run_prints_the_batch_script_with_overrides() {
    let env = Env::new();
    let src = env.mkdir("src");
    std::fs::write(src.join("a.dat"), b"data").unwrap();
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let job = write_job(&env, "move", &src, &[&srv], "[slurm]\nnodes = 2\ntasks_per_node = 4\npartition = \"debug\"\ntime = \"1:00:00\"\n");
    let r = dmover(["submit", "--dry-run", "-N", "3", "--time", "00:05:00"]).arg(&job.path).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines[0], "#!/bin/bash");
    for want in [
        "#SBATCH --job-name=dmover-move",
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --partition=debug",
        "#SBATCH --time=00:05:00",
        &format!("#SBATCH --output={}/slurm-%j.out", job.state.display()),
        &format!("exec {} run {}", BIN, job.path.display()),
    ] {
        assert!(lines.contains(&want), "missing {want:?} in:\n{}", r.stdout);
    }
    assert!(!r.stdout.contains("--nodes=2") && !r.stdout.contains("1:00:00"), "flags must override the job file:\n{}", r.stdout);
    let r = dmover(["submit", "--dry-run", "--time", "soon"]).arg(&job.path).run();
    r.assert_fails(2, &["--time", "HH:MM:SS"]);
    // --metrics goes to the script's `dmover run`, a host name as well as an address.
    let r = dmover(["submit", "--dry-run", "--metrics", "localhost:9464"]).arg(&job.path).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains(&format!("exec {BIN} run --metrics localhost:9464 {}", job.path.display())), "{}", r.stdout);
    let r = dmover(["submit", "--dry-run", "--metrics", "localhost"]).arg(&job.path).run();
    r.assert_fails(2, &["--metrics localhost", "not PORT or HOST:PORT"]);
}

/// Regression: a newline in `slurm.partition`, `slurm.account`,
/// `--partition`, `--account` or the job file's name was written raw into
/// the batch script, and the line after it ran as a command in the batch
/// job. Now each is refused, naming the key, before any script is written
/// or submitted (here to an sbatch that keeps what it is given).
#[test]
fn values_that_would_inject_lines_into_the_batch_script_are_refused() {
    let env = Env::new();
    let src = env.mkdir("src");
    std::fs::write(src.join("a.dat"), b"data").unwrap();
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let submitted = env.path("submitted");
    let bin = env.mkdir("bin");
    let sbatch = bin.join("sbatch");
    std::fs::write(&sbatch, format!("#!/bin/sh\ncat >>'{}'\necho 4242\n", submitted.display())).unwrap();
    chmod(&sbatch, 0o755);
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let owned = env.path("owned");
    let line = format!("touch {}", owned.display());
    let submit = |job: &Job, flags: &[&str]| dmover(["submit"]).args(flags).arg(&job.path).env("PATH", &path).run();
    let cases: Vec<(Job, Vec<String>, &str)> = vec![
        (write_job(&env, "partition", &src, &[&srv], &format!("[slurm]\npartition = \"debug\\n{line}\"\n")), vec![], "slurm.partition"),
        (write_job(&env, "account", &src, &[&srv], &format!("[slurm]\naccount = \"proj\\n{line}\"\n")), vec![], "slurm.account"),
        (write_job(&env, "flag-p", &src, &[&srv], ""), vec!["--partition".into(), format!("debug\n{line}")], "--partition"),
        (write_job(&env, "flag-a", &src, &[&srv], ""), vec!["--account".into(), format!("proj\n{line}")], "--account"),
        // A file name holds no '/': the command runs in the job's directory.
        (write_job(&env, "named\ntouch owned\n", &src, &[&srv], ""), vec![], "the job file's path"),
    ];
    for (job, flags, key) in &cases {
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let r = submit(job, &flags);
        r.assert_fails(2, &[key, "control character (\\n)"]);
        assert!(!job.state.exists(), "{key}: a state directory was made for a refused job");
    }
    assert!(!submitted.exists(), "a script was submitted:\n{}", std::fs::read_to_string(&submitted).unwrap_or_default());
    assert!(!owned.exists());
    // The same job without the newline is submitted.
    let r = submit(&cases[2].0, &["--partition", "debug"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(std::fs::read_to_string(&submitted).unwrap().lines().any(|l| l == "#SBATCH --partition=debug"));
}

#[test]
fn run_without_slurm_uses_local_agents_and_a_rerun_sends_nothing() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 5, 300);
    let (out_a, out_b) = (env.mkdir("a"), env.mkdir("b"));
    let (sa, sb) = (public_server(&env, &out_a), public_server(&env, &out_b));
    let job = write_job(&env, "local", &src, &[&sa, &sb], "[slurm]\ntasks_per_node = 3\n");
    let r = dmover(["run", "--json"]).arg(&job.path).run();
    assert_eq!(r.code, 0, "stderr:\n{}", r.stderr);
    let j = r.json();
    assert_eq!(j["state"], "finished", "{j:#}");
    assert_eq!(j["check"]["passed"], true, "{j:#}");
    assert_eq!(j["total_files"], 308);
    assert_eq!(j["agents"].as_array().unwrap().len(), 3, "{j:#}");
    let hosts = j["hosts"].as_array().unwrap();
    assert_eq!(hosts.len(), 2, "{j:#}");
    assert!(hosts.iter().all(|h| h["files"].as_u64().unwrap() > 50), "round-robin over both hosts: {j:#}");
    assert_spread(&src, &[out_a.join("in"), out_b.join("in")]);
    assert!(r.stderr.contains("check: passed"), "{}", r.stderr);
    assert_eq!(read_report(&job.state.join("report.json")).unwrap(), j);
    let done = std::fs::read_to_string(job.state.join("done.list")).unwrap();
    assert_eq!(done.lines().count(), 308);

    // A re-run sends nothing: every file is on the done list.
    std::fs::remove_dir_all(out_a.join("in")).unwrap();
    let r = dmover(["run", "--json"]).arg(&job.path).run();
    let j = r.json();
    assert_eq!(r.code, 0, "stderr:\n{}", r.stderr);
    assert_eq!((j["earlier_files"].as_u64(), j["done_files"].as_u64()), (Some(308), Some(308)), "{j:#}");
    assert!(!out_a.join("in").exists(), "a re-run sent files again");

    let s = dmover(["status"]).arg(&job.path).run();
    assert_eq!(s.code, 0, "{}", s.stderr);
    assert!(s.stdout.contains("finished") && s.stdout.contains("308/308"), "{}", s.stdout);
}

/// Writes a job file sending `src` to `dst` on `host` reached over `sshd`
/// (no dmover serve there: each agent starts a remote end over ssh).
fn ssh_job(env: &Env, name: &str, src: &Path, host: &str, sshd: &Sshd, dst: &Path, extra: &str) -> Job {
    let text = format!(
        "source_root = \"{}\"\nsources = [\"**\"]\ndest_hosts = [\"{host}\"]\ndest_root = \"{}\"\n\
         [ssh]\ncommand = \"{}\"\nremote_dmover = \"{BIN}\"\n{extra}",
        src.display(),
        dst.display(),
        sshd.ssh()
    );
    let path = env.path(&format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    Job { state: env.path(&format!("{name}.dmover")), path }
}

/// A job whose destination host is reached over ssh, with no token and no
/// server there: `dmover run` (agents on this machine) starts the remote
/// ends, every file arrives, and no remote end is left behind.
#[test]
fn a_job_reaches_its_destination_over_ssh() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 6, 120);
    let dst = env.mkdir("far");
    let sshd = Sshd::start(&env.path("sshd"));
    let job = ssh_job(&env, "over-ssh", &src, "127.0.0.1", &sshd, &dst.join("in"), "[slurm]\ntasks_per_node = 2\n");
    let r = dmover(["run", "--json"]).arg(&job.path).run();
    assert_eq!(r.code, 0, "stderr:\n{}", r.stderr);
    let j = r.json();
    assert_eq!((j["state"].as_str(), j["check"]["passed"].as_bool()), (Some("finished"), Some(true)), "{j:#}");
    assert_eq!(j["hosts"][0]["name"], "127.0.0.1", "{j:#}");
    assert_spread(&src, &[dst.join("in")]);
    let left = || {
        let out = std::process::Command::new("pgrep").args(["-f", &format!("^{BIN} remote")]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    assert!(wait_until(Duration::from_secs(10), || left() == 0), "a remote end outlived the job");
    // A host that ssh cannot log in to is refused before anything runs, with ssh's own words.
    let bad = ssh_job(&env, "unreachable", &src, "no-such-user@127.0.0.1", &sshd, &dst.join("x"), "");
    let r = dmover(["run"]).arg(&bad.path).run();
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("ssh could not log in") && r.stderr.contains("Permission denied") && !dst.join("x").exists(), "{}", r.stderr);
}

// ---------------------------------------------------------------------------
// On a three-node Slurm cluster

/// Submits `job` and returns its Slurm job id.
fn submit(job: &Job) -> String {
    job_id(dmover(["submit"]).arg(&job.path).run())
}

/// The Slurm job id `dmover submit` printed.
fn job_id(r: Run) -> String {
    assert_eq!(r.code, 0, "submit: {}", r.stderr);
    let id = r.stdout.trim().to_string();
    assert!(!id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()), "job id: {:?}", r.stdout);
    id
}

/// Waits for the job's final report.
fn wait_report(job: &Job, id: &str, timeout: Duration) -> Value {
    let end = Instant::now() + timeout;
    loop {
        if let Some(r) = read_report(&job.state.join("report.json")) {
            return r;
        }
        if Instant::now() > end {
            let out = std::fs::read_to_string(job.state.join(format!("slurm-{id}.out"))).unwrap_or_default();
            let _ = std::process::Command::new("scancel").arg(id).status();
            panic!("job {id} did not finish in {timeout:?}; its output:\n{out}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn slurm_job_moves_a_tree_with_agents_on_all_three_nodes() {
    if !dmover_testkit::slurm_possible() {
        return;
    }
    let _cluster = dmover_testkit::slurm_cluster();
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 11, 1992);
    let (out_a, out_b) = (env.mkdir("a"), env.mkdir("b"));
    let (sa, sb) = (public_server(&env, &out_a), public_server(&env, &out_b));
    let job = write_job(&env, "tree", &src, &[&sa, &sb], "[slurm]\nnodes = 3\ntasks_per_node = 2\ntime = \"5\"\n");
    let id = submit(&job);
    let r = wait_report(&job, &id, Duration::from_secs(120));
    let out = std::fs::read_to_string(job.state.join(format!("slurm-{id}.out"))).unwrap_or_default();
    assert_eq!(r["state"], "finished", "report: {r:#}\noutput:\n{out}");
    assert_eq!(r["check"]["passed"], true, "{r:#}");
    assert_eq!(r["slurm_job_id"], id.as_str());
    assert_eq!(r["total_files"], 2000);
    assert_eq!(r["done_files"], 2000);
    let agents = r["agents"].as_array().unwrap();
    assert_eq!(agents.len(), 6, "one agent per task: {r:#}");
    assert!(agents.iter().all(|a| a["state"] == "finished"), "{r:#}");
    let nodes = node_files(&r);
    assert_eq!(nodes.keys().collect::<Vec<_>>(), ["node1", "node2", "node3"], "{r:#}");
    assert!(nodes.values().all(|f| *f > 0), "every node did work: {nodes:?}");
    assert_eq!(nodes.values().sum::<u64>(), 2000);
    let hosts = r["hosts"].as_array().unwrap();
    assert_eq!(hosts.len(), 2, "{r:#}");
    assert!(hosts.iter().all(|h| h["files"].as_u64().unwrap() > 0), "{r:#}");
    assert_spread(&src, &[out_a.join("in"), out_b.join("in")]);
    let s = dmover(["status"]).arg(&job.path).run();
    assert!(s.stdout.contains("2000/2000") && s.stdout.contains("check: passed") && s.stdout.contains("node3"), "{}", s.stdout);
}

/// An agent on node2 that has sent a few files, from the job's progress.
fn busy_agent_on_node2(job: &Job) -> Option<Value> {
    let p = read_report(&job.state.join("progress.json"))?;
    p["agents"].as_array().unwrap().iter().find(|a| a["node"] == "node2" && a["files"].as_u64().unwrap() >= 5).cloned()
}

/// Kills an agent (SIGKILL).
fn kill_agent(agent: &Value) {
    // SAFETY: kill(2) on the agent's pid (the nodes share this machine's pid space).
    assert_eq!(unsafe { libc::kill(agent["pid"].as_i64().unwrap() as i32, libc::SIGKILL) }, 0, "kill agent {agent}");
}

/// Waits until an agent on node2 has sent a few files, kills it and
/// returns its entry in the job's progress.
fn kill_an_agent_on_node2(job: &Job) -> Value {
    let mut victim = None;
    let found = wait_until(Duration::from_secs(60), || {
        victim = busy_agent_on_node2(job);
        victim.is_some()
    });
    assert!(found, "no agent on node2 got going; progress: {:?}", std::fs::read_to_string(job.state.join("progress.json")));
    let victim = victim.unwrap();
    kill_agent(&victim);
    victim
}

/// A job of `files` files of 64 KiB to two servers, on three nodes with two
/// agents each, `bwlimit` per agent: long enough to act on while it runs.
struct Slow {
    src: PathBuf,
    out_a: PathBuf,
    out_b: PathBuf,
    job: Job,
    /// Running while this lives.
    servers: [Server; 2],
}

fn slow_job(env: &Env, name: &str, files: usize, bwlimit: &str) -> Slow {
    let src = env.mkdir("src");
    let mut rng = Rng::new(files as u64);
    for i in 0..files {
        make_file(&src.join(format!("d{}/f{i:03}.dat", i % 7)), 64 << 10, &mut rng);
    }
    let (out_a, out_b) = (env.mkdir("a"), env.mkdir("b"));
    let servers = [public_server(env, &out_a), public_server(env, &out_b)];
    let extra = format!("[transfer]\nbwlimit = \"{bwlimit}\"\n[slurm]\nnodes = 3\ntasks_per_node = 2\n");
    let job = write_job(env, name, &src, &[&servers[0], &servers[1]], &extra);
    Slow { src, out_a, out_b, job, servers }
}

#[test]
fn slurm_job_survives_an_agent_killed_mid_job() {
    if !dmover_testkit::slurm_possible() {
        return;
    }
    let _cluster = dmover_testkit::slurm_cluster();
    let env = Env::new();
    // 1 MB/s per agent: the job takes several seconds, time enough to kill one.
    let Slow { src, out_a, out_b, job, servers: _servers } = slow_job(&env, "kill", 600, "1M");
    let id = submit(&job);
    let victim = kill_an_agent_on_node2(&job);
    let r = wait_report(&job, &id, Duration::from_secs(120));
    assert_eq!(r["state"], "finished", "{r:#}");
    assert_eq!(r["check"]["passed"], true, "{r:#}");
    assert_eq!(r["done_files"], 600);
    let lost: Vec<&Value> = r["agents"].as_array().unwrap().iter().filter(|a| a["state"] == "lost").collect();
    assert_eq!(lost.len(), 1, "{r:#}");
    assert_eq!(lost[0]["pid"], victim["pid"]);
    assert!(r["requeued_files"].as_u64().unwrap() > 0, "the lost agent held files: {r:#}");
    let nodes = node_files(&r);
    assert!(nodes["node1"] > 0 && nodes["node3"] > 0, "{nodes:?}");
    assert_spread(&src, &[out_a.join("in"), out_b.join("in")]);
}

/// What a test reads off the status page's rendered DOM.
const PAGE_VIEW: &str = r##"(() => {
  const $ = (id) => document.getElementById(id);
  const rows = (id) => [...document.querySelectorAll("#" + id + " tr[data-name]")].map((r) => [r.dataset.name, Number(r.dataset.files)]);
  const line = document.querySelector("#chart polyline");
  return {
    state: $("state").textContent,
    title: $("title").textContent,
    done: Number($("files").dataset.done || -1),
    bar: $("bar").style.width,
    points: Number($("chart").dataset.points || 0),
    line: line ? line.getAttribute("points") : "",
    nodes: rows("nodes"),
    hosts: rows("hosts"),
    agents: $("agents").textContent,
    lost: $("lost").textContent,
    check: $("check").hidden ? null : $("check").textContent,
    updates: Number($("updates").dataset.updates),
    now: $("now").textContent,
    rates: (document.querySelector("#chart text.rates") || {}).textContent,
  };
})()"##;

/// Where tests keep what a person may want to look at afterwards.
fn artifacts(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap().join("test-artifacts").join(name)
}

#[test]
fn status_page_follows_a_slurm_job_in_a_browser() {
    if !dmover_testkit::slurm_possible() {
        return;
    }
    if !on_path("chromium") {
        let _ = dmover_testkit::skip("needs chromium (Debian's `chromium` package; ./test installs it)");
        return;
    }
    let _cluster = dmover_testkit::slurm_cluster();
    let env = Env::new();
    // 512 kB/s per agent: the job runs for several seconds while the page is watched.
    let Slow { src, out_a, out_b, job, servers: _servers } = slow_job(&env, "watched", 480, "512K");
    // The page is up before the job: it says it waits, then follows it.
    let port = closed_port().to_string();
    let _web = dmover(["status", "--web", &port]).arg(&job.path).spawn();
    let addr = format!("127.0.0.1:{port}");
    assert!(wait_until(Duration::from_secs(10), || http_get(&addr, "/").is_some_and(|(c, _)| c == 200)), "no status page");
    let mut browser = browser::Browser::open(&format!("http://{addr}/"), &env.path("chromium"));
    let id = submit(&job);

    let shots = artifacts("status-page");
    let mut running: Vec<Value> = Vec::new();
    let mut victim = None;
    let mut last = Value::Null;
    let ended = wait_until(Duration::from_secs(180), || {
        last = browser.eval(PAGE_VIEW);
        if last["state"] == "running" {
            let halfway = last["done"].as_u64().is_some_and(|d| d >= 240);
            if halfway && !running.iter().any(|v| v["done"].as_u64() >= Some(240)) {
                browser.screenshot(&shots.join("running.png"));
            }
            running.push(last.clone());
            if victim.is_none() {
                victim = busy_agent_on_node2(&job);
                victim.iter().for_each(kill_agent);
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        last["check"].is_string() && last["state"] != "running"
    });
    let out = std::fs::read_to_string(job.state.join(format!("slurm-{id}.out"))).unwrap_or_default();
    assert!(ended, "the page never showed the job's end; last view: {last:#}\njob output:\n{out}");
    browser.screenshot(&shots.join("finished.png"));

    // While it ran: progress, the chart and the shares were drawn and changed.
    let first =
        running.iter().find(|v| v["done"].as_u64() > Some(0)).unwrap_or_else(|| panic!("no running view with progress: {running:#?}"));
    assert!(first["done"].as_u64() < Some(480), "{first:#}");
    let distinct = |key: &str| running.iter().map(|v| v[key].to_string()).collect::<std::collections::BTreeSet<_>>().len();
    for key in ["done", "bar", "line", "nodes", "hosts", "updates"] {
        assert!(distinct(key) >= 3, "the page's {key} changed only {} times while the job ran: {running:#?}", distinct(key));
    }
    assert!(running.iter().any(|v| v["points"].as_u64() >= Some(3)), "the chart drew no rate line: {running:#?}");
    let rated = |v: &&Value| v["now"].as_str().is_some_and(|n| n.ends_with("/s") && n != "0 B/s");
    assert!(running.iter().any(|v| rated(&v)), "the page never showed a rate now while the job ran: {running:#?}");
    assert!(running.iter().all(|v| v["rates"].as_str().is_some_and(|r| r.starts_with("now ") && r.contains("/s, peak "))), "{running:#?}");
    assert!(running.iter().any(|v| v["nodes"].as_array().unwrap().len() == 3), "not every node's share was shown: {running:#?}");
    let slurm_title = last["title"].as_str().unwrap();
    assert!(slurm_title.ends_with("watched.toml"), "{last:#}");

    // At the end: everything done, the lost agent named, the check shown.
    let victim = victim.expect("an agent on node2 was killed mid-job");
    assert_eq!(last["state"], "finished", "{last:#}");
    assert_eq!(last["done"], 480, "{last:#}");
    assert_eq!(last["bar"], "100%", "{last:#}");
    assert!(last["check"].as_str().unwrap().starts_with("Check passed"), "{last:#}");
    let lost = format!("agent {} on node2", victim["id"]);
    assert!(last["lost"].as_str().unwrap().contains(&lost), "{lost} not among the lost: {last:#}");
    assert!(last["agents"].as_str().unwrap().ends_with("1 lost"), "{last:#}");
    let nodes: u64 = last["nodes"].as_array().unwrap().iter().map(|r| r[1].as_u64().unwrap()).sum();
    let hosts: Vec<u64> = last["hosts"].as_array().unwrap().iter().map(|r| r[1].as_u64().unwrap()).collect();
    assert_eq!((nodes, hosts.len(), hosts.iter().sum::<u64>()), (480, 2, 480), "{last:#}");
    assert!(hosts.iter().all(|&f| f > 0), "{last:#}");
    for shot in ["running.png", "finished.png"] {
        assert!(std::fs::metadata(shots.join(shot)).unwrap().len() > 10_000, "{shot} is (nearly) empty");
    }
    assert_spread(&src, &[out_a.join("in"), out_b.join("in")]);
}

// ---------------------------------------------------------------------------
// Command agents (no Slurm needed: the same agents, as threads)

fn command_job(env: &Env, name: &str, src: &Path, dest: &Path, template: &str) -> Job {
    let text = format!(
        "source_root = \"{}\"\nsources = [\"**\"]\ndest_hosts = []\ndest_root = \"{}\"\nagent = \"{template}\"\n[slurm]\ntasks_per_node = 2\n",
        src.display(),
        dest.display()
    );
    let path = env.path(&format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    Job { state: env.path(&format!("{name}.dmover")), path }
}

#[test]
fn command_agents_copy_with_cp_and_rsync() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 21, 120);
    std::fs::create_dir_all(src.join("d3/empty")).unwrap();
    for (name, template) in [("cp", "cp -p {src} {dst}"), ("rsync", "rsync -a {src} {dst}")] {
        let dest = env.path(&format!("out-{name}"));
        let job = command_job(&env, name, &src, &dest, template);
        let r = dmover(["run", "--json"]).arg(&job.path).run();
        assert_eq!(r.code, 0, "{name}: stderr:\n{}", r.stderr);
        let j = r.json();
        assert_eq!(j["check"]["passed"], true, "{name}: {j:#}");
        assert_eq!(j["done_files"], 129, "{name}: {j:#}");
        assert_eq!(j["agents"].as_array().unwrap().len(), 2, "{name}: {j:#}");
        assert_same_tree(&src, &dest);
    }
    // A command that fails is retried on the other agent, then reported.
    let dest = env.path("out-false");
    let job = command_job(&env, "false", &src, &dest, "false {src} {dst}");
    let r = dmover(["run", "--json"]).arg(&job.path).run();
    let j = r.json();
    assert_eq!(r.code, 1, "{j:#}");
    assert_eq!(j["state"], "failed", "{j:#}");
    assert_eq!(j["failed_files"], 128, "every file but the empty directory: {j:#}");
    assert!(j["failures"][0]["message"].as_str().unwrap().contains("`false` failed"), "{j:#}");
    assert_eq!(j["failures"][0]["attempts"], 3, "{j:#}");
}

#[test]
fn slurm_jobs_with_cp_and_rsync_agents_on_three_nodes() {
    if !dmover_testkit::slurm_possible() {
        return;
    }
    let _cluster = dmover_testkit::slurm_cluster();
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 31, 292);
    // Each copy takes at least 50 ms, so that the 300 files (about 2.5 s of
    // work for six agents) outlast the time Slurm takes to start the last
    // node's agents: a node whose agents start after the queue has run dry
    // rightly gets nothing, and this test is about the spread.
    let slow = env.path("slow");
    std::fs::write(&slow, "#!/bin/sh\nsleep 0.05\nexec \"$@\"\n").unwrap();
    chmod(&slow, 0o755);
    for (name, command) in [("cp", "cp -p {src} {dst}"), ("rsync", "rsync -a {src} {dst}")] {
        let dest = env.path(&format!("out-{name}"));
        let template = format!("{} {command}", slow.display());
        let job = command_job(&env, name, &src, &dest, &template);
        let text = std::fs::read_to_string(&job.path).unwrap().replace("tasks_per_node = 2", "nodes = 3\ntasks_per_node = 2");
        std::fs::write(&job.path, text).unwrap();
        let id = submit(&job);
        let r = wait_report(&job, &id, Duration::from_secs(120));
        assert_eq!(r["state"], "finished", "{name}: {r:#}");
        assert_eq!(r["check"]["passed"], true, "{name}: {r:#}");
        assert_eq!(r["done_files"], 300);
        let nodes = node_files(&r);
        assert_eq!(nodes.len(), 3, "{name}: agents on all three nodes did work: {nodes:?}");
        assert_same_tree(&src, &dest);
    }
}

#[test]
fn slurm_job_checkpoints_before_its_time_limit_and_resubmits_itself() {
    if !dmover_testkit::slurm_possible() {
        return;
    }
    let _cluster = dmover_testkit::slurm_cluster();
    let env = Env::new();
    let src = env.mkdir("src");
    let mut rng = Rng::new(7);
    for i in 0..180 {
        make_file(&src.join(format!("d{}/f{i:03}.dat", i % 5)), 64 << 10, &mut rng);
    }
    let (out_a, out_b) = (env.mkdir("a"), env.mkdir("b"));
    let (sa, sb) = (public_server(&env, &out_a), public_server(&env, &out_b));
    // About 8 s of sending at 6 x 256 KB/s; a checkpoint 55 s before the
    // one-minute limit stops each run after about 5 s.
    let extra = "[transfer]\nconcurrency = 1\nbwlimit = \"256K\"\n\
                 [slurm]\nnodes = 3\ntasks_per_node = 2\ntime = \"1\"\ncheckpoint_before = \"0:55\"\nresubmit = true\n";
    let job = write_job(&env, "walltime", &src, &[&sa, &sb], extra);
    let first = submit(&job);
    let end = Instant::now() + Duration::from_secs(180);
    let report = loop {
        if let Some(r) = read_report(&job.state.join("report.json")) {
            if r["state"] != "checkpointed" {
                break r;
            }
        }
        if Instant::now() > end {
            let _ = std::process::Command::new("scancel").args(["-n", "dmover-walltime"]).status();
            panic!("the job did not finish in 180 s; runs: {:?}", std::fs::read_to_string(job.state.join("runs.jsonl")));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(report["state"], "finished", "{report:#}");
    assert_eq!(report["check"]["passed"], true, "{report:#}");
    assert!(report["earlier_files"].as_u64().unwrap() > 0, "the last run found files done by the first: {report:#}");
    let runs: Vec<Value> =
        std::fs::read_to_string(job.state.join("runs.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(runs.len() >= 2, "{runs:?}");
    assert_eq!(runs[0]["slurm_job_id"], first.as_str());
    for w in runs.windows(2) {
        assert_eq!(w[0]["state"], "checkpointed", "{runs:?}");
        assert_eq!(w[0]["resubmitted_as"], w[1]["slurm_job_id"], "{runs:?}");
    }
    assert_eq!(runs.last().unwrap()["state"], "finished");
    // Nothing was sent twice: the runs' files add up to the job's, and the
    // done list names each file once.
    assert_eq!(runs.iter().map(|r| r["files"].as_u64().unwrap()).sum::<u64>(), 180, "{runs:?}");
    let done: Vec<String> = std::fs::read_to_string(job.state.join("done.list")).unwrap().lines().map(str::to_string).collect();
    let unique: std::collections::BTreeSet<&String> = done.iter().collect();
    assert_eq!((done.len(), unique.len()), (180, 180));
    assert_spread(&src, &[out_a.join("in"), out_b.join("in")]);
    let s = dmover(["status"]).arg(&job.path).run();
    assert!(s.stdout.contains(&format!("1 (Slurm job {first}): checkpointed")), "{}", s.stdout);
}

#[test]
fn overlapping_sources_list_each_file_once() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 41, 30);
    let dest = env.path("out");
    let job = command_job(&env, "overlap", &src, &dest, "cp -p {src} {dst}");
    let text = std::fs::read_to_string(&job.path).unwrap().replace("sources = [\"**\"]", "sources = [\"**\", \"a\", \"a/b/*.dat\"]");
    std::fs::write(&job.path, text).unwrap();
    let r = dmover(["run", "--json"]).arg(&job.path).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j = r.json();
    assert_eq!((j["total_files"].as_u64(), j["done_files"].as_u64()), (Some(38), Some(38)), "{j:#}");
    assert_same_tree(&src, &dest);
}

// ---------------------------------------------------------------------------
// The job's own keys and reports, run without Slurm (`dmover run`)

/// Every key of `dmover status --json` that docs/CLI.md shows, in its order.
const STATUS_KEYS: [&str; 29] = [
    "state",
    "job",
    "slurm_job_id",
    "started_unix",
    "updated_unix",
    "seconds",
    "walk_done",
    "total_files",
    "total_bytes",
    "done_files",
    "done_bytes",
    "skipped_files",
    "skipped_bytes",
    "earlier_files",
    "earlier_bytes",
    "failed_files",
    "retried_files",
    "requeued_files",
    "mb_per_s",
    "files_per_s",
    "timeline",
    "rates",
    "nodes",
    "hosts",
    "agents",
    "failures",
    "check",
    "error",
    "resubmitted_as",
];

/// CLI.md "Running a job": a server that has fewer connections than a
/// job's agents want turns some away ("server busy"); they back off and
/// try again, and the files they were given but could not start go to the
/// others untried, so none fails.
#[test]
fn agents_a_busy_server_turns_away_fail_no_file() {
    let env = Env::new();
    let src = env.mkdir("src");
    let mut rng = Rng::new(12);
    for i in 0..120 {
        make_file(&src.join(format!("f{i:03}")), 16 << 10, &mut rng);
    }
    let out = env.mkdir("out");
    let log = env.path("busy-server.log");
    let mut spec = ServerSpec::new(&env.token, &[("dst", &out)], &log);
    spec.listen = "0.0.0.0:0".into();
    spec.extra = vec!["--max-connections".into(), "3".into()];
    let srv = Server::start(spec);
    // Four agents of a control and a data connection each, three connections at the server.
    let job = write_job(&env, "busy", &src, &[&srv], "[transfer]\nstreams = 1\nbwlimit = \"512K\"\n[slurm]\ntasks_per_node = 4\n");
    let r = dmover(["run"]).arg(&job.path).run();
    let j = dmover(["status", "--json"]).arg(&job.path).run().json();
    assert_eq!(r.code, 0, "{}\n{j:#}", r.stderr);
    assert_eq!((u(&j["done_files"]), u(&j["failed_files"])), (120, 0), "{j:#}");
    let busy = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(busy.contains("over --max-connections"), "the server turned no agent away: the test tested nothing:\n{busy}");
    assert_spread(&src, &[out.join("in")]);
}

/// CLI.md "dmover status": a job's bytes count as they move, not when a
/// file is confirmed, so one large file going at 2 MB/s shows progress and
/// a rate before it is done, and its peak is near 2 MB/s (confirmed whole,
/// it was a spike of its whole size in one second); the text status shows
/// the same rates as `--json`.
#[test]
fn a_jobs_bytes_count_as_they_move_and_its_rates_are_the_same_everywhere() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_file(&src.join("big"), 12 << 20, &mut Rng::new(8));
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let job = write_job(&env, "big", &src, &[&srv], "[transfer]\nbwlimit = \"2M\"\n[slurm]\ntasks_per_node = 1\n");
    let run = dmover(["run"]).arg(&job.path).spawn();
    let mut before_done = None;
    wait_until(Duration::from_secs(60), || {
        let r = dmover(["status", "--json"]).arg(&job.path).run();
        let Ok(j) = serde_json::from_str::<Value>(&r.stdout) else { return false };
        let moving = j["timeline"].as_array().and_then(|t| t.last()).map_or(0, |p| u(&p["bytes"]));
        if j["state"] == "running" && u(&j["done_files"]) == 0 && moving > 0 && j["rates"]["now_bytes_per_s"].as_f64() > Some(0.0) {
            before_done = Some(j.clone());
        }
        before_done.is_some() || j["state"] == "finished"
    });
    let r = run.wait();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(before_done.is_some(), "no status showed bytes moving or a rate before the file was confirmed");
    let j = dmover(["status", "--json"]).arg(&job.path).run().json();
    let peak = j["rates"]["peak_bytes_per_s"].as_f64().unwrap();
    assert!(peak > 1e6 && peak < 4e6, "a job limited to 2 MB/s peaked at {peak:.0} B/s: {j:#}");
    let text = dmover(["status"]).arg(&job.path).run().stdout;
    let shown = format!("(peak {}/s)", dmover_engine::progress::human(peak as u64));
    assert!(text.contains(&shown), "the text status does not show the peak of --json, {shown}:\n{text}");
    assert!(!text.contains("MB/s"), "one unit convention (binary): {text}");
}

/// CLI.md "Watching a job in a browser": `dmover run --metrics` has the
/// manager serve the job's metrics while it runs (Prometheus' linter
/// accepts them), and `dmover status --web` serves them and the page's
/// data from the state directory once it has ended; off loopback it will
/// not serve without a page token to ask for, and never takes the job's
/// token.
#[test]
fn a_jobs_metrics_follow_it_and_its_page_outlives_it() {
    let env = Env::new();
    let src = env.mkdir("src");
    let mut rng = Rng::new(5);
    for i in 0..120 {
        make_file(&src.join(format!("f{i:03}")), 64 << 10, &mut rng);
    }
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    // 1 MB/s per agent: about four seconds.
    let job = write_job(&env, "metered", &src, &[&srv], "[transfer]\nbwlimit = \"1M\"\n[slurm]\ntasks_per_node = 2\n");
    let port = closed_port().to_string();
    let run = dmover(["run", "--metrics", &port]).arg(&job.path).spawn();
    let addr = format!("127.0.0.1:{port}");
    let mut mid = None;
    let mut done_seen = std::collections::BTreeSet::new();
    wait_until(Duration::from_secs(60), || {
        let Some((200, page)) = http_get(&addr, "/metrics") else { return false };
        let done = sample(&page, "dmover_job_files{status=\"done\"}").unwrap_or(0.0) as u64;
        if sample(&page, "dmover_job_state{state=\"running\"}") == Some(1.0) && done > 0 && done < 120 {
            done_seen.insert(done);
            mid.get_or_insert(page);
        }
        done_seen.len() >= 3
    });
    let mid = mid.expect("no scrape saw the job running with files done");
    assert!(done_seen.len() >= 3, "the done count changed only {} times: {done_seen:?}", done_seen.len());
    assert_eq!(sample(&mid, "dmover_job_files{status=\"listed\"}"), Some(120.0), "{mid}");
    assert_eq!(sample(&mid, "dmover_job_agents{state=\"running\"}"), Some(2.0), "{mid}");
    if on_path("promtool") {
        promtool_check(&mid);
    }
    let r = run.wait();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains(&format!("status page at http://{addr}/")), "{}", r.stderr);

    let port = closed_port().to_string();
    let _web = dmover(["status", "--web", &port]).arg(&job.state).spawn();
    let addr = format!("127.0.0.1:{port}");
    assert!(wait_until(Duration::from_secs(10), || http_get(&addr, "/metrics").is_some_and(|(c, _)| c == 200)));
    let (_, page) = http_get(&addr, "/metrics").unwrap();
    let host = format!("dmover_job_host_files_total{{host=\"{}:{}\"}}", hostname(), srv.port);
    for (name, want) in [
        ("dmover_job_state{state=\"finished\"}", 1.0),
        ("dmover_job_state{state=\"running\"}", 0.0),
        ("dmover_job_check_passed", 1.0),
        ("dmover_job_files{status=\"done\"}", 120.0),
        ("dmover_job_bytes{status=\"done\"}", (120 << 16) as f64),
        (&format!("dmover_job_node_files_total{{node=\"{}\"}}", hostname()), 120.0),
        (&host, 120.0),
        ("dmover_job_agents{state=\"finished\"}", 2.0),
    ] {
        assert_eq!(sample(&page, name), Some(want), "{name}:\n{page}");
    }
    if on_path("promtool") {
        promtool_check(&page);
    }
    let (_, body) = http_get(&addr, "/status.json").unwrap();
    let j: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (j["kind"].as_str(), u(&j["report"]["done_files"]), j["runs"].as_array().map(Vec::len)),
        (Some("job"), 120, Some(1)),
        "{j:#}"
    );

    // Off loopback with no token to ask for: refused before serving anything.
    let r = dmover(["status", "--web", "0.0.0.0:0"]).arg(&job.state).run();
    r.assert_fails(2, &["--web"]);
    assert!(r.stderr.contains("not a loopback address"), "{}", r.stderr);
    for r in [
        dmover(["run", "--metrics", "0.0.0.0:0"]).arg(&job.path).run(),
        dmover(["submit", "--dry-run", "--metrics", "0.0.0.0:9464"]).arg(&job.path).run(),
    ] {
        r.assert_fails(2, &["--metrics", "not a loopback address", "metrics_token_file in the job file", "dmover token FILE"]);
    }

    // Off loopback with a page token of its own: the data needs it, and
    // the job's token (which must never cross the wire) is refused.
    let pages = env.path("pages-token");
    assert_eq!(dmover(["token".as_ref(), pages.as_os_str()]).run().code, 0);
    let page_token = std::fs::read_to_string(&pages).unwrap().trim().to_string();
    let bearer = |t: &str| format!("Authorization: Bearer {t}\r\n");
    let port = closed_port();
    let _web = dmover(["status", "--web", &format!("0.0.0.0:{port}"), "--web-token-file", pages.to_str().unwrap()]).arg(&job.state).spawn();
    let addr = format!("127.0.0.1:{port}");
    let served =
        wait_until(Duration::from_secs(10), || http_get_with(&addr, "/metrics", &bearer(&page_token)).is_some_and(|(c, _)| c == 200));
    assert!(served, "the page token does not open the job's metrics");
    for shown in [bearer(&env.token_str()), String::new()] {
        for target in ["/metrics", "/status.json"] {
            let (code, body) = http_get_with(&addr, target, &shown).unwrap();
            assert_eq!(code, 401, "{target} with {shown:?} was let in: {body}");
        }
    }
    let r = dmover(["status", "--web", "0.0.0.0:0", "--web-token-file", env.token.to_str().unwrap()]).arg(&job.path).run();
    r.assert_fails(2, &["holds the data token"]);
    // The job file's metrics_token_file: what `run` and `submit` use.
    let paged = write_job(&env, "paged", &src, &[&srv], &format!("metrics_token_file = \"{}\"\n", pages.display()));
    let r = dmover(["submit", "--dry-run", "--metrics", "0.0.0.0:9464"]).arg(&paged.path).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains(&format!("run --metrics 0.0.0.0:9464 {}", paged.path.display())), "{}", r.stdout);
}

/// CLI.md "status": `dmover status --json` prints the job's report with
/// exactly the documented fields — counts that add up, each node's, host's
/// and agent's share, the completion check — and it is the report `dmover
/// run --json` printed.
#[test]
fn status_json_has_the_documented_shape() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 42, 40);
    let (files, bytes) = (list_files(&src).len() as u64, total_size(&src));
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let job = write_job(&env, "shape", &src, &[&srv], "[slurm]\ntasks_per_node = 2\n");
    let r = dmover(["run", "--json"]).arg(&job.path).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let s = dmover(["status", "--json"]).arg(&job.path).run();
    assert_eq!(s.code, 0, "{}", s.stderr);
    let j = s.json();
    assert_eq!(j, r.json(), "status --json differs from the report of the run");
    let keys: Vec<&str> = j.as_object().expect("an object").keys().map(String::as_str).collect();
    let mut want = STATUS_KEYS.to_vec();
    want.sort();
    let mut got = keys.clone();
    got.sort();
    assert_eq!(got, want, "the fields of status --json are not the documented ones: {j:#}");
    assert_eq!(j["state"], "finished", "{j:#}");
    assert_eq!(j["job"], job.path.display().to_string(), "{j:#}");
    assert_eq!(j["slurm_job_id"], Value::Null, "no Slurm here: {j:#}");
    assert!(u(&j["updated_unix"]) >= u(&j["started_unix"]) && u(&j["started_unix"]) > 1_700_000_000, "{j:#}");
    assert!(j["seconds"].as_f64().is_some_and(|x| x > 0.0), "{j:#}");
    assert_eq!(j["walk_done"], true, "{j:#}");
    for (k, v) in [("total_files", files), ("total_bytes", bytes), ("done_files", files), ("done_bytes", bytes)] {
        assert_eq!(u(&j[k]), v, "{k}: {j:#}");
    }
    for k in ["skipped_files", "skipped_bytes", "earlier_files", "earlier_bytes", "failed_files", "retried_files"] {
        assert_eq!(u(&j[k]), 0, "{k}: {j:#}");
    }
    u(&j["requeued_files"]);
    assert!(j["mb_per_s"].as_f64().is_some_and(|x| x > 0.0) && j["files_per_s"].as_f64().is_some_and(|x| x > 0.0), "{j:#}");
    let timeline: Vec<(f64, u64, u64)> =
        j["timeline"].as_array().unwrap().iter().map(|p| (p["t"].as_f64().unwrap(), u(&p["bytes"]), u(&p["files"]))).collect();
    assert!(timeline.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1 && w[0].2 <= w[1].2), "{timeline:?}");
    assert_eq!(timeline.last().map(|p| (p.1, p.2)), Some((bytes, files)), "the timeline ends at what the run moved: {timeline:?}");
    let shares = |k: &str| -> Vec<(String, u64, u64)> {
        j[k].as_array()
            .unwrap_or_else(|| panic!("{k} is not an array: {j:#}"))
            .iter()
            .map(|e| (e["name"].as_str().unwrap_or_else(|| panic!("{k}: no name: {e}")).to_string(), u(&e["files"]), u(&e["bytes"])))
            .collect()
    };
    assert_eq!(shares("nodes"), [(hostname(), files, bytes)], "{j:#}");
    assert_eq!(shares("hosts"), [(format!("{}:{}", hostname(), srv.port), files, bytes)], "{j:#}");
    let agents = j["agents"].as_array().unwrap();
    assert_eq!(agents.len(), 2, "{j:#}");
    for (i, a) in agents.iter().enumerate() {
        assert_eq!((u(&a["id"]), a["node"].as_str(), a["state"].as_str()), (i as u64, Some(hostname().as_str()), Some("finished")), "{a}");
        u(&a["task"]);
        u(&a["pid"]);
    }
    let sum = |k: &str| agents.iter().map(|a| u(&a[k])).sum::<u64>();
    assert_eq!((sum("files"), sum("bytes")), (files, bytes), "the agents' shares do not add up: {j:#}");
    assert_eq!(j["failures"], serde_json::json!([]), "{j:#}");
    let check = serde_json::json!({ "passed": true, "source_files": files, "source_bytes": bytes,
                                    "dest_files": files, "dest_bytes": bytes, "digests_match": true });
    assert_eq!(j["check"], check, "{j:#}");
    assert_eq!((&j["error"], &j["resubmitted_as"]), (&Value::Null, &Value::Null), "{j:#}");
}

/// Rewrites `p` with other bytes of the same size and puts its mtime back.
fn change_keeping_size_and_mtime(p: &Path, seed: u64) {
    let (s, ns) = mtime_of(p);
    let size = std::fs::metadata(p).unwrap().len();
    write_random(p, size, seed);
    set_mtime(p, s, ns);
}

/// CLI.md job keys: a job skips files whose size and mtime match at the
/// destination (the quick check, which `transfer.sync` names); with
/// `transfer.checksum` it compares content, so a file changed without a
/// change of size or mtime is sent again — and only that one;
/// `transfer.ignore_times` sends every file again.
#[test]
fn job_reruns_skip_what_is_there_and_checksum_compares_content() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 43, 20);
    let files = list_files(&src).len() as u64;
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let dst = out.join("in");
    let run = |name: &str, extra: &str| -> Value {
        let job = write_job(&env, name, &src, &[&srv], extra);
        let r = dmover(["run", "--json"]).arg(&job.path).run();
        assert_eq!(r.code, 0, "job {name}: {}", r.stderr);
        let j = r.json();
        assert_eq!(j["check"]["passed"], true, "job {name}: {j:#}");
        j
    };
    let j = run("first", "");
    assert_eq!(u(&j["skipped_files"]), 0, "{j:#}");
    assert_same_tree(&src, &dst);

    // A fresh job (no done list) finds every file there.
    let j = run("again", "");
    assert_eq!((u(&j["skipped_files"]), u(&j["skipped_bytes"])), (files, total_size(&src)), "a re-run should skip every file: {j:#}");

    // With ignore_times, every file is sent again.
    let j = run("ignore", "[transfer]\nignore_times = true\n");
    assert_eq!(u(&j["skipped_files"]), 0, "ignore_times should send every file: {j:#}");
    assert_same_tree(&src, &dst);

    let changed = "a/b/c/multi.dat";
    change_keeping_size_and_mtime(&src.join(changed), 4343);
    let j = run("sync", "[transfer]\nsync = true\n");
    assert_eq!((u(&j["skipped_files"]), u(&j["skipped_bytes"])), (files, total_size(&src)), "sync should skip every file: {j:#}");
    assert!(!same_content(&src.join(changed), &dst.join(changed)), "the quick check sent the file whose size and mtime match");

    let j = run("checksum", "[transfer]\nchecksum = true\n");
    assert_eq!(u(&j["skipped_files"]), files - 1, "checksum should send exactly the changed file: {j:#}");
    assert_same_tree(&src, &dst);
}

/// CLI.md: a job whose destination does not accept the token is refused
/// before anything runs or is submitted: exit 7, one line naming the host
/// and the token; no state directory, nothing at the destination.
#[test]
fn a_job_with_the_wrong_token_is_refused_before_anything_runs() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 44, 5);
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let job = write_job(&env, "wrong", &src, &[&srv], "");
    let other = env.path("other-token");
    assert_eq!(dmover(["token".as_ref(), other.as_os_str()]).run().code, 0);
    let text = std::fs::read_to_string(&job.path).unwrap().replace(&env.token.display().to_string(), &other.display().to_string());
    std::fs::write(&job.path, text).unwrap();
    let host = format!("{}:{}", hostname(), srv.port);
    for cmd in [&["run"][..], &["submit", "--dry-run"]] {
        let r = dmover(cmd).arg(&job.path).run();
        r.assert_fails(7, &[&host, "does not accept the token"]);
        assert!(r.stdout.is_empty(), "{cmd:?} printed {:?}", r.stdout);
    }
    assert!(!job.state.exists(), "a refused job created its state directory");
    assert!(list_tree(&out).is_empty(), "a refused job wrote to the destination: {:?}", list_tree(&out));
}

#[test]
fn closed_stdout_ends_every_command_quietly() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 11, 20);
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let job = write_job(&env, "piped", &src, &[&srv], "");
    let r = dmover(["run"]).arg(&job.path).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let token = env.token.display().to_string();
    let job_path = job.path.display().to_string();
    let down = env.mkdir("down").display().to_string();
    // `dmover submit` past its checks, with an sbatch that takes the script
    // and answers with a job id, as Slurm's does.
    let bin = env.mkdir("bin");
    let sbatch = bin.join("sbatch");
    std::fs::write(&sbatch, "#!/bin/sh\ncat >/dev/null\necho 4242\n").unwrap();
    chmod(&sbatch, 0o755);
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let cases: Vec<Vec<String>> = vec![
        vec!["status".into(), job_path.clone()],
        vec!["status".into(), "--json".into(), job_path.clone()],
        vec!["run".into(), "--json".into(), job_path.clone()],
        vec!["submit".into(), "--dry-run".into(), job_path.clone()],
        vec!["submit".into(), job_path.clone()],
        vec!["ls".into(), "--token-file".into(), token.clone(), srv.url("dst/in")],
        vec!["ls".into(), "--json".into(), "--token-file".into(), token.clone(), srv.url("dst/in")],
        vec!["cp".into(), "--json".into(), "-q".into(), "--token-file".into(), token.clone(), srv.url("dst/in/"), down],
        vec!["bench".into(), "--json".into(), "--size".into(), "1M".into(), "--token-file".into(), token.clone(), srv.url("dst")],
        vec!["--help".into()],
        vec!["--version".into()],
    ];
    for args in cases {
        let r = dmover(&args).env("PATH", &path).stdout_closed().run();
        assert_eq!(r.code, 0, "dmover {args:?} with stdout closed; stderr:\n{}", r.stderr);
        assert!(!r.stderr.contains("panicked") && !r.stderr.contains("Broken pipe"), "dmover {args:?}: {}", r.stderr);
    }
    // (`dmover drain`: stream.rs, drain_ends_quietly_when_its_stdout_is_closed.)

    // `dmover ... 2>&1 | head -2`: stderr is closed too. Summaries, notes and
    // errors on stderr are dropped, and each command still ends with its own
    // exit code, not a panic's 101.
    let src_file = src.join(list_files(&src).keys().next().unwrap());
    let bad_job = env.path("bad.toml");
    std::fs::write(&bad_job, std::fs::read_to_string(&job.path).unwrap().replace("[\"**\"]", "[\"*.h5\"]")).unwrap();
    let nothing = env.path("nothing").display().to_string();
    let cases: Vec<(Vec<String>, i32)> = vec![
        (vec!["status".into(), job_path.clone()], 0),
        (vec!["run".into(), job_path.clone()], 0),
        (vec!["submit".into(), job_path.clone()], 0),
        (vec!["submit".into(), "--dry-run".into(), bad_job.display().to_string()], 3),
        (vec!["cp".into(), "--token-file".into(), token.clone(), src_file.display().to_string(), srv.url("dst/one/")], 0),
        (vec!["cp".into(), "--token-file".into(), token.clone(), nothing.clone(), srv.url("dst/one/")], 3),
        (vec!["ls".into(), "--token-file".into(), token.clone(), srv.url("dst/in")], 0),
        (vec!["cp".into()], 2),
    ];
    for (args, want) in cases {
        let r = dmover(&args).env("PATH", &path).output_closed().run();
        assert_eq!(r.code, want, "dmover {args:?} with stdout and stderr closed");
    }

    // A server whose stdout is closed keeps serving.
    let port = closed_port();
    let listen = format!("127.0.0.1:{port}");
    let export = format!("dst={}", out.display());
    let mut serve = std::process::Command::new(BIN);
    serve.args(["serve", "--listen", &listen, "--export", &export, "--token-file", &token]);
    let mut serve = serve.stdout(closed_pipe()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let url = format!("dmover://{listen}/dst/in");
    let serving = wait_until(Duration::from_secs(20), || dmover(["ls", "--token-file", &token, &url]).run().code == 0);
    let exited = serve.try_wait().unwrap();
    let _ = serve.kill();
    let _ = serve.wait();
    assert!(serving && exited.is_none(), "the server did not keep serving with its stdout closed (exit {exited:?})");
}

#[test]
fn job_errors_give_one_hint_and_point_to_the_job_docs() {
    let env = Env::new();
    let src = env.mkdir("src");
    std::fs::write(src.join("a.dat"), b"data").unwrap();
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let good = write_job(&env, "good", &src, &[&srv], "");
    let base = std::fs::read_to_string(&good.path).unwrap();
    let loose = env.path("loose-token");
    std::fs::copy(&env.token, &loose).unwrap();
    chmod(&loose, 0o644);
    let cases = [
        ("nomatch", base.replace("[\"**\"]", "[\"*.h5\"]"), 3, "check the pattern"),
        ("noroot", base.replace(&src.display().to_string(), "/no/such/root"), 3, "check the path"),
        ("unreachable", base.replace(&format!(":{}\"", srv.port), &format!(":{}\"", closed_port())), 6, "check that `dmover serve` runs"),
        ("loose", base.replace(&env.token.display().to_string(), &loose.display().to_string()), 2, "chmod 600"),
        ("unknown", format!("{base}[slurm]\nnodes = 2\ncpus = 4\n"), 2, "docs/CLI.md, section \"Batch jobs\""),
        ("badsize", format!("{base}[transfer]\nstaging = \"lots\"\n"), 2, "docs/CLI.md, section \"Batch jobs\""),
    ];
    for (name, text, code, hint) in cases {
        let p = env.path(&format!("{name}.toml"));
        std::fs::write(&p, text).unwrap();
        let r = dmover(["submit", "--dry-run"]).arg(&p).run();
        r.assert_fails(code, &[hint]);
        let line = r.error_lines()[0];
        assert!(line.ends_with(')'), "{name}: the hint ends the line: {line}");
        for twice in ["check", "run `", "re-run"] {
            assert!(line.matches(twice).count() <= 1, "{name}: {twice:?} said more than once: {line}");
        }
        assert!(!line.contains("dmover --help"), "{name}: --help does not describe job files: {line}");
    }
    // The section the hint names is there, and describes the keys refused above.
    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/CLI.md")).unwrap();
    let section = docs.split("\n## ").find(|s| s.starts_with("Batch jobs")).expect("docs/CLI.md has a section \"Batch jobs\"");
    for key in ["`slurm.nodes`", "`transfer.staging`", "`source_root`", "`sources`", "`dest_root`", "`token_file`"] {
        assert!(section.contains(key), "docs/CLI.md's section \"Batch jobs\" does not describe {key}");
    }
}

#[test]
fn server_logs_no_warnings_for_destination_checks_and_clients_that_hang_up() {
    let env = Env::new();
    let src = env.mkdir("src");
    std::fs::write(src.join("a.dat"), b"data").unwrap();
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let job = write_job(&env, "checked", &src, &[&srv], "");
    for _ in 0..3 {
        let r = dmover(["submit", "--dry-run"]).arg(&job.path).run();
        assert_eq!(r.code, 0, "{}", r.stderr);
    }
    // A client that knows the token but hangs up after the challenge.
    let mut c = Raw::connect(&srv.addr());
    c.send(&Raw::hello(dmover_proto::auth::TOKEN_KEY_ID, env.token_str().as_bytes()).1);
    assert!(matches!(c.read(), Some(dmover_proto::Msg::Challenge { .. })));
    drop(c);
    let hung_up = wait_until(Duration::from_secs(10), || srv.log().contains("hung up during the handshake"));
    let log = srv.log();
    assert!(hung_up, "the hang-up is not logged as one:\n{log}");
    let noise: Vec<&str> = log.lines().filter(|l| l.contains("WARN") || l.contains("authentication failed")).collect();
    assert!(noise.is_empty(), "checks and hang-ups logged as problems:\n{log}");
    // The checks themselves leave nothing about a short read: the one
    // hang-up logged is the client's above.
    let short_reads: Vec<&str> = log.lines().filter(|l| l.contains("failed to fill whole buffer") || l.contains("hung up")).collect();
    assert_eq!(short_reads.len(), 1, "the destination checks are logged as cut-short connections:\n{log}");

    // A client with another token is still logged as an authentication failure.
    let other = env.path("other-token");
    assert_eq!(dmover(["token".as_ref(), other.as_os_str()]).run().code, 0);
    let r = dmover(["ls", "--token-file"]).arg(&other).arg(srv.url("dst")).run();
    assert_eq!(r.code, 7, "{}", r.stderr);
    let refused = wait_until(Duration::from_secs(10), || srv.log().contains("token differs"));
    assert!(refused, "a wrong token is not logged as such:\n{}", srv.log());
}

#[test]
fn a_mistyped_export_in_dest_root_is_refused_at_submit() {
    let env = Env::new();
    let src = env.mkdir("src");
    std::fs::write(src.join("a.dat"), b"data").unwrap();
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let job = write_job(&env, "typo", &src, &[&srv], "");
    let text = std::fs::read_to_string(&job.path).unwrap().replace("dest_root = \"dst/in\"", "dest_root = \"dts/in\"");
    std::fs::write(&job.path, text).unwrap();
    for cmd in [&["submit", "--dry-run"][..], &["run"]] {
        let r = dmover(cmd).arg(&job.path).run();
        r.assert_fails(8, &["dts/in", "no export named 'dts'", "--export NAME=DIR"]);
        assert!(r.stdout.is_empty(), "{cmd:?} printed {:?}", r.stdout);
    }
    assert!(!job.state.exists(), "a refused job created its state directory");
    assert!(list_tree(&out).is_empty(), "a refused job wrote to the destination: {:?}", list_tree(&out));
}

#[test]
fn status_shows_why_agents_stopped() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 13, 10);
    let out = env.mkdir("out");
    // The destination directory is a file: every agent's session is refused.
    std::fs::write(out.join("in"), b"in the way").unwrap();
    let srv = public_server(&env, &out);
    let job = write_job(&env, "stopped", &src, &[&srv], "[slurm]\ntasks_per_node = 2\n");
    let r = dmover(["run"]).arg(&job.path).run();
    assert_ne!(r.code, 0, "{}", r.stderr);
    let s = dmover(["status"]).arg(&job.path).run();
    assert_eq!(s.code, 0, "{}", s.stderr);
    let lost: Vec<&str> = s.stdout.lines().filter(|l| l.contains("lost: agent")).collect();
    assert_eq!(lost.len(), 2, "{}", s.stdout);
    for l in lost {
        assert!(l.contains("dst/in") && l.contains("is a file, not a directory"), "the agent's error is not shown: {l}\n{}", s.stdout);
    }
    let j = dmover(["status", "--json"]).arg(&job.path).run().json();
    for a in j["agents"].as_array().unwrap() {
        assert!(a["error"].as_str().is_some_and(|e| e.contains("is a file, not a directory")), "{a}");
    }
    assert!(j["error"].as_str().is_some_and(|e| e.contains("is a file, not a directory")), "{j:#}");
}

/// The `.dmover-partial/transfer-*` markers left at the destinations.
fn markers(dirs: &[PathBuf]) -> Vec<String> {
    dirs.iter()
        .filter_map(|d| std::fs::read_dir(d.join(".dmover-partial")).ok())
        .flatten()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("transfer-"))
        .collect()
}

#[test]
fn a_killed_agents_markers_are_removed_when_the_job_finishes() {
    if !dmover_testkit::slurm_possible() {
        return;
    }
    let _cluster = dmover_testkit::slurm_cluster();
    let env = Env::new();
    let src = env.mkdir("src");
    let mut rng = Rng::new(4);
    for i in 0..300 {
        make_file(&src.join(format!("d{}/f{i:03}.dat", i % 5)), 64 << 10, &mut rng);
    }
    let (out_a, out_b) = (env.mkdir("a"), env.mkdir("b"));
    let (sa, sb) = (public_server(&env, &out_a), public_server(&env, &out_b));
    let extra = "[transfer]\nbwlimit = \"1M\"\n[slurm]\nnodes = 2\ntasks_per_node = 2\n";
    let job = write_job(&env, "markers", &src, &[&sa, &sb], extra);
    let id = submit(&job);
    kill_an_agent_on_node2(&job);
    let dests = [out_a.join("in"), out_b.join("in")];
    let r = wait_report(&job, &id, Duration::from_secs(120));
    assert_eq!((&r["state"], &r["check"]["passed"]), (&Value::from("finished"), &Value::from(true)), "{r:#}");
    assert_eq!(r["agents"].as_array().unwrap().iter().filter(|a| a["state"] == "lost").count(), 1, "{r:#}");
    assert_spread(&src, &dests);
    let left = markers(&dests);
    assert!(left.is_empty(), "markers left at the destinations after the job finished: {left:?}");
}

// ---------------------------------------------------------------------------
// Sources and destinations in S3 (a real S3 server)

/// The keys of the files below `dir`, leaving out dmover's resume state.
fn delivered(dir: &Path) -> Vec<String> {
    list_files(dir).into_keys().filter(|k| !k.starts_with(".dmover-partial/")).collect()
}

/// A job file whose source_root is a bucket: refused before anything runs
/// when its agent cannot read objects, when the bucket is missing, the
/// credentials are wrong, the S3 server does not answer, the URL is
/// malformed or nothing is below the prefix; the S3 server is found
/// through AWS_ENDPOINT_URL here, unless s3_endpoint names another.
#[test]
fn s3_sources_are_checked_before_anything_runs() {
    let env = Env::new();
    let Some(s3) = S3Server::start(&env.path("s3")) else { return };
    let home = env.mkdir("home");
    let bucket = s3.bucket("data");
    std::fs::create_dir_all(bucket.join("run")).unwrap();
    std::fs::write(bucket.join("run/a.dat"), b"an object").unwrap();
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let good = write_job(&env, "good", Path::new("s3://data/run"), &[&srv], "");
    let base = std::fs::read_to_string(&good.path).unwrap();
    let case = |name: &str, text: String| {
        let p = env.path(&format!("{name}.toml"));
        std::fs::write(&p, text).unwrap();
        dmover(["submit", "--dry-run"]).arg(&p).s3(&s3, &home).run()
    };
    let r = case("good", base.clone());
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains(&format!("run {}", good.path.display())), "{}", r.stdout);
    let r = case("command", format!("agent = \"cp {{src}} {{dst}}\"\n{base}"));
    r.assert_fails(ErrorKind::Usage as i32, &["command.toml", "command agent", "s3://data/run", "native"]);
    let r = case("nobucket", base.replace("s3://data/run", "s3://nobucket/run"));
    r.assert_fails(ErrorKind::NotFound as i32, &["s3://nobucket", "no such bucket", "create it first"]);
    let r = dmover(["submit", "--dry-run"]).arg(&good.path).s3(&s3, &home).env("AWS_SECRET_ACCESS_KEY", "not-the-secret").run();
    r.assert_fails(ErrorKind::Auth as i32, &["s3://data", "refused the credentials", "AWS_SECRET_ACCESS_KEY"]);
    let r = case("noserver", format!("s3_endpoint = \"http://127.0.0.1:{}\"\n{base}", closed_port()));
    r.assert_fails(ErrorKind::Unreachable as i32, &["s3://data", "cannot reach the S3 server", "s3_endpoint"]);
    let r = case("malformed", base.replace("s3://data/run", "s3://da ta/run"));
    r.assert_fails(ErrorKind::Usage as i32, &["source_root", "malformed URL", "s3://BUCKET/prefix"]);
    let r = case("empty", base.replace("s3://data/run", "s3://data/nothing"));
    r.assert_fails(ErrorKind::NotFound as i32, &["s3://data/nothing", "source_root", "objects below"]);
    let r = case("nomatch", base.replace("[\"**\"]", "[\"*.h5\"]"));
    r.assert_fails(ErrorKind::NotFound as i32, &["s3://data/run", "\"*.h5\"", "matches nothing"]);
    assert!(!good.state.exists(), "nothing may be created by a refused job");
}

/// A job whose source_root is a bucket prefix, run by agents on two nodes
/// that read the objects themselves (the nodes reach the S3 server by this
/// machine's name, which the job file's s3_endpoint gives): every object
/// below the prefix arrives at a directory export, byte for byte, and
/// nothing beside the prefix does.
#[test]
fn slurm_job_reads_a_bucket_prefix_into_a_directory_export() {
    if !dmover_testkit::slurm_possible() {
        return;
    }
    let env = Env::new();
    let Some(s3) = S3Server::start_on(&env.path("s3"), "0.0.0.0") else { return };
    let home = env.mkdir("home");
    let _cluster = dmover_testkit::slurm_cluster();
    let bucket = s3.bucket("data");
    let want = make_tree(&bucket.join("run"), 41, 60);
    std::fs::write(bucket.join("beside.dat"), b"outside the prefix").unwrap();
    let out = env.mkdir("out");
    let srv = public_server(&env, &out);
    let extra = format!("s3_endpoint = \"http://{}:{}\"\n[slurm]\nnodes = 2\ntasks_per_node = 2\ntime = \"5\"\n", hostname(), s3.port);
    let job = write_job(&env, "from-s3", Path::new("s3://data/run"), &[&srv], &extra);
    let id = job_id(dmover(["submit"]).arg(&job.path).s3(&s3, &home).run());
    let r = wait_report(&job, &id, Duration::from_secs(120));
    let output = std::fs::read_to_string(job.state.join(format!("slurm-{id}.out"))).unwrap_or_default();
    assert_eq!(r["state"], "finished", "report: {r:#}\noutput:\n{output}");
    assert_eq!(r["check"]["passed"], true, "{r:#}");
    assert_eq!(r["total_files"], want.len() as u64, "{r:#}");
    assert_eq!(r["done_files"], want.len() as u64, "{r:#}");
    let nodes = node_files(&r);
    assert!(!nodes.is_empty() && nodes.keys().all(|n| n == "node1" || n == "node2"), "agents on the nodes read the objects: {r:#}");
    assert_eq!(delivered(&out.join("in")), want, "the files at the destination are the objects below the prefix");
    for k in &want {
        assert!(same_content(&bucket.join("run").join(k), &out.join("in").join(k)), "{k}: content differs");
    }
}

/// A job from a directory into a bucket a server exports
/// (`--export dst=s3://store/incoming`), run by agents on two nodes: every
/// file becomes an object below the prefix, byte for byte.
#[test]
fn slurm_job_delivers_into_a_bucket_a_server_exports() {
    if !dmover_testkit::slurm_possible() {
        return;
    }
    let env = Env::new();
    let Some(s3) = S3Server::start(&env.path("s3")) else { return };
    let home = env.mkdir("home");
    let _cluster = dmover_testkit::slurm_cluster();
    let bucket = s3.bucket("store");
    let src = env.mkdir("src");
    let want = make_tree(&src, 43, 60);
    let mut spec = ServerSpec::new(&env.token, &[("dst", Path::new("s3://store/incoming"))], &env.path("server.log"));
    spec.listen = "0.0.0.0:0".into();
    spec.envs = s3_env(&s3, &home);
    let srv = Server::start(spec);
    let job = write_job(&env, "into-s3", &src, &[&srv], "[slurm]\nnodes = 2\ntasks_per_node = 2\ntime = \"5\"\n");
    let id = submit(&job);
    let r = wait_report(&job, &id, Duration::from_secs(120));
    let output = std::fs::read_to_string(job.state.join(format!("slurm-{id}.out"))).unwrap_or_default();
    assert_eq!(r["state"], "finished", "report: {r:#}\noutput:\n{output}");
    assert_eq!(r["check"]["passed"], true, "{r:#}");
    assert_eq!(r["done_files"], want.len() as u64, "{r:#}");
    let objects = bucket.join("incoming/in");
    assert_eq!(delivered(&objects), want, "the objects below incoming/in are the files");
    for k in &want {
        assert!(same_content(&src.join(k), &objects.join(k)), "{k}: the object differs from the file");
    }
}

/// A job whose destination fills up keeps every file committed there:
/// the job ends with the file that did not fit among its failures, and
/// the files it counts as done are those at the destination, each as it
/// is at the source.
#[test]
fn a_job_to_a_full_destination_keeps_the_files_that_fit() {
    if !dmover_testkit::needs_root("a loop-mounted ext4") {
        return;
    }
    let env = Env::new();
    let src = env.mkdir("src");
    for i in 0..60u64 {
        write_random(&src.join(format!("d{}/f{i:03}.dat", i % 3)), 1 + i * 97 % 6000, i);
    }
    write_random(&src.join("big.dat"), 12 << 20, 99);
    let out = env.path("full");
    let _m = Mount::ext4(&out, &env.path("full.img"), "8M");
    let srv = public_server(&env, &out);
    let job = write_job(&env, "full", &src, &[&srv], "");
    let r = dmover(["run", "--json"]).arg(&job.path).timeout(Duration::from_secs(120)).run();
    let j = r.json();
    assert_ne!(r.code, 0, "{j:#}");
    let failures = j["failures"].as_array().unwrap_or_else(|| panic!("no failures listed: {j:#}"));
    assert!(failures.iter().any(|f| f.to_string().contains("big.dat")), "big.dat is not among the failures: {j:#}");
    let done = std::fs::read_to_string(job.state.join("done.list")).unwrap();
    assert!(done.lines().count() > 0, "nothing is done: {j:#}");
    for line in done.lines() {
        let rel: String = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?} in done.list: {e}"));
        assert!(same_content(&src.join(&rel), &out.join("in").join(&rel)), "{rel} is done, yet not at the destination as at the source");
    }
    assert!(!done.contains("big.dat"), "big.dat is counted done");
    // And what is there is counted done: nothing was committed unreported.
    let done: std::collections::BTreeSet<String> = done.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let there: std::collections::BTreeSet<String> = list_files(&out.join("in")).into_keys().filter(|k| is_final_name(k)).collect();
    assert_eq!(there, done, "the files at the destination are not those the job counts done");
}
