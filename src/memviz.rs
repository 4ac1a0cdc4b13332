//! Snapshots for PyTorch's memory tools on the public face.
//!
//! Owns `pickle_snapshot` of [`PinnedAllocator`] and [`DeviceAllocator`]: a snapshot and the
//! recorded history in the pickle layout of `torch.cuda.memory._snapshot()` (see
//! [`MemorySnapshot::to_pickle`]), the bytes that `torch.cuda.memory._dump_snapshot` writes
//! to a file. Like PyTorch's snapshot, taking one records a `Snapshot` entry in the history
//! while history is on.

use crate::actors::{Error, History, MemorySnapshot, Runtime};

use crate::allocator::PinnedAllocator;
use crate::device::{DeviceAllocator, DeviceRuntime};

impl<R: Runtime> PinnedAllocator<R> {
    /// A snapshot and the recorded history in the pickle layout of
    /// `torch.cuda.memory._snapshot()`; pinned host memory reads as device 0 (see
    /// [`MemorySnapshot::to_pickle`] for how the fields map).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// allocator.record_history(true, 1000, pinpool::HistoryContext::None)?;
    /// let buf = allocator.alloc(4096).await?;
    /// let bytes = allocator.pickle_snapshot().await?;
    /// assert_eq!(&bytes[..2], &[0x80, 2]); // a pickle, protocol 2
    /// # drop(buf);
    /// # Ok(()) }
    /// ```
    pub async fn pickle_snapshot(&self) -> Result<Vec<u8>, Error> {
        let snap = self.snapshot().await?;
        self.engine().record_snapshot_taken();
        let history = self.history().await?;
        Ok(snap.to_pickle(&[history]))
    }
}

impl<R: DeviceRuntime> DeviceAllocator<R> {
    /// A snapshot of every device and each device's recorded history (`device_traces[d]`)
    /// in the pickle layout of `torch.cuda.memory._snapshot()` (see
    /// [`MemorySnapshot::to_pickle`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use pinpool::{DeviceAllocator, HistoryContext};
    ///
    /// let allocator = DeviceAllocator::builder().build()?;
    /// allocator.record_history(true, 100_000, HistoryContext::Alloc)?; // device_traces, with frames
    /// let stream = allocator.runtime().new_stream()?;
    /// let buf = allocator.alloc(1 << 20, &stream).await?;
    /// let bytes = allocator.pickle_snapshot().await?; // what torch.cuda.memory._snapshot() pickles
    /// assert_eq!(&bytes[..2], &[0x80, 2]);
    /// let file = std::env::temp_dir().join("pinpool-device-doc.pickle");
    /// std::fs::write(&file, bytes)?; // open it in pytorch.org/memory_viz
    /// # std::fs::remove_file(&file).ok();
    /// # drop(buf);
    /// # Ok(()) }
    /// ```
    pub async fn pickle_snapshot(&self) -> Result<Vec<u8>, Error> {
        let snap: MemorySnapshot = self.snapshot().await?;
        let mut histories: Vec<History> = Vec::with_capacity(self.device_count());
        for d in 0..self.device_count() {
            self.engine(d)?.record_snapshot_taken();
            histories.push(self.history(d).await?);
        }
        Ok(snap.to_pickle(&histories))
    }
}
