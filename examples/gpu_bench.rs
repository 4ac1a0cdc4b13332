//! pinpool's side of `../shared/anchors/side_by_side.sh`: the metrics of
//! `torch_host_bench.cpp`, measured the same way, printed as
//! `pinpool <metric> [key=value ...] <number>`, plus pinpool's own extras.
//!
//! ```sh
//! cargo run --release --example gpu_bench -- --runtime sim          # any machine
//! cargo build --release --features cuda --example gpu_bench          # then, on a GPU host:
//! ../shared/anchors/side_by_side.sh target/release/examples/gpu_bench
//! ```
//!
//! Options: `--runtime cuda|sim` (default: cuda when built with the `cuda` feature),
//! `--quick` (fewer iterations, for smoke runs), `--policy NAME` (the size
//! policy of every pool it builds; default: the allocator's default, bestfit).
//!
//! What each metric measures (as the anchor does):
//! - `pair_ns size=S`: one thread, allocate a cached size and free it, 2 000 000 times.
//! - `pair_with_record_ns size=1048576`: one thread, allocate, record use on an idle stream,
//!   free; 200 000 times.
//! - `mt_Mpairs_per_s same_class=C threads=T`: T threads each allocating and freeing 300 000
//!   times, all 64 KiB (C=1) or `4096 << (t % 12)` (C=0); each thread warms its size first.
//! - `fresh_alloc_ms size_mb=M`: cache emptied, then the first allocation of M MiB (pinned by
//!   `register` with huge pages and pre-faulting threads).
//! - `reserved_MiB_for_request_MiB request=1025`: reserved bytes after a 1 GiB + 1 request.
//!
//! Extras: `async_pair_ns` (`alloc().await`, cached, in a tokio task),
//! `mixed_sizes_ns_per_request held=64` (one thread holds 64 buffers and replaces one at a
//! time with a buffer of another size, 4 KiB to 1 MiB: misses included), `h2d_GBps` from a
//! pinpool buffer and from a plain pinned buffer, `event_to_reusable_us` (p50/p99: from the
//! moment a buffer's event completes to the moment a request gets that block back),
//! `poller_idle_cpu_pct` (process CPU while the allocator is idle), and
//! `driver_stream_query_ns` / `driver_event_record_plus_query_ns` (the raw driver calls
//! behind `pair_with_record_ns`, timed in this process right after it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::{PinnedAllocator, Runtime};

