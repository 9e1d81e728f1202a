//! Trees moved whole: every name arrives as the source file system holds
//! it, byte for byte, through every path a copy can take (local, upload,
//! download, third party, ssh), and two files never land on one name. The
//! oracle is rsync: each copy is compared, field by field, with what
//! `rsync -a` made of the same tree (`dmover_testkit::tree`).

mod util;

use dmover_testkit::tree::{self, Field};
use std::ffi::OsStr;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use util::*;

/// Names a file system holds that are easy to lose: two that differ only
/// in a byte that is not UTF-8 (a lossy conversion makes them one), a
/// newline, backslashes (one followed by what looks like an escape), a
/// right-to-left override, and a directory whose name is not UTF-8.
const NAMES: [&[u8]; 8] = [
    b"bad\xff.bin",
    b"bad\xfe.bin",
    b"new\nline.txt",
    b"back\\slash",
    b"looks\\xffescaped",
    "\u{202e}gpj.exe".as_bytes(),
    b"d\xe9j\xe0/inner.dat",
    b"plain/\xc3(.dat",
];

/// A tree holding each of [`NAMES`], each file with content of its own.
fn odd_names(root: &Path) -> PathBuf {
    for (i, name) in NAMES.iter().enumerate() {
        let p = root.join(OsStr::from_bytes(name));
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, format!("file {i}: {}", name.escape_ascii()).repeat(i + 1)).unwrap();
    }
    root.to_path_buf()
}

/// What dmover keeps of a tree of files and directories today.
const KEPT: [Field; 5] = [Field::Kind, Field::Content, Field::Perm, Field::Mtime, Field::DirMtime];

/// Asserts that `dst` holds every name of [`NAMES`] as bytes, each with its
/// own content, as `rsync -a` copied them, and nothing else (the report's
/// count agrees).
#[track_caller]
fn assert_names_kept(src: &Path, dst: &Path, report: &serde_json::Value) {
    let reference = src.with_extension("rsync");
    if !reference.exists() {
        tree::rsync(&["-a"], src, &reference);
    }
    tree::assert_same(&reference, dst, &KEPT);
    for name in NAMES {
        let (a, b) = (src.join(OsStr::from_bytes(name)), dst.join(OsStr::from_bytes(name)));
        assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap_or_default(), "{}", name.escape_ascii());
    }
    assert_eq!(u(&report["files"]), NAMES.len() as u64, "{report:#}");
}

/// A copy with the arguments given, once it has `cp`'s own.
type Copy<'a> = &'a dyn Fn(&[&str]) -> Run;

/// Copies the contents of `src` with `args` through every path — into a
/// local directory, up to a server, down from it, from it to a second
/// server (third party), up to a host reached over ssh and back down — and hands
/// `check` each copy (to run, with more arguments if it likes, and run
/// again) and where it lands. The servers let clients set owners
/// (`--allow-owners`).
fn every_path(env: &Env, src: &Path, args: &[&str], check: &mut dyn FnMut(Copy, &Path)) {
    let (ea, eb) = (env.mkdir("export-a"), env.mkdir("export-b"));
    let serve = |name: &str, dir: &Path| {
        let mut spec = ServerSpec::new(&env.token, &[(name, dir)], &env.path(&format!("server-{name}.log")));
        spec.extra = vec!["--allow-owners".into(), name.into()];
        Server::start(spec)
    };
    let (a, b) = (serve("ea", &ea), serve("eb", &eb));
    let (local, down) = (env.mkdir("local"), env.mkdir("down"));
    let (far, back) = (env.mkdir("far"), env.mkdir("back"));
    let sshd = Sshd::start(&env.path("sshd"));
    let contents = format!("{}/", src.display());
    let ssh = ["--ssh", &sshd.ssh(), "--remote-dmover", BIN].map(String::from);
    for (from, to, at, over_ssh) in [
        (contents.clone(), local.display().to_string(), &local, false),
        (contents.clone(), a.url("ea/up/"), &ea.join("up"), false),
        (a.url("ea/up/"), format!("{}/", down.display()), &down, false),
        (a.url("ea/up/"), b.url("eb/third/"), &eb.join("third"), false),
        (contents.clone(), format!("127.0.0.1:{}/", far.display()), &far, true),
        (format!("127.0.0.1:{}/", far.display()), format!("{}/", back.display()), &back, true),
    ] {
        let copy = |more: &[&str]| {
            let mut c = env.cp([&from, &to]);
            c.args(args).args(more);
            if over_ssh {
                c.args(&ssh);
            }
            c.run()
        };
        check(&copy, at);
    }
}

