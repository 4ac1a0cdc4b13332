//! A block: one piece of memory lent out as a unit, and where it goes when it is freed.
//!
//! Blocks travel: from a ready queue to a buffer, from a buffer back to a ready queue (the
//! cached path), parked or to the event poller while recorded events are pending, or to their
//! pool actor to be kept for graph replays or freed. Whoever holds the `Box<Block>` owns the
//! memory. A block dropped anywhere but in its pool actor's free finds its way home
//! (invariant 2: nothing is lost). A block reaches its pool through the [`Home`] it carries
//! (ready queues, parked slots, the senders to its actor and to the poller), never by naming
//! the actor.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::books::home::Home;
use crate::books::mailbox::{Note, PollerMsg, PoolMsg, Split};
use crate::books::segment::Segment;
use crate::holders::parked::Parkable;
use crate::holders::ready::Slotted;
use crate::statistics::meta::MetaRef;
use crate::vocab::idle_probe;
use crate::vocab::keepalive;
use crate::vocab::memory::Region;
use crate::vocab::runtime::{Runtime, RuntimeError, StreamId};

/// A pool's home, with the engine's blocks in its queues.
pub(crate) type Pool<R> = Home<R, Block<R>>;
/// A segment the engine's blocks are cut out of.
pub(crate) type Seg<R> = Segment<R, Block<R>>;

/// Where a block is in its life; decides what happens when it is dropped by accident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// Lent to a buffer, or on its way to one.
    InUse,
    /// In a ready queue.
    Cached,
    /// Freed, waiting for recorded events to complete.
    Waiting,
    /// Used by captured work; kept until its pool is released.
    Kept,
}

/// A block's pending events, and one completed event kept to be recorded again at its next
/// free (no trip through the runtime's event pool). Reached only through `&mut` (`get_mut`,
/// `spare_mut`), so sharing a `&Block` shares no access to them: the block stays `Sync`
/// although events need only be `Send`.
pub(crate) struct Events<E> {
    pending: Vec<E>,
    spare: Option<E>,
}

impl<E> Events<E> {
    fn new() -> Self {
        Events {
            pending: Vec::new(),
            spare: None,
        }
    }

    pub(crate) fn get_mut(&mut self) -> &mut Vec<E> {
        &mut self.pending
    }

    fn spare_mut(&mut self) -> &mut Option<E> {
        &mut self.spare
    }
}

// SAFETY: no method gives access to the events through `&Events`; all access needs `&mut`,
// which is exclusive, so concurrent `&` access from several threads touches nothing.
unsafe impl<E: Send> Sync for Events<E> {}

/// What a free found of one stream that used the block.
enum StreamAtFree<E> {
    /// Capturing: the block is kept (an event would become part of the graph).
    Capturing,
    /// Idle: all its work has run.
    Finished,
    /// Busy: the event that completes with its work so far.
    Recorded(E),
}

// Blocks are made one after another by the pool actor and then written by the threads that
// hold them: each gets cache lines of its own so that two threads' blocks never share one.
#[repr(align(128))]
pub(crate) struct Block<R: Runtime> {
    /// The memory: a whole allocation from the pool's source, or a range of `segment`.
    pub(crate) memory: Region,
    /// Bytes of the block (`memory.size`, kept beside the class for the cached path).
    pub(crate) size: usize,
    /// Index of the size class.
    pub(crate) class: usize,
    /// Stats shard the block is charged to while active.
    pub(crate) shard: usize,
    /// Allocated while its stream was capturing: never given events, kept if used.
    pub(crate) during_capture: bool,
    /// Streams recorded since the block was lent.
    pub(crate) streams: Vec<(StreamId, R::Stream)>,
    /// Events recorded at the free, while the block waits (empty otherwise).
    pub(crate) events: Events<R::Event>,
    pub(crate) state: BlockState,
    /// Set once the memory has been given back to the runtime.
    pub(crate) freed: bool,
    pub(crate) pool: Arc<Pool<R>>,
    /// What the holder writes for snapshots (requested bytes, streams).
    pub(crate) meta: MetaRef,
    /// The segment the block was cut out of (`None`: the block is a host allocation).
    pub(crate) segment: Option<Arc<Seg<R>>>,
    /// Cut again at the range its class last gave back, its class asked for once more
    /// while that range was still free: a large piece stays on the cached path when freed
    /// (see `PoolShared::large_piece`).
    pub(crate) recalled: bool,
    /// Placed by the pool actor into free memory it filled exactly: freed, it may be held
    /// by the freeing thread for its next request of the same size (see
    /// `ReadyQueues::put_held`), which the actor's best fit would most likely place there.
    pub(crate) holdable: bool,
    /// While a [`crate::blocks::lease::RawLease`] holds the block: the bytes requested and the
    /// lending engine's id (a [`crate::blocks::lease::Lease`] keeps them itself).
    pub(crate) raw_len: usize,
    pub(crate) raw_engine: u64,
}

