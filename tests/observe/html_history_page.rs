//! The history page: a self-contained HTML file showing reserved / in-use / waiting bytes
//! over time per pool and the largest allocations, rendered in headless Chromium.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pinpool::{HistoryContext, PinnedAllocator, TraceAction};
use pinpool_testkit::sim_pool;

/// The plot's colours: reserved, in use, waiting on events.
const RESERVED_COLOR: &str = "#1f77b4";
const IN_USE_COLOR: &str = "#2ca02c";
const WAITING_COLOR: &str = "#ff7f0e";

/// A small workload with misses, cached reuse, event waits, an annotation and an empty cache.
async fn workload(pool: &PinnedAllocator, sim: &pinpool::sim::SimRuntime) {
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
async fn the_page_is_self_contained_and_shows_curves_and_the_largest_allocations() {
    let (pool, sim) = sim_pool();
    workload(&pool, &sim).await;
    let page = pool.history_html().await.unwrap();
    assert!(page.starts_with("<!DOCTYPE html>"));
    for needle in [
        RESERVED_COLOR,
        IN_USE_COLOR,
        WAITING_COLOR,
        "<svg",
        "<polyline",
    ] {
        assert!(page.contains(needle), "the page shows {needle}");
    }
    assert!(page.contains("half freed"), "annotations are marked");
    assert!(page.contains("Largest allocations"));
    assert!(page.contains("768.00 KiB") || page.contains("1.00 MiB"));
    assert!(page.contains("backtrace"), "call sites are shown");
    for external in ["<link", "src=", "@import", "url(", "https://"] {
        assert!(!page.contains(external), "no external asset: {external}");
    }
    let without_ns = page.replace("http://www.w3.org/2000/svg", "");
    assert!(!without_ns.contains("http://"), "no network reference");
}

#[tokio::test]
async fn an_empty_history_renders_a_page_that_says_so() {
    let (pool, _sim) = sim_pool();
    let page = pool.history_html().await.unwrap();
    assert!(page.contains("No allocations were recorded"));
    assert!(page.contains("None recorded"));
}

#[tokio::test]
async fn text_in_annotations_is_escaped() {
    let (pool, _sim) = sim_pool();
    pool.record_history(true, 100, HistoryContext::None)
        .unwrap();
    drop(pool.alloc(64).await.unwrap());
    pool.record_annotation("<script>alert(1)</script>");
    let page = pool.history_html().await.unwrap();
    assert!(!page.contains("<script>alert"));
    assert!(page.contains("&lt;script&gt;alert(1)"));
    let h = pool.history().await.unwrap();
    assert!(h
        .entries
        .iter()
        .any(|e| e.action == TraceAction::UserDefined));
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "html-{name}-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn find_chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in ["chromium", "chromium-browser", "google-chrome"] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_renders_in_headless_chromium_with_the_plot_visible() {
    let Some(chromium) = find_chromium() else {
        eprintln!(
            "SKIPPED: chromium is not installed (apt-get install -y chromium, or set CHROMIUM=path); \
             the history page was not rendered"
        );
        return;
    };
    let (pool, sim) = sim_pool();
    workload(&pool, &sim).await;
    let dir = scratch("chromium");
    let page = dir.join("history.html");
    std::fs::write(&page, pool.history_html().await.unwrap()).unwrap();
    let png = dir.join("history.png");
    let profile = dir.join("profile");
    let mut child = Command::new(&chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1100,900",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("file://{}", page.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("chromium starts");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            panic!("chromium did not finish within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let bytes = std::fs::read(&png).unwrap_or_else(|e| {
        panic!(
            "chromium ({status}) wrote no screenshot at {}: {e}",
            png.display()
        )
    });
    eprintln!("screenshot: {} ({} bytes)", png.display(), bytes.len());
    assert!(bytes.len() > 10_000, "a non-trivial screenshot");
    let img = png::decode(&bytes);
    assert_eq!((img.width, img.height), (1100, 900));
    for (name, hex) in [
        ("reserved", RESERVED_COLOR),
        ("in use", IN_USE_COLOR),
        ("waiting", WAITING_COLOR),
    ] {
        let n = img.count_near(png::rgb(hex), 12);
        assert!(n > 200, "the {name} curve is visible: {n} pixels of {hex}");
    }
}

