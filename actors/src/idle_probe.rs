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

use std::cell::Cell;

use crate::runtime::Runtime;

/// The longest run of frees that do not ask (a power of two).
const MAX_SKIP: u8 = 64;

thread_local! {
    /// (frees still to skip, the skip after the next busy answer)
    static PROBE: Cell<(u8, u8)> = const { Cell::new((0, 0)) };
}

/// Whether `stream`, which is not capturing, has run all its work, asked or not as the
/// thread's recent answers say; `false` when not asked or when the runtime could not tell.
pub(crate) fn finished<R: Runtime>(rt: &R, stream: &R::Stream) -> bool {
    PROBE
        .try_with(|probe| {
            let (skip, backoff) = probe.get();
            if skip > 0 {
                probe.set((skip - 1, backoff));
                return false;
            }
            let idle = rt.stream_idle(stream).unwrap_or(false);
            if idle {
                probe.set((0, 0));
            } else {
                let next = backoff.saturating_mul(2).clamp(1, MAX_SKIP);
                probe.set((next, next));
            }
            idle
        })
        .unwrap_or(false)
}

#[cfg(all(test, not(pinpool_loom)))]
mod tests {
    use super::*;
    use crate::runtime::{RuntimeError, StreamId};
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
}
