//! Serving runs from one pinned arena: [`ArenaSession`] owns the arena (one
//! [`PinnedBuffer`] of the plan's arena size, taken from the pool) and a [`PlanCursor`], and
//! answers each request that matches the plan with a [`PlanBuffer`] that views the arena at
//! the planned offset — no allocator work, no runtime call. A request that departs from the
//! plan is served by the pool, with a warning; so is the rest of that iteration.
//!
//! Why served views never overlap while alive: the plan passed the checker (live
//! allocations are disjoint in the arena) and has no empty lifetimes; the cursor serves
//! allocation k only once every allocation that the plan frees before k starts has been
//! dropped (frees reach the session on a channel, drained before each request); and a reset
//! waits until every buffer of the iteration is gone.
//!
//! Stream ordering: a served buffer remembers the streams recorded on it; when it drops it
//! records an event on each and sends them to the session with its free. Within an
//! iteration, a request whose planned bytes overlap a freed buffer with an event not yet
//! complete is served by the pool instead (its slot in the plan still counts). At a reset,
//! if such events remain, their streams are recorded on the arena's `PinnedBuffer`, which
//! goes back to the pool — reused only after those events, as every pool block — and a new
//! arena is taken from the pool: a double buffer that costs one cached allocation per
//! iteration while copies are in flight, and nothing otherwise. If the session goes away
//! first, the arena's last owner records the streams on it before giving it back.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::actors::blocking;
use crate::actors::Runtime;

use super::arena::{completed, release, Arena, Freed, Pending, Ticket};
use super::buffer::{Inner, PlanBuffer};
use super::session::{ArenaPlan, Claim, PlanSessionError, Waiter};
use super::{Mismatch, PlanCursor};
use crate::{PinnedAllocator, PinnedBuffer};

/// Counters of an [`ArenaSession`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServeStats {
    /// Requests served from the arena.
    pub served: u64,
    /// Requests served by the pool (departures from the plan, and planned bytes still in
    /// use by a stream).
    pub fallbacks: u64,
    /// Completed resets.
    pub resets: u64,
    /// Resets that replaced the arena because stream work on it was pending.
    pub arena_swaps: u64,
}

/// What a request gets, decided before any await.
enum Step<R: Runtime> {
    Ready(PlanBuffer<R>),
    Pool(Option<Ticket<R>>),
}

/// Serves iterations of a plan from one pinned arena (see the [module docs](super)).
/// One owner: requests take `&mut self`; buffers may be sent anywhere and dropped anywhere.
pub struct ArenaSession<R: Runtime> {
    pool: PinnedAllocator<R>,
    plan: ArenaPlan,
    cursor: PlanCursor,
    arena: Option<Arc<Arena<R>>>,
    tx: flume::Sender<Freed<R>>,
    rx: flume::Receiver<Freed<R>>,
    pending: Vec<Pending<R>>,
    issued: usize,
    returned: usize,
    mismatch: Option<Mismatch>,
    stats: ServeStats,
    _claim: Claim,
}

