//! A file is confirmed only once it is durable: the receiver — a server
//! taking an upload, or the client downloading or copying locally — makes
//! each file of a batch durable (its own `fsync`, not a sync of the whole
//! file system) before it renames it into place, and the directories it
//! was renamed into (and every new directory on the way up) after, before
//! it confirms it. Empty files, made in place, are synced after they are
//! made, many at once by one sync of their file system. Another name of a
//! file (`-H`) is synced after its rename, as a file is. Seen from outside
//! through strace, as the order of the receiver's writes, sync, mkdir,
//! create and rename calls, and of the debug log line ("committed") it
//! writes as it confirms a file; a client's report comes after them all.

mod util;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use util::*;

const FILES: usize = 300;

/// Which way the traced copy goes, and so which process is traced: the
/// one that receives and writes the files.
#[derive(Clone, Copy, Debug)]
enum Way {
    /// To a server's export: the server is traced.
    Upload,
    /// From a server's export to a local directory: the client is traced.
    Download,
    /// From a local directory to another: the client is traced.
    Local,
}

/// strace's arguments before the traced command: the write, sync, create
/// and rename calls of every thread, with the paths of descriptors (and
/// enough of what is written to read a log line), to `trace`.
fn strace(trace: &Path) -> Vec<std::ffi::OsString> {
    let calls = "trace=fsync,syncfs,openat,mkdir,mkdirat,rename,renameat,renameat2,write,pwrite64,pwritev,pwritev2,writev";
    let mut p: Vec<std::ffi::OsString> = ["strace", "-f", "-qq", "-y", "-s", "300", "-e", calls, "-o"].iter().map(Into::into).collect();
    p.push(trace.into());
    p
}

/// Copies `FILES` files of a size `size` draws in ten directories to a new
/// directory `dst` (in a server's export or a local directory, by `way`),
/// the receiving process running under strace, with `extra` cp flags;
/// returns the directory `dst` was made in and the receiver's sync, create
/// and rename calls.
fn copy_traced(way: Way, extra: &[&str], size: impl Fn(&mut Rng) -> u64) -> (PathBuf, Vec<Call>) {
    let env = Env::new();
    let export = env.mkdir("export");
    let src = env.mkdir("src");
    let mut rng = Rng::new(7);
    for i in 0..FILES {
        let n = size(&mut rng);
        make_file(&src.join(format!("d{}/f{i}.dat", i % 10)), n, &mut rng);
    }
    let trace = env.path("receiver.strace");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    if let Way::Upload = way {
        spec.prefix = strace(&trace);
        // The server is strace's child: have it killed when strace is, as
        // the test's kill reaches strace only.
        spec.prefix.extend(["setpriv", "--pdeathsig", "KILL"].iter().map(Into::into));
        // "PATH: committed" as it confirms each file.
        spec.envs.push(("DMOVER_LOG".into(), Some("debug".into())));
    }
    let srv = Server::start(spec);
    let local = env.mkdir("local");
    let (from, into) = match way {
        Way::Upload => (format!("{}/", src.display()), export.clone()),
        Way::Download => {
            fs::rename(&src, export.join("src")).unwrap();
            (srv.url("e/src/"), local.clone())
        }
        Way::Local => (format!("{}/", src.display()), local.clone()),
    };
    let to = match way {
        Way::Upload => srv.url("e/dst"),
        Way::Download | Way::Local => local.join("dst").display().to_string(),
    };
    let mut args = vec![from, to];
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut cp = env.cp(args);
    if !matches!(way, Way::Upload) {
        cp.prefix(strace(&trace)).env("DMOVER_LOG", "debug");
    }
    cp.run().assert_ok();
    let source = if let Way::Download = way { export.join("src") } else { src };
    assert_same_tree(&source, &into.join("dst"));
    drop(srv);
    (into.canonicalize().unwrap(), calls(&trace))
}

/// A successful system call of the server, with the lines of the trace
/// where it started and where it returned.
#[derive(Debug)]
struct Call {
    start: usize,
    end: usize,
    what: What,
}

