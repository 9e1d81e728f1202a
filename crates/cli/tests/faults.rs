//! Faults injected on purpose, with real processes: kill -9 of the client or
//! the server at random points, the link cut for ten seconds, the
//! destination disk filled up, blocks damaged in flight, a source rewritten
//! while it is read. Each test checks that nothing is lost, corrupted or
//! committed half-done, and that the transfer recovers by itself or when
//! the same command is run again.
//!
//! `DMOVER_FAULT_ITERATIONS` sets the number of randomized kill/resume
//! rounds (default 4); `DMOVER_FAULT_SEED` replays a run (each run prints
//! its seed). Lines starting `reliability:` are the figures that
//! `bench/reliability` collects.

mod util;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use util::*;

const MIB: u64 = 1 << 20;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Whether a transfer into `dst` was cut in the middle: a partial file or
/// resume state in its directory (or below).
fn interrupted_midway(dst: &Path) -> bool {
    let dir = dst.parent().unwrap();
    dir.is_dir() && list_tree(dir).keys().any(|k| k.contains(".dmover-part"))
}

/// After success no resume state is left next to the destination.
#[track_caller]
fn assert_no_state(dst: &Path) {
    for d in [dst.parent().unwrap(), dst.parent().unwrap().parent().unwrap()] {
        assert!(!d.join(".dmover-partial").exists(), "{}/.dmover-partial/ was left after success", d.display());
    }
}

// ---------------------------------------------------------------------------
// kill -9 at random points

/// A data set with one large file (striped over the streams, journaled)
/// and a tree of small and edge-case files. Returns its size.
fn make_set(dir: &Path, seed: u64) -> u64 {
    make_tree(dir, seed, 24);
    let mut rng = Rng::new(seed ^ 0xb16);
    make_file(&dir.join("large/big.bin"), 12 * MIB + rng.below(MIB), &mut rng);
    total_size(dir)
}

