//! pinpool's side of `../shared/anchors/side_by_side_device.sh`: the metrics of
//! `torch_device_bench.cpp` (PyTorch's device caching allocator and `cudaMallocAsync`),
//! measured the same way through [`DeviceAllocator`], printed one figure a line as
//! `pinpool <metric> [key=value ...] <number>` with the anchor's metric names and keys, so
//! that `compare.py` pairs them; plus pinpool's own extras, which pair with nothing.
//!
//! ```sh
//! cargo run --release --example device_bench -- --runtime sim --quick TRACE...   # any machine
//! cargo build --release --features cuda --example device_bench                    # then, on a GPU host:
//! ../shared/anchors/side_by_side_device.sh target/release/examples/device_bench
//! ```
//!
//! Options:
//! - `--runtime sim|cuda|auto`: the simulated 16 GiB device, or CUDA device 0 (built with
//!   `--features cuda`). `auto`, the default, takes CUDA when the build has it and the driver
//!   reports a device, the simulated device otherwise.
//! - `--quick`: every iteration count divided by 20, for smoke runs.
//! - `--repeat N`: run each `dev_pair_ns` loop N times and print the fastest (noisy hosts).
//! - `--policy device|device_segments`: one expandable range per stream (the default) or
//!   separate segments, PyTorch's layout without expandable segments. The other layout keys
//!   come from `PINPOOL_DEVICE_CONF`, as the allocator reads them.
//! - The remaining arguments are trace files: the plain text the anchor reads (`a <id>
//!   <bytes> <stream>`, `f <id>`, `#` comments), gzip-compressed or not, or MiniMalloc CSV.
//!
//! What each metric measures, as the anchor does (its calls are PyTorch's
//! `raw_alloc_with_stream`, `raw_delete` and `recordStream`; these are pinpool's):
//! - `dev_pair_ns size=S`: one thread, allocate a cached size on a stream and free it,
//!   2 000 000 times, for 4 KiB, 1 MiB and 64 MiB.
//! - `dev_pair_with_record_ns size=1048576`: allocate a buffer on one stream, record use on a
//!   second, idle stream, drop it (the event path); 200 000 times.
//! - `dev_mt_Mpairs_per_s same_class=C threads=T`: T threads, each on its own stream, each
//!   allocating and freeing 300 000 times, all 64 KiB (C=1) or `4096 << (t % 12)` (C=0); each
//!   warms its size first, and the clock runs from the last spawn to the last join.
//! - `dev_mixed_sizes_ns_per_request held=64`: one thread holds 64 pointers and replaces one
//!   at a time with one of another size, 4 KiB to 1 MiB; 50 000 times.
//! - `dev_fresh_alloc_ms size_mb=M`: cache emptied, then the first allocation of M MiB (the
//!   allocation call alone) on a stream the allocator has served before, as the anchor's.
//! - `dev_reserved_MiB_for_request_MiB request=1025`: peak reserved bytes, all pools, for one
//!   1025 MiB request from an empty cache.
//! - `dev_replay_* trace=NAME`: each trace played twice from an emptied cache, each trace
//!   stream its own stream (kept across the two runs); from the second run: peak reserved
//!   over peak live requested bytes, time per trace line (allocation or free), and the
//!   segment count. As PyTorch's `segment[0].allocated`, that count is cumulative: it counts
//!   every segment the device allocator has taken since it started.
//!
//! Extras: `dev_pair_buffer_ns size=S` (the `DeviceBuffer` path: `alloc_blocking` and drop,
//! no pointer table), `dev_pair_with_record_raw_ns` (the record loop through raw pointers and
//! `raw_record_stream`), `dev_mixed_sizes_fresh` (device allocations made during the mixed
//! sizes loop), `dev_async_pair_ns` (`alloc().await` of a cached size in a tokio
//! task), `dev_replay_fresh trace=NAME` (device allocations during the second run) and
//! `dev_replay_warm_driver_calls_per_pass trace=NAME` (memory taken from, given back to and
//! moved within the driver's mappings, per pass over three more passes with the cache kept: a
//! repeated stream's steady state), and for those passes `dev_replay_warm_ns_per_request` and
//! `dev_replay_warm_misses_per_pass` (requests the pool actor answered);
//! `dev_replay_paced_ns_per_request trace=NAME pace_us=P` (three more passes with the thread
//! spinning P µs before each request, as a model's host thread does between them: the time
//! in the allocator's calls alone, per request); `dev_miss_us gap_us=G` (the median time of a
//! request the pool actor answers, back to back and after the requesting thread slept G µs),
//! with `dev_miss_misses` and `dev_miss_driver_calls` counting what its 400 requests took;
//! `dev_replay_paced_miss_us` and `dev_replay_paced_miss_served_us` (a paced replay's miss,
//! on average, and the pool actor's own part of it).

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pinpool::config::DeviceConfig;
use pinpool::{DeviceAllocator, DeviceBuilder, DeviceRuntime};
use pinpool_tools::trace::{Trace, TraceError, TraceEvent};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Result<T> = std::result::Result<T, BoxError>;

