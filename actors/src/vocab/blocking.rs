//! Whether a `*_blocking` call may block the calling thread, and how.
//!
//! Owns that one decision for every blocking entry point of the engine and of the `pinpool`
//! crate (allocations, `empty_cache`, history, capture pools, plan sessions). A blocking call
//! waits for an actor's reply; the actors are tokio tasks, so a thread that blocks while it
//! is the one that would run them waits for ever. Keeps invariant 7: such a call is a typed
//! error ([`Error::WouldDeadlock`]) instead of a hang.
//!
//! The rule, decided from the calling thread alone:
//!
//! - Outside any tokio runtime context: block (what the calls are for).
//! - In a multi-thread runtime's context (a worker, `block_on`, or a blocking-pool thread):
//!   block inside [`tokio::task::block_in_place`], which hands the worker's other tasks to
//!   another thread first, so the actors keep running (on a thread that is no worker it only
//!   calls the closure).
//! - In a current-thread runtime's context: [`Error::WouldDeadlock`]. That thread runs the
//!   runtime's tasks (the `block_on` future, or a task it polls); blocking it starves every
//!   task of the runtime, the allocator's actors among them when they live there. tokio
//!   gives no way to tell that thread from one of the runtime's `spawn_blocking` threads,
//!   so those are refused too, except the observer's own threads (`off_runtime`): from a
//!   `spawn_blocking` closure on a current-thread runtime, use
//!   `Handle::current().block_on(pool.alloc(n))`.
//!
//! The allocation calls decide before anything else, the cached path included: a call is
//! refused or served whether or not its request would have missed, so that code tested with
//! a warm cache behaves the same with a cold one. The decision is cheap: outside a runtime
//! it is tokio's own thread-local look (no runtime handle is cloned); in a task, the
//! decision for that task is kept in a thread-local beside its id (a task stays on its
//! runtime), so only the first blocking call of each task on each thread looks at the
//! runtime.

use std::cell::Cell;

use tokio::runtime::{Handle, RuntimeFlavor};

use crate::vocab::error::Error;

thread_local! {
    /// Set while this thread runs code that is known not to be a runtime's executor thread.
    static OFF_RUNTIME: Cell<bool> = const { Cell::new(false) };
    /// The last decision made on this thread in a task, with that task's id.
    static DECIDED: Cell<Option<(tokio::task::Id, Decision)>> = const { Cell::new(None) };
}

/// What [`may_block`] decided for a thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    Block(Blocking),
    Refuse,
}

impl Decision {
    /// Decides from the runtime context this thread is in now.
    fn now() -> Self {
        let Ok(handle) = Handle::try_current() else {
            return Decision::Block(Blocking::Plain);
        };
        match handle.runtime_flavor() {
            RuntimeFlavor::CurrentThread if !OFF_RUNTIME.with(Cell::get) => Decision::Refuse,
            RuntimeFlavor::CurrentThread => Decision::Block(Blocking::Plain),
            _ => Decision::Block(Blocking::InPlace),
        }
    }
}

/// How a blocking call may block the calling thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Blocking {
    /// Block the thread as is: no runtime runs on it.
    Plain,
    /// Block inside [`tokio::task::block_in_place`]: a multi-thread runtime's thread.
    InPlace,
}

impl Blocking {
    /// Runs `wait` (which blocks the thread) in the way this calls for.
    pub(crate) fn run<T>(self, wait: impl FnOnce() -> T) -> T {
        match self {
            Blocking::Plain => wait(),
            Blocking::InPlace => tokio::task::block_in_place(wait),
        }
    }
}

/// Decides whether the blocking call `call` may block this thread: how, or
/// [`Error::WouldDeadlock`] naming `use_instead`, what to use instead. Cheap enough for the
/// cached path: outside a runtime, tokio's thread-local looks alone; in a task, a
/// thread-local read once the task's first call decided (see the module's header).
#[inline]
pub(crate) fn may_block(call: &'static str, use_instead: &'static str) -> Result<Blocking, Error> {
    let decision = match tokio::task::try_id() {
        None => Decision::now(),
        Some(task) => match DECIDED.with(Cell::get) {
            Some((seen, d)) if seen == task => d,
            _ => {
                let d = Decision::now();
                // A decision made on an observer's thread holds only while it is marked.
                if !OFF_RUNTIME.with(Cell::get) {
                    DECIDED.with(|c| c.set(Some((task, d))));
                }
                d
            }
        },
    };
    match decision {
        Decision::Block(how) => Ok(how),
        Decision::Refuse => Err(Error::WouldDeadlock { call, use_instead }),
    }
}

/// Runs `wait`, a call that blocks on the driver or on a plain thread (never on a tokio
/// task, so it cannot deadlock): inside [`tokio::task::block_in_place`] on a multi-thread
/// runtime's thread, so that the worker's other tasks move on, plainly anywhere else (on a
/// current-thread runtime it stalls that runtime's tasks for the call's duration, as any
/// slow synchronous call does).
pub fn stall<T>(wait: impl FnOnce() -> T) -> T {
    let blocking = match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::CurrentThread) | Err(_) => Blocking::Plain,
        Ok(_) => Blocking::InPlace,
    };
    blocking.run(wait)
}

/// Runs `f` with this thread marked as one that no runtime executes tasks on (the
/// observer's blocking threads, where callbacks may call the blocking API).
pub(crate) fn off_runtime<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            OFF_RUNTIME.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(OFF_RUNTIME.with(|c| c.replace(true)));
    f()
}

/// Drives `work` to its end on the calling thread, parking it while the future waits: for
/// futures whose waits block the thread themselves (they are ready when first polled), and
/// for any other that is woken from elsewhere. Never an executor's thread: the caller has
/// decided with [`may_block`] that the thread may block.
pub(crate) fn run_here<F: std::future::Future>(work: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut work = std::pin::pin!(work);
    loop {
        if let std::task::Poll::Ready(out) = work.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// The blocking call `call` (its name, and the async call to use instead) as a thin adapter
/// over its async form `work`: decided by `may_block`, then driven to its end on this
/// thread by `run_here`. For async calls that wait only on actors' replies (no tokio
/// timer or task of their own).
pub fn call<F: std::future::Future>(
    call: (&'static str, &'static str),
    work: F,
) -> Result<F::Output, Error> {
    let blocking = may_block(call.0, call.1)?;
    Ok(blocking.run(|| run_here(work)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_here_returns_what_a_ready_future_gives() {
        assert_eq!(run_here(async { 7 }), 7);
    }

    #[test]
    fn run_here_parks_until_a_future_is_woken_from_another_thread() {
        let (tx, rx) = flume::bounded::<u32>(1);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            tx.send(42).unwrap();
        });
        assert_eq!(run_here(async { rx.recv_async().await.unwrap() }), 42);
        sender.join().unwrap();
    }

    #[test]
    fn call_refuses_a_current_thread_runtimes_thread_and_runs_elsewhere() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let refused = rt.block_on(async { call(("x_blocking", "x().await"), async { 1 }) });
        assert!(
            matches!(refused, Err(Error::WouldDeadlock { .. })),
            "{refused:?}"
        );
        assert_eq!(call(("x_blocking", "x().await"), async { 1 }), Ok(1));
    }
}
