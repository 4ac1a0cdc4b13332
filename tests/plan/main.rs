//! Memory plans: the planners, recording an iteration and serving or validating a later one,
//! and plan sessions on the allocator.
//!
//! Each module holds the tests of one behaviour; the helpers all test binaries share are in
//! `pinpool_testkit` (`tests/common`).

mod plan_cursor;
mod plan_planners;
mod plan_session;
