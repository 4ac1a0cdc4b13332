//! A lease: a block lent to a user, returned when the lease is dropped.
//!
//! This is the engine's side of a buffer (pinned or device): it knows the bytes and which
//! streams used them, and its drop is the free (see [`crate::blocks::block`] for where the block goes).

use std::ptr::NonNull;

use crate::blocks::block::{Block, BlockState};
use crate::vocab::error::Error;
use crate::vocab::holder::{self, NOBODY};
use crate::vocab::memory::Origin;
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::{Runtime, StreamId};

/// Bytes lent by the allocator. Dropping it frees them: they are reused only after
/// every stream recorded with [`Lease::record_stream`] has finished the work enqueued on it
/// before the drop.
pub struct Lease<R: Runtime> {
    block: Option<Box<Block<R>>>,
    len: usize,
    engine: u64,
}

// SAFETY: the lease owns its block exclusively (the block is in no queue while lent), and
// the bytes are plain memory; streams are `Send + Sync` by the `Runtime` bound.
unsafe impl<R: Runtime> Send for Lease<R> {}
// SAFETY: shared access only reads the pointer and length; writes need `&mut`.
unsafe impl<R: Runtime> Sync for Lease<R> {}

impl<R: Runtime> Lease<R> {
    pub(crate) fn new(
        mut block: Box<Block<R>>,
        len: usize,
        during_capture: bool,
        engine: u64,
    ) -> Self {
        block.pool.history.on_alloc(block.seen(), len);
        block.shard = block.pool.stats.lend(block.size, len);
        block.during_capture = during_capture;
        block.state = BlockState::InUse;
        block.meta.lent(len);
        // Who took it matters only to a request that waits under a cap (see `long_wait`).
        if block.pool.budget.limit().is_some() {
            block.meta.held_by(holder::current());
        }
        Lease {
            block: Some(block),
            len,
            engine,
        }
    }

    /// Takes the block out, with the bytes requested, without freeing it (a restore frees
    /// it in its pool actor, or hands it back through [`Self::from_parts`]).
    pub(crate) fn into_parts(mut self) -> Option<(Box<Block<R>>, usize)> {
        let len = self.len;
        self.block.take().map(|b| (b, len))
    }

    /// A lease over a block taken out by [`Self::into_parts`], as it was.
    pub(crate) fn from_parts(block: Box<Block<R>>, len: usize, engine: u64) -> Self {
        Lease {
            block: Some(block),
            len,
            engine,
        }
    }

    pub(crate) fn empty(engine: u64) -> Self {
        Lease {
            block: None,
            len: 0,
            engine,
        }
    }

    /// Start of the bytes (dangling but aligned when the lease is empty).
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.block {
            Some(b) => b.memory.ptr.as_ptr(),
            None => NonNull::<u64>::dangling().as_ptr() as *mut u8,
        }
    }

    /// Bytes requested.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no bytes were requested (no block is held).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the block behind the lease (at least `len`).
    pub fn capacity(&self) -> usize {
        self.block.as_ref().map_or(0, |b| b.size)
    }

    /// The pool the block belongs to (`None` for an empty lease).
    pub fn pool(&self) -> Option<PoolId> {
        self.block.as_ref().map(|b| b.pool.id)
    }

    /// How the memory under the block was obtained (its segment's [`Origin`]; `None` for
    /// an empty lease): e.g. whole device segments versus runs mapped into an expandable
    /// range, which differ in how they can be shared with other processes.
    pub fn origin(&self) -> Option<Origin> {
        self.block.as_ref().map(|b| b.memory.method)
    }

    /// Which engine lent this lease.
    pub fn engine_id(&self) -> u64 {
        self.engine
    }

    /// Whether the block was taken while its stream was being captured into a graph.
    pub fn allocated_during_capture(&self) -> bool {
        self.block.as_ref().is_some_and(|b| b.during_capture)
    }

    /// Marks the bytes as used by work on `stream`: when the lease is dropped, an event is
    /// recorded on the stream, and the bytes are reused only once it has completed.
    /// Recording the same stream twice records it once. A no-op on an empty lease, and for
    /// the stream that owns the block in a stream-ordered pool (its work runs in order
    /// before any later use of the block on that stream).
    ///
    /// # Errors
    /// [`Error::ForeignStream`] for a stream of another runtime than the allocator's
    /// ([`Runtime::owns_stream`]); nothing is recorded.
    pub fn record_stream(&mut self, stream: &R::Stream) -> Result<(), Error> {
        match &mut self.block {
            Some(b) => record(b, stream),
            None => Ok(()),
        }
    }

    /// The lease as one pointer, for tables that hold many (`Err(self)` for an empty
    /// lease, which holds no block): see [`RawLease`].
    pub fn into_raw(mut self) -> Result<RawLease<R>, Self> {
        match self.block.take() {
            Some(mut b) => {
                b.raw_len = self.len;
                b.raw_engine = self.engine;
                Ok(RawLease(NonNull::from(Box::leak(b))))
            }
            None => Err(self),
        }
    }

    /// Gives the block back as if it had never been lent: for a buffer taken by a request
    /// for several that did not get them all, whose requester never sees it. It is freed as
    /// a drop frees it (reusable at once; a block borrowed from another stream's pool, marked
    /// as used by the requesting stream, once that stream's work has run), and its counts go
    /// back (see `PoolStats::roll_back`), so that the statistics count what requesters
    /// received.
    pub(crate) fn roll_back(self) {
        let Some(b) = self.block.as_ref() else {
            return;
        };
        let (pool, shard, size, len) = (b.pool.clone(), b.shard, b.size, self.len);
        drop(self);
        pool.stats.roll_back(shard, size, len);
    }

    /// The streams recorded so far.
    pub fn recorded_streams(&self) -> Vec<StreamId> {
        self.block
            .as_ref()
            .map(|b| b.streams.iter().map(|(s, _)| *s).collect())
            .unwrap_or_default()
    }
}

