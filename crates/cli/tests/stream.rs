//! In-situ streaming end to end: producers (the `dmover-stream` library in
//! this process, and the C and Fortran examples as their own processes)
//! stream to real `dmover sink` processes; every block is checked against
//! what the producer wrote, on disk at the sink the manifests name.

mod util;

use dmover_proto::digest::block_sum;
use dmover_stream::{Config, Report, Stream};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use util::*;

const PRODUCER: &str = "sim-0";
const BLOCK: u32 = 64 * 1024;

/// The bytes of step `step`: deterministic, different for every step.
fn step_data(step: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(0x5eed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut v = vec![0u8; len];
    r.fill(&mut v);
    v
}

/// Step sizes that hit the edges: empty, under a block, exactly blocks, odd.
fn step_len(step: u64) -> usize {
    match step % 5 {
        0 => 300_000 + step as usize * 1013,
        1 => 1000,
        2 => 4 * BLOCK as usize,
        3 => 0,
        _ => 777_777,
    }
}

fn config(env: &Env, dests: &[&str], spill: &Path) -> Config {
    let mut c = Config::new(PRODUCER, dests, env.token_str().as_bytes(), spill);
    c.block_size = BLOCK;
    c.buffer = 16 * BLOCK as u64;
    // The tests read where each block went from the producer's manifest.
    c.keep_manifest = true;
    c
}

/// Writes step `step` in uneven pieces, with metadata.
fn write_step(s: &mut Stream, step: u64) -> Vec<u8> {
    let data = step_data(step, step_len(step));
    s.write_metadata("var", "density").unwrap();
    s.write_metadata("step", &step.to_string()).unwrap();
    let mut at = 0;
    let mut piece = 10_000;
    while at < data.len() {
        let n = piece.min(data.len() - at);
        s.write(&data[at..n + at]).unwrap();
        at += n;
        piece = piece * 3 % 200_003 + 1;
    }
    s.end_step().unwrap();
    data
}

fn read_json(p: &Path) -> Value {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

/// Waits until `sink` (writing to `out`) has saved step `step`, and every
/// byte between it and the producer was read, its acknowledgements too:
/// the steps written so far are settled there.
#[track_caller]
fn wait_settled(sink: &Server, out: &Path, step: u64) {
    let manifest = out.join(PRODUCER).join(format!("step-{step:06}.json"));
    let saved = wait_until(Duration::from_secs(20), || manifest.is_file());
    assert!(saved, "step {step} was not saved at the sink at {} within 20 s:\n{}", sink.addr(), sink.log());
    wait_quiet(sink.port, 1, &format!("step {step} settled at the sink at {}", sink.addr()));
}

/// Waits until the (stopped) `sink` has bytes on its connections that it
/// did not read: blocks in flight to it, unacknowledged.
#[track_caller]
fn wait_in_flight(sink: &Server) {
    let unread = || socket_queues(sink.port, true).iter().any(|&(unread, _)| unread > 0);
    assert!(wait_until(Duration::from_secs(20), unread), "no blocks in flight to the sink at {} within 20 s", sink.addr());
}

/// Waits until the producer has a connection to `sink` (it failed over to it).
#[track_caller]
fn wait_connected(sink: &Server, why: &str) {
    let connected = || !socket_queues(sink.port, true).is_empty();
    assert!(wait_until(Duration::from_secs(20), connected), "no connection to the sink at {} within 20 s ({why})", sink.addr());
}

/// Checks every block of every step against what was written, where the
/// producer's manifest says it is (`sinks`: address → the sink's directory).
fn check_delivery(report: &Report, written: &[Vec<u8>], sinks: &HashMap<String, PathBuf>) -> Value {
    assert_eq!(report.undelivered_blocks, 0, "{report:?}");
    assert_eq!(report.unsaved_steps, 0, "{report:?}");
    assert_eq!(report.steps, written.len() as u64);
    assert_eq!(report.bytes, written.iter().map(|w| w.len() as u64).sum::<u64>());
    check_manifest(report.manifest.as_deref().expect("the manifest is kept"), written, sinks)
}

/// Checks the producer's manifest: every block at a sink, as written.
fn check_manifest(manifest: &Path, written: &[Vec<u8>], sinks: &HashMap<String, PathBuf>) -> Value {
    let m = read_json(manifest);
    let steps = m["steps"].as_array().unwrap();
    assert_eq!(steps.len(), written.len());
    for (step, want) in written.iter().enumerate() {
        let s = &steps[step];
        assert_eq!(s["step"], step as u64);
        assert_eq!(s["bytes"], want.len() as u64);
        assert_eq!(s["metadata"]["step"], step.to_string());
        let mut covered = 0;
        for b in s["blocks"].as_array().unwrap() {
            let (off, len) = (u(&b["offset"]) as usize, u(&b["len"]) as usize);
            assert_eq!(off, covered, "step {step}: blocks in order, without gaps");
            covered += len;
            let at = b["at"].as_str().unwrap_or_else(|| panic!("step {step} block at {off} is not at a sink: {b}"));
            let file = sinks[at].join(PRODUCER).join(format!("step-{step:06}.dat"));
            let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let got = &bytes[off..off + len];
            assert_eq!(b["xxh3"], hex::encode(block_sum(got)), "step {step} block at {off} in {}", file.display());
            assert!(got == &want[off..off + len], "step {step} block at {off} differs from what was written");
        }
        assert_eq!(covered, want.len(), "step {step}");
        let saved_at = s["manifest_at"].as_str().unwrap();
        assert!(sinks[saved_at].join(PRODUCER).join(format!("step-{step:06}.json")).is_file());
    }
    m
}

#[test]
fn every_step_arrives_verified_with_its_manifest_and_runs_the_hook() {
    let env = Env::new();
    let (out, hooked, spill) = (env.mkdir("sink"), env.mkdir("hooked"), env.mkdir("spill"));
    let hook = format!("cp -t {}", hooked.display());
    let metrics = format!("127.0.0.1:{}", closed_port());
    let sink = env.sink(&out, ["--hook", &hook, "--metrics", &metrics]);
    // Writes may wait for room (the blocking bound), so nothing spills even
    // though this producer writes far faster than it can send.
    let mut c = config(&env, &[&sink.addr()], &spill);
    c.max_wait = Duration::from_secs(30);
    let mut s = Stream::open(c).unwrap();
    let written: Vec<Vec<u8>> = (0..12).map(|step| write_step(&mut s, step)).collect();
    let report = s.close().unwrap();
    assert_eq!(report.spilled_blocks, 0, "{report:?}");
    assert_eq!(report.failovers, 0, "{report:?}");
    let sinks = HashMap::from([(sink.addr(), out.clone())]);
    check_delivery(&report, &written, &sinks);
    assert_eq!(std::fs::read_dir(&spill).unwrap().count(), 1, "only the manifest stays in the spill directory");
    for (step, want) in written.iter().enumerate() {
        // The whole step is one file at the sink, and its manifest says so.
        let dir = out.join(PRODUCER);
        assert!(std::fs::read(dir.join(format!("step-{step:06}.dat"))).unwrap() == *want, "step {step}");
        let m = read_json(&dir.join(format!("step-{step:06}.json")));
        assert_eq!(m["complete"], true);
        assert_eq!(m["producer"], PRODUCER);
        assert_eq!(m["metadata"]["var"], "density");
        assert_eq!(m["bytes"], want.len() as u64);
        let records: u64 = m["records"].as_array().unwrap().iter().map(|r| u(&r["len"])).sum();
        assert_eq!(records, want.len() as u64);
        for b in m["blocks"].as_array().unwrap() {
            assert_eq!(b["here"], true);
            assert_eq!(b["at"], sink.addr());
        }
        // The hook ran with this manifest.
        let copy = hooked.join(format!("step-{step:06}.json"));
        assert!(wait_until(Duration::from_secs(20), || copy.is_file()), "no hook for step {step}:\n{}", sink.log());
    }
    // The sink's metrics page counts the session, every step and every byte.
    let (_, page) = http_get(&metrics, "/metrics").expect("the metrics page answers");
    let bytes: usize = written.iter().map(Vec::len).sum();
    assert_eq!(sample(&page, "dmover_sink_steps_total{complete=\"true\"}"), Some(written.len() as f64), "{page}");
    assert_eq!(sample(&page, "dmover_sink_steps_total{complete=\"false\"}"), Some(0.0), "{page}");
    assert_eq!(sample(&page, "dmover_sink_received_bytes_total"), Some(bytes as f64), "{page}");
    assert_eq!(sample(&page, "dmover_sessions_total{kind=\"stream\"}"), Some(1.0), "{page}");
    if on_path("promtool") {
        promtool_check(&page);
    }
}

#[test]
fn a_wrong_token_or_no_sink_fails_at_open_with_a_clear_error() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let sink = env.sink(&out, [] as [&str; 0]);
    let mut c = config(&env, &[&sink.addr()], &spill);
    c.token = b"not-the-token-of-this-sink".to_vec();
    let e = Stream::open(c).err().expect("a wrong token must fail");
    assert_eq!(e.kind, dmover_proto::ErrorKind::Auth, "{e}");
    let closed = format!("127.0.0.1:{}", closed_port());
    let e = Stream::open(config(&env, &[&closed], &spill)).err().expect("no sink must fail");
    assert_eq!(e.kind, dmover_proto::ErrorKind::Unreachable, "{e}");
    let mut c = config(&env, &[&sink.addr()], &spill);
    c.producer = "../escape".into();
    assert_eq!(Stream::open(c).err().unwrap().kind, dmover_proto::ErrorKind::Usage);
    // A producer directory that is a symlink is refused at once.
    std::os::unix::fs::symlink(env.root(), out.join("linked")).unwrap();
    let mut c = config(&env, &[&sink.addr()], &spill);
    c.producer = "linked".into();
    let e = Stream::open(c).err().expect("a symlinked producer directory must be refused");
    assert_eq!(e.kind, dmover_proto::ErrorKind::Refused, "{e}");
    // A file server is not a sink: it refuses streams and says what to run.
    let server = env.serve(&[("x", &env.mkdir("export"))]);
    let e = Stream::open(config(&env, &[&server.addr()], &spill)).err().expect("dmover serve must refuse streams");
    assert_eq!(e.kind, dmover_proto::ErrorKind::Refused, "{e}");
    assert!(e.message.contains("dmover sink"), "{e}");
    assert!(!e.hint().contains("export"), "the advice for a refused stream must not speak of exports: {}", e.hint());
}

#[test]
fn overflow_spills_to_disk_and_everything_arrives_after_close() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let metrics = format!("127.0.0.1:{}", closed_port());
    let sink = env.sink(&out, ["--metrics", &metrics]);
    let mut s = Stream::open(config(&env, &[&sink.addr()], &spill)).unwrap();
    let mut written: Vec<Vec<u8>> = (0..3).map(|step| write_step(&mut s, step)).collect();
    // A sink that stops answering: nothing is acknowledged, the 16-block
    // buffer fills, and the rest must go to the spill file.
    sink.signal(libc::SIGSTOP);
    written.extend((3..10).map(|step| write_step(&mut s, step)));
    let stopped: u64 = written[3..].iter().map(|w| w.len() as u64).sum();
    let spill_file = std::fs::read_dir(&spill).unwrap().map(|e| e.unwrap().path()).find(|p| p.extension().is_some_and(|x| x == "spill"));
    let spill_file = spill_file.expect("writes beyond the buffer went to a spill file");
    sink.signal(libc::SIGCONT);
    let report = s.close().unwrap();
    assert!(report.spilled_blocks > 0, "{report:?}");
    // Slots filled while the sink was stopped cannot be freed before it
    // resumes, so at most a buffer's worth of that data stayed in memory.
    assert!(report.spilled_bytes >= stopped - 16 * BLOCK as u64, "{stopped} bytes written while stopped: {report:?}");
    assert_eq!(report.max_streams, dmover_stream::DEFAULT_MAX_STREAMS, "overflow is state A, with every connection: {report:?}");
    assert!(report.ticks_a > 0, "{report:?}");
    let sinks = HashMap::from([(sink.addr(), out.clone())]);
    check_delivery(&report, &written, &sinks);
    assert!(!spill_file.exists(), "the spill file is removed once every block in it was delivered");
    // The producer told the sink of its spills, with its steps' ends.
    let (_, page) = http_get(&metrics, "/metrics").expect("the sink's metrics page answers");
    assert_eq!(sample(&page, "dmover_sink_producer_spilled_blocks_total"), Some(report.spilled_blocks as f64), "{report:?}\n{page}");
    assert_eq!(sample(&page, "dmover_sink_producer_spilled_bytes_total"), Some(report.spilled_bytes as f64), "{report:?}\n{page}");
    assert_eq!(sample(&page, "dmover_sink_producer_failovers_total"), Some(0.0), "{page}");
}

