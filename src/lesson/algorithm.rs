//! The algorithm view's data: what every rank did in each collective call of a program's run,
//! forward and backward ([`crate::collective::events`]), put together across ranks
//! ([`Events`]: one [`CallAcross`] per call, its messages round by round), and printed
//! ([`render`], what `distgrad run --events` prints).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::Phase;
use crate::collective::events::{Action, Algorithm, CallRecord, Chunk};
use crate::collective::{CommOptions, P2p};
use crate::error::{Error, Result};
use crate::program::{Plan, trace_rank};
use crate::transport::Transport;

/// One collective call as every rank that took part recorded it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallAcross {
    /// Forward or backward (the dual of a forward call).
    pub phase: Phase,
    /// The collective with its op and root.
    pub collective: String,
    /// The algorithm its data took.
    pub algorithm: Algorithm,
    /// The group's ranks (global).
    pub members: Vec<usize>,
    /// The shape its signature names, where it names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<usize>>,
    /// Each taking part rank's record, by rank (a send's has the two ranks of its message).
    pub ranks: Vec<CallRecord>,
}

/// One message of a call, as its sender recorded it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Message {
    /// Sending rank (global).
    pub from: usize,
    /// Receiving rank (global).
    pub to: usize,
    /// Payload bytes.
    pub bytes: u64,
    /// The data it carried.
    pub chunk: Option<Chunk>,
    /// Part of the confirmation round.
    pub confirm: bool,
}

impl CallAcross {
    /// The rounds its messages took (the most any rank took; the confirmation not counted).
    pub fn rounds(&self) -> u32 {
        self.ranks.iter().map(CallRecord::rounds).max().unwrap_or(0)
    }

    /// The messages sent in `round`, in rank order (confirmation messages included, marked).
    pub fn messages(&self, round: u32) -> Vec<Message> {
        self.ranks
            .iter()
            .flat_map(|r| {
                r.of(Action::Send)
                    .filter(move |e| e.round == round)
                    .filter_map(move |e| {
                        Some(Message {
                            from: r.rank,
                            to: e.peer?,
                            bytes: e.bytes,
                            chunk: e.chunk,
                            confirm: e.confirm,
                        })
                    })
            })
            .collect()
    }

    /// The last round any message went in, the confirmation's included (`None`: no message).
    pub fn last_round(&self) -> Option<u32> {
        self.ranks
            .iter()
            .flat_map(|r| &r.events)
            .filter(|e| matches!(e.action, Action::Send | Action::Recv))
            .map(|e| e.round)
            .max()
    }
}

/// Which ranks' values a cell holds: bit `r` for global rank `r` (a world has at most 64).
pub type Contributors = u64;

/// The cell of the algorithm view a chunk is drawn in: its list entry, or its chunk number.
fn cell(c: &Chunk) -> usize {
    c.entry.map_or(c.index as usize, |e| e as usize)
}

impl CallAcross {
    /// How many cells the view draws per rank: the chunks of the algorithm's split, or the
    /// entries of the collective's list, or 1 (a whole tensor).
    pub fn cells(&self) -> usize {
        self.ranks
            .iter()
            .flat_map(|r| &r.events)
            .filter_map(|e| e.chunk)
            .map(|c| c.entry.map_or(c.of as usize, |e| e as usize + 1))
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// What every rank holds of every cell before the first round (`[0]`) and after each round
    /// (`[k + 1]`), index = position in [`CallAcross::ranks`]: the ranks whose values each cell
    /// holds. Read off the events alone: a message carries what its sender held at the start
    /// of the round; the receiver folds it in where it recorded a fold of that cell in that
    /// round, else takes it as it is. `None` for the collectives whose cells are not one
    /// tensor's chunks on every rank (all_to_all, permute, send/recv, barrier).
    pub fn holdings(&self) -> Option<Vec<Vec<Vec<Contributors>>>> {
        let kind = self.collective.split('(').next().unwrap_or("");
        let listed_by_source = matches!(kind, "gather" | "all_gather");
        if !matches!(
            kind,
            "all_reduce" | "reduce" | "reduce_scatter" | "broadcast" | "scatter"
        ) && !listed_by_source
        {
            return None;
        }
        let cells = self.cells();
        let at = |i: usize| -> Option<usize> {
            let r = self.ranks[i].rank;
            (r < 64).then_some(r)
        };
        // At the start a rank holds its own value of a cell when it folds into that cell (a
        // fold includes its own value) or sends it before receiving it (a gather's root holds
        // its own entry, a scatter's root its whole list).
        let mut state: Vec<Vec<Contributors>> = Vec::with_capacity(self.ranks.len());
        for (i, r) in self.ranks.iter().enumerate() {
            let me = 1u64 << at(i)?;
            let mut held = vec![0; cells];
            for (c, h) in held.iter_mut().enumerate() {
                let mut about = r
                    .events
                    .iter()
                    .filter(|e| !e.confirm && e.chunk.is_some_and(|k| cell(&k) == c));
                let folds = about.clone().any(|e| e.action == Action::Reduce);
                let first = about.find(|e| e.action != Action::Copy).map(|e| e.action);
                let own = match first {
                    _ if folds => true,
                    Some(Action::Send) => true,
                    _ if kind == "gather" => c == r.group_rank,
                    _ if kind == "scatter" => r.of(Action::Send).next().is_some(),
                    _ => false,
                };
                if own {
                    *h = me;
                }
            }
            state.push(held);
        }
        let index: HashMap<usize, usize> = self
            .ranks
            .iter()
            .enumerate()
            .map(|(i, r)| (r.rank, i))
            .collect();
        let mut out = vec![state.clone()];
        for round in 0..self.rounds() {
            let before = state.clone();
            for (i, r) in self.ranks.iter().enumerate() {
                let here = |a: Action| r.of(a).filter(move |e| e.round == round && !e.confirm);
                for e in here(Action::Recv) {
                    let (Some(peer), Some(chunk)) = (e.peer, e.chunk) else {
                        continue;
                    };
                    let (c, &p) = (cell(&chunk), index.get(&peer)?);
                    let got = *before.get(p)?.get(c)?;
                    let folds =
                        here(Action::Reduce).any(|f| f.chunk.is_some_and(|k| cell(&k) == c));
                    let held = state.get_mut(i)?.get_mut(c)?;
                    *held = if folds { *held | got } else { got };
                }
            }
            out.push(state.clone());
        }
        Some(out)
    }
}

/// Every call of a run, forward then backward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Events {
    /// World size.
    pub world: usize,
    /// The algorithm chosen for the collectives that have a choice (`None`: each call's
    /// default for its size and transport).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<Algorithm>,
    /// The calls, in the order the lowest taking part rank made them; forward first.
    pub calls: Vec<CallAcross>,
}

