//! A simulated inference server: the main job.
//!
//! Many concurrent request tasks each stage an input in a pinned buffer, copy it to the
//! device on one of a few streams, run a "kernel", copy the result back into a second pinned
//! buffer, wait for it, and free both. Sizes vary the way batched requests do. At the end it
//! prints throughput, the cache hit rate and the allocator's statistics.
//!
//! ```text
//! cargo run --release --example serve -- [--requests N] [--concurrency N] [--streams N] [--max-mib N]
//! ```
//!
//! By default reserved pinned memory is capped at 40 MiB, below what the workload would
//! reserve unbounded: requests over the cap wait for buffers to come back (backpressure).
//!
//! ```text
//! ```
//!
//! It runs on the simulated runtime (software streams that check every copy for early reuse).
//! Built with `--features cuda` on a machine with a GPU, it runs the same server on the real
//! runtime instead: each request copies its input into device memory, a device-side clear and
//! copy stand in for the model, the result comes back into pinned memory, and the bytes are
//! checked. Without a GPU it says so and runs on the simulated runtime as before.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::sim::{DeviceBuffer, SimRuntime, SimStream};
use pinpool::{Builder, PinnedAllocator, Runtime};

struct Args {
    requests: u64,
    concurrency: usize,
    streams: usize,
    /// Cap on reserved pinned memory, in MiB (0: none).
    max_mib: u64,
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
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        requests: 20_000,
        concurrency: 64,
        streams: 4,
        max_mib: 40,
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
            "-h" | "--help" => {
                println!(
                    "usage: serve [--requests N] [--concurrency N] [--streams N] [--max-mib N]\n\
                     --max-mib caps reserved pinned memory (default 40; 0 for none): requests\n\
                     over the cap wait for buffers to come back instead of failing"
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

#[derive(Default)]
struct Counters {
    done: AtomicU64,
    bytes: AtomicU64,
    alloc_ns: AtomicU64,
}

async fn serve_one(
    pool: &PinnedAllocator<SimRuntime>,
    stream: &SimStream,
    dev: &DeviceBuffer,
    size: usize,
    tag: u8,
    counters: &Counters,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let rt = pool.runtime();
    let t0 = Instant::now();
    let mut input = pool.alloc(size).await?;
    let mut output = pool.alloc(size / 4).await?;
    counters
        .alloc_ns
        .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);

    input.fill(tag);
    stream.copy_to_device(input.as_ptr(), COPY.min(size), dev)?;
    input.record_stream(stream);
    drop(input); // freed at once; reused only after the copy has run
    stream.delay(Duration::from_micros(20)); // the model
    let n = COPY.min(output.len());
    stream.copy_to_host(dev, output.as_mut_ptr(), n)?;
    output.record_stream(stream);
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
    let streams: Vec<SimStream> = (0..args.streams).map(|_| sim.stream()).collect();
    let counters = Arc::new(Counters::default());
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();

    let ticker = spawn_ticker(counters.clone(), args.requests, start);

    let mut workers = Vec::new();
    for w in 0..args.concurrency {
        let pool = pool.clone();
        let stream = streams[w % streams.len()].clone();
        let counters = counters.clone();
        let next = next.clone();
        let total = args.requests;
        workers.push(tokio::spawn(async move {
            let dev = DeviceBuffer::new(COPY);
            let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return Ok::<_, String>(());
                }
                let size = request_size(&mut rng);
                serve_one(&pool, &stream, &dev, size, (i % 251) as u8 + 1, &counters)
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

    use cudarc::driver::{CudaSlice, CudaStream};
    use pinpool::cuda::CudaRuntime;

    /// The largest request `request_size` makes.
    const MAX_REQUEST: usize = 16 * 1024 * 128;

    /// Device memory of one worker: where the input lands and where the "model" writes.
    struct Device {
        input: CudaSlice<u8>,
        output: CudaSlice<u8>,
    }

    async fn serve_one(
        pool: &PinnedAllocator<CudaRuntime>,
        stream: &Arc<CudaStream>,
        dev: &mut Device,
        size: usize,
        tag: u8,
        counters: &Counters,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let rt = pool.runtime();
        let t0 = Instant::now();
        let mut input = pool.alloc(size).await?;
        let mut output = pool.alloc(size / 4).await?;
        counters
            .alloc_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);

        input.fill(tag);
        output.fill(0);
        input.copy_to_device(stream, &mut dev.input.slice_mut(..size))?; // records the stream
        drop(input); // freed at once; reused only after the copy has run
        let n = output.len();
        // The model: clear the output, then copy the first quarter of the input into it.
        stream.memset_zeros(&mut dev.output.slice_mut(..n))?;
        stream.memcpy_dtod(&dev.input.slice(..n), &mut dev.output.slice_mut(..n))?;
        output.copy_from_device(stream, &dev.output.slice(..n))?;
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
            let stream = streams[w % streams.len()].clone();
            let counters = counters.clone();
            let next = next.clone();
            let total = args.requests;
            workers.push(tokio::spawn(async move {
                let mut dev = Device {
                    input: stream
                        .alloc_zeros::<u8>(MAX_REQUEST)
                        .map_err(|e| e.to_string())?,
                    output: stream
                        .alloc_zeros::<u8>(MAX_REQUEST / 4)
                        .map_err(|e| e.to_string())?,
                };
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
                        &stream,
                        &mut dev,
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
        let done = counters.done.load(Ordering::Relaxed);
        println!("| results checked | {done} of {} correct |", args.requests);
        !failed && done == args.requests
    }
}