struct Args {
    runtime: String,
    quick: bool,
    /// Repeat `pair_ns` this many times and print the fastest (for noisy machines).
    repeat: usize,
    /// The size policy of every pool the benchmark builds.
    policy: pinpool::config::SizePolicyChoice,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        runtime: if cfg!(feature = "cuda") {
            "cuda".into()
        } else {
            "sim".into()
        },
        quick: false,
        repeat: 1,
        policy: Default::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runtime" => args.runtime = it.next().ok_or("--runtime needs a value")?,
            "--quick" => args.quick = true,
            "--repeat" => {
                args.repeat = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&r| r > 0)
                    .ok_or("--repeat needs a positive number")?
            }
            "--policy" => {
                let name = it.next().ok_or("--policy needs a value")?;
                args.policy = pinpool::config::SizePolicyChoice::from_name(&name)
                    .ok_or_else(|| format!("--policy: unknown policy {name:?}"))?;
            }
            "-h" | "--help" => {
                return Err(
                    "usage: gpu_bench [--runtime cuda|sim] [--quick] [--repeat N] \
                     [--policy default|tiered|pow2|bestfit|bestfit_segments]"
                        .into(),
                );
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

fn tokio_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn ns_per(t0: Instant, n: u64) -> f64 {
    t0.elapsed().as_nanos() as f64 / n as f64
}

/// One thread: cached allocate + free of one size.
fn pair_ns<R: Runtime>(allocator: &PinnedAllocator<R>, quick: bool, repeat: usize) {
    for size in [4096usize, 1 << 20, 64 << 20] {
        let n = if quick { 200_000 } else { 2_000_000 };
        drop(allocator.alloc_blocking(size).expect("warm"));
        let best = (0..repeat)
            .map(|_| {
                let t0 = Instant::now();
                for _ in 0..n {
                    drop(std::hint::black_box(
                        allocator.alloc_blocking(size).expect("alloc"),
                    ));
                }
                ns_per(t0, n)
            })
            .fold(f64::INFINITY, f64::min);
        println!("pinpool pair_ns size={size} {best:.1}");
    }
}

/// One thread: allocate, record use on an idle stream, free.
fn pair_with_record<R: Runtime>(allocator: &PinnedAllocator<R>, stream: &R::Stream, quick: bool) {
    let size = 1usize << 20;
    let n = if quick { 20_000 } else { 200_000 };
    let fresh_before = allocator.stats().num_host_alloc;
    let t0 = Instant::now();
    for _ in 0..n {
        let mut b = allocator.alloc_blocking(size).expect("alloc");
        b.record_stream(stream).unwrap();
    }
    let ns = ns_per(t0, n);
    println!("pinpool pair_with_record_ns size={size} {ns:.1}");
    eprintln!(
        "  (fresh allocations during the record loop: {})",
        allocator.stats().num_host_alloc - fresh_before
    );
}

/// T threads allocating and freeing: all one class, or each its own.
fn mt<R: Runtime>(allocator: &PinnedAllocator<R>, quick: bool) {
    let k: u64 = if quick { 50_000 } else { 300_000 };
    for same in [0, 1] {
        for threads in [1usize, 2, 4, 8, 16] {
            let ready = std::sync::atomic::AtomicUsize::new(0);
            // As the anchor does: the clock starts once every thread is spawned, and runs
            // until they are all joined.
            let secs = std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        let ready = &ready;
                        s.spawn(move || {
                            let size = if same == 1 {
                                1 << 16
                            } else {
                                4096usize << (t % 12)
                            };
                            drop(allocator.alloc_blocking(size).expect("warm"));
                            ready.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            while ready.load(std::sync::atomic::Ordering::SeqCst) < threads {
                                std::hint::spin_loop();
                            }
                            for _ in 0..k {
                                drop(std::hint::black_box(
                                    allocator.alloc_blocking(size).expect("alloc"),
                                ));
                            }
                        })
                    })
                    .collect();
                let t0 = Instant::now();
                for h in handles {
                    h.join().expect("benchmark thread");
                }
                t0.elapsed().as_secs_f64()
            });
            println!(
                "pinpool mt_Mpairs_per_s same_class={same} threads={threads} {:.2}",
                (threads as u64 * k) as f64 / secs / 1e6
            );
        }
    }
}

/// The async path: `alloc().await` of a cached size inside a tokio task.
fn async_pair<R: Runtime>(
    allocator: &PinnedAllocator<R>,
    rt: &tokio::runtime::Runtime,
    quick: bool,
) {
    let n: u64 = if quick { 200_000 } else { 2_000_000 };
    let size = 1usize << 20;
    let allocator = allocator.clone();
    let ns = rt.block_on(async move {
        tokio::spawn(async move {
            drop(allocator.alloc(size).await.expect("warm"));
            let t0 = Instant::now();
            for _ in 0..n {
                drop(std::hint::black_box(
                    allocator.alloc(size).await.expect("alloc"),
                ));
            }
            ns_per(t0, n)
        })
        .await
        .expect("task")
    });
    println!("pinpool async_pair_ns size={size} {ns:.1}");
}

/// One thread holds 64 buffers of varied sizes and replaces one at a time with a buffer of
/// another size: what a request costs when sizes vary (the policy's misses included).
fn mixed_sizes<R: Runtime>(allocator: &PinnedAllocator<R>, quick: bool) {
    let n: usize = if quick { 5_000 } else { 50_000 };
    let size = |i: usize| 4096 + i.wrapping_mul(104_729) % (1 << 20);
    let mut held: Vec<_> = (0..64)
        .map(|i| allocator.alloc_blocking(size(n + i)).expect("alloc"))
        .collect();
    let before = allocator.stats();
    let t0 = Instant::now();
    for i in 0..n {
        held[i % 64] = allocator.alloc_blocking(size(i)).expect("alloc");
    }
    let ns = ns_per(t0, n as u64);
    println!("pinpool mixed_sizes_ns_per_request held=64 {ns:.1}");
    let after = allocator.stats();
    eprintln!(
        "  (during the mixed sizes loop: {} fresh allocations, {:.2} misses a request, {:.1} us waited and {:.1} us served a miss)",
        after.num_host_alloc - before.num_host_alloc,
        (after.num_misses - before.num_misses) as f64 / n as f64,
        (after.miss_wait_ns - before.miss_wait_ns) as f64 / 1e3 / (after.num_misses - before.num_misses).max(1) as f64,
        (after.miss_serve_ns - before.miss_serve_ns) as f64 / 1e3 / (after.num_misses - before.num_misses).max(1) as f64
    );
}

