//! Expandable memory (the arena): for a carving layout on a memory source that maps memory
//! into a reserved address range (`MemorySource::granularity`), one range reserved
//! up front that blocks are cut from, with memory mapped granule by granule as blocks
//! need it and unmapped again once no lent piece touches a granule.
//!
//! Owns the arena's carver (one segment: the whole range, mapped or not), which granules
//! are mapped, how many lent pieces touch each, when each was last touched, and which map
//! call mapped it. Separate segments leave free ranges stranded in segments that still lend
//! a piece; here free ranges coalesce across granules, a piece can grow into the free space
//! next to it, and a granule that no piece touches goes back on its own. It keeps these
//! rules, which the pool relies on:
//! - every granule a lent piece touches is mapped (a piece is lent only after its granules
//!   are mapped, and a granule is unmapped only while no lent piece touches it; blocks in
//!   ready holder, waiting on events or kept for replays are lent: invariants 1, 2 and 4);
//! - placement prefers the places that need the fewest granules mapped, then best fit;
//! - a map call is one host allocation in the books: it stays counted while any granule it
//!   mapped is mapped, and its bytes are charged to the budget granule by granule;
//! - memory no lent piece touches moves (`RangeCall::Move`) into the places a new
//!   piece needs before fresh memory is taken over the reserve cap, and only what cannot
//!   move goes back: where the source unmaps only whole map calls, runs are mapped in units
//!   of a power of two granules (`UNITS_PER_PEAK`), and idle units move whole.

//!
//! This file holds the arena's type and where it places pieces; `granules` keeps the books
//! of the mapped granules and their map calls, `moves` moves idle memory into the places a
//! new piece needs, `map` maps and unmaps memory for the pool actor, and `bits` is the
//! bitmap of mapped granules.

mod bits;
mod granules;
mod map;
mod moves;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::blocks::block::Seg;
use crate::vocab::carve::fits::Fits;
use crate::vocab::carve::{Carver, Piece, SegId};
use crate::vocab::runtime::Runtime;
use bits::Bits;

/// The upper zone of an arena, where small blocks are placed, is this share of it.
const SMALL_ZONE: usize = 8;

/// (offset, bytes) in the range.
type Range = (usize, usize);

/// A mapped granule.
#[derive(Debug, Clone, Copy)]
struct Granule {
    /// Lent pieces that touch it.
    refs: u32,
    /// When a piece touching it was last cut or given back (the arena's clock).
    used: u64,
    /// The map call that mapped it.
    map: u64,
}

/// The actor's side of an arena.
pub(super) struct Arena<R: Runtime> {
    carver: Carver<Arc<Seg<R>>>,
    seg: SegId,
    pub(super) segment: Arc<Seg<R>>,
    granule: usize,
    granules: BTreeMap<usize, Granule>,
    /// The granules mapped, as bits (see [`Bits`]).
    mapped_bits: Bits,
    /// The mapped parts of the free ranges by length: best fit without a scan.
    fits: Fits,
    /// Blocks up to this size are placed in the upper zone of the range (see [`Fits`]).
    small_limit: usize,
    /// The free ranges around a change, for [`Self::refit`] (kept to reuse its buffer).
    around: Vec<(usize, usize)>,
    /// Granules still mapped, by map call.
    maps: HashMap<u64, usize>,
    next_map: u64,
    clock: u64,
    /// The memory source unmaps only whole map calls (see `MemorySource::unmaps_granules`):
    /// each run is mapped by a call of its own and goes back whole, once no lent piece
    /// touches any of its granules.
    whole: bool,
    /// Places memory moved away from that stay mapped until the work queued on them before
    /// the move has run (see `PoolActor::move_idle`): each batch of moves with the event
    /// recorded on the pool's stream at the move; the places are held as lent pieces
    /// meanwhile, so that nothing is placed or mapped there.
    leaving: Vec<(Vec<Piece>, R::Event)>,
}

/// Granules of `[offset, offset + len)`.
fn span(granule: usize, offset: usize, len: usize) -> std::ops::Range<usize> {
    offset / granule..(offset + len.max(1)).div_ceil(granule)
}

/// How many granules of `[offset, offset + len)` are not mapped.
fn count_unmapped(mapped: &Bits, granule: usize, offset: usize, len: usize) -> usize {
    let span = span(granule, offset, len);
    span.len() - mapped.count(span)
}

