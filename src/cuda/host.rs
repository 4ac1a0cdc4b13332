//! Getting and giving back page-locked host memory, the two ways [`PinStrategy`] names.
//!
//! Owns no state: each function is one allocation or release. `host_alloc` is
//! `cuMemHostAlloc(PORTABLE)` / `cuMemFreeHost`. `register` is an anonymous private `mmap`
//! (aligned to, and rounded up to, the huge page size when huge pages are on, with
//! `madvise(MADV_HUGEPAGE)`), pages pre-faulted on several threads, then
//! `cuMemHostRegister(PORTABLE)`; it is released with `cuMemHostUnregister` + `munmap`.
//! Keeps invariant 7: a failure at any step gives back what the earlier steps took.
//!
//! The caller binds a context and relaxes the capture mode (see [`super::context`]) first.
//!
//! [`PinStrategy`]: crate::config::PinStrategy

use std::ffi::c_void;
use std::ops::Range;
use std::ptr::NonNull;

use cudarc::driver::{result, sys};

use super::error::{os_error, runtime_error};
use crate::{Origin, Region, RuntimeError};

/// Sizes from which the pre-fault is spread over several threads; below it one thread
/// touches the pages, which costs less than starting threads.
const PARALLEL_PREFAULT_MIN_BYTES: usize = 8 << 20;

/// `cuMemHostAlloc(size, PORTABLE)`: pinned memory usable from every context. Not
/// write-combined, so the host can also read it at full speed.
pub(crate) fn alloc_host(size: usize) -> Result<Region, RuntimeError> {
    // SAFETY: `malloc_host` only writes the pointer it returns; the memory it hands back is
    // uninitialised bytes, which `Region` never presents as anything but raw memory.
    let ptr = unsafe { result::malloc_host(size, sys::CU_MEMHOSTALLOC_PORTABLE) }
        .map_err(|e| runtime_error("cuMemHostAlloc", e))?;
    let ptr = NonNull::new(ptr.cast::<u8>())
        .ok_or_else(|| RuntimeError::new("cuMemHostAlloc", "returned a null pointer"))?;
    Ok(Region {
        ptr,
        size,
        method: Origin::HostAlloc,
    })
}

/// Gives back memory from [`alloc_host`] or [`alloc_registered`], the way `memory.method`
/// says.
///
/// # Safety
/// `memory` is exactly as one of those functions returned it, not freed yet, and unused.
pub(crate) unsafe fn free(memory: Region) -> Result<(), RuntimeError> {
    match memory.method {
        // SAFETY: guaranteed by the caller; `method` says `alloc_host` made it.
        Origin::HostAlloc => unsafe { free_host(memory.ptr) },
        // SAFETY: guaranteed by the caller; `method` says `alloc_registered` made it.
        Origin::Register => unsafe { free_registered(memory) },
        Origin::Simulated => Err(RuntimeError::new(
            "host_free",
            "simulated memory was not allocated by the CUDA runtime",
        )),
        Origin::Mapped => Err(RuntimeError::new(
            "host_free",
            "mapped memory goes back with host_unmap, not host_free",
        )),
        Origin::Device | Origin::DeviceMapped | Origin::SimulatedDevice => Err(RuntimeError::new(
            "host_free",
            "device memory is not pinned host memory",
        )),
    }
}

/// `cuMemFreeHost` for memory from [`alloc_host`].
///
/// # Safety
/// `ptr` came from [`alloc_host`] and has not been freed; nothing uses the memory any more.
unsafe fn free_host(ptr: NonNull<u8>) -> Result<(), RuntimeError> {
    // SAFETY: the caller guarantees `ptr` is a live `cuMemHostAlloc` allocation.
    unsafe { result::free_host(ptr.as_ptr().cast::<c_void>()) }
        .map_err(|e| runtime_error("cuMemFreeHost", e))
}

/// How `register` allocations are laid out.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RegisterLayout {
    /// The operating system's base page size (4 KiB on x86-64).
    pub(crate) base_page: usize,
    /// The granule sizes are rounded to and the mapping aligned to: the transparent huge page
    /// size when huge pages are on, else `base_page`.
    pub(crate) page: usize,
    /// Whether to ask for transparent huge pages.
    pub(crate) huge_pages: bool,
    /// Threads that pre-fault the pages.
    pub(crate) prefault_threads: usize,
}

impl RegisterLayout {
    /// The layout for this machine's page sizes.
    pub(crate) fn new(huge_pages: bool, prefault_threads: usize) -> Self {
        let base_page = base_page_size();
        let page = if huge_pages {
            huge_page_size().max(base_page)
        } else {
            base_page
        };
        Self {
            base_page,
            page,
            huge_pages,
            prefault_threads: prefault_threads.max(1),
        }
    }

