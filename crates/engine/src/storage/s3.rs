//! The [`Storage`] of an S3-compatible object store: one bucket, or the
//! keys below a prefix in it, named like paths (`dir/sub/file`). Every
//! path is checked to be a plain relative path before it becomes a key, so
//! none names a key outside the prefix.
//!
//! Objects are written whole and never changed in place, so a file exists
//! only once committed: a file being written is kept in memory part by
//! part, and each part wholly written is sent as a part of a multipart
//! upload; commit sends the last part and completes it. A file smaller
//! than a part is sent by one PUT at commit, under its final key. A larger
//! one is uploaded under the key it will be committed as, when created
//! for one ([`Storage::create_for`]): a multipart upload is invisible until
//! complete, so that key is untouched until commit, which completes the
//! upload and then sets the object's metadata by copying it onto itself
//! (the digest is known only at the end, and S3 sets metadata only when an
//! object is made; a server copies an object onto itself by rewriting its
//! metadata alone, where it can). Until that copy ends, the object is
//! whole but without its metadata: a run cut short there leaves one that
//! a later `--sync` sends again. A file committed under another name is
//! completed under its own and copied. Nothing is visible under the final
//! key before commit.
//!
//! Uploads are resumable. Each is recorded in a local state directory
//! (`uploads/`): its id, then each part's ETag once the server has taken
//! it. [`Storage::reopen`] takes the upload up again with the parts the
//! server lists whose size and ETag match the record, and
//! [`WriteFile::holds`] says which bytes those are. An upload is aborted
//! when its file is given up for good: removed ([`Storage::remove`],
//! which the engine does to a file that failed or whose source went or
//! changed), or created afresh; a file dropped uncommitted keeps its
//! upload for a later run once a part is sent. The engine keeps its
//! journals in the same state directory (`journals/`, the
//! [`Storage::state_store`]): an object store has no file that grows by
//! small writes. Where that directory cannot be made or written, uploads
//! work but are not resumed.
//!
//! Each object carries metadata: dmover's digest of its content (with the
//! block size it was computed with), checked when the object is read back
//! whole, and the source's mode and mtime. Directories are the prefixes of
//! keys: one exists while an object is below it, so an empty directory is
//! not kept and making one does nothing.
//!
//! Symlinks are kept as rclone keeps them with `--links`, so that each tool
//! reads the other's: the symlink `NAME` is the object `NAME.rclonelink`,
//! whose content is the link's target and whose metadata holds its mtime
//! where rclone keeps it (`mtime`, seconds since the epoch as a decimal
//! fraction) besides dmover's own. A listing names such an object `NAME`,
//! a symlink as long as its target; where an object `NAME` is there too,
//! that file is what the name holds (making a link removes it).
//!
//! Memory: the parts held in memory, being filled and being sent, of all
//! the files being written here take at most [`Options::staging`] (at
//! least one first part, at most [`MAX_PARTS_IN_FLIGHT`]), and one part more
//! while a part is read back from a file (below). A writer whose part
//! needs more waits while parts being sent will free some (back-pressure
//! on the engine's writer, and through it on the network). Blocks from
//! several streams and readers arrive out of order, so several parts of a
//! file fill at once, each slowly; a writer never waits for those to
//! complete (they may need its own later blocks). Parts being filled take
//! at most a quarter of the bound in memory, so that most of it holds
//! parts being sent, many at once (each waits a round trip for the
//! server's answer); beyond that share, or when the bound is taken, a
//! part fills in an unnamed file of the state directory instead, and is
//! read back to be sent (where no such file can be made, the part stays
//! in memory, beyond the bound, with a warning). Each part's buffer is
//! made at its final capacity and handed to the SDK as it is, never
//! copied.
//!
//! Reads: each range a reader opens (a chunk of a large file, or a file)
//! is asked for with one GET, and its body is read as it arrives, a batch
//! at a time; a few batches wait for the reader, within the same bound
//! (one block per GET where it has no room), and the connection's flow
//! control holds the server back beyond them. Bytes in flight thus keep
//! flowing while the reader is busy, with no round trip between pieces.
//!
//! Listings carry no metadata, so each object listed takes a request for
//! its mode and mtime: a HEAD, or, where every object listed is to be read
//! ([`Options::fetch_listed`]), the GET of a small object whole, kept in
//! memory until it is read (one request per small object in all).
//!
//! The AWS SDK does the requests, on an async runtime of this storage's
//! own; the engine's threads wait on it.

use super::{Attrs, Digest, DirEntry, Features, Keeps, Kind, ReadFile, Stat, Storage, Store, WriteFile, Xattr};
use crate::error::{Damaged, Error, Refused, Result};
use aws_config::meta::credentials::CredentialsProviderChain;
use aws_config::meta::region::RegionProviderChain;
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::{ByteStream, DateTime};
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart, MetadataDirective};
use aws_sdk_s3::Client;
use bytes::Bytes;
use dmover_proto::ErrorKind;
use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use tokio::runtime::Runtime;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// Size of the first parts of a multipart upload (see [`part`]): small
/// enough that the default memory bound holds 8 of them, being filled and
/// sent at once (at 1 Gbit/s and 50 ms, 4 × 1 GiB went up in 47 s with
/// 8 MiB parts, in 82 s with 16 MiB ones: the bound held 4 of those, the
/// parts being filled took most of it, and one part was sent at a time).
const FIRST_PART: u64 = 8 << 20;
/// Parts of each size: each next [`PARTS_PER_SIZE`] parts are twice as
/// large as the last, up to [`MAX_PARTS`] (so objects up to 15.6 GiB have
/// parts of 8 MiB, and the largest object is 484 GiB).
const PARTS_PER_SIZE: u64 = 2_000;
/// The most parts S3 takes in one upload.
const MAX_PARTS: u64 = 10_000;
/// Memory the parts and reads take at most, in first parts, however
/// large [`Options::staging`] is.
const MAX_PARTS_IN_FLIGHT: u64 = 16;
/// Bytes a read's GET hands its reader at once (see [`Stream`]): the
/// pieces its body arrives in, gathered, so that the reader is woken once
/// per batch rather than per piece.
const BATCH: u64 = 1 << 20;
/// Batches a GET holds for its reader at most.
const BATCHES_AHEAD: usize = 2;
/// The memory a read's GET takes of the storage's bound: the batches
/// waiting, the one being gathered and the one being read.
const STREAM_MEMORY: u64 = (BATCHES_AHEAD as u64 + 2) * BATCH;
/// The bytes a GET asks for when the memory bound has no room for a
/// stream's batches: a block, as the reader asks for it.
const BLOCK_WINDOW: u64 = 1 << 20;
/// Requests for the objects of listings at once, all listings together
/// (HEADs, or GETs of small ones). A listing's requests queue behind
/// those of the listings before it, so the connections they take are
/// kept busy from one listing to the next: left idle between listings, a
/// connection starts its next request in slow start.
const HEADS_IN_FLIGHT: usize = 128;
/// Objects at most this large are fetched whole by a listing whose
/// objects are all to be read (see [`Options::fetch_listed`]).
const FETCH_LISTED: u64 = 1 << 20;
/// How long a listing waits, with no object it fetched being read, for room
/// to fetch more; past that, listings stop fetching (the objects kept are
/// not being read: files skipped as already at their destination, say).
const LISTED_STALL: std::time::Duration = std::time::Duration::from_secs(5);
/// Directories listed at once by a walk (see [`Features::lists_at_once`]):
/// the next ones' listings and small objects arrive while one is sent.
const LISTS_AT_ONCE: usize = 4;
/// Files committed at once (each a PUT, or the completion of an upload).
/// Requests sharing a link fairly end together, and the link is idle for
/// the round trip until the next ones start: the more in flight, the
/// smaller that gap's share (at 100 Mbit/s and 50 ms, small files went up
/// at 63 % of the link with 32, at 96 % with 128).
const COMMITS_IN_FLIGHT: usize = 128;
/// Part size of a copy made by the server (at most 5 GiB).
const COPY_PART: u64 = 1 << 30;
/// The largest object one copy request copies (S3's limit).
const MAX_COPY: u64 = 5 << 30;

/// How long connecting to the server may take.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long the server may take to answer a request.
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);
/// Object metadata (`x-amz-meta-*`).
const META_DIGEST: &str = "dmover-digest";
const META_MTIME: &str = "dmover-mtime";
const META_MODE: &str = "dmover-mode";
/// Where rclone keeps an object's mtime (`x-amz-meta-mtime`): seconds
/// since the epoch, as a decimal fraction.
const META_RCLONE_MTIME: &str = "mtime";
/// Where rclone's `--metadata` keeps a file's type and mode (octal, as
/// `100644`) and owner and group (decimal ids).
const META_RCLONE_MODE: &str = "mode";
const META_UID: &str = "uid";
const META_GID: &str = "gid";
/// Metadata names that are not a file's extended attributes: rclone's own
/// (`--metadata` keeps each `user.NAME` attribute as `NAME`) and dmover's.
const META_NOT_XATTRS: [&str; 9] = ["mtime", "atime", "btime", "mode", "uid", "gid", "rdev", "content-type", "tier"];
/// What rclone's `--links` appends to the key of the object that holds a
/// symlink's target.
const LINK_SUFFIX: &str = ".rclonelink";
/// The longest symlink target read back (Linux's `PATH_MAX`): an object
/// holding more is no symlink's.
const MAX_TARGET: u64 = 4096;

/// How an object is cut into the parts of its multipart upload: part
/// `index` (from 0) covers `start(index)..start(index) + len(index)`.
mod part {
    use super::{FIRST_PART, MAX_PARTS, PARTS_PER_SIZE};

    /// The size of part `index` (at most [`MAX_PARTS`]): [`FIRST_PART`],
    /// doubled every [`PARTS_PER_SIZE`] parts.
    pub fn len(index: u64) -> u64 {
        FIRST_PART << (index / PARTS_PER_SIZE)
    }

    /// The offset part `index` starts at.
    pub fn start(index: u64) -> u64 {
        let size = index / PARTS_PER_SIZE;
        PARTS_PER_SIZE * FIRST_PART * ((1 << size) - 1) + (index % PARTS_PER_SIZE) * len(index)
    }

    /// The part that holds offset `off`: [`MAX_PARTS`] past the largest object.
    pub fn at(off: u64) -> u64 {
        (0..MAX_PARTS / PARTS_PER_SIZE)
            .map(|size| size * PARTS_PER_SIZE)
            .find(|&first| off < start(first + PARTS_PER_SIZE))
            .map_or(MAX_PARTS, |first| first + (off - start(first)) / len(first))
    }

