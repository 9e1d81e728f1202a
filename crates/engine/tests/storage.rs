//! The storage conformance suite (`dmover-testkit`) against the POSIX
//! storage: an export resolved with openat2, an export resolved one
//! component at a time, the local file system, and a local destination
//! confined beneath its directory.

use dmover_engine::storage::posix::{Posix, Resolve};
use dmover_engine::storage::{self, Storage};
use dmover_testkit::storage::{run, Subject};
use std::sync::Arc;

fn subject(store: impl Fn(&std::path::Path) -> Arc<dyn Storage>, local: bool) -> Subject {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"not yours").unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    Subject {
        store: store(&root),
        base: if local { root.clone() } else { Default::default() },
        disk: Some(root),
        outside: outside.path().to_path_buf(),
        keep: vec![Box::new(dir), Box::new(outside)],
        objects: false,
        export: !local,
    }
}

#[test]
fn posix_export_with_openat2_conforms() {
    run(&|| {
        subject(
            |root| {
                let s = Posix::export_with("x", root, Resolve::Openat2).unwrap();
                assert_eq!(s.resolve(), Some(Resolve::Openat2), "this kernel lacks openat2");
                Arc::new(s)
            },
            false,
        )
    });
}

#[test]
fn posix_export_walking_components_conforms() {
    run(&|| subject(|root| Arc::new(Posix::export_with("x", root, Resolve::Walk).unwrap()), false));
}

#[test]
fn local_file_system_conforms() {
    run(&|| subject(|_| storage::local(), true));
}

#[test]
fn local_destination_beneath_its_directory_conforms() {
    run(&|| subject(|root| Arc::new(Posix::beneath(root).unwrap()), false));
}
