//! Times one unit-wise forward + recompute backward of the reference GPT on the CPU.
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo run --release --example model_step -- [d_model n_layer seq batch]
//! ```
//!
//! Defaults: d_model 192, n_layer 6, seq 128, batch 16. Prints the median of a few steps and a
//! per-unit split; no assertion (timings are reported, not tested).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use oogc::models::{init_params, loss_and_grads, unit_tensor, CausalLm, Gpt, GptConfig};

fn main() -> anyhow::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse()).collect::<Result<_, _>>()?;
    let get = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (d, l, t, b) = (get(0, 192), get(1, 6), get(2, 128), get(3, 16));
    let cfg = GptConfig { d_model: d, n_layer: l, n_head: (d / 32).max(1), max_seq_len: t, ..GptConfig::default() };
    let gpt = Gpt::new(cfg.clone())?;
    let dev = Device::Cpu;
    let params: Vec<Tensor> =
        init_params(&cfg.units(), 0).iter().map(|f| unit_tensor(f, DType::F32, &dev)).collect::<Result<_, _>>()?;
    let data: Vec<u32> = (0..b * (t + 1)).map(|i| (i * 31 % 251) as u32).collect();
    let seqs = Tensor::from_vec(data, (b, t + 1), &dev)?;
    let tokens = seqs.narrow(1, 0, t)?.contiguous()?;
    let targets = seqs.narrow(1, 1, t)?.contiguous()?;
    println!(
        "d_model {d}, n_layer {l}, n_head {}, seq {t}, batch {b}: {} params; candle threads (RAYON_NUM_THREADS or CPUs) = {}",
        cfg.n_head,
        cfg.num_params(),
        candle_core::utils::get_num_threads()
    );

    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let reps = 5;
    let mut fwd = Vec::new();
    let mut step = Vec::new();
    let mut loss = 0.0;
    let mut last_grads = Vec::new();
    for _ in 0..reps {
        let t0 = Instant::now();
        oogc::models::loss(&gpt, &params, &tokens, &targets)?;
        fwd.push(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let (l, grads) = loss_and_grads(&gpt, &params, &tokens, &targets)?;
        step.push(t0.elapsed().as_secs_f64());
        loss = l;
        last_grads = grads;
    }
    // A fingerprint of the gradient bits, to compare runs with different thread counts.
    let mut fingerprint = 0xcbf29ce484222325u64;
    for g in &last_grads {
        for v in g.to_vec1::<f32>()? {
            fingerprint = (fingerprint ^ v.to_bits() as u64).wrapping_mul(0x100000001b3);
        }
    }
    println!("gradient fingerprint (FNV-1a of the f32 bits): {fingerprint:016x}");
    let step_s = median(step);
    println!(
        "forward only (loss): {:.1} ms; forward + recompute backward (loss_and_grads): {:.1} ms = {:.0} tokens/s; loss {loss:.4}",
        median(fwd) * 1e3,
        step_s * 1e3,
        (b * t) as f64 / step_s
    );

    // Per-unit split: one block's forward and backward, the head's loss backward.
    let x = gpt.forward(0, &params[0], &tokens, None)?;
    let (mut bf, mut bb, mut hb, mut eb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        let t0 = Instant::now();
        let y = gpt.forward(1, &params[1], &x, None)?;
        bf.push(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        gpt.backward(1, &params[1], &x, &y, None)?;
        bb.push(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let h = gpt.head_loss_backward(&params[l + 1], &x, None, &targets)?;
        hb.push(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        gpt.backward(0, &params[0], &tokens, h.grads.grad_input.as_ref().unwrap(), None)?;
        eb.push(t0.elapsed().as_secs_f64());
    }
    println!(
        "per unit: block forward {:.1} ms, block backward (recompute + VJP) {:.1} ms, head loss backward {:.1} ms, embedding backward {:.1} ms",
        median(bf) * 1e3,
        median(bb) * 1e3,
        median(hb) * 1e3,
        median(eb) * 1e3
    );
    Ok(())
}
