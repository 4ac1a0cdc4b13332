//! Simulated expandable host memory: address ranges reserved up front and mapped granule
//! by granule (`Runtime::host_reserve`, `host_map`, `host_unmap`, `host_unreserve`), as the
//! CUDA virtual memory calls do with host locations.
//!
//! A reserved range is one allocation in the ledger whose unmapped granules are not live:
//! a copy or host access that touches one is refused like an access outside any
//! allocation. Mapped bytes count as live bytes under the memory limit; a reservation
//! counts as a live allocation of no bytes until it is given back, and each granule mapped
//! or unmapped as one host allocation made or given back (`total_host_allocs`,
//! `total_host_frees`). Misuse (mapping a mapped
//! granule, unmapping an unmapped one, giving back a range that still maps some) is
//! refused with an error and recorded as an invalid free where memory would be lost.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::actors::{Origin, Region, RuntimeError};

use super::error::SimError;
use super::memory::HostAllocation;
use super::{FaultPoint, SimRuntime, ViolationKind};

/// The granule of simulated expandable memory (CUDA's host granule on x86-64).
pub(crate) const GRANULE: usize = 2 << 20;

fn refused(op: &'static str, what: String) -> RuntimeError {
    RuntimeError::new(op, what)
}

#[cfg(unix)]
pub(super) fn reserve(sim: &SimRuntime, size: usize) -> Result<Region, RuntimeError> {
    const OP: &str = "host_reserve";
    if !sim.shared.expandable {
        return Err(refused(OP, "expandable host memory is turned off".into()));
    }
    let alloc = HostAllocation::reserve(size, GRANULE)
        .map_err(|e| RuntimeError::out_of_memory(OP, e.to_string()))?;
    let ptr = alloc.ptr();
    sim.shared
        .ledger
        .register(Arc::new(alloc))
        .map_err(|e| e.into_runtime(OP))?;
    sim.shared.live_allocations.fetch_add(1, Ordering::SeqCst);
    Ok(Region {
        ptr,
        size,
        method: Origin::Mapped,
    })
}

#[cfg(not(unix))]
pub(super) fn reserve(_: &SimRuntime, _: usize) -> Result<Region, RuntimeError> {
    Err(refused(
        "host_reserve",
        "not supported on this platform".into(),
    ))
}

/// The reserved range `range` describes, if it is one of this runtime's.
fn reserved(
    sim: &SimRuntime,
    op: &'static str,
    range: &Region,
) -> Result<Arc<HostAllocation>, RuntimeError> {
    let (addr, size) = (range.ptr.as_ptr() as usize, range.size);
    let found = if range.method == Origin::Mapped {
        sim.shared
            .ledger
            .find(addr, size)
            .map_err(|e| e.into_runtime(op))?
    } else {
        None
    };
    found.ok_or_else(|| {
        refused(
            op,
            format!("{size} bytes at {addr:#x} are not a reserved range"),
        )
    })
}

/// Maps (`map`) or unmaps whole granules of a reserved range.
pub(super) fn map(
    sim: &SimRuntime,
    range: &Region,
    offset: usize,
    size: usize,
    map: bool,
) -> Result<(), RuntimeError> {
    let op = if map { "host_map" } else { "host_unmap" };
    sim.shared.faults.check(if map {
        FaultPoint::HostAlloc
    } else {
        FaultPoint::HostFree
    })?;
    let alloc = reserved(sim, op, range)?;
    if map {
        sim.reserve_bytes(size)
            .map_err(|e| RuntimeError::out_of_memory(op, e.to_string()))?;
    }
    #[cfg(unix)]
    let done = alloc.set_mapped(offset, size, map);
    #[cfg(not(unix))]
    let done = false;
    if !done {
        if map {
            sim.shared.live_bytes.fetch_sub(size, Ordering::SeqCst);
        } else {
            sim.shared.report(
                ViolationKind::InvalidFree,
                None,
                format!("unmap of {size} bytes at offset {offset:#x}: not whole mapped granules"),
            );
        }
        return Err(refused(
            op,
            format!(
                "{size} bytes at offset {offset:#x} are not whole granules that can be {}mapped",
                if map { "" } else { "un" }
            ),
        ));
    }
    // Each granule counts as one allocation made and one given back.
    let granules = (size / GRANULE) as u64;
    if map {
        sim.shared
            .total_host_allocs
            .fetch_add(granules, Ordering::SeqCst);
    } else {
        // Counted before the live bytes fall: whoever sees none live sees every free.
        sim.shared
            .total_host_frees
            .fetch_add(granules, Ordering::SeqCst);
        sim.shared.live_bytes.fetch_sub(size, Ordering::SeqCst);
    }
    Ok(())
}

/// Moves the memory of the granule mapped at `from` of a reserved range to the unmapped
/// granule at `to`: the live bytes stay as they are, nothing counts as allocated or freed,
/// and the contents are not carried over (the granule at `to` reads zeros until written).
/// All or nothing.
pub(super) fn remap(
    sim: &SimRuntime,
    range: &Region,
    from: usize,
    to: usize,
) -> Result<(), RuntimeError> {
    const OP: &str = "host_remap";
    sim.shared.faults.check(FaultPoint::HostAlloc)?;
    let alloc = reserved(sim, OP, range)?;
    #[cfg(unix)]
    let done = alloc.set_mapped(to, GRANULE, true) && {
        let unmapped = alloc.set_mapped(from, GRANULE, false);
        if !unmapped {
            // `from` was not mapped: `to` goes back to unmapped.
            alloc.set_mapped(to, GRANULE, false);
        }
        unmapped
    };
    #[cfg(not(unix))]
    let done = false;
    if !done {
        return Err(refused(
            OP,
            format!(
                "granule at offset {from:#x} is not mapped, or the one at {to:#x} is not \
                 an unmapped granule of the range"
            ),
        ));
    }
    sim.shared.host_remaps.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// Gives a reserved range back; refused while any granule is mapped.
pub(super) fn unreserve(sim: &SimRuntime, range: Region) -> Result<(), RuntimeError> {
    const OP: &str = "host_unreserve";
    let alloc = reserved(sim, OP, &range)?;
    #[cfg(unix)]
    if alloc.any_mapped() {
        let e = SimError::InvalidFree {
            addr: range.ptr.as_ptr() as usize,
            size: range.size,
        };
        sim.shared.report(
            ViolationKind::InvalidFree,
            None,
            format!("{e} (granules still mapped)"),
        );
        return Err(e.into_runtime(OP));
    }
    drop(alloc);
    let removed = sim
        .shared
        .ledger
        .remove(range.ptr.as_ptr() as usize, range.size)
        .map_err(|e| e.into_runtime(OP))?;
    if removed.is_some() {
        sim.shared.live_allocations.fetch_sub(1, Ordering::SeqCst);
    }
    Ok(())
}
