//! `dmover serve --metrics`: a real Prometheus scrapes a real server
//! while files go up and down, and what it stored (read back through its
//! own HTTP API) matches what moved; `promtool check metrics` accepts the
//! page; a refused connection is counted with its reason.

mod util;

use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use util::*;

/// A Prometheus server scraping `target` every second; killed when dropped.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Prometheus {
    fn start(dir: &Path, target: &str) -> Prometheus {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: dmover\n    static_configs:\n      - targets: ['{target}']\n"
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
    let metrics = format!("127.0.0.1:{}", closed_port());
    let mut spec = ServerSpec::new(&env.path("token"), &[("data", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), metrics.clone().into()];
    let server = Server::start(spec);
    let prometheus = Prometheus::start(&env.mkdir("prometheus"), &metrics);

    // Up, slowly (3 MB/s): the page shows the bytes of a running session.
    let up = env.slow_cp(src.display().to_string(), server.url("data/")).spawn();
    let mut seen_running = false;
    let done = wait_until(Duration::from_secs(60), || {
        let (_, page) = http_get(&metrics, "/metrics").expect("the metrics page answers");
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
    let (code, page) = http_get(&metrics, "/metrics").unwrap();
    assert_eq!(code, 200);
    promtool_check(&page);
    drop(server);
}

/// Sends `request` as it is; the status code of the answer.
fn raw_status(addr: &str, request: &[u8]) -> Option<u16> {
    let mut c = TcpStream::connect(addr).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    c.write_all(request).ok()?;
    let mut answer = String::new();
    c.read_to_string(&mut answer).ok()?;
    answer.split_whitespace().nth(1)?.parse().ok()
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
    assert_eq!(raw_status(&metrics, b"POST /metrics HTTP/1.0\r\n\r\n"), Some(405));
    // Just past the 8 KiB a request head may take (so that the server has
    // read all of it when it answers).
    let mut long = b"GET /metrics HTTP/1.0\r\nX-Filler: ".to_vec();
    long.resize((8 << 10) + 8, b'a');
    assert_eq!(raw_status(&metrics, &long), Some(431));
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
/// are given only to a request that shows the server's token (the page
/// itself holds none).
#[test]
fn the_servers_page_shows_running_sessions_and_off_loopback_needs_the_token() {
    let env = Env::new();
    let export = env.mkdir("export");
    let port = closed_port();
    let mut spec = ServerSpec::new(&env.token, &[("data", &export)], &env.path("server.log"));
    spec.extra = vec!["--metrics".into(), format!("0.0.0.0:{port}").into()];
    let server = Server::start(spec);
    let addr = format!("127.0.0.1:{port}");
    let token = env.token_str();
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
        ("/status.json?token=not-the-token", ""),
        ("/metrics", &format!("Authorization: Basic {token}\r\n")),
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
        let (code, body) = http_get_with(&addr, &format!("/status.json?token={token}"), "").unwrap();
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
