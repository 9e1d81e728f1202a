//! A file being written: its parts being filled (in memory within the
//! storage's budget, else in an unnamed file of the state directory), the
//! parts of its multipart upload sent, and its commit, which sends the
//! last part, completes the upload and sets the object's metadata (or
//! puts a file smaller than a part with one request).
//!
//! Uploads are resumable. Each is recorded in a local state directory
//! (`uploads/`): its id, then each part's ETag once the server has taken it.
//! [`Storage::reopen`](crate::storage::Storage::reopen) takes the upload up
//! again with the parts the server lists whose size and ETag match the
//! record, and [`WriteFile::holds`] says which bytes those are. An upload is
//! aborted when its file is given up for good: removed
//! ([`Storage::remove`](crate::storage::Storage::remove), which the engine
//! does to a file that failed or whose source went or changed), or created
//! afresh; a file dropped uncommitted keeps its upload for a later run once a
//! part is sent. The engine keeps its journals in the same state directory
//! (`journals/`, the
//! [`Storage::state_store`](crate::storage::Storage::state_store)): an object
//! store has no file that grows by small writes. Where that directory cannot
//! be made or written, uploads work but are not resumed.

use super::budget::{Budget, Lease};
use super::part::{self, MAX_PARTS};
use super::{io_error, status, unsupported, Inner};
use crate::storage::{Attrs, Kind, ReadFile, Stat, WriteFile};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::Bytes;
use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;

/// A file being written: the parts being filled, and the parts of its
/// multipart upload the server has or is being sent.
pub(super) struct S3Write {
    inner: Arc<Inner>,
    /// The key it was created under.
    key: String,
    /// The key its multipart upload is made under: the key it is to be
    /// committed as, or its own.
    target: String,
    up: Mutex<Upload>,
}

#[derive(Default)]
pub(super) struct Upload {
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

impl S3Write {
    /// The file `key` of the storage `inner`, uploaded under `target`,
    /// with what `up` says of its upload.
    pub(super) fn new(inner: Arc<Inner>, key: String, target: String, up: Upload) -> S3Write {
        S3Write { inner, key, target, up: Mutex::new(up) }
    }

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

    /// Puts the file under key `to` with `attrs`' metadata.
    fn put_as(&self, to: &str, attrs: Option<Attrs>) -> io::Result<()> {
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
    /// ([`Storage::remove`](crate::storage::Storage::remove) aborts it); one with
    /// none is aborted.
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

    fn commit(&self, to: &Path, attrs: Option<&Attrs>) -> io::Result<()> {
        self.put_as(&self.inner.key(to)?, attrs.cloned())
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
    pub(super) fn abandon(&self, k: &str) -> io::Result<()> {
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
    pub(super) fn resume(&self, k: &str) -> io::Result<Option<(Upload, String)>> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
