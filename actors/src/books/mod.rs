//! Layer 5, shared books: what the pools of an engine share and what reaches a pool without
//! its actor — the memory limit (`Budget`), errands, every actor message (`messages`), a pool's
//! `Home`, and the segments blocks are cut from.

pub(crate) mod budget;
pub(crate) mod errand;
pub(crate) mod messages;
pub(crate) mod home;
pub(crate) mod segment;