/// Every iteration count is divided by this with `--quick`.
const QUICK_DIVISOR: u64 = 20;

const USAGE: &str = "usage: device_bench [--runtime sim|cuda|auto] [--quick] [--repeat N] \
                     [--policy device|device_segments] [TRACE...]";

struct Args {
    runtime: String,
    quick: bool,
    repeat: usize,
    /// `Some(true)` for `--policy device`, `Some(false)` for `device_segments`.
    expandable: Option<bool>,
    traces: Vec<String>,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut args = Args {
        runtime: "auto".into(),
        quick: false,
        repeat: 1,
        expandable: None,
        traces: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runtime" => {
                args.runtime = it.next().ok_or("--runtime needs a value")?;
                if !["sim", "cuda", "auto"].contains(&args.runtime.as_str()) {
                    return Err(format!("--runtime: unknown runtime {:?}", args.runtime));
                }
            }
            "--quick" => args.quick = true,
            "--repeat" => {
                args.repeat = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&r| r > 0)
                    .ok_or("--repeat needs a positive number")?
            }
            "--policy" => match it.next().as_deref() {
                Some("device") => args.expandable = Some(true),
                Some("device_segments") => args.expandable = Some(false),
                other => return Err(format!("--policy: unknown device policy {other:?}")),
            },
            "-h" | "--help" => return Err(USAGE.into()),
            "--" => args.traces.extend(it.by_ref()),
            flag if flag.starts_with("--") => {
                return Err(format!("unknown argument {flag:?}\n{USAGE}"))
            }
            file => args.traces.push(file.to_owned()),
        }
    }
    Ok(args)
}

fn ns_per(t0: Instant, n: u64) -> f64 {
    t0.elapsed().as_nanos() as f64 / n.max(1) as f64
}

/// One step of a trace as the replay plays it: allocations fill numbered slots.
#[derive(Clone, Copy)]
enum Step {
    Alloc {
        slot: usize,
        bytes: usize,
        stream: u64,
    },
    Free {
        slot: usize,
    },
}

/// A trace ready to replay.
/// Passes of each trace replayed warm (the cache kept) after the two cold ones.
const WARM_PASSES: u64 = 3;

/// The time between two requests in the paced passes: a training step of ResNet-50 at batch
/// 32 makes about 700 requests in 45 ms on an H100.
const REPLAY_PACE: Duration = Duration::from_micros(50);

struct Replay {
    steps: Vec<Step>,
    /// Slots the allocations use.
    slots: usize,
    /// What the anchor divides the replay time by: every event line, frees of unknown ids
    /// included.
    lines: u64,
    /// Peak live requested bytes, counted as the anchor counts them.
    peak_live: u64,
    /// Which reader took the file.
    reader: &'static str,
}

