//! Untrusted input never panics and never takes memory out of proportion to its size: the
//! `PINPOOL_CONF` and `PINPOOL_DEVICE_CONF` parsers, the trace readers (text, gzip, MiniMalloc
//! CSV), the planners and plan validation answer every input with a value or a typed error.
//!
//! Property tests over arbitrary bytes and strings, and over strings built from the formats'
//! own words (which reach deeper than random bytes do). A counting allocator measures the
//! peak heap of each call on its thread. CI runs the default number of cases; a long run sets
//! `PROPTEST_CASES` (`docs/reliability.md`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;

use flate2::write::GzEncoder;
use flate2::Compression;
use pinpool::config::{Config, DeviceConfig};
use pinpool::plan::Lifetime;
use pinpool::plan::{check, Observed, Plan, PlanCursor, Planner};
use pinpool_tools::trace::{Trace, TraceErrorKind};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------
// Peak heap bytes of a call, on the calling thread.

struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note_alloc(size: usize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + size;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

fn note_free(size: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(size)));
}

// SAFETY: every call goes to `System` unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_free(layout.size());
        System.dealloc(ptr, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_alloc(new_size);
        let p = System.realloc(ptr, layout, new_size);
        note_free(layout.size());
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns its value and the peak heap bytes it held above what was live
/// before.
fn peak_heap<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, PEAK.with(Cell::get) - base)
}

/// What a reader may hold for `input_len` bytes of (decompressed) input: its buffers, and
/// a few words per byte for the events and lifetimes the input can describe (an event
/// line is at least four bytes).
fn reader_bound(input_len: usize) -> usize {
    256 * 1024 + 64 * input_len
}

// ---------------------------------------------------------------------------------------
// Configuration strings.

const CONF_WORDS: &[&str] = &[
    "pin_method",
    "prefault_threads",
    "huge_pages",
    "size_policy",
    "max_split_size_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "host_alloc",
    "register",
    "tiered",
    "pow2",
    "bestfit",
    "bestfit_segments",
    "unlimited",
    "true",
    "false",
    "on",
    "NaN",
    "inf",
    "-1",
    "0",
    "1",
    "20",
    "64",
    "1024",
    "1025",
    "0.5",
    "1e-300",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999",
    ":",
    ",",
    " ",
    "::",
    "\u{0}",
    "é",
];

/// Strings made of the configuration's own words and separators.
fn conf_text() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(CONF_WORDS), 0..12).prop_map(|w| w.concat())
}

/// Well-formed `PINPOOL_CONF` strings.
fn valid_conf() -> impl Strategy<Value = String> {
    (
        prop::option::of(prop::sample::select(&["host_alloc", "register"][..])),
        prop::option::of(1usize..=1024),
        prop::option::of(any::<bool>()),
        prop::option::of(prop::sample::select(
            &["tiered", "pow2", "bestfit", "bestfit_segments"][..],
        )),
    )
        .prop_map(|(pin, threads, huge, policy)| {
            let mut parts = Vec::new();
            if let Some(p) = pin {
                parts.push(format!("pin_method:{p}"));
            }
            if let Some(t) = threads {
                parts.push(format!(" prefault_threads : {t} "));
            }
            if let Some(h) = huge {
                parts.push(format!("huge_pages:{h}"));
            }
            if let Some(p) = policy {
                parts.push(format!("size_policy:{p}"));
            }
            parts.join(",")
        })
}

/// Well-formed `PINPOOL_DEVICE_CONF` strings.
fn valid_device_conf() -> impl Strategy<Value = String> {
    (
        prop::option::of(prop::option::of(20usize..1 << 30)),
        prop::option::of(prop::sample::select(&[0u32, 1, 2, 4, 8, 16, 32, 64][..])),
        prop::option::of(1u32..1_000_000),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(split, div, gc, exp)| {
            let mut parts = Vec::new();
            match split {
                Some(Some(mb)) => parts.push(format!("max_split_size_mb:{mb}")),
                Some(None) => parts.push("max_split_size_mb:unlimited".into()),
                None => {}
            }
            if let Some(d) = div {
                parts.push(format!("roundup_power2_divisions:{d}"));
            }
            if let Some(g) = gc {
                parts.push(format!(
                    "garbage_collection_threshold:{}",
                    f64::from(g) / 1_000_000.0
                ));
            }
            if let Some(e) = exp {
                parts.push(format!("expandable_segments:{e}"));
            }
            parts.join(",")
        })
}

