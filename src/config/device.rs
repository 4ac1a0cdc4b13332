//! Configuration of device-memory allocation, parsed from `PINPOOL_DEVICE_CONF` in the
//! grammar of PyTorch's `PYTORCH_CUDA_ALLOC_CONF` (bracketed lists included), with its keys
//! and pinpool's own.
//!
//! Owns [`DeviceConfig`]. Every key is optional, and a string sets only the keys it names
//! (over the defaults, or over another configuration: [`DeviceConfig::merged`]); a malformed
//! string is a typed [`ConfigError`] naming the key or entry, never a panic and never an
//! ignored key. PyTorch's keys that concern what pinpool does not do (its pinned-memory
//! allocator, its allocator lock, its backends) are checked and have no effect, as
//! documented on [`DeviceConfig::KEYS`]; one pinpool cannot honour is
//! [`ConfigError::Unsupported`].

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::{grammar, ConfigError};
use crate::actors::DEFAULT_LINGER;

/// The environment variable [`DeviceConfig::from_env`] reads.
pub const DEVICE_ENV_VAR: &str = "PINPOOL_DEVICE_CONF";

/// Settings of the device allocator.
///
/// ```
/// use pinpool::config::DeviceConfig;
///
/// let c: DeviceConfig = "max_split_size_mb:256, roundup_power2_divisions:4".parse()?;
/// assert_eq!(c.max_split_size, Some(256 << 20));
/// assert_eq!(c.roundup_power2_divisions, 4);
/// assert!(c.expandable_segments);
/// assert_eq!(c.to_string().parse::<DeviceConfig>()?, c);
/// # Ok::<(), pinpool::config::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeviceConfig {
    /// Blocks above this size are never cut out of a larger free range, and free ranges
    /// above it are not split for smaller requests (key `max_split_size_mb`, in MiB, at
    /// least 20; `unlimited` by default): large blocks then cannot fragment memory that
    /// smaller ones need. They count as oversize in the statistics.
    pub max_split_size: Option<usize>,
    /// Requests above 1 MiB round up to one of this many steps per power of two (key
    /// `roundup_power2_divisions`: a power of two from 1 to 64; 0, the default, rounds to
    /// 512 bytes only): more reuse of freed blocks for requests of varying size, at the
    /// price of more bytes per block.
    pub roundup_power2_divisions: u32,
    /// The same per power-of-two interval of request sizes (PyTorch's list form,
    /// `roundup_power2_divisions:[256:1,>:4]`: 1 division below 256 MiB, 4 from there):
    /// entry `i` serves requests of [2^i MiB, 2^(i+1) MiB), the first also smaller ones, the
    /// last also larger ones. When set, used instead of `roundup_power2_divisions`.
    pub roundup_power2_divisions_by_size: Option<[u32; ROUNDUP_INTERVALS]>,
    /// Before fresh memory would take reserved bytes above this share of the memory limit,
    /// cached memory nobody uses goes back first (key `garbage_collection_threshold`,
    /// strictly between 0 and 1; only with a limit; off by default).
    pub garbage_collection_threshold: Option<f64>,
    /// Cut blocks out of one expandable range per pool and stream, mapped granule by
    /// granule (key `expandable_segments`, default `true`), rather than separate segments.
    pub expandable_segments: bool,
    /// Freed blocks up to this size stay with the threads that freed them, one of a size
    /// class per thread, for their next requests of that class without the pool actor (key
    /// `thread_cache_mb`, whole MiB; 0, the default: blocks above 1 MiB go back to the pool
    /// actor as they are freed). Fewer round trips on repeating patterns of large requests,
    /// with placements the actor did not choose (see `DeviceFit::thread_cache`).
    pub thread_cache: usize,
    /// Memory a pool maps but no block uses goes back once requests pause, while its
    /// reserved bytes are above this multiple of its peak of live bytes (key `reserve_cap`:
    /// a number, at least 1; default 1). Inside a burst of requests nothing goes back for
    /// it: a repeated step runs on the memory it mapped. `None` (`reserve_cap:none`) keeps
    /// such memory until `empty_cache` or a memory limit needs it.
    pub reserve_cap: Option<f64>,
    /// The longest a pool actor keeps polling for the next request after answering one
    /// (key `linger_us`, whole microseconds, at most 100 000; default 200). It polls for
    /// twice the recent gap between requests, up to this, and not at all when requests come
    /// on average further apart; a request that finds the actor parked waits for its thread
    /// to wake, tens of microseconds more (`device_bench`'s `dev_miss_us`).
    pub linger: Duration,
    /// Caps each device's reserved bytes at this share of its memory (key
    /// `per_process_memory_fraction`, in (0, 1]; none by default), as
    /// `torch.cuda.set_per_process_memory_fraction` and
    /// [`DeviceBuilder::memory_fraction`](crate::DeviceBuilder::memory_fraction) do (a cap
    /// the builder is given wins).
    pub memory_fraction: Option<f64>,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        Self {
            max_split_size: None,
            roundup_power2_divisions: 0,
            roundup_power2_divisions_by_size: None,
            garbage_collection_threshold: None,
            expandable_segments: true,
            thread_cache: 0,
            reserve_cap: Some(DEFAULT_RESERVE_CAP),
            linger: DEFAULT_LINGER,
            memory_fraction: None,
        }
    }
}

