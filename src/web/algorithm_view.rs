//! The algorithm view's markup, from one call's events alone (no DOM): every rank as a row of
//! cells (the chunks of its tensor, or the entries of its list), each cell coloured by how
//! many ranks' values it holds after the round shown, and that round's messages as arrows
//! labelled with the chunk each carries. The page steps it round by round
//! (`page/lessons.rs`); the tests read it natively.

use super::markup::Markup;
use crate::collective::events::{Algorithm, Chunk};
use crate::lesson::Phase;
use crate::lesson::algorithm::{CallAcross, Contributors, Message};

use std::collections::HashSet;

/// Chunk colours: the Okabe–Ito palette, told apart with any colour vision.
pub const PALETTE: [&str; 8] = [
    "#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442", "#000000",
];

/// Colour of cell `c`.
fn colour(c: usize) -> &'static str {
    PALETTE[c % PALETTE.len()]
}

/// Whether white text reads on cell `c`'s colour at full strength (not on the light ones).
fn dark(c: usize) -> bool {
    matches!(c % PALETTE.len(), 0 | 2 | 3 | 5 | 7)
}

/// `0+1+2`, or `5 of 8` where that is long; `·` for nothing.
pub fn contributors(held: Contributors, n: usize) -> String {
    let ranks: Vec<String> = (0..64)
        .filter(|r| held & (1u64 << r) != 0)
        .map(|r| r.to_string())
        .collect();
    match ranks.len() {
        0 => "·".into(),
        k if k == n && n > 1 => "all".into(),
        k if k <= 3 => ranks.join("+"),
        k => format!("{k} of {n}"),
    }
}

/// A chunk as a message's label: `c2` (chunk 2 of a split), `[2]` (list entry 2), or nothing.
fn short(c: &Chunk) -> String {
    match c.entry {
        Some(e) => format!("[{e}]"),
        None if c.of > 1 => format!("c{}", c.index),
        None => String::new(),
    }
}

/// What a student reads above the drawing: the call, its algorithm, and the round shown.
pub fn caption(call: &CallAcross, round: Option<u32>) -> String {
    let rounds = call.rounds();
    let phase = match call.phase {
        Phase::Backward => "backward",
        _ => "forward",
    };
    let how = match call.algorithm {
        Algorithm::Ring => {
            "each rank sends one chunk to the next rank and receives one from the previous"
        }
        Algorithm::Pairwise => {
            "each rank owns one chunk: it collects and folds that chunk, then sends it to everyone"
        }
        Algorithm::Shared => {
            "each rank owns one chunk; rank 0 puts the finished chunks together and sends the whole"
        }
        Algorithm::Exchange => "every rank sends its data straight to every rank that needs it",
        Algorithm::Star => "every rank sends to rank 0, which folds and sends the result back",
        Algorithm::Tree => {
            "a binomial tree: every rank holding the data passes it on, so the number holding it at most doubles each round"
        }
        Algorithm::Direct => "every message goes straight from its source to its destination",
        Algorithm::PointToPoint => "one message from one rank to another",
    };
    let at = match round {
        None => format!(
            "{rounds} round{}, result",
            if rounds == 1 { "" } else { "s" }
        ),
        Some(k) => format!("round {} of {rounds}", k + 1),
    };
    format!(
        "{phase}: {} by {} ({how}) — {at}",
        call.collective,
        call.algorithm.name()
    )
}

/// A set of (row, cell) pairs.
type Cells = HashSet<(usize, usize)>;

/// The geometry of one call's drawing: rows of `cells` cells, the arrows' margin on the right.
struct Drawing<'a> {
    call: &'a CallAcross,
    cells: usize,
    row_h: f64,
    label_w: f64,
    cell_w: f64,
    grid_right: f64,
    /// `" bwd"` and `"-b"` in backward (the arrows' class and marker), else empty.
    bwd: (&'static str, &'static str),
}

