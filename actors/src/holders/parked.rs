//! Parked blocks: freed after a stream used them, their events recorded, waiting in the
//! freeing thread's shard instead of being sent to the event poller (a message and a task
//! wake-up per free).
//!
//! Each thread shard has a few parked slots. On the next miss of a block's class, the same
//! thread queries the block's events inline (one `query_event`) and reuses it when they have
//! completed (invariant 1). A park that finds every parked slot full sends the displaced
//! occupant to the poller. The poller watches a pool's parked slots while any block is parked
//! (the first park after a quiet spell tells it to), and on each of its polls sends home the
//! parked blocks whose events have completed, so blocks come back without any request. The
//! pool actor hands all parked blocks to the poller before it flushes events (so a miss never
//! takes fresh memory while a completed block of its class sits parked: invariant 3), and
//! parked blocks are counted as waiting blocks throughout (invariant 2).
//!
//! The slots hold any [`Parkable`] item (the engine's blocks): what waiting means, and where
//! a block goes once its events complete, is the item's business.

use std::ptr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::holders::ready::{take_slot, Slotted};
use crate::vocab::loom::{fence, AtomicBool, AtomicPtr};
use crate::vocab::policy::SizeClass;
use crate::vocab::shard::{CachePadded, ThreadSlot};

/// Parked (event-pending) blocks a shard holds before it sends the oldest to the poller.
pub(crate) const PARKED: usize = 4;

/// What parked slots need of what they hold: a block that waits on events.
pub(crate) trait Parkable: Slotted + Sized {
    /// Whether every event recorded for it has completed (releasing those that have). A
    /// failed query counts as not completed.
    fn events_completed(&mut self) -> bool;
    /// Its events have completed: it stops being counted as waiting.
    fn leave_waiting(&mut self);
    /// Its events have completed: back where requests find it.
    fn returned_from_waiting(self: Box<Self>);
    /// Hands it to the event poller (or, with the poller gone, waits for its events here).
    fn to_poller(self: Box<Self>);
    /// Blocks this thread until its events complete, then gives it back (no poller left).
    fn wait_here(self: Box<Self>);
}

type ParkedLine<B> = CachePadded<[AtomicPtr<B>; PARKED]>;

/// A pool's parked slots, one line per shard; shared with the poller while it watches them.
pub(crate) struct Parked<B> {
    shards: Box<[ParkedLine<B>]>,
    /// Whether the poller has (or is being sent) this pool's parked slots to watch.
    watched: AtomicBool,
    mask: usize,
}

