//! The CUDA runtime: [`CudaRuntime`] implements [`Runtime`](crate::Runtime) with cudarc's
//! driver API, the driver loaded at run time (so the crate builds and runs without CUDA;
//! [`CudaRuntime::new`] then reports [`CudaInitError::NoDriver`]).
//!
//! - `context`: binding contexts to threads, relaxed capture mode around host calls.
//! - `host`: the two ways of pinning (`cuMemHostAlloc`; `mmap` + pre-fault + register).
//! - `vmm`: expandable memory (a reserved range mapped in granules), host or device.
//! - `device`: device memory (`CudaDeviceMemory`), the devices of the device allocator,
//!   and cudarc's `DevicePtr`/`DevicePtrMut` for `DeviceBuffer<CudaRuntime>`.
//! - `ipc`: the driver calls of inter-process handles, peer access and copies between
//!   devices.
//! - `events`: pooled events, one free list per context.
//! - `runtime`: [`CudaRuntime`] itself, detection ([`cuda_available`]).
//! - `builder`: [`Builder::cuda`](crate::Builder::cuda) and
//!   [`Builder::best_available`](crate::Builder::best_available) on the public builder.
//! - `auto`: [`AutoRuntime`], the GPU where there is one and the simulation elsewhere.
//! - `copy`: cudarc's `HostSlice` for `PinnedBuffer<CudaRuntime>`, and copy calls that
//!   record the stream by themselves.
//!
//! Copies with cudarc: `CudaStream::memcpy_htod`/`memcpy_dtoh` take any
//! `cudarc::driver::HostSlice`, an unsealed trait that `PinnedBuffer<CudaRuntime>`
//! implements. Its `stream_synced_slice` runs *before* the copy is enqueued and receives
//! `&CudaStream` (not the `Arc` that `record_stream` needs) through `&self`, so it cannot note
//! the stream itself: when the stream is already recorded on the buffer it returns
//! `SyncOnDrop::Sync(None)` (the copy is asynchronous, and the event recorded at the free
//! orders after it); otherwise it has cudarc synchronise the stream after enqueuing the copy.
//! [`PinnedBuffer::copy_to_device`](crate::PinnedBuffer::copy_to_device) and
//! [`PinnedBuffer::copy_from_device`](crate::PinnedBuffer::copy_from_device) take
//! `&Arc<CudaStream>`, record it, and check lengths: use those.
//!
//! ```
//! if pinpool::cuda::cuda_available() {
//!     let runtime = pinpool::cuda::CudaRuntime::new(0)?;
//!     println!("{runtime:?}");
//! }
//! # Ok::<(), pinpool::cuda::CudaInitError>(())
//! ```

mod auto;
mod builder;
mod context;
mod copy;
mod device;
mod error;
mod events;
mod host;
mod ipc;
mod runtime;
mod vmm;

#[cfg(test)]
mod gpu_tests;

pub use auto::{AutoEvent, AutoRuntime, AutoStream};
#[cfg(test)]
use device::CudaDeviceMemory;
pub use error::CudaInitError;
pub use events::PooledEvent;
pub use runtime::{cuda_available, device_count, stream_id, CudaRuntime};
