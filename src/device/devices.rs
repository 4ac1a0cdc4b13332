//! Each device's engine, started at the device's first use: a process that works on one GPU
//! of several holds no context, memory, actors or address range on the others (with
//! `torchrun`, every rank sees every GPU of the host and uses one).
//!
//! Owns the recipe that starts a device's engine (the builder's settings), the started
//! engines with their device's size, and the settings made for every device (history,
//! observers, free-memory callbacks): those apply to the engines started and are kept for
//! the ones that start later. Starting and applying an every-device setting take one lock,
//! so that no engine misses a setting made while it started.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use crate::actors::{
    blocking, DeviceFit, Engine, EngineBuilder, Error, HistoryContext, SizePolicy,
};

use super::allocator::fraction_of;
use super::runtime::DeviceRuntime;
use crate::config::DeviceConfig;

/// How the cap of each device is set.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Cap {
    None,
    Bytes(usize),
    Fraction(f64),
}

/// What starts a device's engine: the builder's settings.
pub(crate) struct Recipe<R: DeviceRuntime> {
    pub(crate) runtime: Arc<R>,
    pub(crate) config: DeviceConfig,
    pub(crate) cap: Cap,
    pub(crate) policy: Option<Arc<dyn SizePolicy>>,
    pub(crate) lend_between_streams: bool,
    pub(crate) alloc_timeout: Option<Duration>,
    pub(crate) shards: Option<usize>,
    pub(crate) handle: tokio::runtime::Handle,
}

/// A started device: its engine, and its memory in bytes (no request larger is tried).
pub(crate) struct Device<R: DeviceRuntime> {
    pub(crate) engine: Engine<R>,
    pub(crate) total: usize,
}

/// An observer or callback attached to every device's engine.
type Attached<R> = Arc<dyn Fn(&Engine<R>) + Send + Sync>;

/// The settings made for every device so far, in order.
struct Everywhere<R: DeviceRuntime> {
    /// The last `record_history` call's arguments.
    history: Option<(bool, usize, HistoryContext)>,
    /// Observers and callbacks, each attached once to every engine.
    attached: Vec<Attached<R>>,
    /// The annotations made while history was on (the last `max_entries`), for the devices
    /// that start later: recorded there first thing, at their start's time.
    annotations: VecDeque<Arc<str>>,
}

/// The devices of one allocator.
pub(crate) struct Devices<R: DeviceRuntime> {
    recipe: Recipe<R>,
    slots: Box<[OnceLock<Device<R>>]>,
    everywhere: Mutex<Everywhere<R>>,
}

impl<R: DeviceRuntime> Recipe<R> {
    /// The policy the configuration describes: [`DeviceFit`] with its keys applied, its
    /// expandable range no larger than the device.
    fn device_policy(c: &DeviceConfig, total: usize) -> DeviceFit {
        let mut p = match c.roundup_power2_divisions_by_size {
            Some(table) => DeviceFit::default().roundup_power2_divisions_by_size(table),
            None => DeviceFit::default().roundup_power2_divisions(c.roundup_power2_divisions),
        }
        .arena_reserve(total.next_multiple_of(2 << 20).max(2 << 20));
        if !c.expandable_segments {
            p = p.separate_segments();
        }
        if let Some(m) = c.max_split_size {
            p = p.max_split_size(m);
        }
        if let Some(t) = c.garbage_collection_threshold {
            p = p.garbage_collection_threshold(t);
        }
        p = match c.reserve_cap {
            Some(x) => p.reserve_cap(x),
            None => p.keep_free_memory(),
        };
        p.thread_cache(c.thread_cache)
    }

    /// Starts device `d`'s engine: its actors (on the tokio runtime), its cap, statistics
    /// and history.
    fn start(&self, d: usize) -> Result<Device<R>, Error> {
        let (_, total) = self.runtime.device_memory_info(d)?;
        let limit = match self.cap {
            Cap::None => match self.config.memory_fraction {
                Some(f) => Some(fraction_of(f, total)?),
                None => None,
            },
            Cap::Bytes(b) => Some(b),
            Cap::Fraction(f) => Some(fraction_of(f, total)?),
        };
        let policy: Arc<dyn SizePolicy> = match &self.policy {
            Some(p) => p.clone(),
            None => Arc::new(Self::device_policy(&self.config, total)),
        };
        let mut b = EngineBuilder::new(self.runtime.clone(), self.runtime.device_memory(d)?)
            .policy(policy)
            .stream_ordered(true)
            .lend_between_streams(self.lend_between_streams)
            .device_stats(self.config.max_split_size.unwrap_or(usize::MAX))
            .linger(self.config.linger)
            .handle(self.handle.clone());
        if let Some(l) = limit {
            b = b.max_bytes(l);
        }
        if let Some(t) = self.alloc_timeout {
            b = b.alloc_timeout(t);
        }
        if let Some(s) = self.shards {
            b = b.shards(s);
        }
        Ok(Device {
            engine: b.build()?,
            total,
        })
    }
}

