//! CPU speed of one Llama decoder layer, forward and recompute-backward, fused kernels against
//! the op compositions (the path of non-CPU devices), and of the head's loss backward.
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo run --release -p oogc-models --example llama_layer_speed -- \
//!     [hidden=256] [heads=4] [kv_heads=4] [seq=256] [batch=16] [intermediate=688] [vocab=1024]
//! ```
//!
//! Prints the median of 5 timed runs (after one warm-up) per row, in milliseconds, and tokens/s
//! of forward + backward (the work of one layer in one training step with recomputation).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use oogc_models::{init_params, CausalLm, Llama, LlamaConfig};

fn median_ms(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..5)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[2]
}

fn main() -> oogc_models::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let arg = |i: usize, default: usize| args.get(i).copied().unwrap_or(default);
    let (d, h, kv, t, b, inter, vocab) =
        (arg(0, 256), arg(1, 4), arg(2, 4), arg(3, 256), arg(4, 16), arg(5, 688), arg(6, 1024));
    let cfg = LlamaConfig {
        num_key_value_heads: Some(kv),
        max_position_embeddings: t,
        tie_word_embeddings: true,
        ..LlamaConfig::new(vocab, d, inter, 1, h)
    };
    println!(
        "Llama layer: hidden {d}, heads {h} (kv {kv}), intermediate {inter}, seq {t}, batch {b}, vocab {vocab}, \
         threads {}",
        candle_core::utils::get_num_threads()
    );
    let dev = Device::Cpu;
    let params: Vec<Tensor> = init_params(&cfg.units(), 1)
        .iter()
        .map(|f| oogc_models::unit_tensor(f, DType::F32, &dev))
        .collect::<oogc_models::Result<_>>()?;
    let x = Tensor::randn(0f32, 1.0, (b, t, d), &dev)?;
    let g = Tensor::randn(0f32, 1.0, (b, t, d), &dev)?;
    let targets = Tensor::zeros((b, t), DType::U32, &dev)?;
    println!("| path | layer forward ms | layer backward ms | fwd+bwd tokens/s | head loss+backward ms |");
    println!("|---|---|---|---|---|");
    for composed in [false, true] {
        let mut model = Llama::new(cfg.clone())?;
        if composed {
            model = model.composed_only();
        }
        let fwd = median_ms(|| {
            model.forward(1, &params[1], &x, None).expect("forward");
        });
        let bwd = median_ms(|| {
            model.backward(1, &params[1], &x, &g, None).expect("backward");
        });
        let head = median_ms(|| {
            model.head_loss_backward(&params[2], &x, Some(&params[0]), &targets).expect("head");
        });
        let tps = (b * t) as f64 / ((fwd + bwd) / 1e3);
        let path = if composed { "composed" } else { "fused" };
        println!("| {path} | {fwd:.1} | {bwd:.1} | {tps:.0} | {head:.1} |");
    }
    Ok(())
}