/// Which call a record belongs to across ranks: the group and call number (a point-to-point
/// message: the group, its two ranks and its number between them).
fn key(r: &CallRecord) -> (u32, Option<(usize, usize)>, u64) {
    let pair = r.events.iter().find_map(|e| match e.action {
        Action::Send => Some((r.rank, e.peer?)),
        Action::Recv => Some((e.peer?, r.rank)),
        _ => None,
    });
    let p2p = r.algorithm == Algorithm::PointToPoint;
    (r.group, pair.filter(|_| p2p), r.call)
}

/// Put the ranks' records of one phase together (`per_rank[r]`: rank r's records, in order):
/// one [`CallAcross`] per call, in the order of first appearance (rank 0's calls first).
pub fn collate(phase: Phase, per_rank: Vec<Vec<CallRecord>>) -> Vec<CallAcross> {
    let mut calls: Vec<CallAcross> = Vec::new();
    let mut index: HashMap<_, usize> = HashMap::new();
    for records in per_rank {
        for r in records {
            let k = key(&r);
            match index.get(&k) {
                Some(&i) => calls[i].ranks.push(r),
                None => {
                    index.insert(k, calls.len());
                    calls.push(CallAcross {
                        phase,
                        collective: r.collective.clone(),
                        algorithm: r.algorithm,
                        members: r.members.clone(),
                        shape: r.shape.clone(),
                        ranks: vec![r],
                    });
                }
            }
        }
    }
    calls
}

/// This rank's records of `plan` run forward and backward on `comm` (which records events:
/// [`CommOptions::record_events`]): `(forward, backward)`.
pub async fn rank_events<T: Transport>(
    comm: &P2p<T>,
    plan: &Plan,
) -> Result<(Vec<CallRecord>, Vec<CallRecord>)> {
    comm.take_events();
    let mut forward = Vec::new();
    trace_rank(comm, plan, || forward = comm.take_events(), &mut |_| {}).await?;
    Ok((forward, comm.take_events()))
}

/// Run `plan` on its world of ranks simulated in this process (interleaved on this task: the
/// page's single-tab mode and `distgrad run --events`) with `opts` (events recorded whatever
/// they say; [`CommOptions::algorithm`] where the collectives have the choice).
pub async fn run_simulated(plan: &Plan, opts: CommOptions) -> Result<Events> {
    let algorithm = opts.algorithm;
    let opts = CommOptions {
        record_events: true,
        ..opts
    };
    let results = crate::in_process::run_interleaved(plan.world(), opts, |comm| async move {
        rank_events(&comm, plan).await
    })
    .await;
    let (mut forward, mut backward) = (Vec::new(), Vec::new());
    for (r, res) in results.into_iter().enumerate() {
        let (f, b) = res.map_err(|e| Error::Input(format!("rank {r}: {e}")))?;
        forward.push(f);
        backward.push(b);
    }
    let mut calls = collate(Phase::Forward, forward);
    calls.extend(collate(Phase::Backward, backward));
    Ok(Events {
        world: plan.world(),
        algorithm,
        calls,
    })
}

/// `n` bytes as `12 B`, `3.0 KiB`, `1.5 MiB`.
pub fn bytes(n: u64) -> String {
    match n {
        n if n < 1024 => format!("{n} B"),
        n if n < 1 << 20 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{:.1} MiB", n as f64 / f64::from(1 << 20)),
    }
}

