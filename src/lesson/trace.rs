//! What a lesson shows: its [`Trace`], a list of steps, each with the messages drawn as arrows
//! between ranks and every rank's values at that step; each rank makes its [`RankTrace`], the
//! group's is their [`assemble`]; [`render`] prints it as `distgrad run` does.

use serde::{Deserialize, Serialize};

use super::Lesson;
use super::algorithm::{CallAcross, collate};
use crate::collective::events::CallRecord;
use crate::error::{Error, Result};
use crate::vjp::{self, TensorJson};

/// A named value a rank holds at a step: tensors, or a text (a hash).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Named {
    /// Name as shown (`x`, `y`, `dL/dx`, ...).
    pub name: String,
    /// Values (empty when `text` is set or the rank has none).
    #[serde(default)]
    pub tensors: Vec<TensorJson>,
    /// A text value instead of tensors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// What the value is across the ranks, where the program says (`varying`, `invariant`,
    /// `unreduced`: [`crate::program::ValueKind`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

impl Named {
    pub(super) fn tensors(name: &str, tensors: Vec<TensorJson>) -> Self {
        Named {
            name: name.into(),
            tensors,
            text: None,
            kind: None,
        }
    }

    /// The same value labelled with its kind across the ranks.
    pub(super) fn kind(mut self, kind: Option<crate::program::ValueKind>) -> Self {
        self.kind = kind.map(|k| k.label().to_string());
        self
    }

    pub(super) fn text(name: &str, text: String) -> Self {
        Named {
            name: name.into(),
            tensors: Vec::new(),
            text: Some(text),
            kind: None,
        }
    }

    /// The value as the page and the terminal print it.
    pub fn show(&self) -> String {
        match &self.text {
            Some(t) => t.clone(),
            None if self.tensors.is_empty() => "-".into(),
            None => self
                .tensors
                .iter()
                .map(vjp::fmt_t)
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

/// The stage a step belongs to (colours the arrows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Starting values.
    Input,
    /// Forward pass.
    Forward,
    /// Cotangents seeded.
    Cotangent,
    /// Backward pass.
    Backward,
    /// A training step (forward, backward, all_reduce, update).
    Train,
    /// A conclusion.
    Result,
}

/// One step of one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankStep {
    /// What happens.
    pub label: String,
    /// Stage.
    pub phase: Phase,
    /// Collective that ran at this step, as recorded by the communicator (e.g. `reduce_scatter(op=sum)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<String>,
    /// Messages as (from, to) ranks.
    pub arrows: Vec<(usize, usize)>,
    /// This rank's values.
    pub values: Vec<Named>,
    /// What this rank did in the step's collective calls, as its communicator recorded them
    /// (empty where it recorded none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<CallRecord>,
}

/// One rank's trace of a lesson.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankTrace {
    /// The rank.
    pub rank: usize,
    /// Its steps.
    pub steps: Vec<RankStep>,
}

/// One step of the whole group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// What happens.
    pub label: String,
    /// Stage.
    pub phase: Phase,
    /// Collective that ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<String>,
    /// Messages as (from, to) ranks.
    pub arrows: Vec<(usize, usize)>,
    /// Every rank's values, index = rank.
    pub ranks: Vec<Vec<Named>>,
    /// The step's collective calls as every rank recorded them: the algorithm view's data
    /// (empty where none were recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calls: Vec<CallAcross>,
}

/// One device's gradients for the whole problem beside the ranks' (`one_device.rs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OneDeviceView {
    /// What it shows and the largest difference, per gradient compared ("distgrad's gradients
    /// equal it exactly"), or why it could not be computed.
    pub label: String,
    /// Every rank's values (index = rank): per gradient, one device's (`one device: dF/dx`, the
    /// objective after it where the lesson has two), then each compared gradient minus it
    /// (`distgrad − one device: x`). A training lesson: each rank's parameters after the last
    /// step on one device, and distgrad's minus them.
    pub ranks: Vec<Vec<Named>>,
    /// A training lesson: the group's loss (the mean of the ranks' losses) at each training step
    /// (1, 2, ...) when one device trains the whole problem from the same start; empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub curve: Vec<f32>,
}

