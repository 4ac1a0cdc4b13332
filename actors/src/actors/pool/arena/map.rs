//! Mapping memory for the pool actor: the arena reserved at the first miss that wants one,
//! the granules a piece needs mapped (after idle memory moved or went back to stay under the
//! limits), and idle granules unmapped.

use std::time::Instant;

use super::Arena;
use crate::actors::pool::PoolActor;
use crate::blocks::block::{Home, Seg};
use crate::books::segment::{ArenaMap, Segment};
use crate::vocab::carve::{Piece, SegId};
use crate::vocab::error::{Error, OomCause};
use crate::vocab::memory::units;
use crate::vocab::memory::RangeCall;
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

impl<R: Runtime> PoolActor<R> {
    /// Whether the pool has an arena; reserves it at the first call. No arena (and
    /// separate segments from then on) when the layout does not want one or the runtime
    /// cannot.
    pub(in crate::actors::pool) async fn has_arena(&mut self) -> bool {
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
    pub(in crate::actors::pool) async fn map_for(
        &mut self,
        piece: Piece,
        need: Vec<usize>,
        cap: Option<usize>,
    ) -> Result<(), Error> {
        let Some(arena) = self.carved.as_ref().and_then(|s| s.arena.as_ref()) else {
            return Err(no_arena());
        };
        let granule = arena.granule();
        let mut need = need;
        self.make_room_to_map(&mut need, cap, granule).await;
        if need.is_empty() {
            // Every granule the piece needed was moved there.
            return Ok(());
        }
        let bytes = need.len() * granule;
        self.reserve_to_map(piece, bytes).await?;
        let Some(arena) = self.carved.as_ref().and_then(|s| s.arena.as_ref()) else {
            self.shared.budget.release(bytes);
            return Err(no_arena());
        };
        let whole_from = self
            .carved
            .as_ref()
            .map_or(usize::MAX, |s| s.carving.map_whole_from);
        // Units grow with the pool's peak: few map calls for large runs, and units small
        // enough for idle ones to fit elsewhere.
        let peak_live = self.carved.as_ref().map_or(0, |s| s.peak_live);
        let (runs, groups) = arena.map_plan(need, whole_from, peak_live / UNITS_PER_PEAK);
        let calls = groups.len();
        let (segment, shared) = (arena.segment.clone(), self.shared.clone());
        let t0 = Instant::now();
        let job = self.start_off_executor(move || map_runs(&shared, &segment, &runs));
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
            Err((e, released)) => Err(self.unbook_failed_map(piece, &groups, bytes, released, e)),
        }
    }

