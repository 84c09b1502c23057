//! The lesson step view's markup, from the step alone (no DOM): every rank's values, and what
//! ran. The page puts it on screen (`page/lessons.rs`); the tests read it natively.

use super::markup::{Markup, Table};
use crate::lesson::{Named, OneDeviceView, Phase, Step};

/// The step's values: a row per rank (this tab's, `me`, marked "you"), a column per value.
pub fn step_table(st: &Step, me: Option<usize>) -> Markup {
    values_table(&st.ranks, me)
}

/// One device's gradients for the whole problem beside every rank's (shown with the last step):
/// what it is, then a row per rank and gradient: one device's value and each compared gradient
/// minus it, rounded to 4 significant digits (exact in `distgrad run` and the trace's JSON).
pub fn one_device_table(o: &OneDeviceView, me: Option<usize>) -> Markup {
    let mut m = Markup::new();
    m.el("p", &[("class", "one-device-label")], &o.label);
    // Each rank's values in groups: one device's gradient, then the differences from it.
    let group = |vals: &[Named]| -> Vec<Vec<Named>> {
        let mut out: Vec<Vec<Named>> = Vec::new();
        for n in vals {
            match out.last_mut() {
                Some(g) if !n.name.starts_with("one device: ") => g.push(n.clone()),
                _ => out.push(vec![n.clone()]),
            }
        }
        out
    };
    let Some(first) = o.ranks.first().map(|r| group(r)) else {
        return m;
    };
    // Gradients (`dF/dx`), or a training lesson's parameters after its last step.
    let what = if first.iter().all(|g| g[0].name.starts_with("one device: d")) {
        "gradient"
    } else {
        "parameter"
    };
    let mut head = vec!["rank".to_string(), what.into(), "one device".into()];
    if let Some(g) = first.first() {
        head.extend(g[1..].iter().map(|n| match n.name.split_once(": ") {
            Some((who, _)) => who.to_string(),
            None => n.name.clone(),
        }));
    }
    let mut rows = Vec::new();
    for (r, vals) in o.ranks.iter().enumerate() {
        let you = me == Some(r);
        for g in group(vals) {
            let mut cells = vec![g[0].name.trim_start_matches("one device: ").to_string()];
            cells.extend(g.iter().map(short));
            rows.push((
                you.then(|| "me".to_string()),
                if you {
                    format!("{r} (you)")
                } else {
                    r.to_string()
                },
                cells,
            ));
        }
    }
    m.markup(
        &Table {
            class: "values".into(),
            head,
            rows,
            code: true,
        }
        .markup(),
    );
    m
}

/// A value with 4 significant digits (`-1.9e-6`, `8.831`), as the one-device table shows it.
fn short(n: &Named) -> String {
    if n.tensors.is_empty() {
        return n.show();
    }
    let num = |v: &Option<f32>| match v {
        None => "nan".to_string(),
        Some(x) if *x == 0.0 => "0".into(),
        Some(x) if x.abs() < 1e-3 || x.abs() >= 1e6 => format!("{x:.1e}"),
        Some(x) => {
            let digits = (3 - x.abs().log10().floor() as i32).clamp(0, 6) as usize;
            let t = format!("{x:.digits$}");
            let t = if t.contains('.') {
                t.trim_end_matches('0').trim_end_matches('.').to_string()
            } else {
                t
            };
            if t == "-0" { "0".into() } else { t }
        }
    };
    n.tensors
        .iter()
        .map(|t| {
            let v: Vec<String> = t.data.iter().map(num).collect();
            match t.shape.len() {
                0 => v.join(", "),
                1 => format!("[{}]", v.join(", ")),
                _ => format!(
                    "[{}]:[{}]",
                    t.shape
                        .iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                    v.join(", ")
                ),
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A row per rank (this tab's, `me`, marked "you"), a column per value named as the first rank
/// names it.
fn values_table(ranks: &[Vec<Named>], me: Option<usize>) -> Markup {
    let mut head = vec!["rank".to_string()];
    if let Some(vals) = ranks.first() {
        // A value's kind across the ranks (varying / invariant / unreduced), where the program
        // says, from the first rank that holds it.
        head.extend(vals.iter().enumerate().map(|(i, n)| {
            let kind = ranks
                .iter()
                .find_map(|r| r.get(i).and_then(|n| n.kind.clone()));
            match kind {
                Some(k) => format!("{} · {k}", n.name),
                None => n.name.clone(),
            }
        }));
    }
    let rows = ranks
        .iter()
        .enumerate()
        .map(|(r, vals)| {
            let you = me == Some(r);
            (
                you.then(|| "me".to_string()),
                if you {
                    format!("{r} (you)")
                } else {
                    r.to_string()
                },
                vals.iter().map(|n| n.show()).collect(),
            )
        })
        .collect();
    Table {
        class: "values".into(),
        head,
        rows,
        code: true,
    }
    .markup()
}

/// What ran at this step, and for a lesson that trains (`trains`) whether every replica is the
/// same (their hashes).
pub fn step_note(st: &Step, trains: bool) -> Markup {
    let mut m = Markup::new();
    if let Some(c) = &st.collective {
        m.text(match st.phase {
            Phase::Backward => "backward ran: ",
            _ => "forward ran: ",
        });
        m.el("strong", &[], c);
    }
    if trains {
        let hashes: Vec<String> = st
            .ranks
            .iter()
            .filter_map(|vals| {
                vals.iter()
                    .find(|n| n.name == "replica hash")
                    .and_then(|n| n.text.clone())
            })
            .collect();
        let same = hashes.windows(2).all(|w| w[0] == w[1]);
        // A sharded layer has no replicas: nothing to compare.
        if hashes.is_empty() {
            return m;
        }
        m.text(&format!(
            " replica hashes: {} — {}",
            hashes.join(", "),
            if same {
                "all replicas identical ✓"
            } else {
                "REPLICAS DIFFER ✗"
            }
        ));
    }
    m
}
