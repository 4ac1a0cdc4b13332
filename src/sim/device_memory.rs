//! Simulated device memory: the memory source of each simulated device.
//!
//! Owns nothing but a handle on the runtime and the device's ordinal: the device's books
//! (capacity, bytes in use, allocations made and given back) are atomics in the runtime's
//! shared state, and every allocation is registered in the ledger like host memory, so that
//! stream operations resolve device addresses the way they resolve host ones (the device
//! addresses are host addresses of memory that takes pages only once written).
//!
//! Like a GPU, a device has a capacity (16 GiB unless the builder says otherwise): an
//! allocation or a mapping that would pass it fails as out of memory, the way the driver's
//! `cuMemAlloc` does. Expandable memory follows CUDA's virtual memory calls: a reserved
//! range is mapped in 2 MiB granules, and what one `map` call mapped is unmapped whole, in
//! one call (as `cuMemUnmap` needs: `unmaps_granules` is false); what one call mapped can
//! move whole to unmapped granules of the same range (`RangeCall::Move`: the same memory mapped
//! again elsewhere, no memory taken or given back). Giving memory back, or moving it, waits
//! for every stream of the device first (as `cuMemFree` does); a stream that never gets
//! there, or a free of memory still used by a live graph, is recorded as a violation; a free
//! of memory it never gave out is refused and recorded.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::actors::{MemoryKind, MemorySource, Origin, RangeCall, Region, RuntimeError};

use super::expandable::GRANULE;
use super::memory::HostAllocation;
use super::{FaultPoint, Shared, SimError, ViolationKind};

/// The memory of one simulated device, as the device allocator's memory source
/// (`tests::a_device_memory_source_allocates_up_to_the_capacity`).
pub(crate) struct SimDeviceMemory {
    pub(super) shared: Arc<Shared>,
    pub(super) ordinal: usize,
}

impl SimDeviceMemory {
    fn state(&self) -> &super::DeviceState {
        &self.shared.devices[self.ordinal]
    }

