//! s3://bucket/prefix locations against a real S3 server (versitygw on
//! loopback): a tree up and back down identical, a 2 GiB upload killed
//! midway and resumed (and a download), an upload's memory within its
//! staging, from bucket to bucket, between a bucket and a server, globs
//! (and ls), a first copy into an empty destination asking nothing per
//! file there and a re-run sending nothing, --sync (a same-size change, a
//! same-size same-mtime change with -c, an object left without dmover's
//! metadata), the digest kept
//! with each object and checked on the way down (only with the block size
//! it was made with), objects other tools wrote, credentials from a
//! profile with --s3-endpoint, shared files a profile of which names the
//! endpoint, session tokens sent with the requests, what wrong credentials
//! and a missing bucket say, and symlinks kept as rclone's --links keeps
//! them (read by rclone both ways).
//! And a bucket served by `dmover serve --export NAME=s3://BUCKET/prefix`:
//! up, down and listed as a directory export is, an upload into it cut
//! short and resumed (with its state in the default place, and under
//! `--state-dir`), third-party copies to and from a directory export,
//! paths that leave the prefix refused at the wire level, and a bucket that
//! cannot be reached stopping the server.

mod util;

use dmover_proto::frame::{TransferFlags, TransferOptions};
use dmover_proto::{ErrorKind, Msg};
use std::fs;
use std::path::{Path, PathBuf};
use util::*;

/// A test's S3 server, with its home directory (no ~/.aws unless a test writes one).
struct Setup {
    env: Env,
    s3: S3Server,
}

impl Setup {
    /// None when the server is not installed (the test is skipped).
    fn new() -> Option<Setup> {
        let env = Env::new();
        let s3 = S3Server::start(&env.path("s3"))?;
        env.mkdir("home");
        Some(Setup { env, s3 })
    }

    /// Where `dmover cp` keeps its state for uploads to bucket `data`.
    fn state(&self) -> PathBuf {
        self.env.path("home/.cache/dmover/s3/data")
    }

    /// `dmover cp --json -q ARGS` reaching the server.
    fn cp<S: AsRef<std::ffi::OsStr>>(&self, args: impl IntoIterator<Item = S>) -> Cmd {
        let mut c = self.env.cp(args);
        c.s3(&self.s3, &self.env.path("home"));
        c
    }

    /// A `dmover serve` of `exports` (NAME, and a directory or an s3:// URL)
    /// reaching the S3 server, its state under the home directory's cache.
    fn serve(&self, exports: &[(&str, &str)]) -> Server {
        self.serve_with(exports, &[])
    }

    /// The same with `extra` flags.
    fn serve_with(&self, exports: &[(&str, &str)], extra: &[&str]) -> Server {
        let exports: Vec<(&str, &Path)> = exports.iter().map(|(n, w)| (*n, Path::new(*w))).collect();
        let mut spec = ServerSpec::new(&self.env.token, &exports, &self.env.path(&format!("server-{}.log", unique())));
        spec.envs = s3_env(&self.s3, &self.env.path("home"));
        spec.extra = extra.iter().map(Into::into).collect();
        Server::start(spec)
    }

    /// `dmover serve --export ARG` (with `extra` flags) run to its end.
    fn serve_fails(&self, export: &str, extra: &[&str]) -> Run {
        let mut c = dmover(["serve", "--listen", "127.0.0.1:0", "--token-file"]);
        c.arg(&self.env.token).arg("--export").arg(export).args(extra).s3(&self.s3, &self.env.path("home"));
        let r = c.run();
        assert!(!r.stdout.contains("listening"), "the server started: {}", r.stdout);
        r
    }
}

#[test]
fn a_tree_goes_up_and_comes_back_identical() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 21, 30);
    // Several parts of a multipart upload, the last one short.
    let mut rng = Rng::new(5);
    make_file(&src.join("big/large.bin"), 40 * (1 << 20) + 4321, &mut rng);
    // Exactly two parts: no short last part.
    make_file(&src.join("big/parts.bin"), 32 << 20, &mut rng);
    let j = t.cp([src.to_str().unwrap(), "s3://data/run1/"]).run().assert_ok();
    assert_eq!(u(&j["files"]), list_files(&src).len() as u64, "{j:#}");
    // The objects are the files, byte for byte, under the prefix, and no
    // partial upload or state is left in the bucket.
    for (rel, _) in list_files(&src) {
        let obj = bucket.join("run1/src").join(&rel);
        assert_eq!(fs::read(&obj).unwrap(), fs::read(src.join(&rel)).unwrap(), "{rel}");
    }
    let stray: Vec<_> = list_tree(&bucket).into_keys().filter(|k| k.contains(".part") || k.contains(".dmover")).collect();
    assert!(stray.is_empty(), "left in the bucket: {stray:?}");

    let dst = t.env.mkdir("dst");
    t.cp(["s3://data/run1/src", dst.to_str().unwrap()]).run().assert_ok();
    assert_same_tree(&src, &dst.join("src"));
}

/// CLI.md "Copying to and from S3": an empty directory goes up as a
/// directory marker (an empty object `KEY/`, as rclone's
/// `--s3-directory-markers` makes them) and comes back down as an empty
/// directory: a round trip returns every entry it sent.
#[test]
fn empty_directories_go_up_as_markers_and_come_back() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_file(&src.join("x/f"), 100, &mut Rng::new(3));
    for d in ["x/empty", "e1/e2", "top"] {
        fs::create_dir_all(src.join(d)).unwrap();
    }
    let up = t.cp([src.to_str().unwrap(), "s3://data/run/"]).run().assert_ok();
    assert_eq!(u(&up["files"]), 4, "a file and three empty directories: {up:#}");
    for d in ["x/empty", "e1/e2", "top"] {
        assert!(bucket.join("run/src").join(d).is_dir(), "no marker for {d} in the bucket: {:?}", list_tree(&bucket));
    }
    let dst = t.env.mkdir("dst");
    let down = t.cp(["s3://data/run/src", dst.to_str().unwrap()]).run().assert_ok();
    assert_eq!(u(&down["files"]), 4, "{down:#}");
    for d in ["x/empty", "e1/e2", "top"] {
        let back = dst.join("src").join(d);
        assert!(back.is_dir() && fs::read_dir(&back).unwrap().next().is_none(), "{d} did not come back empty");
    }
    assert_same_tree(&src, &dst.join("src"));
}

const MIB: u64 = 1 << 20;
/// The size of the parts of dmover's multipart uploads (the first 2,000).
const PART: u64 = 8 * MIB;
/// Parts a re-run may send again though the first run recorded them: it
/// keeps a block only where the engine's journal of blocks written also
/// has it, and under load that journal was seen a few parts behind.
const LAG_PARTS: u64 = 2;

/// A file of `size` bytes, sparse but different in every MiB (4 KiB of
/// random bytes at the start of each), written in a moment.
fn make_sparse(path: &Path, size: u64, seed: u64) {
    use std::os::unix::fs::FileExt;
    let f = fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    let mut rng = Rng::new(seed);
    let mut buf = [0u8; 4096];
    for off in (0..size).step_by(MIB as usize) {
        rng.fill(&mut buf);
        let n = buf.len().min((size - off) as usize);
        f.write_all_at(&buf[..n], off).unwrap();
    }
}

/// What a whole upload of `file` sends (its holes go as a few bytes, so
/// far less than its size): measured by uploading it to a key of its own
/// in bucket `data` (whose directory is `bucket`), removed afterwards. What a resumed upload sends is judged against it.
fn whole_send(t: &Setup, bucket: &Path, file: &Path) -> u64 {
    let j = t.cp([file.to_str().unwrap(), "s3://data/whole.bin"]).run().assert_ok();
    fs::remove_file(bucket.join("whole.bin")).unwrap();
    u(&j["sent_bytes"])
}

/// What a resumed upload of a file of `size` bytes that keeps `kept` of
/// them may send at most, when a whole upload sends `whole`: the rest's
/// share of it (the test files hold as much data in every MiB).
fn rest_of(whole: u64, size: u64, kept: u64) -> u64 {
    (u128::from(whole) * u128::from(size.saturating_sub(kept)) / u128::from(size)) as u64
}

