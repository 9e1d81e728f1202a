//! Hosts reached over ssh, with no daemon at the far end: a real `sshd` on
//! loopback starts `dmover remote` for each command. Copies both ways (also
//! to and from a bucket) and listings arrive intact, through every spelling
//! of a location and with `DMOVER_SSH`; each command's token opens only its
//! own remote end; the remote end, seen while it runs, is gone when the
//! command ends, even when the client is killed or the link dies (then
//! within its own watchdog's window), and a re-run resumes; a missing
//! remote dmover and a failing ssh say what to do.

mod util;

use std::path::{Path, PathBuf};
use std::time::Duration;
use util::*;

/// An environment with an sshd whose sessions have `home` as their home
/// directory, and a per-test name for the remote dmover (a link to the
/// binary), to find its processes.
struct Remote {
    env: Env,
    sshd: Sshd,
    home: PathBuf,
    dmover: PathBuf,
    /// What `--remote-dmover` names: `dmover`, or a script that runs it.
    remote_dmover: PathBuf,
}

impl Remote {
    fn new() -> Remote {
        let env = Env::new();
        let home = env.mkdir("home-there");
        let sshd = Sshd::start_with(&env.path("sshd"), SshdOptions { home: Some(&home), ..SshdOptions::default() });
        let dmover = env.path(&format!("bin/dmover-remote-{}", unique()));
        std::fs::create_dir_all(dmover.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(BIN, &dmover).unwrap();
        Remote { env, sshd, home, remote_dmover: dmover.clone(), dmover }
    }

    /// `dmover cp ARGS` reaching 127.0.0.1 over this sshd.
    fn cp<S: AsRef<std::ffi::OsStr>>(&self, args: impl IntoIterator<Item = S>) -> Cmd {
        let mut c = self.cp_by(None, args);
        c.arg("--ssh").arg(self.sshd.ssh());
        c
    }

    /// `dmover cp ARGS` with the ssh command `ssh` (None: no --ssh).
    fn cp_by<S: AsRef<std::ffi::OsStr>>(&self, ssh: Option<&str>, args: impl IntoIterator<Item = S>) -> Cmd {
        let mut c = dmover(["cp", "--json", "-q", "--remote-dmover", self.remote_dmover.to_str().unwrap(), "--token-file"]);
        c.arg(&self.env.token);
        if let Some(ssh) = ssh {
            c.arg("--ssh").arg(ssh);
        }
        c.args(args);
        c
    }

    /// `127.0.0.1:PATH`
    fn at(&self, p: &Path) -> String {
        format!("127.0.0.1:{}", p.display())
    }

    /// The remote dmover processes still running.
    fn remotes(&self) -> usize {
        self.remote_pids().len()
    }

    fn remote_pids(&self) -> Vec<u32> {
        let out = std::process::Command::new("pgrep").arg("-f").arg(format!("^{} remote", self.dmover.display())).output().unwrap();
        String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.trim().parse().ok()).collect()
    }

    /// Spawns `c` and waits until a remote end runs for it: the checks
    /// that none is left afterwards must see the one that ran.
    fn spawn_seen(&self, c: &Cmd) -> Proc {
        let mut p = c.spawn();
        let seen = wait_until(Duration::from_secs(30), || self.remotes() > 0 || !p.running());
        if !(seen && self.remotes() > 0) {
            let run = p.wait();
            panic!("no remote dmover was seen while the command ran (exit {}): {}", run.code, run.stderr);
        }
        p
    }
}

