//! The [`Storage`] of an S3-compatible object store: one bucket, its keys
//! named like paths (`dir/sub/file`).
//!
//! Objects are written whole and never changed in place, so a file exists
//! only once committed: a file being written is kept in memory until a
//! whole part of it is there, then sent as a part of a multipart upload;
//! commit completes it. A file smaller than a part is sent by one PUT at
//! commit, under its final key; a larger one is completed under the name
//! it was created with and copied to its final key with its metadata (the
//! digest is known only at the end, and S3 sets metadata when an object is
//! made). Nothing is visible under the final key before commit, a file
//! dropped uncommitted leaves nothing behind (its upload is aborted), and
//! nothing can be reopened: resuming starts afresh.
//!
//! Each object carries metadata: dmover's digest of its content (with the
//! block size it was computed with), checked when the object is read back
//! whole, and the source's mode and mtime. Directories are the prefixes of
//! keys: one exists while an object is below it, so an empty directory is
//! not kept and making one does nothing.
//!
//! The AWS SDK does the requests, on an async runtime of this storage's
//! own; the engine's threads wait on it.

use super::{Attrs, Digest, DirEntry, Kind, ReadFile, Stat, Storage, WriteFile};
use crate::error::{Damaged, Error, Refused, Result};
use aws_config::meta::credentials::CredentialsProviderChain;
use aws_config::meta::region::RegionProviderChain;
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::{ByteStream, DateTime};
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use aws_sdk_s3::Client;
use dmover_proto::ErrorKind;
use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio::runtime::Runtime;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// Size of a part of a multipart upload (so the largest object is 10,000 parts).
const PART: u64 = 16 << 20;
/// The most parts S3 takes in one upload.
const MAX_PARTS: u64 = 10_000;
/// Parts being sent at once, per storage (each holds a part in memory).
const PARTS_IN_FLIGHT: usize = 8;
/// Bytes one GET fetches at least: the pieces a block is read in, and the
/// next blocks of a file read in order, come from one request.
const READ_AHEAD: u64 = 4 << 20;
/// HEAD requests at once while listing.
const HEADS_IN_FLIGHT: usize = 32;
/// Part size of a copy made by the server (at most 5 GiB).
const COPY_PART: u64 = 1 << 30;

/// How long connecting to the server may take.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long the server may take to answer a request.
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);
/// Object metadata (`x-amz-meta-*`).
const META_DIGEST: &str = "dmover-digest";
const META_MTIME: &str = "dmover-mtime";
const META_MODE: &str = "dmover-mode";

/// Where and how to reach the store.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The endpoint URL (else `AWS_ENDPOINT_URL` or the profile's
    /// `endpoint_url`, else AWS itself).
    pub endpoint: Option<String>,
}

