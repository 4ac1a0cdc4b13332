//! Snapshots in PyTorch's pickle layout (`torch.cuda.memory._snapshot()`): the bytes read
//! back here (with a reader that knows only the opcodes PyTorch's memory visualizer reads)
//! carry each segment, each block's state, and the history as `device_traces`; Python's
//! `pickle` loads the dumped file, and `torch.cuda._memory_viz` renders it where torch is
//! installed (those two tests say "skipped" and pass where python3 or torch is missing).

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use pinpool::sim::SimRuntime;
use pinpool::{
    BlockInfo, BlockStatus, ConfigInfo, DeviceAllocator, DeviceBuilder, Error, HistoryContext,
    MemorySnapshot, SegmentInfo,
};
use pinpool_testkit::pickle::{read, Py};
use pinpool_testkit::sim_pool;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn segments(s: &Py) -> &[Py] {
    s.get("segments").items()
}

fn actions(trace: &Py) -> Vec<&str> {
    trace
        .items()
        .iter()
        .map(|e| e.get("action").str())
        .collect()
}

/// The block of `size` bytes, with its segment.
fn block_of_size(s: &Py, size: usize) -> (&Py, &Py) {
    segments(s)
        .iter()
        .flat_map(|seg| seg.get("blocks").items().iter().map(move |b| (seg, b)))
        .find(|(_, b)| b.get("size").int() == size as i128)
        .unwrap_or_else(|| panic!("a block of {size} bytes"))
}

#[tokio::test]
async fn a_pinned_snapshot_pickles_addresses_sizes_and_each_block_state() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let hold = stream.hold();
    let mut in_use = pool.alloc(3000).await.unwrap();
    in_use.record_stream(&stream).unwrap();
    drop(pool.alloc(8 * KIB).await.unwrap()); // cached
    let mut waiting = pool.alloc(16 * KIB).await.unwrap();
    waiting.record_stream(&stream).unwrap();
    let waiting_ptr = waiting.as_ptr() as usize;
    drop(waiting); // its event waits on the held stream

    let snap = read(&pool.pickle_snapshot().await.unwrap()).unwrap();
    assert_eq!(
        snap.keys(),
        [
            "segments",
            "device_traces",
            "allocator_settings",
            "external_annotations"
        ]
    );
    assert_eq!(segments(&snap).len(), 3);

    let (seg, b) = block_of_size(&snap, 4 * KIB);
    assert_eq!(b.get("state").str(), "active_allocated");
    assert_eq!(b.get("requested_size").int(), 3000);
    assert_eq!(b.get("address").int(), in_use.as_ptr() as i128);
    assert_eq!(seg.get("address").int(), in_use.as_ptr() as i128);
    assert_eq!(
        seg.get("device").int(),
        0,
        "pinned memory reads as device 0"
    );
    assert_eq!(seg.get("total_size").int(), 4096);
    assert_eq!(seg.get("allocated_size").int(), 4096);
    assert_eq!(seg.get("active_size").int(), 4096);
    assert_eq!(seg.get("requested_size").int(), 3000);
    assert_eq!(seg.get("stream").int(), 0);
    assert_eq!(seg.get("segment_type").str(), "small");
    assert_eq!(seg.get("segment_pool_id").items(), [Py::Int(0), Py::Int(0)]);
    assert!(!seg.get("is_expandable").bool());
    assert!(seg.get("frames").items().is_empty());

    let (seg, b) = block_of_size(&snap, 8 * KIB);
    assert_eq!(b.get("state").str(), "inactive");
    assert_eq!(seg.get("allocated_size").int(), 0);
    assert_eq!(seg.get("active_size").int(), 0);

    let (seg, b) = block_of_size(&snap, 16 * KIB);
    assert_eq!(b.get("state").str(), "active_pending_free");
    assert_eq!(b.get("address").int(), waiting_ptr as i128);
    assert_eq!(seg.get("allocated_size").int(), 0);
    assert_eq!(seg.get("active_size").int(), 16 * KIB as i128);

    // One (empty) trace: history was never turned on.
    let traces = snap.get("device_traces").items();
    assert_eq!(traces.len(), 1);
    assert!(traces[0].items().is_empty());

    // Once its event completes the freed block is cached: inactive.
    drop(hold);
    stream.synchronize().unwrap();
    pinpool_testkit::eventually("the waiting block came back", || {
        pool.stats().waiting_blocks == 0
    })
    .await;
    let snap = read(&pool.pickle_snapshot().await.unwrap()).unwrap();
    assert_eq!(
        block_of_size(&snap, 16 * KIB).1.get("state").str(),
        "inactive"
    );
    drop(in_use);
}

