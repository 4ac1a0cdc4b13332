//! A simulated inference server: the main job.
//!
//! Many concurrent request tasks each stage an input in a pinned buffer, take the request's
//! device buffers (its input, and activations twice that size) from the device pool on the
//! stream it runs on, copy the input to the device, run a "kernel" that writes the
//! activations from it, copy part of them back into a second pinned buffer, wait for it,
//! check the bytes and free everything. Sizes vary the way batched requests do. At the end
//! it prints throughput, the cache hit rates and the statistics of both allocators.
//!
//! ```text
//! cargo run --release --example serve -- [--requests N] [--concurrency N] [--streams N]
//!     [--max-mib N] [--device-max-mib N]
//! ```
//!
//! By default reserved pinned memory is capped at 40 MiB, below what the workload would
//! reserve unbounded: requests over the cap wait for buffers to come back (backpressure).
//! Device memory is capped at 512 MiB, more than the largest requests of every task at once
//! need (each task holds two device buffers at a time, so a cap below that could leave every
//! task holding its input while waiting for room for its activations).
//!
//! Device buffers are freed on their own stream as soon as the work on them is enqueued:
//! stream order makes them reusable by the next request on that stream at once, with no
//! event, and the simulated device checks that no such reuse overtakes the work.
//!
//! It runs on the simulated runtime (software streams and a simulated 16 GiB device that
//! check every copy and kernel for early reuse). Built with `--features cuda` on a machine
//! with a GPU, it runs the same server on the real runtime instead, every result checked.
//! Without a GPU it says so and runs on the simulated runtime as before.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::sim::{SimRuntime, SimStream};
use pinpool::{
    Builder, DeviceAllocator, DeviceBuilder, DeviceRuntime, DeviceStats, PinnedAllocator, Runtime,
};

struct Args {
    requests: u64,
    concurrency: usize,
    streams: usize,
    /// Cap on reserved pinned memory, in MiB (0: none).
    max_mib: u64,
    /// Cap on reserved device memory, in MiB (0: none).
    device_max_mib: u64,
}

impl Args {
    /// The allocator builder's memory cap.
    fn apply<R: Runtime>(&self, b: Builder<R>) -> Builder<R> {
        if self.max_mib > 0 {
            b.max_bytes((self.max_mib as usize) << 20)
        } else {
            b
        }
    }

    /// The device allocator on `runtime` (the pinned pool's), with its cap.
    fn device<R: DeviceRuntime>(
        &self,
        runtime: Arc<R>,
    ) -> Result<DeviceAllocator<R>, pinpool::Error> {
        let b = DeviceBuilder::new(runtime);
        if self.device_max_mib > 0 {
            b.max_bytes((self.device_max_mib as usize) << 20).build()
        } else {
            b.build()
        }
    }
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        requests: 20_000,
        concurrency: 64,
        streams: 4,
        max_mib: 40,
        device_max_mib: 512,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            it.next()
                .ok_or(format!("{name} needs a value"))?
                .parse::<u64>()
                .map_err(|e| format!("{name}: {e}"))
        };
        match flag.as_str() {
            "--requests" => a.requests = value("--requests")?,
            "--concurrency" => a.concurrency = value("--concurrency")?.max(1) as usize,
            "--streams" => a.streams = value("--streams")?.max(1) as usize,
            "--max-mib" => a.max_mib = value("--max-mib")?,
            "--device-max-mib" => a.device_max_mib = value("--device-max-mib")?,
            "-h" | "--help" => {
                println!(
                    "usage: serve [--requests N] [--concurrency N] [--streams N] [--max-mib N] \
                     [--device-max-mib N]\n\
                     --max-mib caps reserved pinned memory (default 40; 0 for none): requests\n\
                     over the cap wait for buffers to come back instead of failing\n\
                     --device-max-mib caps reserved device memory (default 512; 0 for none)"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    Ok(a)
}

/// Request sizes: batch × sequence length × hidden size, as a server sees them.
fn request_size(rng: &mut u64) -> usize {
    let r = xorshift(rng);
    let batch = 1 + (r % 16) as usize;
    let seq = [128usize, 256, 384, 512, 1024][(r >> 8) as usize % 5];
    let hidden = [64usize, 128][(r >> 16) as usize % 2];
    batch * seq * hidden
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Bytes of each buffer actually copied (the simulated device checks them all).
const COPY: usize = 16 << 10;

/// Activations are this many times the size of the request's input.
const ACTIVATIONS: usize = 2;

#[derive(Default)]
struct Counters {
    done: AtomicU64,
    bytes: AtomicU64,
    alloc_ns: AtomicU64,
}

async fn serve_one(
    pool: &PinnedAllocator<SimRuntime>,
    device: &DeviceAllocator<SimRuntime>,
    stream: &SimStream,
    size: usize,
    tag: u8,
    counters: &Counters,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let rt = pool.runtime();
    let t0 = Instant::now();
    let mut input = pool.alloc(size).await?;
    let mut output = pool.alloc(size / 4).await?;
    let d_input = device.alloc(size, stream).await?;
    let d_act = device.alloc(size * ACTIVATIONS, stream).await?;
    counters
        .alloc_ns
        .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);

    input.fill(tag);
    let n = COPY.min(size);
    stream.copy_htod(input.as_ptr(), d_input.device_ptr(), n)?;
    input.record_stream(stream);
    drop(input); // freed at once; reused only after the copy has run
                 // The model: clear the activations, then write them from the input.
    stream.fill_device(d_act.device_ptr(), n, 0)?;
    stream.delay(Duration::from_micros(20));
    stream.copy_dtod(d_input.device_ptr(), d_act.device_ptr(), n)?;
    let n = n.min(output.len());
    stream.copy_dtoh(d_act.device_ptr(), output.as_mut_ptr(), n)?;
    output.record_stream(stream);
    // Freed on their own stream: the next request on it may take them at once.
    drop((d_input, d_act));
    let done = rt.record_event(stream)?;
    while !rt.query_event(&done)? {
        tokio::time::sleep(Duration::from_micros(100)).await;
    }
    rt.release_event(done);
    if output[..n].iter().any(|&b| b != tag) {
        return Err("the result came back wrong".into());
    }
    drop(output);
    counters.done.fetch_add(1, Ordering::Relaxed);
    counters.bytes.fetch_add(size as u64, Ordering::Relaxed);
    Ok(())
}

fn spawn_ticker(
    counters: Arc<Counters>,
    total: u64,
    start: Instant,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let every = if std::io::stderr().is_terminal() {
            100
        } else {
            1000
        };
        loop {
            tokio::time::sleep(Duration::from_millis(every)).await;
            progress(counters.done.load(Ordering::Relaxed), total, start, false);
        }
    })
}

