//! How an object is cut into the parts of its multipart upload: part
//! `index` (from 0) covers `start(index)..start(index) + len(index)`.

/// Size of the first parts of a multipart upload (see [`len`]): small
/// enough that the default memory bound holds 8 of them, being filled and
/// sent at once (at 1 Gbit/s and 50 ms, 4 × 1 GiB went up in 47 s with
/// 8 MiB parts, in 82 s with 16 MiB ones: the bound held 4 of those, the
/// parts being filled took most of it, and one part was sent at a time).
pub(super) const FIRST_PART: u64 = 8 << 20;
/// Parts of each size: each next [`PARTS_PER_SIZE`] parts are twice as
/// large as the last, up to [`MAX_PARTS`] (so objects up to 15.6 GiB have
/// parts of 8 MiB, and the largest object is 484 GiB).
const PARTS_PER_SIZE: u64 = 2_000;
/// The most parts S3 takes in one upload.
pub(super) const MAX_PARTS: u64 = 10_000;

/// The size of part `index` (at most [`MAX_PARTS`]): [`FIRST_PART`],
/// doubled every [`PARTS_PER_SIZE`] parts.
pub(super) fn len(index: u64) -> u64 {
    FIRST_PART << (index / PARTS_PER_SIZE)
}

/// The offset part `index` starts at.
pub(super) fn start(index: u64) -> u64 {
    let size = index / PARTS_PER_SIZE;
    PARTS_PER_SIZE * FIRST_PART * ((1 << size) - 1) + (index % PARTS_PER_SIZE) * len(index)
}

/// The part that holds offset `off`: [`MAX_PARTS`] past the largest object.
pub(super) fn at(off: u64) -> u64 {
    (0..MAX_PARTS / PARTS_PER_SIZE)
        .map(|size| size * PARTS_PER_SIZE)
        .find(|&first| off < start(first + PARTS_PER_SIZE))
        .map_or(MAX_PARTS, |first| first + (off - start(first)) / len(first))
}

/// The largest object.
pub(super) fn max_object() -> u64 {
    start(MAX_PARTS)
}

#[cfg(test)]
mod tests {
    use super::{self as part, FIRST_PART, MAX_PARTS, PARTS_PER_SIZE};

    #[test]
    fn parts_tile_an_object_and_grow() {
        assert_eq!((part::start(0), part::len(0)), (0, FIRST_PART));
        // Around each change of size: each part ends where the next begins,
        // and every offset in it is found in it.
        for size in 0..MAX_PARTS / PARTS_PER_SIZE {
            let first = size * PARTS_PER_SIZE;
            for index in (first.saturating_sub(2)..first + 2).chain(first + PARTS_PER_SIZE - 2..first + PARTS_PER_SIZE) {
                let (start, len) = (part::start(index), part::len(index));
                assert_eq!(len, FIRST_PART << (index / PARTS_PER_SIZE), "part {index}");
                assert_eq!(part::start(index + 1), start + len, "part {index}");
                for off in [start, start + 1, start + len / 2, start + len - 1] {
                    assert_eq!(part::at(off), index, "offset {off}");
                }
            }
        }
        assert_eq!(part::max_object(), part::start(MAX_PARTS - 1) + part::len(MAX_PARTS - 1));
        assert_eq!(part::max_object() >> 30, 484);
        assert_eq!((part::at(part::max_object() - 1), part::at(part::max_object())), (MAX_PARTS - 1, MAX_PARTS));
    }
}
