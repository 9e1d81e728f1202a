//! The spill file: blocks that did not fit in the ring, on local disk.
//!
//! Each record is a data frame exactly as it would cross the wire — the
//! 8-byte frame header, the 32-byte data header (step, offset in the step,
//! XXH3-128) and the block — so the file can be read back, checked and sent
//! by anything that decodes dmover frames. The file is created on the first
//! spill, named after the producer and the process, and removed at close if
//! every block in it was delivered.

use dmover_proto::digest::Sum;
use dmover_proto::frame::{DataHeader, DATA_HEADER_LEN, HEADER_LEN};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub struct Spill {
    path: PathBuf,
    /// The file and its length; the writer appends, the queue manager reads
    /// blocks back (both briefly, under this lock).
    file: Mutex<Option<(File, u64)>>,
}

impl Spill {
    pub fn new(dir: &Path, producer: &str) -> Spill {
        Spill::at(&dir.join(format!("{producer}.{}{}", std::process::id(), crate::manifest::SPILL_SUFFIX)))
    }

    /// A spill file at `path`, created on the first spill (or never, for a
    /// drain with nothing to read from it).
    pub fn at(path: &Path) -> Spill {
        Spill { path: path.to_path_buf(), file: Mutex::new(None) }
    }

    /// An existing spill file, to send what it holds (`drain`).
    pub fn open(path: &Path) -> io::Result<Spill> {
        let f = OpenOptions::new().read(true).append(true).open(path)?;
        let len = f.metadata()?.len();
        Ok(Spill { path: path.to_path_buf(), file: Mutex::new(Some((f, len))) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one block; returns the file offset of its bytes.
    pub fn append(&self, step: u64, offset: u64, sum: Sum, data: &[u8]) -> io::Result<u64> {
        let mut g = self.file.lock().expect("spill lock");
        if g.is_none() {
            let f = OpenOptions::new().read(true).append(true).create(true).open(&self.path)?;
            let len = f.metadata()?.len();
            *g = Some((f, len));
        }
        let (f, len) = g.as_mut().expect("opened above");
        let head = DataHeader { file: step, offset, sum, len: data.len() as u32, sparse: false }.encode();
        f.write_all(&head)?;
        f.write_all(data)?;
        let at = *len + (HEADER_LEN + DATA_HEADER_LEN) as u64;
        *len = at + data.len() as u64;
        Ok(at)
    }

    /// Reads the block whose bytes start at `at` into `buf` (its length).
    pub fn read(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        let g = self.file.lock().expect("spill lock");
        let (f, _) = g.as_ref().ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "nothing was spilled"))?;
        f.read_exact_at(buf, at)
    }

    /// Removes the file (every block in it was delivered).
    pub fn remove(&self) {
        if self.file.lock().expect("spill lock").take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmover_proto::digest::block_sum;
    use dmover_proto::frame::{decode, Frame};

    #[test]
    fn records_read_back_and_decode_as_data_frames() {
        let dir = tempfile::tempdir().unwrap();
        let s = Spill::new(dir.path(), "p");
        let a = s.append(3, 0, block_sum(b"hello"), b"hello").unwrap();
        let b = s.append(3, 4096, block_sum(b"world!"), b"world!").unwrap();
        let mut buf = [0u8; 6];
        s.read(b, &mut buf).unwrap();
        assert_eq!(&buf, b"world!");
        s.read(a, &mut buf[..5]).unwrap();
        assert_eq!(&buf[..5], b"hello");
        let bytes = std::fs::read(s.path()).unwrap();
        let (f, used) = decode(&bytes).unwrap().unwrap();
        let Frame::Data(h, data) = f else { panic!("not a data frame") };
        assert_eq!((h.file, h.offset, data), (3, 0, &b"hello"[..]));
        assert_eq!(h.sum, block_sum(data));
        assert!(matches!(decode(&bytes[used..]).unwrap().unwrap().0, Frame::Data(h, _) if h.offset == 4096));
        s.remove();
        assert!(!s.path().exists());
    }
}
