//! A block: one piece of memory lent out as a unit, and where it goes when it is freed.
//!
//! Blocks travel: from a ready holder to a buffer, from a buffer back to a ready holder (the
//! cached path), parked or to the event poller while recorded events are pending, or to their
//! pool actor to be kept for graph replays or freed. Whoever holds the `Box<Block>` owns the
//! memory. A block dropped anywhere but in its pool actor's free finds its way home
//! (invariant 2: nothing is lost). A block reaches its pool through the [`Home`] it carries
//! (ready holder, parked slots, the senders to its actor and to the poller), never by naming
//! the actor.
//!
//! This file holds the block's record; `free` is its free, and `pool` the pool's side of
//! its blocks (records recycled, blocks sent home, memory given back on this thread).

use std::sync::Arc;

use crate::books::home;
use crate::books::messages::{Note, PollerMsg, PoolMsg, Split};
use crate::books::segment::Segment;
use crate::holders::parked::Parkable;
use crate::holders::ready::Slotted;
use crate::observation::history::BlockSeen;
use crate::statistics::meta::MetaRef;
use crate::vocab::memory::Region;
use crate::vocab::runtime::{Runtime, StreamId};

/// A pool's home, with the engine's blocks in its queues.
pub(crate) type Home<R> = home::Home<R, Block<R>>;
/// A segment the engine's blocks are cut out of.
pub(crate) type Seg<R> = Segment<R, Block<R>>;

/// Where a block is in its life; decides what happens when it is dropped by accident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// Lent to a buffer, or on its way to one.
    InUse,
    /// In a ready holder.
    Cached,
    /// Freed, waiting for recorded events to complete.
    Waiting,
    /// Used by captured work; kept until its pool is released.
    Kept,
}

/// A block's pending events, and one completed event kept to be recorded again at its next
/// free (no trip through the runtime's event pool). Reached only through `&mut` (`get_mut`,
/// `spare_mut`), so sharing a `&Block` shares no access to them: the block stays `Sync`
/// although events need only be `Send`.
pub(crate) struct Events<E> {
    pending: Vec<E>,
    spare: Option<E>,
}

impl<E> Events<E> {
    fn new() -> Self {
        Events {
            pending: Vec::new(),
            spare: None,
        }
    }

    pub(crate) fn get_mut(&mut self) -> &mut Vec<E> {
        &mut self.pending
    }

    fn spare_mut(&mut self) -> &mut Option<E> {
        &mut self.spare
    }
}

// SAFETY: no method gives access to the events through `&Events`; all access needs `&mut`,
// which is exclusive, so concurrent `&` access from several threads touches nothing.
unsafe impl<E: Send> Sync for Events<E> {}

/// What a free found of one stream that used the block.
enum StreamAtFree<E> {
    /// Capturing: the block is kept (an event would become part of the graph).
    Capturing,
    /// Idle: all its work has run.
    Finished,
    /// Busy: the event that completes with its work so far.
    Recorded(E),
}

// Blocks are made one after another by the pool actor and then written by the threads that
// hold them: each gets cache lines of its own so that two threads' blocks never share one.
#[repr(align(128))]
pub(crate) struct Block<R: Runtime> {
    /// The memory: a whole allocation from the pool's source, or a range of `segment`.
    pub(crate) memory: Region,
    /// Bytes of the block (`memory.size`, kept beside the class for the cached path).
    pub(crate) size: usize,
    /// Index of the size class.
    pub(crate) class: usize,
    /// Stats shard the block is charged to while active.
    pub(crate) shard: usize,
    /// Allocated while its stream was capturing: never given events, kept if used.
    pub(crate) during_capture: bool,
    /// Streams recorded since the block was lent.
    pub(crate) streams: Vec<(StreamId, R::Stream)>,
    /// Events recorded at the free, while the block waits (empty otherwise).
    pub(crate) events: Events<R::Event>,
    pub(crate) state: BlockState,
    /// Set once the memory has been given back to the runtime.
    pub(crate) freed: bool,
    pub(crate) pool: Arc<Home<R>>,
    /// What the holder writes for snapshots (requested bytes, streams).
    pub(crate) meta: MetaRef,
    /// The segment the block was cut out of (`None`: the block is a host allocation).
    pub(crate) segment: Option<Arc<Seg<R>>>,
    /// Cut again at the range its class last gave back, its class asked for once more
    /// while that range was still free: a large piece stays on the cached path when freed
    /// (see `PoolShared::large_piece`).
    pub(crate) recalled: bool,
    /// Placed by the pool actor into free memory it filled exactly: freed, it may be held
    /// by the freeing thread for its next request of the same size (see
    /// `ReadyHolder::put_held`), which the actor's best fit would most likely place there.
    pub(crate) holdable: bool,
    /// While a [`crate::blocks::lease::RawLease`] holds the block: the bytes requested and the
    /// lending engine's id (a [`crate::blocks::lease::Lease`] keeps them itself).
    pub(crate) raw_len: usize,
    pub(crate) raw_engine: u64,
}

