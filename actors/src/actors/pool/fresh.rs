//! Fresh memory: its bytes reserved from the allocator's budget first (the memory limit), then
//! asked of the pool's memory source on a blocking thread (invariant 6), timed, and entered
//! in the pool's registry of segments.
//!
//! Running out — at the cap, or in the source itself — is reported as `Error::OutOfMemory`
//! (with the cap in `limit`, or `None` for the source); the caller empties the caches and
//! retries (see `crate::requests::miss`).

use std::time::Instant;

use tracing::Instrument;

use super::PoolActor;
use crate::blocks::block::Block;
use crate::books::messages::SegmentView;
use crate::vocab::error::{Error, OomCause};
use crate::vocab::memory::Region;
use crate::vocab::policy::SizeClass;
use crate::vocab::runtime::{Runtime, RuntimeError};

impl<R: Runtime> PoolActor<R> {
    pub(super) async fn fresh(&mut self, class: SizeClass) -> Result<Box<Block<R>>, Error> {
        let memory = self.fresh_memory(class.size).await?;
        let block = Block::new(memory, class.index, self.shared.clone());
        self.remember_segment(SegmentView {
            memory,
            meta: block.meta,
            pieces: Vec::new(),
        });
        Ok(block)
    }

    /// `size` bytes of fresh memory: reserved from the budget first, then asked of the
    /// runtime; the bytes go back to the budget when the runtime fails. The caller enters the
    /// memory in the registry.
    pub(super) async fn fresh_memory(&mut self, size: usize) -> Result<Region, Error> {
        let budget = self.shared.budget.clone();
        if !budget.try_reserve(size) {
            return Err(Error::OutOfMemory {
                requested: size,
                reserved: budget.reserved(),
                limit: budget.limit(),
                cause: OomCause::NoRoomNow,
            });
        }
        let memory = match self.host_alloc(size).await {
            Ok(m) => m,
            Err(e) => {
                budget.release(size);
                if e.out_of_memory {
                    return Err(Error::OutOfMemory {
                        requested: size,
                        reserved: budget.reserved(),
                        limit: None,
                        cause: OomCause::NoRoomNow,
                    });
                }
                return Err(Error::Runtime(e));
            }
        };
        if memory.size > size {
            // The runtime rounded up; the budget counts what is really held.
            budget.force_reserve(memory.size - size);
        }
        Ok(memory)
    }

    pub(super) async fn host_alloc(&self, size: usize) -> Result<Region, RuntimeError> {
        let span = tracing::debug_span!("host_alloc", pool = %self.shared.id, bytes = size);
        let source = self.shared.memory.clone();
        let t0 = Instant::now();
        // The result comes back over a channel: if nobody is left to take it (the actor was
        // dropped with its tokio runtime mid-call), the blocking thread gives it back itself.
        let (tx, rx) = flume::bounded(1);
        self.hand_off(move || {
            let res = source.alloc(size);
            if let Err(flume::SendError(Ok(memory))) = tx.send(res) {
                let _ = source.free(memory);
            }
        });
        let res = rx.recv_async().instrument(span).await.unwrap_or_else(|e| {
            Err(RuntimeError::new(
                "host_alloc",
                format!("blocking task failed: {e}"),
            ))
        });
        let stats = &self.shared.stats;
        stats.host_alloc_time.record(t0.elapsed());
        match &res {
            Ok(m) => {
                self.shared
                    .history
                    .on_segment_alloc(self.shared.id, self.shared.owner, m);
                stats.segment(m.size, true);
                stats.allocations.increase(1);
                stats.allocated_bytes.increase(m.size as i64);
                tracing::debug!(
                    bytes = m.size,
                    took_us = t0.elapsed().as_micros() as u64,
                    "fresh memory"
                );
            }
            Err(e) => tracing::warn!(error = %e, "fresh allocation failed"),
        }
        res
    }
}
