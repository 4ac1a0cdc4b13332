//! Whether a freeing thread asks a stream that used a block if it has run all its work
//! ([`Runtime::stream_idle`]) before it records an event on it.
//!
//! A stream found idle needs no event: nothing it still has to run can touch the block, so
//! the block is reusable at its free, for one driver call (`cuStreamQuery`) instead of an
//! event's record at the free and query at the reuse. A stream still busy costs the call
//! for nothing, so a thread whose asks find streams busy asks ever more rarely (it lets 1,
//! 2, 4, ... up to 64 frees that record streams go by between asks), and one idle answer
//! makes it ask at every free again: where streams are busy at frees, about one query in 65
//! frees is wasted. The state is the thread's own (no shared line is written).
//!
//! An event the thread itself recorded could keep the stream busy until the GPU has
//! processed it, so that an ask at the free right after such a record says busy even on a
//! stream with no other work: a thread freeing in a tight loop, recording an event at each
//! free, would then stay on events (a record and a query per free instead of one ask). The
//! H200 hosts did not show it (an event recorded on an idle stream had completed by the
//! next query every time), but nothing promises it, so a busy answer also owes one more
//! ask: at the free after the thread next sees one of its parked blocks' events completed
//! ([`caught_up`]), when the stream has run at least up to that event. That extra ask's
//! busy answer owes none, so streams that stay busy cost at most two asks per run of
//! skipped frees.

use std::cell::Cell;

use crate::vocab::runtime::Runtime;

/// The longest run of frees that do not ask (a power of two).
const MAX_SKIP: u8 = 64;

/// A thread's asking state.
#[derive(Clone, Copy)]
struct Probe {
    /// Frees still to skip.
    skip: u8,
    /// The skip the last busy answer set (the next one doubles it).
    backoff: u8,
    owed: Owed,
}

/// The one more ask a busy answer owes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Owed {
    /// None owed (no busy answer since the last idle one, or the owed ask was made).
    Nothing,
    /// At the free after the thread sees an event completed ([`caught_up`]).
    OnceCaughtUp,
    /// At the next free (the thread has seen one).
    Now,
}

/// Asking at every free: at the start, and after an idle answer.
const EVERY_FREE: Probe = Probe {
    skip: 0,
    backoff: 0,
    owed: Owed::Nothing,
};

thread_local! {
    static PROBE: Cell<Probe> = const { Cell::new(EVERY_FREE) };
}

/// Whether `stream`, which is not capturing, has run all its work, asked or not as the
/// thread's recent answers say; `false` when not asked or when the runtime could not tell.
pub(crate) fn finished<R: Runtime>(rt: &R, stream: &R::Stream) -> bool {
    PROBE
        .try_with(|cell| {
            let mut p = cell.get();
            if p.skip > 0 {
                p.skip -= 1;
                cell.set(p);
                return false;
            }
            let idle = rt.stream_idle(stream).unwrap_or(false);
            cell.set(if idle {
                EVERY_FREE
            } else if p.owed == Owed::Now {
                // The owed ask found it busy too: the skipping goes on where it was.
                Probe {
                    skip: p.backoff,
                    backoff: p.backoff,
                    owed: Owed::Nothing,
                }
            } else {
                let next = p.backoff.saturating_mul(2).clamp(1, MAX_SKIP);
                Probe {
                    skip: next,
                    backoff: next,
                    owed: Owed::OnceCaughtUp,
                }
            });
            idle
        })
        .unwrap_or(false)
}

/// This thread saw the events of a block it takes back completed: the streams they were
/// recorded on have run at least that far, so an ask owed since a busy answer is made at
/// the thread's next free.
pub(crate) fn caught_up() {
    let _ = PROBE.try_with(|cell| {
        let mut p = cell.get();
        if p.owed == Owed::OnceCaughtUp {
            p.owed = Owed::Now;
            p.skip = 0;
            cell.set(p);
        }
    });
}

#[cfg(all(test, not(pinpool_loom)))]
mod tests {
    use super::*;
    use crate::vocab::runtime::{RuntimeError, StreamId};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A runtime whose one stream is idle or busy as the test says, counting the asks.
    #[derive(Default)]
    struct Probe {
        idle: AtomicBool,
        asked: AtomicUsize,
    }

