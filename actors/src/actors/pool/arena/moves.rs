//! Moving idle memory: an idle map call's (or granule's) memory moved into the places a new
//! piece needs instead of fresh memory taken while idle memory goes back, and the old
//! places held, still mapped, until the work queued on them before the move has run.

use std::time::Instant;

use super::{Arena, Granule};
use crate::actors::pool::PoolActor;
use crate::blocks::block::{Home, Seg};
use crate::vocab::carve::Piece;
use crate::vocab::memory::RangeCall;
use crate::vocab::runtime::Runtime;

/// How long a miss looks at the events of moves not ended yet before it places a block
/// (`PoolActor::retire_moves`): an event whose stream is about to run out of work completes
/// within microseconds, and an old place taken back in time keeps the layout as tight as
/// moves that waited would. Longer work is not waited for.
const MOVE_PATIENCE: std::time::Duration = std::time::Duration::from_micros(50);

impl<R: Runtime> Arena<R> {
    /// Holds the place `[offset, offset + len)` that memory just moved away from (idle, so
    /// wholly free) until the move ends; `None` if it is not free (the move must end now).
    pub(in crate::actors::pool) fn hold_leaving(
        &mut self,
        offset: usize,
        len: usize,
    ) -> Option<Piece> {
        let p = self.carver.take_exact(self.seg, offset, len)?;
        self.refit(p.offset, p.offset + p.len);
        Some(p)
    }

    /// Enters a batch of held places memory moved away from, and the event after which no
    /// queued work uses them.
    pub(in crate::actors::pool) fn leave(&mut self, places: Vec<Piece>, event: R::Event) {
        self.leaving.push((places, event));
    }

    /// Whether moves wait to end.
    pub(in crate::actors::pool) fn has_leaving(&self) -> bool {
        !self.leaving.is_empty()
    }

