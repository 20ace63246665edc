//! What a training run needs on its GPU, by part: [`DevicePlan`]. `[budgets] gpu` covers only
//! the swapper's share (compute copies, staging, candle's copies of the units in use, device
//! optimizers); candle's activations, the working set of a unit's forward and backward, the
//! attention scores, autograd's copies, cuBLAS's workspace and the CUDA context come on top.
//! `oogc plan` prints the whole figure and whether it fits the GPU; a run compares the memory
//! pool's high-water mark (`device_peak_bytes`) with [`DevicePlan::in_pool_bytes`] and names
//! [`DevicePlan::largest_parts`] when it passes it. Pure: plain data in, bytes out.
//!
//! | part | bytes | in the pool |
//! |---|---|---|
//! | `residency` | the residency manager's compute copies: `min(GPU budget − staging − candle's copies − device optimizers, every compute copy)` | yes |
//! | `gradient_staging` | the runtime's gradient staging buffers (the largest unit's compute copy each) | yes |
//! | `activation_staging` | with `[activations] offload`: the checkpoints' staging buffers | yes |
//! | `in_use_copies` | candle's own copy of each unit in use (a device-to-device copy at the fetch) | yes |
//! | `device_optimizers` | `[optimizer] device_units`: 16 B per parameter with f32 moments (12 with bf16, 10.03 with int8: `device_optimizer_bytes`) + the compute copy | yes |
//! | `checkpoints` | the activation checkpoints kept on the device: `(layers·k + k)·B·T·d` elements of the compute dtype (`k` micro-batches; the head's inputs are the `+ k`); with `[activations] offload` only the `k` of the block in backward and the head's `k` | yes |
//! | `input_gradients` | the gradients flowing between units, `2·k·B·T·d` elements of the compute dtype (the ones a unit receives and the ones it returns); with a tied head also the head's gradient of the embedding (its parameters, compute dtype) | yes |
//! | `working_set` | the peak unit's backward (recompute + VJP) at its peak, less the two parts below: norms, residuals, MLP activations and their gradients (blocks); the logits `[B·T, V]` and the softmax/loss gradient in f32 (head); the rows' gradients summed in f32 (embedding) | yes |
//! | `attention` | in a block's backward: q/k/v and their gradients, and the attention core's recomputation of one query block at a time ([`attention_bytes`]: the models crate's bound, `B·H·chunk·T` f32 scores, never `[B, H, T, T]`) | yes |
//! | `autograd` | the peak unit's parameters copied into `Var`s, their gradients (one tensor per group, then the flat concatenation), and with `k > 1` the gradient summed over the micro-batches (f32 for half dtypes) | yes |
//! | `cublas_workspace` | cuBLAS's workspace of candle's one handle: [`CUBLAS_WORKSPACE_BYTES`] | no |
//! | `cuda_context` | the CUDA context (module images, local memory, the runtime's own reserve): [`CUDA_CONTEXT_BYTES`] | no |
//!
//! **The unit's backward** (`working_set` + `attention` + `autograd`). candle's autograd keeps
//! every tensor of the recomputed forward alive until the backward ends, allocates a zero
//! gradient for every input of an op (tracked or not: the causal mask's broadcast and a
//! detached max get full-size gradients that live until the gradient store is dropped), and
//! accumulates each gradient as `zeros + g` (three tensors of the size at that moment). What is
//! alive at the peak therefore depends on which op the peak falls in, and is modelled as the
//! largest of a few **phases**, each a sum of per-element coefficients (bytes) times the sizes
//! of the unit's tensor classes, with `N = B·T` tokens of one micro-batch:
//!
//! | unit | classes (elements) | phases |
//! |---|---|---|
//! | block | `X = N·d`, `Q = N·H·hd`, `K = N·KV·hd`, `M = N·I`, `P` (the block's parameters), `W` (its largest parameter group: `[2I, d]` gate/up), `A` (the attention core's backward peak, bytes: [`attention_bytes`]) | 4 (f32) or 5 (half): attention, MLP, projections, parameter gradients, residual stream |
//! | head | `L = N·V`, `X`, `P` | 3: the loss's softmax and its gradient, the parameters' gradients, the norm |
//! | embedding | `X`, `P`, `U·d` (`U = min(N, V)` distinct rows) | 2 |
//!
//! The coefficients are measured: the peak heap bytes of candle's composed Llama backward on
//! the CPU (`composed_only`, the op sequence a CUDA device runs; in f32, and in f16 for half
//! dtypes, which takes the same f32 upcasts as bf16 — the CPU's bf16 matmul adds f32 copies a
//! GPU does not make) counted by a `GlobalAlloc`, over 300 random block shapes (query blocks of
//! 16 rows to the whole sequence) and 150 head and embedding shapes (d 64–1024, `I` 128–2048,
//! 2–8 heads, 1–8 key/value heads, head width 16–128, vocabulary 512–8192, 32–384 tokens × 1–3
//! sequences), fitted phase by phase by non-negative least squares of relative errors (several
//! random starts of the phases' assignment): blocks within −5.8 %…+2.8 % (f32) and
//! −5.1 %…+5.7 % (half), heads and embeddings within 1 % (f32) and −3.5 %…+1.5 % (half).
//! `tests/device_plan.rs` measures other shapes again against this module. GPT blocks
//! (LayerNorm, GELU MLP, fused qkv) and MoE blocks are planned with the Llama block's
//! coefficients (`I` the MLP's width; MoE: an expert's width × top-k): approximate.
//!
//! On the sim device candle's buffers are host memory: the plan's figure is what the run would
//! need on a GPU. The real check is on the GPU: `oogc gpu-check` compares the pool's measured
//! high-water mark with [`DevicePlan::in_pool_bytes`].

