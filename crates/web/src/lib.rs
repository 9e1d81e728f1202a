//! The read-only web pages of a server, a sink and a job: `/metrics` in
//! Prometheus' text format, `/` the status page (one self-contained HTML
//! file that draws itself from `/status.json` and polls it every second),
//! and `/status.json` itself. What the pages show comes from a [`Site`];
//! this crate only serves them.
//!
//! The HTTP spoken here is the least a browser and Prometheus need: one
//! `GET` per connection, a bounded request head that must be complete
//! within a deadline (and the answer taken within another), a fixed number
//! of requests served at once and fewer from any one address. A page on
//! loopback answers only requests addressed to a loopback name or address
//! (the `Host` header), so that a web site whose name a visitor's browser
//! resolves to 127.0.0.1 (DNS rebinding) cannot read it. Given a page
//! token (always, off loopback), the data (`/metrics` and `/status.json`)
//! is given only to a request that shows it as `Authorization: Bearer
//! TOKEN`: what Prometheus sends with `authorization: {credentials_file:
//! ...}`, and what the status page sends when opened as `/#token=TOKEN` (a
//! fragment, which the browser keeps to itself). The page token is a
//! read-only credential of its own, never the data token a server or a job
//! authenticates with: it travels in the clear. The page itself holds no
//! data.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv6Addr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
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

/// Requests served at once; more are refused until one ends.
const MAX_REQUESTS: usize = 32;
/// Requests served at once to one address (an IPv6 client's /64).
const MAX_PER_ADDRESS: usize = 4;
/// Time a client has to send its whole request head, however it spreads
/// its bytes; and then to take the whole answer.
const DEADLINE: Duration = Duration::from_secs(5);
/// Longest request head read.
const MAX_HEAD: usize = 8 << 10;

/// Who may read the data.
#[derive(Clone)]
pub enum Access {
    /// Anyone who can connect (a loopback address, no page token given).
    Open,
    /// Requests that show this page token.
    Token(Arc<[u8]>),
}

impl Access {
    /// What an address needs: the page token if there is one; without
    /// one, nothing on loopback, and `None` (not to be served) elsewhere.
    pub fn for_listener(listener: &TcpListener, token: Option<&[u8]>) -> Option<Access> {
        let loopback = listener.local_addr().map(|a| a.ip().is_loopback()).unwrap_or(false);
        match (loopback, token) {
            (_, Some(t)) if !t.is_empty() => Some(Access::Token(t.into())),
            (true, _) => Some(Access::Open),
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

/// The pages as served on one listener.
struct Pages {
    site: Arc<dyn Site>,
    access: Access,
    /// The listener is on loopback: requests must be addressed to it.
    loopback: bool,
    port: u16,
}

/// Serves `site` on `listener` from a thread of its own, for as long as
/// the process runs.
pub fn serve(listener: TcpListener, site: Arc<dyn Site>, access: Access) {
    let at = listener.local_addr().ok();
    let pages = Arc::new(Pages { site, access, loopback: at.is_some_and(|a| a.ip().is_loopback()), port: at.map_or(0, |a| a.port()) });
    let slots = Arc::new(Slots::default());
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let Some(slot) = conn.peer_addr().ok().and_then(|a| slots.take(a.ip())) else {
                let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
                let body = b"too many requests at once (from this address, or in all): try again in a few seconds\n";
                let _ = reply(&mut conn, "503 Service Unavailable", "text/plain", body);
                continue;
            };
            let pages = pages.clone();
            let spawned = std::thread::Builder::new().name("dmover-web".into()).spawn(move || {
                let _slot = slot;
                if let Err(e) = answer(Deadline::new(conn), &pages) {
                    log::debug!("web request: {e}");
                }
            });
            if let Err(e) = spawned {
                log::warn!("web request not answered: cannot start a thread: {e}");
            }
        }
    });
}

/// The requests being served, by client address.
#[derive(Default)]
struct Slots {
    held: Mutex<HashMap<IpAddr, usize>>,
}

/// One request's place among those served; given back when dropped.
struct Slot {
    slots: Arc<Slots>,
    client: IpAddr,
}

impl Slots {
    /// A place for a request from `ip`, unless all are taken or its
    /// address has its share.
    fn take(self: &Arc<Slots>, ip: IpAddr) -> Option<Slot> {
        let client = client(ip);
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let mine = held.get(&client).copied().unwrap_or(0);
        if mine >= MAX_PER_ADDRESS || held.values().sum::<usize>() >= MAX_REQUESTS {
            return None;
        }
        held.insert(client, mine + 1);
        Some(Slot { slots: self.clone(), client })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.client);
            }
        }
    }
}

/// The address a client's requests are counted under: its IPv4 address,
/// or the /64 of its IPv6 address (what one host is usually given).
fn client(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(a) => match a.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(a) & (!0u128 << 64))),
        },
        v4 => v4,
    }
}

/// A connection whose reads and writes must all be done by a deadline: a
/// client that trickles its request a byte at a time is cut off when the
/// deadline passes, however often it sends.
struct Deadline {
    conn: TcpStream,
    until: Instant,
}

impl Deadline {
    fn new(conn: TcpStream) -> Deadline {
        Deadline { conn, until: Instant::now() + DEADLINE }
    }

    fn left(&self) -> io::Result<Duration> {
        match self.until.checked_duration_since(Instant::now()) {
            Some(d) if !d.is_zero() => Ok(d),
            _ => Err(io::Error::new(io::ErrorKind::TimedOut, format!("not done within {} s", DEADLINE.as_secs()))),
        }
    }
}

