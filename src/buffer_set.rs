//! `BufferSet`: a request's buffers — pinned and device, any number, each with its stream —
//! taken together, all or none.
//!
//! A server whose requests each need several buffers must not wait for one while it holds
//! the others: two requests that each hold part of what they need under a cap, and wait for
//! the rest, wait for ever. `BufferSet::alloc` never waits while it holds memory: it takes
//! every buffer or gives back what it took, and waits first come first served under the
//! caps of every allocator it spans until all of them fit. The protocol and its liveness
//! rule are in `docs/limits-and-waiting.md` ("A request's buffers, together") and in the
//! engine's `requests/engine/many.rs`.

use std::time::Duration;

use crate::actors::{alloc_many, alloc_many_blocking, Engine, Error, Lease, Wait, Want};

use crate::allocator::PinnedAllocator;
use crate::buffer::PinnedBuffer;
use crate::device::{DeviceAllocator, DeviceBuffer, DeviceRuntime};

/// One buffer of the set.
enum Item<'a, R: DeviceRuntime> {
    Pinned {
        engine: &'a Engine<R>,
        size: usize,
        stream: Option<&'a R::Stream>,
    },
    Device {
        engine: &'a Engine<R>,
        device: usize,
        size: usize,
        stream: &'a R::Stream,
    },
}

/// The buffers of one request, to be taken together: pinned buffers from
/// [`PinnedAllocator`]s and device buffers from [`DeviceAllocator`]s, any number of each.
///
/// [`BufferSet::alloc`] takes all of them or none. Under memory caps it waits, first come
/// first served, until all of them fit, and it never holds memory while it waits: so
/// requests that share the caps cannot deadlock, however many buffers each takes and
/// however many wait. A set larger than a cap, its buffers together, fails at once with
/// [`Error::OutOfMemory`] ([`crate::OomCause::ExceedsLimit`]; one larger than its device,
/// [`crate::OomCause::ExceedsDevice`]). No request waits for ever while the memory it needs
/// is free, cached, or held by buffers that will come back.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), pinpool::Error> {
/// use pinpool::{BufferSet, DeviceBuilder};
///
/// let host = pinpool::PinnedAllocator::builder().max_bytes(4 << 20).build()?;
/// let device = DeviceBuilder::new(host.runtime().clone()).max_bytes(8 << 20).build()?;
/// let stream = host.runtime().new_stream()?;
/// let taken = BufferSet::new()
///     .pinned(&host, 1 << 20) // the input, staged
///     .pinned(&host, 1 << 18) // the result
///     .device(&device, 1 << 20, &stream) // the input on the device
///     .device(&device, 2 << 20, &stream) // the activations
///     .alloc()
///     .await?;
/// assert_eq!(taken.pinned[1].len(), 1 << 18);
/// assert_eq!(taken.device[1].len(), 2 << 20);
///
/// // Larger than the pinned cap, its buffers together: refused at once.
/// let err = BufferSet::new().pinned(&host, 3 << 20).pinned(&host, 3 << 20).alloc().await;
/// assert!(matches!(err, Err(e) if e.never_fits()));
/// # Ok(()) }
/// ```
pub struct BufferSet<'a, R: DeviceRuntime> {
    items: Vec<Item<'a, R>>,
    wait: Wait,
    /// A buffer refused as it was added (larger than its device): the set's answer.
    refused: Option<Error>,
}

/// The buffers a [`BufferSet`] took, each kind in the order it was added.
pub struct TakenBuffers<R: DeviceRuntime> {
    /// The pinned buffers.
    pub pinned: Vec<PinnedBuffer<R>>,
    /// The device buffers.
    pub device: Vec<DeviceBuffer<R>>,
}

impl<R: DeviceRuntime> Default for BufferSet<'_, R> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a, R: DeviceRuntime> BufferSet<'a, R> {
    /// An empty set, that waits as long as the allocators' `alloc_timeout` says (the
    /// shortest of them; by default, as long as it takes).
    pub fn new() -> Self {
        Self {
            items: Vec::new(),
            wait: Wait::Default,
            refused: None,
        }
    }

    /// Adds `size` bytes of pinned memory from `pool`'s default pool.
    pub fn pinned(self, pool: &'a PinnedAllocator<R>, size: usize) -> Self {
        self.add_pinned(pool, size, None)
    }

