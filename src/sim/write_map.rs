//! `WriteMap`: which stream last wrote each 512-byte unit of a simulated device allocation,
//! so that an operation can tell whether *another* stream wrote *its* bytes between its
//! enqueue and its execution (early reuse), whatever other streams wrote elsewhere in the
//! same mapping meanwhile.
//!
//! Every device write takes a sequence number from one counter shared by all allocations
//! when it starts (`HostAllocation::device_write`) and stamps it, with its stream, on each unit it
//! touches before it changes any byte. Each unit keeps two stamps: the latest write, and
//! the latest write by a stream other than that one's. So for any stream `s`, "the latest
//! write to this unit by a stream other than `s`" is exact: the first stamp when it is not
//! `s`'s, the second otherwise. An operation of stream `s` enqueued when the allocation's
//! sequence stood at `q` was reused early if some unit of its range has such a write
//! numbered `q` or later. A write of another stream that a program orders before an
//! operation has run, and been waited for by the host, before the operation is enqueued, so
//! it is numbered below `q`; or it is ordered by a wait of the operation's stream for that
//! stream's event, queued before the operation, and then the check starts from the number
//! when that wait ended if it is later than `q` (`Worker::waited_at`): everything the event
//! waited for, through any chain of waits, is numbered below it.
//!
//! Units are 512 bytes, the alignment and granularity of device blocks, so two blocks never
//! share one; two streams writing disjoint bytes of one unit are not told apart. Stamps are
//! updated lock-free: a compare-and-swap on the first, then a store of the one it replaced
//! into the second; only writers that race on the same unit (themselves early reuse) can
//! leave an older stamp behind. The map takes address space for two words per unit and
//! memory only for the units written (an anonymous mapping on unix).

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes per unit: device blocks are aligned to and sized in 512 bytes.
pub(crate) const UNIT: usize = 512;

/// Bits of a stamp that hold the stream (the rest hold the sequence number plus one).
const STREAM_BITS: u32 = 24;
const STREAM_MASK: u64 = (1 << STREAM_BITS) - 1;

/// A write found by [`WriteMap::foreign_since`]: its stream (the id's low 24 bits) and its
/// sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ForeignWrite {
    pub(crate) stream: u64,
    pub(crate) seq: u64,
}

fn stamp(stream: u64, seq: u64) -> u64 {
    ((seq + 1) << STREAM_BITS) | (stream & STREAM_MASK)
}

fn stream_of(stamp: u64) -> u64 {
    stamp & STREAM_MASK
}

fn seq_of(stamp: u64) -> u64 {
    (stamp >> STREAM_BITS).wrapping_sub(1)
}

/// The two stamps of each unit of one allocation.
pub(crate) struct WriteMap {
    slots: Slots,
}

impl WriteMap {
    /// A map of an allocation of `size` bytes, no unit written; `None` if the address space
    /// for it cannot be had (the allocation's writes then go unchecked).
    pub(crate) fn new(size: usize) -> Option<Self> {
        let units = size.div_ceil(UNIT).max(1);
        Slots::zeroed(units.checked_mul(2)?).map(|slots| Self { slots })
    }

    fn units(offset: usize, len: usize) -> std::ops::Range<usize> {
        offset / UNIT..(offset + len.max(1)).div_ceil(UNIT)
    }

    /// Stamps write `seq` of `stream` on every unit of `[offset, offset + len)`.
    pub(crate) fn mark(&self, offset: usize, len: usize, stream: u64, seq: u64) {
        let me = stamp(stream, seq);
        let slots = self.slots.get();
        for unit in Self::units(offset, len) {
            let (latest, other) = (&slots[2 * unit], &slots[2 * unit + 1]);
            let mut cur = latest.load(Ordering::Acquire);
            loop {
                match latest.compare_exchange_weak(cur, me, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break,
                    Err(seen) => cur = seen,
                }
            }
            if cur != 0 && stream_of(cur) != stream & STREAM_MASK {
                other.store(cur, Ordering::Release);
            }
        }
    }