fn arbitrary_text() -> impl Strategy<Value = String> {
    prop_oneof![any::<String>(), conf_text()]
}

proptest! {
    #[test]
    fn any_conf_string_is_a_config_or_a_typed_error(text in arbitrary_text()) {
        let (parsed, peak) = peak_heap(|| text.parse::<Config>());
        prop_assert!(peak <= 4096 + 8 * text.len(), "{peak} bytes for {} bytes", text.len());
        if let Ok(config) = parsed {
            // What parses prints back to itself.
            prop_assert_eq!(config.to_string().parse::<Config>(), Ok(config));
        }
    }

    #[test]
    fn any_device_conf_string_is_a_config_or_a_typed_error(text in arbitrary_text()) {
        let (parsed, peak) = peak_heap(|| text.parse::<DeviceConfig>());
        prop_assert!(peak <= 4096 + 8 * text.len(), "{peak} bytes for {} bytes", text.len());
        if let Ok(config) = parsed {
            prop_assert_eq!(config.to_string().parse::<DeviceConfig>(), Ok(config));
        }
    }

    #[test]
    fn well_formed_conf_strings_parse_and_print_back(text in valid_conf()) {
        let config = text.parse::<Config>().expect("well-formed");
        prop_assert_eq!(config.to_string().parse::<Config>(), Ok(config));
    }

    #[test]
    fn well_formed_device_conf_strings_parse_and_print_back(text in valid_device_conf()) {
        let config = text.parse::<DeviceConfig>().expect("well-formed");
        prop_assert_eq!(config.to_string().parse::<DeviceConfig>(), Ok(config));
    }
}

// ---------------------------------------------------------------------------------------
// Trace files.

const TRACE_WORDS: &[&str] = &[
    "a",
    "f",
    "0",
    "1",
    "2",
    "3",
    "17",
    "4096",
    "18446744073709551615",
    "18446744073709551616",
    "+1",
    "-1",
    " ",
    "\t",
    "\n",
    "\r\n",
    "#",
    ",",
    "id,lower,upper,size\n",
    "\u{0}",
    "\u{ff}",
];

/// Byte strings made of the trace formats' own words.
fn trace_words() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop::sample::select(TRACE_WORDS), 0..40)
        .prop_map(|w| w.concat().into_bytes())
}

/// Text traces that are mostly well formed: allocations in order, frees of earlier ones,
/// with the odd line broken.
fn text_trace() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec((any::<bool>(), any::<u16>(), 0u64..1 << 40, 0u8..20), 0..60).prop_map(
        |ops| {
            let mut out = String::from("# generated\n");
            let mut next = 0usize;
            for (alloc, pick, bytes, noise) in ops {
                match (alloc || next == 0, noise) {
                    (_, 0) => out.push_str("a x 1 0\n"),
                    (_, 1) => out.push_str("f 99999999999\n"),
                    (true, _) => {
                        out.push_str(&format!("a {next} {bytes} {}\n", pick % 4));
                        next += 1;
                    }
                    (false, _) => out.push_str(&format!("f {}\n", usize::from(pick) % next)),
                }
            }
            out.into_bytes()
        },
    )
}

/// MiniMalloc CSV files that are mostly well formed.
fn csv_trace() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        (
            any::<u16>(),
            any::<u32>(),
            0u32..1000,
            any::<u64>(),
            0u8..20,
        ),
        0..40,
    )
    .prop_map(|rows| {
        let n = rows.len();
        let mut out = String::from("id,lower,upper,size\n");
        for (i, (pick, lower, len, size, noise)) in rows.into_iter().enumerate() {
            let id = if noise == 0 {
                usize::from(pick)
            } else {
                (i + usize::from(pick)) % n
            };
            let upper = u64::from(lower) + u64::from(len) + u64::from(noise == 1);
            out.push_str(&format!("{id},{lower},{upper},{size}\n"));
        }
        out.into_bytes()
    })
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