/// Intervals of request sizes that `roundup_power2_divisions`' list form sets: powers of two
/// from 1 MiB to 32 GiB and above (PyTorch's too).
pub const ROUNDUP_INTERVALS: usize = 16;
const _: () = assert!(ROUNDUP_INTERVALS == crate::actors::DIVISION_INTERVALS);

/// The reserve cap when the key is not given (the device policy's own).
const DEFAULT_RESERVE_CAP: f64 = 1.0;

/// Whether `x` is a reserve cap the `reserve_cap` key takes: finite, and at least 1.
fn valid_reserve_cap(x: f64) -> bool {
    x >= 1.0 && x.is_finite()
}

/// The longest linger the `linger_us` key takes.
const MAX_LINGER: Duration = Duration::from_millis(100);

/// The smallest `max_split_size_mb` (PyTorch's minimum too).
const MIN_SPLIT_MIB: usize = 20;

/// The divisions per interval that the items of `roundup_power2_divisions`' list form give,
/// as PyTorch reads them: `MiB:d` sets `d` for every interval from the one the previous item
/// ended at (the first: from the smallest) up to the interval of `MiB`, exclusive; `>:d`
/// sets `d` from there to the last. Intervals no item reaches round to 512 bytes only, as
/// do those of 1 division (stored as 0).
/// `None` for a size or a count of divisions that is not a power of two, or divisions
/// above 64.
fn divisions_by_size(items: &[(&str, &str)]) -> Option<[u32; ROUNDUP_INTERVALS]> {
    let mut table = [0u32; ROUNDUP_INTERVALS];
    let mut from = 0;
    for &(size, divisions) in items {
        let d: u32 = divisions.parse().ok()?;
        if !d.is_power_of_two() || d > 64 {
            return None;
        }
        let to = if size == ">" {
            ROUNDUP_INTERVALS
        } else {
            let mib: u64 = size.parse().ok()?;
            if !mib.is_power_of_two() {
                return None;
            }
            (mib.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1)
        };
        // One division is no rounding, stored as 0 like the other form's default.
        let d = if d == 1 { 0 } else { d };
        for slot in table.iter_mut().take(to).skip(from) {
            *slot = d;
        }
        from = from.max(to);
    }
    Some(table)
}

