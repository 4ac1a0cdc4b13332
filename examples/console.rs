//! A small workload to watch in tokio-console.
//!
//! It runs a few request tasks against the allocator (fresh memory, cached reuse, frees that
//! wait on simulated streams, a capture pool now and then) for `--seconds` seconds, with
//! history on, and prints the statistics each second. Built with the `console` feature and
//! `--cfg tokio_unstable`, it serves tokio-console on 127.0.0.1:6669, where the allocator's
//! tasks show by name: `pinpool::pool(default)`, `pinpool::pool(<id>)` for capture pools,
//! `pinpool::event_poller`, `pinpool::router`, `pinpool::history` and `pinpool::observer`.
//!
//! ```text
//! RUSTFLAGS="--cfg tokio_unstable" cargo run --release --features console --example console -- --seconds 60
//! tokio-console            # in another terminal
//! ```
//!
//! Options: `--seconds N` (default 30), `--html PATH` (write the history page at the end).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::sim::SimRuntime;
use pinpool::{Builder, HistoryContext, PinnedAllocator};

struct Args {
    seconds: u64,
    html: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        seconds: 30,
        html: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--seconds" => {
                a.seconds = it
                    .next()
                    .ok_or("--seconds needs a value")?
                    .parse()
                    .map_err(|e| format!("--seconds: {e}"))?;
            }
            "--html" => a.html = Some(it.next().ok_or("--html needs a path")?),
            "-h" | "--help" => {
                return Err("usage: console [--seconds N] [--html PATH]".to_string());
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

#[cfg(all(feature = "console", tokio_unstable))]
fn start_tracing() {
    console_subscriber::init();
    eprintln!("tokio-console can attach now: run `tokio-console` (default 127.0.0.1:6669)");
}

#[cfg(not(all(feature = "console", tokio_unstable)))]
fn start_tracing() {
    eprintln!(
        "tokio-console support is off. Build with\n  \
         RUSTFLAGS=\"--cfg tokio_unstable\" cargo run --release --features console --example console\n\
         (the `console` feature adds console-subscriber; `tokio_unstable` gives tasks their names).\n\
         Running the workload anyway, without the console."
    );
}

async fn worker(
    allocator: PinnedAllocator,
    sim: SimRuntime,
    seed: u64,
    stop: Instant,
    ops: Arc<AtomicU64>,
) {
    let stream = sim.new_stream().expect("stream");
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while Instant::now() < stop {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let size = 4096usize << (x % 9);
        let Ok(mut buf) = allocator.alloc(size).await else {
            break;
        };
        buf.fill((x & 0xff) as u8);
        if x % 3 == 0 {
            stream.delay(Duration::from_micros(200));
            buf.record_stream(&stream).unwrap();
        }
        drop(buf);
        ops.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_micros(500 + x % 1500)).await;
    }
}

#[tokio::main]
async fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    start_tracing();
    let sim = SimRuntime::new();
    let allocator = match Builder::new(Arc::new(sim.clone())).build() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("could not start the allocator: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = allocator.record_history(true, 50_000, HistoryContext::None) {
        eprintln!("could not turn history on: {e}");
    }
    let stop = Instant::now() + Duration::from_secs(args.seconds);
    let ops = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..4)
        .map(|i| {
            tokio::spawn(worker(
                allocator.clone(),
                sim.clone(),
                i + 1,
                stop,
                ops.clone(),
            ))
        })
        .collect();

    let mut tick = 0u64;
    while Instant::now() < stop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        tick += 1;
        if tick % 5 == 0 {
            // A capture pool now and then, so that a `pinpool::pool(<id>)` task comes and goes.
            let id = pinpool::PoolId::fresh();
            let capture = sim.new_stream().expect("stream");
            let target = capture.id();
            if allocator
                .begin_allocate_to_pool(id, move |s| s.id() == target)
                .await
                .is_ok()
            {
                let buf = allocator.alloc_on(1 << 16, &capture).await;
                let _ = allocator.end_allocate_to_pool(id).await;
                drop(buf);
                let _ = allocator.release_pool(id).await;
            }
            allocator.record_annotation(&format!("capture {tick}"));
            let _ = allocator.empty_cache().await;
        }
        let s = allocator.stats();
        println!(
            "{:>4}s  ops {:>8}  reserved {:>10}  in use {:>10}  waiting {:>3}  host allocs {}",
            tick,
            ops.load(Ordering::Relaxed),
            mib(s.allocated_bytes.current),
            mib(s.active_bytes.current),
            s.waiting_blocks,
            s.num_host_alloc,
        );
    }
    for w in workers {
        let _ = w.await;
    }
    if let Some(path) = args.html {
        let page = allocator.history_html().await;
        match page
            .map_err(|e| e.to_string())
            .and_then(|page| std::fs::write(&path, page).map_err(|e| e.to_string()))
        {
            Ok(()) => println!("history page written to {path}"),
            Err(e) => eprintln!("could not write the history page: {e}"),
        }
    }
}

/// Bytes in MiB, for the status line.
fn mib(bytes: i64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1 << 20) as f64)
}
