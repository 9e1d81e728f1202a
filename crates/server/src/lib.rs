//! The dmover server: accepts connections, authenticates them, and serves
//! the requests of each: list, receive files, send files, issue tickets and
//! push files to other servers (third-party transfers); and, as a sink
//! ([`sink`]), streams from running simulations.
//!
//! [`run`] owns the accept loop; each connection gets a thread. A connection
//! is either a control connection (requests, and at most one transfer
//! session) or a data connection that attaches to a session by its id.
//! Every path is confined to its export by [`dmover_engine::storage`].
//! Shutdown is one [`Shutdown`] handle: the loop stops accepting, waits up to
//! the grace period for running connections, then returns.

pub mod metrics;
pub mod push_to;
pub mod sink;
mod throttle;
mod tickets;

use dmover_engine::error::{Error, Result};
use dmover_engine::handshake::{self, random};
use dmover_engine::progress::Progress;
use dmover_engine::recv::{self, RecvConfig, WriteErrors};
use dmover_engine::send::{self, Attaching, Files, HostLink, MoreStreams, SendConfig};
use dmover_engine::session::{self, Credential, Dialer};
use dmover_engine::storage::{self, Store};
use dmover_engine::transport::{SocketOptions, Transport};
use dmover_engine::wire::{FrameReader, FrameWriter};
use dmover_proto::auth::{self, KeyId, TOKEN_KEY_ID};
use dmover_proto::frame::{EngineParams, Stats, TicketedHost, TransferOptions, TunerMode};
use dmover_proto::phase::{ListReply, Open, RemoteReport, Reply, Request};
use dmover_proto::ErrorKind;
use metrics::{Kind, Metrics, Outcome};
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use throttle::Throttle;
use tickets::Tickets;
pub use tickets::TICKET_LIFETIME;

/// The server's settings.
#[derive(Clone)]
pub struct Config {
    pub exports: HashMap<String, Store>,
    /// Exports whose clients may set owners and groups, and extended
    /// attributes outside `user.*` (`--allow-owners`).
    pub allow_owners: HashSet<String>,
    pub token: Vec<u8>,
    pub max_connections: usize,
    /// A control connection silent this long is closed.
    pub idle_timeout: Duration,
    /// How long running transfers may go on after a shutdown request.
    pub grace: Duration,
    /// Staging memory of each receiving session.
    pub staging: u64,
    /// Disk writer threads of each receiving session.
    pub writers: usize,
    /// Accept streams from producers (`dmover sink`); `None` refuses them.
    pub sink: Option<Arc<sink::SinkConfig>>,
    /// How long a ticket (and the session it opens) lives unless renewed.
    pub ticket_lifetime: Duration,
    /// Where pushes (third-party copies) may go.
    pub push_to: push_to::PushTo,
    /// What the server counts (see [`metrics`]).
    pub metrics: Arc<Metrics>,
}

/// Time a client has to authenticate, however its bytes are spread over it.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections that may be authenticating at once. They do not count
/// against `max_connections`, which is for authenticated connections only;
/// when this budget is full, the oldest of them is closed to make room for
/// a new one (an honest handshake takes one round trip, so connections
/// that hold it open cannot keep others out).
const MAX_HANDSHAKES: usize = 256;
/// Connections from one address that may be authenticating at once; a new
/// one beyond it closes the oldest from the same address.
const MAX_HANDSHAKES_PER_ADDR: usize = 128;
/// Data connections one request may have this server hold or open, in all
/// (a `Send`'s streams; a `Push`'s hosts times its streams per host; those
/// attached to one session at once).
const MAX_STREAMS: u64 = 64;
/// How long a data connection may wait for its session to appear.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
/// Tickets one control connection may ask for (a client asks for one per
/// connection); beyond, `Grant` is refused.
const MAX_GRANTS_PER_CONNECTION: usize = 16;
/// How often a third-party copy tells its client how far it got.
const PUSH_PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// Asks a running server to stop; cheap to clone, usable from a signal thread.
#[derive(Clone)]
pub struct Shutdown {
    tx: Arc<UnixStream>,
}

/// The server's end of a [`Shutdown`].
pub struct ShutdownSignal {
    rx: UnixStream,
}

/// A new shutdown handle and the signal `run` watches.
pub fn shutdown_pair() -> std::io::Result<(Shutdown, ShutdownSignal)> {
    let (a, b) = UnixStream::pair()?;
    Ok((Shutdown { tx: Arc::new(a) }, ShutdownSignal { rx: b }))
}

impl Shutdown {
    pub fn trigger(&self) {
        let _ = (&*self.tx).write(&[1]);
    }
}

/// A session's attachment point: data connections for it are sent here.
type Attach = crossbeam_channel::Sender<Box<dyn Transport>>;

/// A transfer session as data connections find it: open, or ended (kept
/// for [`ATTACH_TIMEOUT`], so that a connection that comes too late, such as
/// a stream the client's tuner added as the transfer finished, is refused
/// at once instead of waiting for a session that will not appear).
enum Slot {
    /// Open, with the key id of the credential that opened it (only
    /// connections authenticated by the same credential may join) and the
    /// count of data connections it holds (see [`Held`]).
    Open(Attach, KeyId, Arc<AtomicUsize>),
    Ended(Instant),
}

