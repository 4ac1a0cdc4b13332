//! The pool actor: one per pool (the default pool, each stream's pool, each private capture
//! pool). It owns the pool's books and every block of the pool that is not lent out, queued
//! as ready, or waiting on events (the part of the pool that others reach is its [`Home`]):
//! it answers misses (first noticing blocks whose events have completed — invariant 3 —
//! then taking fresh memory on a blocking thread — invariant 6), keeps blocks used by
//! captured work (invariant 4), empties the cache, retires a stream's pool that holds
//! nothing, and on shutdown gives every block back to the runtime as it comes home
//! (invariant 2). Under a memory limit it queues the requests that wait for room, first
//! come first served (see [`crate::books::budget`] and `crate::requests::miss`), and serves
//! them as blocks come back or room is made. Under a layout that carves blocks out of
//! shared segments ([`BlockLayout::Carved`]) it owns their free ranges (see `segments`).
//!
//! This file holds the actor's state and its loop. What it does: `miss` (a miss answered, in
//! one file), `homecoming` (blocks coming home), `queue` (requests queued for room),
//! `fresh` (fresh memory), `cache` (freeing and emptying), `segments` and `arena` (the
//! carved layout's books), `restore`, `retire` and `books`.

mod arena;
mod books;
mod cache;
mod fresh;
mod homecoming;
mod miss;
mod restore;
mod retire;
mod segments;
mod spin;
mod queue;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use flume::Receiver;

use crate::blocks::block::{Block, BlockState, Home, Seg};
use crate::books::errand::{spawn_or_run, Errand};
use crate::books::home::{PoolSettings, DIVERT_CLOSING};
use crate::books::messages::{MissTx, PoolMsg, SegmentView};
use crate::vocab::error::Error;
use crate::vocab::memory::{MemoryKind, RangeCall};
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::{Runtime, StreamId};
use crate::vocab::spawn::spawn_on_own_thread;

/// Starts the actor of pool `id` (a stream's pool where `owner` names the stream) and returns
/// the pool's home.
pub(crate) fn start_pool<R: Runtime>(
    settings: &PoolSettings<R, Block<R>>,
    id: PoolId,
    owner: Option<(StreamId, R::Stream)>,
) -> Arc<Home<R>> {
    let (shared, rx) = Home::new(settings, id, owner);
    let actor = PoolActor {
        shared: shared.clone(),
        rx,
        kept: Vec::new(),
        closing: false,
        finished: false,
        queue: VecDeque::new(),
        segments: BTreeMap::new(),
        carved: segments::Segments::for_layout(settings.layout),
        refused: Vec::new(),
        deferred: VecDeque::new(),
        errand_runner: None,
        spin: spin::Spin::new(settings.linger),
        answered: None,
        trim_due: false,
        relieved: false,
    };
    let pool = if id.is_default() {
        "default".to_string()
    } else {
        id.to_string()
    };
    let name = match (settings.memory.kind(), shared.owner) {
        (MemoryKind::Pinned, None) => format!("pinpool::pool({pool})"),
        (MemoryKind::Pinned, Some(s)) => format!("pinpool::pool({pool}, stream {:#x})", s.0),
        (MemoryKind::Device(d), None) => format!("pinpool::device_pool({d}, {pool})"),
        (MemoryKind::Device(d), Some(s)) => {
            format!("pinpool::device_pool({d}, {pool}, stream {:#x})", s.0)
        }
    };
    spawn_on_own_thread(&name, &settings.handle, actor.run());
    shared
}

