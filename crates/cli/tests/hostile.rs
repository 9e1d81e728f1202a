//! Hostile peers speaking the wire protocol directly, with or without the
//! token: malformed frames, oversized lengths, idle, trickling and
//! half-open connections, paths that try to leave the export, forged and
//! replayed handshakes, links planted in the destination. Each must be
//! refused and logged while the server keeps serving honest clients.
//! (Garbage before the handshake, wrong tokens and symlinks through the
//! command line are in `security.rs` and `bad_input.rs`.)

mod util;

use dmover_proto::auth::{KeyId, TOKEN_KEY_ID};
use dmover_proto::frame::{EngineParams, FileMeta, Owner, TicketedHost, TransferFlags, TransferOptions, Xattr, MAX_FILE_BLOCKS};
use dmover_proto::{ErrorKind, Msg};
use std::fs;
use std::io::Write;
use std::net::Shutdown;
use std::os::unix::fs::{symlink, MetadataExt};
use std::path::Path;
use std::time::{Duration, Instant};
use util::*;

/// WARN lines in a server log.
fn warnings(srv: &Server) -> usize {
    srv.log().lines().filter(|l| l.contains("WARN")).count()
}

/// A slow honest upload, to check that the server keeps serving it while it
/// is attacked. Returns the process and where the data goes.
fn honest_upload(env: &Env, srv: &Server) -> (Proc, std::path::PathBuf, std::path::PathBuf) {
    let src = env.path("honest");
    make_tree(&src, 3, 20);
    let export = srv.spec.exports[0].1.clone();
    let p = env.cp([src.display().to_string(), srv.url("e/honest-in"), "--bwlimit".into(), "4M".into()]).spawn();
    (p, src, export.join("honest-in/honest"))
}

#[test]
fn malformed_frames_after_authentication_are_refused_and_logged_while_others_are_served() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut srv = env.serve(&[("e", &export)]);
    let addr = srv.addr();
    let token = env.token_str();
    let (p, src, dst) = honest_upload(&env, &srv);
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("unknown kind", vec![99, 0, 0, 0, 0, 0, 0, 0]),
        ("control body over 1 MiB", vec![14, 0, 0, 0, 0, 0x10, 0, 1]),
        ("length 2^32-1", vec![14, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
        ("data frame on a control connection", {
            let mut b = vec![64, 0, 0, 0, 0, 0, 0, 42];
            b.extend_from_slice(&[0; 42]);
            b
        }),
        ("data frame shorter than its header", vec![64, 0, 0, 0, 0, 0, 0, 4, 1, 2, 3, 4]),
        ("bytes left over", vec![39, 0, 0, 0, 0, 0, 0, 4, 1, 2, 3, 4]),
    ];
    // A string that claims more bytes than the body holds.
    let mut b = vec![23, 0, 0, 0, 0, 0, 0, 8];
    b.extend_from_slice(&[0, 0, 0x10, 0, b'e', b'/', b'x', b'y']);
    cases.push(("string longer than its frame", b));
    // Invalid UTF-8 in a path.
    let mut b = vec![23, 0, 0, 0, 0, 0, 0, 7];
    b.extend_from_slice(&[0, 0, 0, 3, b'e', 0xff, 0xfe]);
    cases.push(("invalid UTF-8", b));
    // A list claiming 2^32-1 sources in a small body.
    let mut b = vec![15, 0, 0, 0, 0, 0, 0, 8];
    b.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
    cases.push(("huge item count", b));
    for (what, bytes) in &cases {
        let before = warnings(&srv);
        let mut c = Raw::control(&addr, token.as_bytes());
        c.raw(bytes);
        let took = c.wait_closed();
        assert!(took < Duration::from_secs(5), "{what}: the server kept the connection open for {took:?}");
        assert!(wait_until(Duration::from_secs(5), || warnings(&srv) > before), "{what}: not logged:\n{}", srv.log());
    }
    let r = p.wait();
    r.assert_ok();
    assert_same_tree(&src, &dst);
    assert!(srv.running(), "{}", srv.log());
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
}

/// Regression: an unauthenticated peer could make the server reserve a
/// megabyte with an 8-byte header announcing a 1 MiB `Hello`, and hold it
/// for the handshake timeout; a few hundred such connections cost hundreds
/// of megabytes. Now the handshake accepts only small frames. A reservation
/// never written to is not resident: the address space is measured too.
#[test]
fn unauthenticated_header_announcing_a_megabyte_reserves_nothing() {
    const CONNS: usize = 200;
    let env = Env::new();
    let export = env.mkdir("export");
    // Threads with 256 KiB stacks and one malloc arena: with the usual
    // 2 MiB stacks, and 64 MiB of address space reserved for each arena a
    // busy thread adds, how many connection threads a loaded machine
    // keeps alive at once moved the server's data by more than what a
    // megabyte reserved for each header would.
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.envs = vec![("MALLOC_ARENA_MAX".into(), Some("1".into())), ("RUST_MIN_STACK".into(), Some("262144".into()))];
    let srv = Server::start(spec);
    let addr = srv.addr();
    // Memory (RSS, data, address space) and threads, sampled together.
    let memory = || ["VmRSS:", "VmData:", "VmSize:", "Threads:"].map(|f| proc_status(srv.pid(), f));
    let threads = || proc_status(srv.pid(), "Threads:");
    // CONNS connections sending `header`: the most the server's memory
    // grew (RSS, data, address space), sampled until `done`.
    let peak_growth = |header: &[u8], done: &dyn Fn() -> bool| {
        let before = memory();
        let conns: Vec<Raw> = (0..CONNS)
            .map(|_| {
                let mut c = Raw::connect(&addr);
                c.raw(header);
                c
            })
            .collect();
        let mut peak = before;
        let finished = wait_until(Duration::from_secs(5), || {
            let now = memory();
            peak = std::array::from_fn(|i| peak[i].max(now[i]));
            done()
        });
        (std::array::from_fn::<u64, 4, _>(|i| peak[i].saturating_sub(before[i])), conns, finished)
    };
    // First, as many connections that send the header of a 40-byte Hello
    // and never its body, each served by a thread until they hang up: the
    // threads' stacks and the C library's arenas are there before the
    // headers below are measured.
    let idle = threads();
    let (_, conns, _) = peak_growth(&[1, 0, 0, 0, 0, 0, 0, 40], &|| threads() >= idle + CONNS as u64);
    drop(conns);
    assert!(wait_until(Duration::from_secs(5), || threads() <= idle + 1), "the connections that hung up are still served");
    for (claim, header) in [("1 MiB", [1, 0, 0, 0, 0, 0x10, 0, 0]), ("4 GiB", [1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff])] {
        let refused = logged_connections(&srv.log(), "bytes, more than the ");
        let all_refused = || logged_connections(&srv.log(), "bytes, more than the ") >= refused + CONNS;
        let (grew, mut conns, all) = peak_growth(&header, &all_refused);
        eprintln!("server RSS, data, size (KiB) and threads grew by {grew:?} for {CONNS} headers announcing {claim}");
        // Data counts what is reserved, touched or not: a megabyte
        // reserved for each header is 200 MiB.
        for (i, field) in ["RSS", "data", "address space"].into_iter().enumerate() {
            assert!(
                grew[i] < 128 * 1024,
                "the server's {field} grew by {} KiB for {CONNS} headers announcing {claim} each ({} threads more at most)",
                grew[i],
                grew[3]
            );
        }
        for c in &mut conns {
            let t = c.wait_closed();
            assert!(t < Duration::from_secs(5), "a header announcing {claim} was not refused at once: closed after {t:?}");
        }
        assert!(all, "not every header announcing {claim} was refused:\n{}", srv.log());
    }
}

/// Regression: the handshake timeout was a read timeout, which starts again
/// with every byte: a peer sending its `Hello` one byte a second held a
/// connection slot for a minute. Now the whole handshake has 10 s.
#[test]
fn slowloris_trickling_its_handshake_is_cut_off_after_the_handshake_timeout() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let addr = srv.addr();
    let hello = Raw::bytes(&Raw::hello(TOKEN_KEY_ID, env.token_str().as_bytes()).1);
    let (p, src, dst) = honest_upload(&env, &srv);
    let cut_after: Vec<Duration> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..16)
            .map(|_| {
                let (addr, hello) = (&addr, &hello);
                s.spawn(move || {
                    let mut c = Raw::connect(addr);
                    let t = Instant::now();
                    for b in hello {
                        if c.s.write_all(&[*b]).is_err() {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(700));
                        if t.elapsed() > Duration::from_secs(30) {
                            break;
                        }
                    }
                    c.wait_closed();
                    t.elapsed()
                })
            })
            .collect();
        // Silent connections too.
        let silent: Vec<_> = (0..16)
            .map(|_| {
                let addr = &addr;
                s.spawn(move || {
                    let mut c = Raw::connect(addr);
                    c.wait_closed()
                })
            })
            .collect();
        hs.into_iter().chain(silent).map(|h| h.join().unwrap()).collect()
    });
    for t in &cut_after {
        assert!(*t < Duration::from_secs(14), "a connection that never completed its handshake was kept {t:?}");
        assert!(*t >= Duration::from_secs(9), "a connection was closed after {t:?}, before the handshake timeout");
    }
    p.wait().assert_ok();
    assert_same_tree(&src, &dst);
    // A line each, or counted in a summary line within a second.
    let all = wait_until(Duration::from_secs(5), || logged_connections(&srv.log(), "did not authenticate within 10 s") >= 32);
    let log = srv.log();
    let n = logged_connections(&log, "did not authenticate within 10 s");
    assert!(all, "only {n} of 32 slow connections were logged:\n{log}");
}

/// Every connection slot taken by silent authenticated peers: an honest
/// client is told the server is busy, retries, and gets through once the
/// silent ones are cut off by the idle timeout.
#[test]
fn all_slots_taken_by_idle_peers_an_honest_client_gets_through_after_the_timeout() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    let metrics = format!("127.0.0.1:{}", closed_port());
    spec.extra = ["--max-connections", "8", "--idle-timeout", "3", "--metrics", &metrics].map(Into::into).to_vec();
    let srv = Server::start(spec);
    let token = env.token_str();
    let idle: Vec<Raw> = (0..8).map(|_| Raw::control(&srv.addr(), token.as_bytes())).collect();
    // A connection takes its slot just after the welcome it was sent.
    let authenticated = || {
        let page = http_get(&metrics, "/metrics").map(|(_, p)| p).unwrap_or_default();
        sample(&page, "dmover_connections_total{outcome=\"authenticated\"}") == Some(8.0)
    };
    assert!(wait_until(Duration::from_secs(10), authenticated), "the 8 idle peers did not all take a slot within 10 s");
    let src = env.path("src");
    make_tree(&src, 5, 5);
    let r = env.cp([src.display().to_string(), srv.url("e"), "-p".into(), "2".into()]).run();
    r.assert_ok();
    assert_same_tree(&src, &export.join("src"));
    assert!(srv.log().contains("too many connections"), "{}", srv.log());
    drop(idle);
}

/// Half-open and idle connections are closed, at every stage: a half-open
/// one as soon as its end of stream is seen, an idle one at the idle
/// timeout. The idle timeout is long so that it cannot be what closes the
/// half-open ones.
#[test]
fn half_open_and_idle_connections_are_closed() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = vec!["--idle-timeout".into(), "10".into()];
    let srv = Server::start(spec);
    let addr = srv.addr();
    let token = env.token_str();
    let half_open_closed = |stage: &str, c: &mut Raw| {
        c.s.shutdown(Shutdown::Write).unwrap();
        let t = c.wait_closed();
        assert!(t < Duration::from_secs(1), "a connection half-closed {stage} was kept open {t:?} (idle timeout 10 s)");
    };

    // Hello, then the client stops sending: closed as soon as it is seen.
    let mut c = Raw::connect(&addr);
    c.send(&Raw::hello(TOKEN_KEY_ID, token.as_bytes()).1);
    c.s.shutdown(Shutdown::Write).unwrap();
    assert!(matches!(c.read(), Some(Msg::Challenge { .. })));
    let t = c.wait_closed();
    assert!(t < Duration::from_secs(1), "a connection half-closed during the handshake was kept open {t:?} (idle timeout 10 s)");

    // Authenticated, then half-closed before saying what the connection is for.
    let (mut c, _, _) = Raw::handshake(&addr, token.as_bytes());
    assert_eq!(c.read(), Some(Msg::Welcome));
    half_open_closed("after its handshake", &mut c);

    // A control connection, then half-closed.
    let mut c = Raw::control(&addr, token.as_bytes());
    half_open_closed("on a control connection", &mut c);

    // Authenticated, then silent: closed after the idle timeout.
    let mut c = Raw::control(&addr, token.as_bytes());
    let t = c.wait_closed();
    assert!(
        t >= Duration::from_secs(9) && t < Duration::from_secs(13),
        "an idle control connection was closed after {t:?} (idle timeout 10 s)"
    );
    assert!(srv.log().contains("client hung up during the handshake"), "{}", srv.log());
}