/// CLI.md: a plain re-run of a finished copy sends no file data, through
/// every path: each file whose size and mtime match at the destination is
/// skipped (the quick check). One whose mtime differs (same size), or whose
/// size differs, is sent again, and `--ignore-times` sends every one.
/// (The destination's copies are changed: that is what the check compares,
/// and the next path's source stays the same.)
#[test]
fn a_rerun_sends_no_file_data_through_every_path() {
    let env = Env::new();
    let src = env.mkdir("src");
    make_tree(&src, 61, 12);
    let (files, bytes) = (list_files(&src).len() as u64, total_size(&src));
    every_path(&env, &src, &[], &mut |copy, at| {
        let j = copy(&[]).assert_ok();
        assert_eq!((u(&j["files"]), u(&j["skipped_files"])), (files, 0), "a first copy: {j:#}");
        assert!(u(&j["sent_bytes"]) >= bytes, "a first copy sent {} bytes of {bytes}: {j:#}", u(&j["sent_bytes"]));
        let again = copy(&[]).assert_ok();
        assert_eq!(u(&again["skipped_files"]), files, "a re-run should skip every file: {again:#}");
        assert_eq!(u(&again["skipped_bytes"]), bytes, "{again:#}");
        assert_eq!(u(&again["sent_bytes"]), 0, "a re-run sent file data: {again:#}");

        // At the destination: one file with another mtime (same size), one
        // with another size.
        let (retimed, resized) = (at.join("a/block.dat"), at.join("one.bin"));
        let (s, ns) = mtime_of(&retimed);
        set_mtime(&retimed, s - 60, ns);
        let size = fs::metadata(&resized).unwrap().len();
        fs::OpenOptions::new().append(true).open(&resized).unwrap().write_all(b"more").unwrap();
        let j = copy(&[]).assert_ok();
        assert_eq!(u(&j["skipped_files"]), files - 2, "the file with another mtime and the one with another size are sent: {j:#}");
        let sent = fs::metadata(&retimed).unwrap().len() + size;
        assert!(u(&j["sent_bytes"]) >= sent, "sent {} bytes for two files of {sent}: {j:#}", u(&j["sent_bytes"]));
        assert_eq!(mtime_of(&retimed), (s, ns), "the file sent again has its mtime back");
        assert_eq!(fs::metadata(&resized).unwrap().len(), size, "the file sent again has its size back");

        let all = copy(&["--ignore-times"]).assert_ok();
        assert_eq!(u(&all["skipped_files"]), 0, "--ignore-times skipped files: {all:#}");
        assert!(u(&all["sent_bytes"]) >= bytes, "--ignore-times sent {} bytes of {bytes}: {all:#}", u(&all["sent_bytes"]));
    });
}

#[test]
fn names_that_are_not_utf8_arrive_byte_for_byte_through_every_path() {
    let env = Env::new();
    let src = odd_names(&env.mkdir("src"));
    every_path(&env, &src, &[], &mut |copy, at| {
        let j = copy(&[]).assert_ok();
        assert_names_kept(&src, at, &j);
    });
}

/// A glob matches names that are not UTF-8 as it does any other, and a
/// listing shows such a name by its escape, a newline escaped, and a
/// right-to-left override escaped.
#[test]
fn globs_match_and_listings_show_names_that_are_not_utf8() {
    let env = Env::new();
    let export = env.mkdir("export");
    odd_names(&export.join("up"));
    let a = env.serve(&[("ea", &export)]);
    let some = env.mkdir("some");
    let j = env.cp([a.url("ea/up/bad*.bin"), some.display().to_string()]).run().assert_ok();
    assert_eq!(u(&j["files"]), 2, "{j:#}");
    let name = OsStr::from_bytes(b"bad\xfe.bin");
    assert_eq!(fs::read(some.join(name)).unwrap(), fs::read(export.join("up").join(name)).unwrap());
    let l = dmover(["ls", "--token-file"]).arg(&env.token).arg(a.url("ea/up/")).run();
    assert_eq!(l.code, 0, "{}", l.stderr);
    assert!(l.stdout.contains("bad\\xff.bin") && l.stdout.contains("bad\\xfe.bin"), "{}", l.stdout);
    assert!(l.stdout.contains("new\\nline.txt") && !l.stdout.contains("new\nline"), "{}", l.stdout);
    assert!(l.stdout.contains("\\u{202e}gpj.exe"), "{}", l.stdout);
}

