//! Interrupted transfers: kill -9 the client or the server part way through
//! (a rate limit makes the transfer slow enough to catch), then let the
//! retry or a re-run of the same command finish. The result must be
//! byte-identical, only what was missing may be sent again, and no file may
//! ever appear under its final name before it is complete.

mod util;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;
use util::*;

const MIB: u64 = 1 << 20;
const BIG: u64 = 24 * MIB;
/// Slow enough that the kill lands mid-transfer, fast enough for the suite.
const RATE: &str = "6M";

/// The data set: one 24 MiB file, a dozen small ones and an empty one.
/// Returns its size.
fn make_set(dir: &Path) -> u64 {
    let mut rng = Rng::new(77);
    make_file(&dir.join("big.bin"), BIG, &mut rng);
    std::fs::write(dir.join("empty.dat"), b"").unwrap();
    for i in 0..12 {
        make_file(&dir.join(format!("small/s{i:02}.dat")), 1000 + rng.below(50_000), &mut rng);
    }
    total_size(dir)
}

/// Waits until `frac` of `total` bytes are written below `dst`, checking all
/// the while that no final name is half-written; fails if `proc` ends first.
/// Returns the bytes written when the threshold was seen.
fn wait_for_progress(proc: &mut Proc, src: &Path, dst: &Path, total: u64, frac: f64) -> u64 {
    let want = (total as f64 * frac) as u64;
    let mut seen = 0;
    let ok = wait_until(Duration::from_secs(90), || {
        if dst.exists() {
            assert_final_names_complete(src, dst);
        }
        seen = written_bytes(dst);
        seen >= want || !proc.running()
    });
    assert!(ok, "no progress: {seen} of {total} bytes written after 90 s");
    assert!(proc.running(), "the transfer ended before it could be interrupted ({seen} of {total} bytes written)");
    seen
}

/// Checks the state of an interrupted destination: the big file is not under
/// its final name, what is under a final name is complete, resume state is
/// there (in the destination directory given to cp, or — if that did not
/// exist before — possibly its parent; `resume_state_lives_in_the_destination_directory`
/// checks the documented place).
fn check_interrupted(src: &Path, dst: &Path, total: u64) -> (u64, (u64, std::time::SystemTime)) {
    let dest_dir = dst.parent().unwrap();
    let written = written_bytes(dst);
    assert!(written < total, "the transfer had completed ({written} of {total}) — not interrupted");
    assert!(!dst.join("big.bin").exists(), "big.bin exists under its final name after an interruption");
    assert!(dst.join(".big.bin.dmover-part").is_file(), "no .big.bin.dmover-part: {:?}", list_tree(dst).keys().collect::<Vec<_>>());
    let state = [dest_dir, dest_dir.parent().unwrap()].iter().any(|d| d.join(".dmover-partial").is_dir());
    assert!(state, "no .dmover-partial/ resume state in {} (or its parent)", dest_dir.display());
    assert_final_names_complete(src, dst);
    (written, identity(&dst.join(".big.bin.dmover-part")))
}

/// The inode and birth time of `path`: a file completed in place keeps both
/// when renamed to its final name; one written afresh has a new birth time
/// (even if its inode number is reused).
fn identity(path: &Path) -> (u64, std::time::SystemTime) {
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.ino(), m.created().expect("birth time (statx)"))
}

/// Asserts that big.bin is the partial file seen after the interruption,
/// completed in place rather than written again from the start.
#[track_caller]
fn assert_completed_in_place(dst: &Path, partial: (u64, std::time::SystemTime)) {
    assert_eq!(
        identity(&dst.join("big.bin")),
        partial,
        "big.bin (inode, birth time) is not the partial file left by the interruption: it was written afresh, not resumed"
    );
}

/// After success no resume state is left in the destination directory (or its parent).
fn assert_no_state(dst: &Path) {
    for d in [dst.parent().unwrap(), dst.parent().unwrap().parent().unwrap()] {
        assert!(!d.join(".dmover-partial").exists(), "{}/.dmover-partial/ was not removed after the transfer completed", d.display());
    }
}

/// The re-run sent only what was missing: by its own report and, over the
/// network, by `wire`, the payload bytes a relay counted during the re-run.
fn check_resumed(j: &serde_json::Value, total: u64, written_at_kill: u64, wire: Option<u64>) {
    let sent = u(&j["sent_bytes"]);
    eprintln!("re-run: sent {sent} of {total} bytes ({wire:?} on the wire); {written_at_kill} were written before the interruption");
    assert_eq!(u(&j["bytes"]), total, "{j:#}");
    assert!(
        sent + written_at_kill / 2 < total,
        "the re-run sent {sent} of {total} bytes although {written_at_kill} were already at the destination: not resumed\n{j:#}"
    );
    if let Some(w) = wire {
        assert!(
            w + written_at_kill / 2 < total,
            "{w} bytes crossed the wire in the re-run for {total} bytes, {written_at_kill} of which were already at the destination: not resumed"
        );
    }
}

