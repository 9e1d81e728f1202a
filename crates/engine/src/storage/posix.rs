//! The file-system [`Storage`], through directory handles.
//!
//! A confined storage (an export) holds a handle on its root directory and
//! resolves every path beneath it at the moment of use: with `openat2`
//! (`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`), or where the kernel lacks it,
//! by opening one component at a time from the root's handle with
//! `O_NOFOLLOW`. An operation on a name (stat, create, unlink, rename,
//! mkdir) first opens the name's parent directory that way and then acts on
//! the name relative to that handle, never following a symlink. So there
//! is no check followed by a use: a directory swapped for a symlink between
//! two operations makes the second one fail, never leave the export.
//!
//! A local storage (the user's own file system) uses paths as given,
//! relative to the working directory, and follows symlinks the user names;
//! only the final name of a file it creates is never followed. What a
//! receiver writes there is confined the same way as an export, beneath
//! the destination the user named ([`Posix::beneath`]), so that a symlink
//! another user planted below a shared destination is not written through.

use super::{Attrs, DirEntry, Features, Keeps, Kind, ReadFile, Stat, Storage, WriteFile, Xattr};
use crate::error::Refused;
use rustix::fs::{AtFlags, FallocateFlags, Mode, OFlags, ResolveFlags, SeekFrom, Timespec, Timestamps, CWD};
use rustix::io::Errno;
use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// How paths beneath a confined root are resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolve {
    /// `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`.
    Openat2,
    /// One component at a time with `O_NOFOLLOW`, from the root's handle.
    Walk,
}

/// How a new file is opened: exclusively (its inode is ours), never
/// through a symlink at its name.
const NEW_FILE: OFlags = OFlags::RDWR.union(OFlags::CREATE).union(OFlags::EXCL).union(OFlags::NOFOLLOW).union(OFlags::CLOEXEC);

const NOT_BENEATH: &str = "symlinks are not followed inside an export or below a copy's destination, and paths may not leave them";

const NOT_REGULAR: &str = "not a regular file (FIFOs, sockets and devices are never read or written)";

/// Files and directories on a POSIX file system.
#[derive(Debug)]
pub struct Posix {
    /// Where its paths lead, shared with its files open for writing,
    /// which are committed (renamed into place) through it.
    tree: Arc<Tree>,
}

/// The tree of files a [`Posix`] storage names: its root, and how paths
/// beneath it are resolved.
#[derive(Debug)]
struct Tree {
    /// The export's root directory (None: local, paths used as given).
    root: Option<OwnedFd>,
    /// The root's path, for messages.
    dir: PathBuf,
    /// The export's name, for messages; None for the local file system,
    /// whose paths are named as they are (below `dir`).
    label: Option<String>,
    /// Whether `openat2` is known to work; cleared for good by the first
    /// ENOSYS, after which paths are walked.
    openat2: AtomicBool,
}

impl Posix {
    /// The storage of `tree`.
    fn of(tree: Tree) -> Posix {
        Posix { tree: Arc::new(tree) }
    }

    /// The local file system.
    pub fn local() -> Posix {
        Posix::of(Tree { root: None, dir: PathBuf::new(), label: None, openat2: AtomicBool::new(false) })
    }