    /// Takes the batches of places whose event `done` says completed.
    pub(in crate::actors::pool) fn take_left(
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
    pub(in crate::actors::pool) fn release_left(&mut self, place: Piece) {
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

    /// Enters the memory of the idle run of `n` granules at `from` (one map call's, or one
    /// granule where the source unmaps granule by granule) moved to the `n` granules at
    /// `to`, which the piece just placed needs: they join `from`'s map call (their memory
    /// is the same), held by that piece.
    pub(in crate::actors::pool) fn moved(&mut self, from: usize, to: usize, n: usize) {
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
    pub(in crate::actors::pool) fn plan_moves(
        &self,
        need: &[usize],
        max: usize,
    ) -> Vec<(usize, usize, usize)> {
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
}

impl<R: Runtime> PoolActor<R> {
    /// Moves idle memory, at most `n` granules of it, into the places of as many granules of
    /// `need` (see `Arena::plan_moves`), and strikes those from `need`. Returns how many
    /// granules moved.
    ///
    /// Work the pool's stream queued before may still use the memory at its old place (a
    /// block freed on its own stream is reusable by that stream at once). Where the source
    /// maps memory at two places (`RangeCall::Alias`) and the pool has a stream, the
    /// memory is mapped at its new place now; if the stream still has work queued, its old
    /// place is held, still mapped, until an event recorded on the stream at the move
    /// completes (`retire_moves`), else its old mapping ends at once. The move never waits
    /// for the device. Elsewhere each move waits for the device's queued work
    /// (`RangeCall::Move`).
    pub(super) async fn move_idle(&mut self, need: &mut Vec<usize>, n: usize) -> usize {
        let Some(arena) = self.carved.as_ref().and_then(|s| s.arena.as_ref()) else {
            return 0;
        };
        let granule = arena.granule();
        let moves = arena.plan_moves(need, n);
        if moves.is_empty() {
            return 0;
        }
        let (segment, shared) = (arena.segment.clone(), self.shared.clone());
        let job = self.off_executor(move || run_moves(&shared, &segment, moves, granule));
        let (moved, event, stuck) = job.await.unwrap_or_default();
        let Some(unheld) = self.book_moves(&moved, event, &stuck, granule) else {
            return 0;
        };
        if !unheld.is_empty() {
            // Never expected: an idle place is free. Its move ends now, after the device's
            // queued work.
            let Some(a) = self.carved.as_ref().and_then(|s| s.arena.as_ref()) else {
                return 0;
            };
            let (segment, shared) = (a.segment.clone(), self.shared.clone());
            let _ = self
                .off_executor(move || {
                    for (o, l) in unheld {
                        let _ = shared.range_call(
                            &segment.memory,
                            RangeCall::Unalias {
                                at: o,
                                len: l,
                                wait: true,
                            },
                        );
                    }
                })
                .await;
        }
        need.retain(|g| !moved.iter().any(|&(_, t, k)| (t..t + k).contains(g)));
        moved.iter().map(|m| m.2).sum()
    }

    /// Enters the moves made (`moved`, as (from, to, granules)) in the arena's books: with
    /// an `event`, each old place is held until it completes; a place whose mapping could
    /// not end (`stuck`) is held for good. Returns the old places that could not be held
    /// (`None` without an arena).
    fn book_moves(
        &mut self,
        moved: &[(usize, usize, usize)],
        event: Option<R::Event>,
        stuck: &[(usize, usize)],
        granule: usize,
    ) -> Option<Vec<(usize, usize)>> {
        let a = self.carved.as_mut().and_then(|s| s.arena.as_mut())?;
        let mut held = Vec::new();
        let mut unheld = Vec::new();
        for &(f, t, k) in moved {
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
        Some(unheld)
    }

    /// Ends the moves whose old places no queued work uses any more (their events
    /// completed, looked at for up to `MOVE_PATIENCE`; every one with `wait`, once the
    /// device's queued work has run): the old places are unmapped and go back to the free
    /// ranges.
    pub(in crate::actors::pool) async fn retire_moves(&mut self, wait: bool) {
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
                            .range_call(
                                &segment.memory,
                                RangeCall::Unalias {
                                    at: p.offset,
                                    len: p.len,
                                    wait: wait && i == 0,
                                },
                            )
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
}

/// The moves made, as (from, to, granules), the event after which no queued work uses
/// their old places (`None`: their mappings ended at once, or they waited for the device),
/// and the old places, as (offset, bytes), whose mapping could not end.
type Moved<E> = (Vec<(usize, usize, usize)>, Option<E>, Vec<(usize, usize)>);

/// Makes `moves` (as (from, to, granules)) of the arena `segment`, on a blocking thread (see
/// `PoolActor::move_idle`). A failed move changes nothing: those granules are mapped fresh
/// instead.
fn run_moves<R: Runtime>(
    shared: &Home<R>,
    segment: &Seg<R>,
    moves: Vec<(usize, usize, usize)>,
    granule: usize,
) -> Moved<R::Event> {
    let (aliased, event) = move_mode(shared);
    let bytes = |(f, t, k): (usize, usize, usize)| (f * granule, t * granule, k * granule);
    let mut stuck = Vec::new();
    let moved: Vec<_> = moves
        .into_iter()
        .filter(|&m| {
            let (f, t, len) = bytes(m);
            if !aliased {
                return shared
                    .range_call(
                        &segment.memory,
                        RangeCall::Move {
                            from: f,
                            to: t,
                            len,
                        },
                    )
                    .is_ok();
            }
            if shared
                .range_call(
                    &segment.memory,
                    RangeCall::Alias {
                        from: f,
                        to: t,
                        len,
                    },
                )
                .is_err()
            {
                return false;
            }
            if event.is_none()
                && shared
                    .range_call(
                        &segment.memory,
                        RangeCall::Unalias {
                            at: f,
                            len,
                            wait: false,
                        },
                    )
                    .is_err()
            {
                // Both places stay mapped: the old one is held for good.
                stuck.push((f, len));
            }
            true
        })
        .collect();
    (moved, event, stuck)
}

/// How the pool's moves go now: whether memory is mapped at its new place while its old
/// mapping lasts (the source aliases, and the pool has a stream that is not capturing),
/// and, if so, the event recorded on that stream after which the old places are unused;
/// where the stream has run all its work, no queued work uses the old places and there is
/// no event: each move ends at once.
fn move_mode<R: Runtime>(shared: &Home<R>) -> (bool, Option<R::Event>) {
    let rt = &shared.runtime;
    match &shared.owner_stream {
        Some(s) if shared.memory.aliases() && !rt.is_capturing(s).unwrap_or(true) => {
            if rt.stream_idle(s).unwrap_or(false) {
                (true, None)
            } else {
                let event = rt.record_event(s).ok();
                (event.is_some(), event)
            }
        }
        _ => (false, None),
    }
}
