//! Things that go wrong: each must end with its documented exit code and
//! one line on stderr that names the path or host concerned, and must not
//! leave a half-written file under a final name.

mod util;

use std::fs;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::symlink;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use util::*;

const MIB: u64 = 1 << 20;

/// Run as `nobody`: root ignores file permissions.
const NOBODY: [&str; 4] = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"];

#[test]
fn missing_local_source_exits_3() {
    let env = Env::new();
    let missing = env.path("no/such/file.dat");
    let out = env.mkdir("out");
    let r = dmover(["cp", "--json", "-q"]).arg(&missing).arg(&out).run();
    r.assert_fails(3, &["no/such/file.dat"]);
    assert!(list_tree(&out).is_empty(), "something was written: {:?}", list_tree(&out));
    // The report says what failed.
    let j = r.json();
    assert_eq!(j["ok"], false);
    assert_eq!(j["errors"][0]["kind"], "not-found", "{j:#}");

    // Uploading it, too.
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let r = env.cp([missing.display().to_string(), srv.url("e")]).run();
    r.assert_fails(3, &["no/such/file.dat"]);

    // A glob that matches nothing.
    let r = dmover(["cp", "-q"]).arg(format!("{}/*.nothing", env.root().display())).arg(&out).run();
    r.assert_fails(3, &["*.nothing"]);
}

#[test]
fn missing_remote_source_exits_3() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let down = env.mkdir("down");
    let r = env.cp([srv.url("e/nope/missing.dat"), down.display().to_string()]).run();
    r.assert_fails(3, &["nope/missing.dat"]);
    assert!(list_files(&down).is_empty());
}

/// Regression: a destination directory that is a file (or below one) gave
/// `exit 1: ...: Not a directory (os error 20) (please report this)`. It is
/// a usage error with its own advice, locally and at a server, and the file
/// is left as it was.
#[test]
fn a_destination_that_is_a_file_is_a_usage_error_exits_2() {
    let env = Env::new();
    let src = env.mkdir("src");
    fs::write(src.join("a"), "a").unwrap();
    let export = env.mkdir("export");
    fs::write(export.join("afile"), "keep").unwrap();
    let srv = env.serve(&[("e", &export)]);
    let local = export.join("afile").display().to_string();
    let contents = format!("{}/", src.display());
    for (from, to, says) in [
        (contents.clone(), format!("{local}/"), "is a file, not a directory"),
        (src.display().to_string(), local.clone(), "is a file, not a directory"),
        (src.display().to_string(), format!("{local}/sub/"), "a file is in the way"),
        (contents.clone(), srv.url("e/afile/"), "is a file, not a directory"),
        (contents, srv.url("e/afile/sub/"), "a file is in the way"),
    ] {
        let r = env.cp([&from, &to]).run();
        r.assert_fails(2, &["afile", says]);
        assert!(!r.stderr.contains("please report"), "{from} -> {to}: {}", r.stderr);
        assert_eq!(fs::read_to_string(export.join("afile")).unwrap(), "keep", "{from} -> {to}");
    }
}

#[test]
fn unreadable_source_file_exits_4() {
    if !dmover_testkit::needs_root("setpriv to run dmover as nobody") {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("ok.dat"), 5000, 1);
    write_random(&src.join("secret.dat"), 5000, 2);
    chmod(&src.join("secret.dat"), 0o600); // root's, unreadable for nobody
    let out = env.mkdir("out");
    chmod(&out, 0o777);
    let r = dmover(["cp", "--json", "-q"]).arg(&src).arg(&out).prefix(NOBODY).run();
    r.assert_fails(4, &["secret.dat"]);
    assert!(!out.join("src/secret.dat").exists(), "secret.dat exists at the destination");
    assert_eq!(r.json()["errors"][0]["kind"], "permission-denied");
}

/// The server cannot read a file it exports (it runs as nobody): the client
/// downloading it gets 4, naming the file.
#[test]
fn file_the_server_cannot_read_exits_4() {
    if !dmover_testkit::needs_root("setpriv to run the server as nobody") {
        return;
    }
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("secret.dat"), 5000, 3);
    chmod(&export.join("secret.dat"), 0o600);
    let token = env.path("nobody-token");
    fs::copy(&env.token, &token).unwrap();
    // SAFETY: chown(2) on a path we made.
    let c = std::ffi::CString::new(token.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
    let mut spec = ServerSpec::new(&token, &[("e", &export)], &env.path("server.log"));
    spec.prefix = NOBODY.iter().map(Into::into).collect();
    let srv = Server::start(spec);
    let down = env.mkdir("down");
    let r = env.cp([srv.url("e/secret.dat"), down.display().to_string()]).run();
    r.assert_fails(4, &["secret.dat"]);
    assert!(!down.join("secret.dat").exists());
}

/// Root is refused by a read-only file system: uploading into an export
/// that is a read-only mount exits 4 and names the destination. (A correct
/// server answers at once; the timeout only keeps a hang from stalling the suite.)
#[test]
fn read_only_destination_upload_exits_4() {
    if !dmover_testkit::needs_root("a read-only bind mount") {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 1, 3);
    let export = env.mkdir("export");
    let _ro = Mount::read_only(&export);
    let srv = env.serve(&[("e", &export)]);
    let r = env.cp([src.display().to_string(), srv.url("e/in"), "--retries".into(), "0".into()]).timeout(Duration::from_secs(20)).run();
    r.assert_fails(4, &["e/in"]);
}

#[test]
fn read_only_destination_local_exits_4() {
    if !dmover_testkit::needs_root("a read-only bind mount") {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 1, 3);
    let out = env.mkdir("out");
    let _ro = Mount::read_only(&out);
    let r = dmover(["cp", "--json", "-q"]).arg(&src).arg(&out).run();
    r.assert_fails(4, &[out.to_str().unwrap()]);
}

