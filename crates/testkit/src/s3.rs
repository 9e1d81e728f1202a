//! A real S3 server for the tests: versitygw with its POSIX backend, on a
//! free loopback port, each bucket a directory under its root. `./test`
//! installs it (`go install` into [`bin_dir`]).

use std::fs::{self, File};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The versitygw release `./test` installs.
pub const VERSION: &str = "v1.8.0";

/// Where `./test` installs versitygw: `$XDG_CACHE_HOME/dmover/bin`, else
/// `~/.cache/dmover/bin`.
pub fn bin_dir() -> PathBuf {
    match std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("dmover/bin"),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/dmover/bin"),
    }
}

/// Variables of the environment that would change how an S3 client finds
/// its credentials, endpoint or certificates: the tests set their own.
pub fn foreign_env() -> Vec<String> {
    std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| {
            let u = k.to_ascii_uppercase();
            u.starts_with("AWS_") || u.contains("CA_BUNDLE") || u.starts_with("SSL_CERT") || u.ends_with("_PROXY")
        })
        .collect()
}

/// A running versitygw; stopped when dropped.
pub struct S3Server {
    pub port: u16,
    pub access_key: String,
    pub secret_key: String,
    /// The backend's directory: each bucket is a directory in it, each
    /// object a file below.
    pub root: PathBuf,
    log: PathBuf,
    child: Child,
}

impl S3Server {
    /// Starts versitygw on loopback with its data and log under `dir`;
    /// None (the test is skipped, or fails under CI) if it is not installed.
    pub fn start(dir: &Path) -> Option<S3Server> {
        S3Server::start_on(dir, "127.0.0.1")
    }

    /// As [`start`](S3Server::start), listening on address `ip`: `0.0.0.0`
    /// for the nodes of the local Slurm cluster to reach it (by this
    /// machine's name; [`endpoint`](S3Server::endpoint) stays loopback).
    pub fn start_on(dir: &Path, ip: &str) -> Option<S3Server> {
        let bin = bin_dir().join("versitygw");
        if !bin.exists() {
            let why = format!(
                "{} is missing: run ./test once (it needs Go 1.25), or `GOBIN={} go install github.com/versity/versitygw/cmd/versitygw@{VERSION}`",
                bin.display(),
                bin_dir().display()
            );
            if !crate::skip(&why) {
                return None;
            }
        }
        let root = dir.join("s3-root");
        fs::create_dir_all(&root).unwrap();
        let port = std::net::TcpListener::bind((ip, 0)).unwrap().local_addr().unwrap().port();
        let (access_key, secret_key) = ("dmovertest".to_string(), format!("secret-{}", std::process::id()));
        let log = dir.join("versitygw.log");
        let mut c = Command::new(&bin);
        c.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .args(["--access", &access_key, "--secret", &secret_key, "--port", &format!("{ip}:{port}"), "--quiet", "posix"])
            .arg(&root)
            .stdin(Stdio::null())
            .stdout(File::create(&log).unwrap())
            .stderr(File::create(&log).unwrap());
        crate::die_with_parent(&mut c);
        let child = c.spawn().expect("start versitygw");
        let end = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < end, "versitygw did not start: {}", fs::read_to_string(&log).unwrap_or_default());
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(S3Server { port, access_key, secret_key, root, log, child })
    }

    /// Its URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Makes an empty bucket; returns its directory.
    pub fn bucket(&self, name: &str) -> PathBuf {
        let d = self.root.join(name);
        fs::create_dir(&d).unwrap();
        d
    }

    /// What a client needs in its environment (besides clearing
    /// [`foreign_env`]): the keys, the endpoint and a region.
    pub fn client_env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID".into(), self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY".into(), self.secret_key.clone()),
            ("AWS_ENDPOINT_URL".into(), self.endpoint()),
            ("AWS_REGION".into(), "us-east-1".into()),
        ]
    }

    /// The multipart uploads in progress in `bucket`: (key, upload id),
    /// as the server lists them (curl signs the request).
    pub fn uploads(&self, bucket: &str) -> Vec<(String, String)> {
        let xml = self.get(&format!("/{bucket}?uploads="));
        xml.split("<Upload>").skip(1).map(|u| (tag(u, "Key"), tag(u, "UploadId"))).collect()
    }

    /// The body of a signed GET of `path` (with its query); panics on failure.
    fn get(&self, path: &str) -> String {
        let out = Command::new("curl")
            .args(["-sSf", "--aws-sigv4", "aws:amz:us-east-1:s3", "-H", &format!("x-amz-content-sha256: {EMPTY_SHA256}"), "--user"])
            .arg(format!("{}:{}", self.access_key, self.secret_key))
            .arg(format!("{}{path}", self.endpoint()))
            .output()
            .expect("run curl");
        assert!(out.status.success(), "GET {path}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- versitygw log ---\n{}", self.log());
        }
    }
}

/// The SHA-256 of nothing: the body of a GET, which S3 wants to be told.
const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// The text of the first `<name>` element in `xml` (empty if none).
fn tag(xml: &str, name: &str) -> String {
    let open = format!("<{name}>");
    let Some(start) = xml.find(&open).map(|i| i + open.len()) else { return String::new() };
    xml[start..].split(&format!("</{name}>")).next().unwrap_or_default().to_string()
}
