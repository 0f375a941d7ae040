//! SVG plots for the run report, drawn with plotters' SVG backend into strings.
//!
//! Plot functions return the `<svg>` text, or a message saying why nothing could be drawn;
//! the report shows the message in place of the plot. Non-finite values are skipped (lines are
//! broken at them), and a single step still gives a visible point.

use plotters::coord::Shift;
use plotters::prelude::*;

/// Width of every plot, in pixels.
pub const WIDTH: u32 = 960;
/// Height of one panel of a line plot, in pixels.
pub const PANEL_HEIGHT: u32 = 320;
/// The most heatmap columns drawn; longer runs group consecutive steps.
pub const MAX_HEATMAP_COLUMNS: usize = 150;
/// The number of reward bins of the heatmap.
pub const HEATMAP_BINS: usize = 24;

/// Colors of successive series (matplotlib's tab10).
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

const FONT: &str = "sans-serif";
const GRID: RGBColor = RGBColor(232, 232, 232);

/// One line of a plot: `(step, value)` points, in step order.
#[derive(Debug, Clone)]
pub struct Series {
    /// Name shown in the legend.
    pub label: String,
    /// The points; non-finite values are skipped.
    pub points: Vec<(f64, f64)>,
    /// Line color.
    pub color: RGBColor,
}

/// One panel of a line plot.
#[derive(Debug, Clone, Default)]
pub struct Panel {
    /// Title drawn above the panel (empty: none).
    pub title: String,
    /// Label of the y axis.
    pub y_desc: String,
    /// The lines.
    pub series: Vec<Series>,
    /// A shaded band `(step, low, high)` drawn under the first series' color.
    pub band: Vec<(f64, f64, f64)>,
    /// Label of the x axis; empty: `step` (integer ticks).
    pub x_desc: String,
}

/// `#rrggbb` of a color, for HTML legends.
pub fn hex(c: RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)
}

/// A compact tick label: integers as such, 3 significant digits otherwise, scientific notation
/// for very large or small magnitudes.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        "0".into()
    } else if !(1e-3..1e5).contains(&a) {
        format!("{v:.1e}")
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        let decimals = (2 - a.log10().floor() as i32).clamp(0, 6) as usize;
        let s = format!("{v:.decimals$}");
        let s = if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s };
        if s == "-0" {
            "0".into()
        } else {
            s
        }
    }
}

/// A step-axis tick label: blank between integer steps.
fn fmt_step(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{:.0}", v.round())
    } else {
        String::new()
    }
}

/// A plot that could not be drawn: plotters' message (its error types are generic over the
/// drawing backend), or why the data cannot be plotted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PlotError(pub String);

impl PlotError {
    fn no_finite_values() -> Self {
        Self("no finite values".into())
    }
}

fn err(e: impl std::fmt::Display) -> PlotError {
    PlotError(e.to_string())
}

/// `(min, max)` of the finite values, padded so that the range is never empty.
fn padded_range(values: impl Iterator<Item = f64>, pad_frac: f64) -> Option<(f64, f64)> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return None;
    }
    let pad = if hi > lo {
        (hi - lo) * pad_frac
    } else if lo == 0.0 {
        0.1
    } else {
        lo.abs() * 0.1
    };
    Some((lo - pad, hi + pad))
}

/// The step range of the points, at least one step wide.
fn step_range(xs: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    match (lo, hi) {
        (lo, hi) if lo > hi => None,
        (lo, hi) if lo == hi => Some((lo - 1.0, hi + 1.0)),
        r => Some(r),
    }
}

/// Splits points into runs of finite values (a line is broken at each `NaN`).
fn finite_runs<T: Copy>(points: &[T], finite: impl Fn(&T) -> bool) -> Vec<Vec<T>> {
    let mut runs = vec![Vec::new()];
    for p in points {
        if finite(p) {
            if let Some(r) = runs.last_mut() {
                r.push(*p);
            }
        } else if runs.last().is_some_and(|r| !r.is_empty()) {
            runs.push(Vec::new());
        }
    }
    runs.retain(|r| !r.is_empty());
    runs
}