/// Runs `copy` several times (the outcome must not depend on which thread
/// notices first): each exits 5 naming big.dat, and leaves neither big.dat
/// under its final name nor a temporary file eating the space in `dir`.
fn assert_disk_full(copy: impl Fn() -> Run, dir: &std::path::Path) {
    for _ in 0..4 {
        copy().assert_fails(5, &["big.dat"]);
        assert!(!dir.join("big.dat").exists(), "big.dat exists under its final name");
        assert!(!dir.join(".big.dat.dmover-part").exists(), "the temporary file was left filling the disk");
    }
}

/// The destination file system fills up: exit 5, and no file under its
/// final name (nor a temporary file eating the space) is left behind.
#[test]
fn destination_full_upload_exits_5() {
    if !dmover_testkit::needs_root("a small tmpfs mount") {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("big.dat"), 8 * MIB, 5);
    let export = env.path("full");
    let _m = Mount::tmpfs(&export, "4m");
    let srv = env.serve(&[("e", &export)]);
    assert_disk_full(
        || env.cp([src.join("big.dat").display().to_string(), srv.url("e/big.dat"), "--retries".into(), "1".into()]).run(),
        &export,
    );
}

#[test]
fn destination_full_download_exits_5() {
    if !dmover_testkit::needs_root("a small tmpfs mount") {
        return;
    }
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("src/big.dat"), 8 * MIB, 6);
    let srv = env.serve(&[("e", &export)]);
    let local = env.path("full");
    let _m = Mount::tmpfs(&local, "4m");
    assert_disk_full(|| env.cp([srv.url("e/src"), local.display().to_string(), "--retries".into(), "0".into()]).run(), &local.join("src"));
}

/// An error about a destination file names where that file is: the
/// destination directory given on the command line is part of the path.
/// (A read-only subdirectory makes a clean per-file error.)
#[test]
fn destination_errors_name_the_full_destination_path_upload() {
    if !dmover_testkit::needs_root("a read-only bind mount") {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("a.dat"), 5000, 5);
    let export = env.mkdir("export");
    let ro = export.join("deep/er/src");
    fs::create_dir_all(&ro).unwrap();
    let _m = Mount::read_only(&ro);
    let srv = env.serve(&[("e", &export)]);
    let r =
        env.cp([src.display().to_string(), srv.url("e/deep/er"), "--retries".into(), "0".into()]).timeout(Duration::from_secs(20)).run();
    r.assert_fails(4, &["e/deep/er/src/a.dat"]);
}

#[test]
fn destination_errors_name_the_full_destination_path_download() {
    if !dmover_testkit::needs_root("a read-only bind mount") {
        return;
    }
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("src/a.dat"), 5000, 6);
    let srv = env.serve(&[("e", &export)]);
    let local = env.mkdir("local");
    let ro = local.join("deep/src");
    fs::create_dir_all(&ro).unwrap();
    let _m = Mount::read_only(&ro);
    let r = env
        .cp([srv.url("e/src"), local.join("deep").display().to_string(), "--retries".into(), "0".into()])
        .timeout(Duration::from_secs(20))
        .run();
    r.assert_fails(4, &[&ro.join("a.dat").display().to_string()]);
}

#[test]
fn destination_full_local_exits_5() {
    if !dmover_testkit::needs_root("a small tmpfs mount") {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("big.dat"), 8 * MIB, 6);
    write_random(&src.join("small.dat"), 1000, 7);
    let out = env.path("full");
    let _m = Mount::tmpfs(&out, "4m");
    assert_disk_full(|| dmover(["cp", "--json", "-q"]).arg(&src).arg(&out).run(), &out.join("src"));
}

/// A tree of small files (every fourth empty, so that the receiver's
/// batches sync their file system at once) in five directories, and
/// big.dat, larger than the whole of the small ext4 it is copied to.
fn tree_with_one_file_too_big(src: &std::path::Path) {
    for i in 0..200u64 {
        let size = if i % 4 == 0 { 0 } else { 1 + i * 37 % 8000 };
        write_random(&src.join(format!("d{}/f{i:03}.dat", i % 5)), size, i);
    }
    write_random(&src.join("big.dat"), 12 * MIB, 99);
}

/// The destination filled up with big.dat of the tree: exit 5 naming it,
/// and the report lists what is not committed (big.dat among it, each for
/// want of space) and counts the rest committed; every file not listed is
/// at the destination, equal to its source, and every file listed is not
/// (nor is any temporary file).
#[track_caller]
fn assert_full_disk_kept_what_fit(r: &Run, src: &std::path::Path, dst: &std::path::Path) {
    assert_eq!(r.code, 5, "exit code; stderr:\n{}\nstdout:\n{}", r.stderr, r.stdout);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    assert!(r.error_lines().iter().any(|l| l.contains("big.dat")), "no error line names big.dat:\n{}", r.stderr);
    assert!(r.stderr.contains("ran out of space"), "no word of the full disk:\n{}", r.stderr);
    let j = r.json();
    let errors = j["errors"].as_array().unwrap_or_else(|| panic!("no errors listed: {j:#}"));
    assert_eq!(j["errors_not_listed"], 0, "{j:#}");
    for e in errors {
        assert_eq!(e["kind"], "no-space", "a failure other than the full disk: {e}");
    }
    let failed = |rel: &str| errors.iter().any(|e| e["path"].as_str().unwrap().ends_with(rel));
    assert!(failed("big.dat"), "big.dat is not listed as failed: {j:#}");
    let (mut kept, mut not_kept) = (0, 0);
    for rel in list_files(src).keys() {
        if failed(rel) {
            assert!(!dst.join(rel).exists(), "{rel} is listed as failed, yet it is at the destination: {j:#}");
            not_kept += 1;
        } else {
            assert!(
                same_content(&src.join(rel), &dst.join(rel)),
                "{rel} is not listed as failed, yet not at the destination as it is at the source: {j:#}"
            );
            kept += 1;
        }
    }
    let strays: Vec<String> = list_files(dst).into_keys().filter(|k| !is_final_name(k)).collect();
    assert!(strays.is_empty(), "temporary files left filling the disk: {strays:?}");
    assert!(kept > 0, "nothing was kept: {j:#}");
    assert_eq!((u(&j["committed_files"]), u(&j["failed_files"])), (kept, not_kept), "{j:#}");
    assert_eq!(u(&j["failed_files"]), errors.len() as u64, "{j:#}");
}