/// A bucket of an S3-compatible object store.
pub struct S3 {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    bucket: String,
    rt: Runtime,
    parts: Arc<Semaphore>,
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
        let inner = Inner { client, bucket: bucket.to_string(), rt, parts: Arc::new(Semaphore::new(PARTS_IN_FLIGHT)) };
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
            Ok(_) => return Ok(S3 { inner: Arc::new(inner) }),
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

/// The key of `path`: a plain relative path (empty for the bucket's root).
fn key(path: &Path) -> io::Result<String> {
    let p = path.to_str().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "an S3 key must be UTF-8"))?;
    let p = p.trim_start_matches("./").trim_end_matches('/');
    dmover_proto::path::check_relative(p)
        .map_err(|_| Refused::io("an S3 key is a plain relative path, without '.', '..' or empty names"))?;
    Ok(p.to_string())
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
/// mtime as dmover stored them (0644 and the object's time otherwise); the
/// object's time is its change time.
fn object_stat(size: u64, modified: Option<&DateTime>, meta: Option<&HashMap<String, String>>) -> Stat {
    let changed = time_of(modified);
    let get = |k: &str| meta.and_then(|m| m.get(k));
    let mode = get(META_MODE).and_then(|m| u32::from_str_radix(m, 8).ok()).unwrap_or(0o644);
    let mtime = get(META_MTIME).and_then(|m| parse_mtime(m)).unwrap_or(changed);
    Stat { kind: Kind::File, size, mode, mtime, ctime: (changed.0, changed.1 as i64), nlink: 1 }
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
    Stat { kind: Kind::Dir, size: 0, mode: 0o755, mtime: (0, 0), ctime: (0, 0), nlink: 1 }
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
    /// The object at `k`: its attributes, ETag and stored digest.
    fn head(&self, k: &str) -> io::Result<(Stat, Option<String>, Option<Digest>)> {
        let h = self.rt.block_on(self.client.head_object().bucket(&self.bucket).key(k).send()).map_err(|e| io_error(k, e))?;
        let st = object_stat(h.content_length().unwrap_or(0) as u64, h.last_modified(), h.metadata());
        let digest = h.metadata().and_then(|m| m.get(META_DIGEST)).and_then(|d| parse_digest(d));
        Ok((st, h.e_tag().map(str::to_string), digest))
    }

    /// Whether any object is below directory key `k`.
    fn has_below(&self, k: &str) -> io::Result<bool> {
        let r = self.rt.block_on(self.client.list_objects_v2().bucket(&self.bucket).prefix(dir_prefix(k)).max_keys(1).send());
        Ok(r.map_err(|e| io_error(k, e))?.key_count().unwrap_or(0) > 0)
    }

    fn stat(&self, k: &str) -> io::Result<Stat> {
        if k.is_empty() {
            let r = self.rt.block_on(self.client.head_bucket().bucket(&self.bucket).send());
            return r.map(|_| dir_stat()).map_err(|e| io_error(&self.bucket, e));
        }
        match self.head(k) {
            Ok((st, _, _)) => Ok(st),
            Err(e) if e.kind() == io::ErrorKind::NotFound => match self.has_below(k)? {
                true => Ok(dir_stat()),
                false => Err(io::Error::new(io::ErrorKind::NotFound, format!("{k}: no such object"))),
            },
            Err(e) => Err(e),
        }
    }

    fn metadata(attrs: &Attrs) -> HashMap<String, String> {
        let mut m = HashMap::from([(META_MODE.to_string(), format!("{:o}", attrs.mode))]);
        if let Some((s, ns)) = attrs.mtime {
            m.insert(META_MTIME.into(), format!("{s}.{ns:09}"));
        }
        if let Some(d) = attrs.digest {
            m.insert(META_DIGEST.into(), format!("{}:{}", d.block_size, hex::encode(d.sum)));
        }
        m
    }

    /// Copies `from` (of `size` bytes) to `to` with `meta` in place of its
    /// metadata, by the server, in parts (so of any size).
    async fn copy(&self, from: &str, to: &str, size: u64, meta: HashMap<String, String>) -> io::Result<()> {
        let c = &self.client;
        let source = copy_source(&self.bucket, from);
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

/// An object open for reading: ranged GETs of the version seen when opened.
struct S3Read {
    inner: Arc<Inner>,
    key: String,
    stat: Stat,
    etag: Option<String>,
    digest: Option<Digest>,
    /// The bytes the last GET fetched, and the offset of the first.
    window: Mutex<(u64, Vec<u8>)>,
}

impl S3Read {
    /// Fetches `off..end`.
    fn get(&self, off: u64, end: u64) -> io::Result<Vec<u8>> {
        let i = &self.inner;
        let get = i.client.get_object().bucket(&i.bucket).key(&self.key).range(format!("bytes={off}-{}", end - 1));
        let data = i.rt.block_on(async {
            let r = get.set_if_match(self.etag.clone()).send().await.map_err(|e| match status(&e) {
                Some(412) => io::Error::other(format!("{}: the object was replaced while it was read", self.key)),
                _ => io_error(&self.key, e),
            })?;
            let body = r.body.collect().await;
            body.map(|b| b.to_vec()).map_err(|e| {
                if std::error::Error::source(&e).is_some_and(|s| s.is::<aws_smithy_checksums::body::validate::Error>()) {
                    let msg = format!(
                        "{}: what was read differs from the checksum the server keeps for the object ({})",
                        self.key,
                        DisplayErrorContext(&e)
                    );
                    return io::Error::other(Damaged(msg));
                }
                io::Error::new(io::ErrorKind::ConnectionReset, format!("{}: {}", self.key, DisplayErrorContext(&e)))
            })
        })?;
        if data.len() as u64 != end - off {
            return Err(io::Error::other(format!("{}: asked for {} bytes, got {}", self.key, end - off, data.len())));
        }
        Ok(data)
    }
}

impl ReadFile for S3Read {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        if off >= self.stat.size || buf.is_empty() {
            return Ok(0);
        }
        let mut w = self.window.lock().expect("read window lock");
        if !(w.0..w.0 + w.1.len() as u64).contains(&off) {
            let end = (off + READ_AHEAD.max(buf.len() as u64)).min(self.stat.size);
            *w = (off, self.get(off, end)?);
        }
        let start = (off - w.0) as usize;
        let n = buf.len().min(w.1.len() - start);
        buf[..n].copy_from_slice(&w.1[start..start + n]);
        Ok(n)
    }

    fn stat(&self) -> io::Result<Stat> {
        Ok(self.stat)
    }

    fn digest(&self) -> Option<Digest> {
        self.digest
    }
}

/// A file being written: what is not yet sent, and the parts sent.
struct S3Write {
    inner: Arc<Inner>,
    /// The key it was created under.
    key: String,
    up: Mutex<Upload>,
}

#[derive(Default)]
struct Upload {
    /// Bytes from `base` on, not yet sent; `written` says which are there.
    buf: Vec<u8>,
    /// Ranges written in `buf` (start to end, absolute offsets, merged).
    written: BTreeMap<u64, u64>,
    /// Offset of `buf`'s first byte: the parts before it are sent.
    base: u64,
    /// The file's size: the end of the furthest write.
    size: u64,
    /// The multipart upload, once the first part is sent.
    id: Option<String>,
    /// The parts being sent, in order.
    parts: Vec<JoinHandle<io::Result<CompletedPart>>>,
    attrs: Option<Attrs>,
    /// Committed or given up: nothing to abort when dropped.
    done: bool,
}

impl Upload {
    /// Whether every byte of `start..end` is written.
    fn covered(&self, start: u64, end: u64) -> bool {
        start >= end || self.written.range(..=start).next_back().is_some_and(|(_, e)| *e >= end)
    }

    fn mark(&mut self, start: u64, end: u64) {
        let (mut s, mut e) = (start, end);
        let overlapping: Vec<u64> = self.written.range(..=end).filter(|(_, e2)| **e2 >= start).map(|(s2, _)| *s2).collect();
        for s2 in overlapping {
            let e2 = self.written.remove(&s2).expect("listed");
            s = s.min(s2);
            e = e.max(e2);
        }
        self.written.insert(s, e);
    }
}

impl S3Write {
    /// Sends the part that starts at `up.base` (taking it out of the buffer).
    fn send_part(&self, up: &mut Upload, len: u64) -> io::Result<()> {
        let i = &self.inner;
        let number = up.base / PART + 1;
        if number > MAX_PARTS {
            return Err(io::Error::new(
                io::ErrorKind::FileTooLarge,
                format!("objects larger than {} GiB are not supported", (MAX_PARTS * PART) >> 30),
            ));
        }
        if up.id.is_none() {
            let r =
                i.rt.block_on(i.client.create_multipart_upload().bucket(&i.bucket).key(&self.key).send())
                    .map_err(|e| io_error(&self.key, e))?;
            up.id = Some(r.upload_id().unwrap_or_default().to_string());
        }
        let rest = up.buf.split_off(len as usize);
        let data = std::mem::replace(&mut up.buf, rest);
        up.base += len;
        let permit = i.rt.block_on(i.parts.clone().acquire_owned()).map_err(|_| io::Error::other("the S3 client stopped"))?;
        let req =
            i.client.upload_part().bucket(&i.bucket).key(&self.key).upload_id(up.id.clone().unwrap_or_default()).part_number(number as i32);
        let key = self.key.clone();
        up.parts.push(i.rt.spawn(async move {
            let r = req.body(ByteStream::from(data)).send().await.map_err(|e| io_error(&key, e));
            drop(permit);
            Ok(CompletedPart::builder().part_number(number as i32).e_tag(r?.e_tag().unwrap_or_default()).build())
        }));
        Ok(())
    }

    fn abort(&self, up: &mut Upload) {
        up.done = true;
        if let Some(id) = up.id.take() {
            let i = &self.inner;
            for p in up.parts.drain(..) {
                p.abort();
            }
            let _ = i.rt.block_on(i.client.abort_multipart_upload().bucket(&i.bucket).key(&self.key).upload_id(id).send());
        }
    }

    /// Puts the file under `to` with `attrs`' metadata.
    fn commit(&self, to: &str, attrs: Option<Attrs>) -> io::Result<()> {
        let mut up = self.up.lock().expect("upload lock");
        if up.done {
            return Err(io::Error::other(format!("{}: already committed", self.key)));
        }
        if !up.covered(up.base, up.size) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{}: the file has parts never written", self.key)));
        }
        let attrs = attrs.or(up.attrs).unwrap_or(Attrs { mode: 0o600, mtime: None, digest: None });
        let meta = Inner::metadata(&attrs);
        let i = self.inner.clone();
        let r = if up.id.is_none() {
            let data = std::mem::take(&mut up.buf);
            let put = i.client.put_object().bucket(&i.bucket).key(to).body(ByteStream::from(data)).set_metadata(Some(meta));
            i.rt.block_on(put.send()).map(|_| ()).map_err(|e| io_error(to, e))
        } else {
            // The rest is the last part (none when the parts sent hold it all).
            let len = up.buf.len() as u64;
            let last = if len > 0 { self.send_part(&mut up, len) } else { Ok(()) };
            last.and_then(|()| {
                let id = up.id.clone().unwrap_or_default();
                let parts = std::mem::take(&mut up.parts);
                let size = up.size;
                i.rt.block_on(async {
                    let mut done = Vec::with_capacity(parts.len());
                    for p in parts {
                        done.push(p.await.map_err(|e| io::Error::other(format!("{}: sending a part failed: {e}", self.key)))??);
                    }
                    let all = CompletedMultipartUpload::builder().set_parts(Some(done)).build();
                    let c = i.client.complete_multipart_upload().bucket(&i.bucket).key(&self.key).upload_id(id).multipart_upload(all);
                    c.send().await.map_err(|e| io_error(&self.key, e))?;
                    // Onto its own key, the copy only sets the metadata.
                    let copied = i.copy(&self.key, to, size, meta).await;
                    if to == self.key && copied.is_ok() {
                        return Ok(());
                    }
                    // The object under its first key goes, and so does one
                    // left without its metadata when the copy failed.
                    let deleted = i.client.delete_object().bucket(&i.bucket).key(&self.key).send().await;
                    copied.and(deleted.map(drop).map_err(|e| io_error(&self.key, e)))
                })
            })
        };
        match r {
            Ok(()) => {
                up.done = true;
                up.id = None;
                Ok(())
            }
            Err(e) => {
                self.abort(&mut up);
                Err(e)
            }
        }
    }
}

