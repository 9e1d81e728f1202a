//! The WAN link emulator's self-test, and the [`Link`] handle the tests use.

use dmover_testkit::*;
use std::process::Command;

/// tools/wanem/selftest: a link with 20 ms delay and 20 Mbit/s gives round
/// trips of 40 ms (never less) and TCP goodput at the link's rate, and its
/// teardown removes the namespaces.
#[test]
fn wanem_selftest_passes() {
    if !wan_link_possible() {
        return;
    }
    let out = Command::new(wanem_dir().join("selftest")).arg("-v").output().expect("run tools/wanem/selftest");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tools/wanem/selftest failed:\n{text}");
    eprintln!("{text}");
}

/// [`Link`] brings up the namespaces with their addresses, and dropping it
/// removes them.
#[test]
fn link_handle_comes_up_and_goes_away() {
    if !wan_link_possible() {
        return;
    }
    let spec = LinkSpec { ns_a: "kitA", ns_b: "kitB", subnet: 32, delay_ms: 5.0, rate_mbit: 50.0, timeout_s: 60 };
    let namespaces = || String::from_utf8_lossy(&Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).to_string();
    {
        let link = Link::up(spec);
        let addr = Command::new("ip").args(["netns", "exec", "kitB", "ip", "-4", "-o", "addr"]).output().unwrap();
        let addr = String::from_utf8_lossy(&addr.stdout);
        assert!(addr.contains(&format!("{} peer {}", link.ip_b(), link.ip_a())), "kitB's addresses: {addr}");
    }
    let left = namespaces();
    assert!(!left.split_whitespace().any(|n| n == "kitA" || n == "kitB"), "the dropped link left its namespaces: {left}");
}
