//! Copies in all four directions, naming rules, globs and round-robin over
//! several servers: the destination must end up byte-identical to the
//! source, with modes and mtimes kept, and the report must say so.

mod util;

use std::collections::BTreeSet;
use std::fs;
use std::time::Duration;
use util::*;

/// Common checks of a successful report against the source tree.
fn check_report(j: &serde_json::Value, src: &std::path::Path) {
    let files = list_files(src);
    assert_eq!(u(&j["files"]), files.len() as u64, "files in the report: {j:#}");
    assert_eq!(u(&j["bytes"]), total_size(src), "bytes in the report: {j:#}");
    assert_eq!(u(&j["skipped_files"]), 0, "{j:#}");
    assert!(j["seconds"].as_f64().is_some_and(|s| s > 0.0), "seconds: {j:#}");
    let hosts = j["hosts"].as_array().expect("hosts");
    let (hf, hb) = hosts.iter().fold((0, 0), |a, h| (a.0 + u(&h["files"]), a.1 + u(&h["bytes"])));
    assert_eq!((hf, hb), (u(&j["files"]), u(&j["bytes"])), "host shares must add up to the totals: {j:#}");
}

#[test]
fn local_to_local_tree_is_identical() {
    let env = Env::new();
    let src = env.path("data");
    make_tree(&src, 1, 30);
    let dst = env.mkdir("out");
    let r = dmover(["cp", "--json", "-q"]).arg(&src).arg(&dst).run();
    let j = r.assert_ok();
    check_report(&j, &src);
    assert_same_tree(&src, &dst.join("data"));
}

#[test]
fn local_to_remote_tree_is_identical() {
    let env = Env::new();
    let src = env.path("data");
    make_tree(&src, 2, 30);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let r = env.cp([src.as_os_str(), srv.url("e/up").as_ref()]).run();
    let j = r.assert_ok();
    check_report(&j, &src);
    assert_eq!(j["hosts"][0]["host"], srv.addr(), "{j:#}");
    assert_same_tree(&src, &export.join("up/data"));
}

#[test]
fn remote_to_local_tree_is_identical() {
    let env = Env::new();
    let export = env.mkdir("export");
    let src = export.join("data");
    make_tree(&src, 3, 30);
    let srv = env.serve(&[("e", &export)]);
    let dst = env.mkdir("down");
    let r = env.cp([srv.url("e/data").as_ref(), dst.as_os_str()]).run();
    let j = r.assert_ok();
    check_report(&j, &src);
    assert_same_tree(&src, &dst.join("data"));
}

#[test]
fn remote_to_remote_third_party_tree_is_identical() {
    let env = Env::new();
    let ea = env.mkdir("export-a");
    let eb = env.mkdir("export-b");
    let src = ea.join("data");
    make_tree(&src, 4, 30);
    let a = env.serve(&[("ea", &ea)]);
    let b = env.serve(&[("eb", &eb)]);
    let r = env.cp([a.url("ea/data"), b.url("eb/copy")]).run();
    let j = r.assert_ok();
    check_report(&j, &src);
    assert_same_tree(&src, &eb.join("copy/data"));
    // The source export is untouched.
    let again = env.path("expected");
    make_tree(&again, 4, 30);
    assert_same_tree(&again, &src);
}

/// A third-party copy that runs longer than its tickets live: the client
/// renews them while it runs, so the destination's session (which ends
/// when its ticket expires) lasts to the end, with no retry.
#[test]
fn a_third_party_copy_outlives_its_tickets_by_renewing_them() {
    let env = Env::new();
    let (ea, eb) = (env.mkdir("export-a"), env.mkdir("export-b"));
    write_random(&ea.join("data/big.dat"), 5 << 20, 3);
    let a = env.serve(&[("e", &ea)]);
    let mut spec = ServerSpec::new(&env.token, &[("e", &eb)], &env.path("server-b.log"));
    spec.extra = vec!["--ticket-lifetime".into(), "1".into()];
    let b = Server::start(spec);
    let started = std::time::Instant::now();
    let r = env.cp([a.url("e/data"), b.url("e/t"), "--bwlimit".into(), "1M".into(), "--block-size".into(), "256K".into()]).run();
    let j = r.assert_ok();
    assert!(started.elapsed() > std::time::Duration::from_secs(3), "the copy was too quick to outlive its ticket");
    assert_eq!(j["retries"], 0, "the copy was retried: {j:#}\n{}", r.stderr);
    assert_same_tree(&ea.join("data"), &eb.join("t/data"));
    assert!(!b.log().contains("expired without being renewed"), "{}", b.log());
}

