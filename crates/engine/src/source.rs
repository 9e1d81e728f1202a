//! Source specifications and the tree walk that turns them into files.
//!
//! A source is a file, a directory (walked recursively) or a glob, as in
//! DMOVER's SrcDirRoot + SrcRelPath: the glob's directory part is the root,
//! and each match keeps its path below it. Names follow rsync: `dir` is sent
//! as `dir/...`, `dir/` as its contents. The walk streams entries to a
//! callback as it finds them, so sending starts at once and memory does not
//! grow with the tree. Symlinks are not followed (they are reported and
//! skipped), and dmover's own partial files are never sent.

use crate::error::Error;
use crate::fsroot::Root;
use crate::recv::MODE_DIR;
use dmover_proto::frame::FileMeta;
use dmover_proto::ErrorKind;
use globset::{GlobBuilder, GlobMatcher};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

/// Suffix of a file being received; never sent.
pub const PART_SUFFIX: &str = ".dmover-part";
/// Directory of resume state in a destination; never sent.
pub const STATE_DIR: &str = ".dmover-partial";

/// A file found by the walk (or an empty directory: its mode says so).
#[derive(Debug, Clone)]
pub struct Entry {
    /// Where to read it.
    pub path: PathBuf,
    /// Its name at the destination and its attributes.
    pub meta: FileMeta,
    /// Its inode change time (s, ns) when listed. Every write, chmod or
    /// utime moves it, and no one can set it back, so it reveals a change
    /// that restores the modification time.
    pub ctime: (i64, i64),
}

/// Something the walk reports besides files.
pub enum Event {
    File(Entry),
    /// A source or a file that could not be listed.
    Error(Error),
    /// A symlink that was skipped.
    SkippedLink(String),
}

fn is_glob(s: &str) -> bool {
    s.contains(['*', '?', '[', '{'])
}

/// The file's attributes as sent in an announcement.
pub fn meta_of(name: String, m: &fs::Metadata) -> FileMeta {
    FileMeta { path: name, size: m.len(), mtime_s: m.mtime(), mtime_ns: m.mtime_nsec() as u32, mode: m.mode() & 0o7777 }
}

/// The entry for the file at `path` with metadata `m`, named `name`.
pub fn entry(path: PathBuf, name: String, m: &fs::Metadata) -> Entry {
    Entry { path, meta: meta_of(name, m), ctime: (m.ctime(), m.ctime_nsec()) }
}

/// Walks every source under `root`, calling `emit` for each event; stops
/// early if `emit` returns false.
pub fn walk(root: &Root, specs: &[String], emit: &mut dyn FnMut(Event) -> bool) {
    for spec in specs {
        if !walk_spec(root, spec, emit) {
            return;
        }
    }
}

fn walk_spec(root: &Root, spec: &str, emit: &mut dyn FnMut(Event) -> bool) -> bool {
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
        let base_path = match root.resolve(&base) {
            Ok(p) => p,
            Err(e) => return emit(Event::Error(e)),
        };
        let mut matched = false;
        let ok = walk_dir(root, base_path, String::new(), Some((&glob, depth)), &mut |ev| {
            matched |= matches!(ev, Event::File(_));
            emit(ev)
        });
        if ok && !matched {
            return emit(Event::Error(Error::new(ErrorKind::NotFound, root.display(spec), "no file matches this pattern")));
        }
        return ok;
    }
    let path = match root.resolve(trimmed) {
        Ok(p) => p,
        Err(e) => return emit(Event::Error(e)),
    };
    let m = match fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(e) => return emit(Event::Error(Error::io(root.display(trimmed), &e))),
    };
    let base_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if m.is_dir() {
        let prefix = if contents_only { String::new() } else { base_name };
        walk_dir(root, path, prefix, None, emit)
    } else if m.is_file() {
        emit(Event::File(entry(path, base_name, &m)))
    } else if m.file_type().is_symlink() && !root.is_confined() {
        // A symlink named on the command line is followed, as cp and rsync do.
        match fs::metadata(&path) {
            Ok(m) if m.is_file() => emit(Event::File(entry(path, base_name, &m))),
            Ok(_) => walk_dir(root, path, if contents_only { String::new() } else { base_name }, None, emit),
            Err(e) => emit(Event::Error(Error::io(trimmed, &e))),
        }
    } else {
        emit(Event::Error(Error::new(ErrorKind::NotFound, root.display(trimmed), "not a regular file or directory")))
    }
}

