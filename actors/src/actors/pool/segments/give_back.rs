//! Giving wholly free segments back to the memory source: to make room under the reserve
//! cap, when the cache is emptied, and again for those whose free the source refused.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::actors::pool::PoolActor;
use crate::blocks::block::Seg;
use crate::vocab::runtime::Runtime;

impl<R: Runtime> PoolActor<R> {
    /// Gives back wholly free segments, least recently used first, until `bytes` have gone
    /// back.
    pub(in crate::actors::pool) async fn give_back_room(&mut self, bytes: usize) {
        let Some(segs) = self.carved.as_mut() else {
            return;
        };
        let mut freed = 0;
        let mut gone = Vec::new();
        for (id, n) in segs.carver.free_segments_lru() {
            if freed >= bytes {
                break;
            }
            if let Some((g, _)) = segs.carver.remove_segment(id) {
                gone.push(g);
                freed += n;
            }
        }
        self.host_free_segments(gone).await;
    }

    /// Gives back every wholly free segment (only those larger than `max_cached_size`
    /// unless `all`), on a blocking thread. Returns (segments, bytes).
    pub(in crate::actors::pool) async fn give_back_free_segments(
        &mut self,
        all: bool,
    ) -> (usize, usize) {
        let Some(segs) = self.carved.as_mut() else {
            return (0, 0);
        };
        let max = segs.carving.max_cached_size;
        let gone = segs.carver.remove_free_segments(|size| !all && size <= max);
        let gone = gone.into_iter().map(|(g, _)| g).collect();
        let (n, bytes) = self.host_free_segments(gone).await;
        // Idle granules of the arena go too (after a block too large to cache came back,
        // only when there is such a size).
        let (an, abytes) = if all || max < usize::MAX {
            self.unmap_idle(usize::MAX).await
        } else {
            (0, 0)
        };
        (n + an, bytes + abytes)
    }

    /// Gives back wholly free separate segments until `upto` bytes went (see
    /// `give_back_some`). Returns (segments, bytes) given back.
    pub(in crate::actors::pool) async fn give_back_free_segments_upto(
        &mut self,
        upto: usize,
    ) -> (usize, usize) {
        let Some(segs) = self.carved.as_mut() else {
            return (0, 0);
        };
        let mut left = upto;
        let gone = segs.carver.remove_free_segments(|size| {
            if left == 0 {
                return true;
            }
            left = left.saturating_sub(size);
            false
        });
        let gone = gone.into_iter().map(|(g, _)| g).collect();
        self.host_free_segments(gone).await
    }

    /// Gives segments taken out of the carvers back to the runtime on a blocking thread. A
    /// segment the runtime refuses to free is held back (never reused, counted as kept) and
    /// tried again with the kept blocks. Returns (segments, bytes) given back.
    async fn host_free_segments(&mut self, gone: Vec<Arc<Seg<R>>>) -> (usize, usize) {
        if gone.is_empty() {
            return (0, 0);
        }
        let shared = self.shared.clone();
        let job = self.off_executor(move || {
            let mut freed = (0, 0);
            let mut refused = Vec::new();
            for seg in gone {
                // Every piece came back, so no block holds the segment.
                match shared.free_memory_now(seg.memory) {
                    Ok(()) => {
                        seg.mark_given_back();
                        freed = (freed.0 + 1, freed.1 + seg.memory.size);
                    }
                    Err(_) => refused.push(seg),
                }
            }
            (freed, refused)
        });
        match job.await {
            Ok((freed, refused)) => {
                let stats = &self.shared.stats;
                for seg in refused {
                    stats.kept_blocks.fetch_add(1, Ordering::Relaxed);
                    stats
                        .kept_bytes
                        .fetch_add(seg.memory.size as i64, Ordering::Relaxed);
                    self.refused.push(seg);
                }
                freed
            }
            Err(e) => {
                tracing::error!(error = %e, "freeing memory failed");
                (0, 0)
            }
        }
    }

    /// Tries again to give back the segments whose free the runtime refused.
    pub(in crate::actors::pool) async fn retry_refused_segments(&mut self) -> (usize, usize) {
        let refused = std::mem::take(&mut self.refused);
        let stats = &self.shared.stats;
        for seg in &refused {
            stats.kept_blocks.fetch_sub(1, Ordering::Relaxed);
            stats
                .kept_bytes
                .fetch_sub(seg.memory.size as i64, Ordering::Relaxed);
        }
        self.host_free_segments(refused).await
    }

    /// Addresses and sizes of the segments held back after a refused free.
    pub(in crate::actors::pool) fn refused_segments(&self) -> Vec<(usize, usize)> {
        self.refused
            .iter()
            .map(|s| (s.memory.ptr.as_ptr() as usize, s.memory.size))
            .collect()
    }
}