/// Waits for the request tasks, stops the progress ticker and prints the last progress line;
/// returns whether any request failed, and the wall time.
async fn join_workers(
    workers: Vec<tokio::task::JoinHandle<Result<(), String>>>,
    ticker: tokio::task::JoinHandle<()>,
    counters: &Counters,
    total: u64,
    start: Instant,
) -> (bool, Duration) {
    let mut failed = false;
    for w in workers {
        if let Err(e) = w.await.expect("worker task") {
            eprintln!("serve: {e}");
            failed = true;
        }
    }
    ticker.abort();
    let elapsed = start.elapsed();
    progress(counters.done.load(Ordering::Relaxed), total, start, true);
    (failed, elapsed)
}

/// Prints the table of results common to both runtimes.
fn report(stats: &pinpool::HostStats, counters: &Counters, elapsed: Duration) {
    let done = counters.done.load(Ordering::Relaxed);
    let allocs = stats.active_requests.allocated.max(1);
    let hit = 1.0 - stats.num_host_alloc as f64 / allocs as f64;
    let mib = |b: i64| b as f64 / (1 << 20) as f64;
    println!();
    println!("| metric | value |");
    println!("| --- | --- |");
    println!("| requests served | {done} |");
    println!("| wall time | {:.2} s |", elapsed.as_secs_f64());
    println!(
        "| throughput | {:.0} req/s |",
        done as f64 / elapsed.as_secs_f64()
    );
    println!(
        "| staged | {:.2} GB/s |",
        counters.bytes.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64() / 1e9
    );
    println!(
        "| mean time to get both buffers (incl. scheduling) | {:.2} µs |",
        counters.alloc_ns.load(Ordering::Relaxed) as f64 / done.max(1) as f64 / 1e3
    );
    println!(
        "| buffers allocated | {} |",
        stats.active_requests.allocated
    );
    println!("| cache hit rate | {:.3} % |", hit * 100.0);
    println!("| fresh pinned allocations | {} |", stats.num_host_alloc);
    println!(
        "| reserved now / peak | {:.1} / {:.1} MiB |",
        mib(stats.allocated_bytes.current),
        mib(stats.allocated_bytes.peak)
    );
    println!(
        "| active bytes peak | {:.1} MiB |",
        mib(stats.active_bytes.peak)
    );
    println!(
        "| host alloc time total / max | {:.1} ms / {} µs |",
        stats.host_alloc_time.total as f64 / 1e3,
        stats.host_alloc_time.max
    );
    match stats.limit_bytes {
        Some(limit) => println!(
            "| memory limit | {:.1} MiB (cache emptied to make room {} times; requests refused {}) |",
            mib(limit),
            stats.num_alloc_retries,
            stats.num_ooms
        ),
        None => println!("| memory limit | none |"),
    }
}

