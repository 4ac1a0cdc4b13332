//! Tuning and tools: the size policies and their knobs, and the engine under an allocator.
//!
//! Nothing here is needed to allocate, observe or configure: the allocators' own calls and
//! [`crate::config`] do that (a policy is chosen by name with `size_policy` in
//! `PINPOOL_CONF`). What is here is the engine's own vocabulary: the size policies ([`BestFit`], [`TieredPowerOfTwo`], [`PowerOfTwo`] for
//! pinned memory, [`DeviceFit`] for device memory) with the settings a builder's `policy`
//! call takes, the layout vocabulary they describe themselves with ([`BlockLayout`],
//! [`Carving`], [`SizeClass`]), and, through [`engine`] and [`device_engine`], the engine's
//! own calls (the policy in force, every pool's [`Inventory`] of reserved bytes, the memory
//! source, the allocator's identity) for tools and tests that check its books.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), pinpool::Error> {
//! use std::sync::Arc;
//! use pinpool::tuning::{self, BestFit};
//!
//! let allocator = pinpool::PinnedAllocator::builder()
//!     .policy(Arc::new(BestFit::default().separate_segments()))
//!     .build()?;
//! drop(allocator.alloc(4096).await?);
//! assert_eq!(tuning::engine(&allocator).policy().name(), "bestfit_segments");
//! let inventory = tuning::engine(&allocator).inventory().await?;
//! assert!(inventory.iter().all(|pool| pool.in_use_blocks == 0));
//! # Ok(()) }
//! ```

pub use crate::actors::{
    BestFit, BlockLayout, Carving, DeviceFit, Engine, Inventory, MemorySource, Origin, PowerOfTwo,
    RangeCall, SizeClass, SizePolicy, TieredPowerOfTwo,
};

use crate::actors::Error;

use crate::device::{DeviceAllocator, DeviceRuntime};
use crate::{PinnedAllocator, Runtime};

/// The engine under a pinned-memory allocator.
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
