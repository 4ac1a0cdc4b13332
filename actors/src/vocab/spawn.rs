//! Spawning actors as named tokio tasks, so that tokio-console shows them by name: on a
//! given runtime, or on a runtime of their own, on a thread of their own (the pool actors,
//! which poll their mailbox between requests without holding up anyone else's tasks).
//!
//! Task names need `tokio::task::Builder`, which exists only under `--cfg tokio_unstable`;
//! without it, actors are plain `spawn`ed tasks.

use std::future::Future;

/// Runs `fut` as a task named `name` on a single-threaded runtime of its own, on a thread of
/// its own, until it ends or `handle`'s runtime shuts down (then the task is dropped, as a
/// task of that runtime would be, before that runtime's shutdown ends, and the thread ends);
/// where no thread or runtime can be made, on `handle` instead. The task's timers and
/// blocking work use its own runtime.
pub(crate) fn spawn_on_own_thread<F>(name: &str, handle: &tokio::runtime::Handle, fut: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .thread_name("pinpool-blocking")
        .build();
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            tracing::warn!(error = %e, task = name, "no runtime of its own; on the caller's");
            spawn_named(name, handle, fut);
            return;
        }
    };
    // A task of `handle`'s runtime holds the tie until the actor is done: dropped with that
    // runtime, it tells the actor's thread to drop the actor too, and waits for it.
    let (alive, gone) = tokio::sync::oneshot::channel::<()>();
    let (done, finished) = tokio::sync::oneshot::channel::<()>();
    let (dropped, ended) = std::sync::mpsc::channel::<()>();
    // The future moves to the thread through a one-shot hand-over, so that it is still
    // here to spawn on `handle` should the thread not start.
    let (tx, rx) = std::sync::mpsc::sync_channel::<F>(1);
    let task = name.to_string();
    let started = std::thread::Builder::new()
        .name(thread_name(name))
        .spawn(move || {
            let Ok(fut) = rx.recv() else {
                return;
            };
            runtime.block_on(async move {
                let h = tokio::runtime::Handle::current();
                if let Some(join) = spawn_named(&task, &h, fut) {
                    tokio::select! {
                        _ = join => {}
                        _ = gone => {}
                    }
                }
            });
            // Drops the actor's task, if it still runs, with its runtime.
            drop(runtime);
            let _ = dropped.send(());
            let _ = done.send(());
        });
    match started {
        Ok(_) => {
            handle.spawn(async move {
                let _tie = Tie {
                    alive: Some(alive),
                    ended,
                };
                let _ = finished.await;
            });
            let _ = tx.send(fut);
        }
        Err(e) => {
            tracing::warn!(error = %e, task = name, "no thread of its own; on the caller's runtime");
            spawn_named(name, handle, fut);
        }
    }
}

/// The longest a runtime's shutdown waits for an actor's thread to drop the actor.
const TEARDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Held by a task of the runtime an actor belongs to. Dropped (with that runtime, or once
/// the actor ended), it tells the actor's thread to drop the actor and waits until it has:
/// once the runtime's shutdown is over, so is the actor, as if it had been that runtime's
/// task (a buffer dropped afterwards goes back to the memory source on the spot).
struct Tie {
    alive: Option<tokio::sync::oneshot::Sender<()>>,
    ended: std::sync::mpsc::Receiver<()>,
}

impl Drop for Tie {
    fn drop(&mut self) {
        drop(self.alive.take());
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
            self.ended.recv_timeout(TEARDOWN_WAIT)
        {
            tracing::warn!("an actor's thread did not end with its runtime");
        }
    }
}

/// A thread name from a task name (threads' names are cut at 15 bytes on Linux): the part
/// in parentheses, after `pinpool-`.
fn thread_name(task: &str) -> String {
    let inner = task
        .split_once('(')
        .map_or(task, |(_, rest)| rest.trim_end_matches(')'));
    format!("pinpool-{inner}")
}

/// Spawns `fut` on `handle`, named `name` where the build supports task names; its join
/// handle, if it could be spawned.
pub(crate) fn spawn_named<F>(
    name: &str,
    handle: &tokio::runtime::Handle,
    fut: F,
) -> Option<tokio::task::JoinHandle<()>>
where
    F: Future<Output = ()> + Send + 'static,
{
    #[cfg(tokio_unstable)]
    {
        match tokio::task::Builder::new().name(name).spawn_on(fut, handle) {
            Ok(join) => Some(join),
            Err(e) => {
                tracing::error!(error = %e, task = name, "could not spawn actor");
                None
            }
        }
    }
    #[cfg(not(tokio_unstable))]
    {
        let _ = name;
        Some(handle.spawn(fut))
    }
}
