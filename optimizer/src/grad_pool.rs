//! Gradient vectors kept from one step to the next ([`GradPool`]): a unit's gradients land in
//! the vector its previous step's gradients of the same length and dtype used, so a step touches
//! no fresh pages for them (with malloc, every vector of a few MB and up is mapped afresh and
//! its pages faulted in one by one, each step). The pool keeps each idle vector's
//! [`HostClaim`]: the ledger counts the pool's bytes as it counts gradients in use
//! ([`HostUse::Gradients`]), so the process's memory stays what the ledger says. When a new
//! vector's claim does not fit, idle vectors of other sizes are given up first (largest first).
//!
//! The same idea as PyTorch's caching allocators (`CUDACachingAllocator`, and the pinned host
//! allocator), keyed by exact size: a unit's gradients are the same length every step.

use std::sync::Arc;

use oogc_swapper::{DType, HostClaim, HostLedger, HostUse};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::pipeline::Grads;

/// Idle gradient vectors with their ledger claims (module docs). `Send + Sync`.
///
/// The pool keeps only vectors it made or handed out ([`from_bytes`](GradPool::from_bytes)):
/// gradients a caller made itself and gave to the optimizer are dropped after their update, as
/// before, so a caller that never takes from the pool never grows it.
#[derive(Debug)]
pub struct GradPool {
    /// Where every vector's bytes are claimed ([`HostUse::Gradients`]).
    ledger: Arc<HostLedger>,
    state: Mutex<PoolState>,
}

#[derive(Debug, Default)]
struct PoolState {
    idle: Vec<(Grads, HostClaim)>,
    /// Vectors handed out and not given back, by (dtype, length).
    lent: Vec<((DType, usize), usize)>,
}

impl PoolState {
    fn lend(&mut self, key: (DType, usize)) {
        match self.lent.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => *n += 1,
            None => self.lent.push((key, 1)),
        }
    }

    /// Whether a vector of `key` is one of the pool's (and takes it off the lent count).
    fn returned(&mut self, key: (DType, usize)) -> bool {
        match self.lent.iter_mut().find(|(k, n)| *k == key && *n > 0) {
            Some((_, n)) => {
                *n -= 1;
                true
            }
            None => false,
        }
    }
}

impl GradPool {
    /// An empty pool whose vectors are claimed from `ledger`.
    pub fn new(ledger: Arc<HostLedger>) -> Self {
        Self { ledger, state: Mutex::default() }
    }

    /// Gradients of `dtype` from `bytes` (little-endian elements, `bytes.len()` a multiple of
    /// the element size) in a vector of the pool — an idle one of the same dtype and length, or a
    /// new one claimed from the pool's ledger ([`HostUse::Gradients`]) — with its claim, which goes with
    /// the vector until [`give_back`](Self::give_back) or its drop.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] for a non-float `dtype` or a ragged `bytes`; [`Error::Swapper`]
    /// (`unit` named) when the ledger refuses a new vector even with every idle one given up.
    pub fn from_bytes(&self, unit: oogc_swapper::TensorId, dtype: DType, bytes: &[u8]) -> Result<(Grads, HostClaim)> {
        let size = dtype.size_in_bytes().max(1);
        if !dtype.is_float() || !bytes.len().is_multiple_of(size) {
            return Grads::from_bytes(dtype, bytes).map(|g| (g, HostClaim::none(HostUse::Gradients)));
        }
        let n = bytes.len() / size;
        let key = (dtype, n);
        let hit = {
            let mut st = self.state.lock();
            let i = st.idle.iter().position(|(g, _)| g.dtype() == dtype && g.len() == n);
            let hit = i.map(|i| st.idle.swap_remove(i));
            st.lend(key);
            hit
        };
        let Some((mut grads, claim)) = hit else {
            let claim = loop {
                match self.ledger.claim(HostUse::Gradients, bytes.len() as u64) {
                    Ok(c) => break c,
                    Err(source) => {
                        let mut st = self.state.lock();
                        let largest = (0..st.idle.len()).max_by_key(|&i| st.idle[i].0.num_bytes());
                        match largest {
                            Some(i) => drop(st.idle.swap_remove(i)),
                            None => {
                                st.returned(key);
                                return Err(Error::Swapper { unit, source });
                            }
                        }
                    }
                }
            };
            return Grads::from_bytes(dtype, bytes).map(|g| (g, claim));
        };
        grads.as_bytes_mut().copy_from_slice(bytes);
        Ok((grads, claim))
    }