    impl Runtime for Probe {
        type Stream = ();
        type Event = ();
        fn name(&self) -> &'static str {
            "probe"
        }
        fn new_stream(&self) -> Result<(), RuntimeError> {
            Ok(())
        }
        fn stream_id(&self, _: &()) -> StreamId {
            StreamId(1)
        }
        fn is_capturing(&self, _: &()) -> Result<bool, RuntimeError> {
            Ok(false)
        }
        fn record_event(&self, _: &()) -> Result<(), RuntimeError> {
            Ok(())
        }
        fn stream_idle(&self, _: &()) -> Result<bool, RuntimeError> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            Ok(self.idle.load(Ordering::Relaxed))
        }
        fn query_event(&self, _: &()) -> Result<bool, RuntimeError> {
            Ok(true)
        }
        fn release_event(&self, _: ()) {}
    }

    #[test]
    fn busy_streams_are_asked_ever_more_rarely_and_an_idle_answer_restores_every_ask() {
        // On a thread of its own: the state is per thread.
        std::thread::spawn(|| {
            let rt = Probe::default();
            rt.idle.store(true, Ordering::Relaxed);
            assert!((0..10).all(|_| finished(&rt, &())), "idle: asked each time");
            assert_eq!(rt.asked.load(Ordering::Relaxed), 10);

            rt.idle.store(false, Ordering::Relaxed);
            rt.asked.store(0, Ordering::Relaxed);
            assert!((0..10_000).all(|_| !finished(&rt, &())));
            let asked = rt.asked.load(Ordering::Relaxed);
            assert!(
                (10_000 / 65..10_000 / 32).contains(&asked),
                "busy: asked {asked} times in 10 000 frees"
            );

            // Skips run out within 64 frees; the first idle answer makes every free ask.
            rt.idle.store(true, Ordering::Relaxed);
            let first = (0..=64).position(|_| finished(&rt, &()));
            assert!(first.is_some(), "an idle stream is asked within 65 frees");
            rt.asked.store(0, Ordering::Relaxed);
            assert!((0..10).all(|_| finished(&rt, &())));
            assert_eq!(rt.asked.load(Ordering::Relaxed), 10);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_busy_answer_owes_one_ask_after_the_thread_sees_an_event_completed() {
        std::thread::spawn(|| {
            let rt = Probe::default();
            // Busy: the ask owes one more once an event is seen completed.
            assert!(!finished(&rt, &()));
            assert_eq!(rt.asked.load(Ordering::Relaxed), 1);
            rt.idle.store(true, Ordering::Relaxed);
            assert!(!finished(&rt, &()), "skipped: not asked");
            assert_eq!(rt.asked.load(Ordering::Relaxed), 1);
            // The busy stream's backoff grows to its cap; then the thread sees an event of
            // its own completed, and the next free asks at once, finding the stream idle.
            rt.idle.store(false, Ordering::Relaxed);
            for _ in 0..1_000 {
                finished(&rt, &());
            }
            rt.idle.store(true, Ordering::Relaxed);
            caught_up();
            let asked = rt.asked.load(Ordering::Relaxed);
            assert!(finished(&rt, &()), "the owed ask");
            assert_eq!(rt.asked.load(Ordering::Relaxed), asked + 1);
            assert!(finished(&rt, &()), "and every free asks again");
            // Nothing owed without a busy answer: seeing events complete changes nothing.
            caught_up();
            assert!(finished(&rt, &()));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_stream_that_stays_busy_costs_at_most_two_asks_per_run_of_skipped_frees() {
        std::thread::spawn(|| {
            let rt = Probe::default();
            // Busy throughout, the thread seeing an event of its own completed at every
            // request (a busy pipeline whose older work keeps finishing).
            for _ in 0..10_000 {
                finished(&rt, &());
                caught_up();
            }
            let asked = rt.asked.load(Ordering::Relaxed);
            assert!(
                (10_000 / 65..=2 * 10_000 / 32).contains(&asked),
                "asked {asked} times in 10 000 frees"
            );
            // The owed asks do not reset the backoff: the skips still reach 64.
            rt.asked.store(0, Ordering::Relaxed);
            for _ in 0..6_500 {
                finished(&rt, &());
                caught_up();
            }
            assert!(rt.asked.load(Ordering::Relaxed) <= 2 * 6_500 / 64 + 2);
        })
        .join()
        .unwrap();
    }
}
