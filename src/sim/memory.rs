//! Simulated pinned host memory: owns each heap allocation (`HostAllocation`) and the byte
//! access the simulated DMA engine uses on it.
//!
//! An allocation is zeroed, 4096-aligned memory from `std::alloc`, or (for expandable
//! memory) an address range reserved with `mmap` whose granules count as mapped or not: a
//! range that touches an unmapped granule is not inside the allocation, and unmapping a
//! granule zeroes it (`MADV_DONTNEED`) but leaves it addressable, so a buggy unmap can lose
//! bytes but never fault. It is returned to the system when the last `Arc<HostAllocation>`
//! drops: the ledger holds one while the
//! memory is live, and every queued or captured operation that touches it holds another, so
//! a buggy `host_free` can never turn a queued copy into a use-after-free.
//!
//! Each allocation also counts the writes that simulated device work makes to it (a
//! seqlock-style pair of counters), so that a checksum comparison can tell a change made by
//! earlier device work, which is legitimate, from a change made by the host, which is early
//! reuse. Simulated device memory is an allocation of the same kind (its addresses are the
//! device addresses); there every write is device work, and what tells a legitimate write
//! from early reuse is which stream wrote which bytes when: each device write is numbered,
//! and stamped on the units it touches in the allocation's [`WriteMap`], so that an
//! operation can tell whether another stream wrote its own bytes between its enqueue and
//! its execution (writes of other streams to other blocks of the mapping are no concern).
//!
//! Bytes are read and written only through `AtomicU8` views. In a correct program the
//! simulated device and the host never touch the same bytes at the same time; in a buggy one
//! (early reuse) they do, and atomic per-byte access keeps that a detectable logic error
//! instead of a data race.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;

use super::error::SimError;
use super::write_map::{ForeignWrite, WriteMap};

/// Alignment of every simulated pinned allocation (a page, like `cudaHostAlloc`).
pub const HOST_ALIGN: usize = 4096;

/// Where an allocation's bytes come from.
enum Backing {
    Heap(Layout),
    /// Reserved address space; bit `i` of `mapped` says whether granule `i` is mapped, and
    /// bit `i` of `starts` whether a map call began there (for sources that unmap only
    /// whole map calls).
    #[cfg(unix)]
    Reserved {
        granule: usize,
        mapped: Box<[AtomicU64]>,
        starts: Box<[AtomicU64]>,
    },
}

/// One live allocation standing in for pinned memory, or for device memory.
pub(crate) struct HostAllocation {
    ptr: NonNull<u8>,
    size: usize,
    backing: Backing,
    /// The device whose memory this is (`None`: host memory).
    device: Option<usize>,
    /// Device writes begun (incremented before the bytes change).
    device_writes_started: AtomicU64,
    /// Device writes finished (incremented after the bytes changed).
    device_writes_finished: AtomicU64,
    /// Which stream last wrote each unit (device memory; made at the first write, `None`
    /// inside when it could not be).
    write_map: OnceLock<Option<WriteMap>>,
}

// SAFETY: the allocation is plain heap memory owned by this value; all access to the bytes
// goes through `AtomicU8` views (see `atomic_bytes`), which are safe to share across threads.
unsafe impl Send for HostAllocation {}
// SAFETY: as above.
unsafe impl Sync for HostAllocation {}

/// Device writes numbered so far, across every allocation: one order for all of them, so
/// that "written after this moment" means the same for every allocation (a stream that
/// waited for another's event takes the moment its wait ended, see `worker`).
static DEVICE_WRITE_SEQ: AtomicU64 = AtomicU64::new(0);

/// The number the next device write will take: an operation enqueued now was reused early
/// if another stream writes its bytes with this number or a later one before it runs (see
/// [`HostAllocation::foreign_write_since`]).
pub(crate) fn device_write_seq() -> u64 {
    DEVICE_WRITE_SEQ.load(Ordering::SeqCst)
}

