//! The receive journal: which blocks of a partial file are on disk, and
//! their checksums, so an interrupted transfer resumes where it stopped.
//!
//! One journal per multi-block file, in the destination's state directory,
//! named by a hash of the file's path. A header binds it to the source's
//! size, mtime and the block size; a record (block index, checksum) is
//! appended after each block is written. A torn last record is ignored.
//! Journals are read and written through the destination's [`Storage`],
//! so they are confined like the files they describe: a journal is created
//! afresh, never through a link planted at its name.

use crate::storage::{Storage, WriteFile};
use dmover_proto::digest::Sum;
use dmover_proto::frame::FileMeta;
use std::io;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"DMVJ0001";
const HEADER: usize = 32;
const RECORD: usize = 24;

/// Where the journal for destination path `rel` lives in `state_dir`.
pub fn path_for(state_dir: &Path, rel: &str) -> PathBuf {
    let h = u128::from_be_bytes(dmover_proto::digest::block_sum(rel.as_bytes()));
    state_dir.join(format!("{h:032x}.journal"))
}

fn header(meta: &FileMeta, block_size: u32) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..8].copy_from_slice(MAGIC);
    h[8..16].copy_from_slice(&meta.size.to_be_bytes());
    h[16..24].copy_from_slice(&meta.mtime_s.to_be_bytes());
    h[24..28].copy_from_slice(&meta.mtime_ns.to_be_bytes());
    h[28..32].copy_from_slice(&block_size.to_be_bytes());
    h
}

/// The blocks a journal records, if it exists and belongs to this version
/// of the source file.
pub fn load(store: &dyn Storage, path: &Path, meta: &FileMeta, block_size: u32, blocks: u64) -> Option<Vec<(u64, Sum)>> {
    // Each block is recorded once; a longer journal is not ours.
    let limit = (HEADER as u64).saturating_add((RECORD as u64).saturating_mul(blocks));
    let buf = store.read_all(path, limit).ok()?;
    if buf.len() < HEADER || buf[..HEADER] != header(meta, block_size) {
        return None;
    }
    let recs = buf[HEADER..]
        .chunks_exact(RECORD)
        .map(|r| (u64::from_be_bytes(r[..8].try_into().expect("8")), r[8..].try_into().expect("16")))
        .filter(|(b, _)| *b < blocks)
        .collect();
    Some(recs)
}

/// An open journal being appended to.
pub struct Journal {
    file: Box<dyn WriteFile>,
    /// Where the next record goes.
    end: u64,
}

impl Journal {
    /// Starts a new journal (replacing any old one).
    pub fn create(store: &dyn Storage, path: &Path, meta: &FileMeta, block_size: u32) -> io::Result<Journal> {
        let file = match store.create(path) {
            // Another transfer into the same directory, which ended, took
            // the state directory away while it was empty: make it again.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                store.make_dirs(path.parent().ok_or(e)?)?;
                store.create(path)?
            }
            r => r?,
        };
        file.write_all_at(&header(meta, block_size), 0)?;
        Ok(Journal { file, end: HEADER as u64 })
    }

    /// Continues an existing journal (one this end created).
    pub fn append(store: &dyn Storage, path: &Path) -> io::Result<Journal> {
        let file = store.reopen(path)?.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no journal of ours"))?;
        let end = file.stat()?.size;
        Ok(Journal { file, end })
    }

    /// Records that `block` is on disk with checksum `sum`.
    pub fn record(&mut self, block: u64, sum: &Sum) -> io::Result<()> {
        let mut r = [0u8; RECORD];
        r[..8].copy_from_slice(&block.to_be_bytes());
        r[8..].copy_from_slice(sum);
        self.file.write_all_at(&r, self.end)?;
        self.end += RECORD as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survives_a_torn_record_and_rejects_another_version() {
        let t = tempfile::tempdir().unwrap();
        let store = crate::storage::export("t", t.path()).unwrap();
        let s = store.as_ref();
        let meta = FileMeta { path: "a".into(), size: 10, mtime_s: 1, mtime_ns: 2, mode: 0o644, ..Default::default() };
        let p = path_for(Path::new(""), "a");
        let mut j = Journal::create(s, &p, &meta, 4).unwrap();
        j.record(0, &[1; 16]).unwrap();
        drop(j);
        let mut j = Journal::append(s, &p).unwrap();
        j.record(2, &[3; 16]).unwrap();
        drop(j);
        std::fs::OpenOptions::new()
            .append(true)
            .open(t.path().join(&p))
            .and_then(|mut f| std::io::Write::write_all(&mut f, &[9; 5]))
            .unwrap();
        assert_eq!(load(s, &p, &meta, 4, 3).unwrap(), vec![(0, [1; 16]), (2, [3; 16])]);
        assert!(load(s, &p, &FileMeta { mtime_s: 5, ..meta.clone() }, 4, 3).is_none());
        assert!(load(s, &p, &meta, 8, 3).is_none());
    }

    /// Two transfers into one directory share its state directory, and the
    /// one that ends first removes it if empty: the other makes it again.
    #[test]
    fn a_journal_is_made_even_after_its_state_directory_was_removed() {
        let t = tempfile::tempdir().unwrap();
        let store = crate::storage::export("t", t.path()).unwrap();
        let meta = FileMeta { path: "a".into(), size: 10, mtime_s: 1, mtime_ns: 2, mode: 0o644, ..Default::default() };
        let p = path_for(Path::new("gone"), "a");
        assert!(!t.path().join("gone").exists());
        Journal::create(store.as_ref(), &p, &meta, 4).unwrap();
        assert!(t.path().join(&p).is_file());
    }
}
