//! How the pool actor answers a miss, in one place: counted and timed (`on_miss`), refused,
//! queued for room or served (`answer`); served from a ready block, else (under a carving
//! layout) from the arena — the best fit among mapped free memory, else the place that
//! needs the fewest granules mapped, mapped then (`arena::map`) — or from separate segments
//! (a free range, the ready blocks coalesced, completed events noticed: invariant 3), else
//! fresh memory (`fresh`). Also a block lent out of memory the pool holds, taking none.

use std::sync::atomic::Ordering;

use super::PoolActor;
use crate::blocks::block::Block;
use crate::books::messages::{Ask, MissTx, PollerMsg, Refused, SegmentView};
use crate::statistics::meta::MetaRef;
use crate::vocab::error::{Error, OomCause};
use crate::vocab::policy::SizeClass;
use crate::vocab::runtime::{Runtime, RuntimeError};

impl<R: Runtime> PoolActor<R> {
    /// A miss: served from the cache or fresh memory; queued (or refused) when it does not fit.
    pub(super) async fn on_miss(&mut self, class: SizeClass, ask: Ask, reply: MissTx<Block<R>>) {
        if reply.is_disconnected() {
            // Dropped before the pool got to it.
            return;
        }
        self.shared.stats.misses.fetch_add(1, Ordering::Relaxed);
        // Counted until the answer is known, before the requester can see it: every way the
        // ask ends (answered, queued for room, or refused) alike.
        let shared = self.shared.clone();
        let serving = shared.stats.miss_serve.time();
        let answer = self.answer(class, ask, &reply).await;
        drop(serving);
        match answer {
            None => self.enqueue(class, ask.requested, reply),
            Some(result) => {
                if let Err(flume::SendError(Ok(block))) = reply.send(result) {
                    // The request was cancelled: the block is ready for someone else.
                    self.take_back(block).await;
                }
            }
        }
    }

    /// What a miss gets: a block or a refusal, or `None` when it waits for room in the queue.
    async fn answer(
        &mut self,
        class: SizeClass,
        ask: Ask,
        reply: &MissTx<Block<R>>,
    ) -> Option<Result<Box<Block<R>>, Refused>> {
        self.prune();
        if !self.queue.is_empty() {
            // Others came first: no overtaking.
            return if ask.wait {
                None
            } else if ask.quiet {
                Some(Err(Refused::NeedRoom))
            } else {
                let e = self.out_of_room(ask.requested, OomCause::NoRoomNow);
                Some(Err(Refused::Failed(e)))
            };
        }
        if ask.holds && self.thread_cached(class) {
            // Before the pool grows for a size threads cache, the requester's own cached
            // blocks come home and coalesce (a miss never takes other threads' blocks).
            return Some(match self.without_growing(class) {
                Some(b) => Ok(b),
                None => Err(Refused::Coalesce),
            });
        }
        // The requester's thread runs the memory source's calls of this miss, if it runs errands.
        self.errand_runner = ask.runs_errands.then(|| reply.clone());
        let result = self.miss(class).await;
        self.errand_runner = None;
        let result = match result {
            Ok(block) => Ok(block),
            Err(Error::OutOfMemory { limit, .. }) => {
                if !ask.emptied {
                    Err(Refused::NeedRoom)
                } else if limit.is_some() && ask.wait {
                    return None;
                } else if limit.is_some() && ask.quiet {
                    Err(Refused::NeedRoom)
                } else if limit.is_some() {
                    Err(Refused::Failed(
                        self.out_of_room(ask.requested, OomCause::NoRoomNow),
                    ))
                } else {
                    Err(Refused::Failed(self.driver_oom(ask.requested)))
                }
            }
            Err(e) => Err(Refused::Failed(e)),
        };
        Some(result)
    }

    pub(super) async fn miss(&mut self, class: SizeClass) -> Result<Box<Block<R>>, Error> {
        if let Some(b) = self.shared.ready.take(class) {
            return Ok(b);
        }
        if self.carved.is_some() {
            return self.miss_carved(class).await;
        }
        // Invariant 3: notice completed events before taking fresh memory.
        if self.shared.stats.waiting_blocks.load(Ordering::Acquire) > 0 {
            self.flush_events().await;
            if let Some(b) = self.shared.ready.take(class) {
                return Ok(b);
            }
        }
        self.fresh(class).await
    }

    pub(super) async fn flush_events(&self) {
        // Blocks parked by the threads that freed them are polled too.
        self.shared.parked.unpark_all();
        let (tx, rx) = flume::bounded(1);
        if self
            .shared
            .poller
            .send(PollerMsg::Flush { reply: tx })
            .is_ok()
        {
            let _ = rx.recv_async().await;
        }
    }

