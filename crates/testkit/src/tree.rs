//! Snapshots of a directory tree holding everything `rsync -aHAX` keeps,
//! and their comparison field by field: the oracle of the tests that copy
//! whole trees (a tree dmover copied is compared with what rsync made of
//! the same source).
//!
//! A [`Snapshot`] maps each name below a root, as bytes, to an [`Entry`]:
//! kind, permission bits, owner and group, modification time to the
//! nanosecond, size, allocated blocks, device number, a digest of a file's
//! content, a symlink's target, every extended attribute (POSIX ACLs are
//! the `system.posix_acl_*` ones), and which names share an inode.
//! [`compare`] lists every difference in the [`Field`]s asked for, each
//! in words that name the path and both values. Nothing here follows a
//! symlink.

use dmover_proto::digest::{BlockHasher, Sum};
use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// What kind of thing a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

/// Everything kept about one name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub kind: Kind,
    /// Permission bits with setuid, setgid and sticky (no file type).
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time: seconds and nanoseconds.
    pub mtime: (i64, i64),
    pub size: u64,
    /// 512-byte blocks allocated (what a sparse file saves).
    pub blocks: u64,
    /// A device's number.
    pub rdev: u64,
    /// A regular file's content digest.
    pub content: Option<Sum>,
    /// A symlink's target, as bytes.
    pub target: Option<Vec<u8>>,
    /// Extended attributes, name → value.
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// For a non-directory with several names in the tree: the first of
    /// them (in byte order), the same for all; None for a single name.
    pub inode_of: Option<Vec<u8>>,
}

/// The fields a comparison looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// Which names exist, and their kinds.
    Kind,
    /// A regular file's size and content.
    Content,
    /// Permission bits of files, directories and special files (a
    /// symlink's own are not kept by any tool).
    Perm,
    /// Owner and group.
    Owner,
    /// Modification times of everything but directories.
    Mtime,
    /// Modification times of directories.
    DirMtime,
    /// Symlink targets.
    Target,
    /// Device numbers.
    Device,
    /// Extended attributes, POSIX ACLs included.
    Xattrs,
    /// Which names share an inode.
    HardLinks,
    /// A file allocates at most twice the reference's blocks (plus 4 KiB).
    Sparse,
}

impl Field {
    /// Everything `rsync -aHAX --numeric-ids` keeps.
    pub const ALL: [Field; 11] = [
        Field::Kind,
        Field::Content,
        Field::Perm,
        Field::Owner,
        Field::Mtime,
        Field::DirMtime,
        Field::Target,
        Field::Device,
        Field::Xattrs,
        Field::HardLinks,
        Field::Sparse,
    ];
}

/// A tree: relative name (bytes) → entry. The root itself is not in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub entries: BTreeMap<Vec<u8>, Entry>,
}

/// A name as it is printed: bytes that are not UTF-8 as `\xHH`.
pub fn shown(name: &[u8]) -> String {
    dmover_proto::path::printable(&dmover_proto::path::from_bytes(name)).into_owned()
}

