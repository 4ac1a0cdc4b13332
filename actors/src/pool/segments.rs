//! Carved segments: for a policy whose layout is [`BlockLayout::Carved`], the pool's host
//! allocations (segments) and the free ranges in them, and how the pool actor answers a miss
//! from them.
//!
//! Owns the [`Carver`] of the pool's segments; every block of such a pool is a range of one
//! segment and holds an `Arc` of it. A block's range is free in the carver only while no one
//! else holds the block: blocks in ready queues are drained into the carver on a miss that no
//! free range fits (and only then coalesce), while blocks waiting on events (with the poller)
//! or kept for graph replays (in the pool's `kept`) are never in it, so they are never cut
//! into a new block early (invariants 1 and 4). Fresh memory is taken only after completed
//! events have been noticed (invariant 3), on a blocking thread (invariant 6). A segment goes
//! back to the runtime only when no piece of it is lent (invariant 2); if the actor is gone,
//! the last block of a segment gives it back, unless device work may still use a piece.
//!
//! Every fresh segment reserves its bytes from the allocator's budget before the runtime is
//! asked (see `fresh`) and releases them when it goes back; cutting a block out of a segment
//! the pool holds reserves nothing. Segments are entered in the pool's registry like whole
//! blocks, and the pieces lent out of them are remembered here, so that a snapshot lists
//! each segment with its blocks and free ranges.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::{PieceView, PoolActor, PoolShared, SegmentView};
use crate::block::Block;
use crate::carve::{Carver, Piece, SegId};
use crate::error::Error;
use crate::policy::{BlockLayout, Carving, SizeClass};
use crate::runtime::{HostMemory, Runtime, RuntimeError};
use crate::snapshot::BlockMeta;

/// A large request reuses a free segment at most 1/8 larger than itself.
const LARGE_WASTE_DIVISOR: usize = 8;

/// One host allocation that blocks are cut out of.
pub(crate) struct Segment<R: Runtime> {
    id: SegId,
    /// Shared by small blocks (in the small carver) rather than cut for large ones.
    small: bool,
    memory: HostMemory,
    pool: Arc<PoolShared<R>>,
    /// Device work may still use a piece: never give the memory back.
    leaked: AtomicBool,
    /// The pool actor gave the memory back.
    given_back: AtomicBool,
}

impl<R: Runtime> Segment<R> {
    /// Marks the segment as never to be given back (a piece may still be used by the device).
    pub(crate) fn leak(&self) {
        self.leaked.store(true, Ordering::Relaxed);
    }
}

impl<R: Runtime> Drop for Segment<R> {
    fn drop(&mut self) {
        if self.given_back.load(Ordering::Acquire) {
            return;
        }
        if self.leaked.load(Ordering::Relaxed) {
            tracing::warn!(
                bytes = self.memory.size,
                "pinned segment still used by device work outlived its allocator's actors; leaked"
            );
            return;
        }
        // The pool actor is gone and this was the last holder: give the memory back here
        // (a refusal is logged and the memory leaked).
        let _ = self.pool.free_memory_now(self.memory);
    }
}

/// The free ranges of a pool's segments: small blocks and large ones are cut out of
/// different segments, so that small blocks do not pin holes into large free ranges.
pub(super) struct Segments<R: Runtime> {
    small: Carver<Arc<Segment<R>>>,
    large: Carver<Arc<Segment<R>>>,
    carving: Carving,
    /// Pieces lent out of the segments (in blocks, ready queues, waiting or kept), by
    /// address: their bytes and their blocks' records, for snapshots.
    lent: BTreeMap<usize, (usize, Arc<BlockMeta>)>,
}

impl<R: Runtime> Segments<R> {
    /// Segments for a carving layout; `None` for whole blocks.
    pub(super) fn for_layout(layout: BlockLayout) -> Option<Self> {
        match layout {
            BlockLayout::Whole => None,
            BlockLayout::Carved(carving) => Some(Self {
                small: Carver::new(),
                large: Carver::new(),
                carving,
                lent: BTreeMap::new(),
            }),
        }
    }

    /// (free ranges, free bytes, lent pieces), for the books.
    pub(super) fn census(&self) -> (usize, usize, usize) {
        let (s, l) = (&self.small, &self.large);
        (
            s.free_ranges() + l.free_ranges(),
            s.free_bytes() + l.free_bytes(),
            s.lent_pieces() + l.lent_pieces(),
        )
    }

    /// The pieces of every segment in address order, free ranges included, by segment
    /// address.
    pub(super) fn pieces(&self) -> BTreeMap<usize, Vec<PieceView>> {
        let mut out: BTreeMap<usize, Vec<PieceView>> = BTreeMap::new();
        for c in [&self.small, &self.large] {
            for (seg, ranges) in c.free_ranges_by_segment() {
                let base = seg.memory.ptr.as_ptr() as usize;
                let v = out.entry(base).or_default();
                v.extend(ranges.into_iter().map(|(offset, len)| PieceView {
                    addr: base + offset,
                    size: len,
                    meta: None,
                }));
            }
        }
        for (&addr, (size, meta)) in &self.lent {
            if let Some((_, v)) = out.range_mut(..=addr).next_back() {
                v.push(PieceView {
                    addr,
                    size: *size,
                    meta: Some(meta.clone()),
                });
            }
        }
        for v in out.values_mut() {
            v.sort_by_key(|p| p.addr);
        }
        out
    }