/// Two sources holding one name would land on one destination file: the
/// second is refused, the copy fails and says so, and the completion check
/// does not pass. (With the first file committed before the second came,
/// the second used to replace it: exit 0, check passed, a file lost.)
#[test]
fn two_sources_with_one_name_are_refused_and_the_check_fails() {
    let env = Env::new();
    let (a, b) = (env.mkdir("a"), env.mkdir("b"));
    fs::write(a.join("same.dat"), "from a").unwrap();
    for i in 0..300 {
        fs::write(b.join(format!("f{i}")), format!("{i}")).unwrap();
    }
    fs::write(b.join("same.dat"), "from b, longer").unwrap();
    fs::write(b.join("other.dat"), "only in b").unwrap();
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let local = env.mkdir("local");
    for (dest, at) in [(local.display().to_string(), local.clone()), (srv.url("e/"), export.clone())] {
        let r = env.cp([format!("{}/", a.display()), format!("{}/", b.display()), dest]).run();
        assert_ne!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
        let j = r.json();
        assert_eq!(j["ok"], false, "{j:#}");
        assert_eq!(j["check"]["passed"], false, "{j:#}");
        let errors = j["errors"].as_array().unwrap();
        assert_eq!(errors.len(), 1, "{j:#}");
        assert!(errors[0]["path"].as_str().unwrap().ends_with("b/same.dat"), "{j:#}");
        assert!(errors[0]["message"].as_str().unwrap().contains("one destination file"), "{j:#}");
        assert_eq!(fs::read_to_string(at.join("same.dat")).unwrap(), "from a");
        assert_eq!(fs::read_to_string(at.join("other.dat")).unwrap(), "only in b");
    }
    // The same file named twice (overlapping sources) is one file, sent once.
    let twice = env.mkdir("twice");
    let j = env.cp([format!("{}/", b.display()), b.join("other.dat").display().to_string(), twice.display().to_string()]).run().assert_ok();
    assert_eq!(u(&j["files"]), 302, "{j:#}");
}

/// A tree with symlinks of every sort: relative, absolute, dangling, to a
/// directory, with a target that is not UTF-8, and one in a subdirectory.
fn links(root: &Path) -> PathBuf {
    fs::create_dir_all(root.join("dir/sub")).unwrap();
    fs::write(root.join("dir/f.txt"), "content").unwrap();
    let link = |target: &[u8], at: &str| std::os::unix::fs::symlink(OsStr::from_bytes(target), root.join(at)).unwrap();
    link(b"dir/f.txt", "relative");
    link(b"/etc/hostname", "absolute");
    link(b"no/such/file", "dangling");
    link(b"dir", "to-dir");
    link(b"../f.txt\xff", "dir/sub/odd-target");
    root.to_path_buf()
}

/// What `dmover cp -l` keeps of symlinks, rsync -a keeps too: each arrives
/// as a symlink with its target byte for byte and its mtime, through every
/// path; a re-run finds them there. Without -l they are
/// skipped, with a warning, as rsync -r does.
#[test]
fn symlinks_arrive_as_symlinks_with_links_through_every_path() {
    let env = Env::new();
    let src = links(&env.mkdir("src"));
    let reference = tree::rsync(&["-a"], &src, &env.path("src.rsync"));
    let with_links = [Field::Kind, Field::Content, Field::Perm, Field::Mtime, Field::DirMtime, Field::Target];
    every_path(&env, &src, &["-l"], &mut |copy, at| {
        // Six symlinks and files, and dir/sub, which holds only a symlink.
        let j = copy(&[]).assert_ok();
        assert_eq!(u(&j["files"]), 7, "{j:#}");
        tree::assert_same(&reference, at, &with_links);
        let again = copy(&[]).assert_ok();
        assert_eq!(u(&again["skipped_files"]), 7, "a re-run: {again:#}");
    });

    // Without -l: skipped, with a warning naming each.
    let plain = env.mkdir("plain");
    let r = env.cp([format!("{}/", src.display()), plain.display().to_string()]).run();
    let j = r.assert_ok();
    assert_eq!(u(&j["files"]), 2, "the file and dir/sub: {j:#}");
    assert_eq!(r.stderr.matches("symbolic link skipped").count(), 5, "{}", r.stderr);
    let passed: Vec<&str> = j["passed_over"].as_array().unwrap().iter().map(|e| e["path"].as_str().unwrap()).collect();
    assert_eq!(passed.len(), 5, "the report lists what was passed over: {j:#}");
    assert!(passed.contains(&"dir/sub/odd-target"), "{passed:?}");
    assert!(fs::symlink_metadata(plain.join("relative")).is_err());
}

