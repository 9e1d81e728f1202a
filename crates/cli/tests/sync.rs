//! The quick check a copy makes by default (skip files whose size and
//! mtime match at the destination; `--sync` names it), `-c` (compare
//! content instead) and `--ignore-times`/`-I` (send every file), in each
//! direction.

mod util;

use dmover_engine::progress::human;
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use util::*;

/// A direction: how to copy `src` (a directory) so that it lands at `dst()`.
/// Over the network the client talks to the server through a [`Relay`], so
/// that what crosses the wire is counted independently of dmover's report.
struct Setup {
    env: Env,
    src: PathBuf,
    dst: PathBuf,
    from: String,
    to: String,
    relay: Option<Relay>,
    /// Which way the payload goes through the relay (true: to the server).
    upload: bool,
    _srv: Option<Server>,
}

/// An empty directory in each tree, with a mode no default would give it
/// (CLI.md: the permissions of empty directories are preserved).
const EMPTY_DIR: (&str, u32) = ("d1/empty", 0o705);

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
        fs::create_dir_all(src.join(EMPTY_DIR.0)).unwrap();
        chmod(&src.join(EMPTY_DIR.0), EMPTY_DIR.1);
        let relay = srv.as_ref().map(|s| Relay::start(&s.addr()));
        let (from, to) = match (direction, &relay) {
            ("upload", Some(r)) => (src.display().to_string(), r.url("e")),
            ("download", Some(r)) => (r.url("e/data"), local.display().to_string()),
            _ => (src.display().to_string(), local.display().to_string()),
        };
        Setup { env, src, dst, from, to, relay, upload: direction == "upload", _srv: srv }
    }

    /// Runs the copy; with a relay, also returns the payload-direction bytes
    /// and the total bytes (both ways) that crossed it, and the connections.
    fn cp(&self, extra: &[&str]) -> (Run, Option<Wire>) {
        if let Some(r) = &self.relay {
            r.reset();
        }
        let mut c = self.env.cp([self.from.as_str(), self.to.as_str()]);
        c.args(extra).cwd(self.env.root());
        let run = c.run();
        let wire = self.relay.as_ref().map(|r| {
            let (up, down) = (r.to_server(), r.to_client());
            Wire { payload_way: if self.upload { up } else { down }, total: up + down, connections: r.connections() }
        });
        (run, wire)
    }
}

/// What a relay saw during one copy.
#[derive(Debug)]
struct Wire {
    payload_way: u64,
    total: u64,
    connections: u64,
}

impl Wire {
    /// The most that may cross the wire besides file content: a generous
    /// 512 bytes per file (its announcement, plan and confirmation carry a
    /// path of under 40 bytes and a few numbers) and 8 KiB per connection
    /// (authentication, session set-up and the final report).
    fn overhead(&self, files: u64) -> u64 {
        files * 512 + self.connections * 8192
    }
}

/// Inode number and change time of every regular file below `root`: a file
/// that was skipped keeps both; one written again (a new temporary file
/// renamed into place) has a new inode and a new change time.
fn identities(root: &Path) -> BTreeMap<String, (u64, i64, i64)> {
    list_files(root)
        .into_keys()
        .map(|k| {
            let m = fs::symlink_metadata(root.join(&k)).unwrap();
            let id = (m.ino(), m.ctime(), m.ctime_nsec());
            (k, id)
        })
        .collect()
}