#[tokio::test]
async fn the_history_becomes_the_device_trace_in_order_with_requested_sizes() {
    let (pool, _sim) = sim_pool();
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    let buf = pool.alloc(3000).await.unwrap();
    let addr = buf.as_ptr() as i128;
    drop(buf);
    pool.record_annotation("step 1");
    let snap = read(&pool.pickle_snapshot().await.unwrap()).unwrap();

    let traces = snap.get("device_traces").items();
    assert_eq!(traces.len(), 1);
    let trace = &traces[0];
    assert_eq!(
        actions(trace),
        [
            "segment_alloc",
            "alloc",
            "free_requested",
            "free_completed",
            "snapshot"
        ]
    );
    let e = trace.items();
    assert_eq!(e[0].get("addr").int(), addr);
    assert_eq!(e[0].get("size").int(), 4096, "a segment's own bytes");
    for alloc_or_free in &e[1..4] {
        assert_eq!(alloc_or_free.get("addr").int(), addr);
        assert_eq!(alloc_or_free.get("size").int(), 3000, "requested bytes");
        assert_eq!(alloc_or_free.get("stream").int(), 0);
        assert_eq!(alloc_or_free.get("compile_context").str(), "N/A");
        assert_eq!(alloc_or_free.get("user_metadata").str(), "");
    }
    let times: Vec<i128> = e.iter().map(|x| x.get("time_us").int()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");

    // The annotation has no PyTorch action: it is an external annotation.
    let notes = snap.get("external_annotations").items();
    assert_eq!(notes.len(), 1);
    assert_eq!(notes[0].get("name").str(), "step 1");
    assert_eq!(notes[0].get("device").int(), 0);
}

#[tokio::test]
async fn call_sites_recorded_with_the_history_become_frames() {
    let (pool, _sim) = sim_pool();
    pool.record_history(true, 1000, HistoryContext::Alloc)
        .unwrap();
    let buf = pool.alloc(100).await.unwrap();
    let snap = read(&pool.pickle_snapshot().await.unwrap()).unwrap();
    let trace = &snap.get("device_traces").items()[0];
    let alloc = trace
        .items()
        .iter()
        .find(|e| e.get("action").str() == "alloc")
        .unwrap();
    let frames = alloc.get("frames").items();
    assert!(!frames.is_empty());
    for f in frames {
        assert_eq!(f.keys(), ["name", "filename", "line"]);
    }
    assert!(
        frames
            .iter()
            .any(|f| f.get("filename").str().ends_with("torch_snapshot.rs")
                && f.get("line").int() > 0),
        "the test's own line is among the frames"
    );
    drop(buf);
}

fn device_pool(devices: usize) -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::builder().devices(devices).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    (pool, sim)
}

