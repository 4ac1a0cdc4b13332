//! A picture of the allocator's history: one self-contained HTML page.
//!
//! Owns the rendering of a [`History`] into HTML: per pool, a chart of reserved, in-use and
//! waiting bytes over time (inline SVG, drawn here, with a few lines of inline script for a
//! hover read-out), markers for annotations, captures and out-of-memory failures, and a table
//! of the largest allocations with their call sites. The page loads nothing: no network, no
//! external assets; it opens in any browser.
//!
//! The curves are rebuilt from the entries: `SegmentAlloc`/`SegmentFree` and
//! `SegmentMap`/`SegmentUnmap` move reserved bytes, `Alloc`/`FreeRequested` move bytes in
//! use, `FreeRequested`/`FreeCompleted` move bytes waiting on events (blocks kept for graph
//! replays stay in "waiting"). When the history
//! began after memory was already held, or the ring dropped its oldest entries, a curve is
//! raised so that it never goes below zero; the page says so.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), pinpool::Error> {
//! use pinpool::HistoryContext;
//!
//! let allocator = pinpool::PinnedAllocator::builder().build()?;
//! allocator.record_history(true, 1000, HistoryContext::Alloc)?;
//! drop(allocator.alloc(1 << 20).await?);
//! let page = pinpool::report::render_history_html(&allocator.history().await?, "my server");
//! assert!(page.starts_with("<!DOCTYPE html>") && page.contains("my server"));
//! # Ok(()) }
//! ```

mod svg;

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::actors::{History, PoolId, TraceAction, TraceEntry};

pub(crate) use svg::format_bytes;

/// Plot colours (also checked by the screenshot test).
const RESERVED_COLOR: &str = "#1f77b4";
/// Colour of bytes in use.
const IN_USE_COLOR: &str = "#2ca02c";
/// Colour of bytes waiting on events.
const WAITING_COLOR: &str = "#ff7f0e";

/// Rows of the largest-allocations table.
const LARGEST_ROWS: usize = 20;
/// Lines of a call site shown in the table.
const CONTEXT_LINES: usize = 40;

/// One pool's curves: `(time_us, reserved, in_use, waiting)` after each change.
#[derive(Debug, Clone, Default, PartialEq)]
struct PoolSeries {
    /// The pool.
    pool: PoolId,
    /// The points, in time order.
    points: Vec<(u64, i64, i64, i64)>,
    /// How much each curve was raised so that it never goes below zero
    /// (reserved, in use, waiting).
    raised: (i64, i64, i64),
}

/// Rebuilds each pool's reserved / in-use / waiting bytes over time from `history`.
fn series(history: &History) -> Vec<PoolSeries> {
    let mut by_pool: BTreeMap<PoolId, Vec<&TraceEntry>> = BTreeMap::new();
    for e in &history.entries {
        let moves = matches!(
            e.action,
            TraceAction::Alloc
                | TraceAction::FreeRequested
                | TraceAction::FreeCompleted
                | TraceAction::SegmentAlloc
                | TraceAction::SegmentFree
                | TraceAction::SegmentMap
                | TraceAction::SegmentUnmap
        );
        if moves {
            by_pool.entry(e.pool).or_default().push(e);
        }
    }
    by_pool
        .into_iter()
        .map(|(pool, mut entries)| {
            entries.sort_by_key(|e| e.time_us);
            let (mut r, mut u, mut w) = (0i64, 0i64, 0i64);
            let (mut min_r, mut min_u, mut min_w) = (0i64, 0i64, 0i64);
            let mut points: Vec<(u64, i64, i64, i64)> = Vec::with_capacity(entries.len());
            for e in entries {
                let size = e.size as i64;
                match e.action {
                    TraceAction::SegmentAlloc | TraceAction::SegmentMap => r += size,
                    TraceAction::SegmentFree | TraceAction::SegmentUnmap => r -= size,
                    TraceAction::Alloc => u += size,
                    TraceAction::FreeRequested => {
                        u -= size;
                        w += size;
                    }
                    TraceAction::FreeCompleted => w -= size,
                    _ => {}
                }
                min_r = min_r.min(r);
                min_u = min_u.min(u);
                min_w = min_w.min(w);
                match points.last_mut() {
                    Some(last) if last.0 == e.time_us => *last = (e.time_us, r, u, w),
                    _ => points.push((e.time_us, r, u, w)),
                }
            }
            let raised = (-min_r, -min_u, -min_w);
            for p in &mut points {
                p.1 += raised.0;
                p.2 += raised.1;
                p.3 += raised.2;
            }
            PoolSeries {
                pool,
                points,
                raised,
            }
        })
        .collect()
}

