//! `dmover --version` names the build: the package version and the commit of
//! the checkout it was built from, so a benchmark report labelled with it
//! says which code was measured.

use std::path::Path;
use std::process::Command;

/// The trimmed output of a successful `git -C dir args…`; `None` without git
/// or outside a repository.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").arg("-C").arg(dir).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// From a git checkout, `dmover --version` prints the package version, the
/// checkout's HEAD (a prefix of its full hash), "-dirty" exactly when the
/// sources that go into the binary differ from it, and the commit's date; from a tree
/// without git it says "unknown commit".
#[test]
fn version_names_the_commit_the_binary_was_built_from() {
    let out = Command::new(env!("CARGO_BIN_EXE_dmover")).arg("--version").output().expect("run dmover --version");
    assert!(out.status.success(), "dmover --version failed: {out:?}");
    let printed = String::from_utf8(out.stdout).expect("--version prints UTF-8");
    let printed = printed.trim();
    let prefix = format!("dmover {} (", env!("CARGO_PKG_VERSION"));
    let build = printed
        .strip_prefix(&prefix)
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_else(|| panic!("--version printed {printed:?}, not `{prefix}…)`"));

    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    if git(&workspace, &["ls-files", "--error-unmatch", "Cargo.toml"]).is_none() {
        assert_eq!(build, "unknown commit", "built outside a git checkout, yet --version printed {printed:?}");
        return;
    }
    let head = git(&workspace, &["rev-parse", "HEAD"]).expect("git rev-parse HEAD");
    let date = git(&workspace, &["log", "-1", "--format=%cs", "HEAD"]).expect("git log");
    // What goes into the binary, as build.rs counts it (tests and documents do not).
    let sources = ["crates/*/src/*", "crates/*/Cargo.toml", "crates/*/build.rs", "Cargo.toml", "Cargo.lock"];
    let dirty = !git(&workspace, &[&["status", "--porcelain", "--"], &sources[..]].concat()).expect("git status").is_empty();
    let (commit, built_on) = build.split_once(' ').unwrap_or_else(|| panic!("--version printed {printed:?}: no commit date"));
    let hash = commit.strip_suffix("-dirty").unwrap_or(commit);
    assert!(
        hash.len() >= 7 && head.starts_with(hash),
        "--version printed {printed:?}, but the checkout's HEAD is {head}: the binary is stale or mislabelled"
    );
    assert_eq!(
        commit.ends_with("-dirty"),
        dirty,
        "--version printed {printed:?}, but the workspace's sources are {}",
        if dirty { "modified (git status lists changes)" } else { "those of HEAD" }
    );
    assert_eq!(built_on, date, "--version printed {printed:?}, but HEAD's commit date is {date}");
}
