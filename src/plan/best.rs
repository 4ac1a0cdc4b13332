//! The `best` planner: decode several orderings with first-fit and best-fit placement,
//! keep the smallest arena, then improve it by a local search that moves allocations
//! reaching the top of the arena earlier in the order and re-places everything after them.
//! The PyTorch-style greedy plan is a candidate too, so `best` is never worse than it.
//! Every choice is driven by a fixed-seed generator and a work budget counted in placement
//! steps, never in wall time, so plans are deterministic.

use super::greedy;
use super::place::{Fit, Placer};
use super::problem::{Conflicts, Problem};
use super::rng::Rng;

/// Above this many conflict edges the search is skipped and the greedy plan returned.
const MAX_EDGES: usize = 4_000_000;
/// Placement work (allocations placed plus neighbours scanned) allowed in all.
const WORK: u64 = 30_000_000;
const FITS: [Fit; 2] = [Fit::Best, Fit::First];
/// Search iterations allowed per allocation, for small instances.
const ITERATIONS_PER_ALLOCATION: u64 = 40;
/// The search stops after this many iterations per allocation without a smaller arena.
const PATIENCE_PER_ALLOCATION: u64 = 10;
const SEED: u64 = 0x7069_6e70_6f6f_6c21;

pub(crate) fn plan(problem: &Problem) -> Vec<u64> {
    let greedy = greedy::plan(problem);
    let greedy_arena = arena(problem, &greedy);
    let Some(conflicts) = Conflicts::build(problem, MAX_EDGES) else {
        return greedy;
    };
    let n = problem.len();
    let items: Vec<u32> = (0..n as u32)
        .filter(|&i| problem.occupies(i as usize))
        .collect();
    let mut placer = Placer::new(problem, &conflicts);

    // The best ordering for each placement rule, then a search from each. Each full
    // placement costs about `cost` steps; all of it comes out of one budget.
    let cost = (items.len() + conflicts.entries()) as u64 + 1;
    let mut work_left = WORK;
    let mut best: [Option<(u64, Vec<u32>)>; 2] = [None, None];
    'orderings: for order in orderings(problem, &conflicts, &items) {
        for (slot, fit) in FITS.into_iter().enumerate() {
            if work_left < cost && best[0].is_some() {
                break 'orderings;
            }
            work_left = work_left.saturating_sub(cost);
            let arena = placer.place_all(&order, fit);
            if best[slot].as_ref().map_or(true, |(a, _)| arena < *a) {
                best[slot] = Some((arena, order.clone()));
            }
        }
    }
    let starts: Vec<(Vec<u32>, Fit)> = best
        .into_iter()
        .zip(FITS)
        .filter_map(|(found, fit)| found.map(|(_, order)| (order, fit)))
        .collect();
    let budget = work_left / starts.len().max(1) as u64;
    let mut found: Option<(u64, Vec<u64>)> = None;
    for (order, fit) in starts {
        let (arena, offsets) = improve(&mut placer, problem, &conflicts, order, fit, budget);
        if found.as_ref().map_or(true, |(a, _)| arena < *a) {
            found = Some((arena, offsets));
        }
    }
    let Some((arena, offsets)) = found else {
        return greedy; // nothing occupies memory
    };
    if arena < greedy_arena {
        offsets
    } else {
        greedy
    }
}

fn arena(problem: &Problem, offsets: &[u64]) -> u64 {
    (0..problem.len())
        .map(|i| offsets[i] + problem.size[i])
        .max()
        .unwrap_or(0)
}

/// Candidate orderings of the allocations that occupy memory.
fn orderings(problem: &Problem, conflicts: &Conflicts, items: &[u32]) -> Vec<Vec<u32>> {
    let size = |i: u32| problem.size[i as usize];
    let length = |i: u32| problem.end[i as usize] - problem.start[i as usize];
    let start = |i: u32| problem.start[i as usize];
    let load = conflict_load(problem, conflicts);
    let sorted = |key: &dyn Fn(u32) -> (u128, u128)| {
        let mut order = items.to_vec();
        // Descending keys, ties by start then index: a total order, hence deterministic.
        order.sort_by(|&a, &b| {
            key(b)
                .cmp(&key(a))
                .then(start(a).cmp(&start(b)))
                .then(a.cmp(&b))
        });
        order
    };
    vec![
        sorted(&|i| (size(i) as u128, length(i) as u128)),
        sorted(&|i| (size(i) as u128 * length(i) as u128, size(i) as u128)),
        sorted(&|i| (length(i) as u128, size(i) as u128)),
        sorted(&|i| (load[i as usize] as u128, size(i) as u128)),
        sorted(&|i| {
            (
                conflicts.neighbours(i as usize).len() as u128,
                size(i) as u128,
            )
        }),
        sorted(&|i| (u128::MAX - start(i) as u128, size(i) as u128)),
    ]
}

/// Per allocation, its size plus the sizes of everything it conflicts with.
fn conflict_load(problem: &Problem, conflicts: &Conflicts) -> Vec<u64> {
    (0..problem.len())
        .map(|i| {
            conflicts
                .neighbours(i)
                .iter()
                .map(|&j| problem.size[j as usize])
                .sum::<u64>()
                + problem.size[i]
        })
        .collect()
}

/// Local search: take an allocation that reaches the top of the arena, move it to a random
/// earlier place in the order, re-place from there; keep the move unless the arena grows.
fn improve(
    placer: &mut Placer<'_>,
    problem: &Problem,
    conflicts: &Conflicts,
    mut order: Vec<u32>,
    fit: Fit,
    budget: u64,
) -> (u64, Vec<u64>) {
    let mut arena = placer.place_all(&order, fit);
    let lower_bound = problem.peak_live();
    let cost = (order.len() + conflicts.entries()) as u64 + 1;
    let iterations = (budget / cost).min(ITERATIONS_PER_ALLOCATION * order.len() as u64 + 100);
    let patience = PATIENCE_PER_ALLOCATION * order.len() as u64 + 50;
    let mut since_improvement = 0;
    let mut rng = Rng::new(SEED);
    let mut position = vec![0usize; problem.len()];
    let mut saved = placer.offsets.clone();
    let mut critical = Vec::new();
    for _ in 0..iterations {
        if arena <= lower_bound || since_improvement > patience {
            break;
        }
        since_improvement += 1;
        // Alternate between the allocations at the very top and all those above the bound.
        let line = if rng.below(2) == 0 {
            arena - 1
        } else {
            lower_bound
        };
        critical.clear();
        critical.extend(
            order
                .iter()
                .copied()
                .filter(|&i| placer.offsets[i as usize] + problem.size[i as usize] > line),
        );
        let Some(&pick) = critical.get(rng.below(critical.len().max(1))) else {
            break;
        };
        for (p, &i) in order.iter().enumerate() {
            position[i as usize] = p;
        }
        let from = position[pick as usize];
        if from == 0 {
            continue;
        }
        let to = rng.below(from);
        saved.copy_from_slice(&placer.offsets);
        order[to..=from].rotate_right(1);
        let candidate = placer.place_from(&order, to, fit);
        if candidate <= arena {
            if candidate < arena {
                since_improvement = 0;
            }
            arena = candidate;
        } else {
            order[to..=from].rotate_left(1);
            placer.offsets.copy_from_slice(&saved);
        }
    }
    (arena, placer.offsets.clone())
}
