//! Load: many clients at once through one server on loopback. Every copy
//! must complete and verify, the server's memory must stay within what its
//! staging settings allow, and it must give back every file descriptor and
//! thread when the clients are gone.
//!
//! `DMOVER_LOAD_CLIENTS` (default 16) and `DMOVER_LOAD_FILES` (default 100)
//! set the size; the `reliability:` line is what `bench/reliability` collects.

mod util;

use std::path::Path;
use std::time::{Duration, Instant};
use util::*;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

const MIB: u64 = 1 << 20;
/// Staging of every session, at both ends (`--staging`).
const STAGING: u64 = 8 * MIB;
/// Each client's set: two large files, each several times the staging, and
/// small files sharing about `SMALL_TOTAL`: about 64 MiB, eight times the
/// staging of the session that moves it.
const LARGE: u64 = 30 * MIB;
const SMALL_TOTAL: u64 = 8 * MIB;

/// Sockets a process holds open (its connections and its listener), each
/// counted once however many descriptors it has.
fn open_sockets(pid: u32) -> u64 {
    let sockets: std::collections::HashSet<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_string_lossy().starts_with("socket:"))
        .collect();
    sockets.len() as u64
}

/// Writes the set one client moves: `files` small files and two large ones.
fn make_set(dir: &Path, files: usize, rng: &mut Rng) {
    let small_max = 2 * SMALL_TOTAL / files.max(1) as u64;
    for i in 0..files {
        make_file(&dir.join(format!("d{}/f{i:03}.dat", i % 7)), rng.below(small_max), rng);
    }
    make_file(&dir.join("large/a.dat"), LARGE, rng);
    make_file(&dir.join("large/b.dat"), LARGE + 12345, rng);
}

