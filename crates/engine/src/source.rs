//! Source specifications and the tree walk that turns them into files.
//!
//! A source is a file, a directory (walked recursively) or a glob, as in
//! DMOVER's SrcDirRoot + SrcRelPath: the glob's directory part is the root,
//! and each match keeps its path below it. Names follow rsync: `dir` is sent
//! as `dir/...`, `dir/` as its contents. The walk streams entries to a
//! callback as it finds them, so sending starts at once and memory does not
//! grow with the tree. Symlinks are not followed: each is reported with its
//! target, for a copy to keep as a link (`--links`) or skip. dmover's own
//! partial files are never sent.

use crate::error::Error;
use crate::storage::{self, DirEntry, Kind, Stat, Storage};
use dmover_proto::digest::{block_sum, Sum};
use dmover_proto::frame::FileMeta;
use dmover_proto::ErrorKind;
use globset::{GlobBuilder, GlobMatcher};
use std::collections::hash_map::Entry as Slot;
use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::thread::ScopedJoinHandle;

pub use crate::storage::{part_name, PART_SUFFIX, STATE_DIR};

/// A file found by the walk (or an empty directory: its mode says so).
#[derive(Debug, Clone)]
pub struct Entry {
    /// Where to read it: its path in the storage walked.
    pub path: PathBuf,
    /// Its name at the destination and its attributes.
    pub meta: FileMeta,
    /// Its inode change time (s, ns) when listed. Every write, chmod or
    /// utime moves it, and no one can set it back, so it reveals a change
    /// that restores the modification time.
    pub ctime: (i64, i64),
    /// Its user and group ids, where the storage keeps owners.
    pub owner: Option<(u32, u32)>,
    /// Its device and inode, when it is a regular file with more than one
    /// name (hard links); None otherwise.
    pub inode: Option<(u64, u64)>,
}

/// Something the walk reports besides files.
pub enum Event {
    File(Entry),
    /// A source or a file that could not be listed.
    Error(Error),
    /// A symlink, with its target: copied as one where links are kept,
    /// else skipped.
    Link(Entry),
    /// A directory that is not empty, with its attributes (an empty one
    /// comes as a [`Event::File`] whose mode says directory).
    Dir(Entry),
    /// A device, FIFO or socket: copied as one where the transfer asks
    /// (`--devices`, `--specials`), else skipped.
    Special(Entry),
}

impl Event {
    /// What takes a name of its own at the destination: a file, symlink,
    /// device, FIFO or socket (not a directory, which many sources share).
    fn named(&self) -> Option<&Entry> {
        match self {
            Event::File(e) | Event::Link(e) | Event::Special(e) if !e.meta.is_dir() => Some(e),
            _ => None,
        }
    }
}

/// The files with more than one name (hard links) a walk found, by device
/// and inode, each with the first of its names found: later names of the
/// same file are other names of it. A file with one name is never held,
/// so what this keeps grows with the files that have more than one.
#[derive(Debug, Default)]
pub struct LinkGroups {
    first: HashMap<(u64, u64), String>,
}

/// What a walked file's name is to [`LinkGroups`].
#[derive(Debug, PartialEq, Eq)]
pub enum LinkName {
    /// The file has one name.
    Only,
    /// The first name found of a file with more.
    First,
    /// Another name of the file first found under this name.
    Another(String),
}

impl LinkGroups {
    /// What `e`'s name is, remembering it if it is the first found of a
    /// file with more than one name.
    pub fn name(&mut self, e: &Entry) -> LinkName {
        let Some(inode) = e.inode else { return LinkName::Only };
        match self.first.entry(inode) {
            Slot::Vacant(v) => {
                v.insert(e.meta.path.clone());
                LinkName::First
            }
            Slot::Occupied(o) => LinkName::Another(o.get().clone()),
        }
    }

    /// Files held (with more than one name).
    pub fn len(&self) -> usize {
        self.first.len()
    }

    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }
}

/// Whether a source names files by a pattern.
pub fn is_glob(s: &str) -> bool {
    s.contains(['*', '?', '[', '{'])
}

/// The entry for the file at `path` with attributes `s`, named `name`.
pub fn entry(path: PathBuf, name: String, s: &Stat) -> Entry {
    let meta = FileMeta { path: name, size: s.size, mtime_s: s.mtime.0, mtime_ns: s.mtime.1, mode: s.mode, ..Default::default() };
    let inode = s.inode.filter(|_| s.is_file() && s.nlink > 1);
    Entry { path, meta, ctime: s.ctime, owner: s.owner, inode }
}

