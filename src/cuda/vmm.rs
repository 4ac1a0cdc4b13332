//! Expandable memory through the CUDA virtual memory calls: an address range reserved with
//! `cuMemAddressReserve`, and memory created with `cuMemCreate` — pinned host memory
//! (location `CU_MEM_LOCATION_TYPE_HOST`, CUDA 12.2 and later) or a device's memory —
//! mapped into it with `cuMemMap`, and made readable and writable with `cuMemSetAccess` (by
//! the device, and for host memory by the host too). Host memory is mapped one handle per
//! granule, so that a granule can be unmapped on its own; device memory one handle per map
//! call (fast: one call for a whole run), unmapped whole. At unmap a handle is found again
//! with `cuMemRetainAllocationHandle`, so nothing is kept here. Device memory is created
//! exportable as a POSIX file descriptor where the device supports it (probed once per
//! memory source, and given up after the first `cuMemCreate` that refuses it): the handle
//! type costs nothing until a block is exported (`super::ipc`).
//!
//! Owns no state. Keeps invariant 7: a failure at any step gives back what the earlier
//! steps of the same call took. The caller binds a context and relaxes the capture mode
//! first (see [`super::context`]).

use std::ffi::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

use super::error::runtime_error;
use crate::{Origin, Region, RuntimeError};

/// The smallest granule used, whatever the driver's minimum (CUDA's host granule on
/// x86-64 is 2 MiB already).
const MIN_GRANULE: usize = 2 << 20;

/// Where mapped memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Location {
    /// Pinned host memory, accessed by this device.
    Host { device: c_int },
    /// This device's memory, readable and writable by it and by the devices of `peers` (a
    /// bit per device ordinal: those granted access, see the device module's
    /// `MappedAccess`).
    Device { device: c_int, peers: u64 },
}

impl Location {
    /// The memory of `device`, with no peer given access.
    pub(crate) fn device(device: c_int) -> Self {
        Location::Device { device, peers: 0 }
    }

    fn accessor(self) -> c_int {
        match self {
            Location::Host { device } | Location::Device { device, .. } => device,
        }
    }
}

/// The allocation properties of memory at `location`, with a POSIX file descriptor as a
/// shareable handle type where `fd` (so that `cuMemExportToShareableHandle` works on it).
fn prop(location: Location, fd: bool) -> sys::CUmemAllocationProp {
    let requested = if fd {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
    };
    let (type_, id) = match location {
        Location::Host { .. } => (sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, 0),
        Location::Device { device, .. } => {
            (sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, device)
        }
    };
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: requested,
        location: sys::CUmemLocation { type_, id },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn check(op: &'static str, r: sys::CUresult) -> Result<(), RuntimeError> {
    r.result().map_err(|e| runtime_error(op, e))
}

/// The granule for memory at `location`, or `None` when the driver cannot create it (for
/// host memory: older than 12.2, or no such support on this system).
pub(crate) fn granularity(location: Location) -> Option<usize> {
    let prop = prop(location, false);
    let mut granule = 0usize;
    // SAFETY: both pointers are valid for the call; the driver writes only `granule`.
    let r = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granule,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    };
    (r == sys::CUresult::CUDA_SUCCESS && granule > 0)
        .then(|| granule.max(MIN_GRANULE).next_power_of_two())
}

/// `granule`, after checking that `[offset, offset + size)` is whole granules of a range
/// reserved as `method` (the shape every map, unmap and unreserve call needs).
pub(crate) fn whole_granules(
    op: &'static str,
    range: &Region,
    offset: usize,
    size: usize,
    granule: usize,
    method: Origin,
) -> Result<usize, RuntimeError> {
    let whole = offset % granule == 0
        && size % granule == 0
        && offset.checked_add(size).is_some_and(|e| e <= range.size);
    if range.method != method || !whole {
        return Err(RuntimeError::new(
            op,
            format!("{size} bytes at offset {offset} are not whole granules of a reserved range"),
        ));
    }
    Ok(granule)
}

/// Reserves `size` bytes of address space, none of it mapped, described as `method`
/// ([`Origin::Mapped`] for host memory, `DeviceMapped` for device memory).
pub(crate) fn reserve(size: usize, granule: usize, method: Origin) -> Result<Region, RuntimeError> {
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: `va` is valid for the write; no memory is touched.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut va, size, granule, 0, 0)
    })?;
    let ptr = NonNull::new(va as usize as *mut u8)
        .ok_or_else(|| RuntimeError::new("cuMemAddressReserve", "returned a null address"))?;
    Ok(Region { ptr, size, method })
}

