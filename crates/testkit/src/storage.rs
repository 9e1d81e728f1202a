//! The conformance suite every [`Storage`] implementation must pass.
//!
//! [`run`] gives each check a fresh, empty storage from the caller's
//! factory and reports every check that failed, by name. The checks use
//! the interface alone, except those on confinement: an export
//! ([`Subject::export`]) must say it is confined and refuse paths leading
//! out, and one backed by a directory on disk ([`Subject::disk`]) is also
//! tried with symlinks and hard links planted on the disk, leading out.
//! Whether the confinement checks run is the caller's word, never the
//! storage's own: only the local file system skips them.
//!
//! An object store ([`Subject::objects`]) is held to what objects can do:
//! a file exists once committed (nothing of one dropped before is seen,
//! though what it sent may be kept, for [`Storage::reopen`] to take it up
//! again), a committed file is never reopened for writing, and
//! directories are the prefixes of the names below them (making one does
//! nothing, none is empty, and they have no modes of their own). The checks of those things alone are
//! skipped for it, each saying why; the rest hold for it as for files.

use dmover_engine::error::classify;
use dmover_engine::storage::{self, Attrs, Kind, Storage, Store};
use dmover_proto::ErrorKind;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// A storage under test.
pub struct Subject {
    pub store: Store,
    /// Prefix of every path the checks use: empty for a storage whose
    /// paths are relative to its root, an empty directory for a local one.
    pub base: PathBuf,
    /// The directory on disk the storage's root is, if it is one; the
    /// confinement checks plant links there.
    pub disk: Option<PathBuf>,
    /// A directory outside the storage, on the same disk, holding a file
    /// `secret`: nothing may read it or write next to it through a confined storage.
    pub outside: PathBuf,
    /// Kept alive while the check runs (temporary directories).
    pub keep: Vec<Box<dyn std::any::Any>>,
    /// An object store: see the module's documentation.
    pub objects: bool,
    /// An export: it must be confined beneath its root, and every
    /// confinement check applies. Only the local file system is not one.
    pub export: bool,
}

impl Subject {
    fn p(&self, rel: &str) -> PathBuf {
        self.base.join(rel)
    }

    fn s(&self) -> &dyn Storage {
        self.store.as_ref()
    }
}

type Check = fn(&Subject);

/// Runs every check, each on a fresh subject; panics listing the checks
/// that failed and why.
pub fn run(make: &dyn Fn() -> Subject) {
    let checks: &[(&str, Check)] = &[
        ("an export is confined, the local file system is not", confined_if_export),
        ("the root is an empty directory", root_is_empty_dir),
        ("is_empty_dir is true of a missing or empty directory (resume state aside), false above a file", is_empty_dir_sees_files),
        ("make_dirs makes every level and may run again", make_dirs_every_level),
        ("create, write at offsets, read back", write_and_read_back),
        ("create replaces what had the name, owner-only", create_replaces),
        ("reopen finds a file created earlier, and nothing else", reopen_finds_own_files),
        ("commit sets attributes and renames into place", commit_renames),
        ("commit replaces an existing file", commit_replaces),
        ("a file created for a name leaves it untouched until commit", create_for_leaves_dest),
        ("a file taken up again is committed from where it was, keeping what it holds", reopened_commits),
        ("create_empty makes an empty file in place, only where nothing has the name", create_empty_in_place),
        ("remove and remove_dir", removes),
        ("make_dir sets its mode and refuses a file in the way", make_dir_modes),
        ("list names every entry with its kind and size", lists),
        ("read_all stops at its limit", read_all_limit),
        ("missing paths are NotFound", missing_is_not_found),
        ("writes from several threads at once", parallel_writes),
        ("digest_of reads the whole file", digests),
        ("make_link keeps a target as data, replacing what had the name", links_round_trip),
        ("hard_link gives a file another name, replacing what had it, never through a symlink", hard_links),
        ("data_from names every byte of data, and the holes a disk keeps", data_runs),
        ("write_zeros leaves zeros, a hole on a disk, and makes the file long enough", zeros_written),
        ("confined: '..' and absolute paths are refused", refuses_leaving_paths),
        ("confined: a directory symlink leads nowhere", dir_symlink_leads_nowhere),
        ("confined: a file symlink is never read or written through", file_symlink_not_followed),
        ("confined: a hard link is not taken up as our own", hard_link_not_reopened),
        ("a FIFO is never waited for, read or taken up as a file", fifo_not_waited_for),
    ];
    let mut failed = Vec::new();
    for (name, check) in checks {
        let subject = make();
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| check(&subject))) {
            let why = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            failed.push(format!("{name}: {why}"));
        }
    }
    assert!(failed.is_empty(), "{} of {} storage checks failed:\n{}", failed.len(), checks.len(), failed.join("\n"));
}

