//! `SimStream`: a simulated CUDA stream, and `HoldGuard`, the test's brake on it.
//!
//! A stream handle owns the sending side of its worker's queue (see `worker`) and its
//! capture state (see `graph`). Every operation goes through `submit`, which either queues
//! it for the worker or, while the stream captures, records it into the graph. Host ranges
//! are validated against the runtime's ledger when enqueued and keep their allocation alive
//! until the operation is gone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::actors::StreamId;

use super::device::SimDeviceBuffer;
use super::error::SimError;
use super::event::{EventState, SimEvent};
use super::graph::{CaptureState, SimGraph};
use super::worker::{self, HostRange, Op, Progress, Work};
use super::{Shared, SimRuntime};

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

struct StreamInner {
    id: StreamId,
    /// The device whose work the stream runs.
    device: usize,
    shared: Arc<Shared>,
    tx: flume::Sender<Op>,
    progress: Arc<Progress>,
    capture: Arc<CaptureState>,
}

/// A simulated stream: operations run strictly in order on the stream's own thread.
///
/// Cheap to clone (clones share the stream); the thread exits once every handle is dropped
/// and the queue has drained.
///
/// ```
/// use std::time::Duration;
/// use pinpool::sim::{SimDeviceBuffer, SimRuntime};
/// use pinpool::Runtime;
///
/// let sim = SimRuntime::new();
/// let stream = sim.new_stream()?;
/// let host = sim.host_alloc(3).unwrap();
/// let dev = SimDeviceBuffer::new(3);
/// stream.delay(Duration::from_millis(1));
/// stream.write_host(host.ptr.as_ptr(), 3, 7).unwrap();
/// stream.copy_to_device(host.ptr.as_ptr(), 3, &dev).unwrap();
/// stream.synchronize().unwrap();
/// assert_eq!(dev.to_vec(), [7, 7, 7]);
/// sim.host_free(host).unwrap();
/// # Ok::<(), pinpool::RuntimeError>(())
/// ```
#[derive(Clone)]
pub struct SimStream {
    inner: Arc<StreamInner>,
}

/// Keeps a stream stopped at the point where [`SimStream::hold`] was called, until it is
/// released or dropped.
#[must_use = "dropping the guard releases the stream at once"]
#[derive(Debug)]
pub struct HoldGuard {
    _release: flume::Sender<()>,
}

impl HoldGuard {
    /// Lets the stream continue past the hold.
    pub fn release(self) {}
}

impl SimStream {
    /// A new stream of `sim`, with its own worker thread.
    ///
    /// If the OS cannot start the thread, the stream is created dead: every later call
    /// that can fail reports [`SimError::ThreadGone`] (`try_new_on` says so at once).
    pub(crate) fn new(sim: &SimRuntime) -> Self {
        Self::create(sim, 0).0
    }

    /// A new stream of `sim` on device `device` (the caller checked that it exists), or
    /// [`SimError::ThreadGone`] if its worker thread cannot be started.
    pub(crate) fn try_new_on(sim: &SimRuntime, device: usize) -> Result<Self, SimError> {
        let (stream, started) = Self::create(sim, device);
        started.map(|()| stream)
    }