impl<R: Runtime> Block<R> {
    pub(crate) fn new(memory: Region, class: usize, pool: Arc<Pool<R>>) -> Box<Self> {
        Box::new(Block {
            memory,
            size: memory.size,
            class,
            shard: 0,
            during_capture: false,
            streams: Vec::new(),
            events: Events::new(),
            state: BlockState::InUse,
            freed: false,
            pool,
            meta: MetaRef::take(),
            segment: None,
            recalled: false,
            holdable: false,
            raw_len: 0,
            raw_engine: 0,
        })
    }

    /// Splits a ready block cut out of a segment: it keeps its first `keep` bytes (as a
    /// block of class `class`) and the rest becomes a new ready block of class `rest_class`
    /// (returned). The pool actor is told before either part can come back to it (see
    /// [`Split`]). `None`, and the block unchanged, when it was not cut out of a segment or
    /// leaves no rest.
    pub(crate) fn split_off(
        &mut self,
        keep: usize,
        class: usize,
        rest_class: usize,
    ) -> Option<Box<Block<R>>> {
        let seg = self.segment.as_ref()?;
        if keep == 0 || keep >= self.size {
            return None;
        }
        let rest_len = self.size - keep;
        // `keep` lies inside the block, so the rest's start does too.
        let ptr = std::ptr::NonNull::new(self.memory.ptr.as_ptr().wrapping_add(keep))?;
        let rest = Region {
            ptr,
            size: rest_len,
            method: self.memory.method,
        };
        // One more hold on the segment, for the tail (the segment's count is a line every
        // thread cutting the range writes).
        let (seg_id, in_arena) = (seg.id, seg.is_arena());
        let mut tail = self.pool.new_block(rest, rest_class, Arc::clone(seg));
        tail.state = BlockState::Cached;
        self.pool.note(Note::Split(Split {
            addr: self.memory.addr(),
            first: keep,
            first_class: class,
            rest: rest_len,
            rest_class,
            seg: seg_id,
            in_arena,
            rest_meta: tail.meta,
        }));
        self.memory.size = keep;
        self.size = keep;
        self.class = class;
        self.recalled = false;
        Some(tail)
    }

    /// Whether the block was cut out of its pool's expandable range.
    pub(crate) fn in_arena(&self) -> bool {
        self.segment.as_ref().is_some_and(|s| s.is_arena())
    }