#[test]
fn destination_full_upload_keeps_the_files_that_fit() {
    if !dmover_testkit::needs_root("a loop-mounted ext4") {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    tree_with_one_file_too_big(&src);
    let export = env.path("full");
    let _m = Mount::ext4(&export, &env.path("full.img"), "8M");
    let srv = env.serve(&[("e", &export)]);
    let r = env.cp([src.display().to_string(), srv.url("e"), "--retries".into(), "0".into()]).run();
    assert_full_disk_kept_what_fit(&r, &src, &export.join("src"));
}

#[test]
fn destination_full_download_keeps_the_files_that_fit() {
    if !dmover_testkit::needs_root("a loop-mounted ext4") {
        return;
    }
    let env = Env::new();
    let export = env.mkdir("export");
    tree_with_one_file_too_big(&export.join("src"));
    let srv = env.serve(&[("e", &export)]);
    let local = env.path("full");
    let _m = Mount::ext4(&local, &env.path("full.img"), "8M");
    let r = env.cp([srv.url("e/src"), local.display().to_string(), "--retries".into(), "0".into()]).run();
    assert_full_disk_kept_what_fit(&r, &export.join("src"), &local.join("src"));
}

#[test]
fn destination_full_local_keeps_the_files_that_fit() {
    if !dmover_testkit::needs_root("a loop-mounted ext4") {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    tree_with_one_file_too_big(&src);
    let out = env.path("full");
    let _m = Mount::ext4(&out, &env.path("full.img"), "8M");
    let r = dmover(["cp", "--json", "-q"]).arg(&src).arg(&out).run();
    assert_full_disk_kept_what_fit(&r, &src, &out.join("src"));
}

#[test]
fn unreachable_host_exits_6() {
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("a.dat"), 1000, 8);
    let port = closed_port();
    let host = format!("127.0.0.1:{port}");
    for (from, to) in [
        (src.display().to_string(), format!("dmover://{host}/e/x")),
        (src.join("a.dat").display().to_string(), format!("dmover://{host}/e/x")),
        (format!("dmover://{host}/e/x"), env.path("down").display().to_string()),
    ] {
        let r = env.cp([from, to, "--retries".into(), "0".into()]).run();
        r.assert_fails(6, &[&host]);
        assert!(r.elapsed < Duration::from_secs(30), "took {:?} with --retries 0", r.elapsed);
    }
}

/// A host that answers and then fails every try: it accepts each
/// connection and resets it at once, noting when.
struct ResettingHost {
    addr: String,
    accepts: Arc<Mutex<Vec<Instant>>>,
}

impl ResettingHost {
    fn start() -> ResettingHost {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepts = Arc::new(Mutex::new(Vec::new()));
        let noted = accepts.clone();
        std::thread::spawn(move || {
            for c in listener.incoming().flatten() {
                noted.lock().unwrap().push(Instant::now());
                reset(&c);
            }
        });
        ResettingHost { addr, accepts }
    }

    fn url(&self, rel: &str) -> String {
        format!("dmover://{}/{rel}", self.addr)
    }

    /// When each try made so far began. A try opens its connections at
    /// once (control and data), so tries are bursts of accepts apart by
    /// more than a quarter of a second; the shortest backoff is 0.5 s. A
    /// connection of our own, made last, is reset only once every one
    /// before it has been accepted and noted.
    fn tries(&self) -> Vec<Instant> {
        let mut last = TcpStream::connect(&self.addr).unwrap();
        last.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let end = last.read(&mut [0u8; 1]);
        assert!(
            matches!(&end, Ok(0)) || end.as_ref().is_err_and(|e| e.kind() == ErrorKind::ConnectionReset),
            "our own connection was not reset: {end:?}"
        );
        let mut accepts = self.accepts.lock().unwrap().clone();
        accepts.pop();
        accepts.dedup_by(|later, earlier| *later - *earlier < Duration::from_millis(250));
        accepts
    }
}

/// `--retries 2`: three tries at the host, each reset, the second 0.5 s
/// after the first and the third 1 s after the second (the backoff), then
/// exit 6 naming the host.
#[track_caller]
fn assert_retried(r: &Run, host: &ResettingHost) {
    r.assert_fails(6, &[&host.addr]);
    let tries = host.tries();
    assert_eq!(tries.len(), 3, "--retries 2 tried a host that resets every connection {} times, not 3; stderr:\n{}", tries.len(), r.stderr);
    for (n, pair) in tries.windows(2).enumerate() {
        let (gap, backoff) = (pair[1] - pair[0], Duration::from_millis(500 << n));
        assert!(
            gap >= backoff,
            "retry {} came {gap:?} after the try before it, within its {backoff:?} backoff; stderr:\n{}",
            n + 1,
            r.stderr
        );
    }
}

#[test]
fn unreachable_host_is_retried_directory_transfers() {
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("a.dat"), 1000, 8);
    let host = ResettingHost::start();
    let r = env.cp([src.display().to_string(), host.url("e/x"), "--retries".into(), "2".into()]).run();
    assert_retried(&r, &host);
    let host = ResettingHost::start();
    let r = env.cp([host.url("e/x/"), env.path("down").display().to_string(), "--retries".into(), "2".into()]).run();
    assert_retried(&r, &host);
}

