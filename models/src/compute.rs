//! How a model computes its unit calls, written once for every family: which of each op's two
//! forms runs ([`crate::kernels`]: the fused CPU kernel or the composition of candle ops) and
//! over how many query positions per block the composed attention runs ([`crate::attention`]),
//! with that attention's cache of causal masks; and the attention core of every family in its
//! two forms ([`Compute::attention`]). Set through [`crate::CausalLm::composed_only`] and
//! [`crate::CausalLm::with_attention_chunk`].

use candle_core::Tensor;

use crate::attention::Masks;
use crate::{kernels, ops, Result};

/// A model's compute choices ([`crate::CausalLm::compute`]): the fused CPU kernels on or off,
/// the composed attention's query positions per block, and the composed path's causal masks
/// (one `[chunk, chunk]` triangle per dtype and device, a cache). Default: fused kernels where
/// they apply, the default chunk ([`crate::AttentionShape::default_chunk`]).
pub struct Compute {
    /// Use the fused CPU kernels where they apply; `false` forces the op compositions everywhere
    /// (tests compare the two).
    fused_cpu_kernels: bool,
    /// Query positions per block of the composed attention; `None`: the default
    /// ([`crate::AttentionShape::default_chunk`]).
    attention_chunk: Option<usize>,
    masks: Masks,
}

impl Default for Compute {
    fn default() -> Self {
        Self { fused_cpu_kernels: true, attention_chunk: None, masks: Masks::default() }
    }
}

impl std::fmt::Debug for Compute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compute")
            .field("fused_cpu_kernels", &self.fused_cpu_kernels)
            .field("attention_chunk", &self.attention_chunk)
            .finish_non_exhaustive()
    }
}

impl Compute {
    /// Whether the fused CPU kernels may run (`false` after
    /// [`crate::CausalLm::composed_only`]).
    pub fn fused_cpu_kernels(&self) -> bool {
        self.fused_cpu_kernels
    }

    /// The configured query positions per attention block (`None`: the default).
    pub fn attention_chunk(&self) -> Option<usize> {
        self.attention_chunk
    }

    /// Forces the op compositions everywhere.
    pub(crate) fn set_composed_only(&mut self) {
        self.fused_cpu_kernels = false;
    }

    /// Sets the query positions per attention block.
    ///
    /// # Errors
    /// [`crate::Error::Config`] (`attention_chunk`) for `Some(0)`.
    pub(crate) fn set_attention_chunk(&mut self, chunk: Option<usize>) -> Result<()> {
        self.attention_chunk = crate::attention::check_chunk(chunk)?;
        Ok(())
    }

    /// Whether the fused CPU kernels apply to computations on `x`: on, and `x` F32/F64 on the
    /// CPU ([`kernels::fused_supported`]).
    pub(crate) fn fused(&self, x: &Tensor) -> bool {
        self.fused_cpu_kernels && kernels::fused_supported(x)
    }

    /// The causal (grouped-query) attention core: `q` `[B, H, T, hd]` (scaled), `k`, `v`
    /// `[B, KV, T, hd]`, all contiguous → `[B, T, H, hd]`. When `fused` (F32/F64 on the CPU) the
    /// whole sequence's scores `[B, H, T, T]` go through the fused causal softmax
    /// ([`kernels::causal_softmax`]), the `H/KV` query heads that share key/value head `j`
    /// stacked along T (`[B, KV, (H/KV)·T, hd]`) so that their group's keys multiply once;
    /// otherwise the composition over query blocks of the configured chunk
    /// ([`Masks::attention`]: the softmax in F32 for half dtypes, transformers' eager attention).
    pub(crate) fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, fused: bool) -> Result<Tensor> {
        if !fused {
            return self.masks.attention(q, k, v, self.attention_chunk);
        }
        let (b, nh, t, hd) = q.dims4()?;
        let kv = k.dim(1)?;
        let rep = nh / kv;
        let q = q.reshape((b, kv, rep * t, hd))?;
        let att = ops::matmul(&q, &k.t()?)?.reshape((b, nh, t, t))?;
        let att = kernels::causal_softmax(&att)?;
        // [B, KV, rep·T, hd] = [B, H, T, hd]
        Ok(ops::matmul(&att.reshape((b, kv, rep * t, t))?, v)?.reshape((b, nh, t, hd))?.transpose(1, 2)?)
    }
}
