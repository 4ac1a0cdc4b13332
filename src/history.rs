//! History, observers and the history page on the public face.
//!
//! Owns the `PinnedAllocator` calls that record and read the allocator's history (a bounded
//! ring kept by the history actor), attach observers (run by the observer task, never by an
//! actor or an allocation), and render the history as an HTML page ([`crate::report`]).
//! Keeps invariant 5: with history off, the cached path pays one relaxed load of a flag.

use crate::actors::{
    Error, History, HistoryContext, HistorySetting, OomReport, Runtime, TraceEntry,
};

use crate::allocator::PinnedAllocator;

impl<R: Runtime> PinnedAllocator<R> {
    /// Turns history recording on or off (like `torch.cuda.memory._record_memory_history`).
    ///
    /// While on, the allocator keeps the last `max_entries` [`TraceEntry`]s — allocations,
    /// frees requested and completed, segments taken and given back, OOMs, captures and
    /// annotations — with the call sites that `context` asks for. Turning it off keeps what
    /// was recorded. While off, the cached path pays one relaxed atomic load.
    /// [`Error::EmptyHistoryRing`] when asked to record into a ring of 0 entries.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use pinpool::{HistoryContext, PinnedAllocator, TraceAction};
    ///
    /// let allocator = PinnedAllocator::builder().build()?;
    /// allocator.record_history(true, 1000, HistoryContext::None)?;
    /// drop(allocator.alloc(4096).await?);
    /// let actions: Vec<TraceAction> = allocator.history().await?.entries.iter().map(|e| e.action).collect();
    /// // Fresh memory: the granule the block needs is mapped, then the block is cut from it.
    /// assert_eq!(actions, [TraceAction::SegmentMap, TraceAction::Alloc,
    ///                      TraceAction::FreeRequested, TraceAction::FreeCompleted]);
    /// # Ok(()) }
    /// ```
    pub fn record_history(
        &self,
        enabled: bool,
        max_entries: usize,
        context: HistoryContext,
    ) -> Result<(), Error> {
        self.engine()
            .record_history(HistorySetting::new(enabled, max_entries, context))
    }

    /// Whether history recording is on.
    pub fn is_history_enabled(&self) -> bool {
        self.engine().is_history_enabled()
    }

    /// Adds a `UserDefined` entry named `name` to the history, to mark a phase of the
    /// program in the trace and on the history page (nothing while history is off).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// # let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// allocator.record_history(true, 100, pinpool::HistoryContext::None)?;
    /// allocator.record_annotation("warm-up done");
    /// let h = allocator.history().await?;
    /// assert_eq!(h.entries[0].name.as_deref(), Some("warm-up done"));
    /// # Ok(()) }
    /// ```
    pub fn record_annotation(&self, name: &str) {
        self.engine().record_annotation(name)
    }

    /// The recorded history: a round trip to the history actor.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// # let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// let h = allocator.history().await?;
    /// assert!(!h.enabled && h.entries.is_empty());
    /// # Ok(()) }
    /// ```
    pub async fn history(&self) -> Result<History, Error> {
        self.engine().history().await
    }

    /// [`PinnedAllocator::history`] for threads outside the tokio runtime.
    ///
    /// ```
    /// # let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).build().unwrap();
    /// # let allocator = rt.block_on(async { pinpool::PinnedAllocator::builder().build() })?;
    /// allocator.record_history(true, 100, pinpool::HistoryContext::None)?;
    /// drop(allocator.alloc_blocking(64)?);
    /// assert_eq!(allocator.history_blocking()?.entries.len(), 4);
    /// # Ok::<(), pinpool::Error>(())
    /// ```
    pub fn history_blocking(&self) -> Result<History, Error> {
        crate::actors::blocking::call(
            ("history_blocking", "history().await"),
            self.engine().history(),
        )?
    }

