//! Copies between a [`PinnedBuffer`] and device memory: cudarc's [`HostSlice`] for the
//! buffer, and pinpool's own copy calls that record the stream by themselves.
//!
//! Owns no state. Keeps invariant 1 for copies: a copy made with
//! [`PinnedBuffer::copy_to_device`] or [`PinnedBuffer::copy_from_device`] records its stream
//! on the buffer before it is enqueued, so the event recorded when the buffer is freed orders
//! after the copy, and the bytes are not reused before the copy has run. A copy made through
//! cudarc's own calls (`stream.memcpy_htod(&buf, ..)`) is asynchronous when the stream was
//! recorded on the buffer beforehand, and otherwise waits for the copy to finish before the
//! call returns: forgetting `record_stream` costs speed, never correctness. Lengths are checked
//! first (cudarc asserts them, i.e. panics) and a mismatch is [`Error::LengthMismatch`].

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, HostSlice, SyncOnDrop};

use super::error::runtime_error;
use super::runtime::{stream_id, CudaRuntime};
use crate::{Error, PinnedBuffer};

impl PinnedBuffer<CudaRuntime> {
    /// Whether work on `stream` is already recorded on this buffer.
    fn has_recorded(&self, stream: &CudaStream) -> bool {
        self.recorded_streams().contains(&stream_id(stream))
    }

    /// Enqueues a copy of the whole buffer into the start of `dst` on `stream`, and records
    /// the stream on the buffer so that its bytes are reused only after the copy has run.
    /// Returns at once; drop the buffer whenever you like.
    ///
    /// `dst` is a `CudaSlice<u8>` or a `CudaViewMut<u8>` at least `self.len()` bytes long
    /// ([`Error::LengthMismatch`] otherwise, and nothing is enqueued). An empty buffer copies
    /// nothing.
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let allocator = pinpool::PinnedAllocator::builder().cuda(0)?.build()?;
    /// let stream = allocator.runtime().context().new_stream()?;
    /// let mut device = stream.alloc_zeros::<u8>(1 << 20)?;
    /// let mut buf = allocator.alloc(1 << 20).await?;
    /// buf.fill(7);
    /// buf.copy_to_device(&stream, &mut device)?;
    /// drop(buf); // safe: reused only once the copy has run
    /// assert_eq!(stream.clone_dtoh(&device)?[0], 7);
    /// # Ok(()) }
    /// ```
    pub fn copy_to_device<Dst: DevicePtrMut<u8>>(
        &mut self,
        stream: &Arc<CudaStream>,
        dst: &mut Dst,
    ) -> Result<(), Error> {
        if dst.len() < self.len() {
            return Err(Error::LengthMismatch {
                src_len: self.len(),
                dst_len: dst.len(),
            });
        }
        if self.is_empty() {
            return Ok(());
        }
        self.record_stream(stream)?;
        stream
            .memcpy_htod(&*self, dst)
            .map_err(|e| runtime_error("cuMemcpyHtoDAsync", e).into())
    }

    /// Enqueues a copy of all of `src` into the start of the buffer on `stream`, and records
    /// the stream on the buffer so that its bytes are reused only after the copy has run.
    /// Returns at once: wait for the stream (or an event recorded after the copy) before
    /// reading the bytes.
    ///
    /// `src` is a `CudaSlice<u8>` or a `CudaView<u8>` no longer than the buffer
    /// ([`Error::LengthMismatch`] otherwise, and nothing is enqueued).
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let allocator = pinpool::PinnedAllocator::builder().cuda(0)?.build()?;
    /// let stream = allocator.runtime().context().new_stream()?;
    /// let device = stream.clone_htod(&[3u8; 4096])?;
    /// let mut buf = allocator.alloc(4096).await?;
    /// buf.copy_from_device(&stream, &device)?;
    /// stream.synchronize()?;
    /// assert!(buf.iter().all(|&b| b == 3));
    /// # Ok(()) }
    /// ```
    pub fn copy_from_device<Src: DevicePtr<u8>>(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &Src,
    ) -> Result<(), Error> {
        if src.len() > self.len() {
            return Err(Error::LengthMismatch {
                src_len: src.len(),
                dst_len: self.len(),
            });
        }
        if src.is_empty() {
            return Ok(());
        }
        self.record_stream(stream)?;
        stream
            .memcpy_dtoh(src, self)
            .map_err(|e| runtime_error("cuMemcpyDtoHAsync", e).into())
    }
}

/// cudarc's copy calls take a `PinnedBuffer<CudaRuntime>` directly:
/// `stream.memcpy_htod(&buf, &mut device)` and `stream.memcpy_dtoh(&device, &mut buf)`.
///
/// When `stream` has been recorded on the buffer (`buf.record_stream(&stream)`) the copy is
/// asynchronous, and the event recorded when the buffer is freed keeps its bytes from reuse
/// until the copy has run. When it has not, cudarc is told to synchronise the stream right
/// after enqueuing the copy, so the copy has finished when the call returns. That fallback
/// cannot work during stream capture (the synchronisation invalidates the capture, and
/// cudarc reports the error on the context's next call): record the stream first, or use
/// [`PinnedBuffer::copy_to_device`] / [`PinnedBuffer::copy_from_device`], which do.
///
/// cudarc asserts that the destination is long enough (a panic); pinpool's own copy calls
/// check first and return [`Error::LengthMismatch`].
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let allocator = pinpool::PinnedAllocator::builder().cuda(0)?.build()?;
/// let stream = allocator.runtime().context().new_stream()?;
/// let mut device = stream.alloc_zeros::<u8>(4096)?;
/// let mut buf = allocator.alloc(4096).await?;
/// buf.fill(1);
/// buf.record_stream(&stream)?; // makes the copy below asynchronous
/// stream.memcpy_htod(&buf, &mut device)?;
/// drop(buf);
/// # Ok(()) }
/// ```
impl HostSlice<u8> for PinnedBuffer<CudaRuntime> {
    fn len(&self) -> usize {
        PinnedBuffer::len(self)
    }

    unsafe fn stream_synced_slice<'a>(
        &'a self,
        stream: &'a CudaStream,
    ) -> (&'a [u8], SyncOnDrop<'a>) {
        let sync = if self.has_recorded(stream) {
            SyncOnDrop::Sync(None)
        } else {
            SyncOnDrop::sync_stream(stream)
        };
        (self, sync)
    }

    unsafe fn stream_synced_mut_slice<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (&'a mut [u8], SyncOnDrop<'a>) {
        let sync = if self.has_recorded(stream) {
            SyncOnDrop::Sync(None)
        } else {
            SyncOnDrop::sync_stream(stream)
        };
        (self, sync)
    }
}