/// A tree of directories with modes of their own (none that the usual
/// umask 022 would change), deep nesting, empty directories, empty files,
/// a file of mode 000 and a name of 255 bytes, every time set apart from
/// now.
fn shapes(root: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let deep: PathBuf = (0..40).map(|i| format!("d{i}")).collect();
    for (dir, mode) in [("private", 0o700), ("group", 0o750), ("readonly", 0o555), ("sealed", 0o511), ("empty", 0o710)] {
        let d = root.join(dir);
        fs::create_dir_all(d.join("inner")).unwrap();
        if dir != "empty" {
            fs::write(d.join("inner/f.dat"), dir).unwrap();
            fs::write(d.join("zero"), "").unwrap();
        }
        fs::set_permissions(d.join("inner"), fs::Permissions::from_mode(0o751)).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(mode)).unwrap();
    }
    fs::create_dir_all(root.join(&deep)).unwrap();
    fs::write(root.join(&deep).join("bottom.dat"), "deep").unwrap();
    fs::write(root.join("x".repeat(255)), "long name").unwrap();
    fs::write(root.join("nobody-reads"), "mode 000").unwrap();
    fs::set_permissions(root.join("nobody-reads"), fs::Permissions::from_mode(0o000)).unwrap();
    times_back(root)
}

/// Sets the time of everything below `root` (not itself) back from now,
/// to the nanosecond, and returns `root`.
fn times_back(root: &Path) -> PathBuf {
    let out = std::process::Command::new("find")
        .arg(root)
        .args(["-mindepth", "1", "-exec", "touch", "-h", "-d", "2026-01-02 03:04:05.123456789", "{}", "+"])
        .output()
        .unwrap();
    assert!(out.status.success(), "touch: {}", String::from_utf8_lossy(&out.stderr));
    root.to_path_buf()
}

/// Directories arrive with their permissions and modification times, as
/// rsync -a gives them, through every path: dmover gives each its
/// attributes once the files below it are in.
#[test]
fn directories_keep_their_modes_and_times_through_every_path() {
    let env = Env::new();
    let src = shapes(&env.mkdir("src"));
    let reference = tree::rsync(&["-a"], &src, &env.path("src.rsync"));
    every_path(&env, &src, &[], &mut |copy, at| {
        copy(&[]).assert_ok();
        tree::assert_same(&reference, at, &KEPT);
    });
}

/// A tree whose files, directories and symlinks belong to users and groups
/// other than the tester's (ids no name on this machine has), with
/// extended attributes (a value that is not text, a name that is not
/// UTF-8, a `trusted.*` one), POSIX ACLs (an access ACL on a file, a
/// default ACL on a directory), and a setuid program in a setgid
/// directory.
fn owned(root: &Path) -> PathBuf {
    use std::os::unix::fs::{chown, lchown, PermissionsExt};
    fs::create_dir_all(root.join("shared/sub")).unwrap();
    fs::write(root.join("plain.txt"), "plain").unwrap();
    fs::write(root.join("shared/report.txt"), "report").unwrap();
    fs::write(root.join("shared/sub/data.bin"), [0u8, 1, 2]).unwrap();
    std::os::unix::fs::symlink("plain.txt", root.join("link")).unwrap();
    chown(root.join("plain.txt"), Some(4242), Some(4343)).unwrap();
    chown(root.join("shared"), Some(4242), Some(5000)).unwrap();
    chown(root.join("shared/sub/data.bin"), Some(0), Some(5000)).unwrap();
    lchown(root.join("link"), Some(7777), Some(8888)).unwrap();
    let set = |path: &str, name: &[u8], value: &[u8]| tree::set_xattr(&root.join(path), name, value);
    set("plain.txt", b"user.colour", b"blue");
    set("plain.txt", b"user.bin\xff", &[0, 255, 10]);
    set("shared", b"user.project", b"p42");
    set("shared/report.txt", b"trusted.origin", b"lab");
    let acl = |args: &[&str], path: &str| {
        let out = std::process::Command::new("setfacl").args(args).arg(root.join(path)).output().expect("setfacl (apt install acl)");
        assert!(out.status.success(), "setfacl: {}", String::from_utf8_lossy(&out.stderr));
    };
    acl(&["-m", "u:4242:rx,g:5000:r"], "shared/report.txt");
    acl(&["-d", "-m", "g:5000:rwx"], "shared");
    fs::create_dir(root.join("bin")).unwrap();
    fs::write(root.join("bin/tool"), "#!/bin/sh\n").unwrap();
    chown(root.join("bin"), Some(4242), Some(5000)).unwrap();
    chown(root.join("bin/tool"), Some(4242), Some(5000)).unwrap();
    fs::set_permissions(root.join("bin/tool"), fs::Permissions::from_mode(0o4755)).unwrap();
    fs::set_permissions(root.join("bin"), fs::Permissions::from_mode(0o2775)).unwrap();
    root.to_path_buf()
}

