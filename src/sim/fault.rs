//! Fault injection: owns the per-call-site failure plans of one runtime (fail the next N
//! calls, or fail each with a probability) and counts the faults that fired.
//!
//! All state is atomics, so the runtime's hot calls check it without taking a lock.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::actors::RuntimeError;

use super::rng::AtomicXorShift;

/// A call of the `Runtime` trait that can be made to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultPoint {
    /// `SimRuntime::host_alloc` (and mapping expandable host memory).
    HostAlloc,
    /// `SimRuntime::host_free` (and unmapping; the memory stays allocated and live).
    HostFree,
    /// `Runtime::record_event` (no event is created).
    RecordEvent,
    /// `Runtime::query_event`.
    QueryEvent,
    /// Device memory: `alloc` and `map` of a simulated device (injected faults report
    /// out-of-memory, as the driver does when the device is full).
    DeviceAlloc,
    /// Device memory: `free` and `unmap` (the memory stays allocated).
    DeviceFree,
    /// `Runtime::stream_idle` (the freeing thread records an event instead).
    QueryStream,
}

/// How many fault points there are.
const POINTS: usize = 7;

impl FaultPoint {
    const ALL: [FaultPoint; POINTS] = [
        FaultPoint::HostAlloc,
        FaultPoint::HostFree,
        FaultPoint::RecordEvent,
        FaultPoint::QueryEvent,
        FaultPoint::DeviceAlloc,
        FaultPoint::DeviceFree,
        FaultPoint::QueryStream,
    ];

    fn index(self) -> usize {
        match self {
            FaultPoint::HostAlloc => 0,
            FaultPoint::HostFree => 1,
            FaultPoint::RecordEvent => 2,
            FaultPoint::QueryEvent => 3,
            FaultPoint::DeviceAlloc => 4,
            FaultPoint::DeviceFree => 5,
            FaultPoint::QueryStream => 6,
        }
    }

    fn op(self) -> &'static str {
        match self {
            FaultPoint::HostAlloc => "host_alloc",
            FaultPoint::HostFree => "host_free",
            FaultPoint::RecordEvent => "record_event",
            FaultPoint::QueryEvent => "query_event",
            FaultPoint::DeviceAlloc => "device_alloc",
            FaultPoint::DeviceFree => "device_free",
            FaultPoint::QueryStream => "stream_idle",
        }
    }
}

const PPM: u32 = 1_000_000;

/// The fault plan of one runtime; get it with [`SimRuntime::faults`](super::SimRuntime::faults).
///
/// A call fails if a "fail next" count is pending for its point (the count is used up one
/// per call), or else with the configured probability.
///
/// ```
/// use pinpool::sim::{FaultPoint, SimRuntime};
/// use pinpool::Runtime;
///
/// let sim = SimRuntime::new();
/// sim.faults().fail_next(FaultPoint::HostAlloc, 1);
/// let err = sim.host_alloc(4096).unwrap_err();
/// assert!(err.out_of_memory);
/// let mem = sim.host_alloc(4096).unwrap();
/// sim.host_free(mem).unwrap();
/// assert_eq!(sim.faults().injected(FaultPoint::HostAlloc), 1);
/// ```
pub struct Faults {
    fail_next: [AtomicU64; POINTS],
    panic_next: [AtomicU64; POINTS],
    probability_ppm: [AtomicU32; POINTS],
    injected: [AtomicU64; POINTS],
    host_alloc_oom: AtomicBool,
    rng: AtomicXorShift,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            fail_next: Default::default(),
            panic_next: Default::default(),
            probability_ppm: Default::default(),
            injected: Default::default(),
            host_alloc_oom: AtomicBool::new(true),
            rng: AtomicXorShift::new(0),
        }
    }
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Faults");
        for p in FaultPoint::ALL {
            d.field(p.op(), &self.fail_next[p.index()].load(Ordering::Relaxed));
        }
        d.finish_non_exhaustive()
    }
}

impl Faults {
    /// Makes the next `n` calls at `point` fail (adds to any count still pending).
    pub fn fail_next(&self, point: FaultPoint, n: u64) {
        self.fail_next[point.index()].fetch_add(n, Ordering::SeqCst);
    }

    /// Makes the next `n` calls at `point` panic, as a bug in a driver binding would: for
    /// tests that an actor dying turns into errors for its callers rather than a hang.
    pub fn panic_next(&self, point: FaultPoint, n: u64) {
        self.panic_next[point.index()].fetch_add(n, Ordering::SeqCst);
    }

    /// Makes each call at `point` fail with probability `p` (clamped to `0.0..=1.0`, with a
    /// resolution of one in a million; NaN counts as 0).
    pub fn fail_with_probability(&self, point: FaultPoint, p: f64) {
        let ppm = if p.is_nan() {
            0
        } else {
            (p.clamp(0.0, 1.0) * f64::from(PPM)).round() as u32
        };
        self.probability_ppm[point.index()].store(ppm, Ordering::SeqCst);
    }

