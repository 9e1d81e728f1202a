//! The channel between the process manager and its transfer agents.
//!
//! An agent connects to the manager over TCP and both ends run the engine's
//! token handshake ([`dmover_engine::handshake`]) with a token the manager
//! made for this run and handed to its agents in their environment; a peer
//! without it is refused before anything else is read. After the handshake
//! the agent asks and the manager answers, one JSON message per line
//! ([`ToManager`], [`ToAgent`]). Lines are capped at [`MAX_LINE`] bytes, so a
//! hostile or broken peer cannot make the other end grow without bound.

use dmover_engine::handshake::{self, Authenticated};
use dmover_engine::transport::{connect_tcp, Transport};
use dmover_engine::{Error, Result};
use dmover_proto::auth::TOKEN_KEY_ID;
use dmover_proto::record::Protection;
use dmover_proto::ErrorKind;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read, Write};
use std::time::Duration;

/// Longest message line: a batch of work with long paths fits many times.
pub const MAX_LINE: u64 = 16 << 20;
/// Time a peer has to complete the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A file for an agent to send.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WorkItem {
    /// Path below the source root, which is also its path below the destination root.
    pub path: String,
    pub size: u64,
    pub mtime_s: i64,
    pub mtime_ns: u32,
    /// Permission bits, and the directory type bit for an empty directory.
    pub mode: u32,
    /// Inode change time (s, ns) when listed: a file changed since then is
    /// refused by the sender rather than stored half old, half new.
    pub ctime: (i64, i64),
    /// The destination host it goes to (an index into the job's hosts),
    /// the same for every attempt.
    pub host: u32,
}

/// What became of one file an agent was given.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileResult {
    pub path: String,
    /// The destination host it went to (when one took it).
    pub host: Option<String>,
    /// It was already complete at the destination (sync or resume).
    pub skipped: bool,
    /// Why it failed, if it did.
    pub error: Option<Failure>,
    /// With an error: the agent gave the file back without its session
    /// having moved anything (a destination that would not take it, busy
    /// or unreachable): no attempt of the file's own.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub untried: bool,
}

/// A failure: its class and a message. The class crosses the channel as
/// its exit code (`"code": 10`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Failure {
    #[serde(rename = "code", with = "kind_code")]
    pub kind: ErrorKind,
    pub message: String,
}

impl Failure {
    pub fn of(e: &Error) -> Failure {
        Failure { kind: e.kind, message: e.to_string() }
    }
}

/// An [`ErrorKind`] as its number; an unknown number is an internal error.
mod kind_code {
    use dmover_proto::ErrorKind;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(k: &ErrorKind, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(*k as u8)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ErrorKind, D::Error> {
        u8::deserialize(d).map(ErrorKind::from_u8)
    }
}

/// Agent → manager.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToManager {
    /// First message: where the agent runs.
    Hello { node: String, task: u32, pid: u32 },
    /// Outcomes since the last sync, how many more files the agent wants,
    /// and the transfer id of the engine session it has open, if any (the
    /// manager finishes that transfer at the end should the agent be lost).
    Sync {
        results: Vec<FileResult>,
        want: u32,
        #[serde(default)]
        session: Option<[u8; 16]>,
        /// Payload bytes the agent has sent so far, over all its sessions,
        /// counted as they go (the job's rate), not as files settle.
        #[serde(default)]
        sent_bytes: u64,
    },
    /// The agent is done (after the manager said the job is finished):
    /// whether every engine session it ran ended with matching set digests.
    Bye { digests_match: bool },
    /// The agent stops on an error it cannot get past (it reaches no
    /// destination, or a destination refuses it); it exits after this.
    Stopping { error: Failure },
}

/// Manager → agent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToAgent {
    /// Answer to `Hello`: the agent's number in reports.
    Welcome { agent: u32 },
    /// Answer to `Sync`: files to send (maybe none yet), or the news that
    /// the job is finished and the agent should say `Bye` and exit.
    Work { files: Vec<WorkItem>, finished: bool },
}

/// One end of an authenticated manager–agent connection.
pub struct Channel {
    reader: BufReader<Box<dyn Transport>>,
    writer: Box<dyn Transport>,
    peer: String,
}

fn net(peer: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::network(peer, &e)
}

impl Channel {
    /// Connects to the manager at `addr` and proves we know `token`.
    pub fn connect(addr: &str, token: &[u8]) -> Result<Channel> {
        let t: Box<dyn Transport> = Box::new(connect_tcp(addr).map_err(net(addr))?);
        t.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(net(addr))?;
        let mut a =
            handshake::client(t, TOKEN_KEY_ID, token, Protection::Encrypted).map_err(|e| Error { subject: addr.to_string(), ..e })?;
        handshake::expect_welcome(&mut a.reader)?;
        Channel::after_handshake(a, addr)
    }