/// Creates `rel` with `data`, committed under its own name.
fn write_file(t: &Subject, rel: &str, data: &[u8]) {
    let f = t.s().create(&t.p(rel)).unwrap_or_else(|e| panic!("create {rel}: {e}"));
    f.write_all_at(data, 0).unwrap();
    close(t, f, rel);
}

/// Done writing `rel`: an object store's file is committed under its own
/// name, another storage's is just closed (it exists already).
fn close(t: &Subject, f: Box<dyn storage::WriteFile>, rel: &str) {
    if t.objects {
        f.commit(&t.p(rel), None).unwrap_or_else(|e| panic!("commit {rel}: {e}"));
    }
}

/// Skips the rest of a check for an object store, saying why.
fn not_for_objects(t: &Subject, why: &str) -> bool {
    if t.objects {
        eprintln!("storage check skipped for an object store: {why}");
    }
    t.objects
}

fn read(t: &Subject, rel: &str) -> Vec<u8> {
    t.s().read_all(&t.p(rel), 1 << 30).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

fn refused(r: io::Result<impl Sized>, what: &str) {
    match r {
        Ok(_) => panic!("{what}: allowed, should be refused"),
        Err(e) => assert_eq!(classify(&e), ErrorKind::Refused, "{what}: {e}"),
    }
}

fn confined_if_export(t: &Subject) {
    let what = if t.export { "an export" } else { "the local file system" };
    assert_eq!(t.s().features().confined, t.export, "{what} says confined = {}", t.s().features().confined);
}

fn root_is_empty_dir(t: &Subject) {
    assert_eq!(t.s().stat(&t.p("")).unwrap().kind, Kind::Dir);
    assert!(t.s().list(&t.p("")).unwrap().is_empty());
}

fn is_empty_dir_sees_files(t: &Subject) {
    let empty = |rel: &str| t.s().is_empty_dir(&t.p(rel)).unwrap();
    assert!(empty(""), "the root holds nothing");
    assert!(empty("missing"), "a missing directory holds nothing");
    if !t.objects {
        // An object store keeps resume state in a state store of its own.
        t.s().make_dirs(&t.p(storage::STATE_DIR)).unwrap();
        write_file(t, &format!("{}/transfer-x", storage::STATE_DIR), b"resume state");
        assert!(empty(""), "resume state is not what a directory holds");
        t.s().make_dirs(&t.p("d/sub")).unwrap();
        assert!(empty("d/sub"), "a directory just made holds nothing");
        assert!(!empty("d"), "a directory holding a directory holds something");
        t.s().make_dirs(&t.p("d/deep")).unwrap();
    }
    write_file(t, "d/deep/f", b"x");
    for d in ["", "d", "d/deep"] {
        assert!(!empty(d), "{d:?} holds d/deep/f");
    }
}

fn make_dirs_every_level(t: &Subject) {
    t.s().make_dirs(&t.p("a/b/c")).unwrap();
    t.s().make_dirs(&t.p("a/b/c")).unwrap();
    if t.objects {
        // Directories appear with the first object below them.
        write_file(t, "a/b/c/f", b"x");
    }
    for d in ["a", "a/b", "a/b/c"] {
        assert!(t.s().stat(&t.p(d)).unwrap().is_dir(), "{d} is not a directory");
    }
}

fn write_and_read_back(t: &Subject) {
    t.s().make_dirs(&t.p("d")).unwrap();
    let f = t.s().create(&t.p("d/f")).unwrap();
    f.write_all_at(b"world", 6).unwrap();
    f.write_all_at(b"hello ", 0).unwrap();
    let mut buf = [0u8; 11];
    assert_eq!(f.read_at(&mut buf, 0).unwrap(), 11);
    assert_eq!(&buf, b"hello world");
    assert_eq!(f.stat().unwrap().size, 11);
    close(t, f, "d/f");
    assert_eq!(read(t, "d/f"), b"hello world");
    let r = t.s().open(&t.p("d/f")).unwrap();
    let mut tail = [0u8; 16];
    assert_eq!(r.read_at(&mut tail, 6).unwrap(), 5, "a read past the end returns what is there");
    assert_eq!(r.read_at(&mut tail, 11).unwrap(), 0, "a read at the end returns 0");
    if not_for_objects(t, "a committed object cannot be reopened and shortened") {
        return;
    }
    let w = t.s().reopen(&t.p("d/f")).unwrap().expect("reopen");
    w.set_len(5).unwrap();
    assert_eq!(read(t, "d/f"), b"hello");
}

fn create_replaces(t: &Subject) {
    write_file(t, "f", b"old content");
    let f = t.s().create(&t.p("f")).unwrap();
    assert_eq!(f.stat().unwrap().size, 0, "create must start an empty file");
    assert_eq!(f.stat().unwrap().mode & 0o077, 0, "a new file is readable by its owner only");
}

fn reopen_finds_own_files(t: &Subject) {
    assert!(t.s().reopen(&t.p("nothing")).unwrap().is_none());
    write_file(t, "f", b"abc");
    if t.objects {
        assert!(t.s().reopen(&t.p("f")).unwrap().is_none(), "an object is never reopened for writing");
        return;
    }
    let f = t.s().reopen(&t.p("f")).unwrap().expect("a file created earlier");
    f.write_all_at(b"d", 3).unwrap();
    assert_eq!(read(t, "f"), b"abcd");
    t.s().make_dirs(&t.p("dir")).unwrap();
    assert!(t.s().reopen(&t.p("dir")).map(|f| f.is_none()).unwrap_or(true), "a directory is not a file to write");
}

fn commit_renames(t: &Subject) {
    t.s().make_dirs(&t.p("d")).unwrap();
    let f = t.s().create(&t.p("d/.f.part")).unwrap();
    f.write_all_at(b"data", 0).unwrap();
    let attrs = Attrs { mode: 0o640, mtime: Some((1_000_000_000, 123_456_789)), digest: None, ..Default::default() };
    f.commit(&t.p("d/f"), Some(&attrs)).unwrap();
    drop(f);
    let s = t.s().stat(&t.p("d/f")).unwrap();
    assert_eq!((s.kind, s.size, s.mode, s.mtime), (Kind::File, 4, 0o640, (1_000_000_000, 123_456_789)));
    assert_eq!(t.s().stat(&t.p("d/.f.part")).unwrap_err().kind(), io::ErrorKind::NotFound);
    // Across directories too.
    t.s().make_dirs(&t.p("e")).unwrap();
    let g = t.s().create(&t.p("d/g")).unwrap();
    g.commit(&t.p("e/g"), None).unwrap();
    assert!(t.s().stat(&t.p("e/g")).unwrap().is_file());
}

fn commit_replaces(t: &Subject) {
    write_file(t, "f", b"old old old");
    let f = t.s().create(&t.p(".f.part")).unwrap();
    f.write_all_at(b"new", 0).unwrap();
    f.commit(&t.p("f"), None).unwrap();
    assert_eq!(read(t, "f"), b"new");
}

/// Large enough that an object store sends it in several parts.
const SEVERAL_PARTS: usize = 40 << 20;

fn create_for_leaves_dest(t: &Subject) {
    write_file(t, "f", b"old old old");
    let data: Vec<u8> = (0..SEVERAL_PARTS).map(|i| (i % 251) as u8).collect();
    // Written whole, then given up: the old file is as it was.
    let f = t.s().create_for(&t.p(".f.part"), &t.p("f")).unwrap();
    f.write_all_at(&data, 0).unwrap();
    assert_eq!(read(t, "f"), b"old old old", "changed before commit");
    t.s().remove(&t.p(".f.part")).unwrap();
    drop(f);
    assert_eq!(read(t, "f"), b"old old old", "changed by a file given up");
    // Written again and committed: the new file, with its attributes.
    let f = t.s().create_for(&t.p(".f.part"), &t.p("f")).unwrap();
    f.write_all_at(&data, 0).unwrap();
    let attrs = Attrs { mode: 0o640, mtime: Some((1_000_000_000, 5)), digest: None, ..Default::default() };
    f.commit(&t.p("f"), Some(&attrs)).unwrap();
    drop(f);
    assert!(read(t, "f") == data, "not the file committed");
    let s = t.s().stat(&t.p("f")).unwrap();
    assert_eq!((s.size, s.mode, s.mtime), (data.len() as u64, 0o640, (1_000_000_000, 5)));
    assert_eq!(t.s().stat(&t.p(".f.part")).unwrap_err().kind(), io::ErrorKind::NotFound);
}

fn reopened_commits(t: &Subject) {
    const BLOCK: usize = 1 << 20;
    // Large enough that an object store has sent parts of it, which it
    // keeps for a later run once the file is dropped uncommitted.
    let data: Vec<u8> = (0..SEVERAL_PARTS + 12345).map(|i| (i % 253) as u8).collect();
    t.s().make_dirs(&t.p("d")).unwrap();
    let f = t.s().create_for(&t.p("d/.f.part"), &t.p("d/f")).unwrap();
    f.write_all_at(&data, 0).unwrap();
    drop(f);
    let f = t.s().reopen(&t.p("d/.f.part")).unwrap().expect("the file written earlier is taken up again");
    // What it does not hold is written again, as a resumed transfer does.
    for (i, block) in data.chunks(BLOCK).enumerate() {
        let off = (i * BLOCK) as u64;
        if !f.holds(off, block.len() as u64) {
            f.write_all_at(block, off).unwrap();
        }
    }
    let attrs = Attrs { mode: 0o640, mtime: Some((1_000_000_000, 7)), ..Default::default() };
    f.commit(&t.p("d/f"), Some(&attrs)).unwrap_or_else(|e| panic!("commit of a file taken up again: {e}"));
    drop(f);
    assert!(read(t, "d/f") == data, "not the file written");
    let s = t.s().stat(&t.p("d/f")).unwrap();
    assert_eq!((s.size, s.mode, s.mtime), (data.len() as u64, 0o640, (1_000_000_000, 7)));
    assert_eq!(t.s().stat(&t.p("d/.f.part")).unwrap_err().kind(), io::ErrorKind::NotFound, "left under its temporary name");
}

fn create_empty_in_place(t: &Subject) {
    let attrs = Attrs { mode: 0o640, mtime: Some((1_000_000_000, 123_456_789)), digest: None, ..Default::default() };
    t.s().make_dirs(&t.p("d")).unwrap();
    let Some(f) = t.s().create_empty(&t.p("d/e"), &attrs).unwrap() else {
        // A storage that makes files only by committing them declines.
        assert!(t.s().stat(&t.p("d/e")).is_err(), "create_empty declined but made something");
        return;
    };
    f.sync().unwrap();
    drop(f);
    let s = t.s().stat(&t.p("d/e")).unwrap();
    assert_eq!((s.kind, s.size, s.mode, s.mtime), (Kind::File, 0, 0o640, (1_000_000_000, 123_456_789)));
    assert!(t.s().create_empty(&t.p("d/e"), &attrs).unwrap().is_none(), "made again over a file that has the name");
    write_file(t, "d/full", b"content");
    assert!(t.s().create_empty(&t.p("d/full"), &attrs).unwrap().is_none(), "made over a file with content");
    assert_eq!(read(t, "d/full"), b"content", "a file with the name was changed");
    assert_eq!(t.s().create_empty(&t.p("nope/e"), &attrs).err().expect("in a missing directory").kind(), io::ErrorKind::NotFound);
}

fn removes(t: &Subject) {
    t.s().remove(&t.p("never-there")).unwrap();
    t.s().make_dirs(&t.p("d")).unwrap();
    write_file(t, "d/f", b"x");
    assert!(t.s().remove_dir(&t.p("d")).is_err(), "a directory with a file in it is not removed");
    t.s().remove(&t.p("d/f")).unwrap();
    assert_eq!(t.s().stat(&t.p("d/f")).unwrap_err().kind(), io::ErrorKind::NotFound);
    t.s().remove_dir(&t.p("d")).unwrap();
    assert_eq!(t.s().stat(&t.p("d")).unwrap_err().kind(), io::ErrorKind::NotFound);
}

fn make_dir_modes(t: &Subject) {
    if not_for_objects(t, "an object store keeps no empty directories and no modes of directories") {
        return;
    }
    t.s().make_dir(&t.p("d"), 0o750).unwrap();
    assert_eq!(t.s().stat(&t.p("d")).unwrap().mode, 0o750);
    t.s().make_dir(&t.p("d"), 0o705).unwrap();
    assert_eq!(t.s().stat(&t.p("d")).unwrap().mode, 0o705, "an existing directory takes the new mode");
    write_file(t, "f", b"x");
    assert!(t.s().make_dir(&t.p("f"), 0o755).is_err(), "a file in the way is an error");
    assert!(t.s().stat(&t.p("f")).unwrap().is_file(), "and stays a file");
}

fn lists(t: &Subject) {
    t.s().make_dirs(&t.p("d/sub")).unwrap();
    if t.objects {
        write_file(t, "d/sub/x", b"");
    }
    write_file(t, "d/a", b"12345");
    let mut got: Vec<(String, Kind, u64)> = t
        .s()
        .list(&t.p("d"))
        .unwrap()
        .into_iter()
        .map(|e| {
            let s = e.stat.unwrap();
            (e.name.to_string_lossy().into_owned(), s.kind, if s.is_file() { s.size } else { 0 })
        })
        .collect();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got, vec![("a".to_string(), Kind::File, 5), ("sub".to_string(), Kind::Dir, 0)]);
}

