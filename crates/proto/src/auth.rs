//! Challenge–response authentication with a shared secret.
//!
//! The secret (the server's token, or a ticket the server issued)
//! never crosses the wire. Each side sends a fresh 32-byte nonce; each proves
//! it knows the secret with a keyed BLAKE3 MAC over both nonces, under a
//! different label for each direction so that one proof cannot be replayed as
//! the other. Both sides then derive a session key from the same inputs; it
//! is used to wrap secrets handed over the connection (tickets).
//!
//! The steps (see `docs/PROTOCOL.md`):
//! 1. client → server: `Hello { version, key_id, client_nonce }`
//! 2. server → client: `Challenge { server_nonce, server_proof }`
//! 3. client → server: `Proof { client_proof }` (after checking `server_proof`)
//! 4. server → client: `Welcome` or `Error`

/// A 32-byte key derived from a token or ticket secret.
#[derive(Clone)]
pub struct Key([u8; 32]);

/// A nonce, fresh for every connection.
pub type Nonce = [u8; 32];
/// A proof or MAC.
pub type Mac = [u8; 32];

/// Identifies which secret a client uses: all zeros is the server's token,
/// anything else names a ticket the server issued.
pub type KeyId = [u8; 16];
pub const TOKEN_KEY_ID: KeyId = [0; 16];

/// Shortest token a server accepts, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

impl Key {
    /// The key for a token or ticket secret.
    pub fn from_secret(secret: &[u8]) -> Key {
        let mut h = blake3::Hasher::new_derive_key("dmover 1 authentication key");
        h.update(secret);
        Key(*h.finalize().as_bytes())
    }

    fn mac(&self, label: &[u8], a: &Nonce, b: &Nonce) -> Mac {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(label);
        h.update(a);
        h.update(b);
        *h.finalize().as_bytes()
    }

    /// The server's proof: MAC("server", client_nonce, server_nonce).
    pub fn server_proof(&self, client: &Nonce, server: &Nonce) -> Mac {
        self.mac(b"dmover server proof", client, server)
    }

    /// The client's proof: MAC("client", server_nonce, client_nonce).
    pub fn client_proof(&self, client: &Nonce, server: &Nonce) -> Mac {
        self.mac(b"dmover client proof", server, client)
    }

    /// The key both ends derive for this connection.
    pub fn session_key(&self, client: &Nonce, server: &Nonce) -> SessionKey {
        SessionKey(self.mac(b"dmover session key", client, server))
    }
}

/// Compares two MACs in constant time.
pub fn mac_eq(a: &Mac, b: &Mac) -> bool {
    blake3::Hash::from(*a) == blake3::Hash::from(*b)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_secret_and_direction() {
        let (k, other) = (Key::from_secret(b"0123456789abcdef"), Key::from_secret(b"0123456789abcdeX"));
        let (c, s) = ([1u8; 32], [2u8; 32]);
        assert!(mac_eq(&k.client_proof(&c, &s), &k.client_proof(&c, &s)));
        assert!(!mac_eq(&k.client_proof(&c, &s), &other.client_proof(&c, &s)));
        assert!(!mac_eq(&k.client_proof(&c, &s), &k.server_proof(&c, &s)));
        assert!(!mac_eq(&k.client_proof(&c, &s), &k.client_proof(&s, &c)));
    }

    #[test]
    fn wrap_round_trips() {
        let sk = Key::from_secret(b"token-token-token").session_key(&[3; 32], &[4; 32]);
        let secret = [9u8; 32];
        let wrapped = sk.wrap(b"t", &secret);
        assert_ne!(wrapped, secret);
        assert_eq!(sk.wrap(b"t", &wrapped), secret);
    }
}