use oogc_models::{attention_workspace_bytes, AttentionShape};
use oogc_swapper::DType;
use serde::Serialize;

use super::activations::STAGING as ACTIVATION_STAGING;
use super::grads::STAGING_BUFFERS;
use super::ActivationOffload;

/// cuBLAS's workspace of one handle, bytes: 32 MiB, the size the cuBLAS documentation
/// (`cublasSetWorkspace`) recommends for Hopper GPUs (4 MiB for earlier ones) and what cuBLAS
/// and cuBLASLt take there by default (cudarc's cuBLASLt `Workspace` allocates the same: 32 MiB
/// from compute capability 9). candle opens one cuBLAS handle per device
/// (`CudaDevice::new_with_stream`); cuBLAS allocates its workspace itself, outside the
/// stream-ordered pool candle's tensors come from.
pub const CUBLAS_WORKSPACE_BYTES: u64 = 32 << 20;

/// The CUDA context's device memory, bytes: 512 MiB, stated, not measured here (no GPU on the
/// development machine). It holds the loaded module images (candle's kernels, cuBLAS's), local
/// memory sized for every SM's resident threads and the runtime's own reserve; a context on an
/// H100 is commonly reported at 0.5 GB in `nvidia-smi` before any allocation. Outside the
/// stream-ordered pool. gpu-check can measure it (`nvidia-smi`'s process memory less the pool's).
pub const CUDA_CONTEXT_BYTES: u64 = 512 << 20;

/// The shape of a run as its device memory depends on it (plain data).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DeviceShape {
    /// The compute dtype (compute copies, activations, gradients).
    pub dtype: DType,
    /// Sequences per micro-batch (`[train] batch_size`).
    pub batch: u64,
    /// Micro-batches per step (`[train] micro_batches`; at least 1).
    pub micro_batches: u64,
    /// Tokens per sequence `T`.
    pub seq: u64,
    /// Width of the residual stream `d`.
    pub d_model: u64,
    /// Width of a block's MLP `I` (SwiGLU: the gate's and the up projection's each).
    pub d_ff: u64,
    /// Query heads `H`.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Width of a head `hd`.
    pub head_dim: u64,
    /// Blocks.
    pub layers: u64,
    /// Vocabulary `V`.
    pub vocab: u64,
    /// Parameters of the largest block.
    pub block_params: u64,
    /// Elements of a block's largest parameter group (Llama: the merged `[2I, d]` gate/up).
    pub block_largest_group: u64,
    /// Parameters of the head (its norm and output projection).
    pub head_params: u64,
    /// Parameters of the embedding.
    pub embedding_params: u64,
    /// Whether the head uses the embedding as its output projection.
    pub tied_head: bool,
    /// `[activations] offload`: the blocks' checkpoints live in pinned host memory.
    pub activation_offload: bool,
    /// Query rows per attention chunk; `None`: [`default_attention_chunk`].
    pub attention_chunk: Option<u64>,
}

