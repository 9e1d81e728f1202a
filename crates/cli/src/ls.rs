//! `dmover ls`: lists what a path, directory or glob names on a server or
//! in an S3 bucket — the same names a copy of it would send.

use crate::location::{self, Location, S3Args};
use crate::ssh::SshOptions;
use crate::TokenArgs;
use clap::Args;
use dmover_engine::{session, source};
use dmover_engine::{Error, Result};
use dmover_proto::frame::FileMeta;
use dmover_proto::ErrorKind;

#[derive(Args)]
pub struct LsArgs {
    /// What to list: dmover://HOST[:PORT]/EXPORT/path, [user@]host:path or s3://BUCKET/prefix (a file, directory or glob).
    pub url: String,
    /// Print a JSON array of {path, size, mtime, mode}.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub token: TokenArgs,
    #[command(flatten)]
    pub ssh: SshOptions,
    #[command(flatten)]
    pub s3: S3Args,
}

pub fn run(a: LsArgs) -> Result<i32> {
    let mut loc = [Location::parse(&a.url)?];
    // Entries are printed as they come, a JSON array too: a listing of
    // millions of files holds none of them.
    let mut first = true;
    let mut show = |entries: Vec<FileMeta>| {
        for m in &entries {
            if a.json {
                outln!("{}{}", if first { "[" } else { "," }, entry_json(m));
                first = false;
            } else {
                outln!("{}", line(m));
            }
        }
    };
    if let [Location::S3 { bucket, path }] = &loc {
        // Listing sends nothing: no memory for parts.
        let store = a.s3.open(bucket, 0)?;
        source::list(store.as_ref(), path, &mut |m| {
            show(vec![m]);
            true
        })?;
    } else {
        let reach = location::resolve(&mut loc, &a.ssh, &a.token)?;
        let [Location::Remote { hosts, path }] = loc else {
            let msg = "ls needs a dmover:// URL, [user@]host:path or s3://BUCKET/prefix (use ls(1) for local paths)";
            return Err(Error::new(ErrorKind::Usage, &a.url, msg));
        };
        // Each host of a location holds its own share of the files.
        for host in &hosts {
            session::list(host, &reach.cred(host)?, path.clone(), &mut show)?;
        }
    }
    if a.json {
        outln!("{}", if first { "[]" } else { "]" });
    }
    Ok(0)
}

/// One entry as a JSON object: path, size, mtime, mode (octal, with the
/// type bits), and a symlink's target.
fn entry_json(m: &FileMeta) -> String {
    let mut e = serde_json::json!({ "path": m.path, "size": m.size, "mtime": m.mtime_s, "mode": format!("{:o}", m.mode) });
    if let Some(t) = &m.target {
        e["target"] = t.as_str().into();
    }
    e.to_string()
}

/// `drwxr-xr-x` style permissions, size and path, and a symlink's target
/// after ` -> ` (control characters escaped).
fn line(m: &FileMeta) -> String {
    let kind = match m.mode & FileMeta::TYPE {
        FileMeta::DIR => 'd',
        FileMeta::LINK => 'l',
        FileMeta::FIFO => 'p',
        FileMeta::CHAR => 'c',
        FileMeta::BLOCK => 'b',
        FileMeta::SOCKET => 's',
        _ => '-',
    };
    let mut perms = String::from(kind);
    for shift in [6, 3, 0] {
        let b = (m.mode >> shift) & 7;
        perms.push(if b & 4 != 0 { 'r' } else { '-' });
        perms.push(if b & 2 != 0 { 'w' } else { '-' });
        perms.push(if b & 1 != 0 { 'x' } else { '-' });
    }
    let printable = dmover_proto::path::printable;
    let target = m.target.as_deref().map(|t| format!(" -> {}", printable(t))).unwrap_or_default();
    format!("{perms} {:>14} {:>12} {}{target}", m.size, m.mtime_s, printable(&m.path))
}