/// Runs `cp` (a `dmover cp`) and kills it with SIGKILL once the client has
/// recorded `parts` parts of its multipart upload as taken by the server
/// (made under the key the file is to have, invisible until complete);
/// returns how many it had recorded. The client's record is what a re-run
/// resumes from: the server's own list runs ahead of it, since parts sent
/// side by side at one pace end together and are recorded a moment after
/// the server has them.
fn kill_when_parts_recorded(state: &Path, cp: Cmd, parts: u64) -> u64 {
    let mut p = cp.spawn();
    let mut recorded = 0;
    let caught = wait_until(std::time::Duration::from_secs(300), || {
        recorded = recorded_parts(&state.join("uploads"));
        recorded >= parts || !p.running()
    });
    assert!(
        caught && p.running(),
        "the upload ended or stalled before it could be interrupted ({recorded} parts recorded in {})",
        state.join("uploads").display()
    );
    p.kill9();
    recorded
}

/// How many parts the records of uploads in progress in directory
/// `uploads` hold: each record is a line naming the upload, then a line
/// per part the server took (a torn last line is no part).
fn recorded_parts(uploads: &Path) -> u64 {
    let Ok(dir) = fs::read_dir(uploads) else { return 0 };
    dir.flatten().filter_map(|e| fs::read_to_string(e.path()).ok()).map(|text| text.matches('\n').count().saturating_sub(1) as u64).sum()
}

/// The indices of the parts the records of uploads in progress in
/// directory `uploads` hold (a line `INDEX ETAG` each, after the first).
fn recorded_part_indices(uploads: &Path) -> Vec<u64> {
    let Ok(dir) = fs::read_dir(uploads) else { return Vec::new() };
    let texts: Vec<String> = dir.flatten().filter_map(|e| fs::read_to_string(e.path()).ok()).collect();
    let lines = texts.iter().flat_map(|t| t.split_inclusive('\n').skip(1).filter_map(|l| l.strip_suffix('\n')));
    lines.filter_map(|l| l.split_once(' ')?.0.parse().ok()).collect()
}

#[test]
fn a_2_gib_upload_killed_midway_resumes_from_the_parts_sent() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    // Not a whole number of parts: the last one is short.
    let size = (2 << 30) + 12345;
    let file = src.join("huge.bin");
    make_sparse(&file, size, 31);
    let args = [file.to_str().unwrap(), "s3://data/up/huge.bin"];
    // Killed once a quarter of the parts are recorded.
    let recorded = kill_when_parts_recorded(&t.state(), t.cp(args), size / PART / 4);
    // Nothing is visible under the final key, the upload is incomplete.
    assert!(!bucket.join("up/huge.bin").exists(), "visible after the copy was killed");
    assert_eq!(t.s3.uploads("data").len(), 1, "{:?}", t.s3.uploads("data"));

    // Over a gigabyte through a debug build, beside the other tests.
    let j = t.cp(args).timeout(std::time::Duration::from_secs(900)).run().assert_ok();
    let (sent, whole) = (u(&j["sent_bytes"]), whole_send(&t, &bucket, &file));
    eprintln!("re-run: sent {sent} bytes, a whole upload {whole}; {recorded} parts were recorded when the first run was killed");
    assert!(
        sent <= rest_of(whole, size, (recorded - LAG_PARTS) * PART),
        "the re-run sent {sent} of the {whole} bytes a whole upload sends, though {recorded} parts of {PART} bytes were recorded"
    );
    assert!(same_content(&file, &bucket.join("up/huge.bin")), "the object differs from the file");
    assert_eq!(t.s3.uploads("data"), [], "incomplete multipart uploads remain");
    assert_eq!(list_files(&bucket).into_keys().collect::<Vec<_>>(), ["up/huge.bin"]);
    // Nor is resume state left behind.
    let state = t.state();
    assert_eq!(list_files(&state).into_keys().collect::<Vec<_>>(), Vec::<String>::new(), "left in {}", state.display());
}

/// An upload's memory is bounded by `--staging`, whatever the file's size.
///
/// The copy runs both ends in one process, so three things hold data, each
/// within `--staging`: the reading side's staging blocks, the receiving
/// side's, and the S3 storage's parts being filled and sent (plus one part
/// while a part is read back from disk). The fixed overhead is measured,
/// not guessed: the peak of the same command uploading a file smaller than
/// a part (the binary, the SDK and its runtime, the threads' stacks and
/// the allocator's arenas, with a few blocks and that small part in use).
/// Blocks of a large file arrive out of order from several readers and
/// streams, so many parts fill at once: held in memory unbounded, they took
/// several times the staging.
#[test]
fn an_uploads_memory_stays_within_its_staging() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    const STAGING: u64 = 32 * MIB;
    let staging = format!("{}M", STAGING / MIB);
    let small = src.join("small.bin");
    make_sparse(&small, 4 * MIB, 51);
    let (run, base_kib) = t.cp([small.to_str().unwrap(), "s3://data/small.bin", "--staging", &staging]).spawn().wait_peak_rss();
    run.assert_ok();
    let size = 320 * MIB + 4321;
    let file = src.join("big.bin");
    make_sparse(&file, size, 53);
    let args = [file.to_str().unwrap(), "s3://data/big.bin", "--staging", &staging];
    let (run, peak_kib) = t.cp(args).timeout(std::time::Duration::from_secs(600)).spawn().wait_peak_rss();
    run.assert_ok();
    assert!(same_content(&file, &bucket.join("big.bin")), "the object differs from the file");
    let bound_kib = base_kib + (3 * STAGING + PART) / 1024;
    eprintln!("peak RSS: {peak_kib} KiB uploading {size} bytes, {base_kib} KiB uploading 4 MiB; bound {bound_kib} KiB");
    assert!(
        peak_kib <= bound_kib,
        "uploading {size} bytes with --staging {staging} peaked at {peak_kib} KiB, over {bound_kib} KiB \
         ({base_kib} KiB for a small upload, three times the staging and one part)"
    );
    // The parts that went to disk are gone with the upload.
    let state = t.state();
    assert_eq!(list_files(&state).into_keys().collect::<Vec<_>>(), Vec::<String>::new(), "left in {}", state.display());
}

#[test]
fn an_upload_whose_blocks_straddle_parts_resumes_identical() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    let file = src.join("odd.bin");
    let size = 80 * MIB + 777;
    make_sparse(&file, size, 43);
    // 3 MiB blocks: some lie across two parts, one kept and one not.
    let args = [file.to_str().unwrap(), "s3://data/odd.bin", "--block-size", "3M", "--bwlimit", "16M"];
    // Six of its ten parts recorded, wherever they lie. The re-run keeps
    // every block lying wholly in recorded parts, but for the blocks of a
    // lag of the journal.
    kill_when_parts_recorded(&t.state(), t.cp(args), 6);
    let parts = recorded_part_indices(&t.state().join("uploads"));
    const BLOCK: u64 = 3 * MIB;
    let whole_blocks = (0..size.div_ceil(BLOCK))
        .filter(|b| {
            let (start, end) = (b * BLOCK, ((b + 1) * BLOCK).min(size));
            (start / PART..=(end - 1) / PART).all(|p| parts.contains(&p))
        })
        .count() as u64;
    let kept = (whole_blocks * BLOCK).saturating_sub(LAG_PARTS * PART);
    let j = t.cp(args).run().assert_ok();
    let (sent, whole) = (u(&j["sent_bytes"]), whole_send(&t, &bucket, &file));
    eprintln!("re-run: sent {sent} bytes, a whole upload {whole}; parts {parts:?} were recorded, {whole_blocks} blocks wholly in them");
    assert!(
        kept > size / 4 && sent <= rest_of(whole, size, kept),
        "the re-run sent {sent} of the {whole} bytes a whole upload sends, though parts {parts:?} were recorded, holding {whole_blocks} whole blocks of {BLOCK} bytes"
    );
    assert!(same_content(&file, &bucket.join("odd.bin")), "the object differs from the file");
    assert_eq!(t.s3.uploads("data"), [], "incomplete multipart uploads remain");
}

