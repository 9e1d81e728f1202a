//! Sealed records: how the bytes of an authenticated connection travel.
//!
//! After the handshake each direction of a connection
//! is a sequence of records, each sealed with AES-256-GCM under that
//! direction's key from the handshake:
//!
//! ```text
//!   length (u32, big-endian, at most MAX_RECORD) | payload (length bytes) | tag (16)
//! ```
//!
//! Each record is numbered in its direction, and the number is never sent:
//! a record dropped, repeated, reordered or moved to another connection
//! fails its tag, and so does any change to a length or a byte.
//!
//! * [`Protection::Encrypted`]: AES-256-GCM; the nonce is four zero bytes
//!   and the number as a big-endian u64 (as Noise numbers its messages), the
//!   length is the associated data, the payload is the ciphertext.
//! * [`Protection::Authenticated`] (`--no-encrypt`): the payload travels in
//!   the clear; the tag is the first 16 bytes of BLAKE3 keyed with a key
//!   derived from the direction's key, over the number, the length and the
//!   payload. Where the processor has AES instructions this costs about
//!   what encryption costs; where it has none, BLAKE3 is several times
//!   faster than AES done in software.
//!
//! No I/O here: [`Sealer`] and [`Opener`] work on buffers the caller owns.

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM, NONCE_LEN};
use subtle::ConstantTimeEq;

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
    #[error("a record of {0} bytes is longer than the {MAX_RECORD} allowed: the connection was changed in transit, or the peer does not seal its records")]
    TooLong(usize),
    #[error("a record failed its integrity check: the connection was changed in transit, or the peer is not who it claims")]
    Forged,
    #[error("the connection has carried 2^64 records; open a new one")]
    Exhausted,
}

/// How one direction's records are protected.
enum Key {
    Aead(Box<LessSafeKey>),
    Mac([u8; 32]),
}

/// One direction's key and record count.
struct Direction {
    key: Key,
    next: u64,
}

impl Direction {
    fn new(key: &[u8; 32], protection: Protection) -> Direction {
        let key = match protection {
            Protection::Encrypted => {
                Key::Aead(Box::new(LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key).expect("a 32-byte key is an AES-256 key"))))
            }
            Protection::Authenticated => Key::Mac(blake3::derive_key("dmover 2 record mac", key)),
        };
        Direction { key, next: 0 }
    }

    /// The number of the next record, which is then counted.
    fn number(&mut self) -> Result<u64, RecordError> {
        let n = self.next;
        self.next = n.checked_add(1).ok_or(RecordError::Exhausted)?;
        Ok(n)
    }
}

fn nonce(n: u64) -> Nonce {
    let mut b = [0u8; NONCE_LEN];
    b[4..].copy_from_slice(&n.to_be_bytes());
    Nonce::assume_unique_for_key(b)
}

