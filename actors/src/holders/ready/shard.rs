//! One shard's overflow queues: a flume queue per class for the blocks its slots cannot
//! hold, made at the class's first overflow, and the bits that say which queues may hold a
//! block.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use flume::{Receiver, Sender};

use crate::vocab::loom::AtomicU64;

/// A class's overflow queue of one shard, made when the first block overflows into it: a
/// pool has hundreds of classes and tens of shards, and most queues of most pools are
/// never used (made up front, they were most of the time and memory a new pool took).
pub(super) struct Queue<B> {
    chan: OnceLock<Chan<B>>,
}

/// Both ends of a queue's channel (the receiver lives beside the sender: a send cannot fail).
type Chan<B> = (Sender<Box<B>>, Receiver<Box<B>>);

impl<B> Queue<B> {
    fn new() -> Self {
        Queue {
            chan: OnceLock::new(),
        }
    }

    /// A block of the queue, if it holds one.
    #[inline]
    pub(super) fn take(&self) -> Option<Box<B>> {
        self.chan.get()?.1.try_recv().ok()
    }

    /// Adds a block to the queue.
    #[inline]
    pub(super) fn put(&self, block: Box<B>) {
        let _ = self.chan.get_or_init(flume::unbounded).0.send(block);
    }

    /// Takes every block of the queue into `out`.
    fn take_all(&self, out: &mut Vec<Box<B>>) {
        if let Some((_, rx)) = self.chan.get() {
            out.extend(rx.try_iter());
        }
    }
}

/// One shard's overflow queues.
pub(super) struct Shard<B> {
    pub(super) queues: Box<[Queue<B>]>,
    /// One bit per class whose queue may hold a block: set after every send, cleared by a
    /// drain before it empties the queue, or by a look of the shard's own thread that finds
    /// it empty, before it looks again (see `take_or_unmark`). A queue that holds a block
    /// always has its bit set once the send returns (a bit may be set over an empty queue),
    /// so a drain or a steal looks only at queues whose bit is set instead of at every class
    /// of every shard.
    queued: Box<[AtomicU64]>,
}

impl<B> Shard<B> {
    /// Empty queues for `classes` size classes, none marked.
    pub(super) fn new(classes: usize) -> Self {
        Shard {
            queues: (0..classes).map(|_| Queue::new()).collect(),
            queued: (0..classes.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    /// Whether the queue of `class` may hold a block.
    #[inline]
    pub(super) fn may_hold(&self, class: usize) -> bool {
        self.queued[class / 64].load(Ordering::Acquire) & (1 << (class % 64)) != 0
    }

    /// The smallest class in `from..=to` whose queue may hold a block.
    pub(super) fn first_marked(&self, from: usize, to: usize) -> Option<usize> {
        let mut c = from;
        while c <= to {
            let (w, bit) = (c / 64, c % 64);
            let bits = self.queued.get(w)?.load(Ordering::Acquire) >> bit;
            if bits != 0 {
                let found = c + bits.trailing_zeros() as usize;
                return (found <= to).then_some(found);
            }
            c = (w + 1) * 64;
        }
        None
    }

    /// A block from the queue of `class`. A queue found empty loses its bit, and is looked
    /// at once more: a send that came between the two looks set the bit before it was
    /// cleared, and its block is taken now; a send after them sets the bit again. So a
    /// queue that holds a block keeps its bit set, and a bit left set over an emptied queue
    /// (a take leaves it) costs the next look one lock, not every look until a drain.
    pub(super) fn take_or_unmark(&self, class: usize) -> Option<Box<B>> {
        let q = &self.queues[class];
        if let Some(b) = q.take() {
            return Some(b);
        }
        self.queued[class / 64].fetch_and(!(1 << (class % 64)), Ordering::AcqRel);
        let b = q.take()?;
        // It may hold more.
        self.mark(class);
        Some(b)
    }

    /// The queue of `class` (of this shard) holds a block.
    pub(super) fn mark(&self, class: usize) {
        self.queued[class / 64].fetch_or(1 << (class % 64), Ordering::Release);
    }

    /// Takes every block out of the queues whose bit is set, clearing the bits first.
    pub(super) fn drain_into(&self, out: &mut Vec<Box<B>>) {
        for (w, word) in self.queued.iter().enumerate() {
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = word.swap(0, Ordering::Acquire);
            while bits != 0 {
                let class = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                // One block at a time: `drain` would hand over the queue's buffer, and the
                // next frees into it would grow a new one (about 5 % of the mixed sizes
                // loop on a 16-core host went to that growth).
                self.queues[class].take_all(out);
            }
        }
    }
}