/// Draws one line panel onto `area`.
fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel) -> Result<(), PlotError> {
    let xs = p.series.iter().flat_map(|s| s.points.iter().filter(|q| q.1.is_finite()).map(|q| q.0));
    let (x0, x1) = if p.x_desc.is_empty() {
        step_range(xs).ok_or_else(PlotError::no_finite_values)?
    } else {
        padded_range(xs, 0.05).ok_or_else(PlotError::no_finite_values)?
    };
    let ys = p.series.iter().flat_map(|s| s.points.iter().map(|q| q.1));
    let band_ys = p.band.iter().flat_map(|b| [b.1, b.2]);
    let (y0, y1) = padded_range(ys.chain(band_ys), 0.05).ok_or_else(PlotError::no_finite_values)?;
    let mut builder = ChartBuilder::on(area);
    builder.margin(12).x_label_area_size(36).y_label_area_size(72);
    if !p.title.is_empty() {
        builder.caption(&p.title, (FONT, 17));
    }
    let mut chart = builder.build_cartesian_2d(x0..x1, y0..y1).map_err(err)?;
    chart
        .configure_mesh()
        .light_line_style(GRID)
        .bold_line_style(GRID)
        .x_desc(if p.x_desc.is_empty() { "step" } else { p.x_desc.as_str() })
        .y_desc(&p.y_desc)
        .x_label_formatter(&|v| if p.x_desc.is_empty() { fmt_step(v) } else { fmt_num(*v) })
        .y_label_formatter(&|v| fmt_num(*v))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .draw()
        .map_err(err)?;
    if let Some(first) = p.series.first() {
        let fill = first.color.mix(0.2).filled();
        for run in finite_runs(&p.band, |b| b.1.is_finite() && b.2.is_finite()) {
            let mut poly: Vec<(f64, f64)> = run.iter().map(|b| (b.0, b.2)).collect();
            poly.extend(run.iter().rev().map(|b| (b.0, b.1)));
            if run.len() == 1 {
                let b = run[0];
                let w = (x1 - x0) * 0.004;
                chart.draw_series([Rectangle::new([(b.0 - w, b.1), (b.0 + w, b.2)], fill)]).map_err(err)?;
            } else {
                chart.draw_series([Polygon::new(poly, fill)]).map_err(err)?;
            }
        }
    }
    for s in &p.series {
        let style = s.color.stroke_width(2);
        let finite: Vec<(f64, f64)> = s.points.iter().copied().filter(|q| q.1.is_finite()).collect();
        for run in finite_runs(&s.points, |q| q.1.is_finite()) {
            chart.draw_series(LineSeries::new(run, style)).map_err(err)?;
        }
        if finite.len() <= 40 {
            chart.draw_series(finite.iter().map(|&q| Circle::new(q, 3, s.color.filled()))).map_err(err)?;
        }
    }
    Ok(())
}

