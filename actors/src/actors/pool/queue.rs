//! Requests waiting for room under the memory limit: queued first come first served, and
//! served as blocks come back (a block of the head's class goes straight to it; any other is
//! freed to make room) or as room is made elsewhere. A queued request whose future was dropped is
//! forgotten at the next look; nothing it was sent is lost (invariant 2).

use std::sync::atomic::Ordering;

use super::PoolActor;
use crate::blocks::block::{Block, BlockState};
use crate::books::messages::{MissTx, Refused};
use crate::vocab::error::{Error, OomCause};
use crate::vocab::policy::SizeClass;
use crate::vocab::runtime::Runtime;

/// A request queued for room.
pub(crate) struct Queued<R: Runtime> {
    class: SizeClass,
    requested: usize,
    reply: MissTx<Block<R>>,
}

impl<R: Runtime> PoolActor<R> {
    /// Lends a block of `class` out of memory the pool holds, for another stream's pool
    /// (see `PoolMsg::Lend`); nothing while the pool closes.
    pub(super) async fn on_lend(
        &mut self,
        class: SizeClass,
        reply: crate::books::messages::Reply<Option<Box<Block<R>>>>,
    ) {
        let lent = if self.closing { None } else { self.lend(class) };
        if let Err(flume::SendError(Some(block))) = reply.send(lent) {
            // The borrower stopped waiting: the block is ready for someone else.
            self.take_back(block).await;
        }
    }

    pub(super) fn enqueue(&mut self, class: SizeClass, requested: usize, reply: MissTx<Block<R>>) {
        tracing::debug!(pool = %self.shared.id, requested, queued = self.queue.len() + 1, "request waits for room");
        self.queue.push_back(Queued {
            class,
            requested,
            reply,
        });
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        self.shared.budget.queued_added();
    }

    fn pop_queued(&mut self) -> Option<Queued<R>> {
        let w = self.queue.pop_front()?;
        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        self.shared.budget.queued_removed();
        Some(w)
    }

    /// Forgets the queued requests whose futures were dropped.
    pub(super) fn prune(&mut self) {
        let before = self.queue.len();
        self.queue.retain(|w| !w.reply.is_disconnected());
        for _ in self.queue.len()..before {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            self.shared.budget.queued_removed();
        }
    }

    /// Fails every queued request (the pool is closing).
    pub(super) fn drop_queue(&mut self) {
        while let Some(w) = self.pop_queued() {
            let _ = w.reply.send(Err(Refused::Failed(Error::Shutdown)));
        }
    }

    /// Serves queued requests in order while they fit: a ready block of the head's class,
    /// else fresh memory; when the head does not fit, the pool's cached blocks are freed once
    /// to make room.
    pub(super) async fn serve_queue(&mut self) {
        let mut emptied = false;
        loop {
            self.prune();
            let Some(head) = self.queue.front() else {
                break;
            };
            let (class, requested) = (head.class, head.requested);
            if self.shared.budget.limit().is_some_and(|l| class.size > l) {
                // The cap was lowered under it: it can never fit.
                let w = self.pop_queued();
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
                        let w = self.pop_queued();
                        let e = self.driver_oom(requested);
                        if let Some(w) = w {
                            let _ = w.reply.send(Err(Refused::Failed(e)));
                        }
                        continue;
                    }
                    break;
                }
                Err(e) => {
                    if let Some(w) = self.pop_queued() {
                        let _ = w.reply.send(Err(Refused::Failed(e)));
                    }
                }
            }
        }
    }

    /// The periodic look while requests wait: serve this pool's queued requests, or, when requests
    /// wait elsewhere, give back what this pool caches to make room for them: its ready
    /// blocks, and the free memory of its segments once per spell of pressure (what was idle
    /// when the requests began to wait) and again after large pieces went home quietly
    /// (freed as the pressure began; see `book_notes`). Blocks that come home while requests
    /// wait are freed as they come (`take_back`). Nothing is given back while a capture is
    /// underway (see `miss`).
    pub(super) async fn relieve(&mut self) {
        self.book_notes();
        if !self.queue.is_empty() {
            self.serve_queue().await;
        } else if self.shared.budget.under_pressure() && !self.shared.budget.capturing() {
            let blocks = self.shared.ready.drain();
            if !blocks.is_empty() || !self.relieved {
                self.relieved = true;
                self.free_blocks(blocks).await;
            }
        }
    }

    /// Gives `block` to the oldest queued request when it waits for the block's class; returns the
    /// block when nobody at the head of the queue wants it.
    pub(super) fn offer(&mut self, mut block: Box<Block<R>>) -> Option<Box<Block<R>>> {
        self.prune();
        while self
            .queue
            .front()
            .is_some_and(|w| w.class.index == block.class && block.size >= w.class.size)
        {
            let w = self.pop_queued()?;
            block.state = BlockState::InUse;
            match w.reply.send(Ok(block)) {
                Ok(()) => return None,
                Err(flume::SendError(Ok(b))) => block = b,
                Err(flume::SendError(Err(_))) => return None,
            }
        }
        Some(block)
    }
}