/// With `-aXA --numeric-ids` every owner, group, extended attribute and
/// ACL arrives as `rsync -aXA --numeric-ids` makes them, through every path
/// (the tests run as root, so every owner may be set; the servers allow
/// it); a re-run finds everything there.
#[test]
fn owners_xattrs_and_acls_arrive_as_rsync_keeps_them_through_every_path() {
    let env = Env::new();
    let src = owned(&env.mkdir("src"));
    let reference = tree::rsync(&["-aXA", "--numeric-ids"], &src, &env.path("src.rsync"));
    let fields = [Field::Kind, Field::Content, Field::Perm, Field::Owner, Field::Mtime, Field::DirMtime, Field::Target, Field::Xattrs];
    every_path(&env, &src, &["-aXA", "--numeric-ids"], &mut |copy, at| {
        let j = copy(&[]).assert_ok();
        assert_eq!(u(&j["files"]), 5, "{j:#}");
        tree::assert_same(&reference, at, &fields);
        let again = copy(&[]).assert_ok();
        assert_eq!(u(&again["skipped_files"]), 5, "a re-run: {again:#}");
    });
}

/// A server keeps owners out of an export whose operator did not allow
/// them: an explicit `--owner` is refused with advice, `-a` copies with
/// the server's own owner, and of the extended attributes only `user.*`
/// ones are set (a `trusted.*` one, like file capabilities in
/// `security.*`, could grant what the token holder does not have).
#[test]
fn an_export_that_does_not_allow_owners_refuses_them_and_keeps_user_xattrs_only() {
    let env = Env::new();
    let src = owned(&env.mkdir("src"));
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let r = env.cp([format!("{}/", src.display()), srv.url("e/explicit/")]).args(["-o"]).run();
    assert_ne!(r.code, 0, "an explicit --owner was taken: {}", r.stderr);
    assert!(r.stderr.contains("does not let clients set owners") && r.stderr.contains("--allow-owners"), "{}", r.stderr);
    assert!(!export.join("explicit/plain.txt").exists());

    env.cp([format!("{}/", src.display()), srv.url("e/archive/")]).args(["-aX"]).run().assert_ok();
    let meta = fs::symlink_metadata(export.join("archive/plain.txt")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((meta.uid(), meta.gid()), (0, 0), "the owner was set in an export that does not allow it");
    let snap = tree::snapshot(&export.join("archive")).unwrap();
    let xattrs = |p: &[u8]| snap.entries[p].xattrs.keys().map(|k| k.escape_ascii().to_string()).collect::<Vec<_>>();
    assert_eq!(xattrs(b"plain.txt"), ["user.bin\\xff", "user.colour"]);
    assert!(xattrs(b"shared/report.txt").is_empty(), "a trusted.* attribute was set: {:?}", xattrs(b"shared/report.txt"));
    let mode = |p: &str| fs::metadata(export.join("archive").join(p)).unwrap().mode() & 0o7777;
    assert_eq!((mode("bin/tool"), mode("bin")), (0o755, 0o775), "a setuid or setgid bit was planted");
}

/// A tree with a FIFO, a socket, a character and a block device, one of
/// them owned by another user, every time set apart from now.
fn nodes(root: &Path) -> PathBuf {
    let mknod = |args: &[&str]| {
        let out = std::process::Command::new("mknod").args(args).output().unwrap();
        assert!(out.status.success(), "mknod {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    fs::create_dir_all(root.join("dev")).unwrap();
    fs::write(root.join("plain.txt"), "plain").unwrap();
    mknod(&["-m", "640", root.join("fifo").to_str().unwrap(), "p"]);
    mknod(&["-m", "666", root.join("dev/null").to_str().unwrap(), "c", "1", "3"]);
    mknod(&["-m", "600", root.join("dev/loop250").to_str().unwrap(), "b", "7", "250"]);
    drop(std::os::unix::net::UnixListener::bind(root.join("socket")).unwrap());
    std::os::unix::fs::chown(root.join("fifo"), Some(4242), Some(4343)).unwrap();
    times_back(root)
}

/// With `-a` (as root, into exports that allow it) devices, FIFOs and
/// sockets arrive as `rsync -a` makes them: type, device numbers, mode,
/// owner and time, through every path; a re-run finds
/// them there. Without `-a` or `-D` each is skipped with a warning.
#[test]
fn devices_fifos_and_sockets_arrive_with_archive_through_every_path() {
    let env = Env::new();
    let src = nodes(&env.mkdir("src"));
    let reference = tree::rsync(&["-a", "--numeric-ids"], &src, &env.path("src.rsync"));
    let fields = [Field::Kind, Field::Content, Field::Perm, Field::Owner, Field::Mtime, Field::DirMtime, Field::Device];
    every_path(&env, &src, &["-a", "--numeric-ids"], &mut |copy, at| {
        // Four nodes, the file, and dev, which holds only devices.
        let j = copy(&[]).assert_ok();
        assert_eq!(u(&j["files"]), 6, "{j:#}");
        tree::assert_same(&reference, at, &fields);
        let again = copy(&[]).assert_ok();
        assert_eq!(u(&again["skipped_files"]), 6, "a re-run: {again:#}");
    });

    let plain = env.mkdir("plain");
    let r = env.cp([format!("{}/", src.display()), plain.display().to_string()]).run();
    let j = r.assert_ok();
    assert_eq!(u(&j["files"]), 2, "the file and dev");
    assert_eq!(r.stderr.matches(" skipped (--").count(), 4, "{}", r.stderr);
    assert!(fs::symlink_metadata(plain.join("fifo")).is_err());
    // Listed in the report, from a server's walk too (a download).
    let srv = env.serve(&[("src", &src)]);
    let down = env.mkdir("down-plain");
    for report in [j, env.cp([srv.url("src/"), down.display().to_string()]).run().assert_ok()] {
        let mut passed: Vec<String> = report["passed_over"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| format!("{}: {}", e["path"].as_str().unwrap(), e["message"].as_str().unwrap()))
            .collect();
        passed.sort();
        assert_eq!(
            passed,
            [
                "dev/loop250: device skipped (--devices copies it as one)",
                "dev/null: device skipped (--devices copies it as one)",
                "fifo: FIFO or socket skipped (--specials copies it as one)",
                "socket: FIFO or socket skipped (--specials copies it as one)"
            ],
            "{report:#}"
        );
    }
}

/// A server makes no device, FIFO or socket in an export whose operator
/// did not allow it: `-D` is refused naming the flags, `-a` copies the
/// files and passes the rest over.
#[test]
fn an_export_that_does_not_allow_owners_makes_no_devices() {
    let env = Env::new();
    let src = nodes(&env.mkdir("src"));
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let r = env.cp([format!("{}/", src.display()), srv.url("e/explicit/")]).args(["-D"]).run();
    assert_eq!(r.code, 8, "{}", r.stderr);
    assert!(r.stderr.contains("--devices, --specials") && r.stderr.contains("--allow-owners"), "{}", r.stderr);
    let j = env.cp([format!("{}/", src.display()), srv.url("e/archive/")]).args(["-a"]).run().assert_ok();
    assert_eq!((u(&j["files"]), u(&j["skipped_files"])), (2, 0), "{j:#}");
    let mut passed: Vec<&str> = j["passed_over"].as_array().unwrap().iter().map(|e| e["path"].as_str().unwrap()).collect();
    passed.sort();
    assert_eq!(passed, ["dev/loop250", "dev/null", "fifo", "socket"], "{j:#}");
    for e in j["passed_over"].as_array().unwrap() {
        assert!(e["message"].as_str().unwrap().contains("where the receiving end allows them"), "{e}");
    }
    let names: Vec<_> = fs::read_dir(export.join("archive")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 2, "made more than the file and the directory: {names:?}");
    assert!(fs::read_dir(export.join("archive/dev")).unwrap().next().is_none());
}

/// With `--safe-links` a symlink that leads out of the tree (absolute, or
/// climbing above its top) is passed over where it arrives, as
/// `rsync -a --safe-links` does, through every path, and the report lists
/// it as passed over, with why (not as already there); the others arrive.
/// With `-L` each symlink in a local source is copied as what it leads
/// to, as `rsync -rL` copies it, going up to a server too; a server never
/// follows one in its export.
#[test]
fn safe_links_pass_over_links_out_of_the_tree_and_copy_links_follows_them() {
    let env = Env::new();
    let src = links(&env.mkdir("src"));
    let reference = tree::rsync(&["-a", "--safe-links"], &src, &env.path("src.safe"));
    let with_links = [Field::Kind, Field::Content, Field::Perm, Field::Mtime, Field::Target];
    // In the order every_path copies: the source's tree, or a copy's.
    let mut from_source = [true, true, false, false, true, false].into_iter();
    every_path(&env, &src, &["-l", "--safe-links"], &mut |copy, at| {
        // Copies from the source pass the one link over; those from a copy find none.
        let j = copy(&[]).assert_ok();
        assert_eq!((u(&j["files"]), u(&j["skipped_files"])), (6, 0), "{j:#}");
        let passed: Vec<String> = j["passed_over"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| format!("{}: {}", e["path"].as_str().unwrap(), e["message"].as_str().unwrap()))
            .collect();
        let want: &[&str] =
            if from_source.next().unwrap() { &["absolute: symbolic link leading out of the tree skipped (--safe-links)"] } else { &[] };
        assert_eq!(passed, want, "{j:#}");
        tree::assert_same(&reference, at, &with_links);
        assert!(fs::symlink_metadata(at.join("absolute")).is_err());
    });

    fs::remove_file(src.join("dangling")).unwrap();
    fs::remove_file(src.join("dir/sub/odd-target")).unwrap();
    let followed = tree::rsync(&["-rtL"], &src, &env.path("src.followed"));
    let local = env.mkdir("followed");
    env.cp([format!("{}/", src.display()), local.display().to_string()]).args(["-L"]).run().assert_ok();
    tree::assert_same(&followed, &local, &[Field::Kind, Field::Content, Field::Mtime]);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    env.cp([format!("{}/", src.display()), srv.url("e/up/")]).args(["-L"]).run().assert_ok();
    tree::assert_same(&followed, &export.join("up"), &[Field::Kind, Field::Content, Field::Mtime]);

    // A server never follows a symlink in its export, -L or not.
    std::os::unix::fs::symlink("/etc", export.join("up/etc-link")).unwrap();
    let down = env.mkdir("down-followed");
    env.cp([srv.url("e/up/"), down.display().to_string()]).args(["-L"]).run().assert_ok();
    assert!(!down.join("etc-link").exists(), "a server followed a symlink out of its export");
    assert!(srv.log().contains("etc-link: symbolic link skipped"), "{}", srv.log());
}

/// A tree with one of each kind of thing a tree holds: names that are not
/// UTF-8 and other odd ones, symlinks of every sort, deep nesting, empty
/// directories, empty files, a file and a directory of mode 000, a name of
/// 255 bytes, owners and groups of other users, extended attributes, POSIX
/// ACLs, a FIFO, a socket, devices, hard links and a sparse file.
fn whole(root: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    odd_names(&root.join("names"));
    hard_linked(&root.join("linked"));
    links(&root.join("links"));
    shapes(&root.join("shapes"));
    owned(&root.join("owned"));
    nodes(&root.join("nodes"));
    let locked = root.join("shapes/locked");
    fs::create_dir(&locked).unwrap();
    fs::write(locked.join("inside"), "behind mode 000").unwrap();
    fs::set_permissions(&locked, fs::Permissions::from_mode(0o000)).unwrap();
    let sparse = fs::File::create(root.join("sparse.bin")).unwrap();
    sparse.set_len(64 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&sparse, &[7; 4096], 1 << 20).unwrap();
    root.to_path_buf()
}

/// The oracle: a tree with one of each kind, copied by
/// `dmover -aHAX --numeric-ids` through every path, is what
/// `rsync -aHAXS --numeric-ids` makes of it in every field (type, content,
/// mode, owner, times to the nanosecond, targets, device numbers,
/// extended attributes and ACLs, which names share an inode, allocated
/// blocks); and copied with no
/// flags, what `rsync -rt` makes of it (contents, times, modes less the
/// umask; symlinks, devices, FIFOs and sockets passed over).
#[test]
fn a_tree_with_one_of_each_kind_arrives_as_rsync_makes_it_through_every_path() {
    let env = Env::new();
    let src = whole(&env.mkdir("src"));
    let reference = tree::rsync(&["-aHAXS", "--numeric-ids"], &src, &env.path("src.rsync"));
    every_path(&env, &src, &["-aHAX", "--numeric-ids"], &mut |copy, at| {
        copy(&[]).assert_ok();
        tree::assert_same(&reference, at, &Field::ALL);
    });

    let plain = tree::rsync(&["-rt"], &src, &env.path("src.plain"));
    let env2 = Env::new();
    every_path(&env2, &src, &[], &mut |copy, at| {
        copy(&[]).assert_ok();
        tree::assert_same(&plain, at, &KEPT);
    });
}

/// A tree of files with more than one name (hard links): one with three
/// names, two of them in other directories, one with two, and files with
/// one name each.
fn hard_linked(root: &Path) -> PathBuf {
    fs::create_dir_all(root.join("a/deep")).unwrap();
    fs::create_dir_all(root.join("b")).unwrap();
    fs::write(root.join("three"), "one file, three names").unwrap();
    fs::hard_link(root.join("three"), root.join("a/deep/three-again")).unwrap();
    fs::hard_link(root.join("three"), root.join("b/third-name")).unwrap();
    fs::write(root.join("a/two"), "another file, two names ".repeat(1000)).unwrap();
    fs::hard_link(root.join("a/two"), root.join("b/two-too")).unwrap();
    for i in 0..5 {
        fs::write(root.join(format!("b/single{i}")), format!("a file alone, {i}")).unwrap();
    }
    root.to_path_buf()
}

/// What `dmover cp -H` makes of names that share a file, `rsync -aH`
/// makes: the names share one file at the destination, through every
/// path, and each file's data is sent once; a re-run finds
/// every name there. Without -H each name arrives as a file of its own,
/// as rsync -a makes them.
#[test]
fn hard_links_arrive_as_names_of_one_file_with_hard_links_through_every_path() {
    let env = Env::new();
    let src = hard_linked(&env.mkdir("src"));
    let reference = tree::rsync(&["-aH"], &src, &env.path("src.rsync-H"));
    let kept = [Field::Kind, Field::Content, Field::Perm, Field::Mtime, Field::DirMtime, Field::HardLinks];
    let once: u64 = ["three", "a/two"]
        .iter()
        .chain(&["b/single0", "b/single1", "b/single2", "b/single3", "b/single4"])
        .map(|n| fs::metadata(src.join(n)).unwrap().len())
        .sum();
    every_path(&env, &src, &["-H"], &mut |copy, at| {
        let j = copy(&[]).assert_ok();
        assert_eq!((u(&j["files"]), u(&j["bytes"])), (10, once), "each file's data once: {j:#}");
        tree::assert_same(&reference, at, &kept);
        let again = copy(&[]).assert_ok();
        assert_eq!(u(&again["skipped_files"]), 10, "a re-run: {again:#}");
        tree::assert_same(&reference, at, &kept);
    });

    let reference = tree::rsync(&["-a"], &src, &env.path("src.rsync"));
    let plain = env.mkdir("plain");
    let j = env.cp([format!("{}/", src.display()), plain.display().to_string()]).run().assert_ok();
    assert_eq!(u(&j["files"]), 10, "{j:#}");
    tree::assert_same(&reference, &plain, &kept);
}

/// When the first name of a file with other names fails at the
/// destination (a directory is in its way), its other names fail with it,
/// each reported as such, and none is made; the other files' names arrive
/// joined as ever.
#[test]
fn other_names_of_a_file_that_failed_fail_with_it() {
    let env = Env::new();
    let src = hard_linked(&env.mkdir("src"));
    let dst = env.mkdir("dst");
    // Whichever of a/two and b/two-too the walk finds first is in the way.
    for name in ["a/two", "b/two-too"] {
        fs::create_dir_all(dst.join(name).join("blocker")).unwrap();
    }
    let r = env.cp([format!("{}/", src.display()), dst.display().to_string(), "-H".into()]).run();
    assert_ne!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let j = r.json();
    let errors: Vec<(String, String)> = j["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["path"].as_str().unwrap().into(), e["message"].as_str().unwrap().into()))
        .collect();
    assert_eq!(errors.len(), 2, "{j:#}");
    let (with, first): (Vec<_>, Vec<_>) = errors.iter().partition(|(_, m)| m.contains("another name of"));
    assert_eq!((with.len(), first.len()), (1, 1), "{errors:?}");
    let (leader, other) = if first[0].0.ends_with("a/two") { ("a/two", "b/two-too") } else { ("b/two-too", "a/two") };
    assert!(with[0].1.contains(&format!("another name of {leader}, which failed")), "{errors:?}");
    assert_eq!(with[0].0, src.join(other).display().to_string(), "the other name is not named by its source");
    for name in ["a/two", "b/two-too"] {
        assert!(dst.join(name).join("blocker").is_dir(), "{name} was touched");
    }
    let ino = |p: &str| fs::metadata(dst.join(p)).unwrap().ino();
    assert_eq!(ino("three"), ino("a/deep/three-again"));
    assert_eq!(ino("three"), ino("b/third-name"));
}
