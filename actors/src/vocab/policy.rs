//! Size policies: how a request's size maps to a size class and to the bytes reserved for it.
//!
//! A class is the unit of reuse on the cached path: a freed block goes back to the ready
//! queue of its class and is handed out again to a request of that class, so every block of
//! a class is at least as large as the class's size and `class_of` must be cheap. What
//! happens on a miss is the policy's [`BlockLayout`]: [`PowerOfTwo`] gives every block a
//! host allocation of its own; [`BestFit`] cuts blocks of their class's exact size out of
//! shared segments and coalesces them again (see `carve`), so that a miss is served from
//! any free memory that fits before fresh memory is taken.

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
    /// (ready queues) when freed.
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
const KEEP_REST_UNDER: usize = 8;

/// The largest request [`BestFit`] accepts: 1 TiB.
const BEST_FIT_MAX_LOG2: u32 = 40;
/// Classes per doubling above `BEST_FIT_SMALL` (rounding wastes at most 1/16 = 6.25%).
const STEPS_LOG2: u32 = 4;
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
/// every block out of it. A miss is served, after the pool has drained its ready queues and
/// coalesced free neighbours, at the place that needs the fewest granules (2 MiB) mapped,
/// best fit among those. Fresh memory is the granules a block needs and no more. Free
/// ranges coalesce across granules, so a larger request is served in place once its
/// neighbours come back. A granule that no block touches (blocks in ready queues, waiting
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
        let permille = (times_peak_live.max(1.0) * 1000.0).min(u32::MAX as f64);
        self.carving.reserve_cap_permille = Some(permille as u32);
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
        if self.carving.expandable {
            "bestfit"
        } else {
            "bestfit_segments"
        }
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
/// // Sizes of one class share a ready queue but keep their own sizes.
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
        let permille = (times_peak_live.max(1.0) * 1000.0).min(u32::MAX as f64);
        self.carving.reserve_cap_permille = Some(permille as u32);
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
        if self.carving.expandable {
            "device"
        } else {
            "device_segments"
        }
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

    fn max_request(&self) -> usize {
        1usize << BEST_FIT_MAX_LOG2
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
mod tests {
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
}
