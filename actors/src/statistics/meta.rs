//! A block's record for snapshots: the one thing only a block's holder knows — the bytes
//! last requested of it, the streams recorded on it, and who took it — kept in a small per-block record
//! of atomics written by that holder (one thread at a time), so that reading it costs the
//! cached path no shared cache line.
//!
//! Records are recycled, never freed ([`MetaRef`]): the pool actor's books keep references
//! to the records of lent blocks without a reference count that the threads splitting and
//! merging blocks would share with it. A reader that kept a record after its block went (a
//! snapshot taken meanwhile) reads a later holder's values, never freed memory.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;

use flume::{Receiver, Sender};

use crate::vocab::holder::NOBODY;
use crate::vocab::runtime::StreamId;

/// How many recorded streams a block's record remembers.
const STREAMS_KEPT: usize = 4;

/// What a block's holder writes for snapshots (on cache lines of its own: records of blocks
/// held by different threads are made one after another).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct BlockMeta {
    requested: AtomicUsize,
    nstreams: AtomicUsize,
    streams: [AtomicU64; STREAMS_KEPT],
    /// Who took the block and holds it now (see `holder`; `holder::NOBODY` while it is not
    /// lent).
    holder: AtomicU64,
}

impl BlockMeta {
    /// The block is lent for a request of `len` bytes (by nobody yet: see
    /// [`BlockMeta::held_by`]).
    #[inline]
    pub(crate) fn lent(&self, len: usize) {
        self.requested.store(len, Relaxed);
        self.nstreams.store(0, Relaxed);
        self.holder.store(NOBODY, Relaxed);
    }

    /// The block is held by `holder` (a number of `holder`; `NOBODY` once it is freed).
    #[inline]
    pub(crate) fn held_by(&self, holder: u64) {
        self.holder.store(holder, Relaxed);
    }

    /// Who holds the block (`NOBODY` when it is not lent).
    pub(crate) fn holder(&self) -> u64 {
        self.holder.load(Relaxed)
    }

    /// `stream` was recorded on the block (the first few are remembered).
    #[inline]
    pub(crate) fn recorded(&self, stream: StreamId) {
        let n = self.nstreams.load(Relaxed);
        if n < STREAMS_KEPT {
            self.streams[n].store(stream.0, Relaxed);
            self.nstreams.store(n + 1, Relaxed);
        }
    }

    pub(crate) fn requested(&self) -> usize {
        self.requested.load(Relaxed)
    }

    pub(crate) fn streams(&self) -> Vec<u64> {
        let n = self.nstreams.load(Relaxed).min(STREAMS_KEPT);
        self.streams[..n].iter().map(|s| s.load(Relaxed)).collect()
    }
}

/// A block's record, held by one block at a time (and referenced by the books and
/// snapshots): taken from the records given back, or made once and kept for the rest of the
/// process. Memory held: one record (128 bytes) per block alive at the busiest moment.
#[derive(Clone, Copy)]
pub(crate) struct MetaRef(&'static BlockMeta);

/// The record nobody holds (the segment views of mapped runs, a block moved elsewhere).
static NONE: BlockMeta = BlockMeta {
    requested: AtomicUsize::new(0),
    nstreams: AtomicUsize::new(0),
    streams: [const { AtomicU64::new(0) }; STREAMS_KEPT],
    holder: AtomicU64::new(NOBODY),
};

/// Records given back, for the next blocks made.
fn spare() -> &'static (Sender<MetaRef>, Receiver<MetaRef>) {
    static SPARE: OnceLock<(Sender<MetaRef>, Receiver<MetaRef>)> = OnceLock::new();
    SPARE.get_or_init(flume::unbounded)
}

impl MetaRef {
    /// A record for a new block, its values cleared.
    pub(crate) fn take() -> Self {
        match spare().1.try_recv() {
            Ok(m) => {
                m.lent(0);
                m
            }
            Err(_) => MetaRef(Box::leak(Box::default())),
        }
    }

    /// The record nobody holds: reads as nothing requested, and is never given back.
    pub(crate) fn none() -> Self {
        MetaRef(&NONE)
    }

    /// Hands the record back for another block (its holder is gone).
    pub(crate) fn give_back(self) {
        if !std::ptr::eq(self.0, &NONE) {
            let _ = spare().0.send(self);
        }
    }
}

impl std::ops::Deref for MetaRef {
    type Target = BlockMeta;
    fn deref(&self) -> &BlockMeta {
        self.0
    }
}

impl std::fmt::Debug for MetaRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MetaRef({:p})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_given_back_come_back_cleared_and_the_empty_record_is_never_handed_out() {
        // Records written by their holders, then given back (with the empty one, which goes
        // nowhere). Other tests share the spare list, so ours may come back in any order or
        // to another test: whatever comes back is cleared, and never the empty record.
        for n in 1..=8 {
            let m = MetaRef::take();
            m.lent(4096 * n);
            m.recorded(StreamId(7));
            m.give_back();
        }
        MetaRef::none().give_back();
        let taken: Vec<MetaRef> = (0..64).map(|_| MetaRef::take()).collect();
        for r in &taken {
            assert!(!std::ptr::eq(&**r, &NONE));
            assert_eq!(r.requested(), 0);
            assert!(r.streams().is_empty());
        }
        // Each record is held by one taker at a time.
        let mut addrs: Vec<*const BlockMeta> =
            taken.iter().map(|r| std::ptr::from_ref(&**r)).collect();
        addrs.sort_unstable();
        addrs.dedup();
        assert_eq!(addrs.len(), taken.len());
    }
}
