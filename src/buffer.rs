//! `PinnedBuffer`: pinned bytes lent by a [`PinnedAllocator`](crate::PinnedAllocator).
//!
//! RAII: dropping the buffer is the free. It dereferences to bytes, offers typed views of
//! plain-old-data types, and remembers the streams that used it so that its bytes are reused
//! only after their work is done (invariant 1).

use std::fmt;
use std::ops::{Deref, DerefMut};

use crate::actors::{Error, Lease, PoolId, Runtime, StreamId};

use crate::sim::SimRuntime;

/// Pinned host bytes, returned to their allocator when dropped.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), pinpool::Error> {
/// let allocator = pinpool::PinnedAllocator::builder().build()?;
/// let mut buf = allocator.alloc(16).await?;
/// buf.copy_from_slice(&[7u8; 16]);
/// let words: &[u32] = buf.as_slice_of()?;
/// assert_eq!(words[0], u32::from_ne_bytes([7; 4]));
/// # Ok(()) }
/// ```
pub struct PinnedBuffer<R: Runtime = SimRuntime> {
    lease: Lease<R>,
}

impl<R: Runtime> PinnedBuffer<R> {
    pub(crate) fn new(lease: Lease<R>) -> Self {
        Self { lease }
    }

    pub(crate) fn lease_mut(&mut self) -> &mut Lease<R> {
        &mut self.lease
    }

    /// Start of the bytes.
    pub fn as_ptr(&self) -> *const u8 {
        self.lease.as_ptr()
    }

    /// Start of the bytes, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.lease.as_ptr()
    }

    /// Bytes requested (what the buffer dereferences to).
    pub fn len(&self) -> usize {
        self.lease.len()
    }

    /// Whether the buffer is empty (a request of 0 bytes holds no memory).
    pub fn is_empty(&self) -> bool {
        self.lease.is_empty()
    }

    /// Bytes of the pinned block behind the buffer (at least `len`).
    pub fn capacity(&self) -> usize {
        self.lease.capacity()
    }

    /// The pool the buffer came from (`None` for an empty buffer).
    pub fn pool(&self) -> Option<PoolId> {
        self.lease.pool()
    }

    /// Whether the buffer was allocated while its stream was being captured into a graph.
    pub fn allocated_during_capture(&self) -> bool {
        self.lease.allocated_during_capture()
    }

    /// Marks the buffer as used by work enqueued on `stream`. When the buffer is dropped, an
    /// event is recorded on the stream and the bytes are reused only once it has completed.
    ///
    /// # Errors
    /// [`Error::ForeignStream`] for a stream of another runtime than the allocator's (a
    /// stream of another [`SimRuntime`](crate::sim::SimRuntime), say); nothing is recorded.
    pub fn record_stream(&mut self, stream: &R::Stream) -> Result<(), Error> {
        self.lease.record_stream(stream)
    }

    /// The streams recorded so far.
    pub fn recorded_streams(&self) -> Vec<StreamId> {
        self.lease.recorded_streams()
    }

    /// Views the bytes as a slice of `T` (as many whole elements as fit).
    pub fn as_slice_of<T: bytemuck::Pod>(&self) -> Result<&[T], Error> {
        let n = view_len::<T>(self.as_ptr(), self.len())?;
        // SAFETY: `view_len` checked alignment and that `n` elements fit in the `len` bytes
        // this buffer owns; `T: Pod` accepts any bit pattern.
        Ok(unsafe { std::slice::from_raw_parts(self.as_ptr() as *const T, n) })
    }

    /// Views the bytes as a mutable slice of `T` (as many whole elements as fit).
    pub fn as_mut_slice_of<T: bytemuck::Pod>(&mut self) -> Result<&mut [T], Error> {
        let n = view_len::<T>(self.as_ptr(), self.len())?;
        // SAFETY: as in `as_slice_of`; `&mut self` makes the view exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr() as *mut T, n) })
    }
}

fn view_len<T>(ptr: *const u8, len: usize) -> Result<usize, Error> {
    let size = std::mem::size_of::<T>();
    if size == 0 {
        return Err(Error::BadView {
            type_name: std::any::type_name::<T>(),
            reason: "zero-sized element type",
        });
    }
    if (ptr as usize) % std::mem::align_of::<T>() != 0 {
        return Err(Error::BadView {
            type_name: std::any::type_name::<T>(),
            reason: "the buffer is not aligned for it",
        });
    }
    Ok(len / size)
}

impl<R: Runtime> Deref for PinnedBuffer<R> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the lease owns `len` bytes at `as_ptr()` exclusively until it is dropped
        // (a dangling, aligned pointer when `len` is 0, which `from_raw_parts` allows).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }
}

impl<R: Runtime> DerefMut for PinnedBuffer<R> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len()) }
    }
}

impl<R: Runtime> AsRef<[u8]> for PinnedBuffer<R> {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl<R: Runtime> AsMut<[u8]> for PinnedBuffer<R> {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl<R: Runtime> fmt::Debug for PinnedBuffer<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &self.as_ptr())
            .field("len", &self.len())
            .field("capacity", &self.capacity())
            .field("pool", &self.pool())
            .finish()
    }
}
