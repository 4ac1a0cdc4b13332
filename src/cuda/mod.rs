//! The CUDA runtime: [`CudaRuntime`] implements [`Runtime`](crate::Runtime) with cudarc's
//! driver API, the driver loaded at run time (so the crate builds and runs without CUDA;
//! [`CudaRuntime::new`] then reports [`CudaInitError::NoDriver`]).
//!
//! - `context`: binding contexts to threads, relaxed capture mode around host calls.
//! - `host`: the two ways of pinning (`cuMemHostAlloc`; `mmap` + pre-fault + register).
//! - `events`: pooled events, one free list per context.
//! - `runtime`: [`CudaRuntime`] itself, detection ([`cuda_available`]).
//!
//! Copies with cudarc: `CudaStream::memcpy_htod`/`memcpy_dtoh` take any
//! `cudarc::driver::HostSlice`, an unsealed trait a buffer type outside cudarc can implement.
//! Whatever its `stream_synced_slice` does runs *before* the copy is enqueued, so it must only
//! note the stream as a user of the buffer (the event is recorded when the buffer is freed,
//! after the copy) and return `SyncOnDrop::Sync(None)`. It receives `&CudaStream`, not the
//! `Arc`, so copy methods of pinpool's own that take `&Arc<CudaStream>` are the safe way to
//! keep the stream alive until that event is recorded.
//!
//! ```
//! if pinpool::cuda::cuda_available() {
//!     let runtime = pinpool::cuda::CudaRuntime::new(0)?;
//!     println!("{runtime:?}");
//! }
//! # Ok::<(), pinpool::cuda::CudaInitError>(())
//! ```

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
