//! The buffers lent through the raw-pointer calls (`raw_alloc_with_stream`, `raw_delete`,
//! `raw_record_stream`), by address: a lock-free open-addressing table.
//!
//! Owns those buffers: `raw_alloc_with_stream` puts one in, `raw_delete` takes it out and
//! drops it (the free), `raw_record_stream` works on it where it lies. A buffer is filed as
//! one pointer (`Filed`): the allocator files `RawLease`s, the block alone, so that a raw
//! allocation allocates nothing more. Each slot holds an address (0: never used, 1: used
//! once, now free) and that pointer. An insert claims the first free slot of its address's
//! probe sequence with a compare-and-swap, then publishes the buffer.
//!
//! Every other access to a filed buffer first takes its slot: a compare-and-swap from the
//! buffer's pointer to a busy mark, which only one caller at a time wins (the others wait for the
//! slot to be put back, a few instructions later). The taker checks, while it holds the slot,
//! that the slot is still filed under its address (it may have been freed and filed again
//! under another in the meantime), then either takes the buffer out (a removal: of two racing
//! `raw_delete`s of one address exactly one gets it, and the other gets a typed error, as
//! does a `raw_delete` of an address never lent) or works on it in place and puts it back
//! ([`RawTable::with`]): the buffer never leaves the table while it is worked on, so a
//! concurrent `raw_record_stream` or `raw_delete` of it always finds it. When a probe
//! sequence is full (rare: 64 slots), the buffer goes to a slot past the table: chunks of
//! slots in a list that only grows, each pushed at its head with a compare-and-swap, whose
//! slots are claimed, taken and put back as the table's are; so no request is ever refused
//! for want of slots, and nothing takes a lock.

use std::marker::PhantomData;
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use crate::actors::{RawLease, Runtime};

/// What the table files: an owner that travels as one non-null, aligned pointer.
pub(crate) trait Filed: Send + Sized {
    fn into_ptr(self) -> *mut ();
    /// # Safety
    ///
    /// `p` came from [`Filed::into_ptr`] and is given back once.
    unsafe fn from_ptr(p: *mut ()) -> Self;
}

// The table's own tests file plain boxes.
#[cfg(test)]
impl<T: Send> Filed for Box<T> {
    fn into_ptr(self) -> *mut () {
        Box::into_raw(self).cast()
    }
    unsafe fn from_ptr(p: *mut ()) -> Self {
        // SAFETY: by the contract, `p` came from `Box::into_raw`.
        unsafe { Box::from_raw(p.cast()) }
    }
}

impl<R: Runtime> Filed for RawLease<R> {
    fn into_ptr(self) -> *mut () {
        RawLease::into_ptr(self)
    }
    unsafe fn from_ptr(p: *mut ()) -> Self {
        // SAFETY: the contracts are the same.
        unsafe { RawLease::from_ptr(p) }
    }
}

/// Slots of the table: 2^16 (about a megabyte).
const SLOTS: usize = 1 << 16;
/// How far an address's probe sequence runs.
const PROBES: usize = 64;
const EMPTY: usize = 0;
const FREED: usize = 1;

/// The value of a slot whose buffer someone has taken to work on: address 1, which no filed
/// pointer is (blocks and boxes are aligned).
fn busy() -> *mut () {
    std::ptr::NonNull::<()>::dangling().as_ptr()
}

struct Slot {
    addr: AtomicUsize,
    value: AtomicPtr<()>,
}

impl Slot {
    fn empty() -> Self {
        Self {
            addr: AtomicUsize::new(EMPTY),
            value: AtomicPtr::new(ptr::null_mut()),
        }
    }

    /// Claims the slot for `addr` if it is free (its value is null then: it is emptied
    /// before its address is freed, and nobody takes a null value).
    fn claim(&self, addr: usize) -> bool {
        let cur = self.addr.load(Ordering::Acquire);
        (cur == EMPTY || cur == FREED)
            && self
                .addr
                .compare_exchange(cur, addr, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }
}

/// Slots of an overflow chunk.
const CHUNK: usize = 64;

/// Slots past the table's, for buffers whose probe sequence was full; `next` is set before
/// the chunk is published and never changes after.
struct Chunk {
    slots: [Slot; CHUNK],
    next: *mut Chunk,
}

/// Buffers by device address.
pub(crate) struct RawTable<T: Filed> {
    slots: Box<[Slot]>,
    /// The newest overflow chunk (null: none yet); chunks are freed with the table.
    overflow: AtomicPtr<Chunk>,
    /// Buffers filed in overflow chunks now.
    overflowed: AtomicUsize,
    _owns: PhantomData<T>,
}

/// The multiplier of [`home`]'s hash (2^64 over the golden ratio, odd).
const MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;

fn home(addr: usize) -> usize {
    // Fibonacci hashing: the top bits of the product, which every bit of the address moves.
    // (A middle slice of the product, taken before, put the first blocks of sixteen stream
    // pools at one offset of 4 KiB pages of the table, and sixteen threads on them ran at
    // half speed: BENCHMARKS.md.)
    ((addr as u64).wrapping_mul(MULTIPLIER) >> (64 - SLOTS.trailing_zeros())) as usize
}

/// A slot taken by [`RawTable::take_slot`]: it holds the buffer, and puts it back into the
/// slot when dropped (also when the work on it panics), unless it was taken out for good.
struct Taken<'a, T: Filed> {
    slot: &'a Slot,
    value: Option<T>,
}

