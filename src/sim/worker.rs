//! The stream worker: one OS thread per stream that owns the stream's queue and runs its
//! operations strictly in order, the way a CUDA stream does.
//!
//! Copies touch host memory when they run, like DMA. Each operation that reads or
//! overwrites host memory carries a checksum of those bytes taken when it was enqueued; if
//! the bytes differ when it runs, the host changed memory whose device work was still
//! queued — early reuse — and the worker reports a violation. Changes made by device work
//! in between (a kernel or a device→host copy into the same allocation, on any stream) are
//! legitimate; the allocation's device-write counters tell them apart, and the check is
//! skipped when one happened. Each operation on device memory carries instead the number
//! the allocation's next device write would take when it was enqueued: if another stream
//! wrote any of its bytes with that number or a later one before it runs, the two streams'
//! work on those bytes was not ordered — early reuse — whatever either wrote elsewhere in
//! the mapping (see `write_map`). An operation is dropped (releasing its hold on host
//! memory) before the next one starts, so a later event marker completes only after
//! earlier operations have finished with their memory. The thread exits when every sender
//! (stream handle) is gone and the queue is drained.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::actors::StreamId;

use super::device::SimDeviceBuffer;
use super::error::SimError;
use super::event::EventState;
use super::memory::{self, atomic_bytes, checksum, checksum_atomic, HostAllocation};
use super::rng::XorShift;
use super::violation::ViolationKind;
use super::Shared;

/// A host byte range an operation touches, and (for memory of this runtime) the allocation
/// it keeps alive until the operation is dropped.
#[derive(Clone)]
pub(crate) struct HostRange {
    addr: usize,
    len: usize,
    _owner: Option<Arc<HostAllocation>>,
}

impl HostRange {
    /// A range inside `owner`.
    pub(crate) fn owned(addr: usize, len: usize, owner: Arc<HostAllocation>) -> Self {
        Self {
            addr,
            len,
            _owner: Some(owner),
        }
    }

    /// A range whose caller promised it stays allocated until the operation has run.
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay allocated until every operation holding this range
    /// has run (or been dropped).
    pub(crate) unsafe fn unowned(addr: usize, len: usize) -> Self {
        Self {
            addr,
            len,
            _owner: None,
        }
    }

    pub(crate) fn bytes(&self) -> &[AtomicU8] {
        // SAFETY: the range lies in `_owner`, which this value keeps alive, or the creator
        // of an unowned range promised it stays allocated while this value exists.
        unsafe { atomic_bytes(self.addr, self.len) }
    }

    /// Reads the range now: its checksum and the device-write generation it was taken at,
    /// or `None` when device work was writing it at that moment.
    pub(crate) fn snapshot(&self) -> Option<Expect> {
        self.read_with(|| checksum_atomic(self.bytes()))
    }

    /// What an operation enqueued now must find when it runs: for device memory, the next
    /// device-write number (no bytes are read: what matters is who writes them before the
    /// operation runs; writes that a wait queued before the operation orders ahead of it may
    /// still come after this, and the worker checks from the end of that wait on, see
    /// `Worker::waited_at`); for host memory, [`HostRange::snapshot`].
    pub(crate) fn snapshot_for(&self) -> Option<Expect> {
        match self.device_owner() {
            Some(_) => Some(Expect {
                checksum: 0,
                generation: 0,
                write_seq: Some(memory::device_write_seq()),
            }),
            None => self.snapshot(),
        }
    }

    /// The allocation, when the range is device memory.
    fn device_owner(&self) -> Option<&Arc<HostAllocation>> {
        self._owner.as_ref().filter(|o| o.device().is_some())
    }

    /// The device whose memory the range lies in (`None`: host memory).
    pub(crate) fn device(&self) -> Option<usize> {
        self._owner.as_ref().and_then(|o| o.device())
    }

    fn read_with(&self, read: impl FnOnce() -> u64) -> Option<Expect> {
        let (checksum, generation) = match &self._owner {
            Some(owner) => owner.read_consistent(read)?,
            None => (read(), 0),
        };
        Some(Expect {
            checksum,
            generation,
            write_seq: None,
        })
    }

    /// How the range was changed since `expect` was taken in a way the operation's stream
    /// did not order, if it was: device memory that another stream wrote (any of these
    /// bytes) in between; host memory that the host changed (the bytes differ, and no
    /// device write to the allocation happened in between: device work may change them).
    /// `now` reads host memory as it is now (not called for device memory).
    fn changed_unordered(
        &self,
        expect: &Expect,
        now: impl FnOnce() -> Option<Expect>,
        stream: StreamId,
    ) -> Option<String> {
        if let (Some(since), Some(owner)) = (expect.write_seq, self.device_owner()) {
            return owner
                .foreign_write_since(self.addr, self.len, stream.0, since)
                .map(|w| {
                    format!(
                        "written by stream {} (device write #{}) between enqueue and execution",
                        w.stream, w.seq
                    )
                });
        }
        let now = now()?;
        (now.checksum != expect.checksum && now.generation == expect.generation)
            .then(|| "changed between enqueue and execution".to_owned())
    }

