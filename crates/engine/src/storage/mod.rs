//! Storage: everything the engine does with files, behind one interface.
//!
//! A [`Storage`] is a tree of files and directories named by paths relative
//! to its root: walk and list, stat, open for reading, create a file afresh
//! or take up one this end created earlier, write at offsets, commit it
//! through its handle (mode and times, then rename into place), remove.
//! The engine's sender reads through it, its receiver, journal and state
//! directory write through it, and the stream sink keeps its steps in one.
//!
//! [`posix`] is the file-system implementation. An export is *confined*:
//! every path is resolved beneath the export's directory handle and no
//! symlink is followed on the way, by the kernel at the moment of use, so
//! a directory swapped for a symlink cannot lead out. The client's own file
//! system is *local*: paths are used as the user gave them; a receiver
//! writes there confined beneath the destination the user named
//! ([`Storage::beneath`]), so that a symlink planted below it is not
//! written through.
//!
//! [`s3`] (with the `s3` feature) keeps files as the objects of an S3
//! bucket, or those below a key prefix in it (an export of a bucket is
//! confined to its prefix): a file exists once committed, and directories
//! are key prefixes.
//!
//! What a storage does not do: decide what to send or ask for, verify
//! digests, or journal partial files; those belong to the engine (which
//! keeps its journals in the storage, or in the local one a storage names
//! with [`Storage::state_store`]).
//! The tests in `dmover-testkit`'s conformance suite say what every
//! implementation must do.

pub mod posix;
#[cfg(feature = "s3")]
pub mod s3;

use crate::error::{Error, Result};
use crate::wire::PIECE;
use dmover_proto::digest::{block_sum, file_digest, zeros_sum, BlockHasher, Sum};
pub use dmover_proto::frame::Xattr;
use dmover_proto::path::printable;
use dmover_proto::ErrorKind;
use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Suffix of a file being received; never sent.
pub const PART_SUFFIX: &str = ".dmover-part";
/// Directory of resume state in a destination; never sent.
pub const STATE_DIR: &str = ".dmover-partial";

/// The name a file (or symlink) named `name` is received under until it
/// is complete: `.NAME.dmover-part`, or, where that would pass the 255
/// bytes a name may have, the name cut short with a hash of the whole of
/// it, so that a name of any length that fits has a temporary one that
/// fits too, the same on every run (a resumed run finds it).
pub fn part_name(name: &std::ffi::OsStr) -> std::ffi::OsString {
    const NAME_MAX: usize = 255;
    let name = name.as_bytes();
    let mut part = Vec::with_capacity(NAME_MAX);
    part.push(b'.');
    if 1 + name.len() + PART_SUFFIX.len() <= NAME_MAX {
        part.extend_from_slice(name);
    } else {
        let hash = format!("~{:016x}", u64::from_le_bytes(block_sum(name)[..8].try_into().expect("8 bytes")));
        part.extend_from_slice(&name[..NAME_MAX - 1 - hash.len() - PART_SUFFIX.len()]);
        part.extend_from_slice(hash.as_bytes());
    }
    part.extend_from_slice(PART_SUFFIX.as_bytes());
    std::ffi::OsString::from_vec(part)
}

/// A storage shared by the threads of a transfer.
pub type Store = Arc<dyn Storage>;

/// What kind of thing a path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    /// A device, socket or FIFO, with its type bits (as in `st_mode`): never
    /// read or written, only made ([`Storage::make_node`]).
    Special(u32),
}

/// The modification time of what a storage keeps no time for: a directory
/// an object store implies (a key prefix).
pub const NO_TIME: (i64, u32) = (0, 0);

/// What a storage can do beyond the operations every one has, asked once
/// when a transfer starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// Paths are confined beneath the root (an export).
    pub confined: bool,
    /// How many directories a walk may list at once, from as many
    /// threads: 1 where a listing is quick (a local directory), more where
    /// each takes requests to a server (an object store's listing, and the
    /// fetches of the small objects in it), so that the next directories
    /// are listed while one is sent.
    pub lists_at_once: usize,
    /// How many files may be committed ([`WriteFile::commit`]) at once, from
    /// as many threads: 1 where a commit is quick (a rename), more where
    /// each is a request to a server (an object store's PUT), so that many
    /// small files cost a few round trips, not one each. A storage that says
    /// more than one makes each commit durable by itself, with no name to
    /// sync after it: the engine then commits each file as soon as it is
    /// verified, that many at a time, instead of in batches.
    pub commits_at_once: usize,
    /// What it keeps of a file besides its content, mode and times.
    pub keeps: Keeps,
}