impl Replay {
    /// Reads `path` with `pinpool_tools::trace` (strict: ids dense and in order, frees only of live
    /// ids), or, when it rejects the content, the way the anchor reads it.
    fn open(path: &str) -> Result<Replay> {
        match Trace::open(path) {
            Ok(trace) => Ok(Replay::from_trace(&trace)),
            Err(e @ TraceError::Invalid { .. }) => {
                let replay = Replay::read_lenient(path)?;
                eprintln!("  ({e}; read as the anchor reads it instead)");
                Ok(replay)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn from_trace(trace: &Trace) -> Replay {
        let steps = trace
            .events()
            .iter()
            .map(|e| match *e {
                TraceEvent::Alloc { id, bytes, stream } => Step::Alloc {
                    slot: id,
                    bytes: usize::try_from(bytes).unwrap_or(usize::MAX),
                    stream,
                },
                TraceEvent::Free { id } => Step::Free { slot: id },
            })
            .collect::<Vec<_>>();
        Replay {
            lines: steps.len() as u64,
            steps,
            slots: trace.allocation_count(),
            peak_live: trace.peak_live_bytes(),
            reader: "pinpool::trace",
        }
    }

    /// The anchor's reading: any integer ids, an id may come back once freed, a free of an
    /// id not live is skipped (but counted as a line), extra fields are ignored. An id
    /// allocated again while live leaves the first allocation live to the end, as the
    /// anchor's map does. Gzip-compressed files are taken too.
    fn read_lenient(path: &str) -> Result<Replay> {
        let io = |e: std::io::Error| format!("{path}: {e}");
        let mut reader = BufReader::new(std::fs::File::open(path).map_err(io)?);
        let gzip = reader.fill_buf().map_err(io)?.starts_with(&[0x1f, 0x8b]);
        let reader: Box<dyn BufRead> = if gzip {
            Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(reader)))
        } else {
            Box::new(reader)
        };
        let mut replay = Replay {
            steps: Vec::new(),
            slots: 0,
            lines: 0,
            peak_live: 0,
            reader: "lenient",
        };
        let mut live: HashMap<i64, (usize, usize)> = HashMap::new();
        let mut cur: u64 = 0;
        for (n, line) in reader.lines().enumerate() {
            let line = line.map_err(io)?;
            let bad = |what: &str| format!("{path}:{}: {what}: {line:?}", n + 1);
            let mut fields = line.split_ascii_whitespace();
            let Some(tag) = fields.next() else { continue };
            if tag.starts_with('#') {
                continue;
            }
            let mut int = |name: &str| -> Result<i64> {
                let text = fields
                    .next()
                    .ok_or_else(|| bad(&format!("missing {name}")))?;
                Ok(text.parse().map_err(|_| bad(&format!("bad {name}")))?)
            };
            replay.lines += 1;
            match tag {
                "a" => {
                    let id = int("id")?;
                    let bytes = usize::try_from(int("bytes")?).map_err(|_| bad("bad bytes"))?;
                    let stream = int("stream")? as u64;
                    let slot = replay.slots;
                    replay.slots += 1;
                    live.insert(id, (slot, bytes));
                    replay.steps.push(Step::Alloc {
                        slot,
                        bytes,
                        stream,
                    });
                    cur += bytes as u64;
                    replay.peak_live = replay.peak_live.max(cur);
                }
                "f" => {
                    if let Some((slot, bytes)) = live.remove(&int("id")?) {
                        replay.steps.push(Step::Free { slot });
                        cur -= bytes as u64;
                    }
                }
                _ => return Err(bad("unknown event (expected `a` or `f`)").into()),
            }
        }
        Ok(replay)
    }
}

/// The trace's name as the anchor prints it: no directory, no `.txt` or `.trace` (and no
/// `.gz` at the end, for compressed files the anchor does not read).
fn trace_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let mut s = file.strip_suffix(".gz").unwrap_or(file).to_owned();
    // As the anchor's `base()`: cut at the last occurrence of each, wherever it is.
    for suffix in [".txt", ".trace"] {
        if let Some(i) = s.rfind(suffix) {
            s.truncate(i);
        }
    }
    s
}

/// The benchmark over one runtime: its allocator, and how to make a new stream on device 0.
struct Bench<R: DeviceRuntime, F: Fn() -> Result<R::Stream> + Sync> {
    allocator: DeviceAllocator<R>,
    new_stream: F,
    quick: bool,
    repeat: usize,
}

