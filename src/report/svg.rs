//! The chart of one pool: inline SVG with axes, three step curves and markers.

use std::fmt::Write as _;

use crate::actors::{TraceAction, TraceEntry};

use super::{escape, PoolSeries, IN_USE_COLOR, RESERVED_COLOR, WAITING_COLOR};

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 280.0;
const LEFT: f64 = 84.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 28.0;
const BOTTOM: f64 = 36.0;

/// Bytes as a short human-readable string (binary units): `3.00 MiB`, `512 B`.
pub(crate) fn format_bytes(bytes: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v.abs() >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

/// A "nice" step for about `n` grid lines over `0..=max`, in bytes (powers of two times 1, 2, 5
/// would look odd for bytes, so steps are powers of two).
fn byte_step(max: i64, n: i64) -> i64 {
    let mut step = 1i64;
    while max / step > n {
        step *= 2;
    }
    step
}

fn time_step(span_us: f64) -> f64 {
    let raw = span_us / 8.0;
    let mag = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * mag >= raw {
            return m * mag;
        }
    }
    10.0 * mag
}

/// The plot area's scales: time from `t0` to `t1` (microseconds) across, bytes from 0 to
/// `y_max` up.
struct Frame {
    t0: f64,
    t1: f64,
    y_max: i64,
}

impl Frame {
    /// The x coordinate of time `t`.
    fn x(&self, t: u64) -> f64 {
        LEFT + (t as f64 - self.t0) / (self.t1 - self.t0) * (WIDTH - LEFT - RIGHT)
    }

    /// The y coordinate of `v` bytes.
    fn y(&self, v: i64) -> f64 {
        HEIGHT - BOTTOM - v as f64 / self.y_max as f64 * (HEIGHT - TOP - BOTTOM)
    }
}

pub(super) fn chart(
    out: &mut String,
    index: usize,
    s: &PoolSeries,
    markers: &[&TraceEntry],
    t_start: u64,
    t_end: u64,
) {
    let max = s
        .points
        .iter()
        .map(|p| p.1.max(p.2).max(p.3))
        .max()
        .unwrap_or(0)
        .max(1);
    let step = byte_step(max, 5);
    let frame = Frame {
        t0: t_start as f64,
        t1: t_end as f64,
        y_max: (max + step - 1) / step * step,
    };
    open_chart(out, index, s, &frame);
    byte_grid(out, &frame, step);
    time_grid(out, &frame);
    marker_lines(out, &frame, markers);
    curves(out, &frame, s, t_start, t_end);
    out.push_str("</svg></div>\n");
}

/// The chart's container (with the points for the page's tooltip), the SVG element and the
/// plot area's frame.
fn open_chart(out: &mut String, index: usize, s: &PoolSeries, frame: &Frame) {
    let (t0, t1) = (frame.t0, frame.t1);
    let points: Vec<String> = s
        .points
        .iter()
        .map(|p| format!("[{},{},{},{}]", p.0, p.1, p.2, p.3))
        .collect();
    let _ = writeln!(
        out,
        "<div class=\"chart\" id=\"chart{index}\" data-x0=\"{LEFT}\" data-x1=\"{}\" data-t0=\"{t0}\" \
         data-t1=\"{t1}\" data-points=\"[{}]\"><div class=\"tip\"></div>",
        WIDTH - RIGHT,
        points.join(",")
    );
    let _ = writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" \
         width=\"{WIDTH}\" height=\"{HEIGHT}\" font-family=\"sans-serif\" font-size=\"11\">"
    );
    let _ = writeln!(
        out,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{}\" height=\"{}\" fill=\"#fafafa\" stroke=\"#999\"/>",
        WIDTH - LEFT - RIGHT,
        HEIGHT - TOP - BOTTOM
    );
}

/// Horizontal grid lines every `step` bytes, with their labels.
fn byte_grid(out: &mut String, frame: &Frame, step: i64) {
    let mut v = 0;
    while v <= frame.y_max {
        let yy = frame.y(v);
        let _ = writeln!(
            out,
            "<line x1=\"{LEFT}\" y1=\"{yy:.1}\" x2=\"{}\" y2=\"{yy:.1}\" stroke=\"#e3e3e3\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            WIDTH - RIGHT,
            LEFT - 6.0,
            yy + 4.0,
            format_bytes(v)
        );
        v += step;
    }
}

