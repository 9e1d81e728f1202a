//! The server under hostile or careless clients: wrong tokens, symlinks that
//! lead out of an export or are planted where a transfer or a sink is about
//! to write, garbage on the port, late data connections, and signals.

mod util;

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};
use util::*;

#[test]
fn wrong_token_is_refused_and_logged() {
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("data.dat"), 10_000, 1);
    let srv = env.serve(&[("e", &export)]);
    let bad = env.path("bad-token");
    assert_eq!(dmover(["token".as_ref(), bad.as_os_str()]).run().code, 0);
    let src = env.path("src");
    write_random(&src.join("a.dat"), 1000, 2);

    let r = dmover(["cp", "--json", "-q", "--token-file"]).arg(&bad).arg(&src).arg(srv.url("e")).run();
    r.assert_fails(7, &[&srv.addr()]);
    let r = dmover(["cp", "--json", "-q", "--token-file"]).arg(&bad).arg(srv.url("e/data.dat")).arg(env.path("stolen.dat")).run();
    r.assert_fails(7, &[&srv.addr()]);
    assert!(!env.path("stolen.dat").exists(), "data was served to a client with the wrong token");
    assert_eq!(list_files(&export).into_keys().collect::<Vec<_>>(), ["data.dat"], "a client with the wrong token wrote into the export");

    let ok = wait_until(Duration::from_secs(10), || srv.log().matches("refused").count() >= 2);
    let log = srv.log();
    assert!(ok, "the server did not log the refusals:\n{log}");
    assert!(
        log.lines().any(|l| l.contains("refused") && l.contains("127.0.0.1") && (l.contains("token") || l.contains("authentication"))),
        "the refusal log line should name the peer and the reason:\n{log}"
    );
    assert!(!log.contains(&env.token_str()), "the server logged its token");

    // The right token still works.
    env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
}