/// Two rounds that kill the client, then the server, in the middle of an
/// upload and bound what the completing run sends; then many rounds of:
/// start a copy (upload or download), kill -9 the client or
/// the server at a random moment (one to three times; a killed server is
/// restarted on its port), then run the same command again until it
/// succeeds. The destination must be byte-identical to the source each
/// time, no final name may ever hold an incomplete file, and the server
/// must never crash by itself.
#[test]
fn random_kill9_of_client_or_server_then_resume_is_byte_identical() {
    let iterations = env_u64("DMOVER_FAULT_ITERATIONS").unwrap_or(4);
    let seed = env_u64("DMOVER_FAULT_SEED")
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos() as u64);
    eprintln!("seed {seed} (DMOVER_FAULT_SEED={seed} replays this run)");
    let mut rng = Rng::new(seed);
    let env = Env::new();
    let export = env.mkdir("export");
    let mut srv = env.serve(&[("e", &export)]);
    let up_src = env.path("up");
    let up_total = make_set(&up_src, seed);
    let down_src = export.join("down");
    let down_total = make_set(&down_src, seed + 1);
    let (mut kills, mut server_kills, mut mid_transfer, mut verified) = (0u64, 0u64, 0u64, 0u64);
    // Kills in the random rounds that found a partial file or resume state.
    let mut random_mid_transfer = 0u64;

    // Two rounds that surely interrupt an upload in the middle, once 40 %
    // of it has reached the destination: the client killed, then the
    // server. What the run that completes sends is bounded by what was
    // missing (half of what had arrived is slack for blocks written but not
    // yet journaled), so a resume that starts again from zero fails here.
    for kill_server in [false, true] {
        let who = if kill_server { "server" } else { "client" };
        let dst = export.join(format!("mid-{who}/up"));
        let mut cmd = env.cp([up_src.display().to_string(), srv.url(&format!("e/mid-{who}")), "--bwlimit".into(), "6M".into()]);
        cmd.args(["--retries", "3"]).cwd(env.root());
        let mut p = cmd.spawn();
        let reached = wait_until(Duration::from_secs(60), || written_bytes(&dst) >= up_total * 2 / 5 || !p.running());
        assert!(reached && p.running(), "the upload ended before 40 % of it had arrived: no interruption in the middle");
        kills += 1;
        mid_transfer += 1;
        let (j, written, same_process) = if kill_server {
            server_kills += 1;
            srv.kill9();
            let written = written_bytes(&dst);
            assert_final_names_complete(&up_src, &dst);
            srv.restart();
            let r = p.wait();
            if r.code == 0 {
                (r.assert_ok(), written, true)
            } else {
                assert_eq!(r.code, 6, "after the server was killed the client exited {}:\n{}", r.code, r.stderr);
                (cmd.run().assert_ok(), written, false)
            }
        } else {
            let mark = srv.log_mark();
            p.kill9();
            // The session ends; what it wrote stays journaled.
            srv.wait_for_log(mark, ENDED, "the session of the killed client ended");
            let written = written_bytes(&dst);
            assert_final_names_complete(&up_src, &dst);
            (cmd.run().assert_ok(), written, false)
        };
        let sent = u(&j["sent_bytes"]);
        eprintln!("{who} killed with {written} of {up_total} bytes at the destination; the completing run sent {sent}");
        // A client that retried by itself counts what it sent before the kill too.
        let limit = if same_process { up_total + written / 2 } else { up_total - written / 2 };
        assert!(
            sent < limit,
            "{who} killed with {written} of {up_total} bytes at the destination, then {sent} bytes were sent: not resumed\n{j:#}"
        );
        assert_same_tree(&up_src, &dst);
        assert_no_state(&dst);
        verified += up_total;
    }

    for i in 0..iterations {
        let upload = rng.below(2) == 0;
        let (src, dst, total, mut cmd) = if upload {
            let dst = export.join(format!("in{i}/up"));
            let cmd = env.cp([up_src.display().to_string(), srv.url(&format!("e/in{i}")), "--bwlimit".into(), "24M".into()]);
            (up_src.clone(), dst, up_total, cmd)
        } else {
            let out = env.mkdir(&format!("out{i}"));
            let cmd = env.cp([srv.url("e/down"), out.display().to_string(), "--bwlimit".into(), "24M".into()]);
            (down_src.clone(), out.join("down"), down_total, cmd)
        };
        cmd.args(["--retries", "3"]).cwd(env.root());
        let what = if upload { "upload" } else { "download" };
        let mut done = false;
        for _ in 0..1 + rng.below(3) {
            let mut p = cmd.spawn();
            let delay = Duration::from_millis(rng.below(900));
            let kill_server = rng.below(2) == 0;
            wait_until(delay, || !p.running());
            if !p.running() {
                p.wait().assert_ok();
                done = true;
                break;
            }
            kills += 1;
            eprintln!("{what} round {i}: kill -9 of the {} after {delay:?}", if kill_server { "server" } else { "client" });
            if kill_server {
                server_kills += 1;
                srv.kill9();
                random_mid_transfer += u64::from(interrupted_midway(&dst));
                if dst.exists() {
                    assert_final_names_complete(&src, &dst);
                }
                srv.restart();
                // The client retries; it either finishes or gives up as unreachable.
                let r = p.wait();
                assert!(!r.stderr.contains("panicked"), "{what} round {i}: the client panicked:\n{}", r.stderr);
                eprintln!("{what} round {i}: the client exited {} after the server was killed\n{}", r.code, r.stderr);
                if r.code == 0 {
                    r.assert_ok();
                    done = true;
                    break;
                }
                assert_eq!(r.code, 6, "{what} round {i}: after the server was killed the client exited {}:\n{}", r.code, r.stderr);
            } else {
                p.kill9();
                random_mid_transfer += u64::from(interrupted_midway(&dst));
                assert!(srv.running(), "{what} round {i}: the server died when its client was killed:\n{}", srv.log());
            }
            if dst.exists() {
                assert_final_names_complete(&src, &dst);
            }
        }
        if !done {
            cmd.run().assert_ok();
        }
        assert_same_tree(&src, &dst);
        assert_no_state(&dst);
        verified += total;
    }
    assert!(!srv.log().contains("panicked"), "a server thread panicked:\n{}", srv.log());
    mid_transfer += random_mid_transfer;
    assert!(
        random_mid_transfer >= 1,
        "none of the kills at random points found a partial file or resume state: no random round hit a transfer in the middle (seed {seed})"
    );
    eprintln!(
        "reliability: kill-resume seed={seed} iterations={iterations} kills={kills} server_kills={server_kills} \
         kills_with_partial_destination={mid_transfer} random_kills_with_partial_destination={random_mid_transfer} bytes_verified={verified}"
    );
}