#[test]
fn an_upload_whose_source_changed_is_started_afresh_and_the_old_one_aborted() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    let file = src.join("moving.bin");
    let size = 64 * MIB;
    make_sparse(&file, size, 47);
    // An older object is there: the upload is made under its key, but it
    // stays whole until the new one is complete.
    let older = src.join("older");
    fs::write(&older, b"the version before").unwrap();
    t.cp([older.to_str().unwrap(), "s3://data/moving.bin"]).run().assert_ok();
    let args = [file.to_str().unwrap(), "s3://data/moving.bin", "--bwlimit", "8M"];
    kill_when_parts_recorded(&t.state(), t.cp(args), 2);
    let old_upload = t.s3.uploads("data");
    assert_eq!(old_upload.len(), 1, "{old_upload:?}");
    assert_eq!(fs::read(bucket.join("moving.bin")).unwrap(), b"the version before", "the older object was touched");
    // Rewritten with other bytes (and so a new mtime) before the re-run.
    make_sparse(&file, size, 48);
    let j = t.cp(args).run().assert_ok();
    // Everything a fresh upload of the file sends (its holes' pages of
    // zeros go as a bitmap), none of it kept from the old upload.
    let fresh = t.cp([file.to_str().unwrap(), "s3://data/fresh.bin"]).run().assert_ok();
    assert_eq!(u(&j["sent_bytes"]), u(&fresh["sent_bytes"]), "the re-run kept parts of the old version: {j:#}");
    assert!(same_content(&file, &bucket.join("moving.bin")), "the object is not the new version");
    assert_eq!(t.s3.uploads("data"), [], "the old upload was not aborted");
}

/// A download reads many objects at once and streams ahead in each, but
/// the bytes it holds stay within its staging: with 32 readers its peak
/// RSS stays within that of a small download plus three times the staging
/// (the copy's own staging at each end, the GETs' batches) and, per reader,
/// a block fetched outside the bound (twice, while its batch is copied out)
/// and its HTTP connection's buffers.
#[test]
fn a_downloads_memory_stays_within_its_staging() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    make_sparse(&bucket.join("small.bin"), 4 * MIB, 61);
    let size = 640 * MIB + 4321;
    make_sparse(&bucket.join("big.bin"), size, 63);
    const STAGING: u64 = 32 * MIB;
    let staging = format!("{}M", STAGING / MIB);
    let down = t.env.mkdir("down");
    let to = down.to_str().unwrap();
    let (run, base_kib) = t.cp(["s3://data/small.bin", to, "--staging", &staging, "--concurrency", "32"]).spawn().wait_peak_rss();
    run.assert_ok();
    let args = ["s3://data/big.bin", to, "--staging", &staging, "--concurrency", "32"];
    let (run, peak_kib) = t.cp(args).timeout(std::time::Duration::from_secs(600)).spawn().wait_peak_rss();
    run.assert_ok();
    assert!(same_content(&bucket.join("big.bin"), &down.join("big.bin")), "the download differs from the object");
    let bound_kib = base_kib + (3 * STAGING + 32 * (2 * MIB + MIB / 2)) / 1024;
    eprintln!("peak RSS: {peak_kib} KiB downloading {size} bytes, {base_kib} KiB downloading 4 MiB; bound {bound_kib} KiB");
    assert!(
        peak_kib <= bound_kib,
        "downloading {size} bytes with --staging {staging} peaked at {peak_kib} KiB, over {bound_kib} KiB \
         ({base_kib} KiB for a small download, three times the staging and 2.5 MiB for each of 32 readers)"
    );
}

#[test]
fn a_download_killed_midway_resumes_into_its_partial_file() {
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("data");
    let src = t.env.mkdir("src");
    let file = src.join("big.bin");
    let size = 64 * MIB + 999;
    make_sparse(&file, size, 41);
    t.cp([file.to_str().unwrap(), "s3://data/big.bin"]).run().assert_ok();
    let down = t.env.mkdir("down");
    let args = ["s3://data/big.bin", down.to_str().unwrap(), "--bwlimit", "8M"];
    let mut p = t.cp(args).spawn();
    let partial = down.join(".big.bin.dmover-part");
    let mut written = 0;
    let caught = wait_until(std::time::Duration::from_secs(60), || {
        written = fs::metadata(&partial).map_or(0, |m| std::os::unix::fs::MetadataExt::blocks(&m) * 512);
        written >= size * 2 / 5 || !p.running()
    });
    assert!(caught && p.running(), "the download ended or stalled before it could be interrupted ({written} bytes written)");
    p.kill9();
    assert!(!down.join("big.bin").exists(), "big.bin exists under its final name after an interruption");

    let j = t.cp(args).run().assert_ok();
    let sent = u(&j["sent_bytes"]);
    eprintln!("re-run: sent {sent} of {size} bytes; {written} were written before the interruption");
    assert!(sent + written / 2 < size, "the re-run sent {sent} of {size} bytes although {written} were already written: not resumed");
    assert!(same_content(&file, &down.join("big.bin")), "the download differs from the file");
    assert_eq!(list_files(&down).into_keys().collect::<Vec<_>>(), ["big.bin"]);
}

#[test]
fn bucket_to_bucket() {
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("one");
    let two = t.s3.bucket("two");
    let src = t.env.mkdir("src");
    make_tree(&src, 27, 8);
    t.cp([src.to_str().unwrap(), "s3://one/"]).run().assert_ok();
    t.cp(["s3://one/src", "s3://two/copy/"]).run().assert_ok();
    let dst = t.env.mkdir("dst");
    t.cp(["s3://two/copy/src", dst.to_str().unwrap()]).run().assert_ok();
    assert_same_tree(&src, &dst.join("src"));
    assert_eq!(list_files(&two.join("copy/src")).len(), list_files(&src).len());
}

/// A bucket is a source and a destination for a server too: the client
/// reads the objects and sends them, or receives and writes them.
#[test]
fn between_a_bucket_and_a_server_both_ways() {
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("one");
    let two = t.s3.bucket("two");
    let src = t.env.mkdir("src");
    make_tree(&src, 31, 25);
    make_file(&src.join("big/large.bin"), 2 * PART + 777, &mut Rng::new(8));
    t.cp([src.to_str().unwrap(), "s3://one/"]).run().assert_ok();
    let export = t.env.mkdir("export");
    let srv = Server::start(ServerSpec::new(&t.env.token, &[("e", &export)], &t.env.path("server.log")));

    let j = t.cp(["s3://one/src", &srv.url("e/")]).run().assert_ok();
    assert_eq!(u(&j["files"]), list_files(&src).len() as u64, "{j:#}");
    assert_same_tree(&src, &export.join("src"));

    let j = t.cp([srv.url("e/src"), "s3://two/back/".into()]).run().assert_ok();
    assert_eq!(u(&j["files"]), list_files(&src).len() as u64, "{j:#}");
    for (rel, _) in list_files(&src) {
        assert_eq!(fs::read(two.join("back/src").join(&rel)).unwrap(), fs::read(src.join(&rel)).unwrap(), "{rel}");
    }
    let stray: Vec<_> = list_tree(&two).into_keys().filter(|k| k.contains(".part") || k.contains(".dmover")).collect();
    assert!(stray.is_empty(), "left in the bucket: {stray:?}");
}

#[test]
fn objects_other_tools_wrote_come_down_too() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    // Written behind the server's back: objects with no dmover metadata.
    fs::create_dir_all(bucket.join("in/sub")).unwrap();
    fs::write(bucket.join("in/a.txt"), b"from another tool").unwrap();
    let mut rng = Rng::new(3);
    make_file(&bucket.join("in/sub/b.bin"), 5 << 20, &mut rng);
    let dst = t.env.mkdir("dst");
    let j = t.cp(["s3://data/in/", dst.to_str().unwrap()]).run().assert_ok();
    assert_eq!(u(&j["files"]), 2, "{j:#}");
    assert_eq!(fs::read(dst.join("a.txt")).unwrap(), b"from another tool");
    assert_eq!(fs::read(dst.join("sub/b.bin")).unwrap(), fs::read(bucket.join("in/sub/b.bin")).unwrap());
    let mode = std::os::unix::fs::PermissionsExt::mode(&fs::metadata(dst.join("a.txt")).unwrap().permissions()) & 0o777;
    assert_eq!(mode, 0o644, "an object without a stored mode comes down as 0644");
}

#[test]
fn a_glob_picks_objects() {
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 22, 12);
    t.cp([&format!("{}/", src.display()), "s3://data/"]).run().assert_ok();
    let dst = t.env.mkdir("dst");
    let j = t.cp(["s3://data/a/*.dat", dst.to_str().unwrap()]).run().assert_ok();
    let want: Vec<String> = fs::read_dir(src.join("a"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".dat"))
        .collect();
    assert_eq!(u(&j["files"]), want.len() as u64, "{j:#}");
    // ls names what the copy sent.
    let r = dmover(["ls", "--json", "s3://data/a/*.dat"]).s3(&t.s3, &t.env.path("home")).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let listed: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let mut names: Vec<String> = listed.as_array().unwrap().iter().map(|e| e["path"].as_str().unwrap().to_string()).collect();
    let mut want = want;
    names.sort();
    want.sort();
    assert_eq!(names, want);
    for n in want {
        assert_eq!(fs::read(dst.join(&n)).unwrap(), fs::read(src.join("a").join(&n)).unwrap(), "{n}");
    }
}