impl<R: Runtime> ArenaSession<R> {
    fn new_arena(&self, buf: PinnedBuffer<R>) -> Arc<Arena<R>> {
        let mut buf = buf;
        let base = NonNull::new(buf.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Arc::new(Arena {
            buf,
            base,
            runtime: Arc::clone(self.pool.runtime()),
            rx: self.rx.clone(),
        })
    }

    fn arena_len(&self) -> usize {
        // Checked to fit when the plan was bound.
        usize::try_from(self.plan.arena_size()).unwrap_or(usize::MAX)
    }

    /// The plan served.
    pub fn plan(&self) -> &ArenaPlan {
        &self.plan
    }

    /// Start of the arena (null while the session has none: after a failed reset).
    pub fn arena_ptr(&self) -> *const u8 {
        self.arena
            .as_ref()
            .map_or(std::ptr::null(), |a| a.base.as_ptr())
    }

    /// Counters.
    pub fn stats(&self) -> ServeStats {
        self.stats
    }

    /// The first departure from the plan in this iteration, if any.
    pub fn mismatch(&self) -> Option<&Mismatch> {
        self.mismatch.as_ref()
    }

    /// Buffers of this iteration that hold a slot of the plan and are still alive (as of
    /// the frees received so far).
    pub fn live(&self) -> usize {
        self.issued - self.returned
    }

    /// Allocations of this iteration that took their slot of the plan.
    pub fn position(&self) -> usize {
        self.cursor.served()
    }

    fn on_freed(&mut self, freed: Freed<R>) {
        self.returned += 1;
        let _ = self.cursor.on_free(freed.number);
        if freed.events.is_empty() {
            return;
        }
        self.pending.push(Pending {
            lo: freed.lo,
            hi: freed.hi,
            streams: freed.streams,
            events: freed.events,
        });
    }

    fn drain(&mut self) {
        while let Ok(freed) = self.rx.try_recv() {
            self.on_freed(freed);
        }
    }

    /// Forgets pending regions whose events have all completed.
    fn poll_pending(&mut self) {
        let runtime = Arc::clone(self.pool.runtime());
        let mut i = 0;
        while i < self.pending.len() {
            if completed(&*runtime, &self.pending[i].events) {
                let done = self.pending.swap_remove(i);
                release(&*runtime, done.events);
            } else {
                i += 1;
            }
        }
    }

    fn blocked(&mut self, lo: usize, hi: usize) -> bool {
        if self.pending.is_empty() {
            return false;
        }
        self.poll_pending();
        self.pending.iter().any(|p| p.lo < hi && lo < p.hi)
    }

    fn step(&mut self, size: usize) -> Step<R> {
        self.drain();
        if self.mismatch.is_some() {
            return Step::Pool(None);
        }
        let Some(arena) = self.arena.clone() else {
            tracing::warn!(
                allocator = self.plan.allocator_id(),
                "no arena (a reset failed to take one): served by the pool until the next reset"
            );
            return Step::Pool(None);
        };
        let served = match self.cursor.on_alloc(size as u64) {
            Ok(served) => served,
            Err(mismatch) => {
                tracing::warn!(
                    allocator = self.plan.allocator_id(),
                    %mismatch,
                    "request departs from the plan: served by the pool until the next reset"
                );
                self.mismatch = Some(mismatch);
                return Step::Pool(None);
            }
        };
        // The plan placed it inside the arena (checked when the plan was bound).
        let lo = served.offset as usize;
        let hi = lo + size;
        self.issued += 1;
        let ticket = Ticket {
            number: served.number,
            lo,
            hi,
            streams: Vec::new(),
            tx: self.tx.clone(),
            arena,
        };
        if size > 0 && self.blocked(lo, hi) {
            tracing::debug!(
                number = served.number,
                "planned bytes still used by a stream: served by the pool"
            );
            return Step::Pool(Some(ticket));
        }
        // SAFETY: `lo + size <= arena_size`, the arena's length (the plan passed the
        // checker, and the request has the planned size), so the pointer stays inside it.
        let ptr = unsafe { NonNull::new_unchecked(ticket.arena.base.as_ptr().add(lo)) };
        self.stats.served += 1;
        Step::Ready(PlanBuffer {
            inner: Inner::Served {
                ptr,
                len: size,
                ticket,
            },
        })
    }

    fn pool_buffer(
        &mut self,
        result: Result<PinnedBuffer<R>, crate::actors::Error>,
        ticket: Option<Ticket<R>>,
    ) -> Result<PlanBuffer<R>, PlanSessionError> {
        // On failure the ticket drops here and gives its slot back.
        let buf = result?;
        self.stats.fallbacks += 1;
        Ok(PlanBuffer {
            inner: Inner::Pool {
                buf,
                _ticket: ticket,
            },
        })
    }

    /// Allocates `size` bytes: the next slot of the plan if the request matches it, else
    /// from the pool (after a warning, for the rest of the iteration).
    pub async fn alloc(&mut self, size: usize) -> Result<PlanBuffer<R>, PlanSessionError> {
        self.alloc_by(size, Waiter::Task).await
    }

    /// [`ArenaSession::alloc`] for threads outside the tokio runtime
    /// ([`crate::Error::WouldDeadlock`] where blocking would deadlock: see
    /// [blocking calls](crate#blocking-calls)).
    pub fn alloc_blocking(&mut self, size: usize) -> Result<PlanBuffer<R>, PlanSessionError> {
        let call = (
            "ArenaSession::alloc_blocking",
            "ArenaSession::alloc(..).await",
        );
        blocking::call(call, self.alloc_by(size, Waiter::Thread))?
    }

    async fn alloc_by(
        &mut self,
        size: usize,
        who: Waiter,
    ) -> Result<PlanBuffer<R>, PlanSessionError> {
        match self.step(size) {
            Step::Ready(buf) => Ok(buf),
            Step::Pool(ticket) => {
                let result = who.alloc(&self.pool, size).await;
                self.pool_buffer(result, ticket)
            }
        }
    }

    /// Whether no buffer but the session holds the arena (then every free was sent).
    fn exclusive(&mut self) -> bool {
        self.arena
            .as_mut()
            .map_or(true, |a| Arc::get_mut(a).is_some())
    }

    /// With every buffer of the iteration gone: whether the arena must be replaced (stream
    /// work on it may still run); if so, hands the old one back to the pool with the
    /// streams recorded on it.
    fn retire_arena(&mut self) -> bool {
        self.drain();
        self.poll_pending();
        if self.pending.is_empty() {
            return false;
        }
        if let Some(mut arena) = self.arena.take() {
            if let Some(exclusive) = Arc::get_mut(&mut arena) {
                for p in self.pending.drain(..) {
                    exclusive.record(p.streams, p.events);
                }
            }
            // The block goes back to the pool, reused only after the recorded events.
        }
        true
    }

    fn restarted(&mut self) {
        self.cursor.reset();
        self.mismatch = None;
        self.issued = 0;
        self.returned = 0;
        self.stats.resets += 1;
    }

    fn install(
        &mut self,
        swapped: bool,
        result: Option<Result<PinnedBuffer<R>, crate::actors::Error>>,
    ) -> Result<(), PlanSessionError> {
        if swapped {
            self.stats.arena_swaps += 1;
        }
        if let Some(result) = result {
            self.arena = Some(self.new_arena(result?));
        }
        self.restarted();
        Ok(())
    }

    /// Starts the next iteration. Waits until every buffer of this one is dropped; if
    /// stream work on freed arena bytes may still run, the arena goes back to the pool
    /// (ordered by events) and a new one is taken from it.
    pub async fn reset(&mut self) -> Result<(), PlanSessionError> {
        self.reset_by(Waiter::Task).await
    }

    /// [`ArenaSession::reset`] for threads outside the tokio runtime (blocks the thread;
    /// [`crate::Error::WouldDeadlock`] where that would deadlock).
    pub fn reset_blocking(&mut self) -> Result<(), PlanSessionError> {
        let call = (
            "ArenaSession::reset_blocking",
            "ArenaSession::reset().await",
        );
        blocking::call(call, self.reset_by(Waiter::Thread))?
    }

    /// The reset, with `who` waiting for the frees and for a new arena. A thread that drives
    /// it does so with the blocking adapter, which parks it while the frees'
    /// channel is empty; outside a runtime's worker, `yield_now` wakes it again at once.
    async fn reset_by(&mut self, who: Waiter) -> Result<(), PlanSessionError> {
        loop {
            self.drain();
            if self.exclusive() {
                break;
            }
            if self.live() > 0 {
                let rx = self.rx.clone();
                if let Ok(freed) = rx.recv_async().await {
                    self.on_freed(freed);
                }
            } else {
                // The last free was received; its sender is dropping its share of the arena.
                tokio::task::yield_now().await;
            }
        }
        let swapped = self.retire_arena();
        let result = if self.arena.is_none() {
            Some(who.alloc(&self.pool, self.arena_len()).await)
        } else {
            None
        };
        self.install(swapped, result)
    }

    /// Starts the next iteration if it can at once: [`PlanSessionError::Busy`] while
    /// buffers of this one are alive, [`PlanSessionError::StreamsPending`] while stream work
    /// on freed arena bytes may still run (or the session has no arena). Changes nothing
    /// when it fails.
    pub fn try_reset(&mut self) -> Result<(), PlanSessionError> {
        self.drain();
        if !self.exclusive() {
            return Err(PlanSessionError::Busy {
                live: self.live().max(1),
            });
        }
        self.poll_pending();
        if !self.pending.is_empty() || self.arena.is_none() {
            return Err(PlanSessionError::StreamsPending);
        }
        self.restarted();
        Ok(())
    }
}

impl<R: Runtime> Drop for ArenaSession<R> {
    fn drop(&mut self) {
        // Hand pending stream work to the arena: its last owner records it before the
        // block goes back to the pool.
        for p in self.pending.drain(..) {
            let _ = self.tx.send(Freed {
                number: usize::MAX,
                lo: p.lo,
                hi: p.hi,
                streams: p.streams,
                events: p.events,
            });
        }
    }
}

impl<R: Runtime> std::fmt::Debug for ArenaSession<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaSession")
            .field("arena_size", &self.plan.arena_size())
            .field("position", &self.position())
            .field("live", &self.live())
            .field("stats", &self.stats)
            .finish()
    }
}