// ---------------------------------------------------------------------------
// The link cut for 10 s

/// Two network namespaces joined by a veth pair: dmfA (10.252.22.1) and
/// dmfB (10.252.22.2). Removed when dropped.
struct Netns;

const NS_A: &str = "dmfA";
const NS_B: &str = "dmfB";
const ADDR_B: &str = "10.252.22.2";

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr)))
    }
}

impl Netns {
    fn new() -> Netns {
        let _ = ip(&["netns", "del", NS_A]);
        let _ = ip(&["netns", "del", NS_B]);
        let ns = Netns;
        for args in [
            vec!["netns", "add", NS_A],
            vec!["netns", "add", NS_B],
            vec!["link", "add", "dmfA0", "netns", NS_A, "type", "veth", "peer", "name", "dmfB0", "netns", NS_B],
            vec!["-n", NS_A, "addr", "add", "10.252.22.1/24", "dev", "dmfA0"],
            vec!["-n", NS_B, "addr", "add", "10.252.22.2/24", "dev", "dmfB0"],
            vec!["-n", NS_A, "link", "set", "lo", "up"],
            vec!["-n", NS_B, "link", "set", "lo", "up"],
            vec!["-n", NS_A, "link", "set", "dmfA0", "up"],
            vec!["-n", NS_B, "link", "set", "dmfB0", "up"],
        ] {
            ip(&args).unwrap_or_else(|e| panic!("cannot set up the network namespaces (this test needs root and iproute2): {e}"));
        }
        ns
    }

    /// Takes the client's end of the link down (or up).
    fn link(&self, up: bool) {
        ip(&["-n", NS_A, "link", "set", "dmfA0", if up { "up" } else { "down" }]).unwrap();
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", NS_A]);
        let _ = ip(&["netns", "del", NS_B]);
    }
}

/// The network namespaces are one pair: the link tests take turns.
static LINK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What an upload across a cut link did.
struct Cut {
    report: serde_json::Value,
    /// Bytes at the destination when the link went down.
    written_before: u64,
    /// Bytes in the data set.
    total: u64,
    elapsed: Duration,
}

/// An upload between two network namespaces (at 8 MB/s, a 40 MiB file and
/// 20 small ones), the server started with `server_flags`; the link goes
/// down for `cut` once 8 MiB have arrived. Nothing may arrive during the
/// cut (so it really was cut), the same client process must then finish
/// the job by itself, and the tree must arrive whole.
fn upload_across_a_cut(cut: Duration, server_flags: &[&str]) -> Cut {
    let _turn = LINK.lock().unwrap_or_else(|e| e.into_inner());
    let env = Env::new();
    let ns = Netns::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.prefix = ["ip", "netns", "exec", NS_B].iter().map(Into::into).collect();
    spec.listen = format!("{ADDR_B}:0");
    spec.extra = server_flags.iter().map(Into::into).collect();
    let srv = Server::start(spec);
    let src = env.path("src");
    let mut rng = Rng::new(7);
    make_file(&src.join("big.bin"), 40 * MIB, &mut rng);
    for i in 0..20 {
        make_file(&src.join(format!("small/{i:02}.dat")), rng.below(60_000), &mut rng);
    }
    let total = total_size(&src);
    let url = format!("dmover://{ADDR_B}:{}/e/in", srv.port);
    let mut p = env
        .cp([src.display().to_string(), url, "--bwlimit".into(), "8M".into()])
        .prefix(["ip", "netns", "exec", NS_A])
        .timeout(Duration::from_secs(150))
        .spawn();
    assert!(wait_until(Duration::from_secs(60), || written_bytes(&export) >= 8 * MIB || !p.running()), "no progress");
    assert!(p.running(), "the transfer ended before the link was cut");
    ns.link(false);
    let down = Instant::now();
    let written_before = written_bytes(&export);
    std::thread::sleep(Duration::from_secs(2));
    let before = written_bytes(&export);
    std::thread::sleep(cut.saturating_sub(down.elapsed()));
    let after = written_bytes(&export);
    ns.link(true);
    assert!(p.running(), "the client gave up during the cut");
    assert_eq!(before, after, "bytes arrived while the link was down: the cut did not cut");
    let r = p.wait();
    let report = r.assert_ok();
    assert_same_tree(&src, &export.join("in/src"));
    assert!(srv.log().contains("received"), "{}", srv.log());
    Cut { report, written_before, total, elapsed: r.elapsed }
}

