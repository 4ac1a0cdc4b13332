//! The `Runtime` trait: how the engine orders reuse after GPU work.
//!
//! The engine knows nothing of CUDA. It asks a `Runtime` for events recorded on streams,
//! whether an event has completed, and whether a stream is being captured into a graph. The
//! memory it manages comes from a [`crate::vocab::memory::MemorySource`], apart from this trait, so
//! that one engine serves pinned host memory and device memory alike. `pinpool` implements
//! both twice: the real CUDA runtime and the simulated one.
//!
//! Contract (the engine relies on each point):
//! - `record_event` is called from the thread that frees a buffer (never from an actor),
//!   so that the event orders after every operation enqueued on the stream so far.
//! - `query_event` is never called for an event recorded while its stream was capturing, and
//!   `stream_idle` never for a capturing stream. `stream_idle` is called from the freeing
//!   thread too: `true` must mean that everything enqueued on the stream before the call has
//!   run (a block the stream used is then reused with no event).
//! - Every event obtained from `record_event` is handed back exactly once, through
//!   `release_event` or as the `spare` of `record_event_reusing` (which hands back or
//!   re-records it), so that the runtime can pool events. An event is passed as a spare
//!   only once it has completed, by the block that owns it.

use std::fmt;

/// An error reported by a runtime (a failed CUDA call, an injected fault in the simulation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeError {
    /// What was being done, e.g. `"cuMemHostAlloc"`.
    pub op: &'static str,
    /// The runtime's own description of what went wrong.
    pub message: String,
    /// True when the failure means "out of memory": the allocator empties its caches and
    /// retries once.
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

/// What the allocators need from CUDA streams and events (or from a simulation of them).
pub trait Runtime: Send + Sync + 'static {
    /// A stream on which device work is enqueued. Cheap to clone (an `Arc`, or an id).
    type Stream: Clone + Send + Sync + 'static;
    /// An event recorded on a stream (shared only to be queried or waited for).
    type Event: Send + Sync + 'static;

    /// A short name for logs and reports, e.g. `"cuda"` or `"sim"`.
    fn name(&self) -> &'static str;

    /// A new stream, on the runtime's first device (the same call on every runtime: a
    /// non-blocking stream on CUDA, a simulated one on the sim).
    fn new_stream(&self) -> Result<Self::Stream, RuntimeError>;

    /// The stream's identity.
    fn stream_id(&self, stream: &Self::Stream) -> StreamId;

    /// Whether events can be recorded on `stream` by this runtime: a stream of another
    /// runtime (another simulated device, say) is refused where it is recorded on a buffer,
    /// since the block could otherwise never be known to be free. The default accepts every
    /// stream (CUDA's streams all belong to the process's one driver).
    fn owns_stream(&self, stream: &Self::Stream) -> bool {
        let _ = stream;
        true
    }

    /// Whether work enqueued on `stream` now is being captured into a graph rather than run.
    fn is_capturing(&self, stream: &Self::Stream) -> Result<bool, RuntimeError>;

    /// Records an event on `stream` that completes once all work enqueued on it so far has.
    fn record_event(&self, stream: &Self::Stream) -> Result<Self::Event, RuntimeError>;

    /// [`Runtime::record_event`], given a completed event of this runtime's that the caller
    /// no longer needs (`spare`), which the runtime may record again instead of taking
    /// another. The default hands `spare` back and records a new one.
    fn record_event_reusing(
        &self,
        stream: &Self::Stream,
        spare: Option<Self::Event>,
    ) -> Result<Self::Event, RuntimeError> {
        if let Some(e) = spare {
            self.release_event(e);
        }
        self.record_event(stream)
    }

    /// Whether every piece of work enqueued on `stream` so far has completed (nothing of it
    /// is pending or running), so that a block the stream used needs no event to be reused.
    /// Never called for a capturing stream. The default says no: the caller records an event.
    fn stream_idle(&self, stream: &Self::Stream) -> Result<bool, RuntimeError> {
        let _ = stream;
        Ok(false)
    }

    /// Makes work enqueued on `stream` from now on wait until `event` has completed, without
    /// the calling thread waiting (CUDA: `cuStreamWaitEvent`): what lets memory that work on
    /// one stream used serve work on another at once. Never called for an event recorded
    /// during capture, nor for a capturing stream. The default refuses: the caller then
    /// does without.
    fn stream_wait_event(
        &self,
        stream: &Self::Stream,
        event: &Self::Event,
    ) -> Result<(), RuntimeError> {
        let _ = (stream, event);
        Err(RuntimeError::new(
            "stream_wait_event",
            "not supported by this runtime",
        ))
    }

    /// Whether `event` has completed. Never called for an event recorded during capture.
    fn query_event(&self, event: &Self::Event) -> Result<bool, RuntimeError>;

    /// Hands an event back (to be destroyed or reused).
    fn release_event(&self, event: Self::Event);
}