    /// Whether the range's granules are all mapped now (always, outside reserved ranges).
    fn mapped(&self) -> bool {
        self._owner
            .as_ref()
            .map_or(true, |o| o.all_mapped(self.addr - o.addr(), self.len))
    }

    fn device_write(&self, stream: StreamId, write: impl FnOnce(&[AtomicU8])) {
        match &self._owner {
            Some(owner) => {
                owner.device_write(stream.0, self.addr, self.len, || write(self.bytes()))
            }
            None => write(self.bytes()),
        }
    }
}

/// What bytes looked like when an operation was enqueued.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Expect {
    checksum: u64,
    generation: u64,
    /// For device memory: the number the next device write would take.
    write_seq: Option<u64>,
}

/// A device operation: what a stream runs, and what a capture records.
#[derive(Clone)]
pub(crate) enum Work {
    /// The stream is busy for this long (a kernel).
    Delay(Duration),
    /// Host → device; `expect` is the source checksum at enqueue (None when captured).
    CopyToDevice {
        src: HostRange,
        dst: SimDeviceBuffer,
        expect: Option<Expect>,
    },
    /// Device → host; `expect` is the destination checksum at enqueue.
    CopyToHost {
        src: SimDeviceBuffer,
        dst: HostRange,
        expect: Option<Expect>,
    },
    /// A kernel that fills host memory with `byte`; `expect` as for `CopyToHost`.
    WriteHost {
        dst: HostRange,
        byte: u8,
        expect: Option<Expect>,
    },
    /// A copy between ranges of this runtime (host or device memory, either way); each
    /// `expect` is its range's snapshot at enqueue.
    Copy {
        src: HostRange,
        dst: HostRange,
        src_expect: Option<Expect>,
        dst_expect: Option<Expect>,
    },
    /// A kernel that fills device memory with `byte`; `expect` is its snapshot at enqueue.
    FillDevice {
        dst: HostRange,
        byte: u8,
        expect: Option<Expect>,
    },
    /// An event marker.
    Event(Arc<EventState>),
    /// Waits until an event of another stream has completed (`cuStreamWaitEvent`).
    WaitEvent(Arc<EventState>),
    /// A graph replay.
    Launch(Arc<[Work]>),
}

/// What a stream's queue carries.
pub(crate) enum Op {
    Work(Work),
    /// Stop until the sender is released or dropped.
    Hold(flume::Receiver<()>),
    /// Reply once reached (synchronize).
    Signal(flume::Sender<()>),
}

struct Worker {
    stream: StreamId,
    shared: Arc<Shared>,
    jitter: Option<(XorShift, u64)>,
    executed: u64,
    progress: Arc<Progress>,
    /// The device-write number when the last wait for another stream's event ended. Every
    /// operation after that wait in the queue was enqueued after it and is ordered after the
    /// event, and so after every device write numbered below this (the event completed only
    /// once the writes it waited for, through any chain of waits, were done): an operation
    /// is checked against foreign writes from here on, or from its enqueue if later.
    waited_at: u64,
}

/// How far a stream has got: operations that occupy it (work and holds) queued, and run to
/// the end (dropped). Signals are not counted (the device's synchronize sends them too).
#[derive(Default)]
pub(crate) struct Progress {
    queued: AtomicU64,
    done: AtomicU64,
}

impl Progress {
    /// Whether `op` occupies the stream (is counted).
    fn counts(op: &Op) -> bool {
        !matches!(op, Op::Signal(_))
    }

