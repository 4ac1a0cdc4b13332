//! Replays allocation traces through pinpool and reports how much memory each size policy
//! reserves: pinned host memory by default, device memory with `--device`.
//!
//! ```sh
//! cargo run --release --example replay -- [--device] [--policy NAME] FILE...
//! ```
//!
//! With `--device` the trace runs through a `DeviceAllocator` on a simulated device (each
//! trace stream its own simulated stream), and the policies are the device layouts:
//! `device` (the default: blocks packed into one expandable range per stream) and
//! `device_segments` (separate segments, PyTorch's layout without expandable segments).
//! `--policy default` names the default policy, host or device, whichever it is.
//!
//! Each file (the text format of `pinpool_tools::trace`, gzip or plain, or MiniMalloc CSV) is played
//! on the simulated runtime through the real engine and its actors: an allocation at each `a`
//! line, a drop at each `f` line, no streams. For each file and policy it prints peak reserved
//! bytes over peak live requested bytes, how many requests needed fresh memory (host
//! allocations), and the time per request (with `--device`, also what PyTorch's allocator
//! with expandable segments would reserve, emulated: `pinpool_tools::torch_layout`), then
//! one summary line per file and policy:
//!
//! ```text
//! replay <file name> policy=<name> reserved_over_peak=<ratio> fresh=<count> ns_per_request=<ns>
//! ```
//!
//! Without `--policy`, every policy runs. A malformed file is an error naming its line, and
//! the exit status is nonzero.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use pinpool::config::{DeviceConfig, SizePolicyChoice};
use pinpool::tuning::SizePolicy;
use pinpool::{DeviceAllocator, DeviceBuffer, PinnedAllocator, PinnedBuffer};
use pinpool_tools::torch_layout;
use pinpool_tools::trace::{Trace, TraceError, TraceEvent};

/// The device layouts `--device` knows, as `PINPOOL_DEVICE_CONF` settings.
/// `default` is the device allocator's default layout (one expandable range per stream).
const DEVICE_POLICIES: [(&str, bool); 3] = [
    ("default", true),
    ("device", true),
    ("device_segments", false),
];

/// The names of the policies the tool knows (host or device ones).
fn policy_names(device: bool) -> Vec<&'static str> {
    if device {
        DEVICE_POLICIES.iter().map(|(n, _)| *n).collect()
    } else {
        SizePolicyChoice::names().collect()
    }
}

/// The host policy called `name`.
pub(crate) fn policy(name: &str) -> Option<Arc<dyn SizePolicy>> {
    SizePolicyChoice::from_name(name).map(SizePolicyChoice::policy)
}

/// The device configuration of the device policy called `name`.
fn device_config(name: &str) -> Option<DeviceConfig> {
    let (_, expandable) = DEVICE_POLICIES.iter().find(|(n, _)| *n == name)?;
    Some(DeviceConfig::default().with_expandable_segments(*expandable))
}

/// What went wrong.
#[derive(Debug)]
pub(crate) enum ReplayError {
    /// The command line.
    Usage(String),
    /// A trace could not be read (the message names the file and line).
    Trace(TraceError),
    /// The allocator failed.
    Alloc { file: String, error: pinpool::Error },
    /// No tokio runtime could be started.
    Runtime(std::io::Error),
}

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplayError::Usage(m) => write!(
                f,
                "{m}\nusage: replay [--policy {}] FILE...\n       replay --device [--policy {}] FILE...",
                policy_names(false).join("|"),
                policy_names(true).join("|")
            ),
            ReplayError::Trace(e) => write!(f, "{e}"),
            ReplayError::Alloc { file, error } => write!(f, "{file}: allocation failed: {error}"),
            ReplayError::Runtime(e) => write!(f, "could not start a tokio runtime: {e}"),
        }
    }
}

impl std::error::Error for ReplayError {}

/// What a command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Args {
    /// Replay through device memory (`--device`).
    pub(crate) device: bool,
    /// Policy names to run, in order.
    pub(crate) policies: Vec<String>,
    /// Trace files.
    pub(crate) files: Vec<PathBuf>,
}

