//! pinpool: a caching allocator for CUDA pinned (page-locked) host memory, run as a small
//! service of actors on tokio.

pub use pinpool_actors::{HostMemory, PinMethod, Runtime, RuntimeError, StreamId};

pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod plan;
pub mod sim;
pub mod trace;
