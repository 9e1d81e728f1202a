//! Tuned uploads through an emulated WAN link (shared/tools/wanem between
//! two network namespaces): real TCP over 100 Mbit/s and 50 ms, socket
//! buffers of 64 KiB, so one stream cannot fill the link and the tuners
//! must open more while sending.

mod util;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;
use util::*;

const NS_A: &str = "dmtestA";
const NS_B: &str = "dmtestB";
const SUBNET: &str = "13";
const IP_B: &str = "10.250.13.2";

/// The emulated link; torn down when dropped.
struct Link {
    wanem: PathBuf,
}

impl Link {
    fn up() -> Link {
        let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap();
        let wanem = [repo.join("../shared/tools/wanem"), PathBuf::from("/work/shared/tools/wanem")]
            .into_iter()
            .find(|p| p.join("wanem-up").is_file())
            .expect("shared/tools/wanem beside the repository");
        let _ = Command::new(wanem.join("wanem-down")).args([NS_A, NS_B]).output();
        let out = Command::new(wanem.join("wanem-up"))
            .args(["--subnet", SUBNET, "--delay-ms", "25", "--rate-mbit", "100", "--timeout-s", "300", NS_A, NS_B])
            .output()
            .unwrap();
        assert!(out.status.success(), "wanem-up: {}", String::from_utf8_lossy(&out.stderr));
        Link { wanem }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = Command::new(self.wanem.join("wanem-down")).args([NS_A, NS_B]).output();
    }
}

fn bench(env: &Env, args: &[&str], port: u16) -> serde_json::Value {
    let mut c = dmover(["bench", "--json", "--tcp-bs", "64K", "--congestion", "cubic", "--token-file"]);
    c.arg(&env.token).args(args).arg(format!("dmover://{IP_B}:{port}/x/"));
    c.prefix(["ip", "netns", "exec", NS_A]).timeout(Duration::from_secs(120));
    c.run().assert_ok()
}

fn streams(j: &serde_json::Value) -> Vec<u64> {
    j["timeline"].as_array().unwrap().iter().map(|p| u(&p["streams"])).collect()
}

#[test]
fn tuners_open_streams_on_a_link_one_stream_cannot_fill() {
    let env = Env::new();
    let _link = Link::up();
    let export = env.mkdir("export");
    let mut spec = ServerSpec::new(&env.token, &[("x", &export)], &env.path("server.log"));
    spec.listen = format!("{IP_B}:0");
    spec.prefix = ["ip", "netns", "exec", NS_B].iter().map(Into::into).collect();
    let server = Server::start(spec);

    let one = bench(&env, &["--size", "16M", "--streams", "1"], server.port);
    assert!(streams(&one).is_empty(), "a fixed count is not tuned: {one:#}");

    // MI starts from one stream and doubles while the buffers are the bottleneck.
    let mi = bench(&env, &["--size", "40M", "--tune", "mi", "--tune-chunk", "3M"], server.port);
    let mut n = streams(&mi);
    n.dedup();
    let grown: Vec<u64> = n.iter().copied().skip_while(|&s| s == 1).collect();
    assert!(grown.starts_with(&[2, 4]), "MI should double from 1: {n:?}");

    // The default tuner gets well past what one stream can do.
    let auto = bench(&env, &["--size", "40M"], server.port);
    let (r1, ra) = (one["mb_per_s"].as_f64().unwrap(), auto["mb_per_s"].as_f64().unwrap());
    assert!(ra > 1.5 * r1, "auto {ra:.1} MB/s vs one stream {r1:.1} MB/s: {:?}", streams(&auto));
    assert!(auto["check"]["passed"].as_bool().unwrap());
}
