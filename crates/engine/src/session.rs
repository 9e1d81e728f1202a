//! The client's side: connect, authenticate, attach control and data
//! connections to a session on a server, and the client's part of each
//! request a server serves — receive ([`receive_links`], an upload),
//! send ([`download`]), push ([`push`], a third-party copy) and list
//! ([`list`]). Retries are the caller's: each of these is one attempt.

use crate::error::{Error, Result};
use crate::handshake;
use crate::progress::{Progress, Snapshot};
use crate::recv::{self, RecvConfig};
use crate::send::{Attaching, HostLink, MoreStreams};
use crate::transport::{connect_tcp, Connector, Mux, SocketOptions, Transport};
use crate::wire::{FrameReader, FrameWriter};
use dmover_proto::auth::{KeyId, SessionKey, TOKEN_KEY_ID};
use dmover_proto::frame::{EngineParams, FileError, FileMeta, Share, Stats, TicketedHost, TransferOptions, TunerMode};
use dmover_proto::phase::{ListReply, Open, RemoteReport, Reply, Request};
use dmover_proto::{ErrorKind, Msg, Phase};
use std::sync::Arc;
use std::time::Duration;

/// How long a server may take to answer during setup.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// How a client reaches a server other than by a TCP connection to its
/// address: a host reached over ssh carries control connections in its
/// ssh pipe, and data connections inside ssh when a firewall hides its port.
pub trait Dialer: Send + Sync {
    /// A new byte stream to the server at `host`.
    fn dial(&self, host: &str) -> std::io::Result<Box<dyn Transport>>;
    /// Whether the connections reach the server's port over the network, so
    /// that other hosts may too (third-party copies); may try it first.
    fn direct(&self) -> bool {
        false
    }
    /// What a failure to reach `host` and authenticate there says: `e`
    /// itself, unless the dialer must not tell what answered (a server
    /// pushing for a client, which would otherwise learn what listens at
    /// addresses only the server can reach).
    fn unreached(&self, _host: &str, e: Error) -> Error {
        e
    }
}

/// A control connection to a host reached over ssh: a channel of its pipe.
impl Dialer for Mux {
    fn dial(&self, _host: &str) -> std::io::Result<Box<dyn Transport>> {
        Ok(Box::new(self.open()?))
    }
}

/// How to reach a server and prove who we are: the secret (the server's
/// token, or a ticket it issued) and, unless TCP, the way to its port.
#[derive(Clone)]
pub struct Credential {
    pub key_id: KeyId,
    pub secret: Vec<u8>,
    /// How data connections go (None: a TCP connection to the host's address).
    pub via: Option<Arc<dyn Dialer>>,
    /// How control connections go (None: as data connections do).
    pub control: Option<Arc<dyn Dialer>>,
}

impl Credential {
    pub fn token(token: &[u8]) -> Credential {
        Credential { key_id: TOKEN_KEY_ID, secret: token.to_vec(), via: None, control: None }
    }

    /// Whether data connections reach the server over the network, so that
    /// another host can send to it (see [`Dialer::direct`]).
    pub fn direct(&self) -> bool {
        self.via.as_ref().is_none_or(|d| d.direct())
    }
}

