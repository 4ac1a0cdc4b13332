//! The examples of the README and of the guide, compiled and run: each ```rust block of
//! `README.md` and of `docs/*.md` appears here
//! line for line inside the set-up it assumes (imports, a runtime, the `allocator` a fragment
//! uses), on the simulated runtime; whole programs sit in a module of their own and their test
//! calls `main()`. The GPU example is compiled with `--features cuda` and runs where a GPU is
//! present. `every_rust_block_of_the_readme_and_the_guide_is_compiled_here` fails when such a
//! block is missing from this file, so an edit to one must be made to the other too. rustfmt leaves the
//! examples alone so that they stay as the README prints them.

use std::error::Error as StdError;

use pinpool::PinnedAllocator;

type Result<T = (), E = Box<dyn StdError>> = std::result::Result<T, E>;

/// "A short example": a buffer recorded on a stream, freed, and taken again from the cache.
/// (The README leaves `record_stream`'s result unchecked; the stream is the pool's own.)
#[rustfmt::skip]
mod short_example {
    use pinpool::PinnedAllocator;

    #[tokio::main]
    async fn main() -> Result<(), pinpool::Error> {
        let allocator = PinnedAllocator::builder().build()?; // spawns the actors
        let stream = allocator.runtime().new_stream()?; // the same call on the sim and on a GPU

        let mut buf = allocator.alloc(1 << 20).await?; // fresh pinned memory the first time
        buf.fill(0);
        buf.record_stream(&stream)?; // reuse waits for this stream's work
        drop(buf); // back to the allocator, ordered by an event

        let again = allocator.alloc(1 << 20).await?; // cached path once the event completed
        drop(again);

        allocator.empty_cache().await?;
        println!("{:?}", allocator.stats().to_map());
        Ok(())
    }

    #[test]
    fn readme_short_example_reuses_a_recorded_buffer() {
        main().unwrap();
    }
}

/// "A memory limit you can wait on": a capped allocator, `alloc` that waits and `try_alloc`
/// that fails at once.
#[rustfmt::skip]
#[tokio::test(flavor = "multi_thread")]
async fn readme_memory_limit_you_can_wait_on() -> Result {
    use std::time::Duration;

    let allocator = PinnedAllocator::builder()
        .max_bytes(2 << 30)                      // at most 2 GiB pinned
        .alloc_timeout(Duration::from_secs(5))   // how long `alloc` waits for room
        .build()?;
    let buf = allocator.alloc(1 << 20).await?;   // waits (first come, first served) when full
    let now = allocator.try_alloc(1 << 20).await;     // fails at once with Error::OutOfMemory instead
    assert_eq!(buf.len(), 1 << 20);
    assert_eq!(now?.len(), 1 << 20); // the cap is far away
    Ok(())
}

/// "On a GPU": copies from a pinned buffer that record their stream. Needs a GPU; without
/// one it says so and passes.
#[cfg(feature = "cuda")]
#[rustfmt::skip]
mod on_a_gpu {
    use pinpool::cuda::cuda_available;
    use pinpool::PinnedAllocator;

    use super::Result;