/// Takes the snapshot of everything below `root`.
pub fn snapshot(root: &Path) -> io::Result<Snapshot> {
    let mut entries = BTreeMap::new();
    let mut inodes: HashMap<(u64, u64), Vec<Vec<u8>>> = HashMap::new();
    let mut stack = vec![(root.to_path_buf(), Vec::new())];
    while let Some((dir, rel)) = stack.pop() {
        for e in fs::read_dir(&dir)? {
            let e = e?;
            let mut name = rel.clone();
            if !name.is_empty() {
                name.push(b'/');
            }
            name.extend_from_slice(e.file_name().as_bytes());
            let path = e.path();
            let m = fs::symlink_metadata(&path)?;
            let t = m.file_type();
            let kind = if t.is_file() {
                Kind::File
            } else if t.is_dir() {
                Kind::Dir
            } else if t.is_symlink() {
                Kind::Symlink
            } else if t.is_fifo() {
                Kind::Fifo
            } else if t.is_socket() {
                Kind::Socket
            } else if t.is_char_device() {
                Kind::CharDevice
            } else {
                Kind::BlockDevice
            };
            if kind == Kind::Dir {
                stack.push((path.clone(), name.clone()));
            } else if m.nlink() > 1 {
                inodes.entry((m.dev(), m.ino())).or_default().push(name.clone());
            }
            let entry = Entry {
                kind,
                perm: m.mode() & 0o7777,
                uid: m.uid(),
                gid: m.gid(),
                mtime: (m.mtime(), m.mtime_nsec()),
                size: m.len(),
                blocks: m.blocks(),
                rdev: m.rdev(),
                content: if kind == Kind::File { Some(digest(&path)?) } else { None },
                target: if kind == Kind::Symlink { Some(fs::read_link(&path)?.into_os_string().into_vec()) } else { None },
                xattrs: xattrs(&path)?,
                inode_of: None,
            };
            entries.insert(name, entry);
        }
    }
    for mut names in inodes.into_values().filter(|n| n.len() > 1) {
        names.sort();
        for n in &names {
            entries.get_mut(n).expect("listed above").inode_of = Some(names[0].clone());
        }
    }
    Ok(Snapshot { entries })
}

/// The digest of a file's content.
fn digest(path: &Path) -> io::Result<Sum> {
    let mut f = File::open(path)?;
    let mut h = BlockHasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf)? {
            0 => return Ok(h.finish()),
            n => h.update(&buf[..n]),
        }
    }
}

/// Gives `path` itself (not following a symlink) the extended attribute
/// `name` = `value`, for a test to build a tree with; panics if it cannot.
pub fn set_xattr(path: &Path, name: &[u8], value: &[u8]) {
    let c = CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
    let n = CString::new(name).expect("a name without NUL");
    // SAFETY: both strings are NUL-terminated; the value's length is given.
    let r = unsafe { libc::lsetxattr(c.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    assert_eq!(r, 0, "setxattr {} on {}: {}", name.escape_ascii(), path.display(), io::Error::last_os_error());
}

/// Every extended attribute of `path` itself (not following a symlink).
fn xattrs(path: &Path) -> io::Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let names = fill(|buf, len| {
        // SAFETY: `c` is a NUL-terminated path and `buf` holds `len` bytes (or is null with len 0).
        unsafe { libc::llistxattr(c.as_ptr(), buf.cast(), len) }
    })?;
    let mut out = BTreeMap::new();
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let cname = CString::new(name).map_err(io::Error::other)?;
        let value = fill(|buf, len| {
            // SAFETY: both strings are NUL-terminated and `buf` holds `len` bytes (or is null with len 0).
            unsafe { libc::lgetxattr(c.as_ptr(), cname.as_ptr(), buf.cast(), len) }
        })?;
        out.insert(name.to_vec(), value);
    }
    Ok(out)
}

/// Calls `get` first to learn the size, then to fill a buffer of it (again
/// if the value grew in between).
fn fill(get: impl Fn(*mut u8, usize) -> isize) -> io::Result<Vec<u8>> {
    loop {
        let n = get(std::ptr::null_mut(), 0);
        if n < 0 {
            let e = io::Error::last_os_error();
            // A file system without extended attributes has none.
            return if e.raw_os_error() == Some(libc::ENOTSUP) { Ok(Vec::new()) } else { Err(e) };
        }
        let mut buf = vec![0u8; n as usize];
        let got = get(buf.as_mut_ptr(), buf.len());
        if got >= 0 {
            buf.truncate(got as usize);
            return Ok(buf);
        }
        if io::Error::last_os_error().raw_os_error() != Some(libc::ERANGE) {
            return Err(io::Error::last_os_error());
        }
    }
}

