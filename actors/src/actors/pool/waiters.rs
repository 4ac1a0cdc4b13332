//! Requests waiting for room under the memory limit: queued first come first served, and
//! served as blocks come back (a block of the head's class goes straight to it; any other is
//! freed to make room) or as room is made elsewhere. A waiter whose future was dropped is
//! forgotten at the next look; nothing it was sent is lost (invariant 2).

use std::sync::atomic::Ordering;

use super::PoolActor;
use crate::blocks::block::{Block, BlockState};
use crate::books::mailbox::{Ask, MissTx, Refused};
use crate::vocab::error::{Error, OomCause};
use crate::vocab::policy::SizeClass;
use crate::vocab::runtime::Runtime;

/// A request queued for room.
pub(crate) struct Waiter<R: Runtime> {
    class: SizeClass,
    requested: usize,
    reply: MissTx<Block<R>>,
}

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
        if !self.waiters.is_empty() {
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
        // The requester's thread runs the memory source's calls of this miss, if it lends it.
        self.lender = ask.lends.then(|| reply.clone());
        let result = self.miss(class).await;
        self.lender = None;
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

    /// Lends a block of `class` out of memory the pool holds, for another stream's pool
    /// (see `PoolMsg::Lend`); nothing while the pool closes.
    pub(super) async fn on_lend(
        &mut self,
        class: SizeClass,
        reply: crate::books::mailbox::Reply<Option<Box<Block<R>>>>,
    ) {
        let lent = if self.closing { None } else { self.lend(class) };
        if let Err(flume::SendError(Some(block))) = reply.send(lent) {
            // The borrower stopped waiting: the block is ready for someone else.
            self.take_back(block).await;
        }
    }

    /// Counts a failure at the cap and describes it.
    fn out_of_room(&self, requested: usize, cause: OomCause) -> Error {
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
    fn driver_oom(&self, requested: usize) -> Error {
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

    fn enqueue(&mut self, class: SizeClass, requested: usize, reply: MissTx<Block<R>>) {
        tracing::debug!(pool = %self.shared.id, requested, queued = self.waiters.len() + 1, "request waits for room");
        self.waiters.push_back(Waiter {
            class,
            requested,
            reply,
        });
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        self.shared.budget.waiter_added();
    }

    fn pop_waiter(&mut self) -> Option<Waiter<R>> {
        let w = self.waiters.pop_front()?;
        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        self.shared.budget.waiter_removed();
        Some(w)
    }

    /// Forgets the waiters whose futures were dropped.
    fn prune(&mut self) {
        let before = self.waiters.len();
        self.waiters.retain(|w| !w.reply.is_disconnected());
        for _ in self.waiters.len()..before {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            self.shared.budget.waiter_removed();
        }
    }

    /// Fails every waiter (the pool is closing).
    pub(super) fn drop_waiters(&mut self) {
        while let Some(w) = self.pop_waiter() {
            let _ = w.reply.send(Err(Refused::Failed(Error::Shutdown)));
        }
    }

    /// Gives `block` to the oldest waiter when it waits for the block's class; returns the
    /// block when nobody at the head of the queue wants it.
    fn offer(&mut self, mut block: Box<Block<R>>) -> Option<Box<Block<R>>> {
        self.prune();
        while self
            .waiters
            .front()
            .is_some_and(|w| w.class.index == block.class && block.size >= w.class.size)
        {
            let w = self.pop_waiter()?;
            block.state = BlockState::InUse;
            match w.reply.send(Ok(block)) {
                Ok(()) => return None,
                Err(flume::SendError(Ok(b))) => block = b,
                Err(flume::SendError(Err(_))) => return None,
            }
        }
        Some(block)
    }

    /// A block coming home outside the ready queues: to a waiter, freed for room while
    /// requests wait, cached otherwise.
    pub(super) async fn take_back(&mut self, block: Box<Block<R>>) {
        self.take_back_now(block).await;
        // Whatever became of it (freed, cached, handed to a waiter), room may have been
        // made: a request for several buffers waiting at the head of its queue tries again.
        self.shared.budget.came_home();
    }

    async fn take_back_now(&mut self, block: Box<Block<R>>) {
        let pressure = self.shared.budget.under_pressure() || !self.waiters.is_empty();
        if self.closing
            || !pressure
            || matches!(block.state, BlockState::Kept | BlockState::Waiting)
        {
            self.home(block).await;
            return;
        }
        let Some(block) = self.offer(block) else {
            return;
        };
        self.free_blocks(vec![block]).await;
        self.serve_waiters().await;
    }

    /// Serves queued requests in order while they fit: a ready block of the head's class,
    /// else fresh memory; when the head does not fit, the pool's cached blocks are freed once
    /// to make room.
    pub(super) async fn serve_waiters(&mut self) {
        let mut emptied = false;
        loop {
            self.prune();
            let Some(head) = self.waiters.front() else {
                break;
            };
            let (class, requested) = (head.class, head.requested);
            if self.shared.budget.limit().is_some_and(|l| class.size > l) {
                // The cap was lowered under it: it can never fit.
                let w = self.pop_waiter();
                let e = self.out_of_room(requested, OomCause::ExceedsLimit);
                if let Some(w) = w {
                    let _ = w.reply.send(Err(Refused::Failed(e)));
                }
                continue;
            }
            if let Some(b) = self.shared.ready.take(class) {
                if let Some(b) = self.offer(b) {
                    self.home(b).await;
                }
                continue;
            }
            let got = if self.carved.is_some() {
                // A free range of a segment, or a fresh segment.
                self.miss_carved(class).await
            } else {
                self.fresh(class).await
            };
            match got {
                Ok(b) => {
                    if let Some(b) = self.offer(b) {
                        // The head went away meanwhile.
                        self.home(b).await;
                    }
                }
                Err(Error::OutOfMemory { limit, .. }) => {
                    if !emptied {
                        emptied = true;
                        let blocks = self.shared.ready.drain();
                        if !blocks.is_empty() {
                            self.free_blocks(blocks).await;
                            continue;
                        }
                        if limit.is_none() {
                            continue;
                        }
                    }
                    if limit.is_none() {
                        let w = self.pop_waiter();
                        let e = self.driver_oom(requested);
                        if let Some(w) = w {
                            let _ = w.reply.send(Err(Refused::Failed(e)));
                        }
                        continue;
                    }
                    break;
                }
                Err(e) => {
                    if let Some(w) = self.pop_waiter() {
                        let _ = w.reply.send(Err(Refused::Failed(e)));
                    }
                }
            }
        }
    }

    /// The periodic look while requests wait: serve this pool's waiters, or, when requests
    /// wait elsewhere, give back what this pool caches to make room for them: its ready
    /// blocks, and the free memory of its segments once per spell of pressure (what was idle
    /// when the requests began to wait) and again after large pieces went home quietly
    /// (freed as the pressure began; see `book_notes`). Blocks that come home while requests
    /// wait are freed as they come (`take_back`). Nothing is given back while a capture is
    /// underway (see `miss`).
    pub(super) async fn relieve(&mut self) {
        self.book_notes();
        if !self.waiters.is_empty() {
            self.serve_waiters().await;
        } else if self.shared.budget.under_pressure() && !self.shared.budget.capturing() {
            let blocks = self.shared.ready.drain();
            if !blocks.is_empty() || !self.relieved {
                self.relieved = true;
                self.free_blocks(blocks).await;
            }
        }
    }
}
