//! The plan's device part: what a config's run needs on its GPU, by part ([`device_shape`],
//! [`device_plan_for_config`]), and whether it fits the GPU's memory ([`GpuMemory`]).

use oogc_models::{CausalLm, UnitKind};
use serde::Serialize;

use super::PlanError;
use crate::config::TrainConfig;
use crate::runtime::device_plan::{DevicePlan, DeviceShape, SwapperShare};

/// What a config's run needs on its GPU ([`DevicePlan`]) beside the GPU's memory.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuMemory {
    /// The parts.
    pub plan: DevicePlan,
    /// The GPU memory it is compared with, bytes: the profile's when it measured a GPU, else
    /// the datasheet's ([`GpuDatasheet::H100_SXM`](oogc_prefetch::GpuDatasheet::H100_SXM)).
    pub device_memory_bytes: u64,
    /// Where `device_memory_bytes` comes from.
    pub device_memory_source: String,
    /// The run's device is the sim device: candle's buffers are host memory there, the figure is
    /// what the run would need on a GPU, and the sim device's memory is `[budgets] gpu`.
    pub sim: bool,
}

impl GpuMemory {
    /// Whether [`DevicePlan::total_bytes`] fits `device_memory_bytes`.
    pub fn fits(&self) -> bool {
        self.plan.fits(self.device_memory_bytes)
    }

    /// The JSON of `oogc plan --json`'s `device_plan`: `parts` (`name`, `bytes`, `in_pool`),
    /// `in_pool_bytes`, `outside_pool_bytes`, `total_bytes`, `swapper_bytes`, `peak_unit`,
    /// `attention_chunk`, `device_memory_bytes`, `device_memory_source`, `fits`, `sim`.
    pub fn to_json(&self) -> serde_json::Value {
        let p = &self.plan;
        serde_json::json!({
            "parts": p.parts(),
            "in_pool_bytes": p.in_pool_bytes(),
            "outside_pool_bytes": p.outside_pool_bytes(),
            "total_bytes": p.total_bytes(),
            "swapper_bytes": p.swapper_bytes(),
            "peak_unit": p.peak_unit,
            "attention_chunk": p.attention_chunk,
            "device_memory_bytes": self.device_memory_bytes,
            "device_memory_source": self.device_memory_source,
            "fits": self.fits(),
            "sim": self.sim,
        })
    }
}

/// The shape of `cfg`'s run for its device plan ([`DeviceShape`]): batch, micro-batches,
/// sequence, the model's widths (Llama family: key/value heads and head width from its config;
/// GPT: as many key/value heads as heads; MoE: an expert's width × top-k as the MLP), its units'
/// parameters (the largest block or MoE trunk, the head, the embedding), the compute dtype and
/// `[activations] offload`, `[device] attention_chunk` (unset: the models crate's default).
///
/// # Errors
/// [`PlanError::Model`] when a Llama config's checkpoint cannot be read.
pub fn device_shape(cfg: &TrainConfig, model: &dyn CausalLm) -> Result<DeviceShape, PlanError> {
    let dims = model.dims();
    let (d, heads) = (dims.hidden as u64, dims.heads.max(1) as u64);
    let top_k = model.moe().map_or(1, |m| m.experts_per_token()) as u64;
    let (kv_heads, head_dim, d_ff, largest_group) = match &cfg.model {
        crate::config::ModelConfig::Llama(l) => {
            let c = crate::train::llama_config(l, model.vocab_size()).map_err(|e| PlanError::Model(e.to_string()))?;
            // An MoE layer's hidden width per token: top-k experts of the expert width (Qwen3-MoE's
            // and Qwen2-MoE's `moe_intermediate_size`, not the dense `intermediate_size`) plus
            // Qwen2-MoE's shared expert.
            let (i, shared) = if c.is_moe() {
                (c.expert_intermediate_size() as u64, c.shared_expert_width().unwrap_or(0) as u64)
            } else {
                (c.intermediate_size as u64, 0)
            };
            let (kv, hd) = (c.kv_heads() as u64, c.head_dim() as u64);
            (kv, hd, i * top_k + shared, (2 * i.max(shared) * d).max(heads * hd * d))
        }
        crate::config::ModelConfig::Gpt(g) => {
            let ff = g.moe.as_ref().map_or(g.d_ff(), |m| m.d_expert.unwrap_or_else(|| g.d_ff())) as u64;
            (heads, d / heads, ff * top_k, (3 * d * d).max(ff * d))
        }
    };
    let numel = |f: &dyn Fn(&UnitKind) -> bool| {
        model.units().iter().filter(|u| f(&u.kind)).map(|u| u.numel as u64).max().unwrap_or(0)
    };
    Ok(DeviceShape {
        dtype: cfg.train.compute_dtype.dtype(),
        batch: cfg.train.batch_size as u64,
        micro_batches: cfg.train.micro_batches.max(1) as u64,
        seq: cfg.train.seq_len as u64,
        d_model: d,
        d_ff,
        heads,
        kv_heads,
        head_dim,
        layers: dims.layers as u64,
        vocab: model.vocab_size() as u64,
        block_params: numel(&|k| matches!(k, UnitKind::Block(_) | UnitKind::MoeTrunk(_))),
        block_largest_group: largest_group,
        head_params: numel(&|k| matches!(k, UnitKind::Head)),
        embedding_params: numel(&|k| matches!(k, UnitKind::Embedding)),
        tied_head: model.tied_head(),
        activation_offload: cfg.activations.offload,
        attention_chunk: cfg.device.attention_chunk.map(|c| c as u64),
    })
}