/// The link goes down for 10 s, well within the idle timeout: TCP rides it
/// out and the transfer simply continues, on the same connections (no
/// retry), sending nothing twice.
#[test]
fn link_cut_for_10_s_mid_transfer_the_transfer_continues_by_itself() {
    if !dmover_testkit::needs_root("network namespaces and a veth pair, to cut the link") {
        return;
    }
    let c = upload_across_a_cut(Duration::from_secs(10), &[]);
    let (retries, sent) = (u(&c.report["retries"]), u(&c.report["sent_bytes"]));
    assert_eq!(retries, 0, "a 10 s cut within every idle timeout made the client reconnect: {:#}", c.report);
    assert_eq!(sent, c.total, "{sent} bytes sent for {}: data was sent again across a cut TCP rides out: {:#}", c.total, c.report);
    eprintln!("reliability: link-cut seconds=10 bytes_verified={} retries={retries} elapsed_s={:.1}", c.total, c.elapsed.as_secs_f64());
}

/// The link goes down for longer than the server's idle timeout: the
/// server ends the session, so the client must reconnect and resume (at
/// least one retry) and resume: a client that started again from zero
/// would send everything it had sent before the cut (at least what had
/// arrived) on top of the whole data set.
#[test]
fn link_cut_longer_than_the_idle_timeout_the_client_reconnects_and_resumes() {
    if !dmover_testkit::needs_root("network namespaces and a veth pair, to cut the link") {
        return;
    }
    let c = upload_across_a_cut(Duration::from_secs(8), &["--idle-timeout", "3"]);
    let (retries, sent) = (u(&c.report["retries"]), u(&c.report["sent_bytes"]));
    assert!(retries >= 1, "the server dropped the session during the cut, yet the client never reconnected: {:#}", c.report);
    assert!(
        sent < c.total + c.written_before,
        "{sent} bytes sent for {} with {} already at the destination before the cut: the reconnection started again from zero",
        c.total,
        c.written_before
    );
    eprintln!(
        "reliability: link-cut-past-idle seconds=8 idle_timeout=3 bytes_verified={} retries={retries} sent_bytes={sent} elapsed_s={:.1}",
        c.total,
        c.elapsed.as_secs_f64()
    );
}

// ---------------------------------------------------------------------------
// Disk full

