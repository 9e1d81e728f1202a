//! Sealed records: how the bytes of an authenticated connection travel.
//!
//! After the handshake (see [`crate::auth`]) each direction of a connection
//! is a sequence of records, each sealed with AES-256-GCM under that
//! direction's key from the handshake:
//!
//! ```text
//!   length (u32, big-endian, at most MAX_RECORD) | payload (length bytes) | tag (16)
//! ```
//!
//! The nonce is the record's number in its direction (four zero bytes, then
//! the number as a big-endian u64, as Noise numbers its messages), never
//! sent: a record dropped, repeated, reordered or moved to another
//! connection fails its tag, and so does any change to a length or a byte.
//! With [`Protection::Encrypted`] the payload is the ciphertext and the
//! length is the associated data; with [`Protection::Authenticated`]
//! (`--no-encrypt`) the payload travels in the clear and the tag covers the
//! length and the payload (GMAC), so nothing can be changed undetected.
//!
//! No I/O here: [`Sealer`] and [`Opener`] work on buffers the caller owns.

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM, NONCE_LEN};

/// Bytes before a record's payload: its length.
pub const HEADER: usize = 4;
/// Bytes after a record's payload: its tag.
pub const TAG: usize = 16;
/// Largest payload of one record. A reader sets aside this much (plus
/// header and tag) per connection, whatever the peer says.
pub const MAX_RECORD: usize = 64 * 1024;

/// What a connection's records protect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Protection {
    /// Confidentiality and integrity: payloads are encrypted (the default).
    Encrypted = 1,
    /// Integrity only: payloads travel in the clear, and every byte is
    /// still covered by a keyed tag (`--no-encrypt`, for trusted networks).
    Authenticated = 2,
}

impl Protection {
    pub fn from_u8(b: u8) -> Option<Protection> {
        match b {
            1 => Some(Protection::Encrypted),
            2 => Some(Protection::Authenticated),
            _ => None,
        }
    }
}

/// Why a record was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("a record of {0} bytes is longer than the {MAX_RECORD} allowed")]
    TooLong(usize),
    #[error("a record failed its integrity check: the connection was changed in transit, or the peer is not who it claims")]
    Forged,
    #[error("the connection has carried 2^64 records; open a new one")]
    Exhausted,
}

/// One direction's key and record count.
struct Direction {
    key: LessSafeKey,
    protection: Protection,
    next: u64,
}

impl Direction {
    fn new(key: &[u8; 32], protection: Protection) -> Direction {
        let key = UnboundKey::new(&AES_256_GCM, key).expect("a 32-byte key is an AES-256 key");
        Direction { key: LessSafeKey::new(key), protection, next: 0 }
    }

    /// The nonce of the next record, which is then counted.
    fn nonce(&mut self) -> Result<Nonce, RecordError> {
        let n = self.next;
        self.next = n.checked_add(1).ok_or(RecordError::Exhausted)?;
        let mut b = [0u8; NONCE_LEN];
        b[4..].copy_from_slice(&n.to_be_bytes());
        Ok(Nonce::assume_unique_for_key(b))
    }
}

/// Seals the records one end sends.
pub struct Sealer(Direction);

impl Sealer {
    pub fn new(key: &[u8; 32], protection: Protection) -> Sealer {
        Sealer(Direction::new(key, protection))
    }

    /// Seals `record`, laid out as [`HEADER`] bytes of room, the payload
    /// (at most [`MAX_RECORD`] bytes) and [`TAG`] bytes of room: fills in
    /// the length and the tag, and encrypts the payload in place unless
    /// the protection is integrity only.
    pub fn seal(&mut self, record: &mut [u8]) -> Result<(), RecordError> {
        let len = record.len() - HEADER - TAG;
        if len > MAX_RECORD {
            return Err(RecordError::TooLong(len));
        }
        record[..HEADER].copy_from_slice(&(len as u32).to_be_bytes());
        let nonce = self.0.nonce()?;
        let (covered, tag) = record.split_at_mut(HEADER + len);
        let sealed = match self.0.protection {
            Protection::Encrypted => {
                let (header, payload) = covered.split_at_mut(HEADER);
                self.0.key.seal_in_place_separate_tag(nonce, Aad::from(&*header), payload)
            }
            Protection::Authenticated => self.0.key.seal_in_place_separate_tag(nonce, Aad::from(&*covered), &mut []),
        };
        tag.copy_from_slice(sealed.expect("sealing a bounded record cannot fail").as_ref());
        Ok(())
    }

    /// A tag over `aad` alone, as a record with no payload: the client's
    /// proof in the handshake.
    pub fn tag(&mut self, aad: &[u8]) -> Result<[u8; TAG], RecordError> {
        let nonce = self.0.nonce()?;
        let tag = self.0.key.seal_in_place_separate_tag(nonce, Aad::from(aad), &mut []).expect("sealing nothing cannot fail");
        Ok(tag.as_ref().try_into().expect("a 16-byte tag"))
    }
}

/// Opens the records one end receives.
pub struct Opener(Direction);

impl Opener {
    pub fn new(key: &[u8; 32], protection: Protection) -> Opener {
        Opener(Direction::new(key, protection))
    }

    /// The payload length a record header announces, refused beyond
    /// [`MAX_RECORD`] before anything is set aside for it.
    pub fn payload_len(header: [u8; HEADER]) -> Result<usize, RecordError> {
        let len = u32::from_be_bytes(header) as usize;
        if len > MAX_RECORD {
            return Err(RecordError::TooLong(len));
        }
        Ok(len)
    }