/// Half the clients upload, the other half download, all at once through
/// one server; each moves about eight times its session's staging. The
/// server's peak RSS must stay within its footprint before the clients came
/// plus, for every session, its staging and what a session holds besides,
/// and for every connection, what a connection holds (derived below): a
/// server that kept whole files, or everything a session moves, in memory
/// fails it.
#[test]
fn many_clients_at_once_all_verify_with_bounded_memory_and_no_descriptor_leak() {
    let clients = env_usize("DMOVER_LOAD_CLIENTS", 16);
    let files = env_usize("DMOVER_LOAD_FILES", 100);
    let env = Env::new();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("e", &export)], &env.path("server.log"));
    let staging = format!("{}M", STAGING / MIB);
    spec.extra = vec!["--staging".into(), staging.clone().into()];
    let srv = Server::start(spec);
    let pid = srv.pid();

    // One set to upload and one to download; each client has its own destination.
    let mut rng = Rng::new(64);
    let up = env.path("up/set");
    let down = export.join("down/set");
    make_set(&up, files, &mut rng);
    make_set(&down, files, &mut rng);
    let set_bytes = total_size(&up).min(total_size(&down));
    assert!(set_bytes >= 8 * STAGING, "each client must move far more than its staging: {set_bytes} bytes");

    // The server starts its threads and opens its descriptors before it says it listens.
    let fds_before = open_fds(pid);
    let threads_before = proc_status(pid, "Threads:");
    let rss_before = proc_status(pid, "VmRSS:");
    let sockets_before = open_sockets(pid);

    // Four readers and four streams: a sending session's pool (at least
    // one block per stream and reader) is then its staging, as a
    // receiving session's is.
    let common = ["--staging".to_string(), staging.clone(), "--concurrency".into(), "4".into()];
    let started = Instant::now();
    let procs: Vec<(Proc, std::path::PathBuf, std::path::PathBuf)> = (0..clients)
        .map(|i| {
            if i % 2 == 0 {
                let mut args = vec![up.display().to_string(), srv.url(&format!("e/c{i}"))];
                args.extend(common.iter().cloned());
                let p = env.cp(args).timeout(Duration::from_secs(300)).spawn();
                (p, up.clone(), export.join(format!("c{i}/set")))
            } else {
                let out = env.mkdir(&format!("out/c{i}"));
                let mut args = vec![srv.url("e/down/set"), out.display().to_string()];
                args.extend(common.iter().cloned());
                let p = env.cp(args).timeout(Duration::from_secs(300)).spawn();
                (p, down.clone(), out.join("set"))
            }
        })
        .collect();
    // Watch the server while they run.
    let (mut peak_fds, mut peak_threads, mut peak_sockets) = (0, 0, 0);
    let mut running = procs;
    let mut finished = Vec::new();
    while !running.is_empty() {
        peak_fds = peak_fds.max(open_fds(pid));
        peak_threads = peak_threads.max(proc_status(pid, "Threads:"));
        peak_sockets = peak_sockets.max(open_sockets(pid));
        let mut still = Vec::new();
        for mut x in running {
            if x.0.running() {
                still.push(x);
            } else {
                finished.push(x);
            }
        }
        running = still;
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = started.elapsed();
    let peak_rss = proc_status(pid, "VmHWM:");
    let (mut retries, mut verified) = (0, 0);
    for (p, src, dst) in finished {
        let j = p.wait().assert_ok();
        retries += u(&j["retries"]);
        assert_eq!(u(&j["files"]), files as u64 + 2, "{j:#}");
        assert_same_tree(&src, &dst);
        verified += total_size(&dst);
    }

    // What the server may hold, from what it allocates:
    // * per session, its staging pool: `--staging` / block size blocks of
    //   1 MiB, at least one per stream and reader of a sending session (4 +
    //   4 here), so STAGING; the writers' queues, the sending queues and
    //   the blocks being read or written are all pool blocks;
    // * per session besides: the state of up to 1024 announced files (a
    //   few hundred bytes each here, with 16 bytes per block), the writer,
    //   accept and control threads' stacks (a few pages each) and
    //   their allocator arenas' bookkeeping: 1 MiB is generous;
    // * per connection (control or data; the uploads' tuners open data
    //   connections as they like, so they are counted as the most sockets
    //   the server held at once, less those it held before): the sealing
    //   layer's read buffer (a record and 4 KiB) and write batch (four
    //   records, on connections it sends on), its frame reader's buffer
    //   (256 KiB, of which a read through the sealing layer fills one
    //   record's worth) and its thread's stack pages: 384 KiB;
    // * per thread (the tuners add readers and data connections, in both
    //   directions; a committer syncs a batch from a few threads): the
    //   pages of its stack it touches and its share of the allocator's
    //   arenas, 64 KiB, counted as the most threads the server ran at once,
    //   less those it ran before (so the connections' threads twice).
    const SESSION_KIB: u64 = (STAGING + MIB) / 1024;
    const CONNECTION_KIB: u64 = 384;
    const THREAD_KIB: u64 = 64;
    let connections = peak_sockets.saturating_sub(sockets_before);
    let threads = peak_threads.saturating_sub(threads_before);
    let bound = rss_before + clients as u64 * SESSION_KIB + connections * CONNECTION_KIB + threads * THREAD_KIB;
    assert!(
        peak_rss <= bound,
        "server peak RSS {peak_rss} KiB exceeds {bound} KiB: {rss_before} KiB before, {clients} sessions of {SESSION_KIB} KiB \
         (staging and state), {connections} connections of {CONNECTION_KIB} KiB, {threads} threads of {THREAD_KIB} KiB; \
         each session moved {set_bytes} bytes"
    );
    // Everything a client used is given back.
    let settled = wait_until(Duration::from_secs(15), || open_fds(pid) <= fds_before && proc_status(pid, "Threads:") <= threads_before);
    let (fds_after, threads_after) = (open_fds(pid), proc_status(pid, "Threads:"));
    assert!(settled, "descriptors {fds_before} → {fds_after}, threads {threads_before} → {threads_after} after all clients left");
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
    eprintln!(
        "reliability: load clients={clients} files_each={} bytes_verified={} seconds={:.1} retries={retries} \
         server_peak_rss_kib={peak_rss} server_rss_bound_kib={bound} server_rss_before_kib={rss_before} \
         peak_connections={connections} peak_fds={peak_fds} fds_before={fds_before} fds_after={fds_after} peak_threads={peak_threads}",
        files + 2,
        verified,
        elapsed.as_secs_f64()
    );
}