/// The destination file system fills up: a clear error (exit 5), nothing
/// incomplete under a final name; once space is freed, the same command
/// completes, without sending again what had been committed.
fn disk_full_then_freed(upload: bool) {
    if !dmover_testkit::needs_root("a small tmpfs mount, to fill up") {
        return;
    }
    let env = Env::new();
    let export = env.mkdir("export");
    let full = env.path("full");
    let _m = Mount::tmpfs(&full, "16m");
    let filler = full.join("filler.bin");
    write_random(&filler, 10 * MIB, 1);
    let served: &Path = if upload { &full } else { &export };
    let srv = env.serve(&[("e", served)]);
    let src = if upload { env.path("src") } else { export.join("src") };
    make_tree(&src, 31, 40);
    write_random(&src.join("z/late.bin"), 4 * MIB, 2);
    let total = total_size(&src);
    assert!(total > 6 * MIB, "the data set must not fit in the space left");
    let mut cmd = if upload {
        env.cp([src.display().to_string(), srv.url("e/in"), "--retries".into(), "0".into()])
    } else {
        env.cp([srv.url("e/src"), full.join("in").display().to_string(), "--retries".into(), "0".into()])
    };
    cmd.cwd(env.root()).timeout(Duration::from_secs(60));
    let dst = full.join("in/src");
    let r = cmd.run();
    assert_eq!(r.code, 5, "exit code; stderr:\n{}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    let line = r.error_lines().join("\n");
    assert!(line.contains("space"), "the error does not say the disk is full:\n{}", r.stderr);
    let committed = assert_final_names_complete(&src, &dst);
    let committed_bytes = committed_bytes(&dst);
    eprintln!("disk full: {committed} files ({committed_bytes} bytes) committed before the disk filled up");
    assert!(committed > 0, "nothing was committed before the disk filled up, so the re-run proves nothing");

    fs::remove_file(&filler).unwrap();
    let j = cmd.run().assert_ok();
    assert_same_tree(&src, &dst);
    assert_no_state(&dst);
    assert!(
        u(&j["skipped_files"]) >= committed as u64,
        "the re-run skipped {} files, but {committed} were committed before the disk filled up: {j:#}",
        u(&j["skipped_files"])
    );
    assert!(
        u(&j["sent_bytes"]) <= total - committed_bytes,
        "the re-run sent {} bytes, more than the {} not committed before the disk filled up: {j:#}",
        u(&j["sent_bytes"]),
        total - committed_bytes
    );
}

/// Bytes in files under their final names below `dst` (not temporary
/// names, not resume state).
fn committed_bytes(dst: &Path) -> u64 {
    list_files(dst).into_iter().filter(|(k, _)| is_final_name(k)).map(|(_, n)| if let Node::File { size, .. } = n { size } else { 0 }).sum()
}

#[test]
fn disk_full_during_upload_then_space_freed_rerun_completes() {
    disk_full_then_freed(true);
}

#[test]
fn disk_full_during_download_then_space_freed_rerun_completes() {
    disk_full_then_freed(false);
}

// ---------------------------------------------------------------------------
// Corruption in flight (the fault injector of dmover-faulty)

const CORRUPT: &str = "DMOVER_FAULT_CORRUPT_EVERY";

/// Every 5th block the sender puts on the wire is damaged after it was
/// checksummed: the receiver notices each one, asks again, and the copy
/// completes byte-identical — in both directions.
#[test]
fn blocks_damaged_in_flight_are_detected_and_sent_again() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.bin = BIN_FAULTY;
    spec.envs.push((CORRUPT.into(), Some("5".into())));
    let srv = Server::start(spec);
    let src = env.path("src");
    make_tree(&src, 41, 30);
    write_random(&src.join("big.bin"), 9 * MIB + 5, 3);

    // Upload: the client damages blocks, the server notices.
    let r = env.cp([src.display().to_string(), srv.url("e")]).faulty().env(CORRUPT, "5").arg("--block-size").arg("256K").run();
    let j = r.assert_ok();
    assert_same_tree(&src, &export.join("src"));
    let resent = u(&j["resent_blocks"]);
    assert!(resent >= 5, "only {resent} blocks were sent again: {j:#}");
    assert!(srv.log().contains("damaged block"), "the server did not log the damaged blocks:\n{}", srv.log());

    // Download: the server damages blocks, the client notices.
    let down = env.mkdir("down");
    let r = env.cp([srv.url("e/src"), down.display().to_string(), "--block-size".into(), "256K".into()]).run();
    let j = r.assert_ok();
    assert_same_tree(&src, &down.join("src"));
    assert!(r.stderr.contains("damaged block"), "the client did not report the damaged blocks:\n{}", r.stderr);
    assert!(u(&j["resent_blocks"]) >= 5, "{j:#}");
    eprintln!("reliability: corruption every=5 upload_resent={resent} download_resent={}", u(&j["resent_blocks"]));
}

