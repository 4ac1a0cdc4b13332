//! The CUDA runtime: [`CudaRuntime`] implements [`Runtime`](crate::Runtime) with cudarc's
//! driver API, the driver loaded at run time (so the crate builds and runs without CUDA;
//! [`CudaRuntime::new`] then reports [`CudaInitError::NoDriver`]).
//!
//! - `context`: binding contexts to threads, relaxed capture mode around host calls.
//! - `host`: the two ways of pinning (`cuMemHostAlloc`; `mmap` + pre-fault + register).
//! - `events`: pooled events, one free list per context.
//! - `runtime`: [`CudaRuntime`] itself, detection ([`cuda_available`]).

mod context;
mod error;
mod events;
mod host;
mod runtime;

#[cfg(test)]
mod gpu_tests;

pub use error::CudaInitError;
pub use events::PooledEvent;
pub use runtime::{cuda_available, device_count, stream_id, CudaRuntime};