#[test]
fn killing_the_primary_sink_fails_over_to_the_alternate_and_loses_nothing() {
    let env = Env::new();
    let (out_a, out_b, spill) = (env.mkdir("sink-a"), env.mkdir("sink-b"), env.mkdir("spill"));
    let mut primary = env.sink(&out_a, [] as [&str; 0]);
    let metrics = format!("127.0.0.1:{}", closed_port());
    let alternate = env.sink(&out_b, ["--metrics", &metrics]);
    let mut s = Stream::open(config(&env, &[&primary.addr(), &alternate.addr()], &spill)).unwrap();
    let mut written: Vec<Vec<u8>> = (0..4).map(|step| write_step(&mut s, step)).collect();
    // Let the first steps settle at the primary, then freeze it so that
    // blocks are in flight, unacknowledged, when it dies.
    wait_settled(&primary, &out_a, 3);
    primary.signal(libc::SIGSTOP);
    written.extend((4..7).map(|step| write_step(&mut s, step)));
    wait_in_flight(&primary);
    primary.kill9();
    written.extend((7..12).map(|step| write_step(&mut s, step)));
    let report = s.close().unwrap();
    assert!(report.failovers >= 1, "{report:?}");
    assert!(report.resent_blocks > 0, "blocks in flight to the frozen primary were sent again: {report:?}");
    let sinks = HashMap::from([(primary.addr(), out_a.clone()), (alternate.addr(), out_b.clone())]);
    let m = check_delivery(&report, &written, &sinks);
    let at = |step: usize| -> Vec<String> {
        m["steps"][step]["blocks"].as_array().unwrap().iter().map(|b| b["at"].as_str().unwrap().to_string()).collect()
    };
    assert!(at(0).iter().all(|a| *a == primary.addr()), "the first step went to the primary");
    assert!(at(11).iter().all(|a| *a == alternate.addr()), "the last step went to the alternate");
    // Each manifest at the alternate names where every block of its step is,
    // its own blocks and those the primary holds.
    for step in 0..written.len() {
        let p = out_b.join(PRODUCER).join(format!("step-{step:06}.json"));
        if !p.is_file() {
            continue;
        }
        let sm = read_json(&p);
        let blocks = sm["blocks"].as_array().unwrap();
        let mine: Vec<String> = blocks.iter().map(|b| b["at"].as_str().unwrap().to_string()).collect();
        assert_eq!(mine, at(step), "step {step}: the sink's manifest and the producer's agree");
        assert_eq!(sm["complete"], blocks.iter().all(|b| b["here"] == true));
    }
    assert!(out_b.join(PRODUCER).join("step-000011.json").is_file());
    // The alternate heard of the failover with the steps' ends it got.
    let (_, page) = http_get(&metrics, "/metrics").expect("the sink's metrics page answers");
    assert_eq!(sample(&page, "dmover_sink_producer_failovers_total"), Some(report.failovers as f64), "{report:?}\n{page}");
}

/// The static library cargo built for these tests (a dev-dependency).
fn static_lib() -> PathBuf {
    let deps = Path::new(BIN).parent().unwrap().join("deps");
    let newest = std::fs::read_dir(&deps)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("libdmover_stream") && p.extension().is_some_and(|x| x == "a"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().modified().unwrap());
    newest.unwrap_or_else(|| panic!("no libdmover_stream*.a in {}", deps.display()))
}

fn crate_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../stream")
}

fn build(compiler: &str, sources: &[PathBuf], out: &Path) {
    let lib = static_lib();
    let r = Command::new(compiler)
        .arg("-O2")
        .arg("-I")
        .arg(crate_dir().join("include"))
        .args(sources)
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(out)
        .current_dir(out.parent().unwrap())
        .output()
        .unwrap_or_else(|e| panic!("{compiler}: {e} (install it: apt-get install {compiler})"));
    assert!(r.status.success(), "{compiler} failed:\n{}", String::from_utf8_lossy(&r.stderr));
}

/// Runs an example producer (`exe`, then `script` if any); checks its
/// report line and the data at the sink.
fn run_example(env: &Env, exe: &Path, script: Option<&Path>, producer: &str, steps: u64, n: u64) {
    let (out, spill) = (env.mkdir(&format!("sink-{producer}")), env.mkdir(&format!("spill-{producer}")));
    let sink = env.sink(&out, [] as [&str; 0]);
    let r = Command::new(exe)
        .args(script)
        .args([producer, &sink.addr(), spill.to_str().unwrap(), &steps.to_string(), &n.to_string(), "5"])
        .env("DMOVER_TOKEN_FILE", &env.token)
        .env_remove("DMOVER_TOKEN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&r.stdout);
    let stderr = String::from_utf8_lossy(&r.stderr);
    let hint = if stderr.contains("No module named") { "\n(install the module: pip install ./crates/py h5py)" } else { "" };
    assert!(r.status.success(), "{} failed: {stdout}\n{stderr}{hint}", exe.display());
    assert!(stdout.contains(&format!("steps={steps} ")), "{stdout}");
    assert!(stdout.contains("undelivered=0"), "{stdout}");
    for step in 0..steps {
        let dir = out.join(producer);
        let data = std::fs::read(dir.join(format!("step-{step:06}.dat"))).unwrap();
        assert_eq!(data.len() as u64, n * 8, "step {step}");
        for (i, c) in data.chunks_exact(8).enumerate() {
            let v = f64::from_le_bytes(c.try_into().unwrap());
            assert_eq!(v, (step * 1_000_003 + i as u64) as f64, "{producer} step {step} value {i}");
        }
        let m = read_json(&dir.join(format!("step-{step:06}.json")));
        assert_eq!(m["complete"], true);
        assert_eq!(m["metadata"]["var"], "phi");
        assert_eq!(m["metadata"]["dims"], n.to_string());
        assert_eq!(m["metadata"]["step"], step.to_string());
    }
}

#[test]
fn the_c_example_streams_to_a_real_sink() {
    let env = Env::new();
    let exe = env.path("gtc-c");
    build("cc", &[crate_dir().join("examples/gtc.c")], &exe);
    run_example(&env, &exe, None, "gtc-c", 6, 300_000);
}

#[test]
fn the_fortran_example_streams_to_a_real_sink() {
    let env = Env::new();
    let exe = env.path("gtc-f");
    build("gfortran", &[crate_dir().join("include/dmover_stream.f90"), crate_dir().join("examples/gtc.f90")], &exe);
    run_example(&env, &exe, None, "gtc-f", 4, 200_000);
}

/// Needs the module installed: `pip install ./crates/py` (.ci/run does it).
#[test]
fn the_python_example_streams_numpy_arrays_to_a_real_sink() {
    let env = Env::new();
    let script = crate_dir().join("../py/examples/gtc.py");
    run_example(&env, Path::new("python3"), Some(&script), "gtc-py", 5, 250_000);
}

#[test]
fn the_python_module_takes_any_contiguous_buffer_and_refuses_the_rest() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let sink = env.sink(&out, [] as [&str; 0]);
    let r = Command::new("python3")
        .arg(crate_dir().join("../py/tests/check_api.py"))
        .args([&sink.addr(), spill.to_str().unwrap(), out.to_str().unwrap()])
        .env("DMOVER_TOKEN_FILE", &env.token)
        .env_remove("DMOVER_TOKEN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success() && stdout.trim() == "ok", "{stdout}\n{}", String::from_utf8_lossy(&r.stderr));
}

/// Needs h5py (.ci/run installs it).
#[test]
fn the_hdf5_hook_writes_each_step_as_datasets_with_its_metadata() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let hook = format!("python3 {}", crate_dir().join("../py/examples/to_hdf5.py").display());
    let sink = env.sink(&out, ["--hook", &hook]);
    let mut s = Stream::open(config(&env, &[&sink.addr()], &spill)).unwrap();
    let steps = 3u64;
    for step in 0..steps {
        let phi: Vec<u8> = (0..12).flat_map(|i| (step as f64 * 100.0 + i as f64).to_le_bytes()).collect();
        let density: Vec<u8> = (0..5).flat_map(|i| (i as f32 * 0.5 - step as f32).to_le_bytes()).collect();
        s.write_metadata("var", "phi;density").unwrap();
        s.write_metadata("dims", "3,4;5").unwrap();
        s.write_metadata("dtype", "<f8;<f4").unwrap();
        s.write_metadata("time", &format!("{}", step as f64 * 0.25)).unwrap();
        s.write(&phi).unwrap();
        s.write(&density).unwrap();
        s.end_step().unwrap();
    }
    s.close().unwrap();
    let dir = out.join(PRODUCER);
    for step in 0..steps {
        let h5 = dir.join(format!("step-{step:06}.h5"));
        assert!(wait_until(Duration::from_secs(60), || h5.is_file()), "no {}:\n{}", h5.display(), sink.log());
    }
    let check = r#"
import sys, h5py, numpy as np
d = sys.argv[1]
for step in range(int(sys.argv[2])):
    with h5py.File(f"{d}/step-{step:06d}.h5", "r") as h:
        phi, den = h["phi"][()], h["density"][()]
        assert phi.shape == (3, 4) and phi.dtype == np.float64, (phi.shape, phi.dtype)
        assert (phi == step * 100.0 + np.arange(12).reshape(3, 4)).all(), phi
        assert den.shape == (5,) and den.dtype == np.float32
        assert (den == np.arange(5, dtype=np.float32) * 0.5 - step).all(), den
        assert h.attrs["step"] == step and h.attrs["producer"] == "sim-0"
        assert float(h.attrs["time"]) == step * 0.25, h.attrs["time"]
print("ok")
"#;
    let r = Command::new("python3").args(["-c", check, dir.to_str().unwrap(), &steps.to_string()]).output().unwrap();
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success() && stdout.trim() == "ok", "{stdout}\n{}", String::from_utf8_lossy(&r.stderr));
}

#[test]
fn after_every_sink_died_restarting_one_and_draining_leaves_a_complete_set() {
    let env = Env::new();
    let (out_a, out_b, spill) = (env.mkdir("sink-a"), env.mkdir("sink-b"), env.mkdir("spill"));
    let mut primary = env.sink(&out_a, [] as [&str; 0]);
    let mut alternate = env.sink(&out_b, [] as [&str; 0]);
    let mut c = config(&env, &[&primary.addr(), &alternate.addr()], &spill);
    c.close_timeout = Duration::from_secs(2);
    let mut s = Stream::open(c).unwrap();
    let mut written: Vec<Vec<u8>> = (0..4).map(|step| write_step(&mut s, step)).collect();
    wait_settled(&primary, &out_a, 3);
    primary.kill9();
    wait_connected(&alternate, "the producer fails over once the primary is gone");
    alternate.kill9();
    written.extend((4..9).map(|step| write_step(&mut s, step)));
    let report = s.close().unwrap();
    assert!(report.undelivered_blocks > 0 && report.unsaved_steps > 0, "{report:?}");
    let spill_file = report.spill_file.clone().expect("undelivered blocks stay in the spill file");
    assert!(spill_file.is_file());
    // The manifest says where every undelivered block is in the spill file.
    let m = read_json(report.manifest.as_deref().expect("the manifest is kept"));
    let spilled =
        m["steps"].as_array().unwrap().iter().flat_map(|s| s["blocks"].as_array().unwrap()).filter(|b| b["spill"].is_string()).count();
    assert_eq!(spilled as u64, report.undelivered_blocks);

    // With no sink up, drain fails and keeps everything.
    let manifest = report.manifest.as_deref().expect("the manifest is kept").to_str().unwrap().to_string();
    let r = dmover(["drain", "--timeout", "1", "--token-file", env.token.to_str().unwrap(), &manifest]).run();
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert!(r.stderr.contains("check that the server runs"), "{}", r.stderr);
    assert!(spill_file.is_file());

    primary.restart();
    let r = dmover(["drain", "--token-file", env.token.to_str().unwrap(), &manifest]).run();
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    assert!(!spill_file.exists(), "the spill file is removed once drained");
    let sinks = HashMap::from([(primary.addr(), out_a.clone()), (alternate.addr(), out_b.clone())]);
    let m = check_manifest(report.manifest.as_deref().expect("the manifest is kept"), &written, &sinks);
    let last = &m["steps"][written.len() - 1];
    assert_eq!(last["manifest_at"], primary.addr(), "the last step was saved by the restarted primary");
}

#[test]
fn a_sink_that_hangs_is_failed_over_after_the_ack_timeout() {
    let env = Env::new();
    let (out_a, out_b, spill) = (env.mkdir("sink-a"), env.mkdir("sink-b"), env.mkdir("spill"));
    let primary = env.sink(&out_a, [] as [&str; 0]);
    let alternate = env.sink(&out_b, [] as [&str; 0]);
    let mut c = config(&env, &[&primary.addr(), &alternate.addr()], &spill);
    c.ack_timeout = Duration::from_secs(1);
    let mut s = Stream::open(c).unwrap();
    let mut written: Vec<Vec<u8>> = (0..2).map(|step| write_step(&mut s, step)).collect();
    wait_settled(&primary, &out_a, 1);
    // Alive but silent: its connections stay open and nothing is acknowledged.
    primary.signal(libc::SIGSTOP);
    written.extend((2..7).map(|step| write_step(&mut s, step)));
    let report = s.close().unwrap();
    assert_eq!(report.failovers, 1, "{report:?}");
    let sinks = HashMap::from([(primary.addr(), out_a.clone()), (alternate.addr(), out_b.clone())]);
    let m = check_delivery(&report, &written, &sinks);
    assert_eq!(m["steps"][6]["manifest_at"], alternate.addr());
    primary.signal(libc::SIGCONT);
}

