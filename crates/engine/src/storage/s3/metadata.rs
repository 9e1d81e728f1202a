//! What an object's metadata keeps of a file, and how symlinks are kept.
//!
//! Each object carries metadata: dmover's digest of its content (with the
//! block size it was computed with), checked when the object is read back
//! whole, and the source's mode and mtime; its owner, group and `user.*`
//! extended attributes as rclone's `--metadata` keeps them.
//!
//! Symlinks are kept as rclone keeps them with `--links`, so that each tool
//! reads the other's: the symlink `NAME` is the object `NAME.rclonelink`,
//! whose content is the link's target and whose metadata holds its mtime
//! where rclone keeps it (`mtime`, seconds since the epoch as a decimal
//! fraction) besides dmover's own. A listing names such an object `NAME`,
//! a symlink as long as its target; where an object `NAME` is there too,
//! that file is what the name holds (making a link removes it).

use super::{io_error, Inner};
use crate::storage::{Attrs, Digest, Kind, Stat, Xattr, NO_TIME};
use aws_sdk_s3::primitives::DateTime;
use std::collections::HashMap;
use std::io;

/// Object metadata (`x-amz-meta-*`).
const META_DIGEST: &str = "dmover-digest";
const META_MTIME: &str = "dmover-mtime";
const META_MODE: &str = "dmover-mode";
/// Where rclone keeps an object's mtime (`x-amz-meta-mtime`): seconds
/// since the epoch, as a decimal fraction.
const META_RCLONE_MTIME: &str = "mtime";
/// Where rclone's `--metadata` keeps a file's type and mode (octal, as
/// `100644`) and owner and group (decimal ids).
pub(super) const META_RCLONE_MODE: &str = "mode";
const META_UID: &str = "uid";
const META_GID: &str = "gid";
/// Metadata names that are not a file's extended attributes: rclone's own
/// (`--metadata` keeps each `user.NAME` attribute as `NAME`) and dmover's.
const META_NOT_XATTRS: [&str; 9] = ["mtime", "atime", "btime", "mode", "uid", "gid", "rdev", "content-type", "tier"];
/// What rclone's `--links` appends to the key of the object that holds a
/// symlink's target.
pub(super) const LINK_SUFFIX: &str = ".rclonelink";
/// The longest symlink target read back (Linux's `PATH_MAX`): an object
/// holding more is no symlink's.
pub(super) const MAX_TARGET: u64 = 4096;

fn time_of(t: Option<&DateTime>) -> (i64, u32) {
    t.map(|t| (t.secs(), t.subsec_nanos())).unwrap_or((0, 0))
}

/// A file's attributes from its object's size, time and metadata: mode and
/// mtime as dmover stored them (else the mtime rclone stored, else the
/// object's time; else mode 0644); the object's time is its change time.
pub(super) fn object_stat(size: u64, modified: Option<&DateTime>, meta: Option<&HashMap<String, String>>) -> Stat {
    let changed = time_of(modified);
    // Metadata names are HTTP headers': any case.
    let get = |k: &str| meta.and_then(|m| m.iter().find(|(n, _)| n.eq_ignore_ascii_case(k))).map(|(_, v)| v.as_str());
    let octal = |k| get(k).and_then(|m| u32::from_str_radix(m, 8).ok());
    let mode = octal(META_MODE).or_else(|| octal(META_RCLONE_MODE).map(|m| m & 0o7777)).unwrap_or(0o644);
    let mtime = get(META_MTIME).and_then(parse_mtime).or_else(|| get(META_RCLONE_MTIME).and_then(parse_decimal_time)).unwrap_or(changed);
    let id = |k| get(k).and_then(|v| v.parse::<u32>().ok());
    let owner = id(META_UID).zip(id(META_GID));
    Stat { kind: Kind::File, size, mode, mtime, ctime: (changed.0, changed.1 as i64), nlink: 1, owner, rdev: 0, inode: None }
}

/// The attributes of the symlink kept in an object with attributes `st`
/// (see [`LINK_SUFFIX`]): its size is its target's.
pub(super) fn link_stat(st: Stat) -> Stat {
    Stat { kind: Kind::Symlink, mode: 0o777, ..st }
}

