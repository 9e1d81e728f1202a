//! Hosts reached over ssh, with no daemon at the far end: a real `sshd` on
//! loopback starts `dmover remote` for each command. Copies both ways (also
//! to and from a bucket) and listings arrive intact; the remote end is gone
//! when the command ends, even when the client is killed, and a re-run
//! resumes; a missing remote dmover and a failing ssh say what to do.

mod util;

use std::path::{Path, PathBuf};
use std::time::Duration;
use util::*;

/// An environment with an sshd, and a per-test name for the remote dmover
/// (a link to the binary), to find its processes.
struct Remote {
    env: Env,
    sshd: Sshd,
    dmover: PathBuf,
}

impl Remote {
    fn new() -> Remote {
        let env = Env::new();
        let sshd = Sshd::start(&env.path("sshd"));
        let dmover = env.path(&format!("bin/dmover-remote-{}", unique()));
        std::fs::create_dir_all(dmover.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(BIN, &dmover).unwrap();
        Remote { env, sshd, dmover }
    }

    /// `dmover cp ARGS` reaching 127.0.0.1 over this sshd.
    fn cp<S: AsRef<std::ffi::OsStr>>(&self, args: impl IntoIterator<Item = S>) -> Cmd {
        let mut c =
            dmover(["cp", "--json", "-q", "--ssh", &self.sshd.ssh(), "--remote-dmover", self.dmover.to_str().unwrap(), "--token-file"]);
        c.arg(&self.env.token);
        c.args(args);
        c
    }

    /// `127.0.0.1:PATH`
    fn at(&self, p: &Path) -> String {
        format!("127.0.0.1:{}", p.display())
    }

    /// The remote dmover processes still running.
    fn remotes(&self) -> usize {
        let out = std::process::Command::new("pgrep").arg("-f").arg(format!("^{} remote", self.dmover.display())).output().unwrap();
        String::from_utf8_lossy(&out.stdout).lines().count()
    }
}

#[test]
fn copies_both_ways_and_lists_over_ssh_with_no_daemon() {
    let r = Remote::new();
    let src = r.env.path("src");
    make_tree(&src, 21, 30);
    let far = r.env.mkdir("far");
    let up = r.cp([src.display().to_string(), format!("{}/", r.at(&far))]).run();
    up.assert_ok();
    assert_same_tree(&src, &far.join("src"));

    let back = r.env.mkdir("back");
    r.cp([r.at(&far.join("src")), back.display().to_string()]).run().assert_ok();
    assert_same_tree(&src, &back.join("src"));

    // --sync sends nothing that is already there; a glob takes what it matches.
    let again = r.cp([src.display().to_string(), format!("{}/", r.at(&far)), "--sync".into()]).run();
    assert_eq!(u(&again.assert_ok()["skipped_files"]), list_files(&src).len() as u64, "{}", again.stdout);
    let txt = r.env.mkdir("txt");
    r.cp([format!("{}/src/**/*.txt", r.at(&far)), txt.display().to_string()]).run().assert_ok();
    let want = list_files(&src).into_keys().filter(|p| p.ends_with(".txt")).count();
    assert_eq!(list_files(&txt).len(), want, "the glob over ssh took {:?}", list_files(&txt).keys());

    let mut ls = dmover(["ls", "--ssh", &r.sshd.ssh(), "--remote-dmover", r.dmover.to_str().unwrap()]);
    ls.arg(format!("127.0.0.1:{}/src", far.display()));
    let l = ls.run();
    assert_eq!(l.code, 0, "{}", l.stderr);
    assert_eq!(l.stdout.lines().filter(|x| x.starts_with('-')).count(), list_files(&src).len(), "{}", l.stdout);
    assert!(wait_until(Duration::from_secs(10), || r.remotes() == 0), "a remote dmover outlived its command");
}

/// A bucket is a source and a destination for a host reached over ssh:
/// the client reads or writes the objects, the remote end the files.
#[test]
fn between_a_bucket_and_a_host_reached_over_ssh() {
    let r = Remote::new();
    let Some(s3) = S3Server::start(&r.env.path("s3")) else { return };
    s3.bucket("one");
    let two = s3.bucket("two");
    let home = r.env.mkdir("home");
    let src = r.env.path("src");
    make_tree(&src, 23, 30);
    let with_s3 = |args: [String; 2]| {
        let mut c = r.cp(args);
        c.s3(&s3, &home);
        c.run().assert_ok()
    };
    with_s3([src.display().to_string(), "s3://one/".into()]);
    let far = r.env.mkdir("far");
    let j = with_s3(["s3://one/src".into(), format!("{}/", r.at(&far))]);
    assert_eq!(u(&j["files"]), list_files(&src).len() as u64, "{j:#}");
    assert_same_tree(&src, &far.join("src"));
    let j = with_s3([r.at(&far.join("src")), "s3://two/back/".into()]);
    assert_eq!(u(&j["files"]), list_files(&src).len() as u64, "{j:#}");
    for (rel, _) in list_files(&src) {
        assert_eq!(std::fs::read(two.join("back/src").join(&rel)).unwrap(), std::fs::read(src.join(&rel)).unwrap(), "{rel}");
    }
    // The remote end exits once ssh closes its input, which happens as the client exits.
    assert!(wait_until(Duration::from_secs(10), || r.remotes() == 0), "a remote end outlived its command");
}

#[test]
fn a_killed_client_leaves_nothing_behind_and_the_rerun_resumes() {
    let r = Remote::new();
    let src = r.env.path("big");
    std::fs::create_dir_all(&src).unwrap();
    write_random(&src.join("data.bin"), 24 << 20, 7);
    let far = r.env.mkdir("far");
    let args = || [src.display().to_string(), format!("{}/", r.at(&far)), "--bwlimit".into(), "3M".into(), "-p".into(), "2".into()];
    let p = r.cp(args()).spawn();
    let dest = far.join("big");
    assert!(wait_until(Duration::from_secs(60), || written_bytes(&far) + partial_bytes(&dest) >= 4 << 20), "the upload did not start");
    assert_eq!(r.remotes(), 1, "one remote end per command");
    p.kill9();
    // ssh goes with the client; the remote end sees its input close.
    assert!(wait_until(Duration::from_secs(15), || r.remotes() == 0), "the remote dmover outlived a client killed with -9");
    let rerun = r.cp(args().into_iter().take(2)).run();
    rerun.assert_ok();
    assert_same_tree(&src, &dest);
    let sent = u(&rerun.json()["sent_bytes"]);
    assert!(sent < 24 << 20, "the re-run sent {sent} bytes: it did not resume");
}

/// Two hosts reached over ssh (here one sshd under two names, so two
/// remote ends, each with its own one-time secret): a third-party copy
/// from one to the other goes straight between them; several hosts as a
/// destination share the files; a dmover:// server and an ssh host mix.
#[test]
fn third_party_between_ssh_hosts_several_hosts_and_a_server_mixed_in() {
    let r = Remote::new();
    let src = r.env.path("src");
    make_tree(&src, 7, 30);
    let far = r.env.mkdir("far");
    r.cp([src.display().to_string(), format!("{}/", r.at(&far))]).run().assert_ok();

    let mut p = r.cp([r.at(&far.join("src")), format!("localhost:{}/", r.env.mkdir("third").display())]).spawn();
    let two = wait_until(Duration::from_secs(20), || r.remotes() == 2 || !p.running());
    let third = p.wait();
    third.assert_ok();
    assert!(two, "not one remote end per host");
    assert_same_tree(&src, &r.env.path("third/src"));

    // Two destination hosts: each takes a share.
    let shared = r.env.mkdir("shared");
    let both = r.cp([src.display().to_string(), format!("127.0.0.1,localhost:{}/", shared.display())]).run();
    let j = both.assert_ok();
    let shares: Vec<u64> = j["hosts"].as_array().expect("per-host shares").iter().map(|h| u(&h["files"])).collect();
    assert!(shares.len() == 2 && shares.iter().all(|n| *n > 0), "the files were not shared between the two hosts: {j:#}");
    assert_same_tree(&src, &shared.join("src"));

    // A dmover:// server to an ssh host, and back.
    let export = r.env.mkdir("export");
    let srv = r.env.serve(&[("e", &export)]);
    r.cp([src.display().to_string(), srv.url("e/")]).run().assert_ok();
    let mixed = r.env.mkdir("mixed");
    r.cp([srv.url("e/src"), format!("{}/", r.at(&mixed))]).run().assert_ok();
    assert_same_tree(&src, &mixed.join("src"));
    r.cp([r.at(&mixed.join("src")), srv.url("e/back/")]).run().assert_ok();
    assert_same_tree(&src, &export.join("back/src"));
    assert!(wait_until(Duration::from_secs(10), || r.remotes() == 0), "a remote dmover outlived its command");
}

/// Bytes in the partial files under `dir` (those a killed copy leaves).
fn partial_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir.join(".dmover-partial")) else { return 0 };
    rd.flatten().filter_map(|e| e.metadata().ok()).map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512).sum()
}