pub(crate) struct PoolActor<R: Runtime> {
    shared: Arc<Home<R>>,
    rx: Receiver<PoolMsg<Block<R>>>,
    kept: Vec<Box<Block<R>>>,
    closing: bool,
    /// Set when the loop ended on its own; unset when the task is dropped by its runtime.
    finished: bool,
    /// Requests waiting for room, oldest first.
    queue: VecDeque<queue::Queued<R>>,
    /// Every segment the pool holds, by address.
    segments: BTreeMap<usize, SegmentView>,
    /// Free ranges of the pool's segments, when the layout carves blocks out of them.
    carved: Option<segments::Segments<R>>,
    /// Carved segments whose free the runtime refused: never reused, tried again with the
    /// kept blocks (counted as kept).
    refused: Vec<Arc<Seg<R>>>,
    /// Messages that came while a restore waited, answered next, in order.
    deferred: VecDeque<PoolMsg<Block<R>>>,
    /// The reply channel of the miss being served, when its requester runs errands.
    errand_runner: Option<MissTx<Block<R>>>,
    /// How long it keeps polling its mailbox after an answer (see [`Self::linger`]).
    spin: spin::Spin,
    /// When it last answered a request (see [`answers_a_request`]).
    answered: Option<std::time::Instant>,
    /// Reserved memory crossed the reserve cap during a burst: once no message came for
    /// [`TRIM_AFTER`], idle memory above the cap goes back (see [`Self::trim`]).
    trim_due: bool,
    /// The free memory of its segments was given back in this spell of pressure (see
    /// [`Self::relieve`]).
    relieved: bool,
}

impl<R: Runtime> Drop for PoolActor<R> {
    fn drop(&mut self) {
        self.shared.drop_shells();
        if self.finished {
            return;
        }
        // The task was dropped with its tokio runtime: from now on frees cannot reach the
        // actor (the mailbox refuses them), so they free on the spot; what is cached now, and
        // what was sent before the mailbox closed, is freed here.
        self.shared
            .divert
            .fetch_or(DIVERT_CLOSING, Ordering::SeqCst);
        for b in self.take_homeless() {
            if let Err(mut b) = self.shared.free_block_now(b) {
                b.freed = true;
            }
        }
        for s in self.refused.drain(..) {
            s.leak();
        }
        self.end_moves_now();
        self.leak_kept();
    }
}

/// The teardown of a pool actor dropped with its tokio runtime.
impl<R: Runtime> PoolActor<R> {
    /// Every block of the pool that can be freed now: the ready ones, those sent home or
    /// still in the mailbox (which is closed), and parked ones whose events completed.
    /// Blocks that work may still use (kept, waiting, or a restore's blocks used by
    /// streams) go to `kept` instead.
    fn take_homeless(&mut self) -> Vec<Box<Block<R>>> {
        // Blocks already in the mailbox would keep the pool (and the mailbox) alive forever.
        let mut homeless = self.shared.ready.drain();
        homeless.extend(self.shared.homed());
        let deferred: Vec<_> = self.deferred.drain(..).collect();
        for msg in deferred
            .into_iter()
            .chain(self.shared.mailbox.close(&self.rx))
        {
            match msg {
                PoolMsg::Home(b) | PoolMsg::Keep(b) => match b.state {
                    BlockState::Kept | BlockState::Waiting => self.kept.push(b),
                    _ => homeless.push(b),
                },
                // A restore's blocks to free: their streams' work may still use them, and
                // no event can be waited for any more.
                PoolMsg::Restore { free, .. } => {
                    for (b, _) in free {
                        if b.streams.is_empty() {
                            homeless.push(b);
                        } else {
                            self.kept.push(b);
                        }
                    }
                }
                _ => {} // replies dropped: their callers get `Error::Shutdown`
            }
        }
        // So would parked blocks, should the poller that watches them be gone too: those
        // whose events have completed are freed, the others kept (leaked below).
        for mut b in self.shared.parked.take_all() {
            if b.events_completed() {
                b.leave_waiting();
                homeless.push(b);
            } else {
                self.kept.push(b);
            }
        }
        homeless
    }

    /// Moves not ended: their old places are unmapped here, after the device's work.
    fn end_moves_now(&mut self) {
        if let Some(a) = self.carved.as_mut().and_then(|s| s.arena.as_mut()) {
            let rt = self.shared.runtime.clone();
            for (places, e) in a.take_left(|_| true) {
                rt.release_event(e);
                for p in places {
                    let _ = self.shared.range_call(
                        &a.segment.memory,
                        RangeCall::Unalias {
                            at: p.offset,
                            len: p.len,
                            wait: true,
                        },
                    );
                    a.release_left(p);
                }
            }
        }
    }

