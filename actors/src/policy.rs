//! Size policies: how a request's size maps to a size class and to the bytes reserved for it.
//!
//! A class is the unit of reuse: a freed block is handed out again only to a request of the
//! same class. The cached path indexes ready queues by class, so `class_of` must be cheap.

/// A request's class: which ready queue serves it, and how many bytes its block has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeClass {
    /// Index of the class, below [`SizePolicy::num_classes`].
    pub index: usize,
    /// Bytes reserved for a block of this class (at least the request).
    pub size: usize,
}

/// Maps request sizes to classes.
pub trait SizePolicy: Send + Sync + 'static {
    /// A short name for reports, e.g. `"pow2"`.
    fn name(&self) -> &'static str;
    /// Number of classes; class indices are below it.
    fn num_classes(&self) -> usize;
    /// The class of a request of `size` bytes (`size > 0`), or `None` when it is too large.
    fn class_of(&self, size: usize) -> Option<SizeClass>;
    /// The largest request `class_of` accepts.
    fn max_request(&self) -> usize;
}

/// PyTorch's policy: round up to a power of two; one class per power of two.
#[derive(Debug, Clone, Copy, Default)]
pub struct PowerOfTwo;

/// The largest power of two a block may have (4 EiB would not fit in memory anyway).
const MAX_LOG2: u32 = 62;

impl SizePolicy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "pow2"
    }

    fn num_classes(&self) -> usize {
        MAX_LOG2 as usize + 1
    }

    #[inline]
    fn class_of(&self, size: usize) -> Option<SizeClass> {
        if size == 0 || size > self.max_request() {
            return None;
        }
        let rounded = size.next_power_of_two();
        Some(SizeClass {
            index: rounded.trailing_zeros() as usize,
            size: rounded,
        })
    }

    fn max_request(&self) -> usize {
        1usize << MAX_LOG2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