    /// The latest write numbered `since` or later to a unit of `[offset, offset + len)` by
    /// a stream other than `stream`, if any.
    pub(crate) fn foreign_since(
        &self,
        offset: usize,
        len: usize,
        stream: u64,
        since: u64,
    ) -> Option<ForeignWrite> {
        let mine = stream & STREAM_MASK;
        let slots = self.slots.get();
        let mut found: Option<ForeignWrite> = None;
        for unit in Self::units(offset, len) {
            let latest = slots[2 * unit].load(Ordering::Acquire);
            let candidate = if latest == 0 || stream_of(latest) != mine {
                latest
            } else {
                slots[2 * unit + 1].load(Ordering::Acquire)
            };
            if candidate != 0 && stream_of(candidate) != mine && seq_of(candidate) >= since {
                let w = ForeignWrite {
                    stream: stream_of(candidate),
                    seq: seq_of(candidate),
                };
                if found.map_or(true, |f| w.seq > f.seq) {
                    found = Some(w);
                }
            }
        }
        found
    }
}

/// Zeroed atomic words that take memory only once written.
struct Slots {
    ptr: std::ptr::NonNull<AtomicU64>,
    len: usize,
}

// SAFETY: the words are atomics owned by this value; sharing them across threads is what
// atomics are for.
unsafe impl Send for Slots {}
// SAFETY: as above.
unsafe impl Sync for Slots {}

impl Slots {
    #[cfg(unix)]
    fn zeroed(len: usize) -> Option<Self> {
        let bytes = len.checked_mul(std::mem::size_of::<AtomicU64>())?;
        let ptr = super::memory::map_lazy(bytes)?.cast::<AtomicU64>();
        Some(Self { ptr, len })
    }

    #[cfg(not(unix))]
    fn zeroed(len: usize) -> Option<Self> {
        let words: Box<[AtomicU64]> = (0..len).map(|_| AtomicU64::new(0)).collect();
        let ptr = std::ptr::NonNull::new(Box::into_raw(words).cast::<AtomicU64>())?;
        Some(Self { ptr, len })
    }

    fn get(&self) -> &[AtomicU64] {
        // SAFETY: `ptr` points to `len` zero-initialised words (a zero `AtomicU64` is a valid
        // one) that this value owns until it drops; all access is atomic.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        #[cfg(unix)]
        // SAFETY: `ptr` and the byte length are the mapping `zeroed` made; unmapped only here.
        unsafe {
            libc::munmap(
                self.ptr.as_ptr().cast(),
                self.len * std::mem::size_of::<AtomicU64>(),
            );
        }
        #[cfg(not(unix))]
        // SAFETY: `ptr` and `len` are the boxed slice `zeroed` leaked; rebuilt only here.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_by_another_stream_to_the_range_is_found_and_one_elsewhere_is_not() {
        let map = WriteMap::new(4 * UNIT).unwrap();
        map.mark(0, UNIT, 1, 0); // stream 1 writes unit 0
        map.mark(2 * UNIT, UNIT, 2, 1); // stream 2 writes unit 2
                                        // Stream 1 since 0, over unit 0: only its own write.
        assert_eq!(map.foreign_since(0, UNIT, 1, 0), None);
        // Over units 0..3 it finds stream 2's.
        assert_eq!(
            map.foreign_since(0, 3 * UNIT, 1, 0),
            Some(ForeignWrite { stream: 2, seq: 1 })
        );
        // Writes numbered below `since` came before the operation was enqueued.
        assert_eq!(map.foreign_since(0, 3 * UNIT, 1, 2), None);
    }

    #[test]
    fn another_streams_write_stays_visible_under_later_writes_of_ones_own() {
        let map = WriteMap::new(UNIT).unwrap();
        map.mark(0, UNIT, 2, 5); // stream 2
        map.mark(0, UNIT, 1, 6); // then stream 1, twice
        map.mark(0, UNIT, 1, 7);
        assert_eq!(
            map.foreign_since(0, UNIT, 1, 3),
            Some(ForeignWrite { stream: 2, seq: 5 })
        );
        // For stream 2 the foreign write is stream 1's latest.
        assert_eq!(
            map.foreign_since(0, UNIT, 2, 0),
            Some(ForeignWrite { stream: 1, seq: 7 })
        );
        // Three streams: the latest write not by the asking stream.
        map.mark(0, UNIT, 3, 8);
        assert_eq!(
            map.foreign_since(0, UNIT, 3, 0),
            Some(ForeignWrite { stream: 1, seq: 7 })
        );
    }

    #[test]
    fn ranges_cover_every_unit_they_touch() {
        let map = WriteMap::new(3 * UNIT).unwrap();
        map.mark(UNIT - 1, 2, 4, 0); // the last byte of unit 0 and the first of unit 1
        assert!(map.foreign_since(0, 1, 9, 0).is_some());
        assert!(map.foreign_since(UNIT, 1, 9, 0).is_some());
        assert!(map.foreign_since(2 * UNIT, UNIT, 9, 0).is_none());
    }
}