    /// Counts `op` as queued, if it occupies the stream; before it is sent.
    pub(crate) fn queue(&self, op: &Op) {
        if Self::counts(op) {
            self.queued.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Counts an operation as run, if it occupies the stream; once it is dropped.
    fn ran(&self, occupied: bool) {
        if occupied {
            self.done.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Whether every operation queued before this call has run (and been dropped).
    pub(crate) fn idle(&self) -> bool {
        let queued = self.queued.load(Ordering::SeqCst);
        self.done.load(Ordering::SeqCst) >= queued
    }
}

/// Starts the worker thread for `stream`.
pub(crate) fn spawn(
    stream: StreamId,
    shared: Arc<Shared>,
    rx: flume::Receiver<Op>,
    progress: Arc<Progress>,
) -> Result<(), SimError> {
    let jitter = shared
        .random_delays()
        .map(|(seed, max)| (XorShift::new(seed ^ stream.0), max));
    let worker = Worker {
        stream,
        shared,
        jitter,
        executed: 0,
        progress,
        waited_at: 0,
    };
    std::thread::Builder::new()
        .name(format!("pinpool-sim-stream-{}", stream.0))
        .spawn(move || worker.run(rx))
        .map(drop)
        .map_err(|_| SimError::ThreadGone("pinpool-sim-stream"))
}

impl Worker {
    fn run(mut self, rx: flume::Receiver<Op>) {
        while let Ok(op) = rx.recv() {
            self.jitter();
            let occupies = Progress::counts(&op);
            match op {
                Op::Work(work) => self.execute(&work),
                Op::Hold(release) => {
                    // Returns on release() or when the guard is dropped.
                    let _ = release.recv();
                }
                Op::Signal(reply) => {
                    let _ = reply.send(());
                }
            }
            // The operation is dropped by now (its hold on memory released).
            self.progress.ran(occupies);
        }
    }

    fn jitter(&mut self) {
        if let Some((rng, max)) = &mut self.jitter {
            let nanos = rng.below(*max);
            if nanos > 0 {
                std::thread::sleep(Duration::from_nanos(nanos));
            }
        }
    }

    /// Reports work that runs on memory unmapped since it was enqueued (given back, or moved
    /// away, before the work queued on it had run).
    fn check_mapped(&self, range: &HostRange, what: &str) {
        if !range.mapped() {
            self.shared.report(
                ViolationKind::FreedWhileInUse,
                Some(self.stream),
                format!(
                    "{what} ({} bytes at {:#x}, operation #{}) ran on unmapped memory",
                    range.len, range.addr, self.executed
                ),
            );
        }
    }

    fn execute(&mut self, work: &Work) {
        self.executed += 1;
        match work {
            Work::Delay(d) => std::thread::sleep(*d),
            Work::CopyToDevice { src, dst, expect } => {
                // The bytes checked are exactly the bytes copied.
                let seen = src.read_with(|| {
                    checksum(src.bytes().iter().zip(dst.bytes()).map(|(s, d)| {
                        let b = s.load(Ordering::Relaxed);
                        d.store(b, Ordering::Relaxed);
                        b
                    }))
                });
                self.check(src, expect, || seen, "host→device copy source");
            }
            Work::CopyToHost { src, dst, expect } => {
                self.check(
                    dst,
                    expect,
                    || dst.snapshot(),
                    "device→host copy destination",
                );
                dst.device_write(self.stream, |bytes| {
                    for (s, d) in src.bytes().iter().zip(bytes) {
                        d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
                    }
                });
            }
            Work::WriteHost { dst, byte, expect } => {
                self.check(
                    dst,
                    expect,
                    || dst.snapshot(),
                    "host-writing kernel destination",
                );
                dst.device_write(self.stream, |bytes| {
                    bytes.iter().for_each(|d| d.store(*byte, Ordering::Relaxed));
                });
            }
            Work::Copy {
                src,
                dst,
                src_expect,
                dst_expect,
            } => {
                self.check(src, src_expect, || src.snapshot(), "copy source");
                self.check(dst, dst_expect, || dst.snapshot(), "copy destination");
                dst.device_write(self.stream, |bytes| {
                    for (s, d) in src.bytes().iter().zip(bytes) {
                        d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
                    }
                });
            }
            Work::FillDevice { dst, byte, expect } => {
                self.check_mapped(dst, "device-writing kernel destination");
                self.check(
                    dst,
                    expect,
                    || dst.snapshot(),
                    "device-writing kernel destination",
                );
                dst.device_write(self.stream, |bytes| {
                    bytes.iter().for_each(|d| d.store(*byte, Ordering::Relaxed));
                });
            }
            Work::Event(state) => state.complete(),
            Work::WaitEvent(state) => {
                while !state.is_done() {
                    std::thread::sleep(Duration::from_micros(20));
                }
                self.waited_at = memory::device_write_seq();
            }
            Work::Launch(graph) => {
                for w in graph.iter() {
                    self.jitter();
                    self.execute(w);
                }
            }
        }
    }

    fn check(
        &self,
        range: &HostRange,
        expect: &Option<Expect>,
        now: impl FnOnce() -> Option<Expect>,
        what: &str,
    ) {
        let Some(mut expect) = *expect else { return };
        expect.write_seq = expect.write_seq.map(|q| q.max(self.waited_at));
        if let Some(how) = range.changed_unordered(&expect, now, self.stream) {
            self.shared.report(
                ViolationKind::EarlyReuse,
                Some(self.stream),
                format!(
                    "{what} ({} bytes at {:#x}, operation #{}) {how}",
                    range.len, range.addr, self.executed
                ),
            );
        }
    }
}