    async fn copy_to_device() -> Result {
        let context = cudarc::driver::CudaContext::new(0)?;
        let mut dev_slice = context.default_stream().alloc_zeros::<u8>(1 << 20)?;
        let allocator = PinnedAllocator::builder().cuda(0)?.build()?; // Error::DeviceUnavailable without a GPU
        let auto = PinnedAllocator::builder().best_available(0)?.build()?; // CUDA if present, else the sim runtime
        let stream = allocator.runtime().new_stream()?;
        let mut buf = allocator.alloc(1 << 20).await?;
        buf.copy_to_device(&stream, &mut dev_slice)?; // records the stream itself
        drop(buf);                                    // reused once the copy has run
        println!("{}", auto.runtime().describe());
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn readme_copy_to_device_records_the_stream() {
        if !cuda_available() {
            println!("readme_copy_to_device_records_the_stream: skipped: no CUDA driver/GPU");
            return;
        }
        copy_to_device().await.unwrap();
    }
}

/// "Device memory": stream-ordered reuse, a second stream recorded, raw pointers. The raw
/// calls block on a miss, hence the multi-thread runtime. (The README leaves
/// `record_stream`'s result unchecked; the stream is the pool's own.)
#[rustfmt::skip]
#[tokio::test(flavor = "multi_thread")]
async fn readme_device_memory_stream_ordered_reuse() -> Result {
    use pinpool::DeviceAllocator;

    let allocator = DeviceAllocator::builder().build()?;    // a simulated 16 GiB device
    // on a GPU, every CUDA device: DeviceAllocator::builder().cuda()?.build()? (PINPOOL_DEVICE_CONF)
    let stream = allocator.runtime().new_stream()?;         // the same call on a GPU
    let other = allocator.runtime().new_stream()?;
    let mut buf = allocator.alloc(1 << 20, &stream).await?; // on the stream's device
    buf.record_stream(&other)?;                             // work on another stream uses it too
    drop(buf);                                              // reusable once `other`'s work is done
    let ptr = allocator.raw_alloc_with_stream(4096, &stream)?;   // raw pointers, as PyTorch's raw_alloc
    allocator.raw_delete(ptr)?;                             // unknown or freed twice: Error::UnknownPointer
    Ok(())
}

/// "Pinned and device memory together": one runtime under both allocators, a request's
/// buffers taken in one call.
#[rustfmt::skip]
#[tokio::test(flavor = "multi_thread")]
async fn readme_pinned_and_device_memory_together() -> Result {
    use pinpool::{BufferSet, DeviceAllocator, PinnedAllocator};

    let pinned = PinnedAllocator::builder().max_bytes(64 << 20).build()?;
    let device = DeviceAllocator::builder()
        .runtime(pinned.runtime().clone())                  // the same runtime, the same streams
        .max_bytes(256 << 20)
        .build()?;
    let stream = device.runtime().new_stream()?;            // one per worker, kept
    let mut taken = BufferSet::new()
        .pinned(&pinned, 1 << 20)                           // staging for the input
        .device(&device, 1 << 20, &stream)                  // the input on the device
        .alloc()                                            // all or none, first come first served
        .await?;
    let (input, d_input) = (taken.pinned.remove(0), taken.device.remove(0));
    assert_eq!((input.len(), d_input.len()), (1 << 20, 1 << 20));
    // The stream is the pinned allocator's too: recording it is no foreign stream.
    let mut input = input;
    input.record_stream(&stream)?;
    Ok(())
}

/// "Peers and other processes": peer access, a peer copy, and IPC handles on two simulated
/// devices.
#[rustfmt::skip]
mod peers_and_ipc {
    use std::sync::Arc;

    use pinpool::sim::SimRuntime;
    use pinpool::{DeviceBuilder, Error, IpcHandle};

    #[tokio::main]
    async fn main() -> Result<(), Error> {
        let sim = SimRuntime::builder().devices(2).build(); // or CudaRuntime: every GPU
        let allocator = DeviceBuilder::new(Arc::new(sim.clone())).build()?;
        let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());

        // Peers: device 1 reads device 0's memory directly; a peer that does not exist is
        // Error::NoSuchDevice, one without a path Error::PeerAccessUnsupported.
        allocator.enable_peer_access(1, 0)?;
        let mut src = allocator.alloc(1 << 20, &s0).await?;
        let mut dst = allocator.alloc(1 << 20, &s1).await?;
        allocator.memcpy_async(&mut dst, &mut src, 1 << 20, &s1, true)?; // p2p; false: staged
        drop(src); // safe at once: s1 is recorded on both, reuse waits for the copy

        // IPC: export a block for another process (a segment's handle, or the file descriptors
        // of an expandable range's memory), open it there; the simulation says NotSupported.
        let handle: Result<IpcHandle, Error> = allocator.ipc_handle(&dst);
        assert!(matches!(handle, Err(Error::NotSupported { .. })));
        let sent = IpcHandle::new([0; 64], 4096, 1 << 20, 0).to_hex(); // across the process boundary
        let opened = allocator.open_ipc(&sent.parse()?); // on a GPU: IpcMemory, closed when dropped
        assert!(matches!(opened, Err(Error::NotSupported { .. })));
        assert!(matches!(IpcHandle::from_bytes(b"junk"), Err(Error::InvalidIpcHandle { .. })));
        Ok(())
    }

    #[test]
    fn readme_peer_copies_and_ipc_handles() {
        main().unwrap();
    }
}

