//! Tuned transfers in every direction through an emulated WAN link
//! (tools/wanem between two network namespaces, through dmover-testkit):
//! real TCP over 100 Mbit/s and 50 ms, socket buffers of 64 KiB, so one
//! stream cannot fill the link and the tuners must open more while sending
//! — the client itself on an upload, the server (the client dialing the
//! streams it asks for) on a download, the source server on a third-party
//! copy.
//!
//! One stream carries about a socket buffer per round trip, 64 KiB / 50 ms
//! ≈ 10 Mbit/s (a little more, as the kernel rounds the buffers up); the
//! default tuner starts at four streams, about half the link, so only a
//! tuner that opens more reaches [`LINK_SHARE`] of it.

mod util;

use dmover_testkit::{Link, LinkSpec};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use util::*;

const NS_A: &str = "dmtestA";
const NS_B: &str = "dmtestB";
const IP_A: &str = "10.250.13.1";
const IP_B: &str = "10.250.13.2";
/// The emulated link's rate, each way.
const LINK_MBIT: f64 = 100.0;
/// Share of the link a tuned transfer must reach over its steady part:
/// above what the default tuner's starting streams carry (checked against
/// one stream's measured rate: four such streams carry about 0.45 of the
/// link), and below the link's rate less TCP/IP headers (about 0.96) by
/// enough for a loaded machine, where the emulator itself runs short of CPU
/// (a download on a busy 2-core machine held 0.69 of it).
const LINK_SHARE: f64 = 0.6;
/// The streams the default tuner starts with.
const AUTO_START: u64 = 4;

/// The namespaces are shared by the tests of this file: one link at a time.
static LINK: Mutex<()> = Mutex::new(());

/// The emulated link (100 Mbit/s, 25 ms each way) while the guard is held;
/// torn down when dropped, before the guard lets the next test make it
/// again. None (after a visible skip line) where no link can be made.
fn link_up() -> Option<(Link, MutexGuard<'static, ()>)> {
    if !dmover_testkit::wan_link_possible() {
        return None;
    }
    let only = LINK.lock().unwrap_or_else(|e| e.into_inner());
    let link = Link::up(LinkSpec { ns_a: NS_A, ns_b: NS_B, subnet: 13, delay_ms: 25.0, rate_mbit: LINK_MBIT, timeout_s: 300 });
    assert_eq!(link.ip_b(), IP_B);
    Some((link, only))
}

/// A server in namespace B exporting `x`, across the link.
fn server_across(env: &Env, export: &std::path::Path) -> Server {
    server_in(env, export, NS_B, IP_B)
}

/// A server in namespace `ns` at `ip` exporting `x`.
fn server_in(env: &Env, export: &std::path::Path, ns: &str, ip: &str) -> Server {
    let mut spec = ServerSpec::new(&env.token, &[("x", export)], &env.path(&format!("server-{ns}.log")));
    spec.listen = format!("{ip}:0");
    spec.prefix = ["ip", "netns", "exec", ns].iter().map(Into::into).collect();
    // Third-party copies go from A to B, across the link.
    spec.push_to = vec![IP_B.into()];
    Server::start(spec)
}

/// Six files of 12 MiB in `dir`.
fn six_files(dir: &std::path::Path) {
    let mut rng = Rng::new(13);
    for i in 0..6 {
        make_file(&dir.join(format!("f{i}.dat")), 12 << 20, &mut rng);
    }
}

/// Runs `cmd` (a dmover command) from namespace A, over the link with 64 KiB
/// socket buffers; returns its report.
fn across(cmd: &mut Cmd) -> serde_json::Value {
    over_the_link(cmd).run().assert_ok()
}

fn over_the_link(cmd: &mut Cmd) -> &mut Cmd {
    cmd.args(["--tcp-bs", "64K", "--congestion", "cubic"]);
    cmd.prefix(["ip", "netns", "exec", NS_A]).timeout(Duration::from_secs(120))
}

/// Runs `cmd` like [`across`] and meanwhile counts, with `ss` in namespace
/// B every 50 ms, the established connections of the server at `port`
/// (what the kernel holds, not what dmover reports): the report, and the
/// most connections seen at once.
fn across_counted(cmd: &mut Cmd, port: u16) -> (serde_json::Value, usize) {
    let mut p = over_the_link(cmd).spawn();
    let mut most = 0;
    while p.running() {
        let out = in_netns(Some(NS_B), "ss").args(["-Htn", "state", "established", &format!("sport = :{port}")]).output().expect("run ss");
        most = most.max(String::from_utf8_lossy(&out.stdout).lines().count());
        std::thread::sleep(Duration::from_millis(50));
    }
    (p.wait().assert_ok(), most)
}

