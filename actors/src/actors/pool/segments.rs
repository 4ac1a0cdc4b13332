//! Carved segments: for a policy whose layout is [`BlockLayout::Carved`], the pool's host
//! allocations (segments) and the free ranges in them, and how the pool actor answers a miss
//! from them. Where the runtime has expandable host memory, the pool's arena (see `arena`)
//! serves misses first; separate segments serve what it cannot.
//!
//! Owns the [`Carver`] of the pool's segments; every block of such a pool is a range of one
//! segment and holds an `Arc` of it. A block's range is free in the carver only while no one
//! else holds the block: blocks in the ready holder are drained into the carver at a miss that
//! neither a tight free range nor its class's last range serves (and only then coalesce;
//! large pieces that do not fill their segment come back at once, unless recalled), while
//! blocks waiting on events (with the poller) or kept for graph replays (in the pool's
//! `kept`) are never in it, so they are never cut into a new block early (invariants 1
//! and 4). Fresh memory is taken only after completed events have been noticed (invariant
//! 3), on a blocking thread (invariant 6). A segment goes back to the runtime only when no
//! piece of it is lent (invariant 2); if the actor is gone, the last block of a segment
//! gives it back, unless device work may still use a piece.
//!
//! Where a miss is cut from, when fresh memory is taken and how large, and which wholly free
//! segments go back first, are the layout's [`Carving`] rules (see `BestFit`): the pool
//! tracks the peak of live bytes it has seen at misses, for the reserve cap.
//!
//! Every fresh segment reserves its bytes from the allocator's budget before the runtime is
//! asked (see `fresh`) and releases them when it goes back; cutting a block out of a segment
//! the pool holds reserves nothing. Segments are entered in the pool's registry like whole
//! blocks, and the pieces lent out of them are remembered here, so that a snapshot lists
//! each segment with its blocks and free ranges.
//!
//! This file holds the books of the segments and how blocks are cut from them; the pool's
//! `miss` answers a miss from them, its `homecoming` takes blocks back into them, and
//! `give_back` returns wholly free segments to the source.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::arena::Arena;
use super::PoolActor;
use crate::blocks::block::{Block, Seg};
use crate::books::messages::{PieceView, SegmentView, Split};
use crate::books::segment::Segment;
use crate::holders::ready::ReadyHolder;
use crate::statistics::meta::MetaRef;
use crate::vocab::carve::{Carver, Piece, SegId};
use crate::vocab::memory::Region;
use crate::vocab::policy::{BlockLayout, Carving, SizeClass};
use crate::vocab::runtime::Runtime;

/// The free ranges of a pool's segments.
pub(super) struct Segments<R: Runtime> {
    pub(super) carver: Carver<Arc<Seg<R>>>,
    /// The peak of live bytes seen at misses (the requested block included).
    pub(super) peak_live: usize,
    /// Pieces lent out of the segments (in blocks, ready holder, waiting or kept), by
    /// address: their bytes and their blocks' records, for snapshots.
    pub(super) lent: BTreeMap<usize, (usize, MetaRef)>,
    /// The range each class last gave back, by class index, and whether it is in the
    /// arena: a miss of the class takes it again while it is wholly free.
    pub(super) last_range: HashMap<usize, (Piece, bool)>,
    /// The ready holder' slot lines of every class a block was cut for (see
    /// `ReadyHolder::drain_lines`): only those slots can hold blocks of this pool, so a
    /// miss drains them and skips the rest.
    pub(super) slot_lines: Vec<u64>,
    /// The pool's expandable range, once reserved (see `arena`).
    pub(super) arena: Option<Arena<R>>,
    /// Whether reserving the arena was tried (it is tried once, at the first miss).
    pub(super) arena_tried: bool,
    /// The arena's clock at the last trim (see `PoolActor::trim`).
    pub(super) trimmed_at: u64,
    pub(super) carving: Carving,
}

impl<R: Runtime> Segments<R> {
    /// Segments for a carving layout; `None` for whole blocks.
    pub(super) fn for_layout(layout: BlockLayout) -> Option<Self> {
        match layout {
            BlockLayout::Whole => None,
            BlockLayout::Carved(carving) => Some(Self {
                carver: Carver::new(),
                carving,
                peak_live: 0,
                lent: BTreeMap::new(),
                last_range: HashMap::new(),
                slot_lines: Vec::new(),
                arena: None,
                arena_tried: false,
                trimmed_at: 0,
            }),
        }
    }

    /// Forgets what the layout learned from requests, as the cache is emptied at the user's
    /// word: the peak of live bytes (which sizes fresh segments and caps reserved memory)
    /// starts again from the bytes live now, and no class goes back to the range it last
    /// gave back. A stream of requests replayed after that reserves what it did in a fresh
    /// pool (the decoder serving trace's device replay: 1.091 the first time, 1.119 the
    /// second without this).
    pub(super) fn forget(&mut self, live: usize) {
        self.peak_live = live;
        self.last_range.clear();
    }