/// The same for a single file (dmover may have to ask the server what the
/// destination is).
#[test]
fn unreachable_host_is_retried_single_file() {
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("a.dat"), 1000, 8);
    let host = ResettingHost::start();
    let r = env.cp([src.join("a.dat").display().to_string(), host.url("e/x"), "--retries".into(), "2".into()]).run();
    assert_retried(&r, &host);
    let host = ResettingHost::start();
    let r = env.cp([host.url("e/x"), env.path("down").display().to_string(), "--retries".into(), "2".into()]).run();
    assert_retried(&r, &host);
}

/// A third-party copy whose source server is down is retried too.
#[test]
fn unreachable_host_is_retried_third_party() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let host = ResettingHost::start();
    let r = env.cp([host.url("e/x/"), srv.url("e/y"), "--retries".into(), "2".into()]).run();
    assert_retried(&r, &host);
    let host = ResettingHost::start();
    let r = env.cp([srv.url("e"), host.url("e/y"), "--retries".into(), "2".into()]).run();
    assert_retried(&r, &host);
}

/// A server busy with as many connections as it takes refuses the data
/// connection of an upload whose control connection it took: the copy
/// fails at once, saying so ("server busy", exit 6; not the broken pipe of
/// a request written after the refusal), whichever of the two the server
/// took first; it waited for good when the refused one was the data
/// connection (its stream ended quietly after the last file was announced,
/// or the control connection's reader waited on a receiver waiting for data).
#[test]
fn a_copy_a_busy_server_turns_away_fails_at_once() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("busy.log"));
    spec.extra = vec!["--max-connections".into(), "1".into()];
    let srv = Server::start(spec);
    let src = env.path("a.dat");
    write_random(&src, 16 << 10, 4);
    for i in 0..20 {
        let r = env.cp([src.display().to_string(), srv.url("e/"), "-p".into(), "1".into(), "--retries".into(), "0".into()]).run();
        assert!(r.elapsed < Duration::from_secs(10), "copy {i} took {:?} against a busy server", r.elapsed);
        r.assert_fails(6, &[&srv.addr(), "server busy"]);
    }
}

#[test]
fn wrong_token_exits_7() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let other = env.path("other-token");
    assert_eq!(dmover(["token".as_ref(), other.as_os_str()]).run().code, 0);
    let src = env.path("src");
    write_random(&src.join("a.dat"), 1000, 9);
    let r = dmover(["cp", "--json", "-q", "--token-file"]).arg(&other).arg(&src).arg(srv.url("e")).run();
    r.assert_fails(7, &[&srv.addr()]);
    assert!(list_tree(&export).is_empty());
    let r = dmover(["cp", "-q"]).arg(srv.url("e/a.dat")).arg(env.path("x")).env("DMOVER_TOKEN", "0123456789abcdef0123456789abcdef").run();
    r.assert_fails(7, &[&srv.addr()]);
}

/// A download that never starts (a wrong token, a server that is not
/// there) leaves nothing at its destination: neither the directories it
/// would have made nor a transfer's resume state in one that was there.
#[test]
fn a_download_that_never_starts_leaves_nothing_behind() {
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("a.dat"), 1000, 9);
    let srv = env.serve(&[("e", &export)]);
    let other = env.path("other-token");
    assert_eq!(dmover(["token".as_ref(), other.as_os_str()]).run().code, 0);
    let there = env.mkdir("there");
    let gone = format!("dmover://127.0.0.1:{}/e/a.dat", closed_port());
    for (from, code) in [(srv.url("e/a.dat"), 7), (gone, 6)] {
        for dest in [env.path("new/deeper/"), there.clone()] {
            let r = dmover(["cp", "-q", "--retries", "0", "--token-file"]).arg(&other).arg(&from).arg(&dest).run();
            assert_eq!(r.code, code, "{from} to {}: {}", dest.display(), r.stderr);
            assert!(!env.path("new").exists(), "{from}: a directory was made for a download that never started");
            assert!(list_tree(&there).is_empty(), "{from}: left in {}: {:?}", there.display(), list_tree(&there));
        }
    }
}

#[test]
fn unknown_export_exits_8() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let src = env.path("src");
    write_random(&src.join("a.dat"), 1000, 10);
    let r = env.cp([src.display().to_string(), srv.url("nosuch/dir")]).run();
    r.assert_fails(8, &["nosuch"]);
    let r = env.cp([srv.url("nosuch/a.dat"), env.path("down").display().to_string()]).run();
    r.assert_fails(8, &["nosuch"]);
}

/// `..` never reaches the server: it is a malformed URL (2). A symlink inside
/// the export that leads out is refused by the server (8), both ways.
#[test]
fn paths_outside_the_export_exit_2_or_8() {
    let env = Env::new();
    let export = env.mkdir("export");
    let outside = env.mkdir("outside");
    write_random(&outside.join("secret.dat"), 3000, 11);
    fs::create_dir(export.join("d")).unwrap();
    symlink(&outside, export.join("d/link")).unwrap();
    symlink(outside.join("secret.dat"), export.join("filelink")).unwrap();
    let srv = env.serve(&[("e", &export)]);
    let down = env.mkdir("down");

    let r = env.cp([srv.url("e/../outside/secret.dat"), down.display().to_string()]).run();
    r.assert_fails(2, &["e/../outside"]);

    let r = env.cp([srv.url("e/d/link/secret.dat"), down.display().to_string()]).run();
    r.assert_fails(8, &["d/link"]);
    let r = env.cp([srv.url("e/filelink"), down.display().to_string()]).run();
    r.assert_fails(8, &["filelink"]);
    assert!(list_files(&down).is_empty(), "something was downloaded: {:?}", list_files(&down));

    let src = env.path("src");
    write_random(&src.join("evil.dat"), 3000, 12);
    let r = env.cp([src.join("evil.dat").display().to_string(), srv.url("e/d/link/")]).run();
    r.assert_fails(8, &["d/link"]);
    let r = env.cp([src.display().to_string(), srv.url("e/d/link/sub")]).run();
    r.assert_fails(8, &["d/link"]);
    assert_eq!(list_files(&outside).into_keys().collect::<Vec<_>>(), ["secret.dat"], "something was written outside the export");
}

