//! Layer 1, vocabulary: the words every other layer speaks — the `Runtime` and `MemorySource`
//! traits, pool ids, the one `Error`, whether a blocking call may block, threads and shards,
//! tasks and their mailboxes, size policies and the carving of segments into free ranges.
//! It uses no other layer.

pub(crate) mod runtime;
pub(crate) mod memory;
pub(crate) mod pool_id;
pub(crate) mod error;
pub mod blocking;
pub(crate) mod holder;
pub(crate) mod loom;
pub(crate) mod shard;
pub(crate) mod idle_probe;
pub(crate) mod spawn;
pub(crate) mod mailbox;
pub(crate) mod keepalive;
pub(crate) mod policy;
pub(crate) mod carve;