/// Asserts that every file not named in `rewritten` kept its inode and
/// change time, and every one named there has a new inode (or is new).
#[track_caller]
fn assert_rewritten_only(before: &BTreeMap<String, (u64, i64, i64)>, after: &BTreeMap<String, (u64, i64, i64)>, rewritten: &[&str]) {
    for (k, now) in after {
        match before.get(k) {
            Some(was) if rewritten.contains(&k.as_str()) => {
                assert_ne!(was.0, now.0, "{k} should have been written again but kept its inode")
            }
            Some(was) => assert_eq!(was, now, "{k} was skipped yet its inode or change time moved (inode, ctime s, ns): written again"),
            None => assert!(rewritten.contains(&k.as_str()), "{k} appeared at the destination"),
        }
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

/// A plain re-run sends nothing for unchanged files and only the changed
/// ones otherwise (a new mtime at the same size, a new size, a new file);
/// `--sync` does the same; `--ignore-times` and `-I` send everything again.
/// Shown by the report, by the bytes a relay counted on the wire, and by
/// the destination files' inodes and change times.
fn rerun_skips_unchanged(direction: &str) {
    let t = Setup::new(direction, 21);
    let (r, wire) = t.cp(&[]);
    let j = r.assert_ok();
    let (files, bytes) = (u(&j["files"]), u(&j["bytes"]));
    assert_eq!(u(&j["skipped_files"]), 0, "a first copy into an empty destination skipped files: {j:#}");
    assert_same_tree(&t.src, &t.dst);
    if let Some(w) = &wire {
        eprintln!("first copy: {w:?} for {bytes} bytes");
        assert!(
            w.payload_way >= bytes,
            "{} bytes crossed the relay for {bytes} bytes of files: the copy did not go through it",
            w.payload_way
        );
    }
    let ids = identities(&t.dst);

    // Nothing changed: everything is skipped, nothing is sent, with or
    // without --sync (which names the default).
    for flags in [&[][..], &["--sync"]] {
        let (r, wire) = t.cp(flags);
        let j = r.assert_ok();
        assert_eq!(u(&j["files"]), files, "{flags:?}: {j:#}");
        assert_eq!(u(&j["skipped_files"]), files, "a re-run ({flags:?}) should skip every unchanged file: {j:#}");
        assert_eq!(u(&j["skipped_bytes"]), bytes, "{j:#}");
        assert_eq!(j["skipped_because"], "same size and time", "{j:#}");
        assert_eq!(u(&j["sent_bytes"]), 0, "{j:#}");
        assert_same_tree(&t.src, &t.dst);
        if let Some(w) = &wire {
            eprintln!("re-run {flags:?}, nothing changed: {w:?} for {bytes} bytes");
            assert!(
                w.total <= w.overhead(files),
                "{} bytes crossed the wire (both ways) to skip {files} unchanged files: more than the {} they need",
                w.total,
                w.overhead(files)
            );
        }
        assert_rewritten_only(&ids, &identities(&t.dst), &[]);
    }
    // The summary says how many were skipped and why.
    let mut c = dmover(["cp", "--token-file"]);
    let r = c.arg(&t.env.token).args([t.from.as_str(), t.to.as_str()]).cwd(t.env.root()).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let says = format!("{files} files ({}) already there (same size and time)", human(bytes));
    assert!(r.stderr.contains(&says), "the summary should say '{says}':\n{}", r.stderr);

    // One file gets a new mtime (same size), one a new size, one is new.
    let touched = t.src.join("a/block.dat");
    let (s, _) = mtime_of(&touched);
    set_mtime(&touched, s + 3600, 5);
    let grown = t.src.join("one.bin");
    write_random(&grown, 10, 5);
    write_random(&t.src.join("d3/new.dat"), 2000, 6);
    let changed = (1 << 20) + 10 + 2000;
    let (r, wire) = t.cp(&[]);
    let j = r.assert_ok();
    assert_eq!(u(&j["files"]), files + 1, "{j:#}");
    assert_eq!(u(&j["skipped_files"]), files - 2, "{j:#}");
    assert_same_tree(&t.src, &t.dst);
    assert!(u(&j["sent_bytes"]) >= changed, "the changed files were not all sent: {j:#}");
    if let Some(w) = &wire {
        eprintln!("re-run, three files changed ({changed} bytes): {w:?}");
        assert!(w.payload_way >= changed, "only {} bytes crossed the wire for {changed} bytes of changed files", w.payload_way);
        assert!(
            w.total <= changed + w.overhead(files + 1),
            "{} bytes crossed the wire for {changed} bytes of changed files: unchanged files were sent",
            w.total
        );
    }
    assert_rewritten_only(&ids, &identities(&t.dst), &["a/block.dat", "one.bin", "d3/new.dat"]);

    // With --ignore-times (-I), everything is sent again.
    for flag in ["--ignore-times", "-I"] {
        let ids = identities(&t.dst);
        let (r, wire) = t.cp(&[flag]);
        let j = r.assert_ok();
        assert_eq!(u(&j["skipped_files"]), 0, "{flag}: {j:#}");
        let all = u(&j["bytes"]);
        assert!(u(&j["sent_bytes"]) >= all, "{flag} sent {} bytes of {all}: {j:#}", u(&j["sent_bytes"]));
        assert_same_tree(&t.src, &t.dst);
        if let Some(w) = &wire {
            assert!(w.payload_way >= all, "{} bytes crossed the wire for a full copy of {all} bytes", w.payload_way);
        }
        let every: Vec<&str> = ids.keys().map(String::as_str).collect();
        assert_rewritten_only(&ids, &identities(&t.dst), &every);
    }
}

#[test]
fn a_rerun_skips_unchanged_files_upload() {
    rerun_skips_unchanged("upload");
}

#[test]
fn a_rerun_skips_unchanged_files_download() {
    rerun_skips_unchanged("download");
}

#[test]
fn a_rerun_skips_unchanged_files_local() {
    rerun_skips_unchanged("local");
}

/// `-c`/`--checksum` (no `--sync` needed) finds a file whose content
/// changed behind an unchanged size and mtime, and sends only that file:
/// shown by the report, the relay's count and the destination inodes.
/// `--sync --checksum` is the same.
fn checksum_catches_same_size_and_mtime(direction: &str) {
    let t = Setup::new(direction, 22);
    let j = t.cp(&[]).0.assert_ok();
    let files = u(&j["files"]);
    let changed = "a/b/c/multi.dat";
    let size = fs::metadata(t.src.join(changed)).unwrap().len();
    change_keeping_size_and_mtime(&t.src.join(changed), 1234);
    let ids = identities(&t.dst);

    // Size and mtime match: the quick check cannot tell and skips it.
    let (r, wire) = t.cp(&[]);
    let j = r.assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "{j:#}");
    assert!(!same_content(&t.src.join(changed), &t.dst.join(changed)));
    if let Some(w) = &wire {
        assert!(w.total <= w.overhead(files), "{} bytes crossed the wire to skip {files} files: {w:?}", w.total);
    }
    assert_rewritten_only(&ids, &identities(&t.dst), &[]);

    // --checksum compares content and sends just that file.
    let (r, wire) = t.cp(&["--checksum"]);
    let j = r.assert_ok();
    assert_eq!(u(&j["skipped_files"]), files - 1, "--checksum should re-send exactly the changed file: {j:#}");
    assert_eq!(j["skipped_because"], "same content", "{j:#}");
    let sent = u(&j["sent_bytes"]);
    assert!(sent >= size && sent < u(&j["bytes"]), "sent {sent} bytes for one changed file of {size}: {j:#}");
    assert_same_tree(&t.src, &t.dst);
    if let Some(w) = &wire {
        eprintln!("--checksum, one file of {size} bytes changed: {w:?}");
        assert!(w.payload_way >= size, "only {} bytes crossed the wire for a changed file of {size}", w.payload_way);
        assert!(w.total <= size + w.overhead(files), "{} bytes crossed the wire for one changed file of {size}: others were sent", w.total);
    }
    assert_rewritten_only(&ids, &identities(&t.dst), &[changed]);

    // And again, as --sync --checksum: nothing left to send.
    let ids = identities(&t.dst);
    let (r, wire) = t.cp(&["--sync", "--checksum"]);
    let j = r.assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "{j:#}");
    assert_eq!(u(&j["sent_bytes"]), 0, "{j:#}");
    if let Some(w) = &wire {
        assert!(w.total <= w.overhead(files), "{} bytes crossed the wire to skip {files} files: {w:?}", w.total);
    }
    assert_rewritten_only(&ids, &identities(&t.dst), &[]);
}

