//! Ready blocks of a pool, and the blocks its threads have freed with events still pending.
//!
//! The cached path lives here (invariant 5). Each thread shard has, per size class, one
//! *slot*: an atomic pointer that holds at most one ready block. A free puts the block into
//! the freeing thread's slot for its class (one compare-and-swap on a cache line only that
//! thread writes); a request takes it back with one swap. A slot already full overflows into
//! the shard's flume queue for the class, and an empty slot and queue make the request look in
//! the other shards' slots and queues before it asks the pool actor. Slots are shared memory,
//! not thread-locals: the pool actor drains them when it empties the cache or shuts down,
//! and a thread that exits leaves nothing behind. Each shard marks the classes whose queue
//! may hold a block, so that a drain (at a best-fit miss, say) or a steal looks only at
//! those queues, not at every class of every shard.
//!
//! Each shard also has a few *parked* slots for the record path: a block freed after a
//! stream used it waits there, its events recorded, instead of being sent to the event
//! poller (a message and a task wake-up per free). On the next miss of that class, the same
//! thread queries the block's events inline (one `query_event`) and reuses it when they have
//! completed (invariant 1). A park that finds every parked slot full sends the displaced
//! occupant to the poller. The poller watches a pool's parked slots while any block is
//! parked (the first park after a quiet spell tells it to), and on each of its polls sends
//! home the parked blocks whose events have completed, so blocks come back without any
//! request. The pool actor hands all parked blocks to the poller before it flushes events
//! (so a miss never takes fresh memory while a completed block of its class sits parked:
//! invariant 3), and parked blocks are counted as waiting blocks throughout (invariant 2).

use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;

use flume::{Receiver, Sender};

use crate::block::Block;
use crate::poller::PollerMsg;
use crate::runtime::Runtime;
use crate::shard::{CachePadded, ThreadSlot};

struct Queue<R: Runtime> {
    tx: Sender<Box<Block<R>>>,
    rx: Receiver<Box<Block<R>>>,
}

/// Slots on cache lines of their own (16 pointers: 128 bytes).
const SLOTS_PER_LINE: usize = 16;
type SlotLine<R> = CachePadded<[AtomicPtr<Block<R>>; SLOTS_PER_LINE]>;

/// Parked (event-pending) blocks a shard holds before it sends the oldest to the poller.
pub(crate) const PARKED: usize = 4;

/// One shard's overflow queues.
struct Shard<R: Runtime> {
    queues: Box<[Queue<R>]>,
    /// One bit per class whose queue may hold a block: set after every send, cleared by a
    /// drain before it empties the queue. A queue that holds a block always has its bit set
    /// once the send returns (a bit may be set over an empty queue), so a drain or a steal
    /// looks only at queues whose bit is set instead of at every class of every shard.
    queued: Box<[AtomicU64]>,
}

impl<R: Runtime> Shard<R> {
    /// Whether the queue of `class` may hold a block.
    #[inline]
    fn may_hold(&self, class: usize) -> bool {
        self.queued[class / 64].load(Ordering::Acquire) & (1 << (class % 64)) != 0
    }

    /// The queue of `class` (of this shard) holds a block.
    fn mark(&self, class: usize) {
        self.queued[class / 64].fetch_or(1 << (class % 64), Ordering::Release);
    }

    /// Takes every block out of the queues whose bit is set, clearing the bits first.
    fn drain_into(&self, out: &mut Vec<Box<Block<R>>>) {
        for (w, word) in self.queued.iter().enumerate() {
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = word.swap(0, Ordering::Acquire);
            while bits != 0 {
                let class = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                out.extend(self.queues[class].rx.try_iter());
            }
        }
    }
}

type ParkedLine<R> = CachePadded<[AtomicPtr<Block<R>>; PARKED]>;

/// A pool's parked slots, one line per shard; shared with the poller while it watches them.
pub(crate) struct Parked<R: Runtime> {
    shards: Box<[ParkedLine<R>]>,
    /// Whether the poller has (or is being sent) this pool's parked slots to watch.
    watched: AtomicBool,
}

