//! A pool's home: the part of a pool that every handle, block and segment can reach.
//!
//! Owns the pool's identity, its runtime and memory source, its ready holder and parked
//! slots (the cached path: invariant 5), the senders to its actor and to the event poller,
//! its statistics, the flags that divert frees to the actor (closing, or requests waiting for
//! room), the registry channel of segments given back, and the channel of ready blocks that
//! threads split. It gives memory back to its source
//! and keeps the books as it does (stats, history, the budget: invariant 2).
//!
//! Generic over the block type `B`, which it only holds in its queues: what a block is and
//! where it goes when freed is `block`'s business, one layer up, so that neither names the
//! other in a circle. The pool actor (`pool`) owns the rest of a pool's state.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_queue::{ArrayQueue, SegQueue};
use flume::{Receiver, Sender};

use crate::books::budget::{Budget, EmptyReport, Member};
use crate::books::messages::{Note, PollerMsg, PoolMsg};
use crate::holders::parked::Parked;
use crate::holders::ready::ReadyHolder;
use crate::observation::history::Recorder;
use crate::statistics::counters::AtomicDuration;
use crate::statistics::peaks::{Group, Ledger};
use crate::statistics::stats::PoolStats;
use crate::vocab::error::Error;
use crate::vocab::mailbox::Mailbox;
use crate::vocab::memory::{units, MemorySource, RangeCall, Region};
use crate::vocab::policy::{BlockLayout, SizePolicy};
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::{Runtime, RuntimeError, StreamId};

/// `divert` bit: the pool is closing.
pub(crate) const DIVERT_CLOSING: u8 = 1;
/// `divert` bit: requests wait for room somewhere in the allocator.
pub(crate) const DIVERT_PRESSURE: u8 = 2;

/// How many block records a pool keeps for reuse.
const SHELLS: usize = 1024;

// Every call on a reserved range goes through `Home::range_call`, so that each is timed,
// booked and logged in one place.

impl RangeCall {
    /// The timer the call's duration goes to, if it is timed.
    fn timer(self, stats: &PoolStats) -> Option<&AtomicDuration> {
        match self {
            RangeCall::Map { .. } => Some(&stats.host_alloc_time),
            RangeCall::Unmap { .. } | RangeCall::UnmapUnused { .. } => Some(&stats.host_free_time),
            _ => None,
        }
    }

    /// Logs a failure of the call.
    fn log_failure(self, e: &RuntimeError) {
        match self {
            RangeCall::Map { .. } => {}
            RangeCall::Move { .. } => tracing::warn!(error = %e, "moving a granule failed"),
            RangeCall::Alias { .. } => {
                tracing::warn!(error = %e, "mapping memory at a second place failed")
            }
            RangeCall::Unalias { len, .. } => {
                tracing::error!(error = %e, bytes = len, "ending a moved mapping failed")
            }
            RangeCall::Unmap { len, .. } | RangeCall::UnmapUnused { len, .. } => {
                tracing::error!(error = %e, bytes = len, "unmapping memory failed")
            }
        }
    }
}