impl DeviceShape {
    /// Tokens of one micro-batch, `B·T`.
    pub fn tokens(&self) -> u64 {
        self.batch * self.seq
    }

    /// The attention chunk in force: [`DeviceShape::attention_chunk`] (within `1..=T`) or
    /// [`default_attention_chunk`].
    pub fn chunk(&self) -> u64 {
        self.attention_chunk
            .unwrap_or_else(|| default_attention_chunk(self.batch, self.seq, self.heads))
            .clamp(1, self.seq.max(1))
    }

    fn half(&self) -> bool {
        matches!(self.dtype, DType::BF16 | DType::F16)
    }

    fn elem_bytes(&self) -> u64 {
        self.dtype.num_bytes(1) as u64
    }
}

/// The swapper's share of the GPU budget, as the runtime carves it (bytes; plain data).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SwapperShare {
    /// `[budgets] gpu`.
    pub gpu_budget_bytes: u64,
    /// Every unit's compute copy on the device (units computed on the host left out).
    pub compute_copies_bytes: u64,
    /// Gradient staging.
    pub gradient_staging_bytes: u64,
    /// Activation staging (`[activations] offload`).
    pub activation_staging_bytes: u64,
    /// candle's copies of the units in use (on CUDA).
    pub in_use_copies_bytes: u64,
    /// Device optimizers (`[optimizer] device_units`).
    pub device_optimizer_bytes: u64,
}

impl SwapperShare {
    /// The share of a GPU budget of `gpu_budget_bytes` for units of `unit_bytes` (compute
    /// copies) with `max_units_in_use` pinned at once, activation offload `offload` and
    /// `device_optimizer_bytes` of device optimizers: gradient staging and activation staging
    /// as the runtime allocates them (`runtime::staging_bytes`), candle's copies of the
    /// `max_units_in_use` largest units as on CUDA.
    pub fn new(
        gpu_budget_bytes: u64,
        unit_bytes: &[u64],
        max_units_in_use: usize,
        offload: Option<ActivationOffload>,
        device_optimizer_bytes: u64,
    ) -> Self {
        let mut sorted = unit_bytes.to_vec();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let largest = sorted.first().copied().unwrap_or(0);
        Self {
            gpu_budget_bytes,
            compute_copies_bytes: unit_bytes.iter().sum(),
            gradient_staging_bytes: STAGING_BUFFERS as u64 * largest,
            activation_staging_bytes: offload.map_or(0, |a| (ACTIVATION_STAGING * a.checkpoint_bytes) as u64),
            in_use_copies_bytes: sorted.iter().take(max_units_in_use.max(1)).sum(),
            device_optimizer_bytes,
        }
    }

    /// The residency manager's device budget: the GPU budget less staging, candle's copies and
    /// the device optimizers.
    pub fn residency_budget_bytes(&self) -> u64 {
        self.gpu_budget_bytes
            .saturating_sub(self.gradient_staging_bytes + self.activation_staging_bytes)
            .saturating_sub(self.in_use_copies_bytes + self.device_optimizer_bytes)
    }
}

/// The unit whose backward peaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PeakUnit {
    /// The token embedding.
    Embedding,
    /// A decoder block.
    Block,
    /// The final norm and output projection with the loss.
    Head,
}

impl std::fmt::Display for PeakUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeakUnit::Embedding => "embedding",
            PeakUnit::Block => "block",
            PeakUnit::Head => "head",
        })
    }
}

/// One unit's backward at its peak (module docs), bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct UnitPeak {
    /// Activations and their gradients besides attention.
    pub working_set_bytes: u64,
    /// Attention scores, q/k/v, their gradients, the causal mask (blocks only).
    pub attention_bytes: u64,
    /// `Var` copies of the parameters and their gradients.
    pub autograd_bytes: u64,
}

