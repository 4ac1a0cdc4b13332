//! Ready blocks of a pool: the cached path (invariant 5).
//!
//! Each thread shard has, per size class, one *slot*: an atomic pointer that holds at most
//! one ready block. A free puts the block into the freeing thread's slot for its class when
//! the slot is empty (a load and a store, on a cache line only the thread that owns the shard
//! fills; other threads only empty it); a request takes it back with one swap. A slot already
//! full, or a shard the thread does not own, overflows into the shard's flume queue for the
//! class, and an empty slot and queue make the request look in the other shards' slots and
//! queues before it asks the pool actor. Slots are shared memory, not thread-locals: the pool actor drains them
//! when it empties the cache or shuts down, and a thread that exits leaves nothing behind.
//! Each shard marks the classes whose queue may hold a block, so that a drain (at a best-fit
//! miss, say) or a steal looks only at those queues, not at every class of every shard; and
//! each class marks the shards that ever held a block of it, so that a steal looks only at
//! those shards.
//!
//! The queues hold any [`Slotted`] item (the engine's blocks): this module knows their class
//! and size, nothing else.

use std::ptr;
use std::sync::atomic::Ordering;

use crate::vocab::loom::{AtomicPtr, AtomicU64, AtomicUsize};
use crate::vocab::policy::SizeClass;
use crate::vocab::shard::{CachePadded, ThreadSlot};
use shard::Shard;

mod shard;

/// What the ready holder need to know of what they hold.
pub(crate) trait Slotted: Send + 'static {
    /// Index of its size class.
    fn class(&self) -> usize;
    /// Bytes it holds.
    fn size(&self) -> usize;
}

/// Slots on cache lines of their own (16 pointers: 128 bytes).
const SLOTS_PER_LINE: usize = 16;
type SlotLine<B> = CachePadded<[AtomicPtr<B>; SLOTS_PER_LINE]>;

/// The ready blocks of one pool.
pub(crate) struct ReadyHolder<B> {
    /// `shards * lines_per_shard` lines; shard `s`, class `c` is
    /// `slots[s * lines_per_shard + c / 16][c % 16]`.
    slots: Box<[SlotLine<B>]>,
    lines_per_shard: usize,
    shards: Box<[Shard<B>]>,
    mask: usize,
    /// One bit per shard that has ever held a ready block (set before the block is
    /// published, never cleared): steals and drains skip the shards of threads that never
    /// freed into this pool, instead of reading two cache lines of each. On lines of their
    /// own: every put reads them.
    stocked: Box<[CachePadded<AtomicU64>]>,
    /// Per class, one bit per shard (pools of up to 64 shards; none with more) that has ever
    /// held a ready block of the class: set before the block is published (a read first),
    /// never cleared, like `stocked`. Steals look only at the shards that held blocks of
    /// their class, not at every shard that ever held any (threads that have exited or
    /// moved on to other sizes leave their shards stocked). Never cleared: a version whose
    /// steals cleared the bit of a shard they found empty made the word a line that
    /// stealing and freeing threads all write (16 threads freeing and taking one class fell
    /// from about 220 to 53–87 million pairs a second).
    holders: Box<[AtomicU64]>,
    /// Per shard, the large block its thread freed last since its last miss (see
    /// [`ReadyHolder::put_held`]).
    held: Box<[CachePadded<Held<B>>]>,
}

/// A shard's held large block and its size, on a line of its own: only the shard's thread
/// stores into it; others (a drain) only empty it.
struct Held<B> {
    size: AtomicUsize,
    block: AtomicPtr<B>,
}

fn empty_line<B>() -> SlotLine<B> {
    CachePadded(std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())))
}

