//! The lesson step view's markup, from the step alone (no DOM): every rank's values, and what
//! ran. The page puts it on screen (`page/lessons.rs`); the tests read it natively.

use super::markup::{Markup, Table};
use crate::lesson::{Phase, Step};

/// The step's values: a row per rank (this tab's, `me`, marked "you"), a column per value.
pub fn step_table(st: &Step, me: Option<usize>) -> Markup {
    let mut head = vec!["rank".to_string()];
    if let Some(vals) = st.ranks.first() {
        // A value's kind across the ranks (varying / invariant / unreduced), where the program
        // says, from the first rank that holds it.
        head.extend(vals.iter().enumerate().map(|(i, n)| {
            let kind = st
                .ranks
                .iter()
                .find_map(|r| r.get(i).and_then(|n| n.kind.clone()));
            match kind {
                Some(k) => format!("{} · {k}", n.name),
                None => n.name.clone(),
            }
        }));
    }
    let rows = st
        .ranks
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