#[test]
fn malformed_url_exits_2() {
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("a.dat"), 100, 13);
    let port = closed_port();
    for bad in [
        "dmover://".to_string(),
        "dmover://127.0.0.1".to_string(),
        "dmover://127.0.0.1:99999/e".to_string(),
        "dmover://127.0.0.1:x/e".to_string(),
        format!("dmover://127.0.0.1:{port}//e"),
        format!("dmover://127.0.0.1:{port}/e/../x"),
        format!("dmovr://127.0.0.1:{port}/e"),
    ] {
        let r = env.cp([src.display().to_string(), bad.clone()]).run();
        r.assert_fails(2, &[&bad]);
        let r = env.cp([bad.clone(), env.path("down").display().to_string()]).run();
        r.assert_fails(2, &[&bad]);
    }
    // Usage errors from the command line itself.
    // One path only: said in words, not as clap's count of values.
    let r = dmover(["cp", "only-one-path"]).run();
    r.assert_fails(2, &["only-one-path", "needs a source and a destination", "dmover cp SRC... DEST"]);
    assert_eq!(dmover(["cp", "--block-size", "1", "a", "b"]).run().code, 2);
    assert_eq!(dmover(["frobnicate"]).run().code, 2);
    // A remote location without any token.
    let r = dmover(["cp", "-q"]).arg(&src).arg(format!("dmover://127.0.0.1:{port}/e")).run();
    assert_eq!(r.code, 2, "no token: {}", r.stderr);
}

/// CLI.md "dmover serve", "dmover sink": `--idle-timeout` is at least 2
/// seconds (peers ping every second); below that the server does not start
/// and says what the bound is; 2 starts.
#[test]
fn an_idle_timeout_below_2_seconds_is_refused_exits_2() {
    let env = Env::new();
    let export = env.mkdir("export");
    let sink = env.path("sink");
    for command in ["serve", "sink"] {
        for secs in ["0", "1"] {
            let mut c = dmover([command, "--listen", "127.0.0.1:0", "--idle-timeout", secs, "--token-file"]);
            c.arg(&env.token).timeout(Duration::from_secs(20));
            if command == "serve" {
                c.arg("--export").arg(format!("e={}", export.display()));
            } else {
                c.arg("--dir").arg(&sink);
            }
            let r = c.run();
            assert_eq!(r.code, 2, "{command} --idle-timeout {secs}: exit code; stderr:\n{}\nstdout:\n{}", r.stderr, r.stdout);
            assert!(
                r.stderr.contains("'--idle-timeout") && r.stderr.contains("not in 2.."),
                "{command} --idle-timeout {secs}:\n{}",
                r.stderr
            );
        }
    }
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = vec!["--idle-timeout".into(), "2".into()];
    let mut srv = Server::start(spec);
    assert!(srv.running(), "{}", srv.log());
}

/// The level of `line` and its time (ms since the epoch) if it is a message
/// stamped as CLI.md "Messages" says: `[2026-11-25T16:44:55.376Z WARN ] ...`
/// (the time in UTC, to the millisecond).
fn stamped(line: &str) -> Option<(&str, i64)> {
    let rest = line.strip_prefix('[')?;
    let (time, rest) = (rest.get(..24)?, rest.get(24..)?);
    let (level, text) = (rest.strip_prefix(' ')?.get(..5)?, rest.get(6..)?.strip_prefix("] ")?);
    if !["ERROR", "WARN ", "INFO ", "DEBUG", "TRACE"].contains(&level) || text.is_empty() {
        return None;
    }
    let b = time.as_bytes();
    let shape = b"dddd-dd-ddTdd:dd:dd.dddZ";
    if !b.iter().zip(shape).all(|(c, s)| if *s == b'd' { c.is_ascii_digit() } else { c == s }) {
        return None;
    }
    let n = |r: std::ops::Range<usize>| time[r].parse::<i64>().unwrap();
    let (y, m, d) = (n(0..4), n(5..7), n(8..10));
    // Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * if m > 2 { m - 3 } else { m + 9 } + 2) / 5 + d - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    Some((level.trim_end(), ((days * 24 + n(11..13)) * 60 + n(14..16)) * 60_000 + n(17..19) * 1000 + n(20..23)))
}

/// Asserts that every line of `log` but a command's error lines (`dmover:
/// error: ...`, unstamped) is a stamped message of a time within a minute
/// of now; returns their levels.
#[track_caller]
fn assert_stamped(log: &str, whose: &str) -> Vec<String> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    log.lines()
        .filter(|l| !l.starts_with("dmover: error: "))
        .map(|l| {
            let (level, t) = stamped(l).unwrap_or_else(|| panic!("{whose}: a line not stamped [UTC-TIME LEVEL]: {l:?}\n{log}"));
            assert!((now - t).abs() < 60_000, "{whose}: a line stamped {} s from now (not UTC?): {l:?}", (t - now) / 1000);
            level.to_string()
        })
        .collect()
}

