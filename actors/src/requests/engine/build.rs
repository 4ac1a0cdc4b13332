//! Building an engine: the settings, and the start of its actors (history and observers,
//! the event poller, the default pool, the router).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{Engine, EngineInner};
use crate::actors::poller::start_poller;
use crate::actors::pool::{start_pool, DEFAULT_LINGER};
use crate::actors::router::{start_router, Routes};
use crate::books::budget::Budget;
use crate::books::home::PoolSettings;
use crate::statistics::peaks::Ledger;
use crate::vocab::error::Error;
use crate::vocab::memory::MemorySource;
use crate::vocab::policy::{BestFit, SizePolicy};
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::Runtime;
use crate::vocab::shard::default_shard_count;

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// Configures and starts an [`Engine`].
pub struct EngineBuilder<R: Runtime> {
    runtime: Arc<R>,
    memory: Arc<dyn MemorySource>,
    policy: Arc<dyn SizePolicy>,
    handle: Option<tokio::runtime::Handle>,
    shards: Option<usize>,
    max_bytes: Option<usize>,
    alloc_timeout: Option<Duration>,
    stream_ordered: bool,
    lend_between_streams: bool,
    device_stats: Option<usize>,
    linger: Duration,
}

impl<R: Runtime> EngineBuilder<R> {
    /// An engine that orders reuse with `runtime`'s events and takes its memory from
    /// `memory`, with the best-fit size policy ([`BestFit`]).
    pub fn new(runtime: Arc<R>, memory: Arc<dyn MemorySource>) -> Self {
        Self {
            runtime,
            memory,
            policy: Arc::new(BestFit::default()),
            handle: None,
            shards: None,
            max_bytes: None,
            alloc_timeout: None,
            stream_ordered: false,
            lend_between_streams: false,
            device_stats: None,
            linger: DEFAULT_LINGER,
        }
    }

    /// Caps the bytes reserved by all pools together (default: no cap). A request
    /// that would pass the cap first has every cache emptied; if it still does not fit,
    /// `alloc` waits for buffers to come back and `try_alloc` fails. `build` refuses 0.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = Some(bytes);
        self
    }

    /// How long `alloc` waits for room under the cap before failing with
    /// [`Error::Timeout`] (default: as long as it takes).
    pub fn alloc_timeout(mut self, timeout: Duration) -> Self {
        self.alloc_timeout = Some(timeout);
        self
    }

    /// The size policy (default: [`BestFit`]).
    pub fn policy(mut self, policy: Arc<dyn SizePolicy>) -> Self {
        self.policy = policy;
        self
    }

    /// Gives every stream that allocates a pool of its own, whose blocks it owns (default:
    /// off). A block freed with no other stream recorded is reusable by its stream at once,
    /// with no event: the stream runs its work in order, so a later use of the block on it
    /// comes after every earlier one. Recording another stream on a block orders its reuse
    /// by an event, as always. This is how device memory is cached; host memory is not
    /// stream-ordered (the CPU may write a block the moment it is handed out).
    pub fn stream_ordered(mut self, on: bool) -> Self {
        self.stream_ordered = on;
        self
    }

    /// With [`Self::stream_ordered`] pools: a request that finds no room under the cap (or
    /// the driver out of memory) first borrows a block of memory another stream's pool holds
    /// (cached, or free in its mapped memory) before every cache is emptied (default: off
    /// here; `pinpool`'s `DeviceBuilder` turns it on). The block is handed over without the driver and without waiting: the requesting
    /// stream is made to wait for an event recorded on the lender's stream
    /// ([`crate::Runtime::stream_wait_event`]), and the block goes back to its own pool once
    /// the borrower's work on it has run. Needs a runtime that can order one stream after
    /// another's event; elsewhere nothing is borrowed.
    pub fn lend_between_streams(mut self, on: bool) -> Self {
        self.lend_between_streams = on;
        self
    }

    /// How long each pool actor stays awake after a request it answered for the next one (see
    /// `PoolActor::linger`; default [`DEFAULT_LINGER`]).
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// Keeps device statistics ([`crate::DeviceStats`], read with
    /// [`Engine::device_stats`]) beside the host ones, blocks above `max_split_size` bytes
    /// counting as oversize (`usize::MAX`: none). The cached path then also counts
    /// allocations and requested bytes by pool (small and large), a few more stores to the
    /// calling thread's own cache lines.
    pub fn device_stats(mut self, max_split_size: usize) -> Self {
        self.device_stats = Some(max_split_size);
        self
    }

    /// The tokio runtime the actors run on (default: the one this is called in).
    pub fn handle(mut self, handle: tokio::runtime::Handle) -> Self {
        self.handle = Some(handle);
        self
    }

    /// Number of thread shards for the ready holder and stats (rounded up to a power of two;
    /// default: twice the machine's parallelism, at most 64).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards.clamp(1, 1024).next_power_of_two());
        self
    }

    /// Spawns the actors.
    pub fn build(self) -> Result<Engine<R>, Error> {
        let handle = match self.handle {
            Some(h) => h,
            None => tokio::runtime::Handle::try_current().map_err(|_| Error::NoTokioRuntime)?,
        };
        if self.max_bytes == Some(0) {
            return Err(Error::InvalidLimit {
                reason: "a cap of 0 bytes leaves no room for any request".into(),
            });
        }
        let id = NEXT_ENGINE.fetch_add(1, Ordering::Relaxed);
        let shards = self.shards.unwrap_or_else(default_shard_count);
        let budget = Arc::new(Budget::new(
            self.max_bytes,
            self.alloc_timeout,
            shards,
            self.policy.name(),
        ));
        let classes = self.policy.num_classes();
        let layout = self.policy.layout();
        let history = crate::observation::history::start(&handle);
        let ledger = Arc::new(Ledger::new());
        let memory = self.memory.clone();
        let poller = start_poller(&handle);
        let router_budget = budget.clone();
        let settings = PoolSettings {
            runtime: self.runtime.clone(),
            memory,
            lends: self.lend_between_streams && self.stream_ordered,
            linger: self.linger,
            classes,
            shards,
            poller: poller.clone(),
            handle: handle.clone(),
            budget,
            history: history.clone(),
            layout,
            policy: self.policy.clone(),
            device_stats: self.device_stats,
            ledger: ledger.clone(),
        };
        let default = start_pool(&settings, PoolId::DEFAULT, None);
        let table = Arc::new(Routes::new());
        let router = start_router(table.clone(), router_budget, settings);
        tracing::debug!(
            engine = id,
            runtime = self.runtime.name(),
            memory = %self.memory.kind(),
            policy = self.policy.name(),
            shards,
            max_bytes = self.max_bytes,
            "allocator started"
        );
        Ok(Engine {
            inner: Arc::new(EngineInner {
                id,
                stream_ordered: self.stream_ordered,
                runtime: self.runtime,
                memory: self.memory,
                policy: self.policy,
                default,
                table,
                handle: handle.clone(),
                router,
                poller,
                history,
                ledger,
            }),
        })
    }
}