/// CLI.md "dmover sink": `--name NAME` is this sink's name in manifests —
/// the manifest's `sink` and every block's `at`, the producer's too —
/// instead of its address.
#[test]
fn sink_name_names_the_sink_in_its_manifests() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let sink = env.sink(&out, ["--name", "ana-1"]);
    let mut c = config(&env, &[&sink.addr()], &spill);
    c.max_wait = Duration::from_secs(30);
    let mut s = Stream::open(c).unwrap();
    let written: Vec<Vec<u8>> = (0..3).map(|step| write_step(&mut s, step)).collect();
    let report = s.close().unwrap();
    check_delivery(&report, &written, &HashMap::from([("ana-1".to_string(), out.clone())]));
    for step in 0..written.len() {
        let m = read_json(&out.join(PRODUCER).join(format!("step-{step:06}.json")));
        assert_eq!(m["sink"], "ana-1", "step {step}: the manifest does not name the sink by --name: {m:#}");
        for b in m["blocks"].as_array().unwrap() {
            assert_eq!(b["at"], "ana-1", "step {step}: a block held here is not `at` the sink's name: {b}");
        }
    }
}

/// CLI.md "dmover sink": `--name` names a sink in every manifest — its
/// own, those of a sink that took over in the middle of a step (the blocks
/// it holds), and the producer's, which says at which address it reached
/// each name — and both kinds of manifest write a step alike.
#[test]
fn a_sinks_name_is_the_same_in_every_manifest() {
    let env = Env::new();
    let (out_a, out_b, spill) = (env.mkdir("sink-a"), env.mkdir("sink-b"), env.mkdir("spill"));
    let mut primary = env.sink(&out_a, ["--name", "ana-a"]);
    let alternate = env.sink(&out_b, ["--name", "ana-b"]);
    let mut c = config(&env, &[&primary.addr(), &alternate.addr()], &spill);
    c.max_wait = Duration::from_secs(30);
    let mut s = Stream::open(c).unwrap();
    // Step 0's first three blocks reach the primary; it dies; the rest of
    // the step goes to the alternate.
    let first = step_data(0, 7 * BLOCK as usize + 1000);
    s.write_metadata("step", "0").unwrap();
    s.write(&first[..3 * BLOCK as usize]).unwrap();
    let at_primary = out_a.join(PRODUCER).join("step-000000.dat");
    let arrived = || std::fs::metadata(&at_primary).is_ok_and(|m| m.len() == 3 * BLOCK as u64);
    assert!(wait_until(Duration::from_secs(20), arrived), "the first blocks did not reach the primary:\n{}", primary.log());
    wait_quiet(primary.port, 1, "the primary's acknowledgements of the first blocks read by the producer");
    primary.kill9();
    s.write(&first[3 * BLOCK as usize..]).unwrap();
    s.end_step().unwrap();
    let mut written = vec![first];
    written.extend((1..3).map(|step| write_step(&mut s, step)));
    let report = s.close().unwrap();
    let names = HashMap::from([("ana-a".to_string(), out_a.clone()), ("ana-b".to_string(), out_b.clone())]);
    let m = check_delivery(&report, &written, &names);
    assert_eq!(m["sinks"], serde_json::json!({ "ana-a": primary.addr(), "ana-b": alternate.addr() }), "{m:#}");
    let at: Vec<&str> = m["steps"][0]["blocks"].as_array().unwrap().iter().map(|b| b["at"].as_str().unwrap()).collect();
    assert_eq!(at, ["ana-a", "ana-a", "ana-a", "ana-b", "ana-b", "ana-b", "ana-b", "ana-b"], "{m:#}");
    for step in 0..written.len() {
        let producers = &m["steps"][step];
        assert_eq!(producers["manifest_at"], "ana-b", "step {step}");
        let sinks = read_json(&out_b.join(PRODUCER).join(format!("step-{step:06}.json")));
        assert_eq!(sinks["sink"], "ana-b");
        for key in ["bytes", "metadata", "records"] {
            assert_eq!(sinks[key], producers[key], "step {step}: the manifests write {key} differently");
        }
        for (b, p) in sinks["blocks"].as_array().unwrap().iter().zip(producers["blocks"].as_array().unwrap()) {
            assert_eq!((&b["offset"], &b["len"], &b["xxh3"], &b["at"]), (&p["offset"], &p["len"], &p["xxh3"], &p["at"]), "step {step}");
            assert_eq!(b["here"], b["at"] == "ana-b", "step {step}: {b}");
        }
    }
}

/// CLI.md "dmover sink": a failing hook is logged, and the sink carries
/// on: the stream is saved whole, the hooks of later steps still run (one
/// at a time, in step order), and a later stream gets its hooks too.
#[test]
fn a_failing_hook_is_logged_and_later_steps_still_get_theirs() {
    let env = Env::new();
    let (out, hooked, spill) = (env.mkdir("sink"), env.mkdir("hooked"), env.mkdir("spill"));
    let order = env.path("order.txt");
    let script = env.path("hook.sh");
    let text = format!(
        "name=$(basename \"$1\")\necho \"$name\" >> {}\ncp \"$1\" {}/\ncase \"$name\" in step-000001.json) exit 3;; esac\n",
        order.display(),
        hooked.display()
    );
    std::fs::write(&script, text).unwrap();
    let hook = format!("sh {}", script.display());
    let sink = env.sink(&out, ["--hook", &hook]);
    let stream = |steps: u64| {
        let mut c = config(&env, &[&sink.addr()], &spill);
        c.max_wait = Duration::from_secs(30);
        let mut s = Stream::open(c).unwrap();
        let written: Vec<Vec<u8>> = (0..steps).map(|step| write_step(&mut s, step)).collect();
        let report = s.close().unwrap();
        check_delivery(&report, &written, &HashMap::from([(sink.addr(), out.clone())]));
    };
    stream(4);
    for step in 0..4 {
        let copy = hooked.join(format!("step-{step:06}.json"));
        assert!(
            wait_until(Duration::from_secs(20), || copy.is_file()),
            "no hook for step {step} after the hook of step 1 failed:\n{}",
            sink.log()
        );
    }
    let failed = format!("hook for {} failed", out.join(PRODUCER).join("step-000001.json").display());
    assert!(
        wait_until(Duration::from_secs(5), || sink.log().contains(&failed)),
        "the failing hook was not logged ({failed:?}):\n{}",
        sink.log()
    );
    let steps: Vec<String> = (0..4).map(|s| format!("step-{s:06}.json")).collect();
    assert_eq!(std::fs::read_to_string(&order).unwrap().lines().collect::<Vec<_>>(), steps, "hooks ran out of step order");

    // The sink carries on: a new stream, and its hooks.
    std::fs::remove_dir_all(&hooked).unwrap();
    std::fs::create_dir(&hooked).unwrap();
    stream(2);
    for step in 0..2 {
        let copy = hooked.join(format!("step-{step:06}.json"));
        assert!(wait_until(Duration::from_secs(20), || copy.is_file()), "no hook for step {step} of a later stream:\n{}", sink.log());
    }
}

/// A sink address without a port is a mistake in the call, refused before
/// anything connects (Python: `ValueError`), not a connection to retry.
#[test]
fn a_sink_address_without_a_port_is_a_usage_error() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let sink = env.sink(&out, [] as [&str; 0]);
    for dests in [vec!["ana1".to_string()], vec![sink.addr(), "ana1".to_string()]] {
        let dests: Vec<&str> = dests.iter().map(String::as_str).collect();
        let e = Stream::open(config(&env, &dests, &spill)).err().expect("an address without a port must be refused");
        assert_eq!(e.kind, dmover_proto::ErrorKind::Usage, "{dests:?}: {e}");
        assert!(e.message.contains("\"ana1\"") && e.hint().contains("port"), "{dests:?}: {e} ({})", e.hint());
    }
    assert!(!out.join(PRODUCER).exists(), "a refused stream reached the sink");
    let script = r#"
import sys
from dmover_stream import Stream
for dests in (["ana1"], [sys.argv[1], "ana1"]):
    try:
        Stream("usage", dests, sys.argv[2])
        raise AssertionError(f"{dests} was accepted")
    except ValueError as e:
        assert "ana1" in str(e) and "re-running" not in str(e), e
print("ok")
"#;
    let r = Command::new("python3")
        .args(["-c", script, &sink.addr(), spill.to_str().unwrap()])
        .env("DMOVER_TOKEN_FILE", &env.token)
        .env_remove("DMOVER_TOKEN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success() && stdout.trim() == "ok", "{stdout}\n{}", String::from_utf8_lossy(&r.stderr));
    // C (and Fortran, through the same function): dms_open says DMS_EUSAGE.
    let dir = env.mkdir("build");
    std::fs::write(dir.join("usage.c"), USAGE_C).unwrap();
    let exe = dir.join("usage");
    build("cc", &[dir.join("usage.c")], &exe);
    for dests in ["ana1".to_string(), format!("{},ana1", sink.addr())] {
        let r = Command::new(&exe)
            .args([&dests, spill.to_str().unwrap()])
            .env("DMOVER_TOKEN_FILE", &env.token)
            .env_remove("DMOVER_TOKEN")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&r.stdout);
        let (code, message) = said.trim().split_once(' ').unwrap_or((said.trim(), ""));
        assert_eq!(code, "2", "{dests}: dms_open did not answer DMS_EUSAGE: {said}");
        assert!(message.contains("\"ana1\"") && message.contains("port") && !message.contains("re-running"), "{dests}: {message}");
    }
}

/// Opens a stream to argv[1] and prints dms_open's answer and message.
const USAGE_C: &str = r#"
#include <stdio.h>
#include "dmover_stream.h"
int main(int argc, char **argv) {
    dms_stream *s;
    int rc = dms_open("usage", argv[1], argv[2], 0, 0, 0, &s);
    printf("%d %s\n", rc, rc ? dms_last_error() : "");
    return 0;
}
"#;

/// A stream of `steps` steps whose only sink was killed after it opened:
/// the (stopped) sink, its directory, the close report (blocks left in the
/// spill file) and what each step wrote.
fn undelivered_steps(env: &Env, steps: u64) -> (Server, PathBuf, Report, Vec<Vec<u8>>) {
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let mut sink = env.sink(&out, [] as [&str; 0]);
    let mut c = config(env, &[&sink.addr()], &spill);
    c.close_timeout = Duration::from_secs(1);
    let mut s = Stream::open(c).unwrap();
    sink.kill9();
    let written: Vec<Vec<u8>> = (0..steps).map(|step| write_step(&mut s, step)).collect();
    let report = s.close().unwrap();
    assert!(report.undelivered_blocks > 0, "{report:?}");
    (sink, out, report, written)
}

/// CLI.md "dmover drain": `--timeout` is how long it keeps trying, so a
/// drain started while the sink is still down delivers once it is back.
#[test]
fn drain_keeps_trying_for_its_timeout_until_a_sink_is_back() {
    let env = Env::new();
    let (mut sink, out, report, written) = undelivered_steps(&env, 3);
    let manifest = report.manifest.as_deref().expect("the manifest is kept").to_str().unwrap().to_string();
    let drain = dmover(["drain", "--timeout", "60", "--token-file", env.token.to_str().unwrap(), &manifest]).spawn();
    std::thread::sleep(Duration::from_secs(3));
    sink.restart();
    let r = drain.wait();
    assert_eq!(r.code, 0, "drain gave up while the sink was down:\n{}\n{}", r.stdout, r.stderr);
    assert!(r.elapsed >= Duration::from_secs(3), "drain ended after {:?}, before the sink was back", r.elapsed);
    assert!(r.stderr.contains("trying again"), "{}", r.stderr);
    let sinks = HashMap::from([(sink.addr(), out.clone())]);
    check_manifest(report.manifest.as_deref().expect("the manifest is kept"), &written, &sinks);
}

/// `dmover drain MANIFEST | head -1`: a drain whose stdout is closed still
/// delivers everything, and ends quietly.
#[test]
fn drain_ends_quietly_when_its_stdout_is_closed() {
    let env = Env::new();
    let (mut sink, out, report, written) = undelivered_steps(&env, 2);
    sink.restart();
    let manifest = report.manifest.as_deref().expect("the manifest is kept").to_str().unwrap();
    let r = dmover(["drain", "--timeout", "30", "--token-file", env.token.to_str().unwrap(), manifest]).stdout_closed().run();
    assert_eq!(r.code, 0, "drain with its stdout closed:\n{}", r.stderr);
    assert!(!r.stderr.contains("panicked") && !r.stderr.contains("Broken pipe"), "{}", r.stderr);
    check_manifest(report.manifest.as_deref().expect("the manifest is kept"), &written, &HashMap::from([(sink.addr(), out.clone())]));
}

