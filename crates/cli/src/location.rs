//! Locations on the command line: a local path,
//! `dmover://HOST[:PORT][,HOST[:PORT]...]/EXPORT/path`, a host reached
//! over ssh (`[user@]host:path`, `ssh://[user@]host[:port]/path`; see `ssh`),
//! or an S3 bucket (`s3://bucket/prefix`, read and written by this process).

use crate::ssh::{Endpoint, SshOptions, SshTarget};
use crate::TokenArgs;
use clap::Args;
use dmover_engine::session::Credential;
use dmover_engine::storage::{self, s3, Store};
use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use std::collections::HashMap;

/// Port a server listens on when a URL names none.
pub const DEFAULT_PORT: u16 = 7450;
pub const SCHEME: &str = "dmover://";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local path, spelled as names travel (`dmover_proto::path`).
    Local(String),
    Remote {
        /// `host:port` of each server.
        hosts: Vec<String>,
        /// `EXPORT/path` as the server sees it, with any trailing `/` kept.
        path: String,
    },
    /// Hosts reached over ssh; `path` as their remote ends export it
    /// (`home/...` or `root/...`). Becomes `Remote` once the remote ends run.
    Ssh { targets: Vec<SshTarget>, path: String },
    /// Objects of an S3 bucket; `path` is the key prefix (a trailing `/` kept).
    S3 { bucket: String, path: String },
}

/// Where and how to reach S3 buckets.
#[derive(Args, Clone, Debug)]
pub struct S3Args {
    /// URL of the S3 server for s3:// locations (else AWS_ENDPOINT_URL, the
    /// profile's endpoint_url, or AWS itself); addressed path-style.
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
}

impl S3Args {
    /// The storage of `bucket`, sending parts of uploads in `staging` bytes
    /// of memory, with its resume state in the user's cache.
    pub fn open(&self, bucket: &str, staging: u64) -> Result<Store> {
        self.open_with(bucket, &self.options(s3::default_state_dir(bucket), staging))
    }

    /// The storage of `bucket`, opened with options `o`.
    pub fn open_with(&self, bucket: &str, o: &s3::Options) -> Result<Store> {
        Ok(std::sync::Arc::new(s3::S3::open(bucket, o)?))
    }

    /// How to reach a bucket as these flags say: the whole bucket, named by
    /// its URL, resume state in `state_dir`, parts of uploads in `staging` bytes.
    pub fn options(&self, state_dir: std::path::PathBuf, staging: u64) -> s3::Options {
        s3::Options { endpoint: self.s3_endpoint.clone(), prefix: String::new(), label: None, state_dir, staging, fetch_listed: false }
    }
}

fn parse_s3(s: &str, rest: &str) -> Result<Location, Error> {
    let bad = |why: &str| Error::new(ErrorKind::Usage, s, format!("malformed URL: {why} (expected s3://BUCKET/prefix)"));
    let (bucket, path) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() || !bucket.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
        return Err(bad(&format!("bad bucket name '{bucket}'")));
    }
    let body = path.trim_end_matches('/');
    dmover_proto::path::check_relative(body).map_err(|e| bad(&e.to_string()))?;
    Ok(Location::S3 { bucket: bucket.to_string(), path: path.to_string() })
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
        if let Some(rest) = s.strip_prefix(storage::S3_SCHEME) {
            return parse_s3(s, rest);
        }
        let Some(rest) = s.strip_prefix(SCHEME) else {
            if let Some((targets, path)) = crate::ssh::parse(s)? {
                return Ok(Location::Ssh { targets, path });
            }
            if s.contains("://") {
                return Err(bad(s, "unknown scheme"));
            }
            // Spelled as names travel (a backslash doubled), as the engine reads them.
            return Ok(Location::Local(dmover_proto::path::from_bytes(s.as_bytes()).into_owned()));
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

    /// Whether a server holds it (an S3 bucket is read and written here).
    pub fn is_remote(&self) -> bool {
        matches!(self, Location::Remote { .. } | Location::Ssh { .. })
    }

    /// The path part (local path, `EXPORT/path`, or the key prefix).
    pub fn path(&self) -> &str {
        match self {
            Location::Local(p) => p,
            Location::Remote { path, .. } | Location::Ssh { path, .. } | Location::S3 { path, .. } => path,
        }
    }
}

/// The servers a command talks to, and how to authenticate with each: the
/// remote ends started over ssh (running while this lives) with their
/// one-time secrets, and dmover:// servers with the token.
pub struct Hosts {
    started: HashMap<String, Credential>,
    token: Option<Credential>,
    _endpoints: Vec<Endpoint>,
}

impl Hosts {
    /// How to authenticate with `host` (`ip:port`, as a resolved location names it).
    pub fn cred(&self, host: &str) -> Result<Credential> {
        match self.started.get(host) {
            Some(c) => Ok(c.clone()),
            None => self.token.clone().ok_or_else(|| Error::internal(format!("no credential for {host}"))),
        }
    }

    /// Each of `hosts` with its credential.
    pub fn creds(&self, hosts: &[String]) -> Result<Vec<(String, Credential)>> {
        hosts.iter().map(|h| Ok((h.clone(), self.cred(h)?))).collect()
    }
}

/// Starts a remote end over ssh for each host the ssh locations in
/// `locations` name (one per host, at the same time), replaces those
/// locations with the remote ends' addresses, and reads the token if a
/// dmover:// server is named too.
pub fn resolve(locations: &mut [Location], o: &SshOptions, token: &TokenArgs) -> Result<Hosts> {
    let token = match locations.iter().any(|l| matches!(l, Location::Remote { .. })) {
        true => Some(Credential::token(&token.token()?)),
        false => None,
    };
    let mut targets: Vec<SshTarget> = Vec::new();
    for l in locations.iter() {
        if let Location::Ssh { targets: ts, .. } = l {
            for t in ts {
                if !targets.contains(t) {
                    targets.push(t.clone());
                }
            }
        }
    }
    let endpoints = std::thread::scope(|s| {
        let started: Vec<_> = targets.iter().map(|t| s.spawn(|| Endpoint::start(t, o))).collect();
        started
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::internal("starting a remote end panicked"))))
            .collect::<Result<Vec<_>>>()
    })?;
    let addr_of = |t: &SshTarget| endpoints[targets.iter().position(|x| x == t).expect("started")].addr.clone();
    for l in locations.iter_mut() {
        if let Location::Ssh { targets, path } = l {
            *l = Location::Remote { hosts: targets.iter().map(addr_of).collect(), path: std::mem::take(path) };
        }
    }
    let started = endpoints.iter().map(|e| (e.addr.clone(), e.cred.clone())).collect();
    Ok(Hosts { started, token, _endpoints: endpoints })
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
        assert_eq!(Location::parse("s3://b").unwrap(), Location::S3 { bucket: "b".into(), path: "".into() });
        assert_eq!(Location::parse("s3://b.1/d/e/").unwrap(), Location::S3 { bucket: "b.1".into(), path: "d/e/".into() });
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
            "s3://",
            "s3:///x",
            "s3://b/../x",
            "s3://b//x",
            "s3://b c/x",
        ] {
            assert_eq!(Location::parse(bad).unwrap_err().kind, ErrorKind::Usage, "{bad}");
        }
    }
}
