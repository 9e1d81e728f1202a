//! Block checksums and file digests.
//!
//! Each block is checksummed with XXH3-128 where it is read, carried in the
//! block's header and checked where it is received. A file's digest is the
//! XXH3-128 of its block checksums in offset order, so both ends can build it
//! from blocks that arrive in any order, with no second pass over the data.

use xxhash_rust::xxh3::{xxh3_128, Xxh3};

/// A 128-bit checksum, big-endian bytes.
pub type Sum = [u8; 16];

/// Checksum of one block.
pub fn block_sum(data: &[u8]) -> Sum {
    xxh3_128(data).to_be_bytes()
}

/// Checksum of one block fed in pieces as they are read, while each is
/// still in the CPU's cache; equal to [`block_sum`] of the whole block.
pub struct BlockHasher(Xxh3);

impl BlockHasher {
    pub fn new() -> BlockHasher {
        BlockHasher(Xxh3::new())
    }

    pub fn update(&mut self, piece: &[u8]) {
        self.0.update(piece);
    }

    pub fn finish(&self) -> Sum {
        self.0.digest128().to_be_bytes()
    }
}

impl Default for BlockHasher {
    fn default() -> BlockHasher {
        BlockHasher::new()
    }
}

/// The digest of a file from its block checksums, in offset order.
pub fn file_digest<'a>(block_sums: impl IntoIterator<Item = &'a Sum>) -> Sum {
    let mut h = Xxh3::new();
    for s in block_sums {
        h.update(s);
    }
    h.digest128().to_be_bytes()
}

/// An order-independent summary of a set of files: the sum (mod 2^128) of a
/// checksum of each file's (path, size, digest). Both ends compute it
/// independently; equal values mean they agree on every file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetDigest(pub u128);

impl SetDigest {
    pub fn add(&mut self, path: &str, size: u64, digest: &Sum) {
        let mut h = Xxh3::new();
        h.update(&(path.len() as u64).to_be_bytes());
        h.update(path.as_bytes());
        h.update(&size.to_be_bytes());
        h.update(digest);
        self.0 = self.0.wrapping_add(h.digest128());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_digest_is_order_independent() {
        let (mut a, mut b) = (SetDigest::default(), SetDigest::default());
        a.add("x", 1, &[1; 16]);
        a.add("y", 2, &[2; 16]);
        b.add("y", 2, &[2; 16]);
        b.add("x", 1, &[1; 16]);
        assert_eq!(a, b);
        b.add("z", 0, &[0; 16]);
        assert_ne!(a, b);
    }

    #[test]
    fn a_block_hashed_in_pieces_has_the_same_sum() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0, 1, 16, 17, 128, 129, 240, 241, 1024, 1025, 65_536, 300_000] {
            for piece in [1, 7, 64, 1000, 65_536, 1 << 20] {
                let mut h = BlockHasher::new();
                data[..len].chunks(piece).for_each(|c| h.update(c));
                assert_eq!(h.finish(), block_sum(&data[..len]), "length {len} in pieces of {piece}");
            }
        }
    }

    #[test]
    fn file_digest_depends_on_order() {
        let s1 = block_sum(b"one");
        let s2 = block_sum(b"two");
        assert_ne!(file_digest([&s1, &s2]), file_digest([&s2, &s1]));
    }
}
