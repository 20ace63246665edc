//! How a model computes its unit calls, written once for every family: which of each op's two
//! forms runs ([`crate::kernels`]: the fused CPU kernel or the composition of candle ops) and
//! over how many query positions per block the composed attention runs ([`crate::attention`]),
//! with that attention's cache of causal masks. Set through [`crate::CausalLm::composed_only`]
//! and [`crate::CausalLm::with_attention_chunk`].

use candle_core::Tensor;

use crate::attention::Masks;
use crate::{kernels, Result};

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

    /// The composed path's causal attention core over blocks of the configured chunk
    /// ([`Masks::attention`]): `q` `[B, H, T, hd]`, `k`, `v` `[B, KV, T, hd]` → `[B, T, H, hd]`.
    pub(crate) fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        self.masks.attention(q, k, v, self.attention_chunk)
    }
}