impl UnitPeak {
    /// The sum.
    pub fn total_bytes(&self) -> u64 {
        self.working_set_bytes + self.attention_bytes + self.autograd_bytes
    }
}

/// One part of [`DevicePlan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DevicePart {
    /// Its name (module docs' table).
    pub name: &'static str,
    /// Bytes.
    pub bytes: u64,
    /// Whether it comes from the stream-ordered memory pool (what `device_peak_bytes` measures).
    pub in_pool: bool,
}

/// What a run needs on its GPU, by part (module docs). All figures are bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DevicePlan {
    /// The residency manager's compute copies.
    pub residency_bytes: u64,
    /// Gradient staging.
    pub gradient_staging_bytes: u64,
    /// Activation staging.
    pub activation_staging_bytes: u64,
    /// candle's copies of the units in use.
    pub in_use_copies_bytes: u64,
    /// Device optimizers.
    pub device_optimizer_bytes: u64,
    /// Activation checkpoints kept on the device.
    pub checkpoints_bytes: u64,
    /// Gradients between units (and a tied head's gradient of the embedding).
    pub input_gradients_bytes: u64,
    /// The unit whose backward peaks.
    pub peak_unit: PeakUnit,
    /// Its working set (activations and their gradients besides attention).
    pub working_set_bytes: u64,
    /// Its attention.
    pub attention_bytes: u64,
    /// Its autograd copies and gradients (and the micro-batches' gradient sum).
    pub autograd_bytes: u64,
    /// Query rows per attention chunk planned.
    pub attention_chunk: u64,
    /// cuBLAS's workspace (outside the pool).
    pub cublas_workspace_bytes: u64,
    /// The CUDA context (outside the pool).
    pub cuda_context_bytes: u64,
}

impl DevicePlan {
    /// The plan of a run of `shape` with the swapper's share `swapper` (module docs).
    pub fn new(shape: &DeviceShape, swapper: &SwapperShare) -> Self {
        let s = shape;
        let e = s.elem_bytes();
        let k = s.micro_batches.max(1);
        let x = s.tokens() * s.d_model;
        let kinds = [
            (PeakUnit::Embedding, embedding_peak(s), s.embedding_params),
            (PeakUnit::Block, block_peak(s), s.block_params),
            (PeakUnit::Head, head_peak(s), s.head_params),
        ];
        let (peak_unit, unit, params) =
            kinds.into_iter().max_by_key(|(_, p, _)| p.total_bytes()).expect("three unit kinds");
        // With several micro-batches the unit's gradients are summed (in f32 for half dtypes)
        // while the next micro-batch's backward runs.
        let accumulated = if k > 1 { params * if s.half() { 4 } else { e } } else { 0 };
        let checkpoints = if s.activation_offload { k + k } else { s.layers * k + k };
        let tied = if s.tied_head { s.embedding_params * e } else { 0 };
        Self {
            residency_bytes: swapper.residency_budget_bytes().min(swapper.compute_copies_bytes),
            gradient_staging_bytes: swapper.gradient_staging_bytes,
            activation_staging_bytes: swapper.activation_staging_bytes,
            in_use_copies_bytes: swapper.in_use_copies_bytes,
            device_optimizer_bytes: swapper.device_optimizer_bytes,
            checkpoints_bytes: checkpoints * x * e,
            input_gradients_bytes: 2 * k * x * e + tied,
            peak_unit,
            working_set_bytes: unit.working_set_bytes,
            attention_bytes: unit.attention_bytes,
            autograd_bytes: unit.autograd_bytes + accumulated,
            attention_chunk: s.chunk(),
            cublas_workspace_bytes: CUBLAS_WORKSPACE_BYTES,
            cuda_context_bytes: CUDA_CONTEXT_BYTES,
        }
    }

