//! Drawings: the ranks on a circle with a step's messages as arrows, and the loss plot.

use crate::lesson::{self, Phase, Trace};

use super::dom::esc;

const FWD: &str = "#1f6feb";
const BWD: &str = "#d4580a";

/// The ranks on a circle, with the messages of `step` as arrows and each rank's first value.
pub(super) fn diagram(
    world: usize,
    me: Option<usize>,
    present: &[bool],
    step: Option<&lesson::Step>,
) -> String {
    let (w, h, cx, cy) = (480.0f64, 380.0f64, 240.0f64, 190.0f64);
    let radius = if world <= 1 { 0.0 } else { 112.0 };
    let angle = |r: usize| {
        -std::f64::consts::FRAC_PI_2 + std::f64::consts::TAU * r as f64 / world.max(1) as f64
    };
    let pos = |r: usize| {
        let a = angle(r);
        (cx + radius * a.cos(), cy + radius * a.sin())
    };
    // Values sit outside the circle of ranks, away from the arrows.
    let label_pos = |r: usize| {
        let (x, y) = pos(r);
        // Above the nodes of the upper half, below the others.
        let y = if world > 1 && angle(r).sin() < -0.3 {
            y - 40.0
        } else {
            y + 48.0
        };
        (x.clamp(75.0, w - 75.0), y)
    };
    let mut s = format!(
        "<svg viewBox=\"0 0 {w} {h}\" role=\"img\" aria-label=\"{world} ranks{}\">\
         <defs><marker id=\"head-f\" viewBox=\"0 0 10 10\" refX=\"9\" refY=\"5\" markerWidth=\"7\" markerHeight=\"7\" orient=\"auto\"><path d=\"M0,0 L10,5 L0,10 z\" fill=\"{FWD}\"/></marker>\
         <marker id=\"head-b\" viewBox=\"0 0 10 10\" refX=\"9\" refY=\"5\" markerWidth=\"7\" markerHeight=\"7\" orient=\"auto\"><path d=\"M0,0 L10,5 L0,10 z\" fill=\"{BWD}\"/></marker></defs>",
        step.map_or(String::new(), |st| format!(": {}", esc(&st.label)))
    );
    if let Some(st) = step {
        let (class, head) = match st.phase {
            Phase::Backward => ("arrow bwd", "head-b"),
            _ => ("arrow fwd", "head-f"),
        };
        for &(a, b) in &st.arrows {
            if a >= world || b >= world {
                continue;
            }
            let ((x1, y1), (x2, y2)) = (pos(a), pos(b));
            let (dx, dy) = (x2 - x1, y2 - y1);
            let len = (dx * dx + dy * dy).sqrt().max(1.0);
            let (ux, uy) = (dx / len, dy / len);
            // Offset sideways so a→b and b→a are both visible.
            let (ox, oy) = (-uy * 6.0, ux * 6.0);
            s.push_str(&format!(
                "<line class=\"{class}\" x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" marker-end=\"url(#{head})\"/>",
                x1 + ux * 34.0 + ox,
                y1 + uy * 34.0 + oy,
                x2 - ux * 38.0 + ox,
                y2 - uy * 38.0 + oy
            ));
        }
    }
    for r in 0..world {
        let (x, y) = pos(r);
        let mut class = String::from("node");
        if me == Some(r) {
            class.push_str(" me");
        }
        if !present.get(r).copied().unwrap_or(true) {
            class.push_str(" absent");
        }
        let value = step
            .and_then(|st| st.ranks.get(r))
            .and_then(|vals| vals.first())
            .map(|n| {
                // A text (a check's verdict and why) shows its first word, the verdict, beside
                // the rank; the table has the rest.
                if let Some(t) = &n.text {
                    return t.split_whitespace().next().unwrap_or_default().to_string();
                }
                // Short enough that side-by-side labels do not run into each other (from 4
                // ranks, ranks sit beside each other); the table has the whole value.
                let v = format!("{} = {}", n.name, n.show());
                let most = match world {
                    0..=3 => 34,
                    4..=5 => 24,
                    _ => 15,
                };
                if v.chars().count() > most {
                    format!("{}…", v.chars().take(most - 1).collect::<String>())
                } else {
                    v
                }
            })
            .unwrap_or_default();
        let (lx, ly) = label_pos(r);
        s.push_str(&format!(
            "<g class=\"{class}\"><circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"30\"/>\
             <text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">rank {r}</text>{}\
             <text class=\"val\" x=\"{lx:.1}\" y=\"{ly:.1}\" text-anchor=\"middle\">{}</text></g>",
            if me == Some(r) { y } else { y + 5.0 },
            if me == Some(r) {
                format!("<text class=\"you\" x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">you</text>", y + 15.0)
            } else {
                String::new()
            },
            esc(&value)
        ));
    }
    s.push_str("</svg>");
    s
}

/// Loss per rank (thin) and of the group (thick) up to the shown step (a lesson that trains its
/// program), and one device's for the whole problem trained from the same start (dashed).
pub(super) fn loss_plot(trace: &Trace, upto: usize) -> String {
    let value = |st: &lesson::Step, r: usize, name: &str| -> Option<f64> {
        st.ranks
            .get(r)?
            .iter()
            .find(|n| n.name == name)?
            .tensors
            .first()?
            .data
            .first()
            .copied()
            .flatten()
            .map(f64::from)
    };
    let steps: Vec<&lesson::Step> = trace
        .steps
        .iter()
        .filter(|s| s.phase == Phase::Train)
        .collect();
    let n = steps.len().max(1);
    let reference: &[f32] = trace
        .one_device
        .as_ref()
        .map_or(&[], |o| o.curve.as_slice());
    let max = steps
        .iter()
        .flat_map(|st| (0..trace.world).filter_map(|r| value(st, r, "loss")))
        .chain(
            reference
                .iter()
                .map(|&v| f64::from(v))
                .filter(|v| v.is_finite()),
        )
        .fold(0.0f64, f64::max)
        .max(1e-12);
    let (w, h, l, b) = (480.0, 200.0, 40.0, 170.0);
    let x = |i: usize| l + (w - l - 10.0) * i as f64 / n as f64;
    let y = |v: f64| b - (b - 10.0) * (v / max);
    // The Okabe–Ito colours (told apart with the common colour-blindnesses), the yellow last:
    // a thin yellow line on white is hard to see; the group's line is black and thick.
    let colors = [
        "#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#7f7f7f", "#f0e442",
    ];
    let mut s = format!(
        "<svg viewBox=\"0 0 {w} {h}\" role=\"img\" aria-label=\"loss per rank and of the group\">\
         <line x1=\"{l}\" y1=\"{b}\" x2=\"{}\" y2=\"{b}\" class=\"axis\"/><line x1=\"{l}\" y1=\"10\" x2=\"{l}\" y2=\"{b}\" class=\"axis\"/>\
         <text x=\"4\" y=\"16\" class=\"tick\">{max:.2}</text><text x=\"4\" y=\"{b}\" class=\"tick\">0</text>\
         <text x=\"{}\" y=\"195\" class=\"tick\" text-anchor=\"end\">step</text>",
        w - 10.0,
        w - 10.0
    );
    let shown: Vec<&&lesson::Step> = steps.iter().take(upto).collect();
    let line = |name: &str, r: usize| -> String {
        shown
            .iter()
            .enumerate()
            .filter_map(|(i, st)| {
                value(st, r, name).map(|v| format!("{:.1},{:.1}", x(i + 1), y(v)))
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    for r in 0..trace.world {
        s.push_str(&format!(
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"><title>rank {r}</title></polyline>",
            line("loss", r),
            colors[r % colors.len()]
        ));
    }
    s.push_str(&format!(
        "<polyline points=\"{}\" fill=\"none\" stroke=\"#1b1f24\" stroke-width=\"3\"><title>group</title></polyline>",
        line("group loss", 0)
    ));
    let one: Vec<String> = reference
        .iter()
        .take(shown.len())
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| format!("{:.1},{:.1}", x(i + 1), y(f64::from(v))))
        .collect();
    if !one.is_empty() {
        s.push_str(&format!(
            "<polyline class=\"one-device-curve\" points=\"{}\" fill=\"none\" stroke=\"#d55e00\" stroke-width=\"2.5\" stroke-dasharray=\"6 4\"><title>one device</title></polyline>",
            one.join(" ")
        ));
    }
    s.push_str("</svg>");
    let mut legend = String::from("<p class=\"legend\">");
    for r in 0..trace.world {
        legend.push_str(&format!(
            "<span style=\"color:{}\">━ rank {r}</span> ",
            colors[r % colors.len()]
        ));
    }
    legend.push_str("<span>▬ group (mean)</span>");
    if !reference.is_empty() {
        legend.push_str(" <span style=\"color:#d55e00\">╍ one device, the whole problem</span>");
    }
    legend.push_str("</p>");
    s + &legend
}
