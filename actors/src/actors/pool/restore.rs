//! Restoring a capture pool to a checkpoint (PyTorch's `setCheckpointPoolState`): the pool
//! actor takes back the blocks whose leases the caller gave up, and lends exactly the
//! checkpoint's ranges again, at their old addresses (graphs replay against them).
//!
//! Owns the order that makes the restore safe, and all-or-nothing for its caller unless the
//! pool changes under it (see 3):
//! 1. *check* (nothing changes): every wanted range lies in the pool's memory — the arena's
//!    reserved range, or a separate segment the pool still holds (a segment given back by
//!    `empty_cache` cannot come back at the same address: `Error::CheckpointUnavailable`);
//! 2. *settle* (only the cache moves): events are recorded on every stream that used the
//!    blocks to free (the target stream too: memory freed outside the wanted ranges may go
//!    to any stream's request next), and the actor waits for them; ready blocks are drained
//!    into the free ranges and completed events noticed, until no piece over a wanted range
//!    is anything but kept for graph replays or about to be freed (blocks kept for replays
//!    are taken back: the caller restores the pool to a state its graphs were recorded
//!    against; blocks kept because their events were lost or could not be recorded are
//!    never taken back, and block the restore); then the unmapped granules of wanted arena
//!    ranges are mapped, held by placeholder pieces so that nothing unmaps them again;
//! 3. *commit* (no await): the placeholders, the kept pieces over wanted ranges and the
//!    freed blocks go back into the free ranges, and each wanted range is cut out as a
//!    block. Cutting fails only if the pool changed during the settle in a way the settle
//!    does not hold off (mapping under a memory limit unmapped an idle granule of another
//!    wanted range); the error then says that the blocks to free were freed.
//!
//! A restore whose caller stopped waiting, or that reaches a closing pool, frees the blocks
//! it was given the way their leases would have been freed (events on the streams that used
//! them) and lends nothing.
//!
//! Messages that arrive while the actor settles are answered after the restore, in order;
//! blocks coming home meanwhile are taken at once (the restore may be waiting for them).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::PoolActor;
use crate::blocks::block::Block;
use crate::blocks::lease::Lease;
use crate::books::messages::PoolMsg;
use crate::observation::history::BlockSeen;
use crate::vocab::carve::Piece;
use crate::vocab::error::Error;
use crate::vocab::policy::SizeClass;
use crate::vocab::runtime::{Runtime, RuntimeError, StreamId};

/// How long a restore waits for events and blocks coming home before it gives up.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often it looks again meanwhile.
const SETTLE_POLL: Duration = Duration::from_micros(200);

/// Blocks to free, with the bytes their leases requested.
type Freed<R> = Vec<(Box<Block<R>>, usize)>;

impl<R: Runtime> PoolActor<R> {
    /// See the module's header. Returns the blocks lent at `want`, in its order.
    pub(super) async fn restore(
        &mut self,
        want: Vec<(usize, usize)>,
        free: Freed<R>,
        target: StreamId,
    ) -> Result<Vec<Box<Block<R>>>, (Error, Freed<R>)> {
        if let Err(e) = self.check_restore(&want) {
            return Err((e, free));
        }
        let held = match self.settle(&want, &free, target).await {
            Ok(held) => held,
            Err(e) => return Err((e, free)),
        };
        self.commit_restore(&want, free, held)
            .map_err(|e| (e, Vec::new()))
    }

    fn check_restore(&self, want: &[(usize, usize)]) -> Result<(), Error> {
        let pool = self.shared.id;
        let Some(segs) = self.carved.as_ref() else {
            return Err(Error::NotSupported {
                operation: "set_checkpoint_pool_state",
                reason: "the pool's layout lends whole allocations, not ranges of segments".into(),
            });
        };
        for &(addr, size) in want {
            if segs.locate(addr, size).is_none() {
                return Err(Error::CheckpointUnavailable {
                    pool,
                    address: addr as u64,
                    size,
                });
            }
        }
        Ok(())
    }

