//! The read-only web pages of a server, a sink and a job: `/metrics` in
//! Prometheus' text format, `/` the status page (one self-contained HTML
//! file that draws itself from `/status.json` and polls it every second),
//! and `/status.json` itself. What the pages show comes from a [`Site`];
//! this crate only serves them.
//!
//! The HTTP spoken here is the least a browser and Prometheus need: one
//! `GET` per connection, a bounded request head read under a deadline, a
//! fixed number of requests served at once. On an address other than
//! loopback the data (`/metrics` and `/status.json`) is given only to a
//! request that shows the token, as `Authorization: Bearer TOKEN` (what
//! Prometheus sends with `authorization: {credentials_file: ...}`) or as
//! `?token=TOKEN` in the address (what a browser keeps; the page passes it
//! on to its own requests). The page itself holds no data.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use subtle::ConstantTimeEq;

/// What a set of pages shows.
pub trait Site: Send + Sync + 'static {
    /// The Prometheus text page (format version 0.0.4).
    fn metrics(&self) -> Vec<u8>;
    /// The status page's data: a JSON object whose `kind` says what it
    /// describes (`"job"` or `"server"`).
    fn status(&self) -> serde_json::Value;
}

/// The status page, served as it is.
pub const STATUS_PAGE: &str = include_str!("status.html");

/// Requests served at once; more wait to be accepted.
const MAX_REQUESTS: usize = 8;
/// Time a client has to send its request (and to take the answer).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest request head read.
const MAX_HEAD: usize = 8 << 10;

/// Who may read the data.
#[derive(Clone)]
pub enum Access {
    /// Anyone who can connect (a loopback address).
    Open,
    /// Requests that show this token.
    Token(Arc<[u8]>),
}

impl Access {
    /// What an address needs: open on loopback, else the token; `None`
    /// when the address is not loopback and there is no token to ask for.
    pub fn for_listener(listener: &TcpListener, token: Option<&[u8]>) -> Option<Access> {
        let loopback = listener.local_addr().map(|a| a.ip().is_loopback()).unwrap_or(false);
        match (loopback, token) {
            (true, _) => Some(Access::Open),
            (false, Some(t)) if !t.is_empty() => Some(Access::Token(t.into())),
            (false, _) => None,
        }
    }

    fn allows(&self, shown: Option<&[u8]>) -> bool {
        match (self, shown) {
            (Access::Open, _) => true,
            (Access::Token(t), Some(s)) => bool::from(t.as_ref().ct_eq(s)),
            (Access::Token(_), None) => false,
        }
    }
}

