//! A headless Chromium driven over its DevTools protocol: it opens a page
//! and keeps it open, so a test can read the page's rendered DOM as it
//! changes and take screenshots. Killed when dropped.

use serde_json::{json, Value};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

pub struct Browser {
    child: Child,
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
    next_id: u64,
}

impl Browser {
    /// Starts Chromium on `url`, with its profile in `profile`, and waits
    /// until the page has loaded.
    pub fn open(url: &str, profile: &Path) -> Browser {
        let child = Command::new("chromium")
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars", "--mute-audio"])
            .args(["--window-size=1100,1500", "--remote-debugging-port=0"])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(url)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(profile.with_extension("log")).unwrap())
            .spawn()
            .expect("start chromium");
        // Chromium writes the port it chose into its profile.
        let port_file = profile.join("DevToolsActivePort");
        let mut port = String::new();
        let up = super::wait_until(Duration::from_secs(60), || {
            port = std::fs::read_to_string(&port_file).unwrap_or_default().lines().next().unwrap_or_default().to_string();
            !port.is_empty()
        });
        assert!(up, "chromium did not start; log:\n{}", std::fs::read_to_string(profile.with_extension("log")).unwrap_or_default());
        let addr = format!("127.0.0.1:{port}");
        let mut target = None;
        let found = super::wait_until(Duration::from_secs(30), || {
            let Some(body) = devtools_get(&addr, "/json/list") else { return false };
            let list: Value = serde_json::from_str(&body).unwrap_or_default();
            target = list
                .as_array()
                .into_iter()
                .flatten()
                .find(|t| t["type"] == "page")
                .and_then(|t| t["webSocketDebuggerUrl"].as_str().map(String::from));
            target.is_some()
        });
        assert!(found, "chromium has no page to drive");
        let (ws, _) = tungstenite::connect(target.unwrap()).expect("connect to chromium's page");
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        }
        let mut b = Browser { child, ws, next_id: 1 };
        // The page target exists before the page has loaded: wait for it.
        let loaded = format!("document.readyState === 'complete' && location.href === {}", json!(url));
        assert!(super::wait_until(Duration::from_secs(30), || b.eval(&loaded) == json!(true)), "chromium did not load {url}");
        b
    }

    /// Calls a DevTools method and returns its result.
    fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        self.ws.send(Message::text(json!({ "id": id, "method": method, "params": params }).to_string())).expect("send to chromium");
        loop {
            let msg = self.ws.read().expect("read from chromium");
            let Message::Text(text) = msg else { continue };
            let v: Value = serde_json::from_str(&text).expect("chromium sends JSON");
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    /// The value of a JavaScript expression evaluated in the page.
    pub fn eval(&mut self, expression: &str) -> Value {
        let r = self.call("Runtime.evaluate", json!({ "expression": expression, "returnByValue": true }));
        assert!(r.get("exceptionDetails").is_none(), "{expression}: {r}");
        r["result"]["value"].clone()
    }

    /// Saves a screenshot of the whole page as PNG.
    pub fn screenshot(&mut self, path: &Path) {
        use base64::Engine;
        let r = self.call("Page.captureScreenshot", json!({ "format": "png", "captureBeyondViewport": true }));
        let png = base64::engine::general_purpose::STANDARD.decode(r["data"].as_str().expect("screenshot data")).expect("base64");
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

/// A GET of Chromium's DevTools HTTP endpoint (which speaks HTTP/1.1 only,
/// sets a Content-Length and may keep the connection open): the body of a
/// 200 answer.
fn devtools_get(addr: &str, target: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut c = TcpStream::connect(addr).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(c, "GET {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = c.read(&mut buf).ok()?;
        answer.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&answer);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length =
                head.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<usize>()));
            if let Some(Ok(length)) = length {
                if body.len() >= length {
                    return head.starts_with("HTTP/1.1 200").then(|| body.to_string());
                }
            }
        }
        if n == 0 {
            return None;
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