    /// Waits until every wanted range is free but for kept pieces and the blocks to free,
    /// then maps the unmapped granules of wanted arena ranges. Returns the placeholder
    /// pieces that hold those granules.
    async fn settle(
        &mut self,
        want: &[(usize, usize)],
        free: &Freed<R>,
        target: StreamId,
    ) -> Result<Vec<Piece>, Error> {
        let rt = self.shared.runtime.clone();
        let _ = target; // its queued work is waited for like any other stream's
        let mut events = record_free_events(&*rt, free)?;
        let freeing: HashSet<usize> = free.iter().map(|(b, _)| b.memory.addr()).collect();
        let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
        loop {
            self.take_mail().await;
            self.absorb_ready();
            let mut pending = Vec::with_capacity(events.len());
            for e in events.drain(..) {
                match rt.query_event(&e) {
                    Ok(true) => rt.release_event(e),
                    _ => pending.push(e),
                }
            }
            events = pending;
            let kept = self.replay_kept();
            let blocked = self.carved.as_ref().is_some_and(|segs| {
                want.iter().any(|&(a, s)| {
                    segs.lent_overlapping(a, s)
                        .iter()
                        .any(|p| !kept.contains(p) && !freeing.contains(p))
                })
            });
            if !blocked && events.is_empty() {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                events.drain(..).for_each(|e| rt.release_event(e));
                return Err(Error::Timeout {
                    requested: want.iter().map(|w| w.1).sum(),
                    timeout: SETTLE_TIMEOUT,
                });
            }
            self.flush_events().await;
            tokio::time::sleep(SETTLE_POLL).await;
        }
        self.map_wanted(want).await
    }

    /// Maps the unmapped granules of the wanted ranges that lie in the arena; returns the
    /// placeholder pieces that hold them. On a failure every piece goes back.
    async fn map_wanted(&mut self, want: &[(usize, usize)]) -> Result<Vec<Piece>, Error> {
        let mut held = Vec::new();
        for &(addr, size) in want {
            let runs = match self.carved.as_mut().and_then(|s| s.arena.as_mut()) {
                Some(a) if a.holds(addr, size) => {
                    a.take_unmapped(addr - a.segment.memory.addr(), size)
                }
                _ => continue,
            };
            let mut runs = runs.into_iter();
            while let Some((piece, granules)) = runs.next() {
                if let Err(e) = self.map_for(piece, granules, None).await {
                    // `map_for` took the failed piece back; so go the others.
                    let rest: Vec<Piece> = runs.map(|r| r.0).chain(held).collect();
                    self.release_pieces(rest);
                    return Err(e);
                }
                held.push(piece);
            }
        }
        Ok(held)
    }

    /// Takes the messages waiting in the mailbox: blocks coming home now, the rest after
    /// the restore.
    async fn take_mail(&mut self) {
        self.book_notes();
        while let Ok(msg) = self.rx.try_recv() {
            match msg {
                PoolMsg::Home(b) => self.home(b).await,
                PoolMsg::Keep(b) => self.kept.push(b),
                other => self.deferred.push_back(other),
            }
        }
    }

    /// Addresses of the blocks kept for graph replays (allocated during capture): a restore
    /// may take those back; blocks kept for safety (events lost or not recorded) it may not.
    fn replay_kept(&self) -> HashSet<usize> {
        self.kept
            .iter()
            .filter(|b| b.during_capture)
            .map(|b| b.memory.addr())
            .collect()
    }

    /// Gives placeholder pieces of the arena back.
    fn release_pieces(&mut self, pieces: Vec<Piece>) {
        if let Some(a) = self.carved.as_mut().and_then(|s| s.arena.as_mut()) {
            for p in pieces {
                if let Err(e) = a.release(p) {
                    tracing::error!(?e, ?p, "arena piece could not be taken back; range leaked");
                }
            }
        }
    }