    /// Calls `f` with every trace entry recorded while history is on.
    ///
    /// `f` runs on the observer task's blocking thread, never inside an actor or an
    /// allocation: a slow callback delays only later callbacks (entries that find the
    /// observer's queue full are dropped), a panic is caught and logged, and `f` may call the
    /// allocator (`stats`, `alloc_blocking`, ...).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::sync::Arc;
    ///
    /// let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// let seen = Arc::new(AtomicUsize::new(0));
    /// let counter = seen.clone();
    /// allocator.attach_trace_tracker(move |_entry| { counter.fetch_add(1, Ordering::Relaxed); });
    /// allocator.record_history(true, 100, pinpool::HistoryContext::None)?;
    /// drop(allocator.alloc(64).await?);
    /// while seen.load(Ordering::Relaxed) < 4 { tokio::task::yield_now().await; }
    /// # Ok(()) }
    /// ```
    pub fn attach_trace_tracker(&self, f: impl Fn(&TraceEntry) + Send + Sync + 'static) {
        self.engine().attach_trace_tracker(f)
    }

    /// Calls `f` with an [`OomReport`] for every request that fails for want of pinned
    /// memory (whether or not history is on). Runs like a trace tracker: on the observer
    /// task's blocking thread, panics caught.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// allocator.attach_oom_observer(|r| eprintln!("{} bytes wanted, {} reserved", r.requested, r.reserved));
    /// # Ok(()) }
    /// ```
    pub fn attach_oom_observer(&self, f: impl Fn(&OomReport) + Send + Sync + 'static) {
        self.engine().attach_oom_observer(f)
    }

    /// Attaches a free-memory callback (as PyTorch's free-memory callbacks): `f` frees what it
    /// can (drops buffers it holds, say) and returns whether it freed anything. It runs when
    /// a request finds no cached block that fits and no room under the cap or in the
    /// runtime, before the allocator empties its caches and gives up with
    /// [`Error::OutOfMemory`](crate::Error) (or, for `alloc`, waits); when it returns `true`
    /// the request is tried again first. It runs on the requesting thread or a blocking
    /// thread, never in an actor or while the allocator holds anything, once per refused
    /// request (so concurrently when several are refused at once), after the callbacks
    /// attached before it; a request made from inside a callback does not run them again. A
    /// panic in it is caught, counted ([`PinnedAllocator::free_memory_callback_panics`]), and
    /// counts as freeing nothing.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use pinpool::{PinnedAllocator, PinnedBuffer};
    ///
    /// let allocator = PinnedAllocator::builder().max_bytes(8 << 20).build()?;
    /// // Staging buffers kept around in case they are needed again, given up when memory
    /// // runs out.
    /// let (spare, spares) = flume::unbounded::<PinnedBuffer>();
    /// allocator.attach_free_memory_callback(move || spares.drain().count() > 0);
    /// spare.send(allocator.alloc(8 << 20).await?).unwrap();
    /// let buf = allocator.try_alloc(4 << 20).await?; // room made by the callback
    /// assert_eq!(allocator.free_memory_callback_calls(), 1);
    /// # Ok(()) }
    /// ```
    pub fn attach_free_memory_callback(&self, f: impl Fn() -> bool + Send + Sync + 'static) {
        self.engine()
            .attach_free_memory_callback(std::sync::Arc::new(f))
    }

    /// How many times free-memory callbacks were called.
    pub fn free_memory_callback_calls(&self) -> u64 {
        self.engine().free_memory_callback_calls()
    }

    /// How many free-memory callback calls panicked.
    pub fn free_memory_callback_panics(&self) -> u64 {
        self.engine().free_memory_callback_panics()
    }

    /// The history as a self-contained HTML page: reserved, in-use and waiting bytes over
    /// time per pool, and the largest allocations (see [`crate::report`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// # let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// allocator.record_history(true, 10_000, pinpool::HistoryContext::Alloc)?;
    /// let keep = allocator.alloc(1 << 20).await?;
    /// let page = allocator.history_html().await?;
    /// assert!(page.contains("Largest allocations"));
    /// # drop(keep);
    /// # Ok(()) }
    /// ```
    pub async fn history_html(&self) -> Result<String, Error> {
        let h = self.history().await?;
        Ok(crate::report::render_history_html(
            &h,
            self.runtime().name(),
        ))
    }
}
