//! Models of the slot protocol under loom (`scripts/loom.sh`): threads stand at explicit
//! shards, as `ThreadSlot::current` would place them.

use super::*;
use loom::thread;
use std::sync::Arc;

struct Item {
    class: usize,
    size: usize,
    id: usize,
}

impl Slotted for Item {
    fn class(&self) -> usize {
        self.class
    }
    fn size(&self) -> usize {
        self.size
    }
}

const CLASS: SizeClass = SizeClass {
    index: 1,
    size: 1024,
};

fn item(id: usize) -> Box<Item> {
    Box::new(Item {
        class: CLASS.index,
        size: CLASS.size,
        id,
    })
}

fn owner(shard: usize) -> ThreadSlot {
    ThreadSlot { shard, owns: true }
}

/// Every item put is taken exactly once, by a thread or by the final drain.
fn assert_each_once(mut seen: Vec<usize>, left: Vec<Box<Item>>, n: usize) {
    seen.extend(left.into_iter().map(|b| b.id));
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..n).collect::<Vec<_>>(),
        "an item lost or handed out twice"
    );
}

#[test]
fn a_block_freed_into_a_slot_is_taken_once_by_its_owner_or_a_stealing_thread() {
    loom::model(|| {
        let q = Arc::new(ReadyHolder::<Item>::new(4, 2));
        q.put_as(owner(0), item(0));
        let q1 = q.clone();
        let stealer = thread::spawn(move || q1.steal(1, CLASS).map(|b| b.id));
        let mine = q.take_at(0, CLASS).map(|b| b.id);
        let stolen = stealer.join().unwrap();
        let seen: Vec<usize> = mine.into_iter().chain(stolen).collect();
        assert_each_once(seen, q.drain(), 1);
    });
}

#[test]
fn frees_and_takes_racing_on_two_shards_lose_nothing_and_share_nothing() {
    loom::model(|| {
        let q = Arc::new(ReadyHolder::<Item>::new(4, 2));
        let handles: Vec<_> = (0..2)
            .map(|t| {
                let q = q.clone();
                thread::spawn(move || {
                    // Two frees on this thread's shard: one fills the slot, one overflows.
                    q.put_as(owner(t), item(2 * t));
                    q.put_as(owner(t), item(2 * t + 1));
                    // A request: this shard, then the other's.
                    q.take_at(t, CLASS)
                        .or_else(|| q.steal(t, CLASS))
                        .map(|b| b.id)
                })
            })
            .collect();
        let seen: Vec<usize> = handles
            .into_iter()
            .filter_map(|h| h.join().unwrap())
            .collect();
        assert_each_once(seen, q.drain(), 4);
    });
}

#[test]
fn a_block_queued_while_its_queue_is_found_empty_is_taken_or_left_marked() {
    loom::model(|| {
        let q = Arc::new(ReadyHolder::<Item>::new(4, 2));
        // A block queued and taken: its queue's mark stays over the empty queue.
        q.put_queue(0, item(0));
        let first = q.take_queued(0, CLASS).map(|b| b.id);
        assert_eq!(first, Some(0));
        // The next look finds the queue empty and clears the mark, while another thread
        // queues a block: the look takes it, or the mark stays for the drain to find it.
        let q1 = q.clone();
        let putter = thread::spawn(move || q1.put_queue(0, item(1)));
        let taken = q.take_queued(0, CLASS).map(|b| b.id);
        putter.join().unwrap();
        assert_each_once(first.into_iter().chain(taken).collect(), q.drain(), 2);
    });
}

#[test]
fn a_thread_that_does_not_own_its_shard_never_overwrites_the_owners_slot() {
    loom::model(|| {
        let q = Arc::new(ReadyHolder::<Item>::new(4, 1));
        let q1 = q.clone();
        // Two threads on one shard (more threads than shards): only one owns it.
        let other = thread::spawn(move || {
            q1.put_as(
                ThreadSlot {
                    shard: 0,
                    owns: false,
                },
                item(1),
            )
        });
        q.put_as(owner(0), item(0));
        other.join().unwrap();
        let taken = q.take_at(0, CLASS).map(|b| b.id);
        assert_each_once(taken.into_iter().collect(), q.drain(), 2);
    });
}
