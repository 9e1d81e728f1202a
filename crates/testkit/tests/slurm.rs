//! The local Slurm cluster's self-test, through the handle the tests use.

use dmover_testkit::*;
use std::process::Command;

/// A three-node cluster from [`slurm_cluster`] runs real jobs:
/// tools/slurm-local/slurm-selftest checks that every node is idle, that
/// `srun` spreads tasks over all three with Slurm's variables set, and that
/// an `sbatch` job with steps on every node completes.
#[test]
fn slurm_selftest_passes_on_three_nodes() {
    if !slurm_possible() {
        return;
    }
    let _cluster = slurm_cluster();
    let out = Command::new(slurm_local_dir().join("slurm-selftest")).arg("-v").output().expect("run tools/slurm-local/slurm-selftest");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tools/slurm-local/slurm-selftest failed:\n{text}");
    assert!(text.contains("3 node(s)"), "the self-test did not see three nodes:\n{text}");
    eprintln!("{text}");
}