/// Append `items` to `out` after `head`, wrapped at about 100 columns (continuation lines
/// indented under the first item).
fn wrapped(out: &mut String, head: &str, items: &[String]) {
    let mut line = head.to_string();
    let indent = " ".repeat(head.chars().count());
    for (i, it) in items.iter().enumerate() {
        let sep = if i == 0 { "" } else { "   " };
        if i > 0 && line.chars().count() + sep.len() + it.chars().count() > 100 {
            out.push_str(&line);
            out.push('\n');
            line = format!("{indent}{it}");
        } else {
            line.push_str(sep);
            line.push_str(it);
        }
    }
    out.push_str(&line);
    out.push('\n');
}

/// Why a call did not take the `chosen` algorithm, where it has a choice.
fn not_taken(c: &CallAcross, chosen: Option<Algorithm>) -> Option<String> {
    let chosen = chosen?;
    let choosing = matches!(
        c.algorithm,
        Algorithm::Ring
            | Algorithm::Pairwise
            | Algorithm::Shared
            | Algorithm::Exchange
            | Algorithm::Star
    );
    if !choosing || c.algorithm == chosen {
        return None;
    }
    let (n, name) = (c.members.len(), chosen.name());
    let numel: usize = c.shape.as_ref().map_or(0, |s| s.iter().product());
    Some(if c.collective.starts_with("all_reduce") && numel < n {
        format!("the {name} needs at least one element per rank ({numel} < {n})")
    } else if c.collective.starts_with("all_reduce") {
        format!("two ranks exchange, whatever the choice ({name})")
    } else {
        format!(
            "{} has the ring and the exchange, not the {name}",
            c.collective
        )
    })
}

/// One call round by round: the messages (sender→receiver, the chunk, bytes), the local folds
/// and copies, then each rank's totals; with why it did not take the `chosen` algorithm.
fn render_call(out: &mut String, c: &CallAcross, chosen: Option<Algorithm>) {
    let shape = c
        .shape
        .as_ref()
        .map_or(String::new(), |s| format!(" {s:?}"));
    let why = not_taken(c, chosen).map_or(String::new(), |w| format!(" ({w})"));
    out.push_str(&format!(
        "  {}{shape} over ranks {:?}: {}{why}, {} round{}\n",
        c.collective,
        c.members,
        c.algorithm.name(),
        c.rounds(),
        if c.rounds() == 1 { "" } else { "s" }
    ));
    for round in 0..=c.last_round().unwrap_or(0) {
        let msgs = c.messages(round);
        if msgs.is_empty() {
            continue;
        }
        let confirm = msgs.iter().all(|m| m.confirm);
        let items: Vec<String> = msgs
            .iter()
            .map(|m| {
                let what = m.chunk.map_or(String::new(), |k| k.label());
                let what = if what.is_empty() {
                    what
                } else {
                    format!(" {what}")
                };
                format!("{}→{}{what} {}", m.from, m.to, bytes(m.bytes))
            })
            .collect();
        let head = if confirm {
            format!("    round {round} (confirm): ")
        } else {
            format!("    round {round}: ")
        };
        wrapped(out, &head, &items);
        for (action, name) in [(Action::Reduce, "fold"), (Action::Copy, "copy")] {
            // Per rank: its one chunk, or how many.
            let local: Vec<String> = c
                .ranks
                .iter()
                .filter_map(|r| {
                    let here: Vec<_> = r.of(action).filter(|e| e.round == round).collect();
                    match here.as_slice() {
                        [] => None,
                        [e] => {
                            let what = e.chunk.map_or(String::new(), |k| k.label());
                            Some(format!("rank {} {what}", r.rank).trim_end().to_string())
                        }
                        more => Some(format!("rank {} ({} chunks)", r.rank, more.len())),
                    }
                })
                .collect();
            if !local.is_empty() {
                wrapped(out, &format!("      {name}: "), &local);
            }
        }
    }
    let totals: Vec<String> = c
        .ranks
        .iter()
        .map(|r| {
            let received: u64 = r.of(Action::Recv).map(|e| e.bytes).sum();
            format!(
                "rank {} sent {} received {} in {:.0} µs",
                r.rank,
                bytes(r.sent_bytes()),
                bytes(received),
                r.total_us
            )
        })
        .collect();
    wrapped(out, "    ", &totals);
}

/// The run as text, one block per call (what `distgrad run --events` prints).
pub fn render(events: &Events) -> String {
    let mut out = format!("events: world {}", events.world);
    if let Some(a) = events.algorithm {
        out.push_str(&format!(
            ", algorithm {} where a collective has it",
            a.name()
        ));
    }
    out.push('\n');
    for phase in [Phase::Forward, Phase::Backward] {
        let calls: Vec<&CallAcross> = events.calls.iter().filter(|c| c.phase == phase).collect();
        out.push_str(match phase {
            Phase::Forward => "forward\n",
            _ => "backward (each collective's dual)\n",
        });
        if calls.is_empty() {
            out.push_str("  no collective\n");
        }
        for c in calls {
            render_call(&mut out, c, events.algorithm);
        }
    }
    out
}