impl<R: DeviceRuntime, F: Fn() -> Result<R::Stream> + Sync> Bench<R, F> {
    /// The anchor's iteration count `full`, or its share with `--quick`.
    fn n(&self, full: u64) -> u64 {
        if self.quick {
            full / QUICK_DIVISOR
        } else {
            full
        }
    }

    fn fresh_count(&self) -> Result<i64> {
        Ok(self.allocator.stats(0)?.num_device_alloc)
    }

    fn pair(&self) -> Result<()> {
        let stream = (self.new_stream)()?;
        let allocator = &self.allocator;
        let n = self.n(2_000_000);
        for size in [4096usize, 1 << 20, 64 << 20] {
            allocator.raw_delete(allocator.raw_alloc_with_stream(size, &stream)?)?;
            let mut best = f64::INFINITY;
            for _ in 0..self.repeat {
                let t0 = Instant::now();
                for _ in 0..n {
                    let p = allocator.raw_alloc_with_stream(size, &stream)?;
                    allocator.raw_delete(std::hint::black_box(p))?;
                }
                best = best.min(ns_per(t0, n));
            }
            println!("pinpool dev_pair_ns size={size} {best:.1}");
            let mut best = f64::INFINITY;
            for _ in 0..self.repeat {
                let t0 = Instant::now();
                for _ in 0..n {
                    drop(std::hint::black_box(
                        allocator.alloc_blocking(size, &stream)?,
                    ));
                }
                best = best.min(ns_per(t0, n));
            }
            println!("pinpool dev_pair_buffer_ns size={size} {best:.1}");
        }
        Ok(())
    }

    fn pair_with_record(&self) -> Result<()> {
        let (stream, other) = ((self.new_stream)()?, (self.new_stream)()?);
        let allocator = &self.allocator;
        let size = 1usize << 20;
        let n = self.n(200_000);
        drop(allocator.alloc_blocking(size, &stream)?);
        let fresh0 = self.fresh_count()?;
        let t0 = Instant::now();
        for _ in 0..n {
            let mut b = allocator.alloc_blocking(size, &stream)?;
            b.record_stream(&other).unwrap();
        }
        println!(
            "pinpool dev_pair_with_record_ns size={size} {:.1}",
            ns_per(t0, n)
        );
        let fresh1 = self.fresh_count()?;
        let t0 = Instant::now();
        for _ in 0..n {
            let p = allocator.raw_alloc_with_stream(size, &stream)?;
            allocator.raw_record_stream(p, &other)?;
            allocator.raw_delete(p)?;
        }
        println!(
            "pinpool dev_pair_with_record_raw_ns size={size} {:.1}",
            ns_per(t0, n)
        );
        eprintln!(
            "  (fresh device allocations during the record loops: {} with buffers, {} with raw pointers)",
            fresh1 - fresh0,
            self.fresh_count()? - fresh1
        );
        Ok(())
    }

    fn mt(&self) -> Result<()> {
        let k = self.n(300_000);
        for same in [0, 1] {
            for threads in [1usize, 2, 4, 8, 16] {
                let ready = AtomicUsize::new(0);
                let secs = std::thread::scope(|s| -> Result<f64> {
                    let handles: Vec<_> = (0..threads)
                        .map(|t| {
                            let ready = &ready;
                            s.spawn(move || -> Result<()> {
                                let size = if same == 1 {
                                    1 << 16
                                } else {
                                    4096usize << (t % 12)
                                };
                                // Each thread its own stream, made on the thread, as the
                                // anchor does. A thread that fails still counts itself ready,
                                // so the others do not wait for it forever.
                                let warm = (|| -> Result<R::Stream> {
                                    let stream = (self.new_stream)()?;
                                    let p = self.allocator.raw_alloc_with_stream(size, &stream)?;
                                    self.allocator.raw_delete(p)?;
                                    Ok(stream)
                                })();
                                ready.fetch_add(1, Ordering::SeqCst);
                                let stream = warm?;
                                while ready.load(Ordering::SeqCst) < threads {
                                    std::hint::spin_loop();
                                }
                                for _ in 0..k {
                                    let p = self.allocator.raw_alloc_with_stream(size, &stream)?;
                                    self.allocator.raw_delete(std::hint::black_box(p))?;
                                }
                                Ok(())
                            })
                        })
                        .collect();
                    let t0 = Instant::now();
                    let mut first_err = None;
                    for h in handles {
                        let r = h.join().map_err(|_| "a benchmark thread panicked".into());
                        if let Err(e) = r.and_then(|r| r) {
                            first_err.get_or_insert(e);
                        }
                    }
                    let secs = t0.elapsed().as_secs_f64();
                    first_err.map_or(Ok(secs), Err)
                })?;
                println!(
                    "pinpool dev_mt_Mpairs_per_s same_class={same} threads={threads} {:.2}",
                    (threads as u64 * k) as f64 / secs / 1e6
                );
            }
        }
        Ok(())
    }