#[test]
fn sync_skips_what_is_there_both_ways() {
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 23, 10);
    // Uploaded in parts, its metadata set after.
    make_file(&src.join("parts.bin"), 20 << 20, &mut Rng::new(24));
    let j = t.cp([src.to_str().unwrap(), "s3://data/", "--sync"]).run().assert_ok();
    let files = u(&j["files"]);
    assert_eq!(u(&j["skipped_files"]), 0, "{j:#}");
    // Unchanged: nothing goes up again.
    let j = t.cp([src.to_str().unwrap(), "s3://data/", "--sync"]).run().assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "--sync should skip every unchanged file: {j:#}");
    // By content too.
    let j = t.cp([src.to_str().unwrap(), "s3://data/", "--sync", "--checksum"]).run().assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "--sync -c should skip every unchanged file: {j:#}");
    // One file changed: only it goes.
    fs::write(src.join("one.bin"), b"changed").unwrap();
    let j = t.cp([src.to_str().unwrap(), "s3://data/", "--sync"]).run().assert_ok();
    assert_eq!(u(&j["skipped_files"]), files - 1, "{j:#}");
    // And down: a second download skips everything.
    let dst = t.env.mkdir("dst");
    t.cp(["s3://data/src", dst.to_str().unwrap(), "--sync"]).run().assert_ok();
    let j = t.cp(["s3://data/src", dst.to_str().unwrap(), "--sync"]).run().assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "{j:#}");
    assert_same_tree(&src, &dst.join("src"));
}

/// The HEAD requests among those `seen` of objects below `prefix` (a key
/// prefix of bucket `data`).
fn heads_below(seen: &std::sync::Mutex<Vec<u8>>, prefix: &str) -> usize {
    let head = format!("HEAD /data/{prefix}");
    String::from_utf8_lossy(&seen.lock().unwrap()).lines().filter(|l| l.starts_with(&head)).count()
}

/// A first copy into an empty destination asks nothing per file there: an
/// upload of `src` to a bucket holding other objects makes no HEAD of an
/// object (the prefix `src/` is found empty by one listing), and a
/// download into an empty directory fetches each small object whole as it
/// is listed, with no HEAD. A plain re-run skips every file both ways and
/// sends nothing (it looks at each: a HEAD per object).
#[test]
fn a_first_copy_asks_nothing_per_file_and_a_rerun_sends_nothing_both_ways() {
    let Some(t) = Setup::new() else { return };
    fs::write(t.s3.bucket("data").join("other.txt"), b"not part of the copy").unwrap();
    let src = t.env.mkdir("src");
    let files = 40;
    for i in 0..files {
        write_random(&src.join(format!("d{}/f{i}.dat", i % 4)), 100 + 37 * i as u64, i as u64);
    }
    let dst = t.env.mkdir("dst");
    let copy = |from: &str, to: &str| {
        let (relay, seen) = recording_relay(&t.s3);
        let mut c = t.cp([from, to]);
        c.env("AWS_ENDPOINT_URL", format!("http://{}", relay.addr()));
        let j = c.run().assert_ok();
        (j, heads_below(&seen, "src/"))
    };
    let (up, down) = ([src.to_str().unwrap(), "s3://data/"], ["s3://data/src", dst.to_str().unwrap()]);
    for (way, [from, to]) in [("up", up), ("down", down)] {
        let (j, n) = copy(from, to);
        assert_eq!(u(&j["skipped_files"]), 0, "{way}: {j:#}");
        assert_eq!(n, 0, "{way}: a first copy of {files} files into an empty destination made {n} HEAD requests of objects");
        let (j, n) = copy(from, to);
        assert_eq!((u(&j["skipped_files"]), u(&j["sent_bytes"])), (files as u64, 0), "{way}: a re-run should send nothing: {j:#}");
        assert!(n >= files, "{way}: a re-run made {n} HEAD requests for {files} files: it did not look at them");
    }
    assert_same_tree(&src, &dst.join("src"));
}

/// The object a run cut short between completing an upload and setting its
/// metadata leaves: whole, without dmover's metadata (written here behind
/// the server's back with the file's bytes). `--sync` sends it again, and
/// the object it leaves has its metadata: the next `--sync` skips it and a
/// download has the file's mtime and mode.
#[test]
fn sync_sends_again_an_object_without_dmovers_metadata() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 29, 6);
    // Uploaded in parts, as such a run leaves it.
    make_file(&src.join("parts.bin"), 20 * MIB + 5, &mut Rng::new(30));
    let files = u(&t.cp([src.to_str().unwrap(), "s3://data/", "--sync"]).run().assert_ok()["files"]);
    for name in ["parts.bin", "one.bin"] {
        let obj = bucket.join("src").join(name);
        let bytes = fs::read(&obj).unwrap();
        fs::remove_file(&obj).unwrap();
        fs::write(&obj, &bytes).unwrap();
        assert!(same_content(&src.join(name), &obj), "{name}: the object's bytes are not the file's");
    }
    let j = t.cp([src.to_str().unwrap(), "s3://data/", "--sync"]).run().assert_ok();
    assert_eq!(u(&j["skipped_files"]), files - 2, "--sync must send again the 2 objects without dmover's metadata: {j:#}");
    assert_eq!(u(&j["files"]), files, "{j:#}");
    let j = t.cp([src.to_str().unwrap(), "s3://data/", "--sync"]).run().assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "the objects sent again did not get their metadata: {j:#}");
    let dst = t.env.mkdir("dst");
    t.cp(["s3://data/src", dst.to_str().unwrap()]).run().assert_ok();
    assert_same_tree(&src, &dst.join("src"));
}

/// `--sync` decides by size and mtime, `--sync -c` by content: a file
/// changed keeping its size (a new mtime) is sent by `--sync`; one changed
/// keeping its size and its mtime is left by `--sync` and sent by
/// `--sync -c`, which leaves the unchanged ones. Objects keep the files'
/// mtimes throughout (a download has them).
#[test]
fn sync_sees_a_same_size_change_and_with_checksum_a_same_mtime_change() {
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 32, 8);
    make_file(&src.join("parts.bin"), 20 * MIB + 5, &mut Rng::new(33));
    let up = |extra: &[&str]| {
        let mut args = vec![src.to_str().unwrap(), "s3://data/", "--sync"];
        args.extend(extra);
        t.cp(args).run().assert_ok()
    };
    let files = u(&up(&[])["files"]);
    let down = |name: &str| {
        let dst = t.env.mkdir(name);
        t.cp(["s3://data/src", dst.to_str().unwrap()]).run().assert_ok();
        assert_same_tree(&src, &dst.join("src"));
    };
    // Rewritten with other bytes of the same size, as an edit leaves it (a new mtime).
    let flip = |name: &str| {
        let path = src.join(name);
        let mut data = fs::read(&path).unwrap();
        let mid = data.len() / 2;
        data[mid] ^= 0x55;
        let before = mtime_of(&path);
        fs::write(&path, &data).unwrap();
        set_mtime(&path, before.0 + 7, before.1);
        before
    };
    flip("parts.bin");
    flip("one.bin");
    let j = up(&[]);
    assert_eq!(u(&j["skipped_files"]), files - 2, "--sync must send the 2 files changed keeping their size: {j:#}");
    down("dst1");
    // Changed keeping size and mtime: --sync cannot tell, -c can.
    for name in ["parts.bin", "one.bin"] {
        let before = flip(name);
        set_mtime(&src.join(name), before.0, before.1);
    }
    let j = up(&[]);
    assert_eq!(u(&j["skipped_files"]), files, "--sync without -c decides by size and mtime alone: {j:#}");
    let j = up(&["-c"]);
    assert_eq!(u(&j["skipped_files"]), files - 2, "--sync -c must send the 2 files whose content changed: {j:#}");
    down("dst2");
}

