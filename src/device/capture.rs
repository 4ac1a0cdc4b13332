//! Capture pools on device memory: the `DeviceAllocator`'s calls for CUDA graph capture
//! (PyTorch's `beginAllocateToPool`, `endAllocateToPool`, `releasePool`), routed to the
//! named device's engine, whose router owns the registry (see the engine's `router`).
//!
//! Between `begin_allocate_to_pool` and `end_allocate_to_pool`, a request for a stream the
//! filter accepts is served from the capture pool instead of the stream's own pool. A buffer
//! of a capture pool records the stream it was allocated on (a stream pool's buffer need not:
//! its stream owns the pool), so that its free waits for that stream's work, and a buffer
//! taken or freed while its stream was being captured is kept for the graph's replays: never
//! handed to anyone, in or out of the pool, and never given back to the device, while the
//! pool lives (invariant 4). A pool may serve several graphs (begin it again after its
//! capture ended; release it once for each begin); once every use is released, the next
//! `empty_cache` gives its memory back to the device.

use std::sync::Arc;

use crate::actors::{blocking, DeviceStats, Error, PoolId};

use super::allocator::DeviceAllocator;
use super::runtime::DeviceRuntime;

impl<R: DeviceRuntime> DeviceAllocator<R> {
    /// Routes the requests of device `device` for streams that `filter` accepts into the
    /// capture pool `pool` (made now, or given one more use) until
    /// [`DeviceAllocator::end_allocate_to_pool`]. Call it before the stream begins capturing.
    /// Errors: [`Error::NoSuchDevice`], [`Error::DefaultPoolId`], and
    /// [`Error::PoolAlreadyCapturing`] while a capture already allocates to `pool`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use pinpool::{DeviceAllocator, Error};
    ///
    /// let allocator = DeviceAllocator::builder().build()?;
    /// let stream = allocator.runtime().new_stream()?;
    /// let id = pinpool::PoolId::fresh(); // torch.cuda.graph_pool_handle()
    /// let capturing = stream.id();
    /// allocator.begin_allocate_to_pool(0, id, move |s| s.id() == capturing).await?;
    /// stream.begin_capture()?; // on a GPU: stream.begin_capture(mode)
    /// let out = allocator.alloc(1 << 20, &stream).await?; // from the capture pool
    /// stream.fill_device(out.device_ptr(), out.len(), 7)?; // captured work
    /// let graph = stream.end_capture()?;
    /// allocator.end_allocate_to_pool(0, id).await?;
    /// assert_eq!(out.pool(), Some(id));
    /// drop(out); // kept: every replay writes it
    /// graph.launch(&stream)?;
    /// // A second graph may begin_allocate_to_pool(0, id, ..) again and share the pool.
    /// drop(graph);
    /// allocator.release_pool(0, id).await?; // once the graphs are gone, once per begin
    /// allocator.empty_cache().await?; // gives the pool's memory back to the device
    /// assert_eq!(allocator.release_pool(0, id).await, Err(Error::UnknownPool(id)));
    /// assert!(matches!(allocator.pool_stats(0, id), Err(Error::UnknownPool(_)))); // stats per pool, per device
    /// # Ok(()) }
    /// ```
    pub async fn begin_allocate_to_pool(
        &self,
        device: usize,
        pool: PoolId,
        filter: impl Fn(&R::Stream) -> bool + Send + Sync + 'static,
    ) -> Result<(), Error> {
        let engine = self.engine(device)?;
        engine.begin_allocate_to_pool(pool, Arc::new(filter)).await
    }

    /// Stops routing device `device`'s requests into `pool` (call it once the capture has
    /// ended). Errors: [`Error::NoSuchDevice`], [`Error::PoolNotCapturing`].
    pub async fn end_allocate_to_pool(&self, device: usize, pool: PoolId) -> Result<(), Error> {
        self.engine(device)?.end_allocate_to_pool(pool).await
    }

    /// Drops one use of `pool` on device `device`; once none is left, `empty_cache` gives its
    /// memory back, kept blocks included. Call it only once the graphs that use the pool are
    /// gone. Errors: [`Error::NoSuchDevice`], [`Error::UnknownPool`],
    /// [`Error::PoolAlreadyReleased`], and [`Error::PoolCapturing`] for the last use while a
    /// capture still allocates to it.
    pub async fn release_pool(&self, device: usize, pool: PoolId) -> Result<(), Error> {
        self.engine(device)?.release_pool(pool).await
    }

    /// [`DeviceAllocator::begin_allocate_to_pool`] for threads outside the tokio runtime
    /// ([`Error::WouldDeadlock`] where blocking would deadlock).
    pub fn begin_allocate_to_pool_blocking(
        &self,
        device: usize,
        pool: PoolId,
        filter: impl Fn(&R::Stream) -> bool + Send + Sync + 'static,
    ) -> Result<(), Error> {
        let call = (
            "begin_allocate_to_pool_blocking",
            "begin_allocate_to_pool(..).await",
        );
        blocking::call(call, self.begin_allocate_to_pool(device, pool, filter))?
    }

    /// [`DeviceAllocator::end_allocate_to_pool`] for threads outside the tokio runtime.
    pub fn end_allocate_to_pool_blocking(&self, device: usize, pool: PoolId) -> Result<(), Error> {
        let call = (
            "end_allocate_to_pool_blocking",
            "end_allocate_to_pool(..).await",
        );
        blocking::call(call, self.end_allocate_to_pool(device, pool))?
    }

    /// [`DeviceAllocator::release_pool`] for threads outside the tokio runtime.
    pub fn release_pool_blocking(&self, device: usize, pool: PoolId) -> Result<(), Error> {
        let call = ("release_pool_blocking", "release_pool(..).await");
        blocking::call(call, self.release_pool(device, pool))?
    }

    /// The capture pools alive on device `device` (begun, and not yet freed by an
    /// `empty_cache` after their last release).
    pub fn pools(&self, device: usize) -> Result<Vec<PoolId>, Error> {
        Ok(self.engine(device)?.pools())
    }

    /// Statistics of capture pool `pool` on device `device`, with the keys of
    /// `torch.cuda.memory_stats()`. Errors: [`Error::NoSuchDevice`],
    /// [`Error::DefaultPoolId`] (the device's statistics are [`DeviceAllocator::stats`]), and
    /// [`Error::UnknownPool`] for a pool that is not alive on that device.
    pub fn pool_stats(&self, device: usize, pool: PoolId) -> Result<DeviceStats, Error> {
        let engine = self.engine(device)?;
        if pool.is_default() {
            return Err(Error::DefaultPoolId);
        }
        engine
            .pool_device_stats(pool)
            .ok_or(Error::UnknownPool(pool))
    }
}