/// "CUDA graphs and free-memory callbacks": a capture pool on device memory, and a callback
/// that gives up spare buffers.
#[rustfmt::skip]
#[tokio::test(flavor = "multi_thread")]
async fn readme_capture_pools_on_device_memory() -> Result {
    use pinpool::{DeviceAllocator, DeviceBuffer, Error};

    let allocator = DeviceAllocator::builder().build()?;
    let stream = allocator.runtime().new_stream()?;
    let id = pinpool::PoolId::fresh(); // torch.cuda.graph_pool_handle()
    let capturing = stream.id();
    allocator.begin_allocate_to_pool(0, id, move |s| s.id() == capturing).await?;
    stream.begin_capture()?;                                 // on a GPU: stream.begin_capture(mode)
    let out = allocator.alloc(1 << 20, &stream).await?;      // from the capture pool
    stream.fill_device(out.device_ptr(), out.len(), 7)?;     // captured work
    let graph = stream.end_capture()?;
    allocator.end_allocate_to_pool(0, id).await?;
    drop(out);                                               // kept: every replay writes it
    graph.launch(&stream)?;
    drop(graph);
    allocator.release_pool(0, id).await?;                    // once the graphs are gone
    allocator.empty_cache().await?;                          // the pool's memory goes back
    assert_eq!(allocator.release_pool(0, id).await, Err(Error::UnknownPool(id)));
    assert!(matches!(allocator.pool_stats(0, id), Err(Error::UnknownPool(_)))); // stats per pool, per device

    // Spare buffers, given up when memory runs out.
    let (spare, spares) = flume::unbounded::<DeviceBuffer>();
    allocator.attach_free_memory_callback(move || spares.drain().count() > 0);
    spare.send(allocator.alloc(8 << 20, &stream).await?).unwrap();
    assert_eq!(allocator.free_memory_callback_panics(), 0);
    Ok(())
}

/// "Checkpoints of a capture pool": a pool brought back to a checkpoint, its block at its
/// old address again.
#[rustfmt::skip]
#[tokio::test(flavor = "multi_thread")]
async fn readme_checkpoints_of_a_capture_pool() -> Result {
    use pinpool::DeviceAllocator;

    let allocator = DeviceAllocator::builder().build()?;
    let stream = allocator.runtime().new_stream()?;
    let id = pinpool::PoolId::fresh();
    let s = stream.id();
    allocator.begin_allocate_to_pool(0, id, move |t| t.id() == s).await?;
    let a = allocator.raw_alloc_with_stream(1 << 20, &stream)?;  // in the capture pool
    allocator.end_allocate_to_pool(0, id).await?;
    let checkpoint = allocator.checkpoint_state(0, id).await?;
    assert_eq!(checkpoint.allocated(), vec![(a as usize, 1 << 20)]);

    allocator.raw_delete(a)?;
    allocator.begin_allocate_to_pool(0, id, move |t| t.id() == s).await?;
    let b = allocator.raw_alloc_with_stream(2 << 20, &stream)?;  // maybe where `a` was
    allocator.end_allocate_to_pool(0, id).await?;

    let delta = allocator.set_checkpoint_pool_state(0, &checkpoint, &stream).await?;
    assert_eq!(delta.ptrs_freed, vec![b]);
    assert_eq!(delta.dataptrs_allocd, vec![a]);              // back at its old address
    allocator.raw_delete(a)?;
    Ok(())
}

/// "Snapshots for PyTorch's memory visualizer": the pickle and the file.
#[rustfmt::skip]
#[tokio::test(flavor = "multi_thread")]
async fn readme_snapshot_for_the_memory_visualizer() -> Result {
    use pinpool::{DeviceAllocator, HistoryContext};

    let allocator = DeviceAllocator::builder().build()?;
    allocator.record_history(true, 100_000, HistoryContext::Alloc)?; // device_traces, with frames
    let stream = allocator.runtime().new_stream()?;
    let buf = allocator.alloc(1 << 20, &stream).await?;
    let bytes = allocator.pickle_snapshot().await?; // what torch.cuda.memory._snapshot() pickles
    assert_eq!(&bytes[..2], &[0x80, 2]);
    let file = std::env::temp_dir().join("pinpool-device-doc.pickle");
    std::fs::write(&file, bytes)?; // open it in pytorch.org/memory_viz
    drop(buf);
    std::fs::remove_file(&file)?;
    Ok(())
}

/// "Planning repeated work into one arena": record a run, plan it, serve the next from the
/// arena.
#[rustfmt::skip]
#[tokio::test(flavor = "multi_thread")]
async fn readme_plan_repeated_work_into_one_arena() -> Result {
    let allocator = PinnedAllocator::builder().build()?;
    let rec = allocator.record_plan()?;
    let a = rec.alloc(1 << 20).await?;   // allocations made through the recorder are noted
    drop(a);
    let plan = rec.finish().plan()?;     // planner `Best` by default
    let mut session = allocator.serve_plan(&plan).await?;
    let b = session.alloc(1 << 20).await?; // a view into the arena at its planned offset
    drop(b);
    session.reset().await?;              // next iteration
    Ok(())
}