#[test]
fn damaged_objects_fail_verification_on_the_way_down() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    let mut rng = Rng::new(9);
    // One read in a single GET, one in ranges of it.
    make_file(&src.join("small.bin"), 3 << 20, &mut rng);
    // Larger than a part: uploaded in parts, its digest set after.
    make_file(&src.join("large.bin"), 20 << 20, &mut rng);
    t.cp([src.to_str().unwrap(), "s3://data/"]).run().assert_ok();
    // Damage the objects behind the server's back, keeping their size.
    for name in ["small.bin", "large.bin"] {
        let obj = bucket.join("src").join(name);
        let mut data = fs::read(&obj).unwrap();
        data[(1 << 20) + 7] ^= 1;
        fs::write(&obj, &data).unwrap();
    }
    let dst = t.env.mkdir("dst");
    let r = t.cp(["s3://data/src/", dst.to_str().unwrap()]).run();
    assert_ne!(r.code, 0, "a damaged object was accepted: {}", r.stdout);
    let j = r.json();
    let errors = j["errors"].as_array().cloned().unwrap_or_default();
    assert_eq!(errors.len(), 2, "{j:#}");
    for e in &errors {
        assert_eq!(e["kind"], "verify-failed", "{j:#}");
    }
    // The large one, read in ranges, is caught by dmover's own digest (the
    // small one by that or by the server's checksum of the whole object).
    let large = errors.iter().find(|e| e["path"].as_str().unwrap_or("").ends_with("large.bin")).expect("large.bin failed");
    assert!(large["message"].as_str().unwrap().contains("differs from the digest stored with the file"), "{j:#}");
    assert!(list_files(&dst).is_empty(), "a damaged file was kept: {:?}", list_files(&dst));
}

#[test]
fn credentials_from_a_profile_and_the_endpoint_from_the_command_line() {
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("data");
    let home = t.env.path("home");
    fs::create_dir_all(home.join(".aws")).unwrap();
    fs::write(
        home.join(".aws/credentials"),
        format!("[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n[lab]\naws_access_key_id = {}\naws_secret_access_key = {}\n", t.s3.access_key, t.s3.secret_key),
    )
    .unwrap();
    let src = t.env.mkdir("src");
    make_tree(&src, 24, 3);
    let mut c = t.cp([src.to_str().unwrap(), "s3://data/p", "--s3-endpoint", &t.s3.endpoint()]);
    c.env_remove("AWS_ACCESS_KEY_ID").env_remove("AWS_SECRET_ACCESS_KEY").env_remove("AWS_ENDPOINT_URL").env("AWS_PROFILE", "lab");
    c.run().assert_ok();
    assert!(t.s3.root.join("data/p/src/one.bin").exists());
}

/// A relay in front of the S3 server that keeps every byte clients send
/// through it (HTTP in the clear: the requests' headers).
fn recording_relay(s3: &S3Server) -> (Relay, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = seen.clone();
    let tap: Tap = std::sync::Arc::new(move |piece: &mut [u8]| keep.lock().unwrap().extend_from_slice(piece));
    (Relay::tapped(&s3.endpoint().replace("http://", ""), Some(tap)), seen)
}

/// Whether the requests `seen` carried `token` as their session token.
fn carried_session_token(seen: &std::sync::Mutex<Vec<u8>>, token: &str) -> bool {
    let text = String::from_utf8_lossy(&seen.lock().unwrap()).to_ascii_lowercase();
    text.contains(&format!("x-amz-security-token: {}", token.to_ascii_lowercase()))
}

/// Temporary credentials: a session token, from `AWS_SESSION_TOKEN` or a
/// profile's `aws_session_token`, goes with the requests (versitygw, which
/// has no temporary credentials, refuses them: only the requests are
/// checked). And from shared files that `AWS_SHARED_CREDENTIALS_FILE` and
/// `AWS_CONFIG_FILE` name, the profile `AWS_PROFILE` names gives the keys
/// and (`endpoint_url` in the config file) the endpoint, with neither
/// `--s3-endpoint` nor `AWS_ENDPOINT_URL`.
#[test]
fn session_tokens_and_a_profile_with_its_endpoint_from_shared_files() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 31, 3);

    let (relay, seen) = recording_relay(&t.s3);
    let mut c = t.cp([src.to_str().unwrap(), "s3://data/env"]);
    c.env("AWS_ENDPOINT_URL", format!("http://{}", relay.addr())).env("AWS_SESSION_TOKEN", "token-from-the-environment");
    let r = c.run();
    assert!(carried_session_token(&seen, "token-from-the-environment"), "AWS_SESSION_TOKEN did not reach the requests:\n{}", r.stderr);

    let (relay, seen) = recording_relay(&t.s3);
    let aws = t.env.mkdir("elsewhere");
    let (credentials, config) = (aws.join("creds"), aws.join("conf"));
    let keys = format!("aws_access_key_id = {}\naws_secret_access_key = {}\n", t.s3.access_key, t.s3.secret_key);
    let profiles = format!(
        "[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n[lab]\n{keys}\n[temp]\n{keys}aws_session_token = token-of-the-profile\n"
    );
    fs::write(&credentials, profiles).unwrap();
    let endpoint = format!("endpoint_url = http://{}\n", relay.addr());
    fs::write(&config, format!("[default]\nregion = us-east-1\n\n[profile lab]\n{endpoint}\n[profile temp]\n{endpoint}")).unwrap();
    let from_files = |profile: &str| {
        let mut c = t.cp([src.to_str().unwrap(), &format!("s3://data/{profile}")]);
        c.env_remove("AWS_ACCESS_KEY_ID").env_remove("AWS_SECRET_ACCESS_KEY").env_remove("AWS_ENDPOINT_URL");
        c.env("AWS_SHARED_CREDENTIALS_FILE", &credentials).env("AWS_CONFIG_FILE", &config).env("AWS_PROFILE", profile);
        c.run()
    };
    from_files("lab").assert_ok();
    assert_eq!(list_files(&bucket.join("lab/src")).keys().collect::<Vec<_>>(), list_files(&src).keys().collect::<Vec<_>>());
    assert!(relay.to_server() > 0, "nothing went to the endpoint_url of the profile");
    let r = from_files("temp");
    assert!(
        carried_session_token(&seen, "token-of-the-profile"),
        "the profile's aws_session_token did not reach the requests:\n{}",
        r.stderr
    );
}

/// CLI.md: an object's `dmover-digest` is checked on the way down when the
/// same `--block-size` is used, and only then (a digest made with other
/// blocks cannot be compared): an intact object comes down with another
/// block size, and a damaged one fails with the same.
#[test]
fn an_objects_digest_is_checked_only_with_the_block_size_it_was_made_with() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    // Larger than a part, so that it is read in ranges and only dmover's
    // own digest can catch damage (not the server's checksum of the whole).
    make_file(&src.join("large.bin"), 20 * MIB, &mut Rng::new(41));
    t.cp([src.to_str().unwrap(), "s3://data/", "--block-size", "1M"]).run().assert_ok();
    let other = t.env.mkdir("other");
    t.cp(["s3://data/src/", other.to_str().unwrap(), "--block-size", "4M"]).run().assert_ok();
    assert_same_tree(&src, &other);

    let obj = bucket.join("src/large.bin");
    let mut data = fs::read(&obj).unwrap();
    data[(3 << 20) + 11] ^= 1;
    fs::write(&obj, &data).unwrap();
    let same = t.env.mkdir("same");
    let r = t.cp(["s3://data/src/", same.to_str().unwrap(), "--block-size", "1M"]).run();
    let j = r.json();
    assert_ne!(r.code, 0, "a damaged object was accepted with the block size of its digest: {j:#}");
    assert_eq!(j["errors"][0]["kind"], "verify-failed", "{j:#}");
}

#[test]
fn wrong_credentials_say_so() {
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 25, 1);
    let mut c = t.cp([src.to_str().unwrap(), "s3://data/"]);
    c.env("AWS_SECRET_ACCESS_KEY", "not-the-secret");
    let r = c.run();
    r.assert_fails(ErrorKind::Auth as i32, &["s3://data", "refused the credentials", &t.s3.access_key, "AWS_SECRET_ACCESS_KEY"]);
}