/// Vertical grid lines with time labels (milliseconds), and the time axis' title.
fn time_grid(out: &mut String, frame: &Frame) {
    let (t0, t1) = (frame.t0, frame.t1);
    let ts = time_step(t1 - t0);
    let mut t = (t0 / ts).ceil() * ts;
    while t <= t1 {
        let xx = LEFT + (t - t0) / (t1 - t0) * (WIDTH - LEFT - RIGHT);
        let _ = writeln!(
            out,
            "<line x1=\"{xx:.1}\" y1=\"{TOP}\" x2=\"{xx:.1}\" y2=\"{}\" stroke=\"#eeeeee\"/>\
             <text x=\"{xx:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            HEIGHT - BOTTOM,
            HEIGHT - BOTTOM + 14.0,
            trim_ms(t / 1000.0)
        );
        t += ts;
    }
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">time (ms since the allocator started)</text>",
        LEFT + (WIDTH - LEFT - RIGHT) / 2.0,
        HEIGHT - 4.0
    );
}

/// A dashed vertical line and a label for each marker (out-of-memory, capture, snapshot,
/// annotation).
fn marker_lines(out: &mut String, frame: &Frame, markers: &[&TraceEntry]) {
    for m in markers {
        let (color, label) = match m.action {
            TraceAction::Oom => ("#d62728", "OOM".to_string()),
            TraceAction::CaptureBegin => ("#7f7f7f", "capture begins".to_string()),
            TraceAction::CaptureEnd => ("#7f7f7f", "capture ends".to_string()),
            TraceAction::Snapshot => ("#8c564b", "snapshot".to_string()),
            _ => (
                "#9467bd",
                m.name.as_deref().unwrap_or("annotation").to_string(),
            ),
        };
        let xx = frame.x(m.time_us);
        let _ = writeln!(
            out,
            "<line x1=\"{xx:.1}\" y1=\"{TOP}\" x2=\"{xx:.1}\" y2=\"{}\" stroke=\"{color}\" \
             stroke-dasharray=\"4 3\"/><text x=\"{:.1}\" y=\"{}\" fill=\"{color}\">{}</text>",
            HEIGHT - BOTTOM,
            xx + 3.0,
            TOP - 6.0,
            escape(&label)
        );
    }
}

/// The curves: steps, drawn waiting first so that reserved stays on top; bytes in use also
/// as a shaded area under their curve.
fn curves(out: &mut String, frame: &Frame, s: &PoolSeries, t_start: u64, t_end: u64) {
    let (x, y) = (|t| frame.x(t), |v| frame.y(v));
    for (color, pick) in [
        (WAITING_COLOR, 3usize),
        (IN_USE_COLOR, 2usize),
        (RESERVED_COLOR, 1usize),
    ] {
        let mut d = String::new();
        let mut prev: Option<f64> = None;
        for p in &s.points {
            let val = match pick {
                1 => p.1,
                2 => p.2,
                _ => p.3,
            };
            let (xx, yy) = (x(p.0), y(val));
            match prev {
                None => {
                    let _ = write!(d, "{:.1},{:.1} {xx:.1},{:.1} ", x(t_start), y(0), y(0));
                }
                Some(py) => {
                    let _ = write!(d, "{xx:.1},{py:.1} ");
                }
            }
            let _ = write!(d, "{xx:.1},{yy:.1} ");
            prev = Some(yy);
        }
        if let Some(py) = prev {
            let _ = write!(d, "{:.1},{py:.1}", x(t_end));
        }
        if pick == 2 && prev.is_some() {
            let _ = writeln!(
                out,
                "<polygon fill=\"{color}\" fill-opacity=\"0.15\" stroke=\"none\" \
                 points=\"{d} {:.1},{:.1} {:.1},{:.1}\"/>",
                x(t_end),
                y(0),
                x(t_start),
                y(0)
            );
        }
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2.5\" \
             shape-rendering=\"crispEdges\" points=\"{d}\"/>"
        );
    }
}

fn trim_ms(ms: f64) -> String {
    let s = format!("{ms:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}
