//! Authentication, and the keys that protect a connection afterwards.
//!
//! Each connection starts with the Noise handshake `NNpsk2`
//! (`Noise_NNpsk2_25519_AESGCM_SHA256`): both ends send a fresh ephemeral
//! X25519 key, and the shared secret (the server's token, or a ticket the
//! server issued) is mixed in as the pre-shared key. The secret never
//! crosses the wire; the Diffie–Hellman result gives each connection keys of
//! its own, so a captured handshake says nothing about the secret, and a
//! relay that forwards a real client's handshake learns no key and can use
//! nothing it relays.
//!
//! The steps (see `docs/PROTOCOL.md`):
//! 1. client → server: `Hello { key_id, protection, client's ephemeral key }` (Noise message 1);
//! 2. server → client: `Challenge` (Noise message 2: the server's ephemeral
//!    key and a tag only a holder of the secret can make);
//! 3. client → server: `Proof`: a tag over the handshake hash under the
//!    client's new sending key (only a holder of the secret has it);
//! 4. server → client: `Welcome`, the first sealed record (see [`crate::record`]).
//!
//! The key id, the protection and the protocol version are the Noise
//! prologue, so a relay that changes any of them breaks the handshake.

use crate::record::{Opener, Protection, Sealer, TAG};

/// A 32-byte key derived from a token or ticket secret.
#[derive(Clone)]
pub struct Key([u8; 32]);

/// Identifies which secret a client uses: all zeros is the server's token;
/// anything else names a ticket the server issued or, at a sink, a
/// producer (see [`producer_key_id`]).
pub type KeyId = [u8; 16];
pub const TOKEN_KEY_ID: KeyId = [0; 16];

/// The first word of a producer credential file:
/// `dmover-producer NAME SECRET` (the secret in hex).
pub const PRODUCER_CREDENTIAL: &str = "dmover-producer";

/// The key id a producer named `name` authenticates with at a sink.
pub fn producer_key_id(name: &str) -> KeyId {
    let mut h = blake3::Hasher::new_derive_key("dmover 2 producer key id");
    h.update(name.as_bytes());
    let mut id = [0u8; 16];
    id.copy_from_slice(&h.finalize().as_bytes()[..16]);
    id
}

/// The secret of the producer whose key id is `id`, derived from the
/// sink's token: a sink needs no table of producers, and a producer given
/// only its own secret cannot authenticate under another name.
pub fn producer_secret(token: &[u8], id: &KeyId) -> [u8; 32] {
    let key = blake3::derive_key("dmover 2 producer secret", token);
    *blake3::keyed_hash(&key, id).as_bytes()
}

/// The key id and secret producer `name` authenticates with, from what it
/// was given: the sink's token itself, or a producer credential
/// (`dmover token --producer NAME`), which must name `name`.
pub fn producer_credential(given: &[u8], name: &str) -> Result<(KeyId, Vec<u8>), String> {
    let id = producer_key_id(name);
    let text = String::from_utf8_lossy(given);
    let mut words = text.split_whitespace();
    if words.next() != Some(PRODUCER_CREDENTIAL) {
        return Ok((id, producer_secret(given, &id).to_vec()));
    }
    let (Some(owner), Some(hex), None) = (words.next(), words.next(), words.next()) else {
        return Err(format!("a producer credential is one line: {PRODUCER_CREDENTIAL} NAME SECRET"));
    };
    if owner != name {
        return Err(format!("this credential is producer '{owner}''s; the stream is named '{name}'"));
    }
    match hex::decode(hex) {
        Ok(secret) if secret.len() == 32 => Ok((id, secret)),
        _ => Err("a producer credential's secret is 64 hex digits".to_string()),
    }
}

/// The text of producer `name`'s credential file for a sink with `token`.
pub fn producer_credential_text(token: &[u8], name: &str) -> String {
    let secret = producer_secret(token, &producer_key_id(name));
    format!("{PRODUCER_CREDENTIAL} {name} {}", hex::encode(secret))
}

/// Shortest token a server accepts, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