    /// The local file system beneath `dir`, which is followed if it is a
    /// symlink (see [`Storage::beneath`]): every path below it is confined
    /// as in an export, and named in messages by its local path.
    pub fn beneath(dir: &Path) -> io::Result<Posix> {
        let at = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
        let root = rustix::fs::open(at, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
        Ok(Posix::of(Tree { root: Some(root), dir: dir.to_path_buf(), label: None, openat2: AtomicBool::new(true) }))
    }

    /// An export of `dir`, named `label` in messages.
    pub fn export(label: &str, dir: &Path) -> io::Result<Posix> {
        Posix::export_with(label, dir, Resolve::Openat2)
    }

    /// An export that resolves paths as `how` says (the conformance tests
    /// run both ways; [`export`](Posix::export) uses `openat2` where the kernel has it).
    pub fn export_with(label: &str, dir: &Path, how: Resolve) -> io::Result<Posix> {
        let root = rustix::fs::open(dir, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
        let dir = dir.canonicalize()?;
        Ok(Posix::of(Tree { root: Some(root), dir, label: Some(label.to_string()), openat2: AtomicBool::new(how == Resolve::Openat2) }))
    }

    /// `file`, open for writing under `path`.
    fn write_file(&self, file: File, path: &Path) -> PosixWrite {
        PosixWrite { file: PosixFile(file), path: path.to_path_buf(), tree: self.tree.clone() }
    }

    /// How this storage resolves paths now.
    pub fn resolve(&self) -> Option<Resolve> {
        let t = &self.tree;
        t.root.as_ref().map(|_| if t.openat2.load(Ordering::Relaxed) { Resolve::Openat2 } else { Resolve::Walk })
    }
}

impl Tree {
    /// The components of a path within a confined root: only plain names.
    fn names<'a>(&self, path: &'a Path) -> io::Result<Vec<&'a OsStr>> {
        path.components()
            .filter(|c| *c != Component::CurDir)
            .map(|c| match c {
                Component::Normal(n) => Ok(n),
                _ => Err(Refused::io(NOT_BENEATH)),
            })
            .collect()
    }

    /// Opens `path` with `flags`: beneath the root without following any
    /// symlink when confined, as given when local.
    fn open_at(&self, path: &Path, flags: OFlags, mode: Mode) -> io::Result<OwnedFd> {
        let flags = flags | OFlags::CLOEXEC;
        let Some(root) = &self.root else {
            let p = if path.as_os_str().is_empty() { Path::new(".") } else { path };
            return Ok(rustix::fs::openat(CWD, p, flags, mode)?);
        };
        let names = self.names(path)?;
        if self.openat2.load(Ordering::Relaxed) {
            let rel: PathBuf = if names.is_empty() { PathBuf::from(".") } else { names.iter().collect() };
            match rustix::fs::openat2(root, &rel, flags, mode, ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS) {
                Ok(fd) => return Ok(fd),
                Err(Errno::NOSYS) => {
                    log::info!("{}: openat2 is missing; resolving paths one component at a time", self.dir.display());
                    self.openat2.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(refusal(e)),
            }
        }
        let Some((last, dirs)) = names.split_last() else {
            return Ok(rustix::fs::openat(root, ".", flags, mode)?);
        };
        let mut parent: Option<OwnedFd> = None;
        for d in dirs {
            let at = parent.as_ref().map(|p| p.as_fd()).unwrap_or(root.as_fd());
            let fd = open_subdir(at, d)?;
            parent = Some(fd);
        }
        let at = parent.as_ref().map(|p| p.as_fd()).unwrap_or(root.as_fd());
        match rustix::fs::openat(at, *last, flags | OFlags::NOFOLLOW, mode) {
            Err(Errno::NOTDIR) if is_symlink_at(at, last) => Err(Refused::io(NOT_BENEATH)),
            r => r.map_err(refusal),
        }
    }

    /// The parent directory of `path`, open, and the name within it.
    fn parent<'a>(&self, path: &'a Path) -> io::Result<(OwnedFd, &'a OsStr)> {
        let name = match path.components().next_back() {
            Some(Component::Normal(n)) => n,
            _ => return Err(io::Error::new(io::ErrorKind::InvalidInput, "not the name of a file")),
        };
        let parent = path.parent().unwrap_or(Path::new(""));
        Ok((self.open_at(parent, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?, name))
    }

    fn stat_at(&self, path: &Path, follow: bool) -> io::Result<Stat> {
        if path.components().all(|c| c == Component::CurDir) || (self.root.is_none() && path.file_name().is_none()) {
            let fd = self.open_at(path, OFlags::PATH, Mode::empty())?;
            return Ok(stat_of(&rustix::fs::fstat(&fd)?));
        }
        if follow && self.root.is_none() {
            return Ok(stat_of(&rustix::fs::statat(CWD, path, AtFlags::empty())?));
        }
        let (dir, name) = self.parent(path)?;
        Ok(stat_of(&rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)?))
    }