/// STREAMING.md "Parameters": a hung sink is taken for dead after the ack
/// timeout — not before, even when the producer opens new connections to
/// it meanwhile (their setup must not time out first).
#[test]
fn a_hung_sink_is_failed_over_at_the_ack_timeout_not_before() {
    let ack_timeout = Duration::from_secs(40);
    let env = Env::new();
    let (out_a, out_b, spill) = (env.mkdir("sink-a"), env.mkdir("sink-b"), env.mkdir("spill"));
    let primary = env.sink(&out_a, [] as [&str; 0]);
    let alternate = env.sink(&out_b, [] as [&str; 0]);
    let mut c = config(&env, &[&primary.addr(), &alternate.addr()], &spill);
    c.ack_timeout = ack_timeout;
    let mut s = Stream::open(c).unwrap();
    let mut written: Vec<Vec<u8>> = (0..2).map(|step| write_step(&mut s, step)).collect();
    wait_settled(&primary, &out_a, 1);
    primary.signal(libc::SIGSTOP);
    let hung = std::time::Instant::now();
    // More than the buffer holds: the producer widens to all its connections.
    written.extend((2..12).map(|step| write_step(&mut s, step)));
    let first_at_alternate = out_b.join(PRODUCER);
    assert!(
        wait_until(ack_timeout + Duration::from_secs(20), || first_at_alternate.is_dir()),
        "no failover within the ack timeout and 20 s"
    );
    let failed_over = hung.elapsed();
    let report = s.close().unwrap();
    primary.signal(libc::SIGCONT);
    assert!(failed_over >= ack_timeout - Duration::from_secs(1), "failed over after {failed_over:?}, before the ack timeout");
    assert_eq!(report.failovers, 1, "{report:?}");
    let sinks = HashMap::from([(primary.addr(), out_a.clone()), (alternate.addr(), out_b.clone())]);
    check_delivery(&report, &written, &sinks);
}

/// A producer that opens a stream to SINKS (comma-separated) with its spill
/// file in SPILL, says "open" on stdout, waits for a line on stdin (the test
/// kills or stops a sink meanwhile), then writes a 1 MiB step, closes and
/// says "failovers=N": C, giving CLOSE and ACK (seconds, 0 for unchanged)
/// to `dms_set_timeouts` when they follow on its command line.
const TIMEOUTS_PRODUCER_C: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include "dmover_stream.h"
int main(int argc, char **argv) {
    dms_stream *s;
    dms_report r = {0};
    static char data[1 << 20];
    char line[8];
    if (dms_open("timeouts-c", argv[1], argv[2], 0, 0, 0, &s)) { fprintf(stderr, "%s\n", dms_last_error()); return 2; }
    if (argc > 4 && dms_set_timeouts(s, atof(argv[3]), atof(argv[4]))) { fprintf(stderr, "%s\n", dms_last_error()); return 2; }
    printf("open\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 2;
    dms_write(s, data, sizeof data);
    dms_end_step(s);
    int rc = dms_close(s, &r);
    printf("failovers=%llu\n", (unsigned long long)r.failovers);
    if (rc) fprintf(stderr, "%s\n", dms_last_error());
    return rc;
}
"#;

/// The same in Fortran, through the module's `dms_set_timeouts`.
const TIMEOUTS_PRODUCER_F90: &str = r#"
program timeouts
  use iso_c_binding
  use dmover_stream
  implicit none
  character(len=4096) :: sinks, spill, arg
  character(len=8) :: line
  real(c_double) :: close_s, ack_s
  real(c_double), allocatable, target :: data(:)
  type(c_ptr) :: h
  type(dms_report) :: r
  integer(c_int) :: rc

  call get_command_argument(1, sinks)
  call get_command_argument(2, spill)
  if (dms_open(dms_str("timeouts-f"), dms_str(sinks), dms_str(spill), &
      0_c_int64_t, 0_c_int64_t, 0_c_int32_t, h) /= 0) then
    write(0, '(A)') dms_error_message()
    call exit(2)
  end if
  if (command_argument_count() > 3) then
    call get_command_argument(3, arg); read(arg, *) close_s
    call get_command_argument(4, arg); read(arg, *) ack_s
    if (dms_set_timeouts(h, close_s, ack_s) /= 0) then
      write(0, '(A)') dms_error_message()
      call exit(2)
    end if
  end if
  write(*, '(A)') "open"
  flush(6)
  read(*, '(A)') line
  allocate(data(131072))
  data = 0
  rc = dms_write(h, c_loc(data), int(1048576, c_size_t))
  if (rc == 0) rc = dms_end_step(h)
  rc = dms_close(h, r)
  write(*, '(A,I0)') "failovers=", r%failovers
  flush(6)
  if (rc /= 0) write(0, '(A)') dms_error_message()
  call exit(int(rc))
end program
"#;

/// The same in Python, with `close_timeout=` and `ack_timeout=`.
const TIMEOUTS_PRODUCER_PY: &str = r#"
import sys
from dmover_stream import Stream
kw = {}
if len(sys.argv) > 4:
    for name, v in (("close_timeout", sys.argv[3]), ("ack_timeout", sys.argv[4])):
        if float(v):
            kw[name] = float(v)
s = Stream("timeouts-py", sys.argv[1].split(","), sys.argv[2], **kw)
print("open", flush=True)
sys.stdin.readline()
s.write(bytes(1 << 20))
s.end_step()
try:
    r = s.close()
except ConnectionError as e:
    print(e, file=sys.stderr)
    sys.exit(6)
print(f"failovers={r['failovers']}")
"#;

/// The three producers above, built (C, Fortran) or as a command (Python).
struct TimeoutsProducers {
    c: PathBuf,
    fortran: PathBuf,
}

impl TimeoutsProducers {
    fn build(env: &Env) -> TimeoutsProducers {
        let dir = env.mkdir("build");
        let (c_src, f_src) = (dir.join("timeouts.c"), dir.join("timeouts.f90"));
        std::fs::write(&c_src, TIMEOUTS_PRODUCER_C).unwrap();
        std::fs::write(&f_src, TIMEOUTS_PRODUCER_F90).unwrap();
        let (c, fortran) = (dir.join("timeouts-c"), dir.join("timeouts-f"));
        build("cc", &[c_src], &c);
        build("gfortran", &[crate_dir().join("include/dmover_stream.f90"), f_src], &fortran);
        TimeoutsProducers { c, fortran }
    }

    fn command(&self, lang: &str) -> Command {
        match lang {
            "C" => Command::new(&self.c),
            "Fortran" => Command::new(&self.fortran),
            _ => {
                let mut c = Command::new("python3");
                c.args(["-c", TIMEOUTS_PRODUCER_PY]);
                c
            }
        }
    }

    /// Each producer, setting the timeouts through its API (true) or through
    /// the environment variable `var` (false).
    fn cases(&self, var: &str) -> Vec<(String, Command, bool)> {
        let mut cases = Vec::new();
        for (lang, api) in [("C", "dms_set_timeouts"), ("Fortran", "dms_set_timeouts"), ("Python", "close_timeout=, ack_timeout=")] {
            cases.push((format!("{lang}, {api}"), self.command(lang), true));
            let mut c = self.command(lang);
            c.env(var, "1");
            cases.push((format!("{lang}, {var}"), c, false));
        }
        cases
    }
}

/// What a producer from [`TimeoutsProducers`] did.
struct Closed {
    code: i32,
    stdout: String,
    stderr: String,
    /// From the line that let it write to its exit.
    took: Duration,
    /// Its spill directory.
    spill: PathBuf,
}

/// Starts `producer` with the test's token file, its input and output
/// piped, and waits for its first line to be `line`; kills it and fails
/// with `failed` and its stderr otherwise.
fn spawn_until(
    env: &Env,
    producer: &mut Command,
    line: &str,
    failed: &str,
) -> (std::process::Child, std::io::BufReader<std::process::ChildStdout>) {
    use std::io::{BufRead, Read};
    let mut child = producer
        .env("DMOVER_TOKEN_FILE", &env.token)
        .env_remove("DMOVER_TOKEN")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    if first.trim() != line {
        let _ = child.kill();
        let mut stderr = String::new();
        child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
        panic!("{failed}: {first}\n{stderr}");
    }
    (child, stdout)
}

/// Runs `producer SINKS SPILL [CLOSE ACK]`; once its stream is open, `meanwhile`
/// (the test kills or stops a sink), then lets it write and close. A
/// producer still running after 60 s is killed.
fn run_producer(env: &Env, producer: &mut Command, sinks: &[&str], timeouts: Option<(f64, f64)>, meanwhile: impl FnOnce()) -> Closed {
    use std::io::{Read, Write};
    let spill = env.mkdir(&format!("spill-{}", unique()));
    producer.arg(sinks.join(",")).arg(&spill).args(timeouts.map(|(close, ack)| [close.to_string(), ack.to_string()]).into_iter().flatten());
    let (mut child, mut stdout) = spawn_until(env, producer, "open", "the producer did not open its stream");
    meanwhile();
    let start = std::time::Instant::now();
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let end = start + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = start.elapsed();
    let _ = child.kill();
    let r = child.wait_with_output().unwrap();
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    Closed { code: r.status.code().unwrap_or(-1), stdout: rest, stderr: String::from_utf8_lossy(&r.stderr).into_owned(), took, spill }
}

/// STREAMING.md "Parameters": the close timeout can be set from C,
/// Fortran, Python and the environment, and a close that leaves blocks
/// undelivered says to run `dmover drain`.
#[test]
fn close_timeout_is_settable_from_c_fortran_python_and_the_environment_and_points_to_drain() {
    let env = Env::new();
    let producers = TimeoutsProducers::build(&env);
    for (what, mut cmd, api) in producers.cases("DMOVER_CLOSE_TIMEOUT") {
        let out = env.mkdir(&format!("sink-{}", unique()));
        let mut sink = env.sink(&out, [] as [&str; 0]);
        let addr = sink.addr();
        let r = run_producer(&env, &mut cmd, &[&addr], api.then_some((1.0, 0.0)), || sink.kill9());
        assert_eq!(r.code, 6, "{what}: {}", r.stderr);
        assert!(r.took < Duration::from_secs(30), "{what}: close took {:?} with a 1 s close timeout", r.took);
        assert!(
            r.stderr.contains("dmover drain") && r.stderr.contains("manifest.json"),
            "{what}: the error does not say to drain: {}",
            r.stderr
        );
        assert!(
            r.stderr.contains("[dmover-stream WARN] stream timeouts-") && r.stderr.contains(".spill until a sink takes them"),
            "{what}: nothing said that blocks went to the spill file: {}",
            r.stderr
        );
    }
}

/// STREAMING.md "Close": a close that delivered everything leaves nothing
/// in the spill directory (no manifest piles up run after run) unless
/// asked to keep the manifest; one that left blocks keeps both files.
#[test]
fn a_clean_close_leaves_no_manifest_behind_unless_asked_to_keep_it() {
    let env = Env::new();
    let producers = TimeoutsProducers::build(&env);
    let out = env.mkdir("sink");
    let sink = env.sink(&out, [] as [&str; 0]);
    let names = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
    };
    for lang in ["C", "Fortran", "Python"] {
        let r = run_producer(&env, &mut producers.command(lang), &[&sink.addr()], None, || {});
        assert_eq!(r.code, 0, "{lang}: {}", r.stderr);
        assert_eq!(names(&r.spill), Vec::<String>::new(), "{lang}: a clean close left files behind");
        let mut keep = producers.command(lang);
        keep.env("DMOVER_KEEP_MANIFEST", "1");
        let r = run_producer(&env, &mut keep, &[&sink.addr()], None, || {});
        assert_eq!(r.code, 0, "{lang}: {}", r.stderr);
        let kept = names(&r.spill);
        assert!(kept.len() == 1 && kept[0].ends_with(".manifest.json"), "{lang}: DMOVER_KEEP_MANIFEST=1 kept {kept:?}");
    }
    let mut gone = env.sink(&env.mkdir("sink-gone"), [] as [&str; 0]);
    let addr = gone.addr();
    let r = run_producer(&env, &mut producers.command("C"), &[&addr], Some((1.0, 0.0)), || gone.kill9());
    assert_eq!(r.code, 6, "{}", r.stderr);
    let mut left = names(&r.spill);
    left.sort();
    assert!(left.len() == 2 && left[0].ends_with(".manifest.json") && left[1].ends_with(".spill"), "undelivered blocks left {left:?}");
}

