//! The planning problem in normal form: aligned sizes and lifetimes checked once, and the
//! conflict graph (which allocations are live at the same time) in compressed rows.

use super::Lifetime;
use super::PlanError;

/// Aligned sizes and lifetimes, indexed like the planner's input.
pub(crate) struct Problem {
    pub(crate) size: Vec<u64>,
    pub(crate) start: Vec<u64>,
    pub(crate) end: Vec<u64>,
}

impl Problem {
    /// Checks the input and rounds sizes up to `alignment`. Guarantees that the sum of all
    /// aligned sizes fits in a `u64`, so no plan arithmetic can overflow afterwards.
    pub(crate) fn new(lifetimes: &[Lifetime], alignment: u64) -> Result<Problem, PlanError> {
        check_alignment(alignment)?;
        let mut total: u64 = 0;
        let mut size = Vec::with_capacity(lifetimes.len());
        for (index, lifetime) in lifetimes.iter().enumerate() {
            if lifetime.end < lifetime.start {
                return Err(PlanError::ReversedLifetime {
                    index,
                    start: lifetime.start,
                    end: lifetime.end,
                });
            }
            let aligned = align_up(lifetime.size, alignment).ok_or(PlanError::TooLarge)?;
            total = total.checked_add(aligned).ok_or(PlanError::TooLarge)?;
            size.push(aligned);
        }
        Ok(Problem {
            size,
            start: lifetimes.iter().map(|l| l.start).collect(),
            end: lifetimes.iter().map(|l| l.end).collect(),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.size.len()
    }

    /// Whether allocation `i` takes memory at some point (non-empty lifetime and size).
    pub(crate) fn occupies(&self, i: usize) -> bool {
        self.size[i] > 0 && self.start[i] < self.end[i]
    }

    /// Peak of the sum of live aligned sizes.
    pub(crate) fn peak_live(&self) -> u64 {
        let mut events: Vec<(u64, bool, u64)> = Vec::with_capacity(2 * self.len());
        for i in (0..self.len()).filter(|&i| self.occupies(i)) {
            events.push((self.start[i], true, self.size[i]));
            events.push((self.end[i], false, self.size[i]));
        }
        // At equal times frees (`false`) sort first: lifetimes are half-open.
        events.sort_unstable();
        let (mut live, mut peak) = (0u64, 0u64);
        for (_, is_alloc, size) in events {
            if is_alloc {
                live += size;
                peak = peak.max(live);
            } else {
                live -= size;
            }
        }
        peak
    }
}

pub(crate) fn check_alignment(alignment: u64) -> Result<(), PlanError> {
    if alignment.is_power_of_two() {
        Ok(())
    } else {
        Err(PlanError::BadAlignment { alignment })
    }
}

/// Rounds `size` up to a multiple of the power of two `alignment`.
pub(crate) fn align_up(size: u64, alignment: u64) -> Option<u64> {
    Some(size.checked_add(alignment - 1)? & !(alignment - 1))
}

/// Conflict graph: `neighbours(i)` are the allocations live at some time `i` is.
pub(crate) struct Conflicts {
    row: Vec<usize>,
    list: Vec<u32>,
}

impl Conflicts {
    /// Builds the graph by a sweep in start order; `None` if it would have more than
    /// `max_edges` edges (or more than `u32::MAX` allocations).
    pub(crate) fn build(problem: &Problem, max_edges: usize) -> Option<Conflicts> {
        let n = problem.len();
        u32::try_from(n).ok()?;
        let mut by_start: Vec<u32> = (0..n as u32)
            .filter(|&i| problem.occupies(i as usize))
            .collect();
        by_start.sort_unstable_by_key(|&i| (problem.start[i as usize], i));
        let mut edges: Vec<(u32, u32)> = Vec::new();
        let mut active: Vec<u32> = Vec::new();
        for &i in &by_start {
            let start = problem.start[i as usize];
            active.retain(|&j| problem.end[j as usize] > start);
            if edges.len() + active.len() > max_edges {
                return None;
            }
            edges.extend(active.iter().map(|&j| (i, j)));
            active.push(i);
        }
        let mut row = vec![0usize; n + 1];
        for &(a, b) in &edges {
            row[a as usize + 1] += 1;
            row[b as usize + 1] += 1;
        }
        for i in 0..n {
            row[i + 1] += row[i];
        }
        let mut fill = row.clone();
        let mut list = vec![0u32; row[n]];
        for &(a, b) in &edges {
            list[fill[a as usize]] = b;
            fill[a as usize] += 1;
            list[fill[b as usize]] = a;
            fill[b as usize] += 1;
        }
        Some(Conflicts { row, list })
    }

    pub(crate) fn neighbours(&self, i: usize) -> &[u32] {
        &self.list[self.row[i]..self.row[i + 1]]
    }

    /// Total number of adjacency entries (twice the edges).
    pub(crate) fn entries(&self) -> usize {
        self.list.len()
    }
}
