//! Size policies: how a request's size maps to a size class and to the bytes reserved for it.
//!
//! A class is the unit of reuse on the cached path: a freed block goes back to the ready
//! queue of its class and is handed out again to a request of that class, so every block of
//! a class is at least as large as the class's size and `class_of` must be cheap. What
//! happens on a miss is the policy's [`BlockLayout`]: [`PowerOfTwo`] gives every block a
//! host allocation of its own; [`BestFit`] cuts blocks of their class's exact size out of
//! shared segments and coalesces them again (see `carve`), so that a miss is served from
//! any free memory that fits before fresh memory is taken.
//!
//! This file holds the policy trait, the layouts, and the power-of-two policies;
//! `best_fit` and `device_fit` hold the two carving policies.

/// A request's class: which ready holder serves it, and how many bytes its block has.
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
    /// How blocks are laid out in host allocations (default: one allocation per block).
    fn layout(&self) -> BlockLayout {
        BlockLayout::Whole
    }
    /// For carving layouts whose ready blocks a request may split: the largest class every
    /// request of which a free block of `bytes` serves (`None`: none does, or the policy's
    /// blocks are never split).
    fn class_served_by(&self, bytes: usize) -> Option<usize> {
        let _ = bytes;
        None
    }
}

/// [`SizePolicy::class_served_by`] for classes whose requests are at most their class's
/// size in `BestFit`'s ladder.
fn best_fit_served_by(bytes: usize) -> Option<usize> {
    let c = BestFit::default().class_of(bytes)?;
    if c.size <= bytes {
        Some(c.index)
    } else {
        c.index.checked_sub(1)
    }
}

/// How a pool lays its blocks out in host allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockLayout {
    /// Every block is a host allocation of its class's size, reused only by its class.
    Whole,
    /// Blocks are cut out of segments (host allocations) and coalesce when they come back.
    Carved(Carving),
}