/// A data connection a session holds, counted in its slot until the
/// session drops it (its stream ended), so that a session holds at most
/// [`MAX_STREAMS`] at once: each costs the session a thread. Handles split
/// from it (a session keeps one to close the connection when it ends) are
/// not counted.
struct Held {
    inner: Box<dyn Transport>,
    count: Arc<AtomicUsize>,
}

impl Held {
    /// `t`, counted in `count`, or `t` back if the session holds its most.
    fn take(t: Box<dyn Transport>, count: &Arc<AtomicUsize>) -> std::result::Result<Held, Box<dyn Transport>> {
        let most = MAX_STREAMS as usize;
        match count.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < most).then_some(n + 1)) {
            Ok(_) => Ok(Held { inner: t, count: count.clone() }),
            Err(_) => Err(t),
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Read for Held {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.inner.read(buf)
    }
}

impl Write for Held {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf)
    }
    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        self.inner.write_vectored(bufs)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl Transport for Held {
    fn split(&self) -> std::io::Result<Box<dyn Transport>> {
        self.inner.split()
    }
    fn close(&self) {
        self.inner.close()
    }
    fn close_write(&self) {
        self.inner.close_write()
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.inner.set_read_timeout(t)
    }
    fn peer(&self) -> String {
        self.inner.peer()
    }
    fn set_options(&self, o: &SocketOptions) -> std::io::Result<()> {
        self.inner.set_options(o)
    }
    fn send_window(&self) -> u64 {
        self.inner.send_window()
    }
    fn write_consuming(&mut self, head: &[u8], data: &mut [u8]) -> std::io::Result<()> {
        self.inner.write_consuming(head, data)
    }
}

struct Server {
    cfg: Config,
    /// Open transfer sessions by id; control threads insert and remove, data connections look up.
    sessions: Mutex<HashMap<[u8; 16], Slot>>,
    tickets: Tickets,
    /// Authenticated connections being served.
    active: AtomicUsize,
    /// Connections still authenticating, oldest first.
    handshakes: Mutex<VecDeque<Handshaking>>,
    /// The log lines about connections refused before they authenticated.
    throttle: Throttle,
}

/// Serves connections from `listener`, and those `carried` hands over
/// (the control connections a client's ssh pipe carries to `dmover
/// remote`), until `shutdown` fires; then waits up to the grace period for
/// running connections.
pub fn run(
    listener: TcpListener,
    cfg: Config,
    shutdown: ShutdownSignal,
    carried: Option<crossbeam_channel::Receiver<Box<dyn Transport>>>,
) -> std::io::Result<()> {
    // Every export's count is on the metrics page from the start.
    for name in cfg.exports.keys() {
        cfg.metrics.write_errors(name);
    }
    let srv = Arc::new(Server {
        tickets: Tickets::new(cfg.ticket_lifetime),
        cfg,
        sessions: Mutex::new(HashMap::new()),
        active: AtomicUsize::new(0),
        handshakes: Mutex::new(VecDeque::new()),
        throttle: Throttle::default(),
    });
    if let Some(carried) = carried {
        // The pipe bounds its channels; they are not counted among the
        // network's connections that are authenticating.
        let srv = srv.clone();
        std::thread::spawn(move || {
            for t in carried {
                let handshake = HandshakeGuard { srv: srv.clone(), id: 0 };
                std::thread::spawn(move || serve_logged(&handshake, t));
            }
        });
    }
    let mut next_id = 0u64;
    let mut fds = [
        libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: shutdown.rx.as_raw_fd(), events: libc::POLLIN, revents: 0 },
    ];
    loop {
        // Woken at least once a second, to summarise refusals held back.
        srv.throttle.summarise();
        // SAFETY: `fds` is a valid array of two pollfd for the duration of the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, throttle::EVERY.as_millis() as i32) };
        if r == 0 {
            continue;
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            let _ = (&shutdown.rx).read(&mut [0u8; 8]);
            break;
        }
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) => {
                log::warn!("accept failed: {e}");
                continue;
            }
        };
        next_id += 1;
        match stream.try_clone() {
            Ok(c) => srv.admit(next_id, peer.ip(), Box::new(c)),
            Err(e) => {
                log::warn!("cannot serve {peer}: {e}");
                continue;
            }
        }
        let _ = stream.set_nodelay(true);
        let handshake = HandshakeGuard { srv: srv.clone(), id: next_id };
        std::thread::spawn(move || serve_logged(&handshake, Box::new(stream)));
    }
    log::info!("shutting down: waiting up to {:?} for {} connection(s)", srv.cfg.grace, srv.active.load(Ordering::SeqCst));
    let deadline = Instant::now() + srv.cfg.grace;
    while srv.active.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A connection that has not authenticated yet.
struct Handshaking {
    id: u64,
    addr: IpAddr,
    since: Instant,
    /// To close it when it must make room.
    conn: Box<dyn Transport>,
}