#[test]
fn a_data_connection_for_an_ended_session_is_refused_at_once() {
    // A tuner may add a stream just as its transfer ends; the server must not
    // keep that connection (and so the client) waiting for the session.
    use dmover_engine::session::{Conn, Credential};
    use dmover_proto::frame::{TransferFlags, TransferOptions};
    use dmover_proto::phase::{Open, Reply, Request};
    use std::time::Instant;

    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let cred = Credential::token(env.token_str().as_bytes());
    let mut control = Conn::control(&srv.addr(), &cred).unwrap();
    let options = TransferOptions { transfer_id: [7; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let session = match control.request(Request::Receive { dest: "e/in".into(), options }).unwrap() {
        Reply::SessionOpened { session } => session,
        m => panic!("expected a session, got {m:?}"),
    };
    let mark = srv.log_mark();
    drop(control);
    srv.wait_for_log(mark, ENDED, "the session ended with its control connection");

    let started = Instant::now();
    let mut late = Conn::open(&srv.addr(), &cred).unwrap();
    late.send(Open::OpenData { session, index: 0 }).unwrap();
    let reply = late.read_msg::<Reply>();
    assert!(started.elapsed() < Duration::from_secs(5), "the refusal took {:?}", started.elapsed());
    let refusal = format!("{reply:?}");
    assert!(refusal.contains("ended"), "expected a refusal naming the ended session, got {refusal}");

    // The server goes on serving.
    let src = env.path("src");
    write_random(&src.join("a.dat"), 1000, 3);
    env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
}

/// Regression: a token file anyone could read was accepted with a warning.
/// Now both ends refuse it, saying how to fix it.
#[test]
fn a_token_file_group_or_others_can_read_is_refused_at_both_ends() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let src = env.path("src");
    write_random(&src.join("a.dat"), 1000, 4);
    let fix = format!("chmod 600 {}", env.token.display());
    for mode in [0o644, 0o640, 0o604] {
        chmod(&env.token, mode);
        let r = dmover(["serve", "--listen", "127.0.0.1:0", "--export"])
            .arg(format!("e={}", export.display()))
            .arg("--token-file")
            .arg(&env.token)
            .timeout(Duration::from_secs(20))
            .run();
        r.assert_fails(2, &[&fix]);
        env.cp([src.display().to_string(), srv.url("e")]).run().assert_fails(2, &[&fix]);
    }
    assert!(!export.join("src").exists());
}

#[test]
fn token_file_too_short_is_a_usage_error() {
    let env = Env::new();
    let export = env.mkdir("export");
    let short = env.path("short");
    fs::write(&short, "abc\n").unwrap();
    let r = dmover(["serve", "--listen", "127.0.0.1:0", "--export"])
        .arg(format!("e={}", export.display()))
        .arg("--token-file")
        .arg(&short)
        .timeout(Duration::from_secs(20))
        .run();
    r.assert_fails(2, &["short"]);
}

/// A symlink inside an export that leads out is refused for reading and for
/// writing, the refusal is logged, and nothing outside is read or touched.
#[test]
fn symlinks_leading_out_of_an_export_are_refused() {
    let env = Env::new();
    let export = env.mkdir("export");
    let outside = env.mkdir("outside");
    write_random(&outside.join("secret.dat"), 5000, 3);
    write_random(&outside.join("victim.dat"), 5000, 4);
    let victim_before = fs::read(outside.join("victim.dat")).unwrap();
    fs::create_dir_all(export.join("tree/sub")).unwrap();
    write_random(&export.join("tree/sub/fine.dat"), 100, 5);
    symlink(&outside, export.join("tree/out")).unwrap(); // a directory leading out
    symlink(outside.join("secret.dat"), export.join("tree/sub/secret.dat")).unwrap(); // a file leading out
    symlink(outside.join("victim.dat"), export.join("victim.dat")).unwrap();
    let srv = env.serve(&[("e", &export)]);

    // Reading through them, named directly.
    let down = env.mkdir("down");
    env.cp([srv.url("e/tree/out/secret.dat"), down.display().to_string()]).run().assert_fails(8, &["tree/out"]);
    env.cp([srv.url("e/tree/out/"), down.display().to_string()]).run().assert_fails(8, &["tree/out"]);
    env.cp([srv.url("e/tree/sub/secret.dat"), down.display().to_string()]).run().assert_fails(8, &["secret.dat"]);
    // Reading a tree that contains them: they are skipped, never followed,
    // and the rest of the tree arrives (CLI.md: symlinks inside a source tree
    // are skipped); the server logs each one.
    let j = env.cp([srv.url("e/tree"), down.display().to_string()]).run().assert_ok();
    assert_eq!(u(&j["files"]), 1, "only tree/sub/fine.dat is a regular file in tree/: {j:#}");
    assert_eq!(list_tree(&down).into_keys().collect::<Vec<_>>(), ["tree", "tree/sub", "tree/sub/fine.dat"], "what was downloaded");
    assert!(same_content(&export.join("tree/sub/fine.dat"), &down.join("tree/sub/fine.dat")), "tree/sub/fine.dat arrived damaged");
    for link in ["tree/out", "tree/sub/secret.dat"] {
        assert!(
            srv.log().lines().any(|l| l.contains(link) && l.contains("symbolic link skipped")),
            "the server did not log that it skipped {link}:\n{}",
            srv.log()
        );
    }
    let glob_down = env.mkdir("down-glob");
    let j = env.cp([srv.url("e/**/*.dat"), glob_down.display().to_string()]).run().assert_ok();
    assert_eq!(u(&j["files"]), 1, "a glob over the export matched a symlink: {j:#}");
    assert_eq!(list_files(&glob_down).into_keys().collect::<Vec<_>>(), ["tree/sub/fine.dat"], "what the glob downloaded");
    assert!(same_content(&export.join("tree/sub/fine.dat"), &glob_down.join("tree/sub/fine.dat")), "fine.dat arrived damaged");

    // Writing through them.
    let src = env.path("src");
    write_random(&src.join("victim.dat"), 777, 6);
    write_random(&src.join("secret.dat"), 777, 7);
    env.cp([src.join("victim.dat").display().to_string(), srv.url("e/tree/out/")]).run().assert_fails(8, &["tree/out"]);
    env.cp([src.display().to_string(), srv.url("e/tree/out/x")]).run().assert_fails(8, &["tree/out"]);
    env.cp([src.join("victim.dat").display().to_string(), srv.url("e/tree/out/victim.dat")]).run().assert_fails(8, &["tree/out"]);
    // A file named on the command line that is a symlink leading out.
    env.cp([src.join("victim.dat").display().to_string(), srv.url("e/tree/sub/secret.dat")]).run().assert_fails(8, &["secret.dat"]);
    env.cp([src.join("victim.dat").display().to_string(), srv.url("e/victim.dat")]).run().assert_fails(8, &["victim.dat"]);
    // A tree of which one part would land below a symlink leading out: that
    // part is refused and named in the report (exit 8), the rest arrives.
    let mixed = env.path("mixed");
    write_random(&mixed.join("ok.dat"), 4321, 12);
    write_random(&mixed.join("out/x.dat"), 1234, 13);
    let r = env.cp([format!("{}/", mixed.display()), srv.url("e/tree")]).run();
    assert_eq!(r.code, 8, "exit code for a copy of which one file was refused (want 8)\nstdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    let j = r.json();
    assert_eq!(j["ok"], false, "{j:#}");
    let errors = j["errors"].as_array().unwrap_or_else(|| panic!("no errors array: {j:#}"));
    assert_eq!(errors.len(), 1, "exactly out/x.dat was refused: {j:#}");
    assert_eq!(errors[0]["kind"], "refused", "{j:#}");
    assert!(errors[0]["path"].as_str().is_some_and(|p| p.contains("out/x.dat")), "the error does not name out/x.dat: {j:#}");
    assert!(
        same_content(&mixed.join("ok.dat"), &export.join("tree/ok.dat")),
        "ok.dat did not arrive (or arrived damaged) beside the refused file"
    );

    assert_eq!(fs::read(outside.join("victim.dat")).unwrap(), victim_before, "a file outside the export was overwritten");
    assert_eq!(
        list_tree(&outside).into_keys().collect::<Vec<_>>(),
        ["secret.dat", "victim.dat"],
        "something was created outside the export"
    );
    let log = srv.log();
    assert!(log.lines().filter(|l| l.contains("refused") && l.contains("symlink")).count() >= 3, "the refusals were not logged:\n{log}");
}

/// Files inside a directory being uploaded that already exist at the
/// destination as symlinks (at the final name, or at the temporary name) are
/// replaced by the real files, never written through: the copy succeeds and
/// the files outside the export are untouched.
#[test]
fn planted_symlinks_in_the_destination_are_not_written_through() {
    let env = Env::new();
    let export = env.mkdir("export");
    let outside = env.mkdir("outside");
    write_random(&outside.join("victim1"), 5000, 8);
    write_random(&outside.join("victim2"), 5000, 9);
    write_random(&outside.join("victim3"), 5000, 10);
    let before1 = fs::read(outside.join("victim1")).unwrap();
    let before2 = fs::read(outside.join("victim2")).unwrap();
    let before3 = fs::read(outside.join("victim3")).unwrap();
    let mode3 = fs::metadata(outside.join("victim3")).unwrap().permissions().mode();
    fs::create_dir_all(export.join("in/src")).unwrap();
    symlink(outside.join("victim1"), export.join("in/src/a.dat")).unwrap();
    symlink(outside.join("victim2"), export.join("in/src/.b.dat.dmover-part")).unwrap();
    // An empty file is made under its final name where nothing has it.
    symlink(outside.join("victim3"), export.join("in/src/c.dat")).unwrap();
    let srv = env.serve(&[("e", &export)]);
    let src = env.path("src");
    write_random(&src.join("a.dat"), 3000, 10);
    write_random(&src.join("b.dat"), 3000, 11);
    fs::write(src.join("c.dat"), b"").unwrap();
    fs::set_permissions(src.join("c.dat"), fs::Permissions::from_mode(0o600)).unwrap();
    env.cp([src.display().to_string(), srv.url("e/in")]).run().assert_ok();
    assert_eq!(fs::read(outside.join("victim1")).unwrap(), before1, "written through a symlink at the final name");
    assert_eq!(fs::read(outside.join("victim2")).unwrap(), before2, "written through a symlink at the temporary name");
    assert_eq!(fs::read(outside.join("victim3")).unwrap(), before3, "an empty file truncated what a symlink at its name led to");
    let mode = fs::metadata(outside.join("victim3")).unwrap().permissions().mode();
    assert_eq!(mode, mode3, "an empty file's mode was set through a symlink at its name");
    let names = list_tree(&outside).into_keys().collect::<Vec<_>>();
    assert_eq!(names, ["victim1", "victim2", "victim3"], "something was created outside the export");
    // The symlinks are gone: a.dat, b.dat and c.dat are the real files, nothing else is left.
    assert_same_tree(&src, &export.join("in/src"));
}

/// What a local user with write access to an export plants before a
/// transfer, pointing out of it: a directory `outside` holding one file,
/// `victim`. Returns `outside` and the victim's bytes.
fn outside_target(env: &Env) -> (std::path::PathBuf, Vec<u8>) {
    let outside = env.mkdir("outside");
    write_random(&outside.join("victim"), 5000, 20);
    let before = fs::read(outside.join("victim")).unwrap();
    (outside, before)
}

/// Checks that nothing was written through a planted link: `outside`
/// holds its victim alone, as it was.
#[track_caller]
fn assert_untouched(outside: &Path, before: &[u8]) {
    assert_eq!(list_tree(outside).into_keys().collect::<Vec<_>>(), ["victim"], "something was created through a planted link");
    assert!(fs::read(outside.join("victim")).unwrap() == before, "the victim outside the export was written through a planted link");
}

/// README, Security: the destination's state directory, `.dmover-partial`,
/// planted as a symlink to a directory outside the export before an
/// upload, is never followed: the upload is refused naming it (the user
/// must remove it), and nothing is written outside.
#[test]
fn a_state_directory_planted_as_a_symlink_is_refused_not_followed() {
    let env = Env::new();
    let export = env.mkdir("export");
    let (outside, before) = outside_target(&env);
    fs::create_dir_all(export.join("in")).unwrap();
    symlink(&outside, export.join("in/.dmover-partial")).unwrap();
    let srv = env.serve(&[("e", &export)]);
    let src = env.path("src");
    write_random(&src.join("big.dat"), 300_000, 21);
    let r = env.cp([src.join("big.dat").display().to_string(), srv.url("e/in/"), "--block-size".into(), "64K".into()]).run();
    r.assert_fails(8, &["e/in/.dmover-partial", "symlinks are not followed"]);
    assert_untouched(&outside, &before);
    assert!(!export.join("in/big.dat").exists(), "a file was received without its state directory");
}

/// README, Security: a symlink planted at the name of the journal an upload
/// is about to write (`.dmover-partial/HASH.journal`, the XXH3-128 of the
/// file's path, as `engine/src/journal.rs` names it) is replaced, never
/// written through: the upload succeeds and the file it led to is intact.
#[test]
fn a_symlink_planted_at_a_journals_name_is_replaced_not_written_through() {
    let env = Env::new();
    let export = env.mkdir("export");
    let (outside, before) = outside_target(&env);
    let state = export.join("in/.dmover-partial");
    fs::create_dir_all(&state).unwrap();
    let journal = state.join(format!("{:032x}.journal", u128::from_be_bytes(dmover_proto::digest::block_sum(b"big.dat"))));
    symlink(outside.join("victim"), &journal).unwrap();
    let srv = env.serve(&[("e", &export)]);
    let src = env.path("src");
    // Five blocks: a file of more than one has a journal.
    write_random(&src.join("big.dat"), 300_000, 22);
    env.cp([src.join("big.dat").display().to_string(), srv.url("e/in/"), "--block-size".into(), "64K".into()]).run().assert_ok();
    assert_untouched(&outside, &before);
    assert!(same_content(&src.join("big.dat"), &export.join("in/big.dat")), "big.dat arrived damaged");
    assert!(fs::symlink_metadata(&journal).is_err(), "the journal's name still holds something after the upload finished");
}

/// README, Security: symlinks planted in a producer's directory at the
/// names a sink is about to write for a step (its manifest `step-*.json`,
/// the manifest's temporary name and the data file) are replaced, never
/// written through: the step is saved complete and the files they led to
/// are intact.
#[test]
fn symlinks_planted_at_a_sinks_step_names_are_replaced_not_written_through() {
    use dmover_stream::{Config, Stream};
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let (outside, before) = outside_target(&env);
    let dir = out.join("planted");
    fs::create_dir_all(&dir).unwrap();
    for name in ["step-000000.json", ".step-000000.json.tmp", "step-000000.dat"] {
        symlink(outside.join("victim"), dir.join(name)).unwrap();
    }
    let sink = env.sink(&out, std::iter::empty::<&str>());
    let mut c = Config::new("planted", &[&sink.addr()], env.token_str().as_bytes(), &spill);
    c.block_size = 64 << 10;
    c.max_wait = Duration::from_secs(30);
    let mut data = vec![0u8; 200_000];
    Rng::new(23).fill(&mut data);
    let mut s = Stream::open(c).unwrap();
    s.write(&data).unwrap();
    s.end_step().unwrap();
    let report = s.close().unwrap();
    assert_eq!((report.steps, report.undelivered_blocks, report.unsaved_steps), (1, 0, 0), "{report:?}\n{}", sink.log());
    assert_untouched(&outside, &before);
    assert!(fs::read(dir.join("step-000000.dat")).unwrap() == data, "the step's data file does not hold the step");
    let manifest: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("step-000000.json")).unwrap()).unwrap();
    assert_eq!(manifest["complete"], true, "{manifest:#}");
    for name in ["step-000000.json", "step-000000.dat"] {
        assert!(fs::symlink_metadata(dir.join(name)).unwrap().is_file(), "{name} is not the file the sink wrote");
    }
    assert!(!dir.join(".step-000000.json.tmp").exists(), "the manifest's temporary name was left behind");
}