/// An SVG of `panels` stacked vertically, [`PANEL_HEIGHT`] each.
pub fn line_svg(panels: &[Panel]) -> Result<String, PlotError> {
    let mut buf = String::new();
    {
        let height = PANEL_HEIGHT * panels.len().max(1) as u32;
        let root = SVGBackend::with_string(&mut buf, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let areas = root.split_evenly((panels.len().max(1), 1));
        for (area, panel) in areas.iter().zip(panels) {
            draw_panel(area, panel)?;
        }
        root.present().map_err(err)?;
    }
    Ok(buf)
}

/// A viridis-like colormap: `t` in `[0, 1]` from dark purple to yellow.
pub fn viridis(t: f64) -> RGBColor {
    const STOPS: [(f64, f64, f64); 5] = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let t = if t.is_finite() { t.clamp(0.0, 1.0) } else { 0.0 } * (STOPS.len() - 1) as f64;
    let i = (t.floor() as usize).min(STOPS.len() - 2);
    let f = t - i as f64;
    let (a, b) = (STOPS[i], STOPS[i + 1]);
    let lerp = |x: f64, y: f64| (x + (y - x) * f).round() as u8;
    RGBColor(lerp(a.0, b.0), lerp(a.1, b.1), lerp(a.2, b.2))
}

/// Counts of a distribution over time: one column per (group of) step(s), one row per bin.
#[derive(Debug, Clone, PartialEq)]
pub struct HeatmapGrid {
    /// `(left, right)` step extent of each column.
    pub columns: Vec<(f64, f64)>,
    /// Bin edges, `bins + 1` of them.
    pub edges: Vec<f64>,
    /// `counts[column][bin]`.
    pub counts: Vec<Vec<u32>>,
}

/// Bins the finite values of each step's distribution; `None` if there are none.
pub fn heatmap_grid(dists: &[(f64, Vec<f64>)], bins: usize, max_columns: usize) -> Option<HeatmapGrid> {
    let (lo, hi) = padded_range(dists.iter().flat_map(|d| d.1.iter().copied()), 0.0)?;
    let bins = bins.max(1);
    let width = (hi - lo) / bins as f64;
    let edges: Vec<f64> = (0..=bins).map(|i| lo + width * i as f64).collect();
    let group = dists.len().div_ceil(max_columns.max(1)).max(1);
    let steps: Vec<f64> = dists.iter().map(|d| d.0).collect();
    let half = |i: usize, dir: isize| -> f64 {
        let j = i as isize + dir;
        match steps.get(j as usize).filter(|_| j >= 0) {
            Some(&s) => (s - steps[i]).abs() / 2.0,
            None => steps.get((i as isize - dir) as usize).map_or(0.5, |&s| (s - steps[i]).abs() / 2.0),
        }
    };
    let mut columns = Vec::new();
    let mut counts = Vec::new();
    for chunk_start in (0..dists.len()).step_by(group) {
        let chunk_end = (chunk_start + group).min(dists.len()) - 1;
        let left = steps[chunk_start] - half(chunk_start, -1).max(1e-9);
        let right = steps[chunk_end] + half(chunk_end, 1).max(1e-9);
        let mut col = vec![0u32; bins];
        for v in dists[chunk_start..=chunk_end].iter().flat_map(|d| &d.1).filter(|v| v.is_finite()) {
            let b = (((v - lo) / width).floor() as usize).min(bins - 1);
            col[b] += 1;
        }
        columns.push((left, right));
        counts.push(col);
    }
    Some(HeatmapGrid { columns, edges, counts })
}

/// An SVG heatmap of a distribution over steps, with a color bar.
pub fn heatmap_svg(dists: &[(f64, Vec<f64>)], y_desc: &str) -> Result<String, PlotError> {
    let grid =
        heatmap_grid(dists, HEATMAP_BINS, MAX_HEATMAP_COLUMNS).ok_or_else(PlotError::no_finite_values)?;
    let max_count = grid.counts.iter().flatten().copied().max().unwrap_or(1).max(1);
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, (WIDTH, PANEL_HEIGHT + 40)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (main, bar) = root.split_horizontally(WIDTH - 110);
        let x0 = grid.columns.first().map_or(0.0, |c| c.0);
        let x1 = grid.columns.last().map_or(1.0, |c| c.1);
        let (y0, y1) = (grid.edges[0], grid.edges[grid.edges.len() - 1]);
        let mut chart = ChartBuilder::on(&main)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(72)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("step")
            .y_desc(y_desc)
            .x_label_formatter(&fmt_step)
            .y_label_formatter(&|v| fmt_num(*v))
            .label_style((FONT, 13))
            .axis_desc_style((FONT, 14))
            .draw()
            .map_err(err)?;
        let cells = grid.columns.iter().zip(&grid.counts).flat_map(|(&(l, r), col)| {
            let edges = &grid.edges;
            col.iter().enumerate().filter(|(_, &c)| c > 0).map(move |(b, &c)| {
                let color = viridis(c as f64 / max_count as f64);
                Rectangle::new([(l, edges[b]), (r, edges[b + 1])], color.filled())
            })
        });
        chart.draw_series(cells).map_err(err)?;
        draw_color_bar(&bar, max_count)?;
        root.present().map_err(err)?;
    }
    Ok(buf)
}

