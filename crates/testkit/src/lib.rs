//! The tools dmover's tests and benchmarks run, kept in this repository under
//! `tools/`, as Rust handles:
//!
//! * [`Link`]: an emulated WAN link (`tools/wanem`: delay, rate, loss and a
//!   drop-tail queue between two network namespaces over TUN devices),
//!   torn down when dropped;
//! * [`slurm_cluster`]: a real three-node Slurm cluster (`tools/slurm-local`:
//!   munge, slurmctld and slurmd in network namespaces), started once per
//!   test process and stopped when it exits;
//! * [`needs_root`] and [`skip`]: a test that needs root or a kernel feature
//!   says so on the terminal and skips only where it is truly missing; under
//!   CI (`CI=true`) it fails instead;
//! * [`storage::run`]: the conformance suite every `Storage` implementation
//!   of the engine must pass;
//! * [`s3::S3Server`]: a real S3 server (versitygw) on loopback, stopped
//!   when dropped;
//! * [`tree`]: snapshots of a tree with everything `rsync -aHAX` keeps,
//!   compared field by field (the oracle of whole-tree copies).
//!
//! This crate is the one place that knows where the tools are.

pub mod s3;
pub mod storage;
pub mod tree;

/// Has the child killed when this process dies.
fn die_with_parent(c: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        c.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard, Once};

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `tools/wanem`: the WAN link emulator.
pub fn wanem_dir() -> PathBuf {
    repo().join("tools/wanem")
}

/// `tools/slurm-local`: the local Slurm cluster.
pub fn slurm_local_dir() -> PathBuf {
    repo().join("tools/slurm-local")
}

/// Whether the tests run under CI, where nothing may be skipped.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The running test's name (the test harness names each test's thread).
fn test_name() -> String {
    std::thread::current().name().unwrap_or("a test").to_string()
}

/// Skips the running test for `reason`: writes a `SKIPPED` line straight to
/// stderr (not through the harness's output capture, so it shows in a plain
/// `cargo test`) and returns false. Under CI it panics instead.
#[must_use]
pub fn skip(reason: &str) -> bool {
    let name = test_name();
    if under_ci() {
        panic!("{name}: {reason}; under CI (CI=true) nothing may be skipped");
    }
    let _ = writeln!(std::io::stderr(), "SKIPPED {name}: {reason}");
    false
}

/// True if the process runs as root; otherwise skips the test (see [`skip`])
/// saying what it needs root for.
#[must_use]
pub fn needs_root(what: &str) -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root || skip(&format!("needs root ({what})"))
}

/// True if an emulated link can be brought up here (root, network
/// namespaces, TUN devices); otherwise skips the test (see [`skip`]).
#[must_use]
pub fn wan_link_possible() -> bool {
    if !needs_root("network namespaces and TUN devices for an emulated WAN link") {
        return false;
    }
    if !Path::new("/dev/net/tun").exists() {
        return skip("the kernel offers no TUN devices (/dev/net/tun is missing)");
    }
    if !Path::new("/proc/self/ns/net").exists() {
        return skip("the kernel has no network namespaces");
    }
    true
}

/// An emulated link's settings; see tools/wanem/README.md.
#[derive(Clone, Debug)]
pub struct LinkSpec {
    pub ns_a: &'static str,
    pub ns_b: &'static str,
    /// Addresses 10.250.`subnet`.1 (in `ns_a`) and .2 (in `ns_b`).
    pub subnet: u8,
    pub delay_ms: f64,
    pub rate_mbit: f64,
    /// The emulator exits by itself after this long, should the test die.
    pub timeout_s: u32,
}

/// An emulated WAN link between two network namespaces; torn down (emulator
/// stopped, namespaces deleted) when dropped. A link with the same names left
/// by an aborted earlier run is torn down first.
pub struct Link {
    spec: LinkSpec,
}

impl Link {
    /// Brings the link up (builds the emulator from `tools/wanem/wanem.c` if
    /// needed). Needs root: check [`wan_link_possible`] first.
    pub fn up(spec: LinkSpec) -> Link {
        let link = Link { spec };
        link.down();
        let s = &link.spec;
        // Device names of its own, so as not to meet other links' devices.
        let (dev_a, dev_b) = (format!("{}-tun", s.ns_a), format!("{}-tun", s.ns_b));
        let out = Command::new(wanem_dir().join("wanem-up"))
            .args(["--subnet", &s.subnet.to_string(), "--delay-ms", &s.delay_ms.to_string()])
            .args(["--rate-mbit", &s.rate_mbit.to_string(), "--timeout-s", &s.timeout_s.to_string()])
            .args(["--dev-a", &dev_a, "--dev-b", &dev_b, s.ns_a, s.ns_b])
            .stdin(Stdio::null())
            .output()
            .expect("run tools/wanem/wanem-up");
        assert!(
            out.status.success(),
            "wanem-up {} {} failed:\n{}{}",
            s.ns_a,
            s.ns_b,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        link
    }

    /// The address of side B (in namespace `ns_b`).
    pub fn ip_b(&self) -> String {
        format!("10.250.{}.2", self.spec.subnet)
    }

    /// The address of side A (in namespace `ns_a`).
    pub fn ip_a(&self) -> String {
        format!("10.250.{}.1", self.spec.subnet)
    }

    fn down(&self) {
        let _ = Command::new(wanem_dir().join("wanem-down")).args([self.spec.ns_a, self.spec.ns_b]).stdin(Stdio::null()).output();
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.down();
    }
}

/// True if a Slurm cluster can be started here (root); otherwise skips the
/// test (see [`skip`]).
#[must_use]
pub fn slurm_possible() -> bool {
    needs_root("slurm-local installs munge and Slurm and starts their daemons in network namespaces")
}

extern "C" fn slurm_down() {
    let _ = Command::new(slurm_local_dir().join("slurm-down")).arg("-q").stdin(Stdio::null()).status();
}

/// Starts a three-node Slurm cluster (node1..node3) once for this test
/// process, stopped when the process exits, and serializes the tests that
/// use it: hold the guard for the test's length. slurm-up installs the
/// packages it needs (munge, slurmctld, slurmd, slurm-client) if missing.
/// Needs root: check [`slurm_possible`] first.
pub fn slurm_cluster() -> MutexGuard<'static, ()> {
    static UP: Once = Once::new();
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    UP.call_once(|| {
        let out = Command::new(slurm_local_dir().join("slurm-up"))
            .args(["--nodes", "3", "-q"])
            .stdin(Stdio::null())
            .output()
            .expect("run tools/slurm-local/slurm-up");
        // SAFETY: registers a plain function to run at process exit.
        unsafe { libc::atexit(slurm_down) };
        assert!(out.status.success(), "slurm-up failed:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    });
    guard
}