/// What `cfg`'s run of `model` needs on its GPU ([`DevicePlan`]): [`device_shape`] and the
/// swapper's share of `[budgets] gpu` as the runtime carves it (gradient and activation staging,
/// candle's copies of the units in use as on CUDA, the device optimizers of
/// `device_optimizer_bytes`). What the trainer compares the pool's peak with.
///
/// # Errors
/// As [`device_shape`].
pub fn device_plan_for_config(
    cfg: &TrainConfig,
    model: &dyn CausalLm,
    device_optimizer_bytes: u64,
) -> Result<DevicePlan, PlanError> {
    let dtype = cfg.train.compute_dtype.dtype();
    let units: Vec<u64> = model.units().iter().map(|u| dtype.num_bytes(u.numel) as u64).collect();
    let share = SwapperShare::new(
        cfg.budgets.gpu.as_u64(),
        &units,
        crate::train::max_units_in_use(model),
        crate::train::activation_offload(cfg, model),
        device_optimizer_bytes,
    );
    Ok(DevicePlan::new(&device_shape(cfg, model)?, &share))
}

#[cfg(test)]
mod tests {
    use oogc_prefetch::HardwareProfile;

    use super::device_shape;
    use crate::config::ModelConfig;
    use crate::plan::plan_args_for_config;
    use crate::plan::tests::example;

    /// The fine-grained MoE families' MLP width per token is top-k × the expert width
    /// (`moe_intermediate_size`), plus Qwen2-MoE's shared expert, not top-k × the dense
    /// `intermediate_size` (8 × too wide for Qwen3-30B-A3B's 6144 against 768).
    #[test]
    fn an_moe_layers_width_is_its_experts_not_the_dense_mlps() {
        let model = |family: &str, extra: &str| -> ModelConfig {
            toml::from_str(&format!(
                "family = \"{family}\"\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 96\n\
                 num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\n\
                 max_position_embeddings = 32\nnum_experts = 8\nnum_experts_per_tok = 4\n{extra}"
            ))
            .unwrap()
        };
        for (family, extra, d_ff) in [
            ("qwen3_moe", "moe_intermediate_size = 12", 4 * 12),
            ("qwen2_moe", "moe_intermediate_size = 12\nshared_expert_intermediate_size = 40", 4 * 12 + 40),
            ("olmoe", "", 4 * 96),
        ] {
            let mut cfg = example("llama-shakespeare.toml");
            cfg.model = model(family, extra);
            let lm = crate::train::build_model(&cfg, 64).unwrap();
            assert_eq!(device_shape(&cfg, lm.as_ref()).unwrap().d_ff, d_ff, "{family}");
        }
    }

    #[test]
    fn the_gpu_figure_of_the_main_job() {
        // configs/llama-shakespeare.toml: d 128, 4 blocks, 4 query heads of 32 over 2 key/value
        // heads, SwiGLU 344, batch 16 × 128 tokens, f32, on the sim device.
        let cfg = example("llama-shakespeare.toml");
        let args = plan_args_for_config(&cfg, &HardwareProfile::default(), false).unwrap();
        let g = args.device.as_ref().unwrap();
        assert!(g.sim);
        let p = &g.plan;
        // A block: q and o 128·128 each, k and v 128·64 each, gate/up 2·344·128, down 344·128,
        // two norms of 128: 181,504 parameters, 726,016 B in f32 — the largest unit.
        let block = 4 * (2 * 16_384 + 2 * 8_192 + 3 * 344 * 128 + 2 * 128);
        assert_eq!(block, 726_016);
        assert_eq!((p.gradient_staging_bytes, p.in_use_copies_bytes), (block, block));
        // Checkpoints: 4 blocks' inputs + the head's, [16, 128, 128] f32 = 1 MiB each.
        assert_eq!(p.checkpoints_bytes, 5 << 20);
        assert_eq!(p.input_gradients_bytes, 2 << 20);
        // The swapper's share is the GPU budget (1900 KiB): staging, candle's copy, residency.
        assert_eq!(p.swapper_bytes(), 1900 << 10);
        assert_eq!(p.peak_unit, crate::runtime::device_plan::PeakUnit::Block);
        assert_eq!(p.attention_chunk, 128);
        assert!(p.attention_bytes > 0 && g.fits());
        let json = g.to_json();
        assert_eq!(json["total_bytes"].as_u64(), Some(p.total_bytes()));
        assert_eq!(json["parts"].as_array().map(Vec::len), Some(12));
    }
}