impl<B: Slotted> ReadyHolder<B> {
    /// Queues for `classes` size classes in `shards` shards (a power of two).
    pub(crate) fn new(classes: usize, shards: usize) -> Self {
        debug_assert!(shards.is_power_of_two());
        let lines_per_shard = classes.div_ceil(SLOTS_PER_LINE).max(1);
        let slots = (0..shards * lines_per_shard)
            .map(|_| empty_line())
            .collect();
        let shards: Box<[_]> = (0..shards).map(|_| Shard::new(classes)).collect();
        let mask = shards.len() - 1;
        let stocked = (0..shards.len().div_ceil(64))
            .map(|_| CachePadded(AtomicU64::new(0)))
            .collect();
        let holders = if mask < 64 {
            (0..classes).map(|_| AtomicU64::new(0)).collect()
        } else {
            Box::default()
        };
        let held = (0..shards.len())
            .map(|_| {
                CachePadded(Held {
                    size: AtomicUsize::new(0),
                    block: AtomicPtr::new(ptr::null_mut()),
                })
            })
            .collect();
        Self {
            held,
            slots,
            lines_per_shard,
            shards,
            mask,
            stocked,
            holders,
        }
    }

    /// Shard `shard` holds (or is about to hold) a ready block. A load first: once set, the
    /// word is only read.
    #[inline]
    fn stock(&self, shard: usize) {
        let (word, bit) = (&self.stocked[shard / 64], 1u64 << (shard % 64));
        if word.load(Ordering::Relaxed) & bit == 0 {
            word.fetch_or(bit, Ordering::Release);
        }
    }

    /// Whether shard `shard` ever held a ready block.
    #[inline]
    fn ever_stocked(&self, shard: usize) -> bool {
        self.stocked[shard / 64].load(Ordering::Acquire) & (1u64 << (shard % 64)) != 0
    }