#[test]
fn a_missing_remote_dmover_and_a_failing_ssh_say_what_to_do() {
    let r = Remote::new();
    let src = r.env.path("src");
    make_tree(&src, 3, 2);
    let far = r.env.mkdir("far");
    let mut c = dmover(["cp", "-q", "--ssh", &r.sshd.ssh(), "--remote-dmover", "/nowhere/dmover"]);
    c.arg(src.display().to_string()).arg(r.at(&far));
    c.run().assert_fails(2, &["dmover is not on 127.0.0.1 (tried '/nowhere/dmover')", "--remote-dmover PATH"]);

    let mut c =
        dmover(["cp", "-q", "--ssh", &format!("ssh -p {} -o BatchMode=yes", closed_port()), "--remote-dmover", r.dmover.to_str().unwrap()]);
    c.arg(src.display().to_string()).arg(r.at(&far));
    c.run().assert_fails(6, &["ssh failed", "Connection refused"]);

    let mut c = dmover(["cp", "-q", "--ssh", "no-such-ssh-program"]);
    c.arg(src.display().to_string()).arg(r.at(&far));
    c.run().assert_fails(2, &["cannot run 'no-such-ssh-program'"]);
}

/// With `--via-ssh` (what dmover falls back to by itself when a firewall
/// hides the remote end's port) every connection is an ssh of its own,
/// relayed to the remote end from the inside: copies both ways still
/// arrive whole, and no relay or remote end is left behind.
#[test]
fn via_ssh_every_connection_goes_inside_ssh_and_the_copy_arrives() {
    let r = Remote::new();
    let src = r.env.path("src");
    make_tree(&src, 5, 40);
    let far = r.env.mkdir("far");
    let up = r.cp([src.display().to_string(), format!("{}/", r.at(&far)), "--via-ssh".into(), "-p".into(), "3".into()]).run();
    up.assert_ok();
    assert!(up.stderr.contains("data connections go over ssh"), "{}", up.stderr);
    assert_same_tree(&src, &far.join("src"));
    let back = r.env.mkdir("back");
    r.cp([r.at(&far.join("src")), back.display().to_string(), "--via-ssh".into()]).run().assert_ok();
    assert_same_tree(&src, &back.join("src"));
    assert!(wait_until(Duration::from_secs(10), || r.remotes() == 0), "a relay or remote end outlived its command");
}