    /// The free of a buffer: back to the ready queue when no stream used the block, or when
    /// every stream that did has run all its work (see [`idle_probe`]); parked in the freeing
    /// thread's shard with one event per busy stream otherwise (to be queried inline by that
    /// thread's next miss, or by the event poller); kept when captured work used it, unless
    /// it waits for the capture to end instead (see [`Block::defers_capture`]). A
    /// stream on which no event could be recorded stays with the waiting block, and the
    /// event is recorded when the block is next asked about (see
    /// [`Block::events_completed`]): such a block is never reused before, and never kept
    /// for ever.
    pub(crate) fn release(mut self: Box<Self>) {
        if self.streams.is_empty() {
            self.pool.stats.deactivate(self.shard, self.size);
            give_back(self);
            return;
        }
        let mut keep = self.during_capture;
        debug_assert!(self.events.get_mut().is_empty());
        let mut unrecorded = Vec::new();
        if !keep {
            for (id, s) in std::mem::take(&mut self.streams) {
                match self.stream_at_free(&s) {
                    Ok(StreamAtFree::Recorded(e)) => self.events.get_mut().push(e),
                    // Nothing the stream has still to run can touch the block.
                    Ok(StreamAtFree::Finished) => {}
                    Ok(StreamAtFree::Capturing) if self.defers_capture() => {
                        unrecorded.push((id, s));
                    }
                    Ok(StreamAtFree::Capturing) => {
                        keep = true;
                        break;
                    }
                    Err(e) => {
                        // Without an event there is no way to know yet when the stream is
                        // done with the block: it waits, and the event is recorded later.
                        tracing::warn!(error = %e, "could not record an event on free; will try again");
                        unrecorded.push((id, s));
                    }
                }
            }
        }
        self.streams = if keep { Vec::new() } else { unrecorded };
        if keep {
            let rt = &*self.pool.runtime;
            for e in self.events.get_mut().drain(..) {
                rt.release_event(e);
            }
            let stats = &self.pool.stats;
            stats.deactivate(self.shard, self.size);
            stats.kept_blocks.fetch_add(1, Ordering::Relaxed);
            stats
                .kept_bytes
                .fetch_add(self.size as i64, Ordering::Relaxed);
            self.state = BlockState::Kept;
            let pool = self.pool.clone();
            if let Err(flume::SendError(PoolMsg::Keep(b))) = pool.mailbox.send(PoolMsg::Keep(self))
            {
                b.orphaned();
            }
        } else if self.events.get_mut().is_empty() && self.streams.is_empty() {
            // Every stream that used the block had run all its work: reusable at once.
            self.free_completed();
            give_back(self);
        } else {
            let stats = &self.pool.stats;
            stats.waiting_blocks.fetch_add(1, Ordering::Relaxed);
            stats
                .waiting_bytes
                .fetch_add(self.size as i64, Ordering::Relaxed);
            self.state = BlockState::Waiting;
            keepalive::ensure(&self.pool);
            let pool: *const Pool<R> = Arc::as_ptr(&self.pool);
            // SAFETY: `keepalive::ensure` made this thread hold a strong reference to the
            // pool until its next call, so the pool outlives this function even once the
            // block (and the reference it carries) is parked and taken by another thread.
            let pool = unsafe { &*pool };
            if pool.divert.load(Ordering::Acquire) != 0 || pool.wants_home(&self) {
                // A closing pool, or one whose requests wait for room, wants blocks back
                // through its actor, and so does every block too large to cache: go straight
                // to the poller, which sends them home when their events complete.
                if let Err(flume::SendError(PollerMsg::Wait(b))) =
                    pool.poller.send(PollerMsg::Wait(self))
                {
                    b.wait_here();
                }
            } else {
                pool.parked
                    .park(self, |p| pool.poller.send(PollerMsg::Watch(p)).is_ok());
            }
        }
    }

    /// Whether a free that finds a recorded stream capturing waits for the capture to end
    /// instead of keeping the block: a block of a stream's pool (device memory) waits, as
    /// PyTorch's device allocator defers such frees, and the event is recorded once the
    /// stream captures no more (see [`Block::events_completed`]); the block is reused once
    /// that event completes. A block allocated during a capture (invariant 4), and a host
    /// block, which a graph may copy from on every replay, are kept.
    fn defers_capture(&self) -> bool {
        self.pool.owner.is_some() && !self.during_capture
    }

    /// What the free finds of `stream`, one that used the block: capturing, done with its
    /// work, or the event that completes with its work so far.
    fn stream_at_free(
        &mut self,
        stream: &R::Stream,
    ) -> Result<StreamAtFree<R::Event>, RuntimeError> {
        let rt = &*self.pool.runtime;
        // An event recorded during capture would become part of the graph and could never
        // be queried: a block used by captured work is kept instead.
        if rt.is_capturing(stream)? {
            Ok(StreamAtFree::Capturing)
        } else if idle_probe::finished(rt, stream) {
            Ok(StreamAtFree::Finished)
        } else {
            let spare = self.events.spare_mut().take();
            rt.record_event_reusing(stream, spare)
                .map(StreamAtFree::Recorded)
        }
    }

    /// Records the events that the free could not (see [`Block::release`]); whether every
    /// stream now has one (or is done). A stream that fails again, or is capturing by now,
    /// is asked again later.
    fn record_missing(&mut self) -> bool {
        while let Some((id, s)) = self.streams.pop() {
            match self.stream_at_free(&s) {
                Ok(StreamAtFree::Recorded(e)) => self.events.get_mut().push(e),
                Ok(StreamAtFree::Finished) => {}
                Ok(StreamAtFree::Capturing) | Err(_) => {
                    self.streams.push((id, s));
                    return false;
                }
            }
        }
        true
    }

