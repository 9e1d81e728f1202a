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
//! Directories are the prefixes of keys: one exists while an object is
//! below it, so an empty directory is not kept and making one does nothing.
//!
//! This module holds the store: its options, its client and runtime, and
//! the [`Storage`] operations. The rest is by role: `write` (a file being
//! written, as a multipart upload, and the local records by which a later
//! run takes an upload up again), `part` (how an object is cut into the
//! parts of its upload), `read` (ranged GETs streamed to the reader),
//! `list` (listings, and the small objects they fetch whole), `budget`
//! (the memory the parts and reads share) and `metadata` (what an
//! object's metadata keeps, and symlinks as rclone keeps them).
//!
//! The AWS SDK does the requests, on an async runtime of this storage's
//! own; the engine's threads wait on it.

mod budget;
mod list;
mod metadata;
mod part;
mod read;
mod write;

use crate::error::{Error, Refused, Result};
use crate::storage::{Attrs, Digest, DirEntry, Features, Keeps, ReadFile, Stat, Storage, Store, WriteFile, Xattr};
use aws_config::meta::credentials::CredentialsProviderChain;
use aws_config::meta::region::RegionProviderChain;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart, MetadataDirective};
use aws_sdk_s3::Client;
use dmover_proto::ErrorKind;
use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::runtime::Runtime;
use tokio::sync::Semaphore;

use budget::{Budget, MAX_PARTS_IN_FLIGHT};
use list::{Listed, HEADS_IN_FLIGHT};
use metadata::{answered, dir_stat, link_stat, object_stat, LINK_SUFFIX, MAX_TARGET, META_RCLONE_MODE};
use part::FIRST_PART;
use read::S3Read;
use write::{S3Write, Upload};

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
                // The SDK's own account names each provider it tried, in its debug form: for the log.
                log::debug!("{label}: no credentials: {}", causes(&e));
                let msg = "no S3 credentials found (none in the environment, none in ~/.aws/credentials or ~/.aws/config)";
                return Err(Error::new(ErrorKind::Usage, &label, msg)
                    .advised("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or name a profile of ~/.aws/credentials with AWS_PROFILE"));
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
        None => causes(&e),
    };
    io::Error::new(kind, format!("{what}: {msg}"))
}

/// An error and its causes as people read them, `outer: inner: …`, each
/// in its own words (`Display`), a cause that only repeats its parent's
/// words left out: the SDK's own rendering ends in its debug form.
pub(super) fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(c) = next {
        let text = c.to_string();
        if !text.is_empty() && !out.contains(&text) {
            out = format!("{out}: {text}");
        }
        next = c.source();
    }
    out
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
        self.inner.list(dir)
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

    /// A directory that was empty at the source is kept as a directory
    /// marker, an empty object `KEY/` (as rclone's `--s3-directory-markers`
    /// and the AWS console make them), which a listing shows as an empty
    /// directory. Any other directory is the prefix of its objects' keys.
    fn make_dir(&self, dir: &Path, _mode: u32) -> io::Result<()> {
        let k = self.inner.key(dir)?;
        if k == self.inner.root {
            return Ok(());
        }
        let marker = dir_prefix(&k);
        let i = &self.inner;
        i.rt.block_on(i.client.put_object().bucket(&i.bucket).key(&marker).body(ByteStream::from_static(b"")).send())
            .map_err(|e| io_error(&marker, e))?;
        Ok(())
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
        Ok(Box::new(S3Write::new(self.inner.clone(), k, target, Upload::default())))
    }

    fn reopen(&self, path: &Path) -> io::Result<Option<Box<dyn WriteFile>>> {
        let k = self.inner.key(path)?;
        let Some((up, target)) = self.inner.resume(&k)? else { return Ok(None) };
        Ok(Some(Box::new(S3Write::new(self.inner.clone(), k, target, up))))
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
        assert_eq!(copy_source("b", "a dir/é+x"), "b/a%20dir/%C3%A9%2Bx");
    }
}
