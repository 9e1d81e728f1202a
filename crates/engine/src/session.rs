//! The client's side of connection setup: connect, authenticate, and attach
//! control and data connections to a session on a server.

use crate::error::{Error, Result};
use crate::handshake;
use crate::send::{Connector, HostLink};
use crate::transport::{connect_tcp, SocketOptions, Transport};
use crate::wire::{FrameReader, FrameWriter};
use dmover_proto::auth::{KeyId, SessionKey, TOKEN_KEY_ID};
use dmover_proto::frame::TransferOptions;
use dmover_proto::{ErrorKind, Msg};
use std::sync::Arc;
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
    reader: FrameReader,
    /// The server's `Welcome` has not been read yet.
    welcome_pending: bool,
    pub writer: FrameWriter,
    transport: Box<dyn Transport>,
    pub session_key: SessionKey,
}

impl Conn {
    /// Connects to `host` (`name:port`) and authenticates.
    pub fn open(host: &str, cred: &Credential) -> Result<Conn> {
        Conn::open_with(host, cred, &SocketOptions::default())
    }

    /// Connects with the socket options of a data connection and authenticates.
    pub fn open_with(host: &str, cred: &Credential, socket: &SocketOptions) -> Result<Conn> {
        Conn::connect(host, cred, socket, SETUP_TIMEOUT)
    }

    /// Connects and authenticates, waiting up to `setup` (instead of
    /// [`SETUP_TIMEOUT`]) for each of the server's answers during setup.
    pub fn open_within(host: &str, cred: &Credential, setup: Duration) -> Result<Conn> {
        Conn::connect(host, cred, &SocketOptions::default(), setup)
    }

    fn connect(host: &str, cred: &Credential, socket: &SocketOptions, setup: Duration) -> Result<Conn> {
        let t = connect_tcp(host).map_err(|e| Error::network(host, &e))?;
        t.set_options(socket).map_err(|e| Error::new(ErrorKind::Usage, host, e.to_string()))?;
        let t: Box<dyn Transport> = Box::new(t);
        t.set_read_timeout(Some(setup)).map_err(|e| Error::network(host, &e))?;
        let split = |t: &dyn Transport| t.split().map_err(|e| Error::network(host, &e));
        let mut reader = FrameReader::new(split(t.as_ref())?);
        let mut writer = FrameWriter::new(split(t.as_ref())?);
        let session_key =
            handshake::client(&mut reader, &mut writer, cred.key_id, &cred.secret).map_err(|e| Error { subject: host.to_string(), ..e })?;
        Ok(Conn { host: host.to_string(), reader, welcome_pending: true, writer, transport: t, session_key })
    }

    /// Reads the next message (a server's `Error` becomes `Err`).
    pub fn read_msg(&mut self) -> Result<Msg> {
        let host = &self.host;
        let named = |e: Error| Error { subject: if e.subject.is_empty() { host.clone() } else { e.subject }, ..e };
        if std::mem::take(&mut self.welcome_pending) {
            handshake::expect_welcome(&mut self.reader).map_err(named)?;
        }
        self.reader.read_msg().map_err(named)
    }

    /// Sends a request and reads the answer.
    pub fn request(&mut self, m: &Msg) -> Result<Msg> {
        self.writer.send(m)?;
        self.read_msg()
    }

    pub fn send(&mut self, m: &Msg) -> Result<()> {
        self.writer.send(m)
    }

    /// Hands over the raw transport (nothing is buffered: the server only
    /// ever answers requests during setup). The welcome must have been read.
    pub fn into_transport(self) -> Box<dyn Transport> {
        debug_assert!(!self.welcome_pending);
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

/// Starts `n` connections to `host` in parallel: connected and
/// authenticated, but not yet attached to a session. Run it while the
/// control connection sets the session up, so the round trips overlap.
pub fn start_streams(host: &str, cred: &Credential, n: usize, socket: &SocketOptions) -> std::thread::JoinHandle<Result<Vec<Conn>>> {
    let (host, cred, socket) = (host.to_string(), cred.clone(), socket.clone());
    std::thread::spawn(move || {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                let (host, cred, socket) = (host.clone(), cred.clone(), socket.clone());
                std::thread::spawn(move || Conn::open_with(&host, &cred, &socket))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::internal("connection thread panicked")))).collect()
    })
}

/// Attaches started connections to `session`: all requests go out before
/// any answer is awaited, so this costs one round trip.
pub fn attach_streams(started: std::thread::JoinHandle<Result<Vec<Conn>>>, session: [u8; 16]) -> Result<Vec<Box<dyn Transport>>> {
    let mut conns = started.join().unwrap_or_else(|_| Err(Error::internal("connection thread panicked")))?;
    for (i, c) in conns.iter_mut().enumerate() {
        c.send(&Msg::OpenData { session, index: i as u32 })?;
    }
    conns
        .into_iter()
        .map(|mut c| {
            let m = c.read_msg()?;
            expect_session(&c.host, m)?;
            Ok(c.into_transport())
        })
        .collect()
}

/// Opens a receiving session for `dest` on `host` with `streams` data
/// connections: a link the sending engine can use, and can add streams to.
pub fn receive_link(
    host: &str,
    cred: &Credential,
    dest: &str,
    options: TransferOptions,
    streams: usize,
    socket: &SocketOptions,
) -> Result<HostLink> {
    let started = start_streams(host, cred, streams, socket);
    let mut c = Conn::control(host, cred)?;
    let m = c.request(&Msg::Receive { dest: dest.to_string(), options })?;
    let session = expect_session(host, m)?;
    let data = attach_streams(started, session)?;
    let (name, cred, socket) = (host.to_string(), cred.clone(), socket.clone());
    let connect: Connector = Arc::new(move || {
        let mut c = Conn::open_with(&name, &cred, &socket)?;
        c.send(&Msg::OpenData { session, index: 0 })?;
        let m = c.read_msg()?;
        expect_session(&name, m)?;
        Ok(c.into_transport())
    });
    Ok(HostLink { name: host.to_string(), control: c.into_transport(), data, connect: Some(connect) })
}

/// Opens receiving sessions on every host at once.
pub fn receive_links(
    hosts: &[(String, Credential)],
    dest: &str,
    options: TransferOptions,
    streams: usize,
    socket: &SocketOptions,
) -> Result<Vec<HostLink>> {
    let handles: Vec<_> = hosts
        .iter()
        .map(|(h, c)| {
            let (h, c, dest, socket) = (h.clone(), c.clone(), dest.to_string(), socket.clone());
            std::thread::spawn(move || receive_link(&h, &c, &dest, options, streams, &socket))
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