/// The part of a pool every handle and block can reach.
pub(crate) struct Home<R: Runtime, B> {
    pub(crate) id: PoolId,
    /// The stream that owns every block of a stream-ordered pool: a block freed with no
    /// other stream recorded is reusable by it at once (its work runs in order), so recording
    /// it needs no event. `None`: every recorded stream needs an event (host memory, which
    /// the CPU may write the moment a block is handed out, and capture pools).
    pub(crate) owner: Option<StreamId>,
    /// The owner stream itself, held while the pool lives (a stream's id may be reused once
    /// the stream is destroyed: see the router's `RouterMsg::StreamPool`), and for ordering
    /// another stream's work after its own when memory of this pool serves that stream (see
    /// `miss::borrow`).
    pub(crate) owner_stream: Option<R::Stream>,
    /// Whether a request of this stream's pool that finds no room borrows memory other
    /// streams' pools hold (`EngineBuilder::lend_between_streams`).
    pub(crate) lends: bool,
    pub(crate) runtime: Arc<R>,
    /// Where the pool's fresh memory comes from.
    pub(crate) memory: Arc<dyn MemorySource>,
    pub(crate) ready: ReadyHolder<B>,
    pub(crate) parked: Arc<Parked<B>>,
    pub(crate) mailbox: Mailbox<PoolMsg<B>>,
    pub(crate) poller: Arc<Mailbox<PollerMsg<B>>>,
    pub(crate) stats: PoolStats,
    /// Non-zero when frees must go to the actor, not the ready holder: the pool is closing
    /// ([`DIVERT_CLOSING`]), or requests wait for room ([`DIVERT_PRESSURE`]).
    pub(crate) divert: AtomicU8,
    /// The allocator's budget of reserved bytes, shared by all its pools.
    pub(crate) budget: Arc<Budget>,
    /// Requests queued in this pool.
    pub(crate) queued: AtomicUsize,
    /// A `Wake` is on its way to the actor.
    woken: AtomicBool,
    /// Addresses of segments freed, for the actor to strike from its registry.
    forgotten: (Sender<usize>, Receiver<usize>),
    pub(crate) history: Arc<Recorder>,
    /// Freed blocks larger than this go to the actor, not the ready holder.
    pub(crate) max_cached_size: usize,
    /// Freed carved blocks larger than this that do not fill their segment go to the actor,
    /// to be coalesced at once.
    pub(crate) absorb_above: usize,
    /// ... except pieces of the expandable range up to this size, which stay on the cached
    /// path (see `Carving::arena_cached_up_to`).
    pub(crate) arena_cached_up_to: usize,
    /// The size policy: the classes of split blocks.
    pub(crate) policy: Arc<dyn SizePolicy>,
    /// A thread that finds no ready block of its class may split a ready block of a larger
    /// class up to this many bytes (0: never; layouts that do not carve).
    pub(crate) split_up_to: usize,
    /// The largest class `split_up_to` bytes serve (`None`: none), the last class a split
    /// takes a block from.
    pub(crate) split_classes_upto: Option<usize>,
    /// A thread's split leaves a rest under `1 / keep_rest_under` of the block with the
    /// request (0: never; see `Carving::keep_rest_under`).
    pub(crate) keep_rest_under: usize,
    /// Splits made by threads, for the actor to book (see [`Note`]). A lock-free
    /// queue: a splitting thread and the booking actor never wait on one lock (a channel's
    /// lock, taken by both for every note, was a tenth of the mixed sizes loop).
    notes: SegQueue<Note>,
    /// Large pieces freed while nothing diverts frees to the actor (see
    /// `Home::large_piece`), for the actor to take back into their range at its next look
    /// (`PoolActor::book_notes`): such a free sends no message, so it wakes no actor.
    /// Lock-free, like `notes`; drained when the pool closes or its actor is gone.
    homing: SegQueue<Box<B>>,
    /// Block records the actor took back into its free ranges, for the next blocks cut or
    /// split to reuse instead of allocating (see `Home::recycle`). Emptied when the actor
    /// stops (each holds its pool). Lock-free, like `notes`: threads splitting blocks and
    /// the actor taking them back both use it.
    pub(crate) shells: ArrayQueue<Box<B>>,
}

/// What every pool of an engine is built from, whichever pool it is: the engine's settings
/// and the parts its pools share. A pool's home and its actor are both made from it.
pub(crate) struct PoolSettings<R: Runtime, B> {
    pub(crate) runtime: Arc<R>,
    pub(crate) memory: Arc<dyn MemorySource>,
    /// Whether stream pools lend each other memory (see [`Home::lends`]).
    pub(crate) lends: bool,
    /// How long a pool's actor stays awake after a message for the next one.
    pub(crate) linger: Duration,
    pub(crate) classes: usize,
    pub(crate) shards: usize,
    pub(crate) poller: Arc<Mailbox<PollerMsg<B>>>,
    /// Where the pools' actors run.
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) budget: Arc<Budget>,
    pub(crate) history: Arc<Recorder>,
    pub(crate) layout: BlockLayout,
    pub(crate) policy: Arc<dyn SizePolicy>,
    /// Keep device statistics, blocks above this many bytes counting as oversize.
    pub(crate) device_stats: Option<usize>,
    /// The engine's ledger of peaks.
    pub(crate) ledger: Arc<Ledger>,
}