    /// Marks the slot line of `class` as one that may hold this pool's blocks.
    fn mark_line(&mut self, class: usize) {
        let line = ReadyHolder::<Block<R>>::line_of(class);
        if self.slot_lines.len() <= line / 64 {
            self.slot_lines.resize(line / 64 + 1, 0);
        }
        self.slot_lines[line / 64] |= 1 << (line % 64);
    }

    /// Books a thread's split of a lent piece (see `Block::split_off`): one piece more, the
    /// rest's record for snapshots.
    pub(super) fn book_split(&mut self, s: Split) {
        for class in [s.first_class, s.rest_class] {
            self.mark_line(class);
        }
        if let Some(entry) = self.lent.get_mut(&s.addr) {
            entry.0 = s.first;
        }
        self.lent.insert(s.addr + s.first, (s.rest, s.rest_meta));
        let noted = match (s.in_arena, self.arena.as_mut()) {
            (true, Some(a)) => {
                let base = a.segment.memory.addr();
                a.split(s.addr + s.first - base)
            }
            (true, None) => false,
            (false, _) => self.carver.split_lent(s.seg),
        };
        if !noted {
            tracing::error!(addr = s.addr, "split of a block the pool does not lend");
        }
    }

    /// Free ranges, counted cheaply: the carver's, and the arena's but its unmapped tail
    /// (free ranges that reach into unmapped space count as one each).
    pub(super) fn free_ranges(&self) -> usize {
        let arena = self.arena.as_ref().map_or(0, |a| a.free_ranges());
        self.carver.free_ranges() + arena
    }

    /// (free ranges, free bytes, lent pieces), for the books.
    pub(super) fn census(&self) -> (usize, usize, usize) {
        let c = &self.carver;
        let (r, b, l) = self.arena.as_ref().map_or((0, 0, 0), |a| a.census());
        (c.free_ranges() + r, c.free_bytes() + b, c.lent_pieces() + l)
    }

    /// The arena's mapped runs, each listed as a segment.
    pub(super) fn arena_views(&self) -> Vec<SegmentView> {
        let Some(a) = &self.arena else {
            return Vec::new();
        };
        a.mapped_runs()
            .into_iter()
            .map(|((o, l), _)| SegmentView {
                memory: a.segment.part(o, l),
                meta: MetaRef::none(),
                pieces: Vec::new(),
            })
            .collect()
    }

    /// The pieces of every segment in address order, free ranges included, by segment
    /// address.
    pub(super) fn pieces(&self) -> BTreeMap<usize, Vec<PieceView>> {
        let mut out: BTreeMap<usize, Vec<PieceView>> = BTreeMap::new();
        for (seg, ranges) in self.carver.free_ranges_by_segment() {
            let base = seg.memory.ptr.as_ptr() as usize;
            let v = out.entry(base).or_default();
            v.extend(ranges.into_iter().map(|(offset, len)| PieceView {
                addr: base + offset,
                size: len,
                meta: None,
            }));
        }
        if let Some(a) = &self.arena {
            let base = a.segment.memory.ptr.as_ptr() as usize;
            for ((o, _), free) in a.mapped_runs() {
                let v = out.entry(base + o).or_default();
                v.extend(free.into_iter().map(|(offset, len)| PieceView {
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
                    meta: Some(*meta),
                });
            }
        }
        for v in out.values_mut() {
            v.sort_by_key(|p| p.addr);
        }
        out
    }

    /// Addresses of the lent pieces (in blocks, ready holder, waiting or kept) that overlap
    /// `[addr, addr + len)`.
    pub(super) fn lent_overlapping(&self, addr: usize, len: usize) -> Vec<usize> {
        let end = addr.saturating_add(len);
        self.lent
            .range(..end)
            .rev()
            .take_while(|(&a, &(size, _))| a + size > addr)
            .map(|(&a, _)| a)
            .collect()
    }

    /// Where `[addr, addr + len)` lies: `Some(true)` in the arena's reserved range,
    /// `Some(false)` in one separate segment, `None` outside the pool's memory.
    pub(super) fn locate(&self, addr: usize, len: usize) -> Option<bool> {
        if self.arena.as_ref().is_some_and(|a| a.holds(addr, len)) {
            return Some(true);
        }
        self.segment_holding(addr, len).map(|_| false)
    }

    /// The separate segment holding `[addr, addr + len)`.
    fn segment_holding(&self, addr: usize, len: usize) -> Option<(SegId, Arc<Seg<R>>)> {
        self.carver.segments_with().find_map(|(id, seg)| {
            let base = seg.memory.addr();
            let size = seg.memory.size;
            (addr >= base && len <= size && addr - base <= size - len).then(|| (id, seg.clone()))
        })
    }

    /// Cuts exactly `[addr, addr + len)` out of the free ranges (the arena's mapped memory or
    /// a separate segment), if it is wholly free there.
    pub(super) fn take_at(&mut self, addr: usize, len: usize) -> Option<(Piece, Arc<Seg<R>>)> {
        if let Some(a) = self.arena.as_mut().filter(|a| a.holds(addr, len)) {
            let offset = addr - a.segment.memory.addr();
            let piece = a.take_exact(Piece {
                seg: a.seg(),
                offset,
                len,
            })?;
            return Some((piece, a.segment.clone()));
        }
        let (id, seg) = self.segment_holding(addr, len)?;
        let piece = self.carver.take_exact(id, addr - seg.memory.addr(), len)?;
        Some((piece, seg))
    }

    /// Bytes of a fresh segment for a block of `size` bytes, with `room` bytes left under
    /// the reserve cap.
    pub(super) fn segment_size(&self, size: usize, room: usize) -> usize {
        let c = &self.carving;
        let base = if size <= c.small_limit {
            c.small_segment.max(size)
        } else {
            size
        };
        let fill = (room as u128 * c.fill_permille as u128 / 1000) as usize;
        base.max(fill)
            .checked_next_multiple_of(c.large_round.max(1))
            .unwrap_or(base)
    }

    /// Cuts a piece for `size` bytes; a wholly free segment much larger than it only when
    /// `split_any`.
    fn place(&mut self, size: usize, split_any: bool) -> Option<crate::vocab::carve::Piece> {
        let c = self.carving;
        self.carver
            .place(size, |seg| c.may_split(seg, size, split_any))
    }
}

impl<R: Runtime> PoolActor<R> {
    /// Cuts a block of `class` out of a free range, if one fits (see [`Carver::place`]).
    pub(super) fn carve_block(
        &mut self,
        class: SizeClass,
        split_any: bool,
    ) -> Option<Box<Block<R>>> {
        let segs = self.carved.as_mut()?;
        let piece = segs.place(class.size, split_any)?;
        let seg = segs.carver.payload(piece.seg)?.clone();
        self.block_for(class, piece, seg)
    }