#[test]
fn no_credentials_or_no_server_say_so() {
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 28, 1);
    let mut c = t.cp([src.to_str().unwrap(), "s3://data/"]);
    c.env_remove("AWS_ACCESS_KEY_ID").env_remove("AWS_SECRET_ACCESS_KEY");
    let r = c.run();
    r.assert_fails(ErrorKind::Usage as i32, &["s3://data", "no S3 credentials found", "AWS_ACCESS_KEY_ID", "AWS_PROFILE"]);
    let endpoint = format!("http://127.0.0.1:{}", closed_port());
    let r2 = t.cp([src.to_str().unwrap(), "s3://data/", "--s3-endpoint", &endpoint]).run();
    r2.assert_fails(
        ErrorKind::Unreachable as i32,
        &["s3://data", "cannot reach the S3 server", &endpoint, "--s3-endpoint", "Connection refused"],
    );
    // People's words, not the SDK's debug form (`CredentialsNotLoaded(CredentialsNotLoaded { source: …`).
    for stderr in [&r.stderr, &r2.stderr] {
        assert!(!stderr.contains(" { ") && !stderr.contains("(Some("), "debug output in a message: {stderr}");
    }
}

#[test]
fn a_missing_bucket_says_what_to_do() {
    let Some(t) = Setup::new() else { return };
    let src = t.env.mkdir("src");
    make_tree(&src, 26, 1);
    let r = t.cp([src.to_str().unwrap(), "s3://nobucket/x"]).run();
    r.assert_fails(ErrorKind::NotFound as i32, &["s3://nobucket", "no such bucket", "create it first"]);
    let r = t.cp(["s3://nobucket/x", t.env.mkdir("dst").to_str().unwrap()]).run();
    r.assert_fails(ErrorKind::NotFound as i32, &["s3://nobucket", "no such bucket"]);
    // A name S3 does not take (too short).
    let r = t.cp([src.to_str().unwrap(), "s3://ab/x"]).run();
    r.assert_fails(ErrorKind::Usage as i32, &["s3://ab", "HTTP 400", "bucket's name"]);
}

/// The paths of a JSON listing by `dmover ls --json`, sorted.
fn listed(r: &Run) -> Vec<String> {
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let mut names: Vec<String> = v.as_array().unwrap().iter().map(|e| e["path"].as_str().unwrap().to_string()).collect();
    names.sort();
    names
}

#[test]
fn a_served_bucket_takes_uploads_lists_them_and_gives_them_back() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    // Beside the prefix: the export must neither show nor touch it.
    fs::write(bucket.join("beside.txt"), b"not exported").unwrap();
    let srv = t.serve(&[("b", "s3://data/served/in")]);
    let src = t.env.mkdir("src");
    make_tree(&src, 61, 20);
    // Several parts of a multipart upload, the last one short.
    make_file(&src.join("big/large.bin"), 40 * MIB + 4321, &mut Rng::new(62));
    let j = t.env.cp([src.to_str().unwrap(), &srv.url("b/up/")]).run().assert_ok();
    let files = list_files(&src);
    assert_eq!(u(&j["files"]), files.len() as u64, "{j:#}");

    // Every object is under the prefix, and is its file byte for byte...
    let keys: Vec<String> = list_files(&bucket).into_keys().filter(|k| k != "beside.txt").collect();
    let want: Vec<String> = files.keys().map(|rel| format!("served/in/up/src/{rel}")).collect();
    assert_eq!(keys, want, "the bucket holds other objects than the files, under the prefix");
    assert_eq!(fs::read(bucket.join("beside.txt")).unwrap(), b"not exported");
    // ...and read back through the S3 API, with the metadata kept.
    let back = t.env.mkdir("back");
    t.cp(["s3://data/served/in/up/src", back.to_str().unwrap()]).run().assert_ok();
    assert_same_tree(&src, &back.join("src"));
    // The resume state was kept where the server keeps it, and is gone.
    let state = t.env.path("home/.cache/dmover/serve/b");
    assert!(state.join("journals").is_dir(), "no state directory at {}", state.display());
    assert_eq!(list_files(&state).into_keys().collect::<Vec<_>>(), Vec::<String>::new(), "left in {}", state.display());

    // ls names what is there, as for a directory export.
    let ls = |what: &str| dmover(["ls", "--json", "--token-file"]).arg(&t.env.token).arg(srv.url(what)).run();
    let want: Vec<String> = files.keys().map(|rel| format!("src/{rel}")).collect();
    assert_eq!(listed(&ls("b/up/src")), want);
    assert_eq!(listed(&ls("b/up/src/big/*.bin")), ["large.bin"]);
    let r = ls("b/beside.txt");
    assert_ne!(r.code, 0, "an object outside the prefix was listed: {}", r.stdout);

    // Down again, identical.
    let dst = t.env.mkdir("dst");
    let j = t.env.cp([&srv.url("b/up/src"), dst.to_str().unwrap()]).run().assert_ok();
    assert_eq!(u(&j["files"]), files.len() as u64, "{j:#}");
    assert_same_tree(&src, &dst.join("src"));
}

#[test]
fn third_party_copies_between_a_directory_export_and_a_bucket_export() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let dir = t.env.mkdir("export");
    let src = dir.join("src");
    make_tree(&src, 63, 15);
    make_file(&src.join("big/large.bin"), 20 * MIB + 99, &mut Rng::new(64));
    let srv = t.serve(&[("d", dir.to_str().unwrap()), ("b", "s3://data")]);

    // Directory export to bucket export, on one server.
    let j = t.env.cp([srv.url("d/src"), srv.url("b/tp/")]).run().assert_ok();
    assert_eq!(u(&j["files"]), list_files(&src).len() as u64, "{j:#}");
    for rel in list_files(&src).into_keys() {
        assert!(same_content(&src.join(&rel), &bucket.join("tp/src").join(&rel)), "{rel}: the object differs from the file");
    }

    // Bucket export to the directory export of another server.
    let dir2 = t.env.mkdir("export2");
    let other = t.serve(&[("d2", dir2.to_str().unwrap())]);
    let j = t.env.cp([srv.url("b/tp/src"), other.url("d2/back/")]).run().assert_ok();
    assert_eq!(u(&j["files"]), list_files(&src).len() as u64, "{j:#}");
    assert_same_tree(&src, &dir2.join("back/src"));
}

/// An upload into a served bucket cut short (the client killed) resumes
/// from the parts the S3 server holds, with the state the server keeps.
#[test]
fn an_upload_into_a_served_bucket_killed_midway_resumes() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let srv = t.serve(&[("b", "s3://data/in")]);
    let src = t.env.mkdir("src");
    let file = src.join("big.bin");
    let size = 160 * MIB + 999;
    make_sparse(&file, size, 66);
    let args = [file.to_str().unwrap().to_string(), srv.url("b/big.bin"), "--bwlimit".into(), "16M".into()];
    // The server records the parts it sent, in its export's state.
    let recorded = kill_when_parts_recorded(&t.env.path("home/.cache/dmover/serve/b"), t.env.cp(&args), 2);
    let j = t.env.cp(&args).run().assert_ok();
    let (sent, whole) = (u(&j["sent_bytes"]), whole_send(&t, &bucket, &file));
    eprintln!("re-run: sent {sent} bytes, a whole upload {whole}; {recorded} parts were recorded when the client was killed");
    assert!(sent > 0, "nothing was left to send: the first run was not cut short");
    assert!(
        sent <= rest_of(whole, size, recorded * PART),
        "the re-run sent {sent} of the {whole} bytes a whole upload sends, though {recorded} parts were recorded"
    );
    assert!(same_content(&file, &bucket.join("in/big.bin")), "the object differs from the file");
    assert_eq!(t.s3.uploads("data"), [], "incomplete multipart uploads remain");
    assert_eq!(list_files(&bucket).into_keys().collect::<Vec<_>>(), ["in/big.bin"]);
}

/// CLI.md: `--state-dir DIR` keeps a bucket export's resume state (the
/// records of its multipart uploads) in DIR/NAME, not in the default cache
/// directory, and an upload cut short resumes from it.
#[test]
fn a_bucket_exports_resume_state_is_kept_under_state_dir() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let state = t.env.path("state");
    let srv = t.serve_with(&[("b", "s3://data/in")], &["--state-dir", state.to_str().unwrap()]);
    let file = t.env.mkdir("src").join("big.bin");
    let size = 5 * PART + 999;
    make_sparse(&file, size, 67);
    let args = [file.to_str().unwrap().to_string(), srv.url("b/big.bin"), "--bwlimit".into(), "16M".into()];
    let recorded = kill_when_parts_recorded(&state.join("b"), t.env.cp(&args), 1);
    let default = t.env.path("home/.cache/dmover/serve");
    assert!(!default.exists(), "state went to the default {} despite --state-dir", default.display());
    let sent = u(&t.env.cp(&args).run().assert_ok()["sent_bytes"]);
    assert!(sent + recorded * PART <= size, "the re-run sent {sent} of {size} bytes, though {recorded} parts were recorded in --state-dir");
    assert!(same_content(&file, &bucket.join("in/big.bin")), "the object differs from the file");
}

