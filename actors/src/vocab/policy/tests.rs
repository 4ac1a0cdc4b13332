//! Tests of the size policies: classes never below the request, contiguous and monotonic,
//! and each policy's rounding.

use super::*;

#[test]
fn divisions_by_size_round_each_interval_of_sizes_with_its_own_steps() {
    const MIB: usize = 1 << 20;
    // PyTorch's `[256:1,>:4]`: no rounding below 256 MiB, quarters from there.
    let mut table = [1u32; 16];
    table[8..].fill(4);
    let p = DeviceFit::default().roundup_power2_divisions_by_size(table);
    assert_eq!(p.class_of(100 * MIB + 1).unwrap().size, 100 * MIB + 512);
    assert_eq!(p.class_of(300 * MIB).unwrap().size, 320 * MIB);
    assert_eq!(p.class_of(600 * MIB).unwrap().size, 640 * MIB);
    // The last interval serves every larger size; one value fills every interval.
    assert_eq!(p.class_of(40 << 30).unwrap().size, 40 << 30);
    assert_eq!(p.class_of((40 << 30) + 1).unwrap().size, 48 << 30);
    let all = DeviceFit::default().roundup_power2_divisions(4);
    let same = DeviceFit::default().roundup_power2_divisions_by_size([4; 16]);
    for size in [3 * MIB + 1, 300 * MIB, 5 << 30] {
        assert_eq!(all.class_of(size), same.class_of(size), "{size}");
    }
}

#[test]
fn tiered_classes_are_pow2_below_the_threshold_and_within_a_sixteenth_above() {
    let p = TieredPowerOfTwo::default();
    let t = p.threshold();
    assert_eq!(t, 512 << 20);
    for size in [1usize, 3, 4096, 5000, 1 << 20, 300 << 20, t - 1, t] {
        assert_eq!(p.class_of(size), PowerOfTwo.class_of(size), "size {size}");
    }
    let mut last = p.class_of(t).unwrap();
    let mut size = t + 1;
    while size <= p.max_request() {
        let c = p.class_of(size).unwrap();
        assert!(c.size >= size, "a block is never smaller than its request");
        assert!(
            c.size - size <= size / 16,
            "at most 6.25% rounding at {size}"
        );
        assert!(c.index < p.num_classes());
        assert!(c.index >= last.index && c.size >= last.size);
        if c.index == last.index {
            assert_eq!(c.size, last.size, "one size per class");
        }
        last = c;
        size = size + size / 7 + 1;
    }
    assert_eq!(
        p.class_of(p.max_request()).unwrap().index,
        p.num_classes() - 1
    );
    assert_eq!(p.class_of(p.max_request() + 1), None);
    assert_eq!(p.class_of(1025 << 20).unwrap().size, 1088 << 20);
    let small = TieredPowerOfTwo::with_threshold(1 << 20);
    assert_eq!(small.class_of((1 << 20) + 1).unwrap().size, (17 << 20) / 16);
}

#[test]
fn best_fit_classes_are_contiguous_monotonic_and_never_below_the_request() {
    let p = BestFit::default();
    let mut last = p.class_of(1).unwrap();
    assert_eq!(
        last,
        SizeClass {
            index: 0,
            size: 512
        }
    );
    let mut size = 2;
    while size <= p.max_request() {
        for s in [size - 1, size, size + 1, size + size / 3] {
            let Some(c) = p.class_of(s) else { continue };
            assert!(c.size >= s, "class {c:?} for {s}");
            assert!(c.size - s < (s / 16).max(512), "class {c:?} for {s}");
            assert!(c.index < p.num_classes());
            // A class's size maps to the class itself.
            assert_eq!(p.class_of(c.size), Some(c));
            assert_eq!(c.size % 512, 0);
        }
        let c = p.class_of(size).unwrap();
        assert!(c.index == last.index || c.index == last.index + 1 || c.size > last.size);
        last = c;
        size *= 2;
    }
    assert_eq!(p.class_of(8192).unwrap().index, 15);
    assert_eq!(
        p.class_of(8193).unwrap(),
        SizeClass {
            index: 16,
            size: 8704
        }
    );
    assert_eq!(p.class_of(16384).unwrap().index, 31);
    assert_eq!(
        p.class_of(16385).unwrap(),
        SizeClass {
            index: 32,
            size: 17408
        }
    );
    assert_eq!(
        p.class_of(p.max_request()).unwrap().index,
        p.num_classes() - 1
    );
    assert_eq!(p.class_of(p.max_request() + 1), None);
    assert_eq!(p.class_of(0), None);
}

#[test]
fn best_fit_serves_a_1025_mib_request_with_at_most_1100_mib() {
    let c = BestFit::default().class_of(1025 << 20).unwrap();
    assert!(c.size <= 1100 << 20);
    assert_eq!(PowerOfTwo.class_of(1025 << 20).unwrap().size, 2048 << 20);
}

#[test]
fn every_best_fit_class_index_is_used_by_exactly_one_size() {
    let p = BestFit::default();
    let mut sizes = vec![0usize; p.num_classes()];
    let mut s = 512;
    while s <= p.max_request() {
        let c = p.class_of(s).unwrap();
        assert!(sizes[c.index] == 0 || sizes[c.index] == c.size);
        sizes[c.index] = c.size;
        s = c.size + 1;
    }
    assert!(sizes.iter().all(|&s| s > 0));
    assert!(sizes.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn power_of_two_rounds_up_and_indexes_by_log2() {
    let p = PowerOfTwo;
    assert_eq!(p.class_of(1), Some(SizeClass { index: 0, size: 1 }));
    assert_eq!(p.class_of(3), Some(SizeClass { index: 2, size: 4 }));
    assert_eq!(
        p.class_of(4096),
        Some(SizeClass {
            index: 12,
            size: 4096
        })
    );
    assert_eq!(
        p.class_of(4097),
        Some(SizeClass {
            index: 13,
            size: 8192
        })
    );
    assert!(p.class_of(1 << 62).is_some());
    assert_eq!(p.class_of((1 << 62) + 1), None);
    assert_eq!(p.class_of(usize::MAX), None);
    assert_eq!(p.class_of(0), None);
    assert!(p.class_of(1 << 62).unwrap().index < p.num_classes());
}