#[test]
fn copies_both_ways_and_lists_over_ssh_with_no_daemon() {
    let r = Remote::new();
    let src = r.env.path("src");
    make_tree(&src, 21, 30);
    let far = r.env.mkdir("far");
    // Slowed down, so that the remote end is seen while it runs.
    let up = r.spawn_seen(&r.cp([src.display().to_string(), format!("{}/", r.at(&far)), "--bwlimit".into(), "4M".into()])).wait();
    up.assert_ok();
    assert_same_tree(&src, &far.join("src"));
    assert!(wait_until(Duration::from_secs(10), || r.remotes() == 0), "a remote dmover outlived its command");

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

/// Every spelling of a location over ssh leads where it says: `host:rel`
/// and `ssh://host:port/~/rel` under the home directory there (the port
/// from the location: --ssh names none), `ssh://host:port/abs` and
/// `host:/abs` from the root; and `DMOVER_SSH` stands for `--ssh`.
#[test]
fn every_form_of_an_ssh_location_and_dmover_ssh_lead_where_they_say() {
    let r = Remote::new();
    let src = r.env.path("src");
    make_tree(&src, 31, 10);
    let port = r.sshd.port;

    r.cp([src.display().to_string(), "127.0.0.1:rel/".into()]).run().assert_ok();
    assert!(r.home.join("rel/src").is_dir(), "127.0.0.1:rel/ did not lead to rel/ in the home directory there");
    assert_same_tree(&src, &r.home.join("rel/src"));

    let no_port = r.sshd.ssh_without_port();
    let back = r.env.mkdir("back");
    let j = r.cp_by(Some(&no_port), [format!("ssh://127.0.0.1:{port}/~/rel/src"), back.display().to_string()]).run().assert_ok();
    assert_eq!(u(&j["files"]), list_files(&src).len() as u64, "{j:#}");
    assert_same_tree(&src, &back.join("src"));

    let abs = r.env.mkdir("abs");
    r.cp_by(Some(&no_port), [src.display().to_string(), format!("ssh://127.0.0.1:{port}{}/", abs.display())]).run().assert_ok();
    assert_same_tree(&src, &abs.join("src"));

    let mut c = r.cp_by(None, [r.at(&abs.join("src")), format!("{}/", r.env.mkdir("by-env").display())]);
    c.env("DMOVER_SSH", r.sshd.ssh());
    c.run().assert_ok();
    assert_same_tree(&src, &r.env.path("by-env/src"));
}

/// The token each command hands its remote end is its own: the remote end
/// of a later command refuses the token of an earlier one (while it
/// welcomes its own), and once a command ends its remote end, and the
/// port that took its token, are gone. (The tokens are caught by a script
/// that stands for the remote dmover and passes them on.)
#[test]
fn a_one_time_token_opens_nothing_a_second_time() {
    let mut r = Remote::new();
    let tokens = r.env.path("tokens");
    r.remote_dmover = r.env.path("bin/token-catcher");
    std::fs::write(
        &r.remote_dmover,
        format!(
            "#!/bin/sh\nIFS= read -r token\nprintf '%s\\n' \"$token\" >>{tokens}\n{{ printf '%s\\n' \"$token\"; exec cat; }} | exec {dmover} \"$@\"\n",
            tokens = tokens.display(),
            dmover = r.dmover.display()
        ),
    )
    .unwrap();
    chmod(&r.remote_dmover, 0o755);
    let caught = || -> Vec<Vec<u8>> {
        let text = std::fs::read_to_string(&tokens).unwrap_or_default();
        text.lines().map(|l| hex::decode(l).unwrap_or_else(|e| panic!("a token that is not hex ({e}): {l:?}"))).collect()
    };
    let src = r.env.path("src");
    make_tree(&src, 33, 5);
    let far = r.env.mkdir("far");
    r.cp([src.display().to_string(), format!("{}/", r.at(&far))]).run().assert_ok();
    assert_same_tree(&src, &far.join("src"));
    let first = caught();
    assert_eq!(first.len(), 1, "one token for one command");

    let big = r.env.path("big");
    std::fs::create_dir_all(&big).unwrap();
    write_random(&big.join("data.bin"), 16 << 20, 5);
    let p = r.spawn_seen(&r.cp([big.display().to_string(), format!("{}/", r.at(&far)), "--bwlimit".into(), "2M".into()]));
    let mut addr = None;
    let found = wait_until(Duration::from_secs(30), || {
        addr = r.remote_pids().into_iter().find_map(listening_on);
        addr.is_some() && caught().len() == 2
    });
    assert!(found, "the second remote end's port and token were not seen (port {addr:?}, {} token(s))", caught().len());
    let addr = addr.unwrap();
    let second = caught().pop().unwrap();
    assert!(welcomed(&addr, &second), "the remote end at {addr} did not welcome its own token");
    assert!(
        !welcomed(&addr, &first[0]),
        "the remote end at {addr} welcomed the token of an earlier command: a one-time token was used twice"
    );
    p.kill9();
    assert!(wait_until(Duration::from_secs(15), || r.remotes() == 0), "the remote dmover outlived a client killed with -9");
    assert!(
        std::net::TcpStream::connect(&addr).is_err(),
        "{addr}, where the remote end listened, still takes connections after its command"
    );
}

/// The address the process `pid` listens on, if it listens.
fn listening_on(pid: u32) -> Option<String> {
    let out = std::process::Command::new("ss").args(["-Hltnp"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains(&format!("pid={pid},")))?;
    line.split_whitespace().nth(3).map(String::from)
}

/// Whether the server at `addr` welcomes a connection that proves `token`
/// (it must itself prove it knows the token first).
fn welcomed(addr: &str, token: &[u8]) -> bool {
    use dmover_proto::Msg;
    let mut c = Raw::connect(addr);
    let (i, hello) = Raw::hello(dmover_proto::auth::TOKEN_KEY_ID, token);
    c.send(&hello);
    let Some(Msg::Challenge { challenge }) = c.read() else { return false };
    let Ok((channel, proof)) = i.finish(&challenge) else { return false };
    c.send(&Msg::Proof { proof });
    c.seal(channel);
    c.read() == Some(Msg::Welcome)
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
    // Slowed down, so that the remote end is seen while it runs.
    let mut c = r.cp(["s3://one/src".into(), format!("{}/", r.at(&far)), "--bwlimit".into(), "4M".into()]);
    c.s3(&s3, &home);
    let j = r.spawn_seen(&c).wait().assert_ok();
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
    assert!(wait_until(Duration::from_secs(60), || on_disk(&dest) >= 8 << 20), "the upload did not start");
    assert_eq!(r.remotes(), 1, "one remote end per command");
    p.kill9();
    // ssh goes with the client; the remote end sees its input close.
    assert!(wait_until(Duration::from_secs(15), || r.remotes() == 0), "the remote dmover outlived a client killed with -9");
    let there = on_disk(&dest);
    let rerun = r.cp(args().into_iter().take(2)).run();
    rerun.assert_ok();
    assert_same_tree(&src, &dest);
    assert_resumed(&rerun, 24 << 20, there);
}

/// Bytes at the destination `dest` of a copy that was cut: its files and
/// its resume state.
fn on_disk(dest: &Path) -> u64 {
    written_bytes(dest) + partial_bytes(dest)
}

/// The re-run sent what was missing, by a margin of half of what was
/// `there` when the first run was cut (resuming nothing, or a few blocks
/// only, fails).
#[track_caller]
fn assert_resumed(rerun: &Run, total: u64, there: u64) {
    let sent = u(&rerun.json()["sent_bytes"]);
    eprintln!("re-run: sent {sent} of {total} bytes; {there} were there after the cut");
    assert!(sent + there / 2 < total, "the re-run sent {sent} of {total} bytes although {there} were already there: not resumed");
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

    // A key the host does not take: a failed login, exit code 7 as a wrong token.
    let key = r.env.path("wrong-key");
    let made = std::process::Command::new("ssh-keygen").args(["-q", "-t", "ed25519", "-N", ""]).arg("-f").arg(&key).output().unwrap();
    assert!(made.status.success(), "ssh-keygen: {}", String::from_utf8_lossy(&made.stderr));
    let wrong = format!(
        "ssh -p {} -i {} -o IdentitiesOnly=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes -o LogLevel=ERROR",
        r.sshd.port,
        key.display()
    );
    let mut c = dmover(["cp", "-q", "--ssh", &wrong, "--remote-dmover", r.dmover.to_str().unwrap()]);
    c.arg(src.display().to_string()).arg(r.at(&far));
    c.run().assert_fails(7, &["ssh could not log in", "Permission denied"]);

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
    let up = r.cp([
        src.display().to_string(),
        format!("{}/", r.at(&far)),
        "--via-ssh".into(),
        "-p".into(),
        "3".into(),
        "--bwlimit".into(),
        "4M".into(),
    ]);
    let mut p = r.spawn_seen(&up);
    // The remote end and a relay for each of the 3 data connections.
    let relays = wait_until(Duration::from_secs(30), || r.remotes() >= 4 || !p.running());
    let up = p.wait();
    up.assert_ok();
    assert!(relays, "no relays were seen while the copy ran");
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
    let (link, env, sshd) = ssh_host_behind_a_link(NS_A, NS_B, 17, SshdOptions::default());
    nft(NS_B, &format!("table inet dmover_test {{\n chain input {{\n  type filter hook input priority 0;\n  iifname \"{NS_B}-tun\" tcp dport != 22 drop\n }}\n}}\n"));

    let src = env.path("src");
    make_tree(&src, 9, 20);
    let far = env.mkdir("far");
    let mut c = dmover(["cp", "--json", "-q", "--ssh", &sshd.ssh(), "--remote-dmover", BIN]);
    c.prefix(["ip", "netns", "exec", NS_A]);
    c.arg(src.display().to_string()).arg(format!("{}:{}/", link.ip_b(), far.display()));
    // The copy waits 3 s for the port before it falls back: time to see
    // the remote end listen.
    let mut p = c.spawn();
    let listened = wait_until(Duration::from_secs(30), || !dmover_listening(NS_B).is_empty() || !p.running());
    let r = p.wait();
    r.assert_ok();
    assert!(listened, "the remote end was not seen listening on the host while the copy ran");
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
/// and an sshd on port 22 in `ns_b` (`o` says how it differs).
fn ssh_host_behind_a_link(ns_a: &'static str, ns_b: &'static str, subnet: u8, o: SshdOptions) -> (dmover_testkit::Link, Env, Sshd) {
    let link = dmover_testkit::Link::up(dmover_testkit::LinkSpec { ns_a, ns_b, subnet, delay_ms: 5.0, rate_mbit: 200.0, timeout_s: 300 });
    let env = Env::new();
    let sshd = Sshd::start_in(&env.path("sshd"), &link.ip_b(), 22, SshdOptions { ns: Some(ns_b), ..o });
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
/// (every packet dropped in the host's namespace), and sshd there sends no
/// ClientAlive probes, so that it never notices: the remote end does, by
/// itself (a pipe silent for 15 s is dead, docs/PROTOCOL.md), says so, and
/// exits within that window, leaving no process and no listening socket;
/// once the link is back, the re-run resumes.
#[test]
fn a_cut_link_leaves_nothing_behind_and_the_rerun_resumes() {
    if !dmover_testkit::wan_link_possible() {
        return;
    }
    const NS_A: &str = "dmcutA";
    const NS_B: &str = "dmcutB";
    let (link, env, sshd) = ssh_host_behind_a_link(NS_A, NS_B, 18, SshdOptions { no_client_alive: true, ..SshdOptions::default() });
    // The remote dmover, run by a script that keeps its messages (ssh
    // cannot bring them back over a cut link).
    let cut_dmover = env.path(&format!("bin/dmover-cut-{}", unique()));
    std::fs::create_dir_all(cut_dmover.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(BIN, &cut_dmover).unwrap();
    let log = env.path("remote.log");
    let remote_dmover = env.path("bin/logging-dmover");
    std::fs::write(&remote_dmover, format!("#!/bin/sh\nexec {} \"$@\" 2>>{}\n", cut_dmover.display(), log.display())).unwrap();
    chmod(&remote_dmover, 0o755);
    let remotes = || {
        let out = std::process::Command::new("pgrep").arg("-f").arg(format!("^{} remote", cut_dmover.display())).output().unwrap();
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
    assert!(wait_until(Duration::from_secs(60), || on_disk(&dest) >= 8 << 20), "the upload did not start");
    assert_eq!(remotes(), 1);
    assert!(listening() > 0, "the remote end's port was not seen while it ran");

    nft(
        NS_B,
        &format!(
            "table inet dmover_cut {{\n chain input {{\n  type filter hook input priority 0;\n  iifname \"{NS_B}-tun\" drop\n }}\n}}\n"
        ),
    );
    let cut = std::time::Instant::now();
    // The client's last keepalive came at most a second before the cut;
    // the remote end has 2 s to let its transfers end, and a moment to exit.
    let (earliest, latest) = (Duration::from_secs(14), Duration::from_secs(20));
    let gone = wait_until(latest + Duration::from_secs(10), || remotes() == 0 && listening() == 0);
    let after = cut.elapsed();
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    eprintln!("the remote end went {after:?} after the link was cut");
    assert!(
        gone,
        "{after:?} after the link was cut, {} remote dmover(s) and {} listening socket(s) remained:\n{said}",
        remotes(),
        listening()
    );
    assert!(
        (earliest..=latest).contains(&after),
        "the remote end went {after:?} after the link was cut, outside its watchdog's window {earliest:?} to {latest:?}:\n{said}"
    );
    assert!(said.contains("the pipe is taken for dead"), "the remote end did not say why it stopped:\n{said}");
    assert!(p.running(), "the client gave up before the remote end did");
    p.kill9();

    let there = on_disk(&dest);
    nft(NS_B, "delete table inet dmover_cut\n");
    let rerun = cp(&[]).run();
    rerun.assert_ok();
    assert_same_tree(&src, &dest);
    assert_resumed(&rerun, 24 << 20, there);
    assert!(wait_until(Duration::from_secs(10), || remotes() == 0 && listening() == 0), "the re-run left a remote end behind");
    drop(sshd);
}