    /// Whether every event recorded for the block has completed; releases those that have
    /// (keeping one to record again at the next free). A failed query counts as not
    /// completed (it is asked again later), and so does a stream whose event the free
    /// could not record (recorded now if it can be).
    pub(crate) fn events_completed(&mut self) -> bool {
        if !self.streams.is_empty() && !self.record_missing() {
            return false;
        }
        let rt = &*self.pool.runtime;
        let Events { pending, spare } = &mut self.events;
        while let Some(e) = pending.last() {
            match rt.query_event(e) {
                Ok(true) => {
                    if let Some(e) = pending.pop() {
                        match spare {
                            None => *spare = Some(e),
                            Some(_) => rt.release_event(e),
                        }
                    }
                }
                Ok(false) => return false,
                Err(e) => {
                    tracing::warn!(error = %e, "event query failed; will ask again");
                    return false;
                }
            }
        }
        true
    }

    /// Hands the completed event kept for the next free back to the runtime (the record
    /// goes to another block, or away).
    fn release_spare_event(&mut self) {
        if let Some(e) = self.events.spare_mut().take() {
            self.pool.runtime.release_event(e);
        }
    }

    /// Blocks this thread until the block's events complete, then gives the block back. Only
    /// used when the event poller is gone (its tokio runtime was shut down).
    pub(crate) fn wait_here(mut self: Box<Self>) {
        let rt = self.pool.runtime.clone();
        if !self.record_missing() {
            tracing::error!("no event could be recorded with no poller; block leaked");
            self.freed = true;
            return;
        }
        while let Some(e) = self.events.get_mut().pop() {
            loop {
                match rt.query_event(&e) {
                    Ok(true) => break,
                    Ok(false) => std::thread::sleep(std::time::Duration::from_micros(100)),
                    Err(err) => {
                        tracing::error!(error = %err, "event query failed with no poller; block leaked");
                        self.freed = true;
                        return;
                    }
                }
            }
            rt.release_event(e);
        }
        self.returned_from_waiting();
    }

    /// A waiting block whose events have all completed stops being counted as waiting and
    /// active; it is ready to be handed out again.
    pub(crate) fn leave_waiting(&mut self) {
        debug_assert!(self.events.get_mut().is_empty() && self.streams.is_empty());
        let stats = &self.pool.stats;
        stats.waiting_blocks.fetch_sub(1, Ordering::Relaxed);
        stats
            .waiting_bytes
            .fetch_sub(self.size as i64, Ordering::Relaxed);
        self.free_completed();
        self.state = BlockState::InUse;
    }

    /// A freed block no stream's work can touch any more: its free completes (history) and
    /// it stops being counted as active.
    fn free_completed(&mut self) {
        self.pool.history.on_free_completed(
            self.pool.id,
            self.pool.owner,
            self.memory.addr(),
            self.size,
        );
        self.pool.stats.deactivate(self.shard, self.size);
    }

    /// A block whose events have all completed becomes reusable. It counts as waiting until
    /// it is back where requests find it: a miss in between flushes the events (and so waits
    /// for whoever brings it back) rather than taking fresh memory (invariant 3).
    pub(crate) fn returned_from_waiting(mut self: Box<Self>) {
        debug_assert!(self.events.get_mut().is_empty() && self.streams.is_empty());
        let (pool, size) = (self.pool.clone(), self.size as i64);
        self.free_completed();
        self.state = BlockState::InUse;
        give_back(self);
        pool.stats.waiting_bytes.fetch_sub(size, Ordering::Relaxed);
        // Release: a miss that reads the count after this finds the block where it went.
        pool.stats.waiting_blocks.fetch_sub(1, Ordering::Release);
    }

    /// A block that no actor can take any more (its tokio runtime is gone): free it here when
    /// that is safe, leak it otherwise.
    pub(crate) fn orphaned(mut self: Box<Self>) {
        if let Some(segment) = self.segment.take() {
            // A range of a segment: the segment goes back to the runtime with its last piece,
            // unless device work may still use this one.
            if matches!(self.state, BlockState::Waiting | BlockState::Kept) {
                segment.leak();
            }
            self.freed = true;
            return;
        }
        match self.state {
            BlockState::InUse | BlockState::Cached => {
                let pool = self.pool.clone();
                if let Err(mut b) = pool.free_block_now(self) {
                    b.freed = true; // the runtime refused; leaked rather than reused
                }
            }
            BlockState::Waiting | BlockState::Kept => {
                tracing::warn!(
                    bytes = self.memory.size,
                    "pinned block still used by device work outlived its allocator's actors; leaked"
                );
                self.freed = true;
            }
        }
    }

