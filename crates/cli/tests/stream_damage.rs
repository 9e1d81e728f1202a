//! Blocks of a stream damaged on their way to a real `dmover sink`: the
//! sink notices (checksum), asks again (`Nack`), counts it on its metrics
//! page, and acknowledges only what it verified; a block damaged every time it is sent ends in a clear
//! error, kept in the spill file for `dmover drain`.
//!
//! The producers here are the library in this process, with the engine's
//! fault injector installed in it: a test binary of its own, so that the
//! damage reaches no other test. `dmover-faulty` damages what a drain sends.

mod util;

use dmover_proto::ErrorKind;
use dmover_stream::{Config, Stream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};
use util::*;

const PRODUCER: &str = "damaged-0";
const BLOCK: u32 = 64 * 1024;

/// Every how many blocks the injector damages one (0: none).
static EVERY: AtomicU64 = AtomicU64::new(0);
/// The tests change `EVERY`, so they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Damages every `every`th block this process sends from now on (0: none).
fn damage_every(every: u64) {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        static SENT: AtomicU64 = AtomicU64::new(0);
        dmover_engine::fault::install(Box::new(|block: &mut [u8]| {
            let every = EVERY.load(Ordering::Relaxed);
            let n = SENT.fetch_add(1, Ordering::Relaxed) + 1;
            if every == 0 || block.is_empty() || !n.is_multiple_of(every) {
                return false;
            }
            block[n as usize * 7919 % block.len()] ^= 1 << (n % 8);
            true
        }));
    });
    EVERY.store(every, Ordering::Relaxed);
}

fn step_data(step: u64) -> Vec<u8> {
    let mut v = vec![0u8; 5 * BLOCK as usize + 1234 * step as usize];
    Rng::new(0xda3a ^ step).fill(&mut v);
    v
}

/// Streams `steps` steps to `sinks`; returns what was written and the report.
fn stream(env: &Env, sinks: &[&str], spill: &Path, steps: u64) -> (Vec<Vec<u8>>, dmover_stream::Report) {
    let mut c = Config::new(PRODUCER, sinks, env.token_str().as_bytes(), spill);
    c.block_size = BLOCK;
    c.buffer = 64 * BLOCK as u64;
    c.close_timeout = std::time::Duration::from_secs(60);
    let mut s = Stream::open(c).unwrap();
    let written: Vec<Vec<u8>> = (0..steps)
        .map(|step| {
            let data = step_data(step);
            s.write_metadata("var", "phi").unwrap();
            s.write(&data).unwrap();
            s.end_step().unwrap();
            data
        })
        .collect();
    (written, s.close().unwrap())
}

/// Every step is at the sink, complete, as written.
fn assert_delivered(out: &Path, written: &[Vec<u8>]) {
    for (step, want) in written.iter().enumerate() {
        let dir = out.join(PRODUCER);
        let got = std::fs::read(dir.join(format!("step-{step:06}.dat"))).unwrap();
        assert!(got == *want, "step {step} at the sink differs from what was written");
        let m: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(format!("step-{step:06}.json"))).unwrap()).unwrap();
        assert_eq!(m["complete"], true, "step {step}");
    }
}

/// CLI.md `sink --metrics`: the sink counts each damaged block it asked
/// for again, as many as the producer sent again.
#[test]
fn blocks_damaged_on_the_way_to_the_sink_are_sent_again_and_arrive_intact() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let metrics = format!("127.0.0.1:{}", closed_port());
    let sink = env.sink(&out, ["--metrics", &metrics]);
    damage_every(4);
    let (written, report) = stream(&env, &[&sink.addr()], &spill, 6);
    damage_every(0);
    assert!(report.undelivered().is_none(), "{report:?}");
    assert!(report.damaged.is_empty(), "{report:?}");
    let blocks = report.blocks;
    assert!(
        report.resent_blocks >= blocks / 4 - 1,
        "one block in four was damaged, but only {} were sent again: {report:?}",
        report.resent_blocks
    );
    assert!(sink.log().contains("arrived damaged"), "the sink did not notice the damage:\n{}", sink.log());
    assert_delivered(&out, &written);
    let (_, page) = http_get(&metrics, "/metrics").expect("the sink's metrics page answers");
    let counted = sample(&page, "dmover_sink_damaged_blocks_total");
    assert_eq!(counted, Some(report.resent_blocks as f64), "damaged blocks on the sink's page, vs sent again: {report:?}\n{page}");
}

#[test]
fn a_block_damaged_every_time_is_a_clear_error_never_acknowledged_and_drain_sends_it_later() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let env = Env::new();
    let (out, spill) = (env.mkdir("sink"), env.mkdir("spill"));
    let sink = env.sink(&out, [] as [&str; 0]);
    damage_every(1);
    let (written, report) = stream(&env, &[&sink.addr()], &spill, 2);
    damage_every(0);
    let e = report.undelivered().expect("damaged blocks are an error at close");
    assert_eq!(e.kind, ErrorKind::Verify, "{e}");
    assert!(e.message.contains("damaged"), "{e}");
    assert!(e.hint().contains("dmover drain"), "{}", e.hint());
    assert_eq!(report.damaged.len() as u64, report.blocks, "every block was damaged every time: {report:?}");
    assert_eq!(report.undelivered_blocks, report.blocks, "{report:?}");
    // Nothing damaged was acknowledged: the sink wrote no block and no step.
    let files: Vec<_> = std::fs::read_dir(out.join(PRODUCER)).map(|d| d.map(|e| e.unwrap().file_name()).collect()).unwrap_or_default();
    assert!(files.is_empty(), "the sink kept something it never verified: {files:?}");
    let manifest = report.manifest.as_deref().expect("the manifest is kept").to_str().unwrap().to_string();
    let token = env.token.to_str().unwrap().to_string();

    // A drain over a path that still damages everything fails the same way.
    let r = dmover(["drain", "--timeout", "30", "--token-file", &token, &manifest]).faulty().env("DMOVER_FAULT_CORRUPT_EVERY", "1").run();
    assert_eq!(r.code, 10, "{}\n{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("damaged") && r.stderr.contains("dmover drain"), "{}", r.stderr);
    // One that damages some blocks delivers everything, sending those again.
    let r = dmover(["drain", "--token-file", &token, &manifest]).faulty().env("DMOVER_FAULT_CORRUPT_EVERY", "3").run();
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    assert_delivered(&out, &written);
    assert!(report.spill_file.is_some_and(|f| !f.exists()), "the spill file is removed once drained");
}
