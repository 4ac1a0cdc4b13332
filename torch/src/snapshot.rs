//! Snapshots handed to C as PyTorch's allocator front reads them (`snapshot()`, what
//! `torch.cuda.memory._snapshot()` and `_dump_snapshot()` call): each segment with its blocks
//! tiling it, and each device's trace entries, passed one at a time to the caller's
//! callbacks as plain C records. The layout is [`pinpool::MemorySnapshot::torch_segments`]'s
//! and [`pinpool::History::torch_trace`]'s, the one `pinpool_dump_snapshot`'s pickle has.

use std::ffi::{c_int, c_void};

use pinpool::{DeviceRuntime, Error, History, MemorySnapshot, TraceAction};

use crate::plugin::{torch_pool_id, Plugin};

/// One block of a segment, in address order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRecord {
    /// Bytes.
    pub size: u64,
    /// Bytes requested by the caller holding it (0 for free ranges).
    pub requested_size: u64,
    /// 1 while a caller holds it.
    pub allocated: c_int,
    /// 1 while held or not yet reusable (freed, waiting on its streams' work).
    pub active: c_int,
}

/// One segment; `blocks[..n_blocks]` tile it in address order (valid during the callback).
#[repr(C)]
#[derive(Debug)]
pub struct SegmentRecord {
    /// The device's ordinal.
    pub device: i64,
    /// The first byte's address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// Bytes of its allocated blocks.
    pub allocated_size: u64,
    /// Bytes of its active blocks.
    pub active_size: u64,
    /// Requested bytes of its active blocks.
    pub requested_size: u64,
    /// The id of the stream whose pool holds it, 0 outside stream pools.
    pub stream: u64,
    /// PyTorch's `MempoolId_t` of its graph or user pool, `(0, 0)` otherwise.
    pub pool: [u64; 2],
    /// 1 when over PyTorch's small-segment size (its large pool).
    pub is_large: c_int,
    /// 1 for a run of granules mapped into a reserved range (an expandable segment).
    pub is_expandable: c_int,
    /// The blocks.
    pub blocks: *const BlockRecord,
    /// How many blocks.
    pub n_blocks: usize,
}

/// One trace entry.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceRecord {
    /// The device's ordinal.
    pub device: i64,
    /// PyTorch's `TraceEntry::Action`, by [`action_code`].
    pub action: c_int,
    /// The block's or segment's address; for an out-of-memory, the bytes the device had free.
    pub addr: u64,
    /// Bytes: requested bytes for allocations and frees, the segment's for segment entries.
    pub size: u64,
    /// The id of the stream whose pool it happened in, 0 for none.
    pub stream: u64,
    /// PyTorch's `MempoolId_t` of the pool it happened in.
    pub pool: [u64; 2],
    /// Microseconds between the entry and the snapshot.
    pub age_us: u64,
}

/// Called once per segment.
pub type SegmentFn = unsafe extern "C" fn(ctx: *mut c_void, segment: *const SegmentRecord);
/// Called once per trace entry, device by device, oldest first.
pub type TraceFn = unsafe extern "C" fn(ctx: *mut c_void, entry: *const TraceRecord);

/// PyTorch's `TraceEntry::Action` order: alloc 0, free_requested 1, free_completed 2,
/// segment_alloc 3, segment_free 4, segment_map 5, segment_unmap 6, snapshot 7, oom 8; -1 for
/// the actions PyTorch's trace has none for.
pub fn action_code(action: TraceAction) -> c_int {
    match action {
        TraceAction::Alloc => 0,
        TraceAction::FreeRequested => 1,
        TraceAction::FreeCompleted => 2,
        TraceAction::SegmentAlloc => 3,
        TraceAction::SegmentFree => 4,
        TraceAction::SegmentMap => 5,
        TraceAction::SegmentUnmap => 6,
        TraceAction::Snapshot => 7,
        TraceAction::Oom => 8,
        _ => -1,
    }
}

impl<R: DeviceRuntime> Plugin<R> {
    /// The snapshot and, with `traces`, every device's history.
    pub(crate) async fn torch_snapshot(
        &self,
        traces: bool,
    ) -> Result<(MemorySnapshot, Vec<History>), Error> {
        let alloc = self.allocator();
        let snap = alloc.snapshot().await?;
        let mut histories = Vec::new();
        if traces {
            for d in 0..alloc.device_count() {
                histories.push(alloc.history(d).await?);
            }
        }
        Ok((snap, histories))
    }
}

/// Hands `snap`'s segments of PyTorch pool `pool` (all of them for `(0, 0)`) to `on_segment`,
/// then `histories[d]`'s entries as device `d`'s to `on_trace`.
pub fn walk(
    snap: &MemorySnapshot,
    histories: &[History],
    pool: (u64, u64),
    mut on_segment: impl FnMut(&SegmentRecord),
    mut on_trace: impl FnMut(&TraceRecord),
) {
    for s in snap.torch_segments() {
        let owner = torch_pool_id(s.pool);
        if pool != (0, 0) && owner != pool {
            continue;
        }
        let blocks: Vec<BlockRecord> = s
            .blocks
            .iter()
            .map(|b| BlockRecord {
                size: b.size as u64,
                requested_size: b.requested_size as u64,
                allocated: c_int::from(b.allocated()),
                active: c_int::from(b.active()),
            })
            .collect();
        on_segment(&SegmentRecord {
            device: s.device as i64,
            address: s.address as u64,
            total_size: s.total_size as u64,
            allocated_size: s.allocated_size as u64,
            active_size: s.active_size as u64,
            requested_size: s.requested_size as u64,
            stream: s.stream,
            pool: [owner.0, owner.1],
            is_large: c_int::from(s.is_large),
            is_expandable: c_int::from(s.is_expandable),
            blocks: blocks.as_ptr(),
            n_blocks: blocks.len(),
        });
    }
    for (device, h) in histories.iter().enumerate() {
        for t in h.torch_trace().0 {
            let e = t.entry;
            let owner = torch_pool_id(e.pool.0);
            on_trace(&TraceRecord {
                device: device as i64,
                action: action_code(e.action),
                addr: e.addr as u64,
                size: t.size as u64,
                stream: e.owner.map_or(0, |s| s.0),
                pool: [owner.0, owner.1],
                age_us: h.now_us.saturating_sub(e.time_us),
            });
        }
    }
}