/// Parses the arguments after the program name.
pub(crate) fn parse_args(args: &[String]) -> Result<Args, ReplayError> {
    let mut policies = Vec::new();
    let mut files = Vec::new();
    let mut device = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--device" {
            device = true;
        } else if let Some(name) = a.strip_prefix("--policy=") {
            policies.push(name.to_owned());
        } else if a == "--policy" {
            let name = it
                .next()
                .ok_or_else(|| ReplayError::Usage("--policy needs a name".into()))?;
            policies.push(name.clone());
        } else if a.starts_with("--") {
            return Err(ReplayError::Usage(format!("unknown option {a}")));
        } else {
            files.push(PathBuf::from(a));
        }
    }
    let known = policy_names(device);
    for p in &policies {
        if !known.contains(&p.as_str()) {
            return Err(ReplayError::Usage(format!(
                "unknown {}policy {p:?} (known: {})",
                if device { "device " } else { "" },
                known.join(", ")
            )));
        }
    }
    if policies.is_empty() {
        // Every policy once: `default` is one of the others under another name.
        policies = known
            .into_iter()
            .filter(|&n| n != SizePolicyChoice::DEFAULT_NAME)
            .map(String::from)
            .collect();
    }
    if files.is_empty() {
        return Err(ReplayError::Usage("no trace files given".into()));
    }
    Ok(Args {
        device,
        policies,
        files,
    })
}

/// The outcome of replaying one trace under one policy.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Report {
    /// The file's name (without its directory).
    pub(crate) file: String,
    /// The policy's name.
    pub(crate) policy: String,
    /// Allocation requests replayed.
    pub(crate) requests: usize,
    /// Peak live requested bytes.
    pub(crate) peak_live: u64,
    /// Peak reserved (pinned) bytes.
    pub(crate) peak_reserved: u64,
    /// Requests that needed fresh memory (host allocations made).
    pub(crate) fresh: u64,
    /// Idle memory moved to where a request needed it instead (no memory taken).
    pub(crate) moved: u64,
    /// Wall time per request, allocation and free together, in nanoseconds.
    pub(crate) ns_per_request: f64,
}

impl Report {
    /// Peak reserved bytes over peak live requested bytes.
    pub(crate) fn reserved_over_peak(&self) -> f64 {
        if self.peak_live == 0 {
            return 1.0;
        }
        self.peak_reserved as f64 / self.peak_live as f64
    }

    /// The summary line.
    pub(crate) fn line(&self) -> String {
        format!(
            "replay {} policy={} reserved_over_peak={:.3} fresh={} ns_per_request={:.0}",
            self.file,
            self.policy,
            self.reserved_over_peak(),
            self.fresh,
            self.ns_per_request
        )
    }
}

/// Replays `trace` (named `file` in the report) through a fresh device allocator on a
/// simulated device, with the device policy `policy_name`.
pub(crate) fn replay_device(
    trace: &Trace,
    file: &str,
    policy_name: &str,
) -> Result<Report, ReplayError> {
    let config = device_config(policy_name)
        .ok_or_else(|| ReplayError::Usage(format!("unknown device policy {policy_name:?}")))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(ReplayError::Runtime)?;
    let alloc_err = |error| ReplayError::Alloc {
        file: file.to_owned(),
        error,
    };
    rt.block_on(async {
        let allocator = DeviceAllocator::builder()
            .config(&config)
            .build()
            .map_err(alloc_err)?;
        let mut streams = std::collections::BTreeMap::new();
        let mut live: Vec<Option<DeviceBuffer>> = Vec::new();
        live.resize_with(trace.allocation_count(), || None);
        let t0 = Instant::now();
        for event in trace.events() {
            match *event {
                TraceEvent::Alloc { id, bytes, stream } => {
                    let size = usize::try_from(bytes).unwrap_or(usize::MAX);
                    let s = match streams.entry(stream) {
                        std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                        std::collections::btree_map::Entry::Vacant(e) => e.insert(
                            allocator
                                .runtime()
                                .new_stream()
                                .map_err(|e| alloc_err(e.into()))?,
                        ),
                    };
                    live[id] = Some(allocator.alloc(size, s).await.map_err(alloc_err)?);
                }
                TraceEvent::Free { id } => live[id] = None,
            }
        }
        let elapsed = t0.elapsed();
        let stats = allocator.stats(0).map_err(alloc_err)?;
        drop(live);
        let requests = trace.allocation_count();
        Ok(Report {
            file: file.to_owned(),
            policy: policy_name.to_owned(),
            requests,
            peak_live: trace.peak_live_bytes(),
            peak_reserved: stats.reserved_bytes.all.peak.max(0) as u64,
            fresh: stats.num_device_alloc.max(0) as u64,
            moved: allocator.runtime().device_remaps(0).unwrap_or(0),
            ns_per_request: elapsed.as_nanos() as f64 / requests.max(1) as f64,
        })
    })
}