/// Upload through a relay, kill the client part way, re-run: the re-run
/// moves only the missing part over the wire and completes the partial file.
#[test]
fn client_killed_mid_upload_then_rerun_resumes() {
    let env = Env::new();
    let src = env.path("data");
    let total = make_set(&src);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let relay = Relay::start(&srv.addr());
    let dst = export.join("in/data");
    let mut cmd = env.cp([src.display().to_string(), relay.url("e/in"), "--bwlimit".into(), RATE.into()]);
    cmd.cwd(env.root());
    let mut p = cmd.spawn();
    wait_for_progress(&mut p, &src, &dst, total, 0.4);
    let mark = srv.log_mark();
    p.kill9();
    // The session ends; what it wrote stays journaled.
    srv.wait_for_log(mark, ENDED, "the session of the killed client ended");
    let (written, partial) = check_interrupted(&src, &dst, total);
    // As if the empty file had been left as a partial file: a resumed run
    // makes it under its final name and removes the partial one.
    let _ = std::fs::remove_file(dst.join("empty.dat"));
    std::fs::write(dst.join(".empty.dat.dmover-part"), b"stale").unwrap();

    relay.reset();
    let j = cmd.run().assert_ok();
    check_resumed(&j, total, written, Some(relay.to_server()));
    assert_same_tree(&src, &dst);
    assert_completed_in_place(&dst, partial);
    assert_no_state(&dst);
}

/// The same for a download.
#[test]
fn client_killed_mid_download_then_rerun_resumes() {
    let env = Env::new();
    let export = env.mkdir("export");
    let src = export.join("data");
    let total = make_set(&src);
    let srv = env.serve(&[("e", &export)]);
    let relay = Relay::start(&srv.addr());
    let down = env.mkdir("down");
    let dst = down.join("data");
    let mut cmd = env.cp([relay.url("e/data"), down.display().to_string(), "--bwlimit".into(), RATE.into()]);
    cmd.cwd(env.root());
    let mut p = cmd.spawn();
    wait_for_progress(&mut p, &src, &dst, total, 0.4);
    p.kill9();
    let (written, partial) = check_interrupted(&src, &dst, total);

    relay.reset();
    let j = cmd.run().assert_ok();
    check_resumed(&j, total, written, Some(relay.to_client()));
    assert_same_tree(&src, &dst);
    assert_completed_in_place(&dst, partial);
    assert_no_state(&dst);
}

fn local_copy_killed_then_rerun(dest_exists: bool) {
    let env = Env::new();
    let src = env.path("data");
    let total = make_set(&src);
    let out = if dest_exists { env.mkdir("out") } else { env.path("new/out") };
    if !dest_exists {
        env.mkdir("new");
    }
    let dst = out.join("data");
    let mut cmd = dmover(["cp", "--json", "-q", "--bwlimit", RATE]);
    cmd.arg(&src).arg(&out).cwd(env.root());
    let mut p = cmd.spawn();
    wait_for_progress(&mut p, &src, &dst, total, 0.4);
    p.kill9();
    let (written, partial) = check_interrupted(&src, &dst, total);

    let j = cmd.run().assert_ok();
    check_resumed(&j, total, written, None);
    assert_same_tree(&src, &dst);
    assert_completed_in_place(&dst, partial);
    assert_no_state(&dst);
}

/// A local copy killed part way, then re-run: it completes the partial file.
#[test]
fn client_killed_mid_local_copy_then_rerun_resumes() {
    local_copy_killed_then_rerun(true);
}

/// The same when DEST did not exist before the first run (the first run
/// creates it; the re-run finds it).
#[test]
fn client_killed_mid_local_copy_to_new_dest_then_rerun_resumes() {
    local_copy_killed_then_rerun(false);
}