    /// Every part, in the module docs' order.
    pub fn parts(&self) -> [DevicePart; 12] {
        let part = |name, bytes, in_pool| DevicePart { name, bytes, in_pool };
        [
            part("residency", self.residency_bytes, true),
            part("gradient_staging", self.gradient_staging_bytes, true),
            part("activation_staging", self.activation_staging_bytes, true),
            part("in_use_copies", self.in_use_copies_bytes, true),
            part("device_optimizers", self.device_optimizer_bytes, true),
            part("checkpoints", self.checkpoints_bytes, true),
            part("input_gradients", self.input_gradients_bytes, true),
            part("working_set", self.working_set_bytes, true),
            part("attention", self.attention_bytes, true),
            part("autograd", self.autograd_bytes, true),
            part("cublas_workspace", self.cublas_workspace_bytes, false),
            part("cuda_context", self.cuda_context_bytes, false),
        ]
    }

    /// The swapper's share (residency, staging, candle's copies, device optimizers): what
    /// `[budgets] gpu` covers.
    pub fn swapper_bytes(&self) -> u64 {
        self.parts()[..5].iter().map(|p| p.bytes).sum()
    }

    /// What the stream-ordered memory pool holds at the step's peak: every part but the cuBLAS
    /// workspace and the CUDA context. The run's `device_peak_bytes` (the pool's high-water
    /// mark) is compared with this.
    pub fn in_pool_bytes(&self) -> u64 {
        self.parts().iter().filter(|p| p.in_pool).map(|p| p.bytes).sum()
    }

    /// The cuBLAS workspace and the CUDA context.
    pub fn outside_pool_bytes(&self) -> u64 {
        self.parts().iter().filter(|p| !p.in_pool).map(|p| p.bytes).sum()
    }

    /// What the run needs on the device: in the pool and outside it.
    pub fn total_bytes(&self) -> u64 {
        self.in_pool_bytes() + self.outside_pool_bytes()
    }

    /// Whether the run fits a GPU of `device_memory_bytes`.
    pub fn fits(&self, device_memory_bytes: u64) -> bool {
        self.total_bytes() <= device_memory_bytes
    }

    /// The `n` largest parts (non-zero), largest first: what a run names when its pool's peak
    /// passes the plan (`peak passed the plan; largest parts: ...`).
    pub fn largest_parts(&self, n: usize) -> Vec<DevicePart> {
        let mut parts: Vec<DevicePart> = self.parts().into_iter().filter(|p| p.bytes > 0).collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.bytes));
        parts.truncate(n);
        parts
    }
}

/// The default attention chunk: the models crate's (`AttentionShape::default_chunk`), the most
/// query rows whose f32 scores `[B, H, chunk, T]` stay within 64 MiB, rounded down to a
/// multiple of 16, within `1..=T`.
pub fn default_attention_chunk(batch: u64, seq: u64, heads: u64) -> u64 {
    let shape = AttentionShape {
        batch: batch as usize,
        seq_len: seq as usize,
        heads: heads as usize,
        kv_heads: heads as usize,
        head_dim: 1,
    };
    shape.default_chunk() as u64
}

/// A phase of a block's backward: bytes per element of `X`, `Q`, `K`, `M`, `P`, `W`, and the
/// share of `A` (module docs).
type BlockPhase = [f64; 7];

/// Blocks in f32: attention, parameter gradients, MLP, projections.
const BLOCK_F32: [BlockPhase; 4] = [
    [51.75, 15.95, 36.89, 25.39, 12.6, 0.0, 0.78],
    [79.53, 29.14, 43.16, 23.76, 3.9, 22.16, 0.02],
    [68.91, 29.51, 32.48, 83.87, 4.0, 2.0, 0.0],
    [96.66, 70.39, 67.72, 12.12, 11.47, 0.0, 0.0],
];

/// Blocks in bf16/f16 (softmax, norms and the SwiGLU gate in f32): residual stream, parameter
/// gradients, projections, attention, MLP.
const BLOCK_HALF: [BlockPhase; 5] = [
    [105.74, 30.79, 31.63, 16.53, 4.05, 0.04, 0.0],
    [76.28, 14.2, 15.37, 20.06, 2.1, 10.84, 0.0],
    [79.99, 37.42, 31.56, 11.03, 5.97, 0.0, 0.0],
    [76.17, 0.0, 0.0, 22.07, 0.0, 2.72, 0.86],
    [70.18, 14.78, 15.12, 70.02, 2.39, 0.47, 0.0],
];