    /// Reseeds the generator behind probabilistic faults.
    pub fn set_seed(&self, seed: u64) {
        self.rng.reseed(seed);
    }

    /// Whether injected `host_alloc` faults report out-of-memory (default `true`).
    pub fn set_host_alloc_out_of_memory(&self, oom: bool) {
        self.host_alloc_oom.store(oom, Ordering::SeqCst);
    }

    /// Cancels every pending count and probability (fired counts are kept).
    pub fn clear(&self) {
        for p in FaultPoint::ALL {
            self.fail_next[p.index()].store(0, Ordering::SeqCst);
            self.panic_next[p.index()].store(0, Ordering::SeqCst);
            self.probability_ppm[p.index()].store(0, Ordering::SeqCst);
        }
    }

    /// How many faults have fired at `point`.
    pub fn injected(&self, point: FaultPoint) -> u64 {
        self.injected[point.index()].load(Ordering::SeqCst)
    }

    /// Decides whether this call at `point` fails; if so, returns the error to report.
    pub(crate) fn check(&self, point: FaultPoint) -> Result<(), RuntimeError> {
        let i = point.index();
        if self.panic_next[i]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            self.injected[i].fetch_add(1, Ordering::SeqCst);
            panic!("injected panic in {}", point.op());
        }
        let counted = self.fail_next[i]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let fires = counted || {
            let ppm = self.probability_ppm[i].load(Ordering::Relaxed);
            ppm > 0 && self.rng.below(u64::from(PPM)) < u64::from(ppm)
        };
        if !fires {
            return Ok(());
        }
        self.injected[i].fetch_add(1, Ordering::SeqCst);
        let message = "injected fault";
        let oom = match point {
            FaultPoint::HostAlloc => self.host_alloc_oom.load(Ordering::SeqCst),
            FaultPoint::DeviceAlloc => true,
            _ => false,
        };
        if oom {
            Err(RuntimeError::out_of_memory(point.op(), message))
        } else {
            Err(RuntimeError::new(point.op(), message))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fail_next_fires_exactly_n_times_then_stops() {
        let f = Faults::default();
        f.fail_next(FaultPoint::QueryEvent, 3);
        let results: Vec<bool> = (0..5)
            .map(|_| f.check(FaultPoint::QueryEvent).is_err())
            .collect();
        assert_eq!(results, [true, true, true, false, false]);
        assert_eq!(f.injected(FaultPoint::QueryEvent), 3);
        assert!(f.check(FaultPoint::HostAlloc).is_ok());
    }

    #[test]
    fn panic_next_panics_exactly_n_times() {
        let f = Faults::default();
        f.panic_next(FaultPoint::QueryEvent, 1);
        let r = std::panic::catch_unwind(|| f.check(FaultPoint::QueryEvent));
        assert!(r.is_err());
        assert!(f.check(FaultPoint::QueryEvent).is_ok());
        assert_eq!(f.injected(FaultPoint::QueryEvent), 1);
    }

    #[test]
    fn host_alloc_faults_report_out_of_memory_unless_turned_off() {
        let f = Faults::default();
        f.fail_next(FaultPoint::HostAlloc, 2);
        assert!(f.check(FaultPoint::HostAlloc).unwrap_err().out_of_memory);
        f.set_host_alloc_out_of_memory(false);
        assert!(!f.check(FaultPoint::HostAlloc).unwrap_err().out_of_memory);
        f.fail_next(FaultPoint::HostFree, 1);
        assert!(!f.check(FaultPoint::HostFree).unwrap_err().out_of_memory);
    }

    #[test]
    fn probability_one_always_fails_zero_never_and_clear_stops_it() {
        let f = Faults::default();
        f.fail_with_probability(FaultPoint::RecordEvent, 1.0);
        assert!((0..50).all(|_| f.check(FaultPoint::RecordEvent).is_err()));
        f.fail_with_probability(FaultPoint::RecordEvent, 0.0);
        assert!((0..50).all(|_| f.check(FaultPoint::RecordEvent).is_ok()));
        f.fail_with_probability(FaultPoint::RecordEvent, 1.0);
        f.clear();
        assert!(f.check(FaultPoint::RecordEvent).is_ok());
        assert_eq!(f.injected(FaultPoint::RecordEvent), 50);
    }

    #[test]
    fn probability_one_half_fails_roughly_half_the_calls() {
        let f = Faults::default();
        f.set_seed(42);
        f.fail_with_probability(FaultPoint::HostFree, 0.5);
        let fails = (0..10_000)
            .filter(|_| f.check(FaultPoint::HostFree).is_err())
            .count();
        assert!((4_000..6_000).contains(&fails), "{fails}");
    }
}