/// CLI.md "Messages": each message on stderr is one line stamped with the
/// time (UTC, whatever the time zone) and its level; servers show `info`
/// and above, other commands `warn` and above, and `DMOVER_LOG` sets the
/// level: `debug` shows each file as it is committed, `warn` keeps a
/// server's `info` out.
#[test]
fn messages_are_stamped_lines_at_the_level_dmover_log_sets() {
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("f.dat"), 100_000, 55);
    let zone = ("TZ".into(), Some("Asia/Kolkata".into()));
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.envs = vec![("DMOVER_LOG".into(), None), zone.clone()];
    let srv = Server::start(spec.clone());
    let levels = assert_stamped(&srv.log(), "a server by default");
    assert!(levels.iter().any(|l| l == "INFO"), "a server shows no info by default:\n{}", srv.log());

    // A client: warnings and above by default. A source it cannot find is
    // logged at info, besides its error line: shown with DMOVER_LOG=info.
    let mut missing = dmover(["cp", "-q"]);
    missing.arg(env.path("no/such/file")).arg(env.path("nowhere")).env_remove("DMOVER_LOG").env("TZ", "Asia/Kolkata");
    let r = missing.run();
    r.assert_fails(3, &["no/such/file"]);
    let levels = assert_stamped(&r.stderr, "a client by default");
    assert!(levels.iter().all(|l| l == "WARN" || l == "ERROR"), "a client shows below warn by default:\n{}", r.stderr);
    let r = missing.env("DMOVER_LOG", "info").run();
    r.assert_fails(3, &["no/such/file"]);
    assert_stamped(&r.stderr, "a client with DMOVER_LOG=info");
    let logged = r.stderr.lines().any(|l| l.contains(" INFO ] ") && l.contains("no/such/file"));
    assert!(logged, "DMOVER_LOG=info does not show the missing source at info:\n{}", r.stderr);
    // With DMOVER_LOG=debug, each file as it is committed.
    let down = env.mkdir("down");
    let mut cp = env.cp([srv.url("e/f.dat"), down.display().to_string()]);
    cp.env("DMOVER_LOG", "debug").env("TZ", "Asia/Kolkata");
    let r = cp.run();
    r.assert_ok();
    let levels = assert_stamped(&r.stderr, "a client with DMOVER_LOG=debug");
    assert!(levels.iter().any(|l| l == "DEBUG"), "DMOVER_LOG=debug shows no debug message:\n{}", r.stderr);
    let committed = down.join("f.dat").display().to_string() + ": committed";
    assert!(r.stderr.lines().any(|l| l.contains("DEBUG") && l.contains(&committed)), "no {committed:?} message:\n{}", r.stderr);

    // A server with DMOVER_LOG=warn: a refused client is logged, and nothing at info.
    spec.log = env.path("server-warn.log");
    spec.envs.push(("DMOVER_LOG".into(), Some("warn".into())));
    let quiet = Server::start(spec);
    let other = env.path("other-token");
    assert_eq!(dmover(["token".as_ref(), other.as_os_str()]).run().code, 0);
    let r = dmover(["ls", "--token-file", other.to_str().unwrap(), &quiet.url("e/")]).run();
    assert_eq!(r.code, 7, "a wrong token was let in: {}{}", r.stdout, r.stderr);
    assert!(wait_until(Duration::from_secs(10), || quiet.log().contains("WARN")), "the refused client was not logged:\n{}", quiet.log());
    let levels = assert_stamped(&quiet.log(), "a server with DMOVER_LOG=warn");
    assert!(levels.iter().all(|l| l == "WARN" || l == "ERROR"), "DMOVER_LOG=warn shows below warn:\n{}", quiet.log());
}

/// Appends to `path` once `dst` has received at least `after` bytes, while
/// `proc` is still running. Returns false if the transfer finished first.
fn append_while_sending(proc: &mut Proc, path: &std::path::Path, dst: &std::path::Path, after: u64) -> bool {
    let ok = wait_until(Duration::from_secs(60), || written_bytes(dst) >= after || !proc.running());
    assert!(ok, "no progress");
    if !proc.running() {
        return false;
    }
    let mut f = fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(b"appended while being sent").unwrap();
    true
}

/// A file that grows while it is sent: exit 9 naming it, and it does not
/// appear under its final name. The staging memory is kept smaller than the
/// file so that it is still being read when it changes.
#[test]
fn source_changed_while_uploading_exits_9() {
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("growing.dat"), 8 * MIB, 14);
    write_random(&src.join("stable.dat"), 4000, 15);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let mut p = env.slow_cp(src.display().to_string(), srv.url("e")).spawn();
    assert!(append_while_sending(&mut p, &src.join("growing.dat"), &export, 2 * MIB), "the transfer ended before the file was changed");
    let r = p.wait();
    r.assert_fails(9, &["growing.dat"]);
    assert_eq!(r.json()["errors"][0]["kind"], "source-changed");
    assert!(!export.join("src/growing.dat").exists(), "a changed file was committed under its final name");
    assert!(same_content(&src.join("stable.dat"), &export.join("src/stable.dat")), "the unchanged file should still be copied");
}

#[test]
fn source_changed_while_downloading_exits_9() {
    let env = Env::new();
    let export = env.mkdir("export");
    let src = export.join("src");
    write_random(&src.join("growing.dat"), 8 * MIB, 16);
    let srv = env.serve(&[("e", &export)]);
    let down = env.mkdir("down");
    let mut p = env.slow_cp(srv.url("e/src"), down.display().to_string()).spawn();
    assert!(append_while_sending(&mut p, &src.join("growing.dat"), &down, 2 * MIB), "the transfer ended before the file was changed");
    let r = p.wait();
    r.assert_fails(9, &["growing.dat"]);
    assert!(!down.join("src/growing.dat").exists(), "a changed file was committed under its final name");
}

/// A file overwritten in place (same size) while it is sent: exit 9, never
/// committed — neither with the old blocks nor with a mix.
#[test]
fn source_modified_in_place_while_uploading_exits_9() {
    use std::os::unix::fs::FileExt;
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("rewritten.dat"), 8 * MIB, 17);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let mut p = env.slow_cp(src.display().to_string(), srv.url("e")).spawn();
    let ok = wait_until(Duration::from_secs(60), || written_bytes(&export) >= 2 * MIB || !p.running());
    assert!(ok && p.running(), "the transfer ended before the file was changed");
    let f = fs::OpenOptions::new().write(true).open(src.join("rewritten.dat")).unwrap();
    let mut junk = vec![0u8; 100_000];
    Rng::new(5).fill(&mut junk);
    f.write_all_at(&junk, 6 * MIB).unwrap(); // not sent yet
    f.write_all_at(&junk, MIB).unwrap(); // probably sent already
    drop(f);
    let r = p.wait();
    r.assert_fails(9, &["rewritten.dat"]);
    assert!(!export.join("src/rewritten.dat").exists(), "a changed file was committed under its final name");
}

