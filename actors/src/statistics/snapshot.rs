//! Snapshots: what an allocator holds, as plain data — every segment and block with each
//! block's state, and the configuration in force — and the answers built on them
//! (`cache_info`, `base_allocation`). The engine fills them in (see `engine::inspect`).

use serde::{Deserialize, Serialize};

use crate::vocab::pool_id::PoolId;

/// Where a block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockStatus {
    /// Lent to a buffer.
    InUse,
    /// Cached: free for the next request of its size.
    Cached,
    /// Freed by its user, waiting for the events recorded on its streams.
    Waiting,
    /// Used by captured work; kept while its capture pool lives.
    Kept,
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockInfo {
    /// Start address.
    pub address: usize,
    /// Bytes of the block.
    pub size: usize,
    /// Bytes last requested of the block (what its buffer holds while in use).
    pub requested_size: usize,
    /// Where the block is.
    pub state: BlockStatus,
    /// Streams recorded on the block while in use or waiting (the first four).
    pub streams: Vec<u64>,
}

/// One piece of pinned memory taken from the runtime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentInfo {
    /// Start address.
    pub address: usize,
    /// Bytes of the segment.
    pub total_size: usize,
    /// The pool that owns it (0: the default pool).
    pub pool: u64,
    /// How it was obtained (`host_alloc`, `register`, `simulated`, `mapped`, `device`,
    /// `device_mapped`, `simulated_device`).
    pub pin_method: String,
    /// Its blocks, in address order.
    pub blocks: Vec<BlockInfo>,
    /// The device the memory is on (`None`: pinned host memory).
    #[serde(default)]
    pub device: Option<usize>,
    /// The stream whose blocks these are, in a stream-ordered pool (device memory).
    #[serde(default)]
    pub stream: Option<u64>,
}

/// The configuration in force when a snapshot was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigInfo {
    /// Name of the size policy.
    pub policy: String,
    /// Cap on reserved bytes, if any.
    pub max_bytes: Option<usize>,
    /// How long `alloc` waits for room by default, in milliseconds (`None`: no limit).
    pub alloc_timeout_ms: Option<u64>,
    /// Thread shards of the cached path.
    pub shards: usize,
    /// Name of the runtime (`cuda`, `sim`).
    pub runtime: String,
}

/// Every segment and block of an allocator, and its configuration; `snapshot()` of either
/// allocator takes one.
///
/// ```
/// use pinpool::{BlockInfo, BlockStatus, ConfigInfo, MemorySnapshot, SegmentInfo};
///
/// let block = BlockInfo {
///     address: 0x1000,
///     size: 1024,
///     requested_size: 1000,
///     state: BlockStatus::InUse,
///     streams: vec![7],
/// };
/// let snap = MemorySnapshot {
///     segments: vec![SegmentInfo {
///         address: 0x1000,
///         total_size: 1024,
///         pool: 0,
///         pin_method: "simulated".into(),
///         blocks: vec![block],
///         device: None,
///         stream: None,
///     }],
///     config: ConfigInfo {
///         policy: "pow2".into(),
///         max_bytes: Some(1 << 20),
///         alloc_timeout_ms: None,
///         shards: 4,
///         runtime: "sim".into(),
///     },
///     reserved_bytes: 1024,
/// };
/// let in_use: usize = snap
///     .blocks()
///     .filter(|(_, b)| b.state == BlockStatus::InUse)
///     .map(|(_, b)| b.size)
///     .sum();
/// assert_eq!(in_use, 1024);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemorySnapshot {
    /// Every segment, in address order.
    pub segments: Vec<SegmentInfo>,
    /// The configuration in force.
    pub config: ConfigInfo,
    /// Bytes reserved by all pools when the snapshot was taken.
    pub reserved_bytes: usize,
}

impl MemorySnapshot {
    /// Every block, with its segment.
    pub fn blocks(&self) -> impl Iterator<Item = (&SegmentInfo, &BlockInfo)> {
        self.segments
            .iter()
            .flat_map(|s| s.blocks.iter().map(move |b| (s, b)))
    }
}

/// A capture pool's state at one moment (PyTorch's `getCheckpointState`): its segments,
/// each with its blocks, a block allocated when it was lent to a user then
/// ([`BlockStatus::InUse`]). `set_checkpoint_pool_state` brings the pool back to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolCheckpoint {
    /// The pool.
    pub pool: PoolId,
    /// The device the pool's memory is on (`None`: pinned host memory).
    pub device: Option<usize>,
    /// The pool's segments, in address order (those of an expandable range: its mapped
    /// runs).
    pub segments: Vec<SegmentInfo>,
}

impl PoolCheckpoint {
    /// The blocks allocated at the checkpoint, as (address, bytes), in address order.
    pub fn allocated(&self) -> Vec<(usize, usize)> {
        let mut v: Vec<(usize, usize)> = self
            .segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.state == BlockStatus::InUse)
            .map(|b| (b.address, b.size))
            .collect();
        v.sort_unstable();
        v
    }
}

/// What the cache holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheInfo {
    /// Bytes of the largest cached block (0 when none is cached).
    pub largest_block: usize,
    /// Bytes of all cached blocks.
    pub total_cached: usize,
    /// Number of cached blocks.
    pub cached_blocks: usize,
}

/// The segment holding a pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseAllocation {
    /// Start of the segment.
    pub base: usize,
    /// Bytes of the segment.
    pub size: usize,
    /// The pool that owns it.
    pub pool: PoolId,
}