/// Replays `trace` (named `file` in the report) through a fresh allocator with `policy`.
pub(crate) fn replay_trace(
    trace: &Trace,
    file: &str,
    policy_name: &str,
) -> Result<Report, ReplayError> {
    let policy = policy(policy_name)
        .ok_or_else(|| ReplayError::Usage(format!("unknown policy {policy_name:?}")))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(ReplayError::Runtime)?;
    let alloc_err = |error| ReplayError::Alloc {
        file: file.to_owned(),
        error,
    };
    rt.block_on(async {
        let allocator = PinnedAllocator::builder()
            .policy(policy)
            .build()
            .map_err(alloc_err)?;
        let mut live: Vec<Option<PinnedBuffer>> = Vec::new();
        live.resize_with(trace.allocation_count(), || None);
        let t0 = Instant::now();
        for event in trace.events() {
            match *event {
                TraceEvent::Alloc { id, bytes, .. } => {
                    let size = usize::try_from(bytes).unwrap_or(usize::MAX);
                    live[id] = Some(allocator.alloc(size).await.map_err(alloc_err)?);
                }
                TraceEvent::Free { id } => live[id] = None,
            }
        }
        let elapsed = t0.elapsed();
        let stats = allocator.stats();
        drop(live);
        let requests = trace.allocation_count();
        Ok(Report {
            file: file.to_owned(),
            policy: policy_name.to_owned(),
            requests,
            peak_live: trace.peak_live_bytes(),
            peak_reserved: stats.allocated_bytes.peak.max(0) as u64,
            fresh: stats.num_host_alloc.max(0) as u64,
            moved: stats.num_host_remaps.max(0) as u64,
            ns_per_request: elapsed.as_nanos() as f64 / requests.max(1) as f64,
        })
    })
}

/// The name a report gives a path: its file name.
pub(crate) fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// Runs a whole command line, printing details as it goes; returns every report.
pub(crate) fn run(args: &[String], mut out: impl FnMut(&str)) -> Result<Vec<Report>, ReplayError> {
    let args = parse_args(args)?;
    // Read every file first, so that a malformed one fails before any work is done.
    let traces = args
        .files
        .iter()
        .map(|p| Trace::open(p).map(|t| (file_name(p), t)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(ReplayError::Trace)?;
    let mut reports = Vec::new();
    for (name, trace) in &traces {
        out(&format!(
            "{name}: {} requests, peak live {:.1} MiB",
            trace.allocation_count(),
            trace.peak_live_bytes() as f64 / (1u64 << 20) as f64
        ));
        for p in &args.policies {
            let r = if args.device {
                replay_device(trace, name, p)?
            } else {
                replay_trace(trace, name, p)?
            };
            out(&format!(
                "  {:<8} peak reserved {:>9.1} MiB = {:.3}x peak live, {} fresh allocations, {} moved, {:.0} ns per request",
                r.policy,
                r.peak_reserved as f64 / (1u64 << 20) as f64,
                r.reserved_over_peak(),
                r.fresh,
                r.moved,
                r.ns_per_request
            ));
            reports.push(r);
        }
        if args.device {
            let torch = torch_layout::emulate(trace);
            out(&format!(
                "  PyTorch's expandable segments (emulated): peak reserved {:.1} MiB = {:.3}x peak live",
                torch.peak_reserved as f64 / (1u64 << 20) as f64,
                torch.peak_reserved as f64 / trace.peak_live_bytes().max(1) as f64
            ));
        }
    }
    for r in &reports {
        out(&r.line());
    }
    Ok(reports)
}

#[allow(dead_code)]
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = run(&args, |line| println!("{line}")) {
        eprintln!("replay: {e}");
        std::process::exit(match e {
            ReplayError::Usage(_) => 2,
            _ => 1,
        });
    }
}