/// A file truncated while it is sent: exit 9 (no hang, no desynchronised
/// stream), not committed, and the server carries on.
#[test]
fn source_truncated_while_uploading_exits_9() {
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("shrinking.dat"), 8 * MIB, 18);
    let export = env.mkdir("export");
    let mut srv = env.serve(&[("e", &export)]);
    let mut p = env.slow_cp(src.display().to_string(), srv.url("e")).timeout(Duration::from_secs(60)).spawn();
    let ok = wait_until(Duration::from_secs(60), || written_bytes(&export) >= 2 * MIB || !p.running());
    assert!(ok && p.running(), "the transfer ended before the file was changed");
    fs::OpenOptions::new().write(true).open(src.join("shrinking.dat")).unwrap().set_len(3 * MIB + 5).unwrap();
    let r = p.wait();
    r.assert_fails(9, &["shrinking.dat"]);
    assert!(!export.join("src/shrinking.dat").exists(), "a changed file was committed under its final name");
    assert!(srv.running(), "the server died: {}", srv.log());
    write_random(&src.join("shrinking.dat"), 1000, 19);
    env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
}

/// CLI.md "Stream tuning": every direction is tuned the same way, so
/// local copies, downloads, third-party copies and uploads all take
/// `--tune`, with or without `--streams N` (the tuner starts from N), and
/// copy intact; the report's timeline shows the tuner that ran, from the
/// count it started with. Each copy lasts about 2 s, for a timeline point
/// to come after 1 s. Across the network (a download, an upload, a
/// third-party copy) the timeline of such a copy is at times empty, even
/// over 3 s: there only a point that came is checked.
#[test]
fn tune_is_taken_in_every_direction() {
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("a.dat"), 2_000_000, 21);
    let export = env.mkdir("export");
    write_random(&export.join("data/b.dat"), 2_000_000, 22);
    let export2 = env.mkdir("export2");
    let (srv, srv2) = (env.serve(&[("e", &export)]), env.serve(&[("f", &export2)]));
    let (out, down) = (env.mkdir("out"), env.mkdir("down"));
    // (what, from, to, what is copied, where it lands, whether the timeline always has a point)
    let cases = [
        ("local copy", src.display().to_string(), out.display().to_string(), src.clone(), out.join("src"), true),
        ("download", srv.url("e/data"), down.display().to_string(), export.join("data"), down.join("data"), false),
        ("third-party copy", srv.url("e/data"), srv2.url("f/in"), export.join("data"), export2.join("in/data"), false),
        ("upload", src.display().to_string(), srv2.url("f/up"), src.clone(), export2.join("up/src"), false),
    ];
    for (what, from, to, copied, landed, always) in cases {
        for (tune, first) in [(&["--tune", "mi"][..], 1), (&["--streams", "3", "--tune", "aimd"], 3)] {
            let j = env.cp([from.as_str(), to.as_str(), "--block-size", "64K", "--bwlimit", "1M"]).args(tune).run().assert_ok();
            assert_same_tree(&copied, &landed);
            std::fs::remove_dir_all(&landed).unwrap();
            let timeline = j["timeline"].as_array().unwrap_or_else(|| panic!("{what} {tune:?}: no timeline in the report: {j:#}"));
            let start = timeline.first().map(|p| u(&p["streams"]));
            if start.is_some() || always {
                let seconds = &j["seconds"];
                let why =
                    format!("{what} {tune:?}: the tuner did not run from {first} streams; timeline {timeline:?} of a copy of {seconds} s");
                assert_eq!(start, Some(first), "{why}");
            }
        }
    }
}

/// CLI.md "JSON report": when a transfer cannot run at all, `--json`
/// prints `{ "ok": false, "error": { "kind", "subject", "message",
/// "exit_code" } }` on stdout — that object and nothing else — while
/// stderr carries the one-line error and the process exits with `exit_code`.
#[test]
fn json_report_of_a_fatal_error_has_the_documented_shape() {
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("a.dat"), 1000, 23);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let other = env.path("other-token");
    assert_eq!(dmover(["token".as_ref(), other.as_os_str()]).run().code, 0);
    let closed = format!("127.0.0.1:{}", closed_port());
    let s = src.display().to_string();
    let cases: Vec<(Cmd, i32, &str, String)> = vec![
        (dmover(["cp", "--json", "-q", "--token-file", other.to_str().unwrap(), &s, &srv.url("e")]), 7, "auth-failed", srv.addr()),
        (env.cp([s.clone(), srv.url("nosuch/dir")]), 8, "refused", srv.addr()),
        (env.cp([s.clone(), format!("dmover://{closed}/e"), "--retries".into(), "0".into()]), 6, "unreachable", closed.clone()),
        (env.cp([s.clone(), "dmover://127.0.0.1:x/e".into()]), 2, "usage", "dmover://127.0.0.1:x/e".into()),
        (env.cp([s.clone(), env.path("out").display().to_string(), "--tcp-bs".into(), "1".into()]), 2, "usage", String::new()),
        (dmover(["cp", "--json", "-q", &s, &format!("dmover://{closed}/e")]), 2, "usage", String::new()),
    ];
    for (cmd, code, kind, subject) in cases {
        let r = cmd.run();
        r.assert_fails(code, &[]);
        let j = r.json();
        let keys: Vec<&String> = j.as_object().expect("a JSON object").keys().collect();
        assert_eq!(keys, ["error", "ok"], "top-level fields of a fatal error's report: {j:#}");
        assert_eq!(j["ok"], false, "{j:#}");
        let e = j["error"].as_object().unwrap_or_else(|| panic!("error is not an object: {j:#}"));
        let mut fields: Vec<&String> = e.keys().collect();
        fields.sort();
        assert_eq!(fields, ["exit_code", "kind", "message", "subject"], "fields of error: {j:#}");
        assert_eq!(j["error"]["kind"], kind, "{j:#}");
        assert_eq!(j["error"]["exit_code"], code, "exit_code must be the process's exit code: {j:#}");
        let subject_got = j["error"]["subject"].as_str().expect("subject is a string");
        assert!(subject_got.contains(&subject), "subject {subject_got:?} does not name {subject:?}: {j:#}");
        let message = j["error"]["message"].as_str().expect("message is a string");
        assert!(
            !message.is_empty() && r.error_lines()[0].contains(message),
            "the message {message:?} is not the one on stderr:\n{}",
            r.stderr
        );
    }
}