/// Sends `bytes` on a fresh connection, then reads until the server closes
/// it (at most 15 s): how long the server kept it open after the bytes.
fn send_garbage(addr: &str, bytes: &[u8]) -> Duration {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("cannot connect to the server at {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
    }
    t.elapsed()
}

#[test]
fn garbage_on_the_port_does_not_crash_the_server() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut srv = env.serve(&[("e", &export)]);
    let addr = srv.addr();
    // A silent connection that stays open through everything below.
    let silent = TcpStream::connect(&addr).unwrap();

    let mut rng = Rng::new(99);
    let mut payloads: Vec<Vec<u8>> = Vec::new();
    for size in [1, 7, 8, 100, 4096, 1 << 20] {
        let mut b = vec![0u8; size];
        rng.fill(&mut b);
        payloads.push(b);
    }
    payloads.push(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec());
    payloads.push(vec![0u8; 64]);
    payloads.push(vec![0xff; 64]);
    // Headers that claim huge or impossible bodies (kind, flags, reserved, length).
    payloads.push([1u8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff].to_vec());
    payloads.push([64u8, 0, 0, 0, 0x04, 0x00, 0x00, 0x20].to_vec()); // data frame of 64 MiB before authenticating
    payloads.push([64u8, 0, 0, 0, 0, 0, 0, 4].to_vec()); // data frame shorter than its own header
    let mut hello = [1u8, 0, 0, 0, 0, 0x10, 0, 0].to_vec(); // a 1 MiB control frame, cut short
    hello.extend_from_slice(b"DMOVER\0\x01");
    payloads.push(hello);
    let mut hello = [1u8, 0, 0, 0, 0, 0, 0, 40].to_vec(); // the magic, then nonsense
    hello.extend_from_slice(b"DMOVER\0\x01");
    hello.extend_from_slice(&[0xAB; 32]);
    payloads.push(hello);
    for kind in 0..=255u8 {
        let mut b = vec![kind, 0, 0, 0, 0, 0, 0, 48];
        let mut body = vec![0u8; 48];
        rng.fill(&mut body);
        b.extend_from_slice(&body);
        payloads.push(b);
    }
    // Many at once, as well as one after another: each is closed soon.
    std::thread::scope(|s| {
        for (c, chunk) in payloads.chunks(16).enumerate() {
            let addr = addr.clone();
            s.spawn(move || {
                for (i, p) in chunk.iter().enumerate() {
                    let took = send_garbage(&addr, p);
                    let head = &p[..p.len().min(16)];
                    let n = c * 16 + i;
                    assert!(took < Duration::from_secs(5), "payload {n} ({head:02x?}...) was kept open {took:?}");
                }
            });
        }
    });
    assert!(srv.running(), "the server died:\n{}", srv.log());
    assert!(!srv.log().contains("panicked"), "a server thread panicked:\n{}", srv.log());
    // It noticed and logged every bad connection: a line each, or counted
    // in a summary line within a second (the silent one, warned of at the
    // handshake timeout, not counted). It warned of each that holds a
    // whole header and the body it claims; one cut short may be taken for a
    // client that went away.
    let cut_short =
        payloads.iter().filter(|p| p.len() < 8 || p.len() - 8 < u32::from_be_bytes(p[4..8].try_into().unwrap()) as usize).count();
    let counts = || {
        let log = srv.log();
        let warned = logged_connections(&log, " WARN ") - logged_connections(&log, "did not authenticate within");
        (warned, logged_connections(&log, "the peer closed the connection"))
    };
    let noticed = wait_until(Duration::from_secs(5), || {
        let (warned, gone) = counts();
        warned >= payloads.len() - cut_short && warned + gone >= payloads.len()
    });
    let (warned, gone) = counts();
    assert!(
        noticed,
        "of {} bad connections ({cut_short} cut short), {warned} were warned of and {gone} logged as closed by the peer:\n{}",
        payloads.len(),
        srv.log()
    );

    // It still serves real clients, in both directions.
    let src = env.path("src");
    make_tree(&src, 12, 5);
    env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
    assert_same_tree(&src, &export.join("src"));
    let down = env.mkdir("down");
    env.cp([srv.url("e/src"), down.display().to_string()]).run().assert_ok();
    assert_same_tree(&src, &down.join("src"));
    assert!(srv.running());
    drop(silent);
}