/// Paths that try to leave the export, sent as raw requests and
/// announcements (the client's own checks are bypassed): every one is
/// refused and logged, and nothing outside the export is touched.
#[test]
fn paths_leaving_the_export_are_refused_at_the_wire_level() {
    let env = Env::new();
    let export = env.mkdir("export");
    let outside = env.mkdir("outside");
    write_random(&outside.join("secret.dat"), 1000, 1);
    fs::create_dir_all(export.join("in")).unwrap();
    symlink(&outside, export.join("in/link")).unwrap();
    symlink(&outside, export.join("out")).unwrap();
    let srv = env.serve(&[("e", &export)]);
    let addr = srv.addr();
    let token = env.token_str();
    let opts = TransferOptions { transfer_id: [3; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };

    let mut c = Raw::control(&addr, token.as_bytes());
    for dest in ["e/../outside", "/etc", "e//x", "e/./x", "e/a\0b", "e/a\\..\\b", "e/out", "e/in/link/x", "nosuch/x", "..", ""] {
        c.refused(&Msg::Receive { dest: dest.into(), options: opts }, ErrorKind::Refused);
        c.refused(&Msg::Grant { dest: dest.into() }, ErrorKind::Refused);
    }
    for path in ["e/../outside/secret.dat", "e/out/secret.dat", "e/in/link/secret.dat", "e/in/link", "/etc/passwd", "e/\0"] {
        c.refused(&Msg::List { path: path.into() }, ErrorKind::Refused);
    }

    // Inside a receiving session: announcements of paths that leave it.
    let bad = ["../escape.dat", "/tmp/abs.dat", "a/\0/b", "a/./b", "a//b", "sub/../../x", "link/x", "link/deeper/x", "a\\b"];
    c.announcements_refused("e/in", opts, &bad);

    assert_eq!(list_tree(&outside).into_keys().collect::<Vec<_>>(), ["secret.dat"], "something was created outside the export");
    let log = srv.log();
    let refusals = log.lines().filter(|l| l.contains("refused")).count();
    assert!(refusals >= 22 + 6 + bad.len(), "only {refusals} refusals were logged:\n{log}");
    // Still serving.
    let src = env.path("src");
    make_tree(&src, 4, 3);
    env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
}

/// Forged, missing and replayed proofs are refused; so is a second `Hello`
/// on an authenticated connection.
#[test]
fn forged_missing_and_replayed_handshakes_are_refused() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let addr = srv.addr();
    let token = env.token_str();

    // No proof at all: straight to a request.
    let mut c = Raw::connect(&addr);
    c.send(&Raw::hello(TOKEN_KEY_ID, token.as_bytes()).1);
    assert!(matches!(c.read(), Some(Msg::Challenge { .. })));
    c.send(&Msg::OpenControl);
    c.send(&Msg::List { path: "e".into() });
    assert_eq!(c.read(), None, "a client that skipped its proof got an answer");

    // A forged proof.
    let mut c = Raw::connect(&addr);
    c.send(&Raw::hello(TOKEN_KEY_ID, token.as_bytes()).1);
    assert!(matches!(c.read(), Some(Msg::Challenge { .. })));
    c.send(&Msg::Proof { proof: [0; 16] });
    assert!(matches!(c.read(), Some(Msg::Error { kind: ErrorKind::Auth, .. })));
    assert_eq!(c.read(), None);

    // A ticket that was never issued, proved with the server's token.
    let mut c = Raw::connect(&addr);
    let (i, hello) = Raw::hello([1; 16], token.as_bytes());
    c.send(&hello);
    let Some(Msg::Challenge { challenge }) = c.read() else { panic!("no challenge") };
    assert!(i.finish(&challenge).is_err(), "the server proved it knows a ticket it never issued");

    // A relay that rewrites the client's Hello to name another secret.
    let mut c = Raw::connect(&addr);
    let (_, hello) = Raw::hello(TOKEN_KEY_ID, token.as_bytes());
    let Msg::Hello { hello, protection, .. } = hello else { unreachable!() };
    c.send(&Msg::Hello { key_id: [2; 16], protection, hello });
    assert!(matches!(c.read(), Some(Msg::Error { kind: ErrorKind::Auth, .. })));

    // A recorded handshake replayed on a new connection: the server's new
    // ephemeral key makes the old proof worthless.
    let (mut first, hello, proof) = Raw::handshake(&addr, token.as_bytes());
    assert_eq!(first.read(), Some(Msg::Welcome));
    let mut c = Raw::connect(&addr);
    c.raw(&hello);
    assert!(matches!(c.read(), Some(Msg::Challenge { .. })));
    c.raw(&proof);
    assert!(matches!(c.read(), Some(Msg::Error { kind: ErrorKind::Auth, .. })), "a replayed proof was accepted");

    // A second Hello on the authenticated connection is refused, and the
    // connection gains nothing from it.
    first.send(&Msg::OpenControl);
    first.raw(&hello);
    match first.read() {
        Some(Msg::Error { .. }) | None => {}
        m => panic!("a second Hello was answered with {m:?}"),
    }

    let told = wait_until(Duration::from_secs(5), || logged_connections(&srv.log(), "authentication failed") >= 3);
    let log = srv.log();
    assert!(told, "{log}");
    assert!(log.contains("unexpected OpenControl in the client's handshake"), "{log}");
    let src = env.path("src");
    make_tree(&src, 6, 3);
    env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
}

/// Regression: a hard link planted at a file's temporary name was opened
/// and truncated in place, so an upload overwrote the linked file outside
/// the export. Now the temporary name is unlinked and created afresh; a
/// hard link at the final name is replaced by the rename, never written
/// through.
#[test]
fn planted_hard_links_in_the_destination_are_not_written_through() {
    let env = Env::new();
    let export = env.mkdir("export");
    let outside = env.mkdir("outside");
    write_random(&outside.join("victim1"), 5000, 8);
    write_random(&outside.join("victim2"), 3 << 20, 9);
    write_random(&outside.join("victim3"), 5000, 10);
    write_random(&outside.join("victim4"), 5000, 13);
    let before: Vec<Vec<u8>> = (1..=4).map(|i| fs::read(outside.join(format!("victim{i}"))).unwrap()).collect();
    fs::create_dir_all(export.join("in/src")).unwrap();
    fs::hard_link(outside.join("victim1"), export.join("in/src/a.dat")).unwrap();
    fs::hard_link(outside.join("victim2"), export.join("in/src/.b.dat.dmover-part")).unwrap();
    fs::hard_link(outside.join("victim3"), export.join("in/src/.c.dat.dmover-part")).unwrap();
    fs::hard_link(outside.join("victim4"), export.join("in/src/d.dat")).unwrap();
    let srv = env.serve(&[("e", &export)]);
    let src = env.path("src");
    write_random(&src.join("a.dat"), 3000, 11);
    write_random(&src.join("b.dat"), 3 << 20, 12); // several blocks: journaled
    fs::write(src.join("c.dat"), b"").unwrap(); // empty: no block written
    fs::write(src.join("d.dat"), b"").unwrap(); // empty, where a hard link has its final name
    env.cp([src.display().to_string(), srv.url("e/in")]).run().assert_ok();
    for (i, b) in before.iter().enumerate() {
        assert!(fs::read(outside.join(format!("victim{}", i + 1))).unwrap() == *b, "victim{} outside the export was written", i + 1);
    }
    // An empty file is made under its final name, never through its
    // temporary name: a fresh run leaves the link planted there as it was.
    let planted = export.join("in/src/.c.dat.dmover-part");
    assert_eq!(fs::metadata(&planted).unwrap().nlink(), 2, "the link at an empty file's temporary name was replaced");
    fs::remove_file(&planted).unwrap();
    assert_same_tree(&src, &export.join("in/src"));
}

/// Makes a FIFO at `path`.
fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    let r = unsafe { libc::mkfifo(c.as_ptr(), 0o666) };
    assert_eq!(r, 0, "mkfifo {}: {}", path.display(), std::io::Error::last_os_error());
}

/// Regression: a FIFO that a local user with write access to an export
/// made at a journal's name (the name is predictable) held the upload's
/// session in open() for good, with its connections: a few such uploads
/// took every connection a server allows. Now an existing file is opened
/// without waiting and refused unless it is a regular file; the journal is
/// created afresh in its place.
#[test]
fn a_fifo_planted_at_a_journals_name_holds_up_neither_the_upload_nor_others() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = ["--max-connections", "3"].map(Into::into).to_vec();
    let srv = Server::start(spec);
    let src = env.path("src");
    write_random(&src.join("big.dat"), 3 << 20, 41); // three blocks: journaled
    let state_dir = Path::new("in").join(dmover_engine::source::STATE_DIR);
    fs::create_dir_all(export.join(&state_dir)).unwrap();
    let fifo = export.join(dmover_engine::journal::path_for(&state_dir, "src/big.dat"));
    mkfifo(&fifo);
    let timeout = Duration::from_secs(20);
    env.cp([src.display().to_string(), srv.url("e/in"), "-p".into(), "1".into()]).timeout(timeout).run().assert_ok();
    assert_same_tree(&src, &export.join("in/src"));
    assert!(!fifo.exists(), "the FIFO at the journal's name is still there");
    // The upload's connections were given back: another is served.
    let other = env.path("other");
    make_tree(&other, 42, 5);
    env.cp([other.display().to_string(), srv.url("e/elsewhere"), "-p".into(), "1".into()]).timeout(timeout).run().assert_ok();
    assert_same_tree(&other, &export.join("elsewhere/other"));
}