fn read_all_limit(t: &Subject) {
    write_file(t, "f", &[7; 100]);
    assert_eq!(t.s().read_all(&t.p("f"), 100).unwrap().len(), 100);
    assert!(t.s().read_all(&t.p("f"), 99).is_err(), "a file over the limit is not read");
}

fn missing_is_not_found(t: &Subject) {
    let nf = io::ErrorKind::NotFound;
    assert_eq!(t.s().stat(&t.p("nope")).unwrap_err().kind(), nf);
    assert_eq!(t.s().open(&t.p("nope")).err().expect("open of a missing file").kind(), nf);
    assert_eq!(t.s().list(&t.p("nope")).unwrap_err().kind(), nf);
    if not_for_objects(t, "no directory has to exist for an object to be made below it") {
        return;
    }
    assert_eq!(t.s().create(&t.p("nope/f")).err().expect("create in a missing directory").kind(), nf);
}

fn parallel_writes(t: &Subject) {
    const PART: usize = 64 * 1024;
    let f = t.s().create(&t.p("f")).unwrap();
    std::thread::scope(|sc| {
        for i in 0..8u8 {
            let f = &f;
            sc.spawn(move || f.write_all_at(&vec![i; PART], i as u64 * PART as u64).unwrap());
        }
    });
    close(t, f, "f");
    let all = read(t, "f");
    assert_eq!(all.len(), 8 * PART);
    for (i, part) in all.chunks(PART).enumerate() {
        assert!(part.iter().all(|b| *b == i as u8), "part {i} was not written whole");
    }
}