#[test]
fn token_from_the_environment_works() {
    let env = Env::new();
    let src = env.path("data");
    make_tree(&src, 5, 3);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let r = dmover(["cp", "--json", "-q"]).arg(&src).arg(srv.url("e")).env("DMOVER_TOKEN", env.token_str()).run();
    r.assert_ok();
    assert_same_tree(&src, &export.join("data"));
}

#[test]
fn naming_follows_rsync() {
    let env = Env::new();
    let src = env.path("data");
    make_tree(&src, 6, 6);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);

    // `dir/` copies the contents.
    let r = env.cp([format!("{}/", src.display()), srv.url("e/contents")]).run();
    r.assert_ok();
    assert_same_tree(&src, &export.join("contents"));

    // A single file to a name that does not exist is written as that name (upload).
    let one = src.join("a/b/c/multi.dat");
    let r = env.cp([one.as_os_str(), srv.url("e/renamed.bin").as_ref()]).run();
    r.assert_ok();
    assert!(export.join("renamed.bin").is_file(), "renamed.bin should be a file: {:?}", list_tree(&export).keys().collect::<Vec<_>>());
    assert!(same_content(&one, &export.join("renamed.bin")));
    assert_eq!(mtime_of(&one), mtime_of(&export.join("renamed.bin")));

    // ... and locally, and when downloading.
    let local = env.mkdir("local");
    let r = dmover(["cp", "--json", "-q"]).arg(&one).arg(local.join("x.bin")).run();
    r.assert_ok();
    assert!(same_content(&one, &local.join("x.bin")));
    let r = env.cp([srv.url("e/renamed.bin"), local.join("y.bin").display().to_string()]).run();
    r.assert_ok();
    assert!(same_content(&one, &local.join("y.bin")));
    assert_eq!(mtime_of(&one), mtime_of(&local.join("y.bin")));

    // A single file into an existing directory keeps its name (locally and remotely).
    let r = dmover(["cp", "--json", "-q"]).arg(&one).arg(&local).run();
    r.assert_ok();
    assert!(same_content(&one, &local.join("multi.dat")));
    fs::create_dir(export.join("existing")).unwrap();
    let r = env.cp([one.as_os_str(), srv.url("e/existing").as_ref()]).run();
    r.assert_ok();
    assert!(same_content(&one, &export.join("existing/multi.dat")), "{:?}", list_tree(&export.join("existing")));
    let r = env.cp([one.as_os_str(), srv.url("e").as_ref()]).run();
    r.assert_ok();
    assert!(same_content(&one, &export.join("multi.dat")), "a file copied to an export's root keeps its name");

    // Several sources into one destination.
    let r = env.cp([src.join("one.bin").display().to_string(), src.join("a").display().to_string(), srv.url("e/several")]).run();
    r.assert_ok();
    assert!(same_content(&src.join("one.bin"), &export.join("several/one.bin")));
    assert_same_tree(&src.join("a"), &export.join("several/a"));
}

