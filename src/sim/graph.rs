//! Stream capture: owns each stream's capture state and the captured graph, `SimGraph`.
//!
//! Capture is decided on the host at enqueue time, as in CUDA, never by the worker: while a
//! stream captures, `submit` diverts each operation into the capture's own channel instead
//! of the stream's queue, so capture works even while the stream is held. `end_capture`
//! closes the capture, waits for enqueues already under way (an in-flight counter), and
//! drains the channel into an immutable `SimGraph`. A capture whose captured event was
//! queried, or whose device was synchronised meanwhile, is invalidated: `end_capture`
//! reports it and discards the graph.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use crate::actors::StreamId;

use super::error::SimError;
use super::stream::SimStream;
use super::worker::Work;

const IDLE: u8 = 0;
const CAPTURING: u8 = 1;
/// Beginning or ending: enqueues go to the stream, and begin/end are refused.
const SWITCHING: u8 = 2;

/// The capture state of one stream.
pub(crate) struct CaptureState {
    stream: StreamId,
    phase: AtomicU8,
    /// Incremented by each `begin`; identifies the capture an event was recorded into.
    generation: AtomicU64,
    /// The generation that a query of a captured event invalidated (0: none).
    invalidated: AtomicU64,
    /// Enqueues currently deciding where their operation goes.
    inflight: AtomicUsize,
    tx: flume::Sender<Work>,
    rx: flume::Receiver<Work>,
}

impl CaptureState {
    pub(crate) fn new(stream: StreamId) -> Self {
        let (tx, rx) = flume::unbounded();
        Self {
            stream,
            phase: AtomicU8::new(IDLE),
            generation: AtomicU64::new(0),
            invalidated: AtomicU64::new(0),
            inflight: AtomicUsize::new(0),
            tx,
            rx,
        }
    }

    pub(crate) fn is_capturing(&self) -> bool {
        self.phase.load(SeqCst) == CAPTURING
    }

    pub(crate) fn begin(&self) -> Result<(), SimError> {
        self.phase
            .compare_exchange(IDLE, SWITCHING, SeqCst, SeqCst)
            .map_err(|_| SimError::AlreadyCapturing {
                stream: self.stream.0,
            })?;
        self.generation.fetch_add(1, SeqCst);
        self.phase.store(CAPTURING, SeqCst);
        Ok(())
    }

    pub(crate) fn end(&self) -> Result<SimGraph, SimError> {
        self.phase
            .compare_exchange(CAPTURING, SWITCHING, SeqCst, SeqCst)
            .map_err(|_| SimError::NotCapturing {
                stream: self.stream.0,
            })?;
        // An enqueue that saw CAPTURING has incremented `inflight` before looking, so once
        // this reads zero every captured operation is in the channel.
        while self.inflight.load(SeqCst) != 0 {
            std::thread::yield_now();
        }
        let work: Vec<Work> = self.rx.drain().collect();
        let invalid = self.invalidated.load(SeqCst) == self.generation.load(SeqCst);
        self.phase.store(IDLE, SeqCst);
        if invalid {
            return Err(SimError::CaptureInvalidated {
                stream: self.stream.0,
            });
        }
        Ok(SimGraph {
            work: work.into(),
            stream: self.stream,
        })
    }

    /// Marks capture `generation` invalid (a captured event was queried).
    pub(crate) fn invalidate(&self, generation: u64) {
        self.invalidated.store(generation, SeqCst);
    }

    /// Marks the capture underway invalid, if one is (its device was synchronised); whether
    /// one was.
    pub(crate) fn invalidate_underway(&self) -> bool {
        if !self.is_capturing() {
            return false;
        }
        self.invalidate(self.generation.load(SeqCst));
        true
    }

    /// Routes one operation: `build` is told the capture generation (if capturing) and
    /// makes the operation; it is then captured, or handed to `queue` to run.
    pub(crate) fn submit(
        self: &Arc<Self>,
        build: impl FnOnce(Option<(&Arc<CaptureState>, u64)>) -> Result<Work, SimError>,
        queue: impl FnOnce(Work) -> Result<(), SimError>,
    ) -> Result<(), SimError> {
        self.inflight.fetch_add(1, SeqCst);
        let result = if self.phase.load(SeqCst) == CAPTURING {
            let generation = self.generation.load(SeqCst);
            build(Some((self, generation))).map(|work| {
                // Cannot fail: `self.rx` keeps the channel open.
                let _ = self.tx.send(work);
            })
        } else {
            build(None).and_then(queue)
        };
        self.inflight.fetch_sub(1, SeqCst);
        result
    }
}

/// The operations captured on a stream between `begin_capture` and `end_capture`.
///
/// Launching it enqueues a replay of those operations on a stream: copies read the host
/// bytes when the replay runs (so a graph keeps the host memory it reads alive, and freeing
/// that memory while the graph lives is reported as a violation). Events recorded during
/// capture are inert in the replay.
///
/// ```
/// use pinpool::sim::{SimDeviceBuffer, SimRuntime};
/// use pinpool::Runtime;
///
/// let sim = SimRuntime::new();
/// let stream = sim.new_stream()?;
/// let host = sim.host_alloc(2).unwrap();
/// let dev = SimDeviceBuffer::new(2);
/// stream.begin_capture().unwrap();
/// stream.copy_to_device(host.ptr.as_ptr(), 2, &dev).unwrap();
/// let graph = stream.end_capture().unwrap();
/// sim.host_write(host.ptr.as_ptr(), &[5, 6]).unwrap();
/// graph.launch(&stream).unwrap();
/// stream.synchronize().unwrap();
/// assert_eq!(dev.to_vec(), [5, 6]);
/// drop(graph);
/// sim.host_free(host).unwrap();
/// assert_eq!(sim.violations(), 0);
/// # Ok::<(), pinpool::RuntimeError>(())
/// ```
#[derive(Clone)]
pub struct SimGraph {
    work: Arc<[Work]>,
    stream: StreamId,
}

