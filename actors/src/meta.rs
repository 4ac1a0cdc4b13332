//! A block's record for snapshots: the one thing only a block's holder knows — the bytes
//! last requested of it, and the streams recorded on it — kept in a small per-block record
//! of atomics written by that holder (one thread at a time), so that reading it costs the
//! cached path no shared cache line.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use crate::runtime::StreamId;

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
}

impl BlockMeta {
    /// The block is lent for a request of `len` bytes.
    #[inline]
    pub(crate) fn lent(&self, len: usize) {
        self.requested.store(len, Relaxed);
        self.nstreams.store(0, Relaxed);
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
