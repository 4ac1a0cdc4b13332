//! `BestFit`: fine size classes whose blocks are cut out of shared segments (or one
//! expandable range) and coalesce again, and the limits on what its threads split and what
//! takes a segment of its own.

use super::{best_fit_served_by, BlockLayout, Carving, SizeClass, SizePolicy};

/// How large a ready block [`BestFit`]'s threads split on their own: a request up to this
/// size whose class is empty may be served from a larger block of the thread's cache,
/// without the pool actor.
const BEST_FIT_THREAD_LIMIT: usize = 4 << 20;

/// Blocks larger than this take [`BestFit`] separate segments, even with an expandable
/// range: fresh, such a block is one `register` call of huge pages instead of its granules
/// mapped one by one (1 GiB fresh on an H100 host: 53 ms instead of 313 ms), for a little
/// more waste on streams of such blocks (gpt2's replay, with its 785 MiB blocks, about 6 %
/// more; at 256 MiB the CNN stream's 400 MiB blocks would go from 1.039 to 1.229).
const BEST_FIT_ARENA_MAX_BLOCK: usize = 512 << 20;

/// A rest under an eighth of the block a thread splits stays with the request (see
/// [`Carving::keep_rest_under`]): the mixed sizes loop (64 held buffers of 4 KiB to 1 MiB)
/// went from 230 to 155 ns a request on the simulated runtime, with the replayed streams'
/// peak reserved over peak live unchanged on the host and lower or unchanged on the device.
pub(super) const KEEP_REST_UNDER: usize = 8;

/// The largest request [`BestFit`] accepts: 1 TiB.
pub(super) const BEST_FIT_MAX_LOG2: u32 = 40;
/// Classes per doubling above `BEST_FIT_SMALL` (rounding wastes at most 1/16 = 6.25%).
pub(super) const STEPS_LOG2: u32 = 4;
/// Up to this size, classes are the multiples of 512 bytes.
const BEST_FIT_SMALL: usize = 512 << STEPS_LOG2;
const SMALL_LOG2: u32 = BEST_FIT_SMALL.trailing_zeros();

/// Fine size classes (multiples of 512 bytes up to 8 KiB, then 16 classes per doubling, so a
/// class rounds up by at most 6.25%) whose blocks are cut out of one expandable range of
/// pinned memory, or out of shared segments. The default policy.
///
/// Where the runtime offers expandable host memory (`Runtime::host_granularity`: the CUDA
/// virtual memory calls with host locations, CUDA 12.2 and later, or the simulation), the
/// pool reserves one address range (64 GiB by default, at most the memory limit) and cuts
/// every block out of it. A miss is served, after the pool has drained its ready holder and
/// coalesced free neighbours, at the place that needs the fewest granules (2 MiB) mapped,
/// best fit among those. Fresh memory is the granules a block needs and no more. Free
/// ranges coalesce across granules, so a larger request is served in place once its
/// neighbours come back. A granule that no block touches (blocks in the ready holder, waiting
/// on events or kept for graph replays touch theirs) is unmapped, least recently used
/// first, before mapping would cross the reserve cap of 1.15 times the peak of live bytes,
/// when the cache is emptied, and under a memory limit when a request needs room. Under a
/// limit of fewer than eight granules, on runtimes without the capability, and for requests
/// the range cannot hold, blocks come from separate segments instead. Under a memory limit
/// free memory can still be stranded: when every mapped granule holds a live block and no
/// free range fits a request, the request waits for a free even though the free bytes add
/// up to more than it asks for (powers of two free a cached block instead).
///
///
/// With separate segments ([`BestFit::separate_segments`]) a miss is served by the
/// best-fitting free range of a segment that already lends a piece, else by the smallest
/// wholly free segment that holds it, unless that segment is more than 3 times larger than
/// the request (such a split waits until fresh memory would cross the reserve cap). Fresh
/// memory is a 2 MiB segment for small blocks (up to 1 MiB), the block's own size for larger
/// ones, or half the room left under the reserve cap when that is more. Before fresh memory
/// would cross the reserve cap, wholly free segments go back to the runtime, least recently
/// used first. Under a memory limit, free ranges stranded in segments that still lend pieces
/// are not room: a request larger than every free range waits until a segment empties,
/// even when the free bytes add up to more than it asks for.
///
/// Either way, freed small blocks stay on the cached path, and so do large ones that fill
/// their segment; other pieces go back into their segment or range at once, so that they
/// coalesce (in the expandable range, a piece the pool actor placed into free memory it
/// filled exactly is held by the freeing thread until its next request of that size or its
/// next miss). A request whose class is empty is served on its thread where it can be: a
/// larger ready block of the thread's is split for it (a rest under an eighth of the block
/// stays with the request); only then does it ask the pool actor, which places it best-fit.
/// Blocks larger than 512 MiB take separate segments even in the expandable range (fresh,
/// one allocation instead of many granules). The reserve cap is kept inside bursts of
/// requests too: idle granules move, or go back, before fresh memory is mapped over it.
///
/// ```
/// use pinpool::tuning::{BestFit, SizePolicy};
/// let p = BestFit::default();
/// // A 1025 MiB request reserves 1088 MiB, where powers of two would reserve 2 GiB.
/// assert_eq!(p.class_of(1025 << 20).unwrap().size, 1088 << 20);
/// assert_eq!(p.class_of(300).unwrap().size, 512);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BestFit {
    carving: Carving,
}

