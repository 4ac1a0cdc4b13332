//! Segments: one allocation from a memory source that blocks are cut out of, shared by the
//! blocks cut from it, and given back with its last piece when the pool actor is gone.
//!
//! Owns the segment's region, whether it may be given back (a piece may still be used by
//! device work: then never), and, for a pool's expandable range (its arena), which granules
//! are mapped. The pool actor gives segments back itself while it runs (see `pool::segments`
//! and `pool::arena`); the drop here is the fallback that keeps invariant 2 once it is gone.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::books::home::Home;
use crate::vocab::carve::SegId;
use crate::vocab::memory::RangeCall;
use crate::vocab::memory::Region;
use crate::vocab::runtime::Runtime;

/// Which granules of an arena are mapped, readable by whoever drops the arena's segment
/// last (written only by the pool actor and the blocking threads it waits for).
pub(crate) struct ArenaMap {
    pub(crate) granule: usize,
    mapped: Box<[AtomicU64]>,
    /// The first granule of each map call's run (to give back a run whole where the memory
    /// source unmaps only whole map calls).
    starts: Box<[AtomicU64]>,
    /// Map calls with a granule still mapped: host allocations in the books.
    pub(crate) live_maps: AtomicUsize,
}

impl ArenaMap {
    pub(crate) fn new(granule: usize, size: usize) -> Self {
        let words = (size / granule.max(1)).div_ceil(64);
        Self {
            granule,
            mapped: (0..words).map(|_| AtomicU64::new(0)).collect(),
            starts: (0..words).map(|_| AtomicU64::new(0)).collect(),
            live_maps: AtomicUsize::new(0),
        }
    }

    pub(crate) fn set(&self, granule: usize, mapped: bool) {
        set_bit(&self.mapped, granule, mapped);
    }

    /// Marks the granules of `[offset, offset + len)` unmapped, where the unmap runs: whoever
    /// drops the segment last must not unmap them again, even if the pool actor is gone
    /// before it books the unmap itself.
    pub(crate) fn clear(&self, offset: usize, len: usize) {
        let g = self.granule.max(1);
        for i in offset / g..(offset + len) / g {
            self.set(i, false);
            self.set_start(i, false);
        }
    }

    /// Marks `granule` as the first of a map call's run (or not).
    pub(crate) fn set_start(&self, granule: usize, start: bool) {
        set_bit(&self.starts, granule, start);
    }

    /// The mapped granules, in order.
    pub(crate) fn mapped(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for (i, w) in self.mapped.iter().enumerate() {
            let mut bits = w.load(Ordering::Relaxed);
            while bits != 0 {
                out.push(i * 64 + bits.trailing_zeros() as usize);
                bits &= bits - 1;
            }
        }
        out
    }

    /// The mapped memory as (offset, bytes) ranges: one per granule, or with `whole`, one
    /// per map call's run.
    pub(crate) fn mapped_ranges(&self, whole: bool) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = Vec::new();
        for g in self.mapped() {
            let start = self.starts[g / 64].load(Ordering::Relaxed) & (1 << (g % 64)) != 0;
            match out.last_mut() {
                Some((o, l)) if whole && !start && *o + *l == g * self.granule => {
                    *l += self.granule
                }
                _ => out.push((g * self.granule, self.granule)),
            }
        }
        out
    }
}

fn set_bit(words: &[AtomicU64], bit: usize, on: bool) {
    if let Some(w) = words.get(bit / 64) {
        let mask = 1u64 << (bit % 64);
        if on {
            w.fetch_or(mask, Ordering::Relaxed);
        } else {
            w.fetch_and(!mask, Ordering::Relaxed);
        }
    }
}

/// One host allocation that blocks are cut out of.
pub(crate) struct Segment<R: Runtime, B> {
    pub(crate) id: SegId,
    pub(crate) memory: Region,
    pool: Arc<Home<R, B>>,
    /// Device work may still use a piece: never give the memory back.
    leaked: AtomicBool,
    /// The pool actor gave the memory back.
    given_back: AtomicBool,
    /// For the pool's arena (a reserved range mapped granule by granule), which granules
    /// are mapped; `None` for a host allocation.
    arena: Option<ArenaMap>,
}

impl<R: Runtime, B> Segment<R, B> {
    /// A segment of `pool` over `memory`: a host allocation, or (with its granule map) the
    /// pool's arena.
    pub(crate) fn new(
        id: SegId,
        memory: Region,
        pool: Arc<Home<R, B>>,
        arena: Option<ArenaMap>,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            memory,
            pool,
            leaked: AtomicBool::new(false),
            given_back: AtomicBool::new(false),
            arena,
        })
    }

    /// The pool actor gave the memory back: nothing is left for the drop to do.
    pub(crate) fn mark_given_back(&self) {
        self.given_back.store(true, Ordering::Release);
    }

    /// Marks the segment as never to be given back (a piece may still be used by the device).
    pub(crate) fn leak(&self) {
        self.leaked.store(true, Ordering::Relaxed);
    }

    /// Bytes of the segment.
    pub(crate) fn size(&self) -> usize {
        self.memory.size
    }

    /// `len` bytes at `offset` of the segment.
    pub(crate) fn part(&self, offset: usize, len: usize) -> Region {
        self.memory.part(offset, len)
    }

    /// The granule map, for the pool's arena.
    pub(crate) fn arena_map(&self) -> Option<&ArenaMap> {
        self.arena.as_ref()
    }

    /// Whether this is the pool's arena.
    pub(crate) fn is_arena(&self) -> bool {
        self.arena.is_some()
    }
}

impl<R: Runtime, B> Drop for Segment<R, B> {
    fn drop(&mut self) {
        if self.given_back.load(Ordering::Acquire) {
            return;
        }
        if self.leaked.load(Ordering::Relaxed) {
            tracing::warn!(
                bytes = self.memory.size,
                "segment still used by device work outlived its allocator's actors; leaked"
            );
            return;
        }
        // The pool actor is gone and this was the last holder: give the memory back here
        // (a refusal is logged and the memory leaked).
        if let Some(map) = &self.arena {
            let whole = !self.pool.memory.unmaps_granules();
            for (o, l) in map.mapped_ranges(whole) {
                let _ = self
                    .pool
                    .range_call(&self.memory, RangeCall::Unmap { at: o, len: l });
            }
            let maps = map.live_maps.swap(0, Ordering::Relaxed);
            self.pool.stats.allocations.decrease(maps as i64);
            if let Err(e) = self.pool.memory.unreserve(self.memory) {
                tracing::error!(error = %e, "giving back the reserved range failed");
            }
            return;
        }
        let _ = self.pool.free_memory_now(self.memory);
    }
}
