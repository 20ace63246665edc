//! Times one unit-wise forward + recompute backward of the MoE-GPT on the CPU, next to the dense
//! GPT of the same shape, and splits one MoE block into its unit calls.
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo run --release --example moe_step -- [d_model n_layer seq batch experts top_k]
//! ```
//!
//! Defaults: d_model 192, n_layer 6, seq 128, batch 16, 8 experts, top-2 (each expert as wide as
//! the dense MLP, so top-2 does about twice the dense MLP's work). Prints medians; no assertion
//! (timings are reported, not tested).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use oogc::models::{init_params, loss, loss_parts_and_grads, unit_tensor, CausalLm, Gpt, GptConfig, MoeConfig, MoeLm};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time<T>(reps: usize, mut f: impl FnMut() -> anyhow::Result<T>) -> anyhow::Result<(f64, T)> {
    let mut times = Vec::with_capacity(reps);
    let mut last = None;
    for _ in 0..reps {
        let t0 = Instant::now();
        last = Some(f()?);
        times.push(t0.elapsed().as_secs_f64());
    }
    Ok((median(times), last.expect("reps >= 1")))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse()).collect::<Result<_, _>>()?;
    let get = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (d, l, t, b, e, k) = (get(0, 192), get(1, 6), get(2, 128), get(3, 16), get(4, 8), get(5, 2));
    let dense_cfg =
        GptConfig { d_model: d, n_layer: l, n_head: (d / 32).max(1), max_seq_len: t, ..GptConfig::default() };
    let moe = MoeConfig { experts: e, top_k: k, ..MoeConfig::default() };
    let moe_cfg = GptConfig { moe: Some(moe), ..dense_cfg.clone() };
    let dev = Device::Cpu;
    let data: Vec<u32> = (0..b * (t + 1)).map(|i| (i * 31 % 251) as u32).collect();
    let seqs = Tensor::from_vec(data, (b, t + 1), &dev)?;
    let tokens = seqs.narrow(1, 0, t)?.contiguous()?;
    let targets = seqs.narrow(1, 1, t)?.contiguous()?;
    println!(
        "d_model {d}, n_layer {l}, seq {t}, batch {b}, {e} experts top-{k}; candle threads = {}",
        candle_core::utils::get_num_threads()
    );
    let reps = 5;
    for cfg in [&dense_cfg, &moe_cfg] {
        let gpt = Gpt::new(cfg.clone())?;
        let params: Vec<Tensor> =
            init_params(&cfg.units(), 0).iter().map(|f| unit_tensor(f, DType::F32, &dev)).collect::<Result<_, _>>()?;
        let (fwd, _) = time(reps, || Ok(loss(&gpt, &params, &tokens, &targets)?))?;
        let (step, (parts, _)) = time(reps, || Ok(loss_parts_and_grads(&gpt, &params, &tokens, &targets)?))?;
        println!(
            "{:5}: {} params in {} units; forward {:.1} ms, forward + recompute backward {:.1} ms = {:.0} tokens/s; \
             ce {:.4} aux {:.4}",
            if cfg.moe.is_some() { "moe" } else { "dense" },
            cfg.num_params(),
            cfg.num_units(),
            fwd * 1e3,
            step * 1e3,
            (b * t) as f64 / step,
            parts.ce,
            parts.aux
        );
        if cfg.moe.is_none() {
            continue;
        }
        // One MoE block, call by call.
        let x = gpt.forward(0, &params[0], &tokens, None)?;
        let trunk = &params[cfg.block_unit(0)];
        let (tf, tr) = time(reps, || Ok(gpt.trunk_forward(0, trunk, &x)?))?;
        let inputs: Vec<Option<Tensor>> =
            (0..e).map(|x| tr.routing.expert_input(x, &tr.h)).collect::<Result<_, _>>()?;
        let (ef, outs) = time(reps, || {
            inputs
                .iter()
                .enumerate()
                .map(|(x, h)| h.as_ref().map(|h| gpt.expert_forward(&params[cfg.expert_unit(0, x)], h)).transpose())
                .collect::<Result<Vec<_>, _>>()
                .map_err(anyhow::Error::from)
        })?;
        let (cf, y) = time(reps, || Ok(gpt.combine(&tr.x1, &tr.routing, &outs)?))?;
        let (cb, cg) = time(reps, || Ok(tr.routing.combine_backward(&y, &outs)?))?;
        let (eb, grad_inputs) = time(reps, || {
            let mut gi = vec![None; e];
            for (x, h) in inputs.iter().enumerate() {
                if let (Some(h), Some(go)) = (h, &cg.grad_outputs[x]) {
                    gi[x] = Some(gpt.expert_backward(&params[cfg.expert_unit(0, x)], h, go)?.grad_input);
                }
            }
            Ok(gi)
        })?;
        let grad_h = tr.routing.scatter_input_grads(&grad_inputs)?;
        let (tb, _) = time(reps, || Ok(gpt.trunk_backward(0, trunk, &x, &tr.routing, &y, &grad_h, &cg.grad_gates)?))?;
        println!(
            "  block 0: trunk forward (incl. routing) {:.2} ms, experts forward {:.2} ms, combine {:.2} ms, \
             combine backward {:.2} ms, experts backward {:.2} ms, trunk backward {:.2} ms; tokens per expert {:?}",
            tf * 1e3,
            ef * 1e3,
            cf * 1e3,
            cb * 1e3,
            eb * 1e3,
            tb * 1e3,
            tr.routing.counts()
        );
    }
    Ok(())
}