#[test]
fn sigterm_and_sigint_make_an_idle_server_exit_0() {
    let env = Env::new();
    let export = env.mkdir("export");
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut srv = env.serve(&[("e", &export)]);
        // It works before the signal.
        let src = env.path("src");
        make_tree(&src, 13, 1);
        env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
        srv.signal(sig);
        let st = srv.wait_exit(Duration::from_secs(20));
        let st = st.unwrap_or_else(|| panic!("the server did not exit within 20 s of signal {sig}:\n{}", srv.log()));
        assert_eq!(st.code(), Some(0), "exit status after signal {sig}: {st:?}\n{}", srv.log());
    }
}

/// SIGTERM during a transfer: the running transfer is allowed to finish
/// (within --grace), then the server exits 0.
#[test]
fn sigterm_lets_a_running_transfer_finish() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut srv = env.serve(&[("e", &export)]);
    let src = env.path("src");
    write_random(&src.join("big.dat"), 6 << 20, 14);
    let mut p = env.cp([src.display().to_string(), srv.url("e"), "--bwlimit".into(), "3M".into(), "--retries".into(), "0".into()]).spawn();
    assert!(wait_until(Duration::from_secs(60), || written_bytes(&export) >= 1 << 20 || !p.running()), "no progress");
    assert!(p.running(), "the transfer finished before the signal");
    srv.signal(libc::SIGTERM);
    let r = p.wait();
    r.assert_ok();
    assert_same_tree(&src, &export.join("src"));
    let st = srv.wait_exit(Duration::from_secs(30)).unwrap_or_else(|| panic!("the server did not exit after the transfer:\n{}", srv.log()));
    assert_eq!(st.code(), Some(0), "{}", srv.log());
}

