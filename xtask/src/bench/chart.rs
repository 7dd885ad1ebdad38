//! chart.png: rates of each variant relative to no gate (1.0 = free), grouped by scenario.
use std::path::Path;

use anyhow::{Context as _, Result, anyhow};
use plotters::prelude::*;

use super::Report;

/// Debian's fonts-dejavu-core (`cargo xtask setup` installs it): plotters draws text with
/// ab_glyph from this file, no fontconfig needed.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn register_font() -> Result<()> {
    let bytes = std::fs::read(FONT)
        .with_context(|| format!("{FONT} (apt-get install fonts-dejavu-core)"))?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{FONT} is not a usable font"))
}

const VARIANTS: [(&str, &str, RGBColor); 3] = [
    ("gate", "metadata-gate", RGBColor(0x1f, 0x77, 0xb4)),
    ("nft", "nftables", RGBColor(0xff, 0x7f, 0x0e)),
    ("ipt", "iptables", RGBColor(0x2c, 0xa0, 0x2c)),
];

pub(super) fn draw(rep: &Report, path: &Path) -> Result<()> {
    register_font()?;
    let groups: [(&str, &str); 3] = [
        ("connect() rate", "connect_rate_ratio_"),
        ("UDP sendto() rate", "udp_rate_ratio_"),
        ("bulk TCP throughput", "bulk_ratio_"),
    ];
    let mut bars = Vec::new(); // (x0, x1, value, color index)
    for (g, (_, prefix)) in groups.iter().enumerate() {
        for (k, (key, _, _)) in VARIANTS.iter().enumerate() {
            if let Some(v) = rep.get(&format!("{prefix}{key}")) {
                let x0 = g as f64 + 0.12 + k as f64 * 0.26;
                bars.push((x0, x0 + 0.22, v, k));
            }
        }
    }
    let scale: Vec<(String, f64)> = [
        ("1", "1"),
        ("100", "100"),
        ("10k", "10k"),
        ("cg1", "1 cg"),
        ("cg100", "100 cg"),
        ("cg1000", "1000 cg"),
    ]
    .iter()
    .filter_map(|(k, l)| {
        rep.get(&format!("connect_rate_ratio_gate_{k}")).map(|v| (l.to_string(), v))
    })
    .collect();
    let all = bars.iter().map(|b| b.2).chain(scale.iter().map(|s| s.1));
    let lo = all.clone().fold(0.9f64, f64::min) - 0.05;
    let hi = all.fold(1.02f64, f64::max) + 0.08;

    let root = BitMapBackend::new(path, (1100, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(640);
    let mut chart = ChartBuilder::on(&left)
        .caption("Rate relative to no gate (1.0 = no cost)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..groups.len() as f64, lo..hi)?;
    chart.configure_mesh().disable_x_mesh().x_labels(0).y_desc("variant / none").draw()?;
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(0.0, 1.0), (groups.len() as f64, 1.0)],
        BLACK,
    )))?;
    for (k, (_, label, color)) in VARIANTS.iter().enumerate() {
        chart
            .draw_series(
                bars.iter()
                    .filter(|b| b.3 == k)
                    .map(|b| Rectangle::new([(b.0, lo), (b.1, b.2)], color.filled())),
            )?
            .label(*label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    for b in &bars {
        chart.draw_series(std::iter::once(Text::new(
            format!("{:.3}", b.2),
            (b.0, b.2 + (hi - lo) * 0.03),
            ("sans-serif", 12),
        )))?;
    }
    for (g, (name, _)) in groups.iter().enumerate() {
        chart.draw_series(std::iter::once(Text::new(
            name.to_string(),
            (g as f64 + 0.2, lo - (hi - lo) * 0.001),
            ("sans-serif", 14),
        )))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;

    let mut sc = ChartBuilder::on(&right)
        .caption("metadata-gate connect() rate by size", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..scale.len().max(1) as f64, lo..hi)?;
    sc.configure_mesh().disable_x_mesh().x_labels(0).draw()?;
    sc.draw_series(std::iter::once(PathElement::new(
        vec![(0.0, 1.0), (scale.len() as f64, 1.0)],
        BLACK,
    )))?;
    sc.draw_series(scale.iter().enumerate().map(|(i, (_, v))| {
        Rectangle::new([(i as f64 + 0.15, lo), (i as f64 + 0.85, *v)], VARIANTS[0].2.filled())
    }))?;
    for (i, (l, v)) in scale.iter().enumerate() {
        sc.draw_series(std::iter::once(Text::new(
            format!("{v:.3}"),
            (i as f64 + 0.2, v + (hi - lo) * 0.03),
            ("sans-serif", 12),
        )))?;
        sc.draw_series(std::iter::once(Text::new(
            l.clone(),
            (i as f64 + 0.2, lo - (hi - lo) * 0.001),
            ("sans-serif", 12),
        )))?;
    }
    root.present()?;
    Ok(())
}
