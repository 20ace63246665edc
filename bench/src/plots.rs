//! Plots of `oogc bench all` (plotters, pure Rust): each as `NAME.png` (800 × 480 px) and
//! `NAME.svg`.
//!
//! | file | what it shows |
//! |---|---|
//! | `nvme` | write and read GB/s (10⁹ B/s) of the NVMe store per engine, bars; fio's figures (huge-page buffers) as horizontal lines when fio ran |
//! | `adam` | CPU AdamW Gparam/s vs threads, beside the triad roofline (the triad's real bytes, 16 per element against the 12 it is counted at, × GB/s ÷ the step's bytes per parameter) and torch's fused AdamW |
//! | `evict` | bytes moved (GB) per step vs the GPU budget (fraction of the compute copies) for next-use (ours), LRU, FIFO and offline MIN; training and forward-only panels |
//! | `moe` | expert bytes moved host→GPU (GB) per placement policy over the replayed trace, bars |
//! | `timeline` | the last steps of a real run (1200 × 480 px): one lane per resource (compute, H2D, D2H, NVMe, optimizer), a box per span, step boundaries as vertical lines, how much of each lane's busy time overlapped compute ([`super::timeline`]) |
//!
//! Text needs a TrueType font, found at run time and never bundled: `OOGC_PLOT_FONT` (a `.ttf`
//! path), else DejaVu Sans or Liberation Sans at their usual Linux paths. Without one the plots
//! are drawn without text (axes, series and bars only) and a warning says how to fix it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use super::all::SuiteRows;
use super::timeline::{Timeline, Track};
use super::{adam, evict, moe, nvme};
use crate::error::{Context, Error, Result};

/// Width of each plot, pixels.
pub const WIDTH_PX: u32 = 800;
/// Height of each plot, pixels.
pub const HEIGHT_PX: u32 = 480;
/// Width of the step timeline, pixels (wider: a step holds hundreds of spans).
pub const TIMELINE_WIDTH_PX: u32 = 1200;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// Registers a TrueType font for plot text once; whether one is available.
pub fn font_available() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        let candidates = std::env::var_os("OOGC_PLOT_FONT").map(PathBuf::from).into_iter().chain(FONT_PATHS.iter().map(PathBuf::from));
        for path in candidates {
            let Ok(bytes) = std::fs::read(&path) else { continue };
            // plotters keeps fonts for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return true;
            }
            tracing::warn!("{} is not a usable TrueType font", path.display());
        }
        tracing::warn!(
            "no TrueType font found for plot text: plots are drawn without labels (set OOGC_PLOT_FONT=/path/to/font.ttf, \
             or install DejaVu Sans: apt-get install fonts-dejavu-core)"
        );
        false
    })
}

fn err<E: std::fmt::Display>(e: E) -> Error {
    Error::Draw { reason: e.to_string() }
}

/// Draws the series labels of `chart` at `position`: the house style of every legend here
/// (white, 80 % opaque, black border).
fn legend<'a, DB: DrawingBackend + 'a>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    position: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

/// A plotting function drawn on both backends.
type Draw<'a> = dyn Fn(&DrawingArea<SVGBackend, Shift>, bool) -> Result<()> + 'a;
type DrawPng<'a> = dyn Fn(&DrawingArea<BitMapBackend, Shift>, bool) -> Result<()> + 'a;

/// Writes `DIR/name.png` and `DIR/name.svg` with the same drawing; returns both paths.
fn both(dir: &Path, name: &str, svg: &Draw, png: &DrawPng) -> Result<Vec<PathBuf>> {
    both_sized(dir, name, (WIDTH_PX, HEIGHT_PX), svg, png)
}