bitflags::bitflags! {
    /// What of a file's metadata a storage keeps (besides content, mode
    /// and modification time, which every one keeps).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Keeps: u32 {
        /// Symlinks ([`Storage::read_link`], [`Storage::make_link`]).
        const SYMLINKS = 1;
        /// Owners and groups ([`Stat::owner`], [`Attrs::owner`]).
        const OWNERS = 2;
        /// Extended attributes, POSIX ACLs among them ([`Storage::xattrs`],
        /// [`Attrs::xattrs`]).
        const XATTRS = 4;
        /// Devices, FIFOs and sockets ([`Storage::make_node`]).
        const SPECIALS = 8;
        /// POSIX ACLs (as their extended attributes).
        const ACLS = 16;
        /// Owners are recorded, not enforced: any may be given by anyone
        /// (an object store's metadata), where a file system lets root only.
        const ANY_OWNER = 32;
    }
}

/// A file's attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub kind: Kind,
    pub size: u64,
    /// Permission bits, setuid, setgid and sticky included (no file type).
    pub mode: u32,
    /// Modification time: seconds and nanoseconds since the epoch.
    pub mtime: (i64, u32),
    /// Inode change time. Every write, chmod or utime moves it and no one
    /// can set it back, so it reveals a change that restores the mtime.
    pub ctime: (i64, i64),
    /// Names the file has (hard links).
    pub nlink: u64,
    /// User and group ids, where the storage keeps owners.
    pub owner: Option<(u32, u32)>,
    /// A device's number (`st_rdev`); 0 for anything else.
    pub rdev: u64,
    /// Device and inode number: names with the same are one file. None
    /// where the storage has no inodes (an object store).
    pub inode: Option<(u64, u64)>,
}

impl Stat {
    pub fn is_file(&self) -> bool {
        self.kind == Kind::File
    }

    pub fn is_dir(&self) -> bool {
        self.kind == Kind::Dir
    }
}

/// The names of the extended attributes that hold POSIX ACLs.
pub const ACL_XATTRS: [&[u8]; 2] = [b"system.posix_acl_access", b"system.posix_acl_default"];

/// What [`WriteFile::commit`] sets on a file before it takes its final name
/// (and [`Storage::set_dir_attrs`] on a directory): owner and group first,
/// then extended attributes, mode and modification time, in that order (a
/// change of owner clears setuid bits; an ACL sets the group's mode bits).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Attrs {
    pub mode: u32,
    /// Modification time to set (seconds, nanoseconds); None leaves it.
    pub mtime: Option<(i64, u32)>,
    /// The verified digest of the content, for a storage that keeps it
    /// with the file (an object store, as metadata); others ignore it.
    pub digest: Option<Digest>,
    /// User id to give it (a storage that keeps owners); None leaves it.
    pub owner: Option<u32>,
    /// Group id to give it; None leaves it.
    pub group: Option<u32>,
    /// Extended attributes to set (a storage that keeps them).
    pub xattrs: Vec<Xattr>,
}

/// A file's digest as dmover computes it: from the checksums of its
/// blocks of `block_size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Digest {
    pub block_size: u64,
    pub sum: Sum,
}

/// One entry of a directory listing.
#[derive(Debug)]
pub struct DirEntry {
    pub name: OsString,
    /// Its attributes (of the entry itself: a symlink is reported as one),
    /// or why they could not be read.
    pub stat: io::Result<Stat>,
}

/// A file open for reading.
pub trait ReadFile: Send + Sync {
    /// Reads at `off`; returns 0 at the end of the file.
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize>;
    /// The open file's attributes now.
    fn stat(&self) -> io::Result<Stat>;
    /// The digest the storage keeps with the file, if any (written with
    /// [`Attrs::digest`]): a reader of the whole file checks it.
    fn digest(&self) -> Option<Digest> {
        None
    }
    /// Where data lies from `off` on: the first run of bytes at or after
    /// `off` that may hold data, from its start to the hole after it (or
    /// the end of the file); None if only a hole lies from `off` to the
    /// end. Bytes in no run read as zeros, unread. A storage that keeps no
    /// holes says that everything is data (the default).
    fn data_from(&self, off: u64) -> io::Result<Option<std::ops::Range<u64>>> {
        Ok(Some(off..u64::MAX))
    }
}