impl<R: Runtime> Arena<R> {
    /// An arena over the reserved range of `segment` (whose `arena` map is set); blocks up to
    /// `small_limit` bytes are placed in its upper eighth, the others below.
    pub(super) fn new(
        segment: Arc<Seg<R>>,
        granule: usize,
        whole: bool,
        small_limit: usize,
    ) -> Self {
        let mut carver = Carver::new();
        let size = segment.size();
        let boundary = (size - size / SMALL_ZONE) / granule.max(1) * granule.max(1);
        let seg = carver.add_segment_with(size, |_| segment.clone());
        Self {
            carver,
            seg,
            segment,
            granule,
            granules: BTreeMap::new(),
            mapped_bits: Bits::new(size.div_ceil(granule.max(1))),
            fits: Fits::new(granule, boundary),
            small_limit,
            around: Vec::new(),
            maps: HashMap::new(),
            next_map: 0,
            clock: 0,
            whole,
            leaving: Vec::new(),
        }
    }

    /// Brings the index of fits up to date after a change of the free ranges or of the
    /// mapping inside `[lo, hi)` (see [`Fits::refit`]).
    fn refit(&mut self, lo: usize, hi: usize) {
        let mut free = std::mem::take(&mut self.around);
        self.carver.free_touching(self.seg, lo, hi, &mut free);
        self.fits.refit(lo, hi, &free);
        self.around = free;
    }

    /// Whether each run is mapped, and unmapped, as one piece of memory.
    pub(super) fn whole_runs(&self) -> bool {
        self.whole
    }

    /// The arena's clock: it ticks at every piece cut or taken back.
    pub(super) fn clock(&self) -> u64 {
        self.clock
    }

    /// Bytes of a granule.
    pub(super) fn granule(&self) -> usize {
        self.granule
    }

    /// Cuts a piece for `size` bytes out of mapped memory only, at the start of the
    /// shortest stretch of mapped free memory that holds it (see [`Fits::best`]), if that
    /// stretch is no longer than `max_len`: one lookup, no scan.
    pub(super) fn place_mapped(&mut self, size: usize, max_len: usize) -> Option<(Piece, bool)> {
        let want = crate::vocab::carve::align_up(size.max(1))?;
        let (offset, len) = self.fits.best(want, self.zone_for(want))?;
        if len > max_len {
            return None;
        }
        let piece = self.carver.take_exact(self.seg, offset, want)?;
        self.refit(piece.offset, piece.offset + piece.len);
        self.touch(piece);
        Some((piece, len == want))
    }

    /// Cuts a piece for `size` bytes where the fewest granules need mapping, then from the
    /// smallest free range, then at the lowest address; places start or end at a free
    /// range's ends. With `pack`, second comes where the piece leaves the least of the
    /// granules it touches unused (its last granule's tail, and its first granule's head
    /// when no other piece uses that granule: what would be stranded around it), and places
    /// may also start or end at granule boundaries. Returns the piece and the granules it
    /// still needs mapped (the mapped ones it touches are held from now on).
    pub(super) fn place(&mut self, size: usize, pack: bool) -> Option<(Piece, Vec<usize>)> {
        let want = crate::vocab::carve::align_up(size)?;
        let zone = self.zone_for(want);
        let piece = self
            .place_in(want, pack, Some(zone))
            .or_else(|| self.place_in(want, pack, Some(1 - zone)))
            .or_else(|| self.place_in(want, pack, None))?;
        self.refit(piece.offset, piece.offset + piece.len);
        self.touch(piece);
        let need = span(self.granule, piece.offset, piece.len)
            .filter(|i| !self.granules.contains_key(i))
            .collect();
        Some((piece, need))
    }

    /// The zone a block of `want` bytes is placed in: the upper one for small blocks.
    fn zone_for(&self, want: usize) -> usize {
        usize::from(want <= self.small_limit)
    }

    /// [`Self::place`] within one zone (`None`: anywhere, across the boundary too).
    fn place_in(&mut self, want: usize, pack: bool, zone: Option<usize>) -> Option<Piece> {
        let (granules, bits, g) = (&self.granules, &self.mapped_bits, self.granule);
        // Packing granules pays where small blocks share them; a large block placed to leave
        // the least of its granules unused strands the free memory beside it instead
        // (ResNet-50's replay: 1.007 of its peak packed, 1.005 not).
        let pack = pack && zone == Some(1);
        let edge = if pack { g } else { 0 };
        let boundary = self.fits.boundary();
        let fits = |at: usize| match zone {
            Some(1) => at >= boundary,
            Some(_) => at + want <= boundary,
            None => true,
        };
        self.carver.place_ranked(self.seg, want, edge, |at, len| {
            if !fits(at) {
                return None;
            }
            let stranded = if pack {
                let tail = (g - (at + want) % g) % g;
                let head_shared = granules.get(&(at / g)).is_some_and(|gr| gr.refs > 0);
                tail + if head_shared { 0 } else { at % g }
            } else {
                0
            };
            Some((count_unmapped(bits, g, at, want), stranded, len, at))
        })
    }