/// STREAMING.md "What it says": a close that waits on sinks that are gone
/// says how many blocks it waits for and how long it will still wait, and
/// `DMOVER_LOG=off` silences the library.
#[test]
fn a_close_waiting_on_absent_sinks_says_what_it_waits_for_and_for_how_long() {
    let env = Env::new();
    let producers = TimeoutsProducers::build(&env);
    for lang in ["C", "Python"] {
        let out = env.mkdir(&format!("sink-{}", unique()));
        let mut sink = env.sink(&out, [] as [&str; 0]);
        let addr = sink.addr();
        let r = run_producer(&env, &mut producers.command(lang), &[&addr], Some((4.0, 0.0)), || sink.kill9());
        assert_eq!(r.code, 6, "{lang}: {}", r.stderr);
        let note =
            r.stderr.lines().find(|l| l.contains("close waits for")).unwrap_or_else(|| panic!("{lang}: close said nothing: {}", r.stderr));
        assert!(note.starts_with("[dmover-stream WARN] stream timeouts-"), "{lang}: {note}");
        let left: f64 = note.split("gives up in ").nth(1).and_then(|t| t.split(' ').next()).and_then(|n| n.parse().ok()).unwrap_or(-1.0);
        assert!(note.contains("block(s)") && (0.0..=3.0).contains(&left) && note.contains("no sink is connected"), "{lang}: {note}");
        let mut quiet = producers.command(lang);
        quiet.env("DMOVER_LOG", "off");
        let mut sink = env.sink(&env.mkdir(&format!("sink-{}", unique())), [] as [&str; 0]);
        let addr = sink.addr();
        let r = run_producer(&env, &mut quiet, &[&addr], Some((1.0, 0.0)), || sink.kill9());
        assert_eq!(r.code, 6, "{lang}: {}", r.stderr);
        assert!(!r.stderr.contains("[dmover-stream"), "{lang}: DMOVER_LOG=off still logged: {}", r.stderr);
    }
}

/// STREAMING.md "Parameters": the ack timeout can be set from C, Fortran,
/// Python and the environment. With it at 1 s, a producer whose sink hangs
/// (SIGSTOP) fails over to the next sink and closes within seconds, where
/// the default (90 s) would keep it waiting.
#[test]
fn ack_timeout_is_settable_from_c_fortran_python_and_the_environment() {
    let env = Env::new();
    let producers = TimeoutsProducers::build(&env);
    for (what, mut cmd, api) in producers.cases("DMOVER_ACK_TIMEOUT") {
        let (out_a, out_b) = (env.mkdir(&format!("sink-a-{}", unique())), env.mkdir(&format!("sink-b-{}", unique())));
        let (primary, alternate) = (env.sink(&out_a, [] as [&str; 0]), env.sink(&out_b, [] as [&str; 0]));
        let r = run_producer(&env, &mut cmd, &[&primary.addr(), &alternate.addr()], api.then_some((0.0, 1.0)), || {
            primary.signal(libc::SIGSTOP)
        });
        primary.signal(libc::SIGCONT);
        assert_eq!(r.code, 0, "{what}: {}\n{}", r.stdout, r.stderr);
        assert!(r.took < Duration::from_secs(30), "{what}: the hung sink was failed over after {:?}, with a 1 s ack timeout", r.took);
        assert_eq!(r.stdout.trim(), "failovers=1", "{what}: {}", r.stderr);
        let saved = std::fs::read_dir(&out_b).unwrap().map(|e| e.unwrap().path().join("step-000000.json")).collect::<Vec<_>>();
        assert!(saved.len() == 1 && saved[0].is_file(), "{what}: the step is not at the alternate sink: {saved:?}");
    }
}

/// The examples send the step as metadata too (a string): the HDF5 hook's
/// `step` attribute stays the integer step number.
#[test]
fn the_hdf5_hooks_step_attribute_is_the_integer_step_despite_step_metadata() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let hook = format!("python3 {}", crate_dir().join("../py/examples/to_hdf5.py").display());
    let sink = env.sink(&out, ["--hook", &hook]);
    let mut s = Stream::open(config(&env, &[&sink.addr()], &spill)).unwrap();
    for step in 0..2u64 {
        s.write_metadata("var", "phi").unwrap();
        s.write_metadata("step", &step.to_string()).unwrap();
        s.write(&(step as f64).to_le_bytes()).unwrap();
        s.end_step().unwrap();
    }
    s.close().unwrap();
    let dir = out.join(PRODUCER);
    for step in 0..2 {
        let h5 = dir.join(format!("step-{step:06}.h5"));
        assert!(wait_until(Duration::from_secs(60), || h5.is_file()), "no {}:\n{}", h5.display(), sink.log());
    }
    let check = r#"
import sys, h5py, numbers
for step in range(2):
    with h5py.File(f"{sys.argv[1]}/step-{step:06d}.h5", "r") as h:
        v = h.attrs["step"]
        assert isinstance(v, numbers.Integral) and v == step, (type(v), v)
print("ok")
"#;
    let r = Command::new("python3").args(["-c", check, dir.to_str().unwrap()]).output().unwrap();
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success() && stdout.trim() == "ok", "{stdout}\n{}", String::from_utf8_lossy(&r.stderr));
}

/// `dmover drain` given the spill file instead of the manifest says which
/// file it needs, and where that is, as a usage error.
#[test]
fn drain_given_a_spill_file_asks_for_the_manifest() {
    let env = Env::new();
    let spill = env.mkdir("spill");
    let file = spill.join("sim-0.4242.spill");
    std::fs::write(&file, [0xffu8, 0xfe, 0, 1, 2, 3]).unwrap();
    let r = dmover(["drain", "--timeout", "1", "--token-file", env.token.to_str().unwrap(), file.to_str().unwrap()]).run();
    let beside = spill.join("sim-0.4242.manifest.json");
    r.assert_fails(2, &["sim-0.4242.spill", "not a stream manifest", "not its spill file", beside.to_str().unwrap()]);
    assert!(!r.stderr.contains("please report") && !r.stderr.contains("UTF-8"), "{}", r.stderr);
}

/// A producer for a test to kill: it opens a stream (16 blocks of 64 KiB
/// in memory, no waiting) and says "open"; then each line on its stdin,
/// "A B", writes steps A to B-1, or "P A" writes the first half of step A
/// and does not end it; step N's bytes are read from DATA/N. It answers
/// "written" to each line, and never closes.
const KILLED_PRODUCER_C: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include "dmover_stream.h"
static dms_stream *s;
static unsigned char data[4 << 20];
static int write_step(const char *dir, unsigned long step, int end) {
    char name[4096], step_text[32];
    snprintf(name, sizeof name, "%s/%lu", dir, step);
    FILE *f = fopen(name, "rb");
    if (!f) return 3;
    size_t n = fread(data, 1, sizeof data, f), half = n / 2;
    fclose(f);
    snprintf(step_text, sizeof step_text, "%lu", step);
    if (dms_write_metadata(s, "step", step_text) || (half && dms_write(s, data, half))) return 4;
    if (end && ((n > half && dms_write(s, data + half, n - half)) || dms_end_step(s))) return 4;
    return 0;
}
int main(int argc, char **argv) {
    char line[64];
    unsigned long a, b;
    if (argc != 4) return 2;
    if (dms_open("sim-0", argv[1], argv[2], 16 << 16, 1 << 16, 0, &s)) { fprintf(stderr, "%s\n", dms_last_error()); return 2; }
    printf("open\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        int rc = 0;
        if (sscanf(line, "P %lu", &a) == 1)
            rc = write_step(argv[3], a, 0);
        else if (sscanf(line, "%lu %lu", &a, &b) == 2)
            for (unsigned long step = a; step < b && !rc; step++) rc = write_step(argv[3], step, 1);
        else
            rc = 2;
        if (rc) { fprintf(stderr, "%s\n", dms_last_error()); return rc; }
        printf("written\n");
        fflush(stdout);
    }
    return 0;
}
"#;

/// [`KILLED_PRODUCER_C`], built and running against a sink, with `written`
/// (step N's bytes) in its data directory.
struct Killable {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    /// Its manifest and spill file, named after its process.
    manifest: PathBuf,
    spill_file: PathBuf,
}

impl Killable {
    fn start(env: &Env, sink: &Server, spill: &Path, written: &[Vec<u8>]) -> Killable {
        let (data, build_dir) = (env.mkdir("data"), env.mkdir("build"));
        for (step, w) in written.iter().enumerate() {
            std::fs::write(data.join(step.to_string()), w).unwrap();
        }
        let src = build_dir.join("killed.c");
        std::fs::write(&src, KILLED_PRODUCER_C).unwrap();
        let exe = build_dir.join("killed");
        build("cc", &[src], &exe);
        let mut child = Command::new(&exe)
            .args([sink.addr().as_str(), spill.to_str().unwrap(), data.to_str().unwrap()])
            .env("DMOVER_TOKEN_FILE", &env.token)
            .env_remove("DMOVER_TOKEN")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (stdin, stdout) = (child.stdin.take().unwrap(), std::io::BufReader::new(child.stdout.take().unwrap()));
        let manifest = spill.join(format!("{PRODUCER}.{}.manifest.json", child.id()));
        let spill_file = spill.join(format!("{PRODUCER}.{}.spill", child.id()));
        let mut p = Killable { child, stdin, stdout, manifest, spill_file };
        p.said("open");
        p
    }

    fn said(&mut self, want: &str) {
        use std::io::BufRead;
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), want, "the producer did not say {want:?}");
    }

    /// Sends a command line and waits until it is done.
    fn run(&mut self, line: &str) {
        use std::io::Write;
        writeln!(self.stdin, "{line}").unwrap();
        self.said("written");
    }

    /// Waits until the manifest on disk has `steps` steps, those before
    /// `ended` ended with every block acknowledged or spilled, the others not.
    fn wait_for_manifest(&self, steps: usize, ended: usize) {
        let caught_up = || {
            let Some(m) = std::fs::read_to_string(&self.manifest).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()) else {
                return false;
            };
            let s = m["steps"].as_array().map_or(&[][..], Vec::as_slice);
            s.len() == steps
                && s.iter()
                    .enumerate()
                    .all(|(i, s)| s["ended"] == (i < ended) && s["blocks"].as_array().unwrap().iter().all(|b| b["undelivered"].is_null()))
        };
        assert!(wait_until(Duration::from_secs(20), caught_up), "{} does not show the producer's steps", self.manifest.display());
    }

    /// SIGKILL: the producer never closes.
    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

/// STREAMING.md "The producer's manifest": a producer killed (SIGKILL)
/// before close, after it spilled while its sink was down, leaves a
/// manifest on disk beside its spill file, and `dmover drain` on it
/// delivers every step it wrote, byte for byte, to the sink once it is back.
#[test]
fn a_producer_killed_before_close_leaves_a_manifest_that_drain_delivers() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let steps = 12;
    let written: Vec<Vec<u8>> = (0..steps).map(|step| step_data(step, step_len(step))).collect();
    let mut sink = env.sink(&out, [] as [&str; 0]);
    let mut producer = Killable::start(&env, &sink, &spill, &written);
    // The first steps reach the sink; then it dies, and the rest of the
    // stream spills.
    producer.run("0 3");
    let saved = out.join(PRODUCER).join("step-000002.json");
    assert!(wait_until(Duration::from_secs(20), || saved.is_file()), "the first steps did not arrive:\n{}", sink.log());
    sink.kill9();
    producer.run(&format!("3 {steps}"));
    producer.wait_for_manifest(written.len(), written.len());
    let (manifest, spill_file) = (producer.manifest.clone(), producer.spill_file.clone());
    producer.kill9();
    let m = read_json(&manifest);
    let spilled = m["steps"].as_array().unwrap().iter().flat_map(|s| s["blocks"].as_array().unwrap()).filter(|b| b["spill"].is_string());
    // Those that found room in memory too: no sink was there to take them.
    let down: usize = written[3..].iter().map(|w| w.len().div_ceil(BLOCK as usize)).sum();
    assert_eq!(spilled.count(), down, "every block written while the sink was down is in the spill file: {m:#}");
    assert!(spill_file.is_file());

    sink.restart();
    let token = env.token.to_str().unwrap();
    // Given the spill file, drain says where the manifest is.
    let r = dmover(["drain", "--timeout", "5", "--token-file", token, spill_file.to_str().unwrap()]).run();
    r.assert_fails(2, &["not a stream manifest", manifest.to_str().unwrap()]);
    let r = dmover(["drain", "--timeout", "30", "--token-file", token, manifest.to_str().unwrap()]).run();
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    assert!(!spill_file.exists(), "the spill file is removed once drained");
    let sinks = HashMap::from([(sink.addr(), out.clone())]);
    check_manifest(&manifest, &written, &sinks);
    for (step, want) in written.iter().enumerate() {
        let dir = out.join(PRODUCER);
        assert!(std::fs::read(dir.join(format!("step-{step:06}.dat"))).unwrap() == *want, "step {step} differs at the sink");
        assert_eq!(read_json(&dir.join(format!("step-{step:06}.json")))["complete"], true, "step {step}");
    }
}

