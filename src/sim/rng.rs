//! A tiny xorshift64* generator for fault probabilities and random stream delays.
//!
//! Owns only its 64-bit state; not cryptographic, just reproducible from a seed.

use std::sync::atomic::{AtomicU64, Ordering};

/// Mixes a seed so that 0 and nearby seeds give unrelated, non-zero states.
pub(crate) fn mix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) | 1
}

fn step(mut x: u64) -> u64 {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    x
}

/// A generator owned by one thread.
pub(crate) struct XorShift(u64);

impl XorShift {
    pub(crate) fn new(seed: u64) -> Self {
        Self(mix(seed))
    }

    /// A value in `0..bound` (0 when `bound` is 0).
    pub(crate) fn below(&mut self, bound: u64) -> u64 {
        self.0 = step(self.0);
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        if bound == 0 {
            0
        } else {
            r % bound
        }
    }
}

/// A generator shared between threads (one atomic state).
pub(crate) struct AtomicXorShift(AtomicU64);

impl AtomicXorShift {
    pub(crate) fn new(seed: u64) -> Self {
        Self(AtomicU64::new(mix(seed)))
    }

    pub(crate) fn reseed(&self, seed: u64) {
        self.0.store(mix(seed), Ordering::Relaxed);
    }

    /// A value in `0..bound` (0 when `bound` is 0).
    pub(crate) fn below(&self, bound: u64) -> u64 {
        let prev = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |x| Some(step(x)))
            .unwrap_or_else(|x| x);
        let r = step(prev).wrapping_mul(0x2545_f491_4f6c_dd1d);
        if bound == 0 {
            0
        } else {
            r % bound
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_gives_same_sequence_and_values_stay_below_bound() {
        let (mut a, mut b) = (XorShift::new(7), XorShift::new(7));
        for _ in 0..100 {
            let x = a.below(10);
            assert_eq!(x, b.below(10));
            assert!(x < 10);
        }
        assert_eq!(a.below(0), 0);
    }
}