impl SimGraph {
    /// Enqueues a replay on `stream` (captured, if `stream` is itself capturing).
    pub fn launch(&self, stream: &SimStream) -> Result<(), SimError> {
        stream.submit(|_| Ok(Work::Launch(Arc::clone(&self.work))))
    }

    /// The number of captured operations.
    pub fn len(&self) -> usize {
        self.work.len()
    }

    /// Whether nothing was captured.
    pub fn is_empty(&self) -> bool {
        self.work.is_empty()
    }

    /// The stream it was captured on.
    pub fn captured_on(&self) -> StreamId {
        self.stream
    }
}

impl std::fmt::Debug for SimGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimGraph")
            .field("stream", &self.stream)
            .field("ops", &self.work.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{SimDeviceBuffer, SimRuntime, ViolationKind};
    use super::*;
    use crate::actors::Runtime;

    #[test]
    fn captured_operations_do_not_run_and_replay_on_launch() {
        let sim = SimRuntime::new();
        let stream = sim.stream();
        let mem = sim.host_alloc(4).unwrap();
        let p = mem.ptr.as_ptr();
        let dev = SimDeviceBuffer::new(4);
        stream.begin_capture().unwrap();
        assert!(stream.is_capturing());
        assert_eq!(sim.is_capturing(&stream), Ok(true));
        stream.write_host(p, 4, 3).unwrap();
        stream.copy_to_device(p, 4, &dev).unwrap();
        let graph = stream.end_capture().unwrap();
        assert!(!stream.is_capturing());
        assert_eq!(graph.len(), 2);
        assert_eq!(graph.captured_on(), stream.id());
        stream.synchronize().unwrap();
        assert_eq!(sim.host_read(p, 4).unwrap(), [0; 4]);
        assert_eq!(dev.to_vec(), [0; 4]);

        let other = sim.stream();
        graph.launch(&other).unwrap();
        other.synchronize().unwrap();
        assert_eq!(sim.host_read(p, 4).unwrap(), [3; 4]);
        assert_eq!(dev.to_vec(), [3; 4]);
        drop(graph);
        sim.host_free(mem).unwrap();
        assert_eq!(sim.violations(), 0);
    }

    #[test]
    fn replayed_copies_read_host_bytes_at_replay_time() {
        let sim = SimRuntime::new();
        let stream = sim.stream();
        let mem = sim.host_alloc(2).unwrap();
        let p = mem.ptr.as_ptr();
        let dev = SimDeviceBuffer::new(2);
        stream.begin_capture().unwrap();
        stream.copy_to_device(p, 2, &dev).unwrap();
        let graph = stream.end_capture().unwrap();
        for round in 1..=3u8 {
            sim.host_write(p, &[round; 2]).unwrap();
            graph.launch(&stream).unwrap();
            stream.synchronize().unwrap();
            assert_eq!(dev.to_vec(), [round; 2]);
        }
        drop(graph);
        sim.host_free(mem).unwrap();
    }

    #[test]
    fn capture_works_while_the_stream_is_held() {
        let sim = SimRuntime::new();
        let stream = sim.stream();
        let hold = stream.hold();
        stream.begin_capture().unwrap();
        stream.delay(std::time::Duration::from_millis(1));
        let graph = stream.end_capture().unwrap();
        assert_eq!(graph.len(), 1);
        drop(hold);
    }

    #[test]
    fn end_without_begin_and_begin_twice_are_typed_errors() {
        let sim = SimRuntime::new();
        let stream = sim.stream();
        assert!(matches!(
            stream.end_capture(),
            Err(SimError::NotCapturing { .. })
        ));
        stream.begin_capture().unwrap();
        assert!(matches!(
            stream.begin_capture(),
            Err(SimError::AlreadyCapturing { .. })
        ));
        assert!(stream.end_capture().unwrap().is_empty());
        assert!(matches!(
            stream.end_capture(),
            Err(SimError::NotCapturing { .. })
        ));
    }

    #[test]
    fn launching_onto_a_capturing_stream_captures_the_launch() {
        let sim = SimRuntime::new();
        let (a, b) = (sim.stream(), sim.stream());
        a.begin_capture().unwrap();
        a.delay(std::time::Duration::ZERO);
        let inner = a.end_capture().unwrap();
        b.begin_capture().unwrap();
        inner.launch(&b).unwrap();
        let outer = b.end_capture().unwrap();
        assert_eq!(outer.len(), 1);
        outer.launch(&a).unwrap();
        a.synchronize().unwrap();
    }

    #[test]
    fn freeing_memory_a_live_graph_reads_is_a_violation() {
        let sim = SimRuntime::new();
        let stream = sim.stream();
        let mem = sim.host_alloc(4).unwrap();
        stream.begin_capture().unwrap();
        stream
            .copy_to_device(mem.ptr.as_ptr(), 4, &SimDeviceBuffer::new(4))
            .unwrap();
        let graph = stream.end_capture().unwrap();
        sim.host_free(mem).unwrap();
        assert_eq!(sim.violations(), 1);
        assert_eq!(sim.violation_log()[0].kind, ViolationKind::FreedWhileInUse);
        // The graph keeps the bytes alive, so replaying it is still memory-safe.
        graph.launch(&stream).unwrap();
        stream.synchronize().unwrap();
    }
}