/// "History": trace entries, an annotation, and reading them back.
#[rustfmt::skip]
#[tokio::test(flavor = "multi_thread")]
async fn readme_history_records_trace_entries() -> Result {
    let allocator = PinnedAllocator::builder().build()?;
    use pinpool::{HistoryContext, TraceAction};

    allocator.record_history(true, 100_000, HistoryContext::Alloc)?;
    allocator.record_annotation("warm-up");
    let buf = allocator.alloc(1 << 20).await?;
    drop(buf);
    let history = allocator.history().await?; // history_blocking() from plain threads
    assert!(history.entries.iter().any(|e| e.action == TraceAction::SegmentMap)); // fresh granules
    Ok(())
}

/// This file's own source, which the README's blocks must appear in.
const THIS_FILE: &str = include_str!("readme_examples.rs");

/// The ```rust blocks of a markdown text: the line number (from 1) of each opening fence, and
/// the block's lines. Blocks of other languages are skipped.
fn rust_blocks<'a>(markdown: &'a str, name: &str) -> Vec<(usize, Vec<&'a str>)> {
    let mut blocks = Vec::new();
    // Inside a fenced block: `Some` with the rust block being read, `None` for another language.
    let mut inside: Option<Option<(usize, Vec<&str>)>> = None;
    for (index, line) in markdown.lines().enumerate() {
        let fence = line.trim_start().strip_prefix("```");
        match (&mut inside, fence) {
            (None, Some(info)) => {
                let rust = info.split(',').next().map(str::trim) == Some("rust");
                inside = Some(rust.then(|| (index + 1, Vec::new())));
            }
            (Some(block), Some(_)) => {
                blocks.extend(block.take());
                inside = None;
            }
            (Some(Some((_, lines))), None) => lines.push(line),
            (Some(None), None) | (None, None) => {}
        }
    }
    assert!(inside.is_none(), "{name}: a fenced block is never closed");
    blocks
}

/// The lines of `text` that are not blank, trimmed.
fn trimmed_lines(text: &[&str]) -> Vec<String> {
    text.iter()
        .map(|line| line.trim())
        .filter(|line| !line.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The markdown files whose ```rust blocks this file must compile: the README and every page
/// of the guide.
fn documented_files() -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut pages: Vec<_> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|entry| entry.expect("an entry of docs/").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    pages.sort();
    files.extend(pages);
    files
}

#[test]
fn the_readme_says_to_run_programs_with_release_and_runs_every_example_so() {
    let readme = include_str!("../../README.md");
    assert!(
        readme.contains("Run the examples, the benchmarks and your own programs with `--release`"),
        "the README says to build programs with --release"
    );
    for line in readme.lines().filter(|l| l.contains("cargo run")) {
        if line.trim_start().starts_with("cargo run") {
            assert!(
                line.contains("--release"),
                "a debug run in the README: {line}"
            );
        }
    }
}

#[test]
fn every_rust_block_of_the_readme_and_the_guide_is_compiled_here() {
    let source = trimmed_lines(&THIS_FILE.lines().collect::<Vec<_>>());
    let mut missing = Vec::new();
    let mut total = 0;
    for path in documented_files() {
        let text = std::fs::read_to_string(&path).expect("a markdown file");
        let name = path
            .strip_prefix(env!("CARGO_MANIFEST_DIR"))
            .unwrap_or(&path)
            .display();
        let blocks = rust_blocks(&text, &name.to_string());
        total += blocks.len();
        for (start, lines) in &blocks {
            let wanted = trimmed_lines(lines);
            let found = !wanted.is_empty()
                && source
                    .windows(wanted.len())
                    .any(|run| run == wanted.as_slice());
            if !found {
                let numbered: Vec<String> = lines
                    .iter()
                    .enumerate()
                    .map(|(i, line)| format!("{:>5} | {line}", start + 1 + i))
                    .collect();
                missing.push(format!(
                    "{name} line {start}: this ```rust block is not in tests/host/readme_examples.rs \
                     (its non-blank lines, trimmed, must appear there in a row):\n{}",
                    numbered.join("\n")
                ));
            }
        }
    }
    assert!(
        total > 0,
        "no ```rust block found in the README or the guide"
    );
    assert!(
        missing.is_empty(),
        "{} of {} documented blocks are not compiled by this file; copy each into its test:\n\n{}",
        missing.len(),
        total,
        missing.join("\n\n")
    );
}
