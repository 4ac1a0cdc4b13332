//! The device allocator on the simulated device: its calls and errors, the expandable range,
//! capture pools and checkpoints, buffers shared across streams, free-memory callbacks,
//! lending between stream pools, peers, and stream ordering.
//!
//! Each module holds the tests of one behaviour; the helpers all test binaries share are in
//! `pinpool_testkit` (`tests/common`).

mod device_api;
mod device_arena;
mod device_capture_pools;
mod device_checkpoints;
mod device_cross_stream;
mod device_free_memory;
mod device_lending;
mod device_peers;
mod device_stream_ordering;
mod stream_pool_retirement;