/// A phase of the head's backward: bytes per element of `L = N·V`, `X`, `P`.
type HeadPhase = [f64; 3];

/// The head in f32: the loss's softmax, the norm, the parameters' gradients.
const HEAD_F32: [HeadPhase; 3] = [[40.0, 16.3, 4.0], [16.1, 56.0, 8.1], [20.1, 28.1, 24.0]];

/// The head in bf16/f16 (the logits widened to f32 for the loss).
const HEAD_HALF: [HeadPhase; 3] = [[42.0, 26.3, 2.0], [18.1, 64.0, 4.1], [20.0, 32.2, 12.0]];

/// A phase of the embedding's backward: bytes per element of `X`, `P`, `U·d`.
type EmbeddingPhase = [f64; 3];

/// The embedding in f32 (candle's `index_select` backward).
const EMBEDDING_F32: [EmbeddingPhase; 2] = [[28.1, 12.0, 0.0], [36.0, 4.0, 0.0]];

/// The embedding in bf16/f16 (the rows' gradients summed in f32: `ops::embedding_grad`).
const EMBEDDING_HALF: [EmbeddingPhase; 2] = [[5.6, 4.0, 0.5], [4.2, 0.3, 7.5]];

fn bytes(coefficient: f64, elements: u64) -> u64 {
    (coefficient * elements as f64).round() as u64
}

/// The bytes of a block's attention core at the peak of its backward: the models crate's bound
/// (`oogc_models::attention_workspace_bytes(..).backward_peak_bytes`: q, k, v, the output and
/// their gradients, one query block's recomputed scores `B·H·chunk·T` in f32 and its
/// workspace), for one micro-batch of `batch` sequences of `seq` tokens, `heads` query heads over
/// `kv_heads` key/value heads of width `head_dim`, query blocks of `chunk` rows (clamped to
/// `1..=seq`), compute dtype `dtype`.
pub fn attention_bytes(
    batch: u64,
    seq: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    chunk: u64,
    dtype: DType,
) -> u64 {
    let shape = AttentionShape {
        batch: batch as usize,
        seq_len: seq as usize,
        heads: heads as usize,
        kv_heads: kv_heads as usize,
        head_dim: head_dim as usize,
    };
    let dtype = match dtype {
        DType::BF16 => candle_core::DType::BF16,
        DType::F16 => candle_core::DType::F16,
        _ => candle_core::DType::F32,
    };
    attention_workspace_bytes(shape, chunk as usize, dtype).backward_peak_bytes
}

/// A block's backward at its peak: the largest phase (module docs), split into working set
/// (`X`, `M`), attention (`Q`, `K` and the core's `A`) and autograd (`P`, `W`).
pub fn block_peak(s: &DeviceShape) -> UnitPeak {
    let phases: &[BlockPhase] = if s.half() { &BLOCK_HALF } else { &BLOCK_F32 };
    let n = s.tokens();
    let core = attention_bytes(s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, s.chunk(), s.dtype);
    phases
        .iter()
        .map(|p| UnitPeak {
            working_set_bytes: bytes(p[0], n * s.d_model) + bytes(p[3], n * s.d_ff),
            attention_bytes: bytes(p[1], n * s.heads * s.head_dim)
                + bytes(p[2], n * s.kv_heads * s.head_dim)
                + bytes(p[6], core),
            autograd_bytes: bytes(p[4], s.block_params) + bytes(p[5], s.block_largest_group),
        })
        .max_by_key(UnitPeak::total_bytes)
        .unwrap_or_default()
}

/// The head's backward at its peak (module docs).
pub fn head_peak(s: &DeviceShape) -> UnitPeak {
    let phases = if s.half() { &HEAD_HALF } else { &HEAD_F32 };
    let n = s.tokens();
    phases
        .iter()
        .map(|p| UnitPeak {
            working_set_bytes: bytes(p[0], n * s.vocab) + bytes(p[1], n * s.d_model),
            attention_bytes: 0,
            autograd_bytes: bytes(p[2], s.head_params),
        })
        .max_by_key(UnitPeak::total_bytes)
        .unwrap_or_default()
}