/// Regression: a file swapped for a FIFO after it was listed held the
/// server's reading thread in open() for good, after the client had gone.
/// Now the file fails at once as not a regular file, the others are sent,
/// and the session's threads and connections are given back.
#[test]
fn a_file_swapped_for_a_fifo_after_its_listing_fails_at_once_and_holds_nothing() {
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("src/a.dat"), 3 << 20, 43);
    write_random(&export.join("src/b.dat"), 1000, 44);
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = ["--max-connections", "2"].map(Into::into).to_vec();
    let srv = Server::start(spec);
    let (addr, token) = (srv.addr(), env.token_str());
    let threads_before = proc_status(srv.pid(), "Threads:");
    let mut c = Raw::control(&addr, token.as_bytes());
    let options = TransferOptions { transfer_id: [43; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let params = EngineParams { streams: 1, retries: 0, bwlimit: 0, ..EngineParams::default() };
    let Some(Msg::SessionOpened { session }) = c.read_after(&Msg::Send { sources: vec!["e/src/".into()], options, params }) else {
        panic!("no session:\n{}", srv.log())
    };
    let (mut d, _, _) = Raw::handshake(&addr, token.as_bytes());
    assert_eq!(d.read(), Some(Msg::Welcome));
    assert!(matches!(d.read_after(&Msg::OpenData { session, index: 0 }), Some(Msg::SessionOpened { .. })));
    // Both files are listed and announced; a.dat is then swapped for a
    // FIFO before its blocks are asked for.
    let mut announced = std::collections::BTreeMap::new();
    while announced.len() < 2 {
        match next_but_pings(&mut c) {
            Some(Msg::Announce { id, meta, .. }) => announced.insert(meta.path, (id, meta.size)),
            m => panic!("expected the files' announcements, got {m:?}"),
        };
    }
    fs::remove_file(export.join("src/a.dat")).unwrap();
    mkfifo(&export.join("src/a.dat"));
    for (id, size) in announced.values() {
        c.send(&Msg::Plan { id: *id, skip: false, ranges: vec![(0, size.div_ceil(1 << 20))], passed_over: String::new() });
    }
    let (a, b) = (announced["a.dat"].0, announced["b.dat"].0);
    let (mut a_failed, mut b_ended) = (false, false);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(a_failed && b_ended) {
        assert!(Instant::now() < deadline, "a.dat, now a FIFO, was not given up within 10 s:\n{}", srv.log());
        match c.read() {
            Some(Msg::Ping) => {}
            Some(Msg::Abort { id, kind, message }) if id == a => {
                assert_eq!(kind, ErrorKind::Refused, "{message}");
                assert!(message.contains("not a regular file"), "{message}");
                a_failed = true;
            }
            Some(Msg::FileEnd { id, .. }) if id == b => b_ended = true,
            m => panic!("a.dat, now a FIFO, was not given up at once (a_failed {a_failed}, b_ended {b_ended}): {m:?}\n{}", srv.log()),
        }
    }
    drop((c, d));
    let settled = wait_until(Duration::from_secs(10), || proc_status(srv.pid(), "Threads:") <= threads_before);
    assert!(settled, "the server holds {} threads, {threads_before} before the download", proc_status(srv.pid(), "Threads:"));
    fs::remove_file(export.join("src/a.dat")).unwrap();
    let down = env.mkdir("down");
    // One data connection beside the control one: the server takes two.
    env.cp([srv.url("e/src"), down.display().to_string(), "-p".into(), "1".into()]).run().assert_ok();
    assert_same_tree(&export.join("src"), &down.join("src"));
}

/// Regression: a client could write into `.dmover-partial/`, the resume
/// state a server keeps inside an export (journals, markers), by receiving
/// into it or announcing names in it, and read it by listing or
/// downloading it. Now every path a client names in dmover's own state, or
/// naming a partial file, is refused, and nothing there changes.
#[test]
fn a_client_can_neither_write_nor_read_the_resume_state_in_an_export() {
    let env = Env::new();
    let export = env.mkdir("export");
    // What an interrupted upload left.
    write_random(&export.join("in/.dmover-partial/transfer-00"), 100, 1);
    write_random(&export.join("in/.a.dat.dmover-part"), 100, 2);
    let before = list_tree(&export);
    let srv = env.serve(&[("e", &export)]);
    let token = env.token_str();
    let opts = TransferOptions { transfer_id: [42; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };

    let mut c = Raw::control(&srv.addr(), token.as_bytes());
    for dest in ["e/.dmover-partial", "e/in/.dmover-partial", "e/in/.dmover-partial/transfer-00", "e/in/.a.dat.dmover-part"] {
        c.refused(&Msg::Receive { dest: dest.into(), options: opts }, ErrorKind::Refused);
        c.refused(&Msg::Grant { dest: dest.into() }, ErrorKind::Refused);
    }
    for path in [
        "e/in/.dmover-partial",
        "e/in/.dmover-partial/",
        "e/in/.dmover-partial/*",
        "e/in/.dmover-partial/transfer-00",
        "e/in/.a.dat.dmover-part",
    ] {
        c.refused(&Msg::List { path: path.into() }, ErrorKind::Refused);
    }
    let names = [".dmover-partial/transfer-00", ".dmover-partial/x", "sub/.dmover-partial/x", ".a.dat.dmover-part", "sub/.b.dmover-part"];
    c.announcements_refused("e/in", opts, &names);

    // The client: an upload into the state directory, a download from it.
    let src = env.path("x");
    write_random(&src, 100, 3);
    let r = env.cp([src.display().to_string(), srv.url("e/in/.dmover-partial/x")]).run();
    assert_eq!(r.code, 8, "an upload into .dmover-partial/ was not refused: {}", r.stderr);
    assert!(r.stderr.contains("dmover's own"), "the refusal does not say why: {}", r.stderr);
    let down = env.mkdir("down");
    let r = env.cp([srv.url("e/in/.dmover-partial/transfer-00"), down.display().to_string()]).run();
    assert_eq!(r.code, 8, "a download from .dmover-partial/ was not refused: {}", r.stderr);
    assert!(list_tree(&down).is_empty(), "resume state was served: {:?}", list_tree(&down));

    assert_eq!(list_tree(&export), before, "the export changed");
    assert!(srv.log().contains("dmover's own"), "the refusals were not logged:\n{}", srv.log());
}

/// Regression: a download into a shared destination wrote through a
/// symlink another local user planted there (`DEST/src/sub` pointing to a
/// directory of theirs that the client's user can write), and so did a
/// local copy. Now a client writes confined beneath the destination it was
/// given, as a server writes beneath an export: the files below the link
/// fail as refused, nothing is written through it, and the link is left
/// as it was (rsync would replace it with a directory). A destination that
/// is itself a symlink, named by the user, is still followed.
#[test]
fn a_symlinked_subdirectory_planted_in_a_destination_is_not_written_through() {
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("src/top.dat"), 3000, 1);
    write_random(&export.join("src/sub/f.dat"), 3000, 2);
    write_random(&export.join("src/sub/deeper/g.dat"), 3000, 3);
    let srv = env.serve(&[("e", &export)]);
    let elsewhere = env.mkdir("elsewhere");
    let sources = [("download", srv.url("e/src")), ("local copy", export.join("src").display().to_string())];
    for (i, (how, from)) in sources.iter().enumerate() {
        let dest = env.mkdir(&format!("shared{i}/src"));
        symlink(&elsewhere, dest.join("sub")).unwrap();
        let r = env.cp([from.as_str(), dest.parent().unwrap().to_str().unwrap()]).run();
        assert!(list_tree(&elsewhere).is_empty(), "{how}: written through the link: {:?}", list_tree(&elsewhere));
        assert_eq!(r.code, 8, "{how}: {}", r.stderr);
        assert!(!r.stderr.contains("panicked"), "{how}: {}", r.stderr);
        assert_eq!(fs::read_link(dest.join("sub")).unwrap(), elsewhere, "{how}: the link was replaced");
        let errors = r.json()["errors"].as_array().cloned().unwrap_or_default();
        assert_eq!(errors.len(), 2, "{how}: {errors:?}");
        for e in &errors {
            let path = e["path"].as_str().unwrap_or_default();
            assert!(path.contains("src/sub/"), "{how}: {e}");
            assert!(e["message"].as_str().unwrap_or_default().contains("symlink"), "{how}: {e}");
        }
        assert!(same_content(&export.join("src/top.dat"), &dest.join("top.dat")), "{how}: the file beside the link was not copied");

        // The destination the user names may be a symlink: it is followed.
        let real = env.mkdir(&format!("real{i}"));
        let named = env.path(&format!("named{i}"));
        symlink(&real, &named).unwrap();
        env.cp([from.as_str(), named.to_str().unwrap()]).run().assert_ok();
        assert_same_tree(&export.join("src"), &real.join("src"));
    }
}

/// Regression: an `Announce` of 2^60 bytes made the server abort while
/// allocating the file's block map, and one of 2^64-1 bytes in 1-byte
/// blocks panicked the connection thread, which then kept its connection
/// slot for good. Now a size is checked against the most blocks a file may
/// have before anything is sized from it, and the file is refused.
#[test]
fn announced_file_sizes_beyond_the_block_limit_are_refused_without_crash_or_lost_slot() {
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = vec!["--max-connections".into(), "4".into()];
    let mut srv = Server::start(spec);
    let addr = srv.addr();
    let token = env.token_str();
    let cases = [(u64::MAX, 1), (u64::MAX, 1), (u64::MAX, 1), (u64::MAX, 1), (1 << 60, 1 << 20), (u64::MAX, 16 << 20)];
    for (i, (size, block_size)) in cases.into_iter().enumerate() {
        let mut c = Raw::control(&addr, token.as_bytes());
        let opts = TransferOptions { transfer_id: [20 + i as u8; 16], block_size, flags: TransferFlags::empty(), tcp_buffer: 0 };
        c.send(&Msg::Receive { dest: "e/in".into(), options: opts });
        assert!(matches!(c.read(), Some(Msg::SessionOpened { .. })), "case {i}: no session:\n{}", srv.log());
        let meta = FileMeta { path: "huge.dat".into(), size, mtime_s: 0, mtime_ns: 0, mode: 0o644, ..Default::default() };
        c.send(&Msg::Announce { id: 1, meta, digest: None });
        match c.read() {
            Some(Msg::Failed { id: 1, kind: ErrorKind::Refused, message, .. }) => {
                assert!(message.contains("--block-size"), "case {i}: the refusal does not say what to do: {message}")
            }
            m => panic!("case {i}: {size} bytes in blocks of {block_size} were not refused, got {m:?}:\n{}", srv.log()),
        }
        c.send(&Msg::Finish { files: 0, bytes: 0, set_digest: 0 });
        assert!(matches!(c.read(), Some(Msg::Finished { files: 0, .. })), "case {i}:\n{}", srv.log());
    }
    assert!(srv.running(), "{}", srv.log());
    assert!(!export.join("in/huge.dat").exists());
    let src = env.path("src");
    make_tree(&src, 7, 5);
    env.cp([src.display().to_string(), srv.url("e"), "-p".into(), "2".into()]).run().assert_ok();
    assert_same_tree(&src, &export.join("src"));
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
}

/// Regression: a receiving end kept a checksum slot for every block of an
/// announced file before any block came: 20 announcements of 4 TiB files
/// (the most blocks a file may have) took a server 1.4 GB, enough for a
/// memory limit to abort it with every user's sessions. Now a file's state
/// grows with the blocks that arrive.
#[test]
fn announcing_files_of_four_terabytes_costs_the_server_no_memory_until_their_blocks_come() {
    const FILES: u64 = 20;
    let env = Env::new();
    let export = env.mkdir("export");
    let mut srv = env.serve(&[("e", &export)]);
    let token = env.token_str();
    let mut c = Raw::control(&srv.addr(), token.as_bytes());
    let options = TransferOptions { transfer_id: [40; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let opened = c.read_after(&Msg::Receive { dest: "e/in".into(), options });
    assert!(matches!(opened, Some(Msg::SessionOpened { .. })), "no session: {opened:?}\n{}", srv.log());
    let before = proc_status(srv.pid(), "VmRSS:");
    for id in 0..FILES {
        let meta = FileMeta { path: format!("huge{id}.dat"), size: MAX_FILE_BLOCKS << 20, mode: 0o644, ..Default::default() };
        c.send(&Msg::Announce { id, meta, digest: None });
    }
    for _ in 0..FILES {
        match next_but_pings(&mut c) {
            Some(Msg::Plan { skip: false, ranges, .. }) => assert_eq!(ranges, [(0, MAX_FILE_BLOCKS)]),
            m => panic!("a file of 4 TiB was not planned: {m:?}\n{}", srv.log()),
        }
    }
    let during = proc_status(srv.pid(), "VmRSS:");
    eprintln!("server RSS: {before} KiB before, {during} KiB with {FILES} files of 4 TiB announced");
    assert!(during < before + 64 * 1024, "the server's memory grew from {before} to {during} KiB for {FILES} announcements");
    for id in 0..FILES {
        c.send(&Msg::Abort { id, kind: ErrorKind::SourceChanged, message: "given up".into() });
    }
    assert!(matches!(c.read_after(&Msg::Finish { files: 0, bytes: 0, set_digest: 0 }), Some(Msg::Finished { files: 0, .. })));
    assert!(srv.running(), "{}", srv.log());
    assert!(!export.join("in").read_dir().unwrap().any(|e| e.unwrap().file_name().to_string_lossy().contains("huge")));
    let src = env.path("src");
    make_tree(&src, 9, 5);
    env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
    assert_same_tree(&src, &export.join("src"));
}

/// Regression: connections that never authenticate counted against
/// `--max-connections`, so 300 silent TCP connections, opened again as the
/// server cut them, kept an honest client out for as long as they liked.
/// Now they have their own budget (in all and per address), and the oldest
/// of them makes room for a new connection.
#[test]
fn three_hundred_idle_unauthenticated_connections_do_not_lock_out_an_honest_client() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let addr = srv.addr();
    let (stop, full) = (AtomicBool::new(false), AtomicBool::new(false));
    let src = env.path("src");
    make_tree(&src, 8, 10);
    let r = std::thread::scope(|s| {
        // The attacker: 300 connections that send nothing, each opened again once the server closes it.
        s.spawn(|| {
            let mut conns: Vec<std::net::TcpStream> = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                conns.retain(|c| {
                    c.set_nonblocking(true).unwrap();
                    matches!(c.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                });
                while conns.len() < 300 {
                    match std::net::TcpStream::connect(&addr) {
                        Ok(c) => conns.push(c),
                        Err(_) => break,
                    }
                }
                if conns.len() == 300 {
                    full.store(true, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let held = wait_until(Duration::from_secs(20), || full.load(Ordering::SeqCst));
        assert!(held, "the attacker never held its 300 connections at once");
        let r = env.cp([src.display().to_string(), srv.url("e")]).timeout(Duration::from_secs(40)).run();
        stop.store(true, Ordering::SeqCst);
        r
    });
    r.assert_ok();
    assert!(r.elapsed < Duration::from_secs(8), "the honest copy took {:?} while idle connections held the port", r.elapsed);
    assert_same_tree(&src, &export.join("src"));
}

/// Plays a malicious server for one download of `spec` (`EXPORT/path`)
/// into `dest`: it knows the token, so the client trusts it; it answers
/// `Send` with a session and takes one data connection. Returns the
/// client's process and the two connections, control first.
fn malicious_server(env: &Env, spec: &str, dest: &Path) -> (Proc, Raw, Raw) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let token = env.token_str();
    let client = env
        .cp([format!("dmover://{addr}/{spec}"), format!("{}/", dest.display()), "-p".into(), "1".into(), "--retries".into(), "0".into()])
        .spawn();
    // Each connection authenticates in its own thread: the client opens its
    // data connection and its control connection at once.
    let (tx, rx) = std::sync::mpsc::channel();
    for _ in 0..2 {
        let (s, _) = listener.accept().unwrap();
        let (token, tx) = (token.clone(), tx.clone());
        std::thread::spawn(move || {
            let mut c = Raw::accept(s, token.as_bytes());
            c.send(&Msg::Welcome);
            let control = match c.read() {
                Some(Msg::OpenData { session, .. }) => {
                    c.send(&Msg::SessionOpened { session });
                    false
                }
                Some(Msg::OpenControl) => {
                    assert!(matches!(c.read(), Some(Msg::Send { .. })), "the client did not ask for a send");
                    c.send(&Msg::SessionOpened { session: [9; 16] });
                    true
                }
                m => panic!("expected a connection type, got {m:?}"),
            };
            tx.send((control, c)).unwrap();
        });
    }
    let (mut controls, mut data): (Vec<_>, Vec<_>) =
        (0..2).map(|_| rx.recv_timeout(Duration::from_secs(20)).expect("the client did not connect")).partition(|(control, _)| *control);
    let ctl = controls.pop().expect("no control connection").1;
    (client, ctl, data.pop().expect("no data connection").1)
}

/// The next message on `c` but pings.
fn next_but_pings(c: &mut Raw) -> Option<Msg> {
    loop {
        match c.read() {
            Some(Msg::Ping) => continue,
            m => return m,
        }
    }
}

/// Plays a malicious server for one download of `spec` into `dest` (see
/// [`malicious_server`]) that announces `files` (name, size, mode), all
/// empty whatever size they claim, whatever was asked. Returns the client's
/// run and its last word on each file (`Done`, `Failed`, or nothing if it
/// hung up).
fn malicious_download(env: &Env, spec: &str, dest: &Path, files: &[(&str, u64, u32)]) -> (Run, Vec<Option<Msg>>) {
    let (client, mut ctl, data) = malicious_server(env, spec, dest);
    for (i, (name, size, mode)) in files.iter().enumerate() {
        let meta = FileMeta { path: name.to_string(), size: *size, mtime_s: 0, mtime_ns: 0, mode: *mode, ..Default::default() };
        ctl.send(&Msg::Announce { id: i as u64, meta, digest: None });
    }
    let mut last: Vec<Option<Msg>> = vec![None; files.len()];
    let mut open = files.len();
    while open > 0 {
        match next_but_pings(&mut ctl) {
            Some(Msg::Plan { id, .. }) => ctl.send(&Msg::FileEnd { id, digest: dmover_proto::digest::file_digest(&[]) }),
            Some(m @ (Msg::Done { .. } | Msg::Failed { .. })) => {
                let (Msg::Done { id, .. } | Msg::Failed { id, .. }) = m else { unreachable!() };
                last[id as usize] = Some(m);
                open -= 1;
            }
            _ => break, // the client hung up, or said why it gave up
        }
    }
    ctl.send(&Msg::Finish { files: 0, bytes: 0, set_digest: 0 });
    if let Some(Msg::Finished { .. }) = next_but_pings(&mut ctl) {
        ctl.send(&Msg::Report { stats: Default::default() });
    }
    // Hang up, as a server does after its report.
    drop((ctl, data));
    (client.wait(), last)
}

/// Regression: a download of one file from a malicious server also wrote
/// `.bashrc`, `.ssh/authorized_keys`, names with terminal escapes and
/// names in dmover's own state into the destination. Now a client takes
/// only names its request can produce.
#[test]
fn a_malicious_server_cannot_write_names_the_download_did_not_ask_for() {
    let env = Env::new();
    let cases: [(&str, &[&str], &[&str]); 2] = [
        (
            "e/data/report.pdf",
            &["report.pdf"],
            &[
                ".bashrc",
                ".ssh/authorized_keys",
                "report.pdfx",
                "evil\x1b]0;owned\x07",
                "a\nb",
                ".dmover-partial/transfer-00",
                ".x.dmover-part",
            ],
        ),
        ("e/data/*.h5", &["a.h5", "b.h5"], &["c.txt", "sub/d.h5", ".bashrc"]),
    ];
    for (i, (spec, asked, planted)) in cases.into_iter().enumerate() {
        let dest = env.mkdir(&format!("down{i}"));
        let files: Vec<(&str, u64, u32)> = asked.iter().chain(planted).map(|n| (*n, 0, 0o644)).collect();
        let (r, last) = malicious_download(&env, spec, &dest, &files);
        for (n, (name, _, _)) in files.iter().enumerate() {
            let took = matches!(last[n], Some(Msg::Done { .. }));
            if n < asked.len() {
                assert!(took, "{spec}: {name:?}, which was asked for, was not taken: {:?}\n{}", last[n], r.stderr);
            } else {
                assert!(!took, "{spec}: the client took {name:?}, which it never asked for");
                assert!(matches!(&last[n], Some(Msg::Failed { kind: ErrorKind::Refused, .. })), "{spec}: {name:?}: {:?}", last[n]);
            }
        }
        let got: Vec<String> = list_tree(&dest).into_keys().collect();
        assert_eq!(got, asked, "{spec}: the destination holds other names");
        // The names refused are logged escaped: no control character
        // reaches the terminal, and each line is one log line.
        assert!(!r.stderr.contains(['\x1b', '\x07']), "{spec}: a raw control character reached stderr:\n{:?}", r.stderr);
        for l in r.stderr.lines() {
            assert!(
                l.starts_with('[') || l.starts_with("dmover: error: "),
                "{spec}: a name broke a log line on stderr: {l:?}\n{}",
                r.stderr
            );
        }
        for name in planted {
            let line = format!("refused {}: ", name.escape_debug());
            assert!(r.stderr.contains(&line), "{spec}: no {line:?} on stderr:\n{}", r.stderr);
        }
        // The server's report leaves the refused files out; the client
        // counts them itself and says so: exit code 8 (refused), not a
        // crash, and not the server's word alone.
        assert_eq!(r.code, 8, "{spec}: exit code (want 8, files refused); stderr:\n{}", r.stderr);
        let missing = format!("{} file(s) refused or failed here are missing from the server's report", planted.len());
        assert!(r.stderr.contains(&missing), "{spec}: {missing:?} not on stderr:\n{}", r.stderr);
    }
}

/// Regression: a malicious server announcing a file of 2^60 bytes made a
/// downloading client abort. Now the client refuses the file and goes on.
#[test]
fn a_malicious_server_announcing_a_huge_file_does_not_crash_the_client() {
    let env = Env::new();
    let dest = env.mkdir("down");
    let (r, last) = malicious_download(&env, "e/data/", &dest, &[("huge.dat", 1 << 60, 0o644), ("ok.dat", 0, 0o644)]);
    match &last[0] {
        Some(Msg::Failed { kind: ErrorKind::Refused, message, .. }) => assert!(message.contains("--block-size"), "{message}"),
        m => panic!("the client did not refuse a file of 2^60 bytes: {m:?}\n{}", r.stderr),
    }
    assert!(matches!(last[1], Some(Msg::Done { .. })), "{:?}\n{}", last[1], r.stderr);
    assert!(r.code < 128, "the client died: {}", r.stderr);
    assert_eq!(list_tree(&dest).into_keys().collect::<Vec<_>>(), ["ok.dat"]);
}

/// Plays a malicious source server for one third-party copy into the real
/// server `dest`: it knows the token, so the client trusts it; it takes the
/// client's `Push` and answers with `answer` (a report or an error).
/// Returns the client's run.
fn malicious_push_source(env: &Env, dest: &Server, answer: Msg) -> Run {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // As a user runs it: the summary, not JSON.
    let client = dmover(["cp", "--retries", "0", "--token-file"])
        .arg(&env.token)
        .args([format!("dmover://{addr}/e/src"), dest.url("e/in/")])
        .spawn();
    let (s, _) = listener.accept().unwrap();
    let mut c = Raw::accept(s, env.token_str().as_bytes());
    c.send(&Msg::Welcome);
    assert_eq!(c.read(), Some(Msg::OpenControl));
    assert!(matches!(c.read(), Some(Msg::Push { .. })), "the client did not ask for a push");
    c.send(&answer);
    let r = client.wait();
    drop(c);
    r
}

/// Regression: host names in a third-party copy's report went to the
/// client's terminal raw: a malicious source server printed an escape
/// sequence and a forged `check: passed` line on the client's terminal.
/// Now every string from a peer that the client prints is escaped.
#[test]
fn a_malicious_servers_strings_reach_the_client_terminal_escaped() {
    let env = Env::new();
    let export = env.mkdir("export");
    let dest = env.serve(&[("e", &export)]);
    let forged = "\x1b[2K\x1b[1A\ncheck: passed (every file verified at the destination)";
    let host = |n: &str| dmover_proto::frame::Share { name: format!("{n}{forged}"), count: 1, bytes: 1 };
    let stats = dmover_proto::frame::Stats {
        files: 2,
        bytes: 2,
        hosts: vec![host("a"), host("b")],
        errors: vec![dmover_proto::frame::FileError { path: format!("x{forged}"), kind: ErrorKind::Verify, message: forged.into() }],
        ..Default::default()
    };
    let report = malicious_push_source(&env, &dest, Msg::Report { stats });
    let error = malicious_push_source(&env, &dest, Msg::Error { kind: ErrorKind::Refused, message: forged.into() });
    for (what, r, code) in [("report", &report, 10), ("error", &error, 8)] {
        let out = format!("{}{}", r.stdout, r.stderr);
        assert_eq!(r.code, code, "{what}: {out}");
        assert!(!out.contains('\x1b'), "{what}: the client printed an escape character:\n{out:?}");
        assert!(!out.lines().any(|l| l.starts_with("check: passed")), "{what}: a forged line was printed:\n{out}");
        assert!(out.contains("\\u{1b}[2K\\u{1b}[1A\\ncheck: passed"), "{what}: the string is not shown escaped:\n{out}");
    }
    assert!(report.stderr.contains("check: FAILED"), "{}", report.stderr);
}

/// Regression: a downloading client kept a checksum slot for every block
/// of each file a server announced before any block came: a malicious
/// server announcing 20 files of 4 TiB made it take 1.4 GB. Now a file's
/// state grows with the blocks that arrive.
#[test]
fn a_malicious_server_announcing_files_of_four_terabytes_costs_the_client_no_memory() {
    const FILES: u64 = 20;
    let env = Env::new();
    let dest = env.mkdir("down");
    let (client, mut ctl, data) = malicious_server(&env, "e/data/", &dest);
    let before = proc_status(client.pid(), "VmRSS:");
    for id in 0..FILES {
        let meta = FileMeta { path: format!("huge{id}.dat"), size: MAX_FILE_BLOCKS << 20, mode: 0o644, ..Default::default() };
        ctl.send(&Msg::Announce { id, meta, digest: None });
    }
    for _ in 0..FILES {
        match next_but_pings(&mut ctl) {
            Some(Msg::Plan { skip: false, .. }) => {}
            m => panic!("a file of 4 TiB was not planned: {m:?}"),
        }
    }
    let during = proc_status(client.pid(), "VmRSS:");
    eprintln!("client RSS: {before} KiB before, {during} KiB with {FILES} files of 4 TiB announced");
    assert!(during < before + 64 * 1024, "the client's memory grew from {before} to {during} KiB for {FILES} announcements");
    drop((ctl, data));
    let r = client.wait();
    assert!(r.code > 0 && r.code < 128, "the client did not fail cleanly when the server hung up: {}\n{}", r.code, r.stderr);
    let got = list_tree(&dest);
    assert!(!got.keys().any(|k| k.contains("huge")), "{got:?}");
}

/// Regression: one small `Push` naming thousands of hosts made the server
/// open thousands of connections to an address of the client's choosing,
/// and a `Push` naming none panicked its connection thread. Now a push may
/// have the server open at most 64 data connections in all, and must name a host.
#[test]
fn a_push_naming_thousands_of_hosts_makes_the_server_open_no_connections() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("src/a.dat"), 1000, 1);
    let mut srv = env.serve(&[("e", &export)]);
    let token = env.token_str();
    // The target of the amplification: it counts the connections it gets.
    let target = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target.local_addr().unwrap().to_string();
    target.set_nonblocking(true).unwrap();
    let reached = AtomicUsize::new(0);
    let opts = TransferOptions { transfer_id: [30; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let host = TicketedHost { addr: target_addr, key_id: [1; 16], wrapped_secret: [0; 32] };
    let cases = [(2000, 4), (2, 64), (0, 4)];
    for (n, streams) in cases {
        let mut c = Raw::control(&srv.addr(), token.as_bytes());
        let params = EngineParams { streams, concurrency: 8, staging: 64 << 20, retries: 0, bwlimit: 0, ..EngineParams::default() };
        let hosts = vec![host.clone(); n];
        c.send(&Msg::Push { sources: vec!["e/src".into()], dest: "x/in".into(), hosts, options: opts, params });
        let answer = c.read();
        while let Ok((_conn, _)) = target.accept() {
            reached.fetch_add(1, Ordering::SeqCst);
        }
        match answer {
            Some(Msg::Error { message, .. }) if n > 0 => {
                assert!(message.contains("at most 64"), "{n} hosts × {streams} streams: {message}")
            }
            Some(Msg::Error { message, .. }) => assert!(message.contains("no destination host"), "{message}"),
            m => panic!(
                "a push to {n} hosts × {streams} streams was not refused: {m:?}; the target got {} connections",
                reached.load(Ordering::SeqCst)
            ),
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    while let Ok((_conn, _)) = target.accept() {
        reached.fetch_add(1, Ordering::SeqCst);
    }
    assert_eq!(reached.load(Ordering::SeqCst), 0, "the server connected to the push's target");
    assert!(srv.running(), "{}", srv.log());
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
}

/// Regression: data connections attached to a running session were not
/// counted: a token holder could attach any number to one `Receive`, and
/// the server ran a thread for each. Now a session holds at most 64 at
/// once; one beyond is refused, saying so, and counted among refused
/// requests; a place comes back when a stream ends.
#[test]
fn a_session_holds_at_most_64_data_connections_at_once() {
    let env = Env::new();
    let export = env.mkdir("export");
    let metrics = format!("127.0.0.1:{}", closed_port());
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), metrics.clone().into()];
    let srv = Server::start(spec);
    let (addr, token) = (srv.addr(), env.token_str());
    let refused = || {
        let (_, page) = http_get(&metrics, "/metrics").expect("the metrics page answers");
        sample(&page, "dmover_refused_requests_total").expect("no refused requests on the metrics page")
    };
    let options = TransferOptions { transfer_id: [40; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let mut c = Raw::control(&addr, token.as_bytes());
    let Some(Msg::SessionOpened { session }) = c.read_after(&Msg::Receive { dest: "e/in".into(), options }) else {
        panic!("no session:\n{}", srv.log())
    };
    let threads_before = proc_status(srv.pid(), "Threads:");
    let refused_before = refused();
    let attach = || {
        let (mut d, _, _) = Raw::handshake(&addr, token.as_bytes());
        assert_eq!(d.read(), Some(Msg::Welcome));
        let answer = d.read_after(&Msg::OpenData { session, index: 0 });
        (d, answer)
    };
    let mut held: Vec<Raw> = (0..64)
        .map(|i| match attach() {
            (d, Some(Msg::SessionOpened { .. })) => d,
            (_, m) => panic!("data connection {i} of 64 was not attached: {m:?}\n{}", srv.log()),
        })
        .collect();
    let beyond = 100;
    for i in 0..beyond {
        match attach() {
            (mut d, Some(Msg::Error { kind, message })) => {
                assert_eq!(kind, ErrorKind::Usage, "{message}");
                assert!(message.contains("64 data connections already"), "{message}");
                assert!(d.wait_closed() < Duration::from_secs(5), "a refused data connection was kept open");
            }
            (_, m) => panic!("data connection {} was attached to a session holding 64: {m:?}", 65 + i),
        }
    }
    // One thread per connection held, none for those refused.
    let bound = threads_before + 64 + 8;
    let bounded = wait_until(Duration::from_secs(10), || proc_status(srv.pid(), "Threads:") <= bound);
    let threads = proc_status(srv.pid(), "Threads:");
    assert!(bounded, "the server runs {threads} threads for one session of {} data connections, from {threads_before}", 64 + beyond);
    assert_eq!(refused() - refused_before, beyond as f64, "refused attachments are not counted as refused requests");

    // A stream that ends gives its place back: a tuner may open another.
    held.pop().unwrap().send(&Msg::StreamEnd);
    let mut attached = None;
    let again = wait_until(Duration::from_secs(10), || {
        let (d, answer) = attach();
        attached = matches!(answer, Some(Msg::SessionOpened { .. })).then_some(d);
        attached.is_some()
    });
    assert!(again, "no data connection could attach after one of the 64 ended:\n{}", srv.log());
    c.send(&Msg::Finish { files: 0, bytes: 0, set_digest: 0 });
    let finished = loop {
        match c.read() {
            Some(Msg::Ping) => continue,
            m => break m,
        }
    };
    assert!(matches!(finished, Some(Msg::Finished { files: 0, .. })), "the session did not finish: {finished:?}\n{}", srv.log());
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
}

/// A plain TCP service on loopback that greets each connection with an SSH
/// banner, as sshd does. Returns its address and the count of connections
/// it took.
fn banner_service() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::Read;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let taken = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = taken.clone();
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::thread::spawn(move || {
                let _ = s.write_all(b"SSH-2.0-x\r\n");
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = s.read(&mut [0u8; 1024]);
            });
        }
    });
    (addr, taken)
}

/// Asks `srv` to push `e/src` to `host` with a made-up ticket; returns the
/// error it answers with (kind and message).
fn push_answer(env: &Env, srv: &Server, host: &str) -> (ErrorKind, String) {
    let mut c = Raw::control(&srv.addr(), env.token_str().as_bytes());
    let options = TransferOptions { transfer_id: [31; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let params = EngineParams { streams: 2, concurrency: 2, staging: 8 << 20, retries: 0, bwlimit: 0, ..EngineParams::default() };
    let hosts = vec![TicketedHost { addr: host.into(), key_id: [7; 16], wrapped_secret: [1; 32] }];
    c.send(&Msg::Push { sources: vec!["e/src".into()], dest: "x/in".into(), hosts, options, params });
    loop {
        match c.read() {
            Some(Msg::Progress { .. }) => continue,
            Some(Msg::Error { kind, message }) => return (kind, message),
            m => panic!("a push to {host} was not refused: {m:?}\n{}", srv.log()),
        }
    }
}

/// Regression: a token holder could make the server connect to any
/// host:port, loopback included, and the refusal told whether the port was
/// open and the first bytes of what answered there (an SSH banner). Now a
/// push goes by default nowhere on the server's own loopback, link-local,
/// unspecified or multicast addresses (`--push-to` allows destinations),
/// and a refused or failed push says only that, the same for an open port
/// with a banner as for a closed one.
#[test]
fn push_goes_only_where_allowed_and_never_tells_what_answered() {
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("src/a.dat"), 1000, 1);
    let (banner, taken) = banner_service();
    let banner_port = banner.rsplit_once(':').unwrap().1.to_string();
    let closed = format!("127.0.0.1:{}", closed_port());
    let same = |(kind, message): &(ErrorKind, String), port: &str| (*kind, message.replace(port, "PORT"));

    // By default: refused before any connection, whatever the name or form.
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("default.log"));
    spec.push_to = Vec::new();
    let default = Server::start(spec);
    let open = push_answer(&env, &default, &banner);
    assert_eq!(open.0, ErrorKind::Refused, "{open:?}");
    assert!(open.1.starts_with(&format!("push to {banner} refused")), "{open:?}");
    let shut = push_answer(&env, &default, &closed);
    assert_eq!(same(&open, &banner_port), same(&shut, closed.rsplit_once(':').unwrap().1), "an open port and a closed one differ");
    for host in [format!("localhost:{banner_port}"), format!("0.0.0.0:{banner_port}"), format!("[::ffff:127.0.0.1]:{banner_port}")] {
        let (kind, message) = push_answer(&env, &default, &host);
        assert!(kind == ErrorKind::Refused && message.starts_with(&format!("push to {host} refused")), "{host}: {message}");
    }
    assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 0, "the server connected to a loopback service");

    // Allowed (`--push-to 127.0.0.1`, as every test server here): the server
    // connects, and what answered stays in its log.
    let allowed = env.serve(&[("e", &export)]);
    let open = push_answer(&env, &allowed, &banner);
    assert!(taken.load(std::sync::atomic::Ordering::SeqCst) > 0, "the server did not connect where it was allowed to");
    assert!(open.1.starts_with(&format!("push to {banner} failed")), "{open:?}");
    let shut = push_answer(&env, &allowed, &closed);
    assert_eq!(same(&open, &banner_port), same(&shut, closed.rsplit_once(':').unwrap().1), "an open port and a closed one differ");
    // Not a byte of the banner, in any spelling: no "SSH", and no number
    // but the host's own (a frame header read from "SSH-2.0-" is kind 83,
    // 841887789 bytes).
    for (told, host) in [(&open.1, &banner), (&shut.1, &closed)] {
        let rest = told.replace(host.as_str(), "");
        assert!(!rest.contains("SSH") && !rest.contains(|c: char| c.is_ascii_digit()), "{told}");
    }
    assert!(wait_until(Duration::from_secs(5), || allowed.log().contains(&format!("push to {banner} failed: "))), "{}", allowed.log());

    // An honest third-party copy between two allowed servers.
    let other = env.mkdir("other");
    let dest = env.serve(&[("e", &other)]);
    env.cp([allowed.url("e/src"), dest.url("e/in/")]).run().assert_ok();
    assert_same_tree(&export.join("src"), &other.join("in/src"));
    // The same copy from the server that allows no loopback destination.
    let r = env.cp([default.url("e/src"), dest.url("e/again/"), "--retries".into(), "0".into()]).run();
    r.assert_fails(8, &[&format!("push to {} refused", dest.addr()), "--push-to"]);
    let r = dmover(["serve", "--listen", "127.0.0.1:0", "--push-to", "10.0.0.0/33", "--token-file"])
        .arg(&env.token)
        .arg("--export")
        .arg(format!("e={}", export.display()))
        .run();
    r.assert_fails(2, &["--push-to 10.0.0.0/33", "0 to 32 bits"]);
}

/// Regression: a flood of bad connections wrote one warning per connection
/// (49 MB of log in 30 s). Now each cause of refusal writes at most a line a
/// second, and the rest are counted in a summary line: 2,000 connections
/// that are not the handshake make a few lines, which still count them all.
#[test]
fn a_flood_of_bad_connections_writes_a_bounded_number_of_log_lines() {
    const FLOOD: usize = 2000;
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let addr = srv.addr();
    let before = srv.log().lines().count();
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..FLOOD / 8 {
                    let mut c = Raw::connect(&addr);
                    c.raw(&[0xAB; 8]); // a header of no kind there is
                    c.wait_closed();
                }
            });
        }
    });
    let took = started.elapsed();
    // Each told in the log: a line of its own, or counted in a summary line.
    let all = wait_until(Duration::from_secs(5), || logged_connections(&srv.log(), " WARN ") >= FLOOD);
    let log = srv.log();
    let (lines, told) = (log.lines().count() - before, logged_connections(&log, " WARN "));
    assert!(all && told == FLOOD, "{told} of {FLOOD} refusals told:\n{log}");
    // A line a second at most, while the flood lasted and for its summary.
    let most = took.as_secs() as usize + 3;
    assert!(lines <= most, "{lines} log lines for {FLOOD} connections in {took:?} (at most {most}):\n{log}");
    // It still serves.
    let src = env.path("src");
    make_tree(&src, 5, 3);
    env.cp([src.display().to_string(), srv.url("e")]).run().assert_ok();
}

