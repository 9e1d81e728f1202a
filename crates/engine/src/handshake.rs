//! Both ends of the authentication handshake (see `dmover_proto::auth`),
//! and the sealed connection it leaves behind.

use crate::error::{Error, Result};
use crate::transport::{Sealed, Transport};
use crate::wire::{FrameReader, FrameWriter};
use dmover_proto::auth::{AuthError, Channel, Initiator, KeyId, Responder, SessionKey};
use dmover_proto::phase::{ClientHello, ServerHello};
use dmover_proto::record::Protection;
use dmover_proto::{ErrorKind, Msg};

/// A fresh random nonce or identifier.
pub fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).expect("the operating system's random source failed");
    b
}

/// A connection after the handshake: every byte from here on travels in
/// sealed records.
pub struct Authenticated {
    /// The sealed connection, to split or close.
    pub transport: Box<dyn Transport>,
    pub reader: FrameReader,
    pub writer: FrameWriter,
    /// Wraps secrets handed over this connection (tickets).
    pub session_key: SessionKey,
}

/// Puts the sealing layer on `t`, taking over what `r` read past the
/// handshake.
fn seal(t: Box<dyn Transport>, r: FrameReader, channel: Channel) -> Result<Authenticated> {
    let peer = t.peer();
    let net = |e: std::io::Error| Error::network(&peer, &e);
    let early = r.into_buffered();
    let sealed: Box<dyn Transport> = Box::new(Sealed::new(t, channel.sealer, channel.opener, &early));
    let reader = FrameReader::new(sealed.split().map_err(net)?);
    let writer = FrameWriter::new(sealed.split().map_err(net)?);
    Ok(Authenticated { transport: sealed, reader, writer, session_key: channel.session_key })
}

/// Proves to the server on `t` that we know `secret` (named by `key_id`),
/// checks that the server knows it too, and seals the connection with
/// `protection`. The server's `Welcome` is still to be read with
/// [`expect_welcome`].
pub fn client(t: Box<dyn Transport>, key_id: KeyId, secret: &[u8], protection: Protection) -> Result<Authenticated> {
    let peer = t.peer();
    let net = |e: std::io::Error| Error::network(&peer, &e);
    let mut r = FrameReader::new(t.split().map_err(net)?);
    let mut w = FrameWriter::new(t.split().map_err(net)?);
    let (initiator, hello) = Initiator::start(&key_id, secret, protection);
    w.send(ClientHello::Hello { key_id, protection, hello })?;
    let challenge = match r.read_msg::<ServerHello>()? {
        ServerHello::Challenge { challenge } => challenge,
        ServerHello::Welcome {} => return Err(Error::protocol(r.peer(), "expected a challenge, got a welcome")),
        ServerHello::Error { kind, message } => return Err(Error::new(kind, r.peer(), message)),
    };
    let (channel, proof) = match initiator.finish(&challenge) {
        Ok(c) => c,
        Err(AuthError::Mismatch) => {
            // Say why before hanging up, so that the server's log can tell a
            // token mismatch from a client that went away.
            let _ = w.send(Msg::Error { kind: ErrorKind::Auth, message: "the server's proof does not match our token".into() });
            let msg = "authentication failed: the server does not know our token (wrong token or not a dmover server)";
            return Err(Error::new(ErrorKind::Auth, r.peer(), msg));
        }
        Err(e) => return Err(Error::protocol(r.peer(), e)),
    };
    w.send(ClientHello::Proof { proof })?;
    seal(t, r, channel)
}

/// Reads the server's `Welcome`. A client may send its first request right
/// after its proof and read the welcome before the answer: the server
/// handles frames in order, so this saves a round trip.
pub fn expect_welcome(r: &mut FrameReader) -> Result<()> {
    match r.read_msg::<ServerHello>()? {
        ServerHello::Welcome {} => Ok(()),
        ServerHello::Challenge { .. } => Err(Error::protocol(r.peer(), "expected a welcome, got a second challenge")),
        ServerHello::Error { kind, message } => Err(Error::new(kind, r.peer(), message)),
    }
}

/// Largest frame body a server reads from a peer that has not yet
/// authenticated: the handshake's frames are a few dozen bytes, and an
/// 8-byte header must not make the server set aside a megabyte.
pub const HANDSHAKE_BODY: u32 = 256;

/// The server's side on `t`: `lookup` gives the secret for a key id, if
/// any. Returns the key id the client used and the sealed connection, on
/// which `Welcome` has been sent. On failure the client has been told why.
pub fn server(t: Box<dyn Transport>, lookup: impl Fn(&KeyId) -> Option<Vec<u8>>) -> Result<(KeyId, Authenticated)> {
    let peer = t.peer();
    let net = |e: std::io::Error| Error::network(&peer, &e);
    let mut r = FrameReader::new(t.split().map_err(net)?);
    let mut w = FrameWriter::new(t.split().map_err(net)?);
    r.limit(HANDSHAKE_BODY);
    let (key_id, protection, hello) = match r.read_msg::<ClientHello>()? {
        ClientHello::Hello { key_id, protection, hello } => (key_id, protection, hello),
        ClientHello::Proof { .. } => return Err(Error::protocol(r.peer(), "expected hello, got a proof")),
    };
    // An unknown key id still gets a challenge, under a random secret, so
    // that a client cannot tell unknown tickets from wrong secrets.
    let secret = lookup(&key_id).unwrap_or_else(|| random::<32>().to_vec());
    let refuse = |w: &mut FrameWriter, message: String| {
        let _ = w.send(ServerHello::Error { kind: ErrorKind::Auth, message: message.clone() });
        Err(Error::new(ErrorKind::Auth, &peer, message))
    };
    let (responder, challenge) = match Responder::answer(&key_id, &secret, protection, &hello) {
        Ok(a) => a,
        Err(e) => return refuse(&mut w, format!("authentication failed: {e}")),
    };
    w.send(ServerHello::Challenge { challenge })?;
    let proof = match r.read_msg::<ClientHello>() {
        Ok(ClientHello::Proof { proof }) => proof,
        // A client that does not accept our challenge says so (its token differs from ours).
        Err(e) if e.kind == ErrorKind::Auth => {
            let message = "authentication failed: the client does not accept our proof (its token differs from ours)";
            return Err(Error::new(ErrorKind::Auth, r.peer(), message));
        }
        Err(e) if e.kind == ErrorKind::Unreachable => {
            let message = format!("the client hung up during the handshake, before proving it knows the token ({})", e.message);
            return Err(Error::new(ErrorKind::Unreachable, r.peer(), message));
        }
        Err(e) => return Err(e),
        Ok(ClientHello::Hello { .. }) => return Err(Error::protocol(r.peer(), "expected a proof, got a second hello")),
    };
    let channel = match responder.verify(&proof) {
        Ok(c) => c,
        Err(_) => return refuse(&mut w, "authentication failed: wrong token".into()),
    };
    let mut a = seal(t, r, channel)?;
    a.writer.send(ServerHello::Welcome {})?;
    Ok((key_id, a))
}