impl HostAllocation {
    /// Allocates `size` zeroed bytes aligned to `HOST_ALIGN`.
    pub(crate) fn new(size: usize) -> Result<Self, SimError> {
        if size == 0 {
            return Err(SimError::ZeroSize { op: "host_alloc" });
        }
        let layout = Layout::from_size_align(size, HOST_ALIGN)
            .map_err(|_| SimError::OutOfMemory { size })?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(SimError::OutOfMemory { size })?;
        Ok(Self {
            ptr,
            size,
            backing: Backing::Heap(layout),
            device: None,
            device_writes_started: AtomicU64::new(0),
            device_writes_finished: AtomicU64::new(0),
            write_map: OnceLock::new(),
        })
    }

    /// The device whose memory this is (`None`: host memory).
    pub(crate) fn device(&self) -> Option<usize> {
        self.device
    }

    /// Marks this allocation as device `ordinal`'s memory.
    pub(crate) fn on_device(mut self, ordinal: usize) -> Self {
        self.device = Some(ordinal);
        self
    }

    /// The latest device write numbered `since` or later, by a stream other than `stream`,
    /// to `len` bytes at `addr` (inside this allocation), if any.
    pub(crate) fn foreign_write_since(
        &self,
        addr: usize,
        len: usize,
        stream: u64,
        since: u64,
    ) -> Option<ForeignWrite> {
        let map = self.write_map.get()?.as_ref()?;
        map.foreign_since(addr - self.addr(), len, stream, since)
    }

    /// Runs `write`, which changes `len` bytes at `addr` of this allocation on behalf of
    /// device work on `stream`, bracketed by the device-write counters; device memory also
    /// numbers the write and stamps it on the bytes' units first.
    pub(crate) fn device_write(&self, stream: u64, addr: usize, len: usize, write: impl FnOnce()) {
        if self.device.is_some() {
            let seq = DEVICE_WRITE_SEQ.fetch_add(1, Ordering::SeqCst);
            let map = self.write_map.get_or_init(|| WriteMap::new(self.size));
            if let Some(map) = map {
                map.mark(addr - self.addr(), len, stream, seq);
            }
        }
        self.device_writes_started.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        write();
        self.device_writes_finished.fetch_add(1, Ordering::Release);
    }

    /// Runs `read` (which reads bytes of this allocation) and returns its result with the
    /// device-write generation it saw, or `None` if a device write overlapped the read.
    pub(crate) fn read_consistent(&self, read: impl FnOnce() -> u64) -> Option<(u64, u64)> {
        let finished = self.device_writes_finished.load(Ordering::Acquire);
        let started = self.device_writes_started.load(Ordering::Acquire);
        let value = read();
        fence(Ordering::Acquire);
        let again = self.device_writes_started.load(Ordering::Relaxed);
        (started == finished && started == again).then_some((value, started))
    }

    /// Start address.
    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Length in bytes.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Start pointer.
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Whether `[addr, addr + len)` lies within this allocation (and, in reserved address
    /// space, within mapped granules).
    pub(crate) fn contains(&self, addr: usize, len: usize) -> bool {
        let start = self.addr();
        let inside = addr >= start
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= start + self.size());
        inside && self.all_mapped(addr - start, len.max(1))
    }
}

/// A fresh private anonymous mapping of `bytes`, read and write, whose pages take memory
/// only once written (`MAP_NORESERVE`), zeroed; `None` where `mmap` fails. Every lazily
/// backed range of the simulation (reserved ranges, the write map's slots) is made here
/// and given back with `munmap`.
#[cfg(unix)]
pub(super) fn map_lazy(bytes: usize) -> Option<NonNull<u8>> {
    // miri's `mmap` takes no other flags; its memory is materialised anyway.
    let flags = if cfg!(miri) {
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS
    } else {
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE
    };
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    NonNull::new(raw.cast::<u8>())
}