/// STREAMING.md "The producer's manifest": the step a producer was writing
/// when it was killed is lost with it; drain delivers the others and says
/// which step it could not (exit 10).
#[test]
fn drain_after_a_producer_was_killed_mid_step_delivers_the_rest_and_names_the_lost_step() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    // Step 4, the one cut short, has 777,777 bytes.
    let written: Vec<Vec<u8>> = (0..5).map(|step| step_data(step, step_len(step))).collect();
    let mut sink = env.sink(&out, [] as [&str; 0]);
    let mut producer = Killable::start(&env, &sink, &spill, &written);
    sink.kill9();
    producer.run("0 4");
    producer.run("P 4");
    producer.wait_for_manifest(5, 4);
    let manifest = producer.manifest.clone();
    producer.kill9();
    sink.restart();
    let r = dmover(["drain", "--timeout", "30", "--token-file", env.token.to_str().unwrap(), manifest.to_str().unwrap()]).run();
    r.assert_fails(10, &["but not these steps", "stopped before they were whole: 4"]);
    let dir = out.join(PRODUCER);
    for (step, want) in written[..4].iter().enumerate() {
        assert!(std::fs::read(dir.join(format!("step-{step:06}.dat"))).unwrap() == *want, "step {step} differs at the sink");
        assert_eq!(read_json(&dir.join(format!("step-{step:06}.json")))["complete"], true, "step {step}");
    }
    assert!(!dir.join("step-000004.json").exists(), "the lost step was saved");
    let m = read_json(&manifest);
    assert_eq!(m["steps"][4]["ended"], false, "{m:#}");
}

/// STREAMING.md's commands that build and run the C example, taken from the
/// page and run as written in a fresh clone of this repository (only the
/// sink's address, the spill directory and the token file are this test's).
#[test]
fn the_documented_c_build_works_from_a_clean_checkout() {
    let env = Env::new();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let page = std::fs::read_to_string(repo.join("docs/STREAMING.md")).unwrap();
    let block = page
        .split("```sh\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap())
        .find(|b| b.contains("./gtc "))
        .expect("STREAMING.md shows how to build and run the C example");
    let lines: Vec<&str> = block.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 3, "build the library, build the example, run it: {lines:?}");
    let checkout = env.path("checkout");
    let r = Command::new("git").arg("clone").arg("--quiet").arg(&repo).arg(&checkout).output().unwrap();
    assert!(r.status.success(), "git clone: {}", String::from_utf8_lossy(&r.stderr));
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let sink = env.sink(&out, [] as [&str; 0]);
    let run = lines[2]
        .replace("ana1:7460", &sink.addr())
        .replace("/scratch/me/spill", spill.to_str().unwrap())
        .replace("~/.dmover-token", env.token.to_str().unwrap());
    for line in [lines[0], lines[1], &run] {
        let r = Command::new("sh")
            .args(["-ec", line])
            .current_dir(&checkout)
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("DMOVER_TOKEN")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&r.stdout);
        assert!(r.status.success(), "{line}\n{stdout}\n{}", String::from_utf8_lossy(&r.stderr));
        if line == run {
            assert!(stdout.contains("steps=10 ") && stdout.contains("undelivered=0"), "{stdout}");
        }
    }
    for step in 0..10 {
        let m = read_json(&out.join("gtc-17").join(format!("step-{step:06}.json")));
        assert_eq!((m["complete"].as_bool(), m["bytes"].as_u64()), (Some(true), Some(8_000_000)), "step {step}: {m}");
    }
}

/// CLI.md "dmover sink": a sink killed while hooks of complete steps are
/// queued runs them when it starts again (at least once per complete step).
#[test]
fn hooks_queued_when_the_sink_crashed_run_after_it_restarts() {
    let env = Env::new();
    let (out, hooked, spill) = (env.mkdir("sink"), env.mkdir("hooked"), env.mkdir("spill"));
    // Slow: the sink is killed while most steps' hooks wait their turn.
    let hook = format!("sleep 0.5; cp -t {}", hooked.display());
    let mut sink = env.sink(&out, ["--hook", &hook]);
    let mut s = Stream::open(config(&env, &[&sink.addr()], &spill)).unwrap();
    let steps = 6;
    for step in 0..steps {
        write_step(&mut s, step);
    }
    s.close().unwrap();
    sink.kill9();
    let ran = std::fs::read_dir(&hooked).unwrap().count();
    assert!(ran < steps as usize - 1, "the hooks were too fast for this test: {ran} ran before the kill");
    sink.restart();
    for step in 0..steps {
        let copy = hooked.join(format!("step-{step:06}.json"));
        assert!(wait_until(Duration::from_secs(30), || copy.is_file()), "no hook for step {step} after the restart:\n{}", sink.log());
    }
}

/// The producer's manifest and the sink's write a step's writes alike.
#[test]
fn the_producer_and_sink_manifests_write_records_alike() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let sink = env.sink(&out, [] as [&str; 0]);
    let mut s = Stream::open(config(&env, &[&sink.addr()], &spill)).unwrap();
    s.write(&[1; 1000]).unwrap();
    s.write(&[2; 300]).unwrap();
    s.end_step().unwrap();
    let report = s.close().unwrap();
    let producer = read_json(report.manifest.as_deref().expect("the manifest is kept"));
    let at_sink = read_json(&out.join(PRODUCER).join("step-000000.json"));
    let want = serde_json::json!([{ "offset": 0, "len": 1000 }, { "offset": 1000, "len": 300 }]);
    assert_eq!(at_sink["records"], want);
    assert_eq!(producer["steps"][0]["records"], want, "{producer:#}");
}

/// A producer given its own credential (`dmover token --producer NAME`)
/// streams under that name, and is refused under any other with a message
/// that says whose credential it holds.
#[test]
fn a_producer_credential_streams_under_its_own_name_only() {
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let sink = env.sink(&out, [] as [&str; 0]);
    let cred = env.path("sim.credential");
    let made = dmover(["token", "--producer", "sim", "--token-file"]).arg(&env.token).arg(&cred).run();
    assert_eq!(made.code, 0, "{}", made.stderr);
    let script = r#"
import sys
from dmover_stream import Stream
s = Stream("sim", [sys.argv[1]], sys.argv[2])
s.write(b"x" * 100000)
s.end_step()
s.close()
try:
    Stream("other", [sys.argv[1]], sys.argv[2])
    raise AssertionError("a credential made for 'sim' streamed as 'other'")
except Exception as e:
    assert "producer 'sim''s" in str(e), e
print("ok")
"#;
    python_with_token_file(script, &sink, &spill, &cred);
    assert_eq!(std::fs::read(out.join("sim/step-000000.dat")).unwrap(), vec![b'x'; 100000]);
    assert!(!out.join("other").exists());
}

/// Regression (security, token files): the streaming library read
/// `DMOVER_TOKEN_FILE` whatever its mode, where every dmover command refuses
/// a token file that group or others can read. A producer now refuses it the
/// same way, saying how to fix it.
#[test]
fn a_producer_refuses_a_token_file_others_can_read() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let sink = env.sink(&out, [] as [&str; 0]);
    let open = env.path("open-token");
    std::fs::copy(&env.token, &open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
    let script = r#"
import sys
from dmover_stream import Stream
try:
    Stream("leaky", [sys.argv[1]], sys.argv[2])
    raise AssertionError("a token file others can read was accepted")
except Exception as e:
    assert "chmod 600" in str(e), e
print("ok")
"#;
    python_with_token_file(script, &sink, &spill, &open);
}

/// Runs a Python `script` (its arguments: the sink's address and the
/// spill directory) with `DMOVER_TOKEN_FILE` set to `token_file`; it must
/// print "ok".
fn python_with_token_file(script: &str, sink: &Server, spill: &Path, token_file: &Path) {
    let r = Command::new("python3")
        .args(["-c", script, &sink.addr(), spill.to_str().unwrap()])
        .env("DMOVER_TOKEN_FILE", token_file)
        .env_remove("DMOVER_TOKEN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success() && stdout.trim() == "ok", "{stdout}\n{}", String::from_utf8_lossy(&r.stderr));
}

/// Writes step `step` (12 blocks) in two halves: the first, then kills
/// `sink` (writing to `out`) once it holds that half and the producer read
/// its acknowledgements, then the second.
fn write_split_step(s: &mut Stream, step: u64, sink: &mut Server, out: &Path) -> Vec<u8> {
    use std::os::unix::fs::MetadataExt;
    let data = step_data(step, 12 * BLOCK as usize);
    s.write_metadata("step", &step.to_string()).unwrap();
    let half = data.len() / 2;
    s.write(&data[..half]).unwrap();
    let file = out.join(PRODUCER).join(format!("step-{step:06}.dat"));
    let held = || std::fs::metadata(&file).is_ok_and(|m| m.blocks() * 512 >= half as u64);
    assert!(wait_until(Duration::from_secs(20), held), "the first half of step {step} did not reach {} within 20 s", file.display());
    wait_quiet(sink.port, 1, &format!("the acknowledgements of step {step}'s first half read by the producer"));
    sink.kill9();
    s.write(&data[half..]).unwrap();
    s.end_step().unwrap();
    data
}

/// The manifests the hook was run with (the hook appends each to `log`).
fn hooked(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log).unwrap_or_default().lines().map(str::to_string).collect()
}

/// Checks that step `step` is whole at the sink in `out`, its manifest
/// complete and every block there, and that its hook ran exactly once,
/// there, as the hook log `log` says.
fn assert_gathered(out: &Path, log: &Path, step: u64, want: &[u8]) {
    let dir = out.join(PRODUCER);
    assert!(std::fs::read(dir.join(format!("step-{step:06}.dat"))).unwrap() == want, "step {step} is not whole at {}", out.display());
    let m = read_json(&dir.join(format!("step-{step:06}.json")));
    assert_eq!(m["complete"], true, "{m}");
    assert!(m["blocks"].as_array().unwrap().iter().all(|b| b["here"] == true), "{m}");
    let name = format!("step-{step:06}.json");
    assert!(wait_until(Duration::from_secs(20), || hooked(log).iter().any(|l| l.ends_with(&name))), "no hook ran for step {step}");
    std::thread::sleep(Duration::from_secs(1));
    let runs: Vec<String> = hooked(log).into_iter().filter(|l| l.ends_with(&name)).collect();
    assert_eq!(runs, [dir.join(&name).display().to_string()], "the hook of step {step} must run once, where the step is whole");
}

/// Two sinks whose hook appends the manifest it runs on to `log`.
struct Logged {
    out_a: PathBuf,
    out_b: PathBuf,
    spill: PathBuf,
    log: PathBuf,
    primary: Server,
    alternate: Server,
}

fn two_logged_sinks(env: &Env) -> Logged {
    let (out_a, out_b, spill) = (env.mkdir("sink-a"), env.mkdir("sink-b"), env.mkdir("spill"));
    let log = env.path("hooks.log");
    let hook = format!("printf '%s\\n' >> {}", log.display());
    let primary = env.sink(&out_a, ["--hook", &hook]);
    let alternate = env.sink(&out_b, ["--hook", &hook]);
    Logged { out_a, out_b, spill, log, primary, alternate }
}

/// STREAMING.md "Failover": the primary dies in the middle of a step, so
/// the step's first blocks are at the primary and the rest at the
/// alternate. Once the primary is back, the producer fetches its blocks
/// and sends them to the alternate, where the step is complete, verified,
/// and its hook runs once.
#[test]
fn a_step_split_by_failover_is_gathered_to_one_sink_where_its_hook_runs_once() {
    let env = Env::new();
    let Logged { out_a, out_b, spill, log, mut primary, alternate } = two_logged_sinks(&env);
    let mut s = Stream::open(config(&env, &[&primary.addr(), &alternate.addr()], &spill)).unwrap();
    let mut written: Vec<Vec<u8>> = (0..3).map(|step| write_step(&mut s, step)).collect();
    wait_settled(&primary, &out_a, 2);
    written.push(write_split_step(&mut s, 3, &mut primary, &out_a));
    primary.restart();
    written.extend((4..6).map(|step| write_step(&mut s, step)));
    let report = s.close().unwrap();
    assert!(report.failovers >= 1, "{report:?}");
    assert!(report.split_steps.is_empty(), "{report:?}");
    assert!(out_a.join(PRODUCER).join("step-000003.dat").is_file(), "the primary held none of step 3: nothing was split");
    assert!(!out_a.join(PRODUCER).join("step-000003.json").exists(), "the primary saved step 3, which it does not hold whole");
    let sinks = HashMap::from([(primary.addr(), out_a.clone()), (alternate.addr(), out_b.clone())]);
    let m = check_delivery(&report, &written, &sinks);
    assert!(m["steps"][3]["blocks"].as_array().unwrap().iter().all(|b| b["at"] == alternate.addr()), "{}", m["steps"][3]);
    assert_gathered(&out_b, &log, 3, &written[3]);
}

