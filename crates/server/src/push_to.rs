//! Where a server's pushes (third-party copies) may go: `dmover serve
//! --push-to`. A push makes the server connect to addresses its client
//! names, from where the server sits, so without a limit any token holder
//! could use it to reach what only the server can reach (its loopback
//! services, a cloud's metadata address) and learn what answers there.
//!
//! Without `--push-to` a push may go to any address but loopback,
//! link-local, unspecified, multicast and broadcast ones; with it, only to
//! the destinations it lists. A destination's name is resolved once, its
//! addresses checked, and only the allowed ones dialed (a name cannot
//! resolve to another address between the check and the connection). A
//! refused or failed push says only "push to HOST:PORT refused" or
//! "failed": what answered there, if anything, goes to this server's log.

use dmover_engine::error::{Error, Result};
use dmover_engine::session::Dialer;
use dmover_engine::transport::{connect_any, Transport};
use dmover_proto::ErrorKind;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;

/// One allowed destination: the addresses of a network, and a port or any.
#[derive(Clone, Debug, PartialEq)]
struct Rule {
    net: IpAddr,
    prefix: u8,
    port: Option<u16>,
}

impl Rule {
    fn allows(&self, a: SocketAddr) -> bool {
        let ip = a.ip().to_canonical();
        let inside = match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(i)) => same_prefix(&n.octets(), &i.octets(), self.prefix),
            (IpAddr::V6(n), IpAddr::V6(i)) => same_prefix(&n.octets(), &i.octets(), self.prefix),
            _ => false,
        };
        inside && self.port.is_none_or(|p| p == a.port())
    }
}

/// Whether the first `bits` bits of `a` and `b` are the same.
fn same_prefix(a: &[u8], b: &[u8], bits: u8) -> bool {
    let (whole, rest) = ((bits / 8) as usize, bits % 8);
    a[..whole] == b[..whole] && (rest == 0 || (a[whole] ^ b[whole]) >> (8 - rest) == 0)
}

/// Addresses a push may not go to unless `--push-to` allows them: this
/// host's own (loopback, unspecified, which reaches this host too), its
/// link's (link-local, where cloud metadata services answer), and
/// multicast and broadcast.
fn special(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(a) => {
            a.is_loopback() || a.is_link_local() || a.is_unspecified() || a.octets()[0] == 0 || a.is_multicast() || a.is_broadcast()
        }
        IpAddr::V6(a) => a.is_loopback() || a.is_unspecified() || a.is_multicast() || a.segments()[0] & 0xffc0 == 0xfe80,
    }
}

/// The destinations pushes may go to (see the module's documentation).
#[derive(Clone, Debug, Default)]
pub struct PushTo {
    /// Empty: any address but the special ones.
    rules: Vec<Rule>,
}

impl PushTo {
    /// Any address at all, the server's own included (`dmover remote`,
    /// whose one-time token only the user who started it over ssh holds).
    pub fn anywhere() -> PushTo {
        let any = |net: IpAddr| Rule { net, prefix: 0, port: None };
        PushTo { rules: vec![any([0u8; 4].into()), any([0u8; 16].into())] }
    }

    /// The destinations `--push-to` lists: each `HOST`, `HOST:PORT`,
    /// `ADDR/BITS` or `ADDR/BITS:PORT` (an IPv6 address or network in
    /// brackets when a port follows: `[::1]:7450`, `[fd00::/8]:7450`). A
    /// host name stands for the addresses it resolves to now.
    pub fn parse(specs: &[String]) -> std::result::Result<PushTo, String> {
        let mut rules = Vec::new();
        for spec in specs {
            rules.extend(parse_one(spec).map_err(|m| format!("--push-to {spec}: {m}"))?);
        }
        Ok(PushTo { rules })
    }

    /// Whether a push may connect to `a`.
    pub fn allows(&self, a: SocketAddr) -> bool {
        if self.rules.is_empty() {
            return !special(a.ip());
        }
        self.rules.iter().any(|r| r.allows(a))
    }

    /// How to reach `host` (`name:port`, as a client named it in a push):
    /// its allowed addresses, resolved now. Refused when it has none.
    pub fn dialer(&self, host: &str) -> Result<Arc<dyn Dialer>> {
        let addrs: Vec<SocketAddr> = match host.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                log::warn!("push to {host} failed: cannot resolve it: {e}");
                return Err(failed(host));
            }
        };
        let allowed: Vec<SocketAddr> = addrs.iter().copied().filter(|a| self.allows(*a)).collect();
        if allowed.is_empty() {
            log::info!("push to {host} refused: its addresses {addrs:?} are not allowed (--push-to)");
            let message = format!(
                "push to {host} refused: not a destination this server may push to (its administrator can allow it with `dmover serve --push-to`)"
            );
            return Err(Error::new(ErrorKind::Refused, "", message));
        }
        Ok(Arc::new(Checked { addrs: allowed }))
    }
}