/// The server dies mid-upload and comes back on the same port: the same
/// client process, retrying, finishes the job and does not send it all again
/// (by its report and by the bytes a relay counted over both attempts).
#[test]
fn server_killed_mid_upload_client_retries_and_resumes() {
    let env = Env::new();
    let src = env.path("data");
    let total = make_set(&src);
    let export = env.mkdir("export");
    let mut srv = env.serve(&[("e", &export)]);
    let relay = Relay::start(&srv.addr());
    let dst = export.join("in/data");
    let mut cmd = env.cp([src.display().to_string(), relay.url("e/in"), "--bwlimit".into(), RATE.into(), "--retries".into(), "6".into()]);
    cmd.cwd(env.root());
    let mut p = cmd.spawn();
    wait_for_progress(&mut p, &src, &dst, total, 0.4);
    srv.kill9();
    let (written, partial) = check_interrupted(&src, &dst, total);
    assert!(p.running(), "the client gave up at once instead of retrying");
    srv.restart();

    let r = p.wait();
    let j = r.assert_ok();
    assert!(u(&j["retries"]) >= 1, "the report shows no retry: {j:#}");
    // Both count both attempts: the first sent about `written`, so without
    // resuming the total would be about `total + written`.
    let (sent, wire) = (u(&j["sent_bytes"]), relay.to_server());
    eprintln!("retried: sent {sent} ({wire} on the wire) in all for {total} bytes; {written} were written before the server died");
    assert!(sent < total + written / 2, "sent {sent} bytes for {total} with {written} already there: the retry did not resume\n{j:#}");
    assert!(wire < total + written / 2, "{wire} bytes crossed the wire for {total} with {written} already there: the retry did not resume");
    assert_same_tree(&src, &dst);
    assert_completed_in_place(&dst, partial);
    assert_no_state(&dst);
    assert!(srv.log().contains("listening") || srv.log().contains("serving"), "server log: {}", srv.log());
}

/// The server dies mid-upload; the client (no retries) exits 6 naming the
/// host; after a restart on the same port a re-run resumes.
#[test]
fn server_killed_mid_upload_then_rerun_resumes() {
    let env = Env::new();
    let src = env.path("data");
    let total = make_set(&src);
    let export = env.mkdir("export");
    let mut srv = env.serve(&[("e", &export)]);
    let relay = Relay::start(&srv.addr());
    let dst = export.join("in/data");
    let mut cmd = env.cp([src.display().to_string(), relay.url("e/in"), "--bwlimit".into(), RATE.into(), "--retries".into(), "0".into()]);
    cmd.cwd(env.root());
    let mut p = cmd.spawn();
    wait_for_progress(&mut p, &src, &dst, total, 0.4);
    srv.kill9();
    let r = p.wait();
    r.assert_fails(6, &[&relay.addr()]);
    let (written, partial) = check_interrupted(&src, &dst, total);

    srv.restart();
    relay.reset();
    let j = cmd.run().assert_ok();
    check_resumed(&j, total, written, Some(relay.to_server()));
    assert_same_tree(&src, &dst);
    assert_completed_in_place(&dst, partial);
    assert_no_state(&dst);
}

/// A partial file whose source changed in between is not resumed from stale
/// blocks: the re-run must produce the new content.
#[test]
fn rerun_after_source_changed_does_not_mix_old_and_new_blocks() {
    let env = Env::new();
    let src = env.path("data");
    let total = make_set(&src);
    let out = env.mkdir("out");
    let dst = out.join("data");
    let mut cmd = dmover(["cp", "--json", "-q", "--bwlimit", RATE]);
    cmd.arg(&src).arg(&out).cwd(env.root());
    let mut p = cmd.spawn();
    wait_for_progress(&mut p, &src, &dst, total, 0.4);
    p.kill9();
    check_interrupted(&src, &dst, total);
    // New content, same size, a different mtime.
    let (s, _) = mtime_of(&src.join("big.bin"));
    write_random(&src.join("big.bin"), BIG, 4242);
    set_mtime(&src.join("big.bin"), s + 10, 0);

    cmd.run().assert_ok();
    assert_same_tree(&src, &dst);
    assert_no_state(&dst);
}