impl DeviceConfig {
    /// Every key `PINPOOL_DEVICE_CONF` accepts: pinpool's (the first eight, in the order
    /// `Display` prints them), then PyTorch's keys that concern what pinpool does not do,
    /// checked and without effect: `backend` (`native` only: pinpool is the allocator),
    /// `release_lock_on_cudamalloc` (pinpool holds no lock around driver calls),
    /// `graph_capture_record_stream_reuse` (a free during a capture waits for the capture to
    /// end), and the `pinned_*` keys (PyTorch's pinned-memory allocator, which pinpool's
    /// device allocator does not replace; `PINPOOL_CONF` configures pinpool's). PyTorch's
    /// `max_non_split_rounding_mb` is known and refused ([`ConfigError::Unsupported`]).
    pub const KEYS: &'static [&'static str] = &[
        "max_split_size_mb",
        "roundup_power2_divisions",
        "garbage_collection_threshold",
        "expandable_segments",
        "thread_cache_mb",
        "reserve_cap",
        "linger_us",
        "per_process_memory_fraction",
        "backend",
        "release_lock_on_cudamalloc",
        "graph_capture_record_stream_reuse",
        "pinned_use_cuda_host_register",
        "pinned_use_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "max_non_split_rounding_mb",
    ];

    /// Reads [`DEVICE_ENV_VAR`] (`PINPOOL_DEVICE_CONF`); the defaults when it is unset.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::default().merged_with_env()
    }

    /// This configuration with the keys [`DEVICE_ENV_VAR`] (`PINPOOL_DEVICE_CONF`) names set
    /// (see [`DeviceConfig::merged`]); unchanged when it is unset.
    ///
    /// ```
    /// use pinpool::config::DeviceConfig;
    ///
    /// // A program's own defaults, which the variable overrides key by key.
    /// let defaults = DeviceConfig::default().with_thread_cache(256 << 20);
    /// let config = defaults.merged_with_env()?;
    /// # Ok::<(), pinpool::config::ConfigError>(())
    /// ```
    pub fn merged_with_env(self) -> Result<Self, ConfigError> {
        match std::env::var(DEVICE_ENV_VAR) {
            Ok(text) => self.merged(&text),
            Err(std::env::VarError::NotPresent) => Ok(self),
            Err(std::env::VarError::NotUnicode(_)) => Err(ConfigError::NotUnicode),
        }
    }

    /// This configuration with the keys `text` names set as they would be parsed, and every
    /// other setting kept; on an error, nothing is set.
    ///
    /// ```
    /// use pinpool::config::DeviceConfig;
    ///
    /// let base = DeviceConfig::default().with_thread_cache(256 << 20);
    /// let c = base.merged("expandable_segments:False")?;
    /// assert_eq!(c.thread_cache, 256 << 20); // kept
    /// assert!(!c.expandable_segments);
    /// # Ok::<(), pinpool::config::ConfigError>(())
    /// ```
    pub fn merged(mut self, text: &str) -> Result<Self, ConfigError> {
        for (key, value) in grammar::entries(text, Self::KEYS)? {
            self.set(key, value)?;
        }
        Ok(self)
    }

    /// Parses a `key:value,key:value` string; keys left out keep their defaults.
    ///
    /// ```
    /// use pinpool::config::{ConfigError, DeviceConfig};
    ///
    /// let err = "max_split_size_mb:4".parse::<DeviceConfig>().unwrap_err();
    /// assert!(matches!(err, ConfigError::InvalidValue { .. }));
    /// ```
    pub(crate) fn parse(text: &str) -> Result<Self, ConfigError> {
        Self::default().merged(text)
    }

    fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let invalid = |expected: &'static str| invalid_value(key, value, expected);
        match key {
            "max_split_size_mb" => self.max_split_size = max_split_size(value).map_err(invalid)?,
            "roundup_power2_divisions" => self.set_roundup_power2_divisions(key, value)?,
            "garbage_collection_threshold" => {
                self.garbage_collection_threshold = Some(gc_threshold(value).map_err(invalid)?)
            }
            "expandable_segments" => {
                self.expandable_segments =
                    grammar::parse_bool(value).ok_or_else(|| invalid("a boolean"))?
            }
            "thread_cache_mb" => self.thread_cache = thread_cache(value).map_err(invalid)?,
            "reserve_cap" => self.reserve_cap = reserve_cap(value).map_err(invalid)?,
            "linger_us" => self.linger = linger(value).map_err(invalid)?,
            "per_process_memory_fraction" => {
                self.memory_fraction = Some(memory_fraction(value).map_err(invalid)?)
            }
            "backend"
            | "release_lock_on_cudamalloc"
            | "graph_capture_record_stream_reuse"
            | "pinned_use_cuda_host_register"
            | "pinned_use_host_register"
            | "pinned_use_background_threads"
            | "pinned_num_register_threads"
            | "pinned_reserve_segment_size_mb" => check_only(key, value).map_err(invalid)?,
            "max_non_split_rounding_mb" => {
                return Err(ConfigError::Unsupported {
                    key: key.to_owned(),
                    reason: "pinpool does not hand a cached block above max_split_size_mb to a \
                             smaller request; leave the key out",
                })
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    key: key.to_owned(),
                    valid: Self::KEYS,
                })
            }
        }
        Ok(())
    }

    /// Sets `roundup_power2_divisions` (one number for every size) or, in the list form,
    /// `roundup_power2_divisions_by_size`; one form set clears the other's table.
    fn set_roundup_power2_divisions(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        match grammar::list_items(key, value) {
            Some(items) => {
                self.roundup_power2_divisions_by_size =
                    Some(divisions_by_size(&items?).ok_or_else(|| {
                        invalid_value(
                            key,
                            value,
                            "a list of `MiB:divisions` items (sizes and divisions powers \
                             of two, divisions at most 64; `>` for all larger sizes)",
                        )
                    })?);
            }
            None => {
                const EXPECTED: &str =
                    "0, a power of two from 1 to 64, or a list such as [256:1,>:4]";
                let d: u32 = value
                    .parse()
                    .map_err(|_| invalid_value(key, value, EXPECTED))?;
                if d > 64 || (d > 0 && !d.is_power_of_two()) {
                    return Err(invalid_value(key, value, EXPECTED));
                }
                self.roundup_power2_divisions = d;
                self.roundup_power2_divisions_by_size = None;
            }
        }
        Ok(())
    }
}

