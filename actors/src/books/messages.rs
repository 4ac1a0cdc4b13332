//! The messages the pool actors and the event poller answer, and the plain data their replies
//! carry. Defined below the blocks and pools they move (generic over the block type `B`), so
//! that whoever holds a pool's or the poller's sender can send without naming the actor. Also
//! a pool's [`Mailbox`]: its sender, closed for good when the actor's task is gone.

use std::sync::Arc;

use flume::{Receiver, SendError, Sender};

use crate::books::budget::EmptyReport;
use crate::books::errand::Errand;
use crate::holders::parked::Parked;
use crate::statistics::meta::MetaRef;
use crate::vocab::carve::SegId;
use crate::vocab::error::Error;
use crate::vocab::memory::{MemoryKind, Region};
use crate::vocab::policy::SizeClass;
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::StreamId;

/// A one-shot reply: `recv_async` from tasks, `recv` from plain threads.
pub(crate) type Reply<T> = Sender<T>;

/// What a request tells its pool beside the class.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ask {
    /// Bytes the user asked for (for errors).
    pub(crate) requested: usize,
    /// Whether the request may be queued when it does not fit.
    pub(crate) wait: bool,
    /// Whether every pool's cache has been emptied for this request already.
    pub(crate) emptied: bool,
    /// The requesting thread may hold freed blocks of the sizes threads cache in its own
    /// shard of the ready holder: before the pool takes fresh memory for such a size, it asks
    /// the thread to send them home ([`Refused::Coalesce`]).
    pub(crate) holds: bool,
    /// Whether the requesting thread waits on a plain thread that may block, and runs the
    /// errands it is sent while it waits (see [`crate::books::errand`]).
    pub(crate) runs_errands: bool,
    /// A try for one buffer of a request for several (`engine::many`): no room under the cap
    /// is `Refused::NeedRoom` even once the caches were emptied, never a final
    /// out-of-memory, and is not counted (the request waits, or fails, as a whole).
    pub(crate) quiet: bool,
    /// When the requester sent it: the pool actor measures the gaps between requests from
    /// here, not from when it noticed them (which, after it parked, adds its wake-up).
    pub(crate) sent: std::time::Instant,
}

/// Why a pool did not hand out a block.
pub(crate) enum Refused {
    /// No room (under the cap, or from the memory source): empty every cache and ask again.
    NeedRoom,
    /// Only fresh memory would serve the request: the requesting thread sends the blocks its
    /// own shard holds home, where they coalesce with the free memory around them, and asks
    /// again (see [`Ask::holds`]).
    Coalesce,
    /// A final answer.
    Failed(Error),
}

/// A pool's answer to a miss.
pub(crate) type MissReply<B> = Result<Box<B>, Refused>;

/// What a requester receives while it waits for a miss: errands to run, then the answer.
pub(crate) enum Answer<B> {
    Errand(Errand),
    Done(MissReply<B>),
}

impl<B> Answer<B> {
    /// The answer, or `None` for an errand, which is dropped here and so runs on a blocking
    /// thread (for requesters that do not lend their thread).
    pub(crate) fn into_reply(self) -> Option<MissReply<B>> {
        match self {
            Answer::Done(reply) => Some(reply),
            Answer::Errand(_) => None,
        }
    }
}

/// The pool's end of a miss's reply channel.
pub(crate) struct MissTx<B>(Sender<Answer<B>>);

impl<B> Clone for MissTx<B> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<B> MissTx<B> {
    /// A reply channel: the pool's end and the requester's.
    pub(crate) fn pair() -> (Self, Receiver<Answer<B>>) {
        // Room for the answer and an errand the requester has not picked up yet.
        let (tx, rx) = flume::bounded(2);
        (Self(tx), rx)
    }

    /// Sends the answer, or hands it back when the requester is gone.
    pub(crate) fn send(&self, reply: MissReply<B>) -> Result<(), SendError<MissReply<B>>> {
        match self.0.send(Answer::Done(reply)) {
            Err(SendError(Answer::Done(r))) => Err(SendError(r)),
            _ => Ok(()),
        }
    }

    /// Hands the requester an errand to run (dropped unrun, it runs on a blocking thread).
    pub(crate) fn send_errand(&self, errand: Errand) {
        let _ = self.0.try_send(Answer::Errand(errand));
    }

    /// Whether the requester stopped waiting.
    pub(crate) fn is_disconnected(&self) -> bool {
        self.0.is_disconnected()
    }
}

/// A pool's answer to a restore: the blocks lent at the wanted ranges, or the error and
/// the blocks to free, untouched.
pub(crate) type RestoreReply<B> = Result<Vec<Box<B>>, (Error, Vec<(Box<B>, usize)>)>;