/// The same with the primary still down at close: the step stays split
/// (the report says so, and no hook runs for it); `dmover drain` gathers it
/// once the primary is back, and its hook runs once.
#[test]
fn drain_gathers_a_step_left_split_and_its_hook_runs_once() {
    let env = Env::new();
    let Logged { out_a, out_b, spill, log, mut primary, alternate } = two_logged_sinks(&env);
    let mut s = Stream::open(config(&env, &[&primary.addr(), &alternate.addr()], &spill)).unwrap();
    let mut written: Vec<Vec<u8>> = (0..2).map(|step| write_step(&mut s, step)).collect();
    wait_settled(&primary, &out_a, 1);
    written.push(write_split_step(&mut s, 2, &mut primary, &out_a));
    let report = s.close().unwrap();
    assert_eq!(report.split_steps, [2], "{report:?}");
    assert_eq!(report.undelivered_blocks, 0, "{report:?}");
    let partial = read_json(&out_b.join(PRODUCER).join("step-000002.json"));
    assert_eq!(partial["complete"], false, "{partial}");
    std::thread::sleep(Duration::from_secs(1));
    assert!(!hooked(&log).iter().any(|l| l.ends_with("step-000002.json")), "a hook ran for a split step");

    // While the primary is down the step cannot be gathered: drain fails, saying to run it again.
    let manifest = report.manifest.as_deref().expect("the manifest is kept").to_str().unwrap().to_string();
    let r = dmover(["drain", "--timeout", "5", "--token-file", env.token.to_str().unwrap(), &manifest]).run();
    assert_eq!(r.code, 6, "drain left step 2 split, yet did not fail as unreachable:\n{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("[2]") && r.stderr.contains("run drain again"),
        "drain does not name the split step or say to run again:\n{}",
        r.stderr
    );
    assert!(!hooked(&log).iter().any(|l| l.ends_with("step-000002.json")), "a hook ran for a step drain left split");

    primary.restart();
    let r = dmover(["drain", "--token-file", env.token.to_str().unwrap(), &manifest]).run();
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    // Drain sends to the first sink that takes it, the primary: the step is gathered there.
    let sinks = HashMap::from([(primary.addr(), out_a.clone()), (alternate.addr(), out_b.clone())]);
    let m = check_manifest(report.manifest.as_deref().expect("the manifest is kept"), &written, &sinks);
    assert!(m["steps"][2]["blocks"].as_array().unwrap().iter().all(|b| b["at"] == primary.addr()), "{}", m["steps"][2]);
    assert_gathered(&out_a, &log, 2, &written[2]);
}

