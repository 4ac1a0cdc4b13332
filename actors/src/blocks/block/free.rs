//! A block's free: back to the ready holder when no stream's work can touch it, parked or
//! with the event poller while the events recorded on the streams that used it are
//! pending, kept while captured work may use it, and home to its pool actor when the pool
//! wants it back.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Block, BlockState, Events, Home, StreamAtFree};
use crate::books::messages::{PollerMsg, PoolMsg};
use crate::statistics::meta::MetaRef;
use crate::vocab::idle_probe;
use crate::vocab::keepalive;
use crate::vocab::runtime::{Runtime, RuntimeError};

impl<R: Runtime> Block<R> {
    /// The free of a buffer: back to the ready holder when no stream used the block, or when
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
        if self.record_at_free() {
            self.keep_for_replays();
        } else if self.events.get_mut().is_empty() && self.streams.is_empty() {
            // Every stream that used the block had run all its work: reusable at once.
            self.free_completed();
            give_back(self);
        } else {
            self.wait_for_events();
        }
    }

    /// The free's look at each stream that used the block (see [`Self::stream_at_free`]):
    /// events recorded for the busy ones, and the streams it could not record on (or that
    /// capture, where the free waits for the capture to end) left with the block. Returns
    /// whether the block is kept instead (captured work used it); then no stream is left
    /// with it.
    #[inline]
    fn record_at_free(&mut self) -> bool {
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
        keep
    }

    /// A freed block that captured work used: its events go back, it counts as kept, and
    /// it goes to its pool actor, which keeps it while the pool lives (invariant 4).
    fn keep_for_replays(mut self: Box<Self>) {
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
        if let Err(flume::SendError(PoolMsg::Keep(b))) = pool.mailbox.send(PoolMsg::Keep(self)) {
            b.orphaned();
        }
    }

    /// A freed block with events pending (or streams yet to record on): it counts as
    /// waiting, and is parked in the freeing thread's shard, or sent to the poller when its
    /// pool wants blocks back through its actor.
    #[inline]
    fn wait_for_events(mut self: Box<Self>) {
        let stats = &self.pool.stats;
        stats.waiting_blocks.fetch_add(1, Ordering::Relaxed);
        stats
            .waiting_bytes
            .fetch_add(self.size as i64, Ordering::Relaxed);
        self.state = BlockState::Waiting;
        keepalive::ensure(&self.pool);
        let pool: *const Home<R> = Arc::as_ptr(&self.pool);
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
    pub(super) fn release_spare_event(&mut self) {
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
        self.pool.history.on_free_completed(self.seen());
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
    pub(super) fn take(&mut self) -> Box<Self> {
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
    let pool: *const Home<R> = Arc::as_ptr(&block.pool);
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