#[cfg(unix)]
impl HostAllocation {
    /// Reserves `size` bytes of address space (a multiple of `granule`, itself a multiple
    /// of the page size), none of it mapped.
    pub(crate) fn reserve(size: usize, granule: usize) -> Result<Self, SimError> {
        if size == 0 || granule == 0 || size % granule != 0 || granule % HOST_ALIGN != 0 {
            return Err(SimError::ZeroSize { op: "host_reserve" });
        }
        let ptr = map_lazy(size).ok_or(SimError::OutOfMemory { size })?;
        let words = (size / granule).div_ceil(64);
        Ok(Self {
            ptr,
            size,
            backing: Backing::Reserved {
                granule,
                mapped: (0..words).map(|_| AtomicU64::new(0)).collect(),
                starts: (0..words).map(|_| AtomicU64::new(0)).collect(),
            },
            device: None,
            device_writes_started: AtomicU64::new(0),
            device_writes_finished: AtomicU64::new(0),
            write_map: OnceLock::new(),
        })
    }

    /// `size` bytes (rounded up to a page) of memory that take pages only once written (for
    /// simulated device memory, which may be far larger than the host's): reserved and
    /// wholly mapped.
    pub(crate) fn lazy(size: usize) -> Result<Self, SimError> {
        let len = size.max(1).next_multiple_of(HOST_ALIGN);
        let alloc = Self::reserve(len, len)?;
        if !alloc.set_mapped(0, len, true) {
            return Err(SimError::OutOfMemory { size });
        }
        Ok(alloc)
    }

    /// Maps (`map`) the granules of `[offset, offset + len)` as one map call, or unmaps
    /// exactly one earlier map call's granules; refused (nothing changes) for anything else.
    pub(crate) fn set_mapped_call(&self, offset: usize, len: usize, map: bool) -> bool {
        let Backing::Reserved {
            granule, starts, ..
        } = &self.backing
        else {
            return false;
        };
        let g = *granule;
        let start_bit = |i: usize| starts[i / 64].load(Ordering::Acquire) & (1 << (i % 64)) != 0;
        if !map {
            let (first, end) = (offset / g, (offset + len) / g);
            let one_call = offset % g == 0
                && len > 0
                && start_bit(first)
                && (first + 1..end).all(|i| !start_bit(i))
                && (end * g >= self.size || start_bit(end) || !self.all_mapped(end * g, 1));
            if !one_call || !self.set_mapped(offset, len, false) {
                return false;
            }
            starts[first / 64].fetch_and(!(1 << (first % 64)), Ordering::AcqRel);
            return true;
        }
        if !self.set_mapped(offset, len, true) {
            return false;
        }
        let first = offset / g;
        starts[first / 64].fetch_or(1 << (first % 64), Ordering::AcqRel);
        true
    }

    /// Marks the granules of `[offset, offset + len)` mapped (`map`) or unmapped; an
    /// unmapped granule is zeroed. Refused (nothing changes) unless the range is whole
    /// granules of reserved space that are all unmapped (to map) or all mapped (to unmap).
    pub(crate) fn set_mapped(&self, offset: usize, len: usize, map: bool) -> bool {
        let Backing::Reserved {
            granule, mapped, ..
        } = &self.backing
        else {
            return false;
        };
        let g = *granule;
        let ok = len > 0
            && offset % g == 0
            && len % g == 0
            && offset.checked_add(len).is_some_and(|e| e <= self.size)
            && (offset / g..(offset + len) / g).all(|i| self.granule_bit(mapped, i) != map);
        if !ok {
            return false;
        }
        if !map {
            // SAFETY: the range lies inside this mapping (checked above); dropping its pages
            // zeroes them and leaves them addressable (under miri, which has no `madvise`,
            // zeroing them does the same).
            unsafe {
                if cfg!(miri) {
                    std::ptr::write_bytes(self.ptr.as_ptr().add(offset), 0, len);
                } else {
                    libc::madvise(
                        self.ptr.as_ptr().add(offset).cast(),
                        len,
                        libc::MADV_DONTNEED,
                    );
                }
            }
        }
        for i in offset / g..(offset + len) / g {
            let bit = 1u64 << (i % 64);
            if map {
                mapped[i / 64].fetch_or(bit, Ordering::AcqRel);
            } else {
                mapped[i / 64].fetch_and(!bit, Ordering::AcqRel);
            }
        }
        true
    }

