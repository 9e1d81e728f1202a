//! Sparse files: the holes of a source file (as SEEK_DATA and SEEK_HOLE
//! find them) are neither read nor sent, and stay holes at the
//! destination, through an upload, a download and a local copy; a resumed
//! upload of a sparse file arrives intact, with what its partial file held
//! in the holes punched away.

mod util;

use std::fs::{self, File};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use util::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// What a copy of the sparse file may send, and carry over the wire, at
/// most, with the default blocks of 1 MiB: its blocks holding data go
/// without their pages of zeros.
const SENT_AT_MOST: u64 = 1_000_000;

/// Makes `path` a sparse file of `size` bytes holding `len` bytes of
/// pseudo-random data at each of `at`, and holes elsewhere.
fn make_sparse(path: &Path, size: u64, at: &[u64], len: u64, seed: u64) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let f = File::create(path).unwrap();
    f.set_len(size).unwrap();
    let mut rng = Rng::new(seed);
    for &off in at {
        let data: Vec<u8> = (0..len).map(|_| rng.next() as u8 | 1).collect();
        f.write_all_at(&data, off).unwrap();
    }
    f.sync_all().unwrap();
}

/// A file of 1 GiB holding four 4 KiB runs of data: one inside a block,
/// one across a block boundary, one at an odd offset, one at the very end.
fn make_scattered(path: &Path) {
    make_sparse(path, GIB, &[5 * MIB + 12_345, 300 * MIB - 2048, 700 * MIB + 777, GIB - 4 * KIB], 4 * KIB, 43);
}

/// Bytes the file system allocated for `path`.
fn allocated(path: &Path) -> u64 {
    fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).blocks() * 512
}

/// The copy is the source, byte for byte, and allocates at most twice
/// what the source does, and a little more.
#[track_caller]
fn assert_sparse_copy(src: &Path, dst: &Path) {
    assert!(same_content(src, dst), "{} differs from {}", dst.display(), src.display());
    let (a, b) = (allocated(src), allocated(dst));
    eprintln!("{}: {a} bytes allocated, its copy {b}", src.display());
    assert!(b <= 2 * a + 64 * KIB, "the copy allocates {b} bytes, its source {a}: the holes were not kept");
}

/// What the transfer sent, by its report and over the wire (`wire`, the
/// bytes a relay counted), is under [`SENT_AT_MOST`].
#[track_caller]
fn assert_sent_little(j: &serde_json::Value, wire: Option<u64>) {
    let sent = u(&j["sent_bytes"]);
    eprintln!("sent {sent} bytes ({wire:?} on the wire) for {} bytes", u(&j["bytes"]));
    assert_eq!(u(&j["bytes"]), GIB, "{j:#}");
    assert!(sent < SENT_AT_MOST, "{sent} bytes sent for a file of {GIB} bytes holding 16 KiB of data\n{j:#}");
    if let Some(w) = wire {
        assert!(w < SENT_AT_MOST, "{w} bytes crossed the wire for a file of {GIB} bytes holding 16 KiB of data");
    }
}

#[test]
fn a_sparse_file_uploads_without_its_holes_and_stays_sparse() {
    let env = Env::new();
    let src = env.path("src/sparse.bin");
    make_scattered(&src);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let relay = Relay::start(&srv.addr());
    let j = env.cp([src.display().to_string(), relay.url("e/copy.bin")]).run().assert_ok();
    assert_sent_little(&j, Some(relay.to_server()));
    assert_sparse_copy(&src, &export.join("copy.bin"));
}

#[test]
fn a_sparse_file_downloads_without_its_holes_and_stays_sparse() {
    let env = Env::new();
    let export = env.mkdir("export");
    let src = export.join("sparse.bin");
    make_scattered(&src);
    let srv = env.serve(&[("e", &export)]);
    let relay = Relay::start(&srv.addr());
    let dst = env.mkdir("down").join("copy.bin");
    let j = env.cp([relay.url("e/sparse.bin"), dst.display().to_string()]).run().assert_ok();
    assert_sent_little(&j, Some(relay.to_client()));
    assert_sparse_copy(&src, &dst);
}

#[test]
fn a_sparse_file_copies_locally_without_its_holes_and_stays_sparse() {
    let env = Env::new();
    let src = env.path("src/sparse.bin");
    make_scattered(&src);
    let dst = env.mkdir("out").join("copy.bin");
    let mut cmd = dmover(["cp", "--json", "-q"]);
    let j = cmd.arg(&src).arg(&dst).run().assert_ok();
    assert_sent_little(&j, None);
    assert_sparse_copy(&src, &dst);
}

