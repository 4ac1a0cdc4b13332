//! Faults injected into the simulated runtime, concurrency stress on pinned and device memory,
//! teardown and cancellation, and the unsafe code on the engine's paths (the `unsafe_paths`
//! module is what `scripts/miri.sh` runs under miri).
//!
//! Each module holds the tests of one behaviour; the helpers all test binaries share are in
//! `pinpool_testkit` (`tests/common`).

mod bestfit_faults;
mod device_stress;
mod faults;
mod stress;
mod teardown;
mod unsafe_paths;
