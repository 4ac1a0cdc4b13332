//! The runtime's host memory: `host_alloc` / `host_free` with their counters and violations,
//! expandable host memory (reserve, map, unmap, remap), and the runtime as the pinned pools'
//! `MemorySource`, which counts every call that takes memory on the calling thread.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::expandable::{self, GRANULE};
use super::memory::HostAllocation;
use super::{FaultPoint, SimError, SimRuntime, ViolationKind};
use crate::actors::{MemoryKind, MemorySource, Origin, RangeCall, Region, RuntimeError};

/// Host memory: what the simulated runtime's calls operate on.
impl SimRuntime {
    /// Gets `size` bytes of simulated pinned memory (zeroed, page-aligned), counted as live
    /// until `host_free`. Fails as out of memory past the runtime's memory limit.
    pub fn host_alloc(&self, size: usize) -> Result<Region, RuntimeError> {
        const OP: &str = "host_alloc";
        self.shared.faults.check(FaultPoint::HostAlloc)?;
        if size == 0 {
            return Err(SimError::ZeroSize { op: OP }.into_runtime(OP));
        }
        let latency = self.shared.host_alloc_latency_ns.load(Ordering::Relaxed);
        if latency > 0 {
            std::thread::sleep(Duration::from_nanos(latency));
        }
        let oom = |e: SimError| RuntimeError::out_of_memory(OP, e.to_string());
        self.reserve_bytes(size).map_err(oom)?;
        let alloc = match HostAllocation::new(size) {
            Ok(a) => Arc::new(a),
            Err(e) => {
                self.shared.live_bytes.fetch_sub(size, Ordering::SeqCst);
                return Err(oom(e));
            }
        };
        let ptr = alloc.ptr();
        if let Err(e) = self.shared.ledger.register(alloc) {
            self.shared.live_bytes.fetch_sub(size, Ordering::SeqCst);
            return Err(e.into_runtime(OP));
        }
        self.shared.live_allocations.fetch_add(1, Ordering::SeqCst);
        self.shared.total_host_allocs.fetch_add(1, Ordering::SeqCst);
        Ok(Region {
            ptr,
            size,
            method: Origin::Simulated,
        })
    }

    /// Gives back memory from `host_alloc`; a free of memory it never gave out, or still
    /// used by queued work, is recorded as a violation.
    pub fn host_free(&self, memory: Region) -> Result<(), RuntimeError> {
        const OP: &str = "host_free";
        self.shared.faults.check(FaultPoint::HostFree)?;
        let (addr, size) = (memory.ptr.as_ptr() as usize, memory.size);
        let found = self.shared.remove_freed(OP, &memory, Origin::Simulated)?;
        let Some(alloc) = found else {
            let e = SimError::InvalidFree { addr, size };
            self.shared.report(
                ViolationKind::InvalidFree,
                None,
                format!("{e} (method {})", memory.method),
            );
            return Err(e.into_runtime(OP));
        };
        // Counted before the live bytes fall: whoever sees none live sees every free.
        self.shared.total_host_frees.fetch_add(1, Ordering::SeqCst);
        self.shared.live_allocations.fetch_sub(1, Ordering::SeqCst);
        self.shared.live_bytes.fetch_sub(size, Ordering::SeqCst);
        // The memory itself is released when the last of its users is dropped.
        self.shared
            .report_freed_in_use(&alloc, format_args!("{size} bytes at {addr:#x} freed"));
        Ok(())
    }

    /// The granule of expandable host memory (2 MiB), unless the runtime was built without it.
    pub fn host_granularity(&self) -> Option<usize> {
        self.shared.expandable.then_some(GRANULE)
    }

    /// Reserves an address range for expandable host memory.
    pub(crate) fn host_reserve(&self, size: usize) -> Result<Region, RuntimeError> {
        expandable::reserve(self, size)
    }

    /// Maps granules of a reserved range.
    pub(crate) fn host_map(
        &self,
        range: &Region,
        offset: usize,
        size: usize,
    ) -> Result<(), RuntimeError> {
        expandable::map(self, range, offset, size, true)
    }

    /// Unmaps granules of a reserved range.
    pub(crate) fn host_unmap(
        &self,
        range: &Region,
        offset: usize,
        size: usize,
    ) -> Result<(), RuntimeError> {
        expandable::map(self, range, offset, size, false)
    }

    /// Moves the memory of the granule mapped at `from` of a reserved range to the unmapped
    /// granule at `to` (see `RangeCall::Move`).
    pub(crate) fn host_remap(
        &self,
        range: &Region,
        from: usize,
        to: usize,
    ) -> Result<(), RuntimeError> {
        expandable::remap(self, range, from, to)
    }

    /// Gives back a reserved range, none of it mapped.
    pub(crate) fn host_unreserve(&self, range: Region) -> Result<(), RuntimeError> {
        expandable::unreserve(self, range)
    }
}

thread_local! {
    /// Memory taken on this thread through a simulated memory source (allocations and maps).
    pub(super) static MEMORY_CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts a call that takes memory (an allocation or a map), on the calling thread.
pub(crate) fn count_memory_call() {
    MEMORY_CALLS.with(|c| c.set(c.get() + 1));
}

// The allocators\' side of the runtime: hidden from the runtime\'s page, whose users call the
// runtime\'s own methods.
#[doc(hidden)]
impl MemorySource for SimRuntime {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Pinned
    }

    fn alloc(&self, size: usize) -> Result<Region, RuntimeError> {
        count_memory_call();
        self.host_alloc(size)
    }

    fn free(&self, region: Region) -> Result<(), RuntimeError> {
        self.host_free(region)
    }

    fn granularity(&self) -> Option<usize> {
        self.host_granularity()
    }

    fn reserve(&self, size: usize) -> Result<Region, RuntimeError> {
        self.host_reserve(size)
    }

    fn range_call(&self, range: &Region, call: RangeCall) -> Result<(), RuntimeError> {
        call.by_granules(
            self.host_granularity(),
            |at, len| {
                count_memory_call();
                self.host_map(range, at, len)
            },
            |at, len| self.host_unmap(range, at, len),
            |from, to| self.host_remap(range, from, to),
        )
    }

    fn remaps(&self) -> bool {
        self.host_granularity().is_some()
    }

    fn unreserve(&self, range: Region) -> Result<(), RuntimeError> {
        self.host_unreserve(range)
    }
}