fn bench_cmd(env: &Env, args: &[&str], port: u16) -> Cmd {
    let mut c = dmover(["bench", "--json", "--token-file"]);
    c.arg(&env.token).args(args).arg(format!("dmover://{IP_B}:{port}/x/"));
    c
}

fn bench(env: &Env, args: &[&str], port: u16) -> serde_json::Value {
    across(&mut bench_cmd(env, args, port))
}

/// Checks that MI started from one stream and doubled (1, 2, 4, ...), and
/// that the server held as many data connections as the timeline says
/// (`seen`: the most connections seen at once, the control connection with
/// them): at least the most any point but the last gives (the last may be
/// a decision the transfer ended before it took effect), at most the most
/// of all.
fn assert_mi_doubled(what: &str, j: &serde_json::Value, seen: usize) {
    let n = streams(j);
    assert_eq!(n.first(), Some(&1), "{what}: MI should start from one stream: {n:?}");
    let mut steps = n.clone();
    steps.dedup();
    assert!(steps.starts_with(&[1, 2, 4]), "{what}: MI should double from 1: {n:?}");
    let held = *n[..n.len() - 1].iter().max().unwrap() as usize;
    let most = *n.iter().max().unwrap() as usize;
    eprintln!("tuning: {what}: MI streams {n:?}, {seen} connections seen at once at the server");
    assert!(
        (held + 1..=most + 1).contains(&seen),
        "{what}: the timeline {n:?} says {held} streams held (and {most} at most), but the server held {seen} connections at once (ss), the control connection with them"
    );
}

fn streams(j: &serde_json::Value) -> Vec<u64> {
    j["timeline"].as_array().unwrap().iter().map(|p| u(&p["streams"])).collect()
}

/// Goodput (Mbit/s) over the second half of a tuned transfer's timeline:
/// each point's goodput weighted by the time since the previous point, for
/// the points whose interval lies in that half, and the last one. The
/// timeline ends at `Finish` (no probe follows it), which a sender says
/// while its last queued blocks are still on their way.
fn steady_goodput(j: &serde_json::Value) -> f64 {
    let points: Vec<(f64, f64)> =
        j["timeline"].as_array().unwrap().iter().map(|p| (p["t"].as_f64().unwrap(), p["goodput_mbit"].as_f64().unwrap())).collect();
    let end = points.last().map_or(0.0, |p| p.0);
    let (mut bits, mut time) = (0.0, 0.0);
    let mut prev = 0.0;
    for (t, g) in points {
        if prev >= end / 2.0 || t >= end {
            bits += g * (t - prev);
            time += t - prev;
        }
        prev = t;
    }
    assert!(time > 0.5, "the timeline's second half spans {time:.2} s, too little to judge: {:#}", j["timeline"]);
    bits / time
}

/// Asserts that the transfer ran once (no retry), that the default tuner
/// moved past its four starting streams, and that the transfer then held
/// at least LINK_SHARE of the link.
#[track_caller]
fn assert_tuned(what: &str, j: &serde_json::Value) {
    assert_eq!(j["retries"], 0, "{what}: the transfer was retried: {j:#}");
    let n = streams(j);
    let most = n.iter().copied().max().unwrap();
    assert!(most > AUTO_START, "{what}: the tuner never opened more than its {AUTO_START} starting streams: {n:?}");
    let steady = steady_goodput(j);
    assert!(
        steady >= LINK_SHARE * LINK_MBIT,
        "{what}: {steady:.1} Mbit/s over the second half, below {LINK_SHARE} of the {LINK_MBIT} Mbit/s link; streams {n:?}, timeline {}",
        j["timeline"]
    );
    eprintln!("tuning: {what}: streams {n:?}, steady {steady:.1} Mbit/s, whole {:.1} MB/s", j["mb_per_s"].as_f64().unwrap());
}

/// One stream cannot fill the link; MI doubles from one stream; the default
/// tuner opens more than it starts with and fills most of the link.
#[test]
fn tuners_open_streams_on_a_link_one_stream_cannot_fill() {
    let Some(_link) = link_up() else { return };
    let env = Env::new();
    let export = env.mkdir("export");
    let server = server_across(&env, &export);

    let one = bench(&env, &["--size", "8M", "--streams", "1"], server.port);
    assert!(streams(&one).is_empty(), "a fixed count is not tuned: {one:#}");
    let r1 = one["mb_per_s"].as_f64().unwrap() * 8.0;
    assert!(
        AUTO_START as f64 * r1 < LINK_SHARE * LINK_MBIT,
        "one stream with 64 KiB buffers carried {r1:.1} Mbit/s: {AUTO_START} such streams would reach {LINK_SHARE} of the link untuned"
    );
    eprintln!("tuning: one stream {r1:.1} Mbit/s");

    // MI starts from one stream and doubles while the buffers are the bottleneck.
    let (mi, seen) =
        across_counted(&mut bench_cmd(&env, &["--size", "40M", "--tune", "mi", "--tune-chunk", "3M"], server.port), server.port);
    assert_mi_doubled("bench", &mi, seen);

    let auto = bench(&env, &["--size", "64M"], server.port);
    assert_tuned("bench", &auto);
}