/// Parameters of [`BlockLayout::Carved`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Carving {
    /// Blocks up to this size get, when they need fresh memory, a segment of
    /// `small_segment` bytes that later small blocks share; they stay on the cached path
    /// (ready holder) when freed.
    pub(crate) small_limit: usize,
    /// Size of a fresh segment for small blocks.
    pub(crate) small_segment: usize,
    /// A larger block's fresh segment is rounded up to this (a page).
    pub(crate) large_round: usize,
    /// Blocks larger than this are not cached: once free, their segment goes back to the
    /// runtime as soon as no piece of it is lent.
    pub(crate) max_cached_size: usize,
    /// A wholly free segment more than this many times larger than a request is split for
    /// it only when fresh memory would cross the reserve cap: a small block cut out of a
    /// large segment pins it after the large requests it was made for come back.
    pub(crate) split_ratio: usize,
    /// The reserve cap, in thousandths of the peak of live (class-rounded) bytes seen at
    /// misses: before fresh memory would take the reserved bytes above it, wholly free
    /// segments go back, least recently used first. `None`: keep them.
    pub(crate) reserve_cap_permille: Option<u32>,
    /// A fresh segment for a large block takes this share (in thousandths) of the room left
    /// under the reserve cap when that is more than the block needs: fewer, larger host
    /// allocations that later requests are cut from.
    pub(crate) fill_permille: u32,
    /// Cut blocks out of one expandable range (an arena) where the runtime can map pinned
    /// memory into reserved address space, granule by granule: free ranges coalesce across
    /// what would be separate segments, and a granule no block touches goes back on its
    /// own. Requests the arena cannot hold, and runtimes without the capability, use
    /// separate segments.
    pub(crate) expandable: bool,
    /// Bytes of address space the arena reserves (at most the memory limit, when there
    /// is one).
    pub(crate) arena_reserve: usize,
    /// Blocks larger than this take separate segments even when the pool has an arena: a
    /// large fresh block is then one allocation from the memory source rather than many
    /// granules mapped one by one.
    pub(crate) arena_max_block: usize,
    /// A wholly free segment larger than this is cut only for a request above it too, that
    /// leaves at most 20 MiB of it (PyTorch's `max_split_size`: large blocks are not split
    /// for small ones).
    pub(crate) max_split: usize,
    /// Before fresh memory would take reserved bytes above this share (in thousandths) of
    /// the memory limit, cached memory nobody uses goes back first (PyTorch's
    /// `garbage_collection_threshold`; only under a limit).
    pub(crate) gc_threshold_permille: Option<u32>,
    /// In the arena, place a small block where it strands the least of the granules it
    /// touches (see `Arena::place`): fewer granules mapped for the same blocks.
    pub(crate) pack_granules: bool,
    /// Where the memory source unmaps only whole map calls, runs of at least this many
    /// bytes are mapped by one call (fast: one piece of memory) and shorter runs in units of
    /// a power of two granules that each go back, or move, on their own (a small share of
    /// the pool's peak, and of the run).
    pub(crate) map_whole_from: usize,
    /// Outside an expandable range, threads split ready blocks up to this size for their
    /// requests without the pool actor (the pool's split limit).
    pub(crate) thread_limit: usize,
    /// A thread that splits a ready block for a request leaves the rest with the request
    /// when the rest is less than `1 / keep_rest_under` of the block (0: only a rest too
    /// small for any class). A sliver that small rarely serves a request before it is merged
    /// again; cutting it costs a block record and a note for the actor, and leaves one more
    /// fragment for the thread's next misses to pass over (PyTorch's device allocator does
    /// not split a large block whose rest would be 1 MiB or less).
    pub(crate) keep_rest_under: usize,
    /// Keep the reserve cap inside a burst of requests too: idle memory moves, or goes back,
    /// before a miss takes fresh memory over the cap (driver calls while requests come, for
    /// a tighter layout). Otherwise memory above the cap goes back only between bursts.
    pub(crate) cap_in_bursts: bool,
    /// Freed pieces of the expandable range up to this size (and the thread limit) stay on
    /// the cached path even when larger than `small_limit`, as small ones do (one block of
    /// a class per thread), so that a request of their class is served again without a
    /// round trip to the pool actor, whose placements then see less of the free memory.
    /// Larger pieces, and those of separate segments, go back into their range or segment
    /// when freed (0, the default: every large piece does).
    pub(crate) arena_cached_up_to: usize,
}

impl Carving {
    /// Sets the reserve cap to `times_peak_live` times the peak of live bytes (at least 1):
    /// what the `reserve_cap` setter of every carving policy does.
    pub(crate) fn set_reserve_cap(&mut self, times_peak_live: f64) {
        let permille = (times_peak_live.max(1.0) * 1000.0).min(u32::MAX as f64);
        self.reserve_cap_permille = Some(permille as u32);
    }

    /// A carving policy's name: `expandable` while it cuts blocks out of one expandable
    /// range, else `segments`.
    pub(crate) fn name(&self, expandable: &'static str, segments: &'static str) -> &'static str {
        if self.expandable {
            expandable
        } else {
            segments
        }
    }

    /// The largest ready block a thread splits without the pool actor:
    /// `thread_limit`, and never past `max_split`.
    pub(crate) fn thread_split_limit(&self) -> usize {
        self.thread_limit.min(self.max_split)
    }

    /// Size of a fresh segment for small blocks (they share it).
    pub fn small_segment(&self) -> usize {
        self.small_segment
    }

    /// The reserve cap for a peak of `peak_live` live bytes, if there is one.
    pub(crate) fn reserve_cap(&self, peak_live: usize) -> Option<usize> {
        self.reserve_cap_permille
            .map(|p| (peak_live as u128 * p as u128 / 1000).min(usize::MAX as u128) as usize)
    }

    /// Under a memory `limit`, the garbage-collection threshold's share of it, if set.
    pub(crate) fn gc_cap(&self, limit: Option<usize>) -> Option<usize> {
        self.gc_threshold_permille
            .zip(limit)
            .map(|(p, l)| (l as u128 * p as u128 / 1000) as usize)
    }

    /// The cap on reserved bytes before fresh memory: the reserve cap, or under a memory
    /// `limit` the garbage-collection threshold, whichever is lower.
    pub(crate) fn fresh_cap(&self, peak_live: usize, limit: Option<usize>) -> Option<usize> {
        let gc = self.gc_cap(limit);
        match (self.reserve_cap(peak_live), gc) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether a wholly free segment of `seg` bytes may be cut for a request of `size`
    /// (`split_any`: even one much larger than the request).
    pub(crate) fn may_split(&self, seg: usize, size: usize, split_any: bool) -> bool {
        if seg > self.max_split {
            return size > self.max_split && seg - size <= 20 << 20;
        }
        split_any || seg <= self.small_segment || seg / self.split_ratio.max(1) <= size
    }
}