impl<T: Filed> Taken<'_, T> {
    /// Empties the slot for good and hands its buffer over (a taken slot always holds one).
    fn remove(mut self) -> Option<T> {
        let value = self.value.take();
        // The value first: while the slot is taken, no insert may claim it.
        self.slot.value.store(ptr::null_mut(), Ordering::Release);
        self.slot.addr.store(FREED, Ordering::Release);
        value
    }
}

impl<T: Filed> Drop for Taken<'_, T> {
    fn drop(&mut self) {
        if let Some(v) = self.value.take() {
            self.slot.value.store(v.into_ptr(), Ordering::Release);
        }
    }
}

impl<T: Filed> RawTable<T> {
    pub(crate) fn new() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| Slot::empty()).collect(),
            overflow: AtomicPtr::new(ptr::null_mut()),
            overflowed: AtomicUsize::new(0),
            _owns: PhantomData,
        }
    }

    fn probe(addr: usize) -> impl Iterator<Item = usize> {
        let h = home(addr);
        (0..PROBES).map(move |i| (h + i) & (SLOTS - 1))
    }

    /// The overflow chunks, newest first.
    fn chunks(&self) -> impl Iterator<Item = &Chunk> {
        let mut next = self.overflow.load(Ordering::Acquire);
        std::iter::from_fn(move || {
            // SAFETY: a published chunk is whole, its `next` never changes, and chunks are
            // freed only when the table drops (which `&self` rules out).
            let chunk = unsafe { next.as_ref()? };
            next = chunk.next;
            Some(chunk)
        })
    }

    /// Files `value` under `addr` (an address not filed now: the allocator never lends
    /// one address twice at once).
    pub(crate) fn insert(&self, addr: usize, value: T) {
        match Self::probe(addr)
            .map(|i| &self.slots[i])
            .find(|s| s.claim(addr))
        {
            Some(slot) => slot.value.store(value.into_ptr(), Ordering::Release),
            None => self.insert_overflow(addr, value),
        }
    }

    /// Files `value` in a free slot of an overflow chunk, or in a new chunk.
    #[cold]
    fn insert_overflow(&self, addr: usize, value: T) {
        // Counted first: whoever looks for `addr` once it is filed sees the count.
        self.overflowed.fetch_add(1, Ordering::SeqCst);
        let free = self
            .chunks()
            .find_map(|c| c.slots.iter().find(|s| s.claim(addr)));
        if let Some(slot) = free {
            slot.value.store(value.into_ptr(), Ordering::Release);
            return;
        }
        let chunk = Box::into_raw(Box::new(Chunk {
            slots: std::array::from_fn(|_| Slot::empty()),
            next: ptr::null_mut(),
        }));
        // SAFETY: the chunk is this call's alone until the exchange below publishes it.
        unsafe {
            (*chunk).slots[0].addr.store(addr, Ordering::Relaxed);
            (*chunk).slots[0]
                .value
                .store(value.into_ptr(), Ordering::Relaxed);
        }
        let mut head = self.overflow.load(Ordering::Acquire);
        loop {
            // SAFETY: as above, not yet published.
            unsafe { (*chunk).next = head };
            match self.overflow.compare_exchange_weak(
                head,
                chunk,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Takes slot `slot` if it holds the buffer filed under `addr`: `None` when it holds
    /// nothing or another address's buffer. Waits while another caller has it taken.
    fn take_slot<'a>(&self, slot: &'a Slot, addr: usize) -> Option<Taken<'a, T>> {
        let mut spins = 0u32;
        loop {
            let p = slot.value.load(Ordering::Acquire);
            if p.is_null() {
                return None;
            }
            if p == busy() {
                // Held for a few instructions (or one `record_stream`): spin, then yield.
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            if slot
                .value
                .compare_exchange_weak(p, busy(), Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // SAFETY: `p` came from `into_ptr` in `insert` (or a `Taken`'s drop), and the
            // exchange made this call its only holder until it stores a pointer back.
            let value = unsafe { T::from_ptr(p) };
            let taken = Taken {
                slot,
                value: Some(value),
            };
            // While the slot is taken its address is the buffer's: it changes only once the
            // value is emptied. The slot may have been freed and filed again under another
            // address since this caller read the address.
            if slot.addr.load(Ordering::Acquire) == addr {
                return Some(taken);
            }
            return None;
        }
    }

    /// Finds the slot filed under `addr` and takes it (see [`RawTable::take_slot`]).
    fn find(&self, addr: usize) -> Option<Taken<'_, T>> {
        for i in Self::probe(addr) {
            let slot = &self.slots[i];
            let cur = slot.addr.load(Ordering::Acquire);
            if cur == EMPTY {
                break;
            }
            // A slot whose buffer was just taken out may still read `addr` for a moment:
            // the address may be filed again further on, so the search goes on.
            if cur == addr {
                if let Some(taken) = self.take_slot(slot, addr) {
                    return Some(taken);
                }
            }
        }
        None
    }

    /// Finds the overflow slot filed under `addr` and takes it.
    #[cold]
    fn find_overflow(&self, addr: usize) -> Option<Taken<'_, T>> {
        if self.overflowed.load(Ordering::SeqCst) == 0 {
            return None;
        }
        self.chunks().find_map(|c| {
            c.slots
                .iter()
                .filter(|s| s.addr.load(Ordering::Acquire) == addr)
                .find_map(|s| self.take_slot(s, addr))
        })
    }

    /// Takes out what is filed under `addr`, if anything.
    pub(crate) fn remove(&self, addr: usize) -> Option<T> {
        if let Some(taken) = self.find(addr) {
            return taken.remove();
        }
        let value = self.find_overflow(addr)?.remove();
        self.overflowed.fetch_sub(1, Ordering::SeqCst);
        value
    }

    /// Runs `f` on what is filed under `addr` where it lies (`None`, and `f` not run, when
    /// nothing is): a removal or another `with` of the same address waits until `f` is done,
    /// and never misses the buffer meanwhile.
    pub(crate) fn with<U>(&self, addr: usize, f: impl FnOnce(&mut T) -> U) -> Option<U> {
        let mut taken = self.find(addr).or_else(|| self.find_overflow(addr))?;
        taken.value.as_mut().map(f)
    }

    /// Takes out everything filed (for the allocator's teardown, when nothing else can
    /// reach the table).
    pub(crate) fn drain(&self) -> Vec<T> {
        let overflow = self.chunks().flat_map(|c| c.slots.iter());
        let mut out = Vec::new();
        for slot in self.slots.iter().chain(overflow) {
            let p = slot.value.swap(ptr::null_mut(), Ordering::AcqRel);
            if !p.is_null() && p != busy() {
                // SAFETY: as in `take_slot`; the swap made this call its only owner.
                out.push(unsafe { T::from_ptr(p) });
            }
        }
        out
    }
}

