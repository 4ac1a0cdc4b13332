//! Snapshots: every segment and block of an allocator, with each block's state, and the
//! configuration in force; and the queries built on them (`cache_info`, `base_allocation`,
//! `check_pool_live_allocations`).
//!
//! Each pool keeps a registry of the segments it made (it makes and frees them all). A
//! segment is one block, or, under a policy that carves blocks out of segments, the blocks
//! cut out of it and its free ranges (listed as cached blocks with nothing requested). A
//! block's state is derived: cached when it is in a ready queue or a free range, kept when
//! its pool keeps it for graph replays, waiting when the event poller holds it, in use
//! otherwise. Taken at a
//! quiescent point a snapshot is exact; taken while buffers move, a block between two owners
//! shows as in use.
//!
//! The one thing only a block's holder knows — the bytes last requested of it, and the
//! streams recorded on it — is kept in a small per-block record of atomics written by that
//! holder (one thread at a time), so reading it costs the cached path no shared cache line.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

use crate::engine::Engine;
use crate::error::Error;
use crate::poller::PollerMsg;
use crate::pool::{PoolMsg, PoolView};
use crate::pool_id::PoolId;
use crate::runtime::{Runtime, StreamId};

/// How many recorded streams a block's record remembers.
const STREAMS_KEPT: usize = 4;

/// What a block's holder writes for snapshots (on cache lines of its own: records of blocks
/// held by different threads are made one after another).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct BlockMeta {
    requested: AtomicUsize,
    nstreams: AtomicUsize,
    streams: [AtomicU64; STREAMS_KEPT],
}

impl BlockMeta {
    /// The block is lent for a request of `len` bytes.
    #[inline]
    pub(crate) fn lent(&self, len: usize) {
        self.requested.store(len, Relaxed);
        self.nstreams.store(0, Relaxed);
    }

    /// `stream` was recorded on the block (the first few are remembered).
    #[inline]
    pub(crate) fn recorded(&self, stream: StreamId) {
        let n = self.nstreams.load(Relaxed);
        if n < STREAMS_KEPT {
            self.streams[n].store(stream.0, Relaxed);
            self.nstreams.store(n + 1, Relaxed);
        }
    }

    fn requested(&self) -> usize {
        self.requested.load(Relaxed)
    }

    fn streams(&self) -> Vec<u64> {
        let n = self.nstreams.load(Relaxed).min(STREAMS_KEPT);
        self.streams[..n].iter().map(|s| s.load(Relaxed)).collect()
    }
}

/// Where a block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockStatus {
    /// Lent to a buffer.
    InUse,
    /// In a ready queue, free for the next request of its class.
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
    /// How it was pinned (`host_alloc`, `register`, `simulated`).
    pub pin_method: String,
    /// Its blocks, in address order.
    pub blocks: Vec<BlockInfo>,
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

/// Every segment and block of an allocator, and its configuration; `Engine::snapshot` takes
/// one.
///
/// ```
/// use pinpool_actors::{BlockInfo, BlockStatus, ConfigInfo, MemorySnapshot, SegmentInfo};
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

impl<R: Runtime> Engine<R> {
    async fn pool_views(&self) -> Result<Vec<PoolView>, Error> {
        let mut views = Vec::new();
        for p in self.default_pool().budget.pools() {
            let (tx, rx) = flume::bounded(1);
            if p.mailbox.send(PoolMsg::Describe { reply: tx }).is_ok() {
                if let Ok(v) = rx.recv_async().await {
                    views.push(v);
                }
            }
        }
        if views.is_empty() {
            return Err(Error::Shutdown);
        }
        Ok(views)
    }

