//! Recording one iteration and serving or validating a later one against its plan.

use pinpool::plan::{Mismatch, Observed, Plan, Planner, Recorder, ValidationError};
use pinpool_tools::trace::Trace;

/// a(100) b(200) free a, c(100) free b, free c: `c` may take `a`'s bytes.
fn small_plan() -> Plan {
    let mut r = Recorder::new();
    let a = r.on_alloc(100);
    let b = r.on_alloc(200);
    r.on_free(a).unwrap();
    let c = r.on_alloc(100);
    r.on_free(b).unwrap();
    r.on_free(c).unwrap();
    Planner::Best.plan(&r.finish()).unwrap()
}

fn alloc(size: u64) -> Observed {
    Observed::Alloc { size }
}

fn free(id: usize) -> Observed {
    Observed::Free { id }
}

fn mismatch(plan: &Plan, run: &[Observed]) -> Option<ValidationError> {
    plan.validate(run.iter().copied()).err()
}

#[test]
fn recorded_run_replays_without_mismatch() {
    let plan = small_plan();
    assert_eq!(
        mismatch(
            &plan,
            &[
                alloc(100),
                alloc(200),
                free(0),
                alloc(100),
                free(1),
                free(2)
            ]
        ),
        None
    );
}

#[test]
fn frees_may_come_earlier_or_reordered_before_the_bytes_are_needed() {
    let plan = small_plan();
    // Frees reordered at the end, and `c`'s free never made: both harmless.
    assert_eq!(
        mismatch(
            &plan,
            &[
                alloc(100),
                alloc(200),
                free(0),
                alloc(100),
                free(2),
                free(1)
            ]
        ),
        None
    );
    assert_eq!(
        mismatch(&plan, &[alloc(100), alloc(200), free(0), alloc(100)]),
        None
    );
}

#[test]
fn a_late_free_is_reported_at_the_allocation_that_needed_its_bytes() {
    let plan = small_plan();
    let err = mismatch(&plan, &[alloc(100), alloc(200), alloc(100)]).unwrap();
    assert_eq!(
        err,
        ValidationError {
            event: 2,
            mismatch: Mismatch::FreedLate {
                number: 2,
                still_live: 0
            }
        }
    );
}

#[test]
fn size_mismatch_reports_expected_and_seen() {
    let plan = small_plan();
    let err = mismatch(&plan, &[alloc(100), alloc(300)]).unwrap();
    assert_eq!(err.event, 1);
    assert_eq!(
        err.mismatch,
        Mismatch::SizeMismatch {
            number: 1,
            expected: 200,
            seen: 300
        }
    );
}

#[test]
fn extra_and_missing_allocations_are_reported() {
    let plan = small_plan();
    let run = [alloc(100), alloc(200), free(0), alloc(100), alloc(8)];
    assert_eq!(
        mismatch(&plan, &run).unwrap().mismatch,
        Mismatch::TooManyAllocations {
            number: 3,
            planned: 3
        }
    );
    let short = mismatch(&plan, &[alloc(100)]).unwrap();
    assert_eq!(
        short,
        ValidationError {
            event: 1,
            mismatch: Mismatch::TooFewAllocations {
                made: 1,
                planned: 3
            }
        }
    );
}

#[test]
fn free_of_an_allocation_never_made_is_reported_not_undefined() {
    // PyTorch's validate_allocation_plan dereferences find()'s result before the end() check.
    let plan = small_plan();
    assert_eq!(
        mismatch(&plan, &[alloc(100), free(5)]).unwrap().mismatch,
        Mismatch::UnknownFree { id: 5 }
    );
    assert_eq!(
        mismatch(&plan, &[free(0)]).unwrap().mismatch,
        Mismatch::UnknownFree { id: 0 }
    );
    let double = mismatch(&plan, &[alloc(100), free(0), free(0)]).unwrap();
    assert_eq!(double.mismatch, Mismatch::DoubleFree { id: 0 });
}

#[test]
fn cursor_serves_planned_offsets_and_resets_for_the_next_run() {
    let plan = small_plan();
    let mut cursor = plan.cursor();
    for _ in 0..2 {
        let a = cursor.on_alloc(100).unwrap();
        let b = cursor.on_alloc(200).unwrap();
        assert_eq!((a.offset, b.offset), (plan.offsets()[0], plan.offsets()[1]));
        assert!(cursor.on_alloc(100).is_err(), "a is still live");
        assert_eq!(cursor.served(), 2, "a mismatch leaves the cursor unchanged");
        cursor.on_free(a.number).unwrap();
        assert_eq!(cursor.on_alloc(100).unwrap().offset, plan.offsets()[2]);
        cursor.finish().unwrap();
        cursor.reset();
    }
}

#[test]
fn recorder_rejects_unknown_and_double_frees() {
    let mut r = Recorder::new();
    assert!(r.on_free(0).is_err());
    let id = r.on_alloc(1);
    r.on_free(id).unwrap();
    assert!(r.on_free(id).is_err());
    assert_eq!(r.finish()[0].end, 1, "rejected frees do not advance time");
}

#[test]
fn a_trace_validates_against_its_own_plan() {
    let text = "a 0 64 0\na 1 128 0\nf 0\na 2 64 0\na 3 32 0\nf 2\nf 1\na 4 256 0\n";
    let trace = Trace::read_text(text.as_bytes(), "t").unwrap();
    for planner in Planner::ALL {
        let plan = planner.plan(trace.lifetimes()).unwrap();
        assert_eq!(
            plan.validate(trace.events().iter().map(|&e| Observed::from(e))),
            Ok(())
        );
    }
}
