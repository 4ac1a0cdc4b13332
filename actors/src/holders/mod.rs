//! Layer 4, lock-free holders of blocks: the per-shard ready slots and queues of the cached
//! path, and the parked slots where freed blocks wait on their events in the freeing thread's
//! shard. Both reach a higher layer only through the traits they define (`Slotted`,
//! `Parkable`).

pub(crate) mod ready;
pub(crate) mod parked;
