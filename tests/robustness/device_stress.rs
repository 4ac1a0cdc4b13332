//! Stress: tasks on several streams allocate device buffers of varied sizes, write them with
//! kernels on their own stream, let other streams read them (recording those streams), and
//! free them, with random stream delays. The simulated device checks every kernel and copy:
//! no buffer is ever handed out while another stream's work on it is pending (invariant 1),
//! and once everything is freed the books balance and the device gets its memory back
//! (invariant 2).

use std::sync::Arc;
use std::time::Duration;

use pinpool::sim::SimRuntime;
use pinpool::DeviceBuilder;
use pinpool_testkit::eventually;

const KIB: usize = 1 << 10;

fn sizes(seed: u64) -> impl Iterator<Item = usize> {
    let mut x = seed | 1;
    std::iter::from_fn(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        Some(x as usize)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_sharing_buffers_never_see_early_reuse_and_lose_nothing() {
    let sim = SimRuntime::new();
    sim.set_random_delays(7, Duration::from_micros(30));
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let readers: Vec<_> = (0..3).map(|_| sim.stream()).collect();
    let mut tasks = Vec::new();
    for t in 0..4u64 {
        let (pool, sim, readers) = (pool.clone(), sim.clone(), readers.clone());
        tasks.push(tokio::spawn(async move {
            let own = sim.stream();
            let host = sim.host_alloc(256 * KIB).unwrap();
            let mut held = Vec::new();
            for (i, r) in sizes(t + 11).take(300).enumerate() {
                let size = 512 + r % (256 * KIB - 512);
                let mut b = pool.alloc(size, &own).await.unwrap();
                own.fill_device(b.device_ptr(), size, (i % 251) as u8)
                    .unwrap();
                if r % 3 == 0 {
                    // Another stream reads it later (after the kernel that wrote it: the
                    // simulation has no cross-stream waits, so the host orders them): record
                    // it.
                    own.synchronize().unwrap();
                    let reader = &readers[(r >> 8) % readers.len()];
                    reader
                        .copy_dtoh(b.device_ptr(), host.ptr.as_ptr(), size.min(4096))
                        .unwrap();
                    b.record_stream(reader).unwrap();
                }
                held.push(b);
                if held.len() > 8 {
                    let k = (r >> 16) % held.len();
                    drop(held.swap_remove(k));
                }
            }
            drop(held);
            own.synchronize().unwrap();
            host
        }));
    }
    let mut hosts = Vec::new();
    for t in tasks {
        hosts.push(t.await.unwrap());
    }
    for r in &readers {
        r.synchronize().unwrap();
    }
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    eventually("every block home", || {
        let st = pool.stats(0).unwrap();
        st.active.all.current == 0 && st.allocation.all.current == 0
    })
    .await;
    let inv = pinpool::tuning::device_engine(&pool, 0)
        .unwrap()
        .inventory()
        .await
        .unwrap();
    let mut reserved = 0;
    for p in &inv {
        assert_eq!(
            p.reserved_bytes,
            p.cached_bytes + p.in_use_bytes + p.waiting_bytes + p.kept_bytes,
            "{p:?}"
        );
        assert_eq!(p.in_use_blocks, 0, "{p:?}");
        reserved += p.reserved_bytes;
    }
    assert_eq!(sim.device_used(0), Some(reserved));
    for h in hosts {
        sim.host_free(h).unwrap();
    }
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.device_used(0), Some(0), "all device memory back");
    let st = pool.stats(0).unwrap();
    assert_eq!(st.num_device_alloc, st.num_device_free);
}