/// The device side of the table.
fn report_device(stats: &DeviceStats) {
    let mib = |b: i64| b as f64 / (1 << 20) as f64;
    let allocs = stats.allocation.all.allocated.max(1);
    println!(
        "| device buffers allocated | {} |",
        stats.allocation.all.allocated
    );
    println!(
        "| device cache hit rate | {:.3} % |",
        100.0 * (1.0 - stats.num_device_alloc as f64 / allocs as f64)
    );
    println!(
        "| device memory taken from the driver | {} calls ({} given back) |",
        stats.num_device_alloc, stats.num_device_free
    );
    println!(
        "| device reserved now / peak | {:.1} / {:.1} MiB |",
        mib(stats.reserved_bytes.all.current),
        mib(stats.reserved_bytes.all.peak)
    );
    println!(
        "| device allocated peak (small / large pool) | {:.1} MiB ({:.1} / {:.1}) |",
        mib(stats.allocated_bytes.all.peak),
        mib(stats.allocated_bytes.small_pool.peak),
        mib(stats.allocated_bytes.large_pool.peak)
    );
    println!(
        "| device requested peak | {:.1} MiB |",
        mib(stats.requested_bytes.all.peak)
    );
    match stats.limit_bytes {
        Some(limit) => println!(
            "| device memory limit | {:.1} MiB (cache emptied to make room {} times; requests refused {}) |",
            mib(limit),
            stats.num_alloc_retries,
            stats.num_ooms
        ),
        None => println!("| device memory limit | none |"),
    }
}

fn progress(done: u64, total: u64, start: Instant, final_line: bool) {
    let width = 30;
    let filled = (done * width / total.max(1)) as usize;
    let rate = done as f64 / start.elapsed().as_secs_f64().max(1e-9);
    let bar = format!(
        "[{}{}] {done}/{total} requests  {:.1}k req/s",
        "=".repeat(filled),
        " ".repeat(width as usize - filled),
        rate / 1e3
    );
    let mut err = std::io::stderr();
    if err.is_terminal() {
        let _ = write!(err, "\r{bar}{}", if final_line { "\n" } else { "" });
    } else {
        let _ = writeln!(err, "{bar}");
    }
    let _ = err.flush();
}

#[tokio::main]
async fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("serve: {e}");
            std::process::exit(2);
        }
    };
    #[cfg(feature = "cuda")]
    match PinnedAllocator::builder().cuda(0) {
        Ok(builder) => {
            let pool = args.apply(builder).build().expect("allocator");
            if !gpu::serve(pool, &args).await {
                std::process::exit(1);
            }
            return;
        }
        Err(e) => println!("pinpool serve: no CUDA GPU ({e}); using the sim runtime"),
    }
    serve_sim(args).await;
}

async fn serve_sim(args: Args) {
    println!(
        "pinpool serve: runtime=sim (software streams; every copy is checked for early reuse)"
    );
    println!(
        "{} requests, {} concurrent, {} streams, memory limit {}",
        args.requests,
        args.concurrency,
        args.streams,
        if args.max_mib > 0 {
            format!("{} MiB", args.max_mib)
        } else {
            "none".into()
        }
    );
    let sim = SimRuntime::new();
    let pool = args
        .apply(Builder::new(Arc::new(sim.clone())))
        .build()
        .expect("allocator");
    let device = args
        .device(pool.runtime().clone())
        .expect("device allocator");
    let streams: Vec<SimStream> = (0..args.streams).map(|_| sim.stream()).collect();
    let counters = Arc::new(Counters::default());
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();

    let ticker = spawn_ticker(counters.clone(), args.requests, start);

    let mut workers = Vec::new();
    for w in 0..args.concurrency {
        let pool = pool.clone();
        let device = device.clone();
        let stream = streams[w % streams.len()].clone();
        let counters = counters.clone();
        let next = next.clone();
        let total = args.requests;
        workers.push(tokio::spawn(async move {
            let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return Ok::<_, String>(());
                }
                let size = request_size(&mut rng);
                serve_one(
                    &pool,
                    &device,
                    &stream,
                    size,
                    (i % 251) as u8 + 1,
                    &counters,
                )
                .await
                .map_err(|e| format!("request {i}: {e}"))?;
            }
        }));
    }
    let (failed, elapsed) = join_workers(workers, ticker, &counters, args.requests, start).await;
    for s in &streams {
        s.synchronize().expect("stream");
    }

    report(&pool.stats(), &counters, elapsed);
    report_device(&device.stats(0).expect("device 0"));
    println!("| early reuses detected | {} |", sim.violations());
    if sim.violations() > 0 || failed {
        for v in sim.violation_log().iter().take(5) {
            eprintln!("violation: {v:?}");
        }
        std::process::exit(1);
    }
}