#[derive(Debug, PartialEq)]
enum What {
    /// `fsync` of this path (a file or a directory).
    Sync(PathBuf),
    /// `syncfs` of the file system holding this path.
    SyncFs(PathBuf),
    /// A file made with `O_CREAT` at this path.
    Create(PathBuf),
    /// A directory made at this path.
    MakeDir(PathBuf),
    /// A rename of `from` to `to`.
    Rename { from: PathBuf, to: PathBuf },
    /// Data written to the file at this path.
    Write(PathBuf),
    /// A log line written to stderr: the file whose `NAME: committed` it is
    /// (the name as the log shows it), else None.
    Committed(Option<String>),
    /// The start of a JSON report written to stdout.
    Report,
}

/// The sync, create and rename calls that succeeded in a trace of `strace -f -y`,
/// whose calls may be split by other threads' into a start (`<unfinished
/// ...>`) and an end (`<... resumed>`).
fn calls(trace: &Path) -> Vec<Call> {
    let text = std::fs::read_to_string(trace).unwrap_or_else(|e| panic!("{}: {e} (is strace installed?)", trace.display()));
    let mut started: HashMap<&str, (usize, &str)> = HashMap::new();
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let Some((pid, rest)) = line.split_once(' ') else { continue };
        let rest = rest.trim_start();
        let (start, args) = if rest.starts_with("<...") {
            match started.remove(pid) {
                Some(s) => s,
                None => continue,
            }
        } else if rest.ends_with("<unfinished ...>") {
            started.insert(pid, (n, rest));
            continue;
        } else {
            (n, rest)
        };
        let Some((_, result)) = line.trim_end().rsplit_once(" = ") else { continue };
        if !result.starts_with(|c: char| c.is_ascii_digit()) {
            continue;
        }
        let what = if args.starts_with("write(2<") {
            let line = args.split_once('"').map_or("", |(_, l)| l);
            What::Committed(line.split_once("] ").and_then(|(_, m)| m.split_once(": committed\\n")).map(|(name, _)| name.to_string()))
        } else if args.starts_with("write(1<") && args.contains("\"{") {
            What::Report
        } else if args.starts_with("write(") || args.starts_with("writev(") || args.starts_with("pwrite") {
            match first_fd_path(args) {
                Some(p) => What::Write(p),
                None => continue,
            }
        } else if args.starts_with("fsync(") {
            What::Sync(fd_paths(args).remove(0))
        } else if args.starts_with("syncfs(") {
            What::SyncFs(fd_paths(args).remove(0))
        } else if args.starts_with("openat(") && args.contains("O_CREAT") {
            match fd_paths(result).pop() {
                Some(made) => What::Create(made),
                None => continue,
            }
        } else if args.starts_with("mkdir") {
            let (dirs, names) = (fd_paths(args), quoted(args));
            match (dirs.first(), names.first()) {
                (Some(at), Some(name)) => What::MakeDir(at.join(name)),
                (None, Some(name)) => What::MakeDir(PathBuf::from(name)),
                _ => panic!("line {n}: a mkdir not understood: {args}"),
            }
        } else if args.starts_with("rename") {
            let dirs = fd_paths(args);
            let names = quoted(args);
            let (from, to) = match (dirs.len(), names.len()) {
                (2, 2) => (dirs[0].join(&names[0]), dirs[1].join(&names[1])),
                (0, 2) => (PathBuf::from(&names[0]), PathBuf::from(&names[1])),
                _ => panic!("line {n}: a rename not understood: {args}"),
            };
            What::Rename { from, to }
        } else {
            continue;
        };
        out.push(Call { start, end: n, what });
    }
    out
}

/// The path of a call's first descriptor, `9</a/b>`, if it is a file's.
fn first_fd_path(args: &str) -> Option<PathBuf> {
    let (_, rest) = args.split_once('<')?;
    let (path, _) = rest.split_once(">, ")?;
    Some(PathBuf::from(path)).filter(|p| p.is_absolute())
}

/// The paths strace -y shows for descriptors: `9</a/b>`.
fn fd_paths(args: &str) -> Vec<PathBuf> {
    args.split('<').skip(1).filter_map(|p| p.split_once('>')).map(|(p, _)| PathBuf::from(p)).filter(|p| p.is_absolute()).collect()
}