    /// Leaks the kept blocks and their segments: kept for graph replays (or refused by the
    /// runtime), they are never safe to reuse, and nobody is left to say when it is safe to
    /// free them.
    fn leak_kept(&mut self) {
        for mut b in self.kept.drain(..) {
            if let Some(s) = &b.segment {
                s.leak();
            }
            tracing::warn!(
                bytes = b.memory.size,
                "pool torn down with its runtime; kept block leaked"
            );
            b.freed = true;
        }
    }
}

/// How often a closing pool looks for blocks that slipped into its ready holder (doubling
/// up to the maximum while buffers stay out).
const CLOSING_SWEEP: Duration = Duration::from_millis(5);
const MAX_CLOSING_SWEEP: Duration = Duration::from_secs(1);
/// How often a pool looks at its queued requests and ready holder while requests wait for room
/// (a free that raced with the raising of the pressure flag lands in a ready holder).
const PRESSURE_SWEEP: Duration = Duration::from_millis(2);
/// How long a pool stays awake for the result of a call its requester runs (see
/// `PoolActor::off_executor`): a map call takes 0.04–0.5 ms.
const HOT_WAIT: Duration = Duration::from_millis(1);
/// The longest a pool keeps polling after an answer for the next request unless its engine
/// says otherwise (see `PoolActor::linger`): requests 100 µs apart (a model's host thread
/// between two of its large tensors) find it awake; requests further apart wake it.
pub const DEFAULT_LINGER: Duration = Duration::from_micros(200);
/// How long a pool waits with no message before it gives back memory above its reserve cap:
/// a burst of requests (a model's step, a batch of a server) maps what it needs and nothing
/// goes back while it runs, so that a repeated burst finds its memory mapped; a pause this
/// long ends the burst.
const TRIM_AFTER: Duration = Duration::from_millis(20);

/// Whether `msg` is a request whose thread waits for the answer (a miss, or another pool's
/// ask to lend), after which the actor lingers for the next one (see `PoolActor::linger`).
/// Bookkeeping (the threads' notes of splits and merges, blocks coming home, wake-ups) comes
/// in a steady trickle with nobody waiting for it: staying awake after each such message
/// keeps a worker busy for nothing while the threads that sent it run on.
fn answers_a_request<B>(msg: &PoolMsg<B>) -> bool {
    matches!(msg, PoolMsg::Miss { .. } | PoolMsg::Lend { .. })
}

/// Work handed off the executor by [`PoolActor::start_off_executor`], and its result to come.
pub(super) struct OffExecutor<T> {
    rx: flume::Receiver<T>,
    /// Whether the requester of the miss being served runs it.
    lent: bool,
}

impl<T> OffExecutor<T> {
    /// The work's result; `Err` when the work panicked or its runtime went down before
    /// running it.
    pub(super) async fn result(self) -> Result<T, flume::RecvError> {
        let rx = self.rx;
        if self.lent {
            // The requester runs the work now and waits for the answer that follows: stay
            // awake for a short call (yielding, so that the worker's other tasks run), so
            // that its result needs no wake-up of this worker.
            let t0 = std::time::Instant::now();
            while t0.elapsed() < HOT_WAIT {
                match rx.try_recv() {
                    Ok(v) => return Ok(v),
                    Err(flume::TryRecvError::Disconnected) => {
                        return Err(flume::RecvError::Disconnected)
                    }
                    Err(flume::TryRecvError::Empty) => tokio::task::yield_now().await,
                }
            }
        }
        rx.recv_async().await
    }
}

impl<R: Runtime> PoolActor<R> {
    /// Runs `work` (calls into the memory source) off the executor (invariant 6): on the
    /// thread of the miss being served when that thread runs errands (see
    /// [`crate::books::errand`]), on a blocking thread of the runtime otherwise — or here,
    /// should the runtime be shutting down and refuse it (a free dropped unrun would send its
    /// blocks back to this actor, which would try again for ever). Whether it went to the
    /// requester.
    pub(super) fn hand_off(&self, work: impl FnOnce() + Send + 'static) -> bool {
        let handle = tokio::runtime::Handle::current();
        match &self.errand_runner {
            Some(runner) => runner.send_errand(Errand::new(Box::new(work), handle)),
            None => spawn_or_run(&handle, work),
        }
        self.errand_runner.is_some()
    }