/// Renders `history` as a self-contained HTML page titled `title`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), pinpool::Error> {
/// use pinpool::{HistoryContext, PinnedAllocator};
///
/// let allocator = PinnedAllocator::builder().build()?;
/// allocator.record_history(true, 10_000, HistoryContext::None)?;
/// drop(allocator.alloc(4096).await?);
/// let page = pinpool::report::render_history_html(&allocator.history().await?, "my run");
/// assert!(page.starts_with("<!DOCTYPE html>"));
/// assert!(page.contains("<svg"));
/// # Ok(()) }
/// ```
pub fn render_history_html(history: &History, title: &str) -> String {
    let all = series(history);
    let t_end = history
        .entries
        .iter()
        .map(|e| e.time_us)
        .max()
        .unwrap_or(0)
        .max(1);
    let t_start = history
        .entries
        .iter()
        .map(|e| e.time_us)
        .min()
        .unwrap_or(0)
        .min(t_end - 1);
    let mut out = String::with_capacity(64 * 1024);
    let title = escape(title);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>pinpool history: {title}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n\
         <h1>pinpool history: {title}</h1>\n"
    );
    summary(&mut out, history);
    out.push_str(&format!(
        "<p class=\"legend\"><span style=\"background:{RESERVED_COLOR}\"></span>reserved \
         <span style=\"background:{IN_USE_COLOR}\"></span>in use \
         <span style=\"background:{WAITING_COLOR}\"></span>waiting on events (or kept for graph replays) \
         <span class=\"mark ann\"></span>annotation <span class=\"mark cap\"></span>capture \
         <span class=\"mark oom\"></span>out of memory</p>\n"
    ));
    if all.is_empty() {
        out.push_str("<p class=\"empty\">No allocations were recorded.</p>\n");
    }
    for (i, s) in all.iter().enumerate() {
        let markers: Vec<&TraceEntry> = history
            .entries
            .iter()
            .filter(|e| match e.action {
                TraceAction::UserDefined | TraceAction::Snapshot => true,
                TraceAction::Oom | TraceAction::CaptureBegin | TraceAction::CaptureEnd => {
                    e.pool == s.pool
                }
                _ => false,
            })
            .collect();
        let pool = if s.pool.is_default() {
            "default pool".to_string()
        } else {
            format!("capture pool {}", s.pool)
        };
        let _ = writeln!(out, "<h2>{}</h2>", escape(&pool));
        if s.raised != (0, 0, 0) {
            let _ = writeln!(
                out,
                "<p class=\"note\">Recording began after this pool already held memory (or the \
                 ring dropped its oldest entries): curves raised by {} reserved, {} in use, \
                 {} waiting.</p>",
                format_bytes(s.raised.0),
                format_bytes(s.raised.1),
                format_bytes(s.raised.2)
            );
        }
        svg::chart(&mut out, i, s, &markers, t_start, t_end);
    }
    largest(&mut out, history);
    let _ = write!(out, "<script>{SCRIPT}</script>\n</body>\n</html>\n");
    out
}

fn summary(out: &mut String, history: &History) {
    let mut counts: BTreeMap<TraceAction, usize> = BTreeMap::new();
    for e in &history.entries {
        *counts.entry(e.action).or_default() += 1;
    }
    let _ = write!(
        out,
        "<p class=\"summary\">{} entries (ring of {}; {} pushed out, {} lost); recording {}. ",
        history.entries.len(),
        history.max_entries,
        history.overwritten,
        history.lost,
        if history.enabled { "on" } else { "off" }
    );
    let parts: Vec<String> = counts.iter().map(|(a, n)| format!("{a}: {n}")).collect();
    let _ = writeln!(out, "{}</p>", escape(&parts.join(", ")));
}

fn largest(out: &mut String, history: &History) {
    let mut allocs: Vec<(usize, &TraceEntry)> = history
        .entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.action == TraceAction::Alloc)
        .collect();
    allocs.sort_by(|a, b| b.1.size.cmp(&a.1.size).then(a.1.time_us.cmp(&b.1.time_us)));
    allocs.truncate(LARGEST_ROWS);
    out.push_str("<h2>Largest allocations</h2>\n");
    if allocs.is_empty() {
        out.push_str("<p class=\"empty\">None recorded.</p>\n");
        return;
    }
    out.push_str(
        "<table><thead><tr><th>#</th><th>time (ms)</th><th>pool</th><th>address</th>\
         <th>block</th><th>requested</th><th>freed at (ms)</th><th>call site</th></tr></thead><tbody>\n",
    );
    for (rank, (i, e)) in allocs.iter().enumerate() {
        let freed = history.entries[i + 1..]
            .iter()
            .find(|f| f.action == TraceAction::FreeRequested && f.addr == e.addr)
            .map(|f| format!("{:.3}", f.time_us as f64 / 1000.0))
            .unwrap_or_else(|| "in use".to_string());
        let site = match &e.context {
            Some(bt) => {
                let text = bt.to_string();
                let lines: Vec<&str> = text.lines().take(CONTEXT_LINES).collect();
                format!(
                    "<details><summary>backtrace</summary><pre>{}</pre></details>",
                    escape(&lines.join("\n"))
                )
            }
            None => "&mdash;".to_string(),
        };
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td>{:.3}</td><td>{}</td><td><code>{:#x}</code></td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td></tr>",
            rank + 1,
            e.time_us as f64 / 1000.0,
            e.pool,
            e.addr,
            format_bytes(e.size as i64),
            format_bytes(e.requested as i64),
            freed,
            site
        );
    }
    out.push_str("</tbody></table>\n");
}