/// The error of a key whose value is not of the `expected` form.
fn invalid_value(key: &str, value: &str, expected: &'static str) -> ConfigError {
    ConfigError::InvalidValue {
        key: key.to_owned(),
        value: value.to_owned(),
        expected,
    }
}

// The keys' values, each parsed into the setting it stores; an error is the form expected.

/// `max_split_size_mb`: `unlimited`, or whole MiB, at least the minimum.
fn max_split_size(value: &str) -> Result<Option<usize>, &'static str> {
    const EXPECTED: &str = "`unlimited` or a whole number of MiB, at least 20";
    if value == "unlimited" {
        return Ok(None);
    }
    let mb: usize = value.parse().map_err(|_| EXPECTED)?;
    let bytes = mb.checked_mul(1 << 20).ok_or(EXPECTED)?;
    if mb < MIN_SPLIT_MIB {
        return Err(EXPECTED);
    }
    Ok(Some(bytes))
}

/// `garbage_collection_threshold`: strictly between 0 and 1.
fn gc_threshold(value: &str) -> Result<f64, &'static str> {
    const EXPECTED: &str = "a number strictly between 0 and 1";
    let t: f64 = value.parse().map_err(|_| EXPECTED)?;
    if !(t > 0.0 && t < 1.0) {
        return Err(EXPECTED);
    }
    Ok(t)
}

/// `thread_cache_mb`: whole MiB, in bytes.
fn thread_cache(value: &str) -> Result<usize, &'static str> {
    const EXPECTED: &str = "a whole number of MiB";
    let mb: usize = value.parse().map_err(|_| EXPECTED)?;
    mb.checked_mul(1 << 20).ok_or(EXPECTED)
}

/// `reserve_cap`: `none`, or a finite number at least 1.
fn reserve_cap(value: &str) -> Result<Option<f64>, &'static str> {
    const EXPECTED: &str = "`none`, or a number at least 1";
    if value == "none" {
        return Ok(None);
    }
    let x: f64 = value.parse().map_err(|_| EXPECTED)?;
    if !valid_reserve_cap(x) {
        return Err(EXPECTED);
    }
    Ok(Some(x))
}

/// `linger_us`: whole microseconds, at most the longest linger.
fn linger(value: &str) -> Result<Duration, &'static str> {
    const EXPECTED: &str = "a whole number of microseconds, at most 100000";
    let us: u64 = value.parse().map_err(|_| EXPECTED)?;
    let linger = Duration::from_micros(us);
    if linger > MAX_LINGER {
        return Err(EXPECTED);
    }
    Ok(linger)
}

/// `per_process_memory_fraction`: in (0, 1].
fn memory_fraction(value: &str) -> Result<f64, &'static str> {
    const EXPECTED: &str = "a number in (0, 1]";
    let f: f64 = value.parse().map_err(|_| EXPECTED)?;
    if !(f > 0.0 && f <= 1.0) {
        return Err(EXPECTED);
    }
    Ok(f)
}

/// The keys that are checked and have no effect (see [`DeviceConfig::KEYS`]): whether
/// `value` is of the key's form.
fn check_only(key: &str, value: &str) -> Result<(), &'static str> {
    match key {
        "backend" if value != "native" => {
            Err("`native` (pinpool is the allocator: `cudaMallocAsync` would replace it)")
        }
        "backend" => Ok(()),
        "pinned_num_register_threads" => {
            const EXPECTED: &str = "a power of two from 1 to 128";
            let n: u32 = value.parse().map_err(|_| EXPECTED)?;
            if !(n.is_power_of_two() && n <= 128) {
                return Err(EXPECTED);
            }
            Ok(())
        }
        "pinned_reserve_segment_size_mb" => value
            .parse::<usize>()
            .map(drop)
            .map_err(|_| "a whole number of MiB"),
        // The boolean keys.
        _ => grammar::parse_bool(value).map(drop).ok_or("a boolean"),
    }
}

