//! Checkpoints of device capture pools (what PyTorch's CUDA graph trees use):
//! `checkpoint_state` reads a pool's segments and blocks, `set_checkpoint_pool_state`
//! brings the pool back to them (see the engine's `engine::checkpoint` and
//! `pool::restore` for how).
//!
//! Safety first: a restore frees only blocks the allocator owns — raw allocations
//! (`raw_alloc_with_stream`) — and never memory a user still holds through a
//! [`DeviceBuffer`](crate::DeviceBuffer): such a block in the way is
//! [`Error::CheckpointConflict`], naming its address, and nothing changes. The blocks it
//! brings back are raw allocations too (give them back with `raw_delete`): like the blocks
//! it frees, so that a pool can be restored again and again, and like the data pointers
//! PyTorch's `CheckpointDelta` hands back.

use crate::actors::{Error, PoolCheckpoint, PoolId, RawLease};

use super::allocator::DeviceAllocator;
use super::runtime::DeviceRuntime;

/// What a restore changed (PyTorch's `CheckpointDelta`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointDelta {
    /// Raw allocations freed: allocated before the call, free in the checkpoint.
    pub ptrs_freed: Vec<u64>,
    /// Raw allocations made: the checkpoint's allocated blocks that were free, at their old
    /// addresses, in address order (give each back with `raw_delete`).
    pub dataptrs_allocd: Vec<u64>,
}

impl<R: DeviceRuntime> DeviceAllocator<R> {
    /// The segments and blocks of capture pool `pool` on device `device` (PyTorch's
    /// `getCheckpointState`): each block's address, size, state (allocated:
    /// [`BlockStatus::InUse`](crate::BlockStatus)) and streams. Exact at a quiescent point.
    /// Errors: [`Error::NoSuchDevice`], [`Error::DefaultPoolId`], [`Error::UnknownPool`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "multi_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use pinpool::DeviceAllocator;
    ///
    /// let allocator = DeviceAllocator::builder().build()?;
    /// let stream = allocator.runtime().new_stream()?;
    /// let id = pinpool::PoolId::fresh();
    /// let s = stream.id();
    /// allocator.begin_allocate_to_pool(0, id, move |t| t.id() == s).await?;
    /// let a = allocator.raw_alloc_with_stream(1 << 20, &stream)?; // in the capture pool
    /// allocator.end_allocate_to_pool(0, id).await?;
    /// let checkpoint = allocator.checkpoint_state(0, id).await?;
    /// assert_eq!(checkpoint.allocated(), vec![(a as usize, 1 << 20)]);
    ///
    /// allocator.raw_delete(a)?;
    /// allocator.begin_allocate_to_pool(0, id, move |t| t.id() == s).await?;
    /// let b = allocator.raw_alloc_with_stream(2 << 20, &stream)?; // maybe where `a` was
    /// allocator.end_allocate_to_pool(0, id).await?;
    ///
    /// let delta = allocator.set_checkpoint_pool_state(0, &checkpoint, &stream).await?;
    /// assert_eq!(delta.ptrs_freed, vec![b]);
    /// assert_eq!(delta.dataptrs_allocd, vec![a]); // back at its old address
    /// allocator.raw_delete(a)?;
    /// # allocator.release_pool(0, id).await?;
    /// # Ok(()) }
    /// ```
    pub async fn checkpoint_state(
        &self,
        device: usize,
        pool: PoolId,
    ) -> Result<PoolCheckpoint, Error> {
        self.engine(device)?.checkpoint_state(pool).await
    }

    /// Brings capture pool `state.pool` of device `device` back to `state` (PyTorch's
    /// `setCheckpointPoolState`):
    /// - a block allocated now but free in the checkpoint is freed if it is a raw
    ///   allocation; a block a [`DeviceBuffer`](super::DeviceBuffer) holds is [`Error::CheckpointConflict`]
    ///   (drop the buffer first), and nothing changes;
    /// - a block allocated in the checkpoint but free now is allocated again at exactly its
    ///   old address, as a raw allocation for work on `stream` (graphs captured against the
    ///   checkpoint replay against those addresses); blocks kept for graph replays over
    ///   those ranges are taken back (the caller says the pool's graphs were recorded
    ///   against the checkpoint). Memory given back to the device since is mapped again at
    ///   the same address in an expandable range; a separate segment given back is
    ///   [`Error::CheckpointUnavailable`], and nothing changes;
    /// - a block allocated in both (same address and size) is left as it is, in neither list.
    ///
    /// The freed blocks' work on streams other than `stream` is waited for before their
    /// memory is lent again. Call it while no capture allocates to the pool
    /// ([`Error::PoolCapturing`]). Other errors, each changing nothing:
    /// [`Error::NoSuchDevice`], [`Error::DefaultPoolId`], [`Error::UnknownPool`],
    /// [`Error::InvalidCheckpoint`] (another device's state, overlapping or unaligned
    /// blocks), [`Error::Timeout`] (work or events that do not finish within 10 seconds).
    pub async fn set_checkpoint_pool_state(
        &self,
        device: usize,
        state: &PoolCheckpoint,
        stream: &R::Stream,
    ) -> Result<CheckpointDelta, Error> {
        let engine = self.engine(device)?;
        let raw = &self.inner().raw;
        let res = engine
            .set_checkpoint_pool_state(state, stream, |addr| {
                raw.remove(addr).map(RawLease::into_lease)
            })
            .await;
        match res {
            Ok(restored) => {
                let allocd: Vec<u64> = restored
                    .allocated
                    .into_iter()
                    .filter_map(|lease| self.file_raw(lease, stream))
                    .collect();
                Ok(CheckpointDelta {
                    ptrs_freed: restored.freed.into_iter().map(|p| p as u64).collect(),
                    dataptrs_allocd: allocd,
                })
            }
            Err((e, leases)) => {
                // Put back what was taken, as it was.
                for lease in leases {
                    let addr = lease.as_ptr() as usize;
                    if let Ok(r) = lease.into_raw() {
                        raw.insert(addr, r);
                    }
                }
                Err(e)
            }
        }
    }
}