/// [`both`] at `size` (width, height) pixels.
fn both_sized(dir: &Path, name: &str, size: (u32, u32), svg: &Draw, png: &DrawPng) -> Result<Vec<PathBuf>> {
    let text = font_available();
    let (p_png, p_svg) = (dir.join(format!("{name}.png")), dir.join(format!("{name}.svg")));
    {
        let root = BitMapBackend::new(&p_png, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        png(&root, text).with_context(|| format!("plot {name}.png"))?;
        root.present().map_err(|e| Error::Plot { path: p_png.clone(), reason: e.to_string() })?;
    }
    {
        let root = SVGBackend::new(&p_svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        svg(&root, text).with_context(|| format!("plot {name}.svg"))?;
        root.present().map_err(|e| Error::Plot { path: p_svg.clone(), reason: e.to_string() })?;
    }
    Ok(vec![p_png, p_svg])
}

/// Maps key points of an integer-centred f64 axis to category names ("" between them).
fn category(names: &[String], x: f64) -> String {
    let i = x.round();
    if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < names.len() {
        names[i as usize].clone()
    } else {
        String::new()
    }
}

fn max_or(xs: impl Iterator<Item = f64>, floor: f64) -> f64 {
    xs.filter(|x| x.is_finite()).fold(floor, f64::max)
}

/// (a) NVMe write/read GB/s per store engine, with fio's huge-page figures as lines.
pub fn draw_nvme<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    rows: &[nvme::NvmeBenchRow],
    text: bool,
) -> Result<()> {
    let store: Vec<&nvme::NvmeBenchRow> = rows.iter().filter(|r| r.engine.starts_with("store-")).collect();
    // fio with huge-page buffers is the local limit; with malloc'd buffers when hugetlb pages are
    // missing (`sysctl vm.nr_hugepages=64`).
    let fio = ["fio-shmhuge", "fio-malloc"]
        .into_iter()
        .find_map(|name| rows.iter().find(|r| r.engine == name && r.write_gbps.is_some()));
    let names: Vec<String> = store.iter().map(|r| r.engine.clone()).collect();
    let n = store.len().max(1);
    let top = 1.4 * max_or(rows.iter().flat_map(|r| [r.write_gbps, r.read_gbps]).flatten(), 0.1);
    let mut b = ChartBuilder::on(root);
    b.margin(15);
    if text {
        let caption = match fio {
            Some(f) => format!("NVMe store: GB/s per engine ({} as lines)", f.engine),
            None => "NVMe store: GB/s per engine (no fio figures)".to_string(),
        };
        b.caption(caption, ("sans-serif", 20)).x_label_area_size(35).y_label_area_size(55);
    }
    let mut chart = b.build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..top).map_err(err)?;
    if text {
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .disable_x_mesh()
            .x_labels(n + 1)
            .x_label_formatter(&|x| category(&names, *x))
            .y_desc("GB/s (10^9 B/s)")
            .draw()
            .map_err(err)?;
    }
    let w = store.iter().enumerate().filter_map(|(i, r)| r.write_gbps.map(|v| (i, v)));
    let s = chart
        .draw_series(w.map(|(i, v)| Rectangle::new([(i as f64 - 0.38, 0.0), (i as f64 - 0.02, v)], BLUE.filled())))
        .map_err(err)?;
    if text {
        s.label("write").legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], BLUE.filled()));
    }
    let r = store.iter().enumerate().filter_map(|(i, r)| r.read_gbps.map(|v| (i, v)));
    let s = chart
        .draw_series(r.map(|(i, v)| Rectangle::new([(i as f64 + 0.02, 0.0), (i as f64 + 0.38, v)], GREEN.filled())))
        .map_err(err)?;
    if text {
        s.label("read").legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], GREEN.filled()));
    }
    if let Some(f) = fio {
        let (w_label, r_label) = (format!("{} write", f.engine), format!("{} read", f.engine));
        for (v, color, label) in [(f.write_gbps, BLUE, w_label), (f.read_gbps, GREEN, r_label)] {
            let Some(v) = v else { continue };
            let s = chart
                .draw_series(LineSeries::new([(-0.5, v), (n as f64 - 0.5, v)], color.stroke_width(2)))
                .map_err(err)?;
            if text {
                s.label(label).legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2)));
            }
        }
    }
    if text {
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    Ok(())
}