impl Server {
    /// Counts a new connection among those authenticating, within
    /// [`MAX_HANDSHAKES`] and [`MAX_HANDSHAKES_PER_ADDR`]: when a budget is
    /// full, its oldest connection is closed.
    fn admit(&self, id: u64, addr: IpAddr, conn: Box<dyn Transport>) {
        let mut hs = self.handshakes.lock().expect("handshakes lock");
        let per_addr = hs.iter().filter(|h| h.addr == addr).count() >= MAX_HANDSHAKES_PER_ADDR;
        if per_addr || hs.len() >= MAX_HANDSHAKES {
            let budget = if per_addr {
                format!("{MAX_HANDSHAKES_PER_ADDR} connections from {addr} are authenticating")
            } else {
                format!("{MAX_HANDSHAKES} connections are authenticating")
            };
            if let Some(old) = hs.iter().position(|h| !per_addr || h.addr == addr).and_then(|i| hs.remove(i)) {
                let line = format!("closed {}: not authenticated after {:?}, and {budget}", old.conn.peer(), old.since.elapsed());
                self.throttle.log(log::Level::Warn, "closed to make room for new ones", line);
                old.conn.close();
            }
        }
        hs.push_back(Handshaking { id, addr, since: Instant::now(), conn });
    }
}

/// A connection's place among those authenticating, given up when it has
/// authenticated or failed to (or its thread panicked).
struct HandshakeGuard {
    srv: Arc<Server>,
    /// Its number among those authenticating (0: not counted there).
    id: u64,
}

impl Drop for HandshakeGuard {
    fn drop(&mut self) {
        self.srv.handshakes.lock().expect("handshakes lock").retain(|h| h.id != self.id);
    }
}

/// An authenticated connection's place in [`Server::active`], given back
/// when dropped, so that a connection thread that panics does not keep it.
struct ConnectionSlot<'a>(&'a Server);

impl ConnectionSlot<'_> {
    /// A place, if fewer than `max_connections` are taken.
    fn take(srv: &Server) -> Option<ConnectionSlot<'_>> {
        let max = srv.cfg.max_connections;
        srv.active.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < max).then_some(n + 1)).ok().map(|_| ConnectionSlot(srv))
    }
}

impl Drop for ConnectionSlot<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            log::error!("a connection thread panicked; its connection slot is released");
        }
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a connection may do, by how it authenticated.
enum Grant {
    Token,
    /// A ticket (its key id): receive into this export path only, in one
    /// session only.
    Ticket(KeyId, String),
    /// A producer's credential (its key id): stream under the name it was
    /// made for, nothing else.
    Producer(KeyId),
}

impl Grant {
    fn key_id(&self) -> KeyId {
        match self {
            Grant::Token => TOKEN_KEY_ID,
            Grant::Ticket(id, _) | Grant::Producer(id) => *id,
        }
    }
}

/// Closes a connection that has not authenticated by a deadline.
/// A read timeout alone does not do: it starts again with every byte, so a
/// client trickling its handshake a byte at a time would hold a connection
/// slot for as long as it liked.
struct Watchdog {
    /// Dropped to disarm; the watchdog thread waits on the other end.
    disarm: Option<crossbeam_channel::Sender<()>>,
    thread: std::thread::JoinHandle<bool>,
}

impl Watchdog {
    fn arm(t: Box<dyn Transport>, limit: Duration) -> Watchdog {
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        let thread = std::thread::spawn(move || {
            let fired = matches!(rx.recv_timeout(limit), Err(crossbeam_channel::RecvTimeoutError::Timeout));
            if fired {
                t.close();
            }
            fired
        });
        Watchdog { disarm: Some(tx), thread }
    }

    /// Stops the watchdog; true if it had already closed the connection.
    fn disarm(mut self) -> bool {
        drop(self.disarm.take());
        self.thread.join().unwrap_or(true)
    }
}

/// Serves one connection, and logs how it ended.
fn serve_logged(handshake: &HandshakeGuard, t: Box<dyn Transport>) {
    let peer = t.peer();
    match serve(handshake, t) {
        Err(e) if matches!(e.kind, ErrorKind::Auth | ErrorKind::Refused) => log::warn!("refused {peer}: {}", e.message),
        Err(e) => log::warn!("{e}"),
        Ok(()) => {}
    }
}

