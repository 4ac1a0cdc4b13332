//! A simulated inference server: the main job.
//!
//! Many concurrent request tasks each take the request's memory — its input and its result
//! in pinned host memory from a [`PinnedAllocator`], its input and its activations
//! ([`ACTIVATIONS`] times the input's size) in device memory from a [`DeviceAllocator`], on
//! the stream the request runs on — then copy the input to the device, run a "kernel" that
//! writes the activations from it, copy the start of the activations back into the pinned
//! result, wait for it, check the bytes and free everything. Sizes vary the way batched
//! requests do. At the end it prints throughput and, side by side, the statistics of the
//! pinned and the device allocator (cache hit rates, driver calls, reserved and in-use
//! peaks, limits).
//!
//! ```text
//! cargo run --release --example serve -- [--requests N] [--concurrency N] [--streams N]
//!     [--max-mib N] [--device-max-mib N] [--no-lend]
//! ```
//!
//! - `--requests N` (default 20000), `--concurrency N` request tasks (default 64),
//!   `--streams N` (default 4; task `i` runs on stream `i % N`).
//! - `--max-mib N` caps reserved pinned memory (default 40; 0 for none). By default the cap is
//!   below what the workload would reserve unbounded, so requests over it wait for buffers to
//!   come back (backpressure).
//! - `--device-max-mib N` caps reserved device memory (default 48; 0 for none). The requests
//!   hold little device memory at once (about 12 MiB on the simulated runtime: each frees its
//!   device buffers as soon as its work is enqueued), but unbounded the allocator reserves
//!   about 100 MiB, since each stream's pool keeps blocks of every size it has served. At
//!   48 MiB a stream's pool that finds no room borrows memory another stream's pool holds
//!   (`DeviceBuilder::lend_between_streams`: its stream waits for the lender's queued work,
//!   no driver call), and empties the caches only when nothing can be borrowed; a few
//!   requests wait for room (the table counts each); the lower the cap, the more of each.
//! - `--no-lend`: stream pools do not lend each other memory; under the device cap they
//!   empty their caches instead (memory goes back to the driver and is taken again).
//! - `PINPOOL_DEVICE_CONF` (e.g. `expandable_segments:False,max_split_size_mb:64`) sets the
//!   device allocator's layout.
//!
//! Device buffers are freed on their own stream as soon as the work on them is enqueued:
//! stream order makes them reusable by the next request on that stream at once, with no event
//! and no `record_stream`. The pinned buffers are used by the stream, so they record it before
//! they are freed. The simulated runtime checks every copy and kernel against both rules.
//!
//! A request takes its four buffers in one call ([`BufferSet`]): all of them or none, waiting
//! first come first served under both caps until all fit, never holding memory while it
//! waits. So any caps that the largest request fits under (3 MiB pinned, 8 MiB device) are
//! safe, however many tasks share them.
//!
//! It runs on the simulated runtime (software streams and a simulated 16 GiB device that
//! check every copy and kernel for early reuse). Built with `--features cuda` on a machine
//! with a GPU, it runs the same server on the real runtime instead (pinned and device memory
//! from the driver, copies and the "kernel" as cudarc calls), every result checked. Without a
//! GPU it says so and runs on the simulated runtime as before.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::config::{DeviceConfig, SizePolicyChoice, DEVICE_ENV_VAR};
use pinpool::sim::{SimRuntime, SimStream};
use pinpool::{
    BufferSet, Builder, DeviceAllocator, DeviceBuffer, DeviceBuilder, DeviceRuntime, DeviceStats,
    HostStats, PinnedAllocator, PinnedBuffer, Runtime, TakenBuffers,
};

struct Args {
    requests: u64,
    concurrency: usize,
    streams: usize,
    /// Cap on reserved pinned memory, in MiB (0: none).
    max_mib: u64,
    /// Cap on reserved device memory, in MiB (0: none).
    device_max_mib: u64,
    /// The pinned allocator's size policy (`None`: the builder's, from `PINPOOL_CONF` or the
    /// default).
    policy: Option<SizePolicyChoice>,
    /// Stream pools lend each other memory under the device cap (default: on).
    lend: bool,
}

/// The smallest pinned cap that the largest request fits under (its input and result).
const MIN_MAX_MIB: u64 = 3;
/// The smallest device cap that the largest request fits under (its input and activations).
const MIN_DEVICE_MAX_MIB: u64 = 8;

