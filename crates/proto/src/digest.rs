//! Block checksums and file digests.
//!
//! Each block is checksummed with XXH3-128 where it is read, carried in the
//! block's header and checked where it is received. A file's digest is the
//! XXH3-128 of its block checksums in offset order, so both ends can build it
//! from blocks that arrive in any order, with no second pass over the data.

use twox_hash::XxHash3_128;

/// A 128-bit checksum, big-endian bytes.
pub type Sum = [u8; 16];

/// Checksum of one block.
pub fn block_sum(data: &[u8]) -> Sum {
    XxHash3_128::oneshot(data).to_be_bytes()
}

/// Checksum of a block of `len` zero bytes: what a block that lies in a
/// hole of its file checksums to, without reading it. Blocks of one size
/// are the rule, so each thread keeps the last one it computed.
pub fn zeros_sum(len: usize) -> Sum {
    use std::cell::Cell;
    static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];
    thread_local! {
        static LAST: Cell<Option<(usize, Sum)>> = const { Cell::new(None) };
    }
    if let Some((l, sum)) = LAST.get() {
        if l == len {
            return sum;
        }
    }
    let mut h = BlockHasher::new();
    let mut left = len;
    while left > 0 {
        let n = left.min(ZEROS.len());
        h.update(&ZEROS[..n]);
        left -= n;
    }
    let sum = h.finish();
    LAST.set(Some((len, sum)));
    sum
}

/// Checksum of one block fed in pieces as they are read, while each is
/// still in the CPU's cache; equal to [`block_sum`] of the whole block.
pub struct BlockHasher(XxHash3_128);

impl BlockHasher {
    pub fn new() -> BlockHasher {
        BlockHasher(XxHash3_128::new())
    }

    pub fn update(&mut self, piece: &[u8]) {
        self.0.write(piece);
    }

    pub fn finish(&self) -> Sum {
        self.0.finish_128().to_be_bytes()
    }
}

impl Default for BlockHasher {
    fn default() -> BlockHasher {
        BlockHasher::new()
    }
}

/// The digest of a file from its block checksums, in offset order.
pub fn file_digest<'a>(block_sums: impl IntoIterator<Item = &'a Sum>) -> Sum {
    let mut h = XxHash3_128::new();
    for s in block_sums {
        h.write(s);
    }
    h.finish_128().to_be_bytes()
}

/// An order-independent summary of a set of files: the sum (mod 2^128) of a
/// checksum of each file's (path, size, digest). Both ends compute it
/// independently; equal values mean they agree on every file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetDigest(pub u128);

impl SetDigest {
    pub fn add(&mut self, path: &str, size: u64, digest: &Sum) {
        let mut h = XxHash3_128::new();
        h.write(&(path.len() as u64).to_be_bytes());
        h.write(path.as_bytes());
        h.write(&size.to_be_bytes());
        h.write(digest);
        self.0 = self.0.wrapping_add(h.finish_128());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_sum_is_the_checksum_of_zero_bytes() {
        for len in [0, 1, 65536, 65537, 1 << 20, 1 << 20, 3] {
            assert_eq!(zeros_sum(len), block_sum(&vec![0; len]), "{len} bytes");
        }
    }

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

    /// Bytes that repeat only every 2 MiB, so no test block is made of
    /// copies of a shorter run.
    fn sample(len: usize) -> Vec<u8> {
        (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect()
    }

    fn hex(sum: Sum) -> String {
        format!("{:032x}", u128::from_be_bytes(sum))
    }

    /// XXH3-128 (seed 0) of `sample(len)`, as the wire carries it: a change
    /// here is a change of the protocol. The lengths reach both ends of each
    /// of the algorithm's size classes (0, 1–3, 4–8, 9–16, 17–128, 129–240,
    /// longer) and pass its 1 KiB block.
    const KNOWN: [(usize, &str); 15] = [
        (0, "99aa06d3014798d86001c324468d497f"),
        (1, "a6cd5e9392000f6ac44bdff4074eecdb"),
        (3, "95c705060a313bf8a1c4a8259b827291"),
        (4, "afbf64f9281b8de2fde8d93ae8794d8e"),
        (8, "2761698c33953c430234362aaf47b71a"),
        (9, "0d39db6431d37a74895c8a562da51412"),
        (16, "29be75b0bbbb5284aafffcec5df2cb27"),
        (17, "db7e8f77961e47fd878751509ecfdb8b"),
        (128, "ba44fd018231af4cbbe087d879edcc78"),
        (129, "522c922743fd67f1b8075934107218e5"),
        (240, "4f49ccc8526aa7ad407883ea5ef95b9a"),
        (241, "50b62ee1ee6455a7bc424a2c480dd281"),
        (1024, "53bd178b75ab292e1fd15e7d36f5e1bc"),
        (65_536, "463ae68f708ee10132152aa15c5ff65a"),
        ((1 << 20) + 7, "8119ab399ae5fb2ca80bea05304486e6"),
    ];

    #[test]
    fn block_sums_are_the_known_digests_however_the_block_is_split() {
        let data = sample((1 << 20) + 7);
        // Each split is a cycle of piece lengths, uneven so that pieces end
        // on every side of the 64-byte stripes and 256-byte buffer.
        let splits: [&[usize]; 7] = [&[1], &[7], &[64], &[255, 1, 256, 257], &[1000], &[3, 65_536, 17, 129], &[1 << 20]];
        for (len, want) in KNOWN {
            let block = &data[..len];
            assert_eq!(hex(block_sum(block)), want, "length {len}");
            for split in splits {
                let mut h = BlockHasher::new();
                let mut rest = block;
                for &piece in split.iter().cycle() {
                    if rest.is_empty() {
                        break;
                    }
                    let (now, later) = rest.split_at(piece.min(rest.len()));
                    h.update(now);
                    rest = later;
                }
                assert_eq!(hex(h.finish()), want, "length {len} in pieces of {split:?}");
            }
        }
    }

    #[test]
    fn file_and_set_digests_are_the_known_values() {
        let data = sample(65_536);
        let sums: Vec<Sum> = [0, 1, 240, 241, 65_536].map(|len| block_sum(&data[..len])).to_vec();
        assert_eq!(hex(file_digest(&sums)), "8f62eef22952aa40c0fa418d5c12f89f");
        assert_eq!(hex(file_digest([])), KNOWN[0].1);
        let mut set = SetDigest::default();
        set.add("a/b", 12_345, &sums[2]);
        set.add("x", 0, &sums[0]);
        assert_eq!(format!("{:032x}", set.0), "4a264fc79dec7f44f5433ffb4259ced8");
    }

    #[test]
    fn file_digest_depends_on_order() {
        let s1 = block_sum(b"one");
        let s2 = block_sum(b"two");
        assert_ne!(file_digest([&s1, &s2]), file_digest([&s2, &s1]));
    }
}
