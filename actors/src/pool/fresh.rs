//! Fresh pinned memory: asked of the runtime on a blocking thread (invariant 6), timed, and
//! retried once after emptying the cache when the runtime runs out.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::PoolActor;
use crate::block::Block;
use crate::error::Error;
use crate::policy::SizeClass;
use crate::runtime::{HostMemory, Runtime, RuntimeError};

impl<R: Runtime> PoolActor<R> {
    pub(super) async fn fresh(&mut self, class: SizeClass) -> Result<Box<Block<R>>, Error> {
        let memory = self.fresh_memory(class.size).await?;
        Ok(Block::new(memory, class.index, self.shared.clone()))
    }

    /// `size` bytes of fresh memory, retried once after emptying the cache on out of memory.
    pub(super) async fn fresh_memory(&mut self, size: usize) -> Result<HostMemory, Error> {
        match self.host_alloc(size).await {
            Ok(m) => Ok(m),
            Err(e) if e.out_of_memory => {
                // Out of memory from the runtime itself: empty the cache and retry once.
                self.shared
                    .stats
                    .num_alloc_retries
                    .fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    bytes = size,
                    "host allocation out of memory; emptying the cache and retrying"
                );
                self.empty_cache(false).await;
                self.host_alloc(size).await.map_err(|e| self.oom(size, e))
            }
            Err(e) => Err(Error::Runtime(e)),
        }
    }

    pub(super) fn oom(&self, requested: usize, e: RuntimeError) -> Error {
        self.shared.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
        if e.out_of_memory {
            Error::OutOfMemory {
                requested,
                reserved: self.shared.stats.allocated_bytes.read().current.max(0) as usize,
                limit: None,
            }
        } else {
            Error::Runtime(e)
        }
    }

    pub(super) async fn host_alloc(&self, size: usize) -> Result<HostMemory, RuntimeError> {
        let span = tracing::debug_span!("host_alloc", pool = %self.shared.id, bytes = size);
        let _enter = span.enter();
        let rt = self.shared.runtime.clone();
        let t0 = Instant::now();
        let res = tokio::task::spawn_blocking(move || rt.host_alloc(size))
            .await
            .unwrap_or_else(|e| {
                Err(RuntimeError::new(
                    "host_alloc",
                    format!("blocking task failed: {e}"),
                ))
            });
        let stats = &self.shared.stats;
        stats.host_alloc_time.record(t0.elapsed());
        match &res {
            Ok(m) => {
                stats.allocations.increase(1);
                stats.allocated_bytes.increase(m.size as i64);
                tracing::debug!(
                    bytes = m.size,
                    took_us = t0.elapsed().as_micros() as u64,
                    "fresh pinned memory"
                );
            }
            Err(e) => tracing::warn!(error = %e, "host allocation failed"),
        }
        res
    }
}
