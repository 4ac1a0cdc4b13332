//! The pinned-memory allocator on the simulated runtime: the cached path and its sizes, the
//! blocking calls, builder settings, capture pools, `empty_cache` and statistics, streams of
//! another runtime, where fresh memory is taken, both size policies, splitting, stream
//! ordering (invariant 1), per-thread slots, and the README's and guide's examples.
//!
//! Each module holds the tests of one behaviour; the helpers all test binaries share are in
//! `pinpool_testkit` (`tests/common`).

mod arena_frees;
mod blocking_calls;
mod builder_settings;
mod cached_path;
mod capture_pools;
mod empty_cache_and_stats;
mod foreign_streams;
mod memory_calls;
mod policy_arena;
mod policy_bestfit;
mod readme_examples;
mod splitting;
mod stream_ordering;
mod thread_slots;
