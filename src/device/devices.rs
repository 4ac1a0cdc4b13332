//! Each device's engine, started at the device's first use: a process that works on one GPU
//! of several holds no context, memory, actors or address range on the others (with
//! `torchrun`, every rank sees every GPU of the host and uses one).
//!
//! Owns the recipe that starts a device's engine (the builder's settings), the started
//! engines with their device's size, and the settings made for every device (history,
//! observers, free-memory callbacks, annotations): those apply to the engines started and
//! are published whole for the ones that start later. No lock: a setter publishes, then
//! applies to the engines published; a starting engine catches up before it is published and
//! again after, with per-engine counts that apply each observer and annotation once (see
//! `Devices::get`).

use std::collections::VecDeque;
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::actors::{
    blocking, DeviceFit, Engine, EngineBuilder, Error, HistorySetting, SizePolicy,
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

/// A started device: its engine, its memory in bytes (no request larger is tried), and how
/// far the engine has caught up with the settings made for every device.
pub(crate) struct Device<R: DeviceRuntime> {
    pub(crate) engine: Engine<R>,
    pub(crate) total: usize,
    /// How many of `Everywhere::attached` are attached to the engine.
    attached: AtomicUsize,
    /// The number of the next annotation the engine records.
    annotated: AtomicU64,
}

/// An observer or callback attached to every device's engine.
type Attached<R> = Arc<dyn Fn(&Engine<R>) + Send + Sync>;

/// The settings made for every device so far, published whole: each change publishes a new
/// one.
struct Everywhere<R: DeviceRuntime> {
    /// The last `record_history` call's setting, as an engine started later takes it (its
    /// `clear` was applied once, at the call).
    history: Option<HistorySetting>,
    /// Observers and callbacks, each attached once to every engine, in order.
    attached: Vec<Attached<R>>,
    /// The annotations made while history was on (the last `max_entries`), numbered from
    /// `first_annotation`: each engine records each once, those made before its start first
    /// thing, at its start's time.
    annotations: VecDeque<Arc<str>>,
    first_annotation: u64,
}

impl<R: DeviceRuntime> Clone for Everywhere<R> {
    fn clone(&self) -> Self {
        Self {
            history: self.history,
            attached: self.attached.clone(),
            annotations: self.annotations.clone(),
            first_annotation: self.first_annotation,
        }
    }
}

/// The devices of one allocator.
pub(crate) struct Devices<R: DeviceRuntime> {
    recipe: Recipe<R>,
    slots: Box<[OnceLock<Device<R>>]>,
    everywhere: ArcSwap<Everywhere<R>>,
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
            attached: AtomicUsize::new(0),
            annotated: AtomicU64::new(0),
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
            everywhere: ArcSwap::from_pointee(Everywhere {
                history: None,
                attached: Vec::new(),
                annotations: VecDeque::new(),
                first_annotation: 0,
            }),
        }
    }

    /// How many devices there are.
    pub(crate) fn count(&self) -> usize {
        self.slots.len()
    }

    fn slot(&self, device: usize) -> Result<&OnceLock<Device<R>>, Error> {
        self.slots.get(device).ok_or(Error::NoSuchDevice {
            ordinal: device,
            count: self.slots.len(),
        })
    }

    /// Device `device`, started now if it was not ([`Error::NoSuchDevice`] past the last;
    /// a failed start is tried again at the next call).
    ///
    /// No lock: a new engine catches up with the settings made for every device before it
    /// is published, and again after (a setting made meanwhile, which a setter applies
    /// only to the engines published, is not missed). Two threads that start one device at
    /// once each start an engine; the one published first stays, the other closes.
    pub(crate) fn get(&self, device: usize) -> Result<&Device<R>, Error> {
        let slot = self.slot(device)?;
        if let Some(d) = slot.get() {
            return Ok(d);
        }
        // The driver calls take milliseconds: off the worker where they can be.
        let started = blocking::stall(|| self.recipe.start(device))?;
        self.catch_up(&started)?;
        // Published unless another thread's engine was first (then this one is dropped).
        let d = slot.get_or_init(|| started);
        self.catch_up(d)?;
        Ok(d)
    }

    /// Brings `d`'s engine up to the settings made for every device: applies the history
    /// setting, attaches what it lacks and records the annotations it has not (each once,
    /// whoever else catches it up at the same time), until the settings it applied are the
    /// ones in force.
    fn catch_up(&self, d: &Device<R>) -> Result<(), Error> {
        loop {
            let now = self.everywhere.load_full();
            // History first: an engine records annotations only while it is on.
            if let Some(setting) = now.history {
                d.engine.record_history(setting)?;
            }
            self.attach_pending(d, &now);
            self.annotate_pending(d, &now);
            fence(Ordering::SeqCst);
            if Arc::ptr_eq(&now, &self.everywhere.load_full()) {
                return Ok(());
            }
        }
    }

    /// Attaches to `d`'s engine, once each, the observers of `now` it lacks.
    fn attach_pending(&self, d: &Device<R>, now: &Everywhere<R>) {
        loop {
            let i = d.attached.load(Ordering::SeqCst);
            if i >= now.attached.len() {
                return;
            }
            if d.attached
                .compare_exchange(i, i + 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                now.attached[i](&d.engine);
            }
        }
    }

    /// Records on `d`'s engine, once each, the annotations of `now` it has not.
    fn annotate_pending(&self, d: &Device<R>, now: &Everywhere<R>) {
        let end = now.first_annotation + now.annotations.len() as u64;
        loop {
            let n = d.annotated.load(Ordering::SeqCst);
            let next = n.max(now.first_annotation);
            if next >= end {
                return;
            }
            if d.annotated
                .compare_exchange(n, next + 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                let name = &now.annotations[(next - now.first_annotation) as usize];
                d.engine.record_annotation(name);
            }
        }
    }

    /// Publishes `change` made to the settings for every device, then hands each device
    /// published by then to `apply` (a device that starts meanwhile catches up itself).
    fn publish(&self, change: impl Fn(&mut Everywhere<R>), mut apply: impl FnMut(&Device<R>)) {
        self.everywhere.rcu(|now| {
            let mut next = Everywhere::clone(now);
            change(&mut next);
            next
        });
        fence(Ordering::SeqCst);
        for d in self.slots.iter().filter_map(|s| s.get()) {
            apply(d);
        }
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
    pub(crate) fn history_setting(&self) -> Option<HistorySetting> {
        self.everywhere.load().history
    }

    /// Turns history recording on or off on every device, started or not
    /// ([`Error::EmptyHistoryRing`] for recording into a ring of no entries; nothing changes;
    /// a device not started has nothing to clear).
    pub(crate) fn record_history(&self, setting: HistorySetting) -> Result<(), Error> {
        if setting.enabled && setting.max_entries == 0 {
            return Err(Error::EmptyHistoryRing);
        }
        let mut res = Ok(());
        self.publish(
            |e| e.history = Some(setting.kept()),
            |d| {
                if let Err(err) = d.engine.record_history(setting) {
                    res = Err(err);
                }
            },
        );
        res
    }

    /// Adds a `UserDefined` entry named `name` to every device's history: now on the
    /// devices started, at their start on the others.
    pub(crate) fn annotate(&self, name: &str) {
        let Some(HistorySetting {
            enabled: true,
            max_entries,
            ..
        }) = self.history_setting()
        else {
            // Recording is off: the started engines ignore it, the others never see it.
            return;
        };
        let name: Arc<str> = Arc::from(name);
        self.publish(
            |e| {
                e.annotations.push_back(name.clone());
                while e.annotations.len() > max_entries {
                    e.annotations.pop_front();
                    e.first_annotation += 1;
                }
            },
            |d| self.annotate_pending(d, &self.everywhere.load()),
        );
    }

    /// Attaches `f`'s observer or callback to every device's engine, started or not.
    pub(crate) fn attach(&self, f: impl Fn(&Engine<R>) + Send + Sync + 'static) {
        let f: Attached<R> = Arc::new(f);
        self.publish(
            |e| e.attached.push(f.clone()),
            |d| self.attach_pending(d, &self.everywhere.load()),
        );
    }
}