/// (b) CPU AdamW parameters per second vs threads, against the triad roofline and torch.
pub fn draw_adam<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    rows: &[adam::AdamBenchRow],
    text: bool,
) -> Result<()> {
    let g = 1e-9;
    // The triad is counted at 12 B per element but moves 16 (write-allocate): the roofline uses the
    // bytes that really move, as the step's bytes per parameter do.
    let roof = |r: &adam::AdamBenchRow| r.triad_gbps * 16.0 / 12.0 / r.bytes_per_param.max(1.0);
    let max_t = rows.iter().map(|r| r.threads).max().unwrap_or(2).max(2) as f64;
    let top = 1.15 * max_or(rows.iter().flat_map(|r| [r.params_per_s * g, roof(r), r.torch_params_per_s * g]), 0.1);
    let mut b = ChartBuilder::on(root);
    b.margin(15);
    if text {
        b.caption("CPU AdamW: Gparam/s vs threads, against the triad roofline", ("sans-serif", 20))
            .x_label_area_size(40)
            .y_label_area_size(55);
    }
    let mut chart = b.build_cartesian_2d(0.5f64..(max_t + 0.5), 0f64..top).map_err(err)?;
    if text {
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .x_labels(max_t as usize + 2)
            .x_label_formatter(&|x| if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() })
            .x_desc("threads")
            .y_desc("Gparam/s")
            .draw()
            .map_err(err)?;
    }
    let series = [
        ("oogc AdamW", BLUE, rows.iter().map(|r| (r.threads as f64, r.params_per_s * g)).collect::<Vec<_>>()),
        ("triad roofline (same run)", RED, rows.iter().map(|r| (r.threads as f64, roof(r))).collect()),
        ("torch fused (peers)", BLACK, rows.iter().map(|r| (r.threads as f64, r.torch_params_per_s * g)).collect()),
    ];
    for (label, color, pts) in series {
        let s = chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2))).map_err(err)?;
        if text {
            s.label(label).legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2)));
        }
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled()))).map_err(err)?;
    }
    if text {
        legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    }
    Ok(())
}

const POLICY_COLORS: [(&str, &str, RGBColor); 4] = [
    ("next-use", "next-use (ours)", BLUE),
    ("lru", "LRU", RED),
    ("fifo", "FIFO", MAGENTA),
    ("min", "MIN (offline)", BLACK),
];

/// (c) Bytes moved per step vs the GPU budget for next-use (ours), LRU, FIFO and MIN; one
/// panel per workload present in `rows`.
pub fn draw_evict<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    rows: &[evict::EvictBenchRow],
    text: bool,
) -> Result<()> {
    let workloads: Vec<evict::Workload> = [evict::Workload::Train, evict::Workload::Forward]
        .into_iter()
        .filter(|w| rows.iter().any(|r| r.workload == *w))
        .collect();
    let panels = root.split_evenly((1, workloads.len().max(1)));
    for (panel, w) in panels.iter().zip(&workloads) {
        let rs: Vec<&evict::EvictBenchRow> = rows.iter().filter(|r| r.workload == *w).collect();
        let top = 1.1 * max_or(rs.iter().map(|r| r.bytes_moved as f64 * 1e-9), 1e-6);
        let mut b = ChartBuilder::on(panel);
        b.margin(12);
        if text {
            let title = match w {
                evict::Workload::Train => "training step: bytes moved vs GPU budget",
                evict::Workload::Forward => "forward only: bytes moved vs GPU budget",
            };
            b.caption(title, ("sans-serif", 16)).x_label_area_size(40).y_label_area_size(55);
        }
        let mut chart = b.build_cartesian_2d(0f64..1f64, 0f64..top).map_err(err)?;
        if text {
            chart
                .configure_mesh()
                .light_line_style(TRANSPARENT)
                .x_desc("GPU budget (fraction of compute copies)")
                .y_desc("GB moved per step")
                .draw()
                .map_err(err)?;
        }
        for (policy, label, color) in POLICY_COLORS {
            let mut pts: Vec<(f64, f64)> = rs
                .iter()
                .filter(|r| r.policy == policy)
                .map(|r| (r.budget_fraction, r.bytes_moved as f64 * 1e-9))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let s = chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2))).map_err(err)?;
            if text {
                s.label(label).legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2)));
            }
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled()))).map_err(err)?;
        }
        if text {
            legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
        }
    }
    Ok(())
}

/// (d) Expert bytes moved host→GPU per MoE placement policy, bars (refresh bytes stacked on top).
pub fn draw_moe<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    rows: &[moe::MoeBenchRow],
    text: bool,
) -> Result<()> {
    let names: Vec<String> = rows.iter().map(|r| r.policy.clone()).collect();
    let n = rows.len().max(1);
    let top = 1.35 * max_or(rows.iter().map(|r| (r.expert_h2d_bytes + r.refresh_h2d_bytes) as f64 * 1e-9), 1e-6);
    let mut b = ChartBuilder::on(root);
    b.margin(15);
    if text {
        b.caption("MoE: expert bytes host→GPU per placement policy", ("sans-serif", 20))
            .x_label_area_size(35)
            .y_label_area_size(55);
    }
    let mut chart = b.build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..top).map_err(err)?;
    if text {
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .disable_x_mesh()
            .x_labels(n + 1)
            .x_label_formatter(&|x| category(&names, *x))
            .y_desc("GB over the trace")
            .draw()
            .map_err(err)?;
    }
    let bar = |i: usize, lo: f64, hi: f64, c: RGBColor| {
        Rectangle::new([(i as f64 - 0.35, lo), (i as f64 + 0.35, hi)], c.filled())
    };
    let s = chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| bar(i, 0.0, r.expert_h2d_bytes as f64 * 1e-9, BLUE)))
        .map_err(err)?;
    if text {
        s.label("expert fetches").legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], BLUE.filled()));
    }
    let s = chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            let lo = r.expert_h2d_bytes as f64 * 1e-9;
            bar(i, lo, lo + r.refresh_h2d_bytes as f64 * 1e-9, CYAN)
        }))
        .map_err(err)?;
    if text {
        s.label("refresh of resident copies")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], CYAN.filled()));
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    Ok(())
}

