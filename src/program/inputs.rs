//! A program's inputs: who holds an input (`"ranks"`), with which shape (`"shape"` /
//! `"shapes"`), and its values (`"values"` per rank, one `"value"` plus `r · "per_rank"`, or
//! generated from `"seed"` in `"range"`), every field checked against the others when the program
//! is checked ([`InputPlan::check`]); a rank's tensors are made only when that rank asks
//! ([`InputPlan::tensor`]), so a tab builds its own inputs, not every rank's.

use super::{Input, MAX_NUMEL};
use crate::error::{Error, ProgramError, Result};
use crate::tensor::Tensor;

/// One input, checked: who holds it, with which shape, and how its values are made.
#[derive(Debug, Clone)]
pub(super) struct InputPlan {
    /// The global ranks that hold it, in the order of its per-rank lists.
    holders: Vec<usize>,
    /// The shape on each holder.
    shapes: Vec<Vec<usize>>,
    values: Values,
}

/// Where an input's values come from.
#[derive(Debug, Clone)]
enum Values {
    /// `"values"`: one list per holder.
    PerRank(Vec<Vec<f32>>),
    /// `"value"` on every holder, plus `r · per_rank` on rank `r`.
    Shared {
        value: Vec<f32>,
        per_rank: Option<Vec<f32>>,
    },
    /// Generated from a seed in a range, per rank or the same everywhere.
    Generated {
        seed: u64,
        range: (f32, f32),
        replicated: bool,
    },
}

impl InputPlan {
    /// Check input `index` of a program for `world` ranks (see the module docs).
    pub(super) fn check(index: usize, inp: &Input, world: usize) -> Result<InputPlan> {
        let fail = |detail: String| -> Error {
            ProgramError::Input {
                name: inp.name.clone(),
                rank: None,
                detail,
            }
            .into()
        };
        let holders = holders(inp, world).map_err(fail)?;
        let shapes = shapes(inp, holders.len()).map_err(fail)?;
        if inp.replicated && (inp.ranks.is_some() || inp.shapes.is_some()) {
            return Err(fail(
                "a replicated input is the same on every rank; it takes neither \"ranks\" nor \"shapes\""
                    .into(),
            ));
        }
        for shape in &shapes {
            if crate::tensor::checked_numel(shape).is_none_or(|n| n > MAX_NUMEL) {
                return Err(fail(format!(
                    "shape {shape:?} has more than {MAX_NUMEL} elements"
                )));
            }
        }
        check_fields(inp).map_err(fail)?;
        let slots = Slots {
            inp,
            holders: &holders,
            shapes: &shapes,
        };
        let values = if let Some(vs) = &inp.values {
            slots.per_rank(vs, world)?
        } else if let Some(v) = &inp.value {
            slots.shared(v)?
        } else {
            generated_values(inp, index).map_err(fail)?
        };
        Ok(InputPlan {
            holders,
            shapes,
            values,
        })
    }

    /// Which holder `rank` is (its place in the per-rank lists), if it holds the input.
    pub(super) fn holder(&self, rank: usize) -> Option<usize> {
        self.holders.iter().position(|&r| r == rank)
    }

    /// The global ranks that hold it.
    pub(super) fn holders(&self) -> &[usize] {
        &self.holders
    }

    /// Its shape on `rank`, if `rank` holds it.
    pub(super) fn shape(&self, rank: usize) -> Option<&[usize]> {
        self.holder(rank).map(|k| self.shapes[k].as_slice())
    }

    /// Its tensor on `rank`, made now (`None` where `rank` does not hold it).
    pub(super) fn tensor(&self, rank: usize) -> Option<Tensor> {
        let k = self.holder(rank)?;
        let shape = &self.shapes[k];
        let n: usize = shape.iter().product();
        let v = match &self.values {
            Values::PerRank(vs) => vs[k].clone(),
            Values::Shared { value, per_rank } => shared_at(value, per_rank.as_deref(), rank),
            Values::Generated {
                seed,
                range,
                replicated,
            } => generated(*seed, (!replicated).then_some(rank), n, *range),
        };
        // The check made sure the count fits the shape.
        Tensor::from_vec(v, shape).ok()
    }

