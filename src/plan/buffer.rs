//! The buffer a session lends: a view of the arena at its planned offset, or an ordinary
//! pool buffer for a request the plan could not serve.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::actors::{Error, Runtime, StreamId};

use super::arena::Ticket;
use crate::PinnedBuffer;

pub(super) enum Inner<R: Runtime> {
    /// A view of the arena.
    Served {
        ptr: NonNull<u8>,
        len: usize,
        ticket: Ticket<R>,
    },
    /// From the pool; with a ticket when it holds a slot of the plan.
    Pool {
        buf: PinnedBuffer<R>,
        _ticket: Option<Ticket<R>>,
    },
}

/// A buffer lent by an [`ArenaSession`](super::ArenaSession): a view of the arena at its planned offset, or, for a
/// request the plan could not serve, an ordinary [`PinnedBuffer`]. Dereferences to bytes.
pub struct PlanBuffer<R: Runtime> {
    pub(super) inner: Inner<R>,
}

// SAFETY: a served view owns its byte range exclusively until it drops (the session hands
// out disjoint ranges of live buffers); the rest of its fields are `Send + Sync`.
unsafe impl<R: Runtime> Send for PlanBuffer<R> {}
// SAFETY: shared access only reads the bytes; writes need `&mut`.
unsafe impl<R: Runtime> Sync for PlanBuffer<R> {}

impl<R: Runtime> PlanBuffer<R> {
    /// Start of the bytes.
    pub fn as_ptr(&self) -> *const u8 {
        match &self.inner {
            Inner::Served { ptr, .. } => ptr.as_ptr(),
            Inner::Pool { buf, .. } => buf.as_ptr(),
        }
    }

    /// Start of the bytes, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match &mut self.inner {
            Inner::Served { ptr, .. } => ptr.as_ptr(),
            Inner::Pool { buf, .. } => buf.as_mut_ptr(),
        }
    }

    /// Bytes requested.
    pub fn len(&self) -> usize {
        match &self.inner {
            Inner::Served { len, .. } => *len,
            Inner::Pool { buf, .. } => buf.len(),
        }
    }

    /// Whether no bytes were requested.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the buffer is a view of the arena (rather than a pool buffer).
    pub fn is_served(&self) -> bool {
        matches!(self.inner, Inner::Served { .. })
    }

    /// Offset in the arena, for a served buffer.
    pub fn arena_offset(&self) -> Option<usize> {
        match &self.inner {
            Inner::Served { ticket, .. } => Some(ticket.lo),
            Inner::Pool { .. } => None,
        }
    }

    /// Marks the buffer as used by work enqueued on `stream`: its bytes are reused (in this
    /// iteration or a later one) only once that work is done.
    ///
    /// # Errors
    /// [`Error::ForeignStream`] for a stream of another runtime than the allocator's;
    /// nothing is recorded.
    pub fn record_stream(&mut self, stream: &R::Stream) -> Result<(), Error> {
        match &mut self.inner {
            Inner::Served { ticket, .. } => {
                let rt = &*ticket.arena.runtime;
                let id = rt.stream_id(stream);
                if !rt.owns_stream(stream) {
                    return Err(Error::ForeignStream {
                        stream: id.0,
                        runtime: rt.name(),
                    });
                }
                if !ticket.streams.iter().any(|(s, _)| *s == id) {
                    ticket.streams.push((id, stream.clone()));
                }
                Ok(())
            }
            Inner::Pool { buf, .. } => buf.record_stream(stream),
        }
    }

    /// The streams recorded so far.
    pub fn recorded_streams(&self) -> Vec<StreamId> {
        match &self.inner {
            Inner::Served { ticket, .. } => ticket.streams.iter().map(|(s, _)| *s).collect(),
            Inner::Pool { buf, .. } => buf.recorded_streams(),
        }
    }
}

impl<R: Runtime> Deref for PlanBuffer<R> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.inner {
            // SAFETY: the view owns `len` bytes at `ptr` inside the arena, which it keeps
            // alive; no other live buffer overlaps them (module comment).
            Inner::Served { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *len)
            },
            Inner::Pool { buf, .. } => buf,
        }
    }
}

impl<R: Runtime> DerefMut for PlanBuffer<R> {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.inner {
            // SAFETY: as in `deref`; `&mut self` makes the access exclusive.
            Inner::Served { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), *len)
            },
            Inner::Pool { buf, .. } => buf,
        }
    }
}

impl<R: Runtime> AsRef<[u8]> for PlanBuffer<R> {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl<R: Runtime> AsMut<[u8]> for PlanBuffer<R> {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl<R: Runtime> std::fmt::Debug for PlanBuffer<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanBuffer")
            .field("ptr", &self.as_ptr())
            .field("len", &self.len())
            .field("arena_offset", &self.arena_offset())
            .finish()
    }
}
