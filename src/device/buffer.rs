//! `DeviceBuffer`: device memory lent by a [`DeviceAllocator`](crate::DeviceAllocator).
//!
//! RAII: dropping the buffer is the free. It knows its device address, its length, the
//! stream it was allocated on (which owns it: work on that stream is ordered, so a buffer no
//! other stream used is reusable by it at once) and the other streams recorded on it, whose
//! work must finish before the memory is handed out again (invariant 1).

use std::any::Any;
use std::fmt;
use std::sync::OnceLock;

use crate::actors::{Error, Lease, Origin, PoolId, Runtime, StreamId};

use super::ipc_handle::IpcHandle;
use crate::sim::SimRuntime;

/// Device memory, returned to its allocator when dropped.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), pinpool::Error> {
/// let allocator = pinpool::DeviceAllocator::builder().build()?;
/// let stream = allocator.runtime().new_stream()?;
/// let buf = allocator.alloc(1 << 20, &stream).await?;
/// assert_eq!((buf.len(), buf.device()), (1 << 20, 0));
/// assert_ne!(buf.device_ptr(), 0);
/// stream.fill_device(buf.device_ptr(), buf.len(), 7).unwrap(); // a kernel on its stream
/// drop(buf); // reusable by `stream` at once: its work runs in order
/// # Ok(()) }
/// ```
pub struct DeviceBuffer<R: Runtime = SimRuntime> {
    lease: Lease<R>,
    stream: R::Stream,
    device: usize,
    /// Set by the first `ipc_handle` of a block of an expandable range: the handle, and
    /// the file descriptors it names, kept open while the buffer lives.
    exported: OnceLock<Box<Exported>>,
}

/// An export of a buffer's block of an expandable range.
struct Exported {
    handle: IpcHandle,
    _keep_open: Box<dyn Any + Send + Sync>,
}

/// What allocating on `stream` promises a lease: a block of a capture pool, which no stream
/// owns, records the stream, so that its free waits for the stream's work and a block the
/// stream's captured work used is kept for the graph's replays (a stream's own pool needs
/// nothing: stream order covers it).
pub(crate) fn tie_to_stream<R: Runtime>(lease: &mut Lease<R>, stream: &R::Stream) {
    if lease.pool().is_some_and(|p| !p.is_default()) {
        // The stream was routed to a capture pool, which the runtime asked whether it was
        // capturing: it is the runtime's own, and recording it cannot be refused.
        let _ = lease.record_stream(stream);
    }
}

impl<R: Runtime> DeviceBuffer<R> {
    pub(crate) fn new(mut lease: Lease<R>, stream: R::Stream, device: usize) -> Self {
        tie_to_stream(&mut lease, &stream);
        Self {
            lease,
            stream,
            device,
            exported: OnceLock::new(),
        }
    }

    /// The handle of an earlier export of this buffer's block of an expandable range.
    pub(crate) fn exported_handle(&self) -> Option<&IpcHandle> {
        self.exported.get().map(|e| &e.handle)
    }

    /// Keeps `keep_open` (the file descriptors `handle` names) while the buffer lives; the
    /// handle to give out: `handle`, or that of an export made meanwhile on another thread
    /// (then `keep_open` is dropped here, and with it this export's descriptors).
    pub(crate) fn keep_export(
        &self,
        handle: IpcHandle,
        keep_open: Box<dyn Any + Send + Sync>,
    ) -> IpcHandle {
        let ours = handle.clone();
        let exported = Box::new(Exported {
            handle,
            _keep_open: keep_open,
        });
        match self.exported.set(exported) {
            Ok(()) => ours,
            // Set by the other export (a `OnceLock` once set stays set).
            Err(_dropped) => self.exported.get().map_or(ours, |e| e.handle.clone()),
        }
    }

    pub(crate) fn lease_mut(&mut self) -> &mut Lease<R> {
        &mut self.lease
    }

    /// Which engine (one per device) lent the buffer.
    pub(crate) fn engine_id(&self) -> u64 {
        self.lease.engine_id()
    }

    /// How the block's segment was obtained (`None` for an empty buffer).
    pub(crate) fn origin(&self) -> Option<Origin> {
        self.lease.origin()
    }

    /// The device address of the bytes (not dereferenceable on the host). 0 for an empty
    /// buffer, which holds no memory: the address `raw_alloc` gives a request of 0 bytes,
    /// and PyTorch's null pointer for an empty tensor.
    pub fn device_ptr(&self) -> u64 {
        if self.lease.is_empty() {
            return 0;
        }
        self.lease.as_ptr() as usize as u64
    }

    /// Bytes requested.
    pub fn len(&self) -> usize {
        self.lease.len()
    }

    /// Whether the buffer is empty (a request of 0 bytes holds no memory).
    pub fn is_empty(&self) -> bool {
        self.lease.is_empty()
    }

    /// Bytes of the block behind the buffer (at least `len`: the request rounded up).
    pub fn capacity(&self) -> usize {
        self.lease.capacity()
    }

    /// The device the memory is on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The stream the buffer was allocated on: it owns the buffer.
    pub fn stream(&self) -> &R::Stream {
        &self.stream
    }

    /// The pool the buffer came from (`None` for an empty buffer).
    pub fn pool(&self) -> Option<PoolId> {
        self.lease.pool()
    }

    /// Whether the buffer was allocated while its stream was being captured into a graph.
    pub fn allocated_during_capture(&self) -> bool {
        self.lease.allocated_during_capture()
    }

    /// Marks the buffer as used by work enqueued on `stream` (PyTorch's `recordStream`).
    /// When the buffer is dropped, an event is recorded on that stream, and the memory is
    /// handed out again only once the event has completed. Recording the buffer's own
    /// stream changes nothing: its work is ordered anyway (a buffer of a capture pool has
    /// its own stream recorded from the start).
    ///
    /// # Errors
    /// [`Error::ForeignStream`] for a stream of another runtime than the allocator's (a
    /// stream of another [`SimRuntime`], say); nothing is recorded.
    pub fn record_stream(&mut self, stream: &R::Stream) -> Result<(), Error> {
        self.lease.record_stream(stream)
    }

    /// The streams recorded so far (the buffer's own stream is among them only in a capture
    /// pool, which no stream owns).
    pub fn recorded_streams(&self) -> Vec<StreamId> {
        self.lease.recorded_streams()
    }

    /// Checks that `len` bytes at `offset` lie inside the buffer; the device address of
    /// the first of them.
    pub fn offset_ptr(&self, offset: usize, len: usize) -> Result<u64, Error> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(self.device_ptr() + offset as u64),
            _ => Err(Error::LengthMismatch {
                src_len: offset.saturating_add(len),
                dst_len: self.len(),
            }),
        }
    }
}

impl<R: Runtime> fmt::Debug for DeviceBuffer<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device)
            .field("ptr", &format_args!("{:#x}", self.device_ptr()))
            .field("len", &self.len())
            .field("capacity", &self.capacity())
            .field("pool", &self.pool())
            .finish()
    }
}