/// The quoted strings of a call's arguments.
fn quoted(args: &str) -> Vec<String> {
    args.split('"').skip(1).step_by(2).map(str::to_string).collect()
}

/// Each way a copy writes files: to a server, and at the client from a
/// server or from a local directory.
const WAYS: [Way; 3] = [Way::Upload, Way::Download, Way::Local];

#[test]
fn files_are_synced_before_and_after_their_rename_and_no_fsync_skips_it() {
    for way in WAYS {
        let (into, calls) = copy_traced(way, &[], |rng| 1000 + rng.below(20_000));
        let synced = |path: &Path| {
            let what = What::Sync(path.to_path_buf());
            calls.iter().filter(move |c| c.what == what)
        };
        let renames: Vec<(&Call, &Path, &Path)> = calls
            .iter()
            .filter_map(|c| match &c.what {
                What::Rename { from, to } if from.to_string_lossy().ends_with(".dmover-part") => Some((c, from.as_path(), to.as_path())),
                _ => None,
            })
            .collect();
        assert_eq!(renames.len(), FILES, "{way:?}: every file is renamed into place once: {calls:#?}");
        let report = calls.iter().find(|c| c.what == What::Report);
        assert_eq!(report.is_some(), !matches!(way, Way::Upload), "{way:?}: the traced client's report (only a client reports)");
        for (r, from, to) in &renames {
            // Its data is written, then synced, then it is renamed ...
            let written = calls.iter().filter(|c| c.what == What::Write(from.to_path_buf())).map(|c| c.end).max();
            let written = written.unwrap_or_else(|| panic!("{way:?}: no write of {} in the trace", from.display()));
            let data_synced = synced(from).find(|s| s.start > written && s.end < r.start);
            let data_synced = data_synced.unwrap_or_else(|| {
                panic!(
                    "{way:?}: {} was not synced between its last write and its rename (trace lines {written}, {})",
                    to.display(),
                    r.start
                )
            });
            // ... and its directory synced after the rename ...
            let dir = to.parent().unwrap();
            let dir_synced = synced(dir).filter(|s| s.start > r.end).map(|s| s.end).min();
            let dir_synced =
                dir_synced.unwrap_or_else(|| panic!("{way:?}: {}: its directory was not synced after the rename", to.display()));
            // ... all before the receiver confirms it, and before a client reports success.
            let rel = to.strip_prefix(&into).unwrap().to_string_lossy().into_owned();
            let confirmed = calls
                .iter()
                .find(|c| matches!(&c.what, What::Committed(Some(n)) if n == &rel || n.ends_with(&format!("/{rel}"))))
                .unwrap_or_else(|| panic!("{way:?}: the receiver never logged {rel} as committed"));
            assert!(
                data_synced.end < confirmed.start && dir_synced < confirmed.start,
                "{way:?}: {rel} was confirmed at trace line {} before it was durable: its data synced at line {}, its directory at line {dir_synced}",
                confirmed.start,
                data_synced.end
            );
            if let Some(report) = report {
                assert!(dir_synced < report.start, "{way:?}: the client reported success before {rel}'s directory was synced");
            }
        }
        // The new directories' own names: each directory up to the one
        // `dst` was made in is synced after the directory below it on the
        // way to d3 was made there.
        let dst = into.join("dst");
        for (dir, made) in [(dst.clone(), dst.join("d3")), (into.clone(), dst.clone())] {
            let what = What::MakeDir(made.clone());
            let made_at =
                calls.iter().find(|c| c.what == what).unwrap_or_else(|| panic!("{way:?}: {} was never made: {calls:#?}", made.display()));
            let durable = synced(&dir).any(|s| s.start > made_at.end);
            assert!(durable, "{way:?}: {} was never synced after {} was made in it", dir.display(), made.display());
        }
        let syncs = calls.iter().filter(|c| matches!(c.what, What::Sync(_))).count();
        eprintln!("{way:?}: {FILES} files committed with {syncs} syncs");

        let (_, calls) = copy_traced(way, &["--no-fsync"], |rng| 1000 + rng.below(20_000));
        assert!(!calls.iter().any(|c| matches!(c.what, What::Sync(_) | What::SyncFs(_))), "{way:?} --no-fsync: a sync: {calls:#?}");
        let renamed = calls.iter().filter(|c| matches!(c.what, What::Rename { .. })).count();
        assert_eq!(renamed, FILES, "{way:?} --no-fsync: every file renamed once: {calls:#?}");
    }
}

