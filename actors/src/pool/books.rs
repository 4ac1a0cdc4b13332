//! The pool's books: where its reserved bytes are (invariant 2), and its registry of
//! segments (for snapshots).

use super::{Inventory, PoolActor, PoolView, SegmentView};
use crate::runtime::Runtime;

impl<R: Runtime> PoolActor<R> {
    pub(super) fn inventory(&self) -> Inventory {
        let s = self.shared.stats.read();
        let (cached_blocks, cached_bytes) = self.shared.ready.census();
        let reserved_bytes = s.allocated_bytes.current.max(0) as usize;
        let segments = s.allocations.current.max(0) as usize;
        let kept_blocks = self.kept.len();
        let kept_bytes: usize = self.kept.iter().map(|b| b.memory.size).sum();
        let waiting_blocks = s.waiting_blocks.max(0) as usize;
        let waiting_bytes = s.waiting_bytes.max(0) as usize;
        Inventory {
            pool: self.shared.id,
            reserved_bytes,
            segments,
            cached_blocks,
            cached_bytes,
            waiting_blocks,
            waiting_bytes,
            kept_blocks,
            kept_bytes,
            in_use_blocks: segments.saturating_sub(cached_blocks + waiting_blocks + kept_blocks),
            in_use_bytes: reserved_bytes.saturating_sub(cached_bytes + waiting_bytes + kept_bytes),
        }
    }

    /// Strikes the segments freed since the last look from the registry.
    fn forget_freed(&mut self) {
        while let Ok(addr) = self.shared.forgotten.1.try_recv() {
            self.segments.remove(&addr);
        }
    }

    /// Enters a fresh segment in the registry.
    pub(super) fn remember_segment(&mut self, segment: SegmentView) {
        // A freed address may come back from the runtime: strike the old entry first.
        self.forget_freed();
        self.segments.insert(segment.addr(), segment);
    }

    /// The registry, and the addresses of the cached and kept blocks.
    pub(super) fn describe(&mut self) -> PoolView {
        self.forget_freed();
        let ready = self.shared.ready.drain();
        let cached = ready
            .iter()
            .map(|b| b.memory.ptr.as_ptr() as usize)
            .collect();
        for b in ready {
            self.shared.ready.put(b);
        }
        PoolView {
            pool: self.shared.id,
            segments: self.segments.values().cloned().collect(),
            cached,
            kept: self
                .kept
                .iter()
                .map(|b| b.memory.ptr.as_ptr() as usize)
                .collect(),
        }
    }
}