/// The entry of the symlink at `path`, named `name`, with its target.
fn link(store: &dyn Storage, path: PathBuf, name: String, s: &Stat) -> Event {
    match store.read_link(&path) {
        Ok(target) => {
            let e = entry(path, name, s);
            let target = Some(dmover_proto::path::from_bytes(&target).into_owned());
            Event::Link(Entry { meta: FileMeta { size: 0, mode: FileMeta::LINK | s.mode & 0o7777, target, ..e.meta }, ..e })
        }
        Err(e) => Event::Error(Error::io(store.display(&path), &e)),
    }
}

/// Lists what `spec` names in `store`, as a copy of it would send it:
/// `emit` gets each file (and empty directory) and returns false to stop.
/// Fails with the first error only if nothing was listed; later errors
/// concern single entries and are logged.
pub fn list(store: &dyn Storage, spec: &str, emit: &mut dyn FnMut(FileMeta) -> bool) -> Result<(), Error> {
    let mut listed = false;
    let mut first_error = None;
    walk(store, &[spec.to_string()], &mut |ev| match ev {
        Event::File(e) => {
            listed = true;
            emit(e.meta)
        }
        Event::Error(e) => {
            log::info!("listing {}: {e}", storage::display_spelled(store, spec));
            first_error.get_or_insert(e);
            true
        }
        Event::Link(e) => {
            listed = true;
            emit(e.meta)
        }
        Event::Dir(_) | Event::Special(_) => true,
    });
    match first_error {
        Some(e) if !listed => Err(e),
        _ => Ok(()),
    }
}

/// Walks every source in `store`, calling `emit` for each event; stops
/// early if `emit` returns false.
///
/// One source's walk never names two files alike (a directory holds a
/// name once, and names are kept as bytes). Several sources may: `a/` and
/// `b/` both holding `x`. The second file to take a name is then an error,
/// never sent over the first (the same file listed twice, by overlapping
/// sources, is sent once). Only then are names remembered: 32 bytes each.
pub fn walk(store: &dyn Storage, specs: &[String], emit: &mut dyn FnMut(Event) -> bool) {
    walk_following(store, specs, false, emit)
}

/// As [`walk`]; with `follow` (`--copy-links`), a symlink inside a source
/// is taken as what it leads to (a file, a directory walked in turn, a
/// device), as `rsync -L` takes it: only in a storage that is not
/// confined (the user's own files), never in an export; a dangling one is
/// an error, and one that leads to a directory above it (a loop) too.
pub fn walk_following(store: &dyn Storage, specs: &[String], follow: bool, emit: &mut dyn FnMut(Event) -> bool) {
    let mut names: Option<HashMap<Sum, Sum>> = (specs.len() > 1).then(HashMap::new);
    let mut emit = |ev: Event| {
        let (Some(names), Some(e)) = (&mut names, ev.named()) else { return emit(ev) };
        let from = block_sum(e.path.as_os_str().as_bytes());
        match names.entry(block_sum(e.meta.path.as_bytes())) {
            Slot::Vacant(v) => {
                v.insert(from);
                emit(ev)
            }
            Slot::Occupied(o) if *o.get() == from => true,
            Slot::Occupied(_) => {
                let message = format!(
                    "another source has a file named {} too, and both would land on one destination file: the first is copied, this one is not (copy them to different destinations)",
                    dmover_proto::path::printable(&e.meta.path)
                );
                emit(Event::Error(Error::new(ErrorKind::Usage, store.display(&e.path), message)))
            }
        }
    };
    for spec in specs {
        if !walk_spec(store, spec, follow, &mut emit) {
            return;
        }
    }
}