/// The name of the symlink an object named `name` keeps, if it keeps one.
pub(super) fn link_name(name: &str) -> Option<&str> {
    name.strip_suffix(LINK_SUFFIX).filter(|n| !n.is_empty() && !n.ends_with('/'))
}

/// `(secs, nanos)` as a decimal fraction of seconds, as rclone writes an mtime.
fn decimal_time((secs, nanos): (i64, u32)) -> String {
    let t = secs as i128 * 1_000_000_000 + nanos as i128;
    let sign = if t < 0 { "-" } else { "" };
    format!("{sign}{}.{:09}", t.abs() / 1_000_000_000, t.abs() % 1_000_000_000)
}

/// A time written as a decimal fraction of seconds (any number of digits
/// after the point; those past nanoseconds are dropped).
fn parse_decimal_time(s: &str) -> Option<(i64, u32)> {
    let (negative, digits) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let (whole, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if whole.is_empty() || !whole.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let nanos: i128 = format!("{:0<9}", &frac[..frac.len().min(9)]).parse().ok()?;
    let t = whole.parse::<i128>().ok()? * 1_000_000_000 + nanos;
    let t = if negative { -t } else { t };
    Some((i64::try_from(t.div_euclid(1_000_000_000)).ok()?, t.rem_euclid(1_000_000_000) as u32))
}

/// What a HEAD or a GET answered of an object: its attributes, its ETag
/// and the digest dmover stored with it.
pub(super) fn answered(
    size: u64,
    modified: Option<&DateTime>,
    meta: Option<&HashMap<String, String>>,
    etag: Option<&str>,
) -> (Stat, Option<String>, Option<Digest>) {
    let digest = meta.and_then(|m| m.get(META_DIGEST)).and_then(|d| parse_digest(d));
    (object_stat(size, modified, meta), etag.map(str::to_string), digest)
}

fn parse_mtime(s: &str) -> Option<(i64, u32)> {
    let (secs, nanos) = s.split_once('.')?;
    Some((secs.parse().ok()?, nanos.parse().ok().filter(|n| *n < 1_000_000_000)?))
}

fn parse_digest(s: &str) -> Option<Digest> {
    let (block_size, sum) = s.split_once(':')?;
    let sum: [u8; 16] = hex::decode(sum).ok()?.try_into().ok()?;
    Some(Digest { block_size: block_size.parse().ok()?, sum })
}

pub(super) fn dir_stat() -> Stat {
    Stat { kind: Kind::Dir, size: 0, mode: 0o755, mtime: NO_TIME, ctime: (0, 0), nlink: 1, owner: None, rdev: 0, inode: None }
}

impl Inner {
    /// The object metadata that keeps `attrs`: mode, mtime and digest as
    /// dmover's; mode and mtime also where rclone keeps them (`mode` with
    /// the regular file's type, `mtime` a decimal fraction of seconds), and
    /// owner, group and `user.*` extended attributes as its `--metadata`
    /// does (`uid`, `gid`, and `NAME` for `user.NAME`).
    /// An attribute metadata cannot hold (one outside `user.*`, a name
    /// other than lower-case letters, digits, `-` and `_`, or one of
    /// rclone's or dmover's own, a value that is not printable ASCII) is
    /// an error: never dropped.
    pub(super) fn metadata(attrs: &Attrs) -> io::Result<HashMap<String, String>> {
        let mut m = HashMap::from([
            (META_MODE.to_string(), format!("{:o}", attrs.mode)),
            (META_RCLONE_MODE.to_string(), format!("{:o}", 0o100000 | attrs.mode & 0o7777)),
        ]);
        if let Some((s, ns)) = attrs.mtime {
            m.insert(META_MTIME.into(), format!("{s}.{ns:09}"));
            m.insert(META_RCLONE_MTIME.into(), decimal_time((s, ns)));
        }
        if let Some(d) = attrs.digest {
            m.insert(META_DIGEST.into(), format!("{}:{}", d.block_size, hex::encode(d.sum)));
        }
        if let Some(uid) = attrs.owner {
            m.insert(META_UID.into(), uid.to_string());
        }
        if let Some(gid) = attrs.group {
            m.insert(META_GID.into(), gid.to_string());
        }
        for x in &attrs.xattrs {
            let key = x.name.strip_prefix(b"user.").and_then(|k| std::str::from_utf8(k).ok()).filter(|k| {
                !k.is_empty()
                    && k.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
                    && !META_NOT_XATTRS.contains(k)
                    && !k.starts_with("dmover-")
            });
            let value = std::str::from_utf8(&x.value).ok().filter(|v| v.bytes().all(|b| (0x20..0x7f).contains(&b)));
            match (key, value) {
                (Some(k), Some(v)) => m.insert(k.to_string(), v.to_string()),
                _ => {
                    let name = String::from_utf8_lossy(&x.name).escape_debug().to_string();
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("extended attribute {name}: an object store keeps only user.* attributes named in lower-case letters, digits, '-' and '_' (not rclone's or dmover's own names), with values of printable ASCII"),
                    ));
                }
            };
        }
        Ok(m)
    }

    /// The `user.*` extended attributes kept in the metadata of the
    /// object at `k` (see [`Inner::metadata`]).
    pub(super) fn xattrs(&self, k: &str) -> io::Result<Vec<Xattr>> {
        let h = self.rt.block_on(self.client.head_object().bucket(&self.bucket).key(k).send()).map_err(|e| io_error(k, e))?;
        let mut out: Vec<Xattr> = (h.metadata().into_iter().flatten())
            .map(|(k, v)| (k.to_ascii_lowercase(), v))
            .filter(|(k, _)| !META_NOT_XATTRS.contains(&k.as_str()) && !k.starts_with("dmover-"))
            .map(|(k, v)| Xattr { name: format!("user.{k}").into_bytes(), value: v.clone().into_bytes() })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips() {
        let sum = [7u8; 16];
        let d = Digest { block_size: 1 << 20, sum };
        let m = Inner::metadata(&Attrs { mode: 0o640, mtime: Some((1_700_000_000, 5)), digest: Some(d), ..Default::default() }).unwrap();
        let st = object_stat(9, None, Some(&m));
        assert_eq!((st.mode, st.mtime, st.size), (0o640, (1_700_000_000, 5), 9));
        assert_eq!(parse_digest(&m[META_DIGEST]), Some(d));
    }

    #[test]
    fn rclone_mtimes_read_and_write_as_decimal_fractions() {
        for t in [(1_700_000_000, 5), (0, 0), (1, 999_999_999), (-3, 500_000_000), (-1, 0)] {
            assert_eq!(parse_decimal_time(&decimal_time(t)), Some(t), "{}", decimal_time(t));
        }
        assert_eq!(decimal_time((-3, 500_000_000)), "-2.500000000");
        for (s, t) in [
            ("1700000000.5", (1_700_000_000, 500_000_000)),
            ("1700000000", (1_700_000_000, 0)),
            ("1700000000.1234567891", (1_700_000_000, 123_456_789)),
            ("-0.25", (-1, 750_000_000)),
        ] {
            assert_eq!(parse_decimal_time(s), Some(t), "{s}");
        }
        for bad in ["", ".5", "1.2.3", "x", "1e9", "+1", "1.-5"] {
            assert_eq!(parse_decimal_time(bad), None, "{bad}");
        }
        // rclone's metadata alone gives the mtime; dmover's wins where both are.
        let rclone = HashMap::from([("Mtime".to_string(), "1600000000.25".to_string())]);
        assert_eq!(object_stat(3, None, Some(&rclone)).mtime, (1_600_000_000, 250_000_000));
        let both = HashMap::from([("mtime".to_string(), "1600000000.25".to_string()), (META_MTIME.to_string(), "7.000000001".to_string())]);
        assert_eq!(object_stat(3, None, Some(&both)).mtime, (7, 1));
        assert_eq!((link_name("a.rclonelink"), link_name(".rclonelink"), link_name("a")), (Some("a"), None, None));
    }
}
