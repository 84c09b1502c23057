//! The `pipeline_parallel` lesson: one stage per rank, activations sent forward, their
//! gradients sent back.

use super::*;

/// The pipeline lesson (see the module docs): one step per stage forward, the loss, one step per
/// stage backward. Every rank reports the same names at a step; the rank whose stage it is fills
/// them in (the others show `-`). The point-to-point calls each rank's communicator recorded are
/// in its values (`ran`, `backward ran`), and the backward steps name what the backward pass ran.
pub(super) async fn run<T: Transport>(comm: &P2p<T>) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let n = comm.world_size();
    let last = n - 1;
    let device = comm.options().device.clone();
    let group = comm.world();
    let rf = me as f32;
    let x = Tensor::vector(&[1.0, -2.0]).to_device(&device)?;
    let w = Tensor::vector(&[1.0 - 0.25 * rf, 0.5 + 0.25 * rf]).to_device(&device)?;
    let tape = Tape::new();
    let wv = tape.var(w.clone());
    let input_name = |s: usize| {
        if s == 0 {
            "x".to_string()
        } else {
            format!("h{}", s - 1)
        }
    };
    // A value shown only by the rank whose stage it is.
    let blank = |name: &str| Named::tensors(name, Vec::new());
    let mut out = vec![step(
        format!(
            "inputs: stage r (rank r) holds its weights w_r; the data x starts on stage 0; {n} stages"
        ),
        Phase::Input,
        Vec::new(),
        vec![
            if me == 0 {
                Named::tensors("x", vec![read(&x).await?])
            } else {
                blank("x")
            },
            Named::tensors("w_r", vec![read(&w).await?]),
        ],
    )];
    // Forward: stage s receives its input (sent in the step before), computes, sends it on.
    let mut mine = None;
    for s in 0..n {
        let received = format!("{} (received)", input_name(s));
        let mut values = Vec::new();
        if s == me {
            let xin = if me == 0 {
                tape.constant(x.clone())
            } else {
                dist::recv(comm, &tape, &[2], me - 1, &group)
                    .await?
                    .to_device(&device)?
            };
            let hv = wv.mul(&xin)?.tanh()?;
            if me < last {
                dist::send(comm, &hv, me + 1, &group).await?;
            }
            if me > 0 {
                values.push(Named::tensors(&received, vec![read(&xin.value()).await?]));
            }
            values.push(Named::tensors(
                &format!("h{s}"),
                vec![read(&hv.value()).await?],
            ));
            values.push(match ran(comm) {
                Some(r) => Named::text("ran", r),
                None => blank("ran"),
            });
            mine = Some((xin, hv));
        } else {
            if s > 0 {
                values.push(blank(&received));
            }
            values.extend([blank(&format!("h{s}")), blank("ran")]);
        }
        let label = if s < last {
            format!(
                "forward, stage {s}: h{s} = tanh(w{s} ⊙ {}), sent to stage {}",
                input_name(s),
                s + 1
            )
        } else {
            format!("forward, stage {s}: h{s} = tanh(w{s} ⊙ {})", input_name(s))
        };
        let arrows = if s < last {
            vec![(s, s + 1)]
        } else {
            Vec::new()
        };
        out.push(step(label, Phase::Forward, arrows, values));
    }
    let (input, h) =
        mine.ok_or_else(|| Error::Input(format!("rank {me}: its stage did not run")))?;
    let loss = h.square()?.sum()?.scale(0.5)?;
    out.push(step(
        format!("the loss, on the last stage: L = 0.5·sum(h{last}²)"),
        Phase::Forward,
        Vec::new(),
        vec![if me == last {
            Named::tensors("L", vec![read(&loss.value()).await?])
        } else {
            blank("L")
        }],
    ));
    // Backward: the last stage starts from its loss; the others from nothing of their own (the
    // duals of their sends bring their gradients in).
    let grads = if me == last {
        tape.backward(&loss, comm).await?
    } else {
        tape.backward_from(&[], comm).await?
    };
    // What this rank's backward ran, in order: the dual of its send (a recv from the next stage,
    // at boundary me+1), then the dual of its recv (a send to the previous one, at boundary me).
    let calls = recorded(comm);
    let expected = usize::from(me < last) + usize::from(me > 0);
    if calls.len() != expected {
        return Err(Error::Input(format!(
            "rank {me}: the backward pass ran {calls:?}, expected {expected} point-to-point calls"
        )));
    }
    let ran_at = |boundary: usize| -> Option<String> {
        if me < last && boundary == me + 1 {
            calls.first().cloned()
        } else if me > 0 && boundary == me {
            calls.last().cloned()
        } else {
            None
        }
    };
    let dh = read(&grads.wrt(&h)?).await?;
    let dw = read(&grads.wrt(&wv)?).await?;
    let din = read(&grads.wrt(&input)?).await?;
    if n == 1 {
        let mut b = step(
            "backward, stage 0 (the only one): dL/dh0 = h0, dL/dw0 = dL/dh0 ⊙ (1 − h0²) ⊙ x".into(),
            Phase::Backward,
            Vec::new(),
            vec![
                Named::tensors("dL/dh0", vec![dh]),
                Named::tensors("dL/dw0", vec![dw]),
            ],
        );
        b.collective = Some("nothing".into());
        out.push(b);
        return Ok(out);
    }
    // One step per boundary, from the last stage down: stage s computes its gradients and sends
    // dL/dh_{s−1} back; stage s−1 receives it (and stage 0, the last to, finishes dL/dw0).
    for s in (1..n).rev() {
        let p = s - 1;
        let (gs, ws, gp) = (
            format!("dL/dh{s}"),
            format!("dL/dw{s}"),
            format!("dL/dh{p}"),
        );
        let own = |name: &str, t: &TensorJson, mine: bool| {
            if mine {
                Named::tensors(name, vec![t.clone()])
            } else {
                blank(name)
            }
        };
        let mut values = vec![
            own(&gs, &dh, me == s),
            own(&ws, &dw, me == s),
            // Sent by stage s, received by stage s−1: the same numbers on both ends.
            if me == s {
                Named::tensors(&gp, vec![din.clone()])
            } else {
                own(&gp, &dh, me == p)
            },
        ];
        if p == 0 {
            values.push(own("dL/dw0", &dw, me == 0));
        }
        let ran = ran_at(s);
        values.push(match &ran {
            Some(c) => Named::text("backward ran", c.clone()),
            None => blank("backward ran"),
        });
        let head = if s == last {
            format!("dL/dh{s} = h{s} (from the loss)")
        } else {
            format!("dL/dh{s} came from stage {}", s + 1)
        };
        let mut label = format!(
            "backward, stage {s} → {p}: {head}; dL/dw{s} = dL/dh{s} ⊙ (1 − h{s}²) ⊙ h{p}; \
             dL/dh{p} = dL/dh{s} ⊙ (1 − h{s}²) ⊙ w{s} goes back: stage {s}'s recv runs its \
             dual, a send, and stage {p}'s send its dual, a recv"
        );
        if p == 0 {
            label.push_str("; stage 0 finishes dL/dw0 = dL/dh0 ⊙ (1 − h0²) ⊙ x");
        }
        let mut b = step(label, Phase::Backward, vec![(s, p)], values);
        b.collective = ran;
        out.push(b);
    }
    Ok(out)
}