impl Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.conn.set_read_timeout(Some(self.left()?))?;
        self.conn.read(buf)
    }
}

impl Write for Deadline {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.conn.set_write_timeout(Some(self.left()?))?;
        self.conn.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.conn.flush()
    }
}

/// A request's head, as far as these pages care.
struct Request<'a> {
    method: &'a [u8],
    /// The target without its query.
    path: &'a [u8],
    /// The token shown in an `Authorization: Bearer` header.
    token: Option<&'a [u8]>,
    /// The `Host` header.
    host: Option<&'a [u8]>,
}

fn parse(head: &[u8]) -> Request<'_> {
    let mut lines = head.split(|&b| b == b'\n').map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let first = lines.next().unwrap_or_default();
    let mut parts = first.split(|&b| b == b' ');
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    let mut req = Request { method, path, token: None, host: None };
    for line in lines {
        let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"host") {
            req.host = req.host.or(Some(value));
        } else if name.eq_ignore_ascii_case(b"authorization") {
            let bearer = value.get(..7).is_some_and(|s| s.eq_ignore_ascii_case(b"bearer "));
            req.token = req.token.or(bearer.then(|| value[7..].trim_ascii()));
        }
    }
    req
}

/// Whether a `Host` header's value names loopback: `localhost` (or a name
/// below it, which browsers never look up) or a loopback address, with any
/// port. A loopback listener's own address is one of these.
fn loopback_host(host: &[u8]) -> bool {
    let Ok(host) = std::str::from_utf8(host) else { return false };
    let name = match host.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((addr, port)) if port.is_empty() || port.starts_with(':') => addr,
            _ => return false,
        },
        None => host.rsplit_once(':').map_or(host, |(name, _port)| name),
    };
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost") || name.parse::<IpAddr>().is_ok_and(|a| a.is_loopback())
}

/// Reads one request and answers it.
fn answer(mut conn: Deadline, pages: &Pages) -> io::Result<()> {
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
    conn.until = Instant::now() + DEADLINE;
    let req = parse(&head);
    if pages.loopback && !req.host.is_none_or(loopback_host) {
        let body = format!(
            "this page is served on loopback and answers only requests addressed to localhost or a loopback \
             address (a guard against DNS rebinding): open it as http://localhost:{}/\n",
            pages.port
        );
        return reply(&mut conn, "421 Misdirected Request", "text/plain", body.as_bytes());
    }
    if req.method != b"GET" {
        return reply(&mut conn, "405 Method Not Allowed", "text/plain", b"only GET is served\n");
    }
    let data = matches!(req.path, b"/metrics" | b"/status.json");
    if data && !pages.access.allows(req.token) {
        let body = b"this address needs the page token (not the data token): send `Authorization: Bearer TOKEN`, \
                     or open the page as /#token=TOKEN\n";
        return reply(&mut conn, "401 Unauthorized", "text/plain", body);
    }
    let site = pages.site.as_ref();
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

fn reply(conn: &mut impl Write, status: &str, content_type: &str, body: &[u8]) -> io::Result<()> {
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
    fn the_token_is_read_from_the_authorization_header_only() {
        let r = parse(b"GET /status.json?x=1&token=abc HTTP/1.1\r\nHost: h:1\r\n\r\n");
        assert_eq!((r.method, r.path, r.token, r.host), (&b"GET"[..], &b"/status.json"[..], None, Some(&b"h:1"[..])));
        let r = parse(b"GET /metrics HTTP/1.1\r\nauthorization:  bearer  s3cret \r\n\r\n");
        assert_eq!((r.path, r.token, r.host), (&b"/metrics"[..], Some(&b"s3cret"[..]), None));
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
        assert!(!Access::for_listener(&lo, Some(b"given")).unwrap().allows(None), "a token given is asked for on loopback too");
    }

    #[test]
    fn loopback_hosts_are_told_from_others() {
        for ok in ["localhost", "LOCALHOST:9464", "localhost.", "a.localhost:1", "127.0.0.1", "127.1.2.3:80", "[::1]", "[::1]:9464"] {
            assert!(loopback_host(ok.as_bytes()), "{ok}");
        }
        for bad in
            ["evil.example", "evil.example:9464", "localhost.evil.example", "127.0.0.1.nip.io", "10.0.0.1:80", "[::2]:1", "[::1", "::1", ""]
        {
            assert!(!loopback_host(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn each_address_has_its_share_of_the_requests() {
        let slots = Arc::new(Slots::default());
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let held: Vec<Slot> = (0..MAX_PER_ADDRESS).map(|_| slots.take(a).expect("within the share")).collect();
        assert!(slots.take(a).is_none(), "an address beyond its share");
        // One IPv6 host: its /64.
        let v6 = |s: &str| s.parse::<IpAddr>().unwrap();
        let six: Vec<Slot> = (0..MAX_PER_ADDRESS).map(|i| slots.take(v6(&format!("2001:db8::{i}"))).unwrap()).collect();
        assert!(slots.take(v6("2001:db8::ffff:1")).is_none(), "the same /64");
        assert!(slots.take(v6("2001:db8:0:1::1")).is_some(), "another /64");
        drop(held);
        assert!(slots.take(a).is_some(), "a slot given back");
        drop(six);
        let mut all = Vec::new();
        for i in 0.. {
            match slots.take(IpAddr::from([198, 51, 100, i as u8])) {
                Some(s) => all.push(s),
                None => break,
            }
        }
        assert_eq!(all.len(), MAX_REQUESTS, "requests served at once, in all");
    }
}