/// Checks that every step is whole at exactly `copies` of the sinks (name →
/// directory) other than `dead`, as written, and that the producer's
/// manifest says where: each step's `complete_at` names the sinks holding
/// it whole (the dead one too, if it did before it died) and every block's
/// `at` is one of them.
fn assert_copies(manifest: &Path, producer: &str, written: &[Vec<u8>], sinks: &HashMap<String, PathBuf>, dead: &str, copies: usize) {
    let m = read_json(manifest);
    for (step, want) in written.iter().enumerate() {
        let holders: Vec<&String> = sinks
            .iter()
            .filter(|(_, dir)| {
                let dir = dir.join(producer);
                let whole = std::fs::read(dir.join(format!("step-{step:06}.dat"))).is_ok_and(|d| d == *want);
                whole && read_json_opt(&dir.join(format!("step-{step:06}.json"))).is_some_and(|j| j["complete"] == true)
            })
            .map(|(name, _)| name)
            .collect();
        assert_eq!(holders.iter().filter(|h| **h != dead).count(), copies, "step {step} is whole at {holders:?}; {dead} is dead");
        let s = &m["steps"][step];
        let mut listed: Vec<&str> = s["complete_at"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let mut holders: Vec<&str> = holders.iter().map(|h| h.as_str()).collect();
        listed.sort_unstable();
        holders.sort_unstable();
        assert_eq!(listed, holders, "step {step}: the producer's manifest says its copies are elsewhere");
        for b in s["blocks"].as_array().unwrap() {
            let copies: Vec<&str> = b["copies"].as_array().map(|c| c.iter().map(|v| v.as_str().unwrap()).collect()).unwrap_or_default();
            assert!(holders.contains(&b["at"].as_str().unwrap()), "step {step}: {b}");
            assert!(copies.len() + 1 >= holders.len(), "step {step}: not every copy of the block is listed: {b}");
        }
    }
}

fn read_json_opt(p: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

/// STREAMING.md "Replicas": with `replicas = 2` and three sinks, the two
/// preferred ones get every step; killing one in the middle of a step makes
/// the third take its place, with a copy of everything the dead one held,
/// so that every step ends whole at two sinks.
#[test]
fn two_replicas_survive_a_sink_killed_in_the_middle_of_a_step() {
    let env = Env::new();
    let (outs, spill): (Vec<PathBuf>, PathBuf) = ((0..3).map(|i| env.mkdir(&format!("sink-{i}"))).collect(), env.mkdir("spill"));
    let mut sinks: Vec<Server> = outs.iter().map(|o| env.sink(o, [] as [&str; 0])).collect();
    let addrs: Vec<String> = sinks.iter().map(|s| s.addr()).collect();
    let mut c = config(&env, &addrs.iter().map(String::as_str).collect::<Vec<_>>(), &spill);
    c.replicas = 2;
    let mut s = Stream::open(c).unwrap();
    let mut written: Vec<Vec<u8>> = (0..3).map(|step| write_step(&mut s, step)).collect();
    written.push(write_split_step(&mut s, 3, &mut sinks[0], &outs[0]));
    written.extend((4..7).map(|step| write_step(&mut s, step)));
    let report = s.close().unwrap();
    assert!(report.failovers >= 1, "{report:?}");
    assert_eq!(report.undelivered_blocks, 0, "{report:?}");
    assert!(report.complete_at.values().all(|at| at.iter().filter(|a| **a != addrs[0]).count() == 2), "{:?}", report.complete_at);
    let dirs: HashMap<String, PathBuf> = addrs.iter().cloned().zip(outs.iter().cloned()).collect();
    assert_copies(report.manifest.as_deref().expect("the manifest is kept"), PRODUCER, &written, &dirs, &addrs[0], 2);
    assert!(outs[2].join(PRODUCER).join("step-000000.json").is_file(), "the spare did not take the dead sink's copies");
}

/// A producer for the replication tests: streams STEPS steps of N doubles
/// (value step * 1000003 + i) to SINKS with SPILL, in 64 KiB blocks; in the
/// middle of step STEPS / 2 it says "half" and waits for a line on stdin (the
/// test kills a sink meanwhile). C, giving REPLICAS to `dms_set_replicas`
/// when it follows on its command line.
const REPLICAS_PRODUCER_C: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include "dmover_stream.h"
#define FAIL(x) if (x) { fprintf(stderr, "%s\n", dms_last_error()); return 2; }
int main(int argc, char **argv) {
    dms_stream *s;
    dms_report r = {0};
    char line[8], num[32];
    long steps = atol(argv[3]), n = atol(argv[4]);
    double *phi = malloc(n * sizeof *phi);
    FAIL(dms_open("replicas-c", argv[1], argv[2], 0, 65536, 0, &s));
    if (argc > 5) FAIL(dms_set_replicas(s, atoi(argv[5])));
    for (long step = 0; step < steps; step++) {
        for (long i = 0; i < n; i++) phi[i] = (double)(step * 1000003 + i);
        snprintf(num, sizeof num, "%ld", step);
        FAIL(dms_write_metadata(s, "step", num));
        if (step == steps / 2) {
            FAIL(dms_write(s, phi, n / 2 * sizeof *phi));
            printf("half\n");
            fflush(stdout);
            if (!fgets(line, sizeof line, stdin)) return 2;
            FAIL(dms_write(s, phi + n / 2, (n - n / 2) * sizeof *phi));
        } else {
            FAIL(dms_write(s, phi, n * sizeof *phi));
        }
        FAIL(dms_end_step(s));
    }
    FAIL(dms_close(s, &r));
    printf("failovers=%llu\n", (unsigned long long)r.failovers);
    return 0;
}
"#;

/// The same in Python, with `replicas=`.
const REPLICAS_PRODUCER_PY: &str = r#"
import sys
import numpy as np
from dmover_stream import Stream
sinks, spill, steps, n = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kw = {"replicas": int(sys.argv[5])} if len(sys.argv) > 5 else {}
s = Stream("replicas-py", sinks, spill, block_size=65536, **kw)
for step in range(steps):
    phi = np.arange(n, dtype="<f8") + step * 1000003
    s.write_metadata("step", step)
    if step == steps // 2:
        s.write(phi[: n // 2])
        print("half", flush=True)
        sys.stdin.readline()
        s.write(phi[n // 2 :])
    else:
        s.write(phi)
    s.end_step()
r = s.close()
assert all(len(at) >= 2 for at in r["complete_at"].values()), r["complete_at"]
print(f"failovers={r['failovers']}")
"#;

/// Runs a replication producer (`cmd`, then SINKS SPILL STEPS N and
/// `extra`) against three sinks and kills the first in the middle of a
/// step; every step must end whole at two of them.
fn replicas_from(env: &Env, what: &str, producer: &str, mut cmd: Command, extra: &[&str]) {
    use std::io::{Read, Write};
    let (steps, n) = (8u64, 60_000u64);
    let outs: Vec<PathBuf> = (0..3).map(|i| env.mkdir(&format!("sink-{}-{i}", unique()))).collect();
    let mut sinks: Vec<Server> = outs.iter().map(|o| env.sink(o, [] as [&str; 0])).collect();
    let addrs: Vec<String> = sinks.iter().map(|s| s.addr()).collect();
    let spill = env.mkdir(&format!("spill-{}", unique()));
    cmd.arg(addrs.join(",")).arg(&spill).args([steps.to_string(), n.to_string()]).args(extra).env("DMOVER_KEEP_MANIFEST", "1");
    let (mut child, mut stdout) = spawn_until(env, &mut cmd, "half", &format!("{what}: the producer did not get to the middle"));
    // The first sink holds the whole blocks of the first half (the rest of
    // a block waits for the second), and the producer read its acknowledgements.
    use std::os::unix::fs::MetadataExt;
    let whole_blocks = n * 8 / 2 / BLOCK as u64 * BLOCK as u64;
    let file = outs[0].join(producer).join(format!("step-{:06}.dat", steps / 2));
    let held = || std::fs::metadata(&file).is_ok_and(|m| m.blocks() * 512 >= whole_blocks);
    assert!(wait_until(Duration::from_secs(20), held), "{what}: the first half of the middle step did not reach {}", file.display());
    wait_quiet(sinks[0].port, 1, &format!("{what}: the first sink's acknowledgements read by the producer"));
    sinks[0].kill9();
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let r = child.wait_with_output().unwrap();
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(r.status.success(), "{what}: {rest}\n{}", String::from_utf8_lossy(&r.stderr));
    let failovers = rest.lines().find_map(|l| l.strip_prefix("failovers=")).map(|n| n.trim().parse::<u64>());
    assert!(matches!(failovers, Some(Ok(n)) if n >= 1), "{what}: a sink was killed, but no failover was reported: {rest}");
    let written: Vec<Vec<u8>> =
        (0..steps).map(|step| (0..n).flat_map(|i| ((step * 1_000_003 + i) as f64).to_le_bytes()).collect()).collect();
    let dirs: HashMap<String, PathBuf> = addrs.iter().cloned().zip(outs.iter().cloned()).collect();
    let manifest = std::fs::read_dir(&spill).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().ends_with(".manifest.json"));
    assert_copies(&manifest.expect("the producer's manifest"), producer, &written, &dirs, &addrs[0], 2);
}

#[test]
fn two_replicas_from_c_and_python_survive_a_sink_killed_mid_run() {
    let env = Env::new();
    let dir = env.mkdir("build");
    let src = dir.join("replicas.c");
    std::fs::write(&src, REPLICAS_PRODUCER_C).unwrap();
    let c = dir.join("replicas-c");
    build("cc", &[src], &c);
    replicas_from(&env, "C, dms_set_replicas", "replicas-c", Command::new(&c), &["2"]);
    let mut by_env = Command::new(&c);
    by_env.env("DMOVER_REPLICAS", "2");
    replicas_from(&env, "C, DMOVER_REPLICAS", "replicas-c", by_env, &[]);
    let mut py = Command::new("python3");
    py.args(["-c", REPLICAS_PRODUCER_PY]);
    replicas_from(&env, "Python, replicas=", "replicas-py", py, &["2"]);
}

/// With `replicas = 2` and only two sinks, killing one leaves fewer up than
/// copies wanted: the stream goes on (a block's slot is freed once every
/// sink that is up holds it, so the writer does not spill the rest of the
/// run) and close returns without waiting for copies no sink can take.
#[test]
fn with_fewer_sinks_up_than_replicas_the_stream_goes_on_and_close_returns() {
    let env = Env::new();
    let (outs, spill): (Vec<PathBuf>, PathBuf) = ((0..2).map(|i| env.mkdir(&format!("sink-{i}"))).collect(), env.mkdir("spill"));
    let mut sinks: Vec<Server> = outs.iter().map(|o| env.sink(o, [] as [&str; 0])).collect();
    let addrs: Vec<String> = sinks.iter().map(|s| s.addr()).collect();
    let mut c = config(&env, &addrs.iter().map(String::as_str).collect::<Vec<_>>(), &spill);
    c.replicas = 2;
    // A write may wait for room: with a sink up to take every block, none spills.
    c.max_wait = Duration::from_secs(2);
    c.close_timeout = Duration::from_secs(30);
    let mut s = Stream::open(c).unwrap();
    let mut written: Vec<Vec<u8>> = (0..3).map(|step| write_step(&mut s, step)).collect();
    written.push(write_split_step(&mut s, 3, &mut sinks[0], &outs[0]));
    written.extend((4..12).map(|step| write_step(&mut s, step)));
    let start = std::time::Instant::now();
    let report = s.close().unwrap();
    assert_eq!(
        report.spilled_blocks, 0,
        "the ring kept blocks waiting for a second copy no sink could take, and the writer spilled: {report:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(30), "close took {:?}", start.elapsed());
    assert_eq!(report.undelivered_blocks, 0, "{report:?}");
    let dirs: HashMap<String, PathBuf> = addrs.iter().cloned().zip(outs.iter().cloned()).collect();
    assert_copies(report.manifest.as_deref().expect("the manifest is kept"), PRODUCER, &written, &dirs, &addrs[0], 1);
}

/// STREAMING.md "Replicas": `set_replicas` raises k on an open stream, and
/// the steps sent before get their new copies, as the later ones do.
#[test]
fn raising_replicas_mid_stream_copies_the_steps_sent_before() {
    let env = Env::new();
    let (outs, spill): (Vec<PathBuf>, PathBuf) = ((0..2).map(|i| env.mkdir(&format!("sink-{i}"))).collect(), env.mkdir("spill"));
    let sinks: Vec<Server> = outs.iter().map(|o| env.sink(o, [] as [&str; 0])).collect();
    let addrs: Vec<String> = sinks.iter().map(|s| s.addr()).collect();
    let mut s = Stream::open(config(&env, &addrs.iter().map(String::as_str).collect::<Vec<_>>(), &spill)).unwrap();
    let mut written: Vec<Vec<u8>> = (0..3).map(|step| write_step(&mut s, step)).collect();
    let saved = outs[0].join(PRODUCER).join("step-000002.json");
    assert!(wait_until(Duration::from_secs(30), || saved.is_file()), "step 2 was not saved at the first sink");
    assert!(!outs[1].join(PRODUCER).exists(), "with one replica, the second sink got a copy before k was raised");
    s.set_replicas(2).unwrap();
    written.extend((3..6).map(|step| write_step(&mut s, step)));
    let report = s.close().unwrap();
    assert_eq!(report.undelivered_blocks, 0, "{report:?}");
    assert!(report.complete_at.values().all(|at| at.len() == 2), "not every step is whole at both sinks: {:?}", report.complete_at);
    let dirs: HashMap<String, PathBuf> = addrs.iter().cloned().zip(outs.iter().cloned()).collect();
    assert_copies(report.manifest.as_deref().expect("the manifest is kept"), PRODUCER, &written, &dirs, "", 2);
}

/// STREAMING.md "The producer's manifest": `replicas` gives k, which drain
/// keeps. Both sinks of a stream with k = 2 die before anything was
/// delivered; once they are back, drain delivers every step to both.
#[test]
fn drain_of_a_stream_with_two_replicas_delivers_two_copies() {
    let env = Env::new();
    let (outs, spill): (Vec<PathBuf>, PathBuf) = ((0..2).map(|i| env.mkdir(&format!("sink-{i}"))).collect(), env.mkdir("spill"));
    let mut sinks: Vec<Server> = outs.iter().map(|o| env.sink(o, [] as [&str; 0])).collect();
    let addrs: Vec<String> = sinks.iter().map(|s| s.addr()).collect();
    let mut c = config(&env, &addrs.iter().map(String::as_str).collect::<Vec<_>>(), &spill);
    c.replicas = 2;
    c.close_timeout = Duration::from_secs(1);
    let mut s = Stream::open(c).unwrap();
    sinks.iter_mut().for_each(Server::kill9);
    let written: Vec<Vec<u8>> = (0..5).map(|step| write_step(&mut s, step)).collect();
    let report = s.close().unwrap();
    assert_eq!(report.undelivered_blocks, report.blocks, "both sinks were dead, yet blocks were delivered: {report:?}");
    sinks.iter_mut().for_each(Server::restart);
    let manifest = report.manifest.as_deref().expect("the manifest is kept").to_str().unwrap().to_string();
    let r = dmover(["drain", "--timeout", "60", "--token-file", env.token.to_str().unwrap(), &manifest]).run();
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let dirs: HashMap<String, PathBuf> = addrs.iter().cloned().zip(outs.iter().cloned()).collect();
    assert_copies(report.manifest.as_deref().expect("the manifest is kept"), PRODUCER, &written, &dirs, "", 2);
}

/// A producer that measures its own memory: streams STEPS steps of BYTES
/// bytes to SINKS with SPILL and a BUFFER-byte ring of 1 MiB blocks. It
/// says "open" once its stream is open and waits for a line (the test stops
/// the sink meanwhile); after writing it says "written BEFORE PEAK" (its
/// peak resident KiB before opening the stream, with its data in memory,
/// and now) and waits for a line (the test lets the sink go on); after
/// closing it says "closed PEAK".
const RSS_PRODUCER_C: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dmover_stream.h"
#define FAIL(x) if (x) { fprintf(stderr, "%s\n", dms_last_error()); return 2; }
static long peak_kib(void) {
    char line[256];
    long kib = -1;
    FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %ld", &kib) == 1) break;
    if (f) fclose(f);
    return kib;
}
int main(int argc, char **argv) {
    dms_stream *s;
    dms_report r = {0};
    char line[8];
    long buffer = atol(argv[3]), steps = atol(argv[4]), bytes = atol(argv[5]);
    char *data = malloc(bytes);
    memset(data, 7, bytes);
    long before = peak_kib();
    FAIL(dms_open("rss-c", argv[1], argv[2], buffer, 1 << 20, 0, &s));
    printf("open\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 2;
    for (long step = 0; step < steps; step++) {
        data[0] = (char)step;
        FAIL(dms_write(s, data, bytes));
        FAIL(dms_end_step(s));
    }
    printf("written %ld %ld\n", before, peak_kib());
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 2;
    FAIL(dms_close(s, &r));
    printf("closed %ld spilled=%llu\n", peak_kib(), (unsigned long long)r.spilled_blocks);
    return 0;
}
"#;

/// STREAMING.md "How it works": memory never exceeds the buffer. A producer
/// writes six times its buffer while its sink is stopped, so that no slot
/// is ever freed, then closes; its peak resident memory grows by the buffer
/// and a fixed allowance, never by what it wrote. The allowance (24 blocks)
/// covers what lives outside the ring whatever the buffer: a frame being
/// sealed on each of the 8 data connections, the block being spilled or
/// read back, the queue manager's state and the allocator's own.
#[test]
fn a_producers_memory_never_exceeds_its_buffer() {
    use std::io::{BufRead, Read, Write};
    const MIB: u64 = 1 << 20;
    let (buffer, steps, bytes) = (16 * MIB, 24u64, 4 * MIB);
    let env = Env::new();
    let dir = env.mkdir("build");
    let src = dir.join("rss.c");
    std::fs::write(&src, RSS_PRODUCER_C).unwrap();
    let exe = dir.join("rss-c");
    build("cc", &[src], &exe);
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let sink = env.sink(&out, [] as [&str; 0]);
    let mut cmd = Command::new(&exe);
    cmd.arg(sink.addr()).arg(&spill).args([buffer.to_string(), steps.to_string(), bytes.to_string()]);
    let (mut child, mut stdout) = spawn_until(&env, &mut cmd, "open", "the producer did not open its stream");
    let mut stdin = child.stdin.take().unwrap();
    sink.signal(libc::SIGSTOP);
    stdin.write_all(b"go\n").unwrap();
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    sink.signal(libc::SIGCONT);
    stdin.write_all(b"go\n").unwrap();
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let r = child.wait_with_output().unwrap();
    assert!(r.status.success(), "{line}{rest}\n{}", String::from_utf8_lossy(&r.stderr));
    let kib = |s: &str| s.parse::<u64>().unwrap_or_else(|_| panic!("not a number of KiB: {s:?} in {line}{rest}"));
    let w: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(w.first(), Some(&"written"), "{line}{rest}");
    let (before, written) = (kib(w[1]), kib(w[2]));
    let closed = kib(rest.split_whitespace().nth(1).unwrap_or(""));
    let spilled: u64 = rest.split("spilled=").nth(1).and_then(|n| n.trim().parse().ok()).unwrap_or(0);
    let bound = (buffer + 24 * MIB) / 1024;
    for (when, peak) in [("after writing", written), ("after closing", closed)] {
        assert!(
            peak - before <= bound,
            "{when}, the producer's peak memory grew by {} KiB, more than its {} KiB buffer and 24 MiB; it wrote {} MiB",
            peak - before,
            buffer / 1024,
            steps * bytes / MIB
        );
    }
    assert!(spilled * MIB >= steps * bytes - buffer, "the sink was stopped, yet only {spilled} blocks spilled: {rest}");
    for step in 0..steps {
        let len = std::fs::metadata(out.join("rss-c").join(format!("step-{step:06}.dat"))).map(|m| m.len()).unwrap_or(0);
        assert_eq!(len, bytes, "step {step} at the sink");
    }
}

/// Streams 3 steps with its only sink killed once the stream is open, then
/// (once the test damaged the spill file and restarted the sink) closes and
/// prints the exception `close` raised.
const VERIFY_PRODUCER_PY: &str = r#"
import sys
from dmover_stream import Stream
s = Stream("verify-py", [sys.argv[1]], sys.argv[2], block_size=65536, close_timeout=60)
print("open", flush=True)
sys.stdin.readline()
for step in range(3):
    s.write(bytes([step + 1]) * (4 * 65536 + 1000))
    s.end_step()
print("written", flush=True)
sys.stdin.readline()
try:
    s.close()
    print("closed")
except Exception as e:
    print(f"{type(e).__name__}: {e}")
"#;

/// STREAMING.md "Using it": a block that fails its check is a
/// `RuntimeError` in Python. The blocks spill while the sink is down; one
/// is damaged in the spill file; sending it at close finds the damage.
#[test]
fn a_damaged_block_is_a_runtime_error_in_python() {
    use std::io::{BufRead, Read, Write};
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let mut sink = env.sink(&out, [] as [&str; 0]);
    let mut cmd = Command::new("python3");
    cmd.args(["-c", VERIFY_PRODUCER_PY, &sink.addr(), spill.to_str().unwrap()]);
    let (mut child, mut stdout) = spawn_until(&env, &mut cmd, "open", "the producer did not open its stream");
    let mut stdin = child.stdin.take().unwrap();
    sink.kill9();
    stdin.write_all(b"go\n").unwrap();
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "written");
    let manifest =
        || std::fs::read_dir(&spill).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().ends_with(".manifest.json"));
    let all_spilled = || {
        let Some(m) = manifest().and_then(|p| read_json_opt(&p)) else { return false };
        let steps = m["steps"].as_array().cloned().unwrap_or_default();
        steps.len() == 3
            && steps.iter().all(|s| {
                s["ended"] == true
                    && s["blocks"].as_array().is_some_and(|b| b.len() == 5 && b.iter().all(|b| b.get("spill_offset").is_some()))
            })
    };
    assert!(
        wait_until(Duration::from_secs(30), all_spilled),
        "the blocks did not reach the spill file: {:?}",
        manifest().map(|p| read_json(&p))
    );
    let file = std::fs::read_dir(&spill).unwrap().map(|e| e.unwrap().path()).find(|p| p.extension().is_some_and(|x| x == "spill")).unwrap();
    let mut bytes = std::fs::read(&file).unwrap();
    *bytes.last_mut().unwrap() ^= 0x20;
    std::fs::write(&file, &bytes).unwrap();
    sink.restart();
    stdin.write_all(b"go\n").unwrap();
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let r = child.wait_with_output().unwrap();
    assert!(r.status.success(), "{rest}\n{}", String::from_utf8_lossy(&r.stderr));
    assert!(rest.starts_with("RuntimeError: ") && rest.contains("damaged"), "close did not raise RuntimeError for a damaged block: {rest}");
}
