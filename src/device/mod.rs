//! Device memory: [`DeviceAllocator`] and [`DeviceBuffer`], the caching allocator of
//! PyTorch's `CUDACachingAllocator`, on pinpool's engine.
//!
//! One engine per device (its own actors, cap, statistics and history), stream-ordered: each
//! stream that allocates gets a pool of its own, and a block freed with no other stream
//! recorded is reusable by its stream at once, with no event. Blocks are the request rounded
//! to 512 bytes, cut out of one expandable range per pool where the device can map memory
//! granule by granule (CUDA's virtual memory calls, or the simulation), else out of separate
//! segments; see [`crate::tuning::DeviceFit`]. The layout's settings come from
//! `PINPOOL_DEVICE_CONF` ([`crate::config::DeviceConfig`]).
//!
//! This module holds the public face: `runtime` (what a runtime must offer: its devices and
//! their memory), `builder`, `devices` (each device's engine, started at its first use),
//! `allocator`, `buffer`, `raw` (the raw-pointer calls' table),
//! `capture` (capture pools for CUDA graphs), `checkpoint` (checkpoints
//! of capture pools), `free_memory` (free-memory callbacks),
//! `ipc_handle` and `ipc` (blocks shared with other processes), `peer` (peer access
//! and copies between devices) and `mapped_access` (which peers reach each device's mapped
//! memory, for the runtimes).

mod allocator;
mod buffer;
mod builder;
mod capture;
mod checkpoint;
mod devices;
mod free_memory;
mod ipc;
mod ipc_handle;
mod mapped_access;
mod peer;
mod raw;
mod runtime;

pub use allocator::DeviceAllocator;
pub use buffer::DeviceBuffer;
pub use builder::DeviceBuilder;
pub use checkpoint::CheckpointDelta;
pub use ipc::IpcMemory;
pub use ipc_handle::{IpcHandle, MappedHandle, IPC_HANDLE_BYTES, MAX_MAPPED_HANDLES};
pub(crate) use mapped_access::MappedAccess;
pub(crate) use runtime::DeviceCopy;
pub use runtime::DeviceRuntime;
#[cfg(feature = "cuda")]
pub(crate) use runtime::{DeviceOps, IpcExport, IpcMappedExport};
