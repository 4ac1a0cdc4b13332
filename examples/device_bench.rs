//! pinpool's side of `../shared/anchors/side_by_side_device.sh`: the metrics of
//! `torch_device_bench.cpp` (PyTorch's device caching allocator and `cudaMallocAsync`),
//! measured the same way through [`DeviceAllocator`], printed as
//! `pinpool <metric> [key=value ...] <number>`, plus pinpool's own extras.
//!
//! ```sh
//! cargo run --release --example device_bench -- --runtime sim --quick TRACE...  # any machine
//! cargo build --release --features cuda --example device_bench                   # then, on a GPU host:
//! ../shared/anchors/side_by_side_device.sh target/release/examples/device_bench
//! ```
//!
//! Options: `--runtime cuda|sim` (default: cuda when built with the `cuda` feature),
//! `--quick` (fewer iterations, for smoke runs), `--policy device|device_segments` (the
//! expandable range, the default, or separate segments). The last arguments are trace files
//! (plain text as the anchor takes them, or gzip-compressed).
//!
//! What each metric measures (as the anchor does; the anchor's calls are PyTorch's
//! `raw_alloc_with_stream` / `raw_delete`, so these use pinpool's):
//! - `dev_pair_ns size=S`: one thread, allocate a cached size on a stream and free it.
//! - `dev_pair_with_record_ns size=1048576`: allocate on a stream, record use on a second,
//!   idle stream, free (the event path).
//! - `dev_mt_Mpairs_per_s same_class=C threads=T`: T threads, each on its own stream, all
//!   64 KiB (C=1) or `4096 << (t % 12)` (C=0).
//! - `dev_mixed_sizes_ns_per_request held=64`: one thread holds 64 buffers and replaces one
//!   at a time with one of another size, 4 KiB to 1 MiB.
//! - `dev_fresh_alloc_ms size_mb=M`: cache emptied, then the first allocation of M MiB.
//! - `dev_reserved_MiB_for_request_MiB request=1025`: peak reserved for a 1025 MiB request.
//! - `dev_replay_* trace=NAME`: a trace replayed twice from an empty cache, each trace stream
//!   its own stream; the second run's peak reserved over peak live bytes, time per request
//!   and segments taken.
//!
//! Extras: `dev_pair_buffer_ns` (the `DeviceBuffer` path: `alloc_blocking` and drop, no
//! pointer table), `dev_async_pair_ns` (`alloc().await` in a tokio task).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::config::DeviceConfig;
use pinpool::trace::{Trace, TraceEvent};
use pinpool::{DeviceAllocator, DeviceBuilder, DeviceRuntime};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Args {
    runtime: String,
    quick: bool,
    expandable: bool,
    traces: Vec<String>,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut args = Args {
        runtime: if cfg!(feature = "cuda") {
            "cuda".into()
        } else {
            "sim".into()
        },
        quick: false,
        expandable: true,
        traces: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runtime" => args.runtime = it.next().ok_or("--runtime needs a value")?,
            "--quick" => args.quick = true,
            "--policy" => match it.next().as_deref() {
                Some("device") => args.expandable = true,
                Some("device_segments") => args.expandable = false,
                other => return Err(format!("--policy: unknown device policy {other:?}")),
            },
            "-h" | "--help" => {
                return Err("usage: device_bench [--runtime cuda|sim] [--quick] \
                     [--policy device|device_segments] [TRACE...]"
                    .into())
            }
            flag if flag.starts_with("--") => return Err(format!("unknown argument {flag:?}")),
            file => args.traces.push(file.to_owned()),
        }
    }
    Ok(args)
}

fn ns_per(t0: Instant, n: u64) -> f64 {
    t0.elapsed().as_nanos() as f64 / n as f64
}

/// The benchmark over one runtime: its allocator, and how to make a new stream on device 0.
struct Bench<R: DeviceRuntime, F: Fn() -> R::Stream + Sync> {
    pool: DeviceAllocator<R>,
    new_stream: F,
    quick: bool,
}

impl<R: DeviceRuntime, F: Fn() -> R::Stream + Sync> Bench<R, F> {
    fn n(&self, full: u64, quick: u64) -> u64 {
        if self.quick {
            quick
        } else {
            full
        }
    }

