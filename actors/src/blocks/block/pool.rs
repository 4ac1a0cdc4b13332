//! The pool's side of its blocks: records made or recycled, the large blocks a thread held
//! and its ready blocks sent home, records dropped at the end, and memory given back on the
//! freeing thread once the actor is gone.

use std::sync::Arc;

use super::{Block, BlockState, Home, Seg};
use crate::vocab::memory::Region;
use crate::vocab::runtime::Runtime;

impl<R: Runtime> Home<R> {
    /// A block of class `class` over `memory`, cut out of `segment`: a record the actor
    /// recycled if there is one (no allocation), else a new one.
    pub(crate) fn new_block(
        self: &Arc<Self>,
        memory: Region,
        class: usize,
        segment: Arc<Seg<R>>,
    ) -> Box<Block<R>> {
        let Some(mut b) = self.shells.pop() else {
            let mut b = Block::new(memory, class, self.clone());
            b.segment = Some(segment);
            return b;
        };
        b.memory = memory;
        b.size = memory.size;
        b.class = class;
        b.shard = 0;
        b.during_capture = false;
        b.state = BlockState::InUse;
        b.freed = false;
        b.segment = Some(segment);
        b.recalled = false;
        b.holdable = false;
        b.meta.lent(0);
        b
    }

    /// Keeps the record of a block taken back into its segment's free ranges (its memory
    /// no longer its own: `freed`, no segment) for [`Self::new_block`], unless enough are
    /// kept.
    pub(crate) fn recycle(&self, mut block: Box<Block<R>>) {
        if !block.freed || block.segment.is_some() {
            return;
        }
        block.streams.clear();
        block.events.get_mut().clear();
        block.release_spare_event();
        // When enough are kept, the queue hands the record back and it is dropped here.
        let _ = self.shells.push(block);
    }

    /// Once the actor is gone (dropped with its runtime), frees the blocks that a free racing
    /// its teardown put into the ready holder after its last look: each holds the pool, so
    /// left there neither would ever be freed. Called when the allocator's handle goes.
    pub(crate) fn free_stranded(&self) {
        if !self.mailbox.is_closed() {
            return;
        }
        for b in self.ready.drain().into_iter().chain(self.homed()) {
            b.orphaned();
        }
    }

    /// Sends the large blocks this thread held since its last miss home (see
    /// `ReadyHolder::put_held`), before it asks the pool actor: the actor coalesces them
    /// first, so that its placement sees every block this thread freed.
    #[cold]
    pub(crate) fn send_held_home(&self) {
        let mut held = Vec::new();
        self.ready.take_held_mine(&mut held);
        for mut b in held {
            b.state = BlockState::InUse;
            self.home_quietly(b);
        }
    }

    /// Sends every ready block of this thread's shard home, where the pool actor coalesces
    /// it with the free memory around it (see `Refused::Coalesce`).
    #[cold]
    pub(crate) fn send_mine_home(&self) {
        let mut mine = Vec::new();
        self.ready.drain_mine(&mut mine);
        self.ready.take_held_mine(&mut mine);
        for mut b in mine {
            b.state = BlockState::InUse;
            self.home_quietly(b);
        }
    }

    /// Drops the kept records (each holds the pool: the pool would never be dropped).
    pub(crate) fn drop_shells(&self) {
        while let Some(b) = self.shells.pop() {
            drop(b);
        }
    }

    /// Whether a freed block goes to the actor rather than the ready holder: too large to
    /// cache, or a large piece of a segment (coalesced at once).
    #[inline]
    pub(crate) fn wants_home(&self, block: &Block<R>) -> bool {
        block.size > self.max_cached_size || self.large_piece(block)
    }

    /// Whether the block is a large piece that fills less than 3/4 of its carved segment: on
    /// free it goes back into its segment at once, to coalesce with its neighbours. Larger
    /// pieces, pieces recalled to the range their class just gave back, and pieces of the
    /// expandable range up to `Carving::arena_cached_up_to` stay on the cached path like
    /// whole segments: a request of their class that comes back again and again is served
    /// without the pool actor.
    #[inline]
    pub(crate) fn large_piece(&self, block: &Block<R>) -> bool {
        block.size > self.absorb_above
            && !block.recalled
            && !(block.size <= self.arena_cached_up_to && block.in_arena())
            && block
                .segment
                .as_ref()
                .is_some_and(|s| (block.size as u128) * 4 < (s.size() as u128) * 3)
    }

    /// Gives a block's memory back to its source on this thread and keeps the books (stats,
    /// the budget, and the registry of segments). When the source refuses, the block is
    /// handed back, still reserved and still counted.
    ///
    /// A block carved out of a segment is not an allocation of its own: it lets go of its
    /// segment, which goes back with its last piece (see `segment`).
    pub(crate) fn free_block_now(&self, mut block: Box<Block<R>>) -> Result<(), Box<Block<R>>> {
        if let Some(segment) = block.segment.take() {
            block.freed = true;
            drop(segment);
            return Ok(());
        }
        match self.free_memory_now(block.memory) {
            Ok(()) => {
                block.freed = true;
                Ok(())
            }
            Err(_) => Err(block),
        }
    }
}
