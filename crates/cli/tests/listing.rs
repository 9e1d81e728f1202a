//! `dmover ls`: listings name what a copy would send, stay inside the
//! export, and need the token.

mod util;

use std::fs;
use std::os::unix::fs::symlink;
use util::*;

fn ls(env: &Env, url: &str) -> Run {
    let mut c = dmover(["ls", "--json", "--token-file"]);
    c.arg(&env.token).arg(url);
    c.run()
}

#[test]
fn lists_files_directories_and_globs() {
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("run/a.h5"), 1000, 1);
    write_random(&export.join("run/sub/b.h5"), 2000, 2);
    write_random(&export.join("run/sub/c.txt"), 3000, 3);
    fs::create_dir_all(export.join("run/empty")).unwrap();
    let srv = env.serve(&[("e", &export)]);
    let names = |url: &str| -> Vec<(String, u64)> {
        let r = ls(&env, url);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
        let mut out: Vec<(String, u64)> =
            v.as_array().unwrap().iter().map(|e| (e["path"].as_str().unwrap().to_string(), e["size"].as_u64().unwrap())).collect();
        out.sort();
        out
    };
    let s = |p: &str, n: u64| (p.to_string(), n);
    assert_eq!(names(&srv.url("e/run")), [s("run/a.h5", 1000), s("run/empty", 0), s("run/sub/b.h5", 2000), s("run/sub/c.txt", 3000)]);
    assert_eq!(names(&srv.url("e/run/**/*.h5")), [s("a.h5", 1000), s("sub/b.h5", 2000)]);
    assert_eq!(names(&srv.url("e/run/sub/c.txt")), [s("c.txt", 3000)]);
}

#[test]
fn listing_refuses_missing_paths_escapes_and_wrong_tokens() {
    let env = Env::new();
    let export = env.mkdir("export");
    let outside = env.mkdir("outside");
    write_random(&outside.join("secret"), 100, 4);
    symlink(&outside, export.join("link")).unwrap();
    let srv = env.serve(&[("e", &export)]);
    let r = ls(&env, &srv.url("e/nothing-here"));
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(r.stderr.contains("nothing-here"), "{}", r.stderr);
    let r = ls(&env, &srv.url("e/link/secret"));
    assert_eq!(r.code, 8, "{}", r.stderr);
    assert!(!r.stdout.contains("secret"), "{}", r.stdout);
    let r = ls(&env, &srv.url("e/link/"));
    assert_eq!(r.code, 8, "{}", r.stderr);
    let mut c = dmover(["ls", "--json", &srv.url("e/")]);
    c.env("DMOVER_TOKEN", "this-is-not-the-right-token");
    assert_eq!(c.run().code, 7);
}
