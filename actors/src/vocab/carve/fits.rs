//! Best fit by index over mapped memory: the parts of a range's free ranges that lie in mapped
//! granules ("fits"), ordered by length, so that a request that mapped memory can serve is one
//! logarithmic lookup (PyTorch's `lower_bound` on its free blocks) instead of a scan. A pure
//! data structure: offsets and granule numbers only, no memory, no actors.
//!
//! Owns the mapped runs of granules (maximal, coalesced) and the index of fits. Its owner tells
//! it when granules are mapped or unmapped and, after any change of its free ranges or its
//! mapping inside a span, which free ranges lie in that span now ([`Fits::refit`]). It keeps
//! these rules:
//! - a fit lies inside one free range and inside one mapped run, and is as long as both
//!   allow (a free range holds one fit per mapped run it overlaps);
//! - after `refit` of a span, no fit of a free range that no longer exists remains in it:
//!   every fit lies in a free range that exists, so handing one out never lends a range
//!   twice or lends unmapped memory;
//! - the range is split into two zones at a boundary (small blocks above it, large ones
//!   below, as PyTorch keeps small and large pools apart: a small block left in a granule
//!   keeps the free memory around it from coalescing into room for a large one); a fit lies
//!   in one zone;
//! - the best fit for `want` bytes in a zone is the shortest fit of at least `want` bytes
//!   there, the lowest offset among equals.

use std::collections::{BTreeMap, BTreeSet};

/// The mapped parts of free ranges of one range of `granule`-sized granules.
#[derive(Debug, Default)]
pub(crate) struct Fits {
    granule: usize,
    /// Where the upper zone begins (an offset).
    boundary: usize,
    /// Mapped runs of granules: first granule -> one past the last. Never two that touch.
    runs: BTreeMap<usize, usize>,
    /// Fits as (length, offset), per zone (lower, upper).
    by_len: [BTreeSet<(usize, usize)>; 2],
    /// Fits as offset -> length.
    by_off: BTreeMap<usize, usize>,
}

impl Fits {
    /// No granule mapped, no fit; the upper zone begins at offset `boundary`.
    pub(crate) fn new(granule: usize, boundary: usize) -> Self {
        Self {
            granule: granule.max(1),
            boundary,
            ..Self::default()
        }
    }

    /// The zone of a fit at `offset`: 0 below the boundary, 1 from it on.
    pub(crate) fn zone(&self, offset: usize) -> usize {
        usize::from(offset >= self.boundary)
    }

    /// Where the upper zone begins.
    pub(crate) fn boundary(&self) -> usize {
        self.boundary
    }

    /// Granules `first..end` are mapped now (the caller refits the span they cover).
    pub(crate) fn map(&mut self, first: usize, end: usize) {
        if first >= end {
            return;
        }
        let (mut lo, mut hi) = (first, end);
        // Runs that touch or overlap [first, end) merge into one.
        let touching: Vec<(usize, usize)> = self
            .runs
            .range(..=end)
            .rev()
            .take_while(|&(_, &e)| e >= first)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in touching {
            self.runs.remove(&s);
            lo = lo.min(s);
            hi = hi.max(e);
        }
        self.runs.insert(lo, hi);
    }

    /// Granules `first..end` are unmapped now (the caller refits the span they cover).
    pub(crate) fn unmap(&mut self, first: usize, end: usize) {
        if first >= end {
            return;
        }
        let overlapping: Vec<(usize, usize)> = self
            .runs
            .range(..end)
            .rev()
            .take_while(|&(_, &e)| e > first)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in overlapping {
            self.runs.remove(&s);
            if s < first {
                self.runs.insert(s, first);
            }
            if e > end {
                self.runs.insert(end, e);
            }
        }
    }

