//! The pool's cache: answering a miss from ready blocks (after noticing completed events —
//! invariant 3), taking blocks home, and emptying the cache.

use std::sync::atomic::Ordering;

use super::{EmptyReport, PoolActor};
use crate::block::{Block, BlockState};
use crate::error::Error;
use crate::policy::SizeClass;
use crate::poller::PollerMsg;
use crate::runtime::Runtime;

impl<R: Runtime> PoolActor<R> {
    /// A block back outside the ready queues: kept blocks stay kept, others are reusable.
    pub(super) async fn home(&mut self, mut block: Box<Block<R>>) {
        if block.state == BlockState::Waiting {
            // Its events were lost with the poller: never reuse it.
            let stats = &self.shared.stats;
            stats.waiting_blocks.fetch_sub(1, Ordering::Relaxed);
            stats
                .waiting_bytes
                .fetch_sub(block.size as i64, Ordering::Relaxed);
            stats.kept_blocks.fetch_add(1, Ordering::Relaxed);
            stats
                .kept_bytes
                .fetch_add(block.size as i64, Ordering::Relaxed);
            block.state = BlockState::Kept;
        }
        if block.state == BlockState::Kept {
            self.kept.push(block);
            return;
        }
        if self.closing {
            self.free_blocks(vec![block]).await;
        } else {
            block.state = BlockState::Cached;
            self.shared.ready.put(block);
        }
    }

    pub(super) async fn miss(&mut self, class: SizeClass) -> Result<Box<Block<R>>, Error> {
        if let Some(b) = self.shared.ready.take(class.index) {
            return Ok(b);
        }
        // Invariant 3: notice completed events before taking fresh memory.
        if self.shared.stats.waiting_blocks.load(Ordering::Relaxed) > 0 {
            self.flush_events().await;
            if let Some(b) = self.shared.ready.take(class.index) {
                return Ok(b);
            }
        }
        self.fresh(class).await
    }

    pub(super) async fn flush_events(&self) {
        // Blocks parked by the threads that freed them are polled too.
        self.shared.ready.unpark_all(&self.shared.poller);
        let (tx, rx) = flume::bounded(1);
        if self
            .shared
            .poller
            .send(PollerMsg::Flush { reply: tx })
            .is_ok()
        {
            let _ = rx.recv_async().await;
        }
    }

    /// Frees blocks on a blocking thread and keeps the books.
    pub(super) async fn free_blocks(&self, blocks: Vec<Box<Block<R>>>) -> (usize, usize) {
        if blocks.is_empty() {
            return (0, 0);
        }
        let n = blocks.len();
        let bytes = blocks.iter().map(|b| b.memory.size).sum();
        let shared = self.shared.clone();
        let job = tokio::task::spawn_blocking(move || {
            for b in blocks {
                shared.clone().free_block_now(b);
            }
        });
        if let Err(e) = job.await {
            tracing::error!(error = %e, "freeing pinned memory failed");
        }
        (n, bytes)
    }

    pub(super) async fn free_kept(&mut self) -> (usize, usize) {
        let kept = std::mem::take(&mut self.kept);
        let stats = &self.shared.stats;
        for b in &kept {
            stats.kept_blocks.fetch_sub(1, Ordering::Relaxed);
            stats.kept_bytes.fetch_sub(b.size as i64, Ordering::Relaxed);
        }
        self.free_blocks(kept).await
    }

    pub(super) async fn empty_cache(&mut self, include_kept: bool) -> EmptyReport {
        let span = tracing::info_span!("empty_cache", pool = %self.shared.id);
        let _enter = span.enter();
        if self.shared.stats.waiting_blocks.load(Ordering::Relaxed) > 0 {
            self.flush_events().await;
        }
        let blocks = self.shared.ready.drain();
        let (mut n, mut bytes) = self.free_blocks(blocks).await;
        if include_kept {
            let (kn, kb) = self.free_kept().await;
            n += kn;
            bytes += kb;
        }
        let reserved_after = self.shared.stats.allocated_bytes.read().current.max(0) as usize;
        tracing::debug!(
            freed_blocks = n,
            freed_bytes = bytes,
            reserved_after,
            "cache emptied"
        );
        EmptyReport {
            freed_blocks: n,
            freed_bytes: bytes,
            reserved_after,
        }
    }
}
