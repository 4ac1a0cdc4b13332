//! Layer 2, statistics: what the engine counts and reports — counters and their exact peaks,
//! host and device stats, a block's record, trace entries and OOM reports, and snapshots
//! (with their PyTorch pickle layout).

pub(crate) mod counters;
pub(crate) mod peaks;
pub(crate) mod device_stats;
pub(crate) mod stats;
pub(crate) mod retired;
pub(crate) mod meta;
pub(crate) mod trace;
pub(crate) mod snapshot;
mod pickle;
pub(crate) mod torch_snapshot;