/// A host behind an emulated WAN link whose firewall lets only ssh in (an
/// nftables rule in its namespace drops every other TCP port): a listing
/// needs no more than the control connection, which the ssh pipe carries,
/// so it works without a word of falling back; a copy finds the remote
/// end's port unreachable, says so and carries its data connections inside
/// ssh by itself; the copy arrives, and afterwards no dmover process and
/// no listening socket of dmover remain on the host.
#[test]
fn behind_a_firewall_that_lets_only_ssh_through_dmover_falls_back_to_ssh() {
    if !dmover_testkit::wan_link_possible() {
        return;
    }
    const NS_A: &str = "dmsshA";
    const NS_B: &str = "dmsshB";
    let (link, env, sshd) = ssh_host_behind_a_link(NS_A, NS_B, 17);
    nft(NS_B, &format!("table inet dmover_test {{\n chain input {{\n  type filter hook input priority 0;\n  iifname \"{NS_B}-tun\" tcp dport != 22 drop\n }}\n}}\n"));

    let src = env.path("src");
    make_tree(&src, 9, 20);
    let far = env.mkdir("far");
    let mut c = dmover(["cp", "--json", "-q", "--ssh", &sshd.ssh(), "--remote-dmover", BIN]);
    c.prefix(["ip", "netns", "exec", NS_A]);
    c.arg(src.display().to_string()).arg(format!("{}:{}/", link.ip_b(), far.display()));
    let r = c.run();
    r.assert_ok();
    assert!(r.stderr.contains("cannot be reached directly") && r.stderr.contains("data connections go over ssh"), "{}", r.stderr);
    assert_same_tree(&src, &far.join("src"));

    let mut ls = dmover(["ls", "--ssh", &sshd.ssh(), "--remote-dmover", BIN]);
    ls.prefix(["ip", "netns", "exec", NS_A]);
    ls.arg(format!("{}:{}/src", link.ip_b(), far.display()));
    let l = ls.run();
    assert_eq!(l.code, 0, "{}", l.stderr);
    assert_eq!(l.stdout.lines().filter(|x| x.starts_with('-')).count(), list_files(&src).len(), "{}", l.stdout);
    assert!(!l.stderr.contains("go over ssh"), "a listing, which needs only the control connection, fell back: {}", l.stderr);
    let left = || dmover_listening(NS_B);
    assert!(wait_until(Duration::from_secs(10), || left().is_empty()), "dmover still listens on the host: {:?}", left());
    drop(sshd);
}