/// Fill colours of the timeline's spans, by what the span's name holds, with the legend's words.
const SPAN_COLORS: [(&str, &str, RGBColor); 8] = [
    ("forward", "forward", RGBColor(100, 149, 237)),
    ("backward", "backward", RGBColor(25, 55, 140)),
    ("htod", "H2D copy", RGBColor(34, 150, 34)),
    ("dtoh", "D2H copy", RGBColor(240, 120, 0)),
    ("nvme_read", "NVMe read", RGBColor(140, 80, 190)),
    ("nvme_write", "NVMe write", RGBColor(220, 90, 180)),
    ("optimizer::update", "optimizer update", RGBColor(200, 30, 30)),
    ("optimizer::speculate", "speculative update", RGBColor(245, 150, 140)),
];

fn span_color(name: &str) -> RGBColor {
    SPAN_COLORS.iter().find(|(key, ..)| name.contains(key)).map_or(RGBColor(128, 128, 128), |c| c.2)
}

/// Vertical extent of a span within its lane, relative to the lane's centre: reads and updates
/// in the upper half, writes and speculative updates in the lower, so that overlapping ones show.
fn span_band(name: &str) -> (f64, f64) {
    const H: f64 = 0.38;
    match name {
        "swapper::nvme_read" | "optimizer::update" => (0.0, H),
        "swapper::nvme_write" | "optimizer::speculate" => (-H, 0.0),
        _ => (-H, H),
    }
}

fn percent(x: Option<f64>) -> String {
    x.map_or_else(|| "idle".into(), |x| format!("{:.0}%", 100.0 * x))
}

/// Height of the timeline's legend strip, pixels.
const LEGEND_PX: u32 = 30;