#[test]
fn token_does_not_overwrite_an_existing_file_exits_2() {
    let env = Env::new();
    let file = env.path("made-token");
    assert_eq!(dmover(["token".as_ref(), file.as_os_str()]).run().code, 0);
    let before = fs::read(&file).unwrap();
    let r = dmover(["token".as_ref(), file.as_os_str()]).run();
    r.assert_fails(2, &["made-token", "already exists"]);
    assert!(!r.stderr.contains("please report"), "an existing file is not an internal error: {}", r.stderr);
    assert_eq!(fs::read(&file).unwrap(), before, "the token was overwritten");
}

#[test]
fn a_submission_sbatch_refuses_is_one_line_with_sbatchs_reasons_exits_2() {
    // An sbatch that cannot reach Slurm answers with several lines on stderr.
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let src = env.mkdir("src");
    write_random(&src.join("a.dat"), 1000, 1);
    let bin = env.mkdir("bin");
    let sbatch = bin.join("sbatch");
    fs::write(&sbatch, "#!/bin/sh\necho 'sbatch: error: no controller' >&2\necho 'sbatch: fatal: Could not establish a configuration source' >&2\nexit 1\n").unwrap();
    fs::set_permissions(&sbatch, fs::Permissions::from_mode(0o755)).unwrap();
    let job = env.path("move.toml");
    fs::write(
        &job,
        format!(
            "source_root = {:?}\nsources = [\"a.dat\"]\ndest_hosts = [{:?}]\ndest_root = \"e/x\"\n",
            src.display().to_string(),
            srv.addr()
        ),
    )
    .unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let r = dmover(["submit".as_ref(), job.as_os_str()]).env("PATH", path).env("DMOVER_TOKEN", env.token_str()).run();
    r.assert_fails(2, &["sbatch", "no controller; sbatch: fatal: Could not establish a configuration source", "sinfo"]);
    assert!(!r.stderr.contains("\\n"), "sbatch's lines should not show as escaped newlines: {}", r.stderr);
}

/// A token file that group or others can read is refused by every command
/// that reads one, not by `cp` and `serve` alone: `sink`, `ls`, `bench` and
/// `drain` each exit 2 naming the file and the `chmod 600` that fixes it,
/// before they listen, connect or read anything else. Each would otherwise
/// go ahead: the server and the token are good.
#[test]
fn sink_ls_bench_and_drain_refuse_a_token_file_others_can_read() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let open = env.path("open-token");
    fs::copy(&env.token, &open).unwrap();
    let manifest = env.path("spill/sim.1.manifest.json");
    let sink_dir = env.path("sink");
    let fix = format!("chmod 600 {}", open.display());
    for mode in [0o644, 0o640, 0o604] {
        chmod(&open, mode);
        let commands: [(&str, Cmd); 4] = [
            ("sink", {
                let mut c = dmover(["sink", "--listen", "127.0.0.1:0", "--dir"]);
                c.arg(&sink_dir).arg("--token-file").arg(&open).timeout(Duration::from_secs(10));
                c
            }),
            ("ls", {
                let mut c = dmover(["ls", "--token-file"]);
                c.arg(&open).arg(srv.url("e/"));
                c
            }),
            ("bench", {
                let mut c = dmover(["bench", "--size", "8M", "--streams", "2", "--token-file"]);
                c.arg(&open).arg(srv.url("e"));
                c
            }),
            ("drain", {
                let mut c = dmover(["drain", "--timeout", "1", "--token-file"]);
                c.arg(&open).arg(&manifest);
                c
            }),
        ];
        for (name, cmd) in commands {
            let r = cmd.run();
            assert_eq!(
                r.code, 2,
                "{name} with a token file of mode {mode:o}: exit code (want 2); stderr:\n{}\nstdout:\n{}",
                r.stderr, r.stdout
            );
            r.assert_fails(2, &["group or others", &fix]);
            assert!(!r.stdout.contains("listening"), "{name} started with a token file of mode {mode:o}: {}", r.stdout);
        }
    }
    assert!(!sink_dir.exists(), "the sink made its directory with a token file others can read");
}

/// A host name that resolves to nothing is a mistake no retry cures: the
/// copy stops at once, exit code 2, naming the host (it was retried five
/// times over 15 s).
#[test]
fn a_host_name_that_does_not_resolve_is_not_retried() {
    let env = Env::new();
    let src = env.path("src");
    write_random(&src.join("a.dat"), 10, 1);
    let started = std::time::Instant::now();
    let r = env.cp([src.display().to_string(), "dmover://no-such-host.invalid:7450/e/x".into(), "--retries".into(), "5".into()]).run();
    r.assert_fails(2, &["no-such-host.invalid", "does not resolve", "check the host name"]);
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "took {:?}: retried", started.elapsed());
}
