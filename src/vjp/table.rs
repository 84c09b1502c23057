//! How cases and values are printed: a tensor as the tables show it (`[1, 2]`, `[2, 1]:[1, 2]`),
//! the per-rank table of `distgrad vjp`, and the plain-text table of `vjp`, `run` and
//! `gradcheck`.

use std::fmt::Write as _;

use super::{Case, CaseOutput, TensorJson, parse_collective};
use crate::collective::Kind;

/// A tensor as the tables print it: `[1, 2]`, or `[2, 1]:[1, 2]` beyond one dimension.
pub fn fmt_t(t: &TensorJson) -> String {
    let vals: Vec<String> = t
        .data
        .iter()
        .map(|x| match x {
            Some(v) => fmt_value(*v),
            None => "nan".into(),
        })
        .collect();
    if t.shape.is_empty() && vals.len() == 1 {
        vals[0].clone()
    } else if t.shape.len() == 1 {
        format!("[{}]", vals.join(", "))
    } else {
        format!("{:?}:[{}]", t.shape, vals.join(", "))
    }
}

/// A value as the tables print it: shortest round-trip decimal, in exponent form where that is
/// shorter to read (|v| ≥ 1e7 or < 1e-4), `inf` / `-inf` for infinities.
fn fmt_value(v: f32) -> String {
    let a = v.abs();
    if a.is_finite() && a != 0.0 && !(1e-4..1e7).contains(&a) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

fn fmt_list(l: &[TensorJson]) -> String {
    if l.is_empty() {
        "-".into()
    } else {
        l.iter().map(fmt_t).collect::<Vec<_>>().join(" ")
    }
}

/// The per-rank table `distgrad vjp` prints.
pub fn render_table(case: &Case, out: &CaseOutput) -> String {
    let mut s = String::new();
    let mut head = format!("forward: {}", case.collective);
    // The defaults a case may leave out are shown too, where the collective takes them.
    let which = parse_collective(&case.collective).ok();
    match &case.op {
        Some(op) => {
            let _ = write!(head, " op={op}");
        }
        None if which.is_some_and(Kind::takes_op) => head.push_str(" op=sum"),
        None => {}
    }
    match case.root {
        Some(r) => {
            let _ = write!(head, " root={r}");
        }
        None if which.is_some_and(Kind::takes_root) => head.push_str(" root=0"),
        None => {}
    }
    if let Some(p) = &case.perm {
        let _ = write!(head, " perm={p:?}");
    }
    if let Some(g) = &case.group {
        let _ = write!(head, " group={g:?}");
    }
    let _ = writeln!(s, "{head}   world={}", case.world);
    let _ = writeln!(s, "backward (dual): {}", out.dual);
    let cots: Vec<String> = (0..case.world)
        .map(|g| match &case.cotangents {
            Some(c) => fmt_list(&c[g]),
            None => out.outputs[g]
                .iter()
                .map(|o| {
                    fmt_t(&TensorJson {
                        shape: o.shape.clone(),
                        data: vec![Some(1.0); o.data.len()],
                    })
                })
                .collect::<Vec<_>>()
                .join(" "),
        })
        .collect();
    let rows: Vec<[String; 5]> = (0..case.world)
        .map(|g| {
            [
                g.to_string(),
                fmt_list(&case.inputs[g]),
                fmt_list(&out.outputs[g]),
                if cots[g].is_empty() {
                    "-".into()
                } else {
                    cots[g].clone()
                },
                fmt_list(&out.grads[g]),
            ]
        })
        .collect();
    let header = ["rank", "inputs", "outputs", "cotangents", "grads"];
    s.push_str(&text_table(&header, &rows));
    s
}

/// A plain-text table: columns padded to their widest cell, `|` between them, a `-+-` rule under
/// the header, trailing spaces trimmed (the tables of `vjp`, `run` and `gradcheck`).
pub fn text_table<R: AsRef<[String]>>(header: &[&str], rows: &[R]) -> String {
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r.as_ref().get(c).map_or(0, |x| x.chars().count()))
                .chain([header[c].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        cells
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join(" | ")
            .trim_end()
            .to_string()
    };
    let mut s = line(&mut header.iter().copied());
    s.push('\n');
    s.push_str(
        &widths
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .join("-+-"),
    );
    s.push('\n');
    for r in rows {
        s.push_str(&line(&mut r.as_ref().iter().map(String::as_str)));
        s.push('\n');
    }
    s
}