mod best_fit;
mod device_fit;

pub use best_fit::BestFit;
pub use device_fit::{DeviceFit, DIVISION_INTERVALS};

use best_fit::STEPS_LOG2;

/// PyTorch's powers of two up to a threshold (512 MiB by default), and above it sixteen
/// classes per power of two, so that a large request is rounded up by at most 6.25% instead
/// of up to 100% (PyTorch's `pinned_max_round_threshold_mb` knob, always on here).
/// Requests up to the threshold behave exactly as under [`PowerOfTwo`].
///
/// ```
/// use pinpool::tuning::{SizePolicy, TieredPowerOfTwo};
/// let p = TieredPowerOfTwo::default();
/// assert_eq!(p.class_of(3000).unwrap().size, 4096);
/// assert_eq!(p.class_of(300 << 20).unwrap().size, 512 << 20);
/// // A 1025 MiB request reserves 1088 MiB, not 2 GiB.
/// assert_eq!(p.class_of(1025 << 20).unwrap().size, 1088 << 20);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TieredPowerOfTwo {
    threshold_log2: u32,
}

/// The largest request [`TieredPowerOfTwo`] accepts: 1 TiB.
const TIERED_MAX_LOG2: u32 = 40;

impl Default for TieredPowerOfTwo {
    fn default() -> Self {
        Self { threshold_log2: 29 }
    }
}

impl TieredPowerOfTwo {
    /// Powers of two up to `threshold` (rounded up to a power of two, at least 64 KiB, at
    /// most 512 GiB), sixteenths of a power of two above it.
    pub fn with_threshold(threshold: usize) -> Self {
        let log2 = threshold.max(1).next_power_of_two().trailing_zeros();
        Self {
            threshold_log2: log2.clamp(16, TIERED_MAX_LOG2 - 1),
        }
    }

    /// Requests up to this size are rounded to a power of two.
    pub fn threshold(&self) -> usize {
        1 << self.threshold_log2
    }
}

impl SizePolicy for TieredPowerOfTwo {
    fn name(&self) -> &'static str {
        "tiered"
    }

    fn num_classes(&self) -> usize {
        (self.threshold_log2 as usize + 1)
            + (1 << STEPS_LOG2) * (TIERED_MAX_LOG2 - self.threshold_log2) as usize
    }

    #[inline]
    fn class_of(&self, size: usize) -> Option<SizeClass> {
        if size == 0 || size > self.max_request() {
            return None;
        }
        if size <= self.threshold() {
            let rounded = size.next_power_of_two();
            return Some(SizeClass {
                index: rounded.trailing_zeros() as usize,
                size: rounded,
            });
        }
        // size in (2^k, 2^(k+1)], k >= threshold_log2: 16 steps of 2^(k-4).
        let k = usize::BITS - 1 - (size - 1).leading_zeros();
        let step_log2 = k - STEPS_LOG2;
        let m = (size - 1) >> step_log2; // in 16..=31
        Some(SizeClass {
            index: (self.threshold_log2 as usize + 1)
                + (1 << STEPS_LOG2) * (k - self.threshold_log2) as usize
                + (m - (1 << STEPS_LOG2)),
            size: (m + 1) << step_log2,
        })
    }

    fn max_request(&self) -> usize {
        1usize << TIERED_MAX_LOG2
    }
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
mod tests;
