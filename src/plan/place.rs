//! Placement of allocations one at a time, in a given order, into the gaps left by the
//! already placed allocations they conflict with. This is the decoder that the `best`
//! planner's search runs over and over, so it keeps its buffers between calls.

use super::problem::{Conflicts, Problem};

/// Which gap an allocation takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fit {
    /// The lowest offset where it fits.
    First,
    /// The smallest gap between conflicting neighbours that fits, else above them all.
    Best,
}

pub(crate) struct Placer<'a> {
    problem: &'a Problem,
    conflicts: &'a Conflicts,
    placed: Vec<bool>,
    pub(crate) offsets: Vec<u64>,
    scratch: Vec<(u64, u64)>,
}

impl<'a> Placer<'a> {
    pub(crate) fn new(problem: &'a Problem, conflicts: &'a Conflicts) -> Placer<'a> {
        Placer {
            problem,
            conflicts,
            placed: vec![false; problem.len()],
            offsets: vec![0; problem.len()],
            scratch: Vec::new(),
        }
    }

    /// Places every allocation of `order` afresh; returns the arena size.
    pub(crate) fn place_all(&mut self, order: &[u32], fit: Fit) -> u64 {
        self.placed.iter_mut().for_each(|p| *p = false);
        self.place_from(order, 0, fit)
    }

    /// Re-places `order[from..]`, keeping `order[..from]` where they are; returns the arena
    /// size.
    pub(crate) fn place_from(&mut self, order: &[u32], from: usize, fit: Fit) -> u64 {
        for &i in &order[from..] {
            self.placed[i as usize] = false;
        }
        for &i in &order[from..] {
            let offset = self.fit(i as usize, fit);
            self.offsets[i as usize] = offset;
            self.placed[i as usize] = true;
        }
        self.arena()
    }

    pub(crate) fn arena(&self) -> u64 {
        (0..self.problem.len())
            .map(|i| self.offsets[i] + self.problem.size[i])
            .max()
            .unwrap_or(0)
    }

    fn fit(&mut self, i: usize, fit: Fit) -> u64 {
        let size = self.problem.size[i];
        self.scratch.clear();
        for &j in self.conflicts.neighbours(i) {
            let j = j as usize;
            if self.placed[j] {
                let offset = self.offsets[j];
                self.scratch.push((offset, offset + self.problem.size[j]));
            }
        }
        self.scratch.sort_unstable();
        let mut cursor = 0u64;
        let mut best: Option<(u64, u64)> = None; // (gap, offset)
        for &(lo, hi) in &self.scratch {
            if lo > cursor && lo - cursor >= size {
                let gap = lo - cursor;
                match fit {
                    Fit::First => return cursor,
                    Fit::Best => {
                        if best.map_or(true, |(g, _)| gap < g) {
                            best = Some((gap, cursor));
                        }
                    }
                }
            }
            cursor = cursor.max(hi);
        }
        best.map_or(cursor, |(_, offset)| offset)
    }
}
