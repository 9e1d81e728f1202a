//! `--sync` (skip files whose size and mtime match) and `--sync --checksum`
//! (compare content instead), in each direction.

mod util;

use std::fs;
use std::path::{Path, PathBuf};
use util::*;

/// A direction: how to copy `src` (a directory) so that it lands at `dst()`.
struct Setup {
    env: Env,
    src: PathBuf,
    dst: PathBuf,
    from: String,
    to: String,
    _srv: Option<Server>,
}

impl Setup {
    fn new(direction: &str, seed: u64) -> Setup {
        let env = Env::new();
        let export = env.mkdir("export");
        let local = env.mkdir("local");
        let (src, dst, srv) = match direction {
            "upload" => (env.path("data"), export.join("data"), Some(env.serve(&[("e", &export)]))),
            "download" => (export.join("data"), local.join("data"), Some(env.serve(&[("e", &export)]))),
            _ => (env.path("data"), local.join("data"), None),
        };
        make_tree(&src, seed, 20);
        let (from, to) = match (direction, &srv) {
            ("upload", Some(s)) => (src.display().to_string(), s.url("e")),
            ("download", Some(s)) => (s.url("e/data"), local.display().to_string()),
            _ => (src.display().to_string(), local.display().to_string()),
        };
        Setup { env, src, dst, from, to, _srv: srv }
    }

    fn cp(&self, extra: &[&str]) -> Run {
        let mut c = self.env.cp([self.from.as_str(), self.to.as_str()]);
        c.args(extra).cwd(self.env.root());
        c.run()
    }
}

/// Rewrites `p` with different content of the same size and puts its
/// mtime back (nanoseconds included).
fn change_keeping_size_and_mtime(p: &Path, seed: u64) {
    let (s, ns) = mtime_of(p);
    let size = fs::metadata(p).unwrap().len();
    let before = fs::read(p).unwrap();
    write_random(p, size, seed);
    set_mtime(p, s, ns);
    assert_ne!(fs::read(p).unwrap(), before);
    assert_eq!(mtime_of(p), (s, ns));
}

fn sync_skips_unchanged(direction: &str) {
    let t = Setup::new(direction, 21);
    let j = t.cp(&[]).assert_ok();
    let (files, bytes) = (u(&j["files"]), u(&j["bytes"]));
    assert_same_tree(&t.src, &t.dst);

    // Nothing changed: everything is skipped, nothing is sent.
    let j = t.cp(&["--sync"]).assert_ok();
    assert_eq!(u(&j["files"]), files, "{j:#}");
    assert_eq!(u(&j["skipped_files"]), files, "--sync should skip every unchanged file: {j:#}");
    assert_eq!(u(&j["skipped_bytes"]), bytes, "{j:#}");
    assert_eq!(u(&j["sent_bytes"]), 0, "{j:#}");
    assert_same_tree(&t.src, &t.dst);

    // One file gets a new mtime, one a new size, one is new.
    let touched = t.src.join("a/block.dat");
    let (s, _) = mtime_of(&touched);
    set_mtime(&touched, s + 3600, 5);
    let grown = t.src.join("one.bin");
    write_random(&grown, 10, 5);
    write_random(&t.src.join("d3/new.dat"), 2000, 6);
    let j = t.cp(&["--sync"]).assert_ok();
    assert_eq!(u(&j["files"]), files + 1, "{j:#}");
    assert_eq!(u(&j["skipped_files"]), files - 2, "{j:#}");
    assert_same_tree(&t.src, &t.dst);
    assert!(u(&j["sent_bytes"]) >= (1 << 20) + 10 + 2000, "the changed files were not all sent: {j:#}");

    // Without --sync, everything is sent again.
    let j = t.cp(&[]).assert_ok();
    assert_eq!(u(&j["skipped_files"]), 0, "{j:#}");
    assert_same_tree(&t.src, &t.dst);
}

#[test]
fn sync_skips_unchanged_files_upload() {
    sync_skips_unchanged("upload");
}

#[test]
fn sync_skips_unchanged_files_download() {
    sync_skips_unchanged("download");
}

#[test]
fn sync_skips_unchanged_files_local() {
    sync_skips_unchanged("local");
}

fn checksum_catches_same_size_and_mtime(direction: &str) {
    let t = Setup::new(direction, 22);
    let j = t.cp(&[]).assert_ok();
    let files = u(&j["files"]);
    let changed = "a/b/c/multi.dat";
    let size = fs::metadata(t.src.join(changed)).unwrap().len();
    change_keeping_size_and_mtime(&t.src.join(changed), 1234);

    // Size and mtime match: plain --sync cannot tell and skips it.
    let j = t.cp(&["--sync"]).assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "{j:#}");
    assert!(!same_content(&t.src.join(changed), &t.dst.join(changed)));

    // --checksum compares content and sends just that file.
    let j = t.cp(&["--sync", "--checksum"]).assert_ok();
    assert_eq!(u(&j["skipped_files"]), files - 1, "--checksum should re-send exactly the changed file: {j:#}");
    let sent = u(&j["sent_bytes"]);
    assert!(sent >= size && sent < u(&j["bytes"]), "sent {sent} bytes for one changed file of {size}: {j:#}");
    assert_same_tree(&t.src, &t.dst);

    // And again: nothing left to send.
    let j = t.cp(&["--sync", "--checksum"]).assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "{j:#}");
    assert_eq!(u(&j["sent_bytes"]), 0, "{j:#}");
}

#[test]
fn sync_checksum_resends_content_change_upload() {
    checksum_catches_same_size_and_mtime("upload");
}

#[test]
fn sync_checksum_resends_content_change_download() {
    checksum_catches_same_size_and_mtime("download");
}

#[test]
fn sync_checksum_resends_content_change_local() {
    checksum_catches_same_size_and_mtime("local");
}

#[test]
fn checksum_without_sync_is_a_usage_error() {
    let t = Setup::new("local", 23);
    let r = t.cp(&["--checksum"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(!t.dst.exists(), "copied anyway");
}

/// CLI.md: `-c` is `--checksum`. With `--sync`, a file whose size and mtime
/// match but whose content differs is sent only with `-c`; `-c` without
/// `--sync` is a usage error (2), like `--checksum`.
#[test]
fn short_c_is_checksum() {
    let t = Setup::new("upload", 24);
    let files = u(&t.cp(&[]).assert_ok()["files"]);
    let changed = "a/page.dat";
    change_keeping_size_and_mtime(&t.src.join(changed), 4321);
    let j = t.cp(&["--sync"]).assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "{j:#}");
    assert!(!same_content(&t.src.join(changed), &t.dst.join(changed)), "plain --sync sent the file");
    let j = t.cp(&["--sync", "-c"]).assert_ok();
    assert_eq!(u(&j["skipped_files"]), files - 1, "--sync -c should re-send exactly the changed file: {j:#}");
    assert_same_tree(&t.src, &t.dst);
    let r = t.cp(&["-c"]);
    assert_eq!(r.code, 2, "-c without --sync: {}", r.stderr);
    assert!(r.stderr.contains("--sync"), "the usage error should name --sync: {}", r.stderr);
}