fn digests(t: &Subject) {
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 31 % 251) as u8).collect();
    write_file(t, "f", &data);
    let sums: Vec<_> = data.chunks(65536).map(dmover_proto::digest::block_sum).collect();
    let want = dmover_proto::digest::file_digest(&sums);
    assert_eq!(storage::digest_of(t.s(), &t.p("f"), 65536).unwrap(), want);
}

/// A symlink's target is kept byte for byte and never followed: relative,
/// absolute, dangling, not UTF-8. make_link replaces a file or a link at
/// the name, never writing through either.
fn links_round_trip(t: &Subject) {
    t.s().make_dirs(&t.p("d")).unwrap();
    write_file(t, "d/f", b"the file");
    let mtime = (1_500_000_000, 123_456_789);
    let targets: [(&str, &[u8]); 4] = [("rel", b"f"), ("abs", b"/etc/hostname"), ("dangling", b"no/such/file"), ("odd", b"../f\xff\n")];
    for (name, target) in targets {
        let p = t.p(&format!("d/{name}"));
        t.s()
            .make_link(&p, target, &Attrs { mtime: Some(mtime), ..Default::default() })
            .unwrap_or_else(|e| panic!("make_link {name}: {e}"));
        assert_eq!(t.s().read_link(&p).unwrap(), target, "{name}'s target");
        let s = t.s().stat(&p).unwrap();
        assert_eq!((s.kind, s.mtime), (Kind::Symlink, mtime), "{name}");
    }
    let mut listed: Vec<(String, Kind)> =
        t.s().list(&t.p("d")).unwrap().into_iter().map(|e| (e.name.to_string_lossy().into_owned(), e.stat.unwrap().kind)).collect();
    listed.sort_by(|a, b| a.0.cmp(&b.0));
    let want = [("abs", Kind::Symlink), ("dangling", Kind::Symlink), ("f", Kind::File), ("odd", Kind::Symlink), ("rel", Kind::Symlink)];
    assert_eq!(listed, want.map(|(n, k)| (n.to_string(), k)), "the listing");
    // Over the link to d/f: the link changes, d/f does not.
    t.s().make_link(&t.p("d/rel"), b"elsewhere", &Attrs::default()).unwrap();
    assert_eq!(t.s().read_link(&t.p("d/rel")).unwrap(), b"elsewhere");
    assert_eq!(read(t, "d/f"), b"the file", "written through a symlink");
    // Over a file: the file is gone, the name is a link.
    t.s().make_link(&t.p("d/f"), b"rel", &Attrs::default()).unwrap();
    assert_eq!(t.s().stat(&t.p("d/f")).unwrap().kind, Kind::Symlink, "the file is still there");
    assert_eq!(t.s().read_link(&t.p("d/f")).unwrap(), b"rel");
    let names = t.s().list(&t.p("d")).unwrap().into_iter().filter(|e| e.name == "f").count();
    assert_eq!(names, 1, "the name listed twice");
    assert!(t.s().read_link(&t.p("d/nope")).is_err(), "read_link of nothing");
}

