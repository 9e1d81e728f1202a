//! s3://bucket/prefix locations against a real S3 server (versitygw on
//! loopback): a tree up and back down identical, globs, --sync, the
//! digest kept with each object and checked on the way down, credentials
//! from a profile with --s3-endpoint, and what wrong credentials and a
//! missing bucket say.

mod util;

use dmover_proto::ErrorKind;
use std::fs;
use util::*;

/// A test's S3 server, with its home directory (no ~/.aws unless a test writes one).
struct Setup {
    env: Env,
    s3: S3Server,
}

impl Setup {
    fn new() -> Setup {
        let env = Env::new();
        let s3 = S3Server::start(&env.path("s3"));
        env.mkdir("home");
        Setup { env, s3 }
    }

    /// `dmover cp --json -q ARGS` reaching the server.
    fn cp<S: AsRef<std::ffi::OsStr>>(&self, args: impl IntoIterator<Item = S>) -> Cmd {
        let mut c = self.env.cp(args);
        c.s3(&self.s3, &self.env.path("home"));
        c
    }
}

#[test]
fn a_tree_goes_up_and_comes_back_identical() {
    let t = Setup::new();
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 21, 30);
    // Several parts of a multipart upload, the last one short.
    let mut rng = Rng::new(5);
    make_file(&src.join("big/large.bin"), 40 * (1 << 20) + 4321, &mut rng);
    let j = t.cp([src.to_str().unwrap(), "s3://data/run1/"]).run().assert_ok();
    assert_eq!(u(&j["files"]), list_files(&src).len() as u64, "{j:#}");
    // The objects are the files, byte for byte, under the prefix, and no
    // partial upload or state is left in the bucket.
    for (rel, _) in list_files(&src) {
        let obj = bucket.join("run1/src").join(&rel);
        assert_eq!(fs::read(&obj).unwrap(), fs::read(src.join(&rel)).unwrap(), "{rel}");
    }
    let stray: Vec<_> = list_tree(&bucket).into_keys().filter(|k| k.contains(".part") || k.contains(".dmover")).collect();
    assert!(stray.is_empty(), "left in the bucket: {stray:?}");

    let dst = t.env.mkdir("dst");
    t.cp(["s3://data/run1/src", dst.to_str().unwrap()]).run().assert_ok();
    assert_same_tree(&src, &dst.join("src"));
}

#[test]
fn a_glob_picks_objects() {
    let t = Setup::new();
    t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 22, 12);
    t.cp([&format!("{}/", src.display()), "s3://data/"]).run().assert_ok();
    let dst = t.env.mkdir("dst");
    let j = t.cp(["s3://data/a/*.dat", dst.to_str().unwrap()]).run().assert_ok();
    let want: Vec<String> = fs::read_dir(src.join("a"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".dat"))
        .collect();
    assert_eq!(u(&j["files"]), want.len() as u64, "{j:#}");
    for n in want {
        assert_eq!(fs::read(dst.join(&n)).unwrap(), fs::read(src.join("a").join(&n)).unwrap(), "{n}");
    }
}

#[test]
fn sync_skips_what_is_there_both_ways() {
    let t = Setup::new();
    t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 23, 10);
    let j = t.cp([src.to_str().unwrap(), "s3://data/", "--sync"]).run().assert_ok();
    let files = u(&j["files"]);
    assert_eq!(u(&j["skipped_files"]), 0, "{j:#}");
    // Unchanged: nothing goes up again.
    let j = t.cp([src.to_str().unwrap(), "s3://data/", "--sync"]).run().assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "--sync should skip every unchanged file: {j:#}");
    // One file changed: only it goes.
    fs::write(src.join("one.bin"), b"changed").unwrap();
    let j = t.cp([src.to_str().unwrap(), "s3://data/", "--sync"]).run().assert_ok();
    assert_eq!(u(&j["skipped_files"]), files - 1, "{j:#}");
    // And down: a second download skips everything.
    let dst = t.env.mkdir("dst");
    t.cp(["s3://data/src", dst.to_str().unwrap(), "--sync"]).run().assert_ok();
    let j = t.cp(["s3://data/src", dst.to_str().unwrap(), "--sync"]).run().assert_ok();
    assert_eq!(u(&j["skipped_files"]), files, "{j:#}");
    assert_same_tree(&src, &dst.join("src"));
}

#[test]
fn a_damaged_object_fails_verification_on_the_way_down() {
    let t = Setup::new();
    let bucket = t.s3.bucket("data");
    let src = t.env.mkdir("src");
    let mut rng = Rng::new(9);
    make_file(&src.join("f.bin"), 3 << 20, &mut rng);
    t.cp([src.to_str().unwrap(), "s3://data/"]).run().assert_ok();
    // Damage the object behind the server's back, keeping its size.
    let obj = bucket.join("src/f.bin");
    let mut data = fs::read(&obj).unwrap();
    data[1 << 20] ^= 1;
    fs::write(&obj, &data).unwrap();
    let dst = t.env.mkdir("dst");
    let r = t.cp(["s3://data/src/f.bin", dst.join("f.bin").to_str().unwrap()]).run();
    assert_ne!(r.code, 0, "a damaged object was accepted: {}", r.stdout);
    assert!(r.stdout.contains("differs from the digest stored with the file"), "{}\n{}", r.stdout, r.stderr);
    assert!(!dst.join("f.bin").exists(), "the damaged file was kept");
}

#[test]
fn credentials_from_a_profile_and_the_endpoint_from_the_command_line() {
    let t = Setup::new();
    t.s3.bucket("data");
    let home = t.env.path("home");
    fs::create_dir_all(home.join(".aws")).unwrap();
    fs::write(
        home.join(".aws/credentials"),
        format!("[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n[lab]\naws_access_key_id = {}\naws_secret_access_key = {}\n", t.s3.access_key, t.s3.secret_key),
    )
    .unwrap();
    let src = t.env.mkdir("src");
    make_tree(&src, 24, 3);
    let mut c = t.cp([src.to_str().unwrap(), "s3://data/p", "--s3-endpoint", &t.s3.endpoint()]);
    c.env_remove("AWS_ACCESS_KEY_ID").env_remove("AWS_SECRET_ACCESS_KEY").env_remove("AWS_ENDPOINT_URL").env("AWS_PROFILE", "lab");
    c.run().assert_ok();
    assert!(t.s3.root.join("data/p/src/one.bin").exists());
}

#[test]
fn wrong_credentials_say_so() {
    let t = Setup::new();
    t.s3.bucket("data");
    let src = t.env.mkdir("src");
    make_tree(&src, 25, 1);
    let mut c = t.cp([src.to_str().unwrap(), "s3://data/"]);
    c.env("AWS_SECRET_ACCESS_KEY", "not-the-secret");
    let r = c.run();
    r.assert_fails(ErrorKind::Auth as i32, &["s3://data", "refused the credentials", &t.s3.access_key, "AWS_SECRET_ACCESS_KEY"]);
}

#[test]
fn a_missing_bucket_says_what_to_do() {
    let t = Setup::new();
    let src = t.env.mkdir("src");
    make_tree(&src, 26, 1);
    let r = t.cp([src.to_str().unwrap(), "s3://nobucket/x"]).run();
    r.assert_fails(ErrorKind::NotFound as i32, &["s3://nobucket", "no such bucket", "create it first"]);
    let r = t.cp(["s3://nobucket/x", t.env.mkdir("dst").to_str().unwrap()]).run();
    r.assert_fails(ErrorKind::NotFound as i32, &["s3://nobucket", "no such bucket"]);
}
