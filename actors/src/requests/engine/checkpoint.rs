//! Checkpoints of capture pools (what PyTorch's CUDA graph trees use):
//! [`Engine::checkpoint_state`] reads a pool's segments and blocks from a snapshot, and
//! [`Engine::set_checkpoint_pool_state`] brings the pool back to one, through the pool actor
//! (see `pool::restore`, which owns the order of the restore).
//!
//! The handle decides what must change: the blocks allocated now but not at the checkpoint
//! are freed — only those whose leases the caller gives up (`take`); any other one is a
//! user's buffer, and the restore fails with [`Error::CheckpointConflict`], changing nothing.
//! The blocks allocated at the checkpoint but not now are lent again at exactly their old
//! addresses. Blocks allocated both now and then (same address and size) are left alone.

use std::collections::BTreeSet;

use super::Engine;
use crate::blocks::lease::Lease;
use crate::books::messages::{PollerMsg, PoolMsg};
use crate::statistics::snapshot::PoolCheckpoint;
use crate::vocab::error::Error;
use crate::vocab::memory::MemoryKind;
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::Runtime;

/// What a restore did: the addresses freed, and leases over the blocks lent again.
pub struct Restored<R: Runtime> {
    /// Addresses of the blocks freed (their leases were taken from the caller).
    pub freed: Vec<usize>,
    /// The checkpoint's blocks lent again, at their old addresses, in address order.
    pub allocated: Vec<Lease<R>>,
}

/// A failed restore: the error, and the leases taken from the caller, untouched.
pub(crate) type RestoreFailed<R> = (Error, Vec<Lease<R>>);

impl<R: Runtime> Engine<R> {
    /// The segments and blocks of capture pool `pool` (PyTorch's `getCheckpointState`).
    /// Errors: [`Error::DefaultPoolId`], [`Error::UnknownPool`]. Blocks freed and waiting on
    /// events are free; exact at a quiescent point (a block between two owners shows as
    /// allocated).
    #[doc(hidden)]
    pub async fn checkpoint_state(&self, pool: PoolId) -> Result<PoolCheckpoint, Error> {
        if pool.is_default() {
            return Err(Error::DefaultPoolId);
        }
        let shared = {
            let table = self.inner.table.load();
            let found = table.pools.iter().find(|(p, _)| *p == pool);
            found
                .map(|(_, p)| p.clone())
                .ok_or(Error::UnknownPool(pool))?
        };
        // Freed blocks parked by their freeing threads would show as allocated: hand them to
        // the poller, and let it look at them, before the snapshot.
        shared.parked.unpark_all();
        let (tx, rx) = flume::bounded(1);
        if shared.poller.send(PollerMsg::Flush { reply: tx }).is_ok() {
            let _ = rx.recv_async().await;
        }
        let snap = self.snapshot().await?;
        let segments = snap
            .segments
            .into_iter()
            .filter(|s| s.pool == pool.0)
            .collect();
        Ok(PoolCheckpoint {
            pool,
            device: match self.default_pool().memory.kind() {
                MemoryKind::Device(d) => Some(d),
                MemoryKind::Pinned => None,
            },
            segments,
        })
    }