    /// Opens the directory `dir` for reading, never through a symlink when confined.
    fn open_dir(&self, dir: &Path) -> io::Result<OwnedFd> {
        self.open_at(dir, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
    }

    /// Renames `from` to `to`, both resolved as every path is.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (from_dir, from_name) = self.parent(from)?;
        if from.parent() == to.parent() {
            let to_name = to.file_name().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not the name of a file"))?;
            return Ok(rustix::fs::renameat(&from_dir, from_name, &from_dir, to_name)?);
        }
        let (to_dir, to_name) = self.parent(to)?;
        Ok(rustix::fs::renameat(&from_dir, from_name, &to_dir, to_name)?)
    }
}

/// Opens the directory `name` in `dir`, refusing a symlink there.
fn open_subdir(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<OwnedFd> {
    match rustix::fs::openat(dir, name, OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty()) {
        Ok(fd) => Ok(fd),
        // With O_PATH, a symlink is not a directory: say which it was.
        Err(Errno::NOTDIR) if is_symlink_at(dir, name) => Err(Refused::io(NOT_BENEATH)),
        Err(e) => Err(refusal(e)),
    }
}

/// Whether `name` in `dir` is a symlink.
fn is_symlink_at(dir: BorrowedFd<'_>, name: &OsStr) -> bool {
    rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|s| rustix::fs::FileType::from_raw_mode(s.st_mode) == rustix::fs::FileType::Symlink)
}

/// A refusal where the kernel met a symlink or a path leading out;
/// other errors as they are.
fn refusal(e: Errno) -> io::Error {
    match e {
        Errno::LOOP | Errno::XDEV => Refused::io(NOT_BENEATH),
        e => e.into(),
    }
}

fn stat_of(s: &rustix::fs::Stat) -> Stat {
    let kind = match rustix::fs::FileType::from_raw_mode(s.st_mode) {
        rustix::fs::FileType::RegularFile => Kind::File,
        rustix::fs::FileType::Directory => Kind::Dir,
        rustix::fs::FileType::Symlink => Kind::Symlink,
        _ => Kind::Special(s.st_mode & 0o170000),
    };
    Stat {
        kind,
        size: s.st_size as u64,
        mode: s.st_mode & 0o7777,
        mtime: (s.st_mtime, s.st_mtime_nsec as u32),
        ctime: (s.st_ctime, s.st_ctime_nsec as i64),
        nlink: s.st_nlink,
        owner: Some((s.st_uid, s.st_gid)),
        rdev: s.st_rdev,
        inode: Some((s.st_dev, s.st_ino)),
    }
}

/// The user and group ids `attrs` gives, but those equal to `now` (the
/// ids the file has) and -1 (which means none).
fn ids_to_set(attrs: &Attrs, now: Option<(u32, u32)>) -> (Option<rustix::fs::Uid>, Option<rustix::fs::Gid>) {
    let (uid, gid) = now.map_or((None, None), |(u, g)| (Some(u), Some(g)));
    let owner = attrs.owner.filter(|&u| u != u32::MAX && Some(u) != uid).map(rustix::fs::Uid::from_raw);
    let group = attrs.group.filter(|&g| g != u32::MAX && Some(g) != gid).map(rustix::fs::Gid::from_raw);
    (owner, group)
}

/// Gives the open file or directory `fd` the owner, group and extended
/// attributes `attrs` names (an id of -1 is never set: it means none).
fn set_owner_and_xattrs(fd: BorrowedFd<'_>, attrs: &Attrs) -> io::Result<()> {
    if attrs.owner.is_some() || attrs.group.is_some() {
        // Only what differs: a new file often has its owner already, and a
        // change of owner is a change of the inode to journal.
        let st = rustix::fs::fstat(fd)?;
        let (owner, group) = ids_to_set(attrs, Some((st.st_uid, st.st_gid)));
        if owner.is_some() || group.is_some() {
            rustix::fs::fchown(fd, owner, group)?;
        }
    }
    for x in &attrs.xattrs {
        rustix::fs::fsetxattr(fd, OsStr::from_bytes(&x.name), &x.value, rustix::fs::XattrFlags::empty()).map_err(|e| {
            io::Error::new(io::Error::from(e).kind(), format!("extended attribute {}: {e}", String::from_utf8_lossy(&x.name)))
        })?;
    }
    Ok(())
}