    fn pair(&self) -> Result<()> {
        let stream = (self.new_stream)();
        let pool = &self.pool;
        for size in [4096usize, 1 << 20, 64 << 20] {
            let n = self.n(2_000_000, 100_000);
            pool.raw_delete(pool.raw_alloc_with_stream(size, &stream)?)?;
            let t0 = Instant::now();
            for _ in 0..n {
                let p = pool.raw_alloc_with_stream(size, &stream)?;
                pool.raw_delete(std::hint::black_box(p))?;
            }
            println!("pinpool dev_pair_ns size={size} {:.1}", ns_per(t0, n));
            let t0 = Instant::now();
            for _ in 0..n {
                drop(std::hint::black_box(pool.alloc_blocking(size, &stream)?));
            }
            println!(
                "pinpool dev_pair_buffer_ns size={size} {:.1}",
                ns_per(t0, n)
            );
        }
        Ok(())
    }

    fn pair_with_record(&self) -> Result<()> {
        let (stream, other) = ((self.new_stream)(), (self.new_stream)());
        let size = 1 << 20;
        let n = self.n(200_000, 20_000);
        drop(self.pool.alloc_blocking(size, &stream)?);
        let t0 = Instant::now();
        for _ in 0..n {
            let mut b = self.pool.alloc_blocking(size, &stream)?;
            b.record_stream(&other);
        }
        println!(
            "pinpool dev_pair_with_record_ns size={size} {:.1}",
            ns_per(t0, n)
        );
        Ok(())
    }