/// A file takes another name, in another directory, over a file and over
/// a symlink (which is replaced, not followed); one that is a name of it
/// already stays. On a disk the names share the inode; an object store
/// keeps a copy under each. A symlink is never what a name is given to.
fn hard_links(t: &Subject) {
    t.s().make_dirs(&t.p("d")).unwrap();
    t.s().make_dirs(&t.p("e")).unwrap();
    write_file(t, "d/f", b"the file");
    write_file(t, "e/old", b"an old file");
    t.s().make_link(&t.p("e/sym"), b"../d/other", &Attrs::default()).unwrap();
    write_file(t, "d/other", b"another file");
    for name in ["e/new", "e/old", "e/sym", "e/new"] {
        t.s().hard_link(&t.p("d/f"), &t.p(name)).unwrap_or_else(|e| panic!("hard_link d/f to {name}: {e}"));
        assert_eq!(read(t, name), b"the file", "{name}");
        let (f, s) = (t.s().stat(&t.p("d/f")).unwrap(), t.s().stat(&t.p(name)).unwrap());
        assert_eq!(s.kind, Kind::File, "{name}");
        if !t.objects {
            assert_eq!(s.inode, f.inode, "{name} is not a name of d/f");
            assert!(s.inode.is_some(), "a disk's file has an inode");
        }
    }
    assert_eq!(read(t, "d/other"), b"another file", "written through a symlink");
    if !t.objects {
        assert_eq!(t.s().stat(&t.p("d/f")).unwrap().nlink, 4, "d/f's names");
    }
    let left: Vec<_> = t.s().list(&t.p("e")).unwrap().into_iter().map(|e| e.name.to_string_lossy().into_owned()).collect();
    assert_eq!(left.len(), 3, "a temporary name was left: {left:?}");
    assert!(t.s().hard_link(&t.p("e/sym-gone"), &t.p("e/x")).is_err(), "hard_link of nothing");
    t.s().make_link(&t.p("d/s"), b"f", &Attrs::default()).unwrap();
    assert!(t.s().hard_link(&t.p("d/s"), &t.p("e/y")).is_err(), "a symlink was given another name");
    assert!(t.s().stat(&t.p("e/y")).is_err(), "e/y was made");
}

