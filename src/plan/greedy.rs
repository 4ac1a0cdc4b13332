//! The baseline planner, after PyTorch's `formulate_greedy_allocation_plan`: walk the
//! allocation and free events in time order; place each allocation in the smallest free
//! chunk that fits (lowest offset among equals), or else at the current end of the arena;
//! on free, merge the chunk with free neighbours. Like PyTorch, a free chunk at the end of
//! the arena is not extended when a request does not fit in it.

use std::collections::{BTreeMap, BTreeSet};

use super::problem::Problem;

/// Offsets for every allocation of `problem`.
pub(crate) fn plan(problem: &Problem) -> Vec<u64> {
    let n = problem.len();
    let mut offsets = vec![0u64; n];
    // (time, 0 = free / 1 = alloc, index): frees first at equal times (half-open lifetimes).
    let mut events: Vec<(u64, u8, usize)> = Vec::with_capacity(2 * n);
    for i in (0..n).filter(|&i| problem.occupies(i)) {
        events.push((problem.start[i], 1, i));
        events.push((problem.end[i], 0, i));
    }
    events.sort_unstable();

    let mut chunks = FreeChunks::default();
    let mut top: u64 = 0;
    for (_, kind, i) in events {
        let size = problem.size[i];
        if kind == 1 {
            offsets[i] = chunks.take_best_fit(size).unwrap_or_else(|| {
                top += size;
                top - size
            });
        } else {
            chunks.give_back(offsets[i], size);
        }
    }
    offsets
}

/// Free chunks of the arena, by size (for best fit) and by offset (for merging).
#[derive(Default)]
struct FreeChunks {
    by_size: BTreeSet<(u64, u64)>,
    by_offset: BTreeMap<u64, u64>,
}

impl FreeChunks {
    fn take_best_fit(&mut self, size: u64) -> Option<u64> {
        let &(chunk_size, offset) = self.by_size.range((size, 0)..).next()?;
        self.remove(offset, chunk_size);
        if chunk_size > size {
            self.insert(offset + size, chunk_size - size);
        }
        Some(offset)
    }

    fn give_back(&mut self, mut offset: u64, mut size: u64) {
        if let Some(&next_size) = self.by_offset.get(&(offset + size)) {
            self.remove(offset + size, next_size);
            size += next_size;
        }
        let previous = self.by_offset.range(..offset).next_back();
        if let Some((&prev_offset, &prev_size)) = previous {
            if prev_offset + prev_size == offset {
                self.remove(prev_offset, prev_size);
                offset = prev_offset;
                size += prev_size;
            }
        }
        self.insert(offset, size);
    }

    fn insert(&mut self, offset: u64, size: u64) {
        self.by_size.insert((size, offset));
        self.by_offset.insert(offset, size);
    }

    fn remove(&mut self, offset: u64, size: u64) {
        self.by_size.remove(&(size, offset));
        self.by_offset.remove(&offset);
    }
}