    /// Whether any granule is mapped.
    pub(crate) fn any_mapped(&self) -> bool {
        match &self.backing {
            Backing::Reserved { mapped, .. } => {
                mapped.iter().any(|w| w.load(Ordering::Acquire) != 0)
            }
            Backing::Heap(_) => false,
        }
    }
}

impl HostAllocation {
    #[cfg(unix)]
    fn granule_bit(&self, mapped: &[AtomicU64], i: usize) -> bool {
        mapped[i / 64].load(Ordering::Acquire) & (1 << (i % 64)) != 0
    }

    /// Whether every granule touched by `[offset, offset + len)` is mapped (heap memory
    /// always is).
    pub(crate) fn all_mapped(&self, offset: usize, len: usize) -> bool {
        match &self.backing {
            Backing::Heap(_) => true,
            #[cfg(unix)]
            Backing::Reserved {
                granule, mapped, ..
            } => (offset / granule..(offset + len).div_ceil(*granule))
                .all(|i| self.granule_bit(mapped, i)),
        }
    }
}

impl Drop for HostAllocation {
    fn drop(&mut self) {
        match &self.backing {
            // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` and is freed only here,
            // once, when the last owner lets go.
            Backing::Heap(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr(), *layout) },
            // SAFETY: `ptr` and `size` are the mapping `reserve` made; unmapped only here.
            #[cfg(unix)]
            Backing::Reserved { .. } => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.size);
            },
        }
    }
}

/// Views `len` bytes at `addr` as atomics.
///
/// # Safety
/// `[addr, addr + len)` must stay allocated for `'a` (callers hold the owning
/// `HostAllocation`, or the caller of an `_unchecked` stream operation promised it).
pub(crate) unsafe fn atomic_bytes<'a>(addr: usize, len: usize) -> &'a [AtomicU8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: `AtomicU8` has the size and alignment of `u8` and no invalid bit patterns;
    // the range is allocated for `'a` (caller's obligation). Every access the simulation
    // makes is atomic, so concurrent host writes race only with atomics.
    unsafe { std::slice::from_raw_parts(addr as *const AtomicU8, len) }
}

/// 64-bit FNV-1a, the checksum used to notice that bytes changed.
pub(crate) fn checksum(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// Checksum of the bytes behind an atomic view, read now.
pub(crate) fn checksum_atomic(bytes: &[AtomicU8]) -> u64 {
    checksum(bytes.iter().map(|b| b.load(Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_is_zeroed_and_page_aligned() {
        let a = HostAllocation::new(10_000).unwrap();
        assert_eq!(a.addr() % HOST_ALIGN, 0);
        assert_eq!(a.size(), 10_000);
        // SAFETY: `a` owns the range for the duration of the view.
        let bytes = unsafe { atomic_bytes(a.addr(), a.size()) };
        assert!(bytes.iter().all(|b| b.load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn zero_size_allocation_is_refused() {
        assert!(matches!(
            HostAllocation::new(0),
            Err(SimError::ZeroSize { .. })
        ));
    }

    #[test]
    fn contains_checks_both_ends_and_overflow() {
        let a = HostAllocation::new(100).unwrap();
        assert!(a.contains(a.addr(), 100));
        assert!(a.contains(a.addr() + 99, 1));
        assert!(!a.contains(a.addr() + 1, 100));
        assert!(!a.contains(a.addr().wrapping_sub(1), 2));
        assert!(!a.contains(a.addr(), usize::MAX));
    }

    #[test]
    fn checksum_changes_when_one_byte_changes() {
        assert_ne!(checksum([1, 2, 3]), checksum([1, 2, 4]));
        assert_eq!(checksum([7; 16]), checksum([7; 16]));
    }
}