/// (e) The step timeline: a lane per [`Track`] (compute on top), a box per span (at least 1.5 px
/// wide), x in ms from the start of the first shown step, step boundaries as vertical lines; NVMe
/// reads and optimizer updates in the upper half of their lane, NVMe writes and speculative
/// updates in the lower. With text: a title ([`Timeline::title`]), each step's wall time, the
/// share of each lane's busy time that overlapped compute, and a legend of the colours.
///
/// # Errors
/// Plotters failed to draw.
pub fn draw_timeline<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, tl: &Timeline, text: bool) -> Result<()> {
    let lanes = Track::ALL.len();
    let lane_y = |t: Track| (lanes - 1 - Track::ALL.iter().position(|x| *x == t).unwrap_or(0)) as f64;
    let lane_names: Vec<String> = Track::ALL.iter().rev().map(|t| t.name().to_string()).collect();
    let end_ms = tl.steps.last().map_or(0.0, |s| s.1 * 1e3).max(1e-3);
    let top = lanes as f64 - 0.5 + if text { 0.4 } else { 0.0 };
    let area = if text {
        let (area, strip) = root.split_vertically(root.dim_in_pixel().1.saturating_sub(LEGEND_PX));
        draw_timeline_legend(&strip, tl)?;
        area
    } else {
        root.clone()
    };
    let mut b = ChartBuilder::on(&area);
    b.margin(12);
    if text {
        let caption = if tl.title.is_empty() {
            format!("Step timeline: the last {} steps", tl.steps.len())
        } else {
            format!("Step timeline: {} (the last {} steps)", tl.title, tl.steps.len())
        };
        b.caption(caption, ("sans-serif", 20)).x_label_area_size(40).y_label_area_size(80);
    }
    let mut chart = b.build_cartesian_2d(0f64..end_ms, -0.5f64..top).map_err(err)?;
    if text {
        let s = tl.summary();
        let desc = format!(
            "ms from the start of the first shown step;  busy time overlapping compute: H2D {}, D2H {}, NVMe {}, \
             optimizer {}",
            percent(s.h2d_overlap_compute),
            percent(s.d2h_overlap_compute),
            percent(s.nvme_overlap_compute),
            percent(s.optimizer_overlap_compute)
        );
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .disable_y_mesh()
            .x_labels(12)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_labels(4 * lanes + 2)
            .y_label_formatter(&|y| category(&lane_names, *y))
            .x_desc(desc)
            .draw()
            .map_err(err)?;
    }
    // Lane backgrounds, then the spans.
    let lane_bg = RGBColor(240, 240, 240);
    chart
        .draw_series(Track::ALL.iter().map(|&t| {
            let y = lane_y(t);
            Rectangle::new([(0.0, y - 0.45), (end_ms, y + 0.45)], lane_bg.filled())
        }))
        .map_err(err)?;
    // A span narrower than 1.5 px (a 40 µs speculative update) is drawn 1.5 px wide, so it shows.
    let min_ms = 1.5 * end_ms / chart.plotting_area().dim_in_pixel().0.max(1) as f64;
    chart
        .draw_series(tl.spans.iter().map(|s| {
            let (y, (lo, hi)) = (lane_y(s.track), span_band(&s.name));
            let (x0, x1) = (s.start_s * 1e3, (s.end_s * 1e3).max(s.start_s * 1e3 + min_ms));
            Rectangle::new([(x0, y + lo), (x1, y + hi)], span_color(&s.name).filled())
        }))
        .map_err(err)?;
    // Step boundaries.
    let mut bounds: Vec<f64> = tl.steps.iter().map(|s| s.0 * 1e3).collect();
    bounds.extend(tl.steps.last().map(|s| s.1 * 1e3));
    for x in bounds {
        chart.draw_series(LineSeries::new([(x, -0.5), (x, top)], BLACK.stroke_width(2))).map_err(err)?;
    }
    if text {
        let labels = tl.steps.iter().enumerate().map(|(i, &(lo, hi))| {
            let at = (lo * 1e3 + 0.005 * end_ms, top - 0.04);
            Text::new(format!("step {}: {:.0} ms", i + 1, (hi - lo) * 1e3), at, ("sans-serif", 14))
        });
        chart.draw_series(labels).map_err(err)?;
    }
    Ok(())
}

/// The timeline's legend, one line of colour boxes and words (only the kinds of span present).
fn draw_timeline_legend<DB: DrawingBackend>(strip: &DrawingArea<DB, Shift>, tl: &Timeline) -> Result<()> {
    let style = ("sans-serif", 14).into_text_style(strip);
    let mut x = 90i32;
    let y = (LEGEND_PX / 2) as i32;
    for (key, words, color) in SPAN_COLORS {
        if !tl.spans.iter().any(|s| s.name.contains(key)) {
            continue;
        }
        strip.draw(&Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled())).map_err(err)?;
        strip.draw(&Text::new(words, (x + 19, y - 7), style.clone())).map_err(err)?;
        let (w, _) = strip.estimate_text_size(words, &style).map_err(err)?;
        x += 19 + w as i32 + 22;
    }
    Ok(())
}

/// Writes `dir/timeline.png` and `dir/timeline.svg` ([`TIMELINE_WIDTH_PX`] × [`HEIGHT_PX`]) of
/// `tl`; returns both paths.
///
/// # Errors
/// A file cannot be written (the directory is missing or read-only), or plotters failed to draw.
pub fn write_timeline(dir: &Path, tl: &Timeline) -> Result<Vec<PathBuf>> {
    let size = (TIMELINE_WIDTH_PX, HEIGHT_PX);
    both_sized(dir, "timeline", size, &|a, t| draw_timeline(a, tl, t), &|a, t| draw_timeline(a, tl, t))
}