    fn create(sim: &SimRuntime, device: usize) -> (Self, Result<(), SimError>) {
        let id = StreamId(NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed));
        let shared = Arc::clone(&sim.shared);
        let (tx, rx) = flume::unbounded();
        let progress = Arc::new(Progress::default());
        let started = worker::spawn(id, Arc::clone(&shared), rx, Arc::clone(&progress));
        let capture = Arc::new(CaptureState::new(id));
        if let Some(d) = shared.devices.get(device) {
            d.add_stream(id, tx.downgrade(), &capture);
        }
        if let Err(e) = &started {
            tracing::error!(stream = id.0, error = %e, "simulated stream has no worker");
        }
        let stream = Self {
            inner: Arc::new(StreamInner {
                id,
                device,
                shared,
                tx,
                progress,
                capture,
            }),
        };
        (stream, started)
    }

    /// The stream's id, unique in the process.
    pub fn id(&self) -> StreamId {
        self.inner.id
    }

    /// The device whose work the stream runs.
    pub fn device(&self) -> usize {
        self.inner.device
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    /// Makes the stream busy for `duration` (a kernel). Captured while capturing.
    pub fn delay(&self, duration: Duration) {
        // Only a dead worker could refuse it, and a worker does not die while it has a sender.
        let _ = self.submit(|_| Ok(Work::Delay(duration)));
    }

    /// Stops the stream here: later operations and events stay pending, and the stream is
    /// busy ([`SimStream::is_idle`] says no), until the guard is released or dropped. A test
    /// control, not a CUDA operation: it is never captured.
    pub fn hold(&self) -> HoldGuard {
        let (release, wait) = flume::bounded(1);
        self.queue(Op::Hold(wait));
        HoldGuard { _release: release }
    }

    /// Stops the stream here for good (until every handle of its runtime is dropped): a
    /// stream that never completes, for robustness tests.
    pub fn hang(&self) {
        self.queue(Op::Hold(self.inner.shared.lifeline.clone()));
    }

    /// Enqueues a host → device copy of `len` bytes at `src` into the start of `dst`. The
    /// bytes are read when the copy runs; if they changed since this call, the copy reports
    /// an early-reuse violation.
    ///
    /// The range must lie inside memory from this runtime's `host_alloc`, which is checked,
    /// so this is safe; the copy keeps that memory allocated until it has run.
    ///
    /// # Errors
    /// [`SimError::ForeignHostMemory`] or [`SimError::DeviceOutOfBounds`].
    pub fn copy_to_device(
        &self,
        src: *const u8,
        len: usize,
        dst: &SimDeviceBuffer,
    ) -> Result<(), SimError> {
        check_device(len, dst)?;
        let src = self.host_range(src as usize, len)?;
        self.submit_copy_to_device(src, dst)
    }

    /// Like [`copy_to_device`](Self::copy_to_device) for host memory that this runtime did
    /// not allocate (a `Vec`, a stack array).
    ///
    /// # Safety
    /// `[src, src + len)` must be valid for reads and stay allocated until the copy has run
    /// (synchronize the stream, or query an event recorded after it) and, if captured, as long
    /// as the graph can be launched. Host writes to it while the copy is queued are allowed:
    /// the simulation reads through atomics and reports them as early reuse.
    pub unsafe fn copy_to_device_unchecked(
        &self,
        src: *const u8,
        len: usize,
        dst: &SimDeviceBuffer,
    ) -> Result<(), SimError> {
        check_device(len, dst)?;
        // SAFETY: the caller promised the range stays allocated while the op exists.
        let src = unsafe { HostRange::unowned(src as usize, len) };
        self.submit_copy_to_device(src, dst)
    }

    /// Enqueues a device → host copy of the first `len` bytes of `src` to `dst`, written when
    /// it runs. `dst` must lie inside memory from this runtime (checked). If the host changes
    /// `dst` before the copy runs, the copy reports an early-reuse violation.
    ///
    /// # Errors
    /// [`SimError::ForeignHostMemory`] or [`SimError::DeviceOutOfBounds`].
    pub fn copy_to_host(
        &self,
        src: &SimDeviceBuffer,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), SimError> {
        check_device(len, src)?;
        let dst = self.host_range(dst as usize, len)?;
        self.submit(|capture| {
            let expect = capture.is_none().then(|| dst.snapshot()).flatten();
            Ok(Work::CopyToHost {
                src: src.clone(),
                dst,
                expect,
            })
        })
    }

    /// Enqueues a kernel that sets `len` host bytes at `dst` to `byte` when it runs. `dst`
    /// must lie inside memory from this runtime (checked). If the host changes them before
    /// it runs, it reports an early-reuse violation.
    ///
    /// # Errors
    /// [`SimError::ForeignHostMemory`].
    pub fn write_host(&self, dst: *mut u8, len: usize, byte: u8) -> Result<(), SimError> {
        let dst = self.host_range(dst as usize, len)?;
        self.submit(|capture| {
            let expect = capture.is_none().then(|| dst.snapshot()).flatten();
            Ok(Work::WriteHost { dst, byte, expect })
        })
    }

    /// Enqueues a kernel that sets `len` bytes of device memory at `dst` (an address from a
    /// simulated device's memory, checked) to `byte` when it runs. If another stream writes
    /// them between this call and the kernel's run, the kernel reports an early-reuse
    /// violation: their work was not ordered with this stream's.
    ///
    /// # Errors
    /// [`SimError::ForeignDeviceMemory`] when the range is not live memory of this stream's
    /// device.
    pub fn fill_device(&self, dst: u64, len: usize, byte: u8) -> Result<(), SimError> {
        let dst = self.device_range(dst, len)?;
        self.submit(|capture| {
            let expect = capture.is_none().then(|| dst.snapshot_for()).flatten();
            Ok(Work::FillDevice { dst, byte, expect })
        })
    }

    /// Enqueues a copy of `len` bytes from host memory of this runtime at `src` to device
    /// memory at `dst` (both checked). The host bytes are read when it runs: a host change
    /// before then is early reuse, and so is another stream's write to `dst`.
    ///
    /// # Errors
    /// [`SimError::ForeignHostMemory`] or [`SimError::ForeignDeviceMemory`].
    pub fn copy_htod(&self, src: *const u8, dst: u64, len: usize) -> Result<(), SimError> {
        let src = self.host_range(src as usize, len)?;
        let dst = self.device_range(dst, len)?;
        self.submit_copy(src, dst)
    }

    /// Enqueues a copy of `len` bytes from device memory at `src` to host memory of this
    /// runtime at `dst` (both checked): the device→host copy a kernel's output takes. If
    /// another stream writes `src` before it runs (the block was reused early), it reports
    /// an early-reuse violation, and the bytes it copies are the new owner's.
    ///
    /// # Errors
    /// [`SimError::ForeignHostMemory`] or [`SimError::ForeignDeviceMemory`].
    pub fn copy_dtoh(&self, src: u64, dst: *mut u8, len: usize) -> Result<(), SimError> {
        let src = self.device_range(src, len)?;
        let dst = self.host_range(dst as usize, len)?;
        self.submit_copy(src, dst)
    }

    /// Enqueues a copy of `len` bytes between device ranges (both checked; they may be on
    /// different devices: a peer copy).
    ///
    /// # Errors
    /// [`SimError::ForeignDeviceMemory`].
    pub fn copy_dtod(&self, src: u64, dst: u64, len: usize) -> Result<(), SimError> {
        let src = self.any_device_range(src, len)?;
        let dst = self.any_device_range(dst, len)?;
        self.submit_copy(src, dst)
    }

    fn submit_copy(&self, src: HostRange, dst: HostRange) -> Result<(), SimError> {
        self.submit(|capture| {
            let (src_expect, dst_expect) = if capture.is_none() {
                (src.snapshot_for(), dst.snapshot_for())
            } else {
                (None, None)
            };
            Ok(Work::Copy {
                src,
                dst,
                src_expect,
                dst_expect,
            })
        })
    }

    /// A range of live memory of this stream's device.
    fn device_range(&self, addr: u64, len: usize) -> Result<HostRange, SimError> {
        let r = self.any_device_range(addr, len)?;
        if r.device() == Some(self.inner.device) {
            Ok(r)
        } else {
            Err(SimError::ForeignDeviceMemory {
                addr: addr as usize,
                len,
                device: self.inner.device,
            })
        }
    }

    /// A range of live memory of any simulated device.
    fn any_device_range(&self, addr: u64, len: usize) -> Result<HostRange, SimError> {
        let foreign = SimError::ForeignDeviceMemory {
            addr: addr as usize,
            len,
            device: self.inner.device,
        };
        let addr = usize::try_from(addr).map_err(|_| foreign.clone())?;
        let owner = self
            .inner
            .shared
            .ledger
            .lookup(addr, len)?
            .filter(|o| o.device().is_some())
            .ok_or(foreign)?;
        Ok(HostRange::owned(addr, len, owner))
    }

    /// Blocks until every operation enqueued so far has run.
    ///
    /// # Errors
    /// [`SimError::IllegalDuringCapture`] while capturing (as in CUDA).
    pub fn synchronize(&self) -> Result<(), SimError> {
        let reply = self.signal()?;
        reply
            .recv()
            .map_err(|_| SimError::ThreadGone("pinpool-sim-stream"))
    }

    /// Like [`synchronize`](Self::synchronize), giving up after `timeout`; returns whether
    /// the stream got there.
    ///
    /// # Errors
    /// As for `synchronize`.
    pub fn synchronize_timeout(&self, timeout: Duration) -> Result<bool, SimError> {
        let reply = self.signal()?;
        match reply.recv_timeout(timeout) {
            Ok(()) => Ok(true),
            Err(flume::RecvTimeoutError::Timeout) => Ok(false),
            Err(flume::RecvTimeoutError::Disconnected) => {
                Err(SimError::ThreadGone("pinpool-sim-stream"))
            }
        }
    }

    /// Starts capturing: from now on operations are recorded into a graph instead of run.
    ///
    /// # Errors
    /// [`SimError::AlreadyCapturing`].
    pub fn begin_capture(&self) -> Result<(), SimError> {
        self.inner.capture.begin()
    }

    /// Stops capturing and returns the recorded graph.
    ///
    /// # Errors
    /// [`SimError::NotCapturing`], or [`SimError::CaptureInvalidated`] when an event recorded
    /// during this capture was queried (the graph is discarded, and capture stops).
    pub fn end_capture(&self) -> Result<SimGraph, SimError> {
        self.inner.capture.end()
    }

    /// Whether operations enqueued now are captured.
    pub fn is_capturing(&self) -> bool {
        self.inner.capture.is_capturing()
    }

    /// Whether every operation enqueued so far (work, and holds) has run: CUDA's
    /// `cuStreamQuery`.
    pub fn is_idle(&self) -> bool {
        self.inner.progress.idle()
    }

    /// Records an event marker (captured while capturing).
    pub(crate) fn record_event(&self) -> Result<SimEvent, SimError> {
        let id = self.inner.id;
        let mut state = None;
        self.submit(|capture| {
            let s = Arc::new(EventState::new(
                id,
                capture.map(|(c, generation)| (Arc::downgrade(c), generation)),
            ));
            state = Some(Arc::clone(&s));
            Ok(Work::Event(s))
        })?;
        state
            .map(|state| SimEvent { state })
            .ok_or(SimError::ThreadGone("pinpool-sim-stream"))
    }

    /// Makes the work enqueued from now on wait for `event` (of another stream) to
    /// complete, as `cuStreamWaitEvent` does; refused for an event recorded during capture
    /// (it never completes) and while this stream captures.
    pub(crate) fn wait_event(&self, event: &SimEvent) -> Result<(), SimError> {
        if event.was_captured() || self.is_capturing() {
            return Err(SimError::CapturedEventQueried {
                stream: event.stream_id().0,
            });
        }
        if event.stream_id() == self.inner.id {
            // Stream order already puts later work after it.
            return Ok(());
        }
        let state = Arc::clone(&event.state);
        self.submit(|_| Ok(Work::WaitEvent(state)))
    }

    /// Queues or captures the operation `build` makes (it is told whether it is captured).
    pub(crate) fn submit(
        &self,
        build: impl FnOnce(Option<(&Arc<CaptureState>, u64)>) -> Result<Work, SimError>,
    ) -> Result<(), SimError> {
        self.inner.capture.submit(build, |work| {
            let op = Op::Work(work);
            self.inner.progress.queue(&op);
            self.inner
                .tx
                .send(op)
                .map_err(|_| SimError::ThreadGone("pinpool-sim-stream"))
        })
    }

    fn submit_copy_to_device(&self, src: HostRange, dst: &SimDeviceBuffer) -> Result<(), SimError> {
        self.submit(|capture| {
            let expect = capture.is_none().then(|| src.snapshot()).flatten();
            Ok(Work::CopyToDevice {
                src,
                dst: dst.clone(),
                expect,
            })
        })
    }

    fn host_range(&self, addr: usize, len: usize) -> Result<HostRange, SimError> {
        let owner = self
            .inner
            .shared
            .ledger
            .lookup(addr, len)?
            .filter(|o| o.device().is_none())
            .ok_or(SimError::ForeignHostMemory { addr, len })?;
        Ok(HostRange::owned(addr, len, owner))
    }

    fn signal(&self) -> Result<flume::Receiver<()>, SimError> {
        if self.is_capturing() {
            return Err(SimError::IllegalDuringCapture {
                stream: self.inner.id.0,
                op: "synchronize",
            });
        }
        let (reply, wait) = flume::bounded(1);
        self.queue(Op::Signal(reply));
        Ok(wait)
    }

    fn queue(&self, op: Op) {
        self.inner.progress.queue(&op);
        // Only a dead worker could refuse it; a worker does not stop while a sender lives.
        let _ = self.inner.tx.send(op);
    }
}

fn check_device(len: usize, buffer: &SimDeviceBuffer) -> Result<(), SimError> {
    if len > buffer.len() {
        return Err(SimError::DeviceOutOfBounds {
            len,
            capacity: buffer.len(),
        });
    }
    Ok(())
}

impl std::fmt::Debug for SimStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStream")
            .field("id", &self.inner.id)
            .field("capturing", &self.is_capturing())
            .finish()
    }
}

#[cfg(test)]
mod tests;
