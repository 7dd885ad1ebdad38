//! chart.png: rates of each variant relative to no gate (1.0 = free), grouped by scenario,
//! and the gate's connect() rate by size: the median ratio as a bar, its 95 % interval as a
//! whisker.
use std::path::Path;

use anyhow::{Context as _, Result, anyhow};
use plotters::{coord::Shift, prelude::*};

use crate::Report;

/// Debian's fonts-dejavu-core (`cargo xtask setup` installs it): plotters draws text with
/// ab_glyph from this file, no fontconfig needed.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Key suffix, legend and colour of the variants drawn.
const VARIANTS: [(&str, &str, RGBColor); 3] = [
    ("gate", "metadata-gate", RGBColor(0x1f, 0x77, 0xb4)),
    ("nft", "nftables", RGBColor(0xff, 0x7f, 0x0e)),
    ("ipt", "iptables", RGBColor(0x2c, 0xa0, 0x2c)),
];

/// One bar: its left and right edge, the median, the variant (its colour), the interval.
type Bar = (f64, f64, f64, usize, (f64, f64));

pub(super) fn draw(rep: &Report, path: &Path) -> Result<()> {
    let bytes = std::fs::read(FONT)
        .with_context(|| format!("{FONT} (apt-get install fonts-dejavu-core)"))?;
    plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into()))
        .map_err(|_| anyhow!("{FONT} is not a usable font"))?;
    // A key's bar from `x0` to `x1`: the median, and the interval (the median where a report
    // has none).
    let bar = |key: &str, x0: f64, x1: f64, color: usize| -> Option<Bar> {
        let v = rep.get(key)?;
        let end = |e: &str| rep.get(&format!("{key}_{e}")).unwrap_or(v);
        Some((x0, x1, v, color, (end("lo"), end("hi"))))
    };
    let groups = [
        ("connect() rate", "connect_rate_ratio_"),
        ("UDP sendto() rate", "udp_rate_ratio_"),
        ("bulk TCP throughput", "bulk_ratio_"),
    ];
    let mut rates = Vec::new();
    for (g, (_, prefix)) in groups.iter().enumerate() {
        for (k, (key, _, _)) in VARIANTS.iter().enumerate() {
            let x0 = g as f64 + 0.12 + k as f64 * 0.26;
            rates.extend(bar(&format!("{prefix}{key}"), x0, x0 + 0.22, k));
        }
    }
    let sizes = [
        ("1", "1"),
        ("100", "100"),
        ("10k", "10k"),
        ("cg1", "1 cg"),
        ("cg100", "100 cg"),
        ("cg1000", "1000 cg"),
    ];
    let (mut scale, mut scale_labels) = (Vec::new(), Vec::new());
    for (k, label) in sizes {
        let x = scale.len() as f64;
        if let Some(b) = bar(&format!("connect_rate_ratio_gate_{k}"), x + 0.15, x + 0.85, 0) {
            scale.push(b);
            scale_labels.push((x + 0.2, label.to_owned()));
        }
    }
    let all = rates.iter().chain(&scale).flat_map(|b| [b.2, b.4.0, b.4.1]);
    let lo = all.clone().fold(0.9f64, f64::min) - 0.05;
    let hi = all.fold(1.02f64, f64::max) + 0.08;

    let root = BitMapBackend::new(path, (1100, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(640);
    let labels: Vec<_> =
        groups.iter().enumerate().map(|(g, n)| (g as f64 + 0.2, n.0.into())).collect();
    let caption = "Rate relative to no gate (1.0 = no cost)";
    panel(&left, caption, groups.len(), (lo, hi), &rates, &labels, 14, true)?;
    let caption = "metadata-gate connect() rate by size";
    panel(&right, caption, scale.len().max(1), (lo, hi), &scale, &scale_labels, 12, false)?;
    root.present()?;
    Ok(())
}

/// One panel: `bars` with their whiskers and values over `n` groups, named by `labels`
/// (`label_px` high) under the axis, a line at 1.0, and the variants' legend if `legend`.
#[allow(clippy::too_many_arguments)]
fn panel(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    caption: &str,
    n: usize,
    (lo, hi): (f64, f64),
    bars: &[Bar],
    labels: &[(f64, String)],
    label_px: u32,
    legend: bool,
) -> Result<()> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..n as f64, lo..hi)?;
    let mut mesh = chart.configure_mesh();
    mesh.disable_x_mesh().x_labels(0);
    if legend {
        mesh.y_desc("variant / none");
    }
    mesh.draw()?;
    chart.draw_series([PathElement::new(vec![(0.0, 1.0), (n as f64, 1.0)], BLACK)])?;
    for (k, (_, label, color)) in VARIANTS.iter().enumerate() {
        let series = bars.iter().filter(|b| b.3 == k);
        let drawn = chart
            .draw_series(series.map(|b| Rectangle::new([(b.0, lo), (b.1, b.2)], color.filled())))?;
        if legend {
            drawn.label(*label).legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
            });
        }
    }
    for &(x0, x1, v, _, (blo, bhi)) in bars {
        // The interval's whisker: a vertical line with caps a fifth of the bar wide.
        let (mid, cap) = ((x0 + x1) / 2.0, (x1 - x0) / 10.0);
        chart.draw_series([
            PathElement::new(vec![(mid, blo), (mid, bhi)], BLACK),
            PathElement::new(vec![(mid - cap, blo), (mid + cap, blo)], BLACK),
            PathElement::new(vec![(mid - cap, bhi), (mid + cap, bhi)], BLACK),
        ])?;
        let at = (x0 + (x1 - x0) / 10.0, bhi.max(v) + (hi - lo) * 0.03);
        chart.draw_series([Text::new(format!("{v:.3}"), at, ("sans-serif", 12))])?;
    }
    for (x, label) in labels {
        let at = (*x, lo - (hi - lo) * 0.001);
        chart.draw_series([Text::new(label.clone(), at, ("sans-serif", label_px))])?;
    }
    if legend {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}