/// Reads one `--push-to` value.
fn parse_one(spec: &str) -> std::result::Result<Vec<Rule>, String> {
    let (host, port) = match spec.strip_prefix('[') {
        Some(rest) => {
            let (inside, after) = rest.split_once(']').ok_or("an opening '[' without its ']'")?;
            match after.strip_prefix(':') {
                Some(p) => (inside, Some(p)),
                None if after.is_empty() => (inside, None),
                None => return Err(format!("{after:?} after ']': expected ':PORT'")),
            }
        }
        // One colon: HOST:PORT; more: an IPv6 address (or network) alone.
        None if spec.matches(':').count() == 1 => spec.split_once(':').map(|(h, p)| (h, Some(p))).expect("one colon"),
        None => (spec, None),
    };
    let port = match port {
        Some(p) => Some(p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| format!("{p:?} is not a port (1 to 65535)"))?),
        None => None,
    };
    if let Some((addr, bits)) = host.split_once('/') {
        let net: IpAddr = addr.parse().map_err(|_| format!("{addr:?} is not an IP address (a network is ADDR/BITS)"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = bits.parse::<u8>().ok().filter(|b| *b <= max).ok_or_else(|| format!("/{bits}: a prefix is 0 to {max} bits"))?;
        return Ok(vec![Rule { net: net.to_canonical(), prefix, port }]);
    }
    let exact = |ip: IpAddr| {
        let ip = ip.to_canonical();
        Rule { net: ip, prefix: if ip.is_ipv4() { 32 } else { 128 }, port }
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![exact(ip)]);
    }
    let addrs: Vec<SocketAddr> = (host, 0).to_socket_addrs().map_err(|e| format!("cannot resolve {host:?}: {e}"))?.collect();
    if addrs.is_empty() {
        return Err(format!("{host:?} resolves to no address"));
    }
    Ok(addrs.into_iter().map(|a| exact(a.ip())).collect())
}

/// What a client is told when its push could not reach a destination.
fn failed(host: &str) -> Error {
    let message = format!("push to {host} failed: no dmover server that knows the ticket answered there (this server's log says why)");
    Error::new(ErrorKind::Unreachable, "", message)
}

/// Dials a push's destination at the addresses that were checked.
struct Checked {
    addrs: Vec<SocketAddr>,
}

impl Dialer for Checked {
    fn dial(&self, _host: &str) -> std::io::Result<Box<dyn Transport>> {
        Ok(Box::new(connect_any(&self.addrs)?))
    }

    fn direct(&self) -> bool {
        true
    }

    /// Whatever went wrong before the destination proved it knows the
    /// ticket (a closed port, a banner, a wrong answer) is logged here and
    /// told to the client as one and the same failure.
    fn unreached(&self, host: &str, e: Error) -> Error {
        log::warn!("push to {host} failed: {e}");
        failed(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn by_default_the_servers_own_and_its_links_addresses_are_refused() {
        let p = PushTo::default();
        for refused in [
            "127.0.0.1:7450",
            "127.8.9.1:22",
            "0.0.0.0:80",
            "169.254.169.254:80",
            "224.0.0.1:1",
            "255.255.255.255:1",
            "[::1]:22",
            "[::]:22",
        ] {
            assert!(!p.allows(a(refused)), "{refused}");
        }
        for refused in ["[::ffff:127.0.0.1]:22", "[fe80::1]:22", "[ff02::1]:22"] {
            assert!(!p.allows(a(refused)), "{refused}");
        }
        for allowed in ["10.0.0.5:7450", "192.168.1.2:7450", "8.8.8.8:7450", "[2001:db8::1]:7450", "[fd00::1]:7450"] {
            assert!(p.allows(a(allowed)), "{allowed}");
        }
    }

    #[test]
    fn a_list_allows_what_it_names_and_nothing_else() {
        let p = PushTo::parse(&["127.0.0.1:7450".into(), "10.1.0.0/16".into(), "[fd00::/8]:9000".into(), "::1".into()]).unwrap();
        assert!(p.allows(a("127.0.0.1:7450")) && !p.allows(a("127.0.0.1:22")));
        assert!(p.allows(a("[::ffff:127.0.0.1]:7450")), "a mapped address is its IPv4 address");
        assert!(p.allows(a("10.1.255.3:22")) && !p.allows(a("10.2.0.1:22")));
        assert!(p.allows(a("[fd12::1]:9000")) && !p.allows(a("[fd12::1]:9001")) && !p.allows(a("[fe00::1]:9000")));
        assert!(p.allows(a("[::1]:1")));
        assert!(!p.allows(a("8.8.8.8:7450")), "a list replaces the default");
        let names = PushTo::parse(&["localhost:7450".into()]).unwrap();
        assert!(names.allows(a("127.0.0.1:7450")) && !names.allows(a("127.0.0.1:7451")));
        let any = PushTo::anywhere();
        assert!(any.allows(a("127.0.0.1:22")) && any.allows(a("[::1]:22")) && any.allows(a("8.8.8.8:1")));
    }

    #[test]
    fn bad_values_say_what_is_wrong() {
        for (spec, says) in [
            ("10.0.0.0/33", "0 to 32 bits"),
            ("h:0", "not a port"),
            ("h:x", "not a port"),
            ("[::1", "without its ']'"),
            ("[::1]x", "expected ':PORT'"),
            ("10.0.0.x/8", "not an IP address"),
            ("no-such-host.invalid", "cannot resolve"),
        ] {
            let e = PushTo::parse(&[spec.into()]).unwrap_err();
            assert!(e.starts_with(&format!("--push-to {spec}: ")) && e.contains(says), "{spec}: {e}");
        }
    }

    #[test]
    fn prefixes_compare_whole_and_partial_bytes() {
        assert!(same_prefix(&[10, 1, 2, 3], &[10, 1, 200, 3], 16));
        assert!(same_prefix(&[10, 0b1010_0000, 0, 0], &[10, 0b1011_1111, 0, 0], 11));
        assert!(!same_prefix(&[10, 0b1010_0000, 0, 0], &[10, 0b1000_0000, 0, 0], 11));
        assert!(same_prefix(&[1, 2, 3, 4], &[5, 6, 7, 8], 0));
    }
}
