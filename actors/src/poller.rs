//! The event-poller actor: owns every block that waits for GPU work to finish.
//!
//! A freed block that streams used arrives with one event per stream. The poller queries
//! all pending events in batches and sends each block whose events have all completed back to
//! its pool, so one slow event never holds up blocks behind it (invariant 1). It sleeps on its
//! mailbox when nothing is pending, and polls with a growing interval otherwise, so it never
//! burns a core. A `Flush` makes it poll at once (a pool about to take fresh memory uses it:
//! invariant 3).

use std::time::Duration;

use flume::Receiver;

use crate::block::Block;
use crate::pool::Reply;
use crate::runtime::Runtime;
use crate::spawn::spawn_named;

/// Messages the poller answers.
pub(crate) enum PollerMsg<R: Runtime> {
    /// A freed block and the events recorded for it.
    Wait {
        block: Box<Block<R>>,
        events: Vec<R::Event>,
    },
    /// Poll now, then reply.
    Flush { reply: Reply<()> },
    /// The addresses of the blocks pending (for snapshots).
    Pending { reply: Reply<Vec<usize>> },
}

struct Pending<R: Runtime> {
    block: Box<Block<R>>,
    events: Vec<R::Event>,
}

/// Shortest and longest wait between polls while blocks are pending.
const MIN_INTERVAL: Duration = Duration::from_micros(50);
const MAX_INTERVAL: Duration = Duration::from_millis(2);

/// Starts the poller; it stops once every sender of its mailbox is gone.
pub(crate) fn start_poller<R: Runtime>(
    runtime: std::sync::Arc<R>,
    rx: Receiver<PollerMsg<R>>,
    handle: &tokio::runtime::Handle,
) {
    let actor = Poller {
        runtime,
        rx,
        pending: Vec::new(),
    };
    spawn_named("pinpool::event_poller", handle, actor.run());
}

struct Poller<R: Runtime> {
    runtime: std::sync::Arc<R>,
    rx: Receiver<PollerMsg<R>>,
    pending: Vec<Pending<R>>,
}

impl<R: Runtime> Drop for Poller<R> {
    /// The poller stops when every pool is gone, or is dropped with its tokio runtime. A
    /// block whose events have completed by now goes home; one still used by device work
    /// is leaked: freeing it could let the device write into memory given to someone else.
    fn drop(&mut self) {
        // Blocks still in the mailbox would keep their pools (and this mailbox) alive forever.
        while let Ok(msg) = self.rx.try_recv() {
            if let PollerMsg::Wait { block, events } = msg {
                self.pending.push(Pending { block, events });
            }
        }
        self.poll();
        for p in self.pending.drain(..) {
            tracing::warn!(
                bytes = p.block.memory.size,
                "event poller stopped with a block still used by device work; leaked"
            );
            let mut block = p.block;
            block.freed = true;
            drop(p.events);
        }
    }
}

impl<R: Runtime> Poller<R> {
    async fn run(mut self) {
        let mut interval = MIN_INTERVAL;
        loop {
            if self.pending.is_empty() {
                match self.rx.recv_async().await {
                    Ok(msg) => self.handle(msg),
                    Err(_) => break,
                }
                interval = MIN_INTERVAL;
                continue;
            }
            tokio::select! {
                msg = self.rx.recv_async() => match msg {
                    Ok(msg) => self.handle(msg),
                    Err(_) => break,
                },
                _ = tokio::time::sleep(interval) => {
                    let returned = self.poll();
                    interval = if returned > 0 { MIN_INTERVAL } else { (interval * 2).min(MAX_INTERVAL) };
                }
            }
        }
        tracing::debug!("event poller stopped");
    }

    fn handle(&mut self, msg: PollerMsg<R>) {
        match msg {
            PollerMsg::Wait { block, events } => self.pending.push(Pending { block, events }),
            PollerMsg::Flush { reply } => {
                self.poll();
                let _ = reply.send(());
            }
            PollerMsg::Pending { reply } => {
                let _ = reply.send(
                    self.pending
                        .iter()
                        .map(|p| p.block.memory.ptr.as_ptr() as usize)
                        .collect(),
                );
            }
        }
    }

    /// Queries every pending event once; returns how many blocks went home.
    fn poll(&mut self) -> usize {
        let rt = &*self.runtime;
        let mut returned = 0;
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let mut j = 0;
            while j < p.events.len() {
                match rt.query_event(&p.events[j]) {
                    Ok(true) => {
                        let e = p.events.swap_remove(j);
                        rt.release_event(e);
                    }
                    Ok(false) => j += 1,
                    Err(e) => {
                        tracing::warn!(error = %e, "event query failed; will ask again");
                        j += 1;
                    }
                }
            }
            if p.events.is_empty() {
                let p = self.pending.swap_remove(i);
                p.block.returned_from_waiting();
                returned += 1;
            } else {
                i += 1;
            }
        }
        returned
    }
}