/// A lesson's trace: what the page shows and `distgrad run` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// Lesson name.
    pub lesson: String,
    /// Heading.
    pub title: String,
    /// Why the backward pass is what it is.
    pub why: String,
    /// World size.
    pub world: usize,
    /// The steps.
    pub steps: Vec<Step>,
    /// Every rank's gradient beside one device's for the whole problem (a training lesson: one
    /// device's training), shown with the last step; `None` in traces made before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub one_device: Option<OneDeviceView>,
}

/// Put the ranks' traces (index = rank) together; every rank must have run the same steps. A step
/// takes rank 0's label, arrows and collective (or, where rank 0 names none, the first rank's that
/// does: in a pipeline only two stages take part in a step). Without one device's view
/// ([`super::assemble`] adds it).
pub(super) fn assemble_steps(lesson: &Lesson, traces: Vec<RankTrace>) -> Result<Trace> {
    let world = traces.len();
    let first = traces
        .first()
        .ok_or_else(|| Error::Input("no rank traces".into()))?;
    let mut steps: Vec<Step> = first
        .steps
        .iter()
        .map(|s| Step {
            label: s.label.clone(),
            phase: s.phase,
            collective: s.collective.clone(),
            arrows: s.arrows.clone(),
            ranks: Vec::with_capacity(world),
            calls: Vec::new(),
        })
        .collect();
    let mut events: Vec<Vec<Vec<CallRecord>>> = vec![Vec::with_capacity(world); steps.len()];
    for (r, t) in traces.into_iter().enumerate() {
        if t.rank != r || t.steps.len() != steps.len() {
            return Err(Error::Input(format!(
                "rank {r}'s trace (rank {}, {} steps) does not match rank 0's ({} steps)",
                t.rank,
                t.steps.len(),
                steps.len()
            )));
        }
        for ((s, rs), ev) in steps.iter_mut().zip(t.steps).zip(&mut events) {
            // A step where only some ranks communicate names what the first of them recorded.
            if s.collective.is_none() {
                s.collective = rs.collective;
            }
            s.ranks.push(rs.values);
            ev.push(rs.events);
        }
    }
    for (s, ev) in steps.iter_mut().zip(events) {
        // A backward step where no rank communicated ran nothing (an identity dual), and says so.
        if s.phase == Phase::Backward && s.collective.is_none() {
            s.collective = Some("nothing".into());
        }
        if ev.iter().any(|e| !e.is_empty()) {
            s.calls = collate(s.phase, ev);
        }
    }
    Ok(Trace {
        lesson: lesson.name.clone(),
        title: lesson.title.clone(),
        why: lesson.why.clone(),
        world,
        steps,
        one_device: None,
    })
}

/// The trace as text, one block per step (what `distgrad run` prints).
pub fn render(trace: &Trace) -> String {
    let mut s = format!(
        "lesson {}: {} (world {})\nwhy: {}\n",
        trace.lesson, trace.title, trace.world, trace.why
    );
    for (i, st) in trace.steps.iter().enumerate() {
        s.push_str(&format!("\nstep {i} [{:?}] {}\n", st.phase, st.label));
        if !st.arrows.is_empty() {
            // Wrapped at about 100 columns (an all_to_all of 64 ranks has 4032 arrows).
            let mut line = String::from("  messages:");
            for (x, y) in &st.arrows {
                let a = format!(" {x}→{y}");
                if line.chars().count() + a.chars().count() > 100 {
                    s.push_str(&line);
                    s.push('\n');
                    line = " ".repeat("  messages:".len());
                }
                line.push_str(&a);
            }
            s.push_str(&line);
            s.push('\n');
        }
        for (r, vals) in st.ranks.iter().enumerate() {
            let v: Vec<String> = vals
                .iter()
                .map(|n| match &n.kind {
                    Some(k) => format!("{} ({k}) = {}", n.name, n.show()),
                    None => format!("{} = {}", n.name, n.show()),
                })
                .collect();
            s.push_str(&format!("  rank {r}: {}\n", v.join(", ")));
        }
    }
    if let Some(o) = &trace.one_device {
        s.push_str(&format!("\n{}\n", o.label));
        for (r, vals) in o.ranks.iter().enumerate() {
            let v: Vec<String> = vals
                .iter()
                .map(|n| format!("{} = {}", n.name, n.show()))
                .collect();
            s.push_str(&format!("  rank {r}: {}\n", v.join(", ")));
        }
    }
    s
}