    /// A miss under a carving layout. In the arena: the best fit among mapped free memory
    /// (one lookup), else the place that needs the fewest granules mapped (see
    /// `miss_arena`); the ready holder is never drained for it: memory freed above the
    /// threads' limit came home when it was freed and coalesced then. Separate segments: a
    /// free range, then the ready holder drained and coalesced, then (after noticing
    /// completed events) the same again; then, if fresh memory would cross the reserve cap,
    /// any wholly free segment split; then a fresh segment, after giving back wholly free
    /// segments to stay under the cap.
    pub(super) async fn miss_carved(&mut self, class: SizeClass) -> Result<Box<Block<R>>, Error> {
        let live = self.shared.stats.active_bytes_now().max(0) as usize;
        if let Some(s) = self.carved.as_mut() {
            s.peak_live = s.peak_live.max(live.saturating_add(class.size));
        }
        if let Some(res) = self.miss_in_arena(class).await {
            return res;
        }
        // A free range that the block fills (a large piece that came back, say) serves it as
        // is, and so does the range its class last gave back. Otherwise coalesce every ready
        // block first, so that placement sees all free memory.
        if let Some(b) = self.carve_tight(class).or_else(|| self.recall(class)) {
            return Ok(b);
        }
        self.absorb_ready();
        if let Some(b) = self.carve_block(class, false) {
            return Ok(b);
        }
        if self.shared.stats.waiting_blocks.load(Ordering::Acquire) > 0 {
            self.flush_events().await;
            self.absorb_ready();
            if let Some(b) = self.carve_block(class, false) {
                return Ok(b);
            }
        }
        self.carve_fresh_segment(class).await
    }

    /// [`Self::miss_carved`] in the arena, for a block it may hold: the best fit among
    /// mapped free memory, else [`Self::miss_arena`]. `None` when separate segments are to
    /// serve the miss: no arena, a block too large for it, or (near the pinned-memory limit)
    /// no granule left for a block smaller than one, which a segment of its own size may
    /// still fit.
    async fn miss_in_arena(&mut self, class: SizeClass) -> Option<Result<Box<Block<R>>, Error>> {
        let arena_fits = self
            .carved
            .as_ref()
            .is_some_and(|s| class.size <= s.carving.arena_max_block);
        if !(arena_fits && self.has_arena().await) {
            return None;
        }
        if let Some(b) = self.carve_mapped(class) {
            return Some(Ok(b));
        }
        match self.miss_arena(class).await {
            Some(Err(Error::OutOfMemory { limit: None, .. }))
                if class.size < self.granule_size() =>
            {
                None
            }
            res => res,
        }
    }

    /// [`Self::miss_carved`] once no memory the pool holds serves it: if fresh memory would
    /// cross the reserve cap, a wholly free segment split, or wholly free segments given back
    /// to make room; then a fresh segment, padded by the layout's rules (or of the block's
    /// own size when the padded one does not fit), and the block cut out of it.
    async fn carve_fresh_segment(&mut self, class: SizeClass) -> Result<Box<Block<R>>, Error> {
        let reserved = self.shared.stats.allocated_bytes.read().current.max(0) as usize;
        let (cap, size) = match &self.carved {
            Some(s) => {
                let cap = s.carving.fresh_cap(s.peak_live, self.shared.budget.limit());
                let room = cap.map_or(0, |c| c.saturating_sub(reserved));
                (cap, s.segment_size(class.size, room))
            }
            None => (None, class.size),
        };
        if let Some(cap) = cap.filter(|&c| reserved.saturating_add(size) > c) {
            // Fresh memory would cross the cap: split a large free segment after all, or
            // give back wholly free ones (none could serve this miss) to make room.
            if let Some(b) = self.carve_block(class, true) {
                return Ok(b);
            }
            self.give_back_room(reserved.saturating_add(size) - cap)
                .await;
        }
        let memory = match self.fresh_memory(size).await {
            // The padded segment does not fit (the memory limit, or the runtime): the block's
            // own size may.
            Err(Error::OutOfMemory { .. }) if size > class.size => {
                self.fresh_memory(class.size).await?
            }
            res => res?,
        };
        self.add_segment(memory);
        self.remember_segment(SegmentView {
            memory,
            meta: MetaRef::none(),
            pieces: Vec::new(),
        });
        self.carve_block(class, true).ok_or_else(|| {
            Error::Runtime(RuntimeError::new(
                "carve",
                format!(
                    "a fresh segment of {size} bytes did not hold {} bytes",
                    class.size
                ),
            ))
        })
    }

    /// Whether threads keep freed blocks of `class` in their own shards (the ready holder),
    /// rather than sending them home as they are freed: sizes up to the pool's limit for
    /// large pieces, in a pool with an arena.
    pub(super) fn thread_cached(&self, class: SizeClass) -> bool {
        self.carved
            .as_ref()
            .is_some_and(|s| s.carving.expandable && class.size <= self.shared.absorb_above)
    }

    /// A block of `class` from memory the pool holds, mapped and free: a ready block, or the
    /// best fit in the arena. `None` when only fresh memory would serve it.
    pub(super) fn without_growing(&mut self, class: SizeClass) -> Option<Box<Block<R>>> {
        let live = self.shared.stats.active_bytes_now().max(0) as usize;
        if let Some(s) = self.carved.as_mut() {
            s.peak_live = s.peak_live.max(live.saturating_add(class.size));
        }
        self.shared
            .ready
            .take(class)
            .or_else(|| self.carve_mapped(class))
    }