/// A file open for writing (and reading back what was written).
pub trait WriteFile: ReadFile {
    fn write_all_at(&self, buf: &[u8], off: u64) -> io::Result<()>;
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Makes the bytes `off..off + len` read as zeros, storing as little
    /// as the storage can (a hole, in a file system), and the file at
    /// least `off + len` bytes long; nothing may write past `off + len`
    /// meanwhile (a file system's file is made longer by setting its
    /// length). `fresh`: nothing was ever written there (the file was
    /// created by this run), so a file system has a hole there already.
    /// The default writes the zeros.
    fn write_zeros(&self, off: u64, len: u64, fresh: bool) -> io::Result<()> {
        let _ = fresh;
        write_zero_bytes(self, off, len)
    }
    fn set_attrs(&self, attrs: &Attrs) -> io::Result<()>;
    /// Starts writing `len` bytes from `off` to stable storage without
    /// waiting, so that a later [`sync`](WriteFile::sync) finds little left
    /// to do.
    fn write_back(&self, _off: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    /// Makes the file's data and attributes durable (its name is the
    /// directory's: [`Storage::sync_dir`]). A storage whose commit is
    /// durable by itself has nothing to do.
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
    /// Whether the bytes `off..off + len`, written before this file was
    /// taken up again with [`Storage::reopen`], are still held. A storage
    /// that keeps a file's data only in whole parts sent (an object store's
    /// multipart upload) holds those parts and nothing else; others hold
    /// everything written.
    fn holds(&self, _off: u64, _len: u64) -> bool {
        true
    }
    /// Sets `attrs` on the file (where given) and gives it its final name
    /// `to`, in the storage that created or reopened it: a file system's
    /// is renamed from the name it was opened under, an object store's is
    /// made under `to` (a file exists there only once committed). The
    /// file handle carries what its own storage needs for this, so no
    /// storage has to look into another's handle.
    fn commit(&self, to: &Path, attrs: Option<&Attrs>) -> io::Result<()>;
}

/// A tree of files under a root. Paths are relative to the root (a local
/// storage also takes absolute paths); the empty path is the root itself.
/// Nothing here follows a symlink inside a confined storage.
pub trait Storage: Send + Sync + std::fmt::Debug {
    /// What it can do beyond the operations every storage has.
    fn features(&self) -> Features;
    /// How to name `path` in messages: `EXPORT/path`, or the local path.
    fn display(&self, path: &Path) -> String;
    /// The attributes of `path` itself (a symlink is reported as one).
    fn stat(&self, path: &Path) -> io::Result<Stat>;
    /// As [`stat`](Storage::stat), but a local storage follows a symlink at
    /// `path` (one the user named, as cp and rsync follow).
    fn stat_followed(&self, path: &Path) -> io::Result<Stat>;
    /// The entries of directory `dir`, in no particular order.
    fn list(&self, dir: &Path) -> io::Result<Vec<DirEntry>>;
    /// Whether directory `dir` holds nothing, or is not there (dmover's
    /// resume state, [`STATE_DIR`], aside where it is kept in the same
    /// storage): answered without listing it whole (one request to an
    /// object store).
    fn is_empty_dir(&self, dir: &Path) -> io::Result<bool>;
    /// The extended attributes of `path` itself (a symlink's own), POSIX
    /// ACLs among them, never following a symlink: a storage that keeps
    /// them ([`Keeps::XATTRS`]).
    fn xattrs(&self, _path: &Path) -> io::Result<Vec<Xattr>> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "this storage keeps no extended attributes"))
    }
    /// Opens a file for reading.
    fn open(&self, path: &Path) -> io::Result<Box<dyn ReadFile>>;
    /// Opens a file to read `range` of it: a storage that fetches ahead
    /// (an object store) starts at its start and fetches nothing past its
    /// end (reads outside it still work).
    fn open_range(&self, path: &Path, _range: std::ops::Range<u64>) -> io::Result<Box<dyn ReadFile>> {
        self.open(path)
    }
    /// Makes `dir` and its missing parents exist as directories.
    fn make_dirs(&self, dir: &Path) -> io::Result<()>;
    /// Makes `dir` exist as a directory (its parent must exist) with `mode`.
    fn make_dir(&self, dir: &Path, mode: u32) -> io::Result<()>;
    /// Gives the directory `dir` its attributes (as [`Attrs`] says, but a
    /// digest), never through a symlink (a storage without directories has
    /// nothing to do).
    fn set_dir_attrs(&self, _dir: &Path, _attrs: &Attrs) -> io::Result<()> {
        Ok(())
    }
    /// Creates the file `path` afresh, readable and writable by its owner
    /// only: whatever had that name (a stale file, or a link planted to
    /// make us write elsewhere) is unlinked first, and the new file is
    /// created exclusively, so its inode is ours.
    fn create(&self, path: &Path) -> io::Result<Box<dyn WriteFile>>;
    /// Creates `path` as [`create`](Storage::create) does, to be committed
    /// as `dest`. A storage whose files appear only when committed (an
    /// object store, whose multipart upload is invisible until complete)
    /// may write it where it will end up, so that commit moves nothing;
    /// `dest` is untouched until then, and removing `path` gives the file up.
    fn create_for(&self, path: &Path, dest: &Path) -> io::Result<Box<dyn WriteFile>> {
        let _ = dest;
        self.create(path)
    }
    /// Creates the empty file `path` under its final name, with `attrs`'s
    /// mode and mtime, if nothing has that name: an empty file holds no
    /// data to be caught half-written, so it needs no temporary name and
    /// no rename. None if something has the name (a file to replace, or a
    /// link planted there: it is then replaced through a temporary name,
    /// as any file is), or if the storage makes a file only by committing
    /// it (an object store). Never follows a symlink.
    fn create_empty(&self, _path: &Path, _attrs: &Attrs) -> io::Result<Option<Box<dyn WriteFile>>> {
        Ok(None)
    }
    /// Opens for writing a file this end created earlier with
    /// [`create`](Storage::create): None if there is none, or if what is
    /// there is not a regular file with one name (never written through).
    fn reopen(&self, path: &Path) -> io::Result<Option<Box<dyn WriteFile>>>;
    /// Makes the names in directory `dir` durable: files renamed into it,
    /// directories made in it. A storage with no directories has nothing
    /// to do.
    fn sync_dir(&self, _dir: &Path) -> io::Result<()> {
        Ok(())
    }
    /// Makes everything written to the file systems that hold `dirs`
    /// durable, with one call (syncfs) each, if the storage can: `Ok(false)`
    /// if it cannot, and nothing was done. Cheaper than a sync per file for
    /// many files without data, whose syncs each wait for a journal commit
    /// and a flush of the device's cache.
    fn sync_file_systems(&self, _dirs: &[&Path]) -> io::Result<bool> {
        Ok(false)
    }
    /// The target of the symlink `path`, as bytes (never followed).
    fn read_link(&self, _path: &Path) -> io::Result<Vec<u8>> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "this storage holds no symlinks"))
    }
    /// Makes `path` a symlink to `target` (bytes, never followed or
    /// checked: a target is data), with the owner, group, extended
    /// attributes and modification time `attrs` gives (a symlink has no
    /// mode of its own). What had the name is replaced, never written
    /// through: the link is made under a temporary name and renamed into
    /// place.
    fn make_link(&self, _path: &Path, _target: &[u8], _attrs: &Attrs) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "this storage keeps no symlinks"))
    }
    /// Makes `path` a device, FIFO or socket of `mode` (type and permission
    /// bits) and device number `rdev`, with the owner, group, extended
    /// attributes and modification time `attrs` gives: under a temporary
    /// name, renamed into place (replacing what had the name, never
    /// written through), never opened.
    fn make_node(&self, _path: &Path, _mode: u32, _rdev: u64, _attrs: &Attrs) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "this storage keeps no devices, FIFOs or sockets"))
    }
    /// Makes `path` another name of the file `first` (a hard link), never
    /// following a symlink at either: what had the name is replaced,
    /// never written through (the link is made under a temporary name and
    /// renamed into place); a name that is already one of `first`'s is
    /// left as it is. A storage without hard links refuses.
    fn hard_link(&self, _first: &Path, _path: &Path) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "this storage keeps no hard links"))
    }
    /// Removes a file; one that is not there is not an error.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Removes an empty directory.
    fn remove_dir(&self, path: &Path) -> io::Result<()>;
    /// Where the engine keeps the resume state of transfers into this
    /// storage (the journals of partial files): None for the storage
    /// itself; a storage that cannot keep a file growing by small writes
    /// (an object store) names a local one.
    fn state_store(&self) -> Option<Store> {
        None
    }
    /// This storage with every path confined beneath `dir`, as an export
    /// is: what a receiver writes into a destination of the local file
    /// system, so that no symlink below the destination is followed. `dir`
    /// itself is followed if it is a symlink (the user named it, as cp and
    /// rsync follow a destination that is one). None where paths are
    /// confined already (an export, an object store).
    fn beneath(&self, _dir: &Path) -> io::Result<Option<Store>> {
        Ok(None)
    }
    /// Reads a whole file of at most `limit` bytes.
    fn read_all(&self, path: &Path, limit: u64) -> io::Result<Vec<u8>> {
        let f = self.open(path)?;
        let size = f.stat()?.size;
        if size > limit {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("larger than {limit} bytes")));
        }
        let mut buf = vec![0; size as usize];
        let mut n = 0;
        while n < buf.len() {
            match f.read_at(&mut buf[n..], n as u64)? {
                0 => break,
                k => n += k,
            }
        }
        buf.truncate(n);
        Ok(buf)
    }
}