/// Serves `site` on `listener` from a thread of its own, for as long as
/// the process runs.
pub fn serve(listener: TcpListener, site: Arc<dyn Site>, access: Access) {
    let busy = Arc::new(AtomicUsize::new(0));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            if busy.fetch_add(1, Ordering::SeqCst) >= MAX_REQUESTS {
                busy.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            let (site, busy, access) = (site.clone(), busy.clone(), access.clone());
            std::thread::spawn(move || {
                if let Err(e) = answer(conn, site.as_ref(), &access) {
                    log::debug!("web request: {e}");
                }
                busy.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
}

/// A request's head, as far as these pages care.
struct Request<'a> {
    method: &'a [u8],
    path: &'a [u8],
    /// The token shown, in the `Authorization` header or the query.
    token: Option<Vec<u8>>,
}

fn parse(head: &[u8]) -> Request<'_> {
    let mut lines = head.split(|&b| b == b'\n').map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let first = lines.next().unwrap_or_default();
    let mut parts = first.split(|&b| b == b' ');
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let (path, query) = match target.iter().position(|&b| b == b'?') {
        Some(i) => (&target[..i], &target[i + 1..]),
        None => (target, &[][..]),
    };
    let from_query = query.split(|&b| b == b'&').find_map(|kv| kv.strip_prefix(b"token=")).map(percent_decode);
    let from_header = lines.find_map(|l| {
        let (name, value) = l.split_at(l.iter().position(|&b| b == b':')?);
        if !name.eq_ignore_ascii_case(b"authorization") {
            return None;
        }
        let value = value[1..].trim_ascii();
        let scheme = value.get(..7)?;
        scheme.eq_ignore_ascii_case(b"bearer ").then(|| value[7..].trim_ascii().to_vec())
    });
    Request { method, path, token: from_header.or(from_query) }
}

fn percent_decode(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (s[i], s.get(i + 1).copied().and_then(hex), s.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b'+', ..) => {
                out.push(b' ');
                i += 1;
            }
            (b, ..) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

/// Reads one request and answers it.
fn answer(mut conn: TcpStream, site: &dyn Site, access: &Access) -> std::io::Result<()> {
    conn.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    conn.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            return reply(&mut conn, "431 Request Header Fields Too Large", "text/plain", b"request head too long\n");
        }
    }
    let req = parse(&head);
    if req.method != b"GET" {
        return reply(&mut conn, "405 Method Not Allowed", "text/plain", b"only GET is served\n");
    }
    let data = matches!(req.path, b"/metrics" | b"/status.json");
    if data && !access.allows(req.token.as_deref()) {
        let body = b"this address needs the token: send `Authorization: Bearer TOKEN`, or open the page as /?token=TOKEN\n";
        return reply(&mut conn, "401 Unauthorized", "text/plain", body);
    }
    match req.path {
        b"/metrics" => reply(&mut conn, "200 OK", "text/plain; version=0.0.4; charset=utf-8", &site.metrics()),
        b"/status.json" => {
            let body = serde_json::to_vec(&site.status()).expect("JSON values serialize");
            reply(&mut conn, "200 OK", "application/json", &body)
        }
        b"/" => reply(&mut conn, "200 OK", "text/html; charset=utf-8", STATUS_PAGE.as_bytes()),
        _ => reply(&mut conn, "404 Not Found", "text/plain", b"not found: the status page is at /, the metrics at /metrics\n"),
    }
}

fn reply(conn: &mut TcpStream, status: &str, content_type: &str, body: &[u8]) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nCache-Control: no-store\r\n\
         X-Content-Type-Options: nosniff\r\nContent-Security-Policy: default-src 'none'; script-src 'unsafe-inline'; \
         style-src 'unsafe-inline'; connect-src 'self'; img-src data:\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes())?;
    conn.write_all(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_read_from_the_header_or_the_query() {
        let r = parse(b"GET /status.json?x=1&token=ab%2Fc HTTP/1.1\r\nHost: h\r\n\r\n");
        assert_eq!((r.method, r.path, r.token.as_deref()), (&b"GET"[..], &b"/status.json"[..], Some(&b"ab/c"[..])));
        let r = parse(b"GET /metrics HTTP/1.1\r\nauthorization:  bearer  s3cret \r\n\r\n");
        assert_eq!((r.path, r.token.as_deref()), (&b"/metrics"[..], Some(&b"s3cret"[..])));
        let r = parse(b"GET /metrics HTTP/1.1\r\nAuthorization: Basic eDp5\r\n\r\n");
        assert_eq!(r.token, None);
        assert_eq!(parse(b"").path, b"");
    }

    #[test]
    fn a_token_is_needed_off_loopback_and_must_match() {
        let any = TcpListener::bind("0.0.0.0:0").unwrap();
        assert!(Access::for_listener(&any, None).is_none(), "off loopback with no token to ask for");
        let a = Access::for_listener(&any, Some(b"right")).unwrap();
        assert!(a.allows(Some(b"right")));
        for wrong in [Some(&b"wrong"[..]), Some(b"righ"), Some(b""), None] {
            assert!(!a.allows(wrong), "{wrong:?}");
        }
        let lo = TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(Access::for_listener(&lo, None).unwrap().allows(None));
    }
}