#[tokio::test]
async fn a_device_snapshot_has_segments_per_device_and_stream_and_a_trace_per_device() {
    let (pool, sim) = device_pool(2);
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    let (a, b) = (sim.stream(), sim.stream());
    let c = sim.stream_on(1).unwrap();
    let on_a = pool.alloc(MIB, &a).await.unwrap();
    let on_b = pool.alloc(3 * MIB, &b).await.unwrap();
    let on_c = pool.alloc(5000, &c).await.unwrap();

    let snap = read(&pool.pickle_snapshot().await.unwrap()).unwrap();
    let seg_of = |ptr: u64| {
        segments(&snap)
            .iter()
            .find(|s| {
                let start = s.get("address").int();
                let end = start + s.get("total_size").int();
                (start..end).contains(&(ptr as i128))
            })
            .unwrap_or_else(|| panic!("a segment holding {ptr:#x}"))
    };
    let (sa, sb, sc) = (
        seg_of(on_a.device_ptr()),
        seg_of(on_b.device_ptr()),
        seg_of(on_c.device_ptr()),
    );
    assert_eq!(
        (
            sa.get("device").int(),
            sb.get("device").int(),
            sc.get("device").int()
        ),
        (0, 0, 1)
    );
    assert_eq!(sa.get("stream").int(), a.id().0 as i128);
    assert_eq!(sb.get("stream").int(), b.id().0 as i128);
    assert_eq!(sc.get("stream").int(), c.id().0 as i128);
    for s in [sa, sb, sc] {
        assert!(
            s.get("is_expandable").bool(),
            "the sim device maps granules"
        );
        assert_eq!(s.get("segment_pool_id").items(), [Py::Int(0), Py::Int(0)]);
    }
    let in_b = sb
        .get("blocks")
        .items()
        .iter()
        .find(|x| x.get("address").int() == on_b.device_ptr() as i128)
        .unwrap();
    assert_eq!(in_b.get("state").str(), "active_allocated");
    assert_eq!(in_b.get("requested_size").int(), 3 * MIB as i128);
    assert_eq!(sb.get("segment_type").str(), "large");

    // One trace per device; each allocation is in its device's trace, on its stream.
    let traces = snap.get("device_traces").items();
    assert_eq!(traces.len(), 2);
    let alloc_in = |t: &Py, ptr: u64| {
        t.items()
            .iter()
            .find(|e| e.get("action").str() == "alloc" && e.get("addr").int() == ptr as i128)
            .cloned()
    };
    let e = alloc_in(&traces[0], on_b.device_ptr()).expect("b's alloc on device 0");
    assert_eq!(e.get("stream").int(), b.id().0 as i128);
    assert!(alloc_in(&traces[1], on_b.device_ptr()).is_none());
    let e = alloc_in(&traces[1], on_c.device_ptr()).expect("c's alloc on device 1");
    assert_eq!(e.get("size").int(), 5000);
    // Granules mapped into a reserved range are `segment_map`s, on the owner stream.
    let map = traces[1]
        .items()
        .iter()
        .find(|e| e.get("action").str() == "segment_map")
        .expect("a segment_map on device 1");
    assert_eq!(map.get("stream").int(), c.id().0 as i128);
    assert_eq!(actions(&traces[1]).last(), Some(&"snapshot"));
    drop((on_a, on_b, on_c));
}