    fn mt(&self) -> Result<()> {
        let k = self.n(300_000, 30_000);
        for same in [0, 1] {
            for threads in [1usize, 2, 4, 8, 16] {
                let ready = AtomicUsize::new(0);
                let secs = std::thread::scope(|s| -> Result<f64> {
                    let handles: Vec<_> = (0..threads)
                        .map(|t| {
                            let (ready, pool) = (&ready, &self.pool);
                            let stream = (self.new_stream)();
                            s.spawn(move || -> std::result::Result<(), pinpool::Error> {
                                let size = if same == 1 {
                                    1 << 16
                                } else {
                                    4096usize << (t % 12)
                                };
                                pool.raw_delete(pool.raw_alloc_with_stream(size, &stream)?)?;
                                ready.fetch_add(1, Ordering::SeqCst);
                                while ready.load(Ordering::SeqCst) < threads {
                                    std::hint::spin_loop();
                                }
                                for _ in 0..k {
                                    let p = pool.raw_alloc_with_stream(size, &stream)?;
                                    pool.raw_delete(std::hint::black_box(p))?;
                                }
                                Ok(())
                            })
                        })
                        .collect();
                    let t0 = Instant::now();
                    for h in handles {
                        h.join().map_err(|_| "a benchmark thread panicked")??;
                    }
                    Ok(t0.elapsed().as_secs_f64())
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
        let stream = (self.new_stream)();
        let pool = &self.pool;
        let n = self.n(50_000, 5_000) as usize;
        let size = |i: usize| 4096 + i.wrapping_mul(104_729) % (1 << 20);
        let mut held = (0..64)
            .map(|i| pool.raw_alloc_with_stream(size(n + i), &stream))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let before = pool.stats(0)?.num_device_alloc;
        let t0 = Instant::now();
        for i in 0..n {
            let p = pool.raw_alloc_with_stream(size(i), &stream)?;
            pool.raw_delete(held[i % 64])?;
            held[i % 64] = p;
        }
        println!(
            "pinpool dev_mixed_sizes_ns_per_request held=64 {:.1}",
            ns_per(t0, n as u64)
        );
        eprintln!(
            "  (fresh device allocations during the mixed sizes loop: {})",
            pool.stats(0)?.num_device_alloc - before
        );
        for p in held {
            pool.raw_delete(p)?;
        }
        Ok(())
    }

    fn fresh(&self) -> Result<()> {
        let stream = (self.new_stream)();
        let pool = &self.pool;
        for mb in [16usize, 256, 1024] {
            pool.empty_cache_blocking()?;
            let t0 = Instant::now();
            let p = pool.raw_alloc_with_stream(mb << 20, &stream)?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            pool.raw_delete(p)?;
            println!("pinpool dev_fresh_alloc_ms size_mb={mb} {ms:.3}");
        }
        pool.empty_cache_blocking()?;
        pool.reset_peak_stats(0)?;
        pool.raw_delete(pool.raw_alloc_with_stream(1025 << 20, &stream)?)?;
        println!(
            "pinpool dev_reserved_MiB_for_request_MiB request=1025 {:.0}",
            pool.stats(0)?.reserved_bytes.all.peak as f64 / 1048576.0
        );
        Ok(())
    }

    fn async_pair(&self, rt: &tokio::runtime::Runtime) -> Result<()>
    where
        R::Stream: 'static,
    {
        let n = self.n(2_000_000, 100_000);
        let size = 1usize << 20;
        let pool = self.pool.clone();
        let stream = (self.new_stream)();
        let ns = rt.block_on(async move {
            tokio::spawn(async move {
                drop(pool.alloc(size, &stream).await?);
                let t0 = Instant::now();
                for _ in 0..n {
                    drop(std::hint::black_box(pool.alloc(size, &stream).await?));
                }
                Ok::<f64, pinpool::Error>(ns_per(t0, n))
            })
            .await
        })??;
        println!("pinpool dev_async_pair_ns size={size} {ns:.1}");
        Ok(())
    }

    fn replay(&self, path: &str) -> Result<()> {
        let trace = Trace::open(path)?;
        let base = trace_name(path);
        let pool = &self.pool;
        let mut streams = BTreeMap::new();
        for rep in 0..2 {
            pool.empty_cache_blocking()?;
            pool.reset_peak_stats(0)?;
            let mut live: Vec<u64> = vec![0; trace.allocation_count()];
            let t0 = Instant::now();
            for event in trace.events() {
                match *event {
                    TraceEvent::Alloc { id, bytes, stream } => {
                        let s = streams.entry(stream).or_insert_with(&self.new_stream);
                        live[id] = pool.raw_alloc_with_stream(bytes as usize, s)?;
                    }
                    TraceEvent::Free { id } => {
                        pool.raw_delete(std::mem::take(&mut live[id]))?;
                    }
                }
            }
            let ns = ns_per(t0, trace.events().len() as u64);
            let stats = pool.stats(0)?;
            if rep == 1 {
                let peak = trace.peak_live_bytes().max(1) as f64;
                println!(
                    "pinpool dev_replay_reserved_over_peak trace={base} {:.3}",
                    stats.reserved_bytes.all.peak as f64 / peak
                );
                println!("pinpool dev_replay_ns_per_request trace={base} {ns:.1}");
                println!(
                    "pinpool dev_replay_segments trace={base} {}",
                    stats.segment.all.allocated
                );
            }
            for p in live {
                pool.raw_delete(p)?;
            }
        }
        Ok(())
    }

    fn run(&self, rt: &tokio::runtime::Runtime, traces: &[String]) -> Result<()>
    where
        R::Stream: 'static,
    {
        self.pair()?;
        self.pair_with_record()?;
        self.mt()?;
        self.mixed_sizes()?;
        self.fresh()?;
        self.async_pair(rt)?;
        for t in traces {
            self.replay(t)?;
        }
        self.pool.empty_cache_blocking()?;
        Ok(())
    }
}

/// The trace's name as the anchor prints it: no directory, no `.txt` / `.trace` / `.gz`.
fn trace_name(path: &str) -> String {
    let mut s = path.rsplit('/').next().unwrap_or(path).to_owned();
    for suffix in [".gz", ".txt", ".trace"] {
        if let Some(i) = s.rfind(suffix) {
            s.truncate(i);
        }
    }
    s
}

fn tokio_runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

fn config(args: &Args) -> DeviceConfig {
    DeviceConfig::default().with_expandable_segments(args.expandable)
}

fn run_sim(args: &Args) -> Result<()> {
    let rt = tokio_runtime()?;
    let sim = Arc::new(pinpool::sim::SimRuntime::new());
    let pool = DeviceBuilder::new(sim.clone())
        .config(&config(args))
        .handle(rt.handle().clone())
        .build()?;
    let bench = Bench {
        pool,
        new_stream: || sim.stream(),
        quick: args.quick,
    };
    bench.run(&rt, &args.traces)?;
    drop(bench);
    rt.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

#[cfg(feature = "cuda")]
fn run_cuda(args: &Args) -> Result<()> {
    let rt = tokio_runtime()?;
    let pool = DeviceAllocator::builder()
        .cuda()?
        .config(&config(args))
        .handle(rt.handle().clone())
        .build()?;
    let ctx = pool.runtime().context().clone();
    let bench = Bench {
        pool,
        new_stream: || ctx.new_stream().expect("a CUDA stream"),
        quick: args.quick,
    };
    bench.run(&rt, &args.traces)?;
    drop(bench);
    rt.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    eprintln!(
        "device_bench: runtime {}, {}, {} trace(s){}",
        args.runtime,
        if args.expandable {
            "expandable range"
        } else {
            "separate segments"
        },
        args.traces.len(),
        if args.quick { ", quick" } else { "" }
    );
    let result = match args.runtime.as_str() {
        "sim" => run_sim(&args),
        #[cfg(feature = "cuda")]
        "cuda" => run_cuda(&args),
        other => {
            eprintln!("runtime {other:?} is not available in this build (sim, or cuda with --features cuda)");
            std::process::exit(2);
        }
    };
    if let Err(e) = result {
        eprintln!("device_bench: {e}");
        std::process::exit(1);
    }
}