/// The tag of integrity-only record number `n` covering `parts`, one
/// after the other.
fn mac(key: &[u8; 32], n: u64, parts: &[&[u8]]) -> [u8; TAG] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&n.to_be_bytes());
    for p in parts {
        h.update(p);
    }
    h.finalize().as_bytes()[..TAG].try_into().expect("a 16-byte prefix")
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
        let (header, rest) = record.split_at_mut(HEADER);
        let (payload, tag) = rest.split_at_mut(len);
        let (h, t) = self.seal_parts(payload)?;
        header.copy_from_slice(&h);
        tag.copy_from_slice(&t);
        Ok(())
    }

    /// Seals `payload` in place as the next record, whose header and tag
    /// lie apart from it: a writer can so send a buffer it will not send
    /// again without copying it first.
    pub fn seal_parts(&mut self, payload: &mut [u8]) -> Result<([u8; HEADER], [u8; TAG]), RecordError> {
        let len = payload.len();
        if len > MAX_RECORD {
            return Err(RecordError::TooLong(len));
        }
        let header = (len as u32).to_be_bytes();
        let n = self.0.number()?;
        let tag = match &self.0.key {
            Key::Aead(key) => {
                let sealed = key.seal_in_place_separate_tag(nonce(n), Aad::from(&header), payload);
                sealed.expect("sealing a bounded record cannot fail").as_ref().try_into().expect("a 16-byte tag")
            }
            Key::Mac(key) => mac(key, n, &[&header, payload]),
        };
        Ok((header, tag))
    }

    /// A tag over `aad` alone, as a record with no payload: the client's
    /// proof in the handshake.
    pub fn tag(&mut self, aad: &[u8]) -> Result<[u8; TAG], RecordError> {
        let n = self.0.number()?;
        Ok(match &self.0.key {
            Key::Aead(key) => {
                let tag = key.seal_in_place_separate_tag(nonce(n), Aad::from(aad), &mut []).expect("sealing nothing cannot fail");
                tag.as_ref().try_into().expect("a 16-byte tag")
            }
            Key::Mac(key) => mac(key, n, &[aad]),
        })
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
        let (covered, tag) = record.split_at_mut(HEADER + len);
        let tag: [u8; TAG] = (&*tag).try_into().expect("a 16-byte tag");
        let (header, payload) = covered.split_at_mut(HEADER);
        self.open_parts(header.try_into().expect("a 4-byte header"), payload, tag)?;
        Ok(payload)
    }

    /// Checks and opens, in place, a record whose parts lie apart: its
    /// header, its payload (as many bytes as the header says) and its tag.
    /// A reader that knows a record's length from its header can so take
    /// the payload straight into the buffer it is meant for.
    pub fn open_parts(&mut self, header: [u8; HEADER], payload: &mut [u8], tag: [u8; TAG]) -> Result<(), RecordError> {
        if payload.len() != Opener::payload_len(header)? {
            return Err(RecordError::Forged);
        }
        let n = self.0.number()?;
        match &self.0.key {
            Key::Aead(key) => {
                let opened = key.open_in_place_separate_tag(nonce(n), Aad::from(&header), Tag::from(tag), payload, 0..);
                opened.map(drop).map_err(|_| RecordError::Forged)
            }
            Key::Mac(key) => check(&mac(key, n, &[&header, payload]), &tag),
        }
    }

    /// Checks a tag made by [`Sealer::tag`] over `aad`.
    pub fn check_tag(&mut self, aad: &[u8], tag: &[u8; TAG]) -> Result<(), RecordError> {
        let n = self.0.number()?;
        match &self.0.key {
            Key::Aead(key) => {
                let opened = key.open_in_place_separate_tag(nonce(n), Aad::from(aad), Tag::from(*tag), &mut [], 0..);
                opened.map(|_| ()).map_err(|_| RecordError::Forged)
            }
            Key::Mac(key) => check(&mac(key, n, &[aad]), tag),
        }
    }
}

/// Compares tags in constant time.
fn check(expected: &[u8; TAG], got: &[u8; TAG]) -> Result<(), RecordError> {
    if bool::from(expected.ct_eq(got)) {
        Ok(())
    } else {
        Err(RecordError::Forged)
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
    fn a_record_opens_the_same_with_its_parts_apart() {
        for p in [Protection::Encrypted, Protection::Authenticated] {
            let (mut s, mut o) = pair(p);
            let mut r = record(b"apart");
            s.seal(&mut r).unwrap();
            let header: [u8; HEADER] = r[..HEADER].try_into().unwrap();
            let tag: [u8; TAG] = r[HEADER + 5..].try_into().unwrap();
            let mut payload = r[HEADER..HEADER + 5].to_vec();
            o.open_parts(header, &mut payload, tag).unwrap();
            assert_eq!(payload, b"apart", "{p:?}");
            // A payload of another length than its header says, or changed.
            let mut next = record(b"apart");
            s.seal(&mut next).unwrap();
            let header: [u8; HEADER] = next[..HEADER].try_into().unwrap();
            let tag: [u8; TAG] = next[HEADER + 5..].try_into().unwrap();
            assert_eq!(fresh(p).open_parts(header, &mut next[HEADER..HEADER + 4].to_vec(), tag), Err(RecordError::Forged), "{p:?}");
            let mut changed = next[HEADER..HEADER + 5].to_vec();
            changed[0] ^= 1;
            assert_eq!(o.open_parts(header, &mut changed, tag), Err(RecordError::Forged), "{p:?}");
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