    /// The other shards than `me` that ever held a ready block, from `me + 1` round. Up to
    /// 64 shards (one word of marks, the default's cap), read once and walked bit by bit:
    /// a miss on a many-core host looks at the shards that held blocks, not at every
    /// shard's mark (the loop over 31 marks was the largest single cost of a miss in the
    /// mixed sizes loop on a 16-core host).
    fn others(&self, me: usize) -> impl Iterator<Item = usize> + '_ {
        self.others_where(me, u64::MAX)
    }

    /// [`Self::others`] that may hold a ready block of `class` (see `holders`).
    fn holding(&self, me: usize, class: usize) -> impl Iterator<Item = usize> + '_ {
        let hint = self
            .holders
            .get(class)
            .map_or(u64::MAX, |w| w.load(Ordering::Acquire));
        self.others_where(me, hint)
    }

    /// [`Self::others`] whose bit is set in `hint` (pools of up to 64 shards; every other
    /// stocked shard beyond).
    fn others_where(&self, me: usize, hint: u64) -> impl Iterator<Item = usize> + '_ {
        let n = self.shards.len();
        let (high, low, wide) = if n <= 64 {
            // `me < n <= 64`.
            let word = self.stocked[0].load(Ordering::Acquire) & hint;
            let high = word.checked_shr(me as u32 + 1).unwrap_or(0);
            (high, word & ((1u64 << me) - 1), 0..0)
        } else {
            (0, 0, 1..n)
        };
        Bits(high).map(move |b| b + me + 1).chain(Bits(low)).chain(
            wide.map(move |i| (me + i) & self.mask)
                .filter(|&s| self.ever_stocked(s)),
        )
    }

    /// Shard `shard` is about to hold a ready block of `class`. A read first: once set,
    /// the bit is only read.
    #[inline]
    fn hold(&self, shard: usize, class: usize) {
        if let Some(word) = self.holders.get(class) {
            let bit = 1u64 << shard;
            if word.load(Ordering::Relaxed) & bit == 0 {
                word.fetch_or(bit, Ordering::Release);
            }
        }
    }

    /// This thread's shard.
    #[inline]
    pub(crate) fn my_shard(&self) -> usize {
        ThreadSlot::current(self.mask).shard
    }

    #[inline]
    fn slot(&self, shard: usize, class: usize) -> &AtomicPtr<B> {
        &self.slots[shard * self.lines_per_shard + class / SLOTS_PER_LINE][class % SLOTS_PER_LINE]
    }

    /// Takes a ready block of `class` that holds `class.size` bytes: this thread's slot, then
    /// its queue, then the others'.
    #[inline]
    pub(crate) fn take(&self, class: SizeClass) -> Option<Box<B>> {
        self.take_at(self.my_shard(), class)
    }

    /// [`Self::take`] for the thread of shard `me`.
    #[inline]
    fn take_at(&self, me: usize, class: SizeClass) -> Option<Box<B>> {
        if let Some(b) = take_slot(self.slot(me, class.index)) {
            if let Some(b) = self.fitting(me, b, class) {
                return Some(b);
            }
        }
        self.take_slow(me, class)
    }

    #[cold]
    fn take_slow(&self, me: usize, class: SizeClass) -> Option<Box<B>> {
        self.take_queued(me, class)
            .or_else(|| self.steal(me, class))
    }

    /// This thread's slot and queue for `class`, without looking at other shards.
    #[inline]
    pub(crate) fn take_mine(&self, class: SizeClass) -> Option<Box<B>> {
        let me = self.my_shard();
        match take_slot(self.slot(me, class.index)) {
            Some(b) => self
                .fitting(me, b, class)
                .or_else(|| self.take_queued(me, class)),
            None => self.take_queued(me, class),
        }
    }

    #[cold]
    fn take_queued(&self, me: usize, class: SizeClass) -> Option<Box<B>> {
        let shard = &self.shards[me];
        // A queue whose bit is clear held nothing when the bit was read: no lock taken.
        if !shard.may_hold(class.index) {
            return None;
        }
        let b = shard.take_or_unmark(class.index)?;
        self.fitting(me, b, class)
    }

    /// A ready block of `class` (holding `class.size` bytes) from another thread's shard.
    #[cold]
    pub(crate) fn steal(&self, me: usize, class: SizeClass) -> Option<Box<B>> {
        let c = class.index;
        self.holding(me, c).find_map(|s| {
            let from_slot = take_slot(self.slot(s, c)).and_then(|b| self.fitting(s, b, class));
            from_slot.or_else(|| {
                let shard = &self.shards[s];
                if shard.may_hold(c) {
                    let b = shard.queues[c].take()?;
                    self.fitting(s, b, class)
                } else {
                    None
                }
            })
        })
    }

    /// The block in this thread's slot of the class above `class`, if nothing in this
    /// thread's shard is filed under the class below: its slot is empty and its queue
    /// unmarked. A block of the class below may hold `class.size` bytes (see
    /// [`Self::take_from_below`]) and is then the closer fit, so a request looks at it
    /// first whenever there may be one.
    #[inline]
    pub(crate) fn take_above_mine(&self, class: SizeClass) -> Option<Box<B>> {
        let me = self.my_shard();
        let above = class.index + 1;
        if above >= self.shards[me].queues.len() {
            return None;
        }
        if let Some(below) = class.index.checked_sub(1) {
            if !self.slot(me, below).load(Ordering::Relaxed).is_null()
                || self.shards[me].may_hold(below)
            {
                return None;
            }
        }
        take_slot(self.slot(me, above))
    }

    /// A ready block of the class below `class` in this thread's shard that holds
    /// `class.size` bytes: classes are buckets of sizes, and a block filed under the largest
    /// class it serves in full (the rest of a split) may still hold a request of the next.
    #[cold]
    pub(crate) fn take_from_below(&self, class: SizeClass) -> Option<Box<B>> {
        let below = SizeClass {
            index: class.index.checked_sub(1)?,
            size: class.size,
        };
        self.take_mine(below)
    }

    /// The ready block of the smallest class in `above + 1 ..= upto` (every block of those
    /// classes is larger than a request of class `above`): this thread's slots and queues
    /// first, then the other shards' queues, then their slots. For a request that will split
    /// it (see `Block::split_off`) rather than ask the pool actor.
    #[cold]
    pub(crate) fn take_larger(&self, above: usize, upto: usize) -> Option<Box<B>> {
        let me = self.my_shard();
        let classes = self.shards[me].queues.len();
        let upto = upto.min(classes.saturating_sub(1));
        let mine = &self.shards[me];
        for c in above + 1..=upto {
            if let Some(b) = take_slot(self.slot(me, c)) {
                return Some(b);
            }
            if mine.may_hold(c) {
                if let Some(b) = mine.queues[c].take() {
                    return Some(b);
                }
            }
        }
        self.others(me)
            .find_map(|s| {
                let shard = &self.shards[s];
                let mut from = above + 1;
                while let Some(c) = shard.first_marked(from, upto) {
                    if let Some(b) = shard.queues[c].take() {
                        return Some(b);
                    }
                    from = c + 1;
                }
                None
            })
            .or_else(|| {
                (above + 1..=upto)
                    .find_map(|c| self.holding(me, c).find_map(|s| take_slot(self.slot(s, c))))
            })
    }

    /// `block` when it holds the `class.size` bytes a request needs. A class may hold blocks
    /// of several sizes (policies whose classes are buckets of exact sizes); one too small
    /// goes back into `shard`'s queue (only a shard's owner fills its slots) and the request
    /// looks on.
    #[inline]
    fn fitting(&self, shard: usize, block: Box<B>, class: SizeClass) -> Option<Box<B>> {
        if block.size() >= class.size {
            Some(block)
        } else {
            self.put_queue(shard, block);
            None
        }
    }

    /// Puts a block that is ready for reuse into this thread's slot for its class, or its
    /// queue when the slot is full. Only the thread that owns a shard fills its slots, so an
    /// empty slot stays empty until that thread's own store (others only empty slots): a
    /// plain release store suffices.
    #[inline]
    pub(crate) fn put(&self, block: Box<B>) {
        self.put_as(ThreadSlot::current(self.mask), block)
    }

    /// [`Self::put`] for a thread standing at `me`.
    #[inline]
    fn put_as(&self, me: ThreadSlot, block: Box<B>) {
        let class = block.class();
        let slot = self.slot(me.shard, class);
        if me.owns && slot.load(Ordering::Relaxed).is_null() {
            self.stock(me.shard);
            self.hold(me.shard, class);
            slot.store(Box::into_raw(block), Ordering::Release);
            return;
        }
        self.put_queue(me.shard, block);
    }

    /// Holds a freed large block in this thread's held place until a request of exactly its
    /// size takes it back, or the thread's next miss sends it home (see
    /// [`Self::take_held_mine`]). Hands back the block held before, which goes home (only the
    /// last block freed is held), or this one when the thread does not own its shard.
    #[inline]
    pub(crate) fn put_held(&self, block: Box<B>) -> Option<Box<B>> {
        let me = ThreadSlot::current(self.mask);
        if !me.owns {
            return Some(block);
        }
        let held = &self.held[me.shard];
        let before = take_slot(&held.0.block);
        self.stock(me.shard);
        // The size first: a taker that reads it and then finds the block takes this one.
        held.0.size.store(block.size(), Ordering::Relaxed);
        held.0.block.store(Box::into_raw(block), Ordering::Release);
        before
    }

    /// The block this thread holds (see [`Self::put_held`]) if it has exactly `size` bytes.
    #[inline]
    pub(crate) fn take_held(&self, size: usize) -> Option<Box<B>> {
        let me = ThreadSlot::current(self.mask);
        if !me.owns {
            return None;
        }
        let held = &self.held[me.shard].0;
        if held.size.load(Ordering::Relaxed) != size {
            return None;
        }
        // Only this thread stores into its place; others only empty it, so a block found
        // now is the one stored after that size.
        take_slot(&held.block)
    }

    /// Takes the large block this thread holds (see [`Self::put_held`]).
    #[cold]
    pub(crate) fn take_held_mine(&self, out: &mut Vec<Box<B>>) {
        let me = ThreadSlot::current(self.mask);
        if me.owns {
            out.extend(take_slot(&self.held[me.shard].0.block));
        }
    }

    /// Puts a ready block into `shard`'s queue for its class.
    #[cold]
    pub(crate) fn put_queue(&self, shard: usize, block: Box<B>) {
        let class = block.class();
        self.stock(shard);
        self.hold(shard, class);
        // The receiver lives beside the sender, so the send cannot fail.
        let shard = &self.shards[shard];
        shard.queues[class].put(block);
        shard.mark(class);
    }

    /// Takes every ready block out of every slot, held place and queue.
    pub(crate) fn drain(&self) -> Vec<Box<B>> {
        let mut out = Vec::new();
        for s in (0..self.shards.len()).filter(|&s| self.ever_stocked(s)) {
            out.extend(take_slot(&self.held[s].0.block));
            self.drain_shard(s, &mut out);
        }
        out
    }

    /// Takes every ready block out of this thread's shard: its slots and its queues.
    pub(crate) fn drain_mine(&self, out: &mut Vec<Box<B>>) {
        self.drain_shard(self.my_shard(), out);
    }

    /// Takes every ready block out of shard `s`: its slots and its queues.
    fn drain_shard(&self, s: usize, out: &mut Vec<Box<B>>) {
        let base = s * self.lines_per_shard;
        for line in &self.slots[base..base + self.lines_per_shard] {
            out.extend(line.iter().filter_map(take_slot));
        }
        self.shards[s].drain_into(out);
    }

    /// The slot line that holds the slots of `class` in each shard.
    pub(crate) const fn line_of(class: usize) -> usize {
        class / SLOTS_PER_LINE
    }

    /// Takes every queued block, and every block in a slot on one of the lines set in
    /// `lines` (bit `l % 64` of word `l / 64` for line `l`; see [`Self::line_of`]), in every
    /// shard. A caller that knows which classes can hold blocks looks at those lines only.
    pub(crate) fn drain_lines(&self, lines: &[u64]) -> Vec<Box<B>> {
        let mut out = Vec::new();
        for (s, shard) in self.shards.iter().enumerate() {
            if !self.ever_stocked(s) {
                continue;
            }
            let base = s * self.lines_per_shard;
            for (w, &word) in lines.iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let line = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    if line < self.lines_per_shard {
                        out.extend(self.slots[base + line].iter().filter_map(take_slot));
                    }
                }
            }
            shard.drain_into(&mut out);
        }
        out
    }

    /// Counts the ready blocks and their bytes without taking them.
    pub(crate) fn census(&self) -> (usize, usize) {
        let blocks = self.drain();
        let n = blocks.len();
        let bytes = blocks.iter().map(|b| b.size()).sum();
        for b in blocks {
            self.put(b);
        }
        (n, bytes)
    }
}