/// Regression: a block damaged on every attempt was asked for again
/// forever. Now the file fails verification (exit 10) after a bounded
/// number of attempts, nothing is committed, and the server carries on.
#[test]
fn block_damaged_on_every_attempt_fails_verification_instead_of_looping_forever() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut srv = env.serve(&[("e", &export)]);
    let src = env.path("src");
    write_random(&src.join("doomed.bin"), 3 * MIB, 4);
    let r = env
        .cp([src.display().to_string(), srv.url("e")])
        .faulty()
        .env(CORRUPT, "1")
        .arg("--retries")
        .arg("0")
        .timeout(Duration::from_secs(60))
        .run();
    r.assert_fails(10, &["doomed.bin"]);
    assert!(!export.join("src/doomed.bin").exists(), "a damaged file was committed");
    assert!(srv.running(), "{}", srv.log());
    // Without damage the same copy goes through.
    env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
    assert_same_tree(&src, &export.join("src"));
}

// ---------------------------------------------------------------------------
// A source changed while it is sent

/// Regression: a source rewritten in place during the copy, with its mtime
/// put back afterwards (as `cp -p` or `rsync -t` into it would), passed the
/// size-and-mtime check and was committed half old, half new. The change
/// time now gives it away: exit 9, nothing under the final name.
#[test]
fn source_rewritten_with_mtime_restored_is_not_committed_half_old_half_new() {
    use std::os::unix::fs::FileExt;
    let env = Env::new();
    let src = env.path("src");
    let file = src.join("rewritten.dat");
    write_random(&file, 8 * MIB, 17);
    let (s, ns) = mtime_of(&file);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let mut p = env.slow_cp(src.display().to_string(), srv.url("e")).spawn();
    let ok = wait_until(Duration::from_secs(60), || written_bytes(&export) >= 2 * MIB || !p.running());
    assert!(ok && p.running(), "the transfer ended before the file was changed");
    let f = fs::OpenOptions::new().write(true).open(&file).unwrap();
    let mut junk = vec![0u8; 100_000];
    Rng::new(5).fill(&mut junk);
    f.write_all_at(&junk, 6 * MIB).unwrap(); // not sent yet
    f.write_all_at(&junk, MIB).unwrap(); // sent already
    drop(f);
    set_mtime(&file, s, ns);
    assert_eq!(mtime_of(&file), (s, ns));
    let r = p.wait();
    r.assert_fails(9, &["rewritten.dat"]);
    assert!(!export.join("src/rewritten.dat").exists(), "a file changed during the copy was committed");
}

// ---------------------------------------------------------------------------
// Two runs of one transfer

/// The transfer id `dmover cp` gives these arguments run from `cwd`
/// (crates/cli/src/cp.rs: the arguments, the block size and the directory).
fn transfer_id(args: &[&str], block_size: u64, cwd: &Path) -> [u8; 16] {
    let s = format!("{}\0{block_size}\0{}", args.join("\0"), cwd.display());
    dmover_proto::digest::block_sum(s.as_bytes())
}

/// Regression: a re-run started while the server was still writing the
/// blocks the interrupted run had queued (its client killed a moment
/// before) wrote the same partial files at the same time, each end
/// truncating or replacing what the other wrote. Now the second run waits
/// for the first to finish writing. Here the first run is held open by
/// hand: the server must say the re-run waits, nothing may be written
/// while it does, and it must complete once the first run ends.
#[test]
fn rerun_waits_while_an_earlier_run_of_the_same_transfer_is_still_writing() {
    use dmover_proto::frame::{TransferFlags, TransferOptions};
    use dmover_proto::Msg;
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let src = env.path("src");
    make_tree(&src, 51, 10);
    let (from, to) = (src.display().to_string(), srv.url("e/in"));
    let id = transfer_id(&[&from, &to], MIB, &fs::canonicalize(env.root()).unwrap());
    let mut first = Raw::control(&srv.addr(), env.token_str().as_bytes());
    let options = TransferOptions { transfer_id: id, block_size: MIB as u32, flags: TransferFlags::empty(), tcp_buffer: 0 };
    first.send(&Msg::Receive { dest: "e/in".into(), options });
    assert!(matches!(first.read(), Some(Msg::SessionOpened { .. })));

    let mut p = env.cp([from, to]).cwd(env.root()).spawn();
    let waiting = wait_until(Duration::from_secs(20), || srv.log().contains("waiting for an earlier run") || !p.running());
    assert!(waiting && p.running(), "the re-run did not wait for the run still writing:\n{}", srv.log());
    assert!(!export.join("in/src").exists(), "the re-run wrote while the earlier run held the transfer");
    drop(first);
    p.wait().assert_ok();
    assert_same_tree(&src, &export.join("in/src"));
}

