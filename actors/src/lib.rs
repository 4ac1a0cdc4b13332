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
//! Each layer is a folder, and `lib.rs` declares them from the bottom up; each folder's
//! `mod.rs` says what the layer owns and declares its modules in order. A module uses only
//! modules declared before it: those of lower layers, and those listed above it in its own
//! layer (`scripts/check-layers.py` fails on any other `crate::` path, and CI runs it). Where a
//! lower layer must reach a higher one at run time — a block going home when it is freed —
//! it does so through a value it was given: a channel whose messages are defined low
//! (`messages`), a trait it defines and the higher layer implements (`ready::Slotted`,
//! `parked::Parkable`, `budget::Member`), or a type it is generic over (`home::Home<R, B>`).
//!
//! 1. `vocab/`, vocabulary: `runtime`, `memory`, `pool_id`, `error`, `blocking` (whether a
//!    blocking call may block this thread), `holder` (who took a buffer), `loom`, `shard`,
//!    `idle_probe`, `spawn`, `mailbox` (an actor's inbound queue), `keepalive`, `policy`,
//!    `carve`.
//! 2. `statistics/`: `counters`, `peaks` (exact peaks of counts kept in thread shards),
//!    `device_stats`, `stats`, `meta`, `trace`, `snapshot`, `pickle` (a pickle writer),
//!    `torch_snapshot` (snapshots in PyTorch's pickle layout).
//! 3. `observation/`: `observe` (the observer task), `history` (the history actor and the
//!    recorder the hot paths call), `free_memory` (the user's free-memory callbacks).
//! 4. `holders/`, lock-free holders of blocks: `ready` (the cached path), `parked` (freed
//!    blocks waiting on events in the freeing thread's shard).
//! 5. `books/`, shared books: `budget` (the memory limit), `errand` (a memory-source call
//!    handed to the thread waiting for a reply), `messages` (every actor message), `home` (the
//!    part of a pool that handles and blocks reach), `segment` (an allocation that blocks
//!    are cut out of).
//! 6. `blocks/`: `block` (a lent piece of memory and where it goes when freed), `lease` (a
//!    block lent to a user).
//! 7. `actors/`: `poller`, `pool`, `router`.
//! 8. `requests/`, requests and the handle: `long_wait` (a request that waits long under a
//!    cap), `miss` (the miss path), `engine`.

// Blocks travel between threads and actors as `Box<Block>` so that moving one is a pointer
// copy and the allocation is made once per block, not once per trip.
#![allow(clippy::vec_box, clippy::boxed_local)]

mod vocab;
mod statistics;
mod observation;
mod holders;
mod books;
mod blocks;
mod actors;
mod requests;

#[doc(hidden)]
pub use actors::pool::DEFAULT_LINGER;
#[doc(hidden)]
pub use blocks::lease::{Lease, RawLease};
pub use books::budget::EmptyReport;
pub use books::messages::Inventory;
#[doc(hidden)]
pub use observation::free_memory::FreeMemoryCallback;
#[doc(hidden)]
pub use observation::history::HistorySetting;
pub use requests::engine::Engine;
#[doc(hidden)]
pub use requests::engine::{alloc_many, alloc_many_blocking, EngineBuilder, Want};
#[doc(hidden)]
pub use requests::miss::Wait;
pub use statistics::counters::{DurationStat, Stat};
pub use statistics::device_stats::{DeviceStats, StatArray};
pub use statistics::snapshot::{
    BaseAllocation, BlockInfo, BlockStatus, CacheInfo, ConfigInfo, MemorySnapshot, PoolCheckpoint,
    SegmentInfo,
};
pub use statistics::stats::HostStats;
#[doc(hidden)]
pub use statistics::torch_snapshot::{TorchBlock, TorchSegment, TorchTraceEntry};
pub use statistics::trace::{History, HistoryContext, OomReport, TraceAction, TraceEntry};
#[doc(hidden)]
pub use vocab::blocking;
pub use vocab::error::{Error, OomCause};
#[doc(hidden)]
pub use vocab::memory::Region;
pub use vocab::memory::{MemoryKind, MemorySource, Origin, RangeCall};
#[doc(hidden)]
pub use vocab::policy::DIVISION_INTERVALS;
pub use vocab::policy::{
    BestFit, BlockLayout, Carving, DeviceFit, PowerOfTwo, SizeClass, SizePolicy, TieredPowerOfTwo,
};
pub use vocab::pool_id::PoolId;
pub use vocab::runtime::{Runtime, RuntimeError, StreamId};
