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
//!   ready queues, waiting on events or kept for replays are lent: invariants 1, 2 and 4);
//! - placement prefers the places that need the fewest granules mapped, then best fit;
//! - a map call is one host allocation in the books: it stays counted while any granule it
//!   mapped is mapped, and its bytes are charged to the budget granule by granule;
//! - memory no lent piece touches moves (`MemorySource::remap_run`) into the places a new
//!   piece needs before fresh memory is taken over the reserve cap, and only what cannot
//!   move goes back: where the source unmaps only whole map calls, runs are mapped in units
//!   of a power of two granules (`UNITS_PER_PEAK`), and idle units move whole.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::PoolActor;
use crate::blocks::block::Seg;
use crate::books::segment::{ArenaMap, Segment};
use crate::vocab::carve::fits::Fits;
use crate::vocab::carve::{Carver, Piece, SegId};
use crate::vocab::error::{Error, OomCause};
use crate::vocab::memory::units;
use crate::vocab::runtime::{Runtime, RuntimeError};

/// Under a memory limit of fewer granules than this, a pool keeps separate segments.
const MIN_GRANULES_UNDER_LIMIT: usize = 8;

/// Where the memory source unmaps only whole map calls, a run is mapped in units of up to
/// this share of the pool's peak of live bytes (a power of two granules): one call maps a
/// large block's run in a few units rather than granule by granule, while an idle unit is
/// small enough to be moved into the places a later block needs (`Arena::plan_moves`)
/// instead of memory going back and fresh memory being taken (replayed request streams:
/// 3-8x fewer map calls, peak reserved over peak live within 1.10).
const UNITS_PER_PEAK: usize = 32;

/// A run is mapped in units of at least this share of it (and a power of two granules),
/// however small the pool's peak still is: a large block's first run is a few map calls
/// even before the peak has grown (the ResNet-50 replay: 51 calls a run instead of 95, peak
/// reserved over peak live 1.06; at a quarter, 1.11).
const UNITS_PER_RUN: usize = 8;

/// How long a miss looks at the events of moves not ended yet before it places a block
/// (`PoolActor::retire_moves`): an event whose stream is about to run out of work completes
/// within microseconds, and an old place taken back in time keeps the layout as tight as
/// moves that waited would. Longer work is not waited for.
const MOVE_PATIENCE: std::time::Duration = std::time::Duration::from_micros(50);

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

/// One bit per granule of the range, set where it is mapped (the keys of
/// `Arena::granules`): placing a block asks how many granules of a candidate place are
/// mapped for every free range it looks at, which a walk of the tree made the larger part
/// of a miss's work in a large arena.
struct Bits(Vec<u64>);

impl Bits {
    fn new(granules: usize) -> Self {
        Self(vec![0; granules.div_ceil(64)])
    }

    fn set(&mut self, i: usize, on: bool) {
        if let Some(w) = self.0.get_mut(i / 64) {
            if on {
                *w |= 1 << (i % 64);
            } else {
                *w &= !(1 << (i % 64));
            }
        }
    }

    /// How many granules of `span` are set.
    fn count(&self, span: std::ops::Range<usize>) -> usize {
        if span.is_empty() {
            return 0;
        }
        let (first, last) = (span.start / 64, (span.end - 1) / 64);
        (first..=last)
            .map(|w| {
                let mut bits = self.0.get(w).copied().unwrap_or(0);
                if w == first {
                    bits &= !0u64 << (span.start % 64);
                }
                if w == last && span.end % 64 != 0 {
                    bits &= !0u64 >> (64 - span.end % 64);
                }
                bits.count_ones() as usize
            })
            .sum()
    }
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

    /// Holds the place `[offset, offset + len)` that memory just moved away from (idle, so
    /// wholly free) until the move ends; `None` if it is not free (the move must end now).
    pub(super) fn hold_leaving(&mut self, offset: usize, len: usize) -> Option<Piece> {
        let p = self.carver.take_exact(self.seg, offset, len)?;
        self.refit(p.offset, p.offset + p.len);
        Some(p)
    }