fn walk_spec(store: &dyn Storage, spec: &str, follow: bool, emit: &mut dyn FnMut(Event) -> bool) -> bool {
    let contents_only = spec.ends_with('/') || spec.is_empty();
    let trimmed = if spec.len() > 1 { spec.trim_end_matches('/') } else { spec };
    let comps: Vec<&str> = trimmed.split('/').collect();
    if let Some(g) = comps.iter().position(|c| is_glob(c)) {
        let base = if g == 0 && trimmed.starts_with('/') { "/".to_string() } else { comps[..g].join("/") };
        let pattern = comps[g..].join("/");
        let glob = match GlobBuilder::new(&pattern).literal_separator(true).build() {
            Ok(g) => g.compile_matcher(),
            Err(e) => return emit(Event::Error(Error::new(ErrorKind::Usage, spec, format!("bad glob: {e}")))),
        };
        let depth = if pattern.contains("**") { usize::MAX } else { comps.len() - g };
        let base = match storage::checked_path(store, &base) {
            Ok(p) => p,
            Err(e) => return emit(Event::Error(e)),
        };
        let mut matched = false;
        let ok = walk_dir(store, base, String::new(), Some((&glob, depth)), follow, &mut |ev| {
            matched |= matches!(ev, Event::File(_));
            emit(ev)
        });
        if ok && !matched {
            return emit(Event::Error(Error::new(
                ErrorKind::NotFound,
                storage::display_spelled(store, spec),
                "no file matches this pattern",
            )));
        }
        return ok;
    }
    let path = match storage::checked_path(store, trimmed) {
        Ok(p) => p,
        Err(e) => return emit(Event::Error(e)),
    };
    let m = match store.stat(&path) {
        Ok(m) => m,
        Err(e) => return emit(Event::Error(Error::io(store.display(&path), &e))),
    };
    let base_name = path.file_name().map(|n| dmover_proto::path::from_bytes(n.as_bytes()).into_owned()).unwrap_or_default();
    match m.kind {
        Kind::Dir => {
            let prefix = if contents_only { String::new() } else { base_name };
            walk_dir(store, path, prefix, None, follow, emit)
        }
        Kind::File => emit(Event::File(entry(path, base_name, &m))),
        // A symlink named on the command line is followed, as cp and rsync do.
        Kind::Symlink if !store.features().confined => match store.stat_followed(&path) {
            Ok(m) if m.is_file() => emit(Event::File(entry(path, base_name, &m))),
            Ok(_) => walk_dir(store, path, if contents_only { String::new() } else { base_name }, None, follow, emit),
            Err(e) => emit(Event::Error(Error::io(trimmed, &e))),
        },
        _ => emit(Event::Error(Error::new(ErrorKind::NotFound, store.display(&path), "not a regular file or directory"))),
    }
}

/// What the symlink at `path` leads to (`--copy-links`): an error if
/// nothing, or a directory it is inside (a loop).
fn followed(store: &dyn Storage, path: &std::path::Path) -> Result<Stat, Error> {
    let m = store.stat_followed(path).map_err(|e| Error::io(store.display(path), &e))?;
    if m.is_dir() {
        let (at, to) = (std::fs::canonicalize(path.parent().unwrap_or(path)), std::fs::canonicalize(path));
        if let (Ok(at), Ok(to)) = (at, to) {
            if at.starts_with(&to) {
                return Err(Error::new(
                    ErrorKind::Usage,
                    store.display(path),
                    "a symlink to a directory above it: followed (--copy-links), it would never end",
                ));
            }
        }
    }
    Ok(m)
}