/// Messages a pool actor answers.
pub(crate) enum PoolMsg<B> {
    /// No ready block of `class`: find one or get fresh memory (or queue the request when
    /// it must wait for room).
    Miss {
        class: SizeClass,
        ask: Ask,
        reply: MissTx<B>,
    },
    /// A block used by captured work: keep it while the pool lives.
    Keep(Box<B>),
    /// A block coming home outside the ready holder (closing pool, cancelled reply).
    Home(Box<B>),
    /// Free every cached block (and the kept ones when the pool is released).
    EmptyCache {
        include_kept: bool,
        /// Asked for by the user (or a released pool): the pool also forgets what it
        /// learned from requests, and goes on as a fresh pool would. Not when another pool
        /// needs room (the requests go on as before).
        forget: bool,
        /// Bytes to give back: `usize::MAX` for everything cached; less when another pool
        /// needs that much room (least recently used memory first).
        upto: usize,
        reply: Reply<EmptyReport>,
    },
    /// Count what the pool holds (for checking invariant 2 at quiescent points).
    Inventory { reply: Reply<Inventory> },
    /// List the pool's segments and its cached and kept blocks (for snapshots).
    Describe { reply: Reply<PoolView> },
    /// Bring the pool back to a checkpoint (see `pool::restore`): take back `free` (blocks
    /// of leases the caller gave up, with their requested bytes) and lend exactly the
    /// ranges `want` (address, bytes) again, for work on stream `target`. On an error
    /// nothing is changed and `free` comes back.
    Restore {
        want: Vec<(usize, usize)>,
        free: Vec<(Box<B>, usize)>,
        target: StreamId,
        reply: Reply<RestoreReply<B>>,
    },
    /// Lend a block of `class` out of memory the pool holds (its ready blocks, then free
    /// mapped memory), taking no fresh memory and giving none back: for another stream's
    /// pool that found no room (see `miss::borrow`). `None`: nothing fits.
    Lend {
        class: SizeClass,
        reply: Reply<Option<Box<B>>>,
    },
    /// Look at the queued requests again: room was made, or one was cancelled.
    Wake,
    /// Book the splits threads noted (sent every `NOTE_BATCH` notes of a thread,
    /// so that the books keep up and a miss finds few notes to book before it is served).
    Books,
    /// The pool's owner is gone: give everything back as it comes home, then stop.
    Close,
    /// A stream's pool that holds nothing (no memory, no waiting request, no kept block):
    /// stop now and answer `true`; otherwise answer `false` and go on (see the router's
    /// `retire_idle_streams`).
    Retire { reply: Reply<bool> },
}

/// A ready block split in two by the thread that took it (see `Block::split_off`): the
/// first part, `first` bytes at `addr`, was lent; the rest, `rest` bytes after it, a new
/// block of class `rest_class`, went to the ready holder. Sent before either part can come
/// back, so the actor notes it before it takes either back into its free ranges.
pub(crate) struct Split {
    pub(crate) addr: usize,
    pub(crate) first: usize,
    pub(crate) first_class: usize,
    pub(crate) rest: usize,
    pub(crate) rest_class: usize,
    /// The segment the block was cut from (for a separate segment; the arena is `in_arena`).
    pub(crate) seg: SegId,
    pub(crate) in_arena: bool,
    pub(crate) rest_meta: MetaRef,
}

/// A change a thread made to the pieces a segment lends, for the actor's books.
pub(crate) enum Note {
    Split(Split),
}

/// Messages the event poller answers.
pub(crate) enum PollerMsg<B> {
    /// A freed block, with the events recorded for it.
    Wait(Box<B>),
    /// Watch a pool's parked slots (sent by the first park after a quiet spell).
    Watch(Arc<Parked<B>>),
    /// Poll now, then reply.
    Flush { reply: Reply<()> },
    /// The addresses of the blocks pending (for snapshots).
    Pending { reply: Reply<Vec<usize>> },
}

/// Where a pool's reserved bytes are, at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Inventory {
    /// The pool.
    pub pool: PoolId,
    /// Bytes of memory held.
    pub reserved_bytes: usize,
    /// Allocations from the memory source held.
    pub segments: usize,
    /// Blocks in the ready holder, and their bytes.
    pub cached_blocks: usize,
    /// Bytes of `cached_blocks`.
    pub cached_bytes: usize,
    /// Blocks freed by users that wait on events.
    pub waiting_blocks: usize,
    /// Bytes of `waiting_blocks`.
    pub waiting_bytes: usize,
    /// Blocks kept for graph replays.
    pub kept_blocks: usize,
    /// Bytes of `kept_blocks`.
    pub kept_bytes: usize,
    /// Blocks lent out: the rest.
    pub in_use_blocks: usize,
    /// Bytes of `in_use_blocks`.
    pub in_use_bytes: usize,
}

/// A segment of the pool, as its registry knows it.
#[derive(Clone)]
pub(crate) struct SegmentView {
    pub(crate) memory: Region,
    /// The record of the segment's block, when the segment is one whole block.
    pub(crate) meta: MetaRef,
    /// The segment's pieces in address order, when blocks are carved out of it (filled in by
    /// `describe`; empty for a whole block).
    pub(crate) pieces: Vec<PieceView>,
}

impl SegmentView {
    pub(crate) fn addr(&self) -> usize {
        self.memory.addr()
    }
}

/// One piece of a carved segment: a block cut out of it, or a free range.
#[derive(Clone)]
pub(crate) struct PieceView {
    pub(crate) addr: usize,
    pub(crate) size: usize,
    /// The block's record; `None` for a free range.
    pub(crate) meta: Option<MetaRef>,
}

/// What a pool holds, by address, at one moment (for snapshots).
pub(crate) struct PoolView {
    pub(crate) pool: PoolId,
    /// The memory the pool takes from.
    pub(crate) memory: MemoryKind,
    /// The stream that owns the pool's blocks, in a stream-ordered pool.
    pub(crate) owner: Option<StreamId>,
    pub(crate) segments: Vec<SegmentView>,
    pub(crate) cached: Vec<usize>,
    pub(crate) kept: Vec<usize>,
}