fn arbitrary_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        trace_words(),
        // Gzip's magic, then anything: a broken stream.
        prop::collection::vec(any::<u8>(), 0..512).prop_map(|b| [&[0x1f, 0x8b][..], &b].concat()),
    ]
}

/// A trace a reader accepted is consistent: lifetimes by id, each an allocation followed by
/// its free (if any), and the events rebuild the same trace.
fn assert_consistent(trace: &Trace) -> Result<(), TestCaseError> {
    for (i, l) in trace.lifetimes().iter().enumerate() {
        prop_assert_eq!(l.id, i);
        prop_assert!(l.start < l.end);
    }
    prop_assert_eq!(&Trace::from_events(trace.events().to_vec()).unwrap(), trace);
    Ok(())
}

proptest! {
    #[test]
    fn any_bytes_are_a_text_trace_or_a_typed_error(bytes in prop_oneof![arbitrary_bytes(), text_trace()]) {
        let (read, peak) = peak_heap(|| Trace::read_text(&bytes[..], "fuzz"));
        prop_assert!(peak <= reader_bound(bytes.len()), "{peak} bytes for {}", bytes.len());
        if let Ok(trace) = read {
            assert_consistent(&trace)?;
        }
    }

    #[test]
    fn any_bytes_gzipped_read_like_the_bytes_themselves(bytes in prop_oneof![trace_words(), text_trace()]) {
        let plain = Trace::read_text(&bytes[..], "fuzz");
        let packed = gzip(&bytes);
        let (read, peak) = peak_heap(|| Trace::read_text(&packed[..], "fuzz"));
        prop_assert!(peak <= reader_bound(bytes.len()), "{peak} bytes for {}", bytes.len());
        match (plain, read) {
            (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
            (Err(a), Err(b)) => prop_assert_eq!(a.to_string(), b.to_string()),
            (a, b) => prop_assert!(false, "plain {a:?} but gzipped {b:?}"),
        }
    }

    #[test]
    fn any_bytes_are_a_minimalloc_csv_or_a_typed_error(bytes in prop_oneof![arbitrary_bytes(), csv_trace()]) {
        let (read, peak) = peak_heap(|| Trace::read_csv(&bytes[..], "fuzz"));
        prop_assert!(peak <= reader_bound(bytes.len()), "{peak} bytes for {}", bytes.len());
        if let Ok(trace) = read {
            assert_consistent(&trace)?;
        }
    }
}

/// A gzip stream of one endless line (64 MiB of comment, a few kilobytes compressed): the
/// reader stops at its line limit instead of holding the whole line.
#[test]
fn an_endless_line_in_a_gzip_stream_is_an_error_not_unbounded_memory() {
    let mut enc = GzEncoder::new(Vec::new(), Compression::best());
    enc.write_all(b"# ").unwrap();
    let chunk = vec![b'x'; 1 << 20];
    for _ in 0..64 {
        enc.write_all(&chunk).unwrap();
    }
    let packed = enc.finish().unwrap();
    assert!(packed.len() < 1 << 20);
    let (read, peak) = peak_heap(|| Trace::read_text(&packed[..], "bomb"));
    let err = read.expect_err("a 64 MiB line is refused");
    assert!(
        matches!(err.kind(), Some(TraceErrorKind::LineTooLong { .. })),
        "{err}"
    );
    assert_eq!(err.line(), Some(1));
    assert!(peak < 1 << 20, "held {peak} bytes");
}

#[test]
fn an_endless_csv_line_is_an_error_not_unbounded_memory() {
    let mut text = b"id,lower,upper,size\n0,0,1,".to_vec();
    text.extend(std::iter::repeat(b'9').take(8 << 20));
    let (read, peak) = peak_heap(|| Trace::read_csv(&text[..], "long"));
    let err = read.expect_err("an 8 MiB line is refused");
    assert!(
        matches!(err.kind(), Some(TraceErrorKind::LineTooLong { .. })),
        "{err}"
    );
    assert_eq!(err.line(), Some(2));
    assert!(peak < 1 << 20, "held {peak} bytes");
}

// ---------------------------------------------------------------------------------------
// Plans.

fn lifetimes() -> impl Strategy<Value = Vec<Lifetime>> {
    let value = prop_oneof![0u64..64, 0u64..1 << 20, any::<u64>(), Just(u64::MAX)];
    prop::collection::vec((value.clone(), value.clone(), value), 0..12).prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(id, (size, start, end))| Lifetime {
                id,
                size,
                start,
                end,
            })
            .collect()
    })
}