/// Escapes text for HTML.
pub(crate) fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

const STYLE: &str = "
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.legend span { display: inline-block; width: 14px; height: 10px; margin: 0 4px 0 12px; }
.legend .mark { width: 3px; height: 12px; }
.mark.ann { background: #9467bd; } .mark.cap { background: #7f7f7f; } .mark.oom { background: #d62728; }
.note, .empty { color: #666; font-style: italic; }
.chart { position: relative; }
.chart .tip { position: absolute; pointer-events: none; background: rgba(255,255,255,.92);
  border: 1px solid #aaa; padding: 4px 6px; font-size: 12px; display: none; white-space: pre; }
table { border-collapse: collapse; margin-top: 8px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; vertical-align: top; }
td:last-child { text-align: left; }
pre { text-align: left; font-size: 11px; max-width: 800px; overflow-x: auto; }
";

const SCRIPT: &str = r#"
(function () {
  function fmt(b) {
    var u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'], i = 0;
    while (Math.abs(b) >= 1024 && i < u.length - 1) { b /= 1024; i++; }
    return (i ? b.toFixed(2) : b) + ' ' + u[i];
  }
  document.querySelectorAll('.chart').forEach(function (div) {
    var data = JSON.parse(div.getAttribute('data-points'));
    var svg = div.querySelector('svg'), tip = div.querySelector('.tip');
    var x0 = +div.getAttribute('data-x0'), x1 = +div.getAttribute('data-x1');
    var t0 = +div.getAttribute('data-t0'), t1 = +div.getAttribute('data-t1');
    svg.addEventListener('mousemove', function (ev) {
      var r = svg.getBoundingClientRect();
      var x = (ev.clientX - r.left) * (svg.viewBox.baseVal.width / r.width);
      if (x < x0 || x > x1 || !data.length) { tip.style.display = 'none'; return; }
      var t = t0 + (x - x0) / (x1 - x0) * (t1 - t0), p = data[0];
      for (var i = 0; i < data.length && data[i][0] <= t; i++) p = data[i];
      tip.textContent = (t / 1000).toFixed(3) + ' ms\nreserved ' + fmt(p[1]) +
        '\nin use ' + fmt(p[2]) + '\nwaiting ' + fmt(p[3]);
      tip.style.left = (ev.clientX - r.left + 12) + 'px';
      tip.style.top = (ev.clientY - r.top + 12) + 'px';
      tip.style.display = 'block';
    });
    svg.addEventListener('mouseleave', function () { tip.style.display = 'none'; });
  });
})();
"#;

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::actors::HistoryContext;

    use super::series;
    use crate::sim::SimRuntime;
    use crate::tuning::TieredPowerOfTwo;
    use crate::{Builder, PinnedAllocator};

    #[test]
    fn an_empty_history_has_no_curves() {
        assert!(series(&crate::actors::History::default()).is_empty());
    }

    /// A small workload with misses, cached reuse, event waits, an annotation and an empty cache.
    async fn workload(pool: &PinnedAllocator, sim: &SimRuntime) {
        pool.record_history(true, 10_000, HistoryContext::Alloc)
            .unwrap();
        let stream = sim.stream();
        let mut held = Vec::new();
        for i in 0..12usize {
            held.push(pool.alloc((i + 1) << 16).await.unwrap());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        pool.record_annotation("half freed");
        let hold = stream.hold();
        for mut b in held.drain(..6) {
            b.record_stream(&stream).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
        hold.release();
        stream.synchronize().unwrap();
        tokio::time::sleep(Duration::from_millis(3)).await;
        drop(held);
        tokio::time::sleep(Duration::from_millis(2)).await;
        pool.empty_cache().await.unwrap();
    }

    #[tokio::test]
    #[cfg_attr(
        miri,
        ignore = "runs an allocator's actors on a tokio runtime: not the unsafe code"
    )]
    async fn the_curves_follow_the_allocations() {
        let sim = SimRuntime::new();
        let pool = Builder::new(Arc::new(sim.clone()))
            .policy(Arc::new(TieredPowerOfTwo::default()))
            .build()
            .unwrap();
        workload(&pool, &sim).await;
        let h = pool.history().await.unwrap();
        let s = series(&h);
        assert_eq!(s.len(), 1, "one pool");
        let peak_reserved = s[0].points.iter().map(|p| p.1).max().unwrap();
        let peak_in_use = s[0].points.iter().map(|p| p.2).max().unwrap();
        let peak_waiting = s[0].points.iter().map(|p| p.3).max().unwrap();
        let want: i64 = (1..=12usize)
            .map(|i| (i << 16usize).next_power_of_two() as i64)
            .sum();
        assert_eq!(peak_reserved, want);
        assert_eq!(peak_in_use, want);
        assert!(peak_waiting > 0, "some frees waited on events");
        let last = s[0].points.last().unwrap();
        assert_eq!((last.1, last.2, last.3), (0, 0, 0), "all given back");
        assert_eq!(s[0].raised, (0, 0, 0));
    }
}