/// Regression: tickets were unbounded for their 10-minute life (50,000
/// grants held 200 MB). Now one connection may ask for 16 and the server
/// holds at most 1,024; past each bound a `Grant` is refused saying so,
/// and an honest third-party copy still works past the first. (That a
/// ticket's place comes back when it expires or its session ends is the
/// server's unit tests'.)
#[test]
fn grants_are_bounded_per_connection_and_per_server() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    const PER_CONNECTION: usize = 16;
    const HELD: usize = 1024;
    let env = Env::new();
    let (ea, eb) = (env.mkdir("export-a"), env.mkdir("export-b"));
    make_tree(&ea.join("src"), 5, 2);
    let a = env.serve(&[("e", &ea)]);
    let mut b = env.serve(&[("e", &eb)]);
    let token = env.token_str();
    let grant = Msg::Grant { dest: "e/in".into() };
    // Tickets asked for on a new connection until one is refused: how
    // many were given, and the refusal.
    let ask = |most: usize| -> (usize, Option<Msg>) {
        let mut c = Raw::control(&b.addr(), token.as_bytes());
        for given in 0..most {
            match c.read_after(&grant) {
                Some(Msg::Ticket { .. }) => continue,
                m => return (given, m),
            }
        }
        (most, None)
    };
    let refused = |m: Option<Msg>, says: &str| match m {
        Some(Msg::Error { kind: ErrorKind::Refused, message }) => assert!(message.contains(says), "{message}"),
        m => panic!("expected a refusal saying {says:?}, got {m:?}"),
    };

    let (given, m) = ask(2 * PER_CONNECTION);
    assert_eq!(given, PER_CONNECTION, "tickets given on one connection");
    refused(m, "the most one connection may ask for");
    env.cp([a.url("e/src"), b.url("e/one/")]).run().assert_ok();
    assert_same_tree(&ea.join("src"), &eb.join("one/src"));

    // On many connections at once (the handshakes take a while): the
    // server holds at most HELD, the ones above among them (the copy's
    // too: its place is kept a while after its session).
    let given = AtomicUsize::new(PER_CONNECTION + 1);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..HELD / PER_CONNECTION / 4 {
                    given.fetch_add(ask(PER_CONNECTION).0, Ordering::SeqCst);
                }
            });
        }
    });
    assert_eq!(given.load(Ordering::SeqCst), HELD, "tickets held at once");
    let (given, m) = ask(1);
    assert_eq!(given, 0);
    refused(m, &format!("holds {HELD} live tickets"));
    let r = env.cp([a.url("e/src"), b.url("e/two/"), "--retries".into(), "0".into()]).run();
    r.assert_fails(8, &["holds 1024 live tickets"]);
    assert!(b.running() && !b.log().contains("panicked"), "{}", b.log());
}