#[test]
fn empty_files_are_synced_after_they_are_made_many_by_one_sync_of_their_file_system() {
    for way in WAYS {
        let (into, calls) = copy_traced(way, &[], |_| 0);
        let dst = into.join("dst");
        let made: Vec<(&Call, &Path)> = calls
            .iter()
            .filter_map(|c| match &c.what {
                What::Create(p) if p.starts_with(&dst) && p.extension().is_some_and(|e| e == "dat") => Some((c, p.as_path())),
                _ => None,
            })
            .collect();
        assert_eq!(made.len(), FILES, "{way:?}: every empty file is made in place, once: {calls:#?}");
        let whole: Vec<&Call> = calls.iter().filter(|c| matches!(&c.what, What::SyncFs(p) if p.starts_with(&into))).collect();
        for (c, path) in &made {
            let own = What::Sync(path.to_path_buf());
            let dir = What::Sync(path.parent().unwrap().to_path_buf());
            let after = |w: &What| calls.iter().any(|s| s.start > c.end && s.what == *w);
            let by_whole = whole.iter().any(|s| s.start > c.end);
            assert!(by_whole || after(&own), "{way:?}: {} was never synced after it was made", path.display());
            assert!(by_whole || after(&dir), "{way:?}: {}: its directory was not synced after it was made", path.display());
        }
        let syncs = calls.iter().filter(|c| matches!(c.what, What::Sync(_) | What::SyncFs(_))).count();
        let took = format!("{way:?}: {FILES} empty files took {syncs} syncs, {} of them of the file system", whole.len());
        assert!(!whole.is_empty() && syncs < FILES / 4, "{took}");
    }
}

/// Another name of a file (`-H`) is made durable as a file is: made under
/// a temporary name, renamed into place, and its directory synced after,
/// before the copy confirms it. Every name is counted, whichever of a
/// file's two names the walk found first.
#[test]
fn other_names_of_a_file_are_synced_after_their_rename() {
    use std::os::unix::fs::MetadataExt;
    const GROUPS: usize = 20;
    let env = Env::new();
    let src = env.mkdir("src");
    fs::create_dir_all(src.join("names")).unwrap();
    let mut rng = Rng::new(9);
    for i in 0..GROUPS {
        let file = src.join(format!("d{}/f{i}.dat", i % 3));
        make_file(&file, 1000 + rng.below(5000), &mut rng);
        fs::hard_link(&file, src.join(format!("names/n{i}.dat"))).unwrap();
    }
    let trace = env.path("receiver.strace");
    let local = env.mkdir("local");
    let mut cp = env.cp([format!("{}/", src.display()), local.join("dst").display().to_string(), "-H".into()]);
    cp.prefix(strace(&trace));
    cp.run().assert_ok();
    let dst = local.canonicalize().unwrap().join("dst");
    for i in 0..GROUPS {
        let ino = |p: String| fs::metadata(dst.join(p)).unwrap().ino();
        assert_eq!(ino(format!("d{}/f{i}.dat", i % 3)), ino(format!("names/n{i}.dat")), "group {i} arrived as two files");
    }
    let calls = calls(&trace);
    let renames: Vec<(&Call, &Path)> = calls
        .iter()
        .filter_map(|c| match &c.what {
            What::Rename { from, to } if from.to_string_lossy().ends_with(".dmover-part") => Some((c, to.as_path())),
            _ => None,
        })
        .collect();
    assert_eq!(renames.len(), 2 * GROUPS, "every name is renamed into place once: {calls:#?}");
    for (r, to) in renames {
        let dir = What::Sync(to.parent().unwrap().to_path_buf());
        assert!(calls.iter().any(|s| s.start > r.end && s.what == dir), "{}: its directory was not synced after the rename", to.display());
    }
}