    /// The largest object.
    pub fn max_object() -> u64 {
        start(MAX_PARTS)
    }
}

/// Where and how to reach the store.
#[derive(Debug, Clone)]
pub struct Options {
    /// The endpoint URL (else `AWS_ENDPOINT_URL` or the profile's
    /// `endpoint_url`, else AWS itself).
    pub endpoint: Option<String>,
    /// The key prefix that is the storage's root (a plain relative path;
    /// empty for the whole bucket): `path` is the key `prefix/path`.
    pub prefix: String,
    /// How messages name the root (an export's name), else `s3://BUCKET[/prefix]`.
    pub label: Option<String>,
    /// A local directory for this storage's resume state ([`default_state_dir`]
    /// for `cp`; a served bucket's is named after its export).
    pub state_dir: PathBuf,
    /// Memory for the parts of uploads, being filled and being sent, and the
    /// bytes of objects being read (see [`Budget`]): at least one part, at
    /// most [`MAX_PARTS_IN_FLIGHT`].
    pub staging: u64,
    /// Whether every object listed is to be read (a copy of all of it, not
    /// a sync or a glob): a listing then fetches each small object whole
    /// with the GET it would read it by, in place of the HEAD it needs for
    /// the object's mode and mtime, and keeps it until it is read, within
    /// half of the memory bound (see `staging`).
    pub fetch_listed: bool,
}

/// dmover's directory in the user's cache: `$XDG_CACHE_HOME/dmover`, else
/// `~/.cache/dmover`.
pub fn cache_dir() -> PathBuf {
    let cache = match std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"),
    };
    cache.join("dmover")
}

/// Where the resume state of uploads into `bucket` is kept by default:
/// `$XDG_CACHE_HOME/dmover/s3/BUCKET`, else `~/.cache/dmover/s3/BUCKET`.
pub fn default_state_dir(bucket: &str) -> PathBuf {
    cache_dir().join("s3").join(bucket)
}

/// A bucket of an S3-compatible object store.
pub struct S3 {
    inner: Arc<Inner>,
    /// Where the engine keeps its journals of files being written here
    /// (None if that directory cannot be made: uploads are not resumed).
    state: Option<Store>,
}

struct Inner {
    client: Client,
    bucket: String,
    /// The key of the storage's root: the prefix, or empty.
    root: String,
    /// How messages name the root.
    label: String,
    rt: Runtime,
    /// The memory the parts of uploads and the bytes of reads hold,
    /// within [`Options::staging`].
    budget: Arc<Budget>,
    /// The local directory of the records of uploads in progress.
    uploads: PathBuf,
    /// Small objects listings fetched whole, until they are read.
    listed: Listed,
    /// Permits for the requests of listings ([`HEADS_IN_FLIGHT`]).
    heads: Arc<Semaphore>,
}

impl std::fmt::Debug for S3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "S3(s3://{})", self.inner.bucket)
    }
}

impl S3 {
    /// Connects to `bucket`, with the credentials and endpoint found as
    /// AWS tools find them: `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`
    /// (and `AWS_SESSION_TOKEN`), else the profile `AWS_PROFILE` (or
    /// `default`) of `~/.aws/credentials` and `~/.aws/config`; the region
    /// from `AWS_REGION` or the profile (else us-east-1). A server other
    /// than AWS is addressed path-style. Checks that the bucket is there
    /// and the credentials are taken.
    pub fn open(bucket: &str, o: &Options) -> Result<S3> {
        let label = format!("s3://{bucket}");
        let root = o.prefix.trim_end_matches('/').to_string();
        dmover_proto::path::check_relative(&root)
            .map_err(|e| Error::new(ErrorKind::Usage, format!("{label}/{root}"), format!("not a key prefix: {e}")))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("dmover-s3")
            .enable_all()
            .build()
            .map_err(|e| Error::new(ErrorKind::Internal, &label, format!("cannot start the S3 client's runtime: {e}")))?;
        let credentials =
            CredentialsProviderChain::first_try("environment", aws_config::environment::EnvironmentVariableCredentialsProvider::new())
                .or_else("profile", aws_config::profile::ProfileFileCredentialsProvider::builder().build());
        let region = RegionProviderChain::first_try(aws_config::environment::EnvironmentVariableRegionProvider::new())
            .or_else(aws_config::profile::ProfileFileRegionProvider::new())
            .or_else(aws_config::Region::new("us-east-1"));
        // A server that stops answering is given up on, as a dmover peer is.
        let timeouts = aws_config::timeout::TimeoutConfig::builder().connect_timeout(CONNECT_TIMEOUT).read_timeout(READ_TIMEOUT).build();
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .credentials_provider(credentials)
            .region(region)
            .timeout_config(timeouts);
        if let Some(e) = &o.endpoint {
            loader = loader.endpoint_url(e);
        }
        let config = rt.block_on(loader.load());
        let endpoint = config.endpoint_url().map(str::to_string);
        let mut s3 = aws_sdk_s3::config::Builder::from(&config);
        if endpoint.is_some() {
            s3 = s3.force_path_style(true);
        }
        let client = Client::from_conf(s3.build());
        let journals = o.state_dir.join("journals");
        let state = match std::fs::create_dir_all(&journals).and_then(|()| super::export("s3-state", &journals)) {
            Ok(s) => Some(s),
            Err(e) => {
                log::warn!("{}: {e}; uploads to s3://{bucket} cut short will start afresh", journals.display());
                None
            }
        };
        let uploads = o.state_dir.join("uploads");
        let budget = Arc::new(Budget::new(o.staging.clamp(FIRST_PART, MAX_PARTS_IN_FLIGHT * FIRST_PART)));
        let shown = o.label.clone().unwrap_or_else(|| dmover_proto::path::join(&label, &root));
        let listed = Listed::new(o.fetch_listed);
        let heads = Arc::new(Semaphore::new(HEADS_IN_FLIGHT));
        let inner = Inner { client, bucket: bucket.to_string(), root, label: shown, rt, budget, uploads, listed, heads };
        let at = endpoint.as_deref().map(|e| format!(" at {e}")).unwrap_or_default();
        let creds = config.credentials_provider().ok_or_else(|| Error::internal("no credentials provider"))?;
        use aws_sdk_s3::config::ProvideCredentials;
        let key_id = match inner.rt.block_on(creds.provide_credentials()) {
            Ok(c) => c.access_key_id().to_string(),
            Err(e) => {
                return Err(Error::new(ErrorKind::Usage, &label, format!("no S3 credentials found ({})", DisplayErrorContext(&e)))
                    .advised("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or name a profile of ~/.aws/credentials with AWS_PROFILE"))
            }
        };
        let e = match inner.rt.block_on(inner.client.head_bucket().bucket(bucket).send()) {
            Ok(_) => return Ok(S3 { inner: Arc::new(inner), state }),
            Err(e) => e,
        };
        Err(match status(&e) {
            Some(404) => Error::new(ErrorKind::NotFound, &label, format!("no such bucket{at}"))
                .advised(format!("check the bucket's name, or create it first (for example `aws s3 mb s3://{bucket}`)")),
            Some(401 | 403) => {
                let msg = format!("the S3 server{at} refused the credentials with access key ID {key_id} for this bucket");
                Error::new(ErrorKind::Auth, &label, msg).advised(
                    "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the profile AWS_PROFILE names in ~/.aws/credentials), and that they may use this bucket",
                )
            }
            Some(400) => Error::new(ErrorKind::Usage, &label, format!("the S3 server{at} refused a request for this bucket (HTTP 400)"))
                .advised(
                    "check the bucket's name (S3 names are 3 to 63 lowercase letters, digits, '.' and '-') and the region (AWS_REGION)",
                ),
            _ => {
                let e = io_error("reaching the bucket", e);
                Error::new(crate::error::classify(&e), &label, format!("cannot reach the S3 server{at}: {e}"))
                    .advised("check the endpoint (--s3-endpoint or AWS_ENDPOINT_URL) and that the server runs")
            }
        })
    }
}

/// The HTTP status of a failed request, if it got an answer.
fn status<E>(e: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>) -> Option<u16> {
    e.raw_response().map(|r| r.status().as_u16())
}

/// An I/O error for a failed request: NotFound for 404, PermissionDenied
/// for 403, a lost connection as such; the server's status, error code and
/// message if it answered.
fn io_error<E>(what: &str, e: SdkError<E, aws_sdk_s3::config::http::HttpResponse>) -> io::Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let kind = match (status(&e), &e) {
        (Some(404), _) => io::ErrorKind::NotFound,
        (Some(401 | 403), _) => io::ErrorKind::PermissionDenied,
        (_, SdkError::DispatchFailure(_)) => io::ErrorKind::ConnectionRefused,
        (_, SdkError::TimeoutError(_)) => io::ErrorKind::TimedOut,
        _ => io::ErrorKind::Other,
    };
    let msg = match status(&e) {
        Some(s) => {
            let code = e.code().map(|c| format!(" {c}")).unwrap_or_default();
            let message = e.message().map(|m| format!(": {m}")).unwrap_or_default();
            format!("the S3 server answered HTTP {s}{code}{message}")
        }
        None => DisplayErrorContext(&e).to_string(),
    };
    io::Error::new(kind, format!("{what}: {msg}"))
}

fn unsupported(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, format!("an object store cannot {what}"))
}

/// The key of `path` below the key `root` (`root` itself for the empty
/// path): `path` must be a plain relative path, or it is refused.
fn key(root: &str, path: &Path) -> io::Result<String> {
    let p = path.to_str().ok_or_else(|| Refused::io("the name is not UTF-8, which an S3 key must be; the file is not copied"))?;
    let p = p.trim_start_matches("./").trim_end_matches('/');
    dmover_proto::path::check_relative(&dmover_proto::path::from_bytes(p.as_bytes()))
        .map_err(|_| Refused::io("an S3 key is a plain relative path, without '.', '..' or empty names"))?;
    Ok(dmover_proto::path::join(root, p))
}

/// The prefix listing the objects below directory key `k`.
fn dir_prefix(k: &str) -> String {
    if k.is_empty() {
        String::new()
    } else {
        format!("{k}/")
    }
}

fn time_of(t: Option<&DateTime>) -> (i64, u32) {
    t.map(|t| (t.secs(), t.subsec_nanos())).unwrap_or((0, 0))
}

