//! `dmover bench`: memory to memory and disk to disk.

mod util;

use std::time::Duration;
use util::*;

const SIZE: u64 = 64 << 20;

fn bench(env: &Env, extra: &[&str], url: &str) -> Run {
    let tmp = env.mkdir("tmp");
    let mut c = dmover(["bench", "--size", "64M", "--streams", "2", "--json", "--token-file"]);
    c.arg(&env.token).args(extra).arg(url).env("TMPDIR", &tmp).timeout(Duration::from_secs(120));
    c.run()
}

fn check(r: &Run) -> serde_json::Value {
    let j = r.assert_ok();
    assert_eq!(u(&j["bytes"]), SIZE, "{j:#}");
    assert_eq!(u(&j["files"]), 1, "{j:#}");
    assert_eq!(u(&j["check"]["dest_bytes"]), SIZE, "{j:#}");
    assert!(j["mb_per_s"].as_f64().is_some_and(|r| r > 0.0), "{j:#}");
    assert!(u(&j["sent_bytes"]) >= SIZE, "{j:#}");
    j
}

#[test]
fn bench_memory_to_memory() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let r = bench(&env, &[], &srv.url("e"));
    check(&r);
    // Nothing reaches a disk on either side.
    assert!(list_tree(&export).is_empty(), "memory-to-memory bench wrote to the export: {:?}", list_tree(&export));
    assert!(list_tree(&env.path("tmp")).is_empty(), "bench left files in TMPDIR");
}

#[test]
fn bench_disk_to_disk() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let r = bench(&env, &["--disk"], &srv.url("e"));
    check(&r);
    // A real 64 MiB file was written at the server.
    let sizes: Vec<u64> =
        list_files(&export).values().filter_map(|n| if let Node::File { size, .. } = n { Some(*size) } else { None }).collect();
    assert!(sizes.contains(&SIZE), "no 64 MiB file at the server: {:?}", list_tree(&export));
    assert!(list_tree(&env.path("tmp")).is_empty(), "bench --disk left its scratch file behind: {:?}", list_tree(&env.path("tmp")));
}

#[test]
fn bench_human_output_and_errors() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let r = dmover(["bench", "--size", "8M", "--streams", "2", "--token-file"]).arg(&env.token).arg(srv.url("e")).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("MB/s") && r.stdout.contains("memory to memory"), "stdout: {}", r.stdout);

    let bad = env.path("bad");
    assert_eq!(dmover(["token".as_ref(), bad.as_os_str()]).run().code, 0);
    let r = dmover(["bench", "--size", "8M", "--token-file"]).arg(&bad).arg(srv.url("e")).run();
    r.assert_fails(7, &[&srv.addr()]);
    let r = dmover(["bench", "--size", "8M", "--token-file"]).arg(&env.token).arg(env.path("not-a-url")).run();
    assert_eq!(r.code, 2, "{}", r.stderr);
}