/// Paths that try to leave a bucket export's prefix, sent as raw requests
/// and announcements (the client's own checks bypassed): every one is
/// refused, and nothing outside the prefix is read or written.
#[test]
fn paths_leaving_a_bucket_export_are_refused_at_the_wire_level() {
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    fs::write(bucket.join("secret.dat"), b"outside the prefix").unwrap();
    fs::create_dir_all(bucket.join("in")).unwrap();
    fs::write(bucket.join("in/inside.dat"), b"inside").unwrap();
    let srv = t.serve(&[("b", "s3://data/in")]);
    let mut c = Raw::control(&srv.addr(), t.env.token_str().as_bytes());
    let opts = TransferOptions { transfer_id: [5; 16], block_size: 1 << 20, flags: TransferFlags::empty(), tcp_buffer: 0 };
    for dest in ["b/..", "b/../x", "/etc", "b//x", "b/./x", "b/a\0b", "b/a\\..\\b", "b/x/../../y"] {
        c.refused(&Msg::Receive { dest: dest.into(), options: opts }, ErrorKind::Refused);
        c.refused(&Msg::Grant { dest: dest.into() }, ErrorKind::Refused);
    }
    for path in ["b/../secret.dat", "b/..", "b//inside.dat", "b/./inside.dat", "/data/secret.dat"] {
        c.refused(&Msg::List { path: path.into() }, ErrorKind::Refused);
    }
    // Inside a receiving session: announcements of paths that leave it.
    c.announcements_refused(
        "b/sub",
        opts,
        &["../escape.dat", "../../secret.dat", "/abs.dat", "a/\0/b", "a/./b", "a//b", "x/../../y", "a\\b"],
    );
    assert_eq!(list_files(&bucket).into_keys().collect::<Vec<_>>(), ["in/inside.dat", "secret.dat"], "the bucket changed");
    assert_eq!(fs::read(bucket.join("secret.dat")).unwrap(), b"outside the prefix");
    // Still serving, inside the prefix.
    let src = t.env.mkdir("src");
    make_tree(&src, 65, 3);
    t.env.cp([src.to_str().unwrap(), &srv.url("b")]).run().assert_ok();
    for rel in list_files(&src).into_keys() {
        assert!(same_content(&src.join(&rel), &bucket.join("in/src").join(&rel)), "{rel}: the object differs from the file");
    }
}

#[test]
fn a_bucket_export_that_cannot_be_served_stops_the_server_at_start() {
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("data");
    let r = t.serve_fails("b=s3://nobucket/x", &[]);
    r.assert_fails(ErrorKind::NotFound as i32, &["s3://nobucket", "no such bucket", &t.s3.endpoint(), "create it first"]);
    let r = t.serve_fails("b=s3://data", &["--s3-endpoint", &format!("http://127.0.0.1:{}", closed_port())]);
    r.assert_fails(ErrorKind::Unreachable as i32, &["s3://data", "cannot reach the S3 server", "--s3-endpoint"]);
    let mut c = dmover(["serve", "--listen", "127.0.0.1:0", "--export", "b=s3://data", "--token-file"]);
    c.arg(&t.env.token).s3(&t.s3, &t.env.path("home")).env("AWS_SECRET_ACCESS_KEY", "not-the-secret");
    c.run().assert_fails(ErrorKind::Auth as i32, &["s3://data", "refused the credentials", &t.s3.access_key, "AWS_SECRET_ACCESS_KEY"]);
    for bad in ["b=s3://", "b=s3:///x", "b=s3://data/../x", "b=s3://data//x", "b=s3://da ta"] {
        t.serve_fails(bad, &[]).assert_fails(ErrorKind::Usage as i32, &["malformed URL", "s3://BUCKET/prefix"]);
    }
}

