//! Seeing inside: statistics, inventories (invariant 2 at quiescent points) and snapshots,
//! and the queries built on snapshots (`cache_info`, `base_allocation`,
//! `check_pool_live_allocations`). Snapshots ask every pool actor to describe what it holds,
//! and the event poller which blocks wait on events.
//!
//! A segment is one block, or, under a policy that carves blocks out of segments, the
//! blocks cut out of it and its free ranges (listed as cached blocks with nothing requested).
//! A block's state is derived: cached when it is in a ready holder or a free range, kept when
//! its pool keeps it for graph replays, waiting when the event poller holds it, in use
//! otherwise. Taken at a quiescent point a snapshot is exact; taken while buffers move, a
//! block between two owners shows as in use.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use super::Engine;
use crate::actors::router::RouterMsg;
use crate::blocks::block::Home;
use crate::books::messages::{Inventory, PollerMsg, PoolMsg, PoolView};
use crate::statistics::device_stats::DeviceStats;
use crate::statistics::meta::BlockMeta;
use crate::statistics::snapshot::{
    BaseAllocation, BlockInfo, BlockStatus, CacheInfo, ConfigInfo, MemorySnapshot, SegmentInfo,
};
use crate::statistics::stats::HostStats;
use crate::vocab::error::Error;
use crate::vocab::memory::MemoryKind;
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::Runtime;

impl<R: Runtime> Engine<R> {
    /// Statistics over every pool (the stream pools retired included).
    pub fn stats(&self) -> HostStats {
        let mut s = self.inner.table.retired.host();
        for p in self.all_pools() {
            s.merge(&p.stats.read());
        }
        s.set_peaks(
            self.inner.ledger.engine(),
            self.default_pool().stats.active_kinds(),
        );
        s.limit_bytes = self.max_bytes().map(|l| l as i64);
        s
    }

    /// Device statistics over every pool (`None` for an engine built without them: a pinned
    /// allocator's).
    pub fn device_stats(&self) -> Option<DeviceStats> {
        let mut total: Option<DeviceStats> = self.inner.table.retired.device();
        for p in self.all_pools() {
            let s = p.stats.read_device()?;
            match &mut total {
                Some(t) => t.merge(&s),
                None => total = Some(s),
            }
        }
        if let Some(t) = &mut total {
            t.limit_bytes = self.max_bytes().map(|l| l as i64);
            t.set_peaks(self.inner.ledger.engine());
            t.set_reserved_peak(self.default_pool().budget.peak() as i64);
        }
        total
    }

    /// Statistics of one pool (`None` for a pool that does not exist or is gone).
    #[doc(hidden)]
    pub fn pool_stats(&self, id: PoolId) -> Option<HostStats> {
        let limit = self.max_bytes().map(|l| l as i64);
        if id.is_default() {
            let mut s = self.inner.table.retired.host();
            for p in self.default_pools() {
                s.merge(&p.stats.read());
            }
            s.set_peaks(
                self.inner.ledger.default_group(),
                self.default_pool().stats.active_kinds(),
            );
            s.limit_bytes = limit;
            return Some(s);
        }
        let table = self.inner.table.load();
        table.pools.iter().find(|(p, _)| *p == id).map(|(_, p)| {
            let mut s = p.stats.read();
            s.limit_bytes = limit;
            s
        })
    }

    /// Device statistics of capture pool `id` (`None` for a pool that does not exist or is
    /// gone, and for an engine built without device statistics).
    #[doc(hidden)]
    pub fn pool_device_stats(&self, id: PoolId) -> Option<DeviceStats> {
        let table = self.inner.table.load();
        let (_, pool) = table.pools.iter().find(|(p, _)| *p == id)?;
        let mut s = pool.stats.read_device()?;
        s.limit_bytes = self.max_bytes().map(|l| l as i64);
        Some(s)
    }

    /// Ids of the capture pools alive.
    pub fn pools(&self) -> Vec<PoolId> {
        self.inner
            .table
            .load()
            .pools
            .iter()
            .map(|(id, _)| *id)
            .collect()
    }

    /// The default pool, every stream pool and every capture pool alive.
    pub(crate) fn all_pools(&self) -> Vec<Arc<Home<R>>> {
        let table = self.inner.table.load();
        let mut pools = self.default_pools();
        pools.extend(table.pools.iter().map(|(_, p)| p.clone()));
        pools
    }

    /// Sets every peak to the current value.
    #[doc(hidden)]
    pub fn reset_peak_stats(&self) {
        self.all_pools().iter().for_each(|p| p.stats.reset_peak());
        self.inner.table.retired.reset_peaks();
        self.inner.ledger.reset_peaks();
        self.default_pool().budget.reset_peak();
    }

    /// Zeroes the accumulated counts (`allocated`, `freed`, timings, retries, OOMs).
    #[doc(hidden)]
    pub fn reset_accumulated_stats(&self) {
        self.all_pools()
            .iter()
            .for_each(|p| p.stats.reset_accumulated());
        self.inner.table.retired.reset_accumulated();
    }

    /// Where every pool's reserved bytes are (default pool first). Meant for checks at
    /// quiescent points: it briefly takes the ready blocks out of their queues to count them.
    pub async fn inventory(&self) -> Result<Vec<Inventory>, Error> {
        let (tx, rx) = flume::bounded(1);
        self.send_pool(PoolMsg::Inventory { reply: tx })?;
        let mut all = vec![rx.recv_async().await.map_err(|_| Error::Shutdown)?];
        let private = self
            .call_router(|reply| RouterMsg::Inventory { reply })?
            .recv_async()
            .await
            .map_err(|_| Error::Shutdown)?;
        all.extend(private);
        Ok(all)
    }

    async fn pool_views(&self) -> Result<Vec<PoolView>, Error> {
        let mut views = Vec::new();
        for p in self.all_pools() {
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
        let waiting = self.waiting_blocks().await;
        let mut segments = Vec::new();
        for v in views {
            let cached: HashSet<usize> = v.cached.iter().copied().collect();
            let kept: HashSet<usize> = v.kept.iter().copied().collect();
            let block = |addr: usize, size: usize, meta: Option<&BlockMeta>| {
                block_info(addr, size, meta, [&cached, &kept, &waiting])
            };
            for s in v.segments {
                let addr = s.memory.ptr.as_ptr() as usize;
                let blocks = if s.pieces.is_empty() {
                    vec![block(addr, s.memory.size, Some(&*s.meta))]
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
                    device: match v.memory {
                        MemoryKind::Device(d) => Some(d),
                        MemoryKind::Pinned => None,
                    },
                    stream: v.owner.map(|s| s.0),
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

    /// The addresses of the blocks waiting on events with the event poller (none once the
    /// poller is gone).
    async fn waiting_blocks(&self) -> HashSet<usize> {
        let (tx, rx) = flume::bounded(1);
        if self
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
        }
    }

    /// The largest cached block and the bytes cached, over every pool.
    #[doc(hidden)]
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
    #[doc(hidden)]
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
    #[doc(hidden)]
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

/// A snapshot's entry for the piece at `addr` of `size` bytes: a free range of a carved
/// segment without `meta`, else a block whose state is the first of the address sets
/// (cached, kept, waiting) that holds it, or in use; only a block not cached lists the
/// streams that used it.
fn block_info(
    addr: usize,
    size: usize,
    meta: Option<&BlockMeta>,
    [cached, kept, waiting]: [&HashSet<usize>; 3],
) -> BlockInfo {
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
}