/// Serves one connection. A connection refused before it is served (not
/// authenticated, or beyond `--max-connections`) is logged here, through
/// the [`Throttle`]; an error once it is served is returned.
fn serve(handshake: &HandshakeGuard, t: Box<dyn Transport>) -> Result<()> {
    let srv = &handshake.srv;
    let peer = t.peer();
    let refused = |outcome: Outcome, cause: &'static str, level: log::Level, why: &str| {
        srv.cfg.metrics.connection(outcome);
        srv.throttle.log(level, cause, format!("refused {peer}: {why}"));
    };
    let net = |e: std::io::Error| Error::network(&peer, &e);
    let watchdog = Watchdog::arm(t.split().map_err(net)?, HANDSHAKE_TIMEOUT);
    let authenticated = handshake::server(t, |id| Some(secret(srv, id)));
    if watchdog.disarm() {
        let why = format!("did not authenticate within {} s", HANDSHAKE_TIMEOUT.as_secs());
        refused(Outcome::Timeout, "refused: not authenticated in time", log::Level::Warn, &why);
        return Ok(());
    }
    srv.handshakes.lock().expect("handshakes lock").retain(|h| h.id != handshake.id);
    let (key_id, a) = match authenticated {
        // A client that went away during the handshake (killed, or giving
        // up on a connection it no longer needs) is not a refusal.
        Err(e) if e.kind == ErrorKind::Unreachable => {
            srv.throttle.log(log::Level::Info, "gone during the handshake", e.to_string());
            return Ok(());
        }
        Err(e) if e.kind == ErrorKind::Auth => {
            refused(Outcome::BadCredential, "refused: no credential this server knows", log::Level::Warn, &e.message);
            return Ok(());
        }
        Err(e) => {
            refused(Outcome::Malformed, "refused: not the handshake", log::Level::Warn, &e.message);
            return Ok(());
        }
        Ok(a) => a,
    };
    let (t, mut r, mut w, skey) = (a.transport, a.reader, a.writer, a.session_key);
    let Some(_slot) = ConnectionSlot::take(srv) else {
        let _ = w.send(Reply::Error { kind: ErrorKind::Unreachable, message: "server busy: too many connections".into() });
        let why = format!("too many connections (--max-connections {})", srv.cfg.max_connections);
        refused(Outcome::Busy, "refused: over --max-connections", log::Level::Warn, &why);
        return Ok(());
    };
    srv.cfg.metrics.connection(Outcome::Authenticated);
    // An authenticated client may take a while to say what the connection
    // is for (a data connection waits for its session to be set up).
    t.set_read_timeout(Some(srv.cfg.idle_timeout)).map_err(net)?;
    let grant = match srv.tickets.dest(&key_id) {
        _ if key_id == TOKEN_KEY_ID => Grant::Token,
        Some(dest) => Grant::Ticket(key_id, dest),
        None => Grant::Producer(key_id),
    };
    let first = match r.read_msg::<Open>() {
        Ok(m) => m,
        // A client that only checks that it can connect and authenticate
        // (`dmover submit` checking a job's destinations) hangs up here.
        Err(e) if e.kind == ErrorKind::Unreachable => {
            log::debug!("{peer}: authenticated, then closed without a request ({})", e.message);
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    match first {
        Open::OpenControl {} => control(srv, t, r, w, &grant, &skey),
        Open::OpenData { session, .. } => attach(srv, t, w, session, &grant),
    }
}

/// The secret a client authenticating with key id `id` must know: the
/// token, a ticket's, or else a producer's, derived from the token. (A
/// producer's connection may only stream, which a server that is not a
/// sink refuses, saying so.)
fn secret(srv: &Server, id: &KeyId) -> Vec<u8> {
    if *id == TOKEN_KEY_ID {
        return srv.cfg.token.clone();
    }
    srv.tickets.secret(id).unwrap_or_else(|| auth::producer_secret(&srv.cfg.token, id).to_vec())
}

fn refuse(srv: &Server, w: &mut FrameWriter, e: &Error) -> Result<()> {
    log::warn!("refused: {e}");
    srv.cfg.metrics.refused_request();
    let message = match &e.advice {
        Some(advice) => format!("{e}; {advice}"),
        None => e.to_string(),
    };
    w.send(Reply::Error { kind: e.kind, message })
}

/// Hands a data connection to its session.
fn attach(srv: &Server, t: Box<dyn Transport>, mut w: FrameWriter, session: [u8; 16], grant: &Grant) -> Result<()> {
    if let Grant::Ticket(id, _) = grant {
        if srv.tickets.session(id) != Some(session) {
            return refuse(
                srv,
                &mut w,
                &Error::new(ErrorKind::Refused, t.peer(), "a ticket's connections may join only the session it opened"),
            );
        }
    }
    let deadline = Instant::now() + ATTACH_TIMEOUT;
    loop {
        let tx = match srv.sessions.lock().expect("sessions lock").get(&session) {
            Some(Slot::Open(_, opener, _)) if *opener != grant.key_id() => {
                let e = Error::new(ErrorKind::Refused, t.peer(), "a connection may join only a session opened with the same credential");
                return refuse(srv, &mut w, &e);
            }
            Some(Slot::Open(tx, _, held)) => Some((tx.clone(), held.clone())),
            Some(Slot::Ended(_)) => return refuse(srv, &mut w, &Error::new(ErrorKind::Refused, t.peer(), "the session has ended")),
            None => None,
        };
        if let Some((tx, held)) = tx {
            let t = match Held::take(t, &held) {
                Ok(t) => t,
                Err(t) => {
                    let message = format!(
                        "the session holds {MAX_STREAMS} data connections already, the most one session may hold at once: \
                         end one (StreamEnd) before attaching another"
                    );
                    return refuse(srv, &mut w, &Error::new(ErrorKind::Usage, t.peer(), message));
                }
            };
            // Confirm first, then hand the connection over: a sending
            // session may write on it at once (a stream a download's tuner
            // asked for), and nothing may come before the confirmation.
            let _ = t.set_read_timeout(None);
            w.send(Reply::SessionOpened { session })?;
            let _ = tx.send(Box::new(t));
            return Ok(());
        }
        if Instant::now() > deadline {
            return refuse(srv, &mut w, &Error::new(ErrorKind::Refused, t.peer(), "no such session"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Ends the session a ticket opened when the ticket expires unrenewed, by
/// closing the session's control connection; when dropped (the session
/// has ended), stops watching and forgets the ticket.
struct EndAtExpiry {
    /// Dropped to stop; the watching thread waits on the other end.
    _stop: crossbeam_channel::Sender<()>,
    srv: Arc<Server>,
    id: KeyId,
}

impl Drop for EndAtExpiry {
    fn drop(&mut self) {
        self.srv.tickets.end(&self.id);
    }
}

impl EndAtExpiry {
    fn watch(srv: &Arc<Server>, id: KeyId, control: Box<dyn Transport>) -> EndAtExpiry {
        let (stop, stopped) = crossbeam_channel::bounded::<()>(0);
        let watching = srv.clone();
        std::thread::spawn(move || loop {
            let Some(left) = watching.tickets.left(&id) else {
                log::warn!("{}: its ticket expired without being renewed: the session it opened ends", control.peer());
                control.close();
                return;
            };
            if stopped.recv_timeout(left) != Err(crossbeam_channel::RecvTimeoutError::Timeout) {
                return;
            }
        });
        EndAtExpiry { _stop: stop, srv: srv.clone(), id }
    }
}

/// Splits `EXPORT/rest` into the export's root and the rest.
fn locate<'a>(srv: &'a Server, path: &'a str) -> Result<(&'a Store, &'a str)> {
    let (name, rest) = path.split_once('/').unwrap_or((path, ""));
    match srv.cfg.exports.get(name) {
        Some(root) => Ok((root, rest)),
        None => Err(Error::new(ErrorKind::Refused, path, format!("no export named '{name}' on this server"))),
    }
}

struct SessionGuard<'a> {
    srv: &'a Server,
    id: [u8; 16],
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        self.srv.sessions.lock().expect("sessions lock").insert(self.id, Slot::Ended(Instant::now()));
    }
}

fn open_session<'a>(srv: &'a Server, grant: &Grant) -> (SessionGuard<'a>, crossbeam_channel::Receiver<Box<dyn Transport>>) {
    let id: [u8; 16] = random();
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut sessions = srv.sessions.lock().expect("sessions lock");
    sessions.retain(|_, slot| !matches!(slot, Slot::Ended(at) if at.elapsed() > ATTACH_TIMEOUT));
    sessions.insert(id, Slot::Open(tx, grant.key_id(), Arc::default()));
    drop(sessions);
    (SessionGuard { srv, id }, rx)
}

/// What a request leads to, once it has been checked.
enum Action {
    /// Answer and wait for the next request.
    Reply(Reply),
    /// Become the receiving end of a transfer into `dest` below `root`.
    Receive {
        root: Store,
        dest: String,
        options: TransferOptions,
        /// The export's count of files that failed on its storage.
        write_errors: Arc<WriteErrors>,
        /// The export lets clients set owners (`--allow-owners`).
        privileged: bool,
    },
    /// Become the sending end of a transfer to this client.
    Send {
        root: Store,
        specs: Vec<String>,
        options: TransferOptions,
        params: EngineParams,
    },
    /// Stream a listing of what `spec` names.
    List {
        root: Store,
        spec: String,
    },
    /// Send to other servers on this client's behalf, each host reached
    /// by its dialer (at the addresses `--push-to` allows).
    Push {
        root: Store,
        specs: Vec<String>,
        dest: String,
        hosts: Vec<(TicketedHost, Arc<dyn Dialer>)>,
        options: TransferOptions,
        params: EngineParams,
    },
    /// Take a producer's stream.
    Stream {
        sink: Arc<sink::SinkConfig>,
        producer: String,
        dir: std::path::PathBuf,
        block_size: u32,
    },
    Nothing,
}

/// Checks a request; an error here is a refusal the client is told about.
/// `granted` counts the tickets given on this connection so far.
fn prepare(srv: &Server, m: Request, grant: &Grant, skey: &dmover_proto::auth::SessionKey, granted: &mut usize) -> Result<Action> {
    if let Grant::Ticket(id, dest) = grant {
        if srv.tickets.session(id).is_some() {
            return Err(Error::new(
                ErrorKind::Refused,
                dest.clone(),
                "this ticket has opened its session already (a ticket is used once): ask its server for a new one",
            ));
        }
        if !matches!(&m, Request::Receive { dest: d, .. } if d == dest) {
            return Err(Error::new(ErrorKind::Refused, dest.clone(), "a ticket only allows receiving into its destination"));
        }
    }
    if let Grant::Producer(id) = grant {
        match &m {
            Request::Stream { producer, .. } if auth::producer_key_id(producer) != *id => {
                let msg = "this credential was made for another producer name (`dmover token --producer NAME`)";
                return Err(Error::new(ErrorKind::Refused, producer, msg));
            }
            Request::Stream { .. } | Request::Ping {} => {}
            _ => return Err(Error::new(ErrorKind::Refused, "", "a producer's credential allows streaming to this sink only")),
        }
    }
    Ok(match m {
        Request::Receive { dest, options } => {
            blocks_fit(srv, options.block_size, 0)?;
            let (root, rest) = locate(srv, &dest)?;
            storage::checked_path(root.as_ref(), rest)?;
            // An export's name (it was found above): a bounded label.
            let export = dest.split('/').next().unwrap_or_default();
            let privileged = srv.cfg.allow_owners.contains(export);
            Action::Receive {
                root: root.clone(),
                dest: rest.to_string(),
                options,
                write_errors: srv.cfg.metrics.write_errors(export),
                privileged,
            }
        }
        Request::Send { sources, options, params } => {
            if params.streams == 0 {
                return Err(Error::new(ErrorKind::Usage, "", "a download needs at least one data connection"));
            }
            let params = limit(srv, options.block_size, params.streams as u64, params)?;
            let (root, specs) = resolve_sources(srv, &sources)?;
            Action::Send { root, specs, options, params }
        }
        Request::Grant { dest } => {
            if *granted >= MAX_GRANTS_PER_CONNECTION {
                let message = format!(
                    "{granted} tickets were given on this connection already, the most one connection may ask for: ask for more on another"
                );
                return Err(Error::new(ErrorKind::Refused, dest, message));
            }
            let (root, rest) = locate(srv, &dest)?;
            storage::checked_path(root.as_ref(), rest)?;
            let Some((key_id, secret)) = srv.tickets.issue(&dest) else {
                let message = format!(
                    "this server holds {} live tickets, the most it issues: try again once third-party copies into it have ended \
                     or their unused tickets expired ({} s after issue)",
                    tickets::MAX_TICKETS,
                    srv.tickets.lifetime().as_secs()
                );
                return Err(Error::new(ErrorKind::Refused, dest, message));
            };
            *granted += 1;
            let lifetime = srv.tickets.lifetime().as_secs() as u32;
            Action::Reply(Reply::Ticket { key_id, wrapped_secret: skey.wrap(&key_id, &secret), lifetime })
        }
        Request::Renew { key_id } => {
            if !srv.tickets.renew(&key_id) {
                let msg = "no such ticket, or it has expired (and its session has ended): the transfer must start again with a new one";
                return Err(Error::new(ErrorKind::Refused, "", msg));
            }
            Action::Reply(Reply::Renewed { lifetime: srv.tickets.lifetime().as_secs() as u32 })
        }
        Request::Push { sources, dest, hosts, options, params } => {
            if hosts.is_empty() {
                return Err(Error::new(ErrorKind::Usage, dest, "a push names no destination host"));
            }
            let streams = hosts.len() as u64 * params.streams.clamp(1, MAX_STREAMS as u32) as u64;
            let params = limit(srv, options.block_size, streams, params)?;
            let (root, specs) = resolve_sources(srv, &sources)?;
            // Every destination checked (and its name resolved) before any is dialed.
            let hosts = hosts.into_iter().map(|h| srv.cfg.push_to.dialer(&h.addr).map(|d| (h, d))).collect::<Result<_>>()?;
            Action::Push { root, specs, dest, hosts, options, params }
        }
        Request::List { path } => {
            let (root, mut specs) = resolve_sources(srv, std::slice::from_ref(&path))?;
            Action::List { root, spec: specs.remove(0) }
        }
        Request::Stream { producer, block_size } => {
            let Some(sink) = srv.cfg.sink.clone() else {
                return Err(Error::new(ErrorKind::Refused, producer, "this server does not take streams; run `dmover sink` for that"));
            };
            sink::check_block_size(block_size)?;
            let dir = sink::producer_dir(&sink, &producer)?;
            Action::Stream { sink, producer, dir, block_size }
        }
        Request::Ping {} => Action::Nothing,
    })
}

/// Checks that `streams` data connections fit in [`MAX_STREAMS`] and that
/// blocks of `block_size` for them, and at least one file being read (or
/// the receiving pool's four blocks), fit in this server's staging.
/// Returns how many blocks fit.
fn blocks_fit(srv: &Server, block_size: u32, streams: u64) -> Result<u64> {
    if streams > MAX_STREAMS {
        let message = format!("{streams} data connections asked for; this server opens or holds at most {MAX_STREAMS} for one request (fewer streams, -p, or fewer hosts)");
        return Err(Error::new(ErrorKind::Usage, "", message));
    }
    let fits = srv.cfg.staging / (block_size as u64).max(1);
    let need = (streams + 1).max(dmover_engine::pool::MIN_BLOCKS as u64);
    if fits < need {
        let fewer = if streams > 0 { " or fewer streams (-p)" } else { "" };
        let message = format!(
            "{need} blocks of {block_size} bytes do not fit in this server's staging ({} bytes); use a smaller --block-size{fewer}",
            srv.cfg.staging
        );
        return Err(Error::new(ErrorKind::Usage, "", message));
    }
    Ok(fits)
}

/// Holds a sending request's engine parameters to this server's limits: no
/// more staging than its own, and no more files read at once than fit in
/// it beside one block per stream, so that whatever a client asks for, a
/// request holds at most the server's staging.
fn limit(srv: &Server, block_size: u32, streams: u64, p: EngineParams) -> Result<EngineParams> {
    let fits = blocks_fit(srv, block_size, streams)?;
    let concurrency = (p.concurrency as u64).clamp(1, 64).min(fits - streams) as u32;
    Ok(EngineParams { staging: p.staging.min(srv.cfg.staging), concurrency, ..p })
}

/// Serves requests on a control connection until it ends or becomes a transfer.
fn control(
    srv: &Arc<Server>,
    t: Box<dyn Transport>,
    mut r: FrameReader,
    mut w: FrameWriter,
    grant: &Grant,
    skey: &dmover_proto::auth::SessionKey,
) -> Result<()> {
    let mut granted = 0;
    loop {
        let m = match r.read_msg() {
            Ok(m) => m,
            Err(e) if e.kind == ErrorKind::Unreachable => return Ok(()), // the client went away
            Err(e) => return Err(e),
        };
        match prepare(srv, m, grant, skey, &mut granted) {
            Err(e) => refuse(srv, &mut w, &e)?,
            Ok(Action::Nothing) => {}
            Ok(Action::Reply(m)) => w.send(m)?,
            Ok(Action::Receive { root, dest, options, write_errors, privileged }) => {
                let label = storage::display_spelled(root.as_ref(), &dest);
                let cfg = RecvConfig {
                    store: root,
                    dest,
                    options,
                    staging: srv.cfg.staging,
                    writers: srv.cfg.writers,
                    idle_timeout: srv.cfg.idle_timeout,
                    // What all receiving sessions take in, for the senders' tuners (and the metrics).
                    intake: srv.cfg.metrics.intake(),
                    write_errors,
                    accept: None,
                    privileged,
                };
                let prepared = match recv::prepare(cfg) {
                    Ok(p) => p,
                    Err(e) => {
                        refuse(srv, &mut w, &e)?;
                        continue;
                    }
                };
                let (guard, rx) = open_session(srv, grant);
                if let Grant::Ticket(id, dest) = grant {
                    // Two connections racing with one ticket: one session only.
                    if !srv.tickets.claim(id, guard.id) {
                        let e = Error::new(
                            ErrorKind::Refused,
                            dest.clone(),
                            "this ticket has opened its session already (a ticket is used once)",
                        );
                        refuse(srv, &mut w, &e)?;
                        continue;
                    }
                }
                w.send(Reply::SessionOpened { session: guard.id })?;
                drop(r);
                let _running = srv.cfg.metrics.session(Kind::Receive);
                let _expiry = match grant {
                    Grant::Ticket(id, _) => Some(EndAtExpiry::watch(srv, *id, t.split().map_err(|e| Error::network(t.peer(), &e))?)),
                    _ => None,
                };
                let s = prepared.run(t, rx)?;
                srv.cfg.metrics.received(s.files);
                log::info!("received {} files, {} bytes into {label}", s.files, s.bytes);
                return Ok(());
            }
            Ok(Action::Send { root, specs, options, params }) => {
                let (guard, rx) = open_session(srv, grant);
                w.send(Reply::SessionOpened { session: guard.id })?;
                drop(r);
                // Sending starts at once: the first announcements and the
                // client's plans cross while its data connections attach
                // (each is handed over just after its confirmation).
                let want = params.streams as usize;
                let (attached, conns) = crossbeam_channel::bounded(want);
                {
                    let (rx, socket, peer) = (rx.clone(), SocketOptions::of(&options), t.peer());
                    std::thread::spawn(move || {
                        for d in rx.iter().take(want) {
                            let d = d.set_options(&socket).map(|_| d).map_err(|e| Error::network(&peer, &e));
                            if attached.send(d).is_err() {
                                return;
                            }
                        }
                    });
                }
                // A tuned download's new streams are dialed by the client as
                // this end asks, and attach to the session like the first ones.
                let more = (params.tuner != TunerMode::Fixed).then(|| MoreStreams::Ask(rx));
                let link = HostLink {
                    name: t.peer(),
                    control: t.split().map_err(|e| Error::network(t.peer(), &e))?,
                    data: Vec::new(),
                    attaching: Some(Attaching { count: want, conns }),
                    more,
                };
                let progress = Arc::new(Progress::default());
                let _running = srv.cfg.metrics.sending(Kind::Send, progress.clone());
                let stats = send::send(Files::Walk { store: root, specs }, vec![link], send_config(srv, options, params, 1, progress));
                return finish_report(srv, &mut w, t.as_ref(), stats);
            }
            Ok(Action::List { root, spec }) => list(srv, &mut w, &root, &spec)?,
            Ok(Action::Stream { sink, producer, dir, block_size }) => {
                let (guard, rx) = open_session(srv, grant);
                w.send(Reply::SessionOpened { session: guard.id })?;
                let _running = srv.cfg.metrics.session(Kind::Stream);
                return sink::run(&sink, &producer, dir, block_size, t, r, w, rx, srv.cfg.metrics.clone());
            }
            Ok(Action::Push { root, specs, dest, hosts, options, params }) => {
                let stats = push(srv, &mut w, root, specs, &dest, &hosts, skey, options, params);
                return finish_report(srv, &mut w, t.as_ref(), stats);
            }
        }
    }
}

/// Entries per `Listing` frame.
const LISTING_BATCH: usize = 512;

/// Streams the files `spec` names, in batches, as the walk finds them.
fn list(srv: &Server, w: &mut FrameWriter, root: &Store, spec: &str) -> Result<()> {
    let mut batch = Vec::new();
    let mut sent = Ok(());
    let listed = dmover_engine::source::list(root.as_ref(), spec, &mut |meta| {
        batch.push(meta);
        if batch.len() == LISTING_BATCH {
            sent = w.send(ListReply::Listing { entries: std::mem::take(&mut batch), done: false });
        }
        sent.is_ok()
    });
    sent?;
    match listed {
        Err(e) => refuse(srv, w, &e),
        Ok(()) => w.send(ListReply::Listing { entries: batch, done: true }),
    }
}

/// Ends a send or push with its report, or with the error that stopped it.
fn finish_report(srv: &Server, w: &mut FrameWriter, t: &dyn Transport, stats: Result<Stats>) -> Result<()> {
    match stats {
        Ok(s) => {
            srv.cfg.metrics.sent(s.dest_files, s.resent_blocks);
            w.send(RemoteReport::Report { stats: s })
        }
        Err(e) => {
            let _ = w.send(RemoteReport::Error { kind: e.kind, message: e.to_string() });
            dmover_engine::transport::linger(t);
            Err(e)
        }
    }
}

/// How to send for a client: its parameters, and the tuner it chose
/// (opening at most [`MAX_STREAMS`] in all over `hosts` hosts).
fn send_config(srv: &Server, options: TransferOptions, p: EngineParams, hosts: usize, progress: Arc<Progress>) -> SendConfig {
    let most = (MAX_STREAMS as usize / hosts.max(1)).max(1);
    SendConfig {
        options,
        concurrency: (p.concurrency as usize).clamp(1, 64),
        staging: p.staging.clamp(1 << 20, 1 << 30),
        idle_timeout: srv.cfg.idle_timeout,
        progress,
        bwlimit: p.bwlimit,
        tuner: dmover_engine::tuning::requested(&p, most).map(|m| Arc::new(move || m.build()) as send::TunerFactory),
    }
}

/// All sources must name the same export; returns its root and the specs below it.
fn resolve_sources(srv: &Server, sources: &[String]) -> Result<(Store, Vec<String>)> {
    let mut root: Option<&Store> = None;
    let mut specs = Vec::new();
    for s in sources {
        let (r, rest) = locate(srv, s)?;
        if root.is_some_and(|x| !Arc::ptr_eq(x, r)) {
            return Err(Error::new(ErrorKind::Usage, s.clone(), "all sources must be in one export"));
        }
        root = Some(r);
        specs.push(rest.to_string());
    }
    let root = root.ok_or_else(|| Error::new(ErrorKind::Usage, "", "no source given"))?;
    Ok((root.clone(), specs))
}

/// A third-party transfer: this server sends to other servers with the
/// tickets they issued, reporting progress to the client that asked.
#[allow(clippy::too_many_arguments)]
fn push(
    srv: &Arc<Server>,
    w: &mut FrameWriter,
    root: Store,
    specs: Vec<String>,
    dest: &str,
    hosts: &[(TicketedHost, Arc<dyn Dialer>)],
    skey: &dmover_proto::auth::SessionKey,
    options: TransferOptions,
    params: EngineParams,
) -> Result<Stats> {
    let creds: Vec<(String, Credential)> = hosts
        .iter()
        .map(|(h, dialer)| {
            let secret = skey.wrap(&h.key_id, &h.wrapped_secret).to_vec();
            (h.addr.clone(), Credential { key_id: h.key_id, secret, via: Some(dialer.clone()), control: None })
        })
        .collect();
    let progress = Arc::new(Progress::default());
    let _running = srv.cfg.metrics.sending(Kind::Push, progress.clone());
    let streams = (params.streams as usize).clamp(1, 64);
    let attempt = |progress: &Arc<Progress>| -> Result<Stats> {
        let socket = SocketOptions::of(&options);
        let links: Vec<HostLink> = session::receive_links(&creds, dest, options, streams, &socket)?;
        send::send(
            Files::Walk { store: root.clone(), specs: specs.clone() },
            links,
            send_config(srv, options, params, creds.len(), progress.clone()),
        )
    };
    // Progress goes to the client from this thread while the transfer runs;
    // the report follows the transfer's end at once. One attempt: the
    // tickets open one session each, so a retry is the client's, with
    // fresh tickets.
    let result = std::thread::scope(|s| {
        // Dropped when the attempt ends, which wakes this thread.
        let (ended, end) = crossbeam_channel::bounded::<()>(0);
        let running = &progress;
        let h = s.spawn(move || {
            let _ended = ended;
            attempt(running)
        });
        let mut told = true;
        while told && end.recv_timeout(PUSH_PROGRESS_EVERY) == Err(crossbeam_channel::RecvTimeoutError::Timeout) {
            let p = progress.snapshot();
            let m = RemoteReport::Progress {
                files: p.done_files,
                bytes: p.done_bytes,
                total_files: p.total_files,
                total_bytes: p.total_bytes,
                walk_done: p.walk_done,
            };
            told = w.send(m).is_ok();
        }
        h.join().unwrap_or_else(|_| Err(Error::internal("transfer thread panicked")))
    });
    result.map(|s| Stats { sent_bytes: progress.snapshot().sent_bytes, ..s })
}