/// How the URL of an S3 bucket (or of a key prefix in one) begins.
pub const S3_SCHEME: &str = "s3://";

/// The local file system, paths used as given.
pub fn local() -> Store {
    Arc::new(posix::Posix::local())
}

/// An export named `label` of directory `dir`, every path confined beneath it.
pub fn export(label: &str, dir: &Path) -> io::Result<Store> {
    Ok(Arc::new(posix::Posix::export(label, dir)?))
}

/// The path that `spelled` (a path as it travels, see
/// [`dmover_proto::path`]) names in `store`, checked: in a confined
/// storage, a path that is not a plain relative path, that names dmover's
/// own files ([`check_not_reserved`]), or that meets a symlink on the way,
/// is refused; a path that does not exist yet is fine.
pub fn checked_path(store: &dyn Storage, spelled: &str) -> Result<PathBuf> {
    let refuse = |why: String| Err(Error::new(ErrorKind::Refused, display_spelled(store, spelled), format!("path refused: {why}")));
    if store.features().confined {
        if let Err(e) = dmover_proto::path::check_relative(spelled) {
            return refuse(e.to_string());
        }
        if let Err(why) = check_not_reserved(spelled) {
            return refuse(why);
        }
    }
    let path = match dmover_proto::path::to_path(spelled) {
        Ok(p) => p,
        Err(e) => return Err(Error::new(ErrorKind::Usage, printable(spelled), e.to_string())),
    };
    if !store.features().confined {
        return Ok(path);
    }
    match store.stat(&path) {
        Ok(s) if s.kind == Kind::Symlink => refuse("symlinks are not followed inside an export".into()),
        Ok(_) => Ok(path),
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => Ok(path),
        Err(e) => Err(Error::io(store.display(&path), &e)),
    }
}