    /// Counts `bytes` as in use, if the device has room for them.
    fn take(&self, op: &'static str, bytes: usize) -> Result<(), RuntimeError> {
        let s = self.state();
        s.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
                u.checked_add(bytes).filter(|&t| t <= s.capacity)
            })
            .map(drop)
            .map_err(|used| {
                RuntimeError::out_of_memory(
                    op,
                    format!(
                        "out of memory on simulated device {}: {bytes} bytes asked with {used} of {} in use",
                        self.ordinal, s.capacity
                    ),
                )
            })
    }

    /// Notes `[offset, offset + len)` of `range` as mapped, open to the peers granted now
    /// (see `MappedAccess`; a simulated mapping opens at once).
    fn note_mapped(&self, range: &Region, offset: usize, len: usize) {
        let access = &self.shared.mapped_access;
        let granted = access.granted(self.ordinal);
        let opened = |_| Ok::<(), std::convert::Infallible>(());
        access.mapped(self.ordinal, range.addr() + offset, len, granted, opened);
    }

    /// Forgets `[offset, offset + len)` of `range` as mapped.
    fn note_unmapped(&self, range: &Region, offset: usize, len: usize) {
        let at = range.addr() + offset;
        self.shared.mapped_access.unmapped(self.ordinal, at, len);
    }

    fn give(&self, bytes: usize) {
        self.state().used.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// The reserved range `range` describes, if it is one of this device's.
    fn reserved(
        &self,
        op: &'static str,
        range: &Region,
    ) -> Result<Arc<HostAllocation>, RuntimeError> {
        let found = if range.method == Origin::DeviceMapped {
            self.shared
                .ledger
                .find(range.addr(), range.size)
                .map_err(|e| e.into_runtime(op))?
        } else {
            None
        };
        found
            .filter(|a| a.device() == Some(self.ordinal))
            .ok_or_else(|| {
                RuntimeError::new(
                    op,
                    format!(
                        "{} bytes at {:#x} are not a reserved range of device {}",
                        range.size,
                        range.addr(),
                        self.ordinal
                    ),
                )
            })
    }

    /// Waits for every stream of the device, as the driver does before it takes memory
    /// back (`cuMemFree` synchronises the device; PyTorch synchronises before `cuMemUnmap`):
    /// a block freed on its own stream is reusable by that stream at once, but its memory
    /// may go back to the device only once the work queued on it has run. A stream that
    /// does not get there within a few seconds (stopped by a test) is recorded as a
    /// violation, and the memory goes back anyway.
    ///
    /// In CUDA, synchronising a device while one of its streams captures invalidates the
    /// capture: the simulation invalidates it too, and records a violation.
    fn synchronize(&self, op: &'static str) {
        for stream in self.state().invalidate_captures() {
            self.shared.report(
                ViolationKind::SyncDuringCapture,
                Some(stream),
                format!(
                    "device {}: {op} synchronised the device while stream {} was capturing",
                    self.ordinal, stream.0
                ),
            );
        }
        for stream in self.state().synchronize(std::time::Duration::from_secs(5)) {
            self.shared.report(
                ViolationKind::FreedWhileInUse,
                Some(stream),
                format!(
                    "device {}: {op} while stream {} had not run its queued work",
                    self.ordinal, stream.0
                ),
            );
        }
    }

    /// The reserved range `range` describes, for a call made as `op`, once the fault
    /// injected at `fault` (if any) has had its say.
    fn reserved_after(
        &self,
        fault: FaultPoint,
        op: &'static str,
        range: &Region,
    ) -> Result<Arc<HostAllocation>, RuntimeError> {
        self.shared.faults.check(fault)?;
        self.reserved(op, range)
    }

    /// Maps `[offset, offset + size)` of `range` as one mapping (`cuMemMap`).
    fn map(&self, range: &Region, offset: usize, size: usize) -> Result<(), RuntimeError> {
        const OP: &str = "cuMemMap";
        super::count_memory_call();
        let alloc = self.reserved_after(FaultPoint::DeviceAlloc, OP, range)?;
        self.take(OP, size)?;
        if let Err(e) = mark_call(OP, &alloc, offset, size, true) {
            self.give(size);
            return Err(e);
        }
        self.note_mapped(range, offset, size);
        self.state().allocs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// `RangeCall::Move`: the memory leaves `from` once the device's queued work has run.
    fn move_run(&self, r: &Region, from: usize, to: usize, len: usize) -> Result<(), RuntimeError> {
        const OP: &str = "cuMemMap";
        let alloc = self.reserved_after(FaultPoint::DeviceAlloc, OP, r)?;
        self.synchronize(OP);
        mark_call(OP, &alloc, to, len, true)?;
        if let Err(e) = mark_call(OP, &alloc, from, len, false) {
            alloc.set_mapped_call(to, len, false);
            return Err(e);
        }
        self.note_unmapped(r, from, len);
        self.note_mapped(r, to, len);
        self.state().remaps.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// `RangeCall::Alias`: the memory at `from` mapped at `to` too.
    fn alias_run(
        &self,
        r: &Region,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<(), RuntimeError> {
        const OP: &str = "cuMemMap";
        let alloc = self.reserved_after(FaultPoint::DeviceAlloc, OP, r)?;
        if !alloc.all_mapped(from, len) {
            let what = format!("{len} bytes at offset {from:#x} are not mapped");
            return Err(RuntimeError::new(OP, what));
        }
        mark_call(OP, &alloc, to, len, true)?;
        self.note_mapped(r, to, len);
        self.state().remaps.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// `RangeCall::Unalias`: work still queued on the place finds it unmapped when it runs
    /// (a violation).
    fn unalias_run(
        &self,
        r: &Region,
        at: usize,
        len: usize,
        wait: bool,
    ) -> Result<(), RuntimeError> {
        const OP: &str = "cuMemUnmap";
        let alloc = self.reserved(OP, r)?;
        if wait {
            self.synchronize(OP);
        }
        mark_call(OP, &alloc, at, len, false)?;
        self.note_unmapped(r, at, len);
        Ok(())
    }

    /// Unmaps exactly one earlier map call's granules, waiting for the device's queued work
    /// first where `wait` says so (see `RangeCall::UnmapUnused`).
    fn unmap_call(
        &self,
        range: &Region,
        offset: usize,
        size: usize,
        wait: bool,
    ) -> Result<(), RuntimeError> {
        const OP: &str = "cuMemUnmap";
        let alloc = self.reserved_after(FaultPoint::DeviceFree, OP, range)?;
        if wait {
            self.synchronize(OP);
        }
        if let Err(e) = mark_call(OP, &alloc, offset, size, false) {
            self.shared.report(
                ViolationKind::InvalidFree,
                None,
                format!(
                    "device {}: unmap of {size} bytes at offset {offset:#x} is not exactly one earlier map call",
                    self.ordinal
                ),
            );
            return Err(e);
        }
        self.note_unmapped(range, offset, size);
        self.give(size);
        self.state().frees.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// Marks `[at, at + len)` of `alloc` as the granules of one map call (`mapped`) or takes
/// that mark away, or fails as `op` when the granules are not all unmapped (marking) or not
/// exactly one earlier call's (unmarking). Every map, unmap and move of a reserved range
/// checks its granules here.
fn mark_call(
    op: &'static str,
    alloc: &HostAllocation,
    at: usize,
    len: usize,
    mapped: bool,
) -> Result<(), RuntimeError> {
    if alloc.set_mapped_call(at, len, mapped) {
        return Ok(());
    }
    let what = if mapped {
        "whole unmapped granules"
    } else {
        "one mapped call's granules"
    };
    Err(RuntimeError::new(
        op,
        format!("{len} bytes at offset {at:#x} are not {what}"),
    ))
}

impl MemorySource for SimDeviceMemory {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Device(self.ordinal)
    }

    fn alloc(&self, size: usize) -> Result<Region, RuntimeError> {
        const OP: &str = "cuMemAlloc";
        super::count_memory_call();
        self.shared.faults.check(FaultPoint::DeviceAlloc)?;
        if size == 0 {
            return Err(SimError::ZeroSize { op: OP }.into_runtime(OP));
        }
        let alloc = HostAllocation::lazy(size)
            .map_err(|e| RuntimeError::out_of_memory(OP, e.to_string()))?
            .on_device(self.ordinal);
        let size = alloc.size();
        self.take(OP, size)?;
        let ptr = alloc.ptr();
        if let Err(e) = self.shared.ledger.register(Arc::new(alloc)) {
            self.give(size);
            return Err(e.into_runtime(OP));
        }
        self.state().allocs.fetch_add(1, Ordering::SeqCst);
        Ok(Region {
            ptr,
            size,
            method: Origin::SimulatedDevice,
        })
    }

    fn free(&self, region: Region) -> Result<(), RuntimeError> {
        const OP: &str = "cuMemFree";
        self.shared.faults.check(FaultPoint::DeviceFree)?;
        let (addr, size) = (region.addr(), region.size);
        let found = self
            .shared
            .remove_freed(OP, &region, Origin::SimulatedDevice)?;
        if found.is_some() {
            self.synchronize(OP);
        }
        let Some(alloc) = found.filter(|a| a.device() == Some(self.ordinal)) else {
            let e = SimError::InvalidFree { addr, size };
            self.shared.report(
                ViolationKind::InvalidFree,
                None,
                format!("{e} (device {}, method {})", self.ordinal, region.method),
            );
            return Err(e.into_runtime(OP));
        };
        // Queued operations and live graphs hold the other references.
        self.shared.report_freed_in_use(
            &alloc,
            format_args!("device memory: {size} bytes at {addr:#x} given back"),
        );
        self.give(size);
        self.state().frees.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn granularity(&self) -> Option<usize> {
        self.shared.expandable.then_some(GRANULE)
    }

    fn free_bytes(&self) -> Option<usize> {
        let s = self.state();
        Some(s.capacity.saturating_sub(s.used.load(Ordering::SeqCst)))
    }

    fn reserve(&self, size: usize) -> Result<Region, RuntimeError> {
        const OP: &str = "cuMemAddressReserve";
        if !self.shared.expandable {
            return Err(RuntimeError::new(OP, "expandable memory is turned off"));
        }
        #[cfg(unix)]
        {
            let alloc = HostAllocation::reserve(size, GRANULE)
                .map_err(|e| RuntimeError::out_of_memory(OP, e.to_string()))?
                .on_device(self.ordinal);
            let ptr = alloc.ptr();
            self.shared
                .ledger
                .register(Arc::new(alloc))
                .map_err(|e| e.into_runtime(OP))?;
            self.state().reservations.fetch_add(1, Ordering::SeqCst);
            Ok(Region {
                ptr,
                size,
                method: Origin::DeviceMapped,
            })
        }
        #[cfg(not(unix))]
        {
            let _ = size;
            Err(RuntimeError::new(OP, "not supported on this platform"))
        }
    }

    fn range_call(&self, range: &Region, call: RangeCall) -> Result<(), RuntimeError> {
        match call {
            RangeCall::Map { offset, len, unit } => RangeCall::map_each_unit(
                offset,
                len,
                unit,
                |at, part| self.map(range, at, part),
                |at, part| self.unmap_call(range, at, part, true),
            ),
            RangeCall::Unmap { at, len } => self.unmap_call(range, at, len, true),
            RangeCall::UnmapUnused { at, len } => self.unmap_call(range, at, len, false),
            RangeCall::Move { from, to, len } => self.move_run(range, from, to, len),
            RangeCall::Alias { from, to, len } => self.alias_run(range, from, to, len),
            RangeCall::Unalias { at, len, wait } => self.unalias_run(range, at, len, wait),
        }
    }

    fn unmaps_granules(&self) -> bool {
        false
    }

    fn remaps(&self) -> bool {
        true
    }

    fn aliases(&self) -> bool {
        true
    }

    fn unreserve(&self, range: Region) -> Result<(), RuntimeError> {
        const OP: &str = "cuMemAddressFree";
        let alloc = self.reserved(OP, &range)?;
        #[cfg(unix)]
        if alloc.any_mapped() {
            let e = SimError::InvalidFree {
                addr: range.addr(),
                size: range.size,
            };
            self.shared.report(
                ViolationKind::InvalidFree,
                None,
                format!("{e} (device range with granules still mapped)"),
            );
            return Err(e.into_runtime(OP));
        }
        drop(alloc);
        self.shared
            .ledger
            .remove(range.addr(), range.size)
            .map_err(|e| e.into_runtime(OP))?;
        self.state().reservations.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }
}

impl std::fmt::Debug for SimDeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state();
        f.debug_struct("SimDeviceMemory")
            .field("ordinal", &self.ordinal)
            .field("capacity", &s.capacity)
            .field("used", &s.used.load(Ordering::Relaxed))
            .finish()
    }
}
