//! `Bits`: one bit per granule of an arena's range, set where the granule is mapped, so
//! that how many granules of a span are mapped is a count of bits, not a walk of the books.

/// One bit per granule of the range, set where it is mapped (the keys of
/// `Arena::granules`): placing a block asks how many granules of a candidate place are
/// mapped for every free range it looks at, which a walk of the tree made the larger part
/// of a miss's work in a large arena.
pub(super) struct Bits(Vec<u64>);

impl Bits {
    pub(super) fn new(granules: usize) -> Self {
        Self(vec![0; granules.div_ceil(64)])
    }

    pub(super) fn set(&mut self, i: usize, on: bool) {
        if let Some(w) = self.0.get_mut(i / 64) {
            if on {
                *w |= 1 << (i % 64);
            } else {
                *w &= !(1 << (i % 64));
            }
        }
    }

    /// How many granules of `span` are set.
    pub(super) fn count(&self, span: std::ops::Range<usize>) -> usize {
        if span.is_empty() {
            return 0;
        }
        let (first, last) = (span.start / 64, (span.end - 1) / 64);
        (first..=last)
            .map(|w| {
                let mut bits = self.0.get(w).copied().unwrap_or(0);
                if w == first {
                    bits &= !0u64 << (span.start % 64);
                }
                if w == last && span.end % 64 != 0 {
                    bits &= !0u64 >> (64 - span.end % 64);
                }
                bits.count_ones() as usize
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::Bits;

    #[test]
    fn bits_count_what_is_set_in_any_span() {
        let mut bits = Bits::new(300);
        let mut naive = vec![false; 300];
        // A fixed scatter of set and cleared bits, across word boundaries.
        let mut x = 7usize;
        for _ in 0..400 {
            x = (x * 1103515245 + 12345) % 2147483648;
            let (i, on) = (x % 300, x % 3 != 0);
            bits.set(i, on);
            naive[i] = on;
        }
        for start in (0..300).step_by(7) {
            for end in (start..=300).step_by(5) {
                let want = naive[start..end].iter().filter(|b| **b).count();
                assert_eq!(bits.count(start..end), want, "span {start}..{end}");
            }
        }
        // Past the end counts nothing, and setting past the end is ignored.
        bits.set(1000, true);
        assert_eq!(bits.count(300..1100), 0);
    }
}
