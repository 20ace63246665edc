//! Embedding oogc's `Runtime` in your own trainer: a 4-layer MLP regression on candle whose
//! layers are units that live out of (sim) GPU core, with the CPU AdamW overlapping backward.
//!
//! ```sh
//! cargo run --release --example embed_runtime
//! ```
//!
//! Per step: forward unit by unit (fetch → compute → release, keeping each unit's input), then
//! backward in reverse (fetch → recompute → VJP → `push_grads`), then `finish_step`.

use candle_core::{Device, Tensor, Var};
use oogc::runtime::{Phase, Runtime, RuntimeConfig};

const WIDTH: usize = 64;
const LAYERS: usize = 4;
const BATCH: usize = 32;

/// One layer's flat parameters: `w [WIDTH, WIDTH]` then `b [WIDTH]`.
fn layer(params: &Tensor, x: &Tensor, last: bool) -> candle_core::Result<Tensor> {
    let w = params.narrow(0, 0, WIDTH * WIDTH)?.reshape((WIDTH, WIDTH))?;
    let b = params.narrow(0, WIDTH * WIDTH, WIDTH)?;
    let y = x.matmul(&w)?.broadcast_add(&b)?;
    if last {
        Ok(y)
    } else {
        y.tanh()
    }
}

fn main() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let numel = WIDTH * WIDTH + WIDTH;
    // The GPU budget holds two layers (one in use, one prefetched) plus gradient staging; the
    // model's parameters and optimizer state are 4 × 16 B/param.
    let mut rt = Runtime::new(RuntimeConfig::sim(3 * numel as u64 * 4), oogc::dist::Ranks::single())?;
    let mut units = Vec::new();
    for l in 0..LAYERS {
        let init: Vec<f32> = (0..numel).map(|i| ((i * 7919 + l * 104729) % 1000) as f32 / 1000.0 * 0.2 - 0.1).collect();
        units.push(rt.add_unit(&format!("layer{l}"), &init)?);
    }
    let x = Tensor::randn(0f32, 1.0, (BATCH, WIDTH), &dev)?;
    let target = x.sin()?;
    let mut losses = Vec::new();
    for step in 1..=50u64 {
        rt.begin_step(step, 3e-3)?;
        let mut inputs = Vec::new();
        let mut h = x.clone();
        for (l, &u) in units.iter().enumerate() {
            let p = rt.fetch(u, Phase::Forward)?;
            inputs.push(h.clone());
            h = layer(p.tensor(), &h, l + 1 == LAYERS)?;
        }
        let loss = (h.clone() - &target)?.sqr()?.mean_all()?;
        let mut grad = ((h - &target)? * (2.0 / (BATCH * WIDTH) as f64))?;
        for (l, &u) in units.iter().enumerate().rev() {
            let p = rt.fetch(u, Phase::Backward)?;
            let (w, input) = (Var::from_tensor(p.tensor())?, Var::from_tensor(&inputs[l])?);
            drop(p);
            let out = layer(w.as_tensor(), input.as_tensor(), l + 1 == LAYERS)?;
            let grads = (out * &grad)?.sum_all()?.backward()?;
            rt.push_grads(u, grads.get(&w).expect("weight grad"))?;
            grad = grads.get(&input).expect("input grad").clone();
        }
        let stats = rt.finish_step()?;
        losses.push(loss.to_scalar::<f32>()?);
        if step % 10 == 0 {
            println!(
                "step {step:>3}  loss {:.5}  H2D {} B  D2H {} B  stall {:.1} ms",
                loss.to_scalar::<f32>()?,
                stats.figures.h2d_bytes,
                stats.figures.d2h_bytes,
                stats.stall_s() * 1e3
            );
        }
    }
    // CI runs this example: it fails (exit status 1) unless training brought the loss down.
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    anyhow::ensure!(last < 0.5 * first, "the loss went from {first} to {last}: expected it to halve in 50 steps");
    println!("loss {first:.5} -> {last:.5}");
    Ok(())
}