/// Files and empty directories with setuid, setgid and sticky bits, and
/// the modes a receiver under umask 000 must give them (their permission
/// bits alone, and a directory's sticky bit).
fn special_modes(root: &Path) -> Vec<(&'static str, u32)> {
    let entries = [
        ("suid", 0o4755, false),
        ("sgid", 0o2755, false),
        ("all", 0o6777, false),
        ("sgid-dir", 0o2777, true),
        ("sticky-dir", 0o1777, true),
    ];
    plant_modes(root, &entries);
    entries.iter().map(|(name, mode, dir)| (*name, mode & if *dir { 0o1777 } else { 0o777 })).collect()
}

#[track_caller]
fn assert_modes(root: &Path, expected: &[(&str, u32)]) {
    for (name, mode) in expected {
        let got = fs::symlink_metadata(root.join(name)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(got, *mode, "{name} landed with mode {got:o}, not {mode:o}");
    }
}

/// Regression: announced modes were applied whole, so a file of mode 4755
/// uploaded to a server running as root landed setuid root, directories
/// kept setgid bits, and a server could plant setuid files in a root
/// client's download. Now a receiver never applies setuid and setgid bits
/// (a directory keeps its sticky bit, which only restricts).
#[test]
fn setuid_and_setgid_bits_are_dropped_on_upload_and_download() {
    if !dmover_testkit::needs_root("files owned by root with setuid bits") {
        return;
    }
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.prefix = under_umask(0);
    let srv = Server::start(spec);
    let src = env.path("src");
    let expected = special_modes(&src);
    env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
    assert_modes(&export.join("src"), &expected);

    special_modes(&export.join("planted"));
    let down = env.mkdir("down");
    env.cp([srv.url("e/planted"), down.display().to_string()]).prefix(under_umask(0)).run().assert_ok();
    assert_modes(&down.join("planted"), &expected);
}

/// A world-writable file, a private one in a world-writable directory, a
/// world-writable empty directory and a sticky one.
const OPEN_MODES: [(&str, u32, bool); 5] =
    [("open.dat", 0o666, false), ("d/private.dat", 0o600, false), ("d", 0o777, true), ("empty", 0o777, true), ("shared", 0o1777, true)];

fn make_open_modes(root: &Path) {
    plant_modes(root, &OPEN_MODES);
}

/// Makes each (name, mode, is a directory) below `root`: a file of random
/// bytes or a directory, then given its mode.
fn plant_modes(root: &Path, entries: &[(&str, u32, bool)]) {
    for &(name, mode, dir) in entries {
        let p = root.join(name);
        if dir {
            fs::create_dir_all(&p).unwrap();
        } else {
            write_random(&p, 3000, mode as u64);
        }
        chmod(&p, mode);
    }
}

/// The modes a receiver under `umask` must give [`OPEN_MODES`].
fn masked(umask: u32) -> Vec<(&'static str, u32)> {
    OPEN_MODES.iter().map(|(name, mode, _)| (*name, mode & !umask)).collect()
}

/// Regression: files and directories landed with the source's mode whatever
/// the receiving side's umask, so a 0666 file and a 0777 directory arrived
/// world-writable. Now a receiver masks the source's mode with its own
/// umask, as rsync does without `--perms`: the server's for an upload (the
/// client's does not matter), the client's for a download or a local copy.
#[test]
fn received_modes_are_masked_by_the_receivers_umask() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.prefix = under_umask(0o022);
    let srv = Server::start(spec);

    let src = env.path("src");
    make_open_modes(&src);
    env.cp([src.display().to_string(), srv.url("e")]).prefix(under_umask(0)).run().assert_ok();
    assert_modes(&export.join("src"), &masked(0o022));

    make_open_modes(&export.join("planted"));
    let down = env.mkdir("down");
    env.cp([srv.url("e/planted"), down.display().to_string()]).prefix(under_umask(0o027)).run().assert_ok();
    assert_modes(&down.join("planted"), &masked(0o027));

    let local = env.mkdir("local");
    env.cp([src.display().to_string(), local.display().to_string()]).prefix(under_umask(0o077)).run().assert_ok();
    assert_modes(&local.join("src"), &masked(0o077));

    // --perms (and -a) keep them whole, whatever the receiver's umask, as
    // rsync -p does: at the server for an upload, at the client for a download.
    env.cp([src.display().to_string(), srv.url("e/whole"), "--perms".into()]).run().assert_ok();
    assert_modes(&export.join("whole/src"), &masked(0));
    let whole = env.mkdir("whole");
    env.cp([srv.url("e/planted"), whole.display().to_string(), "-a".into()]).prefix(under_umask(0o077)).run().assert_ok();
    assert_modes(&whole.join("planted"), &masked(0));
}

