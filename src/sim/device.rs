//! `SimDeviceBuffer`: simulated device memory, the far end of simulated copies.
//!
//! Owns its bytes behind an `Arc<[AtomicU8]>`: stream workers write them when a copy runs,
//! tests read them after synchronizing. Atomic bytes make the buffer shareable without
//! locks and without `unsafe`.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

/// A simulated device allocation of fixed length, zeroed at creation. Cloning shares it.
///
/// ```
/// use pinpool::sim::{SimDeviceBuffer, SimRuntime};
/// use pinpool::Runtime;
///
/// let sim = SimRuntime::new();
/// let stream = sim.new_stream()?;
/// let host = sim.host_alloc(4).unwrap();
/// sim.host_write(host.ptr.as_ptr(), &[1, 2, 3, 4]).unwrap();
/// let dev = SimDeviceBuffer::new(4);
/// stream.copy_to_device(host.ptr.as_ptr(), 4, &dev).unwrap();
/// stream.synchronize().unwrap();
/// assert_eq!(dev.to_vec(), [1, 2, 3, 4]);
/// sim.host_free(host).unwrap();
/// # Ok::<(), pinpool::RuntimeError>(())
/// ```
#[derive(Clone)]
pub struct SimDeviceBuffer {
    bytes: Arc<[AtomicU8]>,
}

impl SimDeviceBuffer {
    /// A zeroed buffer of `len` bytes.
    pub fn new(len: usize) -> Self {
        Self {
            bytes: (0..len).map(|_| AtomicU8::new(0)).collect(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// A snapshot of the contents (synchronize the stream first to see its copies).
    pub fn to_vec(&self) -> Vec<u8> {
        self.bytes
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect()
    }

    /// Sets every byte to `byte` now (not through a stream).
    pub fn fill(&self, byte: u8) {
        self.bytes
            .iter()
            .for_each(|b| b.store(byte, Ordering::Relaxed));
    }

    pub(crate) fn bytes(&self) -> &[AtomicU8] {
        &self.bytes
    }
}

impl std::fmt::Debug for SimDeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDeviceBuffer")
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_buffer_is_zeroed_and_clones_share_bytes() {
        let a = SimDeviceBuffer::new(8);
        assert_eq!(a.to_vec(), [0; 8]);
        let b = a.clone();
        b.fill(9);
        assert_eq!(a.to_vec(), [9; 8]);
        assert!(SimDeviceBuffer::new(0).is_empty());
    }
}
