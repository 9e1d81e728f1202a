//! Builds the version string `dmover --version` prints: the package version
//! and the commit the binary was built from, with its date, e.g.
//! `0.1.0 (f80e461 2026-11-23)`, `0.1.0 (f80e461-dirty 2026-11-23)` when the
//! workspace's sources differ from that commit, or `0.1.0 (unknown commit)`
//! when git or the repository is missing (a source archive): the build never
//! fails for lack of git.
//!
//! "Dirty" looks at what goes into the binary: each crate's `src/`,
//! `Cargo.toml` and `build.rs`, and the workspace's Cargo.toml and Cargo.lock
//! (a changed test or document does not count). Cargo runs this script again
//! when HEAD moves (the worktree's HEAD file, the branch it names, packed
//! refs) and when any of those sources changes, so the commit and the mark are
//! never stale.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest.parent().and_then(Path::parent).expect("this crate lives in crates/cli");
    println!("cargo:rerun-if-changed=build.rs");
    let commit = commit(workspace).unwrap_or_else(|| "unknown commit".to_string());
    let version = std::env::var("CARGO_PKG_VERSION").expect("cargo sets CARGO_PKG_VERSION");
    println!("cargo:rustc-env=DMOVER_VERSION={version} ({commit})");
}

/// Git pathspecs (relative to the workspace) of the sources whose changes
/// make the build "dirty"; `*` matches across `/` in them.
const SOURCES: [&str; 5] = ["crates/*/src/*", "crates/*/Cargo.toml", "crates/*/build.rs", "Cargo.toml", "Cargo.lock"];

/// `HASH[-dirty] DATE` of the checkout holding this workspace, and the
/// rerun-if-changed lines that keep it current; `None` without git or outside
/// a repository that tracks this workspace.
fn commit(workspace: &Path) -> Option<String> {
    // Only a repository that tracks this workspace counts: an unpacked source
    // archive inside some other repository must not take that one's commit.
    git(workspace, &["ls-files", "--error-unmatch", "Cargo.toml"])?;
    let git_dir = absolute(workspace, &git(workspace, &["rev-parse", "--git-dir"])?);
    let common_dir = absolute(workspace, &git(workspace, &["rev-parse", "--git-common-dir"])?);
    watch(&git_dir.join("HEAD"));
    watch(&common_dir.join("packed-refs"));
    if let Ok(head) = std::fs::read_to_string(git_dir.join("HEAD")) {
        if let Some(branch) = head.trim().strip_prefix("ref: ") {
            // A branch only in packed-refs gets its loose file at its next commit.
            let loose = common_dir.join(branch);
            watch(if loose.exists() { &loose } else { loose.parent().unwrap_or(&common_dir) });
        }
    }
    watch_sources(workspace);

    let hash = git(workspace, &["rev-parse", "--short", "HEAD"])?;
    let date = git(workspace, &["log", "-1", "--format=%cs", "HEAD"])?;
    // --no-optional-locks: status must not rewrite the index it is watched by.
    let mut status = vec!["--no-optional-locks", "status", "--porcelain", "--"];
    status.extend(SOURCES);
    let dirty = if git(workspace, &status)?.is_empty() { "" } else { "-dirty" };
    Some(format!("{hash}{dirty} {date}"))
}

/// The files and directories [`SOURCES`] names (cargo scans a watched
/// directory recursively).
fn watch_sources(workspace: &Path) {
    watch(&workspace.join("Cargo.toml"));
    watch(&workspace.join("Cargo.lock"));
    for krate in std::fs::read_dir(workspace.join("crates")).into_iter().flatten().flatten() {
        for name in ["src", "Cargo.toml", "build.rs"] {
            watch(&krate.path().join(name));
        }
    }
}

/// Tells cargo to run this script again when `path` changes; only for paths
/// that exist, since a missing one would make cargo run it on every build.
fn watch(path: &Path) {
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

fn absolute(base: &Path, path: &str) -> PathBuf {
    let path = Path::new(path);
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    }
}

/// The trimmed standard output of a successful `git -C dir args…`.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").arg("-C").arg(dir).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}
