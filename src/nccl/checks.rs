//! The call check: before each collective the ranks all_gather a fixed-size record of their call
//! (kind, op, root, shape, arguments; digests where it is too long, so the check is never
//! skipped) and fail with [`Error::Mismatch`] naming both ranks when they differ. NCCL itself would
//! hang or mix buffers, and it has no receive timeout.
//!
//! A rank whose own arguments are wrong still takes part, sending the reason instead of a call
//! (`check_args`), so every rank fails together naming it.
//! [`NcclOptions::check_calls`](super::NcclOptions::check_calls) turns the check off (the sequence
//! numbers still count).

use cudarc::nccl::Comm;

use super::NcclComm;
use crate::collective::{CallSig, Group};
use crate::error::{Error, Result};

/// Bytes of one call-signature record in the call check.
const SIG_BYTES: usize = 256;

impl NcclComm {
    /// The call check where this rank's own arguments may be wrong (`sig` is then the error): a
    /// rank with wrong arguments still takes part in the check, sending the reason instead of a
    /// call, so its peers fail with it (naming it) instead of waiting for it inside NCCL.
    pub(super) fn check_args(
        &self,
        comm: &Comm,
        group: &Group,
        sig: Result<CallSig>,
    ) -> Result<()> {
        match sig {
            Ok(sig) => self.check(comm, group, &sig),
            Err(e) => {
                let rec = crate::collective::sig::refusal_record(&e.to_string(), SIG_BYTES);
                // The peers learn the reason from the exchange; our own error is the one to give.
                let _ = self.exchange_records(comm, group, rec, None);
                Err(e)
            }
        }
    }

    /// Compare every rank's call with this one (see the module docs).
    pub(super) fn check(&self, comm: &Comm, group: &Group, sig: &CallSig) -> Result<()> {
        // Long signatures travel as digests: the check is never skipped.
        self.exchange_records(comm, group, sig.record(SIG_BYTES), Some(sig))
    }

    /// All-gather one check record per rank (`rec`, ours) and compare each with `sig` (`None`: we
    /// only tell the others why we have no call).
    fn exchange_records(
        &self,
        comm: &Comm,
        group: &Group,
        rec: Vec<u8>,
        sig: Option<&CallSig>,
    ) -> Result<()> {
        let seq = {
            let mut s = self.seqs.borrow_mut();
            let e = s.entry(group.id()).or_insert(0);
            *e += 1;
            *e
        };
        if !self.opts.check_calls || group.size() == 1 {
            return Ok(());
        }
        let send = self
            .stream
            .clone_htod(&rec)
            .map_err(|e| self.err("call check", e))?;
        let mut recv = self
            .stream
            .alloc_zeros::<u8>(SIG_BYTES * group.size())
            .map_err(|e| self.err("call check", e))?;
        comm.all_gather(&send, &mut recv)
            .map_err(|e| self.err("call check", e))?;
        let all = self
            .stream
            .clone_dtoh(&recv)
            .map_err(|e| self.err("call check", e))?;
        let Some(sig) = sig else { return Ok(()) };
        for (r, rec) in all.chunks(SIG_BYTES).enumerate() {
            if let Err(peer_call) = sig.agrees_record(rec) {
                return Err(Error::Mismatch {
                    group: group.id(),
                    seq,
                    rank: self.rank,
                    call: sig.to_string(),
                    peer: group.global(r),
                    peer_call,
                });
            }
        }
        Ok(())
    }
}
