//! A file is confirmed only once it is durable: the receiving server makes
//! a batch's data durable before it renames the files into place, and the
//! names durable after, before it confirms them (one sync serves a batch's
//! data and the names of the batch before it). Seen from outside through
//! strace, as the order of the server's `syncfs` and rename calls.

mod util;

use std::path::Path;
use util::*;

const FILES: usize = 300;

/// Uploads `FILES` small files to a server running under strace, with
/// `extra` cp flags; returns the server's syncfs (`S`) and rename (`R`)
/// calls in order.
fn upload_traced(extra: &[&str]) -> String {
    let env = Env::new();
    let export = env.mkdir("export");
    let src = env.mkdir("src");
    let mut rng = Rng::new(7);
    for i in 0..FILES {
        make_file(&src.join(format!("d{}/f{i}.dat", i % 10)), 1000 + rng.below(20_000), &mut rng);
    }
    let trace = env.path("server.strace");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    spec.prefix = ["strace", "-f", "-qq", "-e", "trace=syncfs,rename,renameat,renameat2", "-o"].iter().map(Into::into).collect();
    spec.prefix.push(trace.clone().into());
    let srv = Server::start(spec);
    let mut args = vec![format!("{}/", src.display()), srv.url("e/dst")];
    args.extend(extra.iter().map(|s| s.to_string()));
    env.cp(args).run().assert_ok();
    assert_same_tree(&src, &export.join("dst"));
    drop(srv);
    calls(&trace)
}

/// The syncfs and successful rename calls in a trace, as `S` and `R`.
fn calls(trace: &Path) -> String {
    let text = std::fs::read_to_string(trace).unwrap_or_else(|e| panic!("{}: {e} (is strace installed?)", trace.display()));
    text.lines()
        .filter(|l| l.trim_end().ends_with("= 0"))
        .filter_map(|l| {
            if l.contains("syncfs(") {
                Some('S')
            } else if l.contains("rename") && l.contains(".dmover-part") {
                Some('R')
            } else {
                None
            }
        })
        .collect()
}

#[test]
fn files_are_synced_before_and_after_their_rename_and_no_fsync_skips_it() {
    let seq = upload_traced(&[]);
    let renames = seq.matches('R').count();
    assert_eq!(renames, FILES, "every file is renamed into place once: {seq}");
    // Every batch of renames has a sync before it (of its data) and after it
    // (of the names): S R…R S R…R S … S.
    assert!(seq.starts_with('S'), "a rename without a sync of the data before it: {seq}");
    assert!(seq.ends_with('S'), "renames without a sync of the names after them: {seq}");
    let batches = seq.split('S').filter(|b| !b.is_empty()).count();
    assert!(batches < FILES, "no two files shared a sync: {seq}");
    eprintln!("{FILES} files committed in {batches} batches");

    let seq = upload_traced(&["--no-fsync"]);
    assert_eq!(seq, "R".repeat(FILES), "--no-fsync: renames and no sync");
}