/// Reads a token file (surrounding white space is not part of the token),
/// refusing one that group or others can read (as ssh refuses such keys)
/// and one too short to be a token.
pub fn read_token(f: &std::path::Path) -> Result<Vec<u8>> {
    use std::os::unix::fs::PermissionsExt;
    let subject = f.display().to_string();
    let unreadable = |e: std::io::Error| Error::new(ErrorKind::Usage, &subject, format!("cannot read token file: {e}"));
    let mode = std::fs::metadata(f).map_err(unreadable)?.permissions().mode();
    if mode & 0o077 != 0 {
        let msg = format!("token file can be read by group or others (mode {:o})", mode & 0o777);
        return Err(Error::new(ErrorKind::Usage, &subject, msg).advised(format!("run `chmod 600 {subject}`")));
    }
    let s = std::fs::read(f).map_err(unreadable)?;
    let t = String::from_utf8_lossy(&s).trim().as_bytes().to_vec();
    if t.len() < dmover_proto::auth::MIN_TOKEN_LEN {
        let msg = format!("token is too short ({} bytes; at least {})", t.len(), dmover_proto::auth::MIN_TOKEN_LEN);
        return Err(Error::new(ErrorKind::Usage, subject, msg).advised("make one with `dmover token FILE`"));
    }
    Ok(t)
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
        Conn::connect_via(host, cred, cred.via.as_ref(), socket, setup)
    }

    fn connect_via(host: &str, cred: &Credential, via: Option<&Arc<dyn Dialer>>, socket: &SocketOptions, setup: Duration) -> Result<Conn> {
        // Until the handshake has succeeded, what answered is unknown.
        let reach = || {
            let t: Box<dyn Transport> = match via {
                Some(d) => d.dial(host).map_err(|e| Error::network(host, &e))?,
                None => Box::new(connect_tcp(host).map_err(|e| Error::network(host, &e))?),
            };
            t.set_options(socket).map_err(|e| Error::new(ErrorKind::Usage, host, e.to_string()))?;
            t.set_read_timeout(Some(setup)).map_err(|e| Error::network(host, &e))?;
            handshake::client(t, cred.key_id, &cred.secret, socket.protection).map_err(|e| Error { subject: host.to_string(), ..e })
        };
        let a = reach().map_err(|e| match via {
            Some(d) => d.unreached(host, e),
            None => e,
        })?;
        Ok(Conn {
            host: host.to_string(),
            reader: a.reader,
            welcome_pending: true,
            writer: a.writer,
            transport: a.transport,
            session_key: a.session_key,
        })
    }

    /// Reads the next message, of the phase `P` (a server's `Error`
    /// becomes `Err` where `P` has none).
    pub fn read_msg<P: Phase>(&mut self) -> Result<P> {
        let host = &self.host;
        let named = |e: Error| Error { subject: if e.subject.is_empty() { host.clone() } else { e.subject }, ..e };
        if std::mem::take(&mut self.welcome_pending) {
            handshake::expect_welcome(&mut self.reader).map_err(named)?;
        }
        self.reader.read_msg().map_err(named)
    }

    /// Sends a request and reads the answer. A server that refused the
    /// connection before reading it (busy: over its `--max-connections`)
    /// said why and closed: its answer, not the broken pipe, is what the
    /// request gets.
    pub fn request<P: Phase>(&mut self, m: impl Into<Msg>) -> Result<P> {
        if let Err(e) = self.writer.send(m) {
            return self.read_msg().map_err(|_| e);
        }
        self.read_msg()
    }

    pub fn send(&mut self, m: impl Into<Msg>) -> Result<()> {
        self.writer.send(m)
    }

    /// Hands over the sealed transport. Nothing is buffered: the server
    /// sends each answer during setup in a record of its own, and what
    /// follows (a sending session's first messages) in later ones. The
    /// welcome must have been read.
    pub fn into_transport(self) -> Box<dyn Transport> {
        debug_assert!(!self.welcome_pending);
        let _ = self.transport.set_read_timeout(None);
        self.transport
    }

    /// Opens a control connection.
    pub fn control(host: &str, cred: &Credential) -> Result<Conn> {
        let via = cred.control.as_ref().or(cred.via.as_ref());
        let mut c = Conn::connect_via(host, cred, via, &SocketOptions::default(), SETUP_TIMEOUT)?;
        c.send(Open::OpenControl {})?;
        Ok(c)
    }
}