/// Regression: a download asking for 1 GiB of staging and 64 MiB blocks,
/// whose data was never read, made the server hold as much as it asked
/// for. Now a request gets at most the server's own staging (`--staging`,
/// 8 MiB here), and blocks that do not fit in it are refused.
#[test]
fn a_download_asking_for_a_gigabyte_of_staging_holds_no_more_than_the_server_staging() {
    let env = Env::new();
    let export = env.mkdir("export");
    for i in 0..64 {
        write_random(&export.join(format!("big/{i:02}.dat")), 4 << 20, i);
    }
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = vec!["--staging".into(), "8M".into()];
    let srv = Server::start(spec);
    let addr = srv.addr();
    let token = env.token_str();
    let greedy = EngineParams { streams: 1, concurrency: 64, staging: 1 << 30, retries: 0, bwlimit: 0, ..EngineParams::default() };
    let send = |block_size: u32| Msg::Send {
        sources: vec!["e/big/".into()],
        options: TransferOptions { transfer_id: [31; 16], block_size, flags: TransferFlags::empty(), tcp_buffer: 0 },
        params: greedy,
    };

    // Blocks of 64 MiB do not fit in the server's 8 MiB of staging.
    let mut c = Raw::control(&addr, token.as_bytes());
    match c.read_after(&send(64 << 20)) {
        Some(Msg::Error { kind: ErrorKind::Usage, message }) => assert!(message.contains("--block-size"), "{message}"),
        m => panic!("a download in blocks of 64 MiB was not refused: {m:?}"),
    }
    let o = TransferOptions { transfer_id: [32; 16], block_size: 64 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    c.refused(&Msg::Receive { dest: "e/in".into(), options: o }, ErrorKind::Usage);

    // 1 GiB of staging asked for, and the data never read: the server reads
    // ahead no more than its own staging.
    let before = proc_status(srv.pid(), "VmRSS:");
    let Some(Msg::SessionOpened { session }) = c.read_after(&send(1 << 20)) else { panic!("no session:\n{}", srv.log()) };
    let (mut d, _, _) = Raw::handshake(&addr, token.as_bytes());
    assert_eq!(d.read(), Some(Msg::Welcome));
    d.send(&Msg::OpenData { session, index: 0 });
    assert!(matches!(d.read(), Some(Msg::SessionOpened { .. })));
    c.s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if let Some(Msg::Announce { id, meta, .. }) = c.read() {
            c.send(&Msg::Plan { id, skip: false, ranges: vec![(0, meta.size.div_ceil(1 << 20))], passed_over: String::new() });
        }
    }
    let during = proc_status(srv.pid(), "VmRSS:");
    eprintln!("server RSS: {before} KiB before, {during} KiB with a download of 256 MiB never read");
    assert!(during < before + 40 * 1024, "the server's memory grew from {before} to {during} KiB for one download never read");
}

