//! The books of each simulated device: its capacity and use, its calls, and its streams
//! (so that giving memory back can wait for each of them, and catch a capture it would
//! invalidate).

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use super::{graph, worker};
use crate::actors::StreamId;

/// The books of one simulated device.
pub(crate) struct DeviceState {
    pub(super) capacity: usize,
    /// Bytes allocated or mapped.
    pub(super) used: AtomicUsize,
    /// Allocations and map calls made, and given back.
    pub(super) allocs: AtomicU64,
    pub(super) frees: AtomicU64,
    /// Map calls' memory moved to another place of its range (`RangeCall::Move`).
    pub(super) remaps: AtomicU64,
    /// Whether the device's memory source was asked for (as a GPU's context is retained).
    pub(super) opened: std::sync::atomic::AtomicBool,
    /// Address ranges reserved and not given back.
    pub(super) reservations: AtomicU64,
    /// The queues and capture states of the device's streams, so that giving memory back can
    /// wait for every stream of the device first, as `cuMemFree` does, and catch a capture
    /// that this would invalidate (weak: streams end on their own).
    streams: ArcSwap<Vec<DeviceStream>>,
}

/// A stream of a device, as its device's books see it.
#[derive(Clone)]
struct DeviceStream {
    id: StreamId,
    queue: flume::WeakSender<worker::Op>,
    capture: std::sync::Weak<graph::CaptureState>,
}

impl DeviceState {
    /// The books of a device of `capacity` bytes, none used, with no streams.
    pub(super) fn new(capacity: usize) -> Self {
        DeviceState {
            capacity,
            used: AtomicUsize::new(0),
            allocs: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            remaps: AtomicU64::new(0),
            opened: std::sync::atomic::AtomicBool::new(false),
            reservations: AtomicU64::new(0),
            streams: ArcSwap::from_pointee(Vec::new()),
        }
    }

    /// Notes a new stream of the device.
    pub(crate) fn add_stream(
        &self,
        id: StreamId,
        queue: flume::WeakSender<worker::Op>,
        capture: &Arc<graph::CaptureState>,
    ) {
        let stream = DeviceStream {
            id,
            queue,
            capture: Arc::downgrade(capture),
        };
        self.streams.rcu(|streams| {
            let mut all = Vec::clone(streams);
            all.push(stream.clone());
            all
        });
    }

    /// The device's streams that have not ended.
    pub(crate) fn live_streams(&self) -> usize {
        let streams = self.streams.load();
        streams
            .iter()
            .filter(|s| s.queue.upgrade().is_some())
            .count()
    }

    /// Invalidates the capture underway on every stream of the device that captures, as a
    /// device-wide synchronisation does in CUDA; returns those streams.
    pub(crate) fn invalidate_captures(&self) -> Vec<StreamId> {
        self.streams
            .load()
            .iter()
            .filter(|s| s.capture.upgrade().is_some_and(|c| c.invalidate_underway()))
            .map(|s| s.id)
            .collect()
    }

    /// Waits, up to `timeout` each, until every stream of the device has run the work
    /// queued on it so far; returns the streams that did not get there in time.
    pub(crate) fn synchronize(&self, timeout: Duration) -> Vec<StreamId> {
        // Ended streams drop out of the list here.
        self.streams.rcu(|streams| {
            let mut live = Vec::clone(streams);
            live.retain(|s| s.queue.upgrade().is_some());
            live
        });
        let queues: Vec<_> = self
            .streams
            .load()
            .iter()
            .filter_map(|s| Some((s.id, s.queue.upgrade()?)))
            .collect();
        let waits: Vec<_> = queues
            .into_iter()
            .map(|(id, q)| {
                let (reply, wait) = flume::bounded(1);
                let _ = q.send(worker::Op::Signal(reply));
                (id, wait)
            })
            .collect();
        waits
            .into_iter()
            .filter(|(_, wait)| wait.recv_timeout(timeout) == Err(flume::RecvTimeoutError::Timeout))
            .map(|(id, _)| id)
            .collect()
    }
}
