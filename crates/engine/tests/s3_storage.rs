//! The storage conformance suite (`dmover-testkit`) against the S3 storage,
//! on a real S3 server (versitygw), a fresh bucket for each check.

use dmover_engine::storage::s3::{Options, S3};
use dmover_engine::storage::Storage;
use dmover_testkit::s3::{foreign_env, S3Server};
use dmover_testkit::storage::{run, Subject};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

#[test]
fn s3_storage_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = S3Server::start(dir.path()) else { return };
    // This test is alone in its process, so nothing else reads the
    // environment while it is set.
    for k in foreign_env() {
        std::env::remove_var(k);
    }
    for (k, v) in server.client_env() {
        std::env::set_var(k, v);
    }
    let n = AtomicU32::new(0);
    run(&|| {
        let bucket = format!("check{}", n.fetch_add(1, Ordering::Relaxed));
        server.bucket(&bucket);
        let outside = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        Subject {
            store: Arc::new(open(&bucket, state.path(), 64 << 20)),
            base: Default::default(),
            disk: None,
            outside: outside.path().to_path_buf(),
            keep: vec![Box::new(outside), Box::new(state)],
            objects: true,
            export: true,
        }
    });
    parts_beyond_the_bound_go_up_intact(&server);
    ranged_reads_stream_ahead_of_the_reader(&server);
    listed_objects_are_read_as_listed(&server);
}

/// The S3 storage of `bucket` on the server the environment names, with
/// its state in `state`.
fn open(bucket: &str, state: &Path, staging: u64) -> S3 {
    open_with(bucket, state, staging, false)
}

/// The same, its listings fetching small objects if `fetch_listed`.
fn open_with(bucket: &str, state: &Path, staging: u64, fetch_listed: bool) -> S3 {
    let o = Options { endpoint: None, prefix: String::new(), label: None, state_dir: state.to_path_buf(), staging, fetch_listed };
    S3::open(bucket, &o).unwrap()
}

/// Parts filled out of order, more than the memory bound holds (one part
/// with this staging), fill on disk and go up intact: each part's second
/// half is written first, then the first halves, last part first.
fn parts_beyond_the_bound_go_up_intact(server: &S3Server) {
    const PART: usize = 16 << 20;
    server.bucket("bound");
    let state = tempfile::tempdir().unwrap();
    let s3 = open("bound", state.path(), PART as u64);
    let size = 3 * PART + 12345;
    let data: Vec<u8> = (0..size).map(|i| ((i as u64 * 2654435761) >> 13) as u8).collect();
    let (temp, path) = (Path::new(".big.tmp"), Path::new("big"));
    let f = s3.create(temp).unwrap();
    let parts: Vec<(usize, usize, usize)> = (0..size).step_by(PART).map(|p| (p, (p + PART / 2).min(size), (p + PART).min(size))).collect();
    for &(_, mid, end) in &parts {
        f.write_all_at(&data[mid..end], mid as u64).unwrap();
    }
    for &(start, mid, _) in parts.iter().rev() {
        f.write_all_at(&data[start..mid], start as u64).unwrap();
    }
    f.commit(path, None).unwrap();
    drop(f);
    let r = s3.open(path).unwrap();
    let mut back = vec![0; size];
    let mut at = 0;
    while at < size {
        at += r.read_at(&mut back[at..], at as u64).unwrap();
    }
    assert!(back == data, "the object differs from what was written");
}

/// Writes `data` as object `name` of `s3`.
fn put(s3: &S3, name: &str, data: &[u8]) {
    let temp = format!(".{name}.tmp");
    let f = s3.create(Path::new(&temp)).unwrap();
    f.write_all_at(data, 0).unwrap();
    f.commit(Path::new(name), None).unwrap();
}

/// Reads `len` bytes from `off` in pieces of `piece`.
fn read(r: &dyn dmover_engine::storage::ReadFile, off: usize, len: usize, piece: usize) -> std::io::Result<Vec<u8>> {
    let mut back = vec![0; len];
    let mut at = 0;
    while at < len {
        let end = (at + piece).min(len);
        let n = r.read_at(&mut back[at..end], (off + at) as u64)?;
        assert!(n > 0, "nothing read at {}", off + at);
        at += n;
    }
    Ok(back)
}

