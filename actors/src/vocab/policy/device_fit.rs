//! `DeviceFit`: the device policy, blocks of exactly the request rounded to the carving
//! unit (or to a number of divisions per power of two, per interval of sizes), cut out of
//! one expandable range per pool.

use super::best_fit::KEEP_REST_UNDER;
use super::{best_fit_served_by, BestFit, BlockLayout, Carving, SizeClass, SizePolicy};

/// The device policy: blocks of exactly the request rounded up to 512 bytes (PyTorch's device
/// rounding; optionally to `roundup_power2_divisions` steps per power of two), cut out of
/// carved memory like [`BestFit`]'s: one expandable range per pool where the memory source
/// can map memory granule by granule, separate segments otherwise (2 MiB for requests up to
/// 1 MiB, larger ones rounded to 2 MiB).
///
/// A class is a bucket of sizes (the [`BestFit`] classes): the cached path hands a ready
/// block of the request's class to the request only when the block holds the rounded
/// request, so a size seen before is served from its own block again, and no block is
/// larger than its request by more than the rounding.
///
/// ```
/// use pinpool::tuning::{DeviceFit, SizePolicy};
/// let p = DeviceFit::default();
/// assert_eq!(p.class_of(300).unwrap().size, 512);
/// // A 1025 MiB request reserves 1025 MiB (PyTorch's device allocator: 1026).
/// assert_eq!(p.class_of(1025 << 20).unwrap().size, 1025 << 20);
/// // Sizes of one class share a ready holder but keep their own sizes.
/// let (a, b) = (p.class_of(100_000).unwrap(), p.class_of(101_000).unwrap());
/// assert_eq!(a.index, b.index);
/// assert!(a.size < b.size);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceFit {
    carving: Carving,
    /// Steps per power of two that sizes above 1 MiB round up to (0: none, 512-byte
    /// rounding), per interval of sizes: [2^i MiB, 2^(i+1) MiB) for entry `i`, the first
    /// also smaller sizes, the last also larger ones.
    divisions: [u8; DIVISION_INTERVALS],
}

/// The intervals of request sizes [`DeviceFit`] rounds with divisions of their own: powers of
/// two from 1 MiB to 32 GiB and above (PyTorch's `roundup_power2_divisions` list form).
pub const DIVISION_INTERVALS: usize = 16;

/// `divisions` as the policy keeps it: 0 or 1 (no rounding) as 0, others a power of two up
/// to 64.
fn steps(divisions: u32) -> u8 {
    if divisions <= 1 {
        0
    } else {
        divisions.next_power_of_two().min(64) as u8
    }
}

impl Default for DeviceFit {
    fn default() -> Self {
        Self {
            carving: Carving {
                small_limit: 1 << 20,
                small_segment: 2 << 20,
                large_round: 2 << 20,
                max_cached_size: usize::MAX,
                split_ratio: 3,
                reserve_cap_permille: Some(1000),
                fill_permille: 500,
                expandable: true,
                arena_reserve: 1 << 40,
                arena_max_block: usize::MAX,
                max_split: usize::MAX,
                gc_threshold_permille: None,
                pack_granules: true,
                map_whole_from: 256 << 20,
                thread_limit: 2 << 20,
                keep_rest_under: KEEP_REST_UNDER,
                // Large pieces go back to the actor at once: with the reserve cap at the
                // peak of live bytes, pieces cached on threads would have the actor map
                // (and later unmap) more granules (decoder replay: 865 fresh maps to 1200,
                // bert 308 to 396, for a mixed sizes loop about 15 % faster on an H200).
                arena_cached_up_to: 0,
                cap_in_bursts: false,
            },
            divisions: [0; DIVISION_INTERVALS],
        }
    }
}

impl DeviceFit {
    /// Rounds requests above 1 MiB up to one of `divisions` steps per power of two (a power
    /// of two itself, at most 64; 0 or 1: no such rounding), as PyTorch's
    /// `roundup_power2_divisions`: more reuse of freed blocks, more bytes per block.
    pub fn roundup_power2_divisions(mut self, divisions: u32) -> Self {
        self.divisions = [steps(divisions); DIVISION_INTERVALS];
        self
    }

    /// [`DeviceFit::roundup_power2_divisions`] per interval of request sizes (PyTorch's list
    /// form): entry `i` for requests of [2^i MiB, 2^(i+1) MiB), the first also for smaller
    /// ones, the last also for larger ones.
    pub fn roundup_power2_divisions_by_size(mut self, divisions: [u32; 16]) -> Self {
        self.divisions = divisions.map(steps);
        self
    }

    /// Blocks above `bytes` are not cached: once free, their memory goes back.
    pub fn max_cached_size(mut self, bytes: usize) -> Self {
        self.carving.max_cached_size = bytes;
        self
    }