/// Whether device `device` can export memory as POSIX file descriptors
/// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`); false where the
/// driver does not say.
pub(crate) fn fd_handles_supported(device: sys::CUdevice) -> bool {
    if !cfg!(target_os = "linux") {
        return false;
    }
    let mut supported: c_int = 0;
    let attribute =
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
    // SAFETY: `supported` is valid for the write; the driver checks `device`.
    let r = unsafe { sys::cuDeviceGetAttribute(&mut supported, attribute, device) };
    r == sys::CUresult::CUDA_SUCCESS && supported != 0
}

/// Creates `size` bytes of memory at `location`: shareable as a file descriptor while
/// `shareable` says the driver allows it. Where a creation with the handle type fails and
/// one without succeeds, `shareable` is cleared, so the next call asks plainly at once.
fn create(
    size: usize,
    location: Location,
    shareable: Option<&AtomicBool>,
) -> Result<sys::CUmemGenericAllocationHandle, RuntimeError> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    let fd = shareable.is_some_and(|f| f.load(Ordering::Relaxed));
    if fd {
        let with_fd = prop(location, true);
        // SAFETY: `h` and `with_fd` are valid for the call.
        if unsafe { sys::cuMemCreate(&mut h, size, &with_fd, 0) } == sys::CUresult::CUDA_SUCCESS {
            return Ok(h);
        }
    }
    let plain = prop(location, false);
    // SAFETY: `h` and `plain` are valid for the call.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut h, size, &plain, 0)
    })?;
    if let Some(flag) = shareable.filter(|_| fd) {
        // Refused with the handle type, created without it: not a shortage of memory.
        flag.store(false, Ordering::Relaxed);
        tracing::debug!(
            "cuMemCreate refused a file-descriptor handle type: this device's expandable \
             memory is created without it from now on (and cannot be exported)"
        );
    }
    Ok(h)
}

/// Maps memory at `location` at `[offset, offset + size)` of `range`, readable and writable
/// by the accessing device (and, for host memory, by the host): one handle per `unit` (the
/// granule, or `size` for one handle for the whole span). With `shareable` (device memory)
/// each handle is created exportable as a file descriptor while the flag is set (see
/// [`create`]).
///
/// # Safety
/// `range` came from [`reserve`]; the granules of the span lie inside it, are whole, and
/// are not mapped; `unit` divides `size`.
pub(crate) unsafe fn map(
    range: &Region,
    offset: usize,
    size: usize,
    unit: usize,
    location: Location,
    shareable: Option<&AtomicBool>,
) -> Result<(), RuntimeError> {
    let base = range.ptr.as_ptr() as usize as sys::CUdeviceptr + offset as sys::CUdeviceptr;
    let mut done = 0usize;
    let res = (|| {
        while done < size {
            let at = base + done as sys::CUdeviceptr;
            let h = create(unit, location, shareable)?;
            // SAFETY: `at` is unmapped space of the reserved range (caller's promise).
            if let Err(e) = check("cuMemMap", unsafe { sys::cuMemMap(at, unit, 0, h, 0) }) {
                // SAFETY: `h` was created above and is mapped nowhere.
                unsafe { sys::cuMemRelease(h) };
                return Err(e);
            }
            // The mapping holds the memory; the handle is found again at unmap.
            // SAFETY: `h` was created above.
            unsafe { sys::cuMemRelease(h) };
            done += unit;
        }
        set_access(base, size, location)
    })();
    if res.is_err() {
        // SAFETY: exactly the units mapped above.
        let _ = unsafe { unmap(range, offset, done, unit) };
    }
    res
}

/// Opens the mapped span `[at, at + size)` to the accessors `location` names (for device
/// memory, its device and its peers; for host memory, the device and the host).
pub(crate) fn set_access(
    at: sys::CUdeviceptr,
    size: usize,
    location: Location,
) -> Result<(), RuntimeError> {
    let rw = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    let on_device = |id: c_int| sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id,
        },
        flags: rw,
    };
    let mut desc = vec![on_device(location.accessor())];
    match location {
        Location::Device { peers, .. } => {
            // Mapped memory is reachable only by the devices named here: a peer's direct
            // copy or kernel needs it as much as its context's peer access.
            desc.extend(
                (0..64)
                    .filter(|d| peers & (1 << d) != 0)
                    .map(|d| on_device(d as c_int)),
            );
            // SAFETY: the span is mapped; `desc` is valid for the call.
            check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(at, size, desc.as_ptr(), desc.len())
            })
        }
        Location::Host { .. } => {
            desc.push(sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                    id: 0,
                },
                flags: rw,
            });
            // SAFETY: the span is mapped; `desc` is valid for the call.
            let both = unsafe { sys::cuMemSetAccess(at, size, desc.as_ptr(), 2) };
            if both == sys::CUresult::CUDA_SUCCESS {
                return Ok(());
            }
            // Drivers that grant the host access with the mapping refuse a host descriptor.
            // SAFETY: as above.
            check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(at, size, desc.as_ptr(), 1)
            })
        }
    }
}