/// Depth-first walk of `dir`, whose entries are named `prefix/...`. With a
/// glob, entries are named relative to `dir` and only matches are sent (a
/// matching directory is sent whole). Where the storage lists several
/// directories at once ([`Features::lists_at_once`](storage::Features::lists_at_once)), the next ones on the
/// way are listed while one is being sent; entries come in the same order.
fn walk_dir(
    store: &dyn Storage,
    dir: PathBuf,
    prefix: String,
    glob: Option<(&GlobMatcher, usize)>,
    follow: bool,
    emit: &mut dyn FnMut(Event) -> bool,
) -> bool {
    let follow = follow && !store.features().confined;
    let ahead = store.features().lists_at_once.saturating_sub(1);
    std::thread::scope(|scope| {
        // Directories being listed ahead, by path.
        let mut listing: HashMap<PathBuf, ScopedJoinHandle<std::io::Result<Vec<DirEntry>>>> = HashMap::new();
        // (directory, its name, depth below the glob base, inside a matched
        // directory, its attributes as its parent's listing gave them)
        let mut stack = vec![(dir, prefix, 0usize, glob.is_none(), None)];
        while let Some((dir, name, depth, take_all, listed_stat)) = stack.pop() {
            let listed = match listing.remove(&dir) {
                Some(lister) => lister.join().unwrap_or_else(|_| Err(std::io::Error::other("the listing thread panicked"))),
                None => store.list(&dir),
            };
            let entries = match listed {
                Ok(rd) => rd,
                Err(e) => {
                    if !emit(Event::Error(Error::io(store.display(&dir), &e))) {
                        return false;
                    }
                    continue;
                }
            };
            // Empty, for the receiver to make: holding no file or directory
            // that is sent (only symlinks, devices and the like, which a copy
            // may pass over, or dmover's own partial files), as rsync makes
            // every directory it walks.
            let empty = !entries.iter().any(|e| match &e.stat {
                Ok(st) if st.kind == Kind::File => !e.name.as_bytes().ends_with(PART_SUFFIX.as_bytes()),
                Ok(st) if st.kind == Kind::Dir => e.name != STATE_DIR,
                Ok(_) => false,
                Err(_) => true,
            });
            for ent in entries {
                let fname = dmover_proto::path::from_bytes(ent.name.as_bytes());
                let child = dmover_proto::path::join(&name, &fname);
                let path = dir.join(&ent.name);
                let st = match ent.stat {
                    Ok(s) => s,
                    Err(e) => {
                        if !emit(Event::Error(Error::io(store.display(&path), &e))) {
                            return false;
                        }
                        continue;
                    }
                };
                let matched = take_all || glob.is_some_and(|(g, _)| g.is_match(&child));
                let st = match (st.kind, follow && matched) {
                    (Kind::Symlink, true) => match followed(store, &path) {
                        Ok(m) => m,
                        Err(e) => {
                            if !emit(Event::Error(e)) {
                                return false;
                            }
                            continue;
                        }
                    },
                    _ => st,
                };
                let go_on = match st.kind {
                    Kind::Symlink if matched && !fname.ends_with(PART_SUFFIX) => emit(link(store, path, child, &st)),
                    Kind::Dir if fname == STATE_DIR => true,
                    Kind::Dir => {
                        let deeper = glob.is_some_and(|(_, d)| depth + 1 < d);
                        if matched || deeper {
                            stack.push((path, child, depth + 1, matched, Some(st)));
                        }
                        true
                    }
                    Kind::File if matched && !fname.ends_with(PART_SUFFIX) => emit(Event::File(entry(path, child, &st))),
                    Kind::Special(kind) if matched => {
                        let e = entry(path, child, &st);
                        emit(Event::Special(Entry { meta: FileMeta { size: 0, mode: kind | st.mode, rdev: st.rdev, ..e.meta }, ..e }))
                    }
                    _ => true,
                };
                if !go_on {
                    return false;
                }
            }
            // A directory is sent as itself: an empty one (above) as a file,
            // so that it exists at the destination; any other as its
            // attributes, for the receiver to give it once its files are in. (A directory an
            // object store implies, a key prefix, has no attributes.)
            if take_all && !name.is_empty() {
                let ev = match listed_stat.map_or_else(|| store.stat(&dir), Ok) {
                    Ok(m) if !empty && m.mtime == storage::NO_TIME => None,
                    Ok(m) => {
                        let e = entry(dir, name, &m);
                        let e = Entry { meta: FileMeta { size: 0, mode: FileMeta::DIR | m.mode, ..e.meta }, ..e };
                        Some(if empty { Event::File(e) } else { Event::Dir(e) })
                    }
                    Err(e) => Some(Event::Error(Error::io(store.display(&dir), &e))),
                };
                if ev.is_some_and(|ev| !emit(ev)) {
                    return false;
                }
            }
            for (next, ..) in stack.iter().rev().take(ahead) {
                if !listing.contains_key(next) {
                    let next = next.clone();
                    listing.insert(next.clone(), scope.spawn(move || store.list(&next)));
                }
            }
        }
        true
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Result;
    use std::fs;

    fn collect(root: &dyn Storage, specs: &[String]) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        let mut err = None;
        walk(root, specs, &mut |ev| {
            match ev {
                Event::File(e) => out.push(e),
                Event::Error(e) => err = Some(e),
                Event::Link(_) | Event::Dir(_) | Event::Special(_) => {}
            }
            err.is_none()
        });
        match err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    fn names(root: &dyn Storage, spec: &str) -> Vec<String> {
        let mut v: Vec<String> = collect(root, &[spec.to_string()]).unwrap().into_iter().map(|e| e.meta.path).collect();
        v.sort();
        v
    }

    /// A walked tree of 200 files with one name and two files with three
    /// and two: the groups hold the two files alone, and each later name
    /// is another name of the first walked.
    #[test]
    fn link_groups_hold_only_files_with_more_than_one_name() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path();
        fs::create_dir_all(d.join("t/a/b")).unwrap();
        for i in 0..200 {
            fs::write(d.join(format!("t/one{i}")), b"x").unwrap();
        }
        fs::write(d.join("t/three"), b"3").unwrap();
        fs::hard_link(d.join("t/three"), d.join("t/a/three")).unwrap();
        fs::hard_link(d.join("t/three"), d.join("t/a/b/three")).unwrap();
        fs::write(d.join("t/a/two"), b"2").unwrap();
        fs::hard_link(d.join("t/a/two"), d.join("t/two")).unwrap();
        let store = storage::export("t", d).unwrap();
        let entries = collect(store.as_ref(), &["t".to_string()]).unwrap();
        let mut groups = LinkGroups::default();
        let (mut firsts, mut others) = (HashMap::new(), Vec::new());
        for e in &entries {
            assert_eq!(e.inode.is_some(), !e.meta.path.contains("one"), "{}: {:?}", e.meta.path, e.inode);
            match groups.name(e) {
                LinkName::Only => assert!(e.meta.path.contains("one"), "{} taken for a file with one name", e.meta.path),
                LinkName::First => assert!(firsts.insert(e.inode, e.meta.path.clone()).is_none()),
                LinkName::Another(first) => others.push((e.meta.path.clone(), first, e.inode)),
            }
        }
        assert_eq!(groups.len(), 2, "{groups:?}");
        assert_eq!(others.len(), 3, "{others:?}");
        for (name, first, inode) in others {
            assert_eq!(firsts.get(&inode), Some(&first), "{name}");
        }
    }

    #[test]
    fn a_partial_files_name_fits_whatever_the_name() {
        use std::ffi::OsStr;
        assert_eq!(part_name(OsStr::new("a.dat")), ".a.dat.dmover-part");
        let (a, b) = ("x".repeat(254) + "a", "x".repeat(254) + "b");
        let (pa, pb) = (part_name(OsStr::new(&a)), part_name(OsStr::new(&b)));
        assert!(pa.len() <= 255 && pb.len() <= 255, "{} {}", pa.len(), pb.len());
        assert_ne!(pa, pb, "two long names share a partial file");
        assert!(pa.to_str().unwrap().ends_with(PART_SUFFIX) && pa.to_str().unwrap().starts_with('.'));
        assert_eq!(pa, part_name(OsStr::new(&a)), "the same on every run");
    }

    #[test]
    fn names_follow_rsync_and_globs_keep_their_relative_path() {
        let t = tempfile::tempdir().unwrap();
        for p in ["d/a.dat", "d/b.txt", "d/s/c.dat", "d/s/t/e.dat"] {
            let p = t.path().join(p);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, b"x").unwrap();
        }
        fs::write(t.path().join("d/s/.x.dmover-part"), b"x").unwrap();
        fs::create_dir_all(t.path().join("e/empty")).unwrap();
        let r = storage::export("e", t.path()).unwrap();
        let r = r.as_ref();
        assert_eq!(names(r, "d"), ["d/a.dat", "d/b.txt", "d/s/c.dat", "d/s/t/e.dat"]);
        assert_eq!(names(r, "d/"), ["a.dat", "b.txt", "s/c.dat", "s/t/e.dat"]);
        assert_eq!(names(r, "d/*.dat"), ["a.dat"]);
        assert_eq!(names(r, "d/*/*.dat"), ["s/c.dat"]);
        assert_eq!(names(r, "d/**/*.dat"), ["a.dat", "s/c.dat", "s/t/e.dat"]);
        assert_eq!(names(r, "d/s"), ["s/c.dat", "s/t/e.dat"]);
        assert_eq!(names(r, "d/a.dat"), ["a.dat"]);
        assert_eq!(names(r, "*"), ["d/a.dat", "d/b.txt", "d/s/c.dat", "d/s/t/e.dat", "e/empty"]);
        assert_eq!(names(r, "e"), ["e/empty"]);
        assert_eq!(names(r, "e/empty/"), Vec::<String>::new());
        assert_eq!(collect(r, &["d/*.zip".into()]).unwrap_err().kind, ErrorKind::NotFound);
        assert_eq!(collect(r, &["nope".into()]).unwrap_err().kind, ErrorKind::NotFound);
        assert_eq!(collect(r, &["../d".into()]).unwrap_err().kind, ErrorKind::Refused);
    }
}