    /// Moves the block's contents into a new box, leaving this one marked as freed.
    fn take(&mut self) -> Box<Self> {
        self.freed = true;
        Box::new(Block {
            memory: self.memory,
            size: self.size,
            class: self.class,
            shard: self.shard,
            during_capture: self.during_capture,
            streams: std::mem::take(&mut self.streams),
            events: std::mem::replace(&mut self.events, Events::new()),
            state: self.state,
            freed: false,
            pool: self.pool.clone(),
            meta: std::mem::replace(&mut self.meta, MetaRef::none()),
            segment: self.segment.take(),
            recalled: self.recalled,
            holdable: self.holdable,
            raw_len: self.raw_len,
            raw_engine: self.raw_engine,
        })
    }
}

/// Puts a block that is ready for reuse back where requests find it: its pool's ready
/// queue, or its pool actor once the pool is closing or requests wait for room, or when the
/// block is too large to cache; a large piece of a segment goes back into its range at the
/// actor's next look (`Home::home_quietly`).
#[inline]
pub(crate) fn give_back<R: Runtime>(mut block: Box<Block<R>>) {
    keepalive::ensure(&block.pool);
    let pool: *const Pool<R> = Arc::as_ptr(&block.pool);
    // SAFETY: `keepalive::ensure` made this thread hold a strong reference to the pool until
    // its next call, so the pool outlives this function even after the block (and the
    // reference it carries) has moved into a queue and been taken by another thread.
    let pool = unsafe { &*pool };
    let divert = pool.divert.load(Ordering::Acquire);
    if divert != 0 || pool.wants_home(&block) {
        if divert == 0 && block.size <= pool.max_cached_size {
            // A large piece: held by this thread until its next miss (a request of its size
            // takes it back before then), or home at once, with no message and no actor
            // woken.
            block.state = BlockState::Cached;
            let held = if block.holdable {
                pool.ready.put_held(block)
            } else {
                Some(block)
            };
            if let Some(mut block) = held {
                block.state = BlockState::InUse;
                pool.home_quietly(block);
            }
            return;
        }
        block.state = BlockState::InUse;
        if let Err(flume::SendError(PoolMsg::Home(b))) = pool.mailbox.send(PoolMsg::Home(block)) {
            b.orphaned();
        }
        return;
    }
    block.state = BlockState::Cached;
    pool.ready.put(block);
}

impl<R: Runtime> Slotted for Block<R> {
    #[inline]
    fn class(&self) -> usize {
        self.class
    }

    #[inline]
    fn size(&self) -> usize {
        self.size
    }
}

impl<R: Runtime> Parkable for Block<R> {
    fn events_completed(&mut self) -> bool {
        Block::events_completed(self)
    }

    fn leave_waiting(&mut self) {
        Block::leave_waiting(self)
    }

    fn returned_from_waiting(self: Box<Self>) {
        Block::returned_from_waiting(self)
    }

    fn to_poller(self: Box<Self>) {
        let poller = self.pool.poller.clone();
        if let Err(flume::SendError(PollerMsg::Wait(b))) = poller.send(PollerMsg::Wait(self)) {
            // The poller is gone with its runtime: wait here for the events.
            b.wait_here();
        }
    }

    fn wait_here(self: Box<Self>) {
        Block::wait_here(self)
    }
}

impl<R: Runtime> Pool<R> {
    /// A block of class `class` over `memory`, cut out of `segment`: a record the actor
    /// recycled if there is one (no allocation), else a new one.
    pub(crate) fn new_block(
        self: &Arc<Self>,
        memory: Region,
        class: usize,
        segment: Arc<Seg<R>>,
    ) -> Box<Block<R>> {
        let Some(mut b) = self.shells.pop() else {
            let mut b = Block::new(memory, class, self.clone());
            b.segment = Some(segment);
            return b;
        };
        b.memory = memory;
        b.size = memory.size;
        b.class = class;
        b.shard = 0;
        b.during_capture = false;
        b.state = BlockState::InUse;
        b.freed = false;
        b.segment = Some(segment);
        b.recalled = false;
        b.holdable = false;
        b.meta.lent(0);
        b
    }