    /// Enters the fits of the free range `[offset, offset + len)`: its overlap with each
    /// mapped run, cut at the zones' boundary.
    fn enter_extents(&mut self, offset: usize, len: usize) {
        let g = self.granule;
        let end = offset + len;
        let (first, last) = (offset / g, end.div_ceil(g));
        // The run holding the first granule, if any, then every run starting inside.
        let start = self
            .runs
            .range(..=first)
            .next_back()
            .map_or(first, |(&s, _)| s);
        let Self {
            runs,
            by_off,
            by_len,
            boundary,
            ..
        } = self;
        let boundary = *boundary;
        let mut enter = |a: usize, n: usize| {
            by_off.insert(a, n);
            by_len[usize::from(a >= boundary)].insert((n, a));
        };
        for (&s, &e) in runs.range(start..last) {
            let (a, b) = (offset.max(s * g), end.min(e * g));
            if a >= b {
                continue;
            }
            if a < boundary && b > boundary {
                enter(a, boundary - a);
                enter(boundary, b - boundary);
            } else {
                enter(a, b - a);
            }
        }
    }

    /// After a change of the free ranges or of the mapping inside `[lo, hi)`: forgets every
    /// fit that starts there and enters the fits of `free`, the free ranges that overlap the
    /// span now (`free` must hold every free range that overlaps `[lo, hi)` and no other).
    /// The span must cover every free range that existed there before the change, so that
    /// nothing stale is left: a caller passes the span of the ranges it changed widened by
    /// the free ranges now around them.
    pub(crate) fn refit(&mut self, lo: usize, hi: usize, free: &[(usize, usize)]) {
        let lo = free.iter().map(|&(o, _)| o).fold(lo, usize::min);
        let hi = free.iter().map(|&(o, l)| o + l).fold(hi, usize::max);
        // Fits do not overlap: from the last one starting before `hi`, back while they end
        // past `lo`.
        while let Some((&o, &l)) = self.by_off.range(..hi).next_back() {
            if o + l <= lo {
                break;
            }
            self.by_off.remove(&o);
            let z = self.zone(o);
            self.by_len[z].remove(&(l, o));
        }
        for &(o, l) in free {
            self.enter_extents(o, l);
        }
    }

    /// The shortest fit of at least `want` bytes in `zone` (the lowest offset among equals),
    /// as (offset, length); the caller cuts its piece there and refits.
    pub(crate) fn best(&self, want: usize, zone: usize) -> Option<(usize, usize)> {
        self.by_len[zone.min(1)]
            .range((want, 0)..)
            .next()
            .map(|&(len, offset)| (offset, len))
    }

    /// Every fit, as (offset, length), in offset order.
    #[cfg(test)]
    pub(crate) fn all(&self) -> Vec<(usize, usize)> {
        self.by_off.iter().map(|(&o, &l)| (o, l)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const G: usize = 4096;

    /// The fits a naive scan finds: the mapped stretches of each free range, cut at
    /// `boundary`.
    fn naive(free: &[(usize, usize)], mapped: &[bool], boundary: usize) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = Vec::new();
        for &(o, l) in free {
            let mut at = o;
            while at < o + l {
                let g = at / G;
                if mapped.get(g).copied().unwrap_or(false) {
                    let start = at;
                    while at < o + l && mapped.get(at / G).copied().unwrap_or(false) {
                        at = ((at / G) + 1) * G;
                    }
                    let end = at.min(o + l);
                    if start < boundary && end > boundary {
                        out.push((start, boundary - start));
                        out.push((boundary, end - boundary));
                    } else {
                        out.push((start, end - start));
                    }
                } else {
                    at = (g + 1) * G;
                }
            }
        }
        out.sort_unstable();
        out
    }

    #[test]
    fn a_free_range_over_two_mapped_runs_has_two_fits() {
        let mut f = Fits::new(G, usize::MAX);
        f.map(0, 2);
        f.map(3, 5);
        f.refit(0, 5 * G, &[(100, 5 * G - 100)]);
        assert_eq!(f.all(), vec![(100, 2 * G - 100), (3 * G, 2 * G)]);
        assert_eq!(f.best(G, 0), Some((100, 2 * G - 100)));
        assert_eq!(f.best(2 * G - 99, 0), Some((3 * G, 2 * G)));
        assert_eq!(f.best(2 * G + 1, 0), None);
    }

    #[test]
    fn runs_that_touch_merge_and_an_unmap_splits_a_run() {
        let mut f = Fits::new(G, usize::MAX);
        f.map(0, 2);
        f.map(2, 4);
        f.refit(0, 4 * G, &[(0, 4 * G)]);
        assert_eq!(f.all(), vec![(0, 4 * G)]);
        f.unmap(1, 2);
        f.refit(0, 4 * G, &[(0, 4 * G)]);
        assert_eq!(f.all(), vec![(0, G), (2 * G, 2 * G)]);
    }

    #[test]
    fn equal_lengths_give_the_lowest_offset() {
        let mut f = Fits::new(G, usize::MAX);
        f.map(0, 10);
        f.refit(0, 10 * G, &[(8 * G, G), (2 * G, G), (5 * G, G)]);
        assert_eq!(f.best(1, 0), Some((2 * G, G)));
    }

    #[test]
    fn a_fit_across_the_boundary_is_cut_in_two_zones() {
        let mut f = Fits::new(G, 4 * G);
        f.map(0, 8);
        f.refit(0, 8 * G, &[(G, 6 * G)]);
        assert_eq!(f.all(), vec![(G, 3 * G), (4 * G, 3 * G)]);
        assert_eq!(f.best(1, 0), Some((G, 3 * G)));
        assert_eq!(f.best(1, 1), Some((4 * G, 3 * G)));
        assert_eq!(f.best(3 * G + 1, 0), None);
    }

    /// A free list over 64 granules: (offset, length) ranges, coalesced.
    fn ranges(free: &[bool]) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = Vec::new();
        for (i, &f) in free.iter().enumerate() {
            if !f {
                continue;
            }
            match out.last_mut() {
                Some((o, l)) if *o + *l == i * 512 => *l += 512,
                _ => out.push((i * 512, 512)),
            }
        }
        out
    }