/// Just enough of a PNG decoder for Chromium's screenshots: 8-bit RGB or RGBA, not
/// interlaced.
mod png {
    use std::io::Read;

    pub(super) struct Image {
        pub(super) width: usize,
        pub(super) height: usize,
        channels: usize,
        pixels: Vec<u8>,
    }

    pub(super) fn rgb(hex: &str) -> [u8; 3] {
        let v = u32::from_str_radix(hex.trim_start_matches('#'), 16).unwrap();
        [(v >> 16) as u8, (v >> 8) as u8, v as u8]
    }

    impl Image {
        pub(super) fn count_near(&self, c: [u8; 3], tolerance: i32) -> usize {
            self.pixels
                .chunks(self.channels)
                .filter(|p| (0..3).all(|i| (p[i] as i32 - c[i] as i32).abs() <= tolerance))
                .count()
        }
    }

    pub(super) fn decode(bytes: &[u8]) -> Image {
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "a PNG file");
        let mut pos = 8;
        let (mut width, mut height, mut channels) = (0, 0, 0);
        let mut idat = Vec::new();
        while pos + 8 <= bytes.len() {
            let len = u32::from_be_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
            let kind = &bytes[pos + 4..pos + 8];
            let data = &bytes[pos + 8..pos + 8 + len];
            match kind {
                b"IHDR" => {
                    width = u32::from_be_bytes(data[0..4].try_into().unwrap()) as usize;
                    height = u32::from_be_bytes(data[4..8].try_into().unwrap()) as usize;
                    assert_eq!(data[8], 8, "8-bit samples");
                    channels = match data[9] {
                        2 => 3,
                        6 => 4,
                        t => panic!("colour type {t}"),
                    };
                    assert_eq!(data[12], 0, "not interlaced");
                }
                b"IDAT" => idat.extend_from_slice(data),
                b"IEND" => break,
                _ => {}
            }
            pos += 12 + len;
        }
        let mut raw = Vec::new();
        flate2::read::ZlibDecoder::new(&idat[..])
            .read_to_end(&mut raw)
            .unwrap();
        let stride = width * channels;
        let mut pixels = vec![0u8; stride * height];
        for y in 0..height {
            let filter = raw[y * (stride + 1)];
            let line = &raw[y * (stride + 1) + 1..(y + 1) * (stride + 1)];
            for x in 0..stride {
                let a = if x >= channels {
                    pixels[y * stride + x - channels]
                } else {
                    0
                };
                let b = if y > 0 {
                    pixels[(y - 1) * stride + x]
                } else {
                    0
                };
                let c = if x >= channels && y > 0 {
                    pixels[(y - 1) * stride + x - channels]
                } else {
                    0
                };
                let v = match filter {
                    0 => line[x],
                    1 => line[x].wrapping_add(a),
                    2 => line[x].wrapping_add(b),
                    3 => line[x].wrapping_add(((a as u16 + b as u16) / 2) as u8),
                    4 => line[x].wrapping_add(paeth(a, b, c)),
                    f => panic!("filter {f}"),
                };
                pixels[y * stride + x] = v;
            }
        }
        Image {
            width,
            height,
            channels,
            pixels,
        }
    }

    fn paeth(a: u8, b: u8, c: u8) -> u8 {
        let p = a as i16 + b as i16 - c as i16;
        let (pa, pb, pc) = (
            (p - a as i16).abs(),
            (p - b as i16).abs(),
            (p - c as i16).abs(),
        );
        if pa <= pb && pa <= pc {
            a
        } else if pb <= pc {
            b
        } else {
            c
        }
    }
}