fn alignment() -> impl Strategy<Value = u64> {
    prop_oneof![
        prop::sample::select(&[1u64, 64, 4096, 1 << 63][..]),
        any::<u64>(),
        Just(0)
    ]
}

fn observed() -> impl Strategy<Value = Vec<Observed>> {
    prop::collection::vec(
        prop_oneof![
            prop_oneof![0u64..1 << 20, any::<u64>()].prop_map(|size| Observed::Alloc { size }),
            prop_oneof![0usize..16, any::<usize>()].prop_map(|id| Observed::Free { id }),
        ],
        0..24,
    )
}

proptest! {
    #[test]
    fn any_lifetimes_are_planned_soundly_or_refused_with_a_typed_error(
        lifetimes in lifetimes(),
        alignment in alignment(),
    ) {
        for planner in Planner::ALL {
            if let Ok(plan) = planner.plan_aligned(&lifetimes, alignment) {
                prop_assert_eq!(check(&plan), Ok(()), "{:?}", planner);
                prop_assert!(plan.arena_size() >= plan.lower_bound() || alignment == 0);
            }
        }
    }

    #[test]
    fn any_plan_parts_are_checked_without_panicking(
        lifetimes in lifetimes(),
        offsets in prop::collection::vec(prop_oneof![0u64..1 << 20, any::<u64>()], 0..12),
        alignment in alignment(),
        arena_size in prop_oneof![0u64..1 << 22, any::<u64>()],
        events in observed(),
    ) {
        let Ok(plan) = Plan::from_parts(lifetimes, offsets, alignment, arena_size) else {
            return Ok(());
        };
        let _ = check(&plan);
        let _ = plan.validate(events.iter().copied());
        let mut cursor = PlanCursor::new(&plan);
        for event in events {
            let _ = match event {
                Observed::Alloc { size } => cursor.on_alloc(size).map(|_| ()),
                Observed::Free { id } => cursor.on_free(id),
            };
        }
        let _ = cursor.finish();
        cursor.reset();
    }

    #[test]
    fn a_recorded_run_validates_against_its_own_plan_and_any_other_run_gets_an_answer(
        lifetimes in lifetimes(),
        events in observed(),
    ) {
        let Ok(plan) = Planner::Greedy.plan(&lifetimes) else { return Ok(()); };
        let _ = plan.validate(events);
    }
}

/// Found by `any_lifetimes_are_planned_soundly_or_refused_with_a_typed_error`: an
/// allocation of some size whose lifetime is empty took no room in the planners' arena
/// (arena size 0), so the checker refused their plan as out of the arena.
#[test]
fn a_sized_allocation_that_is_never_live_still_lies_inside_the_planned_arena() {
    let at = |id, size, start, end| Lifetime {
        id,
        size,
        start,
        end,
    };
    for lifetimes in [
        vec![at(0, 1, u64::MAX, u64::MAX)],
        vec![at(0, 100, 0, 2), at(1, 5000, 1, 1), at(2, 100, 1, 3)],
    ] {
        for planner in Planner::ALL {
            let plan = planner.plan_aligned(&lifetimes, 64).unwrap();
            assert_eq!(check(&plan), Ok(()), "{planner:?} {lifetimes:?}");
        }
    }
}
