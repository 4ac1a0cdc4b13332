//! Reading trace files: both formats, and a typed, line-numbered error for each kind of
//! malformed input.

use std::io::Write;

use pinpool::plan::Lifetime;
use pinpool_tools::trace::{Trace, TraceError, TraceErrorKind, TraceEvent};

fn text(s: &str) -> Result<Trace, TraceError> {
    Trace::read_text(s.as_bytes(), "t")
}

fn csv(s: &str) -> Result<Trace, TraceError> {
    Trace::read_csv(s.as_bytes(), "c")
}

fn fails_at(result: Result<Trace, TraceError>, line: usize, kind: TraceErrorKind) {
    let err = result.expect_err("malformed input must be rejected");
    assert_eq!(err.line(), Some(line), "{err}");
    assert_eq!(err.kind(), Some(&kind), "{err}");
}

fn bad(field: &'static str, text: &str) -> TraceErrorKind {
    TraceErrorKind::BadNumber {
        field,
        text: text.into(),
    }
}

#[test]
fn text_trace_yields_events_and_lifetimes_in_event_time() {
    let trace = text("# header\n\na 0 1024 0\na 1 512 3\nf 0\na 2 64 0\n").unwrap();
    assert_eq!(trace.events().len(), 4);
    assert_eq!(
        trace.events()[1],
        TraceEvent::Alloc {
            id: 1,
            bytes: 512,
            stream: 3
        }
    );
    let expected = [
        Lifetime {
            id: 0,
            size: 1024,
            start: 0,
            end: 2,
        },
        Lifetime {
            id: 1,
            size: 512,
            start: 1,
            end: 4,
        },
        Lifetime {
            id: 2,
            size: 64,
            start: 3,
            end: 4,
        },
    ];
    assert_eq!(trace.lifetimes(), expected);
    assert_eq!(trace.peak_live_bytes(), 1536);
}

#[test]
fn gzip_text_trace_reads_like_plain_text() {
    let plain = "a 0 100 0\nf 0\na 1 200 1\n";
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(plain.as_bytes()).unwrap();
    let gz = encoder.finish().unwrap();
    let from_gz = Trace::read_text(gz.as_slice(), "gz").unwrap();
    assert_eq!(from_gz, text(plain).unwrap());
}

#[test]
fn corrupt_gzip_is_a_read_error_not_a_panic() {
    let err = Trace::read_text(&[0x1f, 0x8b, 0, 1, 2, 3][..], "gz").unwrap_err();
    assert!(matches!(err, TraceError::Read { .. }), "{err}");
}