impl Key {
    /// The key for a token or ticket secret.
    pub fn from_secret(secret: &[u8]) -> Key {
        let mut h = blake3::Hasher::new_derive_key("dmover 1 authentication key");
        h.update(secret);
        Key(*h.finalize().as_bytes())
    }
}

/// A per-connection key used to wrap secrets sent over that connection.
#[derive(Clone)]
pub struct SessionKey([u8; 32]);

impl SessionKey {
    /// Encrypts or decrypts (the same operation) a 32-byte secret with a
    /// keystream bound to this session and to `label`.
    pub fn wrap(&self, label: &[u8], secret: &[u8; 32]) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"dmover wrap");
        h.update(label);
        let mut stream = [0u8; 32];
        h.finalize_xof().fill(&mut stream);
        let mut out = *secret;
        for (o, s) in out.iter_mut().zip(stream) {
            *o ^= s;
        }
        out
    }
}

/// The Noise protocol every connection speaks.
pub const NOISE: &str = "Noise_NNpsk2_25519_AESGCM_SHA256";
/// Bytes of Noise message 1: the client's ephemeral key and a tag over
/// an empty payload (keyed by nothing secret yet).
pub const HELLO_LEN: usize = 48;
/// Bytes of Noise message 2: the server's ephemeral key and a tag.
pub const CHALLENGE_LEN: usize = 48;

/// Noise message 1, carried by `Hello`.
pub type HelloKey = [u8; HELLO_LEN];
/// Noise message 2, carried by `Challenge`.
pub type ChallengeBytes = [u8; CHALLENGE_LEN];
/// The client's proof, carried by `Proof`.
pub type ProofTag = [u8; TAG];

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The peer's tag does not verify: it does not know the secret, or the
    /// handshake was changed on the way.
    #[error("the peer does not know the secret, or the handshake was changed on the way")]
    Mismatch,
    /// The peer sent something that is not a Noise message.
    #[error("malformed handshake message ({0})")]
    Malformed(String),
}

/// The keys of an authenticated connection, for one end.
pub struct Channel {
    /// Seals what this end sends.
    pub sealer: Sealer,
    /// Opens what this end receives.
    pub opener: Opener,
    /// Wraps secrets handed over this connection (tickets).
    pub session_key: SessionKey,
}

/// The prologue both ends feed to Noise: what the handshake must agree on
/// besides the keys.
fn prologue(key_id: &KeyId, protection: Protection) -> [u8; 25] {
    let mut p = [0u8; 25];
    p[..8].copy_from_slice(b"dmover 2");
    p[8..24].copy_from_slice(key_id);
    p[24] = protection as u8;
    p
}

fn builder<'a>(psk: &'a [u8; 32], prologue: &'a [u8]) -> snow::Builder<'a> {
    let params = NOISE.parse().expect("a valid Noise name");
    snow::Builder::new(params).prologue(prologue).and_then(|b| b.psk(2, psk)).expect("a fresh builder takes a prologue and a psk")
}

/// Splits a finished handshake into the two directions' keys.
fn split(hs: &mut snow::HandshakeState, initiator: bool, protection: Protection) -> Channel {
    let (to_server, to_client) = hs.dangerously_get_raw_split();
    let mut h = blake3::Hasher::new_derive_key("dmover 2 session key");
    h.update(&to_server);
    h.update(&to_client);
    let session_key = SessionKey(*h.finalize().as_bytes());
    let (send, recv) = if initiator { (to_server, to_client) } else { (to_client, to_server) };
    Channel { sealer: Sealer::new(&send, protection), opener: Opener::new(&recv, protection), session_key }
}

fn noise_error(e: snow::Error) -> AuthError {
    match e {
        snow::Error::Decrypt => AuthError::Mismatch,
        e => AuthError::Malformed(e.to_string()),
    }
}

/// The client's side, between `Hello` and `Challenge`.
pub struct Initiator {
    hs: snow::HandshakeState,
    protection: Protection,
}