impl<R: Runtime> Parked<R> {
    /// Goes over every parked block once: those whose events have completed go home (they
    /// are reusable), the others go back to their slot. Returns (blocks seen, sent home).
    pub(crate) fn sweep(&self, poller_pending: &mut Vec<Box<Block<R>>>) -> (usize, usize) {
        let (mut seen, mut home) = (0, 0);
        for line in self.shards.iter() {
            for s in line.iter() {
                let Some(mut b) = take_slot(s) else { continue };
                seen += 1;
                if b.events_completed() {
                    b.returned_from_waiting();
                    home += 1;
                } else {
                    let p = Box::into_raw(b);
                    if s.compare_exchange(ptr::null_mut(), p, Ordering::SeqCst, Ordering::Relaxed)
                        .is_err()
                    {
                        // SAFETY: not published; still ours.
                        poller_pending.push(unsafe { Box::from_raw(p) });
                    }
                }
            }
        }
        (seen, home)
    }

    /// Takes every parked block out of the slots.
    pub(crate) fn take_all(&self) -> Vec<Box<Block<R>>> {
        self.shards
            .iter()
            .flat_map(|l| l.iter().filter_map(take_slot))
            .collect()
    }

    /// Stops being watched unless a block is parked; returns whether it still is watched.
    /// A park racing with this either sees `watched` false (and asks to be watched again) or
    /// is seen here (both sides use sequentially consistent operations).
    pub(crate) fn unwatch_if_empty(&self) -> bool {
        self.watched.store(false, Ordering::SeqCst);
        let any = self
            .shards
            .iter()
            .any(|l| l.iter().any(|s| !s.load(Ordering::SeqCst).is_null()));
        any && self
            .watched
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }
}

impl<R: Runtime> Drop for Parked<R> {
    fn drop(&mut self) {
        for line in self.shards.iter() {
            for s in line.iter() {
                drop(take_slot(s));
            }
        }
    }
}

/// The ready blocks of one pool.
pub(crate) struct ReadyQueues<R: Runtime> {
    /// `shards * lines_per_shard` lines; shard `s`, class `c` is
    /// `slots[s * lines_per_shard + c / 16][c % 16]`.
    slots: Box<[SlotLine<R>]>,
    lines_per_shard: usize,
    shards: Box<[Shard<R>]>,
    parked: Arc<Parked<R>>,
    mask: usize,
}

fn empty_line<R: Runtime>() -> SlotLine<R> {
    CachePadded(std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())))
}