    /// Keeps the record of a block taken back into its segment's free ranges (its memory
    /// no longer its own: `freed`, no segment) for [`Self::new_block`], unless enough are
    /// kept.
    pub(crate) fn recycle(&self, mut block: Box<Block<R>>) {
        if !block.freed || block.segment.is_some() {
            return;
        }
        block.streams.clear();
        block.events.get_mut().clear();
        block.release_spare_event();
        // When enough are kept, the queue hands the record back and it is dropped here.
        let _ = self.shells.push(block);
    }

    /// Once the actor is gone (dropped with its runtime), frees the blocks that a free racing
    /// its teardown put into the ready queues after its last look: each holds the pool, so
    /// left there neither would ever be freed. Called when the allocator's handle goes.
    pub(crate) fn free_stranded(&self) {
        if !self.mailbox.is_closed() {
            return;
        }
        for b in self.ready.drain().into_iter().chain(self.homed()) {
            b.orphaned();
        }
    }

    /// Sends the large blocks this thread held since its last miss home (see
    /// `ReadyQueues::put_held`), before it asks the pool actor: the actor coalesces them
    /// first, so that its placement sees every block this thread freed.
    #[cold]
    pub(crate) fn send_held_home(&self) {
        let mut held = Vec::new();
        self.ready.take_held_mine(&mut held);
        for mut b in held {
            b.state = BlockState::InUse;
            self.home_quietly(b);
        }
    }

    /// Sends every ready block of this thread's shard home, where the pool actor coalesces
    /// it with the free memory around it (see `Refused::Coalesce`).
    #[cold]
    pub(crate) fn send_mine_home(&self) {
        let mut mine = Vec::new();
        self.ready.drain_mine(&mut mine);
        self.ready.take_held_mine(&mut mine);
        for mut b in mine {
            b.state = BlockState::InUse;
            self.home_quietly(b);
        }
    }

    /// Drops the kept records (each holds the pool: the pool would never be dropped).
    pub(crate) fn drop_shells(&self) {
        while let Some(b) = self.shells.pop() {
            drop(b);
        }
    }

    /// Whether a freed block goes to the actor rather than the ready queues: too large to
    /// cache, or a large piece of a segment (coalesced at once).
    #[inline]
    pub(crate) fn wants_home(&self, block: &Block<R>) -> bool {
        block.size > self.max_cached_size || self.large_piece(block)
    }

    /// Whether the block is a large piece that fills less than 3/4 of its carved segment: on
    /// free it goes back into its segment at once, to coalesce with its neighbours. Larger
    /// pieces, pieces recalled to the range their class just gave back, and pieces of the
    /// expandable range up to `Carving::arena_cached_up_to` stay on the cached path like
    /// whole segments: a request of their class that comes back again and again is served
    /// without the pool actor.
    #[inline]
    pub(crate) fn large_piece(&self, block: &Block<R>) -> bool {
        block.size > self.absorb_above
            && !block.recalled
            && !(block.size <= self.arena_cached_up_to && block.in_arena())
            && block
                .segment
                .as_ref()
                .is_some_and(|s| (block.size as u128) * 4 < (s.size() as u128) * 3)
    }

    /// Gives a block's memory back to its source on this thread and keeps the books (stats,
    /// the budget, and the registry of segments). When the source refuses, the block is
    /// handed back, still reserved and still counted.
    ///
    /// A block carved out of a segment is not an allocation of its own: it lets go of its
    /// segment, which goes back with its last piece (see `segment`).
    pub(crate) fn free_block_now(&self, mut block: Box<Block<R>>) -> Result<(), Box<Block<R>>> {
        if let Some(segment) = block.segment.take() {
            block.freed = true;
            drop(segment);
            return Ok(());
        }
        match self.free_memory_now(block.memory) {
            Ok(()) => {
                block.freed = true;
                Ok(())
            }
            Err(_) => Err(block),
        }
    }
}

impl<R: Runtime> Drop for Block<R> {
    fn drop(&mut self) {
        if self.freed {
            self.meta.give_back();
            self.release_spare_event();
            return;
        }
        // Dropped by accident (a cancelled reply, an actor torn down with its runtime):
        // send it home, or free it here if home is gone.
        let b = self.take();
        let pool = b.pool.clone();
        if let Err(flume::SendError(PoolMsg::Home(b))) = pool.mailbox.send(PoolMsg::Home(b)) {
            b.orphaned();
        }
    }
}