/// How to name `spelled` (a path as it travels) of `store` in messages.
pub fn display_spelled(store: &dyn Storage, spelled: &str) -> String {
    match dmover_proto::path::to_path(spelled) {
        Ok(p) => store.display(&p),
        Err(_) => printable(spelled).into_owned(),
    }
}

/// Refuses a path (`/`-separated, relative) that names dmover's own files:
/// resume state (in [`STATE_DIR`]) and partial files (ending in
/// [`PART_SUFFIX`]). They are never sent, and a peer may not name them:
/// not to write there, nor to read them.
pub fn check_not_reserved(path: &str) -> std::result::Result<(), String> {
    let mut names = path.split('/').filter(|c| !c.is_empty());
    if names.clone().any(|c| c == STATE_DIR) || names.next_back().is_some_and(|c| c.ends_with(PART_SUFFIX)) {
        return Err(format!("names in {STATE_DIR}/ and names ending in {PART_SUFFIX} are dmover's own resume state and partial files, which no peer may name"));
    }
    Ok(())
}

/// Reads until `buf` is full or the file ends, in pieces each checksummed
/// while it is still in the CPU's cache; returns the bytes read and the
/// checksum of those bytes.
pub fn read_block(f: &dyn ReadFile, buf: &mut [u8], off: u64) -> io::Result<(usize, Sum)> {
    let mut sum = BlockHasher::new();
    let mut n = 0;
    while n < buf.len() {
        let end = buf.len().min(n + PIECE);
        match f.read_at(&mut buf[n..end], off + n as u64) {
            Ok(0) => break,
            Ok(k) => {
                sum.update(&buf[n..n + k]);
                n += k;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok((n, sum.finish()))
}

/// Writes `len` zero bytes at `off`, a piece at a time.
pub fn write_zero_bytes<F: WriteFile + ?Sized>(f: &F, off: u64, len: u64) -> io::Result<()> {
    let zeros = vec![0u8; len.min(PIECE as u64) as usize];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(zeros.len() as u64);
        f.write_all_at(&zeros[..n as usize], off + at)?;
        at += n;
    }
    Ok(())
}

/// Writes `data` at `off`, leaving each of its [`PAGE`]s of zeros a hole
/// ([`WriteFile::write_zeros`]; `fresh` as there).
pub fn write_sparse(f: &dyn WriteFile, data: &[u8], off: u64, fresh: bool) -> io::Result<()> {
    let mut at = 0;
    while at < data.len() {
        let zeros = |p: &[u8]| p.iter().all(|b| *b == 0);
        let kind = zeros(&data[at..data.len().min(at + PAGE)]);
        let mut end = at;
        while end < data.len() && zeros(&data[end..data.len().min(end + PAGE)]) == kind {
            end = data.len().min(end + PAGE);
        }
        if kind {
            f.write_zeros(off + at as u64, (end - at) as u64, fresh)?;
        } else {
            f.write_all_at(&data[at..end], off + at as u64)?;
        }
        at = end;
    }
    Ok(())
}

/// The unit in which [`write_sparse`] leaves zeros holes: a page, and a
/// file system block.
pub const PAGE: usize = 4096;

/// Where a range of a file lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// Wholly in a hole: it reads as zeros, unread.
    Hole,
    /// Wholly in data.
    Data,
    /// Partly in a hole.
    Mixed,
}

/// Where data lies in a file whose blocks are read in order: the file is
/// asked ([`ReadFile::data_from`]) only when a block lies past the run of
/// data it last named, so a file with no holes is asked once per run.
pub struct DataMap<'a> {
    file: &'a dyn ReadFile,
    /// Where it was last asked, and the first run of data from there.
    known: Option<(u64, Option<std::ops::Range<u64>>)>,
}

