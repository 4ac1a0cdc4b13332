//! Peer devices: [`DeviceAllocator::enable_peer_access`] and
//! [`DeviceAllocator::memcpy_async`], the copy between two buffers (on one device or on two)
//! that records its stream on both, so that neither block is handed out again before the
//! copy has run (invariant 1).
//!
//! Owns the table of enabled peer pairs (one flag per ordered pair of devices, set once and
//! never cleared, as the driver's peer access lasts as long as the context). A copy asked to
//! go peer to peer (`p2p`) between two devices needs the pair enabled first, on every
//! runtime alike; without `p2p` the driver stages it (`cuMemcpyPeerAsync`).

use std::sync::atomic::{AtomicBool, Ordering};

use crate::actors::blocking;
use crate::actors::Error;

use super::allocator::DeviceAllocator;
use super::buffer::DeviceBuffer;
use super::runtime::{DeviceCopy, DeviceRuntime};

/// Which ordered pairs of devices have peer access.
pub(crate) struct PeerTable {
    count: usize,
    enabled: Box<[AtomicBool]>,
}

impl PeerTable {
    pub(crate) fn new(count: usize) -> Self {
        Self {
            count,
            enabled: (0..count * count).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    fn slot(&self, device: usize, peer: usize) -> Option<&AtomicBool> {
        (device < self.count && peer < self.count)
            .then(|| &self.enabled[device * self.count + peer])
    }

    /// Whether `device` may access `peer`'s memory (always for a device itself).
    pub(crate) fn enabled(&self, device: usize, peer: usize) -> bool {
        device == peer
            || self
                .slot(device, peer)
                .is_some_and(|s| s.load(Ordering::SeqCst))
    }

    fn enable(&self, device: usize, peer: usize) {
        if let Some(s) = self.slot(device, peer) {
            s.store(true, Ordering::SeqCst);
        }
    }
}

impl<R: DeviceRuntime> DeviceAllocator<R> {
    /// Lets device `device` access the memory of device `peer` (PyTorch's
    /// `enablePeerAccess`); enabling a pair again, or a device for itself, changes nothing.
    /// Mapped memory (the expandable ranges) names the devices that may access it: the
    /// memory `peer`'s pools mapped before this call is opened to `device` here, and what
    /// they map later is mapped open to it, so that `device` reaches every block of `peer`,
    /// old or new, as it reaches separate segments. Each device a device's memory is open
    /// to makes its later map calls dearer.
    /// [`Error::NoSuchDevice`] for a device that does not exist,
    /// [`Error::PeerAccessUnsupported`] where the two devices have no peer-to-peer path.
    pub fn enable_peer_access(&self, device: usize, peer: usize) -> Result<(), Error> {
        self.inner().devices.started(device)?;
        self.inner().devices.started(peer)?;
        if self.inner().peers.enabled(device, peer) {
            return Ok(());
        }
        // The driver call takes its locks for milliseconds: off the worker where it can be.
        blocking::stall(|| self.runtime().enable_peer_access(device, peer))?;
        self.inner().peers.enable(device, peer);
        Ok(())
    }

    /// Whether [`DeviceAllocator::enable_peer_access`]`(device, peer)` succeeded before
    /// (true for a device and itself).
    pub fn peer_access_enabled(&self, device: usize, peer: usize) -> bool {
        self.inner().peers.enabled(device, peer)
    }

    /// Enqueues a copy of the first `n` bytes of `src` into `dst` on `stream` (PyTorch's
    /// `memcpyAsync`), the two on the same device or on two: directly when `p2p` (the
    /// stream's device must have peer access to the other one, see
    /// [`DeviceAllocator::enable_peer_access`]), else staged by the driver. Records
    /// `stream` on both buffers first, so that dropping either right after the call is
    /// safe: its block is handed out again only once the copy has run. Returns at once.
    ///
    /// Typed errors, with nothing enqueued or recorded: [`Error::CopyOutOfRange`] when `n`
    /// passes either buffer, [`Error::StreamOnOtherDevice`] for a stream on neither
    /// device, [`Error::PeerAccessNotEnabled`] for `p2p` without peer access,
    /// [`Error::ForeignBuffer`] for a buffer of another allocator.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use pinpool::sim::SimRuntime;
    /// use pinpool::{DeviceBuilder, Error, IpcHandle};
    ///
    /// #[tokio::main]
    /// async fn main() -> Result<(), Error> {
    ///     let sim = SimRuntime::builder().devices(2).build(); // or CudaRuntime: every GPU
    ///     let allocator = DeviceBuilder::new(Arc::new(sim.clone())).build()?;
    ///     let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());
    ///
    ///     // Peers: device 1 reads device 0's memory directly; a peer that does not exist is
    ///     // Error::NoSuchDevice, one without a path Error::PeerAccessUnsupported.
    ///     allocator.enable_peer_access(1, 0)?;
    ///     let mut src = allocator.alloc(1 << 20, &s0).await?;
    ///     let mut dst = allocator.alloc(1 << 20, &s1).await?;
    ///     allocator.memcpy_async(&mut dst, &mut src, 1 << 20, &s1, true)?; // p2p; false: staged
    ///     drop(src); // safe at once: s1 is recorded on both, reuse waits for the copy
    ///
    ///     // IPC: export a block for another process (blocks of cuMemAlloc segments, i.e.
    ///     // expandable_segments:false), open it there; the simulation says Error::NotSupported.
    ///     let handle: Result<IpcHandle, Error> = allocator.ipc_handle(&dst);
    ///     assert!(matches!(handle, Err(Error::NotSupported { .. })));
    ///     let sent = IpcHandle::new([0; 64], 4096, 1 << 20, 0).to_hex(); // across the process boundary
    ///     let opened = allocator.open_ipc(&sent.parse()?); // on a GPU: IpcMemory, closed when dropped
    ///     assert!(matches!(opened, Err(Error::NotSupported { .. })));
    ///     assert!(matches!(IpcHandle::from_bytes(b"junk"), Err(Error::InvalidIpcHandle { .. })));
    ///     Ok(())
    /// }
    /// ```
    pub fn memcpy_async(
        &self,
        dst: &mut DeviceBuffer<R>,
        src: &mut DeviceBuffer<R>,
        n: usize,
        stream: &R::Stream,
        p2p: bool,
    ) -> Result<(), Error> {
        if n > src.len() || n > dst.len() {
            return Err(Error::CopyOutOfRange {
                requested: n,
                src_len: src.len(),
                dst_len: dst.len(),
            });
        }
        let (dst_device, src_device) = (dst.device(), src.device());
        let on = self.runtime().stream_device(stream);
        let other = if on == dst_device {
            src_device
        } else if on == src_device {
            dst_device
        } else {
            return Err(Error::StreamOnOtherDevice {
                stream_device: on,
                dst_device,
                src_device,
            });
        };
        if p2p && !self.peer_access_enabled(on, other) {
            return Err(Error::PeerAccessNotEnabled {
                device: on,
                peer: other,
            });
        }
        let (dst_engine, src_engine) = (self.engine(dst_device)?, self.engine(src_device)?);
        if dst.engine_id() != dst_engine.id() || src.engine_id() != src_engine.id() {
            return Err(Error::ForeignBuffer);
        }
        if n == 0 {
            return Ok(());
        }
        dst_engine.record_stream(dst.lease_mut(), stream)?;
        src_engine.record_stream(src.lease_mut(), stream)?;
        // SAFETY: both ranges lie in live buffers of this allocator (`n` is at most either
        // length), and the stream is recorded on both, so neither block is handed out again
        // before the copy has run.
        unsafe {
            self.runtime().copy_device_async(
                stream,
                DeviceCopy {
                    dst: dst.device_ptr(),
                    dst_device,
                    src: src.device_ptr(),
                    src_device,
                    len: n,
                    p2p,
                },
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_is_enabled_one_way_and_a_device_always_reaches_itself() {
        let t = PeerTable::new(3);
        assert!(t.enabled(1, 1));
        assert!(!t.enabled(0, 2));
        t.enable(0, 2);
        assert!(t.enabled(0, 2));
        assert!(!t.enabled(2, 0));
        t.enable(5, 0); // out of range: ignored
        assert!(!t.enabled(5, 0));
    }
}
