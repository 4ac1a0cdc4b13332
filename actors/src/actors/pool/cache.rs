//! Freeing the pool's cached blocks: to make room, when the cache is emptied (the kept
//! blocks too when the pool is released), and as the pool closes. A block the source refuses
//! to free is kept, never reused.

use std::sync::atomic::Ordering;

use super::PoolActor;
use crate::blocks::block::{Block, BlockState};
use crate::books::budget::EmptyReport;
use crate::vocab::runtime::Runtime;

impl<R: Runtime> PoolActor<R> {
    /// Frees blocks on a blocking thread and keeps the books. A block the runtime refuses
    /// to free is held back with the kept blocks (never reused) and tried again when they go.
    /// Carved blocks go back into their segments, and every wholly free segment is given
    /// back. Returns the host allocations given back and their bytes.
    pub(super) async fn free_blocks(&mut self, blocks: Vec<Box<Block<R>>>) -> (usize, usize) {
        let blocks = self.absorb_all(blocks);
        let (sn, sbytes) = self.give_back_free_segments(true).await;
        let (n, bytes) = self.free_whole_blocks(blocks).await;
        (n + sn, bytes + sbytes)
    }

    async fn free_whole_blocks(&mut self, blocks: Vec<Box<Block<R>>>) -> (usize, usize) {
        if blocks.is_empty() {
            return (0, 0);
        }
        let shared = self.shared.clone();
        let job = self.off_executor(move || {
            let mut freed = (0, 0);
            let mut refused = Vec::new();
            for b in blocks {
                let size = b.memory.size;
                match shared.free_block_now(b) {
                    Ok(()) => freed = (freed.0 + 1, freed.1 + size),
                    Err(b) => refused.push(b),
                }
            }
            (freed, refused)
        });
        match job.await {
            Ok((freed, refused)) => {
                for mut b in refused {
                    let stats = &self.shared.stats;
                    stats.kept_blocks.fetch_add(1, Ordering::Relaxed);
                    stats.kept_bytes.fetch_add(b.size as i64, Ordering::Relaxed);
                    b.state = BlockState::Kept;
                    self.kept.push(b);
                }
                freed
            }
            Err(e) => {
                tracing::error!(error = %e, "freeing memory failed");
                (0, 0)
            }
        }
    }

    pub(super) async fn free_kept(&mut self) -> (usize, usize) {
        let kept = std::mem::take(&mut self.kept);
        let stats = &self.shared.stats;
        for b in &kept {
            stats.kept_blocks.fetch_sub(1, Ordering::Relaxed);
            stats.kept_bytes.fetch_sub(b.size as i64, Ordering::Relaxed);
        }
        let (n, bytes) = self.free_blocks(kept).await;
        let (rn, rbytes) = self.retry_refused_segments().await;
        (n + rn, bytes + rbytes)
    }

    /// Frees the cached blocks — up to `upto` bytes of them (`usize::MAX`: all), and the kept
    /// ones too with `include_kept` — and with `forget`, the pool's layout also forgets what
    /// it learned from requests (see `Segments::forget`).
    pub(super) async fn empty_cache(
        &mut self,
        include_kept: bool,
        forget: bool,
        upto: usize,
    ) -> EmptyReport {
        if self.shared.stats.waiting_blocks.load(Ordering::Acquire) > 0 {
            self.flush_events().await;
        }
        let blocks = self.shared.ready.drain();
        let (mut n, mut bytes) = if upto == usize::MAX {
            self.free_blocks(blocks).await
        } else {
            self.give_back_some(blocks, upto).await
        };
        if include_kept {
            let (kn, kb) = self.free_kept().await;
            n += kn;
            bytes += kb;
        }
        let reserved_after = self.shared.stats.allocated_bytes.read().current.max(0) as usize;
        if let Some(s) = self.carved.as_mut().filter(|_| forget) {
            s.forget(self.shared.stats.active_bytes_now().max(0) as usize);
        }
        tracing::debug!(
            pool = %self.shared.id,
            upto,
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

    /// Gives back up to `upto` bytes of what the pool caches, for another pool that needs
    /// that much room under the cap, and keeps the rest cached (what would only be mapped
    /// again): `blocks` (the ready ones) are taken back (coalesced where the layout carves),
    /// then idle memory of the expandable range goes, least recently used first, then wholly
    /// free segments, then cached blocks of layouts that do not carve. Whole map calls,
    /// segments and blocks go, so a little more than `upto` may. Returns (calls or blocks,
    /// bytes) given back.
    async fn give_back_some(&mut self, blocks: Vec<Box<Block<R>>>, upto: usize) -> (usize, usize) {
        let mut rest = self.absorb_all(blocks);
        let (mut n, mut bytes) = self.unmap_idle(upto).await;
        if bytes < upto {
            let (sn, sbytes) = self.give_back_free_segments_upto(upto - bytes).await;
            n += sn;
            bytes += sbytes;
        }
        if bytes < upto && !rest.is_empty() {
            // Largest first: the fewest blocks for the bytes.
            rest.sort_unstable_by_key(|b| b.size);
            let mut going = Vec::new();
            let mut planned = bytes;
            while planned < upto {
                let Some(b) = rest.pop() else {
                    break;
                };
                planned += b.memory.size;
                going.push(b);
            }
            let (bn, bbytes) = self.free_whole_blocks(going).await;
            n += bn;
            bytes += bbytes;
        }
        for b in rest {
            self.shared.ready.put(b);
        }
        (n, bytes)
    }
}