    proptest! {
        /// Random cuts, releases, maps and unmaps of a small range, each followed by a refit
        /// of the span it changed: the index always equals a naive scan.
        #[test]
        fn the_index_always_equals_a_naive_scan(ops in prop::collection::vec((0u8..4, 0usize..512, 1usize..64), 1..120)) {
            // 512 units of 512 bytes: 64 granules of 4096.
            let units = 512;
            let mut free = vec![true; units];
            let mut mapped = vec![false; units * 512 / G];
            let boundary = 40 * G;
            let mut f = Fits::new(G, boundary);
            f.refit(0, units * 512, &ranges(&free));
            for (op, at, n) in ops {
                let (lo, hi) = match op {
                    0 | 1 => {
                        let end = (at + n).min(units);
                        for u in free.iter_mut().take(end).skip(at) {
                            *u = op == 1;
                        }
                        (at * 512, end * 512)
                    }
                    _ => {
                        let (g0, g1) = (at / 8, (at / 8 + n / 8 + 1).min(mapped.len()));
                        for m in mapped.iter_mut().take(g1).skip(g0) {
                            *m = op == 2;
                        }
                        if op == 2 { f.map(g0, g1) } else { f.unmap(g0, g1) }
                        (g0 * G, g1 * G)
                    }
                };
                // The free ranges now overlapping the span widened by one unit each way
                // (a range that coalesced across the span's ends).
                let all = ranges(&free);
                let around: Vec<_> = all
                    .iter()
                    .copied()
                    .filter(|&(o, l)| o + l + 512 > lo && o < hi + 512)
                    .collect();
                let wlo = around.iter().map(|r| r.0).fold(lo, usize::min);
                let whi = around.iter().map(|r| r.0 + r.1).fold(hi, usize::max);
                f.refit(wlo, whi, &around);
                let fits = naive(&all, &mapped, boundary);
                prop_assert_eq!(f.all(), fits.clone());
                let want = 512 * (1 + at % 16);
                for zone in 0..2 {
                    let best = fits
                        .iter()
                        .copied()
                        .filter(|r| r.1 >= want && usize::from(r.0 >= boundary) == zone)
                        .min_by_key(|&(o, l)| (l, o));
                    prop_assert_eq!(f.best(want, zone), best);
                }
            }
        }
    }
}