/// The same server on the real CUDA runtime.
#[cfg(feature = "cuda")]
mod gpu {
    use super::*;

    use cudarc::driver::{result, CudaStream};
    use pinpool::cuda::CudaRuntime;

    async fn serve_one(
        pool: &PinnedAllocator<CudaRuntime>,
        device: &DeviceAllocator<CudaRuntime>,
        stream: &Arc<CudaStream>,
        size: usize,
        tag: u8,
        counters: &Counters,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let rt = pool.runtime();
        let t0 = Instant::now();
        let mut input = pool.alloc(size).await?;
        let mut output = pool.alloc(size / 4).await?;
        let mut d_input = device.alloc(size, stream).await?;
        let mut d_act = device.alloc(size * ACTIVATIONS, stream).await?;
        counters
            .alloc_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);

        input.fill(tag);
        output.fill(0);
        input.copy_to_device(stream, &mut d_input)?; // records the stream
        drop(input); // freed at once; reused only after the copy has run
                     // The model: clear the activations, then write them from the input.
        stream.memset_zeros(&mut d_act)?;
        stream.memcpy_dtod(&d_input, &mut d_act)?;
        // The first quarter of the activations back into pinned memory.
        output.record_stream(stream);
        // SAFETY: `output` is pinned memory of `output.len()` bytes, recorded on the stream
        // (reused only after the copy has run); `d_act` holds more than that many bytes and
        // is freed on this same stream, after the copy in stream order.
        unsafe {
            result::memcpy_dtoh_async(&mut output[..], d_act.device_ptr(), stream.cu_stream())
        }?;
        drop((d_input, d_act)); // reusable by the next request on this stream at once
        let done = rt.record_event(stream)?;
        while !rt.query_event(&done)? {
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        rt.release_event(done);
        if output.iter().any(|&b| b != tag) {
            return Err("the result came back wrong".into());
        }
        drop(output);
        counters.done.fetch_add(1, Ordering::Relaxed);
        counters.bytes.fetch_add(size as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Runs the server on `pool`; false when a request failed.
    pub(super) async fn serve(pool: PinnedAllocator<CudaRuntime>, args: &Args) -> bool {
        let ctx = pool.runtime().context().clone();
        let device = match args.device(pool.runtime().clone()) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("serve: device allocator: {e}");
                return false;
            }
        };
        println!(
            "pinpool serve: runtime=cuda (device {}, pin_method={}; every result is checked)",
            pool.runtime().ordinal(),
            pool.runtime().config().pin_method
        );
        println!(
            "{} requests, {} concurrent, {} streams",
            args.requests, args.concurrency, args.streams
        );
        let streams: Vec<Arc<CudaStream>> = (0..args.streams)
            .map(|_| ctx.new_stream().expect("stream"))
            .collect();
        let counters = Arc::new(Counters::default());
        let next = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let ticker = spawn_ticker(counters.clone(), args.requests, start);

        let mut workers = Vec::new();
        for w in 0..args.concurrency {
            let pool = pool.clone();
            let device = device.clone();
            let stream = streams[w % streams.len()].clone();
            let counters = counters.clone();
            let next = next.clone();
            let total = args.requests;
            workers.push(tokio::spawn(async move {
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        stream.synchronize().map_err(|e| e.to_string())?;
                        return Ok::<_, String>(());
                    }
                    let size = request_size(&mut rng);
                    serve_one(
                        &pool,
                        &device,
                        &stream,
                        size,
                        (i % 251) as u8 + 1,
                        &counters,
                    )
                    .await
                    .map_err(|e| format!("request {i}: {e}"))?;
                }
            }));
        }
        let (failed, elapsed) =
            super::join_workers(workers, ticker, &counters, args.requests, start).await;
        for s in &streams {
            s.synchronize().expect("stream");
        }
        report(&pool.stats(), &counters, elapsed);
        match device.stats(0) {
            Ok(stats) => report_device(&stats),
            Err(e) => eprintln!("serve: device statistics: {e}"),
        }
        let done = counters.done.load(Ordering::Relaxed);
        println!("| results checked | {done} of {} correct |", args.requests);
        !failed && done == args.requests
    }
}