/// A destination URL ending in `/` names a directory, as a local one does
/// (`cp dir dmover://h/e/sub/` → `sub/dir/...`).
#[test]
fn remote_destination_with_trailing_slash() {
    let env = Env::new();
    let src = env.path("data");
    make_tree(&src, 7, 4);
    let export = env.mkdir("export");
    fs::create_dir(export.join("sub")).unwrap();
    let srv = env.serve(&[("e", &export)]);
    let r = env.cp([src.display().to_string(), srv.url("e/sub/")]).run();
    r.assert_ok();
    assert_same_tree(&src, &export.join("sub/data"));
    // A single file into `dir/`.
    let r = env.cp([src.join("one.bin").display().to_string(), srv.url("e/sub/")]).run();
    r.assert_ok();
    assert!(same_content(&src.join("one.bin"), &export.join("sub/one.bin")));
}

/// The set of .dat files below `root`, relative to it.
fn dat_files(root: &std::path::Path) -> BTreeSet<String> {
    list_files(root).into_keys().filter(|k| k.ends_with(".dat")).collect()
}

#[test]
fn glob_keeps_relative_paths_upload() {
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 8, 18);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    // Quoted: one argv element, expanded by dmover.
    let pattern = format!("{}/**/*.dat", src.display());
    let r = env.cp([pattern, srv.url("e/g")]).run();
    let j = r.assert_ok();
    let want = dat_files(&src);
    assert!(want.len() > 5 && want.iter().any(|p| p.contains('/')) && want.iter().any(|p| !p.contains('/')));
    let got: BTreeSet<String> = list_files(&export.join("g")).into_keys().collect();
    assert_eq!(got, want, "a glob's matches keep their path below the glob's directory");
    assert_eq!(u(&j["files"]), want.len() as u64);
    for p in &want {
        assert!(same_content(&src.join(p), &export.join("g").join(p)), "{p}");
        assert_eq!(mtime_of(&src.join(p)), mtime_of(&export.join("g").join(p)), "{p}");
    }
}

#[test]
fn glob_keeps_relative_paths_download_and_local() {
    let env = Env::new();
    let export = env.mkdir("export");
    let src = export.join("src");
    make_tree(&src, 9, 18);
    let srv = env.serve(&[("e", &export)]);
    let want = dat_files(&src);

    let down = env.mkdir("down");
    let r = env.cp([srv.url("e/src/**/*.dat"), down.display().to_string()]).run();
    r.assert_ok();
    let got: BTreeSet<String> = list_files(&down).into_keys().collect();
    assert_eq!(got, want, "remote glob");

    let local = env.mkdir("local");
    let r = dmover(["cp", "--json", "-q"]).arg(format!("{}/*/*.dat", src.display())).arg(&local).run();
    r.assert_ok();
    let got: BTreeSet<String> = list_files(&local).into_keys().collect();
    let one_level: BTreeSet<String> = want.iter().filter(|p| p.matches('/').count() == 1).cloned().collect();
    assert!(!one_level.is_empty());
    assert_eq!(got, one_level, "'*/*.dat' matches one directory level only");
}

