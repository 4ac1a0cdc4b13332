//! Free-memory callbacks on device memory (PyTorch's `FreeMemoryCallback` registry): user
//! code that frees what it can when a request would otherwise run out of memory. The
//! callbacks are registered with every device's engine, whose miss path runs them (see
//! the engine's `free_memory`).

use std::sync::Arc;

use super::allocator::DeviceAllocator;
use super::runtime::DeviceRuntime;

impl<R: DeviceRuntime> DeviceAllocator<R> {
    /// Attaches `f` to every device: it frees what it can (drops buffers it holds, say) and
    /// returns whether it freed anything. It runs when a request finds no cached block that
    /// fits and the device (or the cap) has no room for fresh memory, before the allocator
    /// empties its caches and gives up with [`Error::OutOfMemory`](crate::Error); when it
    /// returns `true`, the request is tried again first. It runs on a blocking thread, never
    /// while the allocator holds anything, once per refused request (so concurrently when
    /// several are refused at once), after the callbacks attached before it; a request made
    /// from inside a callback does not run them again. A panic in it is caught and counted
    /// ([`DeviceAllocator::free_memory_callback_panics`]) and counts as freeing nothing.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use pinpool::{DeviceAllocator, DeviceBuffer};
    ///
    /// let allocator = DeviceAllocator::builder().max_bytes(8 << 20).build()?;
    /// let stream = allocator.runtime().new_stream()?;
    /// // Buffers kept around in case they are needed again, given up when memory runs out.
    /// let (spare, spares) = flume::unbounded::<DeviceBuffer>();
    /// allocator.attach_free_memory_callback(move || spares.drain().count() > 0);
    /// spare.send(allocator.alloc(8 << 20, &stream).await?).unwrap();
    /// let buf = allocator.try_alloc(4 << 20, &stream).await?; // room made by the callback
    /// assert_eq!(allocator.free_memory_callback_calls(), 1);
    /// assert_eq!(allocator.free_memory_callback_panics(), 0);
    /// # Ok(()) }
    /// ```
    pub fn attach_free_memory_callback(&self, f: impl Fn() -> bool + Send + Sync + 'static) {
        let f: crate::actors::FreeMemoryCallback = Arc::new(f);
        self.inner()
            .devices
            .attach(move |e| e.attach_free_memory_callback(f.clone()));
    }

    /// How many times free-memory callbacks were called, over every device.
    pub fn free_memory_callback_calls(&self) -> u64 {
        self.engines().map(|e| e.free_memory_callback_calls()).sum()
    }

    /// How many free-memory callback calls panicked, over every device.
    pub fn free_memory_callback_panics(&self) -> u64 {
        self.engines()
            .map(|e| e.free_memory_callback_panics())
            .sum()
    }
}