/// The runs of data `f` names ([`storage::ReadFile::data_from`]), cut at
/// `size`, each checked to start where it was asked or after and to be
/// longer than nothing.
fn runs_of(f: &dyn storage::ReadFile, size: u64) -> Vec<std::ops::Range<u64>> {
    let mut runs = Vec::new();
    let mut off = 0;
    while off < size {
        let Some(run) = f.data_from(off).unwrap() else { break };
        assert!(run.start >= off && run.end > run.start, "data_from({off}) named {run:?}");
        if run.start >= size {
            break;
        }
        runs.push(run.start..run.end.min(size));
        off = run.end;
    }
    runs
}

/// Bytes the runs cover.
fn covered(runs: &[std::ops::Range<u64>]) -> u64 {
    runs.iter().map(|r| r.end - r.start).sum()
}

fn data_runs(t: &Subject) {
    const MIB: u64 = 1 << 20;
    let size = 8 * MIB + 4096;
    let page = vec![7u8; 4096];
    // A page of data at 1 MiB and one at the end; zeros between, written
    // as a receiver writes the blocks of a hole.
    let f = t.s().create(&t.p("f")).unwrap();
    f.write_zeros(0, MIB, true).unwrap();
    f.write_all_at(&page, MIB).unwrap();
    f.write_zeros(MIB + 4096, size - 4096 - (MIB + 4096), true).unwrap();
    f.write_all_at(&page, size - 4096).unwrap();
    close(t, f, "f");
    let mut want = vec![0u8; size as usize];
    want[MIB as usize..][..4096].fill(7);
    want[size as usize - 4096..].fill(7);
    assert!(read(t, "f") == want, "the file does not read back as written");
    let r = t.s().open(&t.p("f")).unwrap();
    let runs = runs_of(r.as_ref(), size);
    for data in [MIB..MIB + 4096, size - 4096..size] {
        assert!(runs.iter().any(|r| r.start <= data.start && r.end >= data.end), "data at {data:?} is in no run of {runs:?}");
    }
    if t.disk.is_some() {
        assert!(covered(&runs) <= 2 * MIB, "the file system holds holes, but {runs:?} names most of the file as data");
    }
}