impl Drop for S3Write {
    fn drop(&mut self) {
        let mut up = self.up.lock().unwrap_or_else(|e| e.into_inner());
        if !up.done {
            self.abort(&mut up);
        }
    }
}

impl ReadFile for S3Write {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        let up = self.up.lock().expect("upload lock");
        if off >= up.size || buf.is_empty() {
            return Ok(0);
        }
        if off < up.base {
            return Err(unsupported("read back the parts of an object it has sent before the object is complete"));
        }
        let start = (off - up.base) as usize;
        let n = buf.len().min((up.size - off) as usize);
        let have = up.buf.len().saturating_sub(start).min(n);
        buf[..have].copy_from_slice(&up.buf[start..start + have]);
        buf[have..n].fill(0);
        Ok(n)
    }

    fn stat(&self) -> io::Result<Stat> {
        let up = self.up.lock().expect("upload lock");
        let a = up.attrs;
        Ok(Stat {
            kind: Kind::File,
            size: up.size,
            mode: a.map_or(0o600, |a| a.mode),
            mtime: a.and_then(|a| a.mtime).unwrap_or((0, 0)),
            ctime: (0, 0),
            nlink: 1,
        })
    }
}

impl WriteFile for S3Write {
    fn write_all_at(&self, data: &[u8], off: u64) -> io::Result<()> {
        let mut up = self.up.lock().expect("upload lock");
        if up.done {
            return Err(io::Error::other(format!("{}: already committed", self.key)));
        }
        if off < up.base {
            return Err(unsupported("rewrite a part it has sent"));
        }
        let end = off + data.len() as u64;
        let (start, stop) = ((off - up.base) as usize, (end - up.base) as usize);
        if up.buf.len() < stop {
            up.buf.resize(stop, 0);
        }
        up.buf[start..stop].copy_from_slice(data);
        up.mark(off, end);
        up.size = up.size.max(end);
        while up.buf.len() as u64 >= PART && up.covered(up.base, up.base + PART) {
            self.send_part(&mut up, PART)?;
        }
        Ok(())
    }

