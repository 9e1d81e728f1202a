//! A directory swapped for a symlink while a real server reads and writes
//! in it: nothing may be written outside the export, and nothing from
//! outside may be read.
//!
//! A thread swaps `export/d` (a real directory) with `export/d.swap` (a
//! symlink to a directory outside the export) with `renameat2(…,
//! RENAME_EXCHANGE)` as fast as it can, so at every moment `d` is one or
//! the other, while uploads into `d` and downloads from it run through a
//! real `dmover serve`. Every path the server uses is resolved beneath the
//! export at the moment of use, so each copy either works on the real
//! directory or is refused.

mod util;

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use util::*;

/// Copies in each direction.
const COPIES: usize = 1000;
/// Threads running copies, per direction.
const THREADS: usize = 2;

const INSIDE: &[u8] = b"the file inside the export\n";
const SECRET: &[u8] = b"a file outside the export that no client may read\n";

fn exchange(a: &Path, b: &Path) -> bool {
    let (a, b) = (CString::new(a.as_os_str().as_bytes()).unwrap(), CString::new(b.as_os_str().as_bytes()).unwrap());
    // SAFETY: both paths are NUL-terminated strings that outlive the call.
    unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) == 0 }
}

#[test]
fn a_directory_swapped_for_a_symlink_never_leads_out_of_the_export() {
    let env = Env::new();
    let export = env.mkdir("export");
    let outside = env.mkdir("outside");
    fs::create_dir(export.join("d")).unwrap();
    fs::write(export.join("d/in.dat"), INSIDE).unwrap();
    fs::write(outside.join("in.dat"), SECRET).unwrap();
    std::os::unix::fs::symlink(&outside, export.join("d.swap")).unwrap();
    let src = env.mkdir("src");
    for i in 0..COPIES {
        fs::write(src.join(format!("u{i}.dat")), format!("upload {i}\n")).unwrap();
    }
    let got = env.mkdir("got");
    let srv = env.serve(&[("e", &export)]);

    let stop = AtomicBool::new(false);
    let swaps = AtomicU64::new(0);
    let (uploaded, downloaded, refused) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    // What the downloads that failed but left their file said.
    let left_behind = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                assert!(exchange(&export.join("d"), &export.join("d.swap")), "renameat2: {}", std::io::Error::last_os_error());
                swaps.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(20));
            }
        });
        let copiers: Vec<_> = (0..THREADS * 2)
            .map(|t| {
                let (env, srv, src, got) = (&env, &srv, &src, &got);
                let (uploaded, downloaded, refused, left_behind) = (&uploaded, &downloaded, &refused, &left_behind);
                s.spawn(move || {
                    for i in (t / 2..COPIES).step_by(THREADS) {
                        let up = t % 2 == 0;
                        let r = if up {
                            env.cp([src.join(format!("u{i}.dat")).display().to_string(), srv.url("e/d/")]).run()
                        } else {
                            env.cp([srv.url("e/d/in.dat"), got.join(format!("dl{i}.dat")).display().to_string()]).run()
                        };
                        assert!(!r.stderr.contains("panicked"), "dmover panicked: {}", r.stderr);
                        if !up && r.code != 0 && got.join(format!("dl{i}.dat")).exists() {
                            left_behind.lock().unwrap().push(format!("dl{i}.dat (exit {}): {}", r.code, r.stderr.trim()));
                        }
                        match r.code {
                            0 if up => uploaded.fetch_add(1, Ordering::Relaxed),
                            0 => downloaded.fetch_add(1, Ordering::Relaxed),
                            _ => refused.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                })
            })
            .collect();
        for c in copiers {
            c.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });

    let (up, down, no) = (uploaded.into_inner(), downloaded.into_inner(), refused.into_inner());
    eprintln!("{} swaps; {up} uploads and {down} downloads done, {no} refused", swaps.load(Ordering::Relaxed));
    let names: Vec<String> = list_files(&outside).into_keys().collect();
    assert_eq!(names, ["in.dat"], "the server wrote outside the export");
    assert_eq!(fs::read(outside.join("in.dat")).unwrap(), SECRET, "the file outside the export was changed");
    for (name, _) in list_files(&got) {
        assert_eq!(fs::read(got.join(&name)).unwrap(), INSIDE, "{name}: a download read the file outside the export");
    }
    let left_behind = left_behind.into_inner().unwrap();
    assert!(left_behind.is_empty(), "a failed download left a file behind: {left_behind:#?}");
    assert_eq!(list_files(&got).len() as u64, down, "the downloads done and the files in their directory differ");
    assert!(up > 0 && down > 0, "no copy got through: the test proves nothing ({up} uploads, {down} downloads)");
    assert!(no > 0, "no copy met the symlink: the swaps did not race the copies");
    assert!(swaps.load(Ordering::Relaxed) >= COPIES as u64, "too few swaps to race every copy");
}
