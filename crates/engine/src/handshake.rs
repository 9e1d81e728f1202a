//! Both ends of the authentication handshake (see `dmover_proto::auth`).

use crate::error::{Error, Result};
use crate::wire::{FrameReader, FrameWriter};
use dmover_proto::auth::{mac_eq, Key, KeyId, Nonce, SessionKey};
use dmover_proto::phase::{ClientHello, ServerHello};
use dmover_proto::{ErrorKind, Msg};

/// A fresh random nonce or identifier.
pub fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).expect("the operating system's random source failed");
    b
}

/// Proves to the server that we know `secret` (named by `key_id`) and checks
/// that the server knows it too. Returns the session key; the server's
/// `Welcome` is still to be read with [`expect_welcome`].
pub fn client(r: &mut FrameReader, w: &mut FrameWriter, key_id: KeyId, secret: &[u8]) -> Result<SessionKey> {
    let key = Key::from_secret(secret);
    let cn: Nonce = random();
    w.send(ClientHello::Hello { key_id, nonce: cn })?;
    let (sn, proof) = match r.read_msg::<ServerHello>()? {
        ServerHello::Challenge { nonce, proof } => (nonce, proof),
        ServerHello::Welcome {} => return Err(Error::protocol(r.peer(), "expected a challenge, got a welcome")),
        ServerHello::Error { kind, message } => return Err(Error::new(kind, r.peer(), message)),
    };
    if !mac_eq(&proof, &key.server_proof(&cn, &sn)) {
        // Say why before hanging up, so that the server's log can tell a
        // token mismatch from a client that went away.
        let _ = w.send(Msg::Error { kind: ErrorKind::Auth, message: "the server's proof does not match our token".into() });
        let msg = "authentication failed: the server does not know our token (wrong token or not a dmover server)";
        return Err(Error::new(ErrorKind::Auth, r.peer(), msg));
    }
    w.send(ClientHello::Proof { proof: key.client_proof(&cn, &sn) })?;
    Ok(key.session_key(&cn, &sn))
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

/// The server's side: `lookup` gives the secret for a key id, if any.
/// Returns the key id the client used and the session key. On failure the
/// client has been told why.
pub fn server(r: &mut FrameReader, w: &mut FrameWriter, lookup: impl Fn(&KeyId) -> Option<Vec<u8>>) -> Result<(KeyId, SessionKey)> {
    r.limit(HANDSHAKE_BODY);
    let (key_id, cn) = match r.read_msg::<ClientHello>()? {
        ClientHello::Hello { key_id, nonce } => (key_id, nonce),
        ClientHello::Proof { .. } => return Err(Error::protocol(r.peer(), "expected hello, got a proof")),
    };
    // An unknown key id still gets a challenge, under a random key, so that
    // a client cannot tell unknown tickets from wrong secrets.
    let secret = lookup(&key_id);
    let key = Key::from_secret(secret.as_deref().unwrap_or(&random::<32>()));
    let sn: Nonce = random();
    w.send(ServerHello::Challenge { nonce: sn, proof: key.server_proof(&cn, &sn) })?;
    let proof = match r.read_msg::<ClientHello>() {
        Ok(ClientHello::Proof { proof }) => proof,
        // A client that does not accept our proof says so (our token differs from its).
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
    if secret.is_none() || !mac_eq(&proof, &key.client_proof(&cn, &sn)) {
        let message = "authentication failed: wrong token".to_string();
        let _ = w.send(ServerHello::Error { kind: ErrorKind::Auth, message: message.clone() });
        return Err(Error::new(ErrorKind::Auth, r.peer(), message));
    }
    w.send(ServerHello::Welcome {})?;
    r.limit(dmover_proto::frame::MAX_CONTROL_BODY);
    Ok((key_id, key.session_key(&cn, &sn)))
}