#[test]
fn round_robin_over_three_servers() {
    let env = Env::new();
    let src = env.path("data");
    make_tree(&src, 10, 40);
    let exports: Vec<_> = (0..3).map(|i| env.mkdir(&format!("export{i}"))).collect();
    let servers: Vec<_> = exports.iter().map(|e| env.serve(&[("e", e)])).collect();
    let url = format!("dmover://{}/e/rr", servers.iter().map(|s| s.addr()).collect::<Vec<_>>().join(","));
    let r = env.cp([src.display().to_string(), url]).run();
    let j = r.assert_ok();
    check_report(&j, &src);
    let n = list_files(&src).len();

    // Every server got a real share; the report says which.
    let hosts = j["hosts"].as_array().unwrap();
    assert_eq!(hosts.len(), 3, "{j:#}");
    let mut union = std::collections::BTreeMap::new();
    for (s, e) in servers.iter().zip(&exports) {
        let here = list_files(&e.join("rr"));
        assert!(here.len() >= n / 6, "server {} got only {} of {n} files", s.addr(), here.len());
        let h = hosts.iter().find(|h| h["host"] == s.addr()).unwrap_or_else(|| panic!("{} not in hosts: {j:#}", s.addr()));
        assert_eq!(u(&h["files"]), here.len() as u64, "{} files: {j:#}", s.addr());
        assert_eq!(u(&h["bytes"]), total_size(&e.join("rr")), "{} bytes: {j:#}", s.addr());
        for (k, node) in here {
            assert!(union.insert(k.clone(), (e.join("rr"), node)).is_none(), "{k} was sent to two servers");
        }
    }
    // The union is the source.
    let want = list_files(&src.parent().unwrap().join("data"));
    let want: Vec<_> = want.keys().map(|k| format!("data/{k}")).collect();
    let got: Vec<_> = union.keys().cloned().collect();
    assert_eq!(got, want);
    for (k, (root, node)) in &union {
        let rel = k.strip_prefix("data/").unwrap();
        assert!(same_content(&src.join(rel), &root.join(k)), "{k}");
        let Node::File { mode, mtime, .. } = node else { unreachable!() };
        let Node::File { mode: m0, mtime: t0, .. } = &list_files(&src)[rel] else { unreachable!() };
        assert_eq!((mode, mtime), (m0, t0), "{k}: mode and mtime");
    }
    // No resume state left behind anywhere.
    for e in &exports {
        assert!(!list_tree(e).keys().any(|k| k.contains(".dmover-part")), "leftovers in {}", e.display());
    }
}

/// `dir` copied recursively must bring its empty subdirectories too (as cp
/// -r and rsync -r do).
#[test]
fn empty_directories_are_copied() {
    let env = Env::new();
    let src = env.path("data");
    make_tree(&src, 11, 2);
    fs::create_dir_all(src.join("empty/inner")).unwrap();
    let dst = env.mkdir("out");
    let r = dmover(["cp", "--json", "-q"]).arg(&src).arg(&dst).run();
    r.assert_ok();
    assert!(
        dst.join("data/empty/inner").is_dir(),
        "empty directories were not copied: {:?}",
        list_tree(&dst.join("data")).keys().collect::<Vec<_>>()
    );
}

#[test]
fn third_party_round_robin_over_two_servers() {
    let env = Env::new();
    let ea = env.mkdir("export-a");
    let src = ea.join("data");
    make_tree(&src, 12, 20);
    let a = env.serve(&[("e", &ea)]);
    let dests: Vec<_> = (0..2).map(|i| env.mkdir(&format!("dest{i}"))).collect();
    let servers: Vec<_> = dests.iter().map(|d| env.serve(&[("e", d)])).collect();
    let url = format!("dmover://{}/e/out", servers.iter().map(|s| s.addr()).collect::<Vec<_>>().join(","));
    let j = env.cp([a.url("e/data"), url]).run().assert_ok();
    check_report(&j, &src);
    let mut got = std::collections::BTreeSet::new();
    for d in &dests {
        let here = list_files(&d.join("out"));
        assert!(here.len() >= 5, "{} got only {} files", d.display(), here.len());
        for k in here.keys() {
            let rel = k.strip_prefix("data/").expect("under data/");
            assert!(same_content(&src.join(rel), &d.join("out").join(k)), "{k}");
            assert!(got.insert(rel.to_string()), "{rel} sent twice");
        }
    }
    assert_eq!(got, list_files(&src).into_keys().collect(), "the union of the destinations is the source");
}

/// More files than the sender keeps in flight per host, so its window
/// fills and drains; tiny and empty files.
#[test]
fn many_small_files_round_trip() {
    let env = Env::new();
    let src = env.path("many");
    let mut rng = Rng::new(13);
    for i in 0..2500u32 {
        make_file(&src.join(format!("d{}/f{i:04}", i % 7)), rng.below(300), &mut rng);
    }
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let j = env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
    assert_eq!(u(&j["files"]), 2500);
    assert_same_tree(&src, &export.join("many"));
    let down = env.mkdir("down");
    let j = env.cp([srv.url("e/many"), down.display().to_string()]).run().assert_ok();
    assert_eq!(u(&j["files"]), 2500);
    assert_same_tree(&src, &down.join("many"));
}