    fn mixed_sizes(&self) -> Result<()> {
        let stream = (self.new_stream)()?;
        let allocator = &self.allocator;
        let n = self.n(50_000) as usize;
        let size = |i: usize| 4096 + i.wrapping_mul(104_729) % (1 << 20);
        let mut held = Vec::with_capacity(64);
        for i in 0..64 {
            held.push(allocator.raw_alloc_with_stream(size(n + i), &stream)?);
        }
        let fresh0 = self.fresh_count()?;
        let t0 = Instant::now();
        for i in 0..n {
            let p = allocator.raw_alloc_with_stream(size(i), &stream)?;
            allocator.raw_delete(held[i % 64])?;
            held[i % 64] = p;
        }
        println!(
            "pinpool dev_mixed_sizes_ns_per_request held=64 {:.1}",
            ns_per(t0, n as u64)
        );
        println!(
            "pinpool dev_mixed_sizes_fresh held=64 {}",
            self.fresh_count()? - fresh0
        );
        for p in held {
            allocator.raw_delete(p)?;
        }
        Ok(())
    }

    fn fresh(&self) -> Result<()> {
        let stream = (self.new_stream)()?;
        let allocator = &self.allocator;
        // The anchor measures on a stream its allocator has served before: make this
        // stream's pool (and reserve its address range) first, so that only fresh memory
        // is timed.
        allocator.raw_delete(allocator.raw_alloc_with_stream(4096, &stream)?)?;
        for mb in [16usize, 256, 1024] {
            allocator.empty_cache_blocking()?;
            let t0 = Instant::now();
            let p = allocator.raw_alloc_with_stream(mb << 20, &stream)?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            allocator.raw_delete(p)?;
            println!("pinpool dev_fresh_alloc_ms size_mb={mb} {ms:.3}");
        }
        allocator.empty_cache_blocking()?;
        allocator.reset_peak_stats(0)?;
        allocator.raw_delete(allocator.raw_alloc_with_stream(1025 << 20, &stream)?)?;
        println!(
            "pinpool dev_reserved_MiB_for_request_MiB request=1025 {:.0}",
            allocator.stats(0)?.reserved_bytes.all.peak as f64 / 1048576.0
        );
        Ok(())
    }

    fn async_pair(&self, rt: &tokio::runtime::Runtime) -> Result<()> {
        let n = self.n(2_000_000);
        let size = 1usize << 20;
        let allocator = self.allocator.clone();
        let stream = (self.new_stream)()?;
        let ns = rt.block_on(async move {
            tokio::spawn(async move {
                drop(allocator.alloc(size, &stream).await?);
                let t0 = Instant::now();
                for _ in 0..n {
                    drop(std::hint::black_box(allocator.alloc(size, &stream).await?));
                }
                Ok::<f64, pinpool::Error>(ns_per(t0, n))
            })
            .await
        })??;
        println!("pinpool dev_async_pair_ns size={size} {ns:.1}");
        Ok(())
    }

