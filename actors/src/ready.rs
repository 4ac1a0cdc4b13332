//! Ready queues: a pool's cached blocks, one channel per size class and thread shard.
//!
//! The cached path lives here (invariant 5): a request takes a block from its thread's queue
//! for its class (or steals from another shard's), and a free sends it back to the freeing
//! thread's queue. No actor is involved. The pool actor holds the same queues and drains them
//! when it empties the cache or shuts down.

use flume::{Receiver, Sender};

use crate::block::Block;
use crate::runtime::Runtime;
use crate::shard::{thread_number, CachePadded};

struct Queue<R: Runtime> {
    tx: Sender<Box<Block<R>>>,
    rx: Receiver<Box<Block<R>>>,
}

/// One shard's queues, one per class, on cache lines of their own.
type Shard<R> = CachePadded<Box<[Queue<R>]>>;

/// The ready blocks of one pool.
pub(crate) struct ReadyQueues<R: Runtime> {
    shards: Box<[Shard<R>]>,
    mask: usize,
}

impl<R: Runtime> ReadyQueues<R> {
    /// Queues for `classes` size classes in `shards` shards (a power of two).
    pub(crate) fn new(classes: usize, shards: usize) -> Self {
        debug_assert!(shards.is_power_of_two());
        let shards: Box<[_]> = (0..shards)
            .map(|_| {
                CachePadded(
                    (0..classes)
                        .map(|_| {
                            let (tx, rx) = flume::unbounded();
                            Queue { tx, rx }
                        })
                        .collect::<Box<[_]>>(),
                )
            })
            .collect();
        let mask = shards.len() - 1;
        Self { shards, mask }
    }

    /// This thread's shard.
    #[inline]
    pub(crate) fn my_shard(&self) -> usize {
        thread_number() & self.mask
    }

    /// Takes a ready block of `class`: this thread's shard first, then the others.
    #[inline]
    pub(crate) fn take(&self, class: usize) -> Option<Box<Block<R>>> {
        let me = self.my_shard();
        if let Ok(b) = self.shards[me][class].rx.try_recv() {
            return Some(b);
        }
        self.steal(me, class)
    }

    #[cold]
    fn steal(&self, me: usize, class: usize) -> Option<Box<Block<R>>> {
        (1..self.shards.len())
            .map(|i| (me + i) & self.mask)
            .find_map(|s| self.shards[s][class].rx.try_recv().ok())
    }

    /// Puts a block that is ready for reuse into this thread's queue for its class.
    #[inline]
    pub(crate) fn put(&self, block: Box<Block<R>>) {
        let class = block.class;
        // The receiver lives beside the sender, so the send cannot fail.
        let _ = self.shards[self.my_shard()][class].tx.send(block);
    }

    /// Takes every ready block out of every queue.
    pub(crate) fn drain(&self) -> Vec<Box<Block<R>>> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            for q in shard.iter() {
                out.extend(q.rx.try_iter());
            }
        }
        out
    }

    /// Counts the ready blocks and their bytes without taking them.
    pub(crate) fn census(&self) -> (usize, usize) {
        let blocks = self.drain();
        let n = blocks.len();
        let bytes = blocks.iter().map(|b| b.size).sum();
        for b in blocks {
            self.put(b);
        }
        (n, bytes)
    }
}
