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

/// CLI.md "dmover ls": without `--json`, one line per name: permissions
/// (`drwxr-xr-x` style), size, mtime in seconds since 1970, and the path —
/// the same names and values `--json` gives.
#[test]
fn ls_without_json_prints_permissions_size_mtime_and_path_per_line() {
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("run/a.h5"), 1000, 1);
    chmod(&export.join("run/a.h5"), 0o640);
    set_mtime(&export.join("run/a.h5"), 1_234_567_890, 5);
    write_random(&export.join("run/sub/b x.h5"), 2000, 2);
    chmod(&export.join("run/sub/b x.h5"), 0o755);
    set_mtime(&export.join("run/sub/b x.h5"), 1_500_000_000, 0);
    fs::create_dir_all(export.join("run/empty")).unwrap();
    chmod(&export.join("run/empty"), 0o750);
    set_mtime(&export.join("run/empty"), 1_600_000_000, 0);
    let srv = env.serve(&[("e", &export)]);
    let r = dmover(["ls", "--token-file"]).arg(&env.token).arg(srv.url("e/run")).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let mut lines: Vec<Vec<String>> = r
        .stdout
        .lines()
        .map(|l| {
            // Size and mtime are right-aligned in their columns; the path is the rest.
            let mut rest = l;
            let mut fields = Vec::new();
            for _ in 0..3 {
                let t = rest.trim_start();
                let end = t.find(' ').unwrap_or_else(|| panic!("a line with fewer than four fields: {l:?}"));
                fields.push(t[..end].to_string());
                rest = &t[end + 1..];
            }
            fields.push(rest.to_string());
            fields
        })
        .collect();
    lines.sort_by(|a, b| a[3].cmp(&b[3]));
    let want = [
        ["-rw-r-----", "1000", "1234567890", "run/a.h5"],
        ["drwxr-x---", "0", "1600000000", "run/empty"],
        ["-rwxr-xr-x", "2000", "1500000000", "run/sub/b x.h5"],
    ];
    assert_eq!(lines, want, "ls output:\n{}", r.stdout);
    // The same listing as JSON.
    let j: serde_json::Value = serde_json::from_str(&ls(&env, &srv.url("e/run")).stdout).unwrap();
    assert_eq!(j.as_array().map(Vec::len), Some(3), "{j:#}");
}

/// CLI.md "Files while they move": symlinks inside a source tree are
/// skipped (each with a warning on stderr naming it), and a symlink named
/// on the command line is followed — to a file or to a directory.
#[test]
fn symlinks_inside_a_source_tree_are_skipped_and_one_named_is_followed() {
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("a.dat"), 5000, 31);
    write_random(&src.join("sub/b.dat"), 7000, 32);
    let outside = env.path("outside");
    write_random(&outside.join("o.dat"), 3000, 33);
    symlink("a.dat", src.join("to-file")).unwrap();
    symlink(&outside, src.join("sub/to-dir")).unwrap();
    symlink("nowhere", src.join("dangling")).unwrap();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);

    let r = env.cp([src.display().to_string(), srv.url("e/tree")]).run();
    let j = r.assert_ok();
    assert_eq!((u(&j["files"]), u(&j["bytes"])), (2, 12_000), "only the two regular files count: {j:#}");
    let got: Vec<String> = list_tree(&export.join("tree")).into_keys().collect();
    assert_eq!(got, ["src", "src/a.dat", "src/sub", "src/sub/b.dat"], "what arrived");
    for link in ["src/to-file", "src/sub/to-dir", "src/dangling"] {
        let warned = r.stderr.lines().any(|l| l.contains(link) && l.contains("symbolic link skipped"));
        assert!(warned, "no warning names the skipped link {link}:\n{}", r.stderr);
    }

    // Named on the command line: followed, under the link's own name.
    let r = env.cp([src.join("to-file").display().to_string(), srv.url("e/named/")]).run();
    r.assert_ok();
    assert!(same_content(&src.join("a.dat"), &export.join("named/to-file")), "the named link to a file was not followed");
    let r = env.cp([src.join("sub/to-dir").display().to_string(), srv.url("e/named/")]).run();
    r.assert_ok();
    assert_same_tree(&outside, &export.join("named/to-dir"));
}

/// A location naming several hosts lists what each holds (a copy to it
/// spread the files over them), in JSON as in lines.
#[test]
fn a_location_of_several_hosts_lists_every_host() {
    let env = Env::new();
    let (a, b) = (env.mkdir("a"), env.mkdir("b"));
    write_random(&a.join("run/one.dat"), 10, 1);
    write_random(&b.join("run/two.dat"), 20, 2);
    let (sa, sb) = (env.serve(&[("e", &a)]), env.serve(&[("e", &b)]));
    let url = format!("dmover://{},{}/e/run/", sa.addr(), sb.addr());
    let r = ls(&env, &url);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let mut names: Vec<&str> = v.as_array().unwrap().iter().map(|e| e["path"].as_str().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["one.dat", "two.dat"], "{}", r.stdout);
    let mut c = dmover(["ls", "--token-file"]);
    let lines = c.arg(&env.token).arg(&url).run();
    assert_eq!(lines.stdout.lines().count(), 2, "{}", lines.stdout);
}
