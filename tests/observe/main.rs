//! Observing the allocator: statistics, the history ring and its HTML page, observers and
//! callbacks, snapshots (and PyTorch's pickle layout), trace files, and the replay example.
//!
//! Each module holds the tests of one behaviour; the helpers all test binaries share are in
//! `pinpool_testkit` (`tests/common`).

mod exact_stats;
mod history_ring;
mod html_history_page;
mod observers_callbacks;
mod replay_tool;
mod snapshot_contents;
mod stats_add_up;
mod torch_snapshot;
mod trace_parse;