    fn carver(&mut self, small: bool) -> &mut Carver<Arc<Segment<R>>> {
        if small {
            &mut self.small
        } else {
            &mut self.large
        }
    }

    fn is_small(&self, size: usize) -> bool {
        size <= self.carving.small_limit
    }

    /// Bytes of a fresh segment for a block of `size` bytes.
    fn segment_size(&self, size: usize) -> usize {
        let c = &self.carving;
        if size <= c.small_limit {
            c.small_segment.max(size)
        } else {
            size.checked_next_multiple_of(c.large_round.max(1))
                .unwrap_or(size)
        }
    }
}

impl<R: Runtime> PoolActor<R> {
    /// Cuts a block of `class` out of the best-fitting free range, if one fits.
    fn carve_block(&mut self, class: SizeClass) -> Option<Box<Block<R>>> {
        let segs = self.carved.as_mut()?;
        let piece = if segs.is_small(class.size) {
            segs.small.carve(class.size)?
        } else {
            // A large free range is reused whole, and only when it wastes little: split, it
            // could no longer go back to the runtime when the peak needs room.
            segs.large
                .take_whole(class.size, class.size / LARGE_WASTE_DIVISOR)
                .or_else(|| segs.large.carve(class.size))?
        };
        let carver = segs.carver(segs.is_small(class.size));
        let seg = carver.payload(piece.seg)?.clone();
        // The piece lies inside the segment (the carver never hands out a range beyond it),
        // so the pointer stays inside one allocation and is not null.
        let ptr = std::ptr::NonNull::new(seg.memory.ptr.as_ptr().wrapping_add(piece.offset))?;
        let memory = HostMemory {
            ptr,
            size: piece.len,
            method: seg.memory.method,
        };
        let mut block = Block::new(memory, class.index, self.shared.clone());
        block.segment = Some(seg);
        segs.lent
            .insert(ptr.as_ptr() as usize, (piece.len, block.meta.clone()));
        Some(block)
    }

    /// Takes a carved block's range back into the free ranges, merging it with free
    /// neighbours. Returns false for a block that was not carved (left untouched).
    fn absorb(&mut self, block: &mut Box<Block<R>>) -> bool {
        let (Some(segs), Some(seg)) = (self.carved.as_mut(), block.segment.as_ref()) else {
            return false;
        };
        let addr = block.memory.ptr.as_ptr() as usize;
        let piece = Piece {
            seg: seg.id,
            offset: addr - seg.memory.ptr.as_ptr() as usize,
            len: block.size,
        };
        segs.lent.remove(&addr);
        if let Err(e) = segs.carver(seg.small).release(piece) {
            // Bookkeeping gone wrong: keep the range out of circulation rather than risk
            // handing it out twice.
            tracing::error!(
                ?e,
                ?piece,
                "carved block could not be taken back; range leaked"
            );
        }
        block.freed = true;
        block.segment = None;
        true
    }

    /// Moves every block of the ready queues into the free ranges.
    fn absorb_ready(&mut self) {
        for mut b in self.shared.ready.drain() {
            if !self.absorb(&mut b) {
                self.shared.ready.put(b);
            }
        }
    }

    /// Takes carved blocks back; returns those that were not carved.
    pub(super) fn absorb_all(&mut self, blocks: Vec<Box<Block<R>>>) -> Vec<Box<Block<R>>> {
        blocks
            .into_iter()
            .filter_map(|mut b| (!self.absorb(&mut b)).then_some(b))
            .collect()
    }

    /// Whether the pool carves, and the block is too large to cache.
    pub(super) fn uncacheable(&self, block: &Block<R>) -> bool {
        block.segment.is_some()
            && self
                .carved
                .as_ref()
                .is_some_and(|s| block.size > s.carving.max_cached_size)
    }

    /// A miss under a carving layout: a free range, then the ready queues drained and
    /// coalesced, then (after noticing completed events) the same again, then a fresh segment.
    pub(super) async fn miss_carved(&mut self, class: SizeClass) -> Result<Box<Block<R>>, Error> {
        if let Some(b) = self.carve_block(class) {
            return Ok(b);
        }
        self.absorb_ready();
        if let Some(b) = self.carve_block(class) {
            return Ok(b);
        }
        if self.shared.stats.waiting_blocks.load(Ordering::Relaxed) > 0 {
            self.flush_events().await;
            self.absorb_ready();
            if let Some(b) = self.carve_block(class) {
                return Ok(b);
            }
        }
        let size = match &self.carved {
            Some(s) => s.segment_size(class.size),
            None => class.size,
        };
        let reserved = self.shared.stats.allocated_bytes.read();
        let over =
            (reserved.current.max(0) as usize + size).saturating_sub(reserved.peak.max(0) as usize);
        if over > 0
            && self
                .carved
                .as_ref()
                .is_some_and(|s| s.carving.release_before_fresh)
        {
            // Nothing free fits, and the fresh segment would raise the peak of reserved
            // bytes: give back wholly free segments (none of them could serve it), largest
            // first, until it would not, or none is left.
            self.give_back_room(over).await;
        }
        let memory = self.fresh_memory(size).await?;
        let small = self.carved.as_ref().is_some_and(|s| s.is_small(class.size));
        self.add_segment(memory, small);
        self.remember_segment(SegmentView {
            memory,
            meta: Arc::default(),
            pieces: Vec::new(),
        });
        self.carve_block(class).ok_or_else(|| {
            Error::Runtime(RuntimeError::new(
                "carve",
                format!(
                    "a fresh segment of {size} bytes did not hold {} bytes",
                    class.size
                ),
            ))
        })
    }

