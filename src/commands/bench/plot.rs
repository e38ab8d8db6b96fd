//! The two pictures of `memsave bench`: memory and time per configuration (bars), and live
//! bytes across one step of each configuration (the timeline). PNG, drawn with plotters; the
//! font is DejaVu Sans, compiled in, so that no system font is needed.

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::report::{mib, BenchReport};

const FONT: &str = "sans-serif";
const COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bytes are a valid TrueType font: registering cannot fail.
        let _ = register_font_bytes();
    });
}

fn register_font_bytes() -> Result<(), String> {
    plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the DejaVu font did not load".to_string())
}

fn failed(path: &Path, error: impl std::fmt::Display) -> memsave::Error {
    memsave::Error::Data(format!(
        "{}: could not draw the chart: {error}",
        path.display()
    ))
}

/// Bars of peak memory and of step time per configuration; beside them, `theirs`'.
pub fn bars(path: &Path, ours: &BenchReport, theirs: Option<&BenchReport>) -> memsave::Result<()> {
    register_font();
    let root = BitMapBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(path, e))?;
    let title = format!(
        "{}, {} x {}x{} per step",
        ours.model, ours.batch, ours.image_size[1], ours.image_size[0]
    );
    let root = root
        .titled(&title, (FONT, 22))
        .map_err(|e| failed(path, e))?;
    let (left, right) = root.split_horizontally(600);
    let peak = |r: &BenchReport, name: &str| r.config(name).map(|c| mib(c.peak_bytes));
    let time = |r: &BenchReport, name: &str| r.config(name).map(|c| c.median_iter_s);
    panel(
        &left,
        "peak memory above the step's start (MiB)",
        ours,
        theirs,
        &peak,
    )
    .map_err(|e| failed(path, e))?;
    panel(&right, "median time per step (s)", ours, theirs, &time).map_err(|e| failed(path, e))?;
    root.present().map_err(|e| failed(path, e))
}

type Value<'a> = &'a dyn Fn(&BenchReport, &str) -> Option<f64>;

fn panel(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    caption: &str,
    ours: &BenchReport,
    theirs: Option<&BenchReport>,
    value: Value<'_>,
) -> Result<(), Box<dyn std::error::Error>> {
    let names: Vec<String> = ours.configs.iter().map(|c| c.name.clone()).collect();
    let reports: Vec<&BenchReport> = std::iter::once(ours).chain(theirs).collect();
    let top = reports
        .iter()
        .flat_map(|r| names.iter().filter_map(|n| value(r, n)))
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.3;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 18))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..names.len() as f64 - 0.5, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(names.len())
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                names.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .label_style((FONT, 14))
        .draw()?;
    let width = 0.8 / reports.len() as f64;
    for (k, report) in reports.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let bars = names.iter().enumerate().filter_map(|(i, name)| {
            let v = value(report, name)?;
            let x0 = i as f64 - 0.4 + k as f64 * width;
            Some(Rectangle::new(
                [(x0, 0.0), (x0 + width * 0.95, v)],
                color.filled(),
            ))
        });
        chart
            .draw_series(bars)?
            .label(report.who())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        let labels = names.iter().enumerate().filter_map(|(i, name)| {
            let v = value(report, name)?;
            let x0 = i as f64 - 0.4 + k as f64 * width;
            Some(Text::new(
                format!("{v:.2}"),
                (x0, v + top * 0.01),
                (FONT, 11),
            ))
        });
        chart.draw_series(labels)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()?;
    Ok(())
}

/// Live bytes above the step's start across one step, a line per configuration; `theirs`
/// below, on the same scale, when it has timelines.
pub fn timeline(
    path: &Path,
    ours: &BenchReport,
    theirs: Option<&BenchReport>,
) -> memsave::Result<()> {
    register_font();
    let reports: Vec<&BenchReport> = std::iter::once(ours)
        .chain(theirs.filter(|t| t.configs.iter().any(|c| !c.timeline.is_empty())))
        .collect();
    let height = 480 * reports.len() as u32;
    let root = BitMapBackend::new(path, (1200, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(path, e))?;
    let top = reports
        .iter()
        .flat_map(|r| r.configs.iter())
        .flat_map(|c| c.timeline.iter().map(|&(_, b)| mib(b)))
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.1;
    let areas = root.split_evenly((reports.len(), 1));
    for (area, report) in areas.iter().zip(&reports) {
        timeline_panel(area, report, top).map_err(|e| failed(path, e))?;
    }
    root.present().map_err(|e| failed(path, e))
}

fn timeline_panel(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    report: &BenchReport,
    top: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    let end = report
        .configs
        .iter()
        .flat_map(|c| c.timeline.last().map(|&(t, _)| t))
        .fold(0.0f64, f64::max)
        .max(1e-6);
    let caption = format!(
        "{}: live bytes above the step's start across one step ({}x{}, {} per step)",
        report.who(),
        report.image_size[1],
        report.image_size[0],
        report.batch
    );
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end * 1.02, 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc("seconds into the step")
        .y_desc("MiB")
        .label_style((FONT, 14))
        .draw()?;
    for (k, config) in report.configs.iter().enumerate() {
        if config.timeline.is_empty() {
            continue;
        }
        let color = COLORS[k % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                config.timeline.iter().map(|&(t, b)| (t, mib(b))),
                color.stroke_width(2),
            ))?
            .label(config.name.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()?;
    Ok(())
}