    /// Keeps `grads` (and `claim`, the ledger's bytes for it) for the next
    /// [`from_bytes`](Self::from_bytes) of the same dtype and length, when the pool handed out a
    /// vector of that dtype and length that has not come back yet; drops them otherwise.
    pub fn give_back(&self, grads: Grads, claim: HostClaim) {
        let mut st = self.state.lock();
        if st.returned((grads.dtype(), grads.len())) {
            st.idle.push((grads, claim));
        }
    }

    /// Bytes of the idle vectors.
    pub fn idle_bytes(&self) -> u64 {
        self.state.lock().idle.iter().map(|(g, _)| g.num_bytes() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oogc_swapper::TensorId;

    fn bytes_of(v: &[f32]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    fn values(g: &Grads) -> Vec<f32> {
        match g {
            Grads::F32(v) => v.clone(),
            other => panic!("f32 expected, got {:?}", other.dtype()),
        }
    }

    #[test]
    fn a_vector_given_back_is_reused_for_the_same_length_with_its_claim() {
        let ledger = HostLedger::new(1 << 20);
        let pool = GradPool::new(ledger.clone());
        let (g, claim) = pool.from_bytes(TensorId(0), DType::F32, &bytes_of(&[1.0, 2.0, 3.0])).unwrap();
        assert_eq!(values(&g), vec![1.0, 2.0, 3.0]);
        assert_eq!(ledger.used_bytes_of(HostUse::Gradients), 12);
        let ptr = g.as_slice().as_bytes().as_ptr();
        pool.give_back(g, claim);
        // Idle bytes stay claimed: the ledger counts what the process holds.
        assert_eq!((pool.idle_bytes(), ledger.used_bytes()), (12, 12));
        let (g, _claim) = pool.from_bytes(TensorId(0), DType::F32, &bytes_of(&[4.0, 5.0, 6.0])).unwrap();
        assert_eq!(g.as_slice().as_bytes().as_ptr(), ptr, "the same vector");
        assert_eq!(values(&g), vec![4.0, 5.0, 6.0]);
        assert_eq!((pool.idle_bytes(), ledger.used_bytes()), (0, 12));
        // Another length (or dtype) gets a vector of its own.
        let (h, _c) = pool.from_bytes(TensorId(1), DType::F32, &bytes_of(&[7.0])).unwrap();
        assert_ne!(h.as_slice().as_bytes().as_ptr(), ptr);
        assert_eq!(ledger.used_bytes(), 16);
    }

    #[test]
    fn idle_vectors_make_room_when_the_ledger_is_full_and_the_error_names_the_unit_otherwise() {
        let ledger = HostLedger::new(100);
        let pool = GradPool::new(ledger.clone());
        let (g, c) = pool.from_bytes(TensorId(0), DType::F32, &[0u8; 80]).unwrap();
        pool.give_back(g, c);
        // 40 B more do not fit beside the idle 80 B: the idle vector is given up.
        let (g, c) = pool.from_bytes(TensorId(1), DType::F32, &[0u8; 40]).unwrap();
        assert_eq!((pool.idle_bytes(), ledger.used_bytes()), (0, 40));
        let e = pool.from_bytes(TensorId(7), DType::F32, &[0u8; 80]).unwrap_err();
        assert!(matches!(e, Error::Swapper { unit: TensorId(7), .. }), "{e}");
        assert_eq!(ledger.used_bytes(), 40, "nothing claimed by the refused call");
        drop((g, c));
        assert_eq!(ledger.used_bytes(), 0);
    }

    #[test]
    fn vectors_the_pool_did_not_hand_out_are_dropped_not_kept() {
        let ledger = HostLedger::new(1 << 20);
        let pool = GradPool::new(ledger.clone());
        // A caller's own gradients, claimed by the optimizer's `submit`, given back after the
        // update: the pool never lent them, so it lets them go (a caller that never takes from
        // the pool never grows it).
        let claim = ledger.claim(HostUse::Gradients, 12).unwrap();
        pool.give_back(Grads::F32(vec![1.0; 3]), claim);
        assert_eq!((pool.idle_bytes(), ledger.used_bytes()), (0, 0));
        // One lent, two given back of its kind: one kept.
        let (g, c) = pool.from_bytes(TensorId(0), DType::F32, &bytes_of(&[1.0, 2.0, 3.0])).unwrap();
        pool.give_back(g, c);
        pool.give_back(Grads::F32(vec![0.0; 3]), ledger.claim(HostUse::Gradients, 12).unwrap());
        assert_eq!((pool.idle_bytes(), ledger.used_bytes()), (12, 12));
    }

    #[test]
    fn ragged_bytes_are_refused() {
        let pool = GradPool::new(HostLedger::unlimited());
        let e = pool.from_bytes(TensorId(0), DType::F32, &[0u8; 6]).unwrap_err();
        assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
    }
}