    /// The time a request takes that the pool actor answers (a miss), its median over 400:
    /// back to back, and after the thread has slept `gap` microseconds (the actor's worker
    /// thread has gone to sleep by then, and the request wakes it). Sizes of 24 to 42 MiB in
    /// turn, each block freed before the next request: with blocks above 1 MiB going back to
    /// the actor when freed (the default), every request is a miss served from free memory
    /// that is already mapped.
    fn miss_latency(&self) -> Result<()> {
        let stream = (self.new_stream)()?;
        let allocator = &self.allocator;
        let size = |k: usize| (24usize << 20) + (k % 7) * (3 << 20);
        for k in 0..7 {
            allocator.raw_delete(allocator.raw_alloc_with_stream(size(k), &stream)?)?;
        }
        for gap_us in [0u64, 100, 1000] {
            let before = allocator.stats(0)?;
            let mut us = Vec::with_capacity(400);
            for k in 0..400 {
                if gap_us > 0 {
                    std::thread::sleep(Duration::from_micros(gap_us));
                }
                let t0 = Instant::now();
                let p = allocator.raw_alloc_with_stream(size(k), &stream)?;
                us.push(t0.elapsed().as_secs_f64() * 1e6);
                allocator.raw_delete(p)?;
            }
            let after = allocator.stats(0)?;
            us.sort_by(f64::total_cmp);
            println!(
                "pinpool dev_miss_us gap_us={gap_us} {:.1}",
                us[us.len() / 2]
            );
            println!(
                "pinpool dev_miss_misses gap_us={gap_us} {}",
                after.num_misses - before.num_misses
            );
            println!(
                "pinpool dev_miss_driver_calls gap_us={gap_us} {}",
                driver_calls(&after) - driver_calls(&before)
            );
        }
        Ok(())
    }

    /// Plays `trace` once: each trace stream on a stream of its own (made at its first use
    /// and kept in `streams`), the pointers in `live` (what the trace leaves allocated
    /// stays there).
    ///
    /// With a `pace`, the thread spins that long before each request, as a model's host
    /// thread launches work between them, and the time spent in the allocator's calls alone
    /// is returned (zero without a pace).
    fn play(
        &self,
        trace: &Replay,
        streams: &mut BTreeMap<u64, R::Stream>,
        live: &mut [u64],
        pace: Duration,
    ) -> Result<Duration> {
        let allocator = &self.allocator;
        let mut in_calls = Duration::ZERO;
        for step in &trace.steps {
            let t0 = if pace.is_zero() {
                None
            } else {
                let t = Instant::now();
                while t.elapsed() < pace {
                    std::hint::spin_loop();
                }
                Some(Instant::now())
            };
            match *step {
                Step::Alloc {
                    slot,
                    bytes,
                    stream,
                } => {
                    let s = match streams.entry(stream) {
                        std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                        std::collections::btree_map::Entry::Vacant(e) => {
                            e.insert((self.new_stream)()?)
                        }
                    };
                    live[slot] = allocator.raw_alloc_with_stream(bytes, s)?;
                }
                Step::Free { slot } => allocator.raw_delete(std::mem::take(&mut live[slot]))?,
            }
            if let Some(t0) = t0 {
                in_calls += t0.elapsed();
            }
        }
        Ok(in_calls)
    }

