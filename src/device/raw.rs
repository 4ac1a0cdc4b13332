//! The buffers lent through the raw-pointer calls (`raw_alloc_with_stream`, `raw_delete`),
//! by address: a lock-free open-addressing table.
//!
//! Owns those buffers: `raw_alloc_with_stream` puts one in, `raw_delete` takes it out and
//! drops it (the free). A buffer is filed as one pointer (`Filed`): the allocator files
//! `RawLease`s, the block alone, so that a raw allocation allocates nothing more. Each slot
//! holds an address (0: never used, 1: used once, now free) and that pointer. An insert
//! claims the first free slot of its address's probe sequence with a compare-and-swap, then
//! publishes the buffer; a removal takes the buffer with a swap, so of two racing
//! `raw_delete`s of one address exactly one gets it and the other gets a typed error, as does
//! a `raw_delete` of an address never lent. When a probe sequence is full, the buffer goes to
//! an overflow list owned by whoever holds its receiving end (an insert or a removal that
//! finds the list non-empty drains it, looks, and puts back what it did not take), so no
//! request is ever refused for want of slots.

use std::marker::PhantomData;
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use crate::actors::{RawLease, Runtime};

/// What the table files: an owner that travels as one non-null pointer.
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

/// Buffers whose probe sequence was full, with their addresses.
type Overflow<T> = (flume::Sender<(usize, T)>, flume::Receiver<(usize, T)>);

struct Slot {
    addr: AtomicUsize,
    value: AtomicPtr<()>,
}

/// Buffers by device address.
pub(crate) struct RawTable<T: Filed> {
    slots: Box<[Slot]>,
    overflow: Overflow<T>,
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

impl<T: Filed> RawTable<T> {
    pub(crate) fn new() -> Self {
        Self {
            slots: (0..SLOTS)
                .map(|_| Slot {
                    addr: AtomicUsize::new(EMPTY),
                    value: AtomicPtr::new(ptr::null_mut()),
                })
                .collect(),
            overflow: flume::unbounded(),
            overflowed: AtomicUsize::new(0),
            _owns: PhantomData,
        }
    }

    fn probe(addr: usize) -> impl Iterator<Item = usize> {
        let h = home(addr);
        (0..PROBES).map(move |i| (h + i) & (SLOTS - 1))
    }

    /// Files `value` under `addr` (an address not filed now: the allocator never lends
    /// one address twice at once).
    pub(crate) fn insert(&self, addr: usize, value: T) {
        for i in Self::probe(addr) {
            let slot = &self.slots[i];
            let cur = slot.addr.load(Ordering::Acquire);
            if (cur == EMPTY || cur == FREED)
                && slot
                    .addr
                    .compare_exchange(cur, addr, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                slot.value.store(value.into_ptr(), Ordering::Release);
                return;
            }
        }
        self.overflowed.fetch_add(1, Ordering::SeqCst);
        // The receiver lives beside the sender: the send cannot fail.
        let _ = self.overflow.0.send((addr, value));
    }

    /// Takes out what is filed under `addr`, if anything.
    pub(crate) fn remove(&self, addr: usize) -> Option<T> {
        for i in Self::probe(addr) {
            let slot = &self.slots[i];
            let cur = slot.addr.load(Ordering::Acquire);
            if cur == EMPTY {
                break;
            }
            if cur == addr {
                let p = slot.value.swap(ptr::null_mut(), Ordering::AcqRel);
                if p.is_null() {
                    // Another removal took it (or the insert has not published it yet,
                    // which the caller's order rules out).
                    return None;
                }
                slot.addr.store(FREED, Ordering::Release);
                // SAFETY: `p` came from `into_ptr` in `insert`, and the swap made this call
                // its only owner.
                return Some(unsafe { T::from_ptr(p) });
            }
        }
        self.remove_overflow(addr)
    }

    #[cold]
    fn remove_overflow(&self, addr: usize) -> Option<T> {
        if self.overflowed.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let mut found = None;
        let mut rest = Vec::new();
        for (a, v) in self.overflow.1.try_iter() {
            if found.is_none() && a == addr {
                found = Some(v);
            } else {
                rest.push((a, v));
            }
        }
        for item in rest {
            let _ = self.overflow.0.send(item);
        }
        if found.is_some() {
            self.overflowed.fetch_sub(1, Ordering::SeqCst);
        }
        found
    }

    /// Takes out everything filed (for the allocator's teardown).
    pub(crate) fn drain(&self) -> Vec<T> {
        let mut out = Vec::new();
        for slot in self.slots.iter() {
            let p = slot.value.swap(ptr::null_mut(), Ordering::AcqRel);
            if !p.is_null() {
                // SAFETY: as in `remove`.
                out.push(unsafe { T::from_ptr(p) });
            }
        }
        out.extend(self.overflow.1.try_iter().map(|(_, v)| v));
        out
    }
}

impl<T: Filed> Drop for RawTable<T> {
    fn drop(&mut self) {
        for slot in self.slots.iter() {
            let p = slot.value.swap(ptr::null_mut(), Ordering::AcqRel);
            if !p.is_null() {
                // SAFETY: as in `remove`; nobody else can reach the table any more.
                drop(unsafe { T::from_ptr(p) });
            }
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

    #[test]
    fn addresses_past_a_full_probe_sequence_overflow_and_are_still_found() {
        let t = RawTable::new();
        // Addresses that all start at the same slot: those whose products with the hash's
        // multiplier are small (the multiplier's inverse modulo 2^64 times 1, 2, 3, ...).
        let mut inverse = MULTIPLIER;
        for _ in 0..5 {
            inverse = inverse.wrapping_mul(2u64.wrapping_sub(MULTIPLIER.wrapping_mul(inverse)));
        }
        assert_eq!(MULTIPLIER.wrapping_mul(inverse), 1);
        let addrs: Vec<usize> = (1..=PROBES as u64 + 10)
            .map(|i| i.wrapping_mul(inverse) as usize)
            .collect();
        assert!(addrs.iter().all(|&a| home(a) == home(addrs[0])));
        for &a in &addrs {
            t.insert(a, Box::new(a));
        }
        for &a in addrs.iter().rev() {
            assert_eq!(t.remove(a).as_deref(), Some(&a));
        }
        assert!(t.drain().is_empty());
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
