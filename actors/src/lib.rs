//! The engine of pinpool: the crate that the `pinpool` crate is built on.
//!
//! Its public items are the engine's vocabulary for the `pinpool` crate, not a second public
//! face: users depend on `pinpool`, which re-exports what they need (at its root, and in
//! `pinpool::tuning` for tools). Items public here only because `pinpool` uses them are
//! hidden from these docs.
//!
//! Pool actors own memory blocks and their free lists, an event-poller actor owns every block
//! that waits on GPU work, and a router actor owns the capture registry and publishes the
//! routing table. The engine is generic over a [`Runtime`] (events recorded on streams, and
//! stream-capture state) and takes its memory from a [`MemorySource`] (pinned host memory, or
//! one device's memory); it contains no CUDA. `actors/ARCHITECTURE.md` walks through it.
//! The `pinpool` crate gives it its public face (`PinnedAllocator`, `DeviceAllocator`), and
//! `pinpool::tuning` shows the part tools need.
//!
//! # Layers
//!
//! Modules are listed below from the bottom up. A module uses only modules listed above it
//! (`scripts/check-layers.py` fails on any other `crate::` path, and CI runs it). Where a
//! lower layer must reach a higher one at run time — a block going home when it is freed —
//! it does so through a value it was given: a channel whose messages are defined low
//! (`mailbox`), a trait it defines and the higher layer implements (`ready::Slotted`,
//! `parked::Parkable`, `budget::Member`), or a type it is generic over (`home::Home<R, B>`).
//!
//! 1. Vocabulary: `runtime`, `memory`, `pool_id`, `error`, `blocking` (whether a blocking
//!    call may block this thread), `holder` (who took a buffer), `shard`, `spawn`, `keepalive`, `policy`, `carve`,
//!    `counters`, `peaks` (exact peaks of counts kept in thread shards), `device_stats`,
//!    `stats`, `meta`, `trace`, `snapshot`, `pickle` (a pickle writer), `torch_snapshot`
//!    (snapshots in PyTorch's pickle layout).
//! 2. Observation: `observe` (the observer task), `history` (the history actor and the
//!    recorder the hot paths call), `free_memory` (the user's free-memory callbacks).
//! 3. Lock-free holders of blocks: `ready` (the cached path), `parked` (freed blocks waiting
//!    on events in the freeing thread's shard).
//! 4. Shared books: `budget` (the memory limit), `errand` (a memory-source call handed to the
//!    thread waiting for a reply), `mailbox` (every actor message), `home` (the
//!    part of a pool that handles and blocks reach), `segment` (an allocation that blocks
//!    are cut out of).
//! 5. Blocks: `block` (a lent piece of memory and where it goes when freed), `lease` (a
//!    block lent to a user).
//! 6. Actors: `poller`, `pool`, `router`.
//! 7. Requests and the handle: `long_wait` (a request that waits long under a cap), `miss`
//!    (the miss path), `engine`.

// Blocks travel between threads and actors as `Box<Block>` so that moving one is a pointer
// copy and the allocation is made once per block, not once per trip.
#![allow(clippy::vec_box, clippy::boxed_local)]

// 1. Vocabulary.
mod runtime;
mod memory;
mod pool_id;
mod error;
#[doc(hidden)]
pub mod blocking;
mod holder;
mod loom;
mod shard;
mod idle_probe;
mod spawn;
mod keepalive;
mod policy;
mod carve;
mod counters;
mod peaks;
mod device_stats;
mod stats;
mod meta;
mod trace;
mod snapshot;
mod pickle;
mod torch_snapshot;
// 2. Observation.
mod observe;
mod history;
mod free_memory;
// 3. Lock-free holders of blocks.
mod ready;
mod parked;
// 4. Shared books.
mod budget;
mod errand;
mod mailbox;
mod home;
mod segment;
// 5. Blocks.
mod block;
mod lease;
// 6. Actors.
mod poller;
mod pool;
mod router;
// 7. Requests and the handle.
mod long_wait;
mod miss;
mod engine;

pub use budget::EmptyReport;
pub use counters::{DurationStat, Stat};
pub use device_stats::{DeviceStats, StatArray};
pub use engine::Engine;
#[doc(hidden)]
pub use engine::{alloc_many, alloc_many_blocking, EngineBuilder, Want};
pub use error::{Error, OomCause};
#[doc(hidden)]
pub use free_memory::FreeMemoryCallback;
#[doc(hidden)]
pub use lease::{Lease, RawLease};
pub use mailbox::Inventory;
#[doc(hidden)]
pub use memory::Region;
pub use memory::{MemoryKind, MemorySource, Origin};
#[doc(hidden)]
pub use miss::Wait;
#[doc(hidden)]
pub use policy::DIVISION_INTERVALS;
pub use policy::{
    BestFit, BlockLayout, Carving, DeviceFit, PowerOfTwo, SizeClass, SizePolicy, TieredPowerOfTwo,
};
#[doc(hidden)]
pub use pool::DEFAULT_LINGER;
pub use pool_id::PoolId;
pub use runtime::{Runtime, RuntimeError, StreamId};
pub use snapshot::{
    BaseAllocation, BlockInfo, BlockStatus, CacheInfo, ConfigInfo, MemorySnapshot, PoolCheckpoint,
    SegmentInfo,
};
pub use stats::HostStats;
pub use trace::{History, HistoryContext, OomReport, TraceAction, TraceEntry};