/// Every difference between `reference` and `copy` in `fields`, in words;
/// empty when they agree.
pub fn compare(reference: &Snapshot, copy: &Snapshot, fields: &[Field]) -> Vec<String> {
    let has = |f: Field| fields.contains(&f);
    let mut out = Vec::new();
    for (name, r) in &reference.entries {
        let n = shown(name);
        let Some(c) = copy.entries.get(name) else {
            out.push(format!("{n}: missing ({:?} in the reference)", r.kind));
            continue;
        };
        if r.kind != c.kind {
            out.push(format!("{n}: a {:?} in the reference, a {:?} in the copy", r.kind, c.kind));
            continue;
        }
        let mut differ = |field: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{n}: {field} {a} in the reference, {b} in the copy"));
            }
        };
        if has(Field::Content) && r.kind == Kind::File {
            differ("size", r.size.to_string(), c.size.to_string());
            differ("content digest", hex(&r.content.unwrap_or_default()), hex(&c.content.unwrap_or_default()));
        }
        if has(Field::Perm) && r.kind != Kind::Symlink {
            differ("permissions", format!("{:04o}", r.perm), format!("{:04o}", c.perm));
        }
        if has(Field::Owner) {
            differ("owner:group", format!("{}:{}", r.uid, r.gid), format!("{}:{}", c.uid, c.gid));
        }
        let time = |t: (i64, i64)| format!("{}.{:09}", t.0, t.1);
        if (has(Field::Mtime) && r.kind != Kind::Dir) || (has(Field::DirMtime) && r.kind == Kind::Dir) {
            differ("mtime", time(r.mtime), time(c.mtime));
        }
        if has(Field::Target) {
            let t = |t: &Option<Vec<u8>>| t.as_deref().map(shown).unwrap_or_default();
            differ("symlink target", t(&r.target), t(&c.target));
        }
        if has(Field::Device) && matches!(r.kind, Kind::CharDevice | Kind::BlockDevice) {
            differ("device", format!("{:#x}", r.rdev), format!("{:#x}", c.rdev));
        }
        if has(Field::Xattrs) {
            let x =
                |m: &BTreeMap<Vec<u8>, Vec<u8>>| m.iter().map(|(k, v)| format!("{}={}", shown(k), hex(v))).collect::<Vec<_>>().join(",");
            differ("xattrs", format!("[{}]", x(&r.xattrs)), format!("[{}]", x(&c.xattrs)));
        }
        if has(Field::HardLinks) {
            let i = |i: &Option<Vec<u8>>| i.as_deref().map_or("its own inode".to_string(), |n| format!("the inode of {}", shown(n)));
            differ("names", i(&r.inode_of), i(&c.inode_of));
        }
        if has(Field::Sparse) && r.kind == Kind::File && c.blocks > 2 * r.blocks + 8 {
            out.push(format!("{n}: {} blocks allocated in the copy, {} in the reference (more than twice)", c.blocks, r.blocks));
        }
    }
    if has(Field::Kind) {
        for (name, c) in &copy.entries {
            if !reference.entries.contains_key(name) {
                out.push(format!("{}: in the copy only (a {:?})", shown(name), c.kind));
            }
        }
    }
    out
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Asserts that the trees at `reference` and `copy` agree in `fields`,
/// naming every difference.
#[track_caller]
pub fn assert_same(reference: &Path, copy: &Path, fields: &[Field]) {
    let (r, c) = (snapshot(reference).expect("snapshot of the reference"), snapshot(copy).expect("snapshot of the copy"));
    let diff = compare(&r, &c, fields);
    assert!(diff.is_empty(), "{} differs from {} in {} places:\n{}", copy.display(), reference.display(), diff.len(), diff.join("\n"));
}

