//! Locations on the command line: a local path,
//! `dmover://HOST[:PORT][,HOST[:PORT]...]/EXPORT/path`, or a host reached
//! over ssh (`[user@]host:path`, `ssh://[user@]host[:port]/path`; see `ssh`).

use crate::ssh::{Endpoint, SshOptions, SshTarget};
use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;

/// Port a server listens on when a URL names none.
pub const DEFAULT_PORT: u16 = 7450;
pub const SCHEME: &str = "dmover://";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    Local(String),
    Remote {
        /// `host:port` of each server.
        hosts: Vec<String>,
        /// `EXPORT/path` as the server sees it, with any trailing `/` kept.
        path: String,
    },
    /// A host reached over ssh; `path` as its remote end exports it
    /// (`home/...` or `root/...`). Becomes `Remote` once the remote end runs.
    Ssh {
        target: SshTarget,
        path: String,
    },
}

fn bad(url: &str, why: &str) -> Error {
    Error::new(ErrorKind::Usage, url, format!("malformed URL: {why} (expected dmover://HOST[:PORT]/EXPORT/path)"))
}

fn parse_host(url: &str, h: &str) -> Result<String, Error> {
    if h.is_empty() {
        return Err(bad(url, "empty host"));
    }
    let (host, port) = if let Some(rest) = h.strip_prefix('[') {
        let (addr, after) = rest.split_once(']').ok_or_else(|| bad(url, "unclosed '[' in host"))?;
        (format!("[{addr}]"), after.strip_prefix(':'))
    } else {
        match h.rsplit_once(':') {
            Some((a, p)) => (a.to_string(), Some(p)),
            None => (h.to_string(), None),
        }
    };
    if host.is_empty() || host.contains(['/', '@', ' ']) {
        return Err(bad(url, &format!("bad host '{h}'")));
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| bad(url, &format!("bad port '{p}'")))?,
    };
    Ok(format!("{host}:{port}"))
}

impl Location {
    pub fn parse(s: &str) -> Result<Location, Error> {
        if s.is_empty() {
            return Err(Error::new(ErrorKind::Usage, "", "empty path"));
        }
        let Some(rest) = s.strip_prefix(SCHEME) else {
            if let Some((target, path)) = crate::ssh::parse(s)? {
                return Ok(Location::Ssh { target, path });
            }
            if s.contains("://") {
                return Err(bad(s, "unknown scheme"));
            }
            return Ok(Location::Local(s.to_string()));
        };
        let (hosts, path) = rest.split_once('/').ok_or_else(|| bad(s, "no export named"))?;
        let hosts = hosts.split(',').map(|h| parse_host(s, h)).collect::<Result<Vec<_>, _>>()?;
        let export = path.split('/').next().unwrap_or("");
        if export.is_empty() {
            return Err(bad(s, "no export named"));
        }
        let body = path.trim_end_matches('/');
        dmover_proto::path::check_relative(body).map_err(|e| bad(s, &e.to_string()))?;
        Ok(Location::Remote { hosts, path: path.to_string() })
    }

    pub fn is_remote(&self) -> bool {
        !matches!(self, Location::Local(_))
    }

    /// The path part (local path, or `EXPORT/path`).
    pub fn path(&self) -> &str {
        match self {
            Location::Local(p) => p,
            Location::Remote { path, .. } | Location::Ssh { path, .. } => path,
        }
    }
}

/// Replaces each ssh location in `locations` with the remote end started
/// for it, and returns the endpoints (to keep alive while they are used).
/// All ssh locations must name one host (one remote end serves them all).
pub fn resolve_ssh(locations: &mut [Location], o: &SshOptions) -> Result<Option<Endpoint>> {
    let mut target: Option<SshTarget> = None;
    for l in locations.iter() {
        if let Location::Ssh { target: t, .. } = l {
            match &target {
                None => target = Some(t.clone()),
                Some(first) if first == t => {}
                Some(first) => {
                    let msg = format!("one command reaches one host over ssh; here {} and {}", first.destination(), t.destination());
                    return Err(Error::new(ErrorKind::Usage, &t.host, msg).advised("copy to or from each host in its own command"));
                }
            }
        }
    }
    let Some(target) = target else { return Ok(None) };
    let endpoint = Endpoint::start(&target, o)?;
    for l in locations.iter_mut() {
        if let Location::Ssh { path, .. } = l {
            *l = Location::Remote { hosts: vec![endpoint.addr.clone()], path: std::mem::take(path) };
        }
    }
    Ok(Some(endpoint))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_ports_and_paths() {
        assert_eq!(
            Location::parse("dmover://a:1,b,[::1]:3/ex/d/").unwrap(),
            Location::Remote { hosts: vec!["a:1".into(), "b:7450".into(), "[::1]:3".into()], path: "ex/d/".into() }
        );
        assert_eq!(Location::parse("dmover://h/ex").unwrap(), Location::Remote { hosts: vec!["h:7450".into()], path: "ex".into() });
        assert_eq!(Location::parse("/tmp/x").unwrap(), Location::Local("/tmp/x".into()));
        for bad in [
            "dmover://",
            "dmover://h",
            "dmover://h/",
            "dmover://h:0/e",
            "dmover://h:x/e",
            "dmover://,h/e",
            "dmover://h/e/../x",
            "ftp://h/e",
            "dmover://h//x",
        ] {
            assert_eq!(Location::parse(bad).unwrap_err().kind, ErrorKind::Usage, "{bad}");
        }
    }
}