    /// Brings the index of fits up to date after a change of the free ranges or of the
    /// mapping inside `[lo, hi)` (see [`Fits::refit`]).
    fn refit(&mut self, lo: usize, hi: usize) {
        let mut free = std::mem::take(&mut self.around);
        self.carver.free_touching(self.seg, lo, hi, &mut free);
        self.fits.refit(lo, hi, &free);
        self.around = free;
    }

    /// Enters a batch of held places memory moved away from, and the event after which no
    /// queued work uses them.
    pub(super) fn leave(&mut self, places: Vec<Piece>, event: R::Event) {
        self.leaving.push((places, event));
    }

    /// Whether moves wait to end.
    pub(super) fn has_leaving(&self) -> bool {
        !self.leaving.is_empty()
    }

    /// Takes the batches of places whose event `done` says completed.
    pub(super) fn take_left(
        &mut self,
        mut done: impl FnMut(&R::Event) -> bool,
    ) -> Vec<(Vec<Piece>, R::Event)> {
        let (left, still): (Vec<_>, Vec<_>) = std::mem::take(&mut self.leaving)
            .into_iter()
            .partition(|(_, e)| done(e));
        self.leaving = still;
        left
    }

    /// A held place whose mapping has ended goes back to the free ranges.
    pub(super) fn release_left(&mut self, place: Piece) {
        let released = self.carver.release(place);
        self.refit(place.offset, place.offset + place.len);
        if let Err(e) = released {
            tracing::error!(
                ?e,
                ?place,
                "arena place could not be taken back; range leaked"
            );
        }
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

    /// Enters granules just mapped by one map call, held by the one piece that needed them.
    pub(super) fn mapped(&mut self, granules: &[usize]) {
        if granules.is_empty() {
            return;
        }
        let map = self.next_map;
        self.next_map += 1;
        self.maps.insert(map, granules.len());
        for &i in granules {
            self.granules.insert(
                i,
                Granule {
                    refs: 1,
                    used: self.clock,
                    map,
                },
            );
            self.mapped_bits.set(i, true);
        }
        if let Some(m) = self.segment.arena_map() {
            granules.iter().for_each(|&i| m.set(i, true));
            m.set_start(granules[0], true);
            m.live_maps.fetch_add(1, Ordering::Relaxed);
        }
        self.refit_granules(granules, true);
    }

    /// Enters `granules` (in order) as mapped or unmapped in the index of fits, and refits
    /// the spans they cover.
    fn refit_granules(&mut self, granules: &[usize], mapped: bool) {
        let g = self.granule;
        for (o, l) in self.runs(granules) {
            if mapped {
                self.fits.map(o / g, (o + l) / g);
            } else {
                self.fits.unmap(o / g, (o + l) / g);
            }
            self.refit(o, o + l);
        }
    }

    /// Enters the memory of the idle run of `n` granules at `from` (one map call's, or one
    /// granule where the source unmaps granule by granule) moved to the `n` granules at
    /// `to`, which the piece just placed needs: they join `from`'s map call (their memory
    /// is the same), held by that piece.
    pub(super) fn moved(&mut self, from: usize, to: usize, n: usize) {
        for k in 0..n {
            let Some(gr) = self.granules.remove(&(from + k)) else {
                continue;
            };
            self.mapped_bits.set(from + k, false);
            self.mapped_bits.set(to + k, true);
            self.granules.insert(
                to + k,
                Granule {
                    refs: 1,
                    used: self.clock,
                    map: gr.map,
                },
            );
            if let Some(m) = self.segment.arena_map() {
                m.set(from + k, false);
                m.set_start(from + k, false);
                m.set(to + k, true);
            }
        }
        if let Some(m) = self.segment.arena_map() {
            m.set_start(to, true);
        }
        let (gone, came): (Vec<usize>, Vec<usize>) =
            ((from..from + n).collect(), (to..to + n).collect());
        self.refit_granules(&gone, false);
        self.refit_granules(&came, true);
    }

    /// Which idle memory to move into the places of `need` (granules, in order), at most
    /// `max` granules of it, as (from, to, granules): least recently used idle granules one
    /// by one where the source unmaps granule by granule; where it unmaps only whole map
    /// calls, idle calls whole, each into a run of `need` that holds it (the largest that
    /// fits first, then the least recently used), so that a run is filled from its start.
    pub(super) fn plan_moves(&self, need: &[usize], max: usize) -> Vec<(usize, usize, usize)> {
        if !self.whole {
            return self
                .idle_granules(max.min(need.len()) * self.granule, u64::MAX)
                .into_iter()
                .zip(need.iter().copied())
                .map(|(f, t)| (f, t, 1))
                .collect();
        }
        // Idle calls as (granules, last use, first granule).
        let mut idle: Vec<(usize, u64, usize)> = self
            .idle_calls()
            .into_iter()
            .map(|(used, first, n)| (n, used, first))
            .collect();
        // Ties (units cut for one piece were used last at the same tick) go by address, so
        // that the same requests move the same memory every time.
        idle.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut out = Vec::new();
        let mut budget = max;
        for (at, len) in self.runs(need) {
            let (mut to, end) = (at / self.granule, (at + len) / self.granule);
            while to < end && budget > 0 {
                let room = (end - to).min(budget);
                let Some(k) = idle.iter().position(|c| c.0 <= room) else {
                    break;
                };
                let (n, _, first) = idle.remove(k);
                out.push((first, to, n));
                to += n;
                budget -= n;
            }
        }
        out
    }

    /// Map calls none of whose granules a lent piece touches, as (last use, first granule,
    /// granules).
    fn idle_calls(&self) -> Vec<(u64, usize, usize)> {
        let mut calls: HashMap<u64, (u64, usize, usize, bool)> = HashMap::new();
        for (&i, gr) in &self.granules {
            let e = calls.entry(gr.map).or_insert((0, i, 0, true));
            e.0 = e.0.max(gr.used);
            e.1 = e.1.min(i);
            e.2 += 1;
            e.3 &= gr.refs == 0;
        }
        calls
            .into_values()
            .filter(|c| c.3)
            .map(|(used, first, n, _)| (used, first, n))
            .collect()
    }

    /// Strikes unmapped granules; returns how many map calls have no granule mapped any more.
    pub(super) fn unmapped(&mut self, granules: &[usize]) -> usize {
        let mut ended = 0;
        for i in granules {
            let Some(gr) = self.granules.remove(i) else {
                continue;
            };
            self.mapped_bits.set(*i, false);
            if let Some(m) = self.segment.arena_map() {
                m.set(*i, false);
                m.set_start(*i, false);
            }
            if let Some(n) = self.maps.get_mut(&gr.map) {
                *n -= 1;
                if *n == 0 {
                    self.maps.remove(&gr.map);
                    ended += 1;
                }
            }
        }
        if let Some(m) = self.segment.arena_map() {
            m.live_maps.fetch_sub(ended, Ordering::Relaxed);
        }
        let mut gone = granules.to_vec();
        gone.sort_unstable();
        self.refit_granules(&gone, false);
        ended
    }

    /// The ranges to unmap to give back `bytes` of idle memory (all of it for `usize::MAX`),
    /// least recently used first: runs of idle granules, or, when the source unmaps only
    /// whole map calls, the runs of map calls none of whose granules a lent piece touches;
    /// only memory last used before the arena's clock read `before` (see [`Self::clock`]).
    pub(super) fn idle_runs(&self, bytes: usize, before: u64) -> Vec<(usize, usize)> {
        if !self.whole {
            return self.runs(&self.idle_granules(bytes, before));
        }
        let mut idle = self.idle_calls();
        idle.retain(|c| c.0 < before);
        idle.sort_unstable();
        let mut out = Vec::new();
        let mut freed = 0;
        for (_, first, n) in idle {
            if freed >= bytes {
                break;
            }
            out.push((first * self.granule, n * self.granule));
            freed = freed.saturating_add(n * self.granule);
        }
        out
    }

    /// Mapped granules that no lent piece touches, last used before the clock read `before`,
    /// least recently used first, until they make `bytes` (all of them when `bytes` is
    /// `usize::MAX`).
    pub(super) fn idle_granules(&self, bytes: usize, before: u64) -> Vec<usize> {
        let mut idle: Vec<(u64, usize)> = self
            .granules
            .iter()
            .filter(|(_, gr)| gr.refs == 0 && gr.used < before)
            .map(|(&i, gr)| (gr.used, i))
            .collect();
        idle.sort_unstable();
        let n = bytes.div_ceil(self.granule).min(idle.len());
        let mut out: Vec<usize> = idle[..n].iter().map(|&(_, i)| i).collect();
        out.sort_unstable();
        out
    }

    /// The calls that map `granules`, one per maximal run, as (offset, bytes, unit): each
    /// unit is one mapping. Where the source unmaps only whole mappings, runs of at least
    /// `whole_from` bytes are one unit, and shorter ones are cut into units of a power of two
    /// granules up to `max_unit` bytes or an eighth of the run, whichever is more (see
    /// `UNITS_PER_RUN`), largest first, so that idle units fit the places of later runs (see
    /// `plan_moves`); elsewhere a run is one unit.
    pub(super) fn map_calls(
        &self,
        granules: &[usize],
        whole_from: usize,
        max_unit: usize,
    ) -> Vec<(usize, usize, usize)> {
        let g = self.granule;
        let max_units = (max_unit / g).max(1);
        let mut out = Vec::new();
        for (o, l) in self.runs(granules) {
            if !self.whole || l >= whole_from {
                out.push((o, l, l));
                continue;
            }
            let (mut at, end) = (o / g, (o + l) / g);
            let most = max_units.max((end - at) / UNITS_PER_RUN).max(1);
            while at < end {
                let n = 1usize << (usize::BITS - 1 - (end - at).min(most).leading_zeros());
                out.push((at * g, n * g, n * g));
                at += n;
            }
        }
        out
    }

    /// Maximal runs of consecutive granules, as (offset, bytes).
    pub(super) fn runs(&self, granules: &[usize]) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &i in granules {
            match runs.last_mut() {
                Some((o, l)) if *o + *l == i * self.granule => *l += self.granule,
                _ => runs.push((i * self.granule, self.granule)),
            }
        }
        runs
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

    /// (free ranges, free bytes) inside mapped memory, and pieces lent.
    /// Free ranges of the range but the last one (the unmapped rest of the reservation).
    pub(super) fn free_ranges(&self) -> usize {
        self.carver.free_ranges().saturating_sub(1)
    }

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

impl<R: Runtime> PoolActor<R> {
    /// Whether the pool has an arena; reserves it at the first call. No arena (and
    /// separate segments from then on) when the layout does not want one or the runtime
    /// cannot.
    pub(super) async fn has_arena(&mut self) -> bool {
        let Some(segs) = self.carved.as_mut() else {
            return false;
        };
        if segs.arena_tried {
            return segs.arena.is_some();
        }
        self.reserve_arena().await.is_some()
    }

    async fn reserve_arena(&mut self) -> Option<()> {
        let segs = self.carved.as_mut()?;
        segs.arena_tried = true;
        let c = segs.carving;
        let granule = self.shared.memory.granularity()?;
        if !c.expandable || granule == 0 || !granule.is_power_of_two() {
            return None;
        }
        let limit = self.shared.budget.limit().unwrap_or(usize::MAX);
        if limit / granule < MIN_GRANULES_UNDER_LIMIT {
            // Granules would be too coarse for the limit: blocks get their own sizes.
            return None;
        }
        // Under a limit, twice its address space: room for the places that memory moves
        // to (see `move_idle`) beside those it leaves.
        let size = c
            .arena_reserve
            .min(limit.saturating_mul(2).saturating_add(granule - 1))
            .checked_next_multiple_of(granule)?;
        let source = self.shared.memory.clone();
        let reserved = self.off_executor(move || source.reserve(size)).await;
        let memory = match reserved {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, bytes = size, "no expandable memory; separate segments");
                return None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "reserving expandable memory failed");
                return None;
            }
        };
        let map = ArenaMap::new(granule, memory.size);
        let segment = Segment::new(SegId(u64::MAX), memory, self.shared.clone(), Some(map));
        let segs = self.carved.as_mut()?;
        let whole = !self.shared.memory.unmaps_granules();
        segs.arena = Some(Arena::new(segment, granule, whole, c.small_limit));
        Some(())
    }

    /// Maps the granules a piece needs (one map call), first moving or unmapping idle
    /// granules to stay under `cap` (the garbage-collection threshold) and under the memory
    /// limit. The reserve cap is not looked at here: memory above it goes back between bursts
    /// (see `PoolActor::trim`), not while requests come. On failure the piece goes back into
    /// the arena.
    pub(super) async fn map_for(
        &mut self,
        piece: Piece,
        need: Vec<usize>,
        cap: Option<usize>,
    ) -> Result<(), Error> {
        let Some(arena) = self.carved.as_ref().and_then(|s| s.arena.as_ref()) else {
            return Err(Error::Runtime(RuntimeError::new("host_map", "no arena")));
        };
        let granule = arena.granule();
        let movable = self.shared.memory.remaps();
        let whole = arena.whole_runs();
        let mut need = need;
        let reserved = self.shared.stats.allocated_bytes.read().current.max(0) as usize;
        let budget = self.shared.budget.clone();
        if movable {
            // Over `cap` or the memory limit: idle memory moves into the piece's places
            // instead of going back while fresh memory is taken for it. Where memory goes
            // back only by whole map calls, every idle call that fits moves (each is a call
            // that need not be made, and a piece of memory that need not go back).
            let bytes = need.len() * granule;
            let over_cap = cap.map_or(0, |c| (reserved + bytes).saturating_sub(c));
            let over_limit = budget
                .limit()
                .map_or(0, |l| (budget.reserved() + bytes).saturating_sub(l));
            let over = over_cap.max(over_limit);
            if over > 0 {
                let n = if whole {
                    need.len()
                } else {
                    over.div_ceil(granule)
                };
                self.move_idle(&mut need, n).await;
            }
        }
        let bytes = need.len() * granule;
        if let Some(over) = cap.and_then(|c| (reserved + bytes).checked_sub(c)) {
            self.unmap_idle(over).await;
        }
        if need.is_empty() {
            // Every granule the piece needed was moved there.
            return Ok(());
        }
        if !budget.try_reserve(bytes) {
            self.unmap_idle(bytes).await;
            if !budget.try_reserve(bytes) {
                self.release_unmapped(piece);
                return Err(Error::OutOfMemory {
                    requested: bytes,
                    reserved: budget.reserved(),
                    limit: budget.limit(),
                    cause: OomCause::NoRoomNow,
                });
            }
        }
        let Some(arena) = self.carved.as_ref().and_then(|s| s.arena.as_ref()) else {
            budget.release(bytes);
            return Err(Error::Runtime(RuntimeError::new("host_map", "no arena")));
        };
        let whole_from = self
            .carved
            .as_ref()
            .map_or(usize::MAX, |s| s.carving.map_whole_from);
        // One source call per run of consecutive granules, which maps the run's units in
        // one go (CUDA grants access to the run once, not per unit).
        // Units grow with the pool's peak: few map calls for large runs, and units small
        // enough for idle ones to fit elsewhere.
        let peak_live = self.carved.as_ref().map_or(0, |s| s.peak_live);
        let max_unit = peak_live / UNITS_PER_PEAK;
        let runs = arena.map_calls(&need, whole_from, max_unit);
        let mappings: Vec<(usize, usize)> =
            runs.iter().flat_map(|&(o, l, u)| units(o, l, u)).collect();
        // The granules of each map call, as the books enter them: one call per unit where
        // each goes back whole, else the piece's granules as one.
        let g = arena.granule();
        let groups: Vec<Vec<usize>> = if arena.whole_runs() {
            mappings
                .iter()
                .map(|&(o, l)| (o / g..(o + l) / g).collect())
                .collect()
        } else {
            vec![need]
        };
        let calls = groups.len();
        let (segment, shared) = (arena.segment.clone(), self.shared.clone());
        let t0 = Instant::now();
        let job = self.start_off_executor(move || {
            let mut done = Vec::new();
            for &(o, l, unit) in &runs {
                if let Err(e) = shared.map_now(&segment.memory, o, l, unit) {
                    // All or nothing: what this call mapped goes back (and its bytes to
                    // the budget, as `unmap_now` does).
                    let mut released = 0;
                    for (o, l) in done {
                        if shared.unmap_unused_now(&segment.memory, o, l).is_ok() {
                            released += l;
                        }
                    }
                    // Out of the segment's map here, not after the await: the actor may be
                    // gone by then, and the segment's drop must not unmap these.
                    if let Some(m) = segment.arena_map() {
                        runs.iter().for_each(|&(o, l, _)| m.clear(o, l));
                    }
                    return Err((e, released));
                }
                // Each unit goes back on its own.
                done.extend(units(o, l, unit));
            }
            Ok(())
        });
        // Booked while the calls run, and struck again if they fail: the actor has nothing
        // else to do meanwhile (the requester runs them, mostly), and the answer then goes
        // out as soon as they return (a 1 GiB run is 512 granules to enter, 30–80 µs on an
        // H100 host). Nothing reads the books meanwhile: the actor handles no message until
        // this one is done, and the range cannot be given back while the calls hold it.
        if let Some(a) = self.carved.as_mut().and_then(|s| s.arena.as_mut()) {
            groups.iter().for_each(|unit| a.mapped(unit));
        }
        let res = job.result().await.unwrap_or_else(|e| {
            Err((
                RuntimeError::new("host_map", format!("blocking task failed: {e}")),
                0,
            ))
        });
        match res {
            Ok(()) => {
                self.shared.stats.allocations.increase(calls as i64);
                tracing::debug!(
                    bytes,
                    took_us = t0.elapsed().as_micros() as u64,
                    "memory mapped"
                );
                Ok(())
            }
            Err((e, released)) => {
                // Nothing stayed mapped: out of the books again, before the piece goes back.
                if let Some(a) = self.carved.as_mut().and_then(|s| s.arena.as_mut()) {
                    groups.iter().for_each(|unit| {
                        a.unmapped(unit);
                    });
                }
                // Bytes unmapped on the way out went back to the budget already.
                budget.release(bytes - released);
                self.release_unmapped(piece);
                tracing::warn!(error = %e, "mapping memory failed");
                Err(if e.out_of_memory {
                    Error::OutOfMemory {
                        requested: bytes,
                        reserved: budget.reserved(),
                        limit: None,
                        cause: OomCause::NoRoomNow,
                    }
                } else {
                    Error::Runtime(e)
                })
            }
        }
    }

    /// Moves idle memory, at most `n` granules of it, into the places of as many granules of
    /// `need` (see `Arena::plan_moves`), and strikes those from `need`. Returns how many
    /// granules moved.
    ///
    /// Work the pool's stream queued before may still use the memory at its old place (a
    /// block freed on its own stream is reusable by that stream at once). Where the source
    /// maps memory at two places (`MemorySource::alias_run`) and the pool has a stream, the
    /// memory is mapped at its new place now; if the stream still has work queued, its old
    /// place is held, still mapped, until an event recorded on the stream at the move
    /// completes (`retire_moves`), else its old mapping ends at once. The move never waits
    /// for the device. Elsewhere each move waits for the device's queued work
    /// (`MemorySource::remap_run`).
    async fn move_idle(&mut self, need: &mut Vec<usize>, n: usize) -> usize {
        let Some(arena) = self.carved.as_ref().and_then(|s| s.arena.as_ref()) else {
            return 0;
        };
        let granule = arena.granule();
        let moves = arena.plan_moves(need, n);
        if moves.is_empty() {
            return 0;
        }
        let (segment, shared) = (arena.segment.clone(), self.shared.clone());
        let job = self.off_executor(move || {
            let rt = &shared.runtime;
            // Where the stream has run all its work, no queued work uses the old places:
            // each move ends at once.
            let (aliased, event) = match &shared.owner_stream {
                Some(s) if shared.memory.aliases() && !rt.is_capturing(s).unwrap_or(true) => {
                    if rt.stream_idle(s).unwrap_or(false) {
                        (true, None)
                    } else {
                        let event = rt.record_event(s).ok();
                        (event.is_some(), event)
                    }
                }
                _ => (false, None),
            };
            let bytes = |(f, t, k): (usize, usize, usize)| (f * granule, t * granule, k * granule);
            let mut stuck = Vec::new();
            // A failed move changes nothing: those granules are mapped fresh instead.
            let moved: Vec<_> = moves
                .into_iter()
                .filter(|&m| {
                    let (f, t, len) = bytes(m);
                    if !aliased {
                        return shared.move_now(&segment.memory, f, t, len).is_ok();
                    }
                    if shared.alias_now(&segment.memory, f, t, len).is_err() {
                        return false;
                    }
                    if event.is_none()
                        && shared.unalias_now(&segment.memory, f, len, false).is_err()
                    {
                        // Both places stay mapped: the old one is held for good.
                        stuck.push((f, len));
                    }
                    true
                })
                .collect();
            (moved, event, stuck)
        });
        let (moved, event, stuck) = job.await.unwrap_or_default();
        let Some(a) = self.carved.as_mut().and_then(|s| s.arena.as_mut()) else {
            return 0;
        };
        let mut held = Vec::new();
        let mut unheld = Vec::new();
        for &(f, t, k) in &moved {
            a.moved(f, t, k);
            if stuck.contains(&(f * granule, k * granule)) {
                tracing::error!(
                    offset = f * granule,
                    "a moved mapping could not end; range leaked"
                );
                let _ = a.hold_leaving(f * granule, k * granule);
            } else if event.is_some() {
                match a.hold_leaving(f * granule, k * granule) {
                    Some(place) => held.push(place),
                    None => unheld.push((f * granule, k * granule)),
                }
            }
        }
        match event {
            Some(e) if !held.is_empty() => a.leave(held, e),
            Some(e) => self.shared.runtime.release_event(e),
            None => {}
        }
        if !unheld.is_empty() {
            // Never expected: an idle place is free. Its move ends now, after the device's
            // queued work.
            let (segment, shared) = (a.segment.clone(), self.shared.clone());
            let _ = self
                .off_executor(move || {
                    for (o, l) in unheld {
                        let _ = shared.unalias_now(&segment.memory, o, l, true);
                    }
                })
                .await;
        }
        need.retain(|g| !moved.iter().any(|&(_, t, k)| (t..t + k).contains(g)));
        moved.iter().map(|m| m.2).sum()
    }

    /// Ends the moves whose old places no queued work uses any more (their events
    /// completed, looked at for up to `MOVE_PATIENCE`; every one with `wait`, once the
    /// device's queued work has run): the old places are unmapped and go back to the free
    /// ranges.
    pub(super) async fn retire_moves(&mut self, wait: bool) {
        let rt = self.shared.runtime.clone();
        let Some(arena) = self.carved.as_mut().and_then(|s| s.arena.as_mut()) else {
            return;
        };
        if !arena.has_leaving() {
            return;
        }
        let mut left = Vec::new();
        let t0 = Instant::now();
        loop {
            left.extend(arena.take_left(|e| wait || rt.query_event(e).unwrap_or(false)));
            if !arena.has_leaving() || t0.elapsed() >= MOVE_PATIENCE {
                break;
            }
            std::hint::spin_loop();
        }
        if left.is_empty() {
            return;
        }
        let mut places = Vec::new();
        for (p, e) in left {
            rt.release_event(e);
            places.extend(p);
        }
        let (segment, shared) = (arena.segment.clone(), self.shared.clone());
        let ended = self
            .off_executor(move || {
                places
                    .into_iter()
                    .enumerate()
                    .map(|(i, p)| {
                        // Waiting once is enough.
                        let ok = shared
                            .unalias_now(&segment.memory, p.offset, p.len, wait && i == 0)
                            .is_ok();
                        (p, ok)
                    })
                    .collect::<Vec<_>>()
            })
            .await
            .unwrap_or_default();
        let Some(arena) = self.carved.as_mut().and_then(|s| s.arena.as_mut()) else {
            return;
        };
        for (place, ok) in ended {
            if ok {
                arena.release_left(place);
            } else {
                // Still mapped: held for good rather than mapped again.
                tracing::error!(?place, "a moved mapping could not end; range leaked");
            }
        }
    }

    /// Gives a piece whose granules were never mapped back to the arena.
    fn release_unmapped(&mut self, piece: Piece) {
        if let Some(a) = self.carved.as_mut().and_then(|s| s.arena.as_mut()) {
            if let Err(e) = a.release(piece) {
                tracing::error!(
                    ?e,
                    ?piece,
                    "arena piece could not be taken back; range leaked"
                );
            }
        }
    }

    /// Unmaps idle granules, least recently used first, until `bytes` have gone (all of
    /// them for `usize::MAX`). Returns (map calls ended, bytes unmapped).
    pub(super) async fn unmap_idle(&mut self, bytes: usize) -> (usize, usize) {
        self.unmap_idle_before(bytes, u64::MAX).await
    }

    /// [`Self::unmap_idle`] of memory last used before the arena's clock read `before`.
    pub(super) async fn unmap_idle_before(&mut self, bytes: usize, before: u64) -> (usize, usize) {
        let Some(arena) = self.carved.as_ref().and_then(|s| s.arena.as_ref()) else {
            return (0, 0);
        };
        let runs = if bytes == 0 {
            Vec::new()
        } else {
            arena.idle_runs(bytes, before)
        };
        if runs.is_empty() {
            return (0, 0);
        }
        // Memory still mapped at a place it moved away from would not go back with the
        // place it moved to: every move ends first (the unmaps wait for the device anyway).
        self.retire_moves(true).await;
        let Some(arena) = self.carved.as_ref().and_then(|s| s.arena.as_ref()) else {
            return (0, 0);
        };
        let granule = arena.granule();
        let (segment, shared) = (arena.segment.clone(), self.shared.clone());
        let job = self.off_executor(move || {
            let mut gone = Vec::new();
            for (o, l) in runs {
                if shared.unmap_now(&segment.memory, o, l).is_ok() {
                    if let Some(m) = segment.arena_map() {
                        m.clear(o, l);
                    }
                    gone.extend((o / granule)..(o + l) / granule);
                }
            }
            gone
        });
        let gone = job.await.unwrap_or_default();
        let Some(arena) = self.carved.as_mut().and_then(|s| s.arena.as_mut()) else {
            return (0, 0);
        };
        let ended = arena.unmapped(&gone);
        self.shared.stats.allocations.decrease(ended as i64);
        (ended, gone.len() * granule)
    }
}

#[cfg(test)]
mod tests {
    use super::Bits;

    #[test]
    fn bits_count_what_is_set_in_any_span() {
        let mut bits = Bits::new(300);
        let mut naive = vec![false; 300];
        // A fixed scatter of set and cleared bits, across word boundaries.
        let mut x = 7usize;
        for _ in 0..400 {
            x = (x * 1103515245 + 12345) % 2147483648;
            let (i, on) = (x % 300, x % 3 != 0);
            bits.set(i, on);
            naive[i] = on;
        }
        for start in (0..300).step_by(7) {
            for end in (start..=300).step_by(5) {
                let want = naive[start..end].iter().filter(|b| **b).count();
                assert_eq!(bits.count(start..end), want, "span {start}..{end}");
            }
        }
        // Past the end counts nothing, and setting past the end is ignored.
        bits.set(1000, true);
        assert_eq!(bits.count(300..1100), 0);
    }
}