/// Writes every plot whose rows are present to `dir`; returns the files (PNG and SVG).
///
/// # Errors
/// A file cannot be written (the directory is missing or read-only), or plotters failed to draw.
pub fn write_all(dir: &Path, rows: &SuiteRows) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    if !rows.nvme.is_empty() {
        let r = &rows.nvme;
        out.extend(both(dir, "nvme", &|a, t| draw_nvme(a, r, t), &|a, t| draw_nvme(a, r, t))?);
    }
    if !rows.adam.is_empty() {
        let r = &rows.adam;
        out.extend(both(dir, "adam", &|a, t| draw_adam(a, r, t), &|a, t| draw_adam(a, r, t))?);
    }
    if !rows.evict.is_empty() {
        let r = &rows.evict;
        out.extend(both(dir, "evict", &|a, t| draw_evict(a, r, t), &|a, t| draw_evict(a, r, t))?);
    }
    if !rows.moe.is_empty() {
        let r = &rows.moe;
        out.extend(both(dir, "moe", &|a, t| draw_moe(a, r, t), &|a, t| draw_moe(a, r, t))?);
    }
    if !rows.moe_trace.is_empty() {
        let r = &rows.moe_trace;
        out.extend(both(dir, "moe-trace", &|a, t| draw_moe(a, r, t), &|a, t| draw_moe(a, r, t))?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use oogc_moe_placement::{synthetic_trace, SyntheticConfig};

    use super::*;
    use crate::timeline::TrackSpan;

    fn small_timeline() -> Timeline {
        let span = |track, start_s, end_s, name: &str| TrackSpan {
            track,
            start_s,
            end_s,
            name: name.into(),
            label: name.into(),
        };
        Timeline {
            title: "tiny, sim link 0.05 GB/s".into(),
            steps: vec![(0.0, 0.5), (0.5, 1.0)],
            spans: vec![
                span(Track::Compute, 0.0, 0.1, "compute::forward"),
                span(Track::Compute, 0.1, 0.3, "compute::backward"),
                span(Track::H2D, 0.05, 0.4, "swapper::htod"),
                span(Track::D2H, 0.2, 0.35, "swapper::dtoh"),
                span(Track::NVMe, 0.3, 0.45, "swapper::nvme_read"),
                span(Track::NVMe, 0.32, 0.5, "swapper::nvme_write"),
                span(Track::Optimizer, 0.25, 0.45, "optimizer::update"),
                span(Track::Optimizer, 0.3, 0.6, "optimizer::speculate"),
                span(Track::Compute, 0.5, 0.6, "compute::forward"),
            ],
        }
    }

    #[test]
    fn the_timeline_writes_png_and_svg_with_a_box_per_span() {
        let dir = tempfile::tempdir().unwrap();
        let tl = small_timeline();
        let files = write_timeline(dir.path(), &tl).unwrap();
        assert_eq!(files, vec![dir.path().join("timeline.png"), dir.path().join("timeline.svg")]);
        for f in &files {
            assert!(std::fs::metadata(f).unwrap().len() > 0, "{} is empty", f.display());
        }
        let svg = std::fs::read_to_string(&files[1]).unwrap();
        // White fill, 5 lane backgrounds and a box per span (the legend's boxes when text).
        let boxes = svg.matches("<rect").count();
        assert!(boxes > 5 + tl.spans.len(), "{boxes} rectangles:\n{svg}");
        if font_available() {
            for words in ["Step timeline", "NVMe", "optimizer", "step 2: 500 ms", "H2D 71%", "speculative update"] {
                assert!(svg.contains(words), "`{words}` missing:\n{svg}");
            }
        }
    }

    /// Without a font the plots are drawn with no text at all: that path must not touch fonts.
    #[test]
    fn every_plot_draws_without_text() {
        let evict_args = evict::EvictBenchArgs {
            shape: oogc::plan::GptShape { layers: 2, d_model: 32, seq_len: 8, batch: 1, dtype_bytes: 2 },
            fractions: vec![0.5],
            ..evict::EvictBenchArgs::default()
        };
        let evict_rows = evict::run(&evict_args).unwrap();
        let trace = synthetic_trace(&SyntheticConfig { steps: 5, ..SyntheticConfig::default() }).unwrap();
        let moe_rows = moe::run(&trace, &moe::MoeBenchArgs::default()).unwrap();
        let nvme_rows = vec![nvme::NvmeBenchRow {
            engine: "store-psync".into(),
            write_gbps: Some(1.0),
            read_gbps: Some(2.0),
            block_bytes: 1 << 20,
            queue_depth: 32,
            bytes: 1 << 30,
            note: String::new(),
        }];
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (WIDTH_PX, HEIGHT_PX)).into_drawing_area();
            draw_nvme(&root, &nvme_rows, false).unwrap();
            draw_adam(&root, &[], false).unwrap();
            draw_evict(&root, &evict_rows, false).unwrap();
            draw_moe(&root, &moe_rows, false).unwrap();
            draw_timeline(&root, &small_timeline(), false).unwrap();
            draw_timeline(&root, &Timeline::default(), false).unwrap();
            root.present().unwrap();
        }
        assert!(svg.contains("<rect") && !svg.contains("<text"), "{svg}");
    }
}