    fn commit_restore(
        &mut self,
        want: &[(usize, usize)],
        free: Freed<R>,
        held: Vec<Piece>,
    ) -> Result<Vec<Box<Block<R>>>, Error> {
        self.release_pieces(held);
        // Kept pieces over wanted ranges come back into the free ranges.
        let over: HashSet<usize> = self
            .carved
            .as_ref()
            .map(|segs| {
                want.iter()
                    .flat_map(|&(a, s)| segs.lent_overlapping(a, s))
                    .collect()
            })
            .unwrap_or_default();
        let (back, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.kept)
            .into_iter()
            .partition(|b| b.during_capture && over.contains(&b.memory.addr()));
        self.kept = kept;
        let shared = self.shared.clone();
        let stats = &shared.stats;
        for b in &back {
            stats.kept_blocks.fetch_sub(1, Ordering::Relaxed);
            stats.kept_bytes.fetch_sub(b.size as i64, Ordering::Relaxed);
        }
        let mut blocks = back;
        // The freed blocks: the books of a free, then back into the free ranges.
        for (mut b, len) in free {
            let seen = BlockSeen {
                pool: shared.id,
                owner: shared.owner,
                ..b.seen()
            };
            shared
                .history
                .on_free(seen, len, || b.streams.first().map(|(s, _)| *s));
            stats.freed(b.shard, b.size, len);
            stats.deactivate(b.shard, b.size);
            b.streams.clear();
            blocks.push(b);
        }
        let rest = self.absorb_all(blocks);
        debug_assert!(rest.is_empty(), "blocks of a carving pool are carved");
        self.kept.extend(rest);
        let mut out = Vec::with_capacity(want.len());
        for &(addr, size) in want {
            let cut = self.carved.as_mut().and_then(|s| s.take_at(addr, size));
            let index = self
                .shared
                .policy
                .class_served_by(size)
                .or_else(|| self.shared.policy.class_of(size).map(|c| c.index));
            let block = match (cut, index) {
                (Some((piece, seg)), Some(index)) => {
                    self.block_for(SizeClass { index, size }, piece, seg)
                }
                _ => None,
            };
            match block {
                Some(b) => out.push(b),
                None => {
                    tracing::error!(addr, size, "checkpoint range not free after settling");
                    let rest = self.absorb_all(out);
                    self.kept.extend(rest);
                    return Err(Error::Runtime(RuntimeError::new(
                        "set_checkpoint_pool_state",
                        format!(
                            "the range at {addr:#x} ({size} bytes) could not be cut (the pool \
                             changed during the restore); the blocks to free were freed"
                        ),
                    )));
                }
            }
        }
        Ok(out)
    }
}

/// Frees blocks taken out of a caller's leases the way dropping those leases would have:
/// events on the streams that used them, then back to the pool.
pub(super) fn free_as_leases<R: Runtime>(free: Freed<R>) {
    for (b, len) in free {
        drop(Lease::from_parts(b, len, 0));
    }
}

/// Blocks a restore lent that nobody took: lent and freed at once, so that the books balance.
pub(super) fn drop_as_leases<R: Runtime>(lent: Vec<Box<Block<R>>>) {
    for b in lent {
        let size = b.size;
        drop(Lease::new(b, size, false, 0));
    }
}

/// Records an event on every stream that used a block to free, after the work queued there
/// so far; none if a stream is being captured (the restore then fails, and every event
/// recorded goes back).
fn record_free_events<R: Runtime>(rt: &R, free: &Freed<R>) -> Result<Vec<R::Event>, Error> {
    let mut events = Vec::new();
    for (b, _) in free {
        for (_, s) in &b.streams {
            let recorded = rt.is_capturing(s).and_then(|capturing| {
                if capturing {
                    Err(RuntimeError::new(
                        "set_checkpoint_pool_state",
                        "a stream that used a block to free is being captured",
                    ))
                } else {
                    rt.record_event(s)
                }
            });
            match recorded {
                Ok(e) => events.push(e),
                Err(e) => {
                    events.drain(..).for_each(|e| rt.release_event(e));
                    return Err(e.into());
                }
            }
        }
    }
    Ok(events)
}