/// The embedding's backward at its peak (module docs).
pub fn embedding_peak(s: &DeviceShape) -> UnitPeak {
    let phases = if s.half() { &EMBEDDING_HALF } else { &EMBEDDING_F32 };
    let n = s.tokens();
    let rows = n.min(s.vocab) * s.d_model;
    phases
        .iter()
        .map(|p| UnitPeak {
            working_set_bytes: bytes(p[0], n * s.d_model) + bytes(p[2], rows),
            attention_bytes: 0,
            autograd_bytes: bytes(p[1], s.embedding_params),
        })
        .max_by_key(UnitPeak::total_bytes)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Llama-like shape: d 64, 2 heads of 32, 2 key/value heads, MLP 128, vocabulary 256.
    fn small(dtype: DType) -> DeviceShape {
        DeviceShape {
            dtype,
            batch: 1,
            micro_batches: 1,
            seq: 16,
            d_model: 64,
            d_ff: 128,
            heads: 2,
            kv_heads: 2,
            head_dim: 32,
            layers: 2,
            vocab: 256,
            block_params: 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64,
            block_largest_group: 2 * 128 * 64,
            head_params: 64 + 256 * 64,
            embedding_params: 256 * 64,
            tied_head: false,
            activation_offload: false,
            attention_chunk: None,
        }
    }

    #[test]
    fn attention_of_a_small_case_by_hand() {
        // B 1, T 16, H 2, KV 2, hd 32, one block (chunk 16), f32 (s = f = 4 B): q/y/gy/gq 1024
        // elements, k/v 1024, scores E = 2·16·16 = 512. In and out 2·1024·4 + 2·1024·4 = 16384,
        // q's and y's gradients 2·1024·4 = 8192, k's and v's f32 sums 4·1024·4 = 16384 and
        // copies 2·1024·4 = 8192, three scores-sized tensors 3·512·4 = 6144, the block's mask
        // (2·16·16 + 16²)·4 = 3072 and rows 4·(2·16·32)·4 = 16384: 74752.
        assert_eq!(attention_bytes(1, 16, 2, 2, 32, 16, DType::F32), 74_752);
        // Blocks of 4 queries: E = 128 (1536), mask (2·4·16 + 4²)·4 = 576, rows 4·256·4 = 4096.
        assert_eq!(attention_bytes(1, 16, 2, 2, 32, 4, DType::F32), 16384 + 8192 + 16384 + 8192 + 1536 + 576 + 4096);
        // bf16 (s = 2, f = 4): 8192 + 4096 + 16384 + 4096 + 6144 + mask 3072 + rows 8192 + the
        // block's widened q and k/v (1024 + 1024)·4 = 8192.
        assert_eq!(attention_bytes(1, 16, 2, 2, 32, 16, DType::BF16), 58_368);
    }

    #[test]
    fn the_default_chunk_bounds_a_chunks_scores_at_64_mib() {
        // Llama-3-8B's attention at T 2048, B 1: 32 heads × 2048 keys × 4 B = 256 KiB per query
        // row: 256 rows make 64 MiB.
        assert_eq!(default_attention_chunk(1, 2048, 32), 256);
        assert_eq!(default_attention_chunk(2, 2048, 32), 128);
        // Short sequences are one chunk; a huge row is still one row.
        assert_eq!(default_attention_chunk(1, 128, 4), 128);
        assert_eq!(default_attention_chunk(64, 1 << 20, 64), 1);
    }

    #[test]
    fn scores_scale_linearly_chunked_and_quadratically_whole() {
        let a = |t: u64, chunk: u64| attention_bytes(1, t, 32, 8, 128, chunk, DType::BF16) as f64;
        // A fixed block of 256 queries: every term grows with T (the block's keys, q/k/v).
        let r = a(8192, 256) / a(4096, 256);
        assert!((r - 2.0).abs() < 0.05, "{r}");
        // The whole sequence as one block: the scores' T² dominates at long T.
        let r = a(8192, 8192) / a(4096, 4096);
        assert!(r > 3.5 && r <= 4.0, "{r}");
        assert!(a(2048, 256) < a(2048, 2048) / 2.0);
    }

    #[test]
    fn doubling_the_sequence_doubles_the_checkpoints_and_the_head() {
        let mut s = small(DType::BF16);
        s.seq = 512;
        s.vocab = 32_000;
        s.head_params = 64 + 32_000 * 64;
        s.attention_chunk = Some(64);
        let swapper = SwapperShare::default();
        let one = DevicePlan::new(&s, &swapper);
        let two = DevicePlan::new(&DeviceShape { seq: 1024, ..s }, &swapper);
        assert_eq!(two.checkpoints_bytes, 2 * one.checkpoints_bytes);
        assert_eq!(two.input_gradients_bytes, 2 * one.input_gradients_bytes);
        // The head's logits dominate here: its working set doubles.
        assert_eq!((one.peak_unit, two.peak_unit), (PeakUnit::Head, PeakUnit::Head));
        let r = two.working_set_bytes as f64 / one.working_set_bytes as f64;
        assert!((r - 2.0).abs() < 1e-3, "{r}");
        // Offloaded checkpoints: only the block in backward's and the head's stay.
        let off = DevicePlan::new(&DeviceShape { activation_offload: true, micro_batches: 3, ..s }, &swapper);
        assert_eq!(off.checkpoints_bytes, 6 * s.tokens() * s.d_model * 2);
    }

    #[test]
    fn the_swapper_share_is_the_budget_as_the_runtime_carves_it() {
        // Units of 100, 400, 300 B; 2 in use; no offload; 50 B of device optimizers.
        let share = SwapperShare::new(2000, &[100, 400, 300], 2, None, 50);
        assert_eq!(share.compute_copies_bytes, 800);
        assert_eq!(share.gradient_staging_bytes, 400);
        assert_eq!(share.in_use_copies_bytes, 700);
        // 2000 − 400 − 700 − 50 = 850 of residency budget, of which 800 can be used.
        assert_eq!(share.residency_budget_bytes(), 850);
        let plan = DevicePlan::new(&small(DType::F32), &share);
        assert_eq!(plan.residency_bytes, 800);
        assert_eq!(plan.swapper_bytes(), 800 + 400 + 700 + 50);
        let offload = ActivationOffload { checkpoints: 4, checkpoint_bytes: 64 };
        assert_eq!(SwapperShare::new(2000, &[100], 1, Some(offload), 0).activation_staging_bytes, 128);
    }

    #[test]
    fn the_totals_add_the_parts_and_the_largest_come_first() {
        let plan = DevicePlan::new(&small(DType::BF16), &SwapperShare::new(1 << 20, &[40_000, 70_000], 1, None, 0));
        let sum: u64 = plan.parts().iter().map(|p| p.bytes).sum();
        assert_eq!(plan.total_bytes(), sum);
        assert_eq!(plan.outside_pool_bytes(), CUBLAS_WORKSPACE_BYTES + CUDA_CONTEXT_BYTES);
        let top = plan.largest_parts(3);
        assert_eq!(top[0].name, "cuda_context");
        assert!(top.windows(2).all(|w| w[0].bytes >= w[1].bytes) && top.len() == 3);
        assert!(plan.fits(plan.total_bytes()) && !plan.fits(plan.total_bytes() - 1));
    }

    #[test]
    fn a_micro_batch_sum_of_gradients_is_f32_for_half_dtypes() {
        let s = small(DType::BF16);
        let one = DevicePlan::new(&s, &SwapperShare::default());
        let four = DevicePlan::new(&DeviceShape { micro_batches: 4, ..s }, &SwapperShare::default());
        let params = match one.peak_unit {
            PeakUnit::Block => s.block_params,
            PeakUnit::Head => s.head_params,
            PeakUnit::Embedding => s.embedding_params,
        };
        assert_eq!(four.autograd_bytes - one.autograd_bytes, 4 * params);
    }
}