    /// Before granules are mapped for a piece: over `cap` or the memory limit, idle memory
    /// moves into the piece's places (struck from `need`) instead of going back while fresh
    /// memory is taken for it; then, still over `cap`, idle memory goes back.
    async fn make_room_to_map(
        &mut self,
        need: &mut Vec<usize>,
        cap: Option<usize>,
        granule: usize,
    ) {
        let whole = self
            .carved
            .as_ref()
            .and_then(|s| s.arena.as_ref())
            .is_some_and(|a| a.whole_runs());
        let reserved = self.shared.stats.allocated_bytes.read().current.max(0) as usize;
        if self.shared.memory.remaps() {
            // Where memory goes back only by whole map calls, every idle call that fits
            // moves (each is a call that need not be made, and a piece of memory that need
            // not go back).
            let budget = &self.shared.budget;
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
                self.move_idle(need, n).await;
            }
        }
        let bytes = need.len() * granule;
        if let Some(over) = cap.and_then(|c| (reserved + bytes).checked_sub(c)) {
            self.unmap_idle(over).await;
        }
    }

    /// Charges the budget `bytes` to map for `piece`, unmapping idle memory first if it has
    /// no room; with no room still, the piece goes back into the arena and the miss fails.
    async fn reserve_to_map(&mut self, piece: Piece, bytes: usize) -> Result<(), Error> {
        let budget = self.shared.budget.clone();
        if budget.try_reserve(bytes) {
            return Ok(());
        }
        self.unmap_idle(bytes).await;
        if budget.try_reserve(bytes) {
            return Ok(());
        }
        self.release_unmapped(piece);
        Err(Error::OutOfMemory {
            requested: bytes,
            reserved: budget.reserved(),
            limit: budget.limit(),
            cause: OomCause::NoRoomNow,
        })
    }

    /// After map calls failed (nothing of them stays mapped): their granules are struck from
    /// the books, the bytes not given back on the way out go back to the budget, and the
    /// piece goes back into the arena. Returns the miss's error.
    fn unbook_failed_map(
        &mut self,
        piece: Piece,
        groups: &[Vec<usize>],
        bytes: usize,
        released: usize,
        e: RuntimeError,
    ) -> Error {
        if let Some(a) = self.carved.as_mut().and_then(|s| s.arena.as_mut()) {
            groups.iter().for_each(|unit| {
                a.unmapped(unit);
            });
        }
        // Bytes unmapped on the way out went back to the budget already.
        self.shared.budget.release(bytes - released);
        self.release_unmapped(piece);
        tracing::warn!(error = %e, "mapping memory failed");
        if e.out_of_memory {
            Error::OutOfMemory {
                requested: bytes,
                reserved: self.shared.budget.reserved(),
                limit: None,
                cause: OomCause::NoRoomNow,
            }
        } else {
            Error::Runtime(e)
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
    pub(in crate::actors::pool) async fn unmap_idle(&mut self, bytes: usize) -> (usize, usize) {
        self.unmap_idle_before(bytes, u64::MAX).await
    }

    /// [`Self::unmap_idle`] of memory last used before the arena's clock read `before`.
    pub(in crate::actors::pool) async fn unmap_idle_before(
        &mut self,
        bytes: usize,
        before: u64,
    ) -> (usize, usize) {
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
                if shared
                    .range_call(&segment.memory, RangeCall::Unmap { at: o, len: l })
                    .is_ok()
                {
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

/// Source calls that map runs of granules, as (offset, bytes, unit).
type MapCalls = Vec<(usize, usize, usize)>;

impl<R: Runtime> Arena<R> {
    /// The source calls that map `need`, one per run of consecutive granules, which maps
    /// the run's units (up to `max_unit` bytes, see `map_calls`) in one go, as (offset,
    /// bytes, unit); and the granules of each map call as the books enter them: one call
    /// per unit where each goes back whole, else the piece's granules as one.
    fn map_plan(
        &self,
        need: Vec<usize>,
        whole_from: usize,
        max_unit: usize,
    ) -> (MapCalls, Vec<Vec<usize>>) {
        let runs = self.map_calls(&need, whole_from, max_unit);
        let g = self.granule();
        let groups: Vec<Vec<usize>> = if self.whole_runs() {
            runs.iter()
                .flat_map(|&(o, l, u)| units(o, l, u))
                .map(|(o, l)| (o / g..(o + l) / g).collect())
                .collect()
        } else {
            vec![need]
        };
        (runs, groups)
    }
}

/// The error of a pool with no arena where one was expected.
fn no_arena() -> Error {
    Error::Runtime(RuntimeError::new("host_map", "no arena"))
}

/// Maps `runs` of the arena `segment` (on a blocking thread), all or nothing: on a failure,
/// what the call mapped goes back (and its bytes to the budget, as an unmap does), and
/// the error comes with the bytes so given back.
fn map_runs<R: Runtime>(
    shared: &Home<R>,
    segment: &Seg<R>,
    runs: &[(usize, usize, usize)],
) -> Result<(), (RuntimeError, usize)> {
    let mut done = Vec::new();
    for &(o, l, unit) in runs {
        if let Err(e) = shared.range_call(
            &segment.memory,
            RangeCall::Map {
                offset: o,
                len: l,
                unit,
            },
        ) {
            let mut released = 0;
            for (o, l) in done {
                if shared
                    .range_call(&segment.memory, RangeCall::UnmapUnused { at: o, len: l })
                    .is_ok()
                {
                    released += l;
                }
            }
            // Out of the segment's map here, not after the await: the actor may be gone by
            // then, and the segment's drop must not unmap these.
            if let Some(m) = segment.arena_map() {
                runs.iter().for_each(|&(o, l, _)| m.clear(o, l));
            }
            return Err((e, released));
        }
        // Each unit goes back on its own.
        done.extend(units(o, l, unit));
    }
    Ok(())
}
