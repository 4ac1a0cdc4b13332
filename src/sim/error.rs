//! `SimError`: every way a call into the simulated runtime can be refused.
//!
//! Owns no state. Misuse of the simulation (bad ranges, capture misuse, memory it does not
//! own) is reported through this enum and never by a panic.

use crate::actors::RuntimeError;

/// Why the simulated runtime refused a call.
///
/// ```
/// use pinpool::sim::{SimError, SimRuntime};
///
/// let sim = SimRuntime::new();
/// let stream = sim.new_stream()?;
/// assert!(matches!(stream.end_capture(), Err(SimError::NotCapturing { .. })));
/// # Ok::<(), pinpool::RuntimeError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// `begin_capture` on a stream that is already capturing.
    #[error("stream {stream} is already capturing")]
    AlreadyCapturing {
        /// The stream's id.
        stream: u64,
    },
    /// `end_capture` on a stream that is not capturing.
    #[error("stream {stream} is not capturing")]
    NotCapturing {
        /// The stream's id.
        stream: u64,
    },
    /// The capture was invalidated, as CUDA does when an event recorded during capture is
    /// queried; the graph is discarded.
    #[error("capture on stream {stream} was invalidated by querying a captured event")]
    CaptureInvalidated {
        /// The stream's id.
        stream: u64,
    },
    /// An operation that CUDA forbids on a capturing stream (e.g. synchronize).
    #[error("{op} is not allowed while stream {stream} is capturing")]
    IllegalDuringCapture {
        /// The stream's id.
        stream: u64,
        /// The refused operation.
        op: &'static str,
    },
    /// An event recorded during capture was queried (this also invalidates the capture).
    #[error("event was recorded while stream {stream} was capturing and cannot be queried")]
    CapturedEventQueried {
        /// The id of the stream the event was recorded on.
        stream: u64,
    },
    /// A host range that does not lie within one live allocation of this runtime.
    #[error("{len} bytes at {addr:#x} are not within live memory allocated by this runtime")]
    ForeignHostMemory {
        /// Start of the range.
        addr: usize,
        /// Length of the range.
        len: usize,
    },
    /// A device range that does not lie within one live allocation of a simulated device
    /// (for a stream's own operations: of the stream's device).
    #[error("{len} bytes at {addr:#x} are not within live memory of simulated device {device}")]
    ForeignDeviceMemory {
        /// Start of the range.
        addr: usize,
        /// Length of the range.
        len: usize,
        /// The device the range had to be on.
        device: usize,
    },
    /// A device ordinal past the last simulated device.
    #[error("no simulated device {ordinal}: {count} device(s)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the runtime has.
        count: usize,
    },
    /// A `host_free` whose address and size do not match a live allocation of this runtime.
    #[error("{size} bytes at {addr:#x} were not allocated by this runtime or were already freed")]
    InvalidFree {
        /// Address passed to `host_free`.
        addr: usize,
        /// Size passed to `host_free`.
        size: usize,
    },
    /// A copy that runs past the end of a device buffer.
    #[error("{len} bytes do not fit in a device buffer of {capacity} bytes")]
    DeviceOutOfBounds {
        /// Requested length.
        len: usize,
        /// The device buffer's length.
        capacity: usize,
    },
    /// A zero-length request where CUDA would refuse or return nothing usable.
    #[error("{op}: size must be non-zero")]
    ZeroSize {
        /// The refused operation.
        op: &'static str,
    },
    /// The simulated host is out of memory: the system allocator refused, the size cannot be
    /// laid out, or the configured memory limit would be exceeded.
    #[error("out of host memory allocating {size} bytes")]
    OutOfMemory {
        /// The requested size.
        size: usize,
    },
    /// A stream created by a different `SimRuntime` was passed to this one.
    #[error("stream {stream} belongs to another SimRuntime")]
    ForeignStream {
        /// The stream's id.
        stream: u64,
    },
    /// An internal thread of the simulation has stopped (it can only stop if it panicked).
    #[error("simulation thread `{0}` has stopped")]
    ThreadGone(&'static str),
}

impl SimError {
    /// Converts into the allocators' runtime error ([`crate::RuntimeError`]), naming the
    /// failed operation.
    pub fn into_runtime(self, op: &'static str) -> RuntimeError {
        RuntimeError::new(op, self.to_string())
    }
}
