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
//! The allocation calls decide only once the cached path has found nothing (it never blocks,
//! and the check would cost it a thread-local lookup on every call).

use std::cell::Cell;

use tokio::runtime::{Handle, RuntimeFlavor};

use crate::actors::error::Error;

thread_local! {
    /// Set while this thread runs code that is known not to be a runtime's executor thread.
    static OFF_RUNTIME: Cell<bool> = const { Cell::new(false) };
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
/// [`Error::WouldDeadlock`] naming `use_instead`, the async call to use from async code.
/// Cheap outside a runtime (one thread-local read); inside one it also reads the runtime's
/// flavour.
pub(crate) fn may_block(call: &'static str, use_instead: &'static str) -> Result<Blocking, Error> {
    let Ok(handle) = Handle::try_current() else {
        return Ok(Blocking::Plain);
    };
    match handle.runtime_flavor() {
        RuntimeFlavor::CurrentThread if !OFF_RUNTIME.with(Cell::get) => {
            Err(Error::WouldDeadlock { call, use_instead })
        }
        RuntimeFlavor::CurrentThread => Ok(Blocking::Plain),
        _ => Ok(Blocking::InPlace),
    }
}

/// Runs `wait`, a call that blocks on the driver or on a plain thread (never on a tokio
/// task, so it cannot deadlock): inside [`tokio::task::block_in_place`] on a multi-thread
/// runtime's thread, so that the worker's other tasks move on, plainly anywhere else (on a
/// current-thread runtime it stalls that runtime's tasks for the call's duration, as any
/// slow synchronous call does).
pub(crate) fn stall<T>(wait: impl FnOnce() -> T) -> T {
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
pub(crate) fn call<F: std::future::Future>(
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
