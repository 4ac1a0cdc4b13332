//! pinpool: a caching allocator for CUDA pinned (page-locked) host memory and for device
//! memory, run as a small service of actors on tokio.
//!
//! Fresh pinned memory costs milliseconds and device memory takes driver locks, so servers
//! must reuse both, and may reuse a buffer only once the GPU work that touches it is done.
//! pinpool caches blocks, hands them out again on a path that involves no actor and no CUDA
//! call, and holds back every block that a stream used until an event recorded on that
//! stream has completed. Under a cap, a request waits for memory instead of failing.
//!
//! - [`PinnedAllocator`] hands out [`PinnedBuffer`]s of pinned host memory.
//! - [`DeviceAllocator`] hands out [`DeviceBuffer`]s of device memory, of every device of
//!   its runtime, each buffer for a stream (reused first by that stream), with PyTorch's
//!   device statistics ([`DeviceStats`]).
//! - [`BufferSet`] takes a request's buffers of both kinds together, first come first
//!   served under the caps.
//! - [`sim`] is a simulated GPU that checks every reuse; the `cuda` feature adds `cuda`,
//!   the real runtime. Code written against one runs on the other.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), pinpool::Error> {
//! use pinpool::PinnedAllocator;
//!
//! let allocator = PinnedAllocator::builder().build()?;
//! let stream = allocator.runtime().new_stream()?;
//! let mut buf = allocator.alloc(1 << 20).await?;
//! buf.fill(1);
//! buf.record_stream(&stream)?; // reuse waits for this stream's work
//! drop(buf); // back to the allocator, ordered by an event
//! allocator.empty_cache().await?;
//! println!("{:?}", allocator.stats().to_map());
//! # Ok(()) }
//! ```
//!
//! Device memory, on the simulated GPU here (`DeviceAllocator::builder().cuda()?` on a GPU):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), pinpool::Error> {
//! use pinpool::DeviceAllocator;
//!
//! let device = DeviceAllocator::builder().build()?;
//! let stream = device.runtime().new_stream()?;
//! let buf = device.alloc(64 << 20, &stream).await?; // ordered by `stream`
//! drop(buf); // reusable at once by work queued on `stream` after this point
//! let stats = device.stats(0)?;
//! assert_eq!(stats.allocated_bytes.all.peak, 64 << 20);
//! # Ok(()) }
//! ```
//!
//! # Waiting under a cap
//!
//! Under a cap (`max_bytes`, `memory_fraction`), `alloc` waits first come first served until
//! its buffer fits, as long as it takes unless `alloc_timeout` bounds it. No wait is silent:
//! one that has lasted a second is logged (the cap, what is held, and the ways out), and a
//! request that could fit only once buffers its own task took come back is refused with
//! [`OomCause::HeldByRequester`] instead of waiting for ever (where buffers have not been
//! seen to change hands between tasks). A request that needs several buffers takes them
//! together with [`BufferSet`], which holds nothing while it waits. The rules and their
//! reasons are in the guide's page on limits and waiting (`docs/limits-and-waiting.md`).
//!
//! # Blocking calls
//!
//! Every `*_blocking` call is the async call driven to completion on the calling thread. Its
//! rule: outside a tokio runtime it blocks; on a multi-thread runtime's thread it blocks
//! inside `tokio::task::block_in_place`, so the allocator's actors keep running; on a
//! current-thread runtime's thread it fails with [`Error::WouldDeadlock`] instead of hanging
//! (that thread is the one that runs the actors). The answer depends on the thread alone:
//! an allocation the cache would serve at once is refused there too, so code tested with a
//! warm cache behaves as it will with a cold one.
//!
//! # Modules
//!
//! The allocators, buffers, statistics and errors are at the crate's root. Beside them:
//! [`config`] (the `PINPOOL_CONF` and `PINPOOL_DEVICE_CONF` settings), [`sim`] (the
//! simulated runtime), `cuda` (the CUDA runtime, with the `cuda` feature), [`plan`]
//! (serving a recorded run from one planned arena), [`report`] (the history page) and
//! [`tuning`] (size policies and the allocators' books, for tools). Both runtimes implement
//! [`Runtime`], so code written against one runs on the other.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod allocator;
mod buffer;
mod buffer_set;
pub mod config;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
mod device;
mod history;
mod memviz;
pub mod plan;
pub mod report;
pub mod sim;
pub mod tuning;

// The engine, a crate of its own (`actors/`); `crate::actors::...` names its items here.
use pinpool_actors as actors;

pub use crate::actors::{
    BaseAllocation, BlockInfo, BlockStatus, CacheInfo, ConfigInfo, DeviceStats, DurationStat,
    EmptyReport, Error, HostStats, MemoryKind, MemorySnapshot, OomCause, PoolCheckpoint, PoolId,
    Runtime, RuntimeError, SegmentInfo, Stat, StatArray, StreamId,
};
pub use crate::actors::{History, HistoryContext, OomReport, TraceAction, TraceEntry};
pub use allocator::{host_memory_bytes, Builder, PinnedAllocator};
pub use buffer::PinnedBuffer;
pub use buffer_set::{BufferSet, TakenBuffers};
pub use device::{
    CheckpointDelta, DeviceAllocator, DeviceBuffer, DeviceBuilder, DeviceRuntime, IpcHandle,
    IpcMemory, MappedHandle, IPC_HANDLE_BYTES, MAX_MAPPED_HANDLES,
};

// The engine's vocabulary that the runtimes here implement: not part of this crate's API
// (tools reach it in [`tuning`]).
#[allow(unused_imports)]
pub(crate) use crate::actors::{MemorySource, Origin, Region};