impl Default for BestFit {
    fn default() -> Self {
        Self {
            carving: Carving {
                small_limit: 1 << 20,
                small_segment: 2 << 20,
                large_round: 4096,
                max_cached_size: usize::MAX,
                split_ratio: 3,
                reserve_cap_permille: Some(1150),
                fill_permille: 500,
                expandable: true,
                arena_reserve: 64 << 30,
                arena_max_block: BEST_FIT_ARENA_MAX_BLOCK,
                max_split: usize::MAX,
                gc_threshold_permille: None,
                pack_granules: false,
                map_whole_from: usize::MAX,
                thread_limit: BEST_FIT_THREAD_LIMIT,
                keep_rest_under: KEEP_REST_UNDER,
                arena_cached_up_to: 0,
                // Pinned memory keeps its cap while requests come: host replays stay within
                // 1.2 of their peak (moves of host memory cost no device work).
                cap_in_bursts: true,
            },
        }
    }
}

impl BestFit {
    /// Keep wholly free segments when a miss needs fresh memory (default: give them back
    /// once reserved bytes would cross the reserve cap).
    pub fn keep_free_segments(mut self) -> Self {
        self.carving.reserve_cap_permille = None;
        self
    }

    /// The reserve cap as a multiple of the peak of live bytes (default 1.15; at least 1).
    pub fn reserve_cap(mut self, times_peak_live: f64) -> Self {
        self.carving.set_reserve_cap(times_peak_live);
        self
    }

    /// Blocks above `bytes` are not cached: their memory goes back to the runtime once free.
    pub fn max_cached_size(mut self, bytes: usize) -> Self {
        self.carving.max_cached_size = bytes;
        self
    }

    /// Cut blocks out of separate host allocations even where the runtime offers
    /// expandable host memory (default: one expandable range, as the carving sets it).
    pub fn separate_segments(mut self) -> Self {
        self.carving.expandable = false;
        // A segment goes back only once every piece of it is back: threads split only small
        // blocks of separate segments.
        self.carving.thread_limit = self.carving.small_limit;
        self
    }

    /// Bytes of address space the expandable range reserves (default 64 GiB).
    pub fn arena_reserve(mut self, bytes: usize) -> Self {
        self.carving.arena_reserve = bytes;
        self
    }
}

impl SizePolicy for BestFit {
    fn name(&self) -> &'static str {
        self.carving.name("bestfit", "bestfit_segments")
    }

    fn num_classes(&self) -> usize {
        (1 << STEPS_LOG2) * (1 + (BEST_FIT_MAX_LOG2 - SMALL_LOG2) as usize)
    }

    #[inline]
    fn class_of(&self, size: usize) -> Option<SizeClass> {
        if size == 0 || size > self.max_request() {
            return None;
        }
        if size <= BEST_FIT_SMALL {
            let m = size.div_ceil(512);
            return Some(SizeClass {
                index: m - 1,
                size: m * 512,
            });
        }
        // size in (2^k, 2^(k+1)], k >= SMALL_LOG2: 16 steps of 2^(k-4).
        let k = usize::BITS - 1 - (size - 1).leading_zeros();
        let step_log2 = k - STEPS_LOG2;
        let m = (size - 1) >> step_log2; // in 16..=31
        Some(SizeClass {
            index: (1 << STEPS_LOG2) * (1 + (k - SMALL_LOG2) as usize) + (m - (1 << STEPS_LOG2)),
            size: (m + 1) << step_log2,
        })
    }

    #[inline]
    fn max_request(&self) -> usize {
        1usize << BEST_FIT_MAX_LOG2
    }

    fn layout(&self) -> BlockLayout {
        BlockLayout::Carved(self.carving)
    }

    fn class_served_by(&self, bytes: usize) -> Option<usize> {
        best_fit_served_by(bytes)
    }
}
