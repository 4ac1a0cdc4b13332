//! The planners: every plan passes the independent checker, stays at or above the lower
//! bound, and `best` is deterministic and never worse than `greedy`.

use pinpool::plan::Lifetime;
use pinpool::plan::{check, lower_bound, Plan, PlanError, Planner, Violation};
use proptest::prelude::*;

fn l(id: usize, size: u64, start: u64, end: u64) -> Lifetime {
    Lifetime {
        id,
        size,
        start,
        end,
    }
}

fn plan_and_check(planner: Planner, lifetimes: &[Lifetime], alignment: u64) -> Plan {
    let plan = planner.plan_aligned(lifetimes, alignment).unwrap();
    check(&plan).unwrap_or_else(|v| panic!("{} made an unsound plan: {v}", planner.name()));
    let aligned: Vec<Lifetime> = lifetimes
        .iter()
        .map(|x| Lifetime {
            size: x.size.div_ceil(alignment) * alignment,
            ..*x
        })
        .collect();
    assert!(plan.arena_size() >= lower_bound(&aligned));
    plan
}

#[test]
fn greedy_reuses_the_smallest_free_chunk_that_fits_like_pytorch() {
    // Freeing 0 and 2 leaves chunks of 256 and 128 bytes around live 1; 3 takes the 128.
    let lifetimes = [
        l(0, 256, 0, 3),
        l(1, 64, 1, 6),
        l(2, 128, 2, 4),
        l(3, 128, 5, 6),
    ];
    let plan = plan_and_check(Planner::Greedy, &lifetimes, 64);
    assert_eq!(plan.offsets(), [0, 256, 320, 320]);
    assert_eq!(plan.arena_size(), 448);
}

#[test]
fn greedy_does_not_grow_a_trailing_free_chunk_but_best_packs_to_the_bound() {
    // After 0 is freed, 2 (larger) does not fit in its chunk: greedy appends at the end.
    let lifetimes = [l(0, 64, 0, 2), l(1, 64, 1, 4), l(2, 128, 3, 5)];
    assert_eq!(
        plan_and_check(Planner::Greedy, &lifetimes, 64).arena_size(),
        256
    );
    assert_eq!(
        plan_and_check(Planner::Best, &lifetimes, 64).arena_size(),
        192
    );
    assert_eq!(lower_bound(&lifetimes), 192);
}

#[test]
fn sizes_are_rounded_up_to_the_alignment() {
    let lifetimes = [l(0, 1, 0, 2), l(1, 65, 0, 2)];
    for planner in Planner::ALL {
        let plan = plan_and_check(planner, &lifetimes, 64);
        assert_eq!(plan.arena_size(), 64 + 128);
        assert_eq!(plan.aligned_size(1), Some(128));
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    assert_eq!(
        Planner::Best.plan_aligned(&[], 48),
        Err(PlanError::BadAlignment { alignment: 48 })
    );
    assert_eq!(
        Planner::Best.plan(&[l(0, 8, 5, 4)]),
        Err(PlanError::ReversedLifetime {
            index: 0,
            start: 5,
            end: 4
        })
    );
    assert_eq!(
        Planner::Greedy.plan(&[l(0, u64::MAX, 0, 1)]),
        Err(PlanError::TooLarge)
    );
    let too_much = [l(0, 1 << 63, 0, 1), l(1, 1 << 63, 2, 3)];
    assert_eq!(Planner::Best.plan(&too_much), Err(PlanError::TooLarge));
}

#[test]
fn empty_and_zero_sized_allocations_take_no_room() {
    let lifetimes = [l(0, 0, 0, 5), l(1, 64, 2, 2), l(2, 64, 1, 3)];
    for planner in Planner::ALL {
        assert_eq!(plan_and_check(planner, &lifetimes, 64).arena_size(), 64);
    }
    assert_eq!(Planner::Best.plan(&[]).unwrap().arena_size(), 0);
}

#[test]
fn checker_catches_overlap_misalignment_and_overflowing_the_arena() {
    let two = vec![l(0, 64, 0, 2), l(1, 64, 1, 3)];
    let overlap = Plan::from_parts(two.clone(), vec![0, 32], 32, 128).unwrap();
    assert_eq!(
        check(&overlap),
        Err(Violation::Overlap {
            first: 0,
            second: 1
        })
    );
    let misaligned = Plan::from_parts(two.clone(), vec![0, 65], 64, 192).unwrap();
    assert!(matches!(
        check(&misaligned),
        Err(Violation::Misaligned { index: 1, .. })
    ));
    let outside = Plan::from_parts(two.clone(), vec![0, 64], 64, 100).unwrap();
    assert!(matches!(
        check(&outside),
        Err(Violation::OutOfArena { index: 1, .. })
    ));
    let touching = Plan::from_parts(two, vec![0, 64], 64, 128).unwrap();
    assert_eq!(check(&touching), Ok(()));
    // Same bytes at different times are fine.
    let reuse = Plan::from_parts(vec![l(0, 64, 0, 2), l(1, 64, 2, 3)], vec![0, 0], 64, 64).unwrap();
    assert_eq!(check(&reuse), Ok(()));
    assert!(Plan::from_parts(vec![l(0, 1, 0, 1)], vec![], 64, 0).is_err());
}

/// Random instances: up to 40 allocations, times below 40, sizes below 5000.
fn instances() -> impl Strategy<Value = Vec<Lifetime>> {
    prop::collection::vec((0u64..5000, 0u64..40, 1u64..20), 0..40).prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(id, (size, start, len))| l(id, size, start, start + len))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn every_plan_is_sound_and_best_never_loses_to_greedy(lifetimes in instances()) {
        for alignment in [1, 64] {
            let greedy = plan_and_check(Planner::Greedy, &lifetimes, alignment);
            let best = plan_and_check(Planner::Best, &lifetimes, alignment);
            prop_assert!(best.arena_size() <= greedy.arena_size());
        }
    }

    #[test]
    fn plans_are_deterministic(lifetimes in instances()) {
        prop_assert_eq!(Planner::Best.plan(&lifetimes).unwrap(), Planner::Best.plan(&lifetimes).unwrap());
    }

    #[test]
    fn checker_rejects_any_two_live_allocations_at_one_offset(lifetimes in instances()) {
        let overlapping = (0..lifetimes.len()).flat_map(|a| (a + 1..lifetimes.len()).map(move |b| (a, b)))
            .find(|&(a, b)| lifetimes[a].overlaps(&lifetimes[b]) && lifetimes[a].size > 0 && lifetimes[b].size > 0);
        if let Some((a, b)) = overlapping {
            let mut offsets: Vec<u64> = (0..lifetimes.len() as u64).map(|i| i * 8192).collect();
            offsets[b] = offsets[a];
            let plan = Plan::from_parts(lifetimes.clone(), offsets, 1, 1 << 20).unwrap();
            let is_overlap = matches!(check(&plan), Err(Violation::Overlap { .. }));
            prop_assert!(is_overlap);
        }
    }
}