#[tokio::test]
async fn blocks_tile_their_segment_so_readers_can_compute_each_address() {
    // A carving policy: the 64 KiB segments hold blocks and free ranges.
    let (pool, _sim) = pinpool_testkit::segments_pool();
    let a = pool.alloc(1000).await.unwrap();
    let b = pool.alloc(5000).await.unwrap();
    let c = pool.alloc(700).await.unwrap();
    drop(b);
    let snap = read(&pool.pickle_snapshot().await.unwrap()).unwrap();
    for seg in segments(&snap) {
        let mut at = seg.get("address").int();
        for blk in seg.get("blocks").items() {
            assert_eq!(blk.get("address").int(), at);
            at += blk.get("size").int();
        }
        assert_eq!(at, seg.get("address").int() + seg.get("total_size").int());
    }
    let states: Vec<&str> = segments(&snap)
        .iter()
        .flat_map(|s| s.get("blocks").items())
        .map(|b| b.get("state").str())
        .collect();
    assert_eq!(
        states.iter().filter(|s| **s == "active_allocated").count(),
        2
    );
    drop((a, c));

    // A stretch no block covers reads as an inactive block.
    let hand = MemorySnapshot {
        segments: vec![SegmentInfo {
            address: 0x10000,
            total_size: 0x3000,
            pool: 0,
            pin_method: "simulated".into(),
            blocks: vec![BlockInfo {
                address: 0x11000,
                size: 0x1000,
                requested_size: 10,
                state: BlockStatus::InUse,
                streams: vec![],
            }],
            device: None,
            stream: None,
        }],
        config: hand_made_config(),
        reserved_bytes: 0x3000,
    };
    let snap = read(&hand.to_pickle(&[])).unwrap();
    let blocks = segments(&snap)[0].get("blocks").items();
    let got: Vec<(i128, i128, &str)> = blocks
        .iter()
        .map(|b| {
            (
                b.get("address").int(),
                b.get("size").int(),
                b.get("state").str(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (0x10000, 0x1000, "inactive"),
            (0x11000, 0x1000, "active_allocated"),
            (0x12000, 0x1000, "inactive")
        ]
    );
}

#[test]
fn a_stream_id_with_the_top_bit_set_is_written_as_an_int64_never_a_longer_int() {
    // CUDA default streams get ids with the top bit set; PyTorch writes handles as int64,
    // and the visualizer's reader turns ints over 8 bytes into BigInts.
    let id = (1u64 << 63) | (0x5555 << 2) | 1;
    let hand = MemorySnapshot {
        segments: vec![SegmentInfo {
            address: 0x10000,
            total_size: 0x1000,
            pool: 0,
            pin_method: "device".into(),
            blocks: vec![],
            device: Some(0),
            stream: Some(id),
        }],
        config: hand_made_config(),
        reserved_bytes: 0x1000,
    };
    let bytes = hand.to_pickle(&[]);
    let snap = read(&bytes).unwrap();
    assert_eq!(segments(&snap)[0].get("stream").int(), id as i64 as i128);
    assert!(!bytes.windows(2).any(|w| w == [0x8a, 9]), "a 9-byte LONG1");
}

#[tokio::test]
async fn an_out_of_memory_entry_gives_the_request_and_the_drivers_free_bytes() {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .max_bytes(4 * MIB)
        .build()
        .unwrap();
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    let s = sim.stream();
    let err = pool.try_alloc(8 * MIB, &s).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    let snap = read(&pool.pickle_snapshot().await.unwrap()).unwrap();
    let trace = &snap.get("device_traces").items()[0];
    let oom = trace
        .items()
        .iter()
        .find(|e| e.get("action").str() == "oom")
        .expect("an oom entry");
    assert_eq!(oom.get("size").int(), 8 * MIB as i128);
    assert!(oom.try_get("addr").is_none());
    let free = oom.get("device_free").int();
    assert!(
        free > 0 && free <= 16 << 30,
        "the sim device's free bytes: {free}"
    );
}

/// Runs `python3 -c script args`: `None` (after saying so) where python3 is missing or the
/// script exits 77 (a module it needs is missing).
fn python(test: &str, script: &str, args: &[&str]) -> Option<String> {
    let out = match Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            println!("{test}: skipped: python3 not found ({e})");
            return None;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(77) {
        println!("{test}: skipped: {}", stdout.trim());
        return None;
    }
    assert!(out.status.success(), "python failed:\n{stdout}\n{stderr}");
    Some(stdout)
}

/// A snapshot with one block of each state and a recorded history, dumped to `file`;
/// returns (in-use address, waiting address) and the buffers to keep.
async fn dump_known_state(file: &Path) -> (usize, usize) {
    let (pool, sim) = sim_pool();
    pool.record_history(true, 1000, HistoryContext::Alloc)
        .unwrap();
    let stream = sim.stream();
    let hold = stream.hold();
    let mut in_use = pool.alloc(3000).await.unwrap();
    in_use.record_stream(&stream).unwrap();
    drop(pool.alloc(8 * KIB).await.unwrap());
    let mut waiting = pool.alloc(16 * KIB).await.unwrap();
    waiting.record_stream(&stream).unwrap();
    let ptrs = (in_use.as_ptr() as usize, waiting.as_ptr() as usize);
    drop(waiting);
    std::fs::write(file, pool.pickle_snapshot().await.unwrap()).unwrap();
    drop(hold);
    drop(in_use);
    ptrs
}

/// Checks a loaded snapshot in Python: argv[1] the file, argv[2] and argv[3] the in-use and
/// waiting addresses.
const PY_CHECK: &str = r#"
import pickle, sys
with open(sys.argv[1], 'rb') as f:
    s = pickle.load(f)
in_use, waiting = int(sys.argv[2]), int(sys.argv[3])
assert set(s) == {'segments', 'device_traces', 'allocator_settings', 'external_annotations'}, s.keys()
states = {}
for seg in s['segments']:
    assert seg['device'] == 0 and seg['stream'] == 0
    assert seg['segment_type'] in ('small', 'large')
    assert seg['segment_pool_id'] == (0, 0)
    addr = seg['address']
    for b in seg['blocks']:
        assert b['address'] == addr
        addr += b['size']
        states[b['address']] = (b['state'], b['size'], b['requested_size'])
    assert addr == seg['address'] + seg['total_size']
assert states[in_use] == ('active_allocated', 4096, 3000), states[in_use]
assert states[waiting][0] == 'active_pending_free', states[waiting]
assert sorted(v[0] for v in states.values()) == ['active_allocated', 'active_pending_free', 'inactive']
[trace] = s['device_traces']
acts = [e['action'] for e in trace]
assert acts[-1] == 'snapshot', acts
assert acts.count('alloc') == 3 and acts.count('segment_alloc') == 3, acts
for e in trace:
    assert set(e) == {'action', 'addr', 'size', 'stream', 'compile_context', 'user_metadata', 'frames', 'time_us'}, e
allocs = [e for e in trace if e['action'] == 'alloc']
assert allocs[0]['addr'] == in_use and allocs[0]['size'] == 3000
assert all(f['line'] >= 0 and isinstance(f['filename'], str) for e in allocs for f in e['frames'])
assert any(e['frames'] for e in allocs)
print('ok', len(trace))
"#;

#[tokio::test]
async fn python_pickle_loads_the_dumped_snapshot_with_every_field() {
    let file = std::env::temp_dir().join(format!("pinpool-py-{}.pickle", std::process::id()));
    let (in_use, waiting) = dump_known_state(&file).await;
    let out = python(
        "python_pickle_loads_the_dumped_snapshot_with_every_field",
        PY_CHECK,
        &[
            file.to_str().unwrap(),
            &in_use.to_string(),
            &waiting.to_string(),
        ],
    );
    std::fs::remove_file(&file).unwrap();
    if let Some(out) = out {
        assert!(out.starts_with("ok "), "{out}");
    }
}

/// Renders a dumped snapshot with `torch.cuda._memory_viz` (exit 77 without torch).
const TORCH_CHECK: &str = r#"
import pickle, sys
try:
    import torch
    from torch.cuda import _memory_viz as mv
except Exception as e:
    print('torch not importable:', e)
    sys.exit(77)
with open(sys.argv[1], 'rb') as f:
    s = pickle.load(f)
summary = mv.segsum(s)
assert 'segments: ' in summary, summary
text = mv.trace(s)
assert 'Device 0' in text, text
assert 'Allocator State History' in mv.segment_plot(s)
assert 'Active Memory Timeline' in mv.trace_plot(s)
print('ok', torch.__version__)
"#;

#[tokio::test]
async fn torch_memory_viz_renders_the_dumped_snapshot() {
    let file = std::env::temp_dir().join(format!("pinpool-torch-{}.pickle", std::process::id()));
    dump_known_state(&file).await;
    let out = python(
        "torch_memory_viz_renders_the_dumped_snapshot",
        TORCH_CHECK,
        &[file.to_str().unwrap()],
    );
    std::fs::remove_file(&file).unwrap();
    if let Some(out) = out {
        assert!(out.starts_with("ok "), "{out}");
    }
}

/// The configuration of the hand-made snapshots above.
fn hand_made_config() -> ConfigInfo {
    ConfigInfo {
        policy: "x".into(),
        max_bytes: None,
        alloc_timeout_ms: None,
        shards: 1,
        runtime: "sim".into(),
    }
}