/// The block's holder, who took it (`taker`), is done with it: when the buffer is dropped by
/// another task or thread, buffers change hands under this cap (see `long_wait`; once that
/// is known, nobody looks again).
#[inline(never)]
fn dropped_by_holder<R: Runtime>(b: &Block<R>, taker: u64) {
    let budget = &b.pool.budget;
    if !budget.handed_over() && taker != holder::current() {
        budget.note_handed_over();
    }
    b.meta.held_by(NOBODY);
}

/// Marks the block as used by work on `stream` (see [`Lease::record_stream`]).
pub(crate) fn record<R: Runtime>(b: &mut Block<R>, stream: &R::Stream) -> Result<(), Error> {
    let rt = &*b.pool.runtime;
    let id = rt.stream_id(stream);
    if !rt.owns_stream(stream) {
        return Err(Error::ForeignStream {
            stream: id.0,
            runtime: rt.name(),
        });
    }
    if b.pool.owner != Some(id) && !b.streams.iter().any(|(s, _)| *s == id) {
        b.meta.recorded(id);
        b.streams.push((id, stream.clone()));
    }
    Ok(())
}

/// A lease held as one pointer to its block, which carries the bytes requested and the
/// lender's id meanwhile: what the device allocator's table of raw addresses keeps, so that
/// `raw_alloc_with_stream` allocates nothing beside the block. Dropping it frees the block
/// as dropping the lease would.
pub struct RawLease<R: Runtime>(NonNull<Block<R>>);

// SAFETY: as for `Lease`: the raw lease owns its block exclusively.
unsafe impl<R: Runtime> Send for RawLease<R> {}
// SAFETY: shared access only reads the address.
unsafe impl<R: Runtime> Sync for RawLease<R> {}

impl<R: Runtime> RawLease<R> {
    /// Start of the bytes.
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: the raw lease owns the block (see `into_ptr`).
        unsafe { self.0.as_ref() }.memory.ptr.as_ptr()
    }

    /// [`Lease::record_stream`].
    ///
    /// # Errors
    /// As for [`Lease::record_stream`].
    pub fn record_stream(&mut self, stream: &R::Stream) -> Result<(), Error> {
        // SAFETY: as in `as_ptr`, and `&mut self` makes this the only access.
        record(unsafe { self.0.as_mut() }, stream)
    }

    /// The lease again, as it was.
    pub fn into_lease(self) -> Lease<R> {
        let block = self.0;
        std::mem::forget(self);
        // SAFETY: this raw lease owned the block and is gone without its drop.
        unsafe { lease_of(block) }
    }

    /// The pointer, owning the block: give it back to [`RawLease::from_ptr`] exactly once,
    /// or the block is never freed.
    pub fn into_ptr(self) -> *mut () {
        let p = self.0.as_ptr().cast();
        std::mem::forget(self);
        p
    }

    /// The raw lease `into_ptr` gave out.
    ///
    /// # Safety
    ///
    /// `p` came from [`RawLease::into_ptr`] and is given back once.
    pub unsafe fn from_ptr(p: *mut ()) -> Self {
        // SAFETY: by the contract, `p` is a leaked block's non-null address.
        RawLease(unsafe { NonNull::new_unchecked(p.cast()) })
    }
}

/// The lease over a block that `Lease::into_raw` leaked.
///
/// # Safety
///
/// The caller owns the block and gives up its `RawLease` (no other use of it follows).
unsafe fn lease_of<R: Runtime>(block: NonNull<Block<R>>) -> Lease<R> {
    // SAFETY: the block came from `Box::leak` in `Lease::into_raw`, owned by the caller.
    let b = unsafe { Box::from_raw(block.as_ptr()) };
    Lease {
        len: b.raw_len,
        engine: b.raw_engine,
        block: Some(b),
    }
}

impl<R: Runtime> Drop for RawLease<R> {
    fn drop(&mut self) {
        // SAFETY: the raw lease is going; nothing reads `self.0` after this.
        drop(unsafe { lease_of(self.0) });
    }
}

impl<R: Runtime> Drop for Lease<R> {
    fn drop(&mut self) {
        if let Some(b) = self.block.take() {
            b.pool
                .history
                .on_free(b.seen(), self.len, || b.streams.first().map(|(s, _)| *s));
            b.pool.stats.freed(b.shard, b.size, self.len);
            let taker = b.meta.holder();
            if taker != NOBODY {
                dropped_by_holder(&b, taker);
            }
            b.release();
        }
    }
}

impl<R: Runtime> std::fmt::Debug for Lease<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("ptr", &self.as_ptr())
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("pool", &self.pool())
            .finish()
    }
}