impl<R: DeviceRuntime> Devices<R> {
    /// The runtime's devices, none started.
    pub(crate) fn new(recipe: Recipe<R>) -> Self {
        let count = recipe.runtime.device_count();
        Self {
            recipe,
            slots: (0..count).map(|_| OnceLock::new()).collect(),
            everywhere: Mutex::new(Everywhere {
                history: None,
                attached: Vec::new(),
                annotations: VecDeque::new(),
            }),
        }
    }

    /// How many devices there are.
    pub(crate) fn count(&self) -> usize {
        self.slots.len()
    }

    fn everywhere(&self) -> MutexGuard<'_, Everywhere<R>> {
        // The settings stay consistent whatever panicked while they were held.
        self.everywhere.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn slot(&self, device: usize) -> Result<&OnceLock<Device<R>>, Error> {
        self.slots.get(device).ok_or(Error::NoSuchDevice {
            ordinal: device,
            count: self.slots.len(),
        })
    }

    /// Device `device`, started now if it was not ([`Error::NoSuchDevice`] past the last;
    /// a failed start is tried again at the next call).
    pub(crate) fn get(&self, device: usize) -> Result<&Device<R>, Error> {
        let slot = self.slot(device)?;
        if let Some(d) = slot.get() {
            return Ok(d);
        }
        let everywhere = self.everywhere();
        if let Some(d) = slot.get() {
            return Ok(d);
        }
        // The driver calls take milliseconds: off the worker where they can be.
        let started = blocking::stall(|| self.recipe.start(device))?;
        if let Some((enabled, max, context)) = everywhere.history {
            started.engine.record_history(enabled, max, context)?;
        }
        for attach in &everywhere.attached {
            attach(&started.engine);
        }
        for name in &everywhere.annotations {
            started.engine.record_annotation(name);
        }
        Ok(slot.get_or_init(|| started))
    }

    /// Device `device` if it has started (`None` if not), without starting it.
    pub(crate) fn started(&self, device: usize) -> Result<Option<&Device<R>>, Error> {
        Ok(self.slot(device)?.get())
    }

    /// The engines started so far, by ordinal.
    pub(crate) fn engines(&self) -> impl Iterator<Item = &Engine<R>> {
        self.slots.iter().filter_map(|s| s.get().map(|d| &d.engine))
    }

    /// The history setting in force for every device (`None`: never set).
    pub(crate) fn history_setting(&self) -> Option<(bool, usize, HistoryContext)> {
        self.everywhere().history
    }

    /// Turns history recording on or off on every device, started or not.
    pub(crate) fn record_history(
        &self,
        enabled: bool,
        max_entries: usize,
        context: HistoryContext,
    ) -> Result<(), Error> {
        let mut everywhere = self.everywhere();
        for e in self.engines() {
            e.record_history(enabled, max_entries, context)?;
        }
        everywhere.history = Some((enabled, max_entries, context));
        Ok(())
    }

    /// Adds a `UserDefined` entry named `name` to every device's history: now on the
    /// devices started, at their start on the others.
    pub(crate) fn annotate(&self, name: &str) {
        let mut everywhere = self.everywhere();
        for e in self.engines() {
            e.record_annotation(name);
        }
        if let Some((true, max_entries, _)) = everywhere.history {
            if everywhere.annotations.len() >= max_entries {
                everywhere.annotations.pop_front();
            }
            if max_entries > 0 {
                everywhere.annotations.push_back(Arc::from(name));
            }
        }
    }

    /// Attaches `f`'s observer or callback to every device's engine, started or not.
    pub(crate) fn attach(&self, f: impl Fn(&Engine<R>) + Send + Sync + 'static) {
        let mut everywhere = self.everywhere();
        for e in self.engines() {
            f(e);
        }
        everywhere.attached.push(Arc::new(f));
    }
}