impl<T: Filed> Drop for RawTable<T> {
    fn drop(&mut self) {
        // Nobody else can reach the table any more.
        drop(self.drain());
        let mut next = *self.overflow.get_mut();
        while !next.is_null() {
            // SAFETY: each chunk came from `Box::into_raw` in `insert_overflow` and is freed
            // once, here, when nothing else can reach it.
            let chunk = unsafe { Box::from_raw(next) };
            next = chunk.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_that_differ_only_in_high_bits_have_homes_on_different_lines() {
        // One block at the same offset of each of 16 pools whose address ranges lie far
        // apart (each stream's pool reserves its own), as 16 threads on 16 streams hold
        // them: one shared line would have every thread's insert and removal contend on it.
        let lines: std::collections::HashSet<usize> = (0..16usize)
            .map(|k| home(0x7f2a_0000_0000 + (k << 40)) / 4)
            .collect();
        assert_eq!(lines.len(), 16);
        // And blocks side by side in one range spread too.
        let lines: std::collections::HashSet<usize> = (0..64usize)
            .map(|k| home(0x7f2a_0000_0000 + (k << 16)) / 4)
            .collect();
        assert!(lines.len() >= 60, "{} lines for 64 blocks", lines.len());
    }

    #[test]
    fn an_address_is_taken_out_once_and_unknown_ones_never() {
        let t = RawTable::new();
        t.insert(0x1000, Box::new(1u32));
        t.insert(0x2000, Box::new(2u32));
        assert_eq!(t.remove(0x3000), None);
        assert_eq!(t.remove(0x1000).as_deref(), Some(&1));
        assert_eq!(t.remove(0x1000), None);
        t.insert(0x1000, Box::new(3u32));
        assert_eq!(t.remove(0x1000).as_deref(), Some(&3));
        assert_eq!(t.remove(0x2000).as_deref(), Some(&2));
    }

    /// `n` addresses whose probe sequences all start at one slot: those whose products with
    /// the hash's multiplier are small (the multiplier's inverse modulo 2^64 times 1, 2, 3...).
    fn colliding(n: usize) -> Vec<usize> {
        let mut inverse = MULTIPLIER;
        for _ in 0..5 {
            inverse = inverse.wrapping_mul(2u64.wrapping_sub(MULTIPLIER.wrapping_mul(inverse)));
        }
        assert_eq!(MULTIPLIER.wrapping_mul(inverse), 1);
        let addrs: Vec<usize> = (1..=n as u64)
            .map(|i| i.wrapping_mul(inverse) as usize)
            .collect();
        assert!(addrs.iter().all(|&a| home(a) == home(addrs[0])));
        addrs
    }

    #[test]
    fn addresses_past_a_full_probe_sequence_overflow_and_are_still_found() {
        let t = RawTable::new();
        let addrs = colliding(PROBES + 10);
        for &a in &addrs {
            t.insert(a, Box::new(a));
        }
        for &a in addrs.iter().rev() {
            assert_eq!(t.remove(a).as_deref(), Some(&a));
        }
        assert!(t.drain().is_empty());
    }

    #[test]
    fn overflow_past_one_chunk_is_found_and_freed_overflow_slots_are_reused() {
        let t = RawTable::new();
        let addrs = colliding(PROBES + 2 * CHUNK + 3);
        for &a in &addrs {
            t.insert(a, Box::new(a));
        }
        assert_eq!(t.chunks().count(), 3);
        // Every other overflowed address out, then in again: into the slots they left.
        for &a in addrs[PROBES..].iter().step_by(2) {
            assert_eq!(t.remove(a).as_deref(), Some(&a));
        }
        for &a in addrs[PROBES..].iter().step_by(2) {
            t.insert(a, Box::new(a + 1));
        }
        assert_eq!(
            t.chunks().count(),
            3,
            "no new chunk while freed slots remain"
        );
        for (i, &a) in addrs.iter().enumerate() {
            let moved = i >= PROBES && (i - PROBES) % 2 == 0;
            let want = if moved { a + 1 } else { a };
            assert_eq!(t.with(a, |v| **v), Some(want));
            assert_eq!(t.remove(a).as_deref(), Some(&want));
        }
        assert!(t.drain().is_empty());
    }

    /// Threads that work on one filed address in place while another takes it out: every
    /// `with` before the removal finds the buffer (none is lost to another's work on it), the
    /// removal finds it too, and the buffer taken out carries every change made to it.
    fn with_racing_a_removal(overflowed: bool) {
        let rounds = if cfg!(miri) { 2 } else { 50 };
        for round in 0..rounds {
            let t = std::sync::Arc::new(RawTable::new());
            let addr = if overflowed {
                // The address's probe sequence is full of others: it lies in the overflow.
                let addrs = colliding(PROBES + 1);
                for &a in &addrs[..PROBES] {
                    t.insert(a, Box::new(0usize));
                }
                addrs[PROBES]
            } else {
                0x20_0000 + round * 512
            };
            t.insert(addr, Box::new(0usize));
            let removing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let workers: Vec<_> = (0..3)
                .map(|_| {
                    let (t, removing) = (t.clone(), removing.clone());
                    std::thread::spawn(move || {
                        let mut done = 0;
                        for _ in 0..if cfg!(miri) { 5 } else { 500 } {
                            match t.with(addr, |v| **v += 1) {
                                Some(()) => done += 1,
                                None => {
                                    assert!(removing.load(Ordering::SeqCst), "lost the buffer");
                                    break;
                                }
                            }
                        }
                        done
                    })
                })
                .collect();
            std::thread::yield_now();
            removing.store(true, Ordering::SeqCst);
            let taken = t.remove(addr).expect("the removal finds the buffer");
            let done: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
            assert_eq!(*taken, done);
            assert_eq!(t.remove(addr), None);
            assert_eq!(t.with(addr, |_| ()), None);
        }
    }

    #[test]
    fn work_in_place_on_an_address_racing_its_removal_loses_nothing() {
        with_racing_a_removal(false);
    }

    #[test]
    fn work_in_place_on_an_overflowed_address_racing_its_removal_loses_nothing() {
        with_racing_a_removal(true);
    }

    #[test]
    fn racing_removals_of_one_address_give_it_to_exactly_one() {
        // Fewer rounds under miri, which runs every interleaving check far slower.
        let rounds = if cfg!(miri) { 3 } else { 200 };
        for round in 0..rounds {
            let t = std::sync::Arc::new(RawTable::new());
            let addr = 0x10_0000 + round * 512;
            t.insert(addr, Box::new(round));
            let got: usize = (0..4)
                .map(|_| {
                    let t = t.clone();
                    std::thread::spawn(move || t.remove(addr).is_some() as usize)
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .sum();
            assert_eq!(got, 1);
        }
    }
}
