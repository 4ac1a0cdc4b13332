//! pinpool: a caching allocator for CUDA pinned (page-locked) host memory, run as a small
//! service of actors on tokio.
//!
//! Fresh pinned memory costs milliseconds and takes a driver-wide lock, so servers must reuse
//! it, and may reuse a buffer only once the GPU work that touches it is done. pinpool caches
//! pinned blocks by size class, hands them out again on a path that involves no actor and no
//! CUDA call, and holds back every block that a stream used until an event recorded on that
//! stream has completed.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), pinpool::Error> {
//! use pinpool::PinnedAllocator;
//!
//! let pool = PinnedAllocator::builder().build()?;
//! let stream = pool.runtime().stream();
//! let mut buf = pool.alloc(1 << 20).await?;
//! buf.fill(1);
//! buf.record_stream(&stream)?; // reuse waits for this stream's work
//! drop(buf); // back to the pool, ordered by an event
//! pool.empty_cache().await?;
//! println!("{:?}", pool.stats().to_map());
//! # Ok(()) }
//! ```
//!
//! Crate layout: the engine (actors, messages, size classes) lives in `pinpool-actors` and
//! knows nothing of CUDA; this crate implements its [`Runtime`] twice — [`sim`] and, with the
//! `cuda` feature, `cuda` — and gives it its public face. Tuned size policies and the
//! engine under an allocator, for tools, are in [`tuning`]: they follow the engine crate's
//! releases.

mod allocator;
mod buffer;
mod buffer_set;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod history;
mod memviz;
pub mod plan;
pub mod report;
pub mod sim;
pub mod trace;
pub mod tuning;

pub use allocator::{host_memory_bytes, Builder, PinnedAllocator};
pub use buffer::PinnedBuffer;
pub use buffer_set::{BufferSet, TakenBuffers};
pub use device::{
    CheckpointDelta, DeviceAllocator, DeviceBuffer, DeviceBuilder, DeviceRuntime, IpcHandle,
    IpcMemory, MappedHandle, IPC_HANDLE_BYTES, MAX_MAPPED_HANDLES,
};
pub use history::ReportError;
pub use pinpool_actors::{
    BaseAllocation, BlockInfo, BlockStatus, CacheInfo, ConfigInfo, DeviceStats, DurationStat,
    EmptyReport, Error, HostStats, MemoryKind, MemorySnapshot, OomCause, PoolCheckpoint, PoolId,
    Runtime, RuntimeError, SegmentInfo, Stat, StatArray, StreamId,
};
pub use pinpool_actors::{History, HistoryContext, OomReport, TraceAction, TraceEntry};

// The engine's vocabulary that the runtimes here implement: not part of this crate's API
// (tools reach it in [`tuning`]).
#[allow(unused_imports)]
pub(crate) use pinpool_actors::{HostMemory, MemorySource, Origin, PinMethod, Region};