    /// A block of `class` cut at the start of the shortest stretch of the arena's mapped free
    /// memory that holds it (see `Arena::place_mapped`).
    fn carve_mapped(&mut self, class: SizeClass) -> Option<Box<Block<R>>> {
        let a = self.carved.as_mut()?.arena.as_mut()?;
        let (piece, exact) = a.place_mapped(class.size, usize::MAX)?;
        let seg = a.segment.clone();
        let mut b = self.block_for(class, piece, seg)?;
        b.holdable = exact;
        Some(b)
    }

    /// A miss in the arena that mapped free memory cannot serve: the place that needs the
    /// fewest granules mapped (best fit among those), mapping them after noticing completed
    /// events (invariant 3). `None` when the arena's range cannot hold the block (separate
    /// segments then).
    async fn miss_arena(&mut self, class: SizeClass) -> Option<Result<Box<Block<R>>, Error>> {
        self.retire_moves(false).await;
        let pack = self.carved.as_ref()?.carving.pack_granules;
        let mut placed = self
            .carved
            .as_mut()?
            .arena
            .as_mut()?
            .place(class.size, pack)?;
        if !placed.1.is_empty() && self.shared.stats.waiting_blocks.load(Ordering::Acquire) > 0 {
            let arena = self.carved.as_mut()?.arena.as_mut()?;
            if let Err(e) = arena.release(placed.0) {
                tracing::error!(?e, "arena piece could not be taken back; range leaked");
            }
            self.flush_events().await;
            // Blocks whose events completed came home to the ready holder or the homing
            // queue: look again, with them.
            self.book_notes();
            if let Some(b) = self.carve_mapped(class) {
                return Some(Ok(b));
            }
            placed = self
                .carved
                .as_mut()?
                .arena
                .as_mut()?
                .place(class.size, pack)?;
        }
        let (piece, need) = placed;
        if !need.is_empty() {
            let segs = self.carved.as_ref()?;
            // The cap a miss keeps: the garbage-collection threshold, and the reserve cap
            // only where the layout keeps it inside bursts too.
            let limit = self.shared.budget.limit();
            let gc = if segs.carving.cap_in_bursts {
                segs.carving.fresh_cap(segs.peak_live, limit)
            } else {
                segs.carving.gc_cap(limit)
            };
            let cap = segs.carving.reserve_cap(segs.peak_live);
            if let Err(e) = self.map_for(piece, need, gc).await {
                return Some(Err(e));
            }
            let reserved = self.shared.stats.allocated_bytes.read().current.max(0) as usize;
            if cap.is_some_and(|c| reserved > c) {
                self.trim_due = true;
            }
        }
        let seg = self.carved.as_ref()?.arena.as_ref()?.segment.clone();
        Some(self.block_for(class, piece, seg).ok_or_else(|| {
            Error::Runtime(RuntimeError::new("carve", "arena piece outside its range"))
        }))
    }

    /// A block of `class` out of memory the pool holds, taking no fresh memory and giving
    /// none back: a ready block of the class, else (under a carving layout, after the ready
    /// blocks are taken back) the best-fitting free range of mapped memory.
    pub(super) fn lend(&mut self, class: SizeClass) -> Option<Box<Block<R>>> {
        if let Some(b) = self.shared.ready.take(class) {
            return Some(b);
        }
        self.carved.as_ref()?;
        self.absorb_ready();
        let segs = self.carved.as_mut()?;
        let in_arena = segs.arena.as_mut().and_then(|a| {
            let (p, _) = a.place_mapped(class.size, usize::MAX)?;
            Some((p, a.segment.clone()))
        });
        let (piece, seg) = match in_arena {
            Some(found) => found,
            None => {
                let p = segs.carver.place(class.size, |_| true)?;
                (p, segs.carver.payload(p.seg)?.clone())
            }
        };
        self.block_for(class, piece, seg)
    }

    /// Bytes of a granule of the pool's expandable range (0 without one).
    fn granule_size(&self) -> usize {
        self.carved
            .as_ref()
            .and_then(|s| s.arena.as_ref())
            .map_or(0, |a| a.granule())
    }

    /// Counts a failure at the cap and describes it.
    pub(super) fn out_of_room(&self, requested: usize, cause: OomCause) -> Error {
        self.shared.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
        let budget = &self.shared.budget;
        tracing::info!(
            pool = %self.shared.id,
            requested,
            reserved = budget.reserved(),
            limit = budget.limit(),
            "out of room under the memory limit"
        );
        Error::OutOfMemory {
            requested,
            reserved: budget.reserved(),
            limit: budget.limit(),
            cause,
        }
    }

    /// Counts a failure of the runtime itself, after the cache was emptied and the
    /// allocation retried, and describes it.
    pub(super) fn driver_oom(&self, requested: usize) -> Error {
        self.shared.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
        let reserved = self.shared.budget.reserved();
        tracing::warn!(pool = %self.shared.id, requested, reserved, "runtime out of pinned memory");
        Error::OutOfMemory {
            requested,
            reserved,
            limit: None,
            cause: OomCause::NoRoomNow,
        }
    }
}