/// CPU time of the whole process (user + system), from /proc/self/stat.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every Linux this runs on.
    Some(Duration::from_millis(ticks * 10))
}

/// Process CPU while the allocator sits idle for `secs`, in percent of one core.
fn idle_cpu_pct(secs: f64) -> Option<f64> {
    let c0 = process_cpu()?;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let c1 = process_cpu()?;
    Some(100.0 * (c1 - c0).as_secs_f64() / t0.elapsed().as_secs_f64())
}

#[cfg(feature = "cuda")]
fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn run_sim(args: &Args) {
    let rt = tokio_runtime();
    let sim = Arc::new(pinpool::sim::SimRuntime::new());
    let allocator = rt
        .block_on(async {
            pinpool::Builder::new(sim.clone())
                .policy(args.policy.policy())
                .build()
        })
        .expect("allocator");
    pair_ns(&allocator, args.quick, args.repeat);
    let stream = sim.new_stream().expect("stream");
    pair_with_record(&allocator, &stream, args.quick);
    mt(&allocator, args.quick);
    async_pair(&allocator, &rt, args.quick);
    mixed_sizes(&allocator, args.quick);
    // Idle with nothing pending, then with a block waiting on a stream that never finishes.
    if let Some(p) = idle_cpu_pct(1.0) {
        println!("pinpool poller_idle_cpu_pct pending=0 {p:.2}");
    }
    let held = sim.new_stream().expect("stream");
    let hold = held.hold();
    for _ in 0..3 {
        let mut b = allocator.alloc_blocking(4096).expect("alloc");
        b.record_stream(&held).unwrap();
    }
    if let Some(p) = idle_cpu_pct(1.0) {
        println!("pinpool poller_idle_cpu_pct pending=1 {p:.2}");
    }
    hold.release();
    drop(allocator);
    rt.shutdown_timeout(Duration::from_secs(5));
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use cudarc::driver::{result, sys};
    use pinpool::config::{Config, PinStrategy};
    use pinpool::cuda::CudaRuntime;

    pub(super) fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
        let rt = tokio_runtime();
        let cuda = Arc::new(CudaRuntime::with_config(0, Config::default())?);
        let allocator = rt.block_on(async {
            pinpool::Builder::new(cuda.clone())
                .policy(args.policy.policy())
                .build()
        })?;
        let stream = cuda.context().new_stream()?;

        pair_ns(&allocator, args.quick, args.repeat);
        pair_with_record(&allocator, &stream, args.quick);
        driver_calls(&cuda, &stream, args.quick)?;
        mt(&allocator, args.quick);
        fresh(&rt, args)?;
        async_pair(&allocator, &rt, args.quick);
        mixed_sizes(&allocator, args.quick);
        h2d(&allocator, &cuda, &stream)?;
        event_latency(&allocator, &cuda, &stream, args.quick)?;
        if let Some(p) = idle_cpu_pct(2.0) {
            println!("pinpool poller_idle_cpu_pct pending=0 {p:.2}");
        }
        drop(allocator);
        rt.shutdown_timeout(Duration::from_secs(5));
        Ok(())
    }

    /// Fresh memory: `register`, transparent huge pages, pre-faulting on 16 threads.
    fn fresh(rt: &tokio::runtime::Runtime, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
        let config = Config::default()
            .with_pin_method(PinStrategy::Register)
            .with_huge_pages(true)
            .with_prefault_threads(16);
        let cuda = Arc::new(CudaRuntime::with_config(0, config)?);
        let allocator = rt.block_on(async {
            pinpool::Builder::new(cuda)
                .policy(args.policy.policy())
                .build()
        })?;
        for mb in [16usize, 256, 1024] {
            allocator.empty_cache_blocking()?;
            let t0 = Instant::now();
            drop(allocator.alloc_blocking(mb << 20)?);
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            println!("pinpool fresh_alloc_ms size_mb={mb} {ms:.2}");
        }
        allocator.empty_cache_blocking()?;
        allocator.reset_peak_stats();
        drop(allocator.alloc_blocking((1 << 30) + 1)?);
        let peak = allocator.stats().allocated_bytes.peak as f64 / 1048576.0;
        println!("pinpool reserved_MiB_for_request_MiB request=1025 {peak:.0}");
        allocator.empty_cache_blocking()?;
        Ok(())
    }

    /// What the driver calls behind `pair_with_record_ns` cost in this process, right after
    /// it: `cuStreamQuery` on the idle stream (what a free after `record_stream` asks), and
    /// an event's record and query (what the anchor's `event_record_plus_query_ns` times in
    /// its own process). Their cost depends on the CPU a thread runs on: on the GPU hosts'
    /// virtual machines the same call took about 160 ns on some virtual CPUs and 300 on
    /// others, so a ratio of figures from two processes carries that factor.
    fn driver_calls(
        cuda: &Arc<CudaRuntime>,
        stream: &Arc<cudarc::driver::CudaStream>,
        quick: bool,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let n: u32 = if quick { 20_000 } else { 200_000 };
        cuda.context().bind_to_thread()?;
        let s = stream.cu_stream();
        let t0 = Instant::now();
        for _ in 0..n {
            // SAFETY: the stream is live; the answer (idle or not) is all that is wanted.
            std::hint::black_box(unsafe { sys::cuStreamQuery(s) });
        }
        let query = ns_per(t0, n.into());
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        let t0 = Instant::now();
        for _ in 0..n {
            // SAFETY: the event and the stream are live.
            unsafe { result::event::record(event, s) }?;
            // SAFETY: as above.
            std::hint::black_box(unsafe { result::event::query(event) }.is_ok());
        }
        let record_query = ns_per(t0, n.into());
        // SAFETY: recorded work on the stream is done or harmless to the event's destruction.
        unsafe { result::event::destroy(event) }?;
        println!("pinpool driver_stream_query_ns {query:.1}");
        println!("pinpool driver_event_record_plus_query_ns {record_query:.1}");
        Ok(())
    }

    /// Host→device bandwidth from a pinpool buffer and from a plain `cuMemHostAlloc` buffer.
    fn h2d(
        allocator: &PinnedAllocator<CudaRuntime>,
        cuda: &Arc<CudaRuntime>,
        stream: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let bytes = 256usize << 20;
        let reps = 10;
        cuda.context().bind_to_thread()?;
        // SAFETY: a plain device allocation of `bytes`, freed below.
        let dev = unsafe { result::malloc_sync(bytes) }?;
        let time = |src: &[u8]| -> Result<f64, Box<dyn std::error::Error>> {
            // SAFETY: `dev` holds `bytes` bytes, `src` is `bytes` pinned bytes that outlive
            // the copies (the stream is synchronized before returning).
            unsafe { result::memcpy_htod_async(dev, src, stream.cu_stream()) }?;
            stream.synchronize()?;
            let t0 = Instant::now();
            for _ in 0..reps {
                // SAFETY: as above.
                unsafe { result::memcpy_htod_async(dev, src, stream.cu_stream()) }?;
            }
            stream.synchronize()?;
            Ok((bytes * reps) as f64 / t0.elapsed().as_secs_f64() / 1e9)
        };
        let mut buf = allocator.alloc_blocking(bytes)?;
        buf.fill(1);
        buf.record_stream(stream).unwrap();
        let ours = time(&buf[..])?;
        drop(buf);
        let plain = cuda.host_alloc_with(bytes, PinStrategy::HostAlloc)?;
        // SAFETY: `plain` is `bytes` bytes of pinned memory we own until the free below.
        let plain_slice = unsafe { std::slice::from_raw_parts_mut(plain.ptr.as_ptr(), bytes) };
        plain_slice.fill(1);
        let theirs = time(plain_slice)?;
        cuda.host_free(plain)?;
        // SAFETY: `dev` came from `malloc_sync` and every copy into it has finished.
        unsafe { result::free_sync(dev) }?;
        println!("pinpool h2d_GBps source=pinpool {ours:.2}");
        println!("pinpool h2d_GBps source=plain_pinned {theirs:.2}");
        println!(
            "pinpool h2d_ratio_pct pinpool_over_plain {:.1}",
            100.0 * ours / theirs
        );
        Ok(())
    }

    /// From an event's completion to the block being handed out again, p50 and p99: the
    /// buffer is used by a copy of about 300 µs, freed, and the moment the copy's completion
    /// is seen (by spinning on a marker event recorded right after it) a request of the same
    /// class is made, on the freeing thread, or on another thread that spins on the marker.
    fn event_latency(
        allocator: &PinnedAllocator<CudaRuntime>,
        cuda: &Arc<CudaRuntime>,
        stream: &Arc<cudarc::driver::CudaStream>,
        quick: bool,
    ) -> Result<(), Box<dyn std::error::Error>> {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let n = if quick { 50 } else { 400 };
        let size = 16usize << 20;
        cuda.context().bind_to_thread()?;
        // SAFETY: a plain device allocation of `size`, freed below.
        let dev = unsafe { result::malloc_sync(size) }?;
        let marker = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        struct Marker(sys::CUevent);
        // SAFETY: an event handle may be queried from any thread.
        unsafe impl Sync for Marker {}
        let marker_ref = &Marker(marker);
        // One iteration: use, free, mark; returns once the marker is recorded.
        let step = || -> Result<(), Box<dyn std::error::Error>> {
            let mut buf = allocator.alloc_blocking(size)?;
            buf.record_stream(stream).unwrap();
            // SAFETY: `dev` holds `size` bytes; the buffer outlives the copy because its
            // free records an event after it, and reuse waits for that event.
            unsafe { result::memcpy_htod_async(dev, &buf[..], stream.cu_stream()) }?;
            drop(buf);
            // SAFETY: `marker` and the stream are live.
            unsafe { result::event::record(marker, stream.cu_stream()) }?;
            Ok(())
        };
        let spin = |m: &Marker| {
            // SAFETY: the marker is live until the end of this function.
            while unsafe { result::event::query(m.0) }.is_err() {
                std::hint::spin_loop();
            }
        };
        for other_thread in [false, true] {
            let mut lat = Vec::with_capacity(n);
            let fresh0 = allocator.stats().num_host_alloc;
            if !other_thread {
                for _ in 0..n {
                    step()?;
                    spin(marker_ref);
                    let t0 = Instant::now();
                    let again = allocator.alloc_blocking(size)?;
                    lat.push(t0.elapsed().as_secs_f64() * 1e6);
                    drop(again);
                }
            } else {
                let go = AtomicUsize::new(0);
                let done = AtomicUsize::new(0);
                let helper = std::thread::scope(|s| {
                    let h = s.spawn(|| -> Result<Vec<f64>, pinpool::Error> {
                        let mut lat = Vec::with_capacity(n);
                        for i in 1..=n {
                            while go.load(SeqCst) < i {
                                std::hint::spin_loop();
                            }
                            spin(marker_ref);
                            let t0 = Instant::now();
                            let again = allocator.alloc_blocking(size)?;
                            lat.push(t0.elapsed().as_secs_f64() * 1e6);
                            drop(again);
                            done.store(i, SeqCst);
                        }
                        Ok(lat)
                    });
                    let mut err = None;
                    for i in 1..=n {
                        if let Err(e) = step() {
                            err = Some(e.to_string());
                        }
                        go.store(i, SeqCst);
                        while done.load(SeqCst) < i && !h.is_finished() {
                            std::hint::spin_loop();
                        }
                    }
                    (h.join(), err)
                });
                match helper {
                    (Ok(Ok(l)), None) => lat = l,
                    (_, Some(e)) => return Err(e.into()),
                    (Ok(Err(e)), _) => return Err(e.into()),
                    (Err(_), _) => return Err("helper thread panicked".into()),
                }
            }
            let who = if other_thread { "other" } else { "same" };
            eprintln!(
                "  ({who} thread: fresh allocations during {n} rounds: {})",
                allocator.stats().num_host_alloc - fresh0
            );
            println!(
                "pinpool event_to_reusable_us thread={who} p50 {:.2}",
                percentile(&mut lat, 0.5)
            );
            println!(
                "pinpool event_to_reusable_us thread={who} p99 {:.2}",
                percentile(&mut lat, 0.99)
            );
        }
        stream.synchronize()?;
        // SAFETY: the marker is no longer recorded anywhere; `dev` is idle after the sync.
        unsafe {
            result::event::destroy(marker)?;
            result::free_sync(dev)?;
        }
        Ok(())
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
    match args.runtime.as_str() {
        "sim" => run_sim(&args),
        #[cfg(feature = "cuda")]
        "cuda" => {
            if let Err(e) = gpu::run(&args) {
                eprintln!("gpu_bench: {e}");
                std::process::exit(1);
            }
        }
        other => {
            eprintln!("runtime {other:?} is not available in this build (sim, or cuda with --features cuda)");
            std::process::exit(2);
        }
    }
}
