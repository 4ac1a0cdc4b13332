//! The `Runtime` trait: everything the engine needs from the outside world.
//!
//! The engine knows nothing of CUDA. It asks a `Runtime` for host memory, for events
//! recorded on streams, whether an event has completed, and whether a stream is being
//! captured into a graph. `pinpool` implements it twice: the real CUDA runtime and the
//! simulated one.
//!
//! Contract (the engine relies on each point):
//! - `host_alloc` / `host_free` (and the expandable calls `host_reserve`, `host_map`,
//!   `host_unmap`, `host_unreserve`) may block for milliseconds; the engine calls them only on
//!   blocking threads, never on an executor thread or on the cached path.
//! - `record_event` is called from the thread that frees a buffer (never from an actor),
//!   so that the event orders after every operation enqueued on the stream so far.
//! - `query_event` is never called for an event recorded while its stream was capturing.
//! - Every event obtained from `record_event` is handed back exactly once, through
//!   `release_event`, so that the runtime can pool events.

use std::fmt;
use std::ptr::NonNull;

/// An error reported by a runtime (a failed CUDA call, an injected fault in the simulation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeError {
    /// What was being done, e.g. `"cuMemHostAlloc"`.
    pub op: &'static str,
    /// The runtime's own description of what went wrong.
    pub message: String,
    /// True when the failure means "out of memory": the engine empties its cache and retries once.
    pub out_of_memory: bool,
}

impl RuntimeError {
    /// A failure of `op` described by `message`.
    pub fn new(op: &'static str, message: impl Into<String>) -> Self {
        Self {
            op,
            message: message.into(),
            out_of_memory: false,
        }
    }

    /// An out-of-memory failure of `op`.
    pub fn out_of_memory(op: &'static str, message: impl Into<String>) -> Self {
        Self {
            op,
            message: message.into(),
            out_of_memory: true,
        }
    }
}

impl fmt::Display for RuntimeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.op, self.message)
    }
}

impl std::error::Error for RuntimeError {}

/// A stream's identity, stable for the stream's lifetime and unique among live streams of
/// one runtime. Used to de-duplicate `record_stream` calls and to route captures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

/// How a piece of pinned host memory was obtained, so that it is freed the matching way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PinMethod {
    /// The runtime's own pinned allocation call (`cuMemHostAlloc`).
    HostAlloc,
    /// Ordinary pages, faulted in and then registered (`mmap` + `cuMemHostRegister`).
    Register,
    /// Plain heap memory standing in for pinned memory (the simulated runtime).
    Simulated,
    /// Granules of pinned memory mapped into an address range reserved up front
    /// ([`Runtime::host_reserve`]): freed with `host_unmap`, never with `host_free`.
    Mapped,
}

impl fmt::Display for PinMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PinMethod::HostAlloc => "host_alloc",
            PinMethod::Register => "register",
            PinMethod::Simulated => "simulated",
            PinMethod::Mapped => "mapped",
        })
    }
}

/// One piece of pinned host memory as the runtime handed it out: `size` bytes at `ptr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    /// Start of the range; aligned to at least 64 bytes.
    pub ptr: NonNull<u8>,
    /// Length of the range in bytes (at least what was asked for).
    pub size: usize,
    /// How it was pinned; `host_free` uses it to choose the matching release call.
    pub method: PinMethod,
}

// SAFETY: `HostMemory` is an address range, not a reference: the engine guarantees that
// exactly one owner (a pool's books, or the buffer it is lent to) touches the bytes at a time.
unsafe impl Send for HostMemory {}
// SAFETY: as above; sharing the descriptor shares no access to the bytes.
unsafe impl Sync for HostMemory {}

/// What the engine needs from CUDA (or from a simulation of it).
pub trait Runtime: Send + Sync + 'static {
    /// A stream on which device work is enqueued. Cheap to clone (an `Arc`, or an id).
    type Stream: Clone + Send + Sync + 'static;
    /// An event recorded on a stream.
    type Event: Send + 'static;

    /// A short name for logs and reports, e.g. `"cuda"` or `"sim"`.
    fn name(&self) -> &'static str;

    /// Gets `size` bytes of pinned host memory. May block for milliseconds.
    fn host_alloc(&self, size: usize) -> Result<HostMemory, RuntimeError>;

    /// Gives back memory obtained from `host_alloc`. May block for milliseconds.
    fn host_free(&self, memory: HostMemory) -> Result<(), RuntimeError>;

    /// Expandable host memory: the granule (bytes) in which pinned memory is mapped into a
    /// range reserved with [`Runtime::host_reserve`], or `None` when the runtime cannot
    /// (the default). A runtime that returns a granule implements the four calls below.
    fn host_granularity(&self) -> Option<usize> {
        None
    }

    /// Reserves `size` bytes of address space (a multiple of the granule), none of it
    /// mapped yet. The range's method is [`PinMethod::Mapped`].
    fn host_reserve(&self, size: usize) -> Result<HostMemory, RuntimeError> {
        let _ = size;
        Err(RuntimeError::new(
            "host_reserve",
            "not supported by this runtime",
        ))
    }

    /// Maps pinned memory at `[offset, offset + size)` of a reserved `range`, one granule
    /// at a time, so that each granule can be unmapped on its own later; readable and
    /// writable by the host and the device. Both are multiples of the granule; the granules
    /// are unmapped now. All or nothing: on failure nothing stays mapped. May block for
    /// milliseconds.
    fn host_map(&self, range: &HostMemory, offset: usize, size: usize) -> Result<(), RuntimeError> {
        let _ = (range, offset, size);
        Err(RuntimeError::new(
            "host_map",
            "not supported by this runtime",
        ))
    }

    /// Unmaps granules mapped with [`Runtime::host_map`] (any of them, not only whole
    /// earlier calls) and gives their memory back. May block for milliseconds.
    fn host_unmap(
        &self,
        range: &HostMemory,
        offset: usize,
        size: usize,
    ) -> Result<(), RuntimeError> {
        let _ = (range, offset, size);
        Err(RuntimeError::new(
            "host_unmap",
            "not supported by this runtime",
        ))
    }

    /// Gives back a range reserved with [`Runtime::host_reserve`], none of it mapped.
    fn host_unreserve(&self, range: HostMemory) -> Result<(), RuntimeError> {
        let _ = range;
        Err(RuntimeError::new(
            "host_unreserve",
            "not supported by this runtime",
        ))
    }

    /// The stream's identity.
    fn stream_id(&self, stream: &Self::Stream) -> StreamId;

    /// Whether work enqueued on `stream` now is being captured into a graph rather than run.
    fn is_capturing(&self, stream: &Self::Stream) -> Result<bool, RuntimeError>;

    /// Records an event on `stream` that completes once all work enqueued on it so far has.
    fn record_event(&self, stream: &Self::Stream) -> Result<Self::Event, RuntimeError>;

    /// Whether `event` has completed. Never called for an event recorded during capture.
    fn query_event(&self, event: &Self::Event) -> Result<bool, RuntimeError>;

    /// Hands an event back (to be destroyed or reused).
    fn release_event(&self, event: Self::Event);
}