impl DeviceConfig {
    /// This configuration with `max_split_size` set (`None`: unlimited), as the key would
    /// set it: rounded up to whole MiB, at least 20 MiB.
    pub fn with_max_split_size(mut self, bytes: Option<usize>) -> Self {
        self.max_split_size = bytes.map(|b| b.max(MIN_SPLIT_MIB << 20).next_multiple_of(1 << 20));
        self
    }

    /// This configuration with `roundup_power2_divisions` set, as the key would set it: a
    /// power of two up to 64 (rounded up), or 0.
    pub fn with_roundup_power2_divisions(mut self, divisions: u32) -> Self {
        self.roundup_power2_divisions = match divisions {
            0 => 0,
            d => d.next_power_of_two().min(64),
        };
        self
    }

    /// This configuration with `garbage_collection_threshold` set; a threshold the key would
    /// refuse (not strictly between 0 and 1) sets none.
    pub fn with_garbage_collection_threshold(mut self, threshold: Option<f64>) -> Self {
        self.garbage_collection_threshold = threshold.filter(|t| *t > 0.0 && *t < 1.0);
        self
    }

    /// This configuration with `expandable_segments` set.
    pub fn with_expandable_segments(mut self, on: bool) -> Self {
        self.expandable_segments = on;
        self
    }

    /// This configuration with `reserve_cap` set (`None`: no cap); a cap the key would
    /// refuse (below 1, or not finite) sets the default.
    pub fn with_reserve_cap(mut self, times_peak_live: Option<f64>) -> Self {
        self.reserve_cap = match times_peak_live {
            Some(x) if !valid_reserve_cap(x) => Some(DEFAULT_RESERVE_CAP),
            other => other,
        };
        self
    }

    /// This configuration with `linger` set, as the key would set it: whole microseconds
    /// (rounded up), at most 100 ms.
    pub fn with_linger(mut self, linger: Duration) -> Self {
        let us = linger.as_nanos().div_ceil(1000).min(MAX_LINGER.as_micros());
        self.linger = Duration::from_micros(us as u64);
        self
    }

    /// This configuration with `thread_cache` set, as the key would set it: rounded up to
    /// whole MiB.
    pub fn with_thread_cache(mut self, bytes: usize) -> Self {
        self.thread_cache = bytes.next_multiple_of(1 << 20);
        self
    }
}

impl FromStr for DeviceConfig {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

/// Prints the configuration in `PINPOOL_DEVICE_CONF` form; parsing the output gives it back.
impl fmt::Display for DeviceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.max_split_size {
            // Whole MiB, at least the key's minimum (what the builder methods store).
            Some(b) => write!(
                f,
                "max_split_size_mb:{}",
                b.div_ceil(1 << 20).max(MIN_SPLIT_MIB)
            )?,
            None => write!(f, "max_split_size_mb:unlimited")?,
        }
        match &self.roundup_power2_divisions_by_size {
            Some(table) => write!(f, ",roundup_power2_divisions:{}", list_form(table))?,
            None => write!(
                f,
                ",roundup_power2_divisions:{}",
                self.roundup_power2_divisions
            )?,
        }
        if let Some(t) = self.garbage_collection_threshold {
            write!(f, ",garbage_collection_threshold:{t}")?;
        }
        write!(f, ",expandable_segments:{}", self.expandable_segments)?;
        if self.thread_cache > 0 {
            write!(
                f,
                ",thread_cache_mb:{}",
                self.thread_cache.div_ceil(1 << 20)
            )?;
        }
        match self.reserve_cap {
            Some(x) if x == DEFAULT_RESERVE_CAP => {}
            Some(x) => write!(f, ",reserve_cap:{x}")?,
            None => write!(f, ",reserve_cap:none")?,
        }
        if self.linger != DEFAULT_LINGER {
            write!(f, ",linger_us:{}", self.linger.as_micros())?;
        }
        if let Some(x) = self.memory_fraction {
            write!(f, ",per_process_memory_fraction:{x}")?;
        }
        Ok(())
    }
}

/// `table` in the list form [`divisions_by_size`] reads back to it: one item where the
/// divisions change, and `>` for the last run.
fn list_form(table: &[u32; ROUNDUP_INTERVALS]) -> String {
    let mut items = Vec::new();
    for i in 1..ROUNDUP_INTERVALS {
        if table[i] != table[i - 1] {
            items.push(format!("{}:{}", 1u64 << i, table[i - 1].max(1)));
        }
    }
    items.push(format!(">:{}", table[ROUNDUP_INTERVALS - 1].max(1)));
    format!("[{}]", items.join(","))
}

#[cfg(test)]
mod tests;
