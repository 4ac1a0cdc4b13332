//! The atomics of the lock-free holders (ready slots, parked slots, the budget), from `std`, or from
//! [loom](https://docs.rs/loom) when built with `--cfg pinpool_loom`, so that loom's model
//! checker explores every interleaving of their operations (`scripts/loom.sh`, models in
//! `ready.rs` and `budget.rs`). In a normal build these are `std`'s types themselves: the
//! cached path compiles to the same code.

#[cfg(not(pinpool_loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU64, AtomicUsize};

#[cfg(pinpool_loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU64, AtomicUsize};