/// The server dies mid-download and comes back: the retrying client
/// resumes into its local partial file.
#[test]
fn server_killed_mid_download_client_retries_and_resumes() {
    let env = Env::new();
    let export = env.mkdir("export");
    let src = export.join("data");
    let total = make_set(&src);
    let mut srv = env.serve(&[("e", &export)]);
    let relay = Relay::start(&srv.addr());
    let down = env.mkdir("down");
    let dst = down.join("data");
    let mut cmd =
        env.cp([relay.url("e/data"), down.display().to_string(), "--bwlimit".into(), RATE.into(), "--retries".into(), "6".into()]);
    cmd.cwd(env.root());
    let mut p = cmd.spawn();
    wait_for_progress(&mut p, &src, &dst, total, 0.4);
    srv.kill9();
    let (written, partial) = check_interrupted(&src, &dst, total);
    assert!(p.running(), "the client gave up at once instead of retrying");
    srv.restart();

    let j = p.wait().assert_ok();
    assert!(u(&j["retries"]) >= 1, "the report shows no retry: {j:#}");
    assert_same_tree(&src, &dst);
    assert_completed_in_place(&dst, partial);
    assert_no_state(&dst);
    // Here sent_bytes is the last attempt's (the server's report); the relay
    // counted both attempts, so without resuming about `total + written`.
    let (sent, wire) = (u(&j["sent_bytes"]), relay.to_client());
    eprintln!("retried download: sent {sent} of {total} ({wire} on the wire in all); {written} were written before the server died");
    assert!(sent + written / 2 < total, "the retry sent {sent} of {total} bytes with {written} already there: not resumed\n{j:#}");
    assert!(wire < total + written / 2, "{wire} bytes crossed the wire for {total} with {written} already there: the retry did not resume");
}

/// CLI.md: "Resume state lives in `.dmover-partial/` in the destination
/// directory" — the DEST named on the command line, whether or not it
/// existed before, and not its parent (which may be shared, e.g. an export root).
#[test]
fn resume_state_lives_in_the_destination_directory() {
    let env = Env::new();
    let src = env.path("data");
    let total = make_set(&src);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let dest_dir = export.join("in");
    let dst = dest_dir.join("data");
    let mut cmd = env.cp([src.display().to_string(), srv.url("e/in"), "--bwlimit".into(), RATE.into()]);
    cmd.cwd(env.root());
    let mut p = cmd.spawn();
    wait_for_progress(&mut p, &src, &dst, total, 0.2);
    p.kill9();
    assert!(
        dest_dir.join(".dmover-partial").is_dir(),
        "no .dmover-partial/ in the destination directory {}: {:?}",
        dest_dir.display(),
        list_tree(&export).keys().filter(|k| !k.contains("small/")).collect::<Vec<_>>()
    );
    assert!(!export.join(".dmover-partial").exists(), "resume state was put in the destination's parent (the export root)");
}

/// CLI.md "Files while they move": a single file copied to a new name
/// (`cp big.bin dmover://…/e/dir/newname`) is written as
/// `.newname.dmover-part` with its resume state in `.dmover-partial/`
/// beside the destination (in `dir/`); re-run after an interruption, the
/// same command completes it without sending it all again, and the state
/// is removed.
#[test]
fn single_file_to_a_new_name_killed_then_rerun_resumes() {
    let env = Env::new();
    let src = env.path("data/big.bin");
    make_file(&src, BIG, &mut Rng::new(78));
    let export = env.mkdir("export");
    let dir = env.mkdir("export/dir");
    let srv = env.serve(&[("e", &export)]);
    let relay = Relay::start(&srv.addr());
    let (dst, part) = (dir.join("newname"), dir.join(".newname.dmover-part"));
    let mut cmd = env.cp([src.display().to_string(), relay.url("e/dir/newname"), "--bwlimit".into(), RATE.into()]);
    cmd.cwd(env.root());
    let mut p = cmd.spawn();
    let mut written = 0;
    let ok = wait_until(Duration::from_secs(90), || {
        written = written_bytes(&dir);
        written >= BIG * 2 / 5 || !p.running()
    });
    assert!(ok && p.running(), "no interruption mid-file: {written} of {BIG} bytes written, client running: {}", p.running());
    let mark = srv.log_mark();
    p.kill9();
    srv.wait_for_log(mark, ENDED, "the session of the killed client ended");
    assert!(!dst.exists(), "newname exists under its final name after an interruption");
    assert!(part.is_file(), "no .newname.dmover-part: {:?}", list_tree(&export).keys().collect::<Vec<_>>());
    assert!(
        dir.join(".dmover-partial").is_dir(),
        "no .dmover-partial/ beside the destination: {:?}",
        list_tree(&export).keys().collect::<Vec<_>>()
    );
    assert!(!export.join(".dmover-partial").exists(), "resume state was put in the export root, not beside the destination");
    let written = written_bytes(&dir);

    relay.reset();
    let j = cmd.run().assert_ok();
    check_resumed(&j, BIG, written, Some(relay.to_server()));
    assert!(same_content(&src, &dst), "newname differs from the source");
    let left: Vec<String> = list_tree(&dir).into_keys().collect();
    assert_eq!(left, ["newname"], "leftovers beside the destination after success");
}
