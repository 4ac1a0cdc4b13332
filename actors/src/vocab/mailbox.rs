//! An actor's mailbox as its senders reach it: a channel that refuses messages once the
//! actor is gone, and hands the gone actor every message sent before, so that none is
//! stranded unanswered. Every actor's inbound queue is one (the pool actors', the router's,
//! the event poller's, the history actor's).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Weak;

use flume::{Receiver, SendError, Sender};

/// An actor's mailbox: once the actor's task is gone (ended, or dropped with its runtime), it
/// refuses messages, as a disconnected channel would, and the gone actor collects every
/// message sent before — also those of senders that were in the middle of sending when it
/// went. (A flume channel stays connected while a sender lives — a pool's home, the engine —
/// and a message stranded in it would never be answered nor dropped: its sender would wait
/// for ever, and a block in it would hold its pool.)
pub(crate) struct Mailbox<M> {
    tx: Sender<M>,
    /// Senders between their look at `gone` and the end of their send.
    sending: AtomicUsize,
    gone: AtomicBool,
}

impl<M> Mailbox<M> {
    pub(crate) fn new(tx: Sender<M>) -> Self {
        Self {
            tx,
            sending: AtomicUsize::new(0),
            gone: AtomicBool::new(false),
        }
    }

    /// Sends `msg`, or hands it back once the actor is gone.
    pub(crate) fn send(&self, msg: M) -> Result<(), SendError<M>> {
        self.sending.fetch_add(1, SeqCst);
        // A sender that sees `gone` unset counted itself before the closing actor set it, so
        // the actor waits for its send below (see `close`).
        let res = if self.gone.load(SeqCst) {
            Err(SendError(msg))
        } else {
            self.tx.send(msg)
        };
        self.sending.fetch_sub(1, SeqCst);
        res
    }

    /// Whether the actor is gone (see [`Self::close`]).
    pub(crate) fn is_closed(&self) -> bool {
        self.gone.load(SeqCst)
    }

    /// The actor is gone: refuses every later message and returns every message sent
    /// before (from `rx`, the actor's receiver), waiting for senders caught mid-send.
    pub(crate) fn close(&self, rx: &Receiver<M>) -> Vec<M> {
        self.gone.store(true, SeqCst);
        let mut out = Vec::new();
        loop {
            out.extend(rx.try_iter());
            if self.sending.load(SeqCst) == 0 {
                out.extend(rx.try_iter());
                return out;
            }
            std::thread::yield_now();
        }
    }
}

/// Every message left for an actor that is going (ended, or dropped with its runtime): those
/// in `rx`, with its mailbox closed first where senders still hold it (see
/// [`Mailbox::close`]). Where none does, no message can come any more. The actor holds its
/// mailbox weakly, so that it sees its channel disconnect once every sender is gone.
pub(crate) fn leftovers<M>(mailbox: &Weak<Mailbox<M>>, rx: &Receiver<M>) -> Vec<M> {
    match mailbox.upgrade() {
        Some(m) => m.close(rx),
        None => rx.try_iter().collect(),
    }
}