#[test]
fn open_picks_csv_by_extension_and_text_otherwise() {
    let dir = std::env::temp_dir().join(format!("pinpool-trace-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv_path = dir.join("x.csv");
    let txt_path = dir.join("x.trace");
    std::fs::write(&csv_path, "id,lower,upper,size\n0,0,5,64\n").unwrap();
    std::fs::write(&txt_path, "a 0 64 0\n").unwrap();
    assert_eq!(Trace::open(&csv_path).unwrap().lifetimes()[0].size, 64);
    assert_eq!(Trace::open(&txt_path).unwrap().allocation_count(), 1);
    let missing = Trace::open(dir.join("missing.trace.gz")).unwrap_err();
    assert!(matches!(missing, TraceError::Open { .. }), "{missing}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn text_errors_name_the_line_and_the_fault() {
    fails_at(text("a 0 12x 0\n"), 1, bad("bytes", "12x"));
    fails_at(text("a 0 -1 0\n"), 1, bad("bytes", "-1"));
    fails_at(text("a 0 +1 0\n"), 1, bad("bytes", "+1"));
    fails_at(
        text("a 0 99999999999999999999 0\n"),
        1,
        bad("bytes", "99999999999999999999"),
    );
    fails_at(
        text("# c\nx 0\n"),
        2,
        TraceErrorKind::UnknownTag { tag: "x".into() },
    );
    fails_at(
        text("a 0 8\n"),
        1,
        TraceErrorKind::MissingField { field: "stream" },
    );
    fails_at(
        text("f 0 1\n"),
        1,
        TraceErrorKind::ExtraField { text: "1".into() },
    );
    fails_at(
        text("a 0 8 0\nf 1\n"),
        2,
        TraceErrorKind::FreeOfUnknownId { id: 1 },
    );
    fails_at(
        text("a 0 8 0\nf 0\nf 0\n"),
        3,
        TraceErrorKind::DoubleFree { id: 0 },
    );
    fails_at(
        text("a 0 8 0\na 0 8 0\n"),
        2,
        TraceErrorKind::DuplicateId { id: 0 },
    );
    fails_at(
        text("a 0 8 0\na 2 8 0\n"),
        2,
        TraceErrorKind::OutOfOrderId { id: 2, expected: 1 },
    );
    fails_at(
        Trace::read_text(&b"a 0 8 0\n\xff\n"[..], "t"),
        2,
        TraceErrorKind::NotUtf8,
    );
}

#[test]
fn error_message_names_file_and_line() {
    let err = text("a 0 8 0\nq\n").unwrap_err();
    assert_eq!(
        err.to_string(),
        "t:2: unknown event tag \"q\" (expected `a` or `f`)"
    );
}

#[test]
fn csv_orders_frees_before_allocations_at_equal_times() {
    // Buffer 1 starts exactly when 0 ends: they do not overlap; 2 overlaps both.
    let trace = csv("id,lower,upper,size\n1,10,20,64\n0,0,10,128\n2,5,15,32\n").unwrap();
    let l = trace.lifetimes();
    assert_eq!((l[0].id, l[0].size), (0, 128));
    assert!(!l[0].overlaps(&l[1]));
    assert!(l[2].overlaps(&l[0]) && l[2].overlaps(&l[1]));
    assert_eq!(trace.peak_live_bytes(), 160);
}

#[test]
fn csv_errors_name_the_line_and_the_fault() {
    let header = "id,lower,upper,size\n";
    let with = |rows: &str| csv(&format!("{header}{rows}"));
    fails_at(
        csv(""),
        1,
        TraceErrorKind::BadHeader {
            found: String::new(),
        },
    );
    fails_at(
        csv("id,lo,hi,size\n"),
        1,
        TraceErrorKind::BadHeader {
            found: "id,lo,hi,size".into(),
        },
    );
    fails_at(
        with("0,0,5\n"),
        2,
        TraceErrorKind::MissingField { field: "size" },
    );
    fails_at(
        with("0,0,5,8,9\n"),
        2,
        TraceErrorKind::ExtraField { text: "9".into() },
    );
    fails_at(
        with("0,5,5,8\n"),
        2,
        TraceErrorKind::EmptyLifetime { lower: 5, upper: 5 },
    );
    fails_at(
        with("0,0,5,8\n0,1,2,8\n"),
        3,
        TraceErrorKind::DuplicateId { id: 0 },
    );
    fails_at(
        with("0,0,5,8\n3,1,2,8\n"),
        3,
        TraceErrorKind::IdOutOfRange { id: 3, count: 2 },
    );
    fails_at(with("0,0,x,8\n"), 2, bad("upper", "x"));
}

#[test]
fn from_events_checks_the_same_invariants() {
    let ok = Trace::from_events(vec![
        TraceEvent::Alloc {
            id: 1,
            bytes: 8,
            stream: 0,
        },
        TraceEvent::Alloc {
            id: 0,
            bytes: 16,
            stream: 0,
        },
        TraceEvent::Free { id: 1 },
    ])
    .unwrap();
    assert_eq!(
        ok.lifetimes()[1],
        Lifetime {
            id: 1,
            size: 8,
            start: 0,
            end: 2
        }
    );
    let err = Trace::from_events(vec![
        TraceEvent::Alloc {
            id: 0,
            bytes: 8,
            stream: 0,
        },
        TraceEvent::Free { id: 0 },
        TraceEvent::Free { id: 0 },
    ])
    .unwrap_err();
    assert_eq!(err.line(), Some(3));
    assert_eq!(err.kind(), Some(&TraceErrorKind::DoubleFree { id: 0 }));
    let sparse = Trace::from_events(vec![TraceEvent::Alloc {
        id: 1,
        bytes: 8,
        stream: 0,
    }]);
    assert_eq!(
        sparse.unwrap_err().kind(),
        Some(&TraceErrorKind::IdOutOfRange { id: 1, count: 1 })
    );
}
