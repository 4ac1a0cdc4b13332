//! Events: owns `SimEvent` and the completion state that its marker operation shares with
//! the stream worker.
//!
//! An event is a marker op in its stream's queue carrying an `Arc<EventState>`; the worker
//! sets `done` when it reaches the marker, so an event completes only after every operation
//! enqueued before it has run. An event recorded during capture is a node of the graph
//! instead: it never completes, and querying it invalidates the capture (as in CUDA).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use crate::actors::StreamId;

use super::error::SimError;
use super::graph::CaptureState;

/// The state a marker op shares with the event handle.
pub(crate) struct EventState {
    done: AtomicBool,
    stream: StreamId,
    /// The capture (and its generation) this event was recorded into, if any. Weak: the
    /// capture's own channel holds this state, and a strong link would be a cycle.
    captured: Option<(Weak<CaptureState>, u64)>,
}

impl EventState {
    pub(crate) fn new(stream: StreamId, captured: Option<(Weak<CaptureState>, u64)>) -> Self {
        Self {
            done: AtomicBool::new(false),
            stream,
            captured,
        }
    }

    /// Whether the worker has reached the marker.
    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Called by the worker when it reaches the marker (never for captured markers).
    pub(crate) fn complete(&self) {
        if self.captured.is_none() {
            self.done.store(true, Ordering::Release);
        }
    }
}

/// An event recorded on a [`SimStream`](super::SimStream) by `Runtime::record_event`.
///
/// Not `Clone`: it is handed back exactly once through `Runtime::release_event`.
///
/// ```
/// use pinpool::sim::SimRuntime;
/// use pinpool::Runtime;
///
/// let sim = SimRuntime::new();
/// let stream = sim.new_stream()?;
/// let hold = stream.hold();
/// let event = sim.record_event(&stream).unwrap();
/// assert_eq!(sim.query_event(&event), Ok(false));
/// hold.release();
/// stream.synchronize().unwrap();
/// assert_eq!(sim.query_event(&event), Ok(true));
/// sim.release_event(event);
/// assert_eq!(sim.events_released(), 1);
/// # Ok::<(), pinpool::RuntimeError>(())
/// ```
pub struct SimEvent {
    pub(crate) state: Arc<EventState>,
}

impl SimEvent {
    /// The stream it was recorded on.
    pub fn stream_id(&self) -> StreamId {
        self.state.stream
    }

    /// Whether it was recorded while its stream was capturing.
    pub fn was_captured(&self) -> bool {
        self.state.captured.is_some()
    }

    /// Whether the worker has reached it; captured events are an error, and the query
    /// invalidates their capture.
    pub(crate) fn query(&self) -> Result<bool, SimError> {
        match &self.state.captured {
            Some((capture, generation)) => {
                if let Some(capture) = capture.upgrade() {
                    capture.invalidate(*generation);
                }
                Err(SimError::CapturedEventQueried {
                    stream: self.state.stream.0,
                })
            }
            None => Ok(self.state.done.load(Ordering::Acquire)),
        }
    }
}

impl std::fmt::Debug for SimEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimEvent")
            .field("stream", &self.state.stream)
            .field("captured", &self.was_captured())
            .field("done", &self.state.done.load(Ordering::Relaxed))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::SimRuntime;
    use super::*;
    use crate::actors::Runtime;
    use std::time::Duration;

    #[test]
    fn event_completes_only_after_earlier_operations() {
        let sim = SimRuntime::new();
        let stream = sim.stream();
        let mem = sim.host_alloc(4).unwrap();
        let hold = stream.hold();
        stream.write_host(mem.ptr.as_ptr(), 4, 1).unwrap();
        let event = sim.record_event(&stream).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        assert_eq!(sim.query_event(&event), Ok(false));
        hold.release();
        stream.synchronize().unwrap();
        assert_eq!(sim.query_event(&event), Ok(true));
        assert_eq!(sim.host_read(mem.ptr.as_ptr(), 4).unwrap(), [1; 4]);
        sim.release_event(event);
        sim.host_free(mem).unwrap();
    }

    #[test]
    fn event_does_not_wait_for_operations_enqueued_after_it() {
        let sim = SimRuntime::new();
        let stream = sim.stream();
        let first = sim.record_event(&stream).unwrap();
        let hold = stream.hold();
        let second = sim.record_event(&stream).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while !sim.query_event(&first).unwrap() && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(sim.query_event(&first), Ok(true));
        assert_eq!(sim.query_event(&second), Ok(false));
        drop(hold);
        stream.synchronize().unwrap();
        assert_eq!(sim.query_event(&second), Ok(true));
        sim.release_event(first);
        sim.release_event(second);
    }

    #[test]
    fn querying_an_event_recorded_during_capture_errors_and_invalidates_the_capture() {
        let sim = SimRuntime::new();
        let stream = sim.stream();
        stream.begin_capture().unwrap();
        let event = sim.record_event(&stream).unwrap();
        assert!(event.was_captured());
        assert!(sim.query_event(&event).is_err());
        assert!(matches!(
            stream.end_capture(),
            Err(SimError::CaptureInvalidated { .. })
        ));
        assert!(!stream.is_capturing());
        // The event stays an error to query, and never completes.
        assert!(sim.query_event(&event).is_err());
        sim.release_event(event);
        stream.begin_capture().unwrap();
        assert!(stream.end_capture().is_ok(), "a new capture is unaffected");
    }

    #[test]
    fn captured_event_marker_is_recorded_into_the_graph() {
        let sim = SimRuntime::new();
        let stream = sim.stream();
        stream.begin_capture().unwrap();
        let event = sim.record_event(&stream).unwrap();
        let graph = stream.end_capture().unwrap();
        assert_eq!(graph.len(), 1);
        graph.launch(&stream).unwrap();
        stream.synchronize().unwrap();
        sim.release_event(event);
    }

    #[test]
    fn recorded_and_released_events_are_counted() {
        let sim = SimRuntime::new();
        let stream = sim.stream();
        let events: Vec<_> = (0..3).map(|_| sim.record_event(&stream).unwrap()).collect();
        assert_eq!(sim.events_recorded(), 3);
        assert_eq!(sim.events_released(), 0);
        events.into_iter().for_each(|e| sim.release_event(e));
        assert_eq!(sim.events_released(), 3);
    }
}