    /// Brings capture pool `state.pool` back to `state` (PyTorch's
    /// `setCheckpointPoolState`; see the module's header for what changes). `take(address)`
    /// hands over the lease of a block allocated now that the restore may free, if the
    /// caller owns one there; the blocks lent again are for work on `stream` (their frees
    /// wait for its work). The freed blocks' queued work, on every stream that used them, is
    /// waited for first. If this future is dropped before it completes, the leases taken are
    /// freed as if dropped, and nothing is lent.
    ///
    /// Errors, each changing nothing and handing back the leases taken:
    /// [`Error::DefaultPoolId`], [`Error::UnknownPool`], [`Error::PoolCapturing`] while a
    /// capture allocates to the pool, [`Error::InvalidCheckpoint`] for a state of another
    /// device or with overlapping or unaligned blocks, [`Error::CheckpointConflict`],
    /// [`Error::CheckpointUnavailable`], and [`Error::Timeout`] when the freed blocks' work
    /// or blocks waiting on events do not finish within 10 seconds.
    #[doc(hidden)]
    pub async fn set_checkpoint_pool_state(
        &self,
        state: &PoolCheckpoint,
        stream: &R::Stream,
        mut take: impl FnMut(usize) -> Option<Lease<R>>,
    ) -> Result<Restored<R>, RestoreFailed<R>> {
        let pool = state.pool;
        let fail = |e: Error| (e, Vec::new());
        self.check_checkpoint(state).map_err(fail)?;
        let now = self.checkpoint_state(pool).await.map_err(fail)?;
        let (then, now): (BTreeSet<_>, BTreeSet<_>) = (
            state.allocated().into_iter().collect(),
            now.allocated().into_iter().collect(),
        );
        let want: Vec<(usize, usize)> = then.difference(&now).copied().collect();
        let free = self.take_stale(pool, now.difference(&then), &mut take)?;
        let table = self.inner.table.load();
        let Some((_, shared)) = table.pools.iter().find(|(p, _)| *p == pool) else {
            return Err((Error::UnknownPool(pool), free));
        };
        let freed: Vec<usize> = free.iter().map(|l| l.as_ptr() as usize).collect();
        let blocks = free.into_iter().filter_map(Lease::into_parts).collect();
        let (tx, rx) = flume::bounded(1);
        let msg = PoolMsg::Restore {
            want: want.clone(),
            free: blocks,
            target: self.runtime().stream_id(stream),
            reply: tx,
        };
        let engine = self.inner.id;
        let back = |blocks: Vec<(Box<_>, usize)>| {
            blocks
                .into_iter()
                .map(|(b, len)| Lease::from_parts(b, len, engine))
                .collect::<Vec<_>>()
        };
        if let Err(flume::SendError(PoolMsg::Restore { free, .. })) = shared.mailbox.send(msg) {
            return Err((Error::Shutdown, back(free)));
        }
        match rx.recv_async().await {
            Ok(Ok(blocks)) => Ok(Restored {
                freed,
                allocated: blocks
                    .into_iter()
                    .map(|b| {
                        let size = b.size;
                        Lease::new(b, size, false, engine)
                    })
                    .collect(),
            }),
            Ok(Err((e, free))) => Err((e, back(free))),
            // The actor went with the blocks: they found their way home.
            Err(_) => Err((Error::Shutdown, Vec::new())),
        }
    }

    /// The leases of the blocks allocated now that the checkpoint does not hold (`stale`,
    /// as (address, size)), from `take`: each must be the lease of exactly that block of
    /// `pool`, else [`Error::CheckpointConflict`] names the others, and every lease taken
    /// is handed back.
    fn take_stale<'a>(
        &self,
        pool: PoolId,
        stale: impl Iterator<Item = &'a (usize, usize)>,
        take: &mut impl FnMut(usize) -> Option<Lease<R>>,
    ) -> Result<Vec<Lease<R>>, RestoreFailed<R>> {
        let mut free = Vec::new();
        let mut conflicts = Vec::new();
        for &(addr, size) in stale {
            match take(addr) {
                Some(l)
                    if l.as_ptr() as usize == addr
                        && l.capacity() == size
                        && l.pool() == Some(pool)
                        && l.engine_id() == self.inner.id =>
                {
                    free.push(l)
                }
                Some(l) => {
                    free.push(l);
                    conflicts.push(addr as u64);
                }
                None => conflicts.push(addr as u64),
            }
        }
        if !conflicts.is_empty() {
            return Err((
                Error::CheckpointConflict {
                    pool,
                    ptrs: conflicts,
                },
                free,
            ));
        }
        Ok(free)
    }

    /// The checks that need no actor: the pool, its captures, and the state's shape.
    fn check_checkpoint(&self, state: &PoolCheckpoint) -> Result<(), Error> {
        let pool = state.pool;
        if pool.is_default() {
            return Err(Error::DefaultPoolId);
        }
        let table = self.inner.table.load();
        if !table.pools.iter().any(|(p, _)| *p == pool) {
            return Err(Error::UnknownPool(pool));
        }
        if table.captures.iter().any(|c| c.pool.id == pool) {
            return Err(Error::PoolCapturing(pool));
        }
        let device = match self.default_pool().memory.kind() {
            MemoryKind::Device(d) => Some(d),
            MemoryKind::Pinned => None,
        };
        let invalid = |reason: String| Err(Error::InvalidCheckpoint { reason });
        if state.device != device {
            return invalid(format!(
                "taken on device {:?}, restored on device {device:?}",
                state.device
            ));
        }
        let mut end = 0;
        for (addr, size) in state.allocated() {
            if size == 0
                || addr % crate::vocab::carve::ALIGN != 0
                || size % crate::vocab::carve::ALIGN != 0
            {
                return invalid(format!("block at {addr:#x} of {size} bytes is not aligned"));
            }
            if addr < end {
                return invalid(format!("block at {addr:#x} overlaps the one before"));
            }
            end = match addr.checked_add(size) {
                Some(end) => end,
                None => return invalid(format!("block at {addr:#x} of {size} bytes wraps")),
            };
        }
        Ok(())
    }
}
