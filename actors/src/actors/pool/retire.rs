//! Retiring a stream's pool that holds nothing (`PoolMsg::Retire`, sent by the router at
//! `empty_cache`): the pool closes at once, its address range goes back before it answers,
//! and its actor stops.

use std::sync::atomic::Ordering;

use super::PoolActor;
use crate::books::home::DIVERT_CLOSING;
use crate::vocab::runtime::Runtime;

impl<R: Runtime> PoolActor<R> {
    /// Whether the pool holds nothing: no memory of its source (so no block of it is lent,
    /// cached, waiting on events or kept), no segment refused, and no request waiting,
    /// deferred or in its mailbox. Its address range, if it reserved one, maps nothing.
    fn holds_nothing(&self) -> bool {
        let s = &self.shared.stats;
        s.allocations.read().current <= 0
            && s.allocated_bytes.read().current <= 0
            && self.kept.is_empty()
            && self.refused.is_empty()
            && self.queue.is_empty()
            && self.deferred.is_empty()
            && self.shared.queued.load(Ordering::SeqCst) == 0
            && self.rx.is_empty()
    }

    /// Retires the pool if it holds nothing: marks it closing, closes its mailbox (later
    /// messages are refused; those that came meanwhile are dropped unanswered, so that a
    /// request among them sees the pool gone and asks the router again, and a caller of
    /// `empty_cache` counts it as empty), gives its address range back off the executor,
    /// and lets the loop end. Whether it did.
    pub(super) async fn retire(&mut self) -> bool {
        if !self.holds_nothing() {
            return false;
        }
        self.closing = true;
        self.shared
            .divert
            .fetch_or(DIVERT_CLOSING, Ordering::SeqCst);
        // Nothing of the pool is lent, so no message carries a block of it.
        drop(self.shared.mailbox.close(&self.rx));
        let arena = self.carved.as_mut().and_then(|s| s.arena.take());
        if let Some(arena) = arena {
            // The range's last holder: dropping it gives the range back.
            let _ = self.off_executor(move || drop(arena)).await;
        }
        true
    }
}
