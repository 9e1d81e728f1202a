//! Sparse blocks on the wire: a block that lies partly in a hole of its
//! file travels without its pages of zeros. Its data frame (flag
//! [`DATA_SPARSE`](crate::frame::DATA_SPARSE)) carries, after the data
//! header, the block's length (u32), a bitmap of its [`PAGE`]-byte pages
//! (bit `i % 8` of byte `i / 8` set when page `i` comes), and the pages
//! that come, in order; the others read as zeros. The block's checksum is
//! the whole block's, so the receiver checks what it rebuilt.

/// The size of the pages a sparse block leaves out when they hold only zeros.
pub const PAGE: usize = 4096;

/// The most bytes that go before a sparse block's pages: its length and
/// the bitmap of the largest block.
pub const MAX_PREFIX: usize = 4 + (crate::frame::MAX_BLOCK as usize / PAGE).div_ceil(8);

/// Bytes of the bitmap of a block of `len` bytes.
pub fn bitmap_len(len: usize) -> usize {
    len.div_ceil(PAGE).div_ceil(8)
}

/// Bytes of the pages that come, by the bitmap of a block of `len` bytes
/// (the last page may be short).
pub fn packed_len(len: usize, bitmap: &[u8]) -> usize {
    (0..len.div_ceil(PAGE)).filter(|&i| came(bitmap, i)).map(|i| PAGE.min(len - i * PAGE)).sum()
}

fn came(bitmap: &[u8], page: usize) -> bool {
    bitmap.get(page / 8).is_some_and(|b| b & (1 << (page % 8)) != 0)
}

/// Packs `block` in place: moves its pages that hold anything but zeros
/// to its front, in order. Returns what goes before them on the wire (the
/// length and the bitmap) and how many bytes of `block` they now take;
/// None (and `block` untouched) if no page holds only zeros, when the
/// block is better sent as it is.
pub fn pack(block: &mut [u8]) -> Option<(Vec<u8>, usize)> {
    let len = block.len();
    let mut prefix = Vec::with_capacity(4 + bitmap_len(len));
    prefix.extend_from_slice(&(len as u32).to_be_bytes());
    prefix.resize(4 + bitmap_len(len), 0);
    let mut kept = 0;
    let mut any_zeros = false;
    for (i, start) in (0..len).step_by(PAGE).enumerate() {
        let end = (start + PAGE).min(len);
        if block[start..end].iter().all(|&b| b == 0) {
            any_zeros = true;
            continue;
        }
        prefix[4 + i / 8] |= 1 << (i % 8);
        block.copy_within(start..end, kept);
        kept += end - start;
    }
    if !any_zeros {
        // Nothing moved: every page was kept where it was.
        return None;
    }
    Some((prefix, kept))
}

/// Rebuilds in place a block whose pages that came (`packed` bytes, per
/// `bitmap`) are at the front of `block`, which is the block's length:
/// each page goes to its place, zeros between. Fails if the bitmap and
/// `packed` disagree.
pub fn unpack(block: &mut [u8], bitmap: &[u8], packed: usize) -> Result<(), &'static str> {
    let len = block.len();
    let pages = len.div_ceil(PAGE);
    let past_the_end = (pages..bitmap.len() * 8).any(|i| came(bitmap, i));
    if bitmap.len() != bitmap_len(len) || past_the_end || packed_len(len, bitmap) != packed || packed > len {
        return Err("a sparse block's bitmap does not match its length or its bytes");
    }
    // From the last page back, so that no page is overwritten before it moves.
    let mut from = packed;
    for i in (0..len.div_ceil(PAGE)).rev() {
        let start = i * PAGE;
        let end = (start + PAGE).min(len);
        if came(bitmap, i) {
            from -= end - start;
            block.copy_within(from..from + (end - start), start);
        } else {
            block[start..end].fill(0);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Packing and unpacking give the block back, whichever pages hold
        /// zeros and whatever its length.
        #[test]
        fn unpacking_a_packed_block_gives_it_back(len in 1usize..70_000, pages in proptest::collection::vec(any::<bool>(), 18), seed: u8) {
            let block: Vec<u8> = (0..len).map(|i| if pages[i / PAGE] { (i as u8).wrapping_mul(31).wrapping_add(seed) | 1 } else { 0 }).collect();
            let mut buf = block.clone();
            match pack(&mut buf) {
                None => prop_assert!(block.chunks(PAGE).all(|p| p.iter().any(|&b| b != 0))),
                Some((prefix, packed)) => {
                    prop_assert_eq!(u32::from_be_bytes(prefix[..4].try_into().unwrap()) as usize, len);
                    prop_assert_eq!(packed, packed_len(len, &prefix[4..]));
                    prop_assert!(packed < len);
                    unpack(&mut buf, &prefix[4..], packed).unwrap();
                    prop_assert_eq!(buf, block);
                }
            }
        }
    }

    #[test]
    fn a_bitmap_that_disagrees_is_refused() {
        let mut block = vec![0u8; 3 * PAGE];
        assert!(unpack(&mut block, &[0b011], PAGE).is_err(), "two pages said, one sent");
        assert!(unpack(&mut block, &[0b001, 0], PAGE).is_err(), "a bitmap too long");
        assert!(unpack(&mut block, &[0b1000], 0).is_err(), "a page past the end");
        assert!(unpack(&mut block, &[0b001], PAGE).is_ok());
    }
}