fn zeros_written(t: &Subject) {
    const K: u64 = 1024;
    // Zeros over bytes written before (a resumed file), and past the end.
    let f = t.s().create(&t.p("f")).unwrap();
    f.write_all_at(&vec![0xff; 256 * K as usize], 0).unwrap();
    f.write_zeros(64 * K, 128 * K, false).unwrap();
    f.write_zeros(256 * K, 100, true).unwrap();
    close(t, f, "f");
    let got = read(t, "f");
    assert_eq!(got.len() as u64, 256 * K + 100, "write_zeros past the end does not make the file that long");
    let want = |i: usize| if (64 * K..192 * K).contains(&(i as u64)) || i as u64 >= 256 * K { 0 } else { 0xff };
    assert!(got.iter().enumerate().all(|(i, b)| *b == want(i)), "the zeros did not replace what was written");
    if t.disk.is_some() {
        let r = t.s().open(&t.p("f")).unwrap();
        let runs = runs_of(r.as_ref(), 256 * K + 100);
        assert!(covered(&runs) <= 136 * K, "no hole was punched where zeros replaced data: {runs:?}");
    }
}

/// The subject's disk directory, if it is an export on disk.
fn confined_disk(t: &Subject) -> Option<&Path> {
    t.disk.as_deref().filter(|_| t.export)
}

fn refuses_leaving_paths(t: &Subject) {
    if !t.export {
        return;
    }
    refused(t.s().stat(Path::new("../x")), "stat ../x");
    refused(t.s().open(Path::new("/etc/passwd")), "open /etc/passwd");
    refused(t.s().create(Path::new("a/../../x")), "create a/../../x");
    refused(t.s().make_dirs(Path::new("../x")), "make_dirs ../x");
}