    /// Every segment and block, with the state of each, and the configuration in force.
    /// Serializable with serde (JSON, for tools). It briefly takes cached blocks out of their
    /// queues to list them; see [`MemorySnapshot`] for an example.
    pub async fn snapshot(&self) -> Result<MemorySnapshot, Error> {
        let views = self.pool_views().await?;
        let (tx, rx) = flume::bounded(1);
        let waiting: HashSet<usize> = if self
            .default_pool()
            .poller
            .send(PollerMsg::Pending { reply: tx })
            .is_ok()
        {
            rx.recv_async()
                .await
                .unwrap_or_default()
                .into_iter()
                .collect()
        } else {
            HashSet::new()
        };
        let mut segments = Vec::new();
        for v in views {
            let cached: HashSet<usize> = v.cached.iter().copied().collect();
            let kept: HashSet<usize> = v.kept.iter().copied().collect();
            let block = |addr: usize, size: usize, meta: Option<&BlockMeta>| {
                let Some(meta) = meta else {
                    // A free range of a carved segment.
                    return BlockInfo {
                        address: addr,
                        size,
                        requested_size: 0,
                        state: BlockStatus::Cached,
                        streams: Vec::new(),
                    };
                };
                let state = if cached.contains(&addr) {
                    BlockStatus::Cached
                } else if kept.contains(&addr) {
                    BlockStatus::Kept
                } else if waiting.contains(&addr) {
                    BlockStatus::Waiting
                } else {
                    BlockStatus::InUse
                };
                let streams = if state == BlockStatus::Cached {
                    Vec::new()
                } else {
                    meta.streams()
                };
                BlockInfo {
                    address: addr,
                    size,
                    requested_size: meta.requested(),
                    state,
                    streams,
                }
            };
            for s in v.segments {
                let addr = s.memory.ptr.as_ptr() as usize;
                let blocks = if s.pieces.is_empty() {
                    vec![block(addr, s.memory.size, Some(&s.meta))]
                } else {
                    s.pieces
                        .iter()
                        .map(|p| block(p.addr, p.size, p.meta.as_deref()))
                        .collect()
                };
                segments.push(SegmentInfo {
                    address: addr,
                    total_size: s.memory.size,
                    pool: v.pool.0,
                    pin_method: s.memory.method.to_string(),
                    blocks,
                });
            }
        }
        segments.sort_by_key(|s| s.address);
        let budget = &self.default_pool().budget;
        Ok(MemorySnapshot {
            segments,
            config: ConfigInfo {
                policy: budget.policy.to_string(),
                max_bytes: budget.limit(),
                alloc_timeout_ms: budget.default_timeout.map(|d| d.as_millis() as u64),
                shards: budget.shards,
                runtime: self.runtime().name().to_string(),
            },
            reserved_bytes: budget.reserved(),
        })
    }

    /// The largest cached block and the bytes cached, over every pool.
    pub async fn cache_info(&self) -> Result<CacheInfo, Error> {
        let mut info = CacheInfo::default();
        for v in self.pool_views().await? {
            let mut sizes: BTreeMap<usize, usize> = BTreeMap::new();
            let mut free_ranges = Vec::new();
            for s in &v.segments {
                if s.pieces.is_empty() {
                    sizes.insert(s.addr(), s.memory.size);
                }
                for p in &s.pieces {
                    if p.meta.is_some() {
                        sizes.insert(p.addr, p.size);
                    } else {
                        free_ranges.push(p.size);
                    }
                }
            }
            let cached = v.cached.iter().map(|a| sizes.get(a).copied().unwrap_or(0));
            for size in cached.chain(free_ranges) {
                info.largest_block = info.largest_block.max(size);
                info.total_cached += size;
                info.cached_blocks += 1;
            }
        }
        Ok(info)
    }

    /// The segment holding `ptr` (its base address, size and pool), or `None` when no
    /// segment of this allocator holds it.
    pub fn base_allocation(
        &self,
        ptr: *const u8,
    ) -> impl std::future::Future<Output = Result<Option<BaseAllocation>, Error>> + Send + '_ {
        let addr = ptr as usize;
        async move {
            for v in self.pool_views().await? {
                for s in &v.segments {
                    let base = s.addr();
                    if addr >= base && addr - base < s.memory.size {
                        return Ok(Some(BaseAllocation {
                            base,
                            size: s.memory.size,
                            pool: v.pool,
                        }));
                    }
                }
            }
            Ok(None)
        }
    }

    /// Whether the blocks in use in `pool` are exactly those starting at `expected`
    /// (PyTorch's `_cuda_checkPoolLiveAllocations`). `Err(UnknownPool)` for a pool that does
    /// not exist.
    pub fn check_pool_live_allocations(
        &self,
        pool: PoolId,
        expected: &[*const u8],
    ) -> impl std::future::Future<Output = Result<bool, Error>> + Send + '_ {
        let expected: HashSet<usize> = expected.iter().map(|p| *p as usize).collect();
        async move {
            let snap = self.snapshot().await?;
            if !pool.is_default() && !snap.segments.iter().any(|s| s.pool == pool.0) {
                let exists = self.pools().contains(&pool);
                if !exists {
                    return Err(Error::UnknownPool(pool));
                }
            }
            let live: HashSet<usize> = snap
                .blocks()
                .filter(|(s, b)| s.pool == pool.0 && b.state == BlockStatus::InUse)
                .map(|(_, b)| b.address)
                .collect();
            Ok(live == expected)
        }
    }
}