impl<'a> DataMap<'a> {
    pub fn new(file: &'a dyn ReadFile) -> DataMap<'a> {
        DataMap { file, known: None }
    }

    /// Where the bytes `off..off + len` lie.
    pub fn extent(&mut self, off: u64, len: u64) -> io::Result<Extent> {
        let stale = match &self.known {
            Some((asked, run)) => off < *asked || run.as_ref().is_some_and(|r| r.end <= off),
            None => true,
        };
        if stale {
            self.known = Some((off, self.file.data_from(off)?));
        }
        let end = off.saturating_add(len);
        Ok(match self.known.as_ref().and_then(|k| k.1.as_ref()) {
            None => Extent::Hole,
            Some(r) if r.start >= end => Extent::Hole,
            Some(r) if r.start <= off && r.end >= end => Extent::Data,
            Some(_) => Extent::Mixed,
        })
    }
}

/// The digest of a stored file (for `--checksum`), read in blocks of
/// `block_size`; blocks that lie in a hole are not read.
pub fn digest_of(store: &dyn Storage, path: &Path, block_size: u64) -> io::Result<Sum> {
    let f = store.open(path)?;
    let size = f.stat()?.size;
    let mut map = DataMap::new(f.as_ref());
    let mut buf = vec![0u8; block_size as usize];
    let mut sums = Vec::new();
    let mut off = 0;
    loop {
        let len = size.saturating_sub(off).min(block_size);
        let (n, sum) = if len > 0 && map.extent(off, len)? == Extent::Hole {
            (len as usize, zeros_sum(len as usize))
        } else {
            read_block(f.as_ref(), &mut buf, off)?
        };
        if n == 0 {
            break;
        }
        sums.push(sum);
        off += n as u64;
    }
    Ok(file_digest(&sums))
}

#[cfg(test)]
mod tests {
    use super::check_not_reserved;

    #[test]
    fn names_of_resume_state_and_partial_files_are_reserved() {
        for p in [".dmover-partial", ".dmover-partial/", "a/.dmover-partial/x", ".x.dmover-part", "a/.b.dmover-part"] {
            assert!(check_not_reserved(p).is_err(), "{p:?} was not refused");
        }
        for p in ["", "a", "a/b.dmover-partx", ".dmover-partial-old/x", "a.dmover-part/b"] {
            assert!(check_not_reserved(p).is_ok(), "{p:?} was refused");
        }
    }
}
