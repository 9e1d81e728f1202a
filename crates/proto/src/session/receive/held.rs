//! The blocks of one file that the receiving end holds, with their
//! checksums, kept by what has arrived rather than by the size the sender
//! announced: in runs of [`RUN`] consecutive blocks, each made when the
//! first of its blocks comes. A file announced at the most blocks a file
//! may have costs nothing until its blocks arrive; a block that arrives
//! alone costs one run (about 300 bytes), and a file whose blocks have all
//! come about 18 bytes a block.

use crate::digest::Sum;
use std::collections::BTreeMap;

/// Blocks per run.
const RUN: u64 = 16;

/// The checksums of the blocks of one run.
#[derive(Debug)]
struct Run {
    /// Bit `i`: block `RUN * run + i` is held.
    held: u16,
    sums: [Sum; RUN as usize],
}

/// The blocks of a file held, and their checksums.
#[derive(Debug, Default)]
pub(super) struct Held {
    /// By run number; a run is boxed so that the map's nodes stay small
    /// when few runs are held.
    runs: BTreeMap<u64, Box<Run>>,
    count: u64,
}

impl Held {
    /// How many blocks are held.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Holds `sum` for `block` unless the block is held already; whether it
    /// was not.
    pub fn insert(&mut self, block: u64, sum: Sum) -> bool {
        let (run, bit) = (block / RUN, 1u16 << (block % RUN));
        let r = self.runs.entry(run).or_insert_with(|| Box::new(Run { held: 0, sums: [[0; 16]; RUN as usize] }));
        if r.held & bit != 0 {
            return false;
        }
        r.held |= bit;
        r.sums[(block % RUN) as usize] = sum;
        self.count += 1;
        true
    }

    /// Stops holding `block`.
    pub fn remove(&mut self, block: u64) {
        let (run, bit) = (block / RUN, 1u16 << (block % RUN));
        let Some(r) = self.runs.get_mut(&run) else { return };
        if r.held & bit != 0 {
            r.held &= !bit;
            self.count -= 1;
        }
        if r.held == 0 {
            self.runs.remove(&run);
        }
    }

    /// The blocks held with their checksums, in order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Sum)> {
        self.runs
            .iter()
            .flat_map(|(run, r)| (0..RUN).filter(move |i| r.held & (1 << i) != 0).map(move |i| (run * RUN + i, &r.sums[i as usize])))
    }

    /// The blocks of `0..blocks` not held, coalesced into ranges.
    pub fn missing(&self, blocks: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut next = 0;
        for (b, _) in self.iter() {
            if b > next {
                out.push((next, b));
            }
            next = b + 1;
        }
        if next < blocks {
            out.push((next, blocks));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_coalesce_around_the_blocks_held() {
        let mut h = Held::default();
        assert_eq!(h.missing(0), vec![]);
        assert_eq!(h.missing(5), vec![(0, 5)]);
        for b in [0, 3, 17, 18, 40] {
            assert!(h.insert(b, [b as u8; 16]));
        }
        assert!(!h.insert(3, [9; 16]), "a block held twice");
        assert_eq!(h.count(), 5);
        assert_eq!(h.missing(41), vec![(1, 3), (4, 17), (19, 40)]);
        assert_eq!(h.missing(50), vec![(1, 3), (4, 17), (19, 40), (41, 50)]);
        h.remove(17);
        h.remove(17);
        h.remove(99);
        assert_eq!(h.count(), 4);
        let held: Vec<(u64, Sum)> = h.iter().map(|(b, s)| (b, *s)).collect();
        assert_eq!(held, vec![(0, [0; 16]), (3, [3; 16]), (18, [18; 16]), (40, [40; 16])]);
    }

    /// A file of the most blocks a file may have, announced: nothing is
    /// held until its blocks come, and then a run for each.
    #[test]
    fn only_the_runs_of_blocks_that_came_are_kept() {
        let mut h = Held::default();
        let last = crate::frame::MAX_FILE_BLOCKS - 1;
        assert_eq!(h.missing(last + 1), vec![(0, last + 1)]);
        assert!(h.runs.is_empty());
        h.insert(last, [1; 16]);
        h.insert(0, [2; 16]);
        assert_eq!(h.runs.len(), 2);
        assert_eq!(h.missing(last + 1), vec![(1, last)]);
        h.remove(0);
        assert_eq!(h.runs.len(), 1, "an empty run is kept");
    }
}
