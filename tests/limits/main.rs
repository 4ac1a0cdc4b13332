//! Memory caps and waiting: pinned and device caps, driver out-of-memory, requests that wait
//! first come first served, buffer sets taken all or none, and liveness (a waiting request is
//! served once the bytes lent out allow it).
//!
//! Each module holds the tests of one behaviour; the helpers all test binaries share are in
//! `pinpool_testkit` (`tests/common`).

mod buffer_sets;
mod device_limits;
mod limits_driver_oom;
mod limits_waiting;
mod liveness;
mod liveness_sets;
mod long_waits;
mod tight_caps;