impl<R: Runtime> Block<R> {
    /// The block as the history sees it.
    #[inline]
    pub(crate) fn seen(&self) -> BlockSeen {
        BlockSeen {
            pool: self.pool.id,
            owner: self.pool.owner,
            addr: self.memory.addr(),
            size: self.size,
        }
    }

    pub(crate) fn new(memory: Region, class: usize, pool: Arc<Home<R>>) -> Box<Self> {
        Box::new(Block {
            memory,
            size: memory.size,
            class,
            shard: 0,
            during_capture: false,
            streams: Vec::new(),
            events: Events::new(),
            state: BlockState::InUse,
            freed: false,
            pool,
            meta: MetaRef::take(),
            segment: None,
            recalled: false,
            holdable: false,
            raw_len: 0,
            raw_engine: 0,
        })
    }

    /// Splits a ready block cut out of a segment: it keeps its first `keep` bytes (as a
    /// block of class `class`) and the rest becomes a new ready block of class `rest_class`
    /// (returned). The pool actor is told before either part can come back to it (see
    /// [`Split`]). `None`, and the block unchanged, when it was not cut out of a segment or
    /// leaves no rest.
    pub(crate) fn split_off(
        &mut self,
        keep: usize,
        class: usize,
        rest_class: usize,
    ) -> Option<Box<Block<R>>> {
        let seg = self.segment.as_ref()?;
        if keep == 0 || keep >= self.size {
            return None;
        }
        let rest_len = self.size - keep;
        // `keep` lies inside the block, so the rest's start does too.
        let ptr = std::ptr::NonNull::new(self.memory.ptr.as_ptr().wrapping_add(keep))?;
        let rest = Region {
            ptr,
            size: rest_len,
            method: self.memory.method,
        };
        // One more hold on the segment, for the tail (the segment's count is a line every
        // thread cutting the range writes).
        let (seg_id, in_arena) = (seg.id, seg.is_arena());
        let mut tail = self.pool.new_block(rest, rest_class, Arc::clone(seg));
        tail.state = BlockState::Cached;
        self.pool.note(Note::Split(Split {
            addr: self.memory.addr(),
            first: keep,
            first_class: class,
            rest: rest_len,
            rest_class,
            seg: seg_id,
            in_arena,
            rest_meta: tail.meta,
        }));
        self.memory.size = keep;
        self.size = keep;
        self.class = class;
        self.recalled = false;
        Some(tail)
    }

    /// Whether the block was cut out of its pool's expandable range.
    pub(crate) fn in_arena(&self) -> bool {
        self.segment.as_ref().is_some_and(|s| s.is_arena())
    }
}

impl<R: Runtime> Slotted for Block<R> {
    #[inline]
    fn class(&self) -> usize {
        self.class
    }

    #[inline]
    fn size(&self) -> usize {
        self.size
    }
}

impl<R: Runtime> Parkable for Block<R> {
    fn events_completed(&mut self) -> bool {
        Block::events_completed(self)
    }

    fn leave_waiting(&mut self) {
        Block::leave_waiting(self)
    }

    fn returned_from_waiting(self: Box<Self>) {
        Block::returned_from_waiting(self)
    }

    fn to_poller(self: Box<Self>) {
        let poller = self.pool.poller.clone();
        if let Err(flume::SendError(PollerMsg::Wait(b))) = poller.send(PollerMsg::Wait(self)) {
            // The poller is gone with its runtime: wait here for the events.
            b.wait_here();
        }
    }

    fn wait_here(self: Box<Self>) {
        Block::wait_here(self)
    }
}

impl<R: Runtime> Drop for Block<R> {
    fn drop(&mut self) {
        if self.freed {
            self.meta.give_back();
            self.release_spare_event();
            return;
        }
        // Dropped by accident (a cancelled reply, an actor torn down with its runtime):
        // send it home, or free it here if home is gone.
        let b = self.take();
        let pool = b.pool.clone();
        if let Err(flume::SendError(PoolMsg::Home(b))) = pool.mailbox.send(PoolMsg::Home(b)) {
            b.orphaned();
        }
    }
}

mod free;
mod pool;