    fn set_len(&self, _len: u64) -> io::Result<()> {
        Err(unsupported("change the length of an object"))
    }

    fn set_attrs(&self, attrs: &Attrs) -> io::Result<()> {
        self.up.lock().expect("upload lock").attrs = Some(*attrs);
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Storage for S3 {
    fn is_confined(&self) -> bool {
        true
    }

    fn display(&self, path: &Path) -> String {
        let p = path.to_string_lossy();
        dmover_proto::path::join(&format!("s3://{}", self.inner.bucket), p.trim_start_matches("./"))
    }

    fn stat(&self, path: &Path) -> io::Result<Stat> {
        self.inner.stat(&key(path)?)
    }

    fn stat_followed(&self, path: &Path) -> io::Result<Stat> {
        self.stat(path)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        let k = key(dir)?;
        let prefix = dir_prefix(&k);
        let i = &self.inner;
        let mut names: Vec<String> = Vec::new();
        let mut dirs: Vec<String> = Vec::new();
        let mut token = None;
        loop {
            let req = i.client.list_objects_v2().bucket(&i.bucket).prefix(&prefix).delimiter("/").set_continuation_token(token);
            let r = i.rt.block_on(req.send()).map_err(|e| io_error(&k, e))?;
            for o in r.contents() {
                // A "directory marker" some tools make: not a file.
                if let Some(name) = o.key().and_then(|x| x.strip_prefix(&prefix)).filter(|n| !n.is_empty() && !n.ends_with('/')) {
                    names.push(name.to_string());
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
        if names.is_empty() && dirs.is_empty() && !k.is_empty() {
            return Err(match i.head(&k) {
                Ok(_) => io::Error::new(io::ErrorKind::NotADirectory, format!("{k}: an object, not a directory")),
                Err(_) => io::Error::new(io::ErrorKind::NotFound, format!("{k}: no object is below this prefix")),
            });
        }
        // Listings carry no metadata: each object's mode and mtime take a HEAD.
        let heads = Arc::new(Semaphore::new(HEADS_IN_FLIGHT));
        let stats: Vec<io::Result<Stat>> = i.rt.block_on(async {
            let tasks: Vec<_> = names
                .iter()
                .map(|n| {
                    let (client, bucket, key, heads) = (i.client.clone(), i.bucket.clone(), format!("{prefix}{n}"), heads.clone());
                    tokio::spawn(async move {
                        let _permit = heads.acquire().await;
                        let h = client.head_object().bucket(bucket).key(&key).send().await.map_err(|e| io_error(&key, e))?;
                        Ok(object_stat(h.content_length().unwrap_or(0) as u64, h.last_modified(), h.metadata()))
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(tasks.len());
            for t in tasks {
                out.push(t.await.unwrap_or_else(|e| Err(io::Error::other(e.to_string()))));
            }
            out
        });
        let mut out: Vec<DirEntry> = names.into_iter().zip(stats).map(|(n, stat)| DirEntry { name: OsString::from(n), stat }).collect();
        out.extend(dirs.into_iter().map(|n| DirEntry { name: OsString::from(n), stat: Ok(dir_stat()) }));
        Ok(out)
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn ReadFile>> {
        let k = key(path)?;
        let (stat, etag, digest) = self.inner.head(&k)?;
        Ok(Box::new(S3Read { inner: self.inner.clone(), key: k, stat, etag, digest, window: Mutex::new((0, Vec::new())) }))
    }

    fn make_dirs(&self, dir: &Path) -> io::Result<()> {
        key(dir).map(drop)
    }

    fn make_dir(&self, dir: &Path, _mode: u32) -> io::Result<()> {
        key(dir).map(drop)
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let k = key(path)?;
        if k.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not the name of a file"));
        }
        Ok(Box::new(S3Write { inner: self.inner.clone(), key: k, up: Mutex::new(Upload::default()) }))
    }

    fn reopen(&self, path: &Path) -> io::Result<Option<Box<dyn WriteFile>>> {
        key(path).map(|_| None)
    }

    fn commit(&self, file: &dyn WriteFile, from: &Path, to: &Path, attrs: Option<&Attrs>) -> io::Result<()> {
        let f = file.as_any().downcast_ref::<S3Write>().ok_or_else(|| io::Error::other("not a file of this object store"))?;
        if key(from)? != f.key {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{}: committed as {}", f.key, from.display())));
        }
        f.commit(&key(to)?, attrs.copied())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        self.inner.delete(&key(path)?)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        let k = key(path)?;
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
    fn written_ranges_merge_and_cover() {
        let mut up = Upload::default();
        up.mark(10, 20);
        up.mark(30, 40);
        assert!(up.covered(10, 20) && !up.covered(10, 21) && !up.covered(0, 5));
        up.mark(20, 30); // adjacent on both sides: one range
        assert_eq!(up.written.iter().collect::<Vec<_>>(), [(&10, &40)]);
        up.mark(5, 12); // overlapping the start
        up.mark(35, 50); // overlapping the end
        assert_eq!(up.written.iter().collect::<Vec<_>>(), [(&5, &50)]);
        assert!(up.covered(5, 50) && up.covered(7, 7));
        up.mark(60, 70);
        assert!(!up.covered(40, 65), "a hole between ranges");
    }

    #[test]
    fn metadata_round_trips() {
        let sum = [7u8; 16];
        let d = Digest { block_size: 1 << 20, sum };
        let m = Inner::metadata(&Attrs { mode: 0o640, mtime: Some((1_700_000_000, 5)), digest: Some(d) });
        let st = object_stat(9, None, Some(&m));
        assert_eq!((st.mode, st.mtime, st.size), (0o640, (1_700_000_000, 5), 9));
        assert_eq!(parse_digest(&m[META_DIGEST]), Some(d));
        assert_eq!(copy_source("b", "a dir/é+x"), "b/a%20dir/%C3%A9%2Bx");
    }
}