/// Runs `rsync` with `args` (e.g. `-aHAX --numeric-ids`) from the contents
/// of `src` into `dst`: the reference a copy is compared with. Always with
/// `--modify-window=-1`: by default rsync takes times within one second for
/// equal, and leaves a directory it just made with the time it made it.
pub fn rsync(args: &[&str], src: &Path, dst: &Path) -> PathBuf {
    let mut from = src.as_os_str().to_owned();
    from.push("/");
    let out = std::process::Command::new("rsync")
        .args(args)
        .arg("--modify-window=-1")
        .arg(&from)
        .arg(dst)
        .output()
        .expect("rsync (apt install rsync)");
    assert!(out.status.success(), "rsync {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    dst.to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;
    use std::os::unix::fs::{symlink, PermissionsExt};

    /// A tree with one of several kinds of things, for the tests below.
    fn tree(root: &Path) {
        fs::create_dir_all(root.join("d/e")).unwrap();
        fs::write(root.join(OsStr::from_bytes(b"d/bad\xff")), "x").unwrap();
        fs::write(root.join("d/f"), "content").unwrap();
        fs::hard_link(root.join("d/f"), root.join("g")).unwrap();
        symlink("d/f", root.join("link")).unwrap();
        set_xattr(&root.join("d/f"), b"user.note", b"v");
    }

    #[test]
    fn a_snapshot_holds_names_as_bytes_links_inodes_and_xattrs() {
        let t = tempfile::tempdir().unwrap();
        tree(t.path());
        let s = snapshot(t.path()).unwrap();
        assert!(s.entries.contains_key(b"d/bad\xff".as_slice()));
        assert_eq!(s.entries[b"link".as_slice()].target.as_deref(), Some(b"d/f".as_slice()));
        assert_eq!(s.entries[b"g".as_slice()].inode_of.as_deref(), Some(b"d/f".as_slice()));
        assert_eq!(s.entries[b"d/f".as_slice()].inode_of.as_deref(), Some(b"d/f".as_slice()));
        assert_eq!(s.entries[b"d/f".as_slice()].xattrs.get(b"user.note".as_slice()).map(Vec::as_slice), Some(b"v".as_slice()));
        assert_eq!(compare(&s, &s.clone(), &Field::ALL), Vec::<String>::new());
    }

    /// Each field, changed in a copy, is named by the comparison.
    #[test]
    fn every_field_that_differs_is_named() {
        let t = tempfile::tempdir().unwrap();
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        tree(&a);
        let reference = snapshot(&a).unwrap();
        type Change<'a> = &'a dyn Fn(&Path);
        let changes: [(&str, Field, Change); 8] = [
            ("content", Field::Content, &|p| fs::write(p.join(OsStr::from_bytes(b"d/bad\xff")), "y").unwrap()),
            ("permissions", Field::Perm, &|p| fs::set_permissions(p.join("d/e"), fs::Permissions::from_mode(0o700)).unwrap()),
            ("mtime", Field::Mtime, &|p| {
                File::options()
                    .write(true)
                    .open(p.join(OsStr::from_bytes(b"d/bad\xff")))
                    .unwrap()
                    .set_modified(std::time::UNIX_EPOCH)
                    .unwrap()
            }),
            ("mtime", Field::DirMtime, &|p| File::open(p.join("d/e")).unwrap().set_modified(std::time::UNIX_EPOCH).unwrap()),
            ("symlink target", Field::Target, &|p| {
                fs::remove_file(p.join("link")).unwrap();
                symlink("d/g", p.join("link")).unwrap();
            }),
            ("xattrs", Field::Xattrs, &|p| {
                let c = CString::new(p.join("d/f").as_os_str().as_bytes()).unwrap();
                // SAFETY: NUL-terminated path and name.
                unsafe { libc::removexattr(c.as_ptr(), c"user.note".as_ptr()) };
            }),
            ("names", Field::HardLinks, &|p| {
                fs::remove_file(p.join("g")).unwrap();
                fs::write(p.join("g"), "content").unwrap();
            }),
            ("missing", Field::Kind, &|p| fs::remove_file(p.join(OsStr::from_bytes(b"d/bad\xff"))).unwrap()),
        ];
        for (words, field, change) in changes {
            let _ = fs::remove_dir_all(&b);
            rsync(&["-aHAX"], &a, &b);
            assert_eq!(compare(&reference, &snapshot(&b).unwrap(), &Field::ALL), Vec::<String>::new(), "rsync -aHAX");
            change(&b);
            let diff = compare(&reference, &snapshot(&b).unwrap(), &[field]);
            assert!(!diff.is_empty() && diff.iter().all(|d| d.contains(words)), "{field:?}: {diff:?}");
        }
    }
}