fn dir_symlink_leads_nowhere(t: &Subject) {
    let Some(disk) = confined_disk(t) else { return };
    std::os::unix::fs::symlink(&t.outside, disk.join("l")).unwrap();
    let s = t.s();
    assert_eq!(s.stat(Path::new("l")).unwrap().kind, Kind::Symlink);
    refused(s.stat(Path::new("l/secret")), "stat through a symlink");
    refused(s.open(Path::new("l/secret")), "open through a symlink");
    refused(s.list(Path::new("l")), "list a symlink");
    refused(s.create(Path::new("l/new")), "create through a symlink");
    refused(s.make_dirs(Path::new("l/sub")), "make_dirs through a symlink");
    refused(s.make_dirs(Path::new("l")), "make_dirs onto a symlink");
    refused(s.remove(Path::new("l/secret")), "remove through a symlink");
    let attrs = Attrs { mode: 0o644, mtime: None, digest: None, ..Default::default() };
    refused(s.create_empty(Path::new("l/new"), &attrs), "create_empty through a symlink");
    assert!(s.reopen(Path::new("l/secret")).is_err(), "reopen through a symlink");
    refused(s.sync_file_systems(&[Path::new("l")]), "sync the file system of a symlink");
    s.make_dirs(Path::new("d")).unwrap();
    let f = s.create(Path::new("d/.f")).unwrap();
    refused(f.commit(Path::new("l/f"), None), "commit through a symlink");
    std::fs::write(disk.join("d/mine"), b"mine").unwrap();
    refused(s.hard_link(Path::new("l/secret"), Path::new("d/taken")), "hard_link to a file through a symlink");
    refused(s.hard_link(Path::new("d/mine"), Path::new("l/new")), "hard_link a name through a symlink");
    assert!(!disk.join("d/taken").exists(), "a link to the secret outside was made");
    let outside: Vec<_> = std::fs::read_dir(&t.outside).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(outside, ["secret"], "something was written outside");
    assert!(t.outside.join("secret").exists(), "the secret outside was removed");
}

fn file_symlink_not_followed(t: &Subject) {
    let Some(disk) = confined_disk(t) else { return };
    let secret = t.outside.join("secret");
    let before = std::fs::read(&secret).unwrap();
    std::os::unix::fs::symlink(&secret, disk.join("lf")).unwrap();
    let s = t.s();
    refused(s.open(Path::new("lf")), "open a symlink");
    assert!(s.reopen(Path::new("lf")).unwrap().is_none(), "a symlink is not a file of ours");
    assert!(s.read_all(Path::new("lf"), 1 << 20).is_err(), "read_all of a symlink");
    let attrs = Attrs { mode: 0o666, mtime: Some((1, 0)), digest: None, ..Default::default() };
    assert!(s.create_empty(Path::new("lf"), &attrs).unwrap().is_none(), "create_empty over a symlink");
    assert_eq!(s.stat(Path::new("lf")).unwrap().kind, Kind::Symlink, "create_empty touched the symlink");
    let f = s.create(Path::new("lf")).unwrap();
    f.write_all_at(b"mine", 0).unwrap();
    assert_eq!(s.stat(Path::new("lf")).unwrap().kind, Kind::File, "create replaces the symlink");
    assert_eq!(std::fs::read(&secret).unwrap(), before, "the file the symlink led to changed");
}

fn hard_link_not_reopened(t: &Subject) {
    let Some(disk) = confined_disk(t) else { return };
    let target = disk.join("target");
    std::fs::write(&target, b"other file").unwrap();
    std::fs::hard_link(&target, disk.join("hl")).unwrap();
    assert!(t.s().reopen(Path::new("hl")).unwrap().is_none(), "a file with another name is not taken up");
    let f = t.s().create(Path::new("hl")).unwrap();
    f.write_all_at(b"mine", 0).unwrap();
    assert_eq!(std::fs::read(&target).unwrap(), b"other file", "written through a hard link");
}

/// A FIFO planted at a name (by anyone who can write the directory) is
/// refused at once: a plain open of it waits for a writer that never comes.
fn fifo_not_waited_for(t: &Subject) {
    use std::os::unix::ffi::OsStrExt;
    let Some(disk) = &t.disk else { return };
    let fifo = std::ffi::CString::new(disk.join("fifo").as_os_str().as_bytes()).unwrap();
    // SAFETY: `fifo` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0, "mkfifo: {}", io::Error::last_os_error());
    let (store, p) = (t.store.clone(), t.p("fifo"));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let s = store.as_ref();
        let _ = tx.send((s.open(&p).map(drop), s.read_all(&p, 1 << 20).map(drop), s.reopen(&p).map(|f| f.is_some())));
    });
    let (open, read_all, reopen) = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("a FIFO was waited for");
    refused(open, "open a FIFO");
    refused(read_all, "read_all of a FIFO");
    assert!(!reopen.unwrap(), "a FIFO was taken up as a file of ours");
    let f = t.s().create(&t.p("fifo")).unwrap();
    f.write_all_at(b"mine", 0).unwrap();
    assert_eq!(t.s().stat(&t.p("fifo")).unwrap().kind, Kind::File, "create replaces the FIFO");
}
