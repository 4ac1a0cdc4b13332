//! `pinpool-actors`: the engine of pinpool.
//!
//! Pool actors own pinned blocks and their free lists, an event-poller actor owns every block
//! that waits on GPU work, and a router actor owns the capture registry and publishes the
//! routing table. The engine is generic over [`Runtime`], which supplies host memory, events
//! and stream-capture state; it contains no CUDA.

pub mod runtime;

pub use runtime::{HostMemory, PinMethod, Runtime, RuntimeError, StreamId};