/// A vertical color bar from 0 to `max_count`.
fn draw_color_bar<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    max_count: u32,
) -> Result<(), PlotError> {
    let top = max_count as f64;
    let mut chart = ChartBuilder::on(area)
        .margin_top(12)
        .margin_bottom(48)
        .margin_right(40)
        .y_label_area_size(0)
        .right_y_label_area_size(40)
        .caption("count", (FONT, 13))
        .build_cartesian_2d(0.0..1.0, 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_labels(5)
        .y_label_formatter(&|v| fmt_num(*v))
        .label_style((FONT, 12))
        .draw()
        .map_err(err)?;
    let n = 32;
    let steps = (0..n).map(|i| {
        let (a, b) = (top * i as f64 / n as f64, top * (i + 1) as f64 / n as f64);
        Rectangle::new([(0.0, a), (1.0, b)], viridis((i as f64 + 0.5) / n as f64).filled())
    });
    chart.draw_series(steps).map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_formatting() {
        assert_eq!(fmt_num(0.0), "0");
        assert_eq!(fmt_num(3.0), "3");
        assert_eq!(fmt_num(0.123456), "0.123");
        assert_eq!(fmt_num(-2.5), "-2.5");
        assert_eq!(fmt_num(12.345), "12.3");
        assert_eq!(fmt_num(1e-5), "1.0e-5");
        assert_eq!(fmt_step(&2.0), "2");
        assert_eq!(fmt_step(&2.5), "");
    }

    #[test]
    fn runs_break_at_nan() {
        let pts = [(0.0, 1.0), (1.0, f64::NAN), (2.0, 2.0), (3.0, 3.0), (4.0, f64::NAN)];
        let runs = finite_runs(&pts, |p| p.1.is_finite());
        assert_eq!(runs, vec![vec![(0.0, 1.0)], vec![(2.0, 2.0), (3.0, 3.0)]]);
    }

    #[test]
    fn heatmap_bins_every_finite_value_and_groups_columns() {
        let dists: Vec<(f64, Vec<f64>)> =
            (0..10).map(|s| (s as f64, vec![0.0, 1.0, s as f64, f64::NAN])).collect();
        let g = heatmap_grid(&dists, 5, 4).unwrap();
        assert_eq!(g.columns.len(), 4); // groups of 3 steps
        assert_eq!(g.edges.len(), 6);
        let total: u32 = g.counts.iter().flatten().sum();
        assert_eq!(total, 30);
        assert_eq!(g.columns[0].0, -0.5);
        assert_eq!(g.columns[3].1, 9.5);
        let single = heatmap_grid(&[(5.0, vec![2.0, 2.0])], 5, 4).unwrap();
        assert_eq!(single.counts[0].iter().sum::<u32>(), 2);
        assert_eq!(single.columns, vec![(4.5, 5.5)]);
        assert!(heatmap_grid(&[(0.0, vec![f64::NAN])], 5, 4).is_none());
    }

    #[test]
    fn plots_draw_a_single_step_and_refuse_all_nan() {
        let one = Series { label: "a".into(), points: vec![(0.0, 1.0)], color: PALETTE[0] };
        let svg = line_svg(&[Panel { series: vec![one], band: vec![(0.0, 0.5, 1.5)], ..Default::default() }])
            .unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("<circle"), "{svg}");
        let nan = Series { label: "a".into(), points: vec![(0.0, f64::NAN)], color: PALETTE[0] };
        assert!(line_svg(&[Panel { series: vec![nan], ..Default::default() }]).is_err());
        assert!(heatmap_svg(&[(0.0, vec![1.0, 2.0])], "reward").unwrap().contains("<rect"));
    }
}
