//! What the device allocator needs of a runtime beside events: its devices, each device's
//! memory as a memory source, and which device a stream runs on.
//!
//! Implemented by the simulated runtime (its simulated devices) and, with the `cuda`
//! feature, by the CUDA runtime (the driver's devices).

use std::sync::Arc;

use pinpool_actors::{Error, MemorySource, Runtime};

use crate::sim::{SimError, SimRuntime};

/// A runtime with devices whose memory the device allocator caches.
pub trait DeviceRuntime: Runtime {
    /// How many devices there are.
    fn device_count(&self) -> usize;

    /// The memory of device `device`, as a memory source ([`Error::NoSuchDevice`] past the
    /// last device).
    fn device_memory(&self, device: usize) -> Result<Arc<dyn MemorySource>, Error>;

    /// The device whose work `stream` runs.
    fn stream_device(&self, stream: &Self::Stream) -> usize;

    /// Free and total bytes of device `device`, as the driver reports them.
    fn device_memory_info(&self, device: usize) -> Result<(usize, usize), Error>;
}

fn sim_error(e: SimError) -> Error {
    match e {
        SimError::NoSuchDevice { ordinal, count } => Error::NoSuchDevice { ordinal, count },
        other => Error::Runtime(other.into_runtime("device")),
    }
}

impl DeviceRuntime for SimRuntime {
    fn device_count(&self) -> usize {
        SimRuntime::device_count(self)
    }

    fn device_memory(&self, device: usize) -> Result<Arc<dyn MemorySource>, Error> {
        let memory: Arc<dyn MemorySource> =
            SimRuntime::device_memory(self, device).map_err(sim_error)?;
        Ok(memory)
    }

    fn stream_device(&self, stream: &Self::Stream) -> usize {
        stream.device()
    }

    fn device_memory_info(&self, device: usize) -> Result<(usize, usize), Error> {
        let count = SimRuntime::device_count(self);
        match (self.device_capacity(device), self.device_used(device)) {
            (Some(total), Some(used)) => Ok((total.saturating_sub(used), total)),
            _ => Err(Error::NoSuchDevice {
                ordinal: device,
                count,
            }),
        }
    }
}
