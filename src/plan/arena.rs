//! The arena a session serves from, shared by the session and every buffer it lends (its
//! last owner gives it back to the pool), and the ticket a served buffer holds for its slot
//! of the plan: dropping the ticket records an event on each stream the buffer used and
//! sends the free to the session.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::actors::{Runtime, StreamId};

use crate::PinnedBuffer;

/// A free sent by a [`PlanBuffer`] with a slot in the plan.
pub(super) struct Freed<R: Runtime> {
    pub(super) number: usize,
    pub(super) lo: usize,
    pub(super) hi: usize,
    pub(super) streams: Vec<R::Stream>,
    /// One per stream; `None` where recording the event failed (never treated as done).
    pub(super) events: Vec<Option<R::Event>>,
}

/// Arena bytes freed while stream work on them may still run.
pub(super) struct Pending<R: Runtime> {
    pub(super) lo: usize,
    pub(super) hi: usize,
    pub(super) streams: Vec<R::Stream>,
    pub(super) events: Vec<Option<R::Event>>,
}

/// The arena, shared by the session and its served buffers; the last owner gives it back.
pub(super) struct Arena<R: Runtime> {
    pub(super) buf: PinnedBuffer<R>,
    pub(super) base: NonNull<u8>,
    pub(super) runtime: Arc<R>,
    pub(super) rx: flume::Receiver<Freed<R>>,
}

// SAFETY: `base` points into `buf`, which is `Send + Sync`; the arena itself never reads or
// writes through it (served buffers do, each within its own disjoint range).
unsafe impl<R: Runtime> Send for Arena<R> {}
// SAFETY: as above; shared access only copies the pointer.
unsafe impl<R: Runtime> Sync for Arena<R> {}

impl<R: Runtime> Arena<R> {
    pub(super) fn record(&mut self, streams: Vec<R::Stream>, events: Vec<Option<R::Event>>) {
        for stream in &streams {
            // Each was accepted by the runtime when it was recorded on a served buffer.
            let _ = self.buf.record_stream(stream);
        }
        release(&*self.runtime, events);
    }
}

impl<R: Runtime> Drop for Arena<R> {
    fn drop(&mut self) {
        // Frees sent after the session went away: their streams must order the reuse of
        // the arena's block, which goes back to the pool right after this.
        while let Ok(freed) = self.rx.try_recv() {
            self.record(freed.streams, freed.events);
        }
    }
}

pub(super) fn release<R: Runtime>(runtime: &R, events: Vec<Option<R::Event>>) {
    for event in events.into_iter().flatten() {
        runtime.release_event(event);
    }
}

/// Whether every event has completed (a failed record or query counts as not completed).
pub(super) fn completed<R: Runtime>(runtime: &R, events: &[Option<R::Event>]) -> bool {
    events.iter().all(|e| {
        e.as_ref()
            .is_some_and(|e| runtime.query_event(e) == Ok(true))
    })
}

/// A slot of the plan held by a buffer; dropping it sends the free to the session.
pub(super) struct Ticket<R: Runtime> {
    pub(super) number: usize,
    pub(super) lo: usize,
    pub(super) hi: usize,
    pub(super) streams: Vec<(StreamId, R::Stream)>,
    pub(super) tx: flume::Sender<Freed<R>>,
    pub(super) arena: Arc<Arena<R>>,
}

impl<R: Runtime> Drop for Ticket<R> {
    fn drop(&mut self) {
        let runtime = &self.arena.runtime;
        let streams: Vec<R::Stream> = self.streams.drain(..).map(|(_, s)| s).collect();
        let events = streams
            .iter()
            .map(|s| runtime.record_event(s).ok())
            .collect();
        // Sent before `arena` drops: the arena's last owner sees every free (the arena
        // holds a receiver, so the send cannot fail).
        let _ = self.tx.send(Freed {
            number: self.number,
            lo: self.lo,
            hi: self.hi,
            streams,
            events,
        });
    }
}