/// A raw producer's streaming session with a sink: the control connection
/// and one data connection attached to it.
fn stream_session(sink: &Server, token: &[u8], producer: &str) -> (Raw, Raw) {
    let (ctl, Some(Msg::SessionOpened { session })) = open_stream(sink, TOKEN_KEY_ID, token, producer) else {
        panic!("the sink did not open a stream")
    };
    let mut data = authenticated(sink, TOKEN_KEY_ID, token);
    assert!(matches!(data.read_after(&Msg::OpenData { session, index: 0 }), Some(Msg::SessionOpened { .. })));
    (ctl, data)
}

/// A connection to `sink` authenticated with the secret `key_id` names.
fn authenticated(sink: &Server, key_id: KeyId, secret: &[u8]) -> Raw {
    let (mut c, _, _) = Raw::handshake_with(&sink.addr(), key_id, secret);
    assert_eq!(c.read(), Some(Msg::Welcome), "the sink did not welcome the credential");
    c
}

/// Asks `sink` for a stream as `producer`: the control connection and the
/// sink's answer.
fn open_stream(sink: &Server, key_id: KeyId, secret: &[u8], producer: &str) -> (Raw, Option<Msg>) {
    let mut ctl = authenticated(sink, key_id, secret);
    ctl.send(&Msg::OpenControl);
    let answer = ctl.read_after(&Msg::Stream { producer: producer.into(), block_size: 65536 });
    (ctl, answer)
}

/// Regression (7): sink producers were not authenticated by name: any
/// holder of the sink's token could stream as any producer. A producer
/// can now be given a credential of its own (`dmover token --producer
/// NAME`), derived from the sink's token: it streams under that name and
/// no other, joins no other producer's session, and asks nothing else of
/// the server; the sink keeps no table of producers.
#[test]
fn sink_producers_are_authenticated_by_name() {
    use dmover_proto::auth::{producer_credential, producer_key_id};
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let out = env.mkdir("sink");
    let sink = env.sink(&out, [] as [&str; 0]);
    let cred_file = env.path("p.credential");
    let made = dmover(["token", "--producer", "p", "--token-file"]).arg(&env.token).arg(&cred_file).run();
    assert_eq!(made.code, 0, "{}", made.stderr);
    assert_eq!(fs::metadata(&cred_file).unwrap().permissions().mode() & 0o777, 0o600);
    let text = fs::read(&cred_file).unwrap();
    assert!(!String::from_utf8_lossy(&text).contains(env.token_str().as_str()), "the credential holds the sink's token");
    let (p_id, p_secret) = producer_credential(&text, "p").unwrap();

    // Its own name: served.
    let (mut ctl, Some(Msg::SessionOpened { session })) = open_stream(&sink, p_id, &p_secret, "p") else {
        panic!("p's credential was refused for p")
    };
    let mut data = authenticated(&sink, p_id, &p_secret);
    assert!(matches!(data.read_after(&Msg::OpenData { session, index: 0 }), Some(Msg::SessionOpened { .. })));
    send_step_block(&mut data, 0, 0, &[1; 4096]);
    assert!(matches!(ctl.read(), Some(Msg::Acked { .. })));
    assert_eq!(ctl.read_after(&one_block_step(0, &[1; 4096])), Some(Msg::StepSaved { step: 0, complete: true }));

    // Another name: refused, and nothing of q's is touched.
    match open_stream(&sink, p_id, &p_secret, "q").1 {
        Some(Msg::Error { kind, message }) => {
            assert_eq!(kind, ErrorKind::Refused, "{message}");
            assert!(message.contains("another producer name"), "{message}");
        }
        other => panic!("p's credential was not refused a stream as q: {other:?}"),
    }
    // p's credential joins none of q's sessions, even knowing its id.
    let (q_id, q_secret) = producer_credential(env.token_str().as_bytes(), "q").unwrap();
    assert_eq!(q_id, producer_key_id("q"));
    let (_q_ctl, Some(Msg::SessionOpened { session: q_session })) = open_stream(&sink, q_id, &q_secret, "q") else {
        panic!("q's own credential was refused")
    };
    let mut intruder = authenticated(&sink, p_id, &p_secret);
    match intruder.read_after(&Msg::OpenData { session: q_session, index: 0 }) {
        Some(Msg::Error { message, .. }) => assert!(message.contains("same credential"), "{message}"),
        other => panic!("p's credential joined q's session: {other:?}"),
    }
    // Nothing but streams.
    let mut other = authenticated(&sink, p_id, &p_secret);
    other.send(&Msg::OpenControl);
    match other.read_after(&Msg::List { path: "x".into() }) {
        Some(Msg::Error { message, .. }) => assert!(message.contains("streaming to this sink only"), "{message}"),
        other => panic!("a producer's credential was allowed a listing: {other:?}"),
    }
    // A made-up secret for a producer's key id does not authenticate.
    let mut c = Raw::connect(&sink.addr());
    c.send(&Raw::hello(p_id, b"not derived from the sink token").1);
    assert!(matches!(c.read(), Some(Msg::Challenge { .. }) | None));
    c.send(&Msg::Proof { proof: [0; 16] });
    match c.read() {
        Some(Msg::Error { kind, .. }) => assert_eq!(kind, ErrorKind::Auth),
        other => panic!("a guessed producer secret was not refused: {other:?}"),
    }
    assert!(!out.join("q").join("step-000000.json").exists());
}

/// Sends block `offset` of `step` on a data connection.
fn send_step_block(data: &mut Raw, step: u64, offset: u64, bytes: &[u8]) {
    let h = dmover_proto::DataHeader {
        file: step,
        offset,
        sum: dmover_proto::digest::block_sum(bytes),
        len: bytes.len() as u32,
        sparse: false,
    };
    data.raw(&h.encode());
    data.raw(bytes);
}

/// A step of one block, as its producer announces its end.
fn one_block_step(step: u64, bytes: &[u8]) -> Msg {
    let sum = dmover_proto::digest::block_sum(bytes);
    let block = dmover_proto::frame::StepBlock { offset: 0, len: bytes.len() as u32, sum, at: String::new() };
    let info = dmover_proto::frame::StepInfo {
        step,
        bytes: bytes.len() as u64,
        digest: dmover_proto::digest::file_digest(&[sum]),
        metadata: vec![],
        records: vec![(0, bytes.len() as u64)],
        blocks: vec![block],
        events: Default::default(),
    };
    Msg::StepEnd { info }
}

#[test]
fn a_step_end_naming_a_four_gigabyte_block_is_refused_without_allocating_it() {
    let env = Env::new();
    let out = env.mkdir("sink");
    let sink = env.sink(&out, [] as [&str; 0]);
    let token = env.token_str();
    let (mut ctl, mut data) = stream_session(&sink, token.as_bytes(), "p");
    send_step_block(&mut data, 0, 0, &[5; 4096]);
    assert!(matches!(ctl.read(), Some(Msg::Acked { .. })));
    let Msg::StepEnd { mut info } = one_block_step(0, &[5; 4096]) else { unreachable!() };
    info.blocks.push(dmover_proto::frame::StepBlock { offset: 65536, len: u32::MAX, sum: [1; 16], at: String::new() });
    info.bytes += u32::MAX as u64;
    match ctl.read_after(&Msg::StepEnd { info }) {
        Some(Msg::Error { message, .. }) => assert!(message.contains("does not fit the block size"), "{message}"),
        other => panic!("a block of 4 GiB in a step's end was not refused: {other:?}"),
    }
    let peak_kib = proc_status(sink.pid(), "VmHWM:");
    assert!(peak_kib < 512 * 1024, "the sink grew to {peak_kib} KiB for one announced block");
    let (mut ctl, mut data) = stream_session(&sink, token.as_bytes(), "q");
    send_step_block(&mut data, 0, 0, &[6; 4096]);
    assert!(matches!(ctl.read(), Some(Msg::Acked { .. })), "the sink stopped serving");
    assert_eq!(ctl.read_after(&one_block_step(0, &[6; 4096])), Some(Msg::StepSaved { step: 0, complete: true }));
}

#[test]
fn a_complete_step_is_never_rewritten_by_a_producer_claiming_the_same_name() {
    let env = Env::new();
    let out = env.mkdir("sink");
    let sink = env.sink(&out, [] as [&str; 0]);
    let token = env.token_str();
    let (mine, theirs) = (vec![1u8; 4096], vec![2u8; 4096]);

    let (mut ctl, mut data) = stream_session(&sink, token.as_bytes(), "p");
    send_step_block(&mut data, 0, 0, &mine);
    assert!(matches!(ctl.read(), Some(Msg::Acked { .. })));
    assert_eq!(ctl.read_after(&one_block_step(0, &mine)), Some(Msg::StepSaved { step: 0, complete: true }));
    let manifest = fs::read(out.join("p/step-000000.json")).unwrap();

    // Another producer under the same name: its block is not taken, and its
    // version of the step is refused.
    let (mut ctl, mut data) = stream_session(&sink, token.as_bytes(), "p");
    send_step_block(&mut data, 0, 0, &theirs);
    data.wait_closed();
    match ctl.read_after(&one_block_step(0, &theirs)) {
        Some(Msg::Error { kind, message }) => {
            assert_eq!(kind, ErrorKind::Refused, "{message}");
            assert!(message.contains("never rewritten"), "{message}");
        }
        other => panic!("another version of a complete step was not refused: {other:?}"),
    }
    assert_eq!(fs::read(out.join("p/step-000000.dat")).unwrap(), mine, "the complete step's data was rewritten");
    assert_eq!(fs::read(out.join("p/step-000000.json")).unwrap(), manifest, "the complete step's manifest was rewritten");

    // The producer itself repeating the same step (its answer lost) hears
    // that it is complete, and its block is acknowledged without a write.
    let (mut ctl, mut data) = stream_session(&sink, token.as_bytes(), "p");
    send_step_block(&mut data, 0, 0, &mine);
    assert!(matches!(ctl.read(), Some(Msg::Acked { .. })));
    assert_eq!(ctl.read_after(&one_block_step(0, &mine)), Some(Msg::StepSaved { step: 0, complete: true }));
    assert_eq!(fs::read(out.join("p/step-000000.json")).unwrap(), manifest);
}

