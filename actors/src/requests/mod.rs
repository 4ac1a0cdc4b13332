//! Layer 8, requests and the handle: a request that waits long under a cap, the miss path,
//! and the `Engine` that users' allocators hold.

mod long_wait;
pub(crate) mod miss;
pub(crate) mod engine;