impl Drawing<'_> {
    /// Top of row `i`.
    fn y(&self, i: usize) -> f64 {
        8.0 + self.row_h * i as f64
    }

    /// The row of global rank `rank`.
    fn row_of(&self, rank: usize) -> Option<usize> {
        self.call.ranks.iter().position(|r| r.rank == rank)
    }

    /// The (row, cell) pairs `round`'s messages leave from and arrive at.
    fn moved(&self, round: Option<u32>) -> (Cells, Cells) {
        let (mut sent, mut got) = (HashSet::new(), HashSet::new());
        for msg in round.map(|k| self.call.messages(k)).unwrap_or_default() {
            let (Some(a), Some(b)) = (self.row_of(msg.from), self.row_of(msg.to)) else {
                continue;
            };
            if msg.confirm {
                continue;
            }
            let cells: Vec<usize> = match msg.chunk {
                Some(c) if c.entry.is_some() || c.of > 1 => vec![cell_of(&c)],
                _ => (0..self.cells).collect(),
            };
            for c in cells {
                sent.insert((a, c));
                got.insert((b, c));
            }
        }
        (sent, got)
    }

    /// Row `i`'s cell `c`: coloured by how many ranks' values it holds (`held`), outlined
    /// where a message leaves from or arrives at it (`class`).
    fn cell(
        &self,
        m: &mut Markup,
        (i, c): (usize, usize),
        held: Option<Contributors>,
        class: &str,
    ) {
        let n = self.call.members.len();
        let rank = self.call.ranks[i].rank;
        let k = held.map_or(0, |h| h.count_ones() as usize);
        let opacity = if k == 0 {
            0.0
        } else {
            0.25 + 0.75 * k as f64 / n.max(1) as f64
        };
        let (x, y) = (self.label_w + self.cell_w * c as f64, self.y(i));
        let text = held.map_or(String::new(), |h| contributors(h, n));
        let title = match held {
            Some(h) => format!(
                "rank {rank}, {}: holds {}",
                cell_name(self.call, c),
                contributors(h, n)
            ),
            None => format!("rank {rank}, {}", cell_name(self.call, c)),
        };
        let class = format!("{}{class}", if k == 0 { "empty" } else { "held" });
        m.with("g", &[("class", "algo-cell")], |m| {
            m.el("title", &[], &title);
            m.empty(
                "rect",
                &[
                    ("x", &format!("{:.1}", x + 1.0)),
                    ("y", &format!("{:.1}", y + 2.0)),
                    ("width", &format!("{:.1}", self.cell_w - 2.0)),
                    ("height", &format!("{:.1}", self.row_h - 6.0)),
                    ("fill", colour(c)),
                    ("fill-opacity", &format!("{opacity:.2}")),
                    ("class", &class),
                ],
            );
            if self.cell_w >= 22.0 || text.len() <= 2 {
                let class = if k * 2 > n && dark(c) {
                    "algo-n dark"
                } else {
                    "algo-n"
                };
                let (tx, ty) = (
                    format!("{:.1}", x + self.cell_w / 2.0),
                    format!("{:.1}", y + 21.0),
                );
                m.el("text", &[("x", &tx), ("y", &ty), ("class", class)], &text);
            }
        });
    }

    /// Message `j` of a round: an arrow out of the grid's right edge at the sender's row and
    /// back in at the receiver's, the chunk's name beside its start (one message per sender and
    /// round in the ring, so the names do not collide there).
    fn arrow(&self, m: &mut Markup, j: usize, msg: &Message) {
        let (Some(a), Some(b)) = (self.row_of(msg.from), self.row_of(msg.to)) else {
            return;
        };
        let (bwd, bwd_id) = self.bwd;
        let right = self.grid_right;
        let (y1, y2) = (
            self.y(a) + self.row_h / 2.0 - 4.0,
            self.y(b) + self.row_h / 2.0 + 4.0,
        );
        // Farther rows bulge farther out; each message a little more than the last.
        let out = right + 14.0 + 5.0 * (a.abs_diff(b) as f64) + 2.0 * (j % 4) as f64;
        let d = format!(
            "M{:.1},{y1:.1} C{out:.1},{y1:.1} {out:.1},{y2:.1} {:.1},{y2:.1}",
            right + 2.0,
            right + 4.0
        );
        let (class, head) = (format!("algo-msg{bwd}"), format!("url(#algo-head{bwd_id})"));
        m.empty(
            "path",
            &[("d", &d), ("class", &class), ("marker-end", &head)],
        );
        if let Some(c) = msg.chunk.as_ref().map(short).filter(|s| !s.is_empty()) {
            let (x, y) = (
                format!("{:.1}", right + 5.0),
                format!("{:.1}", self.y(a) + 9.0),
            );
            let class = format!("algo-chunk{bwd}");
            m.el("text", &[("x", &x), ("y", &y), ("class", &class)], &c);
        }
    }
}

