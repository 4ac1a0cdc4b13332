//! Memory: where the engine's fresh memory comes from and goes back to.
//!
//! The engine manages one kind of memory per pool — pinned host memory, or the memory of one
//! device — through a [`MemorySource`]. It knows a piece of memory only as a [`Region`]: an
//! address, a length, and how it was obtained ([`Origin`]), so that it goes back the way it
//! came. It never reads or writes the bytes itself.
//!
//! Contract (the engine relies on each point):
//! - every call may block for milliseconds: the engine makes them only on blocking threads,
//!   never on an executor thread or on the cached path (invariant 6);
//! - a region from `alloc` goes back through `free`, exactly once; a region from `reserve`
//!   goes back through `unreserve`, once everything mapped into it has been unmapped.

use std::fmt;
use std::ptr::NonNull;

use crate::vocab::runtime::RuntimeError;

/// How a region of memory was obtained, so that it is given back the matching way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// The runtime's own pinned allocation call (`cuMemHostAlloc`).
    HostAlloc,
    /// Ordinary pages, faulted in and then registered (`mmap` + `cuMemHostRegister`).
    Register,
    /// Plain heap memory standing in for pinned memory (the simulated runtime).
    Simulated,
    /// Granules of pinned memory mapped into an address range reserved up front
    /// ([`MemorySource::reserve`]): freed with `unmap`, never with `free`.
    Mapped,
    /// Device memory from the driver's allocation call (`cuMemAlloc`).
    Device,
    /// Granules of device memory mapped into a reserved device address range.
    DeviceMapped,
    /// Simulated device memory.
    SimulatedDevice,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Origin::HostAlloc => "host_alloc",
            Origin::Register => "register",
            Origin::Simulated => "simulated",
            Origin::Mapped => "mapped",
            Origin::Device => "device",
            Origin::DeviceMapped => "device_mapped",
            Origin::SimulatedDevice => "simulated_device",
        })
    }
}

/// One region of memory as a source handed it out: `size` bytes at `ptr`. For device memory
/// `ptr` is the device address, not dereferenceable on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Start of the range; aligned to at least 64 bytes.
    pub ptr: NonNull<u8>,
    /// Length of the range in bytes (at least what was asked for).
    pub size: usize,
    /// How it was obtained; the source uses it to choose the matching release call.
    pub method: Origin,
}

impl Region {
    /// The start address as a number.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// `len` bytes at `offset` of this region (the caller keeps them inside it).
    pub fn part(&self, offset: usize, len: usize) -> Region {
        Region {
            // Inside the region (callers pass a range of it), so not null.
            ptr: NonNull::new(self.ptr.as_ptr().wrapping_add(offset)).unwrap_or(self.ptr),
            size: len,
            method: self.method,
        }
    }
}

// SAFETY: a `Region` is an address range, not a reference: the engine guarantees that exactly
// one owner (a pool's books, or the buffer it is lent to) touches the bytes at a time.
unsafe impl Send for Region {}
// SAFETY: as above; sharing the descriptor shares no access to the bytes.
unsafe impl Sync for Region {}

/// Which memory a source gives: what snapshots, stats and logs call it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemoryKind {
    /// Page-locked host memory.
    Pinned,
    /// The memory of the device with this ordinal.
    Device(usize),
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Pinned => f.write_str("pinned"),
            MemoryKind::Device(d) => write!(f, "device {d}"),
        }
    }
}

/// The units `[offset, offset + len)` is mapped as, `unit` bytes each (the last one shorter
/// if `unit` does not divide `len`), as (offset, bytes): what
/// [`MemorySource::map_units`] maps and each later [`MemorySource::unmap`] takes.
pub(crate) fn units(
    offset: usize,
    len: usize,
    unit: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let end = offset + len;
    (offset..end)
        .step_by(unit.max(1))
        .map(move |at| (at, unit.max(1).min(end - at)))
}

fn unsupported(op: &'static str) -> RuntimeError {
    RuntimeError::new(op, "not supported by this memory source")
}

