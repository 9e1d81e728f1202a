//! `dmover serve --metrics`: a real Prometheus scrapes a real server
//! (off loopback, with the page token) while files go up and down, and
//! what it stored (read back through its own HTTP API) matches what moved;
//! `promtool check metrics` accepts the page; each connection is counted
//! by how its handshake ended, and refused requests, push sessions and the
//! blocks sent again are counted. The pages take a token of their own,
//! never the server's; slow clients cannot keep others out; a loopback
//! page answers only requests addressed to loopback.

mod util;

use dmover_proto::{ErrorKind, Msg};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use util::*;

/// A Prometheus server scraping `target` every second, sending the token
/// in `credentials` as a bearer credential; killed when dropped.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Prometheus {
    fn start(dir: &Path, target: &str, credentials: &Path) -> Prometheus {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: dmover\n    \
                 authorization:\n      credentials_file: {}\n    static_configs:\n      - targets: ['{target}']\n",
                credentials.display()
            ),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{}", closed_port());
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, addr };
        let ready = wait_until(Duration::from_secs(60), || http_get(&p.addr, "/-/ready").is_some_and(|(c, _)| c == 200));
        assert!(ready, "prometheus not ready; log:\n{}", std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default());
        p
    }

    /// The value of the instant query `q` (one series), if it has one.
    fn value(&self, q: &str) -> Option<f64> {
        let (code, body) = http_get(&self.addr, &format!("/api/v1/query?query={q}"))?;
        assert_eq!(code, 200, "query {q}: {body}");
        let j: Value = serde_json::from_str(&body).unwrap();
        let result = j["data"]["result"].as_array()?;
        assert!(result.len() <= 1, "query {q} has several series: {body}");
        result.first()?["value"][1].as_str()?.parse().ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn prometheus_reads_what_moved() {
    if !(on_path("prometheus") && on_path("promtool")) {
        let _ = dmover_testkit::skip("needs prometheus and promtool (Debian's `prometheus` package; ./test installs it)");
        return;
    }
    let env = Env::new();
    let src = env.mkdir("src");
    let mut bytes = 0;
    for i in 0..6u64 {
        let size = (1 << 20) + i * 4099;
        write_random(&src.join(format!("f{i}")), size, i);
        bytes += size;
    }
    let export = env.mkdir("export");
    // Off loopback: Prometheus shows the page token, as it is told to.
    let port = closed_port();
    let pages = page_token(&env, "pages-token");
    let mut spec = ServerSpec::new(&env.path("token"), &[("data", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), format!("0.0.0.0:{port}").into(), "--metrics-token-file".into(), pages.clone().into()];
    let server = Server::start(spec);
    let metrics = format!("127.0.0.1:{port}");
    let bearer = format!("Authorization: Bearer {}\r\n", token_text(&pages));
    let prometheus = Prometheus::start(&env.mkdir("prometheus"), &metrics, &pages);

    // Up, slowly (3 MB/s): the page shows the bytes of a running session.
    let up = env.slow_cp(src.display().to_string(), server.url("data/")).spawn();
    let mut seen_running = false;
    let done = wait_until(Duration::from_secs(60), || {
        let (_, page) = http_get_with(&metrics, "/metrics", &bearer).expect("the metrics page answers");
        let got = sample(&page, "dmover_received_bytes_total").expect("received bytes on the page");
        let active = sample(&page, "dmover_sessions_active{kind=\"receive\"}").expect("running receive sessions on the page");
        seen_running |= got > 0.0 && (got as u64) < bytes && active == 1.0;
        got as u64 == bytes
    });
    up.wait().assert_ok();
    assert!(done, "the page never counted all {bytes} bytes received");
    assert!(seen_running, "no scrape of the page saw the upload's bytes while it ran");

    // Down again, into a fresh directory.
    let back = env.mkdir("back");
    env.cp([server.url("data/src"), back.display().to_string()]).run().assert_ok();
    assert_same_tree(&src, &back.join("src"));

    // Refused: a client with another token.
    let wrong = env.path("wrong-token");
    std::fs::write(&wrong, "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef").unwrap();
    chmod(&wrong, 0o600);
    let refused = dmover(["ls", "--token-file", wrong.to_str().unwrap(), &server.url("data/")]).run();
    assert_ne!(refused.code, 0, "a wrong token was let in: {}", refused.stdout);

    // What Prometheus stored, through its own API.
    let wanted = [
        ("dmover_received_bytes_total", bytes as f64),
        ("dmover_sent_bytes_total", bytes as f64),
        ("dmover_received_files_total", 6.0),
        ("dmover_sent_files_total", 6.0),
        ("dmover_sessions_total{kind=\"receive\"}", 1.0),
        ("dmover_sessions_total{kind=\"send\"}", 1.0),
        ("dmover_connections_total{outcome=\"bad_credential\"}", 1.0),
    ];
    let stored = wait_until(Duration::from_secs(30), || wanted.iter().all(|(q, v)| prometheus.value(q) == Some(*v)));
    let got: Vec<_> = wanted.iter().map(|(q, _)| (q, prometheus.value(q))).collect();
    assert!(stored, "Prometheus holds {got:?}, want {wanted:?}");
    assert_eq!(prometheus.value("up"), Some(1.0), "the scrapes failed");

    // The page is well-formed, by Prometheus' own linter.
    let (code, page) = http_get_with(&metrics, "/metrics", &bearer).unwrap();
    assert_eq!(code, 200);
    promtool_check(&page);
    drop(server);
}

/// A new page token in `name`, made by `dmover token`.
fn page_token(env: &Env, name: &str) -> PathBuf {
    let file = env.path(name);
    let r = dmover(["token".as_ref(), file.as_os_str()]).run();
    assert_eq!(r.code, 0, "dmover token: {}", r.stderr);
    file
}

/// The token in `file`.
fn token_text(file: &Path) -> String {
    std::fs::read_to_string(file).unwrap().trim().to_string()
}

/// Sends `request` as it is; the status code and body of the answer.
fn raw(addr: &str, request: &[u8]) -> Option<(u16, String)> {
    let mut c = TcpStream::connect(addr).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    c.write_all(request).ok()?;
    let mut answer = String::new();
    c.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    Some((head.split_whitespace().nth(1)?.parse().ok()?, body.to_string()))
}

#[test]
fn the_metrics_page_answers_nothing_but_get() {
    let env = Env::new();
    let export = env.mkdir("export");
    let metrics = format!("127.0.0.1:{}", closed_port());
    let mut spec = ServerSpec::new(&env.path("token"), &[("data", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), metrics.clone().into()];
    let mut server = Server::start(spec);
    assert!(wait_until(Duration::from_secs(10), || http_get(&metrics, "/metrics").is_some_and(|a| a.0 == 200)));
    assert_eq!(http_get(&metrics, "/nothing").map(|a| a.0), Some(404));
    assert_eq!(http_get(&metrics, "/metrics/../etc/passwd").map(|a| a.0), Some(404));
    assert_eq!(raw(&metrics, b"POST /metrics HTTP/1.0\r\n\r\n").map(|a| a.0), Some(405));
    // Just past the 8 KiB a request head may take (so that the server has
    // read all of it when it answers).
    let mut long = b"GET /metrics HTTP/1.0\r\nX-Filler: ".to_vec();
    long.resize((8 << 10) + 8, b'a');
    assert_eq!(raw(&metrics, &long).map(|a| a.0), Some(431));
    // A client that connects and says nothing, many times over, does not
    // stop the page from answering, nor the server from serving.
    let silent: Vec<TcpStream> = (0..32).filter_map(|_| TcpStream::connect(&metrics).ok()).collect();
    assert!(wait_until(Duration::from_secs(15), || http_get(&metrics, "/metrics").is_some_and(|a| a.0 == 200)));
    drop(silent);
    let src = env.mkdir("src");
    write_random(&src.join("f"), 1000, 1);
    env.cp([src.display().to_string(), server.url("data/")]).run().assert_ok();
    assert!(server.running(), "the server died; log:\n{}", server.log());
}

/// CLI.md `serve --metrics`: the status page of a server lists its running
/// sessions; on an address other than loopback its data and the metrics
/// are given only to a request that shows the page token (the page itself
/// holds none).
#[test]
fn the_servers_page_shows_running_sessions_and_off_loopback_needs_the_page_token() {
    let env = Env::new();
    let export = env.mkdir("export");
    let port = closed_port();
    let pages = page_token(&env, "pages-token");
    let mut spec = ServerSpec::new(&env.token, &[("data", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), format!("0.0.0.0:{port}").into(), "--metrics-token-file".into(), pages.clone().into()];
    let server = Server::start(spec);
    let addr = format!("127.0.0.1:{port}");
    let token = token_text(&pages);
    let bearer = format!("Authorization: Bearer {token}\r\n");
    assert!(wait_until(Duration::from_secs(10), || http_get_with(&addr, "/", "").is_some_and(|(c, _)| c == 200)), "no page");
    let (_, html) = http_get_with(&addr, "/", "").unwrap();
    assert!(html.starts_with("<!doctype html>"), "{html}");
    for outside in [" src=", " href=", "url(", "@import", "https://"] {
        assert!(!html.contains(outside), "the page is not self-contained: it has {outside:?}");
    }
    for (target, header) in [
        ("/status.json", ""),
        ("/metrics", ""),
        ("/metrics", "Authorization: Bearer not-the-token\r\n"),
        ("/metrics", &format!("Authorization: Basic {token}\r\n")),
        // The token in the address: the page reads it from the fragment,
        // which browsers never send; the server takes it from the header only.
        (&format!("/metrics?token={token}"), ""),
    ] {
        let (code, body) = http_get_with(&addr, target, header).unwrap();
        assert_eq!(code, 401, "{target} with {header:?} was let in: {body}");
        assert!(body.contains("token"), "{body}");
    }
    let (code, page) = http_get_with(&addr, "/metrics", &bearer).unwrap();
    assert_eq!(code, 200, "{page}");
    assert!(sample(&page, "dmover_received_bytes_total").is_some(), "{page}");

    // A slow upload (3 MB/s): the page lists it while it runs.
    let src = env.mkdir("src");
    write_random(&src.join("f"), 6 << 20, 3);
    let up = env.slow_cp(src.display().to_string(), server.url("data/")).spawn();
    let mut seen = None;
    let listed = wait_until(Duration::from_secs(30), || {
        let (code, body) = http_get_with(&addr, "/status.json", &bearer).unwrap();
        assert_eq!(code, 200, "{body}");
        let j: Value = serde_json::from_str(&body).unwrap();
        let receiving = j["sessions"].as_array().unwrap().iter().any(|s| s["kind"] == "receive" && s["seconds"].as_f64() > Some(0.0));
        let received = j["received_bytes"].as_u64().unwrap();
        if receiving && received > 0 && received < 6 << 20 && j["receive_streams"].as_u64() > Some(0) {
            seen = Some(j);
        }
        seen.is_some()
    });
    assert!(listed, "the page never listed the running upload with its bytes");
    let j = seen.unwrap();
    assert_eq!(j["kind"], "server", "{j:#}");
    assert!(!j["timeline"].as_array().unwrap().is_empty(), "{j:#}");
    // The rate now, as the page shows it, while the upload goes on.
    let mut rates = Value::Null;
    let moving = wait_until(Duration::from_secs(30), || {
        let (_, body) = http_get_with(&addr, "/status.json", &bearer).unwrap();
        let j: Value = serde_json::from_str(&body).unwrap();
        rates = j["rates"].clone();
        j["received_bytes"].as_u64() < Some(6 << 20) && rates["now_bytes_per_s"].as_f64() > Some(0.0)
    });
    assert!(moving, "the page never showed a rate now while the upload ran: {rates}");
    assert!(rates["peak_bytes_per_s"].as_f64() >= rates["now_bytes_per_s"].as_f64(), "{rates}");
    up.wait().assert_ok();
    let (_, body) = http_get_with(&addr, "/status.json", &bearer).unwrap();
    let j: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((j["received_files"].as_u64(), j["sessions"].as_array().map(Vec::len)), (Some(1), Some(0)), "{j:#}");
    assert_eq!(j["refused_connections"], 0, "{j:#}");
    assert_eq!((j["receive_streams"].as_u64(), j["staging_bytes"].as_u64()), (Some(0), Some(0)), "streams or staging kept: {j:#}");
    assert_eq!(j["write_errors"]["data"], serde_json::json!({ "permission": 0, "no_space": 0, "io": 0 }), "{j:#}");

    // A slow download: the page lists the sending session with its streams.
    let back = env.mkdir("back");
    let down = env.slow_cp(server.url("data/src"), back.display().to_string()).spawn();
    let (mut seen, mut staged) = (None, false);
    let listed = wait_until(Duration::from_secs(30), || {
        let (_, body) = http_get_with(&addr, "/status.json", &bearer).unwrap();
        let j: Value = serde_json::from_str(&body).unwrap();
        staged |= j["staging_bytes"].as_u64() > Some(0);
        let sending = j["sessions"].as_array().unwrap().iter().find(|s| s["kind"] == "send" && s["streams"].as_u64() > Some(0)).cloned();
        if let Some(s) = sending.filter(|_| j["send_streams"].as_u64() > Some(0)) {
            seen = Some(s);
        }
        seen.is_some() && staged
    });
    assert!(listed, "the page never listed the running download with its streams");
    assert!(staged, "the page never showed the sending session's staging in use");
    down.wait().assert_ok();
    assert_same_tree(&src, &back.join("src"));
    let (_, page) = http_get_with(&addr, "/metrics", &bearer).unwrap();
    assert_eq!(sample(&page, "dmover_send_streams"), Some(0.0), "{page}");
    assert_eq!(sample(&page, "dmover_staging_bytes"), Some(0.0), "staging kept after the download: {page}");
    drop(server);
}

/// CLI.md `serve --metrics`: a file that fails on an export's storage is
/// counted for that export, by class.
#[test]
fn write_errors_are_counted_by_export() {
    if !dmover_testkit::needs_root("a small tmpfs mount") {
        return;
    }
    let env = Env::new();
    let full = env.path("full");
    let _m = Mount::tmpfs(&full, "4m");
    let roomy = env.mkdir("roomy");
    let metrics = format!("127.0.0.1:{}", closed_port());
    let mut spec = ServerSpec::new(&env.token, &[("full", &full), ("roomy", &roomy)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), metrics.clone().into()];
    let server = Server::start(spec);
    let src = env.mkdir("src");
    write_random(&src.join("big.dat"), 8 << 20, 7);
    for _ in 0..2 {
        let r = env.cp([src.join("big.dat").display().to_string(), server.url("full/big.dat"), "--retries".into(), "0".into()]).run();
        r.assert_fails(5, &["big.dat"]);
    }
    env.cp([src.join("big.dat").display().to_string(), server.url("roomy/big.dat")]).run().assert_ok();
    let (_, page) = http_get(&metrics, "/metrics").unwrap();
    for (series, want) in [
        ("dmover_write_errors_total{export=\"full\",kind=\"no_space\"}", 2.0),
        ("dmover_write_errors_total{export=\"full\",kind=\"io\"}", 0.0),
        ("dmover_write_errors_total{export=\"roomy\",kind=\"no_space\"}", 0.0),
        ("dmover_write_errors_total{export=\"roomy\",kind=\"permission\"}", 0.0),
        ("dmover_staging_bytes", 0.0),
        ("dmover_receive_streams", 0.0),
    ] {
        assert_eq!(sample(&page, series), Some(want), "{series}:\n{page}");
    }
    if on_path("promtool") {
        promtool_check(&page);
    }
    drop(server);
}

/// Waits (up to 10 s) for each series in `wanted` to show its value on
/// the metrics page at `addr` (the counters go up as the server's threads
/// finish with a connection, which may be just after its client saw the
/// end); fails naming those that differ, and how, in `whose` page.
#[track_caller]
fn assert_series(addr: &str, wanted: &[(&str, f64)], whose: &str) {
    let (mut page, mut wrong) = (String::new(), Vec::new());
    let shown = wait_until(Duration::from_secs(10), || {
        page = http_get(addr, "/metrics").expect("the metrics page answers").1;
        wrong = wanted.iter().map(|&(series, want)| (series, want, sample(&page, series))).filter(|(_, w, got)| *got != Some(*w)).collect();
        wrong.is_empty()
    });
    assert!(shown, "{whose}'s series (wanted, on the page): {wrong:?}\n{page}");
}

/// CLI.md `serve --metrics`: each connection is counted once, by how its
/// handshake ended — authenticated, a wrong token, bytes that are no
/// handshake, silence past the 10 s to authenticate, or authenticated
/// beyond `--max-connections` (busy) — and each refused request is counted.
#[test]
fn connections_are_counted_by_outcome_and_refused_requests_too() {
    let env = Env::new();
    let export = env.mkdir("export");
    let metrics = format!("127.0.0.1:{}", closed_port());
    let mut spec = ServerSpec::new(&env.token, &[("data", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), metrics.clone().into(), "--max-connections".into(), "1".into()];
    let server = Server::start(spec);
    let token = env.token_str();

    // Silent from the start: closed when its time to authenticate is up.
    let mut silent = Raw::connect(&server.addr());
    // Bytes that are no handshake.
    let mut garbage = Raw::connect(&server.addr());
    garbage.raw(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    assert!(garbage.wait_closed() < Duration::from_secs(5), "bytes that are no handshake were not refused at once");
    // A wrong token.
    let wrong = env.path("wrong-token");
    std::fs::write(&wrong, "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef").unwrap();
    chmod(&wrong, 0o600);
    let ls = dmover(["ls", "--token-file", wrong.to_str().unwrap(), &server.url("data/")]).run();
    assert_eq!(ls.code, 7, "a wrong token was not refused for its credential: {}{}", ls.stdout, ls.stderr);
    // The one connection `--max-connections 1` allows, and a request it
    // makes that is refused.
    let mut control = Raw::control(&server.addr(), token.as_bytes());
    control.refused(&Msg::List { path: "no-such-export/x".into() }, ErrorKind::Refused);
    // One more, with the right token: busy.
    let (mut busy, _, _) = Raw::handshake(&server.addr(), token.as_bytes());
    assert_eq!(busy.read(), Some(Msg::Welcome), "the right token was not welcomed");
    match busy.read() {
        Some(Msg::Error { message, .. }) => assert!(message.contains("busy"), "{message}"),
        other => panic!("a connection beyond --max-connections 1 was not told the server is busy: {other:?}"),
    }
    let waited = silent.wait_closed();
    assert!(waited < Duration::from_secs(15), "a silent connection was kept {waited:?}");

    assert_series(
        &metrics,
        &[
            ("dmover_connections_total{outcome=\"authenticated\"}", 1.0),
            ("dmover_connections_total{outcome=\"bad_credential\"}", 1.0),
            ("dmover_connections_total{outcome=\"malformed\"}", 1.0),
            ("dmover_connections_total{outcome=\"timeout\"}", 1.0),
            ("dmover_connections_total{outcome=\"busy\"}", 1.0),
            ("dmover_refused_requests_total", 1.0),
        ],
        "the server",
    );
    drop(control);
}

/// CLI.md `serve --metrics`: a third-party copy is a `push` session of the
/// source server (a `receive` session of the destination), and the blocks
/// the source sends again, after the destination found them damaged, are
/// counted: as many as the copy's report says.
#[test]
fn push_sessions_and_the_blocks_they_send_again_are_counted() {
    let env = Env::new();
    let (ea, eb) = (env.mkdir("export-a"), env.mkdir("export-b"));
    let src = ea.join("data");
    make_tree(&src, 53, 10);
    write_random(&src.join("big.bin"), 4 << 20, 53);
    let (ma, mb) = (format!("127.0.0.1:{}", closed_port()), format!("127.0.0.1:{}", closed_port()));
    // The source damages every 5th block it sends.
    let mut spec = ServerSpec::new(&env.token, &[("ea", &ea)], &env.path("server-a.log"));
    spec.extra = vec!["--metrics".into(), ma.clone().into()];
    spec.bin = BIN_FAULTY;
    spec.envs.push(("DMOVER_FAULT_CORRUPT_EVERY".into(), Some("5".into())));
    let a = Server::start(spec);
    let mut spec = ServerSpec::new(&env.token, &[("eb", &eb)], &env.path("server-b.log"));
    spec.extra = vec!["--metrics".into(), mb.clone().into()];
    let b = Server::start(spec);

    let j = env.cp([a.url("ea/data"), b.url("eb/copy"), "--block-size".into(), "256K".into()]).run().assert_ok();
    assert_same_tree(&src, &eb.join("copy/data"));
    let resent = u(&j["resent_blocks"]);
    assert!(resent > 0, "no block was sent again, though every 5th was damaged: {j:#}");
    let files = list_files(&src).len() as f64;

    assert_series(
        &ma,
        &[
            ("dmover_sessions_total{kind=\"push\"}", 1.0),
            ("dmover_sessions_total{kind=\"send\"}", 0.0),
            ("dmover_sessions_total{kind=\"receive\"}", 0.0),
            ("dmover_sessions_active{kind=\"push\"}", 0.0),
            ("dmover_sent_files_total", files),
            ("dmover_resent_blocks_total", resent as f64),
        ],
        "the source",
    );
    assert_series(
        &mb,
        &[
            ("dmover_sessions_total{kind=\"receive\"}", 1.0),
            ("dmover_sessions_total{kind=\"push\"}", 0.0),
            ("dmover_received_files_total", files),
            ("dmover_resent_blocks_total", 0.0),
        ],
        "the destination",
    );
    drop((a, b));
}

#[test]
fn metrics_address_in_use_is_refused_clearly() {
    let env = Env::new();
    let export = env.mkdir("export");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let run = dmover([
        "serve",
        "--export",
        &format!("data={}", export.display()),
        "--token-file",
        env.path("token").to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--metrics",
        &port,
    ])
    .run();
    run.assert_fails(2, &["--metrics", &port]);
}

/// CLI.md `serve --metrics-token-file`: off loopback the pages take a
/// token of their own (made by `dmover token`), which travels in the
/// clear; the server's token, which must never cross the wire, is refused
/// there, in the header as in the address; and the page token opens no
/// data connection: it downloads nothing.
#[test]
fn the_pages_take_a_token_of_their_own_which_opens_nothing_else() {
    let env = Env::new();
    let export = env.mkdir("export");
    write_random(&export.join("f"), 1000, 9);
    let port = closed_port();
    let pages = page_token(&env, "pages-token");
    let mut spec = ServerSpec::new(&env.token, &[("data", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), format!("0.0.0.0:{port}").into(), "--metrics-token-file".into(), pages.clone().into()];
    let server = Server::start(spec);
    let addr = format!("127.0.0.1:{port}");
    assert!(wait_until(Duration::from_secs(10), || http_get(&addr, "/").is_some_and(|(c, _)| c == 200)), "no page");
    let data = env.token_str();
    for (target, header) in [
        ("/metrics".to_string(), format!("Authorization: Bearer {data}\r\n")),
        ("/status.json".into(), format!("Authorization: Bearer {data}\r\n")),
        (format!("/metrics?token={data}"), String::new()),
        (format!("/status.json?token={data}"), String::new()),
    ] {
        let (code, body) = http_get_with(&addr, &target, &header).unwrap();
        assert_eq!(code, 401, "{target} with the server's token {header:?} was let in: {body}");
        assert!(body.contains("page token (not the data token)"), "{body}");
    }
    let bearer = format!("Authorization: Bearer {}\r\n", token_text(&pages));
    let (code, page) = http_get_with(&addr, "/metrics", &bearer).unwrap();
    assert_eq!(code, 200, "{page}");
    assert_eq!(sample(&page, "dmover_sent_files_total"), Some(0.0), "{page}");
    let (code, body) = http_get_with(&addr, "/status.json", &bearer).unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["kind"], "server", "{body}");

    // The page token as a client's token: refused at the handshake.
    let back = env.mkdir("back");
    let down = dmover(["cp".as_ref(), "--json".as_ref(), "--token-file".as_ref(), pages.as_os_str()])
        .args([server.url("data/f"), back.display().to_string()])
        .run();
    assert_eq!(down.code, 7, "a download with the page token was not refused for its credential: {}", down.stderr);
    assert!(!back.join("f").exists(), "a download with the page token wrote the file");
    let ls = dmover(["ls".as_ref(), "--token-file".as_ref(), pages.as_os_str(), server.url("data/").as_ref()]).run();
    assert_eq!(ls.code, 7, "a listing with the page token was not refused for its credential: {}{}", ls.stdout, ls.stderr);
    assert!(!ls.stdout.contains('f'), "{}", ls.stdout);
    let (_, page) = http_get_with(&addr, "/metrics", &bearer).unwrap();
    assert_eq!(sample(&page, "dmover_connections_total{outcome=\"authenticated\"}"), Some(0.0), "{page}");
    assert!(sample(&page, "dmover_connections_total{outcome=\"bad_credential\"}") >= Some(2.0), "{page}");
    drop(server);
}

/// CLI.md `serve --metrics`: off loopback without a page token, or with
/// the server's own token as one, the server refuses to start, and says
/// what to do.
#[test]
fn pages_off_loopback_need_a_token_of_their_own() {
    let env = Env::new();
    let export = env.mkdir("export");
    let serve = |extra: &[&std::ffi::OsStr]| {
        let mut c = dmover(["serve", "--listen", "127.0.0.1:0", "--export", &format!("data={}", export.display())]);
        c.arg("--token-file").arg(&env.token).args(extra).timeout(Duration::from_secs(20));
        c.run()
    };
    let r = serve(&["--metrics".as_ref(), "0.0.0.0:0".as_ref()]);
    r.assert_fails(2, &["--metrics 0.0.0.0:0", "not a loopback address", "--metrics-token-file FILE", "dmover token FILE"]);
    let copy = env.path("copy-of-the-token");
    std::fs::copy(&env.token, &copy).unwrap();
    for same in [&env.token, &copy] {
        let r = serve(&["--metrics".as_ref(), "0.0.0.0:0".as_ref(), "--metrics-token-file".as_ref(), same.as_os_str()]);
        r.assert_fails(2, &[same.to_str().unwrap(), "holds the data token", "dmover token FILE"]);
    }
    // And on loopback too: the server's token is never a page token.
    let r = serve(&["--metrics".as_ref(), "0".as_ref(), "--metrics-token-file".as_ref(), copy.as_os_str()]);
    r.assert_fails(2, &["holds the data token"]);
}

/// A connection to `to` from `from`, another loopback address: another
/// client, as far as the server can tell.
fn connect_from(from: Ipv4Addr, to: SocketAddrV4) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let sockaddr = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    let (src, dst) = (sockaddr(SocketAddrV4::new(from, 0)), sockaddr(to));
    // SAFETY: a new socket, owned by the stream from here on (closed on
    // every path); the addresses are sockaddr_in of the length given.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd);
        if libc::bind(fd, (&src as *const libc::sockaddr_in).cast(), len) != 0
            || libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), len) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(stream)
    }
}

/// CLI.md `serve --metrics`: clients that send their request a byte every
/// two seconds, more of them than the page serves at once and connecting
/// again whenever cut off, hold no connection past the request's
/// deadline and keep no one else out: a scrape from another address is
/// answered at once throughout.
#[test]
fn slow_clients_do_not_keep_a_scrape_out() {
    let env = Env::new();
    let export = env.mkdir("export");
    let metrics = format!("127.0.0.1:{}", closed_port());
    let mut spec = ServerSpec::new(&env.token, &[("data", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), metrics.clone().into()];
    let mut server = Server::start(spec);
    assert!(wait_until(Duration::from_secs(10), || http_get(&metrics, "/metrics").is_some_and(|a| a.0 == 200)));
    let to: SocketAddrV4 = metrics.parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // How long each slow connection was kept open by the server.
    let kept = Arc::new(Mutex::new(Vec::new()));
    let slow: Vec<_> = (0..40)
        .map(|_| {
            let (stop, kept) = (stop.clone(), kept.clone());
            std::thread::spawn(move || {
                let request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut c) = connect_from(Ipv4Addr::new(127, 0, 0, 2), to) else {
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    };
                    let start = Instant::now();
                    c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    // A byte every two seconds (the head never ends), until
                    // the server answers or closes.
                    for i in 0.. {
                        let byte = request.get(i).copied().unwrap_or(b'a');
                        if stop.load(Ordering::Relaxed) || c.write_all(&[byte]).is_err() {
                            break;
                        }
                        match c.read(&mut [0; 512]) {
                            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                            _ => break,
                        }
                    }
                    kept.lock().unwrap().push(start.elapsed());
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    // Scrapes for 10 s: across the slow connections' deadline.
    let scrapes_end = Instant::now() + Duration::from_secs(10);
    let mut scrapes = 0;
    while Instant::now() < scrapes_end {
        let start = Instant::now();
        let got = http_get(&metrics, "/metrics");
        let took = start.elapsed();
        assert_eq!(got.as_ref().map(|a| a.0), Some(200), "a scrape among slow clients was not answered (after {took:?}): {got:?}");
        assert!(took < Duration::from_secs(3), "a scrape among slow clients took {took:?}");
        scrapes += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    stop.store(true, Ordering::Relaxed);
    for t in slow {
        t.join().unwrap();
    }
    let kept = kept.lock().unwrap();
    let longest = kept.iter().max().copied().unwrap_or_default();
    assert!(longest >= Duration::from_secs(4), "no slow connection was ever held (longest {longest:?}): the test proves nothing");
    assert!(longest < Duration::from_secs(8), "a slow connection was kept {longest:?}, past the request's deadline");
    assert!(scrapes >= 10, "{scrapes} scrapes");
    assert!(server.running(), "the server died; log:\n{}", server.log());
}

/// CLI.md `serve --metrics`: a page on loopback answers only requests
/// addressed to a loopback name or address, so that a web site whose name
/// a browser was made to resolve to 127.0.0.1 (DNS rebinding) cannot read
/// it.
#[test]
fn a_loopback_page_answers_only_requests_addressed_to_loopback() {
    let env = Env::new();
    let export = env.mkdir("export");
    let port = closed_port();
    let metrics = format!("127.0.0.1:{port}");
    let mut spec = ServerSpec::new(&env.token, &[("data", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), metrics.clone().into()];
    let server = Server::start(spec);
    assert!(wait_until(Duration::from_secs(10), || http_get(&metrics, "/metrics").is_some_and(|a| a.0 == 200)));
    for host in
        ["evil.example".to_string(), format!("evil.example:{port}"), format!("127.0.0.1.nip.io:{port}"), "localhost.evil.example".into()]
    {
        for target in ["/metrics", "/status.json", "/"] {
            let got = raw(&metrics, format!("GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes());
            let (code, body) = got.unwrap_or_else(|| panic!("no answer to {target} for Host: {host}"));
            assert_eq!(code, 421, "{target} for Host: {host} was answered: {body}");
            assert!(body.contains("DNS rebinding") && body.contains(&format!("http://localhost:{port}/")), "{body}");
        }
    }
    for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}"), format!("[::1]:{port}"), "LocalHost".into()] {
        let got = raw(&metrics, format!("GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes());
        assert_eq!(got.as_ref().map(|a| a.0), Some(200), "Host: {host}: {got:?}");
    }
    drop(server);
}

/// CLI.md `serve --metrics`: opened in a browser as `/#token=TOKEN`, the
/// server's page off loopback reads the page token from the fragment (the
/// browser never sends it) and shows its data: it sends the token in the
/// header of its own requests.
#[test]
fn a_browser_reads_the_servers_page_with_the_token_in_its_fragment() {
    if !on_path("chromium") {
        let _ = dmover_testkit::skip("needs chromium (Debian's `chromium` package; ./test installs it)");
        return;
    }
    let env = Env::new();
    let export = env.mkdir("export");
    let port = closed_port();
    let pages = page_token(&env, "pages-token");
    let mut spec = ServerSpec::new(&env.token, &[("data", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), format!("0.0.0.0:{port}").into(), "--metrics-token-file".into(), pages.clone().into()];
    let server = Server::start(spec);
    let addr = format!("127.0.0.1:{port}");
    assert!(wait_until(Duration::from_secs(10), || http_get(&addr, "/").is_some_and(|(c, _)| c == 200)), "no page");
    let view = r##"({ state: document.getElementById("state").textContent,
        problem: document.getElementById("problem").hidden ? null : document.getElementById("problem").textContent,
        updates: Number(document.getElementById("updates").dataset.updates),
        now: document.getElementById("s-now").textContent,
        rates: (document.querySelector("#s-chart text.rates") || {}).textContent })"##;
    let mut browser = browser::Browser::open(&format!("http://{addr}/#token={}", token_text(&pages)), &env.path("chromium"));
    let mut last = Value::Null;
    let shown = wait_until(Duration::from_secs(30), || {
        last = browser.eval(view);
        last["state"] == "idle" && last["problem"].is_null() && last["updates"].as_u64() >= Some(2)
    });
    assert!(shown, "the page did not show the server's data with the token in its fragment: {last}");
    assert_eq!(last["now"], "0 B/s", "an idle server's rate now: {last}");
    assert!(last["rates"].as_str().is_some_and(|r| r.starts_with("now 0 B/s, peak 0 B/s over the last ")), "{last}");
    drop(browser);
    let mut browser = browser::Browser::open(&format!("http://{addr}/"), &env.path("chromium-without"));
    let refused = wait_until(Duration::from_secs(30), || {
        last = browser.eval(view);
        last["problem"].as_str().is_some_and(|p| p.contains("401") && p.contains("page token"))
    });
    assert!(refused, "without the token the page does not say it needs one: {last}");
    drop(server);
}
