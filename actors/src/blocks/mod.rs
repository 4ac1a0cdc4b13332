//! Layer 6, blocks: a lent piece of memory and where it goes when freed (`Block`), and a block
//! lent to a user (`Lease`, whose drop is the free).

pub(crate) mod block;
pub(crate) mod lease;