impl<R: Runtime> ReadyQueues<R> {
    /// Queues for `classes` size classes in `shards` shards (a power of two).
    pub(crate) fn new(classes: usize, shards: usize) -> Self {
        debug_assert!(shards.is_power_of_two());
        let lines_per_shard = classes.div_ceil(SLOTS_PER_LINE).max(1);
        let slots = (0..shards * lines_per_shard)
            .map(|_| empty_line())
            .collect();
        let shards: Box<[_]> = (0..shards)
            .map(|_| Shard {
                queues: (0..classes)
                    .map(|_| {
                        let (tx, rx) = flume::unbounded();
                        Queue { tx, rx }
                    })
                    .collect(),
                queued: (0..classes.div_ceil(64))
                    .map(|_| AtomicU64::new(0))
                    .collect(),
            })
            .collect();
        let mask = shards.len() - 1;
        let parked = Arc::new(Parked {
            shards: (0..shards.len())
                .map(|_| CachePadded(std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut()))))
                .collect(),
            watched: AtomicBool::new(false),
        });
        Self {
            slots,
            lines_per_shard,
            shards,
            parked,
            mask,
        }
    }

    /// This thread's shard.
    #[inline]
    pub(crate) fn my_shard(&self) -> usize {
        ThreadSlot::current(self.mask).shard
    }

    #[inline]
    fn slot(&self, shard: usize, class: usize) -> &AtomicPtr<Block<R>> {
        &self.slots[shard * self.lines_per_shard + class / SLOTS_PER_LINE][class % SLOTS_PER_LINE]
    }

    /// Takes a ready block of `class`: this thread's slot, then its queue, then the others'.
    #[inline]
    pub(crate) fn take(&self, class: usize) -> Option<Box<Block<R>>> {
        let me = self.my_shard();
        if let Some(b) = take_slot(self.slot(me, class)) {
            return Some(b);
        }
        self.take_slow(me, class)
    }

    #[cold]
    fn take_slow(&self, me: usize, class: usize) -> Option<Box<Block<R>>> {
        self.take_queued(me, class)
            .or_else(|| self.steal(me, class))
    }

    /// This thread's slot and queue for `class`, without looking at other shards.
    #[inline]
    pub(crate) fn take_mine(&self, class: usize) -> Option<Box<Block<R>>> {
        let me = self.my_shard();
        take_slot(self.slot(me, class)).or_else(|| self.take_queued(me, class))
    }

    #[cold]
    fn take_queued(&self, me: usize, class: usize) -> Option<Box<Block<R>>> {
        self.shards[me].queues[class].rx.try_recv().ok()
    }

    /// A ready block of `class` from another thread's shard.
    #[cold]
    pub(crate) fn steal(&self, me: usize, class: usize) -> Option<Box<Block<R>>> {
        (1..self.shards.len())
            .map(|i| (me + i) & self.mask)
            .find_map(|s| {
                take_slot(self.slot(s, class)).or_else(|| {
                    let shard = &self.shards[s];
                    if shard.may_hold(class) {
                        shard.queues[class].rx.try_recv().ok()
                    } else {
                        None
                    }
                })
            })
    }

    /// Puts a block that is ready for reuse into this thread's slot for its class, or its
    /// queue when the slot is full. Only the thread that owns a shard fills its slots, so an
    /// empty slot stays empty until that thread's own store (others only empty slots): a
    /// plain release store suffices.
    #[inline]
    pub(crate) fn put(&self, block: Box<Block<R>>) {
        let me = ThreadSlot::current(self.mask);
        let slot = self.slot(me.shard, block.class);
        if me.owns && slot.load(Ordering::Relaxed).is_null() {
            slot.store(Box::into_raw(block), Ordering::Release);
            return;
        }
        self.put_queue(me.shard, block);
    }

    #[cold]
    fn put_queue(&self, shard: usize, block: Box<Block<R>>) {
        let class = block.class;
        // The receiver lives beside the sender, so the send cannot fail.
        let shard = &self.shards[shard];
        let _ = shard.queues[class].tx.send(block);
        shard.mark(class);
    }

    /// Takes every ready block out of every slot and queue.
    pub(crate) fn drain(&self) -> Vec<Box<Block<R>>> {
        let mut out = Vec::new();
        for line in self.slots.iter() {
            out.extend(line.iter().filter_map(take_slot));
        }
        for shard in self.shards.iter() {
            shard.drain_into(&mut out);
        }
        out
    }

    /// The slot line that holds the slots of `class` in each shard.
    pub(crate) const fn line_of(class: usize) -> usize {
        class / SLOTS_PER_LINE
    }

    /// Takes every queued block, and every block in a slot on one of the lines set in
    /// `lines` (bit `l % 64` of word `l / 64` for line `l`; see [`Self::line_of`]), in every
    /// shard. A caller that knows which classes can hold blocks looks at those lines only.
    pub(crate) fn drain_lines(&self, lines: &[u64]) -> Vec<Box<Block<R>>> {
        let mut out = Vec::new();
        for (s, shard) in self.shards.iter().enumerate() {
            let base = s * self.lines_per_shard;
            for (w, &word) in lines.iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let line = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    if line < self.lines_per_shard {
                        out.extend(self.slots[base + line].iter().filter_map(take_slot));
                    }
                }
            }
            shard.drain_into(&mut out);
        }
        out
    }

    /// Counts the ready blocks and their bytes without taking them.
    pub(crate) fn census(&self) -> (usize, usize) {
        let blocks = self.drain();
        let n = blocks.len();
        let bytes = blocks.iter().map(|b| b.size).sum();
        for b in blocks {
            self.put(b);
        }
        (n, bytes)
    }

    /// Parks a freed block whose events are recorded (in `block.events`) in this thread's
    /// shard; when every parked slot is full, the one displaced goes to the poller.
    pub(crate) fn park(&self, block: Box<Block<R>>, poller: &Sender<PollerMsg<R>>) {
        let parked = &self.parked.shards[self.my_shard()];
        let p = Box::into_raw(block);
        let mut placed = false;
        for s in parked.iter() {
            if s.load(Ordering::Relaxed).is_null()
                && s.compare_exchange(ptr::null_mut(), p, Ordering::SeqCst, Ordering::Relaxed)
                    .is_ok()
            {
                placed = true;
                break;
            }
        }
        if !placed {
            // Full: the first slot's occupant makes room and goes to the poller.
            let old = parked[0].swap(p, Ordering::SeqCst);
            if !old.is_null() {
                // SAFETY: a non-null pointer in a parked slot is a leaked `Box<Block>` that
                // the swap made ours alone.
                send_to_poller(unsafe { Box::from_raw(old) }, poller);
            }
        }
        // The poller must watch the parked slots, or blocks would wait for a request.
        if !self.parked.watched.load(Ordering::SeqCst)
            && self
                .parked
                .watched
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            && poller.send(PollerMsg::Watch(self.parked.clone())).is_err()
        {
            // The poller is gone with its runtime: nobody will watch; wait here.
            let mut rest = Vec::new();
            self.parked.sweep(&mut rest);
            for b in rest.into_iter().chain(self.unpark_drain()) {
                b.wait_here();
            }
        }
    }

    /// Takes every parked block out of its slot (events not looked at).
    pub(crate) fn unpark_drain(&self) -> Vec<Box<Block<R>>> {
        self.parked
            .shards
            .iter()
            .flat_map(|l| l.iter().filter_map(take_slot))
            .collect()
    }

    /// A parked block of `class` whose events have all completed (events released, stats
    /// moved from waiting), from this thread's shard, or `None`.
    pub(crate) fn take_parked(
        &self,
        class: usize,
        poller: &Sender<PollerMsg<R>>,
    ) -> Option<Box<Block<R>>> {
        self.take_parked_from(self.my_shard(), class, poller)
    }

    /// The same, from the other threads' shards (a miss would otherwise ask the pool actor).
    #[cold]
    pub(crate) fn steal_parked(
        &self,
        class: usize,
        poller: &Sender<PollerMsg<R>>,
    ) -> Option<Box<Block<R>>> {
        let me = self.my_shard();
        (1..self.shards.len())
            .map(|i| (me + i) & self.mask)
            .find_map(|s| self.take_parked_from(s, class, poller))
    }

    fn take_parked_from(
        &self,
        shard: usize,
        class: usize,
        poller: &Sender<PollerMsg<R>>,
    ) -> Option<Box<Block<R>>> {
        let parked = &self.parked.shards[shard];
        for s in parked.iter() {
            if s.load(Ordering::Relaxed).is_null() {
                continue;
            }
            let p = s.swap(ptr::null_mut(), Ordering::Acquire);
            if p.is_null() {
                continue;
            }
            // SAFETY: as in `park`: the swap handed us the only pointer to this block.
            let mut b = unsafe { Box::from_raw(p) };
            if b.class == class && b.events_completed() {
                b.leave_waiting();
                return Some(b);
            }
            // Not ours to take, or not done yet: back in its slot, or to the poller.
            let p = Box::into_raw(b);
            if s.compare_exchange(ptr::null_mut(), p, Ordering::SeqCst, Ordering::Relaxed)
                .is_err()
            {
                // SAFETY: not published; still ours.
                send_to_poller(unsafe { Box::from_raw(p) }, poller);
            }
        }
        None
    }

    /// Hands every parked block of every shard to the poller (before a flush, or when the
    /// pool closes). Returns how many.
    pub(crate) fn unpark_all(&self, poller: &Sender<PollerMsg<R>>) -> usize {
        let blocks = self.unpark_drain();
        let n = blocks.len();
        for b in blocks {
            send_to_poller(b, poller);
        }
        n
    }
}