#[test]
fn checksum_resends_content_change_upload() {
    checksum_catches_same_size_and_mtime("upload");
}

#[test]
fn checksum_resends_content_change_download() {
    checksum_catches_same_size_and_mtime("download");
}

#[test]
fn checksum_resends_content_change_local() {
    checksum_catches_same_size_and_mtime("local");
}

/// `--ignore-times` sends every file, which `--sync` and `--checksum`
/// would skip: asking for both is a usage error (2) that names them, and
/// nothing is copied.
#[test]
fn ignore_times_with_sync_or_checksum_is_a_usage_error() {
    let t = Setup::new("local", 23);
    for (flags, named) in [(["--ignore-times", "--checksum"], "--checksum"), (["-I", "--sync"], "--sync"), (["-I", "-c"], "--checksum")] {
        let (r, _) = t.cp(&flags);
        assert_eq!(r.code, 2, "{flags:?}: {}", r.stderr);
        assert!(r.stderr.contains(named) && r.stderr.contains("--ignore-times"), "{flags:?} should name both: {}", r.stderr);
        assert!(!t.dst.exists(), "{flags:?} copied anyway");
    }
}

/// CLI.md: `-c` is `--checksum`: a file whose size and mtime match but
/// whose content differs is sent only with `-c`.
#[test]
fn short_c_is_checksum() {
    let t = Setup::new("upload", 24);
    let files = u(&t.cp(&[]).0.assert_ok()["files"]);
    let changed = "a/page.dat";
    change_keeping_size_and_mtime(&t.src.join(changed), 4321);
    let j = t.cp(&[]).0.assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "{j:#}");
    assert!(!same_content(&t.src.join(changed), &t.dst.join(changed)), "a plain re-run sent the file");
    let j = t.cp(&["-c"]).0.assert_ok();
    assert_eq!(u(&j["skipped_files"]), files - 1, "-c should re-send exactly the changed file: {j:#}");
    assert_same_tree(&t.src, &t.dst);
}