/// The modification time `mtime` to set, the access time left.
fn mtime_only((s, ns): (i64, u32)) -> Timestamps {
    let omit = Timespec { tv_sec: 0, tv_nsec: rustix::fs::UTIME_OMIT };
    Timestamps { last_access: omit, last_modification: Timespec { tv_sec: s, tv_nsec: ns as _ } }
}

/// The name `name` in the directory open at `dir`, as a path that names
/// it through that handle (for the calls that take no directory handle:
/// the `l*xattr` family), so that no path is resolved again.
fn through_handle(dir: BorrowedFd<'_>, name: &OsStr) -> PathBuf {
    let mut p = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    p.push(name);
    p
}

/// The extended attributes of the file at `path` (a symlink's own).
fn xattrs_at(path: &Path) -> io::Result<Vec<Xattr>> {
    let mut names = vec![0u8; rustix::fs::llistxattr_query(path)?];
    let n = rustix::fs::llistxattr(path, &mut names[..])?;
    let mut out = Vec::new();
    for name in names[..n].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let name = OsStr::from_bytes(name);
        let mut value = vec![0u8; rustix::fs::lgetxattr_query(path, name)?];
        let len = rustix::fs::lgetxattr(path, name, &mut value[..])?;
        value.truncate(len);
        out.push(Xattr { name: name.as_bytes().to_vec(), value });
    }
    Ok(out)
}

/// `fd` as a file if it is a regular one, with its attributes; None if it
/// is anything else. Existing files are opened with `O_NONBLOCK`, so that a
/// FIFO (or a device) planted at the name cannot hold the open until a
/// writer comes; it is cleared here once the file is known to be regular.
fn regular(fd: OwnedFd) -> io::Result<Option<(File, Stat)>> {
    let s = stat_of(&rustix::fs::fstat(&fd)?);
    if !s.is_file() {
        return Ok(None);
    }
    rustix::fs::fcntl_setfl(&fd, OFlags::empty())?;
    Ok(Some((File::from(fd), s)))
}

/// An open file of a [`Posix`] storage.
struct PosixFile(File);

impl ReadFile for PosixFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        self.0.read_at(buf, off)
    }

    fn stat(&self) -> io::Result<Stat> {
        Ok(stat_of(&rustix::fs::fstat(&self.0)?))
    }

    /// With `SEEK_DATA` and `SEEK_HOLE` (the reads are `pread`s, which
    /// the file offset these move does not concern). A file system that
    /// does not track holes says the whole file is data.
    fn data_from(&self, off: u64) -> io::Result<Option<std::ops::Range<u64>>> {
        let start = match rustix::fs::seek(&self.0, SeekFrom::Data(off)) {
            Ok(start) => start,
            Err(Errno::NXIO) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        Ok(Some(start..rustix::fs::seek(&self.0, SeekFrom::Hole(start))?))
    }
}

/// A file of a [`Posix`] storage open for writing, with the name it was
/// opened under and the tree it is in, through which it is committed.
struct PosixWrite {
    file: PosixFile,
    path: PathBuf,
    tree: Arc<Tree>,
}

impl ReadFile for PosixWrite {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        self.file.read_at(buf, off)
    }

    fn stat(&self) -> io::Result<Stat> {
        self.file.stat()
    }

    fn data_from(&self, off: u64) -> io::Result<Option<std::ops::Range<u64>>> {
        self.file.data_from(off)
    }
}

