//! `pinpool-actors`: the engine of pinpool.
//!
//! Pool actors own pinned blocks and their free lists, an event-poller actor owns every block
//! that waits on GPU work, and a router actor owns the capture registry and publishes the
//! routing table. The engine is generic over [`Runtime`], which supplies host memory, events
//! and stream-capture state; it contains no CUDA.
//!
//! Most users want the `pinpool` crate, which wraps this engine in `PinnedAllocator`.

// Blocks travel between threads and actors as `Box<Block>` so that moving one is a pointer
// copy and the allocation is made once per block, not once per trip.
#![allow(clippy::vec_box, clippy::boxed_local)]

mod block;
mod carve;
mod engine;
mod error;
mod history;
mod keepalive;
mod lease;
mod limit;
mod observe;
mod policy;
mod poller;
mod pool;
mod pool_id;
mod ready;
mod router;
pub mod runtime;
mod shard;
mod snapshot;
mod spawn;
mod stats;

pub use engine::{Engine, EngineBuilder};
pub use error::Error;
pub use history::{History, HistoryContext, TraceAction, TraceEntry};
pub use lease::Lease;
pub use observe::{OomObserver, OomReport, TraceTracker};
pub use policy::{
    BestFit, BlockLayout, Carving, PowerOfTwo, SizeClass, SizePolicy, TieredPowerOfTwo,
};
pub use pool::{EmptyReport, Inventory};
pub use pool_id::PoolId;
pub use router::StreamFilter;
pub use runtime::{HostMemory, PinMethod, Runtime, RuntimeError, StreamId};
pub use snapshot::{
    BaseAllocation, BlockInfo, BlockStatus, CacheInfo, ConfigInfo, MemorySnapshot, SegmentInfo,
};
pub use stats::{DurationStat, HostStats, Stat};