/// The blocks a journal in `state` (the one there) records.
fn journaled(state: &Path) -> Vec<u64> {
    let journals: Vec<PathBuf> =
        fs::read_dir(state).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "journal")).collect();
    assert_eq!(journals.len(), 1, "want the journal of the one file in {}: {journals:?}", state.display());
    // A 32-byte header, then a record per block: index (u64) and checksum (16).
    let j = fs::read(&journals[0]).unwrap();
    j[32..].chunks_exact(24).map(|r| u64::from_be_bytes(r[..8].try_into().unwrap())).collect()
}

/// A sparse upload killed part way, whose partial file then holds stale
/// bytes in the blocks not yet journaled (as a partial file may hold in
/// blocks written and not journaled): the re-run completes it in place,
/// sends only what is missing, punches the holes the stale bytes filled,
/// and the copy is the source, as sparse as it.
#[test]
fn a_sparse_upload_killed_then_rerun_completes_it_intact_and_sparse() {
    const BLOCK_SIZE: u64 = 256 * KIB;
    const SIZE: u64 = 96 * MIB;
    // Twelve runs of a little over 1 MiB, starting and ending inside
    // blocks, with holes of several blocks between them.
    const RUN: u64 = MIB + 5000;
    let runs: Vec<u64> = (0..12).map(|i| i * 8 * MIB + 100_000).collect();
    let data = 12 * RUN;
    // Bytes of the blocks that hold data: what a full upload sends.
    let data_blocks: u64 = runs.iter().map(|r| ((r + RUN).div_ceil(BLOCK_SIZE) - r / BLOCK_SIZE) * BLOCK_SIZE).sum();
    let env = Env::new();
    let src = env.path("src/sparse.bin");
    make_sparse(&src, SIZE, &runs, RUN, 44);
    let export = env.mkdir("export");
    let srv = env.serve(&[("e", &export)]);
    let relay = Relay::start(&srv.addr());
    let (dst, part) = (export.join("copy.bin"), export.join(".copy.bin.dmover-part"));
    let mut cmd =
        env.cp([src.display().to_string(), relay.url("e/copy.bin"), "--block-size".into(), "256K".into(), "--bwlimit".into(), "4M".into()]);
    cmd.cwd(env.root());
    let mut p = cmd.spawn();
    let mut written = 0;
    let ok = wait_until(Duration::from_secs(90), || {
        written = fs::metadata(&part).map_or(0, |m| m.blocks() * 512);
        written >= data * 2 / 5 || !p.running()
    });
    assert!(ok && p.running(), "no interruption mid-file: {written} of {data} bytes written, client running: {}", p.running());
    let mark = srv.log_mark();
    p.kill9();
    srv.wait_for_log(mark, ENDED, "the session of the killed client ended");
    assert!(!dst.exists(), "copy.bin exists under its final name after an interruption");
    let written = allocated(&part).min(data);

    let held = journaled(&export.join(".dmover-partial"));
    assert!(!held.is_empty(), "nothing journaled after {written} bytes were written");
    let stale = vec![0xa5u8; 4096];
    let f = fs::OpenOptions::new().write(true).open(&part).unwrap();
    for b in (0..SIZE / BLOCK_SIZE).filter(|b| !held.contains(b)) {
        f.write_all_at(&stale, b * BLOCK_SIZE).unwrap();
        f.write_all_at(&stale, (b + 1) * BLOCK_SIZE - 4096).unwrap();
    }
    drop(f);

    relay.reset();
    let j = cmd.run().assert_ok();
    let (sent, wire) = (u(&j["sent_bytes"]), relay.to_server());
    eprintln!("re-run: sent {sent} bytes ({wire} on the wire); {written} were written before, of {data_blocks} in the blocks holding data");
    assert_eq!(u(&j["bytes"]), SIZE, "{j:#}");
    for (what, n) in [("sent", sent), ("carried over the wire", wire)] {
        assert!(
            n + written / 2 < data_blocks,
            "the re-run {what} {n} bytes of {data_blocks} bytes in blocks with data: not resumed, or holes sent\n{j:#}"
        );
    }
    assert_sparse_copy(&src, &dst);
}