    fn add_segment(&mut self, memory: HostMemory, small: bool) {
        let pool = self.shared.clone();
        if let Some(segs) = self.carved.as_mut() {
            segs.carver(small).add_segment_with(memory.size, |id| {
                Arc::new(Segment {
                    id,
                    small,
                    memory,
                    pool,
                    leaked: AtomicBool::new(false),
                    given_back: AtomicBool::new(false),
                })
            });
        }
    }

    /// Gives back wholly free segments, largest first, until `bytes` have gone back.
    async fn give_back_room(&mut self, bytes: usize) {
        let Some(segs) = self.carved.as_mut() else {
            return;
        };
        let mut candidates: Vec<(usize, bool, SegId)> = Vec::new();
        for small in [true, false] {
            let c = segs.carver(small);
            candidates.extend(c.free_segments().into_iter().map(|(id, n)| (n, small, id)));
        }
        candidates.sort_unstable_by(|a, b| b.cmp(a));
        let mut freed = 0;
        let mut gone = Vec::new();
        for (n, small, id) in candidates {
            if freed >= bytes {
                break;
            }
            if let Some((g, _)) = segs.carver(small).remove_segment(id) {
                gone.push(g);
                freed += n;
            }
        }
        self.host_free_segments(gone).await;
    }

    /// Gives back every wholly free segment (only those larger than `max_cached_size`
    /// unless `all`), on a blocking thread. Returns (segments, bytes).
    pub(super) async fn give_back_free_segments(&mut self, all: bool) -> (usize, usize) {
        let Some(segs) = self.carved.as_mut() else {
            return (0, 0);
        };
        let max = segs.carving.max_cached_size;
        let mut gone = segs.small.remove_free_segments(|size| !all && size <= max);
        gone.extend(segs.large.remove_free_segments(|size| !all && size <= max));
        let gone = gone.into_iter().map(|(g, _)| g).collect();
        self.host_free_segments(gone).await
    }

    /// Gives segments taken out of the carvers back to the runtime on a blocking thread. A
    /// segment the runtime refuses to free is held back (never reused, counted as kept) and
    /// tried again with the kept blocks. Returns (segments, bytes) given back.
    async fn host_free_segments(&mut self, gone: Vec<Arc<Segment<R>>>) -> (usize, usize) {
        if gone.is_empty() {
            return (0, 0);
        }
        let shared = self.shared.clone();
        let job = tokio::task::spawn_blocking(move || {
            let mut freed = (0, 0);
            let mut refused = Vec::new();
            for seg in gone {
                // Every piece came back, so no block holds the segment.
                match shared.free_memory_now(seg.memory) {
                    Ok(()) => {
                        seg.given_back.store(true, Ordering::Release);
                        freed = (freed.0 + 1, freed.1 + seg.memory.size);
                    }
                    Err(_) => refused.push(seg),
                }
            }
            (freed, refused)
        });
        match job.await {
            Ok((freed, refused)) => {
                let stats = &self.shared.stats;
                for seg in refused {
                    stats.kept_blocks.fetch_add(1, Ordering::Relaxed);
                    stats
                        .kept_bytes
                        .fetch_add(seg.memory.size as i64, Ordering::Relaxed);
                    self.refused.push(seg);
                }
                freed
            }
            Err(e) => {
                tracing::error!(error = %e, "freeing pinned memory failed");
                (0, 0)
            }
        }
    }

    /// Tries again to give back the segments whose free the runtime refused.
    pub(super) async fn retry_refused_segments(&mut self) -> (usize, usize) {
        let refused = std::mem::take(&mut self.refused);
        let stats = &self.shared.stats;
        for seg in &refused {
            stats.kept_blocks.fetch_sub(1, Ordering::Relaxed);
            stats
                .kept_bytes
                .fetch_sub(seg.memory.size as i64, Ordering::Relaxed);
        }
        self.host_free_segments(refused).await
    }

    /// Addresses and sizes of the segments held back after a refused free.
    pub(super) fn refused_segments(&self) -> Vec<(usize, usize)> {
        self.refused
            .iter()
            .map(|s| (s.memory.ptr.as_ptr() as usize, s.memory.size))
            .collect()
    }
}