    /// Cuts exactly `piece` again, if it is wholly free and mapped.
    pub(super) fn take_exact(&mut self, piece: Piece) -> Option<Piece> {
        if piece.seg != self.seg
            || count_unmapped(&self.mapped_bits, self.granule, piece.offset, piece.len) > 0
        {
            return None;
        }
        let p = self.carver.take_exact(self.seg, piece.offset, piece.len)?;
        self.refit(p.offset, p.offset + p.len);
        self.touch(p);
        Some(p)
    }

    /// The runs of unmapped granules that `[offset, offset + len)` spans, each cut out of
    /// the free ranges as a piece (no lent piece touches an unmapped granule, so each run is
    /// free), with its granules: mapped by `map_for`, they stay held by the piece.
    pub(super) fn take_unmapped(&mut self, offset: usize, len: usize) -> Vec<(Piece, Vec<usize>)> {
        let unmapped: Vec<usize> = span(self.granule, offset, len)
            .filter(|i| !self.granules.contains_key(i))
            .collect();
        let mut out = Vec::new();
        for (o, l) in self.runs(&unmapped) {
            if let Some(p) = self.carver.take_exact(self.seg, o, l) {
                self.refit(o, o + l);
                out.push((p, (o / self.granule..(o + l) / self.granule).collect()));
            }
        }
        out
    }

    /// Whether `[addr, addr + len)` lies in the reserved range.
    pub(super) fn holds(&self, addr: usize, len: usize) -> bool {
        let base = self.segment.memory.addr();
        let size = self.segment.size();
        addr >= base && len <= size && addr - base <= size - len
    }

    /// Holds the mapped granules a piece touches.
    fn touch(&mut self, piece: Piece) {
        self.clock += 1;
        for (_, gr) in self
            .granules
            .range_mut(span(self.granule, piece.offset, piece.len))
        {
            gr.refs += 1;
            gr.used = self.clock;
        }
    }

    /// A lent piece was split at `at` (an offset in the range) by whoever held it: one more
    /// piece is lent, and the granule the cut falls inside, if any, is touched by both.
    pub(super) fn split(&mut self, at: usize) -> bool {
        if !self.carver.split_lent(self.seg) {
            return false;
        }
        if at % self.granule != 0 {
            if let Some(gr) = self.granules.get_mut(&(at / self.granule)) {
                gr.refs += 1;
            }
        }
        true
    }

    /// Takes a lent piece back (or one whose granules could not be mapped): its granules
    /// are let go and its range coalesces with free neighbours.
    pub(super) fn release(&mut self, piece: Piece) -> Result<(), crate::vocab::carve::CarveError> {
        self.carver.release(piece)?;
        self.refit(piece.offset, piece.offset + piece.len);
        self.clock += 1;
        for (_, gr) in self
            .granules
            .range_mut(span(self.granule, piece.offset, piece.len))
        {
            gr.refs = gr.refs.saturating_sub(1);
            gr.used = self.clock;
        }
        Ok(())
    }

    /// The mapped runs, as (offset, bytes), with the free ranges inside each.
    pub(super) fn mapped_runs(&self) -> Vec<(Range, Vec<Range>)> {
        let all: Vec<usize> = self.granules.keys().copied().collect();
        let free: Vec<(usize, usize)> = self
            .carver
            .free_ranges_by_segment()
            .flat_map(|(_, r)| r)
            .collect();
        self.runs(&all)
            .into_iter()
            .map(|(o, l)| {
                let inside = free
                    .iter()
                    .filter_map(|&(fo, fl)| {
                        let (a, b) = (fo.max(o), (fo + fl).min(o + l));
                        (a < b).then(|| (a, b - a))
                    })
                    .collect();
                ((o, l), inside)
            })
            .collect()
    }

    /// Free ranges of the range but the last one (the unmapped rest of the reservation).
    pub(super) fn free_ranges(&self) -> usize {
        self.carver.free_ranges().saturating_sub(1)
    }

    /// (free ranges, free bytes) inside mapped memory, and pieces lent.
    pub(super) fn census(&self) -> (usize, usize, usize) {
        let (mut ranges, mut bytes) = (0, 0);
        for (_, free) in self.mapped_runs() {
            ranges += free.len();
            bytes += free.iter().map(|r| r.1).sum::<usize>();
        }
        (ranges, bytes, self.carver.lent_pieces())
    }

    /// The segment's id in the arena's carver.
    pub(super) fn seg(&self) -> SegId {
        self.seg
    }
}