impl<R: Runtime> PinnedAllocator<R> {
    fn new_arena_session(&self, plan: &ArenaPlan, claim: Claim) -> (ArenaSession<R>, usize) {
        let (tx, rx) = flume::unbounded();
        let session = ArenaSession {
            pool: self.clone(),
            plan: plan.clone(),
            cursor: plan.plan().cursor(),
            arena: None,
            tx,
            rx,
            pending: Vec::new(),
            issued: 0,
            returned: 0,
            mismatch: None,
            stats: ServeStats::default(),
            _claim: claim,
        };
        let len = session.arena_len();
        (session, len)
    }

    /// Serves iterations of `plan` from one arena taken from this allocator
    /// ([`ArenaSession`]). [`PlanSessionError::ForeignPlan`] if the plan is for another
    /// allocator, [`PlanSessionError::Nested`] while another plan session is under way.
    pub async fn serve_plan(&self, plan: &ArenaPlan) -> Result<ArenaSession<R>, PlanSessionError> {
        self.serve_plan_by(plan, Waiter::Task).await
    }

    /// [`PinnedAllocator::serve_plan`] for threads outside the tokio runtime
    /// ([`crate::Error::WouldDeadlock`] where blocking would deadlock).
    pub fn serve_plan_blocking(
        &self,
        plan: &ArenaPlan,
    ) -> Result<ArenaSession<R>, PlanSessionError> {
        let call = ("serve_plan_blocking", "serve_plan(..).await");
        blocking::call(call, self.serve_plan_by(plan, Waiter::Thread))?
    }

    async fn serve_plan_by(
        &self,
        plan: &ArenaPlan,
        who: Waiter,
    ) -> Result<ArenaSession<R>, PlanSessionError> {
        plan.check_owner(self)?;
        let claim = Claim::take(self.engine().id())?;
        let (mut session, len) = self.new_arena_session(plan, claim);
        let buf = who.alloc(self, len).await?;
        session.arena = Some(session.new_arena(buf));
        Ok(session)
    }
}