/// A name that is not UTF-8 cannot be an S3 key: that file fails with an
/// error that says why, never under a changed name, and the others arrive;
/// a backslash in a name goes up and comes back as it was.
#[test]
fn a_name_no_key_can_hold_fails_clearly_and_a_backslash_goes_and_comes_back() {
    use std::os::unix::ffi::OsStrExt;
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    fs::write(src.join(std::ffi::OsStr::from_bytes(b"bad\xff.bin")), "not a key").unwrap();
    fs::write(src.join("back\\slash.txt"), "kept").unwrap();
    fs::write(src.join("plain.txt"), "plain").unwrap();
    let r = t.cp([format!("{}/", src.display()), "s3://data/n/".into()]).run();
    assert_ne!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let j = r.json();
    let errors = j["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 1, "{j:#}");
    assert!(errors[0]["path"].as_str().unwrap().contains("bad\\xff.bin"), "{j:#}");
    assert!(errors[0]["message"].as_str().unwrap().contains("UTF-8"), "{j:#}");
    let keys: Vec<String> = list_files(&bucket.join("n")).into_keys().collect();
    assert_eq!(keys, ["back\\\\slash.txt", "plain.txt"], "objects written");
    let dst = t.env.mkdir("dst");
    let j = t.cp(["s3://data/n/", dst.to_str().unwrap()]).run().assert_ok();
    assert_eq!(u(&j["files"]), 2, "{j:#}");
    assert_eq!(fs::read_to_string(dst.join("back\\slash.txt")).unwrap(), "kept");
    assert_eq!(fs::read_to_string(dst.join("plain.txt")).unwrap(), "plain");
}

/// `rclone ARGS` reaching the test's S3 server as the remote `vgw:`, with
/// no configuration or S3 settings of this environment's; panics unless
/// it succeeds.
fn rclone(t: &Setup, args: &[&str]) {
    let mut c = std::process::Command::new("rclone");
    for k in foreign_env() {
        c.env_remove(k);
    }
    c.env("RCLONE_CONFIG", t.env.path("rclone.conf"))
        .env("RCLONE_CONFIG_VGW_TYPE", "s3")
        .env("RCLONE_CONFIG_VGW_PROVIDER", "Other")
        .env("RCLONE_CONFIG_VGW_ENDPOINT", t.s3.endpoint())
        .env("RCLONE_CONFIG_VGW_REGION", "us-east-1");
    for (k, v) in t.s3.client_env() {
        match k.as_str() {
            "AWS_ACCESS_KEY_ID" => c.env("RCLONE_CONFIG_VGW_ACCESS_KEY_ID", v),
            "AWS_SECRET_ACCESS_KEY" => c.env("RCLONE_CONFIG_VGW_SECRET_ACCESS_KEY", v),
            _ => &mut c,
        };
    }
    let out = c.args(args).output().expect("run rclone");
    assert!(out.status.success(), "rclone {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Symlinks go up with -l as rclone's --links keeps them (the symlink NAME
/// is the object NAME.rclonelink, its target the content) and come back
/// down with -l as symlinks with their targets and mtimes, as rsync -a
/// copies them; without -l a download skips them with a warning, as it
/// skips a file system's. rclone reads dmover's upload back as symlinks,
/// and dmover reads rclone's.
#[test]
fn symlinks_go_up_and_come_back_with_links_as_rclone_keeps_them() {
    use dmover_testkit::tree::{self, Field};
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    fs::create_dir(src.join("dir")).unwrap();
    fs::write(src.join("dir/f.txt"), "content").unwrap();
    let links = [("relative", "dir/f.txt"), ("absolute", "/etc/hostname"), ("dir/dangling", "../no/such/file")];
    for (name, target) in links {
        std::os::unix::fs::symlink(target, src.join(name)).unwrap();
    }
    let reference = tree::rsync(&["-a"], &src, &t.env.path("src.rsync"));
    let with_links = [Field::Kind, Field::Content, Field::Perm, Field::Mtime, Field::Target];
    let up = format!("{}/", src.display());

    let j = t.cp([up.as_str(), "s3://data/up/", "-l"]).run().assert_ok();
    assert_eq!(u(&j["files"]), 4, "{j:#}");
    for (name, target) in links {
        let obj = bucket.join(format!("up/{name}.rclonelink"));
        assert_eq!(fs::read(&obj).unwrap_or_default(), target.as_bytes(), "{}", obj.display());
        assert!(!bucket.join("up").join(name).exists(), "{name} is also a plain object");
    }
    let ls = dmover(["ls", "s3://data/up/"]).s3(&t.s3, &t.env.path("home")).run();
    assert_eq!(ls.code, 0, "{}", ls.stderr);
    for (name, target) in links {
        assert!(ls.stdout.lines().any(|l| l.starts_with('l') && l.ends_with(&format!("{name} -> {target}"))), "{name}: {}", ls.stdout);
    }
    assert!(!ls.stdout.contains(".rclonelink"), "{}", ls.stdout);
    let again = t.cp([up.as_str(), "s3://data/up/", "-l", "--sync"]).run().assert_ok();
    assert_eq!(u(&again["skipped_files"]), 4, "{again:#}");

    let down = t.env.mkdir("down");
    let j = t.cp(["s3://data/up/", down.to_str().unwrap(), "-l"]).run().assert_ok();
    assert_eq!(u(&j["files"]), 4, "{j:#}");
    tree::assert_same(&reference, &down, &with_links);

    // Without -l: each skipped with a warning, and no .rclonelink file arrives.
    let plain = t.env.mkdir("plain");
    let r = t.cp(["s3://data/up/", plain.to_str().unwrap()]).run();
    assert_eq!(u(&r.assert_ok()["files"]), 1, "{}", r.stdout);
    assert_eq!(r.stderr.matches("symbolic link skipped").count(), 3, "{}", r.stderr);
    assert_eq!(list_files(&plain).len(), 1, "{:?}", list_files(&plain));

    if !on_path("rclone") {
        return;
    }
    // rclone reads dmover's upload as symlinks...
    let by_rclone = t.env.path("by-rclone");
    rclone(&t, &["copy", "--links", "vgw:data/up", by_rclone.to_str().unwrap()]);
    tree::assert_same(&reference, &by_rclone, &[Field::Kind, Field::Content, Field::Target]);
    // The links' mtimes too.
    let mtime = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        let m = fs::symlink_metadata(p).unwrap();
        (m.mtime(), m.mtime_nsec())
    };
    for (name, _) in links {
        assert_eq!(mtime(&by_rclone.join(name)), mtime(&reference.join(name)), "{name}'s mtime through rclone");
    }
    // ...and dmover reads rclone's, mtimes included.
    rclone(&t, &["copy", "--links", src.to_str().unwrap(), "vgw:data/rclone"]);
    let from_rclone = t.env.mkdir("from-rclone");
    t.cp(["s3://data/rclone/", from_rclone.to_str().unwrap(), "-l"]).run().assert_ok();
    tree::assert_same(&reference, &from_rclone, &[Field::Kind, Field::Content, Field::Target, Field::Mtime]);
}

/// Owners, groups and `user.*` extended attributes go up with `-aX` as
/// rclone's `--metadata` keeps them (`uid`, `gid`, and `NAME` for
/// `user.NAME`), and come back down as `rsync -aX --numeric-ids` copied
/// them; rclone reads dmover's objects so, and dmover reads rclone's. An
/// attribute metadata cannot hold fails its file, naming it, and `-A`
/// (which a bucket cannot keep) is refused.
#[test]
fn owners_and_xattrs_go_up_and_come_back_as_rclone_metadata() {
    use dmover_testkit::tree::{self, Field};
    let Some(t) = Setup::new() else { return };
    t.s3.bucket("data");
    let src = t.env.mkdir("src");
    fs::create_dir(src.join("dir")).unwrap();
    let setx = |path: &Path, name: &str, value: &[u8]| tree::set_xattr(path, name.as_bytes(), value);
    for (name, uid, gid) in [("a.txt", 4242, 4343), ("dir/b.txt", 0, 5000), ("dir/c.txt", 1234, 0)] {
        fs::write(src.join(name), name).unwrap();
        std::os::unix::fs::chown(src.join(name), Some(uid), Some(gid)).unwrap();
    }
    setx(&src.join("a.txt"), "user.colour", b"blue");
    setx(&src.join("dir/b.txt"), "user.project-id", b"p 42");
    let reference = tree::rsync(&["-aX", "--numeric-ids"], &src, &t.env.path("src.rsync"));
    let fields = [Field::Kind, Field::Content, Field::Perm, Field::Owner, Field::Mtime, Field::Xattrs];
    let up = format!("{}/", src.display());

    let j = t.cp([up.as_str(), "s3://data/up/", "-aX", "--numeric-ids"]).run().assert_ok();
    assert_eq!(u(&j["files"]), 3, "{j:#}");
    let down = t.env.mkdir("down");
    t.cp(["s3://data/up/", down.to_str().unwrap(), "-aX", "--numeric-ids"]).run().assert_ok();
    tree::assert_same(&reference, &down, &fields);

    let refused = t.cp([up.as_str(), "s3://data/acl/", "-A"]).run();
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(refused.stderr.contains("keeps no ACLs"), "{}", refused.stderr);
    setx(&src.join("dir/c.txt"), "user.Binary", &[0, 1, 255]);
    let r = t.cp([up.as_str(), "s3://data/odd/", "-X"]).run();
    assert_ne!(r.code, 0, "an attribute no metadata holds was dropped: {}", r.stdout);
    assert!(r.stderr.contains("user.Binary") && r.stderr.contains("printable ASCII"), "{}", r.stderr);

    if !on_path("rclone") {
        return;
    }
    // rclone reads dmover's modes, times, owners and attributes (and makes
    // every other metadata an attribute too: dmover's own, the content type)...
    let by_rclone = t.env.path("by-rclone");
    rclone(&t, &["copy", "--metadata", "vgw:data/up", by_rclone.to_str().unwrap()]);
    tree::assert_same(&reference, &by_rclone, &[Field::Kind, Field::Content, Field::Perm, Field::Mtime, Field::Owner]);
    let got = tree::snapshot(&by_rclone).unwrap();
    for (path, name, value) in [(&b"a.txt"[..], &b"user.colour"[..], &b"blue"[..]), (b"dir/b.txt", b"user.project-id", b"p 42")] {
        assert_eq!(got.entries[path].xattrs.get(name).map(Vec::as_slice), Some(value), "{}", path.escape_ascii());
    }
    // ...and dmover reads rclone's.
    fs::remove_file(src.join("dir/c.txt")).unwrap();
    fs::remove_file(reference.join("dir/c.txt")).unwrap();
    rclone(&t, &["copy", "--metadata", src.to_str().unwrap(), "vgw:data/rclone"]);
    let from_rclone = t.env.mkdir("from-rclone");
    t.cp(["s3://data/rclone/", from_rclone.to_str().unwrap(), "-aX", "--numeric-ids"]).run().assert_ok();
    tree::assert_same(&reference, &from_rclone, &[Field::Kind, Field::Content, Field::Perm, Field::Mtime, Field::Owner, Field::Xattrs]);
}

/// Names that share a file go up to a bucket with -H as an object each,
/// copied by the server from the first (an object store has no hard
/// links, and rclone stores them so too), each with the file's content,
/// mode and mtime; a second run with --sync finds every name there; and
/// they come back down as files of their own, as rsync -a (without -H)
/// makes them.
#[test]
fn hard_links_go_up_as_an_object_per_name() {
    use dmover_testkit::tree::{self, Field};
    let Some(t) = Setup::new() else { return };
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    fs::create_dir_all(src.join("a/deep")).unwrap();
    fs::write(src.join("three"), "one file, three names").unwrap();
    fs::hard_link(src.join("three"), src.join("a/deep/three-again")).unwrap();
    fs::hard_link(src.join("three"), src.join("a/third-name")).unwrap();
    fs::write(src.join("alone"), "a file alone").unwrap();
    let reference = tree::rsync(&["-a"], &src, &t.env.path("src.rsync"));
    let up = format!("{}/", src.display());
    let j = t.cp([up.as_str(), "s3://data/up/", "-H"]).run().assert_ok();
    assert_eq!((u(&j["files"]), u(&j["bytes"])), (4, 21 + 12), "each file's data once: {j:#}");
    for name in ["three", "a/deep/three-again", "a/third-name"] {
        assert_eq!(fs::read_to_string(bucket.join("up").join(name)).unwrap_or_default(), "one file, three names", "{name}");
    }
    let again = t.cp([up.as_str(), "s3://data/up/", "-H", "--sync"]).run().assert_ok();
    assert_eq!(u(&again["skipped_files"]), 4, "{again:#}");
    let down = t.env.mkdir("down");
    t.cp(["s3://data/up/", down.to_str().unwrap(), "-H"]).run().assert_ok();
    tree::assert_same(&reference, &down, &[Field::Kind, Field::Content, Field::Perm, Field::Mtime, Field::HardLinks]);
}
