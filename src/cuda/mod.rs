//! The CUDA runtime: [`CudaRuntime`] implements [`Runtime`](crate::Runtime) with cudarc's
//! driver API, the driver loaded at run time (so the crate builds and runs without CUDA;
//! [`CudaRuntime::new`] then reports [`CudaInitError::NoDriver`]).
//!
//! - [`CudaRuntime`]: the driver's devices, streams ([`CudaRuntime::new_stream`]) and events
//!   ([`PooledEvent`], recycled); [`cuda_available`] and [`device_count`] tell whether there
//!   is a GPU.
//! - [`Builder::cuda`](crate::Builder::cuda) and
//!   [`Builder::best_available`](crate::Builder::best_available) build a pinned allocator
//!   on it; [`DeviceBuilder::cuda`](crate::DeviceBuilder::cuda) a device allocator of every
//!   device; [`AutoRuntime`] is the GPU where there is one and the simulation elsewhere.
//! - Pinned memory comes from `cuMemHostAlloc`, or from `mmap` pinned with
//!   `cuMemHostRegister` (`PINPOOL_CONF`'s `pin_method`); expandable memory (host or
//!   device) is a reserved range mapped a granule at a time with CUDA's virtual memory calls.
//! - `DeviceBuffer<CudaRuntime>` is a cudarc `DevicePtr`/`DevicePtrMut`, and
//!   `PinnedBuffer<CudaRuntime>` a cudarc `HostSlice`.
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

// Module layout: `context` (binding contexts to threads, relaxed capture mode around host
// calls), `host` (the two ways of pinning), `vmm` (expandable memory, host or device),
// `device` (device memory, the devices of the device allocator, cudarc's device-pointer
// traits), `ipc` (inter-process handles, peer access, copies between devices), `events`
// (pooled events, one free list per context), `runtime` (`CudaRuntime`, detection),
// `builder` (the builders' `cuda` calls), `auto` (`AutoRuntime`), `copy` (cudarc's
// `HostSlice`, and copy calls that record the stream by themselves).

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