    fn replay(&self, base: &str, trace: &Replay) -> Result<()> {
        let allocator = &self.allocator;
        let mut streams: BTreeMap<u64, R::Stream> = BTreeMap::new();
        let mut live: Vec<u64> = vec![0; trace.slots];
        for rep in 0..2 {
            // The first run warms nothing up: the cache is emptied before each.
            allocator.empty_cache_blocking()?;
            allocator.reset_peak_stats(0)?;
            let fresh0 = self.fresh_count()?;
            let t0 = Instant::now();
            self.play(trace, &mut streams, &mut live, Duration::ZERO)?;
            let ns = ns_per(t0, trace.lines);
            let stats = allocator.stats(0)?;
            if rep == 1 {
                eprintln!(
                    "  ({base}: {} lines, {} allocations on {} streams, peak live {:.1} MiB, read by {})",
                    trace.lines,
                    trace.slots,
                    streams.len(),
                    trace.peak_live as f64 / 1048576.0,
                    trace.reader
                );
                println!(
                    "pinpool dev_replay_reserved_over_peak trace={base} {:.3}",
                    stats.reserved_bytes.all.peak as f64 / trace.peak_live.max(1) as f64
                );
                println!("pinpool dev_replay_ns_per_request trace={base} {ns:.1}");
                println!(
                    "pinpool dev_replay_segments trace={base} {}",
                    stats.segment.all.allocated
                );
                println!(
                    "pinpool dev_replay_fresh trace={base} {}",
                    stats.num_device_alloc - fresh0
                );
            }
            for p in live.iter_mut() {
                allocator.raw_delete(std::mem::take(p))?;
            }
        }
        // Warm passes, the cache kept: what a repeated stream (training steps, a serving
        // loop) costs the driver once the pool has learned it.
        let before = allocator.stats(0)?;
        let t0 = Instant::now();
        for _ in 0..WARM_PASSES {
            self.play(trace, &mut streams, &mut live, Duration::ZERO)?;
            for p in live.iter_mut() {
                allocator.raw_delete(std::mem::take(p))?;
            }
        }
        let ns = ns_per(t0, trace.lines * WARM_PASSES);
        let after = allocator.stats(0)?;
        println!(
            "pinpool dev_replay_warm_misses_per_pass trace={base} {:.1}",
            (after.num_misses - before.num_misses) as f64 / WARM_PASSES as f64
        );
        println!("pinpool dev_replay_warm_ns_per_request trace={base} {ns:.1}");
        let calls = driver_calls(&after) - driver_calls(&before);
        println!(
            "pinpool dev_replay_warm_driver_calls_per_pass trace={base} {:.1}",
            calls as f64 / WARM_PASSES as f64
        );
        // The same passes at a model's pace: what the allocator's calls cost when its actors
        // have had time to fall asleep between requests.
        let mut in_calls = Duration::ZERO;
        for _ in 0..WARM_PASSES {
            in_calls += self.play(trace, &mut streams, &mut live, REPLAY_PACE)?;
            for p in live.iter_mut() {
                allocator.raw_delete(std::mem::take(p))?;
            }
        }
        println!(
            "pinpool dev_replay_paced_ns_per_request trace={base} pace_us={} {:.1}",
            REPLAY_PACE.as_micros(),
            in_calls.as_nanos() as f64 / (trace.lines * WARM_PASSES) as f64
        );
        // Where a paced miss's time goes: the pool actor's own work, and the rest (threads
        // handing the request over and waking up).
        let paced = allocator.stats(0)?;
        let misses = (paced.num_misses - after.num_misses).max(1) as f64;
        println!(
            "pinpool dev_replay_paced_miss_us trace={base} {:.1}",
            (paced.miss_wait_ns - after.miss_wait_ns) as f64 / misses / 1e3
        );
        println!(
            "pinpool dev_replay_paced_miss_served_us trace={base} {:.1}",
            (paced.miss_serve_ns - after.miss_serve_ns) as f64 / misses / 1e3
        );
        Ok(())
    }

    fn run(&self, rt: &tokio::runtime::Runtime, traces: &[(String, Replay)]) -> Result<()> {
        self.pair()?;
        self.pair_with_record()?;
        self.mt()?;
        self.mixed_sizes()?;
        self.fresh()?;
        self.async_pair(rt)?;
        self.miss_latency()?;
        for (base, trace) in traces {
            self.replay(base, trace)
                .map_err(|e| -> BoxError { format!("replay of {base}: {e}").into() })?;
        }
        self.allocator.empty_cache_blocking()?;
        Ok(())
    }
}

/// Memory taken from, given back to and moved within the driver's mappings, so far.
fn driver_calls(stats: &pinpool::DeviceStats) -> i64 {
    stats.num_device_alloc + stats.num_device_free + stats.num_device_remaps
}