    /// The reserve cap as a multiple of the peak of live bytes (default 1.0; at least 1):
    /// before fresh memory would take reserved bytes above it, free memory goes back.
    pub fn reserve_cap(mut self, times_peak_live: f64) -> Self {
        self.carving.set_reserve_cap(times_peak_live);
        self
    }

    /// No reserve cap: free memory stays mapped until the cache is emptied or a memory
    /// limit needs room.
    pub fn keep_free_memory(mut self) -> Self {
        self.carving.reserve_cap_permille = None;
        self
    }

    /// Cut blocks out of separate segments even where the memory source offers expandable
    /// memory (PyTorch's layout without `expandable_segments`).
    pub fn separate_segments(mut self) -> Self {
        self.carving.expandable = false;
        self
    }

    /// Freed blocks of the expandable range up to `bytes` stay on the cached path, one of a
    /// size class per thread (0, the default: blocks above 1 MiB go back to the actor when
    /// freed). Requests of a repeating pattern are then served without a round trip to the
    /// actor, at the price of placements the actor did not choose: more memory reserved for
    /// the same peak of live bytes.
    pub fn thread_cache(mut self, bytes: usize) -> Self {
        let default = Self::default().carving;
        if bytes == 0 {
            self.carving.thread_limit = default.thread_limit;
            self.carving.arena_cached_up_to = default.arena_cached_up_to;
        } else {
            self.carving.thread_limit = bytes.max(default.thread_limit);
            self.carving.arena_cached_up_to = bytes;
        }
        self
    }

    /// Bytes of address space the expandable range of each pool reserves (default 1 TiB).
    pub fn arena_reserve(mut self, bytes: usize) -> Self {
        self.carving.arena_reserve = bytes;
        self
    }

    /// Runs of at least `bytes` are mapped by one call where the memory source unmaps only
    /// whole calls (default 256 MiB): the carving's `map_whole_from` setting.
    pub fn map_whole_from(mut self, bytes: usize) -> Self {
        self.carving.map_whole_from = bytes;
        self
    }

    /// Blocks larger than `bytes` take separate segments rather than the expandable range.
    pub fn arena_max_block(mut self, bytes: usize) -> Self {
        self.carving.arena_max_block = bytes;
        self
    }

    /// PyTorch's `max_split_size`: blocks above `bytes` get segments of their own (never
    /// the expandable range), and a free segment above it is cut only for a request above it
    /// too that leaves at most 20 MiB.
    pub fn max_split_size(mut self, bytes: usize) -> Self {
        self.carving.max_split = bytes;
        self.carving.arena_max_block = self.carving.arena_max_block.min(bytes);
        self
    }

    /// PyTorch's `garbage_collection_threshold`: under a memory limit, before fresh memory
    /// would take reserved bytes above `fraction` of it, cached memory nobody uses goes back
    /// first. Clamped to (0, 1).
    pub fn garbage_collection_threshold(mut self, fraction: f64) -> Self {
        let permille = (fraction.clamp(0.001, 0.999) * 1000.0) as u32;
        self.carving.gc_threshold_permille = Some(permille);
        self
    }

    /// The rounding applied to a request of `size` bytes (`size > 0`), without overflow
    /// checks (the caller bounds `size`).
    fn round(&self, size: usize) -> usize {
        let rounded = size.div_ceil(512) * 512;
        if rounded <= 1 << 20 {
            return rounded;
        }
        let log = (usize::BITS - 1 - rounded.leading_zeros()) as usize;
        let divisions = self.divisions[log.saturating_sub(20).min(DIVISION_INTERVALS - 1)];
        let floor = 1usize << log;
        if divisions == 0 || floor == rounded {
            return rounded;
        }
        let step = (floor / divisions as usize).max(512);
        rounded.div_ceil(step) * step
    }
}

impl SizePolicy for DeviceFit {
    fn name(&self) -> &'static str {
        self.carving.name("device", "device_segments")
    }

    fn num_classes(&self) -> usize {
        BestFit::default().num_classes()
    }

    #[inline]
    fn class_of(&self, size: usize) -> Option<SizeClass> {
        if size == 0 || size > self.max_request() {
            return None;
        }
        let rounded = self.round(size);
        let index = BestFit::default().class_of(rounded)?.index;
        Some(SizeClass {
            index,
            size: rounded,
        })
    }

    #[inline]
    fn max_request(&self) -> usize {
        // The largest request of the `BestFit` classes.
        BestFit::default().max_request()
    }

    fn layout(&self) -> BlockLayout {
        BlockLayout::Carved(self.carving)
    }

    fn class_served_by(&self, bytes: usize) -> Option<usize> {
        // A request's class is the `BestFit` class of its rounded size, at most that
        // class's size.
        best_fit_served_by(bytes)
    }
}