impl<R: Runtime, B: Send + 'static> Home<R, B> {
    /// The home of pool `id` (owned by the stream `owner`, kept alive as `owner_stream`, for
    /// a stream's pool), registered with its budget, and the receiving end of its actor's
    /// mailbox.
    pub(crate) fn new(
        settings: &PoolSettings<R, B>,
        id: PoolId,
        owner: Option<(StreamId, R::Stream)>,
    ) -> (Arc<Self>, Receiver<PoolMsg<B>>)
    where
        B: crate::holders::parked::Parkable,
    {
        let s = settings;
        let (tx, rx) = flume::unbounded();
        let carving = match s.layout {
            BlockLayout::Whole => None,
            BlockLayout::Carved(c) => Some(c),
        };
        let split_up_to = carving.map_or(0, |c| c.thread_split_limit());
        let group = if id.is_default() {
            s.ledger.default_group().clone()
        } else {
            Arc::new(Group::new())
        };
        let (owner, owner_stream) = owner.unzip();
        let home = Arc::new(Home {
            id,
            owner,
            owner_stream,
            lends: s.lends,
            runtime: s.runtime.clone(),
            memory: s.memory.clone(),
            ready: ReadyHolder::new(s.classes, s.shards),
            parked: Parked::new(s.shards),
            mailbox: Mailbox::new(tx),
            poller: s.poller.clone(),
            stats: PoolStats::new(s.shards, s.device_stats, s.ledger.clone(), group),
            divert: AtomicU8::new(0),
            budget: s.budget.clone(),
            queued: AtomicUsize::new(0),
            woken: AtomicBool::new(false),
            forgotten: flume::unbounded(),
            history: s.history.clone(),
            max_cached_size: carving.map_or(usize::MAX, |c| c.max_cached_size),
            absorb_above: carving.map_or(usize::MAX, |c| c.small_limit),
            arena_cached_up_to: match carving {
                Some(c) if c.expandable => c.arena_cached_up_to.min(c.thread_split_limit()),
                _ => 0,
            },
            split_up_to,
            split_classes_upto: s.policy.class_served_by(split_up_to),
            keep_rest_under: carving.map_or(0, |c| c.keep_rest_under),
            notes: SegQueue::new(),
            homing: SegQueue::new(),
            shells: ArrayQueue::new(SHELLS),
            policy: s.policy.clone(),
        });
        home.budget.register(&home);
        (home, rx)
    }
}

/// How many notes of splits a thread sends before it asks the actor to book them.
const NOTE_BATCH: usize = 64;

thread_local! {
    /// Notes this thread sent, to any pool (a count of its own: a shared one would be a
    /// line every splitting thread writes).
    static NOTES_SENT: Cell<usize> = const { Cell::new(0) };
}

