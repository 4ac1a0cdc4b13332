//! Property tests: the allocator against a reference model, and untrusted input (configuration
//! strings, traces, snapshots) that never panics or takes memory out of proportion.
//!
//! Each module holds the tests of one behaviour; the helpers all test binaries share are in
//! `pinpool_testkit` (`tests/common`).

mod fuzz_inputs;
mod model;
mod stats_invariants;