impl<B: Parkable> Parked<B> {
    /// Parked slots for `shards` shards (a power of two).
    pub(crate) fn new(shards: usize) -> Arc<Self> {
        debug_assert!(shards.is_power_of_two());
        Arc::new(Self {
            shards: (0..shards)
                .map(|_| CachePadded(std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut()))))
                .collect(),
            watched: AtomicBool::new(false),
            mask: shards - 1,
        })
    }

    fn my_shard(&self) -> usize {
        ThreadSlot::current(self.mask).shard
    }

    /// Parks a freed block whose events are recorded in this thread's shard; when every
    /// parked slot is full, the one displaced goes to the poller. `watch` asks the poller to
    /// watch these slots (false when the poller is gone); it is called after the block is
    /// placed, when nobody watches them yet.
    pub(crate) fn park(self: &Arc<Self>, block: Box<B>, watch: impl FnOnce(Arc<Self>) -> bool) {
        self.park_at(self.my_shard(), block, watch)
    }

    /// [`Self::park`] in shard `shard`.
    fn park_at(
        self: &Arc<Self>,
        shard: usize,
        block: Box<B>,
        watch: impl FnOnce(Arc<Self>) -> bool,
    ) {
        let parked = &self.shards[shard];
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
                // SAFETY: a non-null pointer in a parked slot is a leaked `Box` that the swap
                // made ours alone.
                unsafe { Box::from_raw(old) }.to_poller();
            }
        }
        // The poller must watch the parked slots, or blocks would wait for a request. The
        // fence pairs with the one in `unwatch_if_empty`: of a park and an unwatch that race,
        // at least one sees the other's write.
        fence(Ordering::SeqCst);
        if !self.watched.load(Ordering::SeqCst)
            && self
                .watched
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            && !watch(self.clone())
        {
            // The poller is gone with its runtime: nobody will watch; wait here.
            let mut rest = Vec::new();
            self.sweep(&mut rest);
            for b in rest.into_iter().chain(self.take_all()) {
                b.wait_here();
            }
        }
    }

    /// Puts a block back into the slot it was taken from, or hands it to the poller when
    /// another block took the slot meanwhile.
    fn put_back(&self, slot: &AtomicPtr<B>, block: Box<B>) {
        let p = Box::into_raw(block);
        if slot
            .compare_exchange(ptr::null_mut(), p, Ordering::SeqCst, Ordering::Relaxed)
            .is_err()
        {
            // SAFETY: not published; still ours.
            unsafe { Box::from_raw(p) }.to_poller();
            return;
        }
        // The poller may have looked at the slots while the block was out and stopped
        // watching them: as in `park`, either its look after `unwatch_if_empty`'s write sees
        // the block, or this sees `watched` false and hands the block to the poller itself
        // (else it would wait for the next request of its class).
        fence(Ordering::SeqCst);
        if !self.watched.load(Ordering::SeqCst) {
            if let Some(b) = take_slot(slot) {
                b.to_poller();
            }
        }
    }

    /// Goes over every parked block once: those whose events have completed go home (they
    /// are reusable), the others go back to their slot. Returns (blocks seen, sent home).
    pub(crate) fn sweep(&self, poller_pending: &mut Vec<Box<B>>) -> (usize, usize) {
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

    /// Takes every parked block out of the slots (events not looked at).
    pub(crate) fn take_all(&self) -> Vec<Box<B>> {
        self.shards
            .iter()
            .flat_map(|l| l.iter().filter_map(take_slot))
            .collect()
    }

    /// Stops being watched unless a block is parked; returns whether it still is watched.
    /// A park racing with this either sees `watched` false (and asks to be watched again) or
    /// is seen here (both sides write, fence, then read; loom checks it).
    pub(crate) fn unwatch_if_empty(&self) -> bool {
        self.watched.store(false, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let any = self
            .shards
            .iter()
            .any(|l| l.iter().any(|s| !s.load(Ordering::SeqCst).is_null()));
        any && self
            .watched
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// A parked block of `class`, holding `class.size` bytes, whose events have all
    /// completed (events released, no longer counted as waiting), from this thread's shard,
    /// or `None`.
    pub(crate) fn take_mine(&self, class: SizeClass) -> Option<Box<B>> {
        self.take_from(self.my_shard(), class)
    }

    /// The same, from the other threads' shards (a miss would otherwise ask the pool actor).
    #[cold]
    pub(crate) fn steal(&self, class: SizeClass) -> Option<Box<B>> {
        let me = self.my_shard();
        (1..self.shards.len())
            .map(|i| (me + i) & self.mask)
            .find_map(|s| self.take_from(s, class))
    }

    fn take_from(&self, shard: usize, class: SizeClass) -> Option<Box<B>> {
        for s in self.shards[shard].iter() {
            let Some(mut b) = take_slot(s) else { continue };
            if b.class() == class.index && b.size() >= class.size && b.events_completed() {
                b.leave_waiting();
                crate::vocab::idle_probe::caught_up();
                return Some(b);
            }
            // Not ours to take, or not done yet: back in its slot, or to the poller.
            self.put_back(s, b);
        }
        None
    }

    /// Hands every parked block of every shard to the poller (before a flush, or when the
    /// pool closes). Returns how many.
    pub(crate) fn unpark_all(&self) -> usize {
        let blocks = self.take_all();
        let n = blocks.len();
        for b in blocks {
            b.to_poller();
        }
        n
    }
}

impl<B> Drop for Parked<B> {
    fn drop(&mut self) {
        for line in self.shards.iter() {
            for s in line.iter() {
                drop(take_slot(s));
            }
        }
    }
}

/// Models of parking under loom (`scripts/loom.sh`): threads stand at explicit shards.
#[cfg(all(test, pinpool_loom))]
mod loom_models {
    use super::*;
    use crate::vocab::loom::AtomicUsize;
    use loom::thread;

    const CLASS: SizeClass = SizeClass {
        index: 1,
        size: 1024,
    };

    /// A block whose one "event" is a flag; where it ends up is sent to `log`.
    struct Item {
        id: usize,
        done: Arc<AtomicBool>,
        log: flume::Sender<(usize, &'static str)>,
    }

    impl Item {
        fn note(&self, what: &'static str) {
            let _ = self.log.send((self.id, what));
        }
    }

    impl Slotted for Item {
        fn class(&self) -> usize {
            CLASS.index
        }
        fn size(&self) -> usize {
            CLASS.size
        }
    }

    impl Parkable for Item {
        fn events_completed(&mut self) -> bool {
            self.done.load(Ordering::SeqCst)
        }
        fn leave_waiting(&mut self) {}
        fn returned_from_waiting(self: Box<Self>) {
            assert!(
                self.done.load(Ordering::SeqCst),
                "sent home before its event"
            );
            self.note("home");
        }
        fn to_poller(self: Box<Self>) {
            self.note("poller");
        }
        fn wait_here(self: Box<Self>) {
            self.note("waited");
        }
    }

    #[test]
    fn a_parked_block_goes_to_exactly_one_place_and_only_once_its_event_completed() {
        loom::model(|| {
            let parked = Parked::<Item>::new(2);
            let (log, places) = flume::unbounded();
            let done = Arc::new(AtomicBool::new(false));
            let item = Box::new(Item {
                id: 0,
                done: done.clone(),
                log: log.clone(),
            });
            parked.park_at(0, item, |_| true);
            let event = thread::spawn(move || done.store(true, Ordering::SeqCst));
            let p = parked.clone();
            let poller = thread::spawn(move || {
                let mut pending = Vec::new();
                p.sweep(&mut pending);
                for b in pending {
                    b.note("pending");
                }
            });
            // The freeing thread's next miss of the class.
            if let Some(b) = parked.take_from(0, CLASS) {
                assert!(b.done.load(Ordering::SeqCst), "reused before its event");
                b.note("reused");
            }
            event.join().unwrap();
            poller.join().unwrap();
            for b in parked.take_all() {
                b.note("still parked");
            }
            let places: Vec<_> = places.try_iter().collect();
            assert_eq!(places.len(), 1, "one place, once: {places:?}");
        });
    }

    #[test]
    fn a_block_parked_while_the_poller_stops_watching_is_still_watched() {
        loom::model(|| {
            let parked = Parked::<Item>::new(2);
            let (log, _places) = flume::unbounded();
            let item = move |id| {
                Box::new(Item {
                    id,
                    done: Arc::new(AtomicBool::new(false)),
                    log: log.clone(),
                })
            };
            // Watched since an earlier park; that block has left.
            parked.park_at(0, item(0), |_| true);
            drop(parked.take_all());
            let asked = Arc::new(AtomicUsize::new(0));
            let (p, a) = (parked.clone(), asked.clone());
            let freeing = thread::spawn(move || {
                p.park_at(0, item(1), |_| {
                    a.fetch_add(1, Ordering::SeqCst);
                    true
                })
            });
            let still_watched = parked.unwatch_if_empty();
            freeing.join().unwrap();
            let parked_now = parked.take_all();
            if !parked_now.is_empty() {
                assert!(
                    still_watched || asked.load(Ordering::SeqCst) == 1,
                    "a parked block nobody watches waits for a request"
                );
            }
        });
    }
}