/// Unmaps `[offset, offset + size)` of `range`, one `unit` at a time (each unit one
/// mapping of [`map`]), and gives the memory back.
///
/// # Safety
/// Each unit of the span was mapped by [`map`] as one mapping, and nothing uses them any
/// more.
pub(crate) unsafe fn unmap(
    range: &Region,
    offset: usize,
    size: usize,
    unit: usize,
) -> Result<(), RuntimeError> {
    let base = range.ptr.as_ptr() as usize + offset;
    let mut first_error = None;
    for at in (base..base + size).step_by(unit.max(1)) {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `at` is a mapped granule (caller's promise); the driver writes `h`.
        let r = unsafe { sys::cuMemRetainAllocationHandle(&mut h, at as *mut c_void) };
        let res = check("cuMemRetainAllocationHandle", r).and_then(|()| {
            // SAFETY: as above; the mapping goes, and with the retained handle released
            // the memory goes back.
            let r = check("cuMemUnmap", unsafe {
                sys::cuMemUnmap(at as sys::CUdeviceptr, unit)
            });
            // SAFETY: `h` was retained above.
            unsafe { sys::cuMemRelease(h) };
            r
        });
        if let Err(e) = res {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// Moves the memory of the `granule` bytes mapped at `from` in `range` to `to`: maps the same
/// handle at `to` (a handle may be mapped at two places), grants access there, then unmaps
/// `from`. All or nothing: on failure `from` stays mapped and `to` unmapped. `granule` is
/// the handle's size: one granule, or the run of a device map call made as one unit.
///
/// # Safety
/// `range` came from [`reserve`]; `from` is one mapping of a `granule`-byte handle made by
/// [`map`] that nothing uses any more; `to` is whole granules of the range, unmapped.
pub(crate) unsafe fn remap(
    range: &Region,
    from: usize,
    to: usize,
    granule: usize,
    location: Location,
) -> Result<(), RuntimeError> {
    // SAFETY: as the caller promised.
    unsafe { alias(range, from, to, granule, location) }?;
    let base = range.ptr.as_ptr() as usize as sys::CUdeviceptr;
    // SAFETY: `from` is mapped and unused (caller's promise); its memory stays mapped at
    // `to`.
    let moved = check("cuMemUnmap", unsafe {
        sys::cuMemUnmap(base + from as sys::CUdeviceptr, granule)
    });
    if moved.is_err() {
        // SAFETY: `to` was mapped just above and nothing has used it.
        unsafe { sys::cuMemUnmap(base + to as sys::CUdeviceptr, granule) };
    }
    moved
}

/// Maps the memory of the `len` bytes mapped at `from` in `range` at `to` too (a handle may
/// be mapped at two places), readable and writable there; `from` stays mapped. All or
/// nothing.
///
/// # Safety
/// `range` came from [`reserve`]; `from` is one mapping of a `len`-byte handle made by
/// [`map`]; `to` is whole granules of the range, unmapped.
pub(crate) unsafe fn alias(
    range: &Region,
    from: usize,
    to: usize,
    len: usize,
    location: Location,
) -> Result<(), RuntimeError> {
    let base = range.ptr.as_ptr() as usize as sys::CUdeviceptr;
    let (from, to) = (
        base + from as sys::CUdeviceptr,
        base + to as sys::CUdeviceptr,
    );
    let h = retain(from).ok_or_else(|| {
        RuntimeError::new("cuMemRetainAllocationHandle", "no memory is mapped there")
    })?;
    let res = (|| {
        // SAFETY: `to` is unmapped space of the reserved range (caller's promise) and `h`
        // is a live handle of `len` bytes.
        check("cuMemMap", unsafe { sys::cuMemMap(to, len, 0, h, 0) })?;
        let access = set_access(to, len, location);
        if access.is_err() {
            // SAFETY: `to` was mapped just above and nothing has used it.
            unsafe { sys::cuMemUnmap(to, len) };
        }
        access
    })();
    // SAFETY: `h` was retained above; the mappings hold the memory.
    unsafe { sys::cuMemRelease(h) };
    res
}

/// The handle of the memory mapped at `at`, retained (release it with `cuMemRelease`), or
/// `None` where nothing is mapped there.
pub(crate) fn retain(at: sys::CUdeviceptr) -> Option<sys::CUmemGenericAllocationHandle> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `h` is valid for the write; the driver only looks the address up (an address
    // with nothing mapped is an error, not undefined behaviour).
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut h, at as usize as *mut c_void) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(h)
}

/// Gives back a reserved range.
///
/// # Safety
/// `range` came from [`reserve`] and none of it is mapped.
pub(crate) unsafe fn unreserve(range: Region) -> Result<(), RuntimeError> {
    // SAFETY: guaranteed by the caller.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(range.ptr.as_ptr() as usize as sys::CUdeviceptr, range.size)
    })
}
