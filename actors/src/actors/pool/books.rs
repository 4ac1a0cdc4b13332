//! The pool's books: where its reserved bytes are (invariant 2), and its registry of
//! segments (for snapshots).

use super::PoolActor;
use crate::books::messages::{Inventory, PieceView, PoolView, SegmentView};
use crate::vocab::runtime::Runtime;

impl<R: Runtime> PoolActor<R> {
    pub(super) fn inventory(&self) -> Inventory {
        let s = self.shared.stats.read();
        let (ready_blocks, ready_bytes) = self.shared.ready.census();
        let reserved_bytes = s.allocated_bytes.current.max(0) as usize;
        let segments = s.allocations.current.max(0) as usize;
        let refused = self
            .carved
            .as_ref()
            .map_or(Vec::new(), |_| self.refused_segments());
        let kept_blocks = self.kept.len() + refused.len();
        let kept_bytes: usize = self.kept.iter().map(|b| b.memory.size).sum::<usize>()
            + refused.iter().map(|r| r.1).sum::<usize>();
        let waiting_blocks = s.waiting_blocks.max(0) as usize;
        let waiting_bytes = s.waiting_bytes.max(0) as usize;
        // Under a carving layout, free ranges of segments count as cached, and blocks are
        // the pieces lent out of segments rather than host allocations.
        let (free_ranges, free_bytes, blocks) = self
            .carved
            .as_ref()
            .map_or((0, 0, segments), |s| s.census());
        // Refused segments are counted among the host allocations, not the lent pieces.
        let blocks = blocks + refused.len();
        let (cached_blocks, cached_bytes) = (ready_blocks + free_ranges, ready_bytes + free_bytes);
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
            in_use_blocks: blocks.saturating_sub(ready_blocks + waiting_blocks + kept_blocks),
            in_use_bytes: reserved_bytes.saturating_sub(cached_bytes + waiting_bytes + kept_bytes),
        }
    }

    /// Strikes the segments freed since the last look from the registry.
    fn forget_freed(&mut self) {
        for addr in self.shared.forgotten() {
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
        let mut kept: Vec<usize> = self
            .kept
            .iter()
            .map(|b| b.memory.ptr.as_ptr() as usize)
            .collect();
        let mut segments: Vec<SegmentView> = self.segments.values().cloned().collect();
        if let Some(carved) = &self.carved {
            segments.extend(carved.arena_views());
            let mut pieces = carved.pieces();
            let refused = self.refused_segments();
            for s in &mut segments {
                if let Some(p) = pieces.remove(&s.addr()) {
                    s.pieces = p;
                } else if let Some(&(addr, size)) = refused.iter().find(|r| r.0 == s.addr()) {
                    // Held back after a refused free: one kept piece.
                    s.pieces = vec![PieceView {
                        addr,
                        size,
                        meta: Some(s.meta),
                    }];
                    kept.push(addr);
                }
            }
        }
        PoolView {
            pool: self.shared.id,
            memory: self.shared.memory.kind(),
            owner: self.shared.owner,
            segments,
            cached,
            kept,
        }
    }
}
