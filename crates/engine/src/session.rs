//! The client's side of connection setup: connect, authenticate, and attach
//! control and data connections to a session on a server.

use crate::error::{Error, Result};
use crate::handshake;
use crate::send::HostLink;
use crate::transport::{connect_tcp, Transport};
use crate::wire::{FrameReader, FrameWriter};
use dmover_proto::auth::{KeyId, SessionKey, TOKEN_KEY_ID};
use dmover_proto::frame::TransferOptions;
use dmover_proto::Msg;
use std::time::Duration;

/// How long a server may take to answer during setup.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// A secret to authenticate with: the server's token, or a ticket it issued.
#[derive(Clone)]
pub struct Credential {
    pub key_id: KeyId,
    pub secret: Vec<u8>,
}

impl Credential {
    pub fn token(token: &[u8]) -> Credential {
        Credential { key_id: TOKEN_KEY_ID, secret: token.to_vec() }
    }
}

/// An authenticated connection to a server.
pub struct Conn {
    pub host: String,
    pub reader: FrameReader,
    pub writer: FrameWriter,
    transport: Box<dyn Transport>,
    pub session_key: SessionKey,
}

impl Conn {
    /// Connects to `host` (`name:port`) and authenticates.
    pub fn open(host: &str, cred: &Credential) -> Result<Conn> {
        let t = connect_tcp(host).map_err(|e| Error::network(host, &e))?;
        let t: Box<dyn Transport> = Box::new(t);
        t.set_read_timeout(Some(SETUP_TIMEOUT)).map_err(|e| Error::network(host, &e))?;
        let split = |t: &Box<dyn Transport>| t.split().map_err(|e| Error::network(host, &e));
        let mut reader = FrameReader::new(split(&t)?);
        let mut writer = FrameWriter::new(split(&t)?);
        let session_key = handshake::client(&mut reader, &mut writer, cred.key_id, &cred.secret).map_err(|e| Error { subject: host.to_string(), ..e })?;
        Ok(Conn { host: host.to_string(), reader, writer, transport: t, session_key })
    }

    /// Sends a request and reads the answer (a server's `Error` becomes `Err`).
    pub fn request(&mut self, m: &Msg) -> Result<Msg> {
        self.writer.send(m)?;
        self.reader.read_msg().map_err(|e| Error { subject: if e.subject.is_empty() { self.host.clone() } else { e.subject }, ..e })
    }

    pub fn send(&mut self, m: &Msg) -> Result<()> {
        self.writer.send(m)
    }

    /// Hands over the raw transport (nothing is buffered: the server only
    /// ever answers requests during setup).
    pub fn into_transport(self) -> Box<dyn Transport> {
        let _ = self.transport.set_read_timeout(None);
        self.transport
    }

    /// Opens a control connection.
    pub fn control(host: &str, cred: &Credential) -> Result<Conn> {
        let mut c = Conn::open(host, cred)?;
        c.send(&Msg::OpenControl)?;
        Ok(c)
    }
}

fn expect_session(host: &str, m: Msg) -> Result<[u8; 16]> {
    match m {
        Msg::SessionOpened { session } => Ok(session),
        m => Err(Error::protocol(host, format!("expected a session, got {m:?}"))),
    }
}

/// Opens `n` data connections to `session` on `host`, in parallel.
pub fn open_streams(host: &str, cred: &Credential, session: [u8; 16], n: usize) -> Result<Vec<Box<dyn Transport>>> {
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let (host, cred) = (host.to_string(), cred.clone());
            std::thread::spawn(move || -> Result<Box<dyn Transport>> {
                let mut c = Conn::open(&host, &cred)?;
                let m = c.request(&Msg::OpenData { session, index: i as u32 })?;
                expect_session(&host, m)?;
                Ok(c.into_transport())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::internal("connection thread panicked")))).collect()
}

/// Opens a receiving session for `dest` on `host` with `streams` data
/// connections: a link the sending engine can use.
pub fn receive_link(host: &str, cred: &Credential, dest: &str, options: TransferOptions, streams: usize) -> Result<HostLink> {
    let mut c = Conn::control(host, cred)?;
    let m = c.request(&Msg::Receive { dest: dest.to_string(), options })?;
    let session = expect_session(host, m)?;
    let data = open_streams(host, cred, session, streams)?;
    Ok(HostLink { name: host.to_string(), control: c.into_transport(), data })
}

/// Opens receiving sessions on every host at once.
pub fn receive_links(hosts: &[(String, Credential)], dest: &str, options: TransferOptions, streams: usize) -> Result<Vec<HostLink>> {
    let handles: Vec<_> = hosts
        .iter()
        .map(|(h, c)| {
            let (h, c, dest) = (h.clone(), c.clone(), dest.to_string());
            std::thread::spawn(move || receive_link(&h, &c, &dest, options, streams))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::internal("connection thread panicked")))).collect()
}

/// Asks `host` for a ticket to receive into `dest`, for a third party.
pub fn grant(host: &str, cred: &Credential, dest: &str) -> Result<(KeyId, [u8; 32])> {
    let mut c = Conn::control(host, cred)?;
    match c.request(&Msg::Grant { dest: dest.to_string() })? {
        Msg::Ticket { key_id, wrapped_secret } => Ok((key_id, c.session_key.wrap(&key_id, &wrapped_secret))),
        m => Err(Error::protocol(host, format!("expected a ticket, got {m:?}"))),
    }
}
