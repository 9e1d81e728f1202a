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
            store: Arc::new(
                S3::open(
                    &bucket,
                    &Options {
                        endpoint: None,
                        prefix: String::new(),
                        label: None,
                        state_dir: state.path().to_path_buf(),
                        staging: 64 << 20,
                    },
                )
                .unwrap(),
            ),
            base: Default::default(),
            disk: None,
            outside: outside.path().to_path_buf(),
            keep: vec![Box::new(outside), Box::new(state)],
            objects: true,
        }
    });
    parts_beyond_the_bound_go_up_intact(&server);
}

/// Parts filled out of order, more than the memory bound holds (one part
/// with this staging), fill on disk and go up intact: each part's second
/// half is written first, then the first halves, last part first.
fn parts_beyond_the_bound_go_up_intact(server: &S3Server) {
    const PART: usize = 16 << 20;
    server.bucket("bound");
    let state = tempfile::tempdir().unwrap();
    let s3 = S3::open(
        "bound",
        &Options { endpoint: None, prefix: String::new(), label: None, state_dir: state.path().to_path_buf(), staging: PART as u64 },
    )
    .unwrap();
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
    s3.commit(&*f, temp, path, None).unwrap();
    drop(f);
    let r = s3.open(path).unwrap();
    let mut back = vec![0; size];
    let mut at = 0;
    while at < size {
        at += r.read_at(&mut back[at..], at as u64).unwrap();
    }
    assert!(back == data, "the object differs from what was written");
}