/// An emulated link between namespaces `ns_a` and `ns_b` (10.250.`subnet`.x)
/// and an sshd on port 22 in `ns_b`.
fn ssh_host_behind_a_link(ns_a: &'static str, ns_b: &'static str, subnet: u8) -> (dmover_testkit::Link, Env, Sshd) {
    let link = dmover_testkit::Link::up(dmover_testkit::LinkSpec { ns_a, ns_b, subnet, delay_ms: 5.0, rate_mbit: 200.0, timeout_s: 300 });
    let env = Env::new();
    let sshd = Sshd::start_in(&env.path("sshd"), Some(ns_b), &link.ip_b(), 22);
    (link, env, sshd)
}

/// Applies an nftables script in namespace `ns`.
fn nft(ns: &str, script: &str) {
    let st = in_netns(Some(ns), "nft").args(["-f", "-"]).stdin(std::process::Stdio::piped()).spawn().and_then(|mut c| {
        use std::io::Write;
        c.stdin.take().unwrap().write_all(script.as_bytes())?;
        c.wait()
    });
    assert!(st.is_ok_and(|s| s.success()), "nft could not apply {script:?} (apt install nftables)");
}

/// dmover's listening sockets in namespace `ns`.
fn dmover_listening(ns: &str) -> Vec<String> {
    let out = in_netns(Some(ns), "ss").args(["-Hltnp"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains("dmover")).map(String::from).collect()
}

/// The link to a host reached over ssh dies in the middle of an upload
/// (every packet dropped in the host's namespace): the remote end notices
/// by itself (sshd ends the session, and with it the remote end's input)
/// and exits, leaving no process and no listening socket; once the link is
/// back, the re-run resumes.
#[test]
fn a_cut_link_leaves_nothing_behind_and_the_rerun_resumes() {
    if !dmover_testkit::wan_link_possible() {
        return;
    }
    const NS_A: &str = "dmcutA";
    const NS_B: &str = "dmcutB";
    let (link, env, sshd) = ssh_host_behind_a_link(NS_A, NS_B, 18);
    let remote_dmover = env.path(&format!("bin/dmover-cut-{}", unique()));
    std::fs::create_dir_all(remote_dmover.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(BIN, &remote_dmover).unwrap();
    let remotes = || {
        let out = std::process::Command::new("pgrep").arg("-f").arg(format!("^{} remote", remote_dmover.display())).output().unwrap();
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    let listening = || dmover_listening(NS_B).len();
    let src = env.path("big");
    std::fs::create_dir_all(&src).unwrap();
    write_random(&src.join("data.bin"), 24 << 20, 11);
    let far = env.mkdir("far");
    let cp = |extra: &[&str]| {
        let mut c = dmover(["cp", "--json", "-q", "--ssh", &sshd.ssh(), "--remote-dmover", remote_dmover.to_str().unwrap()]);
        c.prefix(["ip", "netns", "exec", NS_A]);
        c.arg(src.display().to_string()).arg(format!("{}:{}/", link.ip_b(), far.display())).args(extra);
        c
    };
    let mut p = cp(&["--bwlimit", "3M", "-p", "2"]).spawn();
    let dest = far.join("big");
    let partial = || {
        let Ok(rd) = std::fs::read_dir(dest.join(".dmover-partial")) else { return 0 };
        rd.flatten().filter_map(|e| e.metadata().ok()).map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512).sum::<u64>()
    };
    assert!(wait_until(Duration::from_secs(60), || written_bytes(&far) + partial() >= 4 << 20), "the upload did not start");
    assert_eq!(remotes(), 1);

    nft(
        NS_B,
        &format!(
            "table inet dmover_cut {{\n chain input {{\n  type filter hook input priority 0;\n  iifname \"{NS_B}-tun\" drop\n }}\n}}\n"
        ),
    );
    let gone = wait_until(Duration::from_secs(30), || remotes() == 0 && listening() == 0);
    assert!(gone, "after the link was cut, {} remote dmover(s) and {} listening socket(s) remained", remotes(), listening());
    assert!(p.running(), "the client gave up before the remote end did");
    p.kill9();

    nft(NS_B, "delete table inet dmover_cut\n");
    let rerun = cp(&[]).run();
    rerun.assert_ok();
    assert_same_tree(&src, &dest);
    let sent = u(&rerun.json()["sent_bytes"]);
    assert!(sent < 24 << 20, "the re-run sent {sent} bytes: it did not resume");
    assert!(wait_until(Duration::from_secs(10), || remotes() == 0 && listening() == 0), "the re-run left a remote end behind");
    drop(sshd);
}