/// The session a request opened.
pub fn expect_session(host: &str, m: Reply) -> Result<[u8; 16]> {
    match m {
        Reply::SessionOpened { session } => Ok(session),
        Reply::Ticket { .. } | Reply::Renewed { .. } => Err(Error::protocol(host, "expected a session")),
        Reply::Error { kind, message } => Err(Error::new(kind, host, message)),
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

/// Attaches started connections to `session` in the background, while
/// the transfer starts: all requests go out before any answer is awaited,
/// and `deliver` is given each connection once the server confirms it —
/// or the first error, after which it hears nothing more.
fn attach_streams(
    started: std::thread::JoinHandle<Result<Vec<Conn>>>,
    session: [u8; 16],
    mut deliver: impl FnMut(Result<Box<dyn Transport>>) + Send + 'static,
) {
    std::thread::spawn(move || {
        let attached = (|| {
            let mut conns = started.join().unwrap_or_else(|_| Err(Error::internal("connection thread panicked")))?;
            for (i, c) in conns.iter_mut().enumerate() {
                // One that cannot be sent is heard below: the server's
                // refusal (busy), or the connection's end.
                let _ = c.send(Open::OpenData { session, index: i as u32 });
            }
            for mut c in conns {
                let m = c.read_msg()?;
                expect_session(&c.host, m)?;
                deliver(Ok(c.into_transport()));
            }
            Ok(())
        })();
        if let Err(e) = attached {
            deliver(Err(e));
        }
    });
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
    let m = c.request(Request::Receive { dest: dest.to_string(), options })?;
    let session = expect_session(host, m)?;
    // The first announcements go out while the data connections attach.
    let (attached, conns) = crossbeam_channel::unbounded();
    attach_streams(started, session, move |c| drop(attached.send(c)));
    let more = MoreStreams::Connect(joiner(host, cred, socket, session));
    Ok(HostLink {
        name: host.to_string(),
        control: c.into_transport(),
        data: Vec::new(),
        attaching: Some(Attaching { count: streams, conns }),
        more: Some(more),
    })
}

/// Opens one more data connection to `host` and attaches it to `session`
/// (a stream a tuner adds, at whichever end dials).
fn joiner(host: &str, cred: &Credential, socket: &SocketOptions, session: [u8; 16]) -> Connector {
    let (name, cred, socket) = (host.to_string(), cred.clone(), socket.clone());
    Arc::new(move || {
        let mut c = Conn::open_with(&name, &cred, &socket)?;
        c.send(Open::OpenData { session, index: 0 })?;
        let m = c.read_msg()?;
        expect_session(&name, m)?;
        Ok(c.into_transport())
    })
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

/// A ticket a server issued for a third party to receive into it.
pub struct Ticket {
    pub host: String,
    pub key_id: KeyId,
    pub secret: [u8; 32],
    /// How long it lives unless renewed.
    pub lifetime: Duration,
}

/// Asks `host` for a ticket to receive into `dest`, for a third party.
pub fn grant(host: &str, cred: &Credential, dest: &str) -> Result<Ticket> {
    let mut c = Conn::control(host, cred)?;
    match c.request(Request::Grant { dest: dest.to_string() })? {
        Reply::Ticket { key_id, wrapped_secret, lifetime } => Ok(Ticket {
            host: host.to_string(),
            key_id,
            secret: c.session_key.wrap(&key_id, &wrapped_secret),
            lifetime: Duration::from_secs(lifetime.into()),
        }),
        Reply::Error { kind, message } => Err(Error::new(kind, host, message)),
        _ => Err(Error::protocol(host, "expected a ticket")),
    }
}

/// Extends a ticket's life (and that of the session it opened) at its
/// server, as the holder of `cred` that asked for it.
fn renew(t: &Ticket, cred: &Credential) -> Result<()> {
    let mut c = Conn::control(&t.host, cred)?;
    match c.request(Request::Renew { key_id: t.key_id })? {
        Reply::Renewed { .. } => Ok(()),
        Reply::Error { kind, message } => Err(Error::new(kind, &t.host, message)),
        _ => Err(Error::protocol(&t.host, "expected a renewed ticket")),
    }
}

/// Keeps the tickets of a third-party copy alive while it runs, renewing
/// each at its server three times per lifetime, until dropped.
struct Renewer {
    /// Dropped to stop; the renewing thread waits on the other end.
    _stop: crossbeam_channel::Sender<()>,
}

impl Renewer {
    /// Renews each ticket with the credential that got it.
    fn start(tickets: Vec<(Ticket, Credential)>) -> Renewer {
        let (stop, stopped) = crossbeam_channel::bounded::<()>(0);
        // A lifetime is the server's word: however short it says, renew at
        // most five times a second.
        let every = tickets.iter().map(|(t, _)| (t.lifetime / 3).max(Duration::from_millis(200))).min().unwrap_or(Duration::MAX);
        std::thread::spawn(move || {
            while stopped.recv_timeout(every) == Err(crossbeam_channel::RecvTimeoutError::Timeout) {
                for (t, cred) in &tickets {
                    // A failed renewal is tried again next time; if the
                    // ticket expires meanwhile, its session ends and the
                    // copy is retried with new tickets.
                    if let Err(e) = renew(t, cred) {
                        log::warn!("renewing a ticket: {e}");
                    }
                }
            }
        });
        Renewer { _stop: stop }
    }
}

/// What a server sends while it works for a client (a download's sender,
/// a push): progress, then its report. Progress goes to `progress`.
fn remote_report(mut read: impl FnMut() -> Result<RemoteReport>, host: &str, progress: &Progress) -> Result<Stats> {
    loop {
        match read()? {
            RemoteReport::Progress { files, bytes, total_files, total_bytes, walk_done } => {
                progress.set(&Snapshot { total_files, total_bytes, walk_done, done_files: files, done_bytes: bytes, ..Snapshot::default() })
            }
            RemoteReport::Report { stats } => return Ok(stats),
            RemoteReport::Ping {} => {}
            RemoteReport::Error { kind, message } => return Err(Error::new(kind, host, message)),
        }
    }
}

/// One attempt at a download: asks `host` to send `sources` (specs below
/// its exports) over `params.streams` data connections, and receives them
/// with a receiving end prepared from `cfg`. With a tuner in `params` the
/// server tunes its streams, and this end dials each one it asks for.
/// Returns the server's report, each host share named by `host`.
pub fn download(
    host: &str,
    cred: &Credential,
    sources: Vec<String>,
    params: EngineParams,
    socket: &SocketOptions,
    cfg: RecvConfig,
    progress: &Progress,
) -> Result<Stats> {
    let options = cfg.options;
    let prepared = recv::prepare(cfg)?;
    let started = start_streams(host, cred, params.streams as usize, socket);
    let mut c = Conn::control(host, cred)?;
    let session = expect_session(host, c.request(Request::Send { sources, options, params })?)?;
    let prepared = match params.tuner {
        TunerMode::Fixed => prepared,
        _ => prepared.dialing(joiner(host, cred, socket, session)),
    };
    let control = c.into_transport();
    let after = control.split().map_err(|e| Error::network(host, &e))?;
    // The server starts sending at once: its first announcements and this
    // end's plans cross while the data connections attach. If none can,
    // the attempt ends (closing the control connection stops the receiving
    // end), with the reason. Once one has, the control connection's word
    // settles the transfer: a small one can be over before the others
    // attach, and the server refuses those as late.
    let refused = Arc::new(std::sync::Mutex::new(None));
    let (tx, rx) = crossbeam_channel::unbounded();
    {
        let (refused, stop) = (refused.clone(), control.split().map_err(|e| Error::network(host, &e))?);
        let mut attached = false;
        attach_streams(started, session, move |c| match c {
            Ok(t) => {
                attached = true;
                drop(tx.send(t))
            }
            Err(e) if attached => log::debug!("a data connection did not attach: {e}"),
            Err(e) => {
                *refused.lock().expect("refusal lock") = Some(e);
                stop.close();
            }
        });
    }
    let summary = prepared.run(control, rx);
    // The sender's report follows its `Finish` (and pings, which it may
    // still send until then).
    let mut r = FrameReader::new(after);
    let report = remote_report(|| r.read_msg(), host, progress);
    if summary.is_err() || report.is_err() {
        // Why no data connection attached, rather than what closing the
        // control connection then caused.
        if let Some(e) = refused.lock().expect("refusal lock").take() {
            return Err(e);
        }
    }
    let here = summary?;
    let mut s = report?;
    // The report is the server's word; what arrived here, and what this
    // end refused, is known here: a server cannot make a copy look whole.
    s.dest_files = here.files;
    s.dest_bytes = here.bytes;
    if let Some(left_out) = here.failed.checked_sub(s.errors.len() as u64).filter(|n| *n > 0) {
        s.errors.push(FileError {
            path: host.to_string(),
            kind: ErrorKind::Refused,
            message: format!("{left_out} file(s) refused or failed here are missing from the server's report"),
        });
    }
    progress.set(&Snapshot {
        total_files: s.files,
        total_bytes: s.bytes,
        walk_done: true,
        done_files: s.dest_files,
        done_bytes: s.dest_bytes,
        skipped_files: s.skipped_files,
        skipped_bytes: s.skipped_bytes,
        sent_bytes: s.sent_bytes,
        streams: 0,
    });
    let hosts = s.hosts.into_iter().map(|h| Share { name: host.to_string(), ..h }).collect();
    Ok(Stats { hosts, ..s })
}

/// One attempt at a third-party copy: gets a ticket for `dest` from each
/// destination host and asks the source host `src` to send `sources`
/// there, following its progress and renewing the tickets while it runs.
/// Returns the source server's report.
pub fn push(
    src: &(String, Credential),
    dests: &[(String, Credential)],
    sources: Vec<String>,
    dest: &str,
    options: TransferOptions,
    params: EngineParams,
    progress: &Progress,
) -> Result<Stats> {
    let tickets = dests.iter().map(|(h, cred)| Ok((grant(h, cred, dest)?, cred.clone()))).collect::<Result<Vec<_>>>()?;
    let mut c = Conn::control(&src.0, &src.1)?;
    let hosts = tickets
        .iter()
        .map(|(t, _)| TicketedHost { addr: t.host.clone(), key_id: t.key_id, wrapped_secret: c.session_key.wrap(&t.key_id, &t.secret) })
        .collect();
    c.send(Request::Push { sources, dest: dest.to_string(), hosts, options, params })?;
    let _renewer = Renewer::start(tickets);
    remote_report(|| c.read_msg(), &src.0, progress)
}

/// Lists what `path` (a file, directory or glob below an export) names on
/// `host`, handing each batch of entries to `emit` as it arrives.
pub fn list(host: &str, cred: &Credential, path: String, emit: &mut dyn FnMut(Vec<FileMeta>)) -> Result<()> {
    let mut c = Conn::control(host, cred)?;
    c.send(Request::List { path })?;
    loop {
        match c.read_msg::<ListReply>()? {
            ListReply::Listing { entries, done } => {
                emit(entries);
                if done {
                    return Ok(());
                }
            }
            ListReply::Error { kind, message } => return Err(Error::new(kind, host, message)),
        }
    }
}