impl<R: Runtime, B> Home<R, B> {
    /// Gives a region from `alloc` back to the memory source on this thread and keeps the
    /// books (stats, history, the budget, and the registry of segments).
    pub(crate) fn free_memory_now(&self, memory: Region) -> Result<(), RuntimeError> {
        let t0 = Instant::now();
        let res = self.memory.free(memory);
        self.stats.host_free_time.record(t0.elapsed());
        match res {
            Ok(()) => {
                self.history.on_segment_free(self.id, self.owner, &memory);
                self.stats.segment(memory.size, false);
                self.stats.allocations.decrease(1);
                self.stats.allocated_bytes.decrease(memory.size as i64);
                // The actor awaits its frees before it takes fresh memory, so the address is
                // struck before the source can hand it back to this pool.
                let _ = self.forgotten.0.send(memory.addr());
                self.budget.release(memory.size);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, bytes = memory.size, "freeing memory failed");
                Err(e)
            }
        }
    }

    /// Makes `call` on the reserved `range` on this thread (see [`RangeCall`]) and keeps
    /// its books. The one shape of every call on a reserved range: the source call, timed
    /// where it takes or gives back memory, then the books of a success, or the failure
    /// logged.
    pub(crate) fn range_call(&self, range: &Region, call: RangeCall) -> Result<(), RuntimeError> {
        let m = &*self.memory;
        let t0 = call.timer(&self.stats).map(|timer| (timer, Instant::now()));
        let res = m.range_call(range, call);
        if let Some((timer, t0)) = t0 {
            timer.record(t0.elapsed());
        }
        match &res {
            Ok(()) => self.book_range_call(range, call),
            Err(e) => call.log_failure(e),
        }
        res
    }

    /// The books of a `call` on `range` that succeeded (see [`RangeCall`] for each).
    fn book_range_call(&self, range: &Region, call: RangeCall) {
        let (id, owner) = (self.id, self.owner);
        match call {
            RangeCall::Map { offset, len, unit } => {
                for (at, part) in units(offset, len, unit) {
                    self.history
                        .on_segment_map(id, owner, &range.part(at, part));
                    self.stats.segment(part, true);
                }
                self.stats.allocated_bytes.increase(len as i64);
            }
            RangeCall::Move { from, to, len } => {
                self.history
                    .on_segment_unmap(id, owner, &range.part(from, len));
                self.history.on_segment_map(id, owner, &range.part(to, len));
                self.stats.remaps.fetch_add(1, Ordering::Relaxed);
            }
            RangeCall::Alias { to, len, .. } => {
                self.history.on_segment_map(id, owner, &range.part(to, len));
                self.stats.remaps.fetch_add(1, Ordering::Relaxed);
            }
            RangeCall::Unalias { at, len, .. } => {
                self.history
                    .on_segment_unmap(id, owner, &range.part(at, len));
            }
            RangeCall::Unmap { at, len } | RangeCall::UnmapUnused { at, len } => {
                self.history
                    .on_segment_unmap(id, owner, &range.part(at, len));
                self.stats.allocated_bytes.decrease(len as i64);
                self.stats.segment(len, false);
                self.budget.release(len);
            }
        }
    }

    /// Reports an out-of-memory failure of a request of this pool (see `Recorder::on_oom`);
    /// returns `err`.
    pub(crate) fn oom(&self, err: Error) -> Error {
        self.history.on_oom(self.id, err, || {
            let allocated = self.stats.active_bytes_now().max(0) as usize;
            (self.memory.kind(), allocated, self.memory.free_bytes())
        })
    }

    /// Tells the actor that a thread split a ready block (before any part can come
    /// back).
    pub(crate) fn note(&self, note: Note) {
        self.notes.push(note);
        let sent = NOTES_SENT.with(|n| {
            let sent = n.get().wrapping_add(1);
            n.set(sent);
            sent
        });
        if sent % NOTE_BATCH == 0 {
            let _ = self.mailbox.send(PoolMsg::Books);
        }
    }

    /// The splits made since the last look (for the actor's books).
    pub(crate) fn notes(&self) -> impl Iterator<Item = Note> + '_ {
        // Those queued now: a thread that keeps splitting does not keep the actor booking.
        let queued = self.notes.len();
        std::iter::from_fn(|| self.notes.pop()).take(queued)
    }

    /// Sends a freed large piece home without a message (see `homing`).
    pub(crate) fn home_quietly(&self, block: Box<B>) {
        self.homing.push(block);
    }

    /// The large pieces sent home quietly since the last look.
    pub(crate) fn homed(&self) -> impl Iterator<Item = Box<B>> + '_ {
        let queued = self.homing.len();
        std::iter::from_fn(|| self.homing.pop()).take(queued)
    }

    /// The addresses of segments given back since the last look (for the actor's registry).
    pub(crate) fn forgotten(&self) -> flume::TryIter<'_, usize> {
        self.forgotten.1.try_iter()
    }

    /// The actor took the `Wake` on its way.
    pub(crate) fn woke(&self) {
        self.woken.store(false, Ordering::SeqCst);
    }

    /// Asks the actor to look at its queued requests again (once per look).
    pub(crate) fn nudge(&self) {
        if self.queued.load(Ordering::SeqCst) > 0 {
            self.wake();
        }
    }

    /// Sends the actor a `Wake` unless one is on its way.
    fn wake(&self) {
        if !self.woken.swap(true, Ordering::SeqCst) {
            let _ = self.mailbox.send(PoolMsg::Wake);
        }
    }
}

impl<R: Runtime, B: Send + 'static> Member for Home<R, B> {
    fn set_pressure(&self, on: bool) {
        if on {
            let before = self.divert.fetch_or(DIVERT_PRESSURE, Ordering::SeqCst);
            // An actor parked without requests of its own would not look at the memory it
            // caches (large pieces that went home quietly before the flag was set among it)
            // until its next message: it is woken once, to watch the pressure.
            if before & DIVERT_PRESSURE == 0 {
                self.wake();
            }
        } else {
            self.divert.fetch_and(!DIVERT_PRESSURE, Ordering::SeqCst);
        }
    }

    fn nudge(&self) {
        Home::nudge(self);
    }

    fn ask_to_empty(&self, upto: usize) -> Option<Receiver<EmptyReport>> {
        let (tx, rx) = flume::bounded(1);
        let msg = PoolMsg::EmptyCache {
            include_kept: false,
            forget: false,
            upto,
            reply: tx,
        };
        self.mailbox.send(msg).is_ok().then_some(rx)
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}