/// Regression: when a reply failed on a lost control connection (a client
/// gone while the server answered it), the receiving session deadlocked on
/// its own control lock and kept its threads, descriptors and memory for
/// good (and a re-run of the same transfer waited for it). Here clients
/// announce a file and reset the connection at once, so that the server's
/// answer meets a reset connection: every session must end and give
/// everything back.
#[test]
fn reply_on_a_reset_control_connection_ends_the_session() {
    use dmover_proto::frame::{FileMeta, TransferFlags, TransferOptions};
    use dmover_proto::Msg;
    use std::os::unix::io::AsRawFd;
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let pid = srv.pid();
    let token = env.token_str();
    // The server starts its threads and opens its descriptors before it says it listens.
    let (fds_before, threads_before) = (open_fds(pid), proc_status(pid, "Threads:"));
    for i in 0..40u8 {
        let mut c = Raw::control(&srv.addr(), token.as_bytes());
        let options = TransferOptions { transfer_id: [i; 16], block_size: MIB as u32, flags: TransferFlags::empty(), tcp_buffer: 0 };
        c.send(&Msg::Receive { dest: format!("e/r{i}"), options });
        assert!(matches!(c.read(), Some(Msg::SessionOpened { .. })));
        let meta = FileMeta { path: "f.dat".into(), size: 5, mtime_s: 0, mtime_ns: 0, mode: 0o644, ..Default::default() };
        c.send(&Msg::Announce { id: 1, meta, digest: None });
        // Close with a reset (SO_LINGER 0) right behind the announcement.
        let linger = libc::linger { l_onoff: 1, l_linger: 0 };
        // SAFETY: setsockopt on a socket we own, with a valid linger struct.
        let r = unsafe {
            libc::setsockopt(
                c.s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0);
        drop(c);
    }
    let ended = wait_until(Duration::from_secs(10), || open_fds(pid) <= fds_before && proc_status(pid, "Threads:") <= threads_before);
    assert!(
        ended,
        "the server still holds {} descriptors (had {fds_before}) and {} threads (had {threads_before}) 10 s after its clients left",
        open_fds(pid),
        proc_status(pid, "Threads:")
    );
}

/// Regression: a file whose blocks had all reached the disk before the run
/// was interrupted (only its confirmation was missing) was committed empty
/// when the transfer was resumed: with nothing left to write, the commit
/// opened the partial file afresh, truncating it. Here the first run sends
/// every block and hangs up before the end of the file; the second run
/// must be asked for nothing and commit the whole file.
#[test]
fn resumed_file_with_every_block_already_on_disk_is_committed_whole() {
    use dmover_proto::digest::{block_sum, file_digest};
    use dmover_proto::frame::{DataHeader, FileMeta, TransferFlags, TransferOptions};
    use dmover_proto::Msg;
    const BLOCK: usize = 64 << 10;
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let token = env.token_str();
    let mut data = vec![0u8; 3 * BLOCK + 100];
    Rng::new(71).fill(&mut data);
    let sums: Vec<_> = data.chunks(BLOCK).map(block_sum).collect();
    let meta =
        FileMeta { path: "f.dat".into(), size: data.len() as u64, mtime_s: 1_600_000_000, mtime_ns: 5, mode: 0o644, ..Default::default() };
    let options = TransferOptions { transfer_id: [9; 16], block_size: BLOCK as u32, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let open = || {
        let mut c = Raw::control(&srv.addr(), token.as_bytes());
        c.send(&Msg::Receive { dest: "e/in".into(), options });
        let Some(Msg::SessionOpened { session }) = c.read() else { panic!("no session") };
        c.send(&Msg::Announce { id: 1, meta: meta.clone(), digest: None });
        let Some(Msg::Plan { ranges, .. }) = c.read() else { panic!("no plan") };
        (c, session, ranges)
    };

    // First run: every block goes over a data connection, then it hangs up.
    let (c, session, ranges) = open();
    assert_eq!(ranges, vec![(0, 4)]);
    let (mut d, _, _) = Raw::handshake(&srv.addr(), token.as_bytes());
    assert_eq!(d.read(), Some(Msg::Welcome));
    d.send(&Msg::OpenData { session, index: 0 });
    assert!(matches!(d.read(), Some(Msg::SessionOpened { .. })));
    for (i, block) in data.chunks(BLOCK).enumerate() {
        let h = DataHeader { file: 1, offset: (i * BLOCK) as u64, sum: sums[i], len: block.len() as u32, sparse: false };
        d.raw(&h.encode());
        d.raw(block);
    }
    let temp = export.join("in/.f.dat.dmover-part");
    let written = || fs::metadata(&temp).map(|m| m.len()).unwrap_or(0) == data.len() as u64;
    assert!(wait_until(Duration::from_secs(10), written), "the blocks were not written");
    std::thread::sleep(Duration::from_millis(300)); // and journaled
    drop(d);
    drop(c);

    // Second run: nothing is missing; the end of the file commits it.
    let (mut c, _, ranges) = open();
    assert_eq!(ranges, Vec::<(u64, u64)>::new(), "blocks already on disk were asked for again");
    c.send(&Msg::FileEnd { id: 1, digest: file_digest(&sums) });
    assert!(matches!(c.read(), Some(Msg::Done { id: 1, .. })));
    let got = fs::read(export.join("in/f.dat")).unwrap();
    assert!(got == data, "the resumed file was committed with {} bytes of {}, or different ones", got.len(), data.len());
}

/// Regression: a file skipped as already there (by `--sync`, or by a
/// resumed run) kept the partial file and journal an interrupted run had
/// left for it — a re-run killed right after a completed one left them for
/// good. Now a resumed run removes the stale partial state of a file it
/// skips; the killed run leaves its marker, so the next run is a resumed one.
#[test]
fn stale_partial_file_of_a_file_skipped_as_already_there_is_removed() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let src = env.path("src");
    make_tree(&src, 81, 5);
    let sync = |extra: &[&str]| {
        let mut c = env.cp([src.display().to_string(), srv.url("e"), "--sync".into()]);
        c.args(extra.iter().copied()).cwd(env.root());
        c
    };
    sync(&[]).run().assert_ok();
    // What a re-run interrupted after the first one completed leaves
    // behind: a partial file of a file the first run completed (as if the
    // re-run had been sending it again), and the re-run's own marker,
    // here from a re-run killed while it sends a new large file.
    let stale = export.join("src/a/b/c/.multi.dat.dmover-part");
    fs::write(&stale, b"the first blocks of an interrupted run").unwrap();
    make_file(&src.join("large.bin"), 24 << 20, &mut Rng::new(5));
    let mut p = sync(&["--bwlimit", "6M"]).spawn();
    let partial = export.join("src/.large.bin.dmover-part");
    let started = wait_until(Duration::from_secs(60), || fs::metadata(&partial).is_ok_and(|m| m.len() > 0) || !p.running());
    assert!(started && p.running(), "the re-run ended before it could be interrupted");
    p.kill9();
    let j = sync(&[]).run().assert_ok();
    assert_eq!(u(&j["skipped_files"]) + 1, u(&j["files"]), "every file but the new one is skipped: {j:#}");
    assert!(!stale.exists(), "the stale partial file of a skipped file was left behind");
    assert_same_tree(&src, &export.join("src"));
}