/// Regression: names with terminal escapes and newlines were printed raw by
/// `dmover ls` and logged raw, so a file name could clear a terminal or
/// forge a log line. Now control characters are escaped (`\u{1b}`, `\n`).
#[test]
fn names_with_escapes_and_newlines_are_escaped_by_ls_and_in_logs() {
    use dmover_proto::frame::{FileMeta, TransferFlags, TransferOptions};
    use dmover_proto::Msg;
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("d/evil\x1b[2Jname"), 10, 1);
    write_random(&export.join("d/two\n[2026-01-01T00:00:00Z INFO ] forged"), 10, 2);
    let srv = env.serve(&[("e", &export)]);
    let r = dmover(["ls", "--token-file"]).arg(&env.token).arg(srv.url("e/d/")).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!r.stdout.contains('\x1b'), "ls printed an escape character:\n{:?}", r.stdout);
    assert_eq!(r.stdout.lines().count(), 2, "ls printed a name over two lines:\n{}", r.stdout);
    assert!(r.stdout.contains("evil\\u{1b}[2Jname") && r.stdout.contains("two\\n[2026"), "{}", r.stdout);

    // A name refused at the server is logged escaped.
    let mut c = Raw::control(&srv.addr(), env.token_str().as_bytes());
    let options = TransferOptions { transfer_id: [40; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    c.send(&Msg::Receive { dest: "e/in".into(), options });
    assert!(matches!(c.read(), Some(Msg::SessionOpened { .. })));
    let meta = FileMeta {
        path: "../\x1b[2J\n[2026-01-01T00:00:00Z INFO ] forged".into(),
        size: 1,
        mtime_s: 0,
        mtime_ns: 0,
        mode: 0o644,
        ..Default::default()
    };
    c.send(&Msg::Announce { id: 1, meta, digest: None });
    assert!(matches!(c.read(), Some(Msg::Failed { .. })));
    let log = srv.log();
    assert!(log.contains("\\u{1b}[2J\\n"), "the refusal was not logged escaped:\n{log}");
    assert!(!log.contains('\x1b') && !log.lines().any(|l| l.starts_with("[2026-01-01")), "a name was logged raw:\n{log}");
}