    /// Whether every one of `world` ranks holds it with the same values (a parameter that data
    /// parallel training keeps equal everywhere).
    pub(super) fn same_everywhere(&self, world: usize) -> bool {
        if self.holders.len() != world || self.shapes.windows(2).any(|w| w[0] != w[1]) {
            return false;
        }
        match &self.values {
            Values::PerRank(vs) => vs.windows(2).all(|w| w[0] == w[1]),
            Values::Shared { per_rank, .. } => per_rank
                .as_ref()
                .is_none_or(|d| world == 1 || d.iter().all(|&x| x == 0.0)),
            Values::Generated { replicated, .. } => *replicated || world == 1,
        }
    }
}

/// One input's holders and shapes, whose values are being checked.
struct Slots<'a> {
    inp: &'a Input,
    holders: &'a [usize],
    shapes: &'a [Vec<usize>],
}

impl Slots<'_> {
    /// An error about this input (on `rank`, where it is one rank's values).
    fn fail(&self, rank: Option<usize>, detail: String) -> Error {
        ProgramError::Input {
            name: self.inp.name.clone(),
            rank,
            detail,
        }
        .into()
    }

    /// `v` as the values of holder `k`: the right count, every one finite; `rank` where a
    /// message names the rank.
    fn check_values(&self, v: &[f32], k: usize, rank: Option<usize>) -> Result<()> {
        let n: usize = self.shapes[k].iter().product();
        if v.len() != n {
            let detail = format!(
                "shape {:?} needs {n} values, got {}",
                self.shapes[k],
                v.len()
            );
            return Err(self.fail(rank, detail));
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(self.fail(rank, format!("value {i} is not finite")));
        }
        Ok(())
    }

    /// `"values"`: one list per holder.
    fn per_rank(&self, vs: &[Vec<f32>], world: usize) -> Result<Values> {
        if vs.len() != self.holders.len() {
            let whom = if self.inp.ranks.is_some() {
                format!("rank of \"ranks\" ({})", self.holders.len())
            } else {
                format!("rank ({world})")
            };
            let detail = format!("\"values\" needs one list per {whom}, got {}", vs.len());
            return Err(self.fail(None, detail));
        }
        for (k, v) in vs.iter().enumerate() {
            self.check_values(v, k, Some(self.holders[k]))?;
        }
        Ok(Values::PerRank(vs.to_vec()))
    }

    /// `"value"` on every holder, plus `r · "per_rank"` on rank `r`: every rank's values
    /// checked (finite), none kept.
    fn shared(&self, v: &[f32]) -> Result<Values> {
        for (k, &r) in self.holders.iter().enumerate() {
            self.check_values(v, k, self.inp.shapes.is_some().then_some(r))?;
        }
        let Some(d) = &self.inp.per_rank else {
            return Ok(Values::Shared {
                value: v.to_vec(),
                per_rank: None,
            });
        };
        if d.len() != v.len() || d.iter().any(|x| !x.is_finite()) {
            let detail = format!(
                "\"per_rank\" needs {} finite values (one per value), got {}",
                v.len(),
                d.len()
            );
            return Err(self.fail(None, detail));
        }
        for (k, &r) in self.holders.iter().enumerate() {
            self.check_values(&shared_at(v, Some(d), r), k, Some(r))?;
        }
        Ok(Values::Shared {
            value: v.to_vec(),
            per_rank: Some(d.clone()),
        })
    }
}

/// `value + rank · per_rank`.
fn shared_at(value: &[f32], per_rank: Option<&[f32]>, rank: usize) -> Vec<f32> {
    match per_rank {
        Some(d) => value
            .iter()
            .zip(d)
            .map(|(a, b)| a + rank as f32 * b)
            .collect(),
        None => value.to_vec(),
    }
}