/// The positions of the bits set in a word, lowest first.
struct Bits(u64);

impl Iterator for Bits {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(b)
    }
}

/// Takes the block out of a slot, if any.
#[inline]
pub(crate) fn take_slot<B>(slot: &AtomicPtr<B>) -> Option<Box<B>> {
    if slot.load(Ordering::Relaxed).is_null() {
        return None;
    }
    let p = slot.swap(ptr::null_mut(), Ordering::Acquire);
    if p.is_null() {
        None
    } else {
        // SAFETY: every non-null pointer stored in a slot comes from `Box::into_raw` and is
        // published with a release store; the acquiring swap removed it, so this is its only
        // owner.
        Some(unsafe { Box::from_raw(p) })
    }
}

impl<B> Drop for ReadyHolder<B> {
    fn drop(&mut self) {
        // Every block holds its pool alive, so the slots are empty by now; should one not
        // be, dropping the block sends it home (or frees it when home is gone).
        for line in self.slots.iter() {
            for s in line.iter() {
                drop(take_slot(s));
            }
        }
        for h in self.held.iter() {
            drop(take_slot(&h.0.block));
        }
    }
}

#[cfg(all(test, not(pinpool_loom)))]
mod tests;

#[cfg(all(test, pinpool_loom))]
mod loom_models;
