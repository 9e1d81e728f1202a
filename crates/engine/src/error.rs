//! The engine's error type: a class (which is also the exit code), what it
//! concerns (a path or host), and a message for people.

use dmover_proto::ErrorKind;
use std::fmt;
use std::io;

/// An error with its class and the path or host it concerns.
#[derive(Debug, Clone)]
pub struct Error {
    pub kind: ErrorKind,
    /// The path, host or URL the error is about; may be empty.
    pub subject: String,
    pub message: String,
    /// What the user can do about this particular error, when it is more
    /// precise than its class's general hint (see [`Error::hint`]).
    pub advice: Option<String>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, subject: impl Into<String>, message: impl Into<String>) -> Error {
        Error { kind, subject: subject.into(), message: message.into(), advice: None }
    }

    /// The error with `advice` as what the user can do about it, in place of
    /// its class's general hint.
    pub fn advised(self, advice: impl Into<String>) -> Error {
        Error { advice: Some(advice.into()), ..self }
    }

    /// Classifies an I/O error about `subject`.
    pub fn io(subject: impl Into<String>, e: &io::Error) -> Error {
        Error::new(classify(e), subject, e.to_string())
    }

    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Internal, "", message)
    }

    pub fn protocol(subject: impl Into<String>, message: impl fmt::Display) -> Error {
        Error::new(ErrorKind::Internal, subject, format!("protocol error: {message}"))
    }

    /// A lost or refused connection to `host`.
    pub fn network(host: impl Into<String>, e: &io::Error) -> Error {
        // A host name with no address: a mistake no retry cures.
        if e.kind() == io::ErrorKind::NotFound {
            return Error::new(ErrorKind::Usage, host, e.to_string()).advised("check the host name");
        }
        // A socket's read timeout (the idle or handshake timeout) shows as
        // EAGAIN, "Resource temporarily unavailable", which says nothing to
        // a reader of the log. (A connect timeout is TimedOut and says so.)
        let message = match e.kind() {
            io::ErrorKind::WouldBlock => "nothing received from the peer within the timeout".to_string(),
            // read_exact's "failed to fill whole buffer".
            io::ErrorKind::UnexpectedEof => "the peer closed the connection".to_string(),
            _ => e.to_string(),
        };
        Error::new(ErrorKind::Unreachable, host, message)
    }

    pub fn is_transient(&self) -> bool {
        self.kind.is_transient()
    }

    /// What the user can do about it: the error's own advice, else its
    /// class's general hint.
    pub fn hint(&self) -> &str {
        if let Some(a) = &self.advice {
            return a;
        }
        match self.kind {
            ErrorKind::NotFound => "check the path",
            ErrorKind::Permission => "check the file's permissions",
            ErrorKind::NoSpace => "free space at the destination, then re-run the same command to resume",
            ErrorKind::Unreachable => "check that the server runs and the host and port are right; re-running resumes",
            ErrorKind::Auth => "check that the token matches the server's --token-file",
            ErrorKind::Refused => "the server's rules do not allow this",
            ErrorKind::SourceChanged => "the file was modified during the copy; re-run when it is stable",
            ErrorKind::Verify => "the data arrived damaged repeatedly; check the network and storage",
            ErrorKind::Usage => "see dmover --help",
            ErrorKind::Internal => "please report this",
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.subject.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.subject, self.message)
        }
    }
}

impl std::error::Error for Error {}

/// Why a path was refused: it leaves a confined storage or meets a symlink
/// on the way, or names a FIFO, socket or device where a file is read.
/// Carried inside an `io::Error`; [`crate::error::classify`]
/// makes it [`ErrorKind::Refused`].
#[derive(Debug)]
pub struct Refused(pub &'static str);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "path refused: {}", self.0)
    }
}

impl std::error::Error for Refused {}

/// Data read from a storage failed that storage's own check (the checksum
/// an object store keeps). Carried inside an `io::Error`;
/// [`crate::error::classify`] makes it [`ErrorKind::Verify`].
#[derive(Debug)]
pub struct Damaged(pub String);

impl std::fmt::Display for Damaged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Damaged {}

impl Refused {
    pub fn io(why: &'static str) -> io::Error {
        io::Error::other(Refused(why))
    }

    /// Whether `e` is a refusal.
    pub fn is(e: &io::Error) -> bool {
        e.get_ref().is_some_and(|x| x.is::<Refused>())
    }
}

/// Maps an I/O error to an error class.
pub fn classify(e: &io::Error) -> ErrorKind {
    use io::ErrorKind as K;
    if Refused::is(e) {
        return ErrorKind::Refused;
    }
    if e.get_ref().is_some_and(|x| x.is::<Damaged>()) {
        return ErrorKind::Verify;
    }
    match e.kind() {
        K::NotFound => ErrorKind::NotFound,
        K::PermissionDenied => ErrorKind::Permission,
        K::StorageFull => ErrorKind::NoSpace,
        K::ConnectionRefused
        | K::ConnectionReset
        | K::ConnectionAborted
        | K::NotConnected
        | K::BrokenPipe
        | K::TimedOut
        | K::UnexpectedEof
        | K::HostUnreachable
        | K::NetworkUnreachable
        | K::AddrNotAvailable
        | K::WouldBlock => ErrorKind::Unreachable,
        _ => match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorKind::NoSpace,
            Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => ErrorKind::Permission,
            // O_NOFOLLOW met a symlink where dmover writes; a name longer
            // than the destination's file system takes.
            Some(libc::ELOOP) | Some(libc::ENAMETOOLONG) => ErrorKind::Refused,
            _ => ErrorKind::Internal,
        },
    }
}