    /// Checks and opens a whole record (header, payload, tag) in place;
    /// returns its payload. A record that fails its check is refused and
    /// the connection is useless from then on.
    pub fn open<'a>(&mut self, record: &'a mut [u8]) -> Result<&'a [u8], RecordError> {
        if record.len() < HEADER + TAG {
            return Err(RecordError::Forged);
        }
        let header: [u8; HEADER] = record[..HEADER].try_into().expect("a 4-byte header");
        let len = Opener::payload_len(header)?;
        if record.len() != HEADER + len + TAG {
            return Err(RecordError::Forged);
        }
        let nonce = self.0.nonce()?;
        let (covered, tag) = record.split_at_mut(HEADER + len);
        let tag = Tag::from(<[u8; TAG]>::try_from(&*tag).expect("a 16-byte tag"));
        match self.0.protection {
            Protection::Encrypted => {
                let (header, payload) = covered.split_at_mut(HEADER);
                let opened = self.0.key.open_in_place_separate_tag(nonce, Aad::from(&*header), tag, payload, 0..);
                opened.map(|p| &*p).map_err(|_| RecordError::Forged)
            }
            Protection::Authenticated => {
                self.0.key.open_in_place_separate_tag(nonce, Aad::from(&*covered), tag, &mut [], 0..).map_err(|_| RecordError::Forged)?;
                Ok(&covered[HEADER..])
            }
        }
    }

    /// Checks a tag made by [`Sealer::tag`] over `aad`.
    pub fn check_tag(&mut self, aad: &[u8], tag: &[u8; TAG]) -> Result<(), RecordError> {
        let nonce = self.0.nonce()?;
        let tag = Tag::from(*tag);
        self.0.key.open_in_place_separate_tag(nonce, Aad::from(aad), tag, &mut [], 0..).map(|_| ()).map_err(|_| RecordError::Forged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(payload: &[u8]) -> Vec<u8> {
        let mut r = vec![0u8; HEADER];
        r.extend_from_slice(payload);
        r.extend_from_slice(&[0u8; TAG]);
        r
    }

    fn fresh(p: Protection) -> Opener {
        Opener::new(&[7; 32], p)
    }

    fn pair(p: Protection) -> (Sealer, Opener) {
        (Sealer::new(&[7; 32], p), Opener::new(&[7; 32], p))
    }

    #[test]
    fn records_open_in_order_and_hide_their_payload_when_encrypted() {
        for p in [Protection::Encrypted, Protection::Authenticated] {
            let (mut s, mut o) = pair(p);
            for msg in [&b"first"[..], b"", &[9u8; MAX_RECORD]] {
                let mut r = record(msg);
                s.seal(&mut r).unwrap();
                let shown = r[HEADER..HEADER + msg.len()].to_vec();
                assert_eq!(shown == msg, p == Protection::Authenticated || msg.is_empty(), "{p:?}");
                assert_eq!(o.open(&mut r).unwrap(), msg);
            }
        }
    }

    #[test]
    fn any_change_reorder_replay_or_wrong_key_is_refused() {
        for p in [Protection::Encrypted, Protection::Authenticated] {
            let (mut s, _) = pair(p);
            let mut a = record(b"alpha");
            let mut b = record(b"bravo");
            s.seal(&mut a).unwrap();
            s.seal(&mut b).unwrap();
            // Every single flipped bit, anywhere in the record.
            for i in 0..a.len() * 8 {
                let mut x = a.clone();
                x[i / 8] ^= 1 << (i % 8);
                assert!(fresh(p).open(&mut x).is_err(), "{p:?}: bit {i} flipped went undetected");
            }
            // Out of order, or the same record twice.
            assert_eq!(fresh(p).open(&mut b.clone()), Err(RecordError::Forged));
            let mut o = fresh(p);
            o.open(&mut a.clone()).unwrap();
            assert_eq!(o.open(&mut a.clone()), Err(RecordError::Forged));
            // Another key.
            assert_eq!(Opener::new(&[8; 32], p).open(&mut a.clone()), Err(RecordError::Forged));
            // The other protection.
            let q = if p == Protection::Encrypted { Protection::Authenticated } else { Protection::Encrypted };
            assert_eq!(Opener::new(&[7; 32], q).open(&mut a.clone()), Err(RecordError::Forged));
        }
    }

    #[test]
    fn lengths_are_bounded_before_anything_is_sized() {
        assert_eq!(Opener::payload_len((MAX_RECORD as u32 + 1).to_be_bytes()), Err(RecordError::TooLong(MAX_RECORD + 1)));
        assert_eq!(Opener::payload_len(u32::MAX.to_be_bytes()), Err(RecordError::TooLong(u32::MAX as usize)));
        let mut big = record(&vec![0; MAX_RECORD + 1]);
        assert_eq!(Sealer::new(&[1; 32], Protection::Encrypted).seal(&mut big), Err(RecordError::TooLong(MAX_RECORD + 1)));
        assert_eq!(Opener::new(&[1; 32], Protection::Encrypted).open(&mut [0u8; 3]), Err(RecordError::Forged));
    }

    #[test]
    fn tags_prove_the_key_over_their_data() {
        let mut s = Sealer::new(&[3; 32], Protection::Encrypted);
        let t = s.tag(b"handshake hash").unwrap();
        Opener::new(&[3; 32], Protection::Encrypted).check_tag(b"handshake hash", &t).unwrap();
        assert!(Opener::new(&[3; 32], Protection::Encrypted).check_tag(b"handshake hasH", &t).is_err());
        assert!(Opener::new(&[4; 32], Protection::Encrypted).check_tag(b"handshake hash", &t).is_err());
    }
}
