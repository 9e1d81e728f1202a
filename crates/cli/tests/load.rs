//! Load: many clients at once through one server on loopback. Every copy
//! must complete and verify, the server's memory must stay within what its
//! staging settings allow, and it must give back every file descriptor and
//! thread when the clients are gone.
//!
//! `DMOVER_LOAD_CLIENTS` (default 64) and `DMOVER_LOAD_FILES` (default 100)
//! set the size; the `reliability:` line is what `bench/reliability` collects.

mod util;

use std::time::{Duration, Instant};
use util::*;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Half the clients upload 100 files each, the other half download 100
/// files each, all at once, through one server; every session (receiving
/// or sending) stages at most 8 MiB.
#[test]
fn many_clients_at_once_all_verify_with_bounded_memory_and_no_descriptor_leak() {
    let clients = env_usize("DMOVER_LOAD_CLIENTS", 64);
    let files = env_usize("DMOVER_LOAD_FILES", 100);
    const STAGING_MIB: u64 = 8;
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    let staging = format!("{STAGING_MIB}M");
    spec.extra = vec!["--staging".into(), staging.clone().into()];
    let srv = Server::start(spec);
    let pid = srv.pid();

    // One set to upload and one to download; each client has its own destination.
    let mut rng = Rng::new(64);
    let up = env.path("up/set");
    let down = export.join("down/set");
    for i in 0..files {
        make_file(&up.join(format!("d{}/f{i:03}.dat", i % 7)), rng.below(64_000), &mut rng);
        make_file(&down.join(format!("d{}/f{i:03}.dat", i % 7)), rng.below(64_000), &mut rng);
    }

    std::thread::sleep(Duration::from_millis(200));
    let fds_before = open_fds(pid);
    let threads_before = proc_status(pid, "Threads:");
    let rss_before = proc_status(pid, "VmRSS:");

    let started = Instant::now();
    let procs: Vec<(Proc, std::path::PathBuf, std::path::PathBuf)> = (0..clients)
        .map(|i| {
            if i % 2 == 0 {
                let p = env
                    .cp([up.display().to_string(), srv.url(&format!("e/c{i}")), "--staging".into(), staging.clone()])
                    .timeout(Duration::from_secs(300))
                    .spawn();
                (p, up.clone(), export.join(format!("c{i}/set")))
            } else {
                let out = env.mkdir(&format!("out/c{i}"));
                let p = env
                    .cp([srv.url("e/down/set"), out.display().to_string(), "--staging".into(), staging.clone()])
                    .timeout(Duration::from_secs(300))
                    .spawn();
                (p, down.clone(), out.join("set"))
            }
        })
        .collect();
    // Watch the server while they run.
    let (mut peak_fds, mut peak_threads) = (0, 0);
    let mut running = procs;
    let mut finished = Vec::new();
    while !running.is_empty() {
        peak_fds = peak_fds.max(open_fds(pid));
        peak_threads = peak_threads.max(proc_status(pid, "Threads:"));
        let mut still = Vec::new();
        for mut x in running {
            if x.0.running() {
                still.push(x);
            } else {
                finished.push(x);
            }
        }
        running = still;
        std::thread::sleep(Duration::from_millis(50));
    }
    let elapsed = started.elapsed();
    let (mut retries, mut verified) = (0, 0);
    for (p, src, dst) in finished {
        let j = p.wait().assert_ok();
        retries += u(&j["retries"]);
        assert_eq!(u(&j["files"]), files as u64, "{j:#}");
        assert_same_tree(&src, &dst);
        verified += total_size(&dst);
    }
    let peak_rss = proc_status(pid, "VmHWM:");
    // Each session stages at most STAGING_MIB, or one 1 MiB block per
    // stream and reader if that is more (a sending pool: 4 + 8); each
    // client's connections add read buffers and thread stacks (2 MiB is
    // generous for them).
    let per_session = STAGING_MIB.max(4 + 8);
    let bound = rss_before + clients as u64 * (per_session + 2) * 1024;
    assert!(peak_rss <= bound, "server peak RSS {peak_rss} kB exceeds the staging bound {bound} kB");
    // Everything a client used is given back.
    let settled = wait_until(Duration::from_secs(15), || open_fds(pid) <= fds_before && proc_status(pid, "Threads:") <= threads_before);
    let (fds_after, threads_after) = (open_fds(pid), proc_status(pid, "Threads:"));
    assert!(settled, "descriptors {fds_before} → {fds_after}, threads {threads_before} → {threads_after} after all clients left");
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
    eprintln!(
        "reliability: load clients={clients} files_each={files} bytes_verified={} seconds={:.1} retries={retries} \
         server_peak_rss_kib={peak_rss} server_rss_before_kib={rss_before} peak_fds={peak_fds} fds_before={fds_before} \
         fds_after={fds_after} peak_threads={peak_threads}",
        verified,
        elapsed.as_secs_f64()
    );
}