/// Takes the block out of a slot, if any.
#[inline]
fn take_slot<R: Runtime>(slot: &AtomicPtr<Block<R>>) -> Option<Box<Block<R>>> {
    if slot.load(Ordering::Relaxed).is_null() {
        return None;
    }
    let p = slot.swap(ptr::null_mut(), Ordering::Acquire);
    if p.is_null() {
        None
    } else {
        // SAFETY: every non-null pointer stored in a slot comes from `Box::into_raw` and is
        // published with a release store; the acquiring swap removed it, so this is its only
        // owner.
        Some(unsafe { Box::from_raw(p) })
    }
}

fn send_to_poller<R: Runtime>(block: Box<Block<R>>, poller: &Sender<PollerMsg<R>>) {
    if let Err(flume::SendError(PollerMsg::Wait(b))) = poller.send(PollerMsg::Wait(block)) {
        // The poller is gone with its runtime: wait here for the events.
        b.wait_here();
    }
}

impl<R: Runtime> Drop for ReadyQueues<R> {
    fn drop(&mut self) {
        // Every block holds its pool alive, so the slots are empty by now; should one not
        // be, dropping the block sends it home (or frees it when home is gone).
        for line in self.slots.iter() {
            for s in line.iter() {
                drop(take_slot(s));
            }
        }
    }
}
