//! The event-poller actor: owns every block that waits for GPU work to finish.
//!
//! A freed block that streams used arrives with one event per stream. The poller queries
//! all pending events in batches and sends each block whose events have all completed back to
//! its pool, so one slow event never holds up blocks behind it (invariant 1). It sleeps on its
//! mailbox when nothing is pending, and polls with a growing interval otherwise, so it never
//! burns a core. A `Flush` makes it poll at once (a pool about to take fresh memory uses it:
//! invariant 3).

use std::sync::{Arc, Weak};
use std::time::Duration;

use flume::Receiver;

use crate::blocks::block::Block;
use crate::books::messages::PollerMsg;
use crate::holders::parked::Parked;
use crate::vocab::mailbox::{leftovers, Mailbox};
use crate::vocab::runtime::Runtime;
use crate::vocab::spawn::spawn_named;

/// Shortest and longest wait between polls while blocks are pending.
const MIN_INTERVAL: Duration = Duration::from_micros(50);
const MAX_INTERVAL: Duration = Duration::from_millis(2);

/// Starts the poller and returns its mailbox; it stops once every holder of its mailbox is
/// gone.
pub(crate) fn start_poller<R: Runtime>(
    handle: &tokio::runtime::Handle,
) -> Arc<Mailbox<PollerMsg<Block<R>>>> {
    let (tx, rx) = flume::unbounded();
    let mailbox = Arc::new(Mailbox::new(tx));
    let actor = Poller {
        watched: Vec::new(),
        mailbox: Arc::downgrade(&mailbox),
        rx,
        pending: Vec::new(),
    };
    spawn_named("pinpool::event_poller", handle, actor.run());
    mailbox
}

struct Poller<R: Runtime> {
    /// Parked slots to sweep on each poll, while blocks are parked in them.
    watched: Vec<Arc<Parked<Block<R>>>>,
    mailbox: Weak<Mailbox<PollerMsg<Block<R>>>>,
    rx: Receiver<PollerMsg<Block<R>>>,
    pending: Vec<Box<Block<R>>>,
}

impl<R: Runtime> Drop for Poller<R> {
    /// The poller stops when every pool is gone, or is dropped with its tokio runtime. A
    /// block whose events have completed by now is freed here; one still used by device work
    /// is leaked (a piece of a segment leaks its segment): freeing it could let the device
    /// write into memory given to someone else.
    ///
    /// Neither goes back through its pool: the pool actors are being dropped with the same
    /// runtime, maybe at this moment on another thread, and a block handed to a pool whose
    /// actor has just drained its queues would be stranded there, holding its pool alive.
    fn drop(&mut self) {
        // Blocks still in the mailbox would keep their pools (and this mailbox) alive forever.
        // So would blocks parked in the slots it watches.
        for msg in leftovers(&self.mailbox, &self.rx) {
            match msg {
                PollerMsg::Wait(block) => self.pending.push(block),
                PollerMsg::Watch(parked) => self.watched.push(parked),
                _ => {}
            }
        }
        for parked in self.watched.drain(..) {
            self.pending.extend(parked.take_all());
        }
        for mut block in self.pending.drain(..) {
            if block.events_completed() {
                block.leave_waiting();
            } else {
                block.events.get_mut().clear();
            }
            block.orphaned();
        }
    }
}

impl<R: Runtime> Poller<R> {
    async fn run(mut self) {
        let mut interval = MIN_INTERVAL;
        loop {
            if self.pending.is_empty() && self.watched.is_empty() {
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

    fn handle(&mut self, msg: PollerMsg<Block<R>>) {
        match msg {
            PollerMsg::Wait(block) => self.pending.push(block),
            PollerMsg::Watch(parked) => {
                if !self.watched.iter().any(|p| Arc::ptr_eq(p, &parked)) {
                    self.watched.push(parked);
                }
            }
            PollerMsg::Flush { reply } => {
                self.poll();
                let _ = reply.send(());
            }
            PollerMsg::Pending { reply } => {
                // Parked blocks are pending too: take them in to list them.
                for parked in &self.watched {
                    self.pending.extend(parked.take_all());
                }
                let _ = reply.send(
                    self.pending
                        .iter()
                        .map(|b| b.memory.ptr.as_ptr() as usize)
                        .collect(),
                );
            }
        }
    }

    /// Queries every pending block's events once; returns how many blocks went home.
    fn poll(&mut self) -> usize {
        let mut returned = 0;
        let mut w = 0;
        while w < self.watched.len() {
            let (seen, home) = self.watched[w].sweep(&mut self.pending);
            returned += home;
            if seen == 0 && !self.watched[w].unwatch_if_empty() {
                self.watched.swap_remove(w);
            } else {
                w += 1;
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].events_completed() {
                let b = self.pending.swap_remove(i);
                b.returned_from_waiting();
                returned += 1;
            } else {
                i += 1;
            }
        }
        returned
    }
}