    /// The layout for one allocation of `size` bytes: huge pages only for allocations of at
    /// least one huge page, so that small blocks are not each rounded up to 2 MiB.
    pub(crate) fn for_size(&self, size: usize) -> Self {
        if self.huge_pages && size < self.page {
            Self {
                page: self.base_page,
                huge_pages: false,
                ..*self
            }
        } else {
            *self
        }
    }

    /// `size` rounded up to the page granule; `None` when that overflows.
    pub(crate) fn rounded(&self, size: usize) -> Option<usize> {
        size.checked_next_multiple_of(self.page)
    }
}

/// The base page size, from `sysconf(_SC_PAGESIZE)`.
fn base_page_size() -> usize {
    // SAFETY: `sysconf` reads a configuration value and has no other effect.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|s| s.is_power_of_two())
        .unwrap_or(4096)
}

/// The transparent huge page size the kernel reports, else 2 MiB.
fn huge_page_size() -> usize {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|s| s.is_power_of_two())
        .unwrap_or(2 << 20)
}

/// `mmap` + huge pages + pre-fault + `cuMemHostRegister(PORTABLE)`; `size` rounds up to
/// the page granule of [`RegisterLayout::for_size`].
pub(crate) fn alloc_registered(
    size: usize,
    layout: &RegisterLayout,
) -> Result<Region, RuntimeError> {
    let layout = &layout.for_size(size);
    let len = layout
        .rounded(size)
        .ok_or_else(|| RuntimeError::new("mmap", format!("size {size} is too large")))?;
    let mapping = Mapping::new(len, layout.page, layout.base_page)?;
    if layout.huge_pages {
        // SAFETY: the range is exactly the mapping just made, which this function owns.
        let advised =
            unsafe { libc::madvise(mapping.ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        if advised != 0 {
            // Transparent huge pages off in this kernel: carry on with base pages.
            tracing::debug!(error = %std::io::Error::last_os_error(), "madvise(MADV_HUGEPAGE) failed");
        }
    }
    prefault(mapping.ptr.as_ptr() as usize, len, layout);
    // SAFETY: the range is a live private mapping of `len` bytes owned by this function and
    // not registered yet; the caller has bound a context to this thread.
    let registered = unsafe {
        sys::cuMemHostRegister_v2(
            mapping.ptr.as_ptr().cast(),
            len,
            sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    }
    .result();
    registered.map_err(|e| runtime_error("cuMemHostRegister", e))?;
    Ok(Region {
        ptr: mapping.into_raw(),
        size: len,
        method: Origin::Register,
    })
}

/// `cuMemHostUnregister` + `munmap` for memory from [`alloc_registered`]. When unregistering
/// fails the mapping is kept (leaked) rather than unmapped under the driver's feet.
///
/// # Safety
/// `memory` came from [`alloc_registered`] (so `memory.size` is the mapped length) and has
/// not been freed; nothing uses the memory any more.
unsafe fn free_registered(memory: Region) -> Result<(), RuntimeError> {
    // SAFETY: the caller guarantees the range is a live registration made by
    // `alloc_registered`.
    unsafe { sys::cuMemHostUnregister(memory.ptr.as_ptr().cast()) }
        .result()
        .map_err(|e| runtime_error("cuMemHostUnregister", e))?;
    // SAFETY: the caller guarantees `ptr..ptr + size` is exactly the live mapping that
    // `alloc_registered` made, now unregistered and unused.
    unsafe { unmap(memory.ptr.as_ptr() as usize, memory.size) }
}

/// An anonymous private mapping, unmapped on drop unless handed out with `into_raw`.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes aligned to `align` (a multiple of `base_page`): maps `len + align`
    /// bytes when `align` exceeds the base page, and gives back the unaligned head and tail.
    fn new(len: usize, align: usize, base_page: usize) -> Result<Self, RuntimeError> {
        let slack = if align > base_page { align } else { 0 };
        let total = len
            .checked_add(slack)
            .ok_or_else(|| RuntimeError::new("mmap", format!("size {len} is too large")))?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing
        // aliases nothing; the arguments are plain values.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(os_error("mmap", std::io::Error::last_os_error()));
        }
        let base = raw as usize;
        let start = if slack == 0 {
            base
        } else {
            base.next_multiple_of(align)
        };
        let (head, tail) = (start - base, base + total - (start + len));
        for (at, bytes) in [(base, head), (start + len, tail)] {
            if bytes > 0 {
                // SAFETY: `at..at + bytes` lies inside the mapping made above, outside the
                // `start..start + len` range that is kept, and is page-aligned because
                // `base`, `start`, `len` and `total` are multiples of the base page.
                if let Err(error) = unsafe { unmap(at, bytes) } {
                    tracing::debug!(%error, "could not trim an aligned mapping");
                }
            }
        }
        // `start` lies inside a successful mapping, so it is not null.
        let ptr = NonNull::new(start as *mut u8)
            .ok_or_else(|| RuntimeError::new("mmap", "returned a null pointer"))?;
        Ok(Self { ptr, len })
    }

    fn into_raw(self) -> NonNull<u8> {
        let ptr = self.ptr;
        std::mem::forget(self);
        ptr
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `self` owns exactly this mapping and is the last user of it.
        if let Err(error) = unsafe { unmap(self.ptr.as_ptr() as usize, self.len) } {
            tracing::warn!(%error, "could not unmap a failed pinned allocation");
        }
    }
}

/// `munmap(at, len)`.
///
/// # Safety
/// `at..at + len` is (part of) a mapping that nothing uses any more.
unsafe fn unmap(at: usize, len: usize) -> Result<(), RuntimeError> {
    // SAFETY: guaranteed by the caller.
    if unsafe { libc::munmap(at as *mut c_void, len) } == 0 {
        Ok(())
    } else {
        Err(os_error("munmap", std::io::Error::last_os_error()))
    }
}

/// Touches one byte of every page of `start..start + len` so that the kernel faults the
/// pages in before `cuMemHostRegister` (which would otherwise fault them one by one under
/// the driver's lock). Large ranges are split over `layout.prefault_threads` threads.
fn prefault(start: usize, len: usize, layout: &RegisterLayout) {
    // With huge pages one touch faults a whole huge page; should the kernel not give one,
    // `cuMemHostRegister` faults the rest of it.
    let page = layout.page;
    let pages = len / page;
    let threads = layout.prefault_threads.min(pages).max(1);
    if threads == 1 || len < PARALLEL_PREFAULT_MIN_BYTES {
        touch(start, 0..pages, page);
        return;
    }
    std::thread::scope(|scope| {
        let mut not_spawned = Vec::new();
        for i in 0..threads {
            let range = pages * i / threads..pages * (i + 1) / threads;
            let spawned = std::thread::Builder::new()
                .name("pinpool-prefault".into())
                .spawn_scoped(scope, {
                    let range = range.clone();
                    move || touch(start, range, page)
                });
            if spawned.is_err() {
                not_spawned.push(range);
            }
        }
        // Threads the system would not give: touch their share here.
        for range in not_spawned {
            touch(start, range, page);
        }
    });
}

/// Writes a zero to the first byte of pages `pages` of the range at `start`.
fn touch(start: usize, pages: Range<usize>, page: usize) {
    for i in pages {
        // SAFETY: `prefault`'s caller owns the writable mapping `start..start + len` and has
        // handed it to no one yet; page `i` lies inside it (i < len / page), and the threads
        // touch disjoint pages. Fresh anonymous memory already reads as zero, so the write
        // changes no value.
        unsafe { ((start + i * page) as *mut u8).write_volatile(0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_the_page_granule() {
        let layout = RegisterLayout {
            base_page: 4096,
            page: 2 << 20,
            huge_pages: true,
            prefault_threads: 4,
        };
        assert_eq!(layout.rounded(1), Some(2 << 20));
        assert_eq!(layout.rounded(2 << 20), Some(2 << 20));
        assert_eq!(layout.rounded((2 << 20) + 1), Some(4 << 20));
        assert_eq!(layout.rounded(usize::MAX), None);
    }

    #[test]
    fn allocations_below_a_huge_page_use_base_pages() {
        let layout = RegisterLayout {
            base_page: 4096,
            page: 2 << 20,
            huge_pages: true,
            prefault_threads: 4,
        };
        let small = layout.for_size(5000);
        assert!(!small.huge_pages);
        assert_eq!(small.rounded(5000), Some(8192));
        let big = layout.for_size(2 << 20);
        assert!(big.huge_pages);
        assert_eq!(big.rounded((2 << 20) + 1), Some(4 << 20));
    }

    #[test]
    fn mapping_is_aligned_and_prefaulted_on_several_threads() {
        let layout = RegisterLayout::new(true, 4);
        let len = layout.rounded(16 << 20).unwrap();
        let mapping = Mapping::new(len, layout.page, layout.base_page).unwrap();
        assert_eq!(mapping.ptr.as_ptr() as usize % layout.page, 0);
        prefault(mapping.ptr.as_ptr() as usize, len, &layout);
        // SAFETY: the mapping is live, `len` bytes long and owned by this test.
        let bytes = unsafe { std::slice::from_raw_parts(mapping.ptr.as_ptr(), len) };
        assert!(bytes.iter().step_by(layout.page).all(|&b| b == 0));
    }

    #[test]
    fn impossible_mapping_is_out_of_memory_not_a_panic() {
        let err = Mapping::new((usize::MAX / 2) & !4095, 4096, 4096)
            .err()
            .unwrap();
        assert!(err.out_of_memory, "{err}");
    }
}
