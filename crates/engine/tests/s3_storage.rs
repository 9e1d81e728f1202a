//! The storage conformance suite (`dmover-testkit`) against the S3 storage,
//! on a real S3 server (versitygw), a fresh bucket for each check.

use dmover_engine::storage::s3::{Options, S3};
use dmover_testkit::s3::{foreign_env, S3Server};
use dmover_testkit::storage::{run, Subject};
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
                S3::open(&bucket, &Options { endpoint: None, state_dir: state.path().to_path_buf(), staging: 64 << 20 }).unwrap(),
            ),
            base: Default::default(),
            disk: None,
            outside: outside.path().to_path_buf(),
            keep: vec![Box::new(outside), Box::new(state)],
            objects: true,
        }
    });
}