/// A reader's GET streams the bytes of its range while it reads them: in
/// order, reads give the object's bytes; outside the range and out of
/// order too; and an object replaced while it is read gives the rest of
/// the range as opened, if anything, and fails a read that takes another
/// GET rather than mixing two versions.
fn ranged_reads_stream_ahead_of_the_reader(server: &S3Server) {
    const MIB: usize = 1 << 20;
    server.bucket("ranges");
    let state = tempfile::tempdir().unwrap();
    let s3 = open("ranges", state.path(), 64 << 20);
    let size = 13 * MIB + 12345;
    let data: Vec<u8> = (0..size).map(|i| ((i as u64 * 2654435761) >> 11) as u8).collect();
    put(&s3, "obj", &data);
    let path = Path::new("obj");

    let whole = s3.open_range(path, 0..size as u64).unwrap();
    assert!(read(&*whole, 0, size, MIB).unwrap() == data, "read in order, the object differs");

    let part = s3.open_range(path, 5 * MIB as u64..9 * MIB as u64).unwrap();
    assert!(read(&*part, 5 * MIB, 4 * MIB, 300_000).unwrap() == data[5 * MIB..9 * MIB], "the range differs");
    assert!(read(&*part, size - 100, 100, MIB).unwrap() == data[size - 100..], "past the range, the object differs");
    assert!(read(&*part, 0, MIB, MIB).unwrap() == data[..MIB], "before the range, the object differs");

    let reader = s3.open_range(path, 0..2 * MIB as u64).unwrap();
    assert!(read(&*reader, 0, MIB, MIB).unwrap() == data[..MIB]);
    let other: Vec<u8> = data.iter().map(|b| !b).collect();
    put(&s3, "obj", &other);
    let mut at = MIB;
    let e = loop {
        let mut buf = vec![0; MIB.min(size - at)];
        match reader.read_at(&mut buf, at as u64) {
            Ok(n) => {
                assert!(buf[..n] == data[at..at + n], "bytes of the new version at {at} came with the old");
                at += n;
                assert!(at < size, "the whole object was read although it was replaced");
            }
            Err(e) => break e,
        }
    };
    assert!(e.to_string().contains("replaced while it was read"), "{e}");
}

/// A storage whose listed objects are all to be read fetches the small ones
/// with the listing, and reads them as fetched: objects replaced after
/// they were listed read as listed (the version whose attributes the
/// listing gave), as far as half the memory bound holds them, and as
/// replaced past that. Once objects kept are not read for a while, listings
/// fetch no more.
fn listed_objects_are_read_as_listed(server: &S3Server) {
    const MIB: usize = 1 << 20;
    server.bucket("listed");
    let state = tempfile::tempdir().unwrap();
    // The smallest bound, 16 MiB: 8 MiB of objects kept at most.
    let plain = open("listed", state.path(), 16 << 20);
    let fetching = open_with("listed", state.path(), 16 << 20, true);
    let version =
        |i: usize, v: usize| -> Vec<u8> { (0..MIB).map(|j| ((j as u64 * 2654435761) >> 9) as u8 ^ i as u8 ^ (v as u8 * 85)).collect() };
    let put_all = |dir: &str, v: usize| (0..12).for_each(|i| put(&plain, &format!("{dir}/{i:02}"), &version(i, v)));
    let read_as = |dir: &str| -> Vec<usize> {
        (0..12)
            .map(|i| {
                let r = fetching.open(Path::new(&format!("{dir}/{i:02}"))).unwrap();
                let back = read(&*r, 0, MIB, 256 << 10).unwrap();
                (0..3).find(|&v| back == version(i, v)).expect("an object read as neither version")
            })
            .collect()
    };

    put_all("a", 0);
    assert_eq!(fetching.list(Path::new("a")).unwrap().len(), 12);
    put_all("a", 1);
    let part = fetching.open_range(Path::new("a/00"), 1000..3000).unwrap();
    assert!(read(&*part, 1000, 2000, MIB).unwrap() == version(0, 0)[1000..3000], "a range of an object kept differs");
    // The first 8 MiB were kept; a/00 was taken by the range read.
    assert_eq!(read_as("a"), [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1], "which objects read as listed");

    // Kept, then not read: the next listing waits for them, then fetches nothing.
    fetching.list(Path::new("a")).unwrap();
    put_all("b", 0);
    fetching.list(Path::new("b")).unwrap();
    put_all("b", 1);
    assert_eq!(read_as("b"), [1; 12], "objects were kept while those kept before were not read");
    put_all("a", 2);
    assert_eq!(read_as("a"), [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2], "the objects kept were lost");
}
