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
/// if `unit` does not divide `len`), as (offset, bytes): what a [`RangeCall::Map`] maps and
/// each later [`RangeCall::Unmap`] takes.
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

/// One call on a range reserved with [`MemorySource::reserve`] ([`MemorySource::range_call`]).
/// Offsets and lengths are in bytes from the range's start, whole granules
/// ([`MemorySource::granularity`]). Each call may block for milliseconds, and is all or
/// nothing: on failure nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeCall {
    /// Maps memory at `[offset, offset + len)`, unmapped now, as consecutive units of
    /// `unit` bytes (`unit` divides `len`; `unit == len`: one mapping), each of which an
    /// `Unmap` later takes on its own, as if each had been mapped by a call of its own.
    Map {
        /// Where the span starts.
        offset: usize,
        /// Its bytes.
        len: usize,
        /// The bytes of each unit.
        unit: usize,
    },
    /// Unmaps memory mapped by `Map` and gives it back: any granules where
    /// [`MemorySource::unmaps_granules`] says so, else exactly the span of one earlier unit.
    /// A device source first waits for the device's queued work.
    Unmap {
        /// Where the span starts.
        at: usize,
        /// Its bytes.
        len: usize,
    },
    /// `Unmap` for memory that no work has used since it was mapped (a map that failed part
    /// way gives back what it mapped): no wait for the device's queued work is needed, so
    /// none is made (a device-wide synchronisation would invalidate a capture underway).
    UnmapUnused {
        /// Where the span starts.
        at: usize,
        /// Its bytes.
        len: usize,
    },
    /// Moves the memory mapped at `from` (one granule, or for a source that unmaps only whole
    /// units, exactly one unit) to the unmapped `[to, to + len)`: `from` ends unmapped, `to`
    /// mapped with the same memory, its contents undefined. No memory is taken or given
    /// back (pinned host memory is not pinned again), so it costs a fraction of an unmap and
    /// a map. Nothing may use the memory at `from` any more. Where
    /// [`MemorySource::remaps`] says so.
    Move {
        /// Where the memory is mapped now.
        from: usize,
        /// Where it goes.
        to: usize,
        /// Its bytes.
        len: usize,
    },
    /// The first half of a move: maps the memory mapped at `from` (as for `Move`) at the
    /// unmapped `[to, to + len)` too, without waiting for the work queued on `from`; until
    /// `Unalias` ends the mapping at `from`, both places map the same memory. No memory is
    /// taken. Where [`MemorySource::aliases`] says so.
    Alias {
        /// Where the memory is mapped now.
        from: usize,
        /// Where it is mapped too.
        to: usize,
        /// Its bytes.
        len: usize,
    },
    /// The second half of a move: ends the mapping at `[at, at + len)` of memory `Alias`
    /// mapped elsewhere too; no memory goes back. With `wait` it first waits for the
    /// device's queued work (as `Unmap` does); without, the caller knows that no queued
    /// work uses the place any more (an event completed).
    Unalias {
        /// Where the mapping to end starts.
        at: usize,
        /// Its bytes.
        len: usize,
        /// Whether to wait for the device's queued work first.
        wait: bool,
    },
}

impl RangeCall {
    /// The driver call it stands for, for errors.
    pub fn name(self) -> &'static str {
        match self {
            RangeCall::Map { .. } | RangeCall::Move { .. } | RangeCall::Alias { .. } => "map",
            RangeCall::Unmap { .. } | RangeCall::UnmapUnused { .. } | RangeCall::Unalias { .. } => {
                "unmap"
            }
        }
    }

    /// Makes a `Map` as one `map(offset, len)` call per unit, all or nothing: what it mapped
    /// is unmapped again with `unmap` when a later unit fails.
    pub fn map_each_unit(
        offset: usize,
        len: usize,
        unit: usize,
        mut map: impl FnMut(usize, usize) -> Result<(), RuntimeError>,
        mut unmap: impl FnMut(usize, usize) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        for (at, part) in units(offset, len, unit) {
            if let Err(e) = map(at, part) {
                for (back, part) in units(offset, at - offset, unit) {
                    let _ = unmap(back, part);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Makes this call for a source that maps and unmaps any granules in one call
    /// ([`MemorySource::unmaps_granules`]), moves one `granule` at a time, and neither waits
    /// for queued work nor aliases (pinned host memory): with `map(at, len)`,
    /// `unmap(at, len)` and `remap(from, to)`.
    pub fn by_granules(
        self,
        granule: Option<usize>,
        mut map: impl FnMut(usize, usize) -> Result<(), RuntimeError>,
        mut unmap: impl FnMut(usize, usize) -> Result<(), RuntimeError>,
        remap: impl FnOnce(usize, usize) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        match self {
            RangeCall::Map { offset, len, unit } => {
                Self::map_each_unit(offset, len, unit, &mut map, &mut unmap)
            }
            RangeCall::Unmap { at, len } | RangeCall::UnmapUnused { at, len } => unmap(at, len),
            RangeCall::Move { from, to, len } if Some(len) == granule => remap(from, to),
            _ => Err(unsupported(self.name())),
        }
    }
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
    /// default). A source that returns a granule implements `reserve`, `unreserve` and
    /// [`MemorySource::range_call`]'s `Map` and `Unmap`.
    fn granularity(&self) -> Option<usize> {
        None
    }

    /// Reserves `size` bytes of address space (a multiple of the granule), none of it
    /// mapped yet.
    fn reserve(&self, size: usize) -> Result<Region, RuntimeError> {
        let _ = size;
        Err(unsupported("reserve"))
    }

    /// Makes `call` on a reserved `range` (see [`RangeCall`] for each call). The default
    /// refuses every call.
    fn range_call(&self, range: &Region, call: RangeCall) -> Result<(), RuntimeError> {
        let _ = range;
        Err(unsupported(call.name()))
    }

    /// Whether a [`RangeCall::Unmap`] takes any granules mapped earlier (true, the default:
    /// memory is mapped granule by granule), or only exactly one earlier unit of a
    /// [`RangeCall::Map`] (false: each unit is one piece of memory, which is faster to get).
    fn unmaps_granules(&self) -> bool {
        true
    }

    /// Whether [`RangeCall::Move`] is offered (false, the default).
    fn remaps(&self) -> bool {
        false
    }

    /// Whether [`RangeCall::Alias`] and [`RangeCall::Unalias`] are offered (false, the
    /// default).
    fn aliases(&self) -> bool {
        false
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