impl Initiator {
    /// Starts a handshake with `secret` (named by `key_id`); returns the
    /// client's half and the key to send in `Hello`.
    pub fn start(key_id: &KeyId, secret: &[u8], protection: Protection) -> (Initiator, HelloKey) {
        let psk = Key::from_secret(secret).0;
        let prologue = prologue(key_id, protection);
        let mut hs = builder(&psk, &prologue).build_initiator().expect("an initiator");
        let mut hello = [0u8; HELLO_LEN];
        let n = hs.write_message(&[], &mut hello).expect("Noise message 1 fits");
        debug_assert_eq!(n, HELLO_LEN);
        (Initiator { hs, protection }, hello)
    }

    /// Checks the server's `Challenge`: only a server that knows the secret
    /// can make it. Returns the connection's keys and the client's proof.
    pub fn finish(mut self, challenge: &ChallengeBytes) -> Result<(Channel, ProofTag), AuthError> {
        let mut payload = [0u8; CHALLENGE_LEN];
        self.hs.read_message(challenge, &mut payload).map_err(noise_error)?;
        let hash = self.hs.get_handshake_hash().to_vec();
        let mut channel = split(&mut self.hs, true, self.protection);
        let proof = channel.sealer.tag(&hash).expect("the first record number");
        Ok((channel, proof))
    }
}

/// The server's side, between `Challenge` and `Proof`.
pub struct Responder {
    channel: Channel,
    hash: Vec<u8>,
}

impl Responder {
    /// Answers a client's `Hello` with `secret`, the secret its key id
    /// names (a random one if it names none: the client cannot tell an
    /// unknown id from a wrong secret). Returns the server's half and the
    /// `Challenge` to send.
    pub fn answer(
        key_id: &KeyId,
        secret: &[u8],
        protection: Protection,
        hello: &HelloKey,
    ) -> Result<(Responder, ChallengeBytes), AuthError> {
        let psk = Key::from_secret(secret).0;
        let prologue = prologue(key_id, protection);
        let mut hs = builder(&psk, &prologue).build_responder().expect("a responder");
        let mut payload = [0u8; HELLO_LEN];
        hs.read_message(hello, &mut payload).map_err(noise_error)?;
        let mut challenge = [0u8; CHALLENGE_LEN];
        let n = hs.write_message(&[], &mut challenge).map_err(noise_error)?;
        debug_assert_eq!(n, CHALLENGE_LEN);
        let hash = hs.get_handshake_hash().to_vec();
        Ok((Responder { channel: split(&mut hs, false, protection), hash }, challenge))
    }

