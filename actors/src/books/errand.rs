//! Errands: calls into the memory source that a pool actor hands to the thread waiting for
//! its reply, instead of to a blocking thread of the runtime (invariant 6 either way: never on
//! the executor).
//!
//! A thread blocked in `alloc_blocking` on a miss that needs fresh memory has nothing to do
//! until the actor replies, and it is awake: it has just run the request and is spinning on the
//! reply. A blocking thread of the runtime was asleep, and the driver's calls run several times
//! slower on a thread that slept just before (BENCHMARKS.md, "Fresh device memory: where the
//! time goes"). So the actor sends the work through the reply channel, the requester runs it
//! and goes on waiting, and the actor awaits the work's own result as it awaited the blocking
//! thread's.
//!
//! Nothing is lost when nobody runs it: an errand dropped unrun (the requester gave up
//! waiting, or never runs errands) runs on a blocking thread of the runtime it came from,
//! and work the runtime refuses to run (it is shutting down: `spawn_blocking` drops the
//! closure at once) runs where it was dropped ([`spawn_or_run`]). Frees, above all, must run:
//! a block whose free is dropped goes back to its pool, which would try again for ever.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Work for a thread that may block.
type Work = Box<dyn FnOnce() + Send>;

/// Work handed to a waiting thread; run there, or on a blocking thread once dropped unrun.
pub(crate) struct Errand {
    work: Option<Work>,
    handle: tokio::runtime::Handle,
}

impl Errand {
    /// `work`, falling back to the blocking threads of the runtime behind `handle`.
    pub(crate) fn new(work: Work, handle: tokio::runtime::Handle) -> Self {
        Self {
            work: Some(work),
            handle,
        }
    }

    /// Runs the work on this thread. A panic in it is caught: the work's result channel is
    /// dropped with it, which tells the actor the call failed.
    pub(crate) fn run(mut self) {
        if let Some(work) = self.work.take() {
            let _ = catch_unwind(AssertUnwindSafe(work));
        }
    }
}

impl Drop for Errand {
    fn drop(&mut self) {
        if let Some(work) = self.work.take() {
            spawn_or_run(&self.handle, work);
        }
    }
}

/// Runs `work` on a blocking thread of the runtime behind `handle`, or here when that runtime
/// is shutting down and refuses it.
pub(crate) fn spawn_or_run(handle: &tokio::runtime::Handle, work: impl FnOnce() + Send + 'static) {
    let work = MustRun(Some(work));
    // Run by the blocking thread (the closure drops it), or where the refused closure is
    // dropped.
    drop(handle.spawn_blocking(move || drop(work)));
}

/// Work that runs when dropped.
struct MustRun<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Drop for MustRun<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap()
    }

    #[test]
    fn a_run_errand_runs_on_the_thread_that_runs_it() {
        let rt = runtime();
        let (tx, rx) = flume::bounded(1);
        let work = Box::new(move || tx.send(std::thread::current().id()).unwrap());
        Errand::new(work, rt.handle().clone()).run();
        assert_eq!(rx.recv().unwrap(), std::thread::current().id());
    }

    #[test]
    fn an_errand_dropped_unrun_runs_on_a_blocking_thread_of_its_runtime() {
        let rt = runtime();
        let (tx, rx) = flume::bounded(1);
        let work = Box::new(move || tx.send(std::thread::current().id()).unwrap());
        drop(Errand::new(work, rt.handle().clone()));
        let ran_on = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the dropped errand never ran");
        assert_ne!(ran_on, std::thread::current().id());
    }

    #[test]
    fn work_a_shut_down_runtime_refuses_runs_where_it_was_handed_over() {
        let rt = runtime();
        let handle = rt.handle().clone();
        rt.shutdown_background();
        let (tx, rx) = flume::bounded(1);
        spawn_or_run(&handle, move || {
            tx.send(std::thread::current().id()).unwrap()
        });
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(10)),
            Ok(std::thread::current().id())
        );
    }

    #[test]
    fn a_panicking_errand_does_not_unwind_into_the_thread_that_runs_it() {
        let rt = runtime();
        let (tx, rx) = flume::bounded::<()>(1);
        let work = Box::new(move || {
            let _keep = tx;
            panic!("the memory source failed");
        });
        Errand::new(work, rt.handle().clone()).run();
        assert!(
            rx.recv().is_err(),
            "the result channel closes with the work"
        );
    }
}