impl WriteFile for PosixWrite {
    fn write_all_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.file.0.write_all_at(buf, off)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.0.set_len(len)
    }

    /// Punches a hole where something may have been written (a file
    /// system that cannot gets the zeros written); where nothing was, the
    /// hole is there already. A file shorter than `off + len` is made that
    /// long.
    fn write_zeros(&self, off: u64, len: u64, fresh: bool) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        if !fresh {
            match rustix::fs::fallocate(&self.file.0, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, off, len) {
                Ok(()) => {}
                Err(Errno::OPNOTSUPP | Errno::NOSYS) => return super::write_zero_bytes(self, off, len),
                Err(e) => return Err(e.into()),
            }
        }
        if self.file.0.metadata()?.len() < off + len {
            self.file.0.set_len(off + len)?;
        }
        Ok(())
    }

    fn set_attrs(&self, attrs: &Attrs) -> io::Result<()> {
        set_owner_and_xattrs(self.file.0.as_fd(), attrs)?;
        rustix::fs::fchmod(&self.file.0, Mode::from_raw_mode(attrs.mode))?;
        if let Some(mtime) = attrs.mtime {
            rustix::fs::futimens(&self.file.0, &mtime_only(mtime))?;
        }
        Ok(())
    }

    fn write_back(&self, off: u64, len: u64) -> io::Result<()> {
        // SAFETY: the descriptor is open for the call; the range is plain numbers.
        let r = unsafe { libc::sync_file_range(self.file.0.as_raw_fd(), off as i64, len as i64, libc::SYNC_FILE_RANGE_WRITE) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn sync(&self) -> io::Result<()> {
        self.file.0.sync_all()
    }

    fn commit(&self, to: &Path, attrs: Option<&Attrs>) -> io::Result<()> {
        if let Some(a) = attrs {
            self.set_attrs(a)?;
        }
        self.tree.rename(&self.path, to)
    }
}

/// Directories a walk lists at once: a cold directory's listing waits on
/// the disk for each inode it stats, and several in flight keep the disk's
/// queue full (and a second core busy) while one is sent.
const LISTS_AT_ONCE: usize = 8;

impl Storage for Posix {
    fn features(&self) -> Features {
        Features {
            confined: self.tree.root.is_some(),
            lists_at_once: LISTS_AT_ONCE,
            commits_at_once: 1,
            keeps: Keeps::all().difference(Keeps::ANY_OWNER),
        }
    }

    fn display(&self, path: &Path) -> String {
        let Some(label) = &self.tree.label else {
            let local = if path.as_os_str().is_empty() { self.tree.dir.clone() } else { self.tree.dir.join(path) };
            return dmover_proto::path::from_path(&local).into_owned();
        };
        let rel = dmover_proto::path::from_path(path);
        dmover_proto::path::join(label, rel.trim_start_matches("./"))
    }

    fn stat(&self, path: &Path) -> io::Result<Stat> {
        self.tree.stat_at(path, false)
    }

    fn stat_followed(&self, path: &Path) -> io::Result<Stat> {
        self.tree.stat_at(path, true)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        let fd = self.tree.open_dir(dir)?;
        let mut out = Vec::new();
        for ent in rustix::fs::Dir::read_from(&fd)? {
            let ent = ent?;
            let name = ent.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let name = <OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name).to_os_string();
            let stat = rustix::fs::statat(&fd, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW).map(|s| stat_of(&s)).map_err(io::Error::from);
            out.push(DirEntry { name, stat });
        }
        Ok(out)
    }

    /// Reads entries only until one other than `.`, `..` and [`STATE_DIR`](super::STATE_DIR).
    fn is_empty_dir(&self, dir: &Path) -> io::Result<bool> {
        let fd = match self.tree.open_dir(dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(true),
            got => got?,
        };
        for ent in rustix::fs::Dir::read_from(&fd)? {
            if ![&b"."[..], b"..", super::STATE_DIR.as_bytes()].contains(&ent?.file_name().to_bytes()) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn ReadFile>> {
        let fd = self.tree.open_at(path, OFlags::RDONLY | OFlags::NONBLOCK, Mode::empty())?;
        let (f, _) = regular(fd)?.ok_or_else(|| Refused::io(NOT_REGULAR))?;
        Ok(Box::new(PosixFile(f)))
    }

    fn make_dirs(&self, dir: &Path) -> io::Result<()> {
        let Some(root) = &self.tree.root else {
            return if dir.as_os_str().is_empty() { Ok(()) } else { std::fs::create_dir_all(dir) };
        };
        let mut at: Option<OwnedFd> = None;
        for name in self.tree.names(dir)? {
            let parent = at.as_ref().map(|p| p.as_fd()).unwrap_or(root.as_fd());
            match rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o777)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
            at = Some(open_subdir(parent, name)?);
        }
        Ok(())
    }

    fn make_dir(&self, dir: &Path, mode: u32) -> io::Result<()> {
        let (parent, name) = self.tree.parent(dir)?;
        match rustix::fs::mkdirat(&parent, name, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
        let fd = rustix::fs::openat(&parent, name, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| match e {
                Errno::NOTDIR | Errno::LOOP => {
                    io::Error::new(io::ErrorKind::AlreadyExists, "something other than a directory is in the way")
                }
                e => e.into(),
            })?;
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
        Ok(())
    }

    fn set_dir_attrs(&self, dir: &Path, attrs: &Attrs) -> io::Result<()> {
        let fd = self.tree.open_at(dir, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW, Mode::empty())?;
        set_owner_and_xattrs(fd.as_fd(), attrs)?;
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(attrs.mode))?;
        match attrs.mtime {
            Some(mtime) => Ok(rustix::fs::futimens(&fd, &mtime_only(mtime))?),
            None => Ok(()),
        }
    }

    /// Through the handle of the parent directory, resolved as every path
    /// is, where confined; by the path as given on the local file system.
    /// The name itself is never followed.
    fn xattrs(&self, path: &Path) -> io::Result<Vec<Xattr>> {
        if self.tree.root.is_none() && !path.as_os_str().is_empty() {
            return xattrs_at(path);
        }
        if path.as_os_str().is_empty() || path.file_name().is_none() {
            let fd = self.tree.open_at(path, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?;
            return xattrs_at(&PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())));
        }
        let (dir, name) = self.tree.parent(path)?;
        xattrs_at(&through_handle(dir.as_fd(), name))
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let (parent, name) = self.tree.parent(path)?;
        match rustix::fs::unlinkat(&parent, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(e.into()),
        }
        let fd = rustix::fs::openat(&parent, name, NEW_FILE, Mode::from_raw_mode(0o600))?;
        Ok(Box::new(self.write_file(File::from(fd), path)))
    }

    fn create_empty(&self, path: &Path, attrs: &Attrs) -> io::Result<Option<Box<dyn WriteFile>>> {
        let (parent, name) = self.tree.parent(path)?;
        let f = match rustix::fs::openat(&parent, name, NEW_FILE, Mode::from_raw_mode(0o600)) {
            Ok(fd) => self.write_file(File::from(fd), path),
            Err(Errno::EXIST) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        f.set_attrs(attrs)?;
        Ok(Some(Box::new(f)))
    }

    fn reopen(&self, path: &Path) -> io::Result<Option<Box<dyn WriteFile>>> {
        let (parent, name) = self.tree.parent(path)?;
        let flags = OFlags::RDWR | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let fd = match rustix::fs::openat(&parent, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT | Errno::LOOP) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        Ok(regular(fd)?.filter(|(_, s)| s.nlink == 1).map(|(f, _)| Box::new(self.write_file(f, path)) as Box<dyn WriteFile>))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        // fsync needs a descriptor opened for reading, not an O_PATH one.
        let fd = self.tree.open_dir(dir)?;
        Ok(rustix::fs::fsync(&fd)?)
    }

    fn sync_file_systems(&self, dirs: &[&Path]) -> io::Result<bool> {
        let mut synced = HashSet::new();
        for dir in dirs {
            let fd = self.tree.open_dir(dir)?;
            if synced.insert(rustix::fs::fstat(&fd)?.st_dev) {
                rustix::fs::syncfs(&fd)?;
            }
        }
        Ok(true)
    }

    fn read_link(&self, path: &Path) -> io::Result<Vec<u8>> {
        let (dir, name) = self.tree.parent(path)?;
        Ok(rustix::fs::readlinkat(&dir, name, Vec::new())?.into_bytes())
    }

    fn make_link(&self, path: &Path, target: &[u8], attrs: &Attrs) -> io::Result<()> {
        let (dir, name) = self.tree.parent(path)?;
        let temp = super::part_name(name);
        match rustix::fs::unlinkat(&dir, &temp, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(e.into()),
        }
        rustix::fs::symlinkat(OsStr::from_bytes(target), &dir, &temp)?;
        let placed = (|| -> io::Result<()> {
            let (owner, group) = ids_to_set(attrs, None);
            if owner.is_some() || group.is_some() {
                rustix::fs::chownat(&dir, &temp, owner, group, AtFlags::SYMLINK_NOFOLLOW)?;
            }
            for x in &attrs.xattrs {
                let at = through_handle(dir.as_fd(), &temp);
                rustix::fs::lsetxattr(&at, OsStr::from_bytes(&x.name), &x.value, rustix::fs::XattrFlags::empty())?;
            }
            if let Some(mtime) = attrs.mtime {
                rustix::fs::utimensat(&dir, &temp, &mtime_only(mtime), AtFlags::SYMLINK_NOFOLLOW)?;
            }
            Ok(rustix::fs::renameat(&dir, &temp, &dir, name)?)
        })();
        if let Err(e) = placed {
            let _ = rustix::fs::unlinkat(&dir, &temp, AtFlags::empty());
            return Err(e);
        }
        Ok(())
    }

    /// Made with `mknodat` under a temporary name; its attributes are set
    /// through a path-only handle on it (`/proc/self/fd/N` names that very
    /// inode, so a name swapped meanwhile leads nowhere else), then renamed.
    fn make_node(&self, path: &Path, mode: u32, rdev: u64, attrs: &Attrs) -> io::Result<()> {
        let (dir, name) = self.tree.parent(path)?;
        let temp = super::part_name(name);
        match rustix::fs::unlinkat(&dir, &temp, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(e.into()),
        }
        let kind = rustix::fs::FileType::from_raw_mode(mode);
        rustix::fs::mknodat(&dir, &temp, kind, Mode::from_raw_mode(0o600), rdev)?;
        let placed = (|| -> io::Result<()> {
            let fd = rustix::fs::openat(&dir, &temp, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())?;
            let at = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
            let (owner, group) = ids_to_set(attrs, None);
            if owner.is_some() || group.is_some() {
                rustix::fs::chownat(&fd, "", owner, group, AtFlags::EMPTY_PATH)?;
            }
            for x in &attrs.xattrs {
                rustix::fs::setxattr(&at, OsStr::from_bytes(&x.name), &x.value, rustix::fs::XattrFlags::empty())?;
            }
            rustix::fs::chmod(&at, Mode::from_raw_mode(attrs.mode))?;
            if let Some(mtime) = attrs.mtime {
                rustix::fs::utimensat(CWD, &at, &mtime_only(mtime), AtFlags::empty())?;
            }
            Ok(rustix::fs::renameat(&dir, &temp, &dir, name)?)
        })();
        if let Err(e) = placed {
            let _ = rustix::fs::unlinkat(&dir, &temp, AtFlags::empty());
            return Err(e);
        }
        Ok(())
    }

    fn hard_link(&self, first: &Path, path: &Path) -> io::Result<()> {
        let (first_dir, first_name) = self.tree.parent(first)?;
        let (dir, name) = self.tree.parent(path)?;
        let file = rustix::fs::statat(&first_dir, first_name, AtFlags::SYMLINK_NOFOLLOW)?;
        if rustix::fs::FileType::from_raw_mode(file.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{}: {NOT_REGULAR}", self.display(first))));
        }
        match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(s) if (s.st_dev, s.st_ino) == (file.st_dev, file.st_ino) => return Ok(()),
            _ => {}
        }
        let temp = super::part_name(name);
        match rustix::fs::unlinkat(&dir, &temp, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(e.into()),
        }
        // Without AT_SYMLINK_FOLLOW: a symlink put at `first` since would be
        // linked itself, never followed.
        rustix::fs::linkat(&first_dir, first_name, &dir, &temp, AtFlags::empty())?;
        if let Err(e) = rustix::fs::renameat(&dir, &temp, &dir, name) {
            let _ = rustix::fs::unlinkat(&dir, &temp, AtFlags::empty());
            return Err(e.into());
        }
        Ok(())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let (parent, name) = self.tree.parent(path)?;
        match rustix::fs::unlinkat(&parent, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        let (parent, name) = self.tree.parent(path)?;
        Ok(rustix::fs::unlinkat(&parent, name, AtFlags::REMOVEDIR)?)
    }

    fn beneath(&self, dir: &Path) -> io::Result<Option<super::Store>> {
        if self.tree.root.is_some() {
            return Ok(None);
        }
        Ok(Some(std::sync::Arc::new(Posix::beneath(dir)?)))
    }
}
