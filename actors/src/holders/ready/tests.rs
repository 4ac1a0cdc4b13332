//! Tests of the ready holder: slots, overflow queues, steals and drains.

use super::*;
use std::sync::Arc;

struct Item(usize, usize);

impl Slotted for Item {
    fn class(&self) -> usize {
        self.0
    }
    fn size(&self) -> usize {
        self.1
    }
}

fn class(index: usize) -> SizeClass {
    SizeClass {
        index,
        size: 1024 << index,
    }
}

fn put_on_a_thread_of_its_own(q: &Arc<ReadyHolder<Item>>, items: Vec<Item>) {
    let q = q.clone();
    std::thread::spawn(move || {
        for it in items {
            q.put(Box::new(it));
        }
    })
    .join()
    .unwrap();
}

#[test]
fn a_steal_looks_only_at_the_shards_that_held_its_class() {
    let q = Arc::new(ReadyHolder::new(4, 8));
    let me = q.my_shard();
    put_on_a_thread_of_its_own(&q, vec![Item(1, 2048), Item(2, 4096)]);
    let holders = |c: usize| q.holders[c].load(Ordering::Relaxed) & !(1 << me);
    let theirs = holders(1);
    assert_eq!(
        theirs.count_ones(),
        1,
        "the putting thread's shard held class 1"
    );
    assert_eq!(holders(2), theirs);
    assert_eq!(holders(3), 0, "nobody put class 3");
    assert_eq!(q.steal(me, class(1)).map(|b| b.size()), Some(2048));
    assert!(q.steal(me, class(1)).is_none());
    assert_eq!(holders(1), theirs, "marks are never cleared");
    assert_eq!(q.steal(me, class(2)).map(|b| b.size()), Some(4096));
    // Without its mark a block is not stolen, but a drain still finds it.
    put_on_a_thread_of_its_own(&q, vec![Item(3, 8192)]);
    q.holders[3].store(0, Ordering::Relaxed);
    assert!(q.steal(me, class(3)).is_none());
    assert_eq!(q.drain().len(), 1);
}

#[test]
fn a_steal_visits_every_other_stocked_shard_once_from_the_next_one_round() {
    for shards in [1, 8, 64, 128] {
        let q: ReadyHolder<Item> = ReadyHolder::new(4, shards);
        let stocked: Vec<usize> = [0, 1, 3, 6, 63, 64, 100, 127]
            .into_iter()
            .filter(|&s| s < shards)
            .collect();
        for &s in &stocked {
            q.stock(s);
        }
        for me in 0..shards {
            let want: Vec<usize> = (1..shards)
                .map(|i| (me + i) % shards)
                .filter(|s| stocked.contains(s))
                .collect();
            assert_eq!(
                q.others(me).collect::<Vec<_>>(),
                want,
                "{shards} shards, me {me}"
            );
        }
    }
}

#[test]
fn a_queue_found_empty_loses_its_mark_and_the_next_block_queued_marks_it_again() {
    let q = ReadyHolder::new(4, 8);
    let me = q.my_shard();
    q.put_queue(me, Box::new(Item(2, 4096)));
    assert!(q.shards[me].may_hold(2));
    assert_eq!(q.take_mine(class(2)).map(|b| b.size()), Some(4096));
    assert!(q.shards[me].may_hold(2), "a take leaves the mark");
    assert!(q.take_mine(class(2)).is_none());
    assert!(!q.shards[me].may_hold(2), "an empty look clears it");
    q.put_queue(me, Box::new(Item(2, 4096)));
    assert!(q.shards[me].may_hold(2));
    let mut drained = Vec::new();
    q.drain_mine(&mut drained);
    assert_eq!(drained.len(), 1, "a drain finds it by its mark");
}

#[test]
fn blocks_freed_by_threads_that_have_exited_are_found_by_steals_and_drains() {
    let q = Arc::new(ReadyHolder::new(4, 8));
    // Nothing held anywhere: nothing found, whichever shard is asked.
    assert!(q.take(class(1)).is_none());
    assert!(q.take_larger(0, 3).is_none());
    assert!(q.drain().is_empty());
    // One block of class 1 from another thread: this thread's request finds it.
    put_on_a_thread_of_its_own(&q, vec![Item(1, 2048)]);
    assert_eq!(q.take(class(1)).map(|b| b.size()), Some(2048));
    // A larger block from another thread serves a split.
    put_on_a_thread_of_its_own(&q, vec![Item(3, 8192)]);
    assert_eq!(q.take_larger(1, 3).map(|b| b.class()), Some(3));
    // Two of one class (a slot and a queue) and one of another: the drain takes all.
    put_on_a_thread_of_its_own(&q, vec![Item(2, 4096), Item(2, 4096), Item(0, 1024)]);
    let mut drained: Vec<usize> = q.drain().iter().map(|b| b.class()).collect();
    drained.sort_unstable();
    assert_eq!(drained, vec![0, 2, 2]);
    assert!(q.drain().is_empty());
}