/// Depth-first walk of `dir`, whose entries are named `prefix/...`. With a
/// glob, entries are named relative to `dir` and only matches are sent (a
/// matching directory is sent whole).
fn walk_dir(root: &Root, dir: PathBuf, prefix: String, glob: Option<(&GlobMatcher, usize)>, emit: &mut dyn FnMut(Event) -> bool) -> bool {
    // (directory, its name, depth below the glob base, inside a matched directory)
    let mut stack = vec![(dir, prefix, 0usize, glob.is_none())];
    while let Some((dir, name, depth, take_all)) = stack.pop() {
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) => {
                if !emit(Event::Error(Error::io(root.label_of(&dir), &e))) {
                    return false;
                }
                continue;
            }
        };
        let mut entries = 0usize;
        for ent in rd {
            entries += 1;
            let ent = match ent {
                Ok(e) => e,
                Err(e) => {
                    if !emit(Event::Error(Error::io(root.label_of(&dir), &e))) {
                        return false;
                    }
                    continue;
                }
            };
            let fname = ent.file_name().to_string_lossy().into_owned();
            let child = dmover_proto::path::join(&name, &fname);
            let ft = match ent.file_type() {
                Ok(t) => t,
                Err(_) => continue,
            };
            let matched = take_all || glob.is_some_and(|(g, _)| g.is_match(&child));
            if ft.is_symlink() {
                if matched && !emit(Event::SkippedLink(child)) {
                    return false;
                }
            } else if ft.is_dir() {
                if fname == STATE_DIR {
                    continue;
                }
                let deeper = glob.is_some_and(|(_, d)| depth + 1 < d);
                if matched || deeper {
                    stack.push((ent.path(), child, depth + 1, matched));
                }
            } else if ft.is_file() && matched && !fname.ends_with(PART_SUFFIX) {
                let ev = match ent.metadata() {
                    Ok(m) => Event::File(entry(ent.path(), child, &m)),
                    Err(e) => Event::Error(Error::io(root.label_of(&ent.path()), &e)),
                };
                if !emit(ev) {
                    return false;
                }
            }
        }
        // An empty directory is sent as itself, so that it exists at the destination.
        if entries == 0 && take_all && !name.is_empty() {
            let ev = match fs::symlink_metadata(&dir) {
                Ok(m) => {
                    let e = entry(dir, name, &m);
                    Event::File(Entry { meta: FileMeta { size: 0, mode: MODE_DIR | (m.mode() & 0o7777), ..e.meta }, ..e })
                }
                Err(e) => Event::Error(Error::io(root.label_of(&dir), &e)),
            };
            if !emit(ev) {
                return false;
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Result;

    fn collect(root: &Root, specs: &[String]) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        let mut err = None;
        walk(root, specs, &mut |ev| {
            match ev {
                Event::File(e) => out.push(e),
                Event::Error(e) => err = Some(e),
                Event::SkippedLink(_) => {}
            }
            err.is_none()
        });
        match err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    fn names(root: &Root, spec: &str) -> Vec<String> {
        let mut v: Vec<String> = collect(root, &[spec.to_string()]).unwrap().into_iter().map(|e| e.meta.path).collect();
        v.sort();
        v
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
        let r = Root::export("e", t.path()).unwrap();
        assert_eq!(names(&r, "d"), ["d/a.dat", "d/b.txt", "d/s/c.dat", "d/s/t/e.dat"]);
        assert_eq!(names(&r, "d/"), ["a.dat", "b.txt", "s/c.dat", "s/t/e.dat"]);
        assert_eq!(names(&r, "d/*.dat"), ["a.dat"]);
        assert_eq!(names(&r, "d/*/*.dat"), ["s/c.dat"]);
        assert_eq!(names(&r, "d/**/*.dat"), ["a.dat", "s/c.dat", "s/t/e.dat"]);
        assert_eq!(names(&r, "d/s"), ["s/c.dat", "s/t/e.dat"]);
        assert_eq!(names(&r, "d/a.dat"), ["a.dat"]);
        assert_eq!(names(&r, "*"), ["d/a.dat", "d/b.txt", "d/s/c.dat", "d/s/t/e.dat", "e/empty"]);
        assert_eq!(names(&r, "e"), ["e/empty"]);
        assert_eq!(names(&r, "e/empty/"), Vec::<String>::new());
        assert_eq!(collect(&r, &["d/*.zip".into()]).unwrap_err().kind, ErrorKind::NotFound);
        assert_eq!(collect(&r, &["nope".into()]).unwrap_err().kind, ErrorKind::NotFound);
        assert_eq!(collect(&r, &["../d".into()]).unwrap_err().kind, ErrorKind::Refused);
    }
}