/// Regression (9): nothing protected a connection after the handshake. A
/// relay on the path, without the token, could read every byte, change data
/// undetected, and forward a real client's handshake, then drop the client
/// and use the authenticated connection itself. Now every byte after the
/// handshake is sealed: the relay sees no file content (unless the client
/// chose `--no-encrypt`, whose bytes it does see), a byte it changes is
/// caught and the copy still arrives intact, and frames it injects after
/// a real handshake end the connection unanswered.
#[test]
fn relay_on_the_path_can_neither_read_change_nor_take_over_a_connection() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    const MARK: &[u8] = b"confidential-sequence-0123456789";
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let src = env.path("secret");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("genome.dat"), MARK.repeat((3 << 20) / MARK.len())).unwrap();
    let contains = |hay: &[u8]| hay.windows(MARK.len()).any(|w| w == MARK);

    // Reading: the relay keeps everything clients send.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let keep = seen.clone();
    let relay = Relay::tapped(&srv.addr(), Some(Arc::new(move |b: &mut [u8]| keep.lock().unwrap().extend_from_slice(b))));
    env.cp([src.display().to_string(), relay.url("e/sealed"), "-p".into(), "2".into()]).run().assert_ok();
    assert_same_tree(&src, &export.join("sealed/secret"));
    let wire = std::mem::take(&mut *seen.lock().unwrap());
    assert!(wire.len() > 3 << 20, "the relay saw only {} bytes", wire.len());
    assert!(!contains(&wire), "the file's content crossed the relay in the clear");
    env.cp([src.display().to_string(), relay.url("e/clear"), "-p".into(), "2".into(), "--no-encrypt".into()]).run().assert_ok();
    assert_same_tree(&src, &export.join("clear/secret"));
    assert!(contains(&seen.lock().unwrap()), "--no-encrypt should send data unencrypted, and the relay should see it");
    drop(relay);

    // Changing: one byte flipped once 2 MB have crossed, whatever the protection.
    for protection in [None, Some("--no-encrypt")] {
        let crossed = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let (c, d) = (crossed.clone(), done.clone());
        let relay = Relay::tapped(
            &srv.addr(),
            Some(Arc::new(move |b: &mut [u8]| {
                if c.fetch_add(b.len() as u64, Ordering::SeqCst) > 2 << 20 && !d.swap(true, Ordering::SeqCst) {
                    b[b.len() / 2] ^= 0x20;
                }
            })),
        );
        let dest = format!("e/changed{}", protection.is_some() as u8);
        let mut args = vec![src.display().to_string(), relay.url(&dest), "-p".into(), "2".into()];
        args.extend(protection.map(String::from));
        let r = env.cp(args).run();
        r.assert_ok();
        assert!(done.load(Ordering::SeqCst), "the relay never changed a byte");
        assert_same_tree(&src, &export.join(format!("changed{}/secret", protection.is_some() as u8)));
    }
    let log = srv.log();
    assert!(log.matches("integrity check").count() >= 2, "the changed bytes were not caught as such:\n{log}");

    // Taking over: a real client's handshake, then the relay's own frames.
    let (mut c, _, _) = Raw::handshake(&srv.addr(), env.token_str().as_bytes());
    let options = TransferOptions { transfer_id: [3; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let mut injected = Raw::bytes(&Msg::OpenControl);
    injected.extend(Raw::bytes(&Msg::Receive { dest: "e/hijacked".into(), options }));
    c.s.write_all(&injected).unwrap();
    assert!(c.wait_closed() < Duration::from_secs(5), "the server kept a connection that carried unsealed frames");
    assert!(!export.join("hijacked").exists(), "injected frames were obeyed");
    let refused = wait_until(Duration::from_secs(5), || srv.log().contains("the peer does not seal its records"));
    assert!(refused, "the injected frames were not refused as unsealed:\n{}", srv.log());
}

/// Regression (10): a ticket could be used again and again until it
/// expired, for sessions of its own and to join others. Now a ticket opens
/// one session: a second `Receive` with it is refused, and its connections
/// may join that session and no other.
#[test]
fn tickets_are_single_use_and_join_only_the_session_they_opened() {
    let env = Env::new();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let addr = srv.addr();
    let token = env.token_str();
    let options = TransferOptions { transfer_id: [5; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let receive = Msg::Receive { dest: "e/in".into(), options };

    // A ticket for e/in, as a client asks for one for a third-party copy.
    let mut owner = Raw::control(&addr, token.as_bytes());
    let Some(Msg::Ticket { key_id, wrapped_secret, .. }) = owner.read_after(&Msg::Grant { dest: "e/in".into() }) else {
        panic!("no ticket")
    };
    let secret = owner.session_key.as_ref().unwrap().wrap(&key_id, &wrapped_secret);
    let with_ticket = || {
        let (mut c, _, _) = Raw::handshake_with(&addr, key_id, &secret);
        assert_eq!(c.read(), Some(Msg::Welcome), "the ticket was not welcomed");
        c
    };

    // Its first session.
    let mut first = with_ticket();
    first.send(&Msg::OpenControl);
    let Some(Msg::SessionOpened { session: mine }) = first.read_after(&receive) else { panic!("the ticket opened no session") };

    // Used again, on another connection: refused.
    let mut again = with_ticket();
    again.send(&Msg::OpenControl);
    again.refused(&receive, ErrorKind::Refused);

    // Joining a session the token holder opened: refused; its own: allowed.
    let mut other = Raw::control(&addr, token.as_bytes());
    let elsewhere = Msg::Receive { dest: "e/other".into(), options: TransferOptions { transfer_id: [6; 16], ..options } };
    let Some(Msg::SessionOpened { session: theirs }) = other.read_after(&elsewhere) else { panic!("no session for the token") };
    with_ticket().refused(&Msg::OpenData { session: theirs, index: 0 }, ErrorKind::Refused);
    assert_eq!(with_ticket().read_after(&Msg::OpenData { session: mine, index: 0 }), Some(Msg::SessionOpened { session: mine }));
    assert!(srv.log().contains("a ticket is used once"), "{}", srv.log());
}

/// A symlink a sender announces is data: the server makes it as sent, and
/// a file announced through it afterwards is refused, never written where
/// the link leads (outside the export, or anywhere).
#[test]
fn a_symlink_announced_then_a_file_through_it_writes_nothing_where_it_leads() {
    let env = Env::new();
    let export = env.mkdir("export");
    let outside = env.mkdir("outside");
    let srv = env.serve(&[("e", &export)]);
    let target = outside.display().to_string();
    let link = FileMeta {
        path: "l".into(),
        size: 0,
        mtime_s: 0,
        mtime_ns: 0,
        mode: FileMeta::LINK | 0o777,
        target: Some(target.clone()),
        ..Default::default()
    };
    // A transfer that did not ask for symlinks takes none.
    let mut c = Raw::control(&srv.addr(), env.token_str().as_bytes());
    let options = TransferOptions { transfer_id: [11; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    c.send(&Msg::Receive { dest: "e/in".into(), options });
    assert!(matches!(c.read(), Some(Msg::SessionOpened { .. })));
    c.send(&Msg::Announce { id: 1, meta: link.clone(), digest: None });
    assert!(matches!(c.read(), Some(Msg::Failed { kind: ErrorKind::Refused, .. })), "a symlink was taken without --links");
    assert!(fs::symlink_metadata(export.join("in/l")).is_err());

    let mut c = Raw::control(&srv.addr(), env.token_str().as_bytes());
    let options = TransferOptions { transfer_id: [12; 16], flags: TransferFlags::LINKS, ..options };
    c.send(&Msg::Receive { dest: "e/in".into(), options });
    assert!(matches!(c.read(), Some(Msg::SessionOpened { .. })));
    c.send(&Msg::Announce { id: 1, meta: link, digest: None });
    assert!(matches!(c.read(), Some(Msg::Done { id: 1, .. })), "the symlink was not made");
    assert_eq!(fs::read_link(export.join("in/l")).unwrap(), outside, "the symlink's target is kept as sent");
    for (id, path) in [(2, "l/x"), (3, "l/deeper/x")] {
        let meta = FileMeta { path: path.into(), size: 5, mtime_s: 0, mtime_ns: 0, mode: 0o644, ..Default::default() };
        c.send(&Msg::Announce { id, meta, digest: None });
        match c.read() {
            Some(Msg::Failed { kind: ErrorKind::Refused, .. }) => {}
            m => panic!("a file announced through a symlink was not refused: {m:?}"),
        }
    }
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0, "something was written where the symlink leads");
}

/// A third-party ticket allows one thing: receiving into the destination it
/// was issued for. Another destination in its export, another export,
/// sending, listing and another ticket are refused, and none of them uses
/// the ticket up: it still opens its own session afterwards.
#[test]
fn a_ticket_allows_receiving_into_its_own_destination_only() {
    let env = Env::new();
    let (e, f) = (env.mkdir("e"), env.mkdir("f"));
    fs::write(e.join("secret.dat"), "not for a ticket holder").unwrap();
    let srv = env.serve(&[("e", &e), ("f", &f)]);
    let addr = srv.addr();
    let mut owner = Raw::control(&addr, env.token_str().as_bytes());
    let Some(Msg::Ticket { key_id, wrapped_secret, .. }) = owner.read_after(&Msg::Grant { dest: "e/in".into() }) else {
        panic!("no ticket")
    };
    let secret = owner.session_key.as_ref().unwrap().wrap(&key_id, &wrapped_secret);
    let options = TransferOptions { transfer_id: [9; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let params = EngineParams { streams: 1, ..EngineParams::default() };
    for m in [
        Msg::Receive { dest: "e/elsewhere".into(), options },
        Msg::Receive { dest: "e".into(), options },
        Msg::Receive { dest: "f/in".into(), options },
        Msg::Receive { dest: "e/in/sub".into(), options },
        Msg::Send { sources: vec!["e/secret.dat".into()], options, params },
        Msg::List { path: "e/".into() },
        Msg::Grant { dest: "e/in".into() },
    ] {
        let (mut c, _, _) = Raw::handshake_with(&addr, key_id, &secret);
        assert_eq!(c.read(), Some(Msg::Welcome), "the ticket was not welcomed");
        c.send(&Msg::OpenControl);
        c.send(&m);
        match c.read() {
            Some(Msg::Error { kind: ErrorKind::Refused, message }) => {
                assert!(message.contains("only allows receiving into its destination"), "{m:?}: {message}")
            }
            other => panic!("a ticket for e/in was allowed {m:?}: {other:?}"),
        }
    }
    let (mut c, _, _) = Raw::handshake_with(&addr, key_id, &secret);
    assert_eq!(c.read(), Some(Msg::Welcome));
    c.send(&Msg::OpenControl);
    assert!(matches!(c.read_after(&Msg::Receive { dest: "e/in".into(), options }), Some(Msg::SessionOpened { .. })));
}

/// Regression (10): the session a ticket opened outlived the ticket, for as
/// long as its holder kept it going. Now it ends when the ticket expires,
/// unless the client that asked for the ticket (a token holder) renews it;
/// a ticket holder cannot renew its own ticket.
#[test]
fn a_ticket_session_ends_when_its_ticket_expires_unrenewed() {
    const LIFETIME: Duration = Duration::from_secs(2);
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.extra = vec!["--ticket-lifetime".into(), LIFETIME.as_secs().to_string().into()];
    let srv = Server::start(spec);
    let addr = srv.addr();
    let token = env.token_str();
    let mut owner = Raw::control(&addr, token.as_bytes());
    // A ticket, and the session it opens as a source server would.
    let ticket = |owner: &mut Raw, dest: &str| {
        let Some(Msg::Ticket { key_id, wrapped_secret, lifetime }) = owner.read_after(&Msg::Grant { dest: dest.into() }) else {
            panic!("no ticket")
        };
        assert_eq!(u64::from(lifetime), LIFETIME.as_secs());
        let secret = owner.session_key.as_ref().unwrap().wrap(&key_id, &wrapped_secret);
        let (mut c, _, _) = Raw::handshake_with(&addr, key_id, &secret);
        assert_eq!(c.read(), Some(Msg::Welcome));
        c.send(&Msg::OpenControl);
        let options = TransferOptions {
            transfer_id: dmover_engine::handshake::random(),
            block_size: 1 << 20,
            flags: TransferFlags::empty(),
            tcp_buffer: 0,
        };
        let Some(Msg::SessionOpened { session }) = c.read_after(&Msg::Receive { dest: dest.into(), options }) else { panic!("no session") };
        (key_id, secret, session, c)
    };

    // Not renewed: the session ends with the ticket.
    let opened = Instant::now();
    let (key_id, _, _, mut unrenewed) = ticket(&mut owner, "e/a");
    unrenewed.wait_closed();
    let lasted = opened.elapsed();
    assert!(lasted >= LIFETIME - Duration::from_millis(200) && lasted < LIFETIME + Duration::from_secs(3), "the session lasted {lasted:?}");
    assert!(srv.log().contains("expired without being renewed"), "{}", srv.log());
    match owner.read_after(&Msg::Renew { key_id }) {
        Some(Msg::Error { kind, message }) => {
            assert_eq!(kind, ErrorKind::Refused);
            assert!(message.contains("expired"), "{message}");
        }
        other => panic!("an expired ticket was renewed: {other:?}"),
    }

    // Renewed by the token holder: the session outlives twice the lifetime,
    // and a data connection with the ticket still joins it.
    let (key_id, secret, session, mut renewed) = ticket(&mut owner, "e/b");
    let until = Instant::now() + 2 * LIFETIME;
    while Instant::now() < until {
        assert_eq!(owner.read_after(&Msg::Renew { key_id }), Some(Msg::Renewed { lifetime: LIFETIME.as_secs() as u32 }));
        std::thread::sleep(LIFETIME / 4);
    }
    let (mut data, _, _) = Raw::handshake_with(&addr, key_id, &secret);
    assert_eq!(data.read(), Some(Msg::Welcome), "a renewed ticket was refused");
    assert_eq!(data.read_after(&Msg::OpenData { session, index: 0 }), Some(Msg::SessionOpened { session }));

    // The ticket's holder cannot renew it itself.
    let (mut holder, _, _) = Raw::handshake_with(&addr, key_id, &secret);
    assert_eq!(holder.read(), Some(Msg::Welcome));
    holder.send(&Msg::OpenControl);
    holder.refused(&Msg::Renew { key_id }, ErrorKind::Refused);

    // Renewals stop: the session ends.
    let stopped = Instant::now();
    renewed.wait_closed();
    assert!(stopped.elapsed() < LIFETIME + Duration::from_secs(3), "the session outlived its ticket by {:?}", stopped.elapsed());
}

/// A receiving session with a data connection, for a raw sender: the
/// control connection, with `Receive` into `dest` answered, and the data
/// connection attached.
fn raw_upload(srv: &Server, token: &[u8], dest: &str, options: TransferOptions) -> (Raw, Raw) {
    let mut c = Raw::control(&srv.addr(), token);
    let Some(Msg::SessionOpened { session }) = c.read_after(&Msg::Receive { dest: dest.into(), options }) else {
        panic!("no session:\n{}", srv.log())
    };
    let (mut d, _, _) = Raw::handshake(&srv.addr(), token);
    assert_eq!(d.read(), Some(Msg::Welcome));
    assert!(matches!(d.read_after(&Msg::OpenData { session, index: 0 }), Some(Msg::SessionOpened { .. })));
    (c, d)
}

/// A hole (blocks sent without their bytes, as zeros) that is not whole
/// blocks of its file — off a block boundary, ending inside a block, past
/// the announced size, more blocks than one hole may stand for — ends the
/// session with an error naming the hole, commits nothing, and the server
/// goes on serving; a hole of whole blocks stands for zeros. A sink
/// refuses a hole outright (it closes the data connection, as for any
/// frame it does not take) and goes on serving.
#[test]
fn holes_that_are_not_whole_blocks_of_their_file_end_the_session() {
    const BS: u64 = 16 * 1024;
    let env = Env::new();
    let export = env.mkdir("export");
    let mut srv = env.serve(&[("e", &export)]);
    let token = env.token_str();
    let size = 2000 * BS + 100;
    let meta = |name: &str| FileMeta { path: name.into(), size, mtime_s: 1_000_000_000, mtime_ns: 0, mode: 0o644, ..Default::default() };
    let options =
        |i: u8| TransferOptions { transfer_id: [70 + i; 16], block_size: BS as u32, flags: TransferFlags::empty(), tcp_buffer: 0 };
    let cases = [(100, BS), (0, BS + 1), (1999 * BS, BS + 101), (0, 1025 * BS), (0, 0), (u64::MAX - BS + 1, BS)];
    for (i, (offset, len)) in cases.into_iter().enumerate() {
        let (mut c, mut d) = raw_upload(&srv, token.as_bytes(), "e/in", options(i as u8));
        c.send(&Msg::Announce { id: 1, meta: meta(&format!("h{i}.dat")), digest: None });
        assert!(matches!(next_but_pings(&mut c), Some(Msg::Plan { id: 1, .. })), "case {i}: not planned:\n{}", srv.log());
        d.send(&Msg::Hole { id: 1, offset, len });
        match next_but_pings(&mut c) {
            Some(Msg::Error { message, .. }) => assert!(message.contains("hole"), "case {i}: the error does not name the hole: {message}"),
            m => panic!("case {i}: a hole of {len} bytes at {offset} of a file of {size} bytes was not refused: {m:?}\n{}", srv.log()),
        }
    }
    assert!(srv.running(), "{}", srv.log());
    let left: Vec<String> =
        fs::read_dir(export.join("in")).map_or(Vec::new(), |r| r.map(|e| e.unwrap().file_name().to_string_lossy().into()).collect());
    assert!(left.iter().all(|n| !n.starts_with('h')), "a file of a refused session was committed: {left:?}");

    // Whole blocks: a hole of the first 1,024, another of the rest but the
    // last, which comes with its bytes.
    let (mut c, mut d) = raw_upload(&srv, token.as_bytes(), "e/in", options(20));
    c.send(&Msg::Announce { id: 1, meta: meta("zeros.dat"), digest: None });
    assert!(matches!(next_but_pings(&mut c), Some(Msg::Plan { id: 1, .. })), "not planned:\n{}", srv.log());
    d.send(&Msg::Hole { id: 1, offset: 0, len: 1024 * BS });
    d.send(&Msg::Hole { id: 1, offset: 1024 * BS, len: 976 * BS });
    let tail = [7u8; 100];
    let sum = dmover_proto::digest::block_sum(&tail);
    let h = dmover_proto::DataHeader { file: 1, offset: 2000 * BS, sum, len: 100, sparse: false };
    d.raw(&h.encode());
    d.raw(&tail);
    let mut sums = vec![dmover_proto::digest::block_sum(&vec![0; BS as usize]); 2000];
    sums.push(sum);
    let digest = dmover_proto::digest::file_digest(&sums);
    c.send(&Msg::FileEnd { id: 1, digest });
    assert_eq!(next_but_pings(&mut c), Some(Msg::Done { id: 1, digest }), "{}", srv.log());
    let got = fs::read(export.join("in/zeros.dat")).unwrap();
    assert!(got.len() as u64 == size && got[..2000 * BS as usize].iter().all(|b| *b == 0) && got[2000 * BS as usize..] == tail);
    assert!(fs::metadata(export.join("in/zeros.dat")).unwrap().blocks() * 512 <= 64 * 1024, "the holes were written");

    let sink_dir = env.mkdir("sink");
    let sink = env.sink(&sink_dir, Vec::<String>::new());
    let (_ctl, mut data) = stream_session(&sink, token.as_bytes(), "sim");
    data.send(&Msg::Hole { id: 1, offset: 0, len: 65536 });
    data.wait_closed();
    assert!(sink.log().lines().any(|l| l.contains("WARN") && l.contains("hole")), "the sink did not say why:\n{}", sink.log());
    let (mut ctl, mut data) = stream_session(&sink, token.as_bytes(), "sim2");
    send_step_block(&mut data, 0, 0, &[6; 4096]);
    assert!(matches!(ctl.read(), Some(Msg::Acked { .. })), "the sink stopped serving:\n{}", sink.log());
}

/// A token holder cannot make a device, give a file to root (or anyone),
/// or set an attribute outside `user.*` in an export whose operator did
/// not allow owners: asked for outright, the transfer is refused; asked
/// for as `--archive` does, the device is passed over and the file keeps
/// the server's owner and only its `user.*` attribute. Into an export that
/// allows them, the same announcements are made as sent.
#[test]
fn a_token_holder_makes_no_device_and_sets_no_owner_unless_the_export_allows_it() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let env = Env::new();
    let (plain, trusted) = (env.mkdir("plain"), env.mkdir("trusted"));
    let mut spec = ServerSpec::new(&env.token, &[("e", &plain), ("t", &trusted)], &env.path("server.log"));
    spec.extra = vec!["--allow-owners".into(), "t".into()];
    let srv = Server::start(spec);
    let owner = Some(Owner { uid: 0, gid: 0, user: String::new(), group: String::new() });
    let device = FileMeta { path: "null".into(), mode: FileMeta::CHAR | 0o666, rdev: 0x103, owner: owner.clone(), ..Default::default() };
    let xattrs = vec![
        Xattr { name: b"user.note".to_vec(), value: b"kept".to_vec() },
        Xattr { name: b"trusted.planted".to_vec(), value: b"x".to_vec() },
    ];
    let file = FileMeta {
        path: "f".into(),
        mode: 0o644,
        owner: Some(Owner { uid: 4242, ..owner.clone().unwrap() }),
        xattrs,
        ..Default::default()
    };
    let wanted = TransferFlags::DEVICES | TransferFlags::OWNER | TransferFlags::GROUP | TransferFlags::XATTRS;
    let session = |dest: &str, flags: TransferFlags, id: u8| {
        let mut c = Raw::control(&srv.addr(), env.token_str().as_bytes());
        let options = TransferOptions { transfer_id: [id; 16], block_size: 1 << 20, flags, tcp_buffer: 0 };
        c.send(&Msg::Receive { dest: dest.into(), options });
        c
    };

    // Asked for outright: refused before anything is made.
    let mut c = session("e/outright", wanted, 41);
    match c.read() {
        Some(Msg::Error { kind: ErrorKind::Refused, message }) => assert!(message.contains("--allow-owners"), "{message}"),
        m => panic!("owners and devices were taken in an export that does not allow them: {m:?}"),
    }
    assert!(!plain.join("outright").exists());

    // As --archive asks: the device passed over, the file the server's, user.* only.
    for (export, dir, id) in [("e", &plain, 42), ("t", &trusted, 43)] {
        let mut c = session(&format!("{export}/archive"), wanted | TransferFlags::IF_ALLOWED, id);
        assert!(matches!(c.read(), Some(Msg::SessionOpened { .. })));
        c.send(&Msg::Announce { id: 1, meta: device.clone(), digest: None });
        // Made (Done), or passed over as if there already (a Plan to skip it).
        let m = c.read();
        assert!(matches!(m, Some(Msg::Done { id: 1, .. } | Msg::Plan { id: 1, skip: true, .. })), "the device was refused: {m:?}");
        c.send(&Msg::Announce { id: 2, meta: file.clone(), digest: None });
        assert!(matches!(c.read(), Some(Msg::Plan { id: 2, skip: false, .. })));
        c.send(&Msg::FileEnd { id: 2, digest: dmover_proto::digest::file_digest(&[]) });
        let m = c.read();
        assert!(matches!(m, Some(Msg::Done { id: 2, .. })), "the empty file was not made: {m:?}");
        let made = fs::symlink_metadata(dir.join("archive/null"));
        let f = fs::metadata(dir.join("archive/f")).unwrap();
        let snap = dmover_testkit::tree::snapshot(&dir.join("archive")).unwrap();
        let names: Vec<String> = snap.entries[b"f".as_slice()].xattrs.keys().map(|k| String::from_utf8_lossy(k).into_owned()).collect();
        if export == "e" {
            assert!(made.is_err(), "a device was made in an export that does not allow it");
            assert_eq!((f.uid(), names), (0, vec!["user.note".to_string()]), "an owner or a trusted.* attribute was set");
            assert!(srv.log().contains("null: skipped"), "{}", srv.log());
        } else {
            assert!(made.unwrap().file_type().is_char_device(), "the allowed export has no device");
            assert_eq!((f.uid(), names), (4242, vec!["trusted.planted".to_string(), "user.note".to_string()]));
        }
    }
}

/// A sender that knows the token announces hard links (`HardLink`) to
/// files this transfer did not receive: one the export holds beside the
/// destination, one planted in the destination, one outside the export,
/// one received but never said to have other names, and one still in
/// flight. Each is refused, naming why; the files are untouched and no
/// link is made, while a link to a file the same transfer received and
/// said was linked is made. A transfer without the hard-links flag makes
/// none at all.
#[test]
fn hard_links_to_files_the_transfer_did_not_receive_are_refused() {
    use dmover_proto::digest::file_digest;
    let env = Env::new();
    let export = env.mkdir("export");
    let outside = env.mkdir("outside");
    fs::write(export.join("shadow"), "root:secret").unwrap();
    fs::create_dir_all(export.join("in")).unwrap();
    fs::write(export.join("in/planted"), "someone else's file").unwrap();
    fs::write(outside.join("secret.dat"), "outside").unwrap();
    let srv = env.serve(&[("e", &export)]);
    let token = env.token_str();
    let meta = |path: &str| FileMeta { path: path.into(), size: 0, mtime_s: 1, mtime_ns: 0, mode: 0o644, ..Default::default() };
    let link = |id, path: &str, first: &str| Msg::HardLink { id, path: path.into(), first: first.into() };
    let mut c = Raw::control(&srv.addr(), token.as_bytes());
    let options = TransferOptions { transfer_id: [50; 16], block_size: 1 << 20, flags: TransferFlags::HARD_LINKS, tcp_buffer: 0 };
    assert!(matches!(c.read_after(&Msg::Receive { dest: "e/in".into(), options }), Some(Msg::SessionOpened { .. })));
    // Two empty files received: `mine`, said to have other names, and `unmarked`.
    c.send(&Msg::Linked { id: 1 });
    for (id, path) in [(1, "mine"), (2, "unmarked")] {
        c.send(&Msg::Announce { id, meta: meta(path), digest: None });
        assert!(matches!(next_but_pings(&mut c), Some(Msg::Plan { id: i, .. }) if i == id), "{path} not planned:\n{}", srv.log());
        let done = c.read_after(&Msg::FileEnd { id, digest: file_digest(&[]) });
        assert!(matches!(done, Some(Msg::Done { id: i, .. }) if i == id), "{path}: {done:?}\n{}", srv.log());
    }
    // A file still in flight, said to have other names.
    c.send(&Msg::Linked { id: 3 });
    c.send(&Msg::Announce { id: 3, meta: FileMeta { size: 10, ..meta("pending") }, digest: None });
    assert!(matches!(next_but_pings(&mut c), Some(Msg::Plan { id: 3, .. })), "{}", srv.log());
    let hostile = [
        (4, "stolen-planted", "planted"),
        (5, "stolen-unmarked", "unmarked"),
        (6, "stolen-pending", "pending"),
        (7, "stolen-shadow", "../shadow"),
        (8, "stolen-outside", "../../outside/secret.dat"),
        (9, "stolen-abs", "/etc/passwd"),
        (10, "mine", "mine"),
    ];
    for (id, path, first) in hostile {
        match c.read_after(&link(id, path, first)) {
            Some(Msg::Failed { id: i, kind: ErrorKind::Refused, message, .. }) if i == id => {
                assert!(message.contains("which this transfer did not receive"), "{path} -> {first}: {message}")
            }
            m => panic!("a hard link of {path} to {first} was not refused: {m:?}\n{}", srv.log()),
        }
    }
    let done = c.read_after(&link(11, "mine-too", "mine"));
    assert!(matches!(done, Some(Msg::Done { id: 11, .. })), "a link to a file received was not made: {done:?}\n{}", srv.log());
    c.send(&Msg::Abort { id: 3, kind: ErrorKind::SourceChanged, message: "given up".into() });
    assert!(matches!(c.read_after(&Msg::Finish { files: 3, bytes: 0, set_digest: 0 }), Some(Msg::Finished { files: 3, .. })));

    let ino = |p: &Path| fs::metadata(p).unwrap().ino();
    assert_eq!(ino(&export.join("in/mine")), ino(&export.join("in/mine-too")), "mine-too is not a name of mine");
    for (file, content) in [
        (export.join("shadow"), "root:secret"),
        (export.join("in/planted"), "someone else's file"),
        (outside.join("secret.dat"), "outside"),
    ] {
        assert_eq!(fs::read_to_string(&file).unwrap(), content, "{}", file.display());
        assert_eq!(fs::metadata(&file).unwrap().nlink(), 1, "{} was given another name", file.display());
    }
    let names: Vec<_> = list_tree(&export.join("in")).into_keys().collect();
    assert_eq!(names, ["mine", "mine-too", "planted", "unmarked"], "names made in the destination");
    assert!(srv.log().lines().filter(|l| l.contains("did not receive")).count() >= 6, "the refusals were not logged:\n{}", srv.log());

    // Without the flag, not even a link to a file received is made.
    let mut c = Raw::control(&srv.addr(), token.as_bytes());
    let options = TransferOptions { transfer_id: [51; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    assert!(matches!(c.read_after(&Msg::Receive { dest: "e/flagless".into(), options }), Some(Msg::SessionOpened { .. })));
    c.send(&Msg::Linked { id: 1 });
    c.send(&Msg::Announce { id: 1, meta: meta("f"), digest: None });
    assert!(matches!(next_but_pings(&mut c), Some(Msg::Plan { id: 1, .. })));
    assert!(matches!(c.read_after(&Msg::FileEnd { id: 1, digest: file_digest(&[]) }), Some(Msg::Done { id: 1, .. })));
    match c.read_after(&link(2, "g", "f")) {
        Some(Msg::Failed { id: 2, kind: ErrorKind::Refused, message, .. }) => assert!(message.contains("--hard-links"), "{message}"),
        m => panic!("a hard link in a transfer without the flag was not refused: {m:?}"),
    }
    assert!(!export.join("flagless/g").exists());
}