/// Where a pool's fresh memory comes from: pinned host memory, or one device's memory.
pub trait MemorySource: Send + Sync + 'static {
    /// Which memory this is.
    fn kind(&self) -> MemoryKind;

    /// Gets `size` bytes. May block for milliseconds.
    fn alloc(&self, size: usize) -> Result<Region, RuntimeError>;

    /// Gives back memory obtained from `alloc`. May block for milliseconds.
    fn free(&self, region: Region) -> Result<(), RuntimeError>;

    /// Expandable memory: the granule (bytes) in which memory is mapped into a range
    /// reserved with [`MemorySource::reserve`], or `None` when the source cannot (the
    /// default). A source that returns a granule implements the four calls below.
    fn granularity(&self) -> Option<usize> {
        None
    }

    /// Reserves `size` bytes of address space (a multiple of the granule), none of it
    /// mapped yet.
    fn reserve(&self, size: usize) -> Result<Region, RuntimeError> {
        let _ = size;
        Err(unsupported("reserve"))
    }

    /// Maps memory at `[offset, offset + size)` of a reserved `range`. Both are multiples of
    /// the granule; the granules are unmapped now. All or nothing: on failure nothing stays
    /// mapped. May block for milliseconds. Whether each granule can later be unmapped on its
    /// own, or only the whole of what one call mapped, is [`MemorySource::unmaps_granules`].
    fn map(&self, range: &Region, offset: usize, size: usize) -> Result<(), RuntimeError> {
        let _ = (range, offset, size);
        Err(unsupported("map"))
    }

    /// Maps `[offset, offset + size)` of a reserved `range` as consecutive units of `unit`
    /// bytes (`unit` divides `size`), each of which [`MemorySource::unmap`] later takes on
    /// its own, as if each had been mapped by a [`MemorySource::map`] call of its own. All or
    /// nothing, like `map`. The default makes those calls; a source may map the units in
    /// fewer driver calls (CUDA: one access grant for the whole span).
    fn map_units(
        &self,
        range: &Region,
        offset: usize,
        size: usize,
        unit: usize,
    ) -> Result<(), RuntimeError> {
        for (at, len) in units(offset, size, unit) {
            if let Err(e) = self.map(range, at, len) {
                for (back, len) in units(offset, at - offset, unit) {
                    let _ = self.unmap(range, back, len);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Whether [`MemorySource::unmap`] takes any granules mapped earlier (true, the default:
    /// `map` maps granule by granule), or only exactly the range of one earlier `map` call
    /// (false: `map` backs a call with one piece of memory, which is faster to get).
    fn unmaps_granules(&self) -> bool {
        true
    }

    /// Unmaps granules mapped with [`MemorySource::map`] (see
    /// [`MemorySource::unmaps_granules`] for which ranges) and gives their memory back. May
    /// block for milliseconds.
    fn unmap(&self, range: &Region, offset: usize, size: usize) -> Result<(), RuntimeError> {
        let _ = (range, offset, size);
        Err(unsupported("unmap"))
    }

    /// [`MemorySource::unmap`] for memory that no work has used since it was mapped (a map
    /// call that failed part way gives back what it mapped): no wait for the device's queued
    /// work is needed, so none is made (a device-wide synchronisation would invalidate a
    /// capture underway). The default unmaps as `unmap` does.
    fn unmap_unused(&self, range: &Region, offset: usize, size: usize) -> Result<(), RuntimeError> {
        self.unmap(range, offset, size)
    }

    /// Whether [`MemorySource::remap`] moves a mapped granule to another place of its range
    /// without giving its memory back (false, the default: it is not offered).
    fn remaps(&self) -> bool {
        false
    }

    /// Moves the memory of the granule mapped at `from` in a reserved `range` to the
    /// granule at `to`, unmapped now (both offsets multiples of the granule): afterwards
    /// `from` is unmapped and `to` mapped, with the same memory behind it and its contents
    /// undefined. No memory is taken or given back, so it costs a fraction of an unmap
    /// and a map (pinned host memory is not pinned again). All or nothing: on failure
    /// `from` stays mapped and `to` unmapped. Offered where [`MemorySource::remaps`] says
    /// so (for a source that unmaps only whole map calls, `from` was mapped by a call of
    /// its own of one granule); nothing may use the granule at `from` any more. May block
    /// for milliseconds.
    fn remap(&self, range: &Region, from: usize, to: usize) -> Result<(), RuntimeError> {
        let _ = (range, from, to);
        Err(unsupported("remap"))
    }

    /// [`MemorySource::remap`] for `len` bytes: moves the memory mapped at `from` (for a
    /// source that unmaps only whole map calls, exactly the run of one earlier map call) to
    /// the unmapped `[to, to + len)` of the same `range`. No memory is taken or given back.
    /// All or nothing. Offered where [`MemorySource::remaps`] says so; nothing may use the
    /// memory at `from` any more (a source whose `unmap` waits for queued device work waits
    /// here too). The default moves one granule with `remap` and refuses other lengths.
    fn remap_run(
        &self,
        range: &Region,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<(), RuntimeError> {
        if Some(len) != self.granularity() {
            return Err(unsupported("remap_run"));
        }
        self.remap(range, from, to)
    }

    /// Whether [`MemorySource::alias_run`] and [`MemorySource::unalias_run`] are offered
    /// (false, the default).
    fn aliases(&self) -> bool {
        false
    }

    /// Maps the memory mapped at `from` (for a source that unmaps only whole map calls,
    /// exactly the run of one earlier map call) at the unmapped `[to, to + len)` of the same
    /// `range` too, without waiting for the work queued on `from`: until
    /// [`MemorySource::unalias_run`] ends the mapping at `from`, both places map the same
    /// memory. The first half of a move whose second half waits for that work to have run
    /// (the caller knows when: an event). No memory is taken. All or nothing.
    fn alias_run(
        &self,
        range: &Region,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<(), RuntimeError> {
        let _ = (range, from, to, len);
        Err(unsupported("alias_run"))
    }

    /// Ends the mapping at `[offset, offset + len)` of memory that
    /// [`MemorySource::alias_run`] mapped elsewhere too. No memory goes back. With `wait`
    /// it first waits for the device's queued work (as `unmap` does); without, the caller
    /// knows that no queued work uses the place any more.
    fn unalias_run(
        &self,
        range: &Region,
        offset: usize,
        len: usize,
        wait: bool,
    ) -> Result<(), RuntimeError> {
        let _ = (range, offset, len, wait);
        Err(unsupported("unalias_run"))
    }

    /// Bytes the source could still give, as its driver reports them (`None`: it cannot
    /// tell; pinned host memory). Out-of-memory reports carry it.
    fn free_bytes(&self) -> Option<usize> {
        None
    }

    /// Gives back a range reserved with [`MemorySource::reserve`], none of it mapped.
    fn unreserve(&self, range: Region) -> Result<(), RuntimeError> {
        let _ = range;
        Err(unsupported("unreserve"))
    }
}