/// `--bwlimit` caps the rate in every direction (for a download the server
/// sends, at the client's limit; for a third-party copy the source server).
/// The rate is observed at the destination, not taken from dmover's report
/// or from the command's run time (which includes start-up): the time the
/// destination took to go from 1 MiB to all 6 MiB written.
#[test]
fn bwlimit_is_honoured_in_every_direction() {
    const MIB: u64 = 1 << 20;
    const SIZE: u64 = 6 * MIB;
    const LIMIT: u64 = 4 * MIB;
    let env = Env::new();
    let src = env.path("data");
    write_random(&src.join("six.dat"), SIZE, 1);
    let ea = env.mkdir("export-a");
    write_random(&ea.join("data/six.dat"), SIZE, 1);
    let eb = env.mkdir("export-b");
    let a = env.serve(&[("e", &ea)]);
    let b = env.serve(&[("e", &eb)]);
    let out = env.mkdir("out");
    let cases: [(&str, String, String, std::path::PathBuf); 4] = [
        ("local", src.display().to_string(), out.join("l").display().to_string(), out.join("l")),
        ("upload", src.display().to_string(), b.url("e/u"), eb.join("u")),
        ("download", a.url("e/data"), out.join("d").display().to_string(), out.join("d")),
        ("third party", a.url("e/data"), b.url("e/t"), eb.join("t")),
    ];
    // 5 MiB at 4 MiB/s is 1.25 s; blocks of 256 KiB land whole, so each
    // end of the window may be off by one block (about 0.06 s each).
    let least = std::time::Duration::from_millis(1100);
    let most = std::time::Duration::from_secs(5);
    let mut wrong = Vec::new();
    for (what, from, to, dst) in cases {
        let mut p = env.cp([from, to, "--bwlimit".into(), "4M".into(), "--block-size".into(), "256K".into()]).spawn();
        let (mut first, mut all) = (None, None);
        wait_until(std::time::Duration::from_secs(60), || {
            let written = written_bytes(&dst);
            if first.is_none() && written >= MIB {
                first = Some(std::time::Instant::now());
            }
            if written >= SIZE {
                all = Some(std::time::Instant::now());
            }
            all.is_some() || !p.running()
        });
        p.wait().assert_ok();
        let (Some(first), Some(all)) = (first, all) else { panic!("{what}: the destination was never seen filling up") };
        let took = all - first;
        if took < least || took > most {
            wrong.push(format!("{what}: 5 MiB in {took:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "at --bwlimit 4M ({LIMIT} B/s) the last 5 MiB must take between {least:?} and {most:?} to arrive: {wrong:#?}"
    );
}

/// `--concurrency N` is the number of files read at once. Observed in the
/// client: the source files it holds open while a slow upload runs (one
/// stream, no tuner). Each reader holds the file it reads; a block queued
/// for the network keeps its file open a little longer, so a count can
/// briefly exceed N (by at most the blocks queued and in flight: 2 per
/// stream, plus one per reader that passed the queue check at once, plus
/// one being sent), but most of the time it is exactly N.
#[test]
fn concurrency_is_the_number_of_source_files_read_at_once() {
    const N: usize = 3;
    let env = Env::new();
    let src = env.path("data");
    for i in 0..8 {
        write_random(&src.join(format!("f{i}.dat")), 2 << 20, 40 + i);
    }
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let args = ["--concurrency", "3", "--streams", "1", "--bwlimit", "2M", "--block-size", "64K", "--staging", "1M"];
    let mut p = env.cp([src.display().to_string(), srv.url("e")]).args(args).spawn();
    let pid = p.pid();
    let open_sources = || -> usize {
        let Ok(rd) = fs::read_dir(format!("/proc/{pid}/fd")) else { return 0 };
        rd.flatten()
            .filter_map(|e| fs::read_link(e.path()).ok())
            .filter(|t| t.starts_with(&src) && t.extension().is_some_and(|x| x == "dat"))
            .count()
    };
    // Sample for 3 s once reading has begun (the copy takes about 8 s).
    assert!(wait_until(Duration::from_secs(30), || open_sources() > 0 || !p.running()), "the client never opened a source file");
    let mut counts = std::collections::BTreeMap::<usize, usize>::new();
    let end = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < end && p.running() {
        *counts.entry(open_sources()).or_default() += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(p.running(), "the copy ended while it was observed: {counts:?}");
    p.kill9();
    let samples: usize = counts.values().sum();
    let (&mode, _) = counts.iter().max_by_key(|(_, &n)| n).unwrap();
    eprintln!("source files open at once (count: samples): {counts:?}");
    assert!(samples >= 50, "too few samples: {counts:?}");
    assert_eq!(mode, N, "with --concurrency {N} the client should mostly hold {N} source files open: {counts:?}");
    let max = *counts.keys().last().unwrap();
    assert!(max <= 2 * N + 2, "{max} source files open at once with --concurrency {N}: {counts:?}");
}

/// A network namespace of its own, with loopback up (and nothing else):
/// its ports are free whatever other tests listen on. Deleted when dropped.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Netns {
        let name = format!("dm{tag}{}", std::process::id());
        let ip = |args: &[&str]| {
            let out = std::process::Command::new("ip").args(args).output().expect("run ip");
            assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        let _ = std::process::Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        let ns = Netns(name);
        ip(&["-n", &ns.0, "link", "set", "lo", "up"]);
        ns
    }

    /// `ip netns exec NAME`: what runs a command in it.
    fn exec(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.0].map(String::from).to_vec()
    }

    /// The local addresses of the TCP sockets listening in it, as `ss` shows them.
    fn listening(&self) -> BTreeSet<String> {
        let out = in_netns(Some(&self.0), "ss").arg("-Hltn").output().expect("run ss");
        assert!(out.status.success(), "ss: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().nth(3).map(String::from)).collect()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// CLI.md "dmover serve", "dmover sink": without `--listen` a server
/// listens on loopback only, `serve` on port 7450 and `sink` on 7460, and
/// `--metrics` given a port alone serves on loopback; a `dmover://HOST/`
/// location without a port reaches 7450, both ways. The servers run in a
/// network namespace of their own, where these ports are free and no other
/// test races for them.
#[test]
fn servers_listen_on_loopback_at_their_default_ports_which_locations_without_one_reach() {
    if !dmover_testkit::needs_root("a network namespace of its own, where the default ports are free") {
        return;
    }
    let env = Env::new();
    let export = env.mkdir("export");
    let ns = Netns::new("defaults");
    let mut spec = ServerSpec::new(&env.token, &[("data", &export)], &env.path("serve.log"));
    spec.listen = String::new();
    spec.prefix = ns.exec().into_iter().map(Into::into).collect();
    spec.extra = vec!["--metrics".into(), "9464".into()];
    let serve = Server::start(spec.clone());
    assert_eq!(serve.port, 7450, "dmover serve's port without --listen:\n{}", serve.log());
    spec.command = "sink";
    spec.exports.clear();
    spec.log = env.path("sink.log");
    spec.extra = vec!["--dir".into(), env.mkdir("sink").into()];
    let sink = Server::start(spec);
    assert_eq!(sink.port, 7460, "dmover sink's port without --listen:\n{}", sink.log());
    let want: BTreeSet<String> = ["127.0.0.1:7450", "127.0.0.1:7460", "127.0.0.1:9464"].map(String::from).into();
    assert_eq!(ns.listening(), want, "what listens in the namespace, by ss (local addresses)");

    let src = env.path("src");
    write_random(&src.join("f.dat"), 300_000, 54);
    let mut up = env.cp([src.display().to_string(), "dmover://127.0.0.1/data/".into(), "--retries".into(), "0".into()]);
    up.prefix(ns.exec()).run().assert_ok();
    assert_same_tree(&src, &export.join("src"));
    let back = env.mkdir("back");
    let mut down = env.cp(["dmover://127.0.0.1/data/src".into(), back.display().to_string(), "--retries".into(), "0".into()]);
    down.prefix(ns.exec()).run().assert_ok();
    assert_same_tree(&src, &back.join("src"));
    drop((serve, sink));
}

/// CLI.md "dmover serve": on SIGTERM the server stops accepting, lets
/// running transfers go on for up to `--grace` seconds, and exits 0. An
/// upload that needs longer keeps arriving during the grace; then the
/// server exits 0, about the grace after the signal; the client (no
/// retries) fails with 6 naming the host; nothing is half-written under a
/// final name; and the same command, against the restarted server, finishes
/// the copy without sending it all again.
#[test]
fn sigterm_lets_an_upload_go_on_for_the_grace_then_the_server_exits_0() {
    const GRACE: u64 = 3;
    const MIB: u64 = 1 << 20;
    let env = Env::new();
    let src = env.path("data");
    let mut rng = Rng::new(50);
    make_file(&src.join("big.bin"), 24 * MIB, &mut rng);
    for i in 0..6 {
        make_file(&src.join(format!("small/s{i}.dat")), 30_000, &mut rng);
    }
    let total = total_size(&src);
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = vec!["--grace".into(), GRACE.to_string().into()];
    let mut srv = Server::start(spec);
    let dst = export.join("in/data");
    // 2 MB/s: the upload needs about 13 s, far longer than the grace.
    let mut cmd = env.cp([src.display().to_string(), srv.url("e/in"), "--bwlimit".into(), "2M".into(), "--retries".into(), "0".into()]);
    cmd.cwd(env.root());
    let mut p = cmd.spawn();
    assert!(wait_until(Duration::from_secs(60), || written_bytes(&dst) >= MIB || !p.running()), "the upload did not start");
    assert!(p.running(), "the upload ended before the signal");

    srv.signal(libc::SIGTERM);
    let signalled = std::time::Instant::now();
    let at_signal = written_bytes(&dst);
    let went_on = wait_until(Duration::from_secs(GRACE), || written_bytes(&dst) >= at_signal + MIB);
    assert!(went_on, "the upload stopped at the signal ({} bytes then, {} now): the grace was not given", at_signal, written_bytes(&dst));
    let status = srv.wait_exit(Duration::from_secs(GRACE + 10)).expect("the server did not exit after its grace");
    let after = signalled.elapsed();
    assert!(status.success(), "the server exited with {status:?} after SIGTERM");
    assert!(after >= Duration::from_millis(GRACE * 1000 - 100), "the server exited {after:?} after SIGTERM, before its {GRACE} s grace");
    assert!(after <= Duration::from_secs(GRACE + 5), "the server took {after:?} to exit with a {GRACE} s grace");
    assert!(srv.log().contains("shutting down"), "server log:\n{}", srv.log());

    let r = p.wait();
    r.assert_fails(6, &[&srv.addr()]);
    let written = written_bytes(&dst);
    assert!(written < total, "the upload had completed ({written} of {total})");
    assert!(!dst.join("big.bin").exists(), "big.bin is under its final name although the upload was cut");
    assert_final_names_complete(&src, &dst);

    srv.restart();
    let j = cmd.run().assert_ok();
    let sent = u(&j["sent_bytes"]);
    assert!(sent + written / 2 < total, "the re-run sent {sent} of {total} bytes with {written} already there: not resumed\n{j:#}");
    assert_same_tree(&src, &dst);
    assert!(!export.join("in/.dmover-partial").exists(), "resume state left after the copy completed");
}

/// CLI.md "dmover serve": on SIGTERM the server stops accepting. A client
/// that connects during the grace is not served (its connection is refused,
/// or never answered), while the upload running at the signal goes on to
/// its end; then the server exits 0 at once, well within its grace.
#[test]
fn during_the_grace_no_new_client_is_served_and_the_running_upload_completes() {
    const GRACE: u64 = 30;
    let env = Env::new();
    let src = env.path("data");
    write_random(&src.join("big.bin"), 24 << 20, 52);
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = vec!["--grace".into(), GRACE.to_string().into()];
    let mut srv = Server::start(spec);
    // 3 MB/s: about 8 s, no retries.
    let mut up = env.slow_cp(src.display().to_string(), srv.url("e")).arg("--retries").arg("0").spawn();
    assert!(wait_until(Duration::from_secs(60), || written_bytes(&export) >= 1 << 20 || !up.running()), "the upload did not start");
    assert!(up.running(), "the upload ended before the signal");

    srv.signal(libc::SIGTERM);
    let signalled = std::time::Instant::now();
    let stopped = wait_until(Duration::from_secs(10), || srv.log().contains("shutting down"));
    assert!(stopped, "the server did not say it was shutting down:\n{}", srv.log());
    // A new client, during the grace: a connection refused, or one whose
    // hello is never answered (nobody accepts it), or closed unanswered.
    let answer = match std::net::TcpStream::connect(srv.addr()) {
        Err(e) => {
            assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "connecting during the grace: {e}");
            None
        }
        Ok(s) => {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut c = Raw::over(s);
            let (_, hello) = Raw::hello(dmover_proto::auth::TOKEN_KEY_ID, env.token_str().as_bytes());
            c.read_after(&hello)
        }
    };
    assert_eq!(answer, None, "a client that connected {:?} after SIGTERM was served", signalled.elapsed());
    assert!(up.running(), "the upload ended before the new client was tried: the test proves nothing");

    up.wait().assert_ok();
    let ended = std::time::Instant::now();
    assert_same_tree(&src, &export.join("data"));
    let status = srv.wait_exit(Duration::from_secs(GRACE + 5)).expect("the server did not exit within its grace");
    assert!(status.success(), "the server exited with {status:?} after SIGTERM:\n{}", srv.log());
    let (after_end, after_signal) = (ended.elapsed(), signalled.elapsed());
    assert!(
        after_end < Duration::from_secs(5) && after_signal < Duration::from_secs(GRACE),
        "the server exited {after_end:?} after the upload ended, {after_signal:?} after SIGTERM with a {GRACE} s grace: \
         it waited out the grace with nothing left to finish"
    );
}

/// Regression: the client pinged its server only every 30 s (a quarter of
/// its own idle timeout), so a server started with a short
/// `--idle-timeout` dropped healthy transfers whose control connection
/// happened to be quiet (a large file on fixed streams: no tuner messages)
/// and the client had to reconnect. Both ends now ping every second: a
/// slow upload and download through a server with `--idle-timeout 2` run
/// without a single retry.
#[test]
fn a_server_with_a_short_idle_timeout_keeps_slow_transfers_going() {
    let env = Env::new();
    let src = env.path("data");
    write_random(&src.join("slow.dat"), 8 << 20, 9);
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = vec!["--idle-timeout".into(), "2".into()];
    let srv = Server::start(spec);
    let out = env.mkdir("out");
    for (what, from, to) in
        [("upload", src.display().to_string(), srv.url("e")), ("download", srv.url("e/data"), out.display().to_string())]
    {
        let r = env.cp([from, to, "--bwlimit".into(), "2M".into(), "--streams".into(), "2".into()]).run();
        let j = r.assert_ok();
        assert!(r.elapsed > std::time::Duration::from_secs(3), "{what}: too fast to outlast the idle timeout");
        assert_eq!(u(&j["retries"]), 0, "{what}: the server dropped a transfer whose data was moving:\n{}\n{}", r.stderr, srv.log());
    }
    assert_same_tree(&src, &out.join("data"));
}