    /// Cuts a block of `class` out of a free range of a separate segment that it fills to
    /// within 1/8, if there is one: such a miss is served without draining the ready
    /// queues. A block cut at the very range its class last gave back is recalled (see
    /// `recall`).
    pub(super) fn carve_tight(&mut self, class: SizeClass) -> Option<Box<Block<R>>> {
        let max_len = class.size.saturating_add(class.size / 8);
        let segs = self.carved.as_mut()?;
        let (piece, seg) = Self::tight_in_carver(segs, class.size, max_len)?;
        let recalled = segs.last_range.get(&class.index) == Some(&(piece, seg.is_arena()));
        let mut b = self.block_for(class, piece, seg)?;
        b.recalled = recalled;
        Some(b)
    }

    fn tight_in_carver(
        segs: &mut Segments<R>,
        size: usize,
        max_len: usize,
    ) -> Option<(Piece, Arc<Seg<R>>)> {
        let p = segs.carver.place_tight(size, max_len)?;
        Some((p, segs.carver.payload(p.seg)?.clone()))
    }

    /// Cuts a block of `class` at the range its class last gave back, if that is still
    /// wholly free (and mapped): such a miss is served without draining the ready holder
    /// (the layout is the one an earlier placement chose), and the block, its class asked
    /// for again and again, stays on the cached path when freed.
    pub(super) fn recall(&mut self, class: SizeClass) -> Option<Box<Block<R>>> {
        let segs = self.carved.as_mut()?;
        let (last, in_arena) = segs.last_range.remove(&class.index)?;
        if last.len != class.size {
            // A class of several sizes: the range its last block left is another size.
            return None;
        }
        let (piece, seg) = match (in_arena, segs.arena.as_mut()) {
            (true, Some(a)) => (a.take_exact(last)?, a.segment.clone()),
            (true, None) => return None,
            (false, _) => {
                let p = segs.carver.take_exact(last.seg, last.offset, last.len)?;
                (p, segs.carver.payload(p.seg)?.clone())
            }
        };
        let mut block = self.block_for(class, piece, seg)?;
        block.recalled = true;
        Some(block)
    }

    /// The block for a piece cut out of `seg` (a separate segment or the arena).
    pub(super) fn block_for(
        &mut self,
        class: SizeClass,
        piece: Piece,
        seg: Arc<Seg<R>>,
    ) -> Option<Box<Block<R>>> {
        let segs = self.carved.as_mut()?;
        // The piece lies inside the segment (the carver never hands out a range beyond it),
        // so the pointer stays inside one allocation and is not null.
        let ptr = std::ptr::NonNull::new(seg.memory.ptr.as_ptr().wrapping_add(piece.offset))?;
        let memory = Region {
            ptr,
            size: piece.len,
            method: seg.memory.method,
        };
        segs.mark_line(class.index);
        let block = self.shared.new_block(memory, class.index, seg);
        segs.lent
            .insert(ptr.as_ptr() as usize, (piece.len, block.meta));
        Some(block)
    }

    /// Enters a fresh segment in the carver: all of it free.
    pub(super) fn add_segment(&mut self, memory: Region) {
        let pool = self.shared.clone();
        if let Some(segs) = self.carved.as_mut() {
            segs.carver
                .add_segment_with(memory.size, |id| Segment::new(id, memory, pool, None));
        }
    }
}

mod give_back;
