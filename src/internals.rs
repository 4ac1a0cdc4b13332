//! The engine under an allocator, for tools and tests that check its books.
//!
//! Nothing here is needed to allocate, observe or configure: the allocators' own calls do
//! that. These functions hand out the `pinpool_actors` engine an allocator runs on, whose
//! calls (the size policy in force, every pool's inventory of reserved bytes, the
//! allocator's identity) follow the engine's releases, not this crate's.

use pinpool_actors::{Engine, Error};

use crate::device::{DeviceAllocator, DeviceRuntime};
use crate::{PinnedAllocator, Runtime};

/// The engine under a pinned-memory allocator.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), pinpool::Error> {
/// let pool = pinpool::PinnedAllocator::builder().build()?;
/// let engine = pinpool::internals::engine(&pool);
/// assert!(engine.inventory().await?.iter().all(|pool| pool.in_use_blocks == 0));
/// # Ok(()) }
/// ```
pub fn engine<R: Runtime>(allocator: &PinnedAllocator<R>) -> &Engine<R> {
    allocator.engine()
}

/// The engine of device `device` under a device-memory allocator
/// ([`Error::NoSuchDevice`] for a device it does not serve).
pub fn device_engine<R: DeviceRuntime>(
    allocator: &DeviceAllocator<R>,
    device: usize,
) -> Result<&Engine<R>, Error> {
    allocator.engine(device)
}