/// A file's attributes from its object's size, time and metadata: mode and
/// mtime as dmover stored them (else the mtime rclone stored, else the
/// object's time; else mode 0644); the object's time is its change time.
fn object_stat(size: u64, modified: Option<&DateTime>, meta: Option<&HashMap<String, String>>) -> Stat {
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
fn link_stat(st: Stat) -> Stat {
    Stat { kind: Kind::Symlink, mode: 0o777, ..st }
}

/// The name of the symlink an object named `name` keeps, if it keeps one.
fn link_name(name: &str) -> Option<&str> {
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

/// The size of the whole object a GET of a range of it answered.
fn total_size(r: &aws_sdk_s3::operation::get_object::GetObjectOutput) -> u64 {
    let whole = r.content_range().and_then(|c| c.rsplit_once('/')).and_then(|(_, n)| n.parse().ok());
    whole.unwrap_or(r.content_length().unwrap_or(0) as u64)
}

/// What a HEAD or a GET answered of an object: its attributes, its ETag
/// and the digest dmover stored with it.
fn answered(
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

fn dir_stat() -> Stat {
    Stat { kind: Kind::Dir, size: 0, mode: 0o755, mtime: super::NO_TIME, ctime: (0, 0), nlink: 1, owner: None, rdev: 0, inode: None }
}

/// `bucket/key` for a copy's source, percent-encoded as S3 wants it.
fn copy_source(bucket: &str, key: &str) -> String {
    let mut s = format!("{bucket}/");
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

impl Inner {
    fn key(&self, path: &Path) -> io::Result<String> {
        key(&self.root, path)
    }

    /// The key of the file `path` names, and that of the object that keeps
    /// a symlink of that name: not the root's.
    fn entry_keys(&self, path: &Path) -> io::Result<(String, String)> {
        let k = self.key(path)?;
        if k == self.root {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "the root is a directory, not the name of a file"));
        }
        let link = format!("{k}{LINK_SUFFIX}");
        Ok((k, link))
    }

    /// The object at `k`: its attributes, ETag and stored digest.
    fn head(&self, k: &str) -> io::Result<(Stat, Option<String>, Option<Digest>)> {
        let h = self.rt.block_on(self.client.head_object().bucket(&self.bucket).key(k).send()).map_err(|e| io_error(k, e))?;
        Ok(answered(h.content_length().unwrap_or(0) as u64, h.last_modified(), h.metadata(), h.e_tag()))
    }

    /// Whether any object is below directory key `k`.
    fn has_below(&self, k: &str) -> io::Result<bool> {
        let r = self.rt.block_on(self.client.list_objects_v2().bucket(&self.bucket).prefix(dir_prefix(k)).max_keys(1).send());
        Ok(r.map_err(|e| io_error(k, e))?.key_count().unwrap_or(0) > 0)
    }

    fn stat(&self, k: &str) -> io::Result<Stat> {
        // The root is a directory, whether or not any object is below it yet.
        if k == self.root {
            let r = self.rt.block_on(self.client.head_bucket().bucket(&self.bucket).send());
            return r.map(|_| dir_stat()).map_err(|e| io_error(&self.bucket, e));
        }
        match self.head(k) {
            Ok((st, _, _)) => Ok(st),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // A symlink kept as rclone keeps it, or a directory: both asked at once.
                let link = format!("{k}{LINK_SUFFIX}");
                let head = self.rt.spawn(self.client.head_object().bucket(&self.bucket).key(&link).send());
                let below = self.has_below(k);
                match self.rt.block_on(head).map_err(|e| io::Error::other(format!("{link}: {e}")))? {
                    Ok(h) => return Ok(link_stat(object_stat(h.content_length().unwrap_or(0) as u64, h.last_modified(), h.metadata()))),
                    Err(e) if status(&e) == Some(404) => {}
                    Err(e) => return Err(io_error(&link, e)),
                }
                match below? {
                    true => Ok(dir_stat()),
                    false => Err(io::Error::new(io::ErrorKind::NotFound, format!("{k}: no such object"))),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// The object metadata that keeps `attrs`: mode, mtime and digest as
    /// dmover's; mode and mtime also where rclone keeps them (`mode` with
    /// the regular file's type, `mtime` a decimal fraction of seconds), and
    /// owner, group and `user.*` extended attributes as its `--metadata`
    /// does (`uid`, `gid`, and `NAME` for `user.NAME`).
    /// An attribute metadata cannot hold (one outside `user.*`, a name
    /// other than lower-case letters, digits, `-` and `_`, or one of
    /// rclone's or dmover's own, a value that is not printable ASCII) is
    /// an error: never dropped.
    fn metadata(attrs: &Attrs) -> io::Result<HashMap<String, String>> {
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
    fn xattrs(&self, k: &str) -> io::Result<Vec<Xattr>> {
        let h = self.rt.block_on(self.client.head_object().bucket(&self.bucket).key(k).send()).map_err(|e| io_error(k, e))?;
        let mut out: Vec<Xattr> = (h.metadata().into_iter().flatten())
            .map(|(k, v)| (k.to_ascii_lowercase(), v))
            .filter(|(k, _)| !META_NOT_XATTRS.contains(&k.as_str()) && !k.starts_with("dmover-"))
            .map(|(k, v)| Xattr { name: format!("user.{k}").into_bytes(), value: v.clone().into_bytes() })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Copies `from` (of `size` bytes) to `to` with `meta` in place of its
    /// metadata, by the server: by one request up to the largest object
    /// one copies (so an object copied onto itself only has its metadata
    /// rewritten, where the server can), in parts above.
    async fn copy(&self, from: &str, to: &str, size: u64, meta: HashMap<String, String>) -> io::Result<()> {
        let c = &self.client;
        let source = copy_source(&self.bucket, from);
        if size <= MAX_COPY {
            let r = c.copy_object().bucket(&self.bucket).key(to).copy_source(&source).metadata_directive(MetadataDirective::Replace);
            return r.set_metadata(Some(meta)).send().await.map(drop).map_err(|e| io_error(to, e));
        }
        let up =
            c.create_multipart_upload().bucket(&self.bucket).key(to).set_metadata(Some(meta)).send().await.map_err(|e| io_error(to, e))?;
        let id = up.upload_id().unwrap_or_default().to_string();
        let mut parts = Vec::new();
        let copied: io::Result<()> = async {
            for (i, off) in (0..size).step_by(COPY_PART as usize).enumerate() {
                let range = format!("bytes={off}-{}", (off + COPY_PART).min(size) - 1);
                let p = c.upload_part_copy().bucket(&self.bucket).key(to).upload_id(&id).part_number(i as i32 + 1);
                let r = p.copy_source(&source).copy_source_range(range).send().await.map_err(|e| io_error(to, e))?;
                let etag = r.copy_part_result().and_then(|p| p.e_tag()).unwrap_or_default().to_string();
                parts.push(CompletedPart::builder().part_number(i as i32 + 1).e_tag(etag).build());
            }
            let done = CompletedMultipartUpload::builder().set_parts(Some(parts)).build();
            c.complete_multipart_upload()
                .bucket(&self.bucket)
                .key(to)
                .upload_id(&id)
                .multipart_upload(done)
                .send()
                .await
                .map_err(|e| io_error(to, e))?;
            Ok(())
        }
        .await;
        if copied.is_err() {
            let _ = c.abort_multipart_upload().bucket(&self.bucket).key(to).upload_id(&id).send().await;
        }
        copied
    }

    fn delete(&self, k: &str) -> io::Result<()> {
        let r = self.rt.block_on(self.client.delete_object().bucket(&self.bucket).key(k).send());
        match r {
            Ok(_) => Ok(()),
            Err(e) if status(&e) == Some(404) => Ok(()),
            Err(e) => Err(io_error(k, e)),
        }
    }
}

/// An object open for reading: a ranged GET of the version seen when
/// opened, its body handed to the reader as it arrives.
struct S3Read {
    inner: Arc<Inner>,
    key: String,
    stat: Stat,
    etag: Option<String>,
    digest: Option<Digest>,
    /// Where reading is meant to end: no GET asks for bytes past it.
    end: u64,
    window: Mutex<Window>,
}

/// The bytes the reader was last handed, and the GET under way that
/// hands it the bytes after them.
struct Window {
    /// The offset of the first byte of `data`.
    start: u64,
    data: Body,
    /// The memory `data` takes, where it is an object a listing fetched.
    held: Option<Lease>,
    stream: Option<Stream>,
}

/// The body of a GET, as it arrives: a task of the runtime gathers its
/// pieces into batches of [`BATCH`] bytes and hands them over, at most
/// [`BATCHES_AHEAD`] waiting; past those the socket's flow control holds
/// the server back while the reader is busy.
struct Stream {
    /// The offset of the first byte of the next batch.
    at: u64,
    batches: tokio::sync::mpsc::Receiver<io::Result<Body>>,
    task: JoinHandle<()>,
    /// The memory the batches take ([`STREAM_MEMORY`]), where the bound had room.
    _held: Option<Lease>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The `Range` header of bytes `off..end` (to the object's end for `u64::MAX`).
fn byte_range(off: u64, end: u64) -> String {
    if end == u64::MAX {
        format!("bytes={off}-")
    } else {
        format!("bytes={off}-{}", end - 1)
    }
}

impl S3Read {
    /// Opens object `k` to read `range` of it with one GET of the range:
    /// its answer carries the object's size, ETag and metadata as a HEAD's
    /// would (one with nothing at the start, an empty one say, takes a
    /// HEAD: that range of it cannot be asked for). Where the memory bound
    /// has no room for a stream's batches, the GET asks for one block.
    fn open(inner: &Arc<Inner>, k: &str, range: std::ops::Range<u64>) -> io::Result<S3Read> {
        if let Some(f) = inner.listed.take(k) {
            return Ok(S3Read::fetched(inner, k, range, f));
        }
        let off = range.start;
        let held = inner.budget.try_take(STREAM_MEMORY);
        let asked = if held.is_some() { range.end.max(off + 1) } else { range.end.min(off + BLOCK_WINDOW).max(off + 1) };
        let get = inner.client.get_object().bucket(&inner.bucket).key(k).range(byte_range(off, asked));
        let first = inner.rt.block_on(async {
            match get.send().await {
                Ok(r) => {
                    let (stat, etag, digest) = answered(total_size(&r), r.last_modified(), r.metadata(), r.e_tag());
                    Ok(Some((stat, etag, digest, r.body)))
                }
                Err(e) if status(&e) == Some(416) => Ok(None),
                Err(e) => Err(io_error(k, e)),
            }
        })?;
        let (stat, etag, digest, body) = match first {
            Some((stat, etag, digest, body)) => (stat, etag, digest, Some(body)),
            None => {
                let (stat, etag, digest) = inner.head(k)?;
                (stat, etag, digest, None)
            }
        };
        let end = range.end.min(stat.size);
        let window = Window { start: off, data: Body::default(), held: None, stream: None };
        let read = S3Read { inner: inner.clone(), key: k.to_string(), stat, etag, digest, end, window: Mutex::new(window) };
        if let Some(body) = body {
            let len = asked.min(stat.size).saturating_sub(off);
            read.window.lock().expect("read window lock").stream = Some(read.pump(off, len, body, held));
        }
        Ok(read)
    }

    /// Reads `range` of object `k` from what a listing fetched of it: the
    /// version listed, as if opened then.
    fn fetched(inner: &Arc<Inner>, k: &str, range: std::ops::Range<u64>, f: Fetched) -> S3Read {
        let end = range.end.min(f.stat.size);
        let start = range.start.min(end);
        let data = f.data.slice(start..end);
        let mut held = f.held;
        held.keep(data.len());
        let window = Mutex::new(Window { start, data, held: Some(held), stream: None });
        S3Read { inner: inner.clone(), key: k.to_string(), stat: f.stat, etag: f.etag, digest: f.digest, end, window }
    }

    /// Starts the GET of the bytes from `off` for a read of `want` bytes:
    /// to where reading is meant to end (to the read's end for a read past
    /// it, or where the memory bound has no room for a stream's batches).
    fn stream_from(&self, off: u64, want: u64) -> io::Result<Stream> {
        let i = &self.inner;
        let read_end = (off + want).min(self.stat.size);
        let held = i.budget.try_take(STREAM_MEMORY);
        let end = if held.is_some() && off < self.end { self.end } else { read_end };
        let get = i.client.get_object().bucket(&i.bucket).key(&self.key).range(byte_range(off, end));
        let get = get.set_if_match(self.etag.clone());
        let r = i.rt.block_on(get.send()).map_err(|e| match status(&e) {
            Some(412) => io::Error::other(format!("{}: the object was replaced while it was read", self.key)),
            _ => io_error(&self.key, e),
        })?;
        Ok(self.pump(off, end - off, r.body, held))
    }

    /// Hands the `len` bytes of `body`, from offset `at`, to the reader in
    /// batches (see [`Stream`]); a body longer or shorter fails the read.
    fn pump(&self, at: u64, len: u64, mut body: ByteStream, held: Option<Lease>) -> Stream {
        let (tx, batches) = tokio::sync::mpsc::channel(BATCHES_AHEAD);
        let key = self.key.clone();
        let task = self.inner.rt.spawn(async move {
            let (mut got, mut batched, mut batch) = (0, 0, Vec::new());
            let outcome = loop {
                match body.try_next().await {
                    Ok(Some(piece)) => {
                        (got, batched) = (got + piece.len() as u64, batched + piece.len() as u64);
                        batch.push(piece);
                        if got > len {
                            break Err(io::Error::other(format!("{key}: asked for {len} bytes, got more")));
                        }
                        if batched >= BATCH {
                            if tx.send(Ok(Body::of(batch.drain(..)))).await.is_err() {
                                return;
                            }
                            batched = 0;
                        }
                    }
                    Ok(None) if got < len => break Err(io::Error::other(format!("{key}: asked for {len} bytes, got {got}"))),
                    Ok(None) => break Ok(Body::of(batch.drain(..))),
                    Err(e) => break Err(body_error(&key, e)),
                }
            };
            let _ = tx.send(outcome).await;
        });
        Stream { at, batches, task, _held: held }
    }
}

/// The body of a GET of `key` whole, checked against the checksum the
/// server keeps for the object where it sent one.
async fn collect(key: &str, body: ByteStream) -> io::Result<Body> {
    body.collect().await.map(|b| Body::of(b.into_segments())).map_err(|e| body_error(key, e))
}

/// What went wrong with the body of a GET of `key`: it differs from the
/// checksum the server keeps for the object, or the connection failed.
fn body_error(key: &str, e: aws_sdk_s3::primitives::ByteStreamError) -> io::Error {
    if std::error::Error::source(&e).is_some_and(|s| s.is::<aws_smithy_checksums::body::validate::Error>()) {
        let msg = format!("{key}: what was read differs from the checksum the server keeps for the object ({})", DisplayErrorContext(&e));
        return io::Error::other(Damaged(msg));
    }
    io::Error::new(io::ErrorKind::ConnectionReset, format!("{key}: {}", DisplayErrorContext(&e)))
}

/// The body of a GET as the chunks it came in, never joined: reading it
/// copies each byte once, into the reader's buffer.
#[derive(Default)]
struct Body {
    chunks: Vec<Bytes>,
    len: u64,
}

impl Body {
    fn of(chunks: impl Iterator<Item = Bytes>) -> Body {
        let chunks: Vec<Bytes> = chunks.collect();
        let len = chunks.iter().map(|c| c.len() as u64).sum();
        Body { chunks, len }
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the bytes from `off` into `buf`, as many as it holds and fit:
    /// how many.
    fn copy_at(&self, mut off: u64, buf: &mut [u8]) -> usize {
        let mut n = 0;
        for c in &self.chunks {
            if n == buf.len() {
                break;
            }
            if off >= c.len() as u64 {
                off -= c.len() as u64;
                continue;
            }
            let piece = &c[off as usize..];
            let k = piece.len().min(buf.len() - n);
            buf[n..n + k].copy_from_slice(&piece[..k]);
            (n, off) = (n + k, 0);
        }
        n
    }

    /// The bytes of `range` (within it), sharing its chunks.
    fn slice(&self, range: std::ops::Range<u64>) -> Body {
        let mut at = 0;
        let mut chunks = Vec::new();
        for c in &self.chunks {
            let (start, end) = (at, at + c.len() as u64);
            at = end;
            let (from, to) = (range.start.max(start), range.end.min(end));
            if from < to {
                chunks.push(c.slice((from - start) as usize..(to - start) as usize));
            }
        }
        Body::of(chunks.into_iter())
    }
}

impl ReadFile for S3Read {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        if off >= self.stat.size || buf.is_empty() {
            return Ok(0);
        }
        let mut w = self.window.lock().expect("read window lock");
        loop {
            if (w.start..w.start + w.data.len()).contains(&off) {
                return Ok(w.data.copy_at(off - w.start, buf));
            }
            // The bytes from `off` come next from the GET under way, or from a new one.
            if w.stream.as_ref().is_none_or(|s| s.at != off) {
                (w.data, w.held, w.stream) = (Body::default(), None, None);
                w.stream = Some(self.stream_from(off, buf.len() as u64)?);
            }
            let s = w.stream.as_mut().expect("a stream from off");
            let batch = s.batches.blocking_recv();
            let at = s.at;
            match batch {
                Some(Ok(data)) if !data.is_empty() => {
                    s.at += data.len();
                    (w.start, w.data) = (at, data);
                }
                Some(Err(e)) => {
                    w.stream = None;
                    return Err(e);
                }
                // The GET is over: the bytes from `off` take a new one.
                Some(Ok(_)) | None => w.stream = None,
            }
        }
    }

    fn stat(&self) -> io::Result<Stat> {
        Ok(self.stat)
    }

    fn digest(&self) -> Option<Digest> {
        self.digest
    }
}

/// A file being written: the parts being filled, and the parts of its
/// multipart upload the server has or is being sent.
struct S3Write {
    inner: Arc<Inner>,
    /// The key it was created under.
    key: String,
    /// The key its multipart upload is made under: the key it is to be
    /// committed as, or its own.
    target: String,
    up: Mutex<Upload>,
}

#[derive(Default)]
struct Upload {
    /// Parts not yet sent, by index (part number − 1).
    filling: BTreeMap<u64, Filling>,
    /// Parts sent, by index: kept from an earlier run or sent by this one.
    sent: BTreeMap<u64, Sent>,
    /// The file's size: the end of the furthest write (or kept part).
    size: u64,
    /// The multipart upload, once the first part is sent.
    id: Option<String>,
    attrs: Option<Attrs>,
    /// Committed or given up: nothing more is written.
    done: bool,
}

/// A part being filled: its bytes so far, and which of them are written.
struct Filling {
    data: PartData,
    /// The end of the furthest write into it.
    len: usize,
    written: Ranges,
    /// The memory `data` holds.
    lease: Lease,
}

/// Where a part being filled keeps its bytes.
enum PartData {
    /// In memory, in a buffer of a whole part's capacity.
    Memory(PartBuf),
    /// In an unnamed file of the state directory: the part needed memory
    /// beyond the bound when none could be freed by waiting.
    Spilled(std::fs::File),
}

impl Filling {
    /// An empty part of `cap` bytes, its memory to be taken from `budget` as it fills.
    fn new(budget: &Arc<Budget>, cap: u64) -> io::Result<Filling> {
        Ok(Filling { data: PartData::Memory(PartBuf::new(cap as usize)?), len: 0, written: Ranges::default(), lease: budget.lease() })
    }

    /// Writes `src` at `rel`. Memory for the part is taken from the budget
    /// as the part grows, waiting while parts being sent will free some;
    /// when none will, the part moves to a file (else stays in memory,
    /// beyond the bound, if no file can be made).
    fn write(&mut self, i: &Inner, k: &str, index: u64, rel: usize, src: &[u8]) -> io::Result<()> {
        let end = rel + src.len();
        if let PartData::Memory(v) = &mut self.data {
            if v.len() < end && !self.lease.grow((end - v.len()) as u64) {
                match spill_file(i, k, index).and_then(|f| f.write_all_at(v.as_ref(), 0).map(|()| f)) {
                    Ok(f) => {
                        self.data = PartData::Spilled(f);
                        self.lease.release();
                    }
                    Err(e) => {
                        log::warn!("{}: {e}; a part of {k} is kept in memory beyond the bound", i.uploads.display());
                        self.lease.force((end - v.len()) as u64);
                    }
                }
            }
        }
        match &mut self.data {
            PartData::Memory(v) => v.write(rel, src),
            PartData::Spilled(f) => f.write_all_at(src, rel as u64)?,
        }
        self.len = self.len.max(end);
        self.written.mark(rel as u64, end as u64);
        Ok(())
    }

    /// Reads what was written of `rel..rel + buf.len()` (zeros where
    /// nothing was); answers how many bytes the part has there.
    fn read_at(&self, rel: usize, buf: &mut [u8]) -> io::Result<usize> {
        let have = self.len.saturating_sub(rel).min(buf.len());
        match &self.data {
            PartData::Memory(v) => buf[..have].copy_from_slice(&v.as_ref()[rel..rel + have]),
            PartData::Spilled(f) => f.read_exact_at(&mut buf[..have], rel as u64)?,
        }
        Ok(have)
    }

    /// The part's bytes, to be sent, with the memory they hold counted as
    /// being sent. A spilled part is read back into memory once the budget
    /// has room for it (or once nothing else is being sent).
    fn into_body(self, budget: &Arc<Budget>) -> io::Result<(Bytes, Lease)> {
        let Filling { data, len, mut lease, .. } = self;
        let v = match data {
            PartData::Memory(v) => {
                lease.sending();
                v
            }
            PartData::Spilled(f) => {
                lease = budget.take_to_send(len as u64);
                let mut v = PartBuf::new(len)?;
                f.read_exact_at(v.grow(len), 0)?;
                v
            }
        };
        // The buffer itself, not a copy: the SDK shares it with any retry.
        Ok((if len == 0 { Bytes::new() } else { Bytes::from_owner(v) }, lease))
    }
}

/// A part's buffer: anonymous memory mapped for it alone, of the part's
/// final capacity, so that it never moves as it fills and goes back to
/// the system when dropped (a heap allocator may keep buffers this large
/// once freed, and the process's memory with them). Its pages take memory
/// only once written; its length is the end of the furthest write.
struct PartBuf {
    map: memmap2::MmapMut,
    len: usize,
}

impl PartBuf {
    /// An empty buffer of capacity `cap`.
    fn new(cap: usize) -> io::Result<PartBuf> {
        Ok(PartBuf { map: memmap2::MmapMut::map_anon(cap.max(1))?, len: 0 })
    }

    /// The end of the furthest write.
    fn len(&self) -> usize {
        self.len
    }

    /// Extends it to at least `len` bytes (zeros where never written), and
    /// answers its first `len` bytes.
    fn grow(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.map.len(), "a part's buffer holds {} bytes, not {len}", self.map.len());
        self.len = self.len.max(len);
        &mut self.map[..len]
    }

    /// Writes `src` at `at`.
    fn write(&mut self, at: usize, src: &[u8]) {
        self.grow(at + src.len())[at..].copy_from_slice(src);
    }
}

impl AsRef<[u8]> for PartBuf {
    fn as_ref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

/// An unnamed file in the state directory for part `index` of key `k`.
fn spill_file(i: &Inner, k: &str, index: u64) -> io::Result<std::fs::File> {
    std::fs::create_dir_all(&i.uploads)?;
    let mut path = i.record_path(k).into_os_string();
    path.push(format!(".{index}.spill"));
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
    std::fs::remove_file(&path)?;
    Ok(f)
}

/// The memory the parts of a storage's uploads hold in memory (being
/// filled or being sent), and the bytes of the objects it reads, kept
/// within a bound. A read takes its memory only if it fits at once (see
/// [`Stream`]).
///
/// A writer that needs more waits while parts are being sent: each send
/// ends (taken, failed or timed out) and frees its part. It never waits
/// for parts still being filled, which may need that writer's own later
/// blocks (a file's blocks are written by one thread, in the order they
/// arrive): such a part goes to a file instead. A part is sent from
/// memory; one read back from a file waits for room as a writer does,
/// and takes its memory beyond the bound only when nothing else is being
/// sent, so the parts held never exceed the bound by more than one part.
struct Budget {
    bound: u64,
    held: Mutex<Held>,
    /// Signalled when memory is given back.
    freed: Condvar,
}

/// What a [`Budget`] has handed out.
#[derive(Default)]
struct Held {
    bytes: u64,
    /// Of those, the bytes of parts being filled in memory.
    filling: u64,
    /// Parts being sent.
    sending: usize,
}

impl Budget {
    /// A budget of `bound` bytes, none handed out.
    fn new(bound: u64) -> Budget {
        Budget { bound, held: Mutex::new(Held::default()), freed: Condvar::new() }
    }

    /// A lease of no memory yet.
    fn lease(self: &Arc<Self>) -> Lease {
        Lease { budget: self.clone(), bytes: 0, holds: Holds::Window }
    }

    /// The most parts being filled may hold in memory: a quarter of the
    /// bound (one first part at least); see the module's comment.
    fn filling_share(&self) -> u64 {
        (self.bound / 4).max(FIRST_PART)
    }

    /// Takes `n` bytes if they fit now (for an object being read).
    fn try_take(self: &Arc<Self>, n: u64) -> Option<Lease> {
        let mut h = self.held.lock().expect("budget lock");
        (h.bytes + n <= self.bound).then(|| {
            h.bytes += n;
            Lease { budget: self.clone(), bytes: n, holds: Holds::Window }
        })
    }

    /// Takes `len` bytes to send a part read back from a file: once they
    /// fit, or nothing else is being sent.
    fn take_to_send(self: &Arc<Self>, len: u64) -> Lease {
        let mut h = self.held.lock().expect("budget lock");
        while h.bytes + len > self.bound && h.sending > 0 {
            h = self.freed.wait(h).expect("budget lock");
        }
        h.bytes += len;
        h.sending += 1;
        Lease { budget: self.clone(), bytes: len, holds: Holds::Sending }
    }
}

/// Memory taken from a [`Budget`], given back when dropped.
struct Lease {
    budget: Arc<Budget>,
    bytes: u64,
    holds: Holds,
}

/// What a [`Lease`]'s memory holds, as its budget counts it.
#[derive(Clone, Copy, PartialEq)]
enum Holds {
    /// Bytes of an object being read, or nothing yet.
    Window,
    /// A part being filled.
    Filling,
    /// A part being sent.
    Sending,
}

impl Lease {
    /// Takes `n` more bytes for a part being filled if they fit, waiting
    /// while parts being sent may make room; false if the parts being
    /// filled would take more than their share, or if the bytes do not fit
    /// and nothing is being sent.
    fn grow(&mut self, n: u64) -> bool {
        let b = self.budget.clone();
        let mut h = b.held.lock().expect("budget lock");
        loop {
            if h.filling + n > b.filling_share() {
                return false;
            }
            if h.bytes + n <= b.bound {
                self.take_filling(&mut h, n);
                return true;
            }
            if h.sending == 0 {
                return false;
            }
            h = b.freed.wait(h).expect("budget lock");
        }
    }

    fn take_filling(&mut self, h: &mut Held, n: u64) {
        h.bytes += n;
        h.filling += n;
        self.bytes += n;
        self.holds = Holds::Filling;
    }

    /// Gives back what it holds beyond `n` bytes.
    fn keep(&mut self, n: u64) {
        if n < self.bytes {
            let mut h = self.budget.held.lock().expect("budget lock");
            h.bytes -= self.bytes - n;
            self.bytes = n;
            self.budget.freed.notify_all();
        }
    }

    /// Takes `n` more bytes, beyond the bound if need be.
    fn force(&mut self, n: u64) {
        let b = self.budget.clone();
        self.take_filling(&mut b.held.lock().expect("budget lock"), n);
    }

    /// Gives back all it holds.
    fn release(&mut self) {
        let mut h = self.budget.held.lock().expect("budget lock");
        h.bytes -= self.bytes;
        match std::mem::replace(&mut self.holds, Holds::Window) {
            Holds::Filling => h.filling -= self.bytes,
            Holds::Sending => h.sending -= 1,
            Holds::Window => {}
        }
        self.bytes = 0;
        self.budget.freed.notify_all();
    }

    /// Counts its part as being sent.
    fn sending(&mut self) {
        if self.holds != Holds::Sending {
            let mut h = self.budget.held.lock().expect("budget lock");
            h.sending += 1;
            if self.holds == Holds::Filling {
                h.filling -= self.bytes;
            }
            self.holds = Holds::Sending;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

/// Small objects listings fetched whole, each kept until it is read (see
/// [`Options::fetch_listed`]), their memory taken from the budget.
struct Listed {
    state: Mutex<Kept>,
    /// Signalled when an object kept is taken.
    taken: Condvar,
}

#[derive(Default)]
struct Kept {
    /// Whether listings fetch small objects.
    on: bool,
    objects: HashMap<String, Fetched>,
    /// The sizes of `objects`, together.
    bytes: u64,
}

/// An object's attributes from a listing, with its key and what was
/// fetched of it where it was fetched whole.
type ListedObject = (Stat, Option<(String, Fetched)>);

/// What the GET of a whole object answered.
struct Fetched {
    stat: Stat,
    etag: Option<String>,
    digest: Option<Digest>,
    data: Body,
    held: Lease,
}

impl Listed {
    fn new(on: bool) -> Listed {
        Listed { state: Mutex::new(Kept { on, ..Kept::default() }), taken: Condvar::new() }
    }

    /// How many bytes of small objects a listing is to fetch, within `cap`
    /// together with those kept: first it waits until those take at most
    /// half of `cap` while they are being read (so listings run ahead of
    /// reading by what memory allows); none once that stalls for
    /// [`LISTED_STALL`], for good.
    fn room(&self, cap: u64) -> u64 {
        let mut k = self.state.lock().expect("listed lock");
        let mut last = k.bytes;
        while k.on && k.bytes > cap / 2 {
            let (next, waited) = self.taken.wait_timeout(k, LISTED_STALL).expect("listed lock");
            k = next;
            if waited.timed_out() && k.bytes >= last {
                log::debug!("objects fetched by a listing are not being read: listings fetch no more");
                k.on = false;
            }
            last = k.bytes;
        }
        if k.on {
            cap.saturating_sub(k.bytes)
        } else {
            0
        }
    }

    /// Keeps the objects fetched, in place of any kept under the same key.
    fn keep(&self, fetched: impl IntoIterator<Item = (String, Fetched)>) {
        let mut k = self.state.lock().expect("listed lock");
        for (key, f) in fetched {
            k.bytes += f.stat.size;
            if let Some(old) = k.objects.insert(key, f) {
                k.bytes -= old.stat.size;
            }
        }
    }

    /// Takes the object kept under `key`, if any.
    fn take(&self, key: &str) -> Option<Fetched> {
        let mut k = self.state.lock().expect("listed lock");
        let f = k.objects.remove(key)?;
        k.bytes -= f.stat.size;
        self.taken.notify_all();
        Some(f)
    }
}

/// A part of the upload.
enum Sent {
    /// The server holds it, with this ETag.
    Held(String),
    /// Being sent; the task answers its ETag.
    Sending(JoinHandle<io::Result<String>>),
}

/// Byte ranges written (start to end, merged).
#[derive(Default)]
struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    /// Whether every byte of `start..end` is written.
    fn covered(&self, start: u64, end: u64) -> bool {
        start >= end || self.0.range(..=start).next_back().is_some_and(|(_, e)| *e >= end)
    }

    fn mark(&mut self, start: u64, end: u64) {
        let (mut s, mut e) = (start, end);
        let overlapping: Vec<u64> = self.0.range(..=end).filter(|(_, e2)| **e2 >= start).map(|(s2, _)| *s2).collect();
        for s2 in overlapping {
            let e2 = self.0.remove(&s2).expect("listed");
            s = s.min(s2);
            e = e.max(e2);
        }
        self.0.insert(s, e);
    }
}

/// What the local record of an upload says: its id, the key it is made
/// under, and the ETag of each part the server took, by index.
#[derive(Debug, PartialEq)]
struct Record {
    id: String,
    target: String,
    parts: HashMap<u64, String>,
}

impl Record {
    /// The record's first line: the upload's id and, in hex, its key.
    fn head(id: &str, target: &str) -> String {
        format!("{id} {}\n", hex::encode(target))
    }

    /// Reads the record of the upload of file `k`: the id and key on the
    /// first line (the id alone in a record an earlier version wrote: the
    /// upload is under `k`), then `index etag` lines (a torn last line is
    /// ignored).
    fn parse(text: &str, k: &str) -> Option<Record> {
        let mut lines = text.split_inclusive('\n').filter_map(|l| l.strip_suffix('\n'));
        let first = lines.next()?;
        let (id, target) = match first.split_once(' ') {
            Some((id, target)) => (id, String::from_utf8(hex::decode(target).ok()?).ok()?),
            None => (first, k.to_string()),
        };
        if id.is_empty() {
            return None;
        }
        let parts = lines.filter_map(|l| l.split_once(' ')).filter_map(|(i, etag)| Some((i.parse().ok()?, etag.to_string()))).collect();
        Some(Record { id: id.to_string(), target, parts })
    }
}

impl Inner {
    /// Where the record of the upload of key `k` is kept.
    fn record_path(&self, k: &str) -> PathBuf {
        let h = u128::from_be_bytes(dmover_proto::digest::block_sum(k.as_bytes()));
        self.uploads.join(format!("{h:032x}"))
    }

    fn record(&self, k: &str) -> Option<Record> {
        Record::parse(&std::fs::read_to_string(self.record_path(k)).ok()?, k)
    }

    /// Aborts the upload of `k` that the record names, if any, and drops the record.
    fn abandon(&self, k: &str) -> io::Result<()> {
        let Some(r) = self.record(k) else { return Ok(()) };
        let abort = self.client.abort_multipart_upload().bucket(&self.bucket).key(&r.target).upload_id(&r.id);
        match self.rt.block_on(abort.send()) {
            Ok(_) => {}
            Err(e) if status(&e) == Some(404) => {}
            Err(e) => return Err(io_error(k, e)),
        }
        remove_record(&self.record_path(k))
    }

    /// Starts the multipart upload of file `k` under key `target`,
    /// aborting any other of that key (one an interrupted run started but
    /// did not record), and records it. Neither the clean-up (which needs
    /// leave to list uploads) nor the record is needed for the upload
    /// itself: their failure is a warning.
    fn begin(&self, k: &str, target: &str) -> io::Result<String> {
        let c = &self.client;
        match self.rt.block_on(c.list_multipart_uploads().bucket(&self.bucket).prefix(target).send()) {
            Ok(listed) => {
                for u in listed.uploads().iter().filter(|u| u.key() == Some(target)) {
                    let abort = c.abort_multipart_upload().bucket(&self.bucket).key(target).upload_id(u.upload_id().unwrap_or_default());
                    let _ = self.rt.block_on(abort.send());
                }
            }
            Err(e) => log::warn!("{}", io_error(&format!("{target}: listing earlier uploads to abort them"), e)),
        }
        let r = self.rt.block_on(c.create_multipart_upload().bucket(&self.bucket).key(target).send()).map_err(|e| io_error(k, e))?;
        let id = r.upload_id().unwrap_or_default().to_string();
        let recorded = std::fs::create_dir_all(&self.uploads).and_then(|()| std::fs::write(self.record_path(k), Record::head(&id, target)));
        if let Err(e) = recorded {
            log::warn!("{}: {e}; the upload of {k} cannot be resumed if cut short", self.uploads.display());
        }
        Ok(id)
    }

    /// Takes up the recorded upload of `k` again: the parts the server
    /// holds whose size is a whole part and whose ETag is the one recorded
    /// when they were sent, and the key it is made under. None if there is
    /// no record, or the server no longer has the upload.
    fn resume(&self, k: &str) -> io::Result<Option<(Upload, String)>> {
        let Some(r) = self.record(k) else { return Ok(None) };
        let mut up = Upload { id: Some(r.id.clone()), ..Upload::default() };
        let mut marker = None;
        loop {
            let req = self.client.list_parts().bucket(&self.bucket).key(&r.target).upload_id(&r.id).set_part_number_marker(marker);
            let listed = match self.rt.block_on(req.send()) {
                Ok(l) => l,
                Err(e) if status(&e) == Some(404) => {
                    remove_record(&self.record_path(k))?;
                    return Ok(None);
                }
                Err(e) => return Err(io_error(k, e)),
            };
            for p in listed.parts() {
                let (Some(n), Some(etag)) = (p.part_number(), p.e_tag()) else { continue };
                // A part number the server made up is no part of ours.
                let Some(index) = u64::try_from(n).ok().and_then(|n| n.checked_sub(1)).filter(|&i| i < MAX_PARTS) else { continue };
                if p.size() == Some(part::len(index) as i64) && r.parts.get(&index).is_some_and(|e| e == etag) {
                    up.sent.insert(index, Sent::Held(etag.to_string()));
                    up.size = up.size.max(part::start(index + 1));
                }
            }
            marker = listed.next_part_number_marker().map(str::to_string);
            if !listed.is_truncated().unwrap_or(false) || marker.is_none() {
                return Ok(Some((up, r.target)));
            }
        }
    }
}

fn remove_record(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

impl S3Write {
    /// Sends part `index` (whole, or the last one), recording its ETag once
    /// the server has it. Its memory is given back once the request ends.
    fn send_part(&self, up: &mut Upload, index: u64, part: Filling) -> io::Result<()> {
        let i = &self.inner;
        let id = match &up.id {
            Some(id) => id.clone(),
            None => up.id.insert(i.begin(&self.key, &self.target)?).clone(),
        };
        let (data, lease) = part.into_body(&i.budget)?;
        let req = i.client.upload_part().bucket(&i.bucket).key(&self.target).upload_id(id).part_number(index as i32 + 1);
        let (key, record) = (self.key.clone(), i.record_path(&self.key));
        up.sent.insert(
            index,
            Sent::Sending(i.rt.spawn(async move {
                let r = req.body(ByteStream::from(data)).send().await.map_err(|e| io_error(&key, e));
                drop(lease);
                let etag = r?.e_tag().unwrap_or_default().to_string();
                // Only while the record is there: one removed meanwhile
                // (the upload given up) is not made again. Unrecorded, the
                // part is only not kept by a later run.
                let line = format!("{index} {etag}\n");
                let _ = std::fs::OpenOptions::new()
                    .append(true)
                    .open(record)
                    .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
                Ok(etag)
            })),
        );
        Ok(())
    }

    /// Puts the file under `to` with `attrs`' metadata.
    fn commit(&self, to: &str, attrs: Option<Attrs>) -> io::Result<()> {
        let mut up = self.up.lock().expect("upload lock");
        if up.done {
            return Err(io::Error::other(format!("{}: already committed", self.key)));
        }
        let never_written = || io::Error::new(io::ErrorKind::InvalidData, format!("{}: the file has parts never written", self.key));
        let attrs = attrs.or(up.attrs.take()).unwrap_or(Attrs { mode: 0o600, ..Default::default() });
        let meta = Inner::metadata(&attrs)?;
        let i = self.inner.clone();
        let size = up.size;
        if up.id.is_none() {
            let (data, lease) = match up.filling.remove(&0) {
                Some(f) if f.written.covered(0, size) => f.into_body(&i.budget)?,
                None if size == 0 => (Bytes::new(), i.budget.lease()),
                _ => return Err(never_written()),
            };
            let put = i.client.put_object().bucket(&i.bucket).key(to).body(ByteStream::from(data)).set_metadata(Some(meta));
            i.rt.block_on(put.send()).map_err(|e| io_error(to, e))?;
            drop(lease);
            up.done = true;
            return Ok(());
        }
        // The last part (short, so not sent yet), and parts rewritten only
        // in part (blocks that straddle a kept part: it holds those bytes).
        let parts = part::at(size - 1) + 1;
        for index in 0..parts {
            let len = part::len(index).min(size - part::start(index));
            match up.filling.remove(&index) {
                Some(f) if f.written.covered(0, len) => self.send_part(&mut up, index, f)?,
                _ if up.sent.contains_key(&index) => {}
                _ => return Err(never_written()),
            }
        }
        let id = up.id.clone().unwrap_or_default();
        let sent = std::mem::take(&mut up.sent);
        log::debug!("{}: commit: waiting for parts", self.key);
        i.rt.block_on(async {
            let mut done = Vec::with_capacity(sent.len());
            for (index, part) in sent.into_iter().filter(|(index, _)| *index < parts) {
                let etag = match part {
                    Sent::Held(etag) => etag,
                    Sent::Sending(t) => t.await.map_err(|e| io::Error::other(format!("{}: sending a part failed: {e}", self.key)))??,
                };
                done.push(CompletedPart::builder().part_number(index as i32 + 1).e_tag(etag).build());
            }
            let all = CompletedMultipartUpload::builder().set_parts(Some(done)).build();
            let c = i.client.complete_multipart_upload().bucket(&i.bucket).key(&self.target).upload_id(id).multipart_upload(all);
            c.send().await.map_err(|e| io_error(&self.key, e))?;
            Ok::<_, io::Error>(())
        })?;
        up.done = true;
        log::debug!("{}: commit: completed under {}; setting its metadata", self.key, self.target);
        remove_record(&i.record_path(&self.key))?;
        i.rt.block_on(async {
            // Onto its own key, the copy only sets the metadata.
            let copied = i.copy(&self.target, to, size, meta).await;
            if to == self.target && copied.is_ok() {
                return Ok(());
            }
            // The object under its first key goes, and so does one left
            // without its metadata when the copy failed.
            let deleted = i.client.delete_object().bucket(&i.bucket).key(&self.target).send().await;
            copied.and(deleted.map(drop).map_err(|e| io_error(&self.target, e)))
        })
    }
}

impl Drop for S3Write {
    /// An upload with parts sent is kept for a later run to take up again
    /// ([`Storage::remove`] aborts it); one with none is aborted.
    fn drop(&mut self) {
        let up = self.up.lock().unwrap_or_else(|e| e.into_inner());
        if !up.done && up.id.is_some() && up.sent.is_empty() {
            let _ = self.inner.abandon(&self.key);
        }
    }
}

impl ReadFile for S3Write {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        let up = self.up.lock().expect("upload lock");
        if off >= up.size || buf.is_empty() {
            return Ok(0);
        }
        let n = buf.len().min((up.size - off) as usize);
        let mut at = 0;
        while at < n {
            let o = off + at as u64;
            let index = part::at(o);
            let rel = (o - part::start(index)) as usize;
            let len = (n - at).min(part::len(index) as usize - rel);
            if up.sent.contains_key(&index) {
                return Err(unsupported("read back the parts of an object it has sent before the object is complete"));
            }
            let have = match up.filling.get(&index) {
                Some(f) => f.read_at(rel, &mut buf[at..at + len])?,
                None => 0,
            };
            buf[at + have..at + len].fill(0);
            at += len;
        }
        Ok(n)
    }

    fn stat(&self) -> io::Result<Stat> {
        let up = self.up.lock().expect("upload lock");
        let a = up.attrs.as_ref();
        Ok(Stat {
            kind: Kind::File,
            size: up.size,
            mode: a.map_or(0o600, |a| a.mode),
            mtime: a.and_then(|a| a.mtime).unwrap_or((0, 0)),
            ctime: (0, 0),
            nlink: 1,
            owner: None,
            rdev: 0,
            inode: None,
        })
    }
}

impl WriteFile for S3Write {
    /// Writes into the parts being filled; a part wholly written is sent.
    /// A part sent already is filled again, and sent again once whole.
    /// Waits while the parts held reach the bound and parts being sent
    /// will make room (see [`Budget`]).
    fn write_all_at(&self, data: &[u8], off: u64) -> io::Result<()> {
        let mut up = self.up.lock().expect("upload lock");
        if up.done {
            return Err(io::Error::other(format!("{}: already committed", self.key)));
        }
        let end = off + data.len() as u64;
        let mut at = off;
        while at < end {
            let index = part::at(at);
            if index >= MAX_PARTS {
                return Err(io::Error::new(
                    io::ErrorKind::FileTooLarge,
                    format!("{}: objects larger than {} GiB are not supported", self.key, part::max_object() >> 30),
                ));
            }
            let (start, cap) = (part::start(index), part::len(index));
            let stop = (start + cap).min(end);
            let (rel, len) = ((at - start) as usize, (stop - at) as usize);
            let f = match up.filling.entry(index) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => e.insert(Filling::new(&self.inner.budget, cap)?),
            };
            f.write(&self.inner, &self.key, index, rel, &data[(at - off) as usize..][..len])?;
            if f.written.covered(0, cap) {
                let f = up.filling.remove(&index).expect("filled above");
                self.send_part(&mut up, index, f)?;
            }
            at = stop;
        }
        up.size = up.size.max(end);
        Ok(())
    }

    fn set_len(&self, _len: u64) -> io::Result<()> {
        Err(unsupported("change the length of an object"))
    }

    fn set_attrs(&self, attrs: &Attrs) -> io::Result<()> {
        self.up.lock().expect("upload lock").attrs = Some(attrs.clone());
        Ok(())
    }

    fn holds(&self, off: u64, len: u64) -> bool {
        let up = self.up.lock().expect("upload lock");
        len == 0 || (part::at(off)..=part::at(off + len - 1)).all(|index| matches!(up.sent.get(&index), Some(Sent::Held(_))))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Storage for S3 {
    /// Confined to its bucket (or prefix); symlinks, owners and `user.*`
    /// extended attributes as rclone keeps them (`--links`, `--metadata`).
    fn features(&self) -> Features {
        let keeps = Keeps::SYMLINKS | Keeps::OWNERS | Keeps::ANY_OWNER | Keeps::XATTRS;
        Features { confined: true, lists_at_once: LISTS_AT_ONCE, commits_at_once: COMMITS_IN_FLIGHT, keeps }
    }

    fn xattrs(&self, path: &Path) -> io::Result<Vec<Xattr>> {
        let (k, link) = self.inner.entry_keys(path)?;
        match self.inner.xattrs(&k) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => self.inner.xattrs(&link),
            got => got,
        }
    }

    fn display(&self, path: &Path) -> String {
        let p = dmover_proto::path::from_path(path);
        dmover_proto::path::join(&self.inner.label, p.trim_start_matches("./"))
    }

    fn stat(&self, path: &Path) -> io::Result<Stat> {
        self.inner.stat(&self.inner.key(path)?)
    }

    fn stat_followed(&self, path: &Path) -> io::Result<Stat> {
        self.stat(path)
    }

    fn is_empty_dir(&self, dir: &Path) -> io::Result<bool> {
        self.inner.has_below(&self.inner.key(dir)?).map(|any| !any)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        let k = self.inner.key(dir)?;
        let prefix = dir_prefix(&k);
        let i = &self.inner;
        // Each object's name and size.
        let mut names: Vec<(String, u64)> = Vec::new();
        let mut dirs: Vec<String> = Vec::new();
        let mut token = None;
        loop {
            let req = i.client.list_objects_v2().bucket(&i.bucket).prefix(&prefix).delimiter("/").set_continuation_token(token);
            let r = i.rt.block_on(req.send()).map_err(|e| io_error(&k, e))?;
            for o in r.contents() {
                // A "directory marker" some tools make: not a file.
                if let Some(name) = o.key().and_then(|x| x.strip_prefix(&prefix)).filter(|n| !n.is_empty() && !n.ends_with('/')) {
                    names.push((name.to_string(), o.size().unwrap_or(0).max(0) as u64));
                }
            }
            for p in r.common_prefixes() {
                if let Some(name) =
                    p.prefix().and_then(|x| x.strip_prefix(&prefix)).map(|n| n.trim_end_matches('/')).filter(|n| !n.is_empty())
                {
                    dirs.push(name.to_string());
                }
            }
            token = r.next_continuation_token().map(str::to_string);
            if token.is_none() {
                break;
            }
        }
        if names.is_empty() && dirs.is_empty() && k != i.root {
            return Err(match i.head(&k) {
                Ok(_) => io::Error::new(io::ErrorKind::NotADirectory, format!("{k}: an object, not a directory")),
                Err(_) => io::Error::new(io::ErrorKind::NotFound, format!("{k}: no object is below this prefix")),
            });
        }
        // Listings carry no metadata: each object's mode and mtime take a HEAD,
        // or the GET of the whole object where it is small and to be read, as
        // far as half the memory bound has room; such objects are kept until
        // they are read.
        let mut room = i.listed.room(i.budget.bound / 2);
        let answers: Vec<io::Result<ListedObject>> = i.rt.block_on(async {
            let tasks: Vec<_> = names
                .iter()
                .map(|&(ref n, size)| {
                    let lease = (0 < size && size <= FETCH_LISTED.min(room)).then(|| i.budget.try_take(size)).flatten();
                    if lease.is_some() {
                        room -= size;
                    }
                    let (client, bucket, key, heads) = (i.client.clone(), i.bucket.clone(), format!("{prefix}{n}"), i.heads.clone());
                    tokio::spawn(async move {
                        let _permit = heads.acquire().await;
                        let Some(held) = lease else {
                            let h = client.head_object().bucket(bucket).key(&key).send().await.map_err(|e| io_error(&key, e))?;
                            let (stat, _, _) = answered(h.content_length().unwrap_or(0) as u64, h.last_modified(), h.metadata(), None);
                            return Ok((stat, None));
                        };
                        let get = client.get_object().bucket(bucket).key(&key).range(format!("bytes=0-{}", size - 1));
                        let r = get.send().await.map_err(|e| io_error(&key, e))?;
                        let (stat, etag, digest) = answered(total_size(&r), r.last_modified(), r.metadata(), r.e_tag());
                        let data = collect(&key, r.body).await?;
                        // An object replaced since it was listed is read later, as a large one is.
                        if stat.size != size {
                            return Ok((stat, None));
                        }
                        if data.len() != size {
                            return Err(io::Error::other(format!("{key}: asked for {size} bytes, got {}", data.len())));
                        }
                        Ok((stat, Some((key, Fetched { stat, etag, digest, data, held }))))
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(tasks.len());
            for t in tasks {
                out.push(t.await.unwrap_or_else(|e| Err(io::Error::other(e.to_string()))));
            }
            out
        });
        let mut fetched = Vec::new();
        let stats: Vec<io::Result<Stat>> = answers
            .into_iter()
            .map(|a| {
                a.map(|(stat, f)| {
                    fetched.extend(f);
                    stat
                })
            })
            .collect();
        i.listed.keep(fetched);
        // An object NAME.rclonelink is the symlink NAME, unless a file has that name.
        let files: std::collections::HashSet<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
        let mut out: Vec<DirEntry> = names
            .iter()
            .zip(stats)
            .filter_map(|((n, _), stat)| match link_name(n) {
                Some(link) if files.contains(link) => None,
                Some(link) => Some(DirEntry { name: OsString::from(link), stat: stat.map(link_stat) }),
                None => Some(DirEntry { name: OsString::from(n), stat }),
            })
            .collect();
        out.extend(dirs.into_iter().map(|n| DirEntry { name: OsString::from(n), stat: Ok(dir_stat()) }));
        Ok(out)
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn ReadFile>> {
        self.open_range(path, 0..u64::MAX)
    }

    fn open_range(&self, path: &Path, range: std::ops::Range<u64>) -> io::Result<Box<dyn ReadFile>> {
        Ok(Box::new(S3Read::open(&self.inner, &self.inner.key(path)?, range)?))
    }

    fn make_dirs(&self, dir: &Path) -> io::Result<()> {
        self.inner.key(dir).map(drop)
    }

    fn make_dir(&self, dir: &Path, _mode: u32) -> io::Result<()> {
        self.inner.key(dir).map(drop)
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        self.create_for(path, path)
    }

    fn create_for(&self, path: &Path, dest: &Path) -> io::Result<Box<dyn WriteFile>> {
        let (k, target) = (self.inner.key(path)?, self.inner.key(dest)?);
        if k == self.inner.root || target == self.inner.root {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not the name of a file"));
        }
        // A file made afresh replaces the upload an earlier run left.
        if let Err(e) = self.inner.abandon(&k) {
            log::warn!("{}: cannot abort the upload an earlier run left: {e}", self.display(path));
        }
        Ok(Box::new(S3Write { inner: self.inner.clone(), key: k, target, up: Mutex::new(Upload::default()) }))
    }

    fn reopen(&self, path: &Path) -> io::Result<Option<Box<dyn WriteFile>>> {
        let k = self.inner.key(path)?;
        let Some((up, target)) = self.inner.resume(&k)? else { return Ok(None) };
        Ok(Some(Box::new(S3Write { inner: self.inner.clone(), key: k, target, up: Mutex::new(up) })))
    }

    fn commit(&self, file: &dyn WriteFile, from: &Path, to: &Path, attrs: Option<&Attrs>) -> io::Result<()> {
        let f = file.as_any().downcast_ref::<S3Write>().ok_or_else(|| io::Error::other("not a file of this object store"))?;
        if self.inner.key(from)? != f.key {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{}: committed as {}", f.key, from.display())));
        }
        f.commit(&self.inner.key(to)?, attrs.cloned())
    }

    fn state_store(&self) -> Option<Store> {
        self.state.clone()
    }

    /// Removes the object, and aborts the upload of a file being written
    /// under that name.
    fn remove(&self, path: &Path) -> io::Result<()> {
        let k = self.inner.key(path)?;
        self.inner.abandon(&k)?;
        self.inner.delete(&k)
    }

    /// Reads the object `NAME.rclonelink` (see [`LINK_SUFFIX`]).
    fn read_link(&self, path: &Path) -> io::Result<Vec<u8>> {
        let (_, link) = self.inner.entry_keys(path)?;
        let r = S3Read::open(&self.inner, &link, 0..MAX_TARGET)?;
        if r.stat.size > MAX_TARGET {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{link}: {} bytes, more than a symlink's target holds ({MAX_TARGET})", r.stat.size),
            ));
        }
        let mut target = vec![0; r.stat.size as usize];
        let mut n = 0;
        while n < target.len() {
            match r.read_at(&mut target[n..], n as u64)? {
                0 => return Err(io::Error::other(format!("{link}: the object ended at {n} of {} bytes", target.len()))),
                k => n += k,
            }
        }
        Ok(target)
    }

    /// Puts the object `NAME.rclonelink` holding `target`, with the mtime
    /// where rclone keeps it and dmover's metadata, then removes a file
    /// `NAME` (which would hide the link). Nothing is followed: a target is
    /// data.
    fn make_link(&self, path: &Path, target: &[u8], attrs: &Attrs) -> io::Result<()> {
        let (k, link) = self.inner.entry_keys(path)?;
        let mtime = attrs.mtime;
        let mut meta = Inner::metadata(&Attrs { mode: 0o777, mtime, owner: attrs.owner, group: attrs.group, ..Default::default() })?;
        // The object is the link's, not a regular file's.
        meta.remove(META_RCLONE_MODE);
        let i = &self.inner;
        let put = i.client.put_object().bucket(&i.bucket).key(&link).body(ByteStream::from(target.to_vec())).set_metadata(Some(meta));
        i.rt.block_on(put.send()).map_err(|e| io_error(&link, e))?;
        i.abandon(&k)?;
        i.delete(&k)
    }

    /// Copies the object `first`, metadata and all, to `path` by the
    /// server (an object store keeps no hard links: each name is an object
    /// of its own, as rclone makes them), then removes a symlink `path`
    /// (`NAME.rclonelink`) that the copy replaces.
    fn hard_link(&self, first: &Path, path: &Path) -> io::Result<()> {
        let (from, _) = self.inner.entry_keys(first)?;
        let (to, link) = self.inner.entry_keys(path)?;
        let i = &self.inner;
        let h = i.rt.block_on(i.client.head_object().bucket(&i.bucket).key(&from).send()).map_err(|e| io_error(&from, e))?;
        let size = h.content_length().unwrap_or(0) as u64;
        i.abandon(&to)?;
        i.rt.block_on(i.copy(&from, &to, size, h.metadata().cloned().unwrap_or_default()))?;
        i.delete(&link)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        let k = self.inner.key(path)?;
        if self.inner.has_below(&k)? {
            return Err(io::Error::new(io::ErrorKind::DirectoryNotEmpty, format!("{k}: objects are below it")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_being_filled_keep_to_their_share_of_memory() {
        let budget = Arc::new(Budget::new(8 * FIRST_PART));
        let held = || {
            let h = budget.held.lock().unwrap();
            (h.bytes / FIRST_PART, h.filling / FIRST_PART, h.sending)
        };
        let (mut a, mut b, mut c) = (budget.lease(), budget.lease(), budget.lease());
        // A quarter of the bound: two first parts fill in memory, not a third.
        assert!(a.grow(FIRST_PART) && b.grow(FIRST_PART));
        assert!(!c.grow(1), "a third part filled in memory");
        assert_eq!(held(), (2, 2, 0));
        // One is sent: the third fills, and the sent one still counts in the bound.
        a.sending();
        assert_eq!(held(), (2, 1, 1));
        assert!(c.grow(FIRST_PART));
        assert_eq!(held(), (3, 2, 1));
        drop((a, b, c));
        assert_eq!(held(), (0, 0, 0));
        // A small bound still fills one first part in memory.
        let small = Arc::new(Budget::new(FIRST_PART));
        assert!(small.lease().grow(FIRST_PART));
    }

    #[test]
    fn parts_tile_an_object_and_grow() {
        assert_eq!((part::start(0), part::len(0)), (0, FIRST_PART));
        // Around each change of size: each part ends where the next begins,
        // and every offset in it is found in it.
        for size in 0..MAX_PARTS / PARTS_PER_SIZE {
            let first = size * PARTS_PER_SIZE;
            for index in (first.saturating_sub(2)..first + 2).chain(first + PARTS_PER_SIZE - 2..first + PARTS_PER_SIZE) {
                let (start, len) = (part::start(index), part::len(index));
                assert_eq!(len, FIRST_PART << (index / PARTS_PER_SIZE), "part {index}");
                assert_eq!(part::start(index + 1), start + len, "part {index}");
                for off in [start, start + 1, start + len / 2, start + len - 1] {
                    assert_eq!(part::at(off), index, "offset {off}");
                }
            }
        }
        assert_eq!(part::max_object(), part::start(MAX_PARTS - 1) + part::len(MAX_PARTS - 1));
        assert_eq!(part::max_object() >> 30, 484);
        assert_eq!((part::at(part::max_object() - 1), part::at(part::max_object())), (MAX_PARTS - 1, MAX_PARTS));
    }

    #[test]
    fn written_ranges_merge_and_cover() {
        let mut up = Ranges::default();
        up.mark(10, 20);
        up.mark(30, 40);
        assert!(up.covered(10, 20) && !up.covered(10, 21) && !up.covered(0, 5));
        up.mark(20, 30); // adjacent on both sides: one range
        assert_eq!(up.0.iter().collect::<Vec<_>>(), [(&10, &40)]);
        up.mark(5, 12); // overlapping the start
        up.mark(35, 50); // overlapping the end
        assert_eq!(up.0.iter().collect::<Vec<_>>(), [(&5, &50)]);
        assert!(up.covered(5, 50) && up.covered(7, 7));
        up.mark(60, 70);
        assert!(!up.covered(40, 65), "a hole between ranges");
    }

    #[test]
    fn a_body_reads_across_its_chunks() {
        let whole: Vec<u8> = (0..100u8).collect();
        let body = Body::of([0..7, 7..7, 7..40, 40..41, 41..100].into_iter().map(|r| Bytes::copy_from_slice(&whole[r])));
        assert_eq!(body.len(), 100);
        for (off, len) in [(0, 100), (0, 7), (5, 10), (39, 3), (40, 60), (99, 5), (100, 4), (3, 0)] {
            let mut buf = vec![0; len];
            let n = body.copy_at(off, &mut buf);
            let want = &whole[(off as usize).min(100)..(off as usize + len).min(100)];
            assert_eq!(&buf[..n], want, "{len} bytes from {off}");
        }
        let part = body.slice(5..45);
        assert_eq!(part.len(), 40);
        let mut buf = vec![0; 40];
        assert_eq!(part.copy_at(0, &mut buf), 40);
        assert_eq!(buf, whole[5..45]);
    }

    #[test]
    fn a_record_survives_a_torn_last_line() {
        let head = Record::head("upid", "d/f g");
        let r = Record::parse(&format!("{head}0 \"e0\"\n3 \"e3\"\n4 \"e"), "d/.f g.part").unwrap();
        let parts = HashMap::from([(0, "\"e0\"".into()), (3, "\"e3\"".into())]);
        assert_eq!(r, Record { id: "upid".into(), target: "d/f g".into(), parts: parts.clone() });
        // An earlier version's record: the upload is under the file's own key.
        let r = Record::parse("upid\n0 \"e0\"\n3 \"e3\"\n", "k").unwrap();
        assert_eq!(r, Record { id: "upid".into(), target: "k".into(), parts });
        assert!(Record::parse("", "k").is_none() && Record::parse("torn", "k").is_none());
        assert!(Record::parse("upid nothex\n", "k").is_none());
    }

    #[test]
    fn keys_stay_below_the_prefix() {
        for (root, path, want) in [
            ("run/1", "x/y", "run/1/x/y"),
            ("run/1", "", "run/1"),
            ("run/1", "./x/", "run/1/x"),
            ("", "x", "x"),
            ("", "", ""),
            ("", "a\\b", "a\\b"),
        ] {
            assert_eq!(key(root, Path::new(path)).unwrap(), want, "{root} {path}");
        }
        for path in ["..", "../x", "x/../../y", "/x", ".//x", "x//y", "x/./y", "x/..", "x\0y"] {
            let e = key("run/1", Path::new(path)).unwrap_err();
            assert!(Refused::is(&e), "{path:?}: {e}");
        }
        use std::os::unix::ffi::OsStrExt;
        let e = key("run/1", Path::new(std::ffi::OsStr::from_bytes(b"bad\xff"))).unwrap_err();
        assert!(Refused::is(&e) && e.to_string().contains("UTF-8"), "{e}");
    }

    #[test]
    fn metadata_round_trips() {
        let sum = [7u8; 16];
        let d = Digest { block_size: 1 << 20, sum };
        let m = Inner::metadata(&Attrs { mode: 0o640, mtime: Some((1_700_000_000, 5)), digest: Some(d), ..Default::default() }).unwrap();
        let st = object_stat(9, None, Some(&m));
        assert_eq!((st.mode, st.mtime, st.size), (0o640, (1_700_000_000, 5), 9));
        assert_eq!(parse_digest(&m[META_DIGEST]), Some(d));
        assert_eq!(copy_source("b", "a dir/é+x"), "b/a%20dir/%C3%A9%2Bx");
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
