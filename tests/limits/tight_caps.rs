//! Caps a user would pick: a few requests' worth. A server whose requests take their pinned
//! and device buffers together under such caps waits for room more often; how often its
//! allocators trade memory with the driver meanwhile is bounded here.

use std::sync::Arc;

use pinpool::sim::SimRuntime;
use pinpool::{BufferSet, Builder, DeviceBuilder};
use pinpool_testkit::multi_thread;

const MIB: usize = 1 << 20;
/// Requests, tasks taking them, and streams the tasks run on.
const REQUESTS: u64 = 1200;
const TASKS: usize = 16;
const STREAMS: usize = 4;
/// The largest request's input (batch 16 × 1024 positions × 128).
const LARGEST: usize = 2 * MIB;

/// A request's input size: batches of 1 to 16, varied lengths (as `serve` draws them).
fn request_size(r: u64) -> usize {
    let batch = 1 + (r % 16) as usize;
    let seq = [128usize, 256, 384, 512, 1024][(r >> 8) as usize % 5];
    let hidden = [64usize, 128][(r >> 16) as usize % 2];
    batch * seq * hidden
}

/// What the allocators did under a pair of caps.
#[derive(Debug, Clone, Copy)]
struct Churn {
    /// Driver calls of both allocators (memory taken and given back).
    calls: i64,
    /// Device requests that went to a pool actor.
    misses: i64,
}

/// Runs the server's requests under the caps (bytes of pinned and device memory), with the
/// allocators' defaults otherwise.
fn churn_under(pinned_cap: usize, device_cap: usize) -> Churn {
    let rt = multi_thread(2);
    let sim = SimRuntime::new();
    let host = Builder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .max_bytes(pinned_cap)
        .build()
        .unwrap();
    let dev = DeviceBuilder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .max_bytes(device_cap)
        .build()
        .unwrap();
    let streams: Vec<_> = (0..STREAMS).map(|_| sim.stream()).collect();
    rt.block_on(async {
        let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let tasks: Vec<_> = (0..TASKS)
            .map(|t| {
                let (host, dev, next) = (host.clone(), dev.clone(), next.clone());
                let stream = streams[t % STREAMS].clone();
                tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= REQUESTS {
                            break;
                        }
                        let r = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 7;
                        let size = request_size(r);
                        let taken = BufferSet::new()
                            .pinned(&host, size)
                            .pinned(&host, size / 4)
                            .device(&dev, size, &stream)
                            .device(&dev, size * 2, &stream)
                            .alloc()
                            .await
                            .unwrap();
                        tokio::task::yield_now().await;
                        drop(taken);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    let h = host.stats();
    let d = dev.stats(0).unwrap();
    Churn {
        calls: h.num_host_alloc + h.num_host_free + d.num_device_alloc + d.num_device_free,
        misses: d.num_misses,
    }
}

#[test]
fn under_caps_of_three_requests_worth_the_allocators_churn_little_more_than_under_roomy_caps() {
    // Three of the largest requests' worth of each memory, and for comparison the roomy caps
    // of `serve`. Stream pools lend each other memory under the device cap (the default), so
    // most requests that find no room are served without the driver.
    let tight = churn_under(3 * LARGEST * 5 / 4, 3 * LARGEST * 3);
    let roomy = churn_under(40 * MIB, 48 * MIB);
    eprintln!("tight caps {tight:?}, roomy caps {roomy:?}");
    let buffers = REQUESTS as i64 * 4;
    assert!(
        tight.calls <= buffers / 16,
        "tight {tight:?}, roomy {roomy:?}"
    );
    assert!(
        tight.calls <= 6 * roomy.calls.max(24),
        "tight {tight:?}, roomy {roomy:?}"
    );
    assert!(
        tight.misses <= 2 * roomy.misses.max(400),
        "tight {tight:?}, roomy {roomy:?}"
    );
}