impl Args {
    /// The pinned allocator builder's memory cap.
    fn apply<R: Runtime>(&self, mut b: Builder<R>) -> Builder<R> {
        if let Some(p) = self.policy {
            b = b.policy(p.policy());
        }
        if self.max_mib > 0 {
            b.max_bytes((self.max_mib as usize) << 20)
        } else {
            b
        }
    }

    /// The device allocator on `runtime` (the pinned allocator's own), with its cap and the
    /// layout `PINPOOL_DEVICE_CONF` asks for.
    fn device<R: DeviceRuntime>(&self, runtime: Arc<R>) -> Result<DeviceAllocator<R>, String> {
        let config = DeviceConfig::from_env().map_err(|e| format!("{DEVICE_ENV_VAR}: {e}"))?;
        let mut b = DeviceBuilder::new(runtime)
            .config(&config)
            .lend_between_streams(self.lend);
        if self.device_max_mib > 0 {
            b = b.max_bytes((self.device_max_mib as usize) << 20);
        }
        b.build().map_err(|e| format!("device allocator: {e}"))
    }

    /// The header line: the workload and both caps.
    fn describe(&self) -> String {
        let cap = |mib: u64| {
            if mib > 0 {
                format!("{mib} MiB")
            } else {
                "none".into()
            }
        };
        format!(
            "{} requests, {} concurrent, {} streams, pinned memory limit {}, device memory limit {}",
            self.requests,
            self.concurrency,
            self.streams,
            cap(self.max_mib),
            cap(self.device_max_mib)
        ) + &self
            .policy
            .map(|p| format!(", pinned size policy {p}"))
            .unwrap_or_default()
    }
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        requests: 20_000,
        concurrency: 64,
        streams: 4,
        max_mib: 40,
        device_max_mib: 48,
        policy: None,
        lend: true,
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
            "--no-lend" => a.lend = false,
            "--policy" => {
                let name = it.next().ok_or("--policy needs a value")?;
                a.policy = Some(SizePolicyChoice::from_name(&name).ok_or_else(|| {
                    let known: Vec<_> = SizePolicyChoice::names().collect();
                    format!(
                        "--policy: unknown policy {name:?} (known: {})",
                        known.join(", ")
                    )
                })?);
            }
            "-h" | "--help" => {
                println!(
                    "usage: serve [--requests N] [--concurrency N] [--streams N] [--max-mib N] \
                     [--device-max-mib N] [--policy NAME] [--no-lend]\n\
                     --max-mib caps reserved pinned memory (default 40; 0 for none): requests\n\
                     over the cap wait for buffers to come back instead of failing\n\
                     --device-max-mib caps reserved device memory (default 48; 0 for none)\n\
                     --no-lend: under the device cap, streams' cached memory is given back\n\
                     instead of lent from one stream to another\n\
                     --policy sets the pinned allocator's size policy (default, tiered, pow2,\n\
                     bestfit, bestfit_segments; default: PINPOOL_CONF's, else the default)\n\
                     {DEVICE_ENV_VAR} sets the device allocator's layout \
                     (e.g. expandable_segments:False)"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    if a.max_mib > 0 && a.max_mib < MIN_MAX_MIB {
        return Err(format!(
            "--max-mib {}: the largest request needs {MIN_MAX_MIB} MiB of pinned memory",
            a.max_mib
        ));
    }
    if a.device_max_mib > 0 && a.device_max_mib < MIN_DEVICE_MAX_MIB {
        return Err(format!(
            "--device-max-mib {}: the largest request needs {MIN_DEVICE_MAX_MIB} MiB of device \
             memory",
            a.device_max_mib
        ));
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

/// Bytes of each buffer actually copied on the simulated runtime (it checks them all).
const COPY: usize = 16 << 10;

/// The activations are this many times the size of the request's input.
const ACTIVATIONS: usize = 2;

#[derive(Default)]
struct Counters {
    done: AtomicU64,
    bytes: AtomicU64,
    /// Time spent getting each request's four buffers, waiting for room included.
    alloc_ns: AtomicU64,
    /// Bytes (whole blocks) the requests hold now, and the most they held at once.
    pinned_held: Held,
    device_held: Held,
    /// Device bytes requested, counted both ways round the allocator's calls.
    device_requested: Bracket,
}

/// The most held at once of what the allocator's users asked for, bracketed: `lower` counts
/// a buffer from just after its allocation returned to just before it is freed, `upper`
/// from just before the allocation is asked for to just after the free returned. The
/// allocator's exact peak lies between the two most-held figures.
#[derive(Default)]
struct Bracket {
    lower: Held,
    upper: Held,
}

impl Bracket {
    fn lies_within(&self, peak: i64) -> bool {
        self.lower.peak() <= peak && peak <= self.upper.peak()
    }
}

/// Bytes held now, and the most held at once. A buffer counts from just after the allocator
/// lent it to just before it goes back, so the peak here is at most the allocator's in-use
/// peak, which also counts buffers on their way in or out at that moment; the line printed
/// at the end compares the two.
#[derive(Default)]
struct Held {
    now: AtomicU64,
    peak: AtomicU64,
}

impl Held {
    fn take(&self, bytes: usize) {
        let now = self.now.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn give_back(&self, bytes: usize) {
        self.now.fetch_sub(bytes as u64, Ordering::Relaxed);
    }

    fn peak(&self) -> i64 {
        self.peak.load(Ordering::Relaxed) as i64
    }
}

/// What every request task shares: both allocators and the counters.
struct Server<R: DeviceRuntime> {
    allocator: PinnedAllocator<R>,
    device: DeviceAllocator<R>,
    counters: Counters,
}

/// One request's memory.
struct Buffers<R: DeviceRuntime> {
    /// The request's input, staged in pinned memory.
    input: PinnedBuffer<R>,
    /// Where the start of the activations comes back (a quarter of the input's size).
    output: PinnedBuffer<R>,
    /// The input on the device.
    d_input: DeviceBuffer<R>,
    /// The activations the "kernel" writes.
    d_act: DeviceBuffer<R>,
}

impl<R: DeviceRuntime> Server<R> {
    fn new(allocator: PinnedAllocator<R>, device: DeviceAllocator<R>) -> Self {
        Self {
            allocator,
            device,
            counters: Counters::default(),
        }
    }

    /// Takes a request's buffers for work on `stream`, all in one call: its input and result
    /// in pinned memory, its input and activations in device memory. It waits, first come
    /// first served, until all four fit under the caps, and holds none while it waits.
    async fn acquire(&self, stream: &R::Stream, size: usize) -> Result<Buffers<R>, pinpool::Error> {
        let t0 = Instant::now();
        let requested = size * (1 + ACTIVATIONS);
        self.counters.device_requested.upper.take(requested);
        let set = self.take_set(stream, size).await;
        let c = &self.counters;
        match &set {
            Ok(_) => c.device_requested.lower.take(requested),
            Err(_) => c.device_requested.upper.give_back(requested),
        }
        let buffers = set?;
        c.alloc_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        c.pinned_held
            .take(buffers.input.capacity() + buffers.output.capacity());
        c.device_held
            .take(buffers.d_input.capacity() + buffers.d_act.capacity());
        Ok(buffers)
    }

    async fn take_set(
        &self,
        stream: &R::Stream,
        size: usize,
    ) -> Result<Buffers<R>, pinpool::Error> {
        let TakenBuffers {
            mut pinned,
            mut device,
        } = BufferSet::new()
            .pinned(&self.allocator, size)
            .pinned(&self.allocator, size / 4)
            .device(&self.device, size, stream)
            .device(&self.device, size * ACTIVATIONS, stream)
            .alloc()
            .await?;
        let (Some(d_act), Some(d_input), Some(output), Some(input)) =
            (device.pop(), device.pop(), pinned.pop(), pinned.pop())
        else {
            unreachable!("a set gives back one buffer for each it was asked for");
        };
        Ok(Buffers {
            input,
            output,
            d_input,
            d_act,
        })
    }

    /// Frees a request's device buffers (on their own stream: no event needed).
    fn release_device(&self, d_input: DeviceBuffer<R>, d_act: DeviceBuffer<R>) {
        let c = &self.counters;
        let requested = d_input.len() + d_act.len();
        c.device_held
            .give_back(d_input.capacity() + d_act.capacity());
        c.device_requested.lower.give_back(requested);
        drop((d_input, d_act));
        c.device_requested.upper.give_back(requested);
    }

    /// Frees a pinned buffer (any stream that used it recorded on it).
    fn release_pinned(&self, buf: PinnedBuffer<R>) {
        self.counters.pinned_held.give_back(buf.capacity());
        drop(buf);
    }

    /// A request done: counts it.
    fn served(&self, size: usize) {
        let c = &self.counters;
        c.done.fetch_add(1, Ordering::Relaxed);
        c.bytes.fetch_add(size as u64, Ordering::Relaxed);
    }

    /// Waits until `stream` has run everything enqueued so far, without blocking the task's
    /// thread.
    async fn wait_for(&self, stream: &R::Stream) -> Result<(), pinpool::Error> {
        let rt = self.allocator.runtime();
        let done = rt.record_event(stream)?;
        while !rt.query_event(&done)? {
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        rt.release_event(done);
        Ok(())
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn serve_one(
    server: &Server<SimRuntime>,
    stream: &SimStream,
    size: usize,
    tag: u8,
) -> Result<(), BoxError> {
    let Buffers {
        mut input,
        mut output,
        d_input,
        d_act,
    } = server.acquire(stream, size).await?;

    input.fill(tag);
    let n = COPY.min(size);
    stream.copy_htod(input.as_ptr(), d_input.device_ptr(), n)?;
    input.record_stream(stream).unwrap();
    // Freed at once; reused only after the copy has run.
    server.release_pinned(input);
    // The model: clear the activations, write their start from the input and their end
    // from scratch.
    stream.fill_device(d_act.device_ptr(), n, 0)?;
    stream.delay(Duration::from_micros(20));
    stream.copy_dtod(d_input.device_ptr(), d_act.device_ptr(), n)?;
    stream.fill_device(d_act.offset_ptr(d_act.len() - n, n)?, n, !tag)?;
    let n = n.min(output.len());
    stream.copy_dtoh(d_act.device_ptr(), output.as_mut_ptr(), n)?;
    output.record_stream(stream).unwrap();
    // Freed on their own stream: the next request on it may take them at once.
    server.release_device(d_input, d_act);
    server.wait_for(stream).await?;
    if output[..n].iter().any(|&b| b != tag) {
        return Err("the result came back wrong".into());
    }
    server.release_pinned(output);
    server.served(size);
    Ok(())
}

/// Starts the request tasks: task `w` runs on `streams[w % streams.len()]` and serves
/// requests with `serve` until `total` have been handed out.
fn spawn_workers<R, F, Fut>(
    server: &Arc<Server<R>>,
    streams: &[R::Stream],
    concurrency: usize,
    total: u64,
    serve: F,
) -> Vec<tokio::task::JoinHandle<Result<(), String>>>
where
    R: DeviceRuntime,
    F: Fn(Arc<Server<R>>, R::Stream, usize, u8) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    let next = Arc::new(AtomicU64::new(0));
    (0..concurrency)
        .map(|w| {
            let server = server.clone();
            let stream = streams[w % streams.len()].clone();
            let next = next.clone();
            let serve = serve.clone();
            tokio::spawn(async move {
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return Ok(());
                    }
                    let size = request_size(&mut rng);
                    serve(server.clone(), stream.clone(), size, (i % 251) as u8 + 1)
                        .await
                        .map_err(|e| format!("request {i}: {e}"))?;
                }
            })
        })
        .collect()
}

/// Serves `args.requests` requests with `serve` on `args.concurrency` tasks over `streams`,
/// with a progress line; returns whether any request failed, and the wall time.
async fn run_workers<R, F, Fut>(
    server: &Arc<Server<R>>,
    streams: &[R::Stream],
    args: &Args,
    serve: F,
) -> (bool, Duration)
where
    R: DeviceRuntime,
    F: Fn(Arc<Server<R>>, R::Stream, usize, u8) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    let start = Instant::now();
    let ticker = spawn_ticker(server.clone(), args.requests, start);
    let workers = spawn_workers(server, streams, args.concurrency, args.requests, serve);
    join_workers(workers, ticker, &server.counters, args.requests, start).await
}

fn spawn_ticker<R: DeviceRuntime>(
    server: Arc<Server<R>>,
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
            progress(
                server.counters.done.load(Ordering::Relaxed),
                total,
                start,
                false,
            );
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

fn mib(bytes: i64) -> String {
    format!("{:.1}", bytes as f64 / (1 << 20) as f64)
}

/// Prints the table of the workload's results, common to both runtimes, then `checked` (the
/// runtime's own row: how it checked the results) and, side by side, the statistics of the
/// pinned and the device allocator.
fn report(
    host: &HostStats,
    device: &DeviceStats,
    counters: &Counters,
    elapsed: Duration,
    checked: (&str, String),
) {
    let done = counters.done.load(Ordering::Relaxed);
    let secs = elapsed.as_secs_f64();
    println!();
    println!("| metric | value |");
    println!("| --- | --- |");
    println!("| requests served | {done} |");
    println!("| wall time | {secs:.2} s |");
    println!("| throughput | {:.0} req/s |", done as f64 / secs);
    println!(
        "| staged | {:.2} GB/s |",
        counters.bytes.load(Ordering::Relaxed) as f64 / secs / 1e9
    );
    println!(
        "| mean time to get a request's 2 pinned + 2 device buffers (incl. waiting) | {:.2} µs |",
        counters.alloc_ns.load(Ordering::Relaxed) as f64 / done.max(1) as f64 / 1e3
    );
    println!("| {} | {} |", checked.0, checked.1);

    let hit = |fresh: i64, allocated: i64| {
        format!(
            "{:.3} %",
            100.0 * (1.0 - fresh as f64 / allocated.max(1) as f64)
        )
    };
    let limit = |l: Option<i64>| l.map_or("none".into(), |l| format!("{} MiB", mib(l)));
    let rows: [(&str, String, String); 12] = [
        (
            "buffers allocated",
            host.active_requests.allocated.to_string(),
            device.allocation.all.allocated.to_string(),
        ),
        (
            "cache hit rate",
            hit(host.num_host_alloc, host.active_requests.allocated),
            hit(device.num_device_alloc, device.allocation.all.allocated),
        ),
        (
            "memory taken from the driver (calls)",
            host.num_host_alloc.to_string(),
            device.num_device_alloc.to_string(),
        ),
        (
            "memory given back to the driver (calls)",
            host.num_host_free.to_string(),
            device.num_device_free.to_string(),
        ),
        (
            "memory moved within its range instead of taken anew (calls)",
            host.num_host_remaps.to_string(),
            "-".to_string(),
        ),
        (
            "reserved now / peak",
            format!(
                "{} / {} MiB",
                mib(host.allocated_bytes.current),
                mib(host.allocated_bytes.peak)
            ),
            format!(
                "{} / {} MiB",
                mib(device.reserved_bytes.all.current),
                mib(device.reserved_bytes.all.peak)
            ),
        ),
        (
            "in use peak, as the statistics report it (pinned: active, so also freed buffers whose copies had not run)",
            format!("{} MiB", mib(host.active_bytes.peak)),
            format!("{} MiB", mib(device.allocated_bytes.all.peak)),
        ),
        (
            "held by the requests at once, peak (measured here)",
            format!("{} MiB", mib(counters.pinned_held.peak())),
            format!("{} MiB", mib(counters.device_held.peak())),
        ),
        (
            "driver allocation time total / max",
            format!(
                "{:.1} ms / {} µs",
                host.host_alloc_time.total as f64 / 1e3,
                host.host_alloc_time.max
            ),
            "-".into(),
        ),
        (
            "memory limit",
            limit(host.limit_bytes),
            limit(device.limit_bytes),
        ),
        (
            "caches emptied to make room",
            host.num_alloc_retries.to_string(),
            device.num_alloc_retries.to_string(),
        ),
        (
            "requests refused (out of memory)",
            host.num_ooms.to_string(),
            device.num_ooms.to_string(),
        ),
    ];
    println!();
    println!("| allocator | pinned host | device |");
    println!("| --- | --- | --- |");
    for (name, h, d) in rows {
        println!("| {name} | {h} | {d} |");
    }
    let peak = device.requested_bytes.all.peak;
    let held = &counters.device_requested;
    println!();
    println!(
        "device requested-bytes peak {peak} {} what the requests held at once, counted from \
         after each allocation to before each free ({}) and from before each allocation to \
         after each free ({})",
        if held.lies_within(peak) {
            "lies between"
        } else {
            "LIES OUTSIDE"
        },
        held.lower.peak(),
        held.upper.peak(),
    );
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

fn fail(e: String) -> ! {
    eprintln!("serve: {e}");
    std::process::exit(2);
}

#[tokio::main]
async fn main() {
    let args = parse_args().unwrap_or_else(|e| fail(e));
    #[cfg(feature = "cuda")]
    match PinnedAllocator::builder().cuda(0) {
        Ok(builder) => {
            let allocator = args.apply(builder).build().expect("allocator");
            if !gpu::serve(allocator, &args).await {
                std::process::exit(1);
            }
            return;
        }
        Err(e) => println!("pinpool serve: no CUDA GPU ({e}); using the sim runtime"),
    }
    serve_sim(args).await;
}

async fn serve_sim(args: Args) {
    let sim = SimRuntime::new();
    let allocator = args
        .apply(Builder::new(Arc::new(sim.clone())))
        .build()
        .expect("allocator");
    let device = args
        .device(allocator.runtime().clone())
        .unwrap_or_else(|e| fail(e));
    println!(
        "pinpool serve: runtime=sim (software streams and a simulated device; every copy and \
         kernel is checked for early reuse)"
    );
    println!("{}", args.describe());
    println!("device layout: {}", device.config());
    let streams: Vec<SimStream> = (0..args.streams)
        .map(|_| sim.new_stream())
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| fail(e.to_string()));
    let server = Arc::new(Server::new(allocator, device));
    let (failed, elapsed) = run_workers(
        &server,
        &streams,
        &args,
        |server, stream, size, tag| async move { serve_one(&server, &stream, size, tag).await },
    )
    .await;
    for s in &streams {
        s.synchronize().expect("stream");
    }

    report(
        &server.allocator.stats(),
        &server.device.stats(0).expect("device 0"),
        &server.counters,
        elapsed,
        ("early reuses detected", sim.violations().to_string()),
    );
    if args.lend {
        println!(
            "device buffers lent from one stream to another (stream waits): {}",
            sim.stream_waits()
        );
    }
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
        server: &Server<CudaRuntime>,
        stream: &Arc<CudaStream>,
        size: usize,
        tag: u8,
    ) -> Result<(), BoxError> {
        let Buffers {
            mut input,
            mut output,
            mut d_input,
            mut d_act,
        } = server.acquire(stream, size).await?;

        input.fill(tag);
        output.fill(0);
        // Records the stream on the pinned buffer, which is then freed at once: it is reused
        // only after the copy has run.
        input.copy_to_device(stream, &mut d_input)?;
        server.release_pinned(input);
        // The model: clear the activations, then write the input into their start.
        stream.memset_zeros(&mut d_act)?;
        stream.memcpy_dtod(&d_input, &mut d_act)?;
        // The start of the activations comes back: a partial copy, so by address.
        let n = output.len();
        let src = d_act.offset_ptr(0, n)?;
        output.record_stream(stream).unwrap();
        stream.context().bind_to_thread()?;
        // SAFETY: `src` is `n` bytes inside `d_act`, which is owned by `stream`, so its reuse
        // is ordered after the copy; `output` is pinned memory of `n` bytes with `stream`
        // recorded on it, so it is neither freed nor handed out again before the copy has run,
        // and it is read only once the stream has got past the copy.
        unsafe { result::memcpy_dtoh_async(&mut output[..n], src, stream.cu_stream()) }?;
        // Freed on their own stream: the next request on it may take them at once.
        server.release_device(d_input, d_act);
        server.wait_for(stream).await?;
        if output.iter().any(|&b| b != tag) {
            return Err("the result came back wrong".into());
        }
        server.release_pinned(output);
        server.served(size);
        Ok(())
    }

    /// Runs the server on `pool` and a device allocator on the same runtime; false when a
    /// request failed.
    pub(super) async fn serve(allocator: PinnedAllocator<CudaRuntime>, args: &Args) -> bool {
        let ctx = allocator.runtime().context().clone();
        let device = args
            .device(allocator.runtime().clone())
            .unwrap_or_else(|e| fail(e));
        println!(
            "pinpool serve: runtime=cuda (device {}, pin_method={}; every result is checked)",
            allocator.runtime().ordinal(),
            allocator.runtime().config().pin_method
        );
        println!("{}", args.describe());
        println!("device layout: {}", device.config());
        let streams: Vec<Arc<CudaStream>> = (0..args.streams)
            .map(|_| ctx.new_stream().expect("stream"))
            .collect();
        let server = Arc::new(Server::new(allocator, device));
        let (failed, elapsed) = run_workers(
            &server,
            &streams,
            args,
            |server, stream, size, tag| async move { serve_one(&server, &stream, size, tag).await },
        )
        .await;
        for s in &streams {
            s.synchronize().expect("stream");
        }
        let done = server.counters.done.load(Ordering::Relaxed);
        report(
            &server.allocator.stats(),
            &server.device.stats(0).expect("device 0"),
            &server.counters,
            elapsed,
            (
                "results checked",
                format!("{done} of {} correct", args.requests),
            ),
        );
        !failed && done == args.requests
    }
}