    /// Checks the client's `Proof`: only a client that knows the secret
    /// can make it. Returns the connection's keys.
    pub fn verify(mut self, proof: &ProofTag) -> Result<Channel, AuthError> {
        self.channel.opener.check_tag(&self.hash, proof).map_err(|_| AuthError::Mismatch)?;
        Ok(self.channel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{HEADER, TAG};

    const ID: KeyId = [5; 16];

    fn handshake(client: &[u8], server: &[u8], p: Protection) -> Result<(Channel, Channel), AuthError> {
        let (i, hello) = Initiator::start(&ID, client, p);
        let (r, challenge) = Responder::answer(&ID, server, p, &hello)?;
        let (c, proof) = i.finish(&challenge)?;
        Ok((c, r.verify(&proof)?))
    }

    fn round_trip(from: &mut Channel, to: &mut Channel, msg: &[u8]) -> Vec<u8> {
        let mut r = vec![0u8; HEADER + msg.len() + TAG];
        r[HEADER..HEADER + msg.len()].copy_from_slice(msg);
        from.sealer.seal(&mut r).unwrap();
        to.opener.open(&mut r).unwrap().to_vec()
    }

    #[test]
    fn a_producer_credential_serves_its_own_name_only() {
        let token = b"the sink's token, 32 bytes long.";
        let text = producer_credential_text(token, "gtc-1");
        let (id, secret) = producer_credential(text.as_bytes(), "gtc-1").unwrap();
        // What the producer holds is what the sink derives from its token.
        assert_eq!((id, secret.clone()), producer_credential(token, "gtc-1").unwrap());
        assert_eq!(secret, producer_secret(token, &id).to_vec());
        let other = producer_credential(text.as_bytes(), "gtc-2").unwrap_err();
        assert!(other.contains("producer 'gtc-1''s") && other.contains("'gtc-2'"), "{other}");
        // Another name's key id gets another secret.
        assert_ne!(producer_secret(token, &producer_key_id("gtc-2")).to_vec(), secret);
        assert_ne!(producer_key_id("gtc-1"), TOKEN_KEY_ID);
        assert!(producer_credential(b"dmover-producer gtc-1 abcd", "gtc-1").is_err());
        assert!(producer_credential(b"dmover-producer gtc-1", "gtc-1").is_err());
    }

    #[test]
    fn both_ends_agree_on_keys_in_both_directions() {
        for p in [Protection::Encrypted, Protection::Authenticated] {
            let (mut c, mut s) = handshake(b"0123456789abcdef", b"0123456789abcdef", p).unwrap();
            assert_eq!(round_trip(&mut c, &mut s, b"request"), b"request");
            assert_eq!(round_trip(&mut s, &mut c, b"answer"), b"answer");
            let secret = [9u8; 32];
            assert_eq!(s.session_key.wrap(b"t", &c.session_key.wrap(b"t", &secret)), secret);
            assert_ne!(c.session_key.wrap(b"t", &secret), secret);
        }
    }

    #[test]
    fn a_wrong_secret_fails_at_the_client_and_a_forged_proof_at_the_server() {
        let (i, hello) = Initiator::start(&ID, b"0123456789abcdef", Protection::Encrypted);
        let (_, challenge) = Responder::answer(&ID, b"0123456789abcdeX", Protection::Encrypted, &hello).unwrap();
        assert_eq!(i.finish(&challenge).err(), Some(AuthError::Mismatch));
        let (_, hello) = Initiator::start(&ID, b"0123456789abcdef", Protection::Encrypted);
        let (r, _) = Responder::answer(&ID, b"0123456789abcdef", Protection::Encrypted, &hello).unwrap();
        assert_eq!(r.verify(&[0; TAG]).err(), Some(AuthError::Mismatch));
    }

    #[test]
    fn a_changed_key_id_or_protection_breaks_the_handshake() {
        // A relay that rewrites `Hello` to ask for another secret or less protection.
        let (_, hello) = Initiator::start(&ID, b"0123456789abcdef", Protection::Encrypted);
        let r = Responder::answer(&[6; 16], b"0123456789abcdef", Protection::Encrypted, &hello);
        assert_eq!(r.err(), Some(AuthError::Mismatch));
        let r = Responder::answer(&ID, b"0123456789abcdef", Protection::Authenticated, &hello);
        assert_eq!(r.err(), Some(AuthError::Mismatch));
    }

    #[test]
    fn a_relay_that_answers_each_side_itself_learns_no_key_it_can_use() {
        // The relay knows no secret: it runs its own handshakes with each end.
        let relay_secret = b"the relay guesses this secret!!";
        let (i, hello) = Initiator::start(&ID, b"0123456789abcdef", Protection::Encrypted);
        let (_, challenge) = Responder::answer(&ID, relay_secret, Protection::Encrypted, &hello).unwrap();
        assert_eq!(i.finish(&challenge).err(), Some(AuthError::Mismatch));
        // Forwarding the real messages gives a channel the relay has no keys for:
        // the connection's keys differ from every other connection's.
        let (mut a, _) = handshake(b"0123456789abcdef", b"0123456789abcdef", Protection::Encrypted).unwrap();
        let (_, mut b) = handshake(b"0123456789abcdef", b"0123456789abcdef", Protection::Encrypted).unwrap();
        let mut r = vec![0u8; HEADER + 3 + TAG];
        a.sealer.seal(&mut r).unwrap();
        assert!(b.opener.open(&mut r).is_err());
    }
}