/// Which ranks of `ranks` are named, checked: distinct, below `world`, not none (else why not,
/// `what` naming the field).
pub(super) fn ranks_of(
    what: &str,
    ranks: &[usize],
    world: usize,
) -> std::result::Result<Vec<bool>, String> {
    let mut seen = vec![false; world];
    for &r in ranks {
        if r >= world || std::mem::replace(&mut seen[r], true) {
            return Err(format!(
                "{what} {ranks:?}: ranks must be distinct and below world {world}"
            ));
        }
    }
    if ranks.is_empty() {
        return Err(format!("{what} must not be empty"));
    }
    Ok(seen)
}

/// The global ranks that hold the input, in the order its per-rank lists use.
fn holders(inp: &Input, world: usize) -> std::result::Result<Vec<usize>, String> {
    match &inp.ranks {
        Some(r) => {
            ranks_of("\"ranks\"", r, world)?;
            Ok(r.clone())
        }
        None => Ok((0..world).collect()),
    }
}

/// The shape on each holder.
fn shapes(inp: &Input, holders: usize) -> std::result::Result<Vec<Vec<usize>>, String> {
    match (&inp.shape, &inp.shapes) {
        (Some(s), None) => Ok(vec![s.clone(); holders]),
        (None, Some(s)) if s.len() == holders => Ok(s.clone()),
        (None, Some(s)) => Err(format!(
            "\"shapes\" needs one shape per rank that holds it ({holders}), got {}",
            s.len()
        )),
        _ => Err("give \"shape\" (every rank) or \"shapes\" (one per rank that holds it)".into()),
    }
}

/// The fields that exclude or need each other.
fn check_fields(inp: &Input) -> std::result::Result<(), String> {
    let given = [
        inp.values.is_some(),
        inp.value.is_some(),
        inp.seed.is_some(),
    ];
    if given.iter().filter(|&&b| b).count() > 1 {
        return Err("give one of \"values\", \"value\", \"seed\"".into());
    }
    if inp.per_rank.is_some() && (inp.value.is_none() || inp.replicated) {
        return Err(
            "\"per_rank\" adds r times itself to \"value\" on rank r: give \"value\" too, and not \"replicated\""
                .into(),
        );
    }
    if inp.range.is_some() && (inp.values.is_some() || inp.value.is_some()) {
        return Err("\"range\" is for generated values".into());
    }
    if inp.values.is_some() && inp.replicated {
        return Err(
            "\"values\" are per rank; a replicated input takes \"value\" or \"seed\"".into(),
        );
    }
    Ok(())
}

/// Values generated from `"seed"` (default: the input's index) in `"range"`.
fn generated_values(inp: &Input, index: usize) -> std::result::Result<Values, String> {
    let range = inp.range.unwrap_or((-1.0, 1.0));
    if !(range.0.is_finite() && range.1.is_finite() && range.0 <= range.1) {
        return Err(format!("range {range:?} must be finite and ordered"));
    }
    Ok(Values::Generated {
        seed: inp.seed.unwrap_or(index as u64),
        range,
        replicated: inp.replicated,
    })
}

/// Seeded values for rank `rank` (the same on every rank if `rank` is `None`).
fn generated(seed: u64, rank: Option<usize>, n: usize, (lo, hi): (f32, f32)) -> Vec<f32> {
    let s = match rank {
        Some(r) => seed
            .wrapping_mul(0x100_0000_01B3)
            .wrapping_add(r as u64 + 1),
        None => seed.wrapping_mul(0x100_0000_01B3),
    };
    crate::train::uniform(s ^ 0x5EED, n)
        .into_iter()
        .map(|u| lo + (u + 1.0) * 0.5 * (hi - lo))
        .collect()
}