    /// [`Self::hand_off`] and await the work's result; `Err` when the work panicked or its
    /// runtime went down before running it.
    pub(super) async fn off_executor<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, flume::RecvError> {
        self.start_off_executor(work).result().await
    }

    /// [`Self::off_executor`] in two steps: the work is handed off now, and the actor may
    /// do its own share of the job while it runs before it awaits the result.
    pub(super) fn start_off_executor<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> OffExecutor<T> {
        let (tx, rx) = flume::bounded(1);
        let lent = self.hand_off(move || {
            let _ = tx.send(work());
        });
        OffExecutor { rx, lent }
    }

    async fn run(mut self) {
        let mut sweep = CLOSING_SWEEP;
        loop {
            if let Some(msg) = self.deferred.pop_front() {
                self.handle(msg).await;
                continue;
            }
            if self.closing {
                if self.shared.stats.allocations.read().current <= 0 {
                    break;
                }
                match tokio::time::timeout(sweep, self.rx.recv_async()).await {
                    Ok(Ok(msg)) => self.handle(msg).await,
                    Ok(Err(_)) => break,
                    Err(_) => {
                        // Blocks that slipped into the ready holder as the pool closed, and
                        // blocks whose free the runtime refused, are tried again; blocks
                        // parked by freeing threads go to the poller.
                        self.book_notes();
                        self.shared.parked.unpark_all();
                        let blocks = self.shared.ready.drain();
                        self.free_blocks(blocks).await;
                        self.free_kept().await;
                        sweep = (sweep * 2).min(MAX_CLOSING_SWEEP);
                    }
                }
            } else if self.shared.budget.under_pressure() || !self.queue.is_empty() {
                let sweep = tokio::time::Instant::now() + PRESSURE_SWEEP;
                match tokio::time::timeout_at(sweep, self.rx.recv_async()).await {
                    Ok(Ok(msg)) => {
                        self.handle(msg).await;
                        if tokio::time::Instant::now() >= sweep {
                            self.relieve().await;
                        }
                    }
                    Ok(Err(_)) => break,
                    Err(_) => self.relieve().await,
                }
            } else {
                self.relieved = false;
                let next = if self.trim_due {
                    match tokio::time::timeout(TRIM_AFTER, self.rx.recv_async()).await {
                        Ok(next) => next,
                        Err(_) => {
                            self.trim().await;
                            continue;
                        }
                    }
                } else {
                    self.rx.recv_async().await
                };
                match next {
                    Ok(msg) => {
                        let asked = self.take_request(msg).await;
                        if asked && !self.linger().await {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
        }
        self.drop_queue();
        self.shared.drop_shells();
        self.finished = true;
        tracing::debug!(pool = %self.shared.id, "pool actor stopped");
    }

    /// Handles a message; for a request (see [`answers_a_request`]), also notes the gap
    /// since the last answer and when this one was answered. Whether it was a request.
    async fn take_request(&mut self, msg: PoolMsg<Block<R>>) -> bool {
        let asked = answers_a_request(&msg);
        // From when a miss was sent: a wake-up of a parked actor is not a gap between
        // requests (counted, it would keep the window shut once it had shut). A miss asked
        // again (its thread's blocks sent home, or room made) is the same request.
        let gap = match &msg {
            PoolMsg::Miss { ask, .. } if ask.holds && !ask.emptied => self
                .answered
                .map(|at| ask.sent.saturating_duration_since(at)),
            PoolMsg::Miss { .. } => None,
            _ => self.answered.map(|at| at.elapsed()),
        };
        if let (true, Some(gap)) = (asked, gap) {
            self.spin.gap(gap);
        }
        self.handle(msg).await;
        if asked {
            self.answered = Some(std::time::Instant::now());
        }
        asked
    }

    /// Keeps polling the mailbox after a request it answered, without yielding to its
    /// executor or making a system call, for as long as requests have lately come that
    /// fast (see [`spin::Spin`]): a request in a burst then needs no wake-up of the actor.
    /// Every message is handled as it comes. Gives up at once when the pool closes or has
    /// queued requests or pressure to watch (the main loop's other arms do). False when the mailbox
    /// is closed.
    async fn linger(&mut self) -> bool {
        loop {
            let window = self.spin.window();
            let since = self.answered.map_or(Duration::MAX, |at| at.elapsed());
            if since >= window
                || self.closing
                || self.shared.budget.under_pressure()
                || !self.queue.is_empty()
                || !self.deferred.is_empty()
            {
                return true;
            }
            match self.rx.try_recv() {
                Ok(msg) => {
                    self.take_request(msg).await;
                }
                Err(flume::TryRecvError::Empty) => std::hint::spin_loop(),
                Err(flume::TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// Between bursts: gives back idle memory of the arena above the reserve cap, least
    /// recently used first, but only memory no block used since the trim before (see
    /// [`TRIM_AFTER`]): a repeated burst uses its memory each time, and keeps it, while
    /// memory only an earlier burst needed goes. Not while a capture is underway: giving
    /// memory back waits for the device's work, which a capture forbids; it is tried again
    /// after the next pause.
    async fn trim(&mut self) {
        if self.shared.budget.capturing() {
            return;
        }
        let Some(segs) = self.carved.as_mut() else {
            self.trim_due = false;
            return;
        };
        let (Some(cap), Some(clock)) = (
            segs.carving.reserve_cap(segs.peak_live),
            segs.arena.as_ref().map(|a| a.clock()),
        ) else {
            self.trim_due = false;
            return;
        };
        let before = std::mem::replace(&mut segs.trimmed_at, clock);
        let reserved = self.shared.stats.allocated_bytes.read().current.max(0) as usize;
        let over = reserved.saturating_sub(cap);
        if over > 0 {
            self.unmap_idle_before(over, before).await;
        }
        // Memory used since this trim may go at the next one.
        let reserved = self.shared.stats.allocated_bytes.read().current.max(0) as usize;
        self.trim_due = reserved > cap;
    }

    async fn handle(&mut self, msg: PoolMsg<Block<R>>) {
        self.book_notes();
        self.dispatch(msg).await;
        if let Some(c) = &self.carved {
            self.shared.stats.set_free_ranges(c.free_ranges());
        }
    }

    async fn dispatch(&mut self, msg: PoolMsg<Block<R>>) {
        match msg {
            PoolMsg::Miss { class, ask, reply } => self.on_miss(class, ask, reply).await,
            PoolMsg::Keep(block) => {
                // Counted as kept by the thread that freed it.
                self.kept.push(block);
                if self.closing {
                    self.free_kept().await;
                }
            }
            PoolMsg::Home(block) => self.take_back(block).await,
            PoolMsg::EmptyCache {
                include_kept,
                forget,
                upto,
                reply,
            } => {
                let report = self.empty_cache(include_kept, forget, upto).await;
                let _ = reply.send(report);
            }
            PoolMsg::Inventory { reply } => {
                let _ = reply.send(self.inventory());
            }
            PoolMsg::Describe { reply } => {
                let _ = reply.send(self.describe());
            }
            PoolMsg::Restore {
                want,
                free,
                target,
                reply,
            } => {
                if reply.is_disconnected() || self.closing {
                    // Nobody waits for it (or the pool is going): the caller's blocks are
                    // freed as their leases would be (events on the streams that used them).
                    restore::free_as_leases(free);
                    let _ = reply.send(Err((Error::Shutdown, Vec::new())));
                    return;
                }
                let res = Box::pin(self.restore(want, free, target)).await;
                match reply.send(res) {
                    Ok(()) => {}
                    // The caller stopped waiting: what it would have got is freed the way its
                    // leases would have been.
                    Err(flume::SendError(Ok(lent))) => restore::drop_as_leases(lent),
                    Err(flume::SendError(Err((_, free)))) => restore::free_as_leases(free),
                }
            }
            // `handle` booked the notes before dispatching.
            PoolMsg::Books => {}
            PoolMsg::Lend { class, reply } => self.on_lend(class, reply).await,
            PoolMsg::Wake => {
                self.shared.woke();
                self.serve_queue().await;
            }
            PoolMsg::Retire { reply } => {
                let _ = reply.send(self.retire().await);
            }
            PoolMsg::Close => {
                self.closing = true;
                self.shared
                    .divert
                    .fetch_or(DIVERT_CLOSING, Ordering::Release);
                self.drop_queue();
                self.empty_cache(true, true, usize::MAX).await;
            }
        }
    }
}
