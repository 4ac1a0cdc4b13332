//! The other process of the GPU suite's IPC tests (`tests/gpu_ipc_peer.rs`).
//!
//! ```text
//! ipc_peer open HANDLE_HEX EXPECT_SEED WRITE_SEED
//!     opens the exported block (of either kind: a block of a cuMemAlloc segment, or of an
//!     expandable range, whose file descriptors are taken from the exporting process),
//!     checks that it holds pattern(EXPECT_SEED), writes pattern(WRITE_SEED) over it, and
//!     exits 0 (2 when the bytes differ, 1 on an error)
//! ipc_peer export SEED [expandable]
//!     allocates 1 MiB (of a cuMemAlloc segment, or with `expandable` of the default
//!     layout's expandable range), fills it with pattern(SEED), prints its handle in hex and
//!     exits (its memory goes with it: the handle is then one of a process that is gone)
//! ```
//!
//! Build it with `cargo build --release --features cuda --example ipc_peer`.

use std::process::ExitCode;

use cudarc::driver::{result, CudaContext};
use pinpool::config::DeviceConfig;
use pinpool::{DeviceAllocator, Error, IpcHandle};

/// The byte pattern the tests use: differs from position to position and seed to seed.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32 * 17) as u8)
        .collect()
}

fn seed(arg: Option<&String>) -> Result<u8, String> {
    arg.ok_or("missing seed")?
        .parse()
        .map_err(|e| format!("bad seed: {e}"))
}

/// An allocator of whole cuMemAlloc segments, or with `expandable` of expandable ranges.
fn allocator(expandable: bool) -> Result<DeviceAllocator<pinpool::cuda::CudaRuntime>, Error> {
    let setting = format!("expandable_segments:{expandable}");
    let config: DeviceConfig = setting.parse().map_err(|e| Error::InvalidConfig {
        message: format!("{e}"),
    })?;
    DeviceAllocator::builder().cuda()?.config(&config).build()
}

#[tokio::main(flavor = "current_thread")]
async fn open(args: &[String]) -> Result<bool, String> {
    let handle: IpcHandle = args
        .first()
        .ok_or("missing handle")?
        .parse()
        .map_err(|e| format!("{e}"))?;
    let (expect, write) = (seed(args.get(1))?, seed(args.get(2))?);
    // Either layout opens either kind of handle.
    let allocator = allocator(false).map_err(|e| e.to_string())?;
    let block = allocator.open_ipc(&handle).map_err(|e| e.to_string())?;
    let ctx = CudaContext::new(block.device()).map_err(|e| format!("{e:?}"))?;
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let mut bytes = vec![0u8; block.len()];
    // SAFETY: `block` is open (it lives to the end of this function) and holds `len` bytes.
    unsafe { result::memcpy_dtoh_sync(&mut bytes, block.device_ptr()) }
        .map_err(|e| format!("cuMemcpyDtoH: {e:?}"))?;
    if bytes != pattern(block.len(), expect) {
        eprintln!("ipc_peer: the block does not hold pattern({expect})");
        return Ok(false);
    }
    // SAFETY: as above.
    unsafe { result::memcpy_htod_sync(block.device_ptr(), &pattern(block.len(), write)) }
        .map_err(|e| format!("cuMemcpyHtoD: {e:?}"))?;
    println!(
        "ipc_peer: read pattern({expect}) and wrote pattern({write}) over {} bytes on device {}",
        block.len(),
        block.device()
    );
    Ok(true)
}

#[tokio::main(flavor = "current_thread")]
async fn export(args: &[String]) -> Result<bool, String> {
    let fill = seed(args.first())?;
    let expandable = match args.get(1).map(String::as_str) {
        None => false,
        Some("expandable") => true,
        Some(other) => return Err(format!("unknown layout {other:?}")),
    };
    let allocator = allocator(expandable).map_err(|e| e.to_string())?;
    let stream = allocator
        .runtime()
        .context()
        .new_stream()
        .map_err(|e| format!("{e:?}"))?;
    let buf = allocator
        .alloc(1 << 20, &stream)
        .await
        .map_err(|e| e.to_string())?;
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| format!("{e:?}"))?;
    // SAFETY: the buffer is live and 1 MiB long; nothing else uses it.
    unsafe { result::memcpy_htod_sync(buf.device_ptr(), &pattern(buf.len(), fill)) }
        .map_err(|e| format!("cuMemcpyHtoD: {e:?}"))?;
    let handle = allocator.ipc_handle(&buf).map_err(|e| e.to_string())?;
    println!("{handle}");
    Ok(true)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let done = match args.first().map(String::as_str) {
        Some("open") => open(&args[1..]),
        Some("export") => export(&args[1..]),
        _ => Err(
            "usage: ipc_peer open HANDLE_HEX EXPECT_SEED WRITE_SEED | ipc_peer export SEED \
             [expandable]"
                .into(),
        ),
    };
    match done {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("ipc_peer: {e}");
            ExitCode::FAILURE
        }
    }
}
