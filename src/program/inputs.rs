//! A program's inputs made into each rank's tensors: who holds an input (`"ranks"`), with which
//! shape (`"shape"` / `"shapes"`), and its values (`"values"` per rank, one `"value"` plus
//! `r · "per_rank"`, or generated from `"seed"` in `"range"`), every field checked against the
//! others first.

use super::{Input, MAX_NUMEL};
use crate::error::{ProgramError, Result};
use crate::tensor::Tensor;

/// Each rank's value of input `index` of a program for `world` ranks (`None` on ranks that do
/// not hold it).
pub(super) fn input_values(index: usize, inp: &Input, world: usize) -> Result<Vec<Option<Tensor>>> {
    let fail = |detail: String| -> crate::error::Error {
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
    let numels = shapes
        .iter()
        .map(|shape| {
            crate::tensor::checked_numel(shape)
                .filter(|&n| n <= MAX_NUMEL)
                .ok_or_else(|| {
                    fail(format!(
                        "shape {shape:?} has more than {MAX_NUMEL} elements"
                    ))
                })
        })
        .collect::<Result<Vec<usize>>>()?;
    check_fields(inp).map_err(fail)?;
    let slots = Slots {
        inp,
        holders: &holders,
        shapes: &shapes,
        numels: &numels,
        world,
    };
    let held = if let Some(vs) = &inp.values {
        slots.per_rank(vs)?
    } else if let Some(v) = &inp.value {
        slots.shared_value(v)?
    } else {
        slots.generated(index).map_err(fail)?
    };
    let mut out = vec![None; world];
    for ((v, shape), &r) in held.into_iter().zip(&shapes).zip(&holders) {
        out[r] = Some(Tensor::from_vec(v, shape).map_err(|e| fail(e.to_string()))?);
    }
    Ok(out)
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

/// One input's holders, with their shapes and sizes: where its values go.
struct Slots<'a> {
    inp: &'a Input,
    holders: &'a [usize],
    shapes: &'a [Vec<usize>],
    numels: &'a [usize],
    world: usize,
}

impl Slots<'_> {
    /// An error about this input (on `rank`, where it is one rank's values).
    fn fail(&self, rank: Option<usize>, detail: String) -> ProgramError {
        ProgramError::Input {
            name: self.inp.name.clone(),
            rank,
            detail,
        }
    }

    /// `v` as the values of holder `k`: the right count, every one finite; `rank` where a
    /// message names the rank.
    fn check(&self, v: &[f32], k: usize, rank: Option<usize>) -> Result<()> {
        if v.len() != self.numels[k] {
            let detail = format!(
                "shape {:?} needs {} values, got {}",
                self.shapes[k],
                self.numels[k],
                v.len()
            );
            return Err(self.fail(rank, detail).into());
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(self.fail(rank, format!("value {i} is not finite")).into());
        }
        Ok(())
    }

    /// `"values"`: one list per holder.
    fn per_rank(&self, vs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        if vs.len() != self.holders.len() {
            let whom = if self.inp.ranks.is_some() {
                format!("rank of \"ranks\" ({})", self.holders.len())
            } else {
                format!("rank ({})", self.world)
            };
            let detail = format!("\"values\" needs one list per {whom}, got {}", vs.len());
            return Err(self.fail(None, detail).into());
        }
        for (k, v) in vs.iter().enumerate() {
            self.check(v, k, Some(self.holders[k]))?;
        }
        Ok(vs.to_vec())
    }

    /// `"value"` on every holder, plus `r · "per_rank"` on rank `r`.
    fn shared_value(&self, v: &[f32]) -> Result<Vec<Vec<f32>>> {
        for (k, &r) in self.holders.iter().enumerate() {
            self.check(v, k, self.inp.shapes.is_some().then_some(r))?;
        }
        let Some(d) = &self.inp.per_rank else {
            return Ok(vec![v.to_vec(); self.holders.len()]);
        };
        if d.len() != v.len() || d.iter().any(|x| !x.is_finite()) {
            let detail = format!(
                "\"per_rank\" needs {} finite values (one per value), got {}",
                v.len(),
                d.len()
            );
            return Err(self.fail(None, detail).into());
        }
        let mut out = Vec::with_capacity(self.holders.len());
        for (k, &r) in self.holders.iter().enumerate() {
            let at: Vec<f32> = v.iter().zip(d).map(|(a, b)| a + r as f32 * b).collect();
            self.check(&at, k, Some(r))?;
            out.push(at);
        }
        Ok(out)
    }

    /// Values generated from `"seed"` (default: the input's index) in `"range"`.
    fn generated(&self, index: usize) -> std::result::Result<Vec<Vec<f32>>, String> {
        let range = self.inp.range.unwrap_or((-1.0, 1.0));
        if !(range.0.is_finite() && range.1.is_finite() && range.0 <= range.1) {
            return Err(format!("range {range:?} must be finite and ordered"));
        }
        let seed = self.inp.seed.unwrap_or(index as u64);
        Ok(self
            .holders
            .iter()
            .enumerate()
            .map(|(k, &r)| {
                let rank = (!self.inp.replicated).then_some(r);
                generated(seed, rank, self.numels[k], range)
            })
            .collect())
    }
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