/// The drawing of `call` after `round` (`None`: after the last), for a box `width` pixels wide
/// at most (rows and cells shrink to fit a phone).
pub fn call_svg(call: &CallAcross, round: Option<u32>, width: f64) -> Markup {
    let rows = call.ranks.len();
    let cells = call.cells();
    let (row_h, label_w) = (34.0, 62.0);
    // The arrows need a margin on the right: the widest goes around the whole column.
    let arrow_w = 40.0 + 6.0 * rows as f64;
    let cell_w = ((width - label_w - arrow_w) / cells as f64).clamp(14.0, 48.0);
    let d = Drawing {
        call,
        cells,
        row_h,
        label_w,
        cell_w,
        grid_right: label_w + cell_w * cells as f64,
        bwd: if call.phase == Phase::Backward {
            (" bwd", "-b")
        } else {
            ("", "")
        },
    };
    let (w, h) = (d.grid_right + arrow_w, row_h * rows as f64 + 16.0);
    let holdings = call.holdings();
    let shown = round.map_or(call.rounds(), |k| (k + 1).min(call.rounds())) as usize;
    let (sent, got) = d.moved(round);
    let mut m = Markup::new();
    let view = format!("0 0 {w:.0} {h:.0}");
    let label = caption(call, round);
    let attrs = [
        ("viewBox", view.as_str()),
        ("role", "img"),
        ("aria-label", &label),
        ("class", "algo"),
        // Drawn at most a little larger than its own size: one cell must not fill a page.
        ("style", &format!("max-width: {:.0}px", w * 1.25)),
    ];
    m.with("svg", &attrs, |m| {
        m.with("defs", &[], |m| {
            marker(m, "algo-head", "algo-head");
            marker(m, "algo-head-b", "algo-head bwd");
        });
        for (i, r) in call.ranks.iter().enumerate() {
            let ty = format!("{:.1}", d.y(i) + 21.0);
            let name = format!("rank {}", r.rank);
            m.el(
                "text",
                &[("x", "4"), ("y", &ty), ("class", "algo-rank")],
                &name,
            );
            for c in 0..cells {
                let held = holdings
                    .as_ref()
                    .and_then(|h| h.get(shown)?.get(i)?.get(c).copied());
                let mut class = String::new();
                if sent.contains(&(i, c)) {
                    class.push_str(" sent");
                }
                if got.contains(&(i, c)) {
                    class.push_str(" got");
                }
                d.cell(m, (i, c), held, &class);
            }
        }
        if let Some(k) = round {
            for (j, msg) in call.messages(k).iter().filter(|m| !m.confirm).enumerate() {
                d.arrow(m, j, msg);
            }
        }
    });
    m
}

/// An arrowhead marker `id` whose path has class `class`.
fn marker(m: &mut Markup, id: &str, class: &str) {
    let attrs = [
        ("id", id),
        ("viewBox", "0 0 10 10"),
        ("refX", "9"),
        ("refY", "5"),
        ("markerWidth", "6"),
        ("markerHeight", "6"),
        ("orient", "auto"),
    ];
    m.with("marker", &attrs, |m| {
        m.empty("path", &[("d", "M0,0 L10,5 L0,10 z"), ("class", class)]);
    });
}

/// The drawn cell of a chunk: its list entry, or its chunk number.
fn cell_of(c: &Chunk) -> usize {
    c.entry.map_or(c.index as usize, |e| e as usize)
}

/// A cell as the student reads it: `chunk 2 (elements 4..6)`, `entry 2`, `the tensor`.
fn cell_name(call: &CallAcross, c: usize) -> String {
    let chunk = call
        .ranks
        .iter()
        .flat_map(|r| &r.events)
        .filter_map(|e| e.chunk)
        .find(|k| k.entry.map_or(k.index as usize, |e| e as usize) == c);
    match chunk {
        Some(k) if k.entry.is_some() => format!("entry {c}"),
        Some(k) if k.of > 1 => format!("chunk {c} (elements {}..{})", k.start, k.start + k.len),
        _ => "the tensor".into(),
    }
}

/// The round's messages as text, for reading aloud and for a narrow screen:
/// `0→1 carries chunk 0 (8 B)`.
pub fn messages_text(call: &CallAcross, round: u32) -> Vec<String> {
    call.messages(round)
        .iter()
        .filter(|m| !m.confirm)
        .map(|m| {
            let what = m.chunk.map(|c| c.label()).filter(|s| !s.is_empty());
            let what = what.map_or(String::new(), |w| format!(" {w}"));
            format!(
                "{}→{}{what} ({})",
                m.from,
                m.to,
                crate::lesson::algorithm::bytes(m.bytes)
            )
        })
        .collect()
}