fn tokio_runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// The layout settings: `PINPOOL_DEVICE_CONF`, with `--policy` over it.
fn config(args: &Args) -> Result<DeviceConfig> {
    let mut config = DeviceConfig::from_env()
        .map_err(|e| format!("{}: {e}", pinpool::config::DEVICE_ENV_VAR))?;
    if let Some(expandable) = args.expandable {
        config = config.with_expandable_segments(expandable);
    }
    Ok(config)
}

/// Builds the allocator over `runtime` and runs every measurement on this (plain) thread
/// and threads it spawns, the actors on a tokio runtime of their own.
fn bench<R: DeviceRuntime>(
    runtime: Arc<R>,
    what: &str,
    new_stream: impl Fn(&Arc<R>) -> Result<R::Stream> + Sync,
    args: &Args,
    traces: &[(String, Replay)],
) -> Result<()> {
    let rt = tokio_runtime()?;
    let config = config(args)?;
    let allocator = DeviceBuilder::new(runtime.clone())
        .config(&config)
        .handle(rt.handle().clone())
        .build()?;
    let (_, total) = allocator.memory_info(0)?;
    eprintln!(
        "device_bench: runtime {what} ({:.0} GiB), {config}, {}{} trace(s)",
        total as f64 / (1u64 << 30) as f64,
        if args.quick {
            format!("quick (counts / {QUICK_DIVISOR}), ")
        } else {
            String::new()
        },
        traces.len()
    );
    // Every stream made lives to the end of the run, as PyTorch's pool streams do: a
    // destroyed CUDA stream's handle can come back as the next stream's, and with it
    // whatever the allocator still keeps under that stream's id.
    let streams = Mutex::new(Vec::new());
    let bench = Bench {
        allocator,
        new_stream: || {
            let s = new_stream(&runtime)?;
            streams
                .lock()
                .map_err(|_| "a benchmark thread panicked")?
                .push(s.clone());
            Ok(s)
        },
        quick: args.quick,
        repeat: args.repeat,
    };
    let result = bench.run(&rt, traces);
    drop(bench);
    drop(streams);
    rt.shutdown_timeout(Duration::from_secs(5));
    result
}

fn run_sim(args: &Args, traces: &[(String, Replay)]) -> Result<()> {
    let sim = Arc::new(pinpool::sim::SimRuntime::new());
    bench(sim, "sim", |sim| Ok(sim.new_stream()?), args, traces)
}

#[cfg(feature = "cuda")]
fn run_cuda(args: &Args, traces: &[(String, Replay)]) -> Result<()> {
    let cuda = Arc::new(pinpool::cuda::CudaRuntime::new(0)?);
    bench(
        cuda,
        "cuda, device 0",
        |cuda| Ok(cuda.context().new_stream()?),
        args,
        traces,
    )
}

/// The runtime `--runtime` names, `auto` resolved.
fn pick_runtime(name: &str) -> &'static str {
    match name {
        "sim" => "sim",
        "cuda" => "cuda",
        #[cfg(feature = "cuda")]
        _ if pinpool::cuda::cuda_available() => "cuda",
        _ => {
            if cfg!(feature = "cuda") {
                eprintln!("device_bench: no CUDA device found; using the simulated device");
            } else {
                eprintln!(
                    "device_bench: built without the cuda feature; using the simulated device"
                );
            }
            "sim"
        }
    }
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    // Every trace is read first, so that a bad file fails before any measurement.
    let mut traces = Vec::with_capacity(args.traces.len());
    for path in &args.traces {
        match Replay::open(path) {
            Ok(t) => traces.push((trace_name(path), t)),
            Err(e) => {
                eprintln!("device_bench: {e}");
                std::process::exit(1);
            }
        }
    }
    let result = match pick_runtime(&args.runtime) {
        "sim" => run_sim(&args, &traces),
        #[cfg(feature = "cuda")]
        "cuda" => run_cuda(&args, &traces),
        _ => {
            eprintln!(
                "device_bench: runtime cuda is not in this build (build with --features cuda)"
            );
            std::process::exit(2);
        }
    };
    if let Err(e) = result {
        eprintln!("device_bench: {e}");
        std::process::exit(1);
    }
}
