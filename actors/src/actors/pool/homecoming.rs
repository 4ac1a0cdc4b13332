//! Blocks coming home to the pool actor, in one place: the large pieces threads freed
//! without a message (`Home::home_quietly`) and the splits they noted, booked before the
//! actor handles each message (`book_notes`); a block sent home (`PoolMsg::Home`) handed to
//! the oldest queued request of its class, freed for room while requests wait, or cached; kept
//! blocks staying kept (invariant 4). A carved block's range goes back into the free ranges
//! and coalesces with its free neighbours at once (`absorb`); a wholly free segment goes
//! back once nothing of it is lent (invariant 2).

use std::sync::atomic::Ordering;

use super::PoolActor;
use crate::blocks::block::{Block, BlockState};
use crate::books::messages::Note;
use crate::vocab::carve::Piece;
use crate::vocab::runtime::Runtime;

impl<R: Runtime> PoolActor<R> {
    /// Books the ready blocks threads split or merged since the last look (see
    /// `Block::split_off`, `Block::absorb_next`): one piece more or fewer lent from the
    /// segment, the records for snapshots, and the slot lines of the parts' classes to
    /// drain. Done before any block is taken back: a part can only come back after its note
    /// was sent. Then takes back the large pieces freed since (`Home::home_quietly`): their splits
    /// were noted before they were freed.
    pub(super) fn book_notes(&mut self) {
        let Some(segs) = self.carved.as_mut() else {
            return;
        };
        for note in self.shared.notes() {
            match note {
                Note::Split(s) => segs.book_split(s),
            }
        }
        let homed: Vec<_> = self.shared.homed().collect();
        if !homed.is_empty() {
            // Memory the next look under pressure gives back (see `relieve`).
            self.relieved = false;
        }
        for mut b in homed {
            if self.absorb(&mut b) {
                self.shared.recycle(b);
            } else {
                b.state = crate::blocks::block::BlockState::Cached;
                self.shared.ready.put(b);
            }
        }
    }

    /// A block back outside the ready holder: kept blocks stay kept, others are reusable.
    pub(super) async fn home(&mut self, mut block: Box<Block<R>>) {
        if block.state == BlockState::Waiting {
            // Its events were lost with the poller: never reuse it.
            let stats = &self.shared.stats;
            stats.waiting_blocks.fetch_sub(1, Ordering::Relaxed);
            stats
                .waiting_bytes
                .fetch_sub(block.size as i64, Ordering::Relaxed);
            stats.kept_blocks.fetch_add(1, Ordering::Relaxed);
            stats
                .kept_bytes
                .fetch_add(block.size as i64, Ordering::Relaxed);
            block.state = BlockState::Kept;
        }
        if block.state == BlockState::Kept {
            self.kept.push(block);
            return;
        }
        if self.closing {
            self.free_blocks(vec![block]).await;
        } else if self.uncacheable(&block) {
            // Too large to cache: back into its segment, which goes back once wholly free.
            self.absorb_all(vec![block]);
            self.give_back_free_segments(false).await;
        } else if self.shared.large_piece(&block) {
            // A large piece: back into its segment now, to coalesce with its neighbours.
            self.absorb_all(vec![block]);
        } else {
            block.state = BlockState::Cached;
            self.shared.ready.put(block);
        }
    }

    /// A block coming home outside the ready holder: to a queued request, freed for room while
    /// requests wait, cached otherwise.
    pub(super) async fn take_back(&mut self, block: Box<Block<R>>) {
        self.take_back_now(block).await;
        // Whatever became of it (freed, cached, handed to a queued request), room may have been
        // made: a request for several buffers waiting at the head of its queue tries again.
        self.shared.budget.came_home();
    }

    async fn take_back_now(&mut self, block: Box<Block<R>>) {
        let pressure = self.shared.budget.under_pressure() || !self.queue.is_empty();
        if self.closing
            || !pressure
            || matches!(block.state, BlockState::Kept | BlockState::Waiting)
        {
            self.home(block).await;
            return;
        }
        let Some(block) = self.offer(block) else {
            return;
        };
        self.free_blocks(vec![block]).await;
        self.serve_queue().await;
    }

    /// Takes a carved block's range back into the free ranges, merging it with free
    /// neighbours. Returns false for a block that was not carved (left untouched).
    /// Call `book_notes` first, after the block was received: the splits it is part of
    /// were sent before it could come back.
    fn absorb(&mut self, block: &mut Box<Block<R>>) -> bool {
        let (Some(segs), Some(seg)) = (self.carved.as_mut(), block.segment.as_ref()) else {
            return false;
        };
        let addr = block.memory.ptr.as_ptr() as usize;
        let in_arena = seg.is_arena();
        let piece = Piece {
            seg: match (&segs.arena, in_arena) {
                (Some(a), true) => a.seg(),
                _ => seg.id,
            },
            offset: addr - seg.memory.ptr.as_ptr() as usize,
            len: block.size,
        };
        segs.lent.remove(&addr);
        segs.last_range.insert(block.class, (piece, in_arena));
        let released = match segs.arena.as_mut() {
            Some(a) if in_arena => a.release(piece),
            _ => segs.carver.release(piece).map(drop),
        };
        if let Err(e) = released {
            // Bookkeeping gone wrong: keep the range out of circulation rather than risk
            // handing it out twice.
            tracing::error!(
                ?e,
                ?piece,
                "carved block could not be taken back; range leaked"
            );
        }
        block.freed = true;
        block.segment = None;
        true
    }

    /// Moves every block of the ready holder into the free ranges (looking only at the slots
    /// of classes the pool has cut blocks for).
    pub(super) fn absorb_ready(&mut self) {
        self.book_notes();
        let lines = self
            .carved
            .as_ref()
            .map(|s| s.slot_lines.clone())
            .unwrap_or_default();
        let blocks = self.shared.ready.drain_lines(&lines);
        // Splits of the blocks just drained were sent before they were put back.
        self.book_notes();
        for mut b in blocks {
            if self.absorb(&mut b) {
                self.shared.recycle(b);
            } else {
                self.shared.ready.put(b);
            }
        }
    }

    /// Takes carved blocks back; returns those that were not carved.
    pub(super) fn absorb_all(&mut self, blocks: Vec<Box<Block<R>>>) -> Vec<Box<Block<R>>> {
        self.book_notes();
        let mut rest = Vec::new();
        for mut b in blocks {
            if self.absorb(&mut b) {
                self.shared.recycle(b);
            } else {
                rest.push(b);
            }
        }
        rest
    }

    /// Whether the pool carves, and the block is too large to cache.
    pub(super) fn uncacheable(&self, block: &Block<R>) -> bool {
        block.segment.is_some()
            && self
                .carved
                .as_ref()
                .is_some_and(|s| block.size > s.carving.max_cached_size)
    }
}