    /// Adds `size` bytes of pinned memory from `pool` for work on `stream` (from a
    /// capture pool when a capture under way accepts the stream; see
    /// [`PinnedAllocator::alloc_on`]).
    pub fn pinned_on(
        self,
        pool: &'a PinnedAllocator<R>,
        size: usize,
        stream: &'a R::Stream,
    ) -> Self {
        self.add_pinned(pool, size, Some(stream))
    }

    fn add_pinned(
        mut self,
        pool: &'a PinnedAllocator<R>,
        size: usize,
        stream: Option<&'a R::Stream>,
    ) -> Self {
        let engine = pool.engine();
        self.items.push(Item::Pinned {
            engine,
            size,
            stream,
        });
        self
    }

    /// Adds `size` bytes of device memory from `pool`, for work on `stream` (on the
    /// stream's device, from the stream's pool: see [`DeviceAllocator::alloc`]).
    pub fn device(
        mut self,
        pool: &'a DeviceAllocator<R>,
        size: usize,
        stream: &'a R::Stream,
    ) -> Self {
        match pool.engine_of(stream, size) {
            Ok((device, engine)) => self.items.push(Item::Device {
                engine,
                device,
                size,
                stream,
            }),
            Err(e) => {
                self.refused.get_or_insert(e);
            }
        }
        self
    }

    /// Waits at most `timeout` for room ([`Error::Timeout`] after, nothing held).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.wait = Wait::Upto(timeout);
        self
    }

    /// Takes every buffer of the set, or none: waits first come first served under the
    /// caps until all of them fit (see [`BufferSet`]). Cancel-safe: dropping the future
    /// gives back every buffer taken so far and leaves no waiter behind.
    pub async fn alloc(self) -> Result<TakenBuffers<R>, Error> {
        let (items, wait) = self.ready()?;
        let leases = alloc_many(&wants(&items), wait).await?;
        Ok(wrap(&items, leases))
    }

    /// Takes every buffer of the set now, or none: never waits for buffers to come back
    /// (the caches are emptied first); no room is [`Error::OutOfMemory`] with
    /// [`crate::OomCause::NoRoomNow`].
    pub async fn try_alloc(mut self) -> Result<TakenBuffers<R>, Error> {
        self.wait = Wait::Never;
        self.alloc().await
    }

    /// [`BufferSet::alloc`] for threads outside the tokio runtime: blocks the calling thread
    /// on the async call. Where that would deadlock — on a thread that runs a
    /// current-thread runtime's tasks — it fails at once with [`Error::WouldDeadlock`]; on a
    /// multi-thread runtime's threads it blocks inside `block_in_place` (the rule is in
    /// [blocking calls](crate#blocking-calls)).
    pub fn alloc_blocking(self) -> Result<TakenBuffers<R>, Error> {
        let (items, wait) = self.ready()?;
        let call = ("BufferSet::alloc_blocking", "BufferSet::alloc(..).await");
        let leases = alloc_many_blocking(&wants(&items), wait, call)?;
        Ok(wrap(&items, leases))
    }

    /// The items, or the error of one refused as it was added.
    fn ready(self) -> Result<(Vec<Item<'a, R>>, Wait), Error> {
        match self.refused {
            Some(e) => Err(e),
            None => Ok((self.items, self.wait)),
        }
    }
}

fn wants<'a, R: DeviceRuntime>(items: &[Item<'a, R>]) -> Vec<Want<'a, R>> {
    items
        .iter()
        .map(|item| match *item {
            Item::Pinned {
                engine,
                size,
                stream,
            } => Want::new(engine, size, stream),
            Item::Device {
                engine,
                size,
                stream,
                ..
            } => Want::new(engine, size, Some(stream)),
        })
        .collect()
}

fn wrap<R: DeviceRuntime>(items: &[Item<'_, R>], leases: Vec<Lease<R>>) -> TakenBuffers<R> {
    let mut taken = TakenBuffers {
        pinned: Vec::new(),
        device: Vec::new(),
    };
    for (item, lease) in items.iter().zip(leases) {
        match item {
            Item::Pinned { .. } => taken.pinned.push(PinnedBuffer::new(lease)),
            Item::Device { device, stream, .. } => {
                taken
                    .device
                    .push(DeviceBuffer::new(lease, (*stream).clone(), *device))
            }
        }
    }
    taken
}
