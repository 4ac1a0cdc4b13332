//! The pool's books: where its reserved bytes are (invariant 2).

use super::{Inventory, PoolActor};
use crate::runtime::Runtime;

impl<R: Runtime> PoolActor<R> {
    pub(super) fn inventory(&self) -> Inventory {
        let s = self.shared.stats.read();
        let (ready_blocks, ready_bytes) = self.shared.ready.census();
        let reserved_bytes = s.allocated_bytes.current.max(0) as usize;
        let segments = s.allocations.current.max(0) as usize;
        let kept_blocks = self.kept.len();
        let kept_bytes: usize = self.kept.iter().map(|b| b.memory.size).sum();
        let waiting_blocks = s.waiting_blocks.max(0) as usize;
        let waiting_bytes = s.waiting_bytes.max(0) as usize;
        // Under a carving layout, free ranges of segments count as cached, and blocks are
        // the pieces lent out of segments rather than host allocations.
        let (free_ranges, free_bytes, blocks) = self
            .segments
            .as_ref()
            .map_or((0, 0, segments), |s| s.census());
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
}