    /// Runs the manager's side of the handshake on an accepted connection.
    pub fn accept(t: Box<dyn Transport>, token: &[u8]) -> Result<Channel> {
        let peer = t.peer();
        t.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(net(&peer))?;
        let (_, a) = handshake::server(t, |id| (*id == TOKEN_KEY_ID).then(|| token.to_vec()))?;
        Channel::after_handshake(a, &peer)
    }

    /// Both sides wait for the other's last handshake frame before they
    /// write a line, so nothing can be left in the frame reader's buffer.
    fn after_handshake(a: Authenticated, peer: &str) -> Result<Channel> {
        let t = a.transport;
        if a.reader.buffered() != 0 {
            return Err(Error::protocol(peer, "data before the end of the handshake"));
        }
        let writer = t.split().map_err(net(peer))?;
        Ok(Channel { reader: BufReader::new(t), writer, peer: peer.to_string() })
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Fails reads that wait longer than `t`.
    pub fn set_timeout(&self, t: Option<Duration>) -> Result<()> {
        self.reader.get_ref().set_read_timeout(t).map_err(net(&self.peer))
    }

    pub fn send<T: Serialize>(&mut self, m: &T) -> Result<()> {
        let mut line = serde_json::to_vec(m).map_err(|e| Error::internal(e.to_string()))?;
        line.push(b'\n');
        self.writer.write_all(&line).map_err(net(&self.peer))
    }

    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<T> {
        let mut line = Vec::new();
        let n = self.reader.by_ref().take(MAX_LINE).read_until(b'\n', &mut line).map_err(net(&self.peer))?;
        if n == 0 {
            return Err(Error::new(ErrorKind::Unreachable, &self.peer, "connection closed"));
        }
        if line.last() != Some(&b'\n') {
            let why = if n as u64 >= MAX_LINE { "message too long" } else { "connection closed mid-message" };
            return Err(Error::protocol(&self.peer, why));
        }
        serde_json::from_slice(&line).map_err(|e| Error::protocol(&self.peer, format!("bad message: {e}")))
    }

    /// Sends `m` and reads the answer.
    pub fn request<T: Serialize, A: DeserializeOwned>(&mut self, m: &T) -> Result<A> {
        self.send(m)?;
        self.recv()
    }

    /// Ends the connection in both directions.
    pub fn close(&self) {
        self.writer.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn listen() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap().to_string();
        (l, a)
    }

    #[test]
    fn messages_cross_after_the_handshake() {
        let (l, addr) = listen();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut c = Channel::accept(Box::new(s), b"0123456789abcdef0123").unwrap();
            let m: ToManager = c.recv().unwrap();
            assert_eq!(m, ToManager::Hello { node: "n1".into(), task: 3, pid: 7 });
            c.send(&ToAgent::Welcome { agent: 1 }).unwrap();
        });
        let mut c = Channel::connect(&addr, b"0123456789abcdef0123").unwrap();
        let a: ToAgent = c.request(&ToManager::Hello { node: "n1".into(), task: 3, pid: 7 }).unwrap();
        assert_eq!(a, ToAgent::Welcome { agent: 1 });
        server.join().unwrap();
    }

    #[test]
    fn a_wrong_token_is_refused_before_any_message() {
        let (l, addr) = listen();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            Channel::accept(Box::new(s), b"0123456789abcdef0123").err().map(|e| e.kind)
        });
        let e = Channel::connect(&addr, b"another-token-entirely").err().expect("refused");
        assert_eq!(e.kind, ErrorKind::Auth);
        assert_eq!(server.join().unwrap(), Some(ErrorKind::Auth));
    }

    #[test]
    fn a_failure_crosses_as_its_exit_code() {
        let r = FileResult {
            path: "a".into(),
            host: None,
            skipped: false,
            error: Some(Failure { kind: ErrorKind::Permission, message: "m".into() }),
            untried: false,
        };
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(line, r#"{"path":"a","host":null,"skipped":false,"error":{"code":4,"message":"m"}}"#);
        assert_eq!(serde_json::from_str::<FileResult>(&line).unwrap(), r);
    }

    #[test]
    fn garbage_after_the_handshake_is_a_clear_error() {
        let (l, addr) = listen();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut c = Channel::accept(Box::new(s), b"0123456789abcdef0123").unwrap();
            c.recv::<ToManager>().unwrap_err()
        });
        let mut c = Channel::connect(&addr, b"0123456789abcdef0123").unwrap();
        c.writer.write_all(b"{\"msg\":\"launch_missiles\"}\n").unwrap();
        let e = server.join().unwrap();
        assert!(e.message.contains("bad message"), "{e}");
    }
}