/// A real `dmover cp` upload of files across the link, with the default
/// `--streams auto`: its report's timeline shows the tuner opening more
/// streams than it starts with, the upload fills most of the link, and the
/// files arrive intact.
#[test]
fn cp_upload_is_tuned_past_its_starting_streams() {
    let Some(_link) = link_up() else { return };
    let env = Env::new();
    let export = env.mkdir("export");
    let server = server_across(&env, &export);
    let src = env.path("src");
    six_files(&src);
    let mut c = env.cp([src.display().to_string(), format!("dmover://{IP_B}:{}/x/", server.port)]);
    let up = across(&mut c);
    assert_eq!(u(&up["files"]), 6, "{up:#}");
    assert_same_tree(&src, &export.join("src"));
    assert_tuned("cp", &up);
}

/// A `dmover cp` download across the link with the default `--streams
/// auto`: the server tunes its streams (the client dials each one it asks
/// for), the report's timeline shows it opening more than it starts with,
/// the download fills most of the link, and the files arrive intact.
#[test]
fn cp_download_is_tuned_past_its_starting_streams() {
    let Some(_link) = link_up() else { return };
    let env = Env::new();
    let export = env.mkdir("export");
    six_files(&export.join("src"));
    let server = server_across(&env, &export);
    let dest = env.mkdir("dest");
    let mut c = env.cp([format!("dmover://{IP_B}:{}/x/src", server.port), format!("{}/", dest.display())]);
    let down = across(&mut c);
    assert_eq!(u(&down["files"]), 6, "{down:#}");
    assert_same_tree(&export.join("src"), &dest.join("src"));
    assert_tuned("download", &down);
}

/// A fixed `-p 2` download is not tuned: no timeline, and no more streams.
#[test]
fn a_fixed_download_is_not_tuned() {
    let Some(_link) = link_up() else { return };
    let env = Env::new();
    let export = env.mkdir("export");
    let mut rng = Rng::new(5);
    make_file(&export.join("src/one.dat"), 4 << 20, &mut rng);
    let server = server_across(&env, &export);
    let dest = env.mkdir("dest");
    let mut c = env.cp([format!("dmover://{IP_B}:{}/x/src", server.port), format!("{}/", dest.display()), "-p".into(), "2".into()]);
    let down = across(&mut c);
    assert!(streams(&down).is_empty(), "a fixed count is not tuned: {down:#}");
    assert_same_tree(&export.join("src"), &dest.join("src"));
}

/// A third-party copy from a server in namespace A to one in namespace B,
/// across the link, asked for by a client in A: the source server runs the
/// client's tuner, its timeline comes back in the report, and the copy
/// fills most of the link.
#[test]
fn third_party_copy_is_tuned_past_its_starting_streams() {
    let Some(_link) = link_up() else { return };
    let env = Env::new();
    let (ea, eb) = (env.mkdir("export-a"), env.mkdir("export-b"));
    six_files(&ea.join("src"));
    let a = server_in(&env, &ea, NS_A, IP_A);
    let b = server_across(&env, &eb);
    let mut c = env.cp([format!("dmover://{IP_A}:{}/x/src", a.port), format!("dmover://{IP_B}:{}/x/", b.port)]);
    let copied = across(&mut c);
    assert_eq!(u(&copied["files"]), 6, "{copied:#}");
    assert_same_tree(&ea.join("src"), &eb.join("src"));
    assert_tuned("third party", &copied);
}

/// MI on a download, as on an upload: the server starts from one stream
/// and doubles while the socket buffers are the bottleneck.
#[test]
fn mi_doubles_the_streams_of_a_download() {
    let Some(_link) = link_up() else { return };
    let env = Env::new();
    let export = env.mkdir("export");
    let mut rng = Rng::new(7);
    make_file(&export.join("src/big.dat"), 40 << 20, &mut rng);
    let server = server_across(&env, &export);
    let dest = env.mkdir("dest");
    let mut c = env.cp([
        format!("dmover://{IP_B}:{}/x/src", server.port),
        format!("{}/", dest.display()),
        "--tune".into(),
        "mi".into(),
        "--tune-chunk".into(),
        "3M".into(),
    ]);
    let (down, seen) = across_counted(&mut c, server.port);
    assert_mi_doubled("download", &down, seen);
    assert_same_tree(&export.join("src"), &dest.join("src"));
}
