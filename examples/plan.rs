//! Plans the allocation traces given on the command line with every planner and prints, per
//! file and planner, the arena size over the peak-live lower bound and the planning time.
//!
//! ```text
//! cargo run --release --example plan -- /work/shared/traces/*.trace.gz /work/shared/traces/minimalloc/*.csv
//! ```
//!
//! `--random N` instead plans a synthetic instance of N allocations (fixed seed), to time
//! the planners on large inputs.
//!
//! Accepts `.trace.gz` (or plain text) traces and MiniMalloc `.csv` files. Every plan is
//! checked with `pinpool::plan::check`; bad input or an unsound plan exits nonzero.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use pinpool::plan::{check, Planner};
use pinpool_tools::trace::{Trace, TraceEvent};

fn main() -> ExitCode {
    let files: Vec<String> = std::env::args().skip(1).collect();
    if files.is_empty() {
        eprintln!("usage: plan FILE... (.trace.gz, plain text traces, or MiniMalloc .csv)");
        return ExitCode::from(2);
    }
    let mut ratios = vec![Vec::new(); Planner::ALL.len()];
    for file in &files {
        let trace = match random_spec(&files, file) {
            Some(n) => Ok(random_trace(n)),
            None if file == "--random" => continue,
            None => Trace::open(file),
        };
        let trace = match trace {
            Ok(trace) => trace,
            Err(err) => {
                eprintln!("error: {err}");
                return ExitCode::FAILURE;
            }
        };
        let name = Path::new(file)
            .file_name()
            .map_or_else(|| file.clone(), |n| n.to_string_lossy().into_owned());
        for (p, planner) in Planner::ALL.into_iter().enumerate() {
            let started = Instant::now();
            let plan = match planner.plan(trace.lifetimes()) {
                Ok(plan) => plan,
                Err(err) => {
                    eprintln!("error: {file}: {err}");
                    return ExitCode::FAILURE;
                }
            };
            let plan_ms = started.elapsed().as_secs_f64() * 1e3;
            if let Err(violation) = check(&plan) {
                eprintln!(
                    "error: {file}: planner {} made an unsound plan: {violation}",
                    planner.name()
                );
                return ExitCode::FAILURE;
            }
            let ratio = plan.arena_size() as f64 / plan.lower_bound().max(1) as f64;
            ratios[p].push(ratio);
            println!(
                "plan {name} planner={} arena_over_lower_bound={ratio:.4} plan_ms={plan_ms:.1}",
                planner.name()
            );
        }
    }
    for (p, planner) in Planner::ALL.into_iter().enumerate() {
        let geomean =
            (ratios[p].iter().map(|r| r.ln()).sum::<f64>() / ratios[p].len() as f64).exp();
        println!(
            "geomean planner={} files={} arena_over_lower_bound={geomean:.4}",
            planner.name(),
            ratios[p].len()
        );
    }
    ExitCode::SUCCESS
}

/// `N` when `file` follows `--random`.
fn random_spec(files: &[String], file: &str) -> Option<usize> {
    let position = files.iter().position(|f| f == file)?;
    if position > 0 && files[position - 1] == "--random" {
        file.parse().ok()
    } else {
        None
    }
}

/// A server-like synthetic trace of `n` allocations: sizes 512 B to 4 MiB, about 60 live at
/// a time, a few long-lived ones. Deterministic.
fn random_trace(n: usize) -> Trace {
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut events = Vec::new();
    let mut live: Vec<usize> = Vec::new();
    for id in 0..n {
        while live.len() > 60 || (!live.is_empty() && next() % 3 == 0) {
            let victim = live.swap_remove((next() % live.len() as u64) as usize);
            events.push(TraceEvent::Free { id: victim });
        }
        let bytes = 512 << (next() % 14);
        events.push(TraceEvent::Alloc {
            id,
            bytes,
            stream: 0,
        });
        if next() % 1000 != 0 {
            live.push(id);
        }
    }
    Trace::from_events(events).expect("generated events are well formed")
}
