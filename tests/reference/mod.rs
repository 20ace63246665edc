//! The independent in-memory reference for "offloaded training equals in-memory training"
//! (DESIGN.md invariant 3): the same model, data, schedule and AdamW as a plain loop — the
//! model's unit calls on tensors in memory and the optimizer's one-thread kernel — with no
//! `Runtime`, no swapper, no pipelined optimizer and no prefetch. With `[train] compute_dtype =
//! "bf16"` the units compute on bf16 copies of the fp32 master weights (rounded by candle's cast)
//! and the optimizer reads their bf16 gradients, as mixed precision does.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use oogc::config::TrainConfig;
use oogc::data::{Corpus, Sampler};
use oogc::models::{init_params, CausalLm, UnitKind};
use oogc::optimizer::{adam_step, clip_scale, global_norm, grad_sumsq, CopyOut, DType, Grads, Isa, StateIo};
use oogc::train::{build_model, lr_schedule, optimizer_config};

/// What the reference run produced: the training loss of every step and the final master
/// weights of every unit.
pub struct Reference {
    pub losses: Vec<f64>,
    pub params: Vec<Vec<f32>>,
}

/// The loss of one batch and the gradient of every unit that has one (MoE experts without
/// tokens have none), computed unit by unit as the model's docs spell out: forward keeping each
/// block's input, the head's loss and backward, the blocks' backward in reverse by recompute.
fn loss_and_grads(
    model: &dyn CausalLm,
    params: &[Tensor],
    tokens: &Tensor,
    targets: &Tensor,
) -> (f64, BTreeMap<usize, Tensor>) {
    let units = model.units();
    let head = units.len() - 1;
    let tied = model.tied_head().then(|| &params[0]);
    let mut grads = BTreeMap::new();
    // Forward.
    let mut x = model.forward(0, &params[0], tokens, None).unwrap();
    let mut saved = Vec::new();
    let mut u = 1;
    while u < head {
        match units[u].kind {
            UnitKind::Block(_) => {
                let y = model.forward(u, &params[u], &x, None).unwrap();
                saved.push((u, std::mem::replace(&mut x, y), None));
                u += 1;
            }
            UnitKind::MoeTrunk(block) => {
                let moe = model.moe().unwrap();
                let n =
                    units.iter().filter(|s| matches!(s.kind, UnitKind::Expert { block: b, .. } if b == block)).count();
                let t = moe.trunk_forward(block, &params[u], &x).unwrap();
                let outs: Vec<Option<Tensor>> = (0..n)
                    .map(|e| {
                        t.routing
                            .expert_input(e, &t.h)
                            .unwrap()
                            .map(|h| moe.expert_forward(&params[u + 1 + e], &h).unwrap())
                    })
                    .collect();
                let y = moe.combine(&t.x1, &t.routing, &outs).unwrap();
                saved.push((u, std::mem::replace(&mut x, y), Some((block, n, t.routing))));
                u += 1 + n;
            }
            other => panic!("unexpected unit kind {other:?} between the embedding and the head"),
        }
    }
    // A load-balancing loss pooled over the blocks (Mixtral) needs the pass's routings together.
    if let Some(moe) = model.moe() {
        let mut routings: Vec<_> = saved.iter_mut().filter_map(|(_, _, m)| m.as_mut().map(|(_, _, r)| r)).collect();
        moe.finish_forward(&mut routings).unwrap();
    }
    // The head.
    let out = model.head_loss_backward(&params[head], &x, tied, targets).unwrap();
    grads.insert(head, out.grads.grad_params);
    let mut g = out.grads.grad_input.unwrap();
    // Backward.
    for (u, input, moe_block) in saved.into_iter().rev() {
        match moe_block {
            None => {
                let ug = model.backward(u, &params[u], &input, &g, None).unwrap();
                grads.insert(u, ug.grad_params);
                g = ug.grad_input.unwrap();
            }
            Some((block, n, routing)) => {
                let moe = model.moe().unwrap();
                let t = moe.trunk_forward(block, &params[u], &input).unwrap();
                let (mut grad_inputs, mut grad_gates) = (vec![None; n], vec![None; n]);
                for e in 0..n {
                    let Some(h_e) = routing.expert_input(e, &t.h).unwrap() else { continue };
                    let grad_out = moe.expert_grad_output(&routing, e, &g).unwrap().unwrap();
                    let eg = moe.expert_backward(&params[u + 1 + e], &h_e, &grad_out).unwrap();
                    grad_gates[e] = moe.expert_grad_gate(&routing, e, &g, &eg.output).unwrap();
                    grad_inputs[e] = Some(eg.grad_input);
                    grads.insert(u + 1 + e, eg.grad_params);
                }
                let grad_h = routing.scatter_input_grads(&grad_inputs).unwrap();
                let tg = moe.trunk_backward(block, &params[u], &input, &routing, &g, &grad_h, &grad_gates).unwrap();
                grads.insert(u, tg.grad_params);
                g = tg.grad_input.unwrap();
            }
        }
    }
    let mut g0 = model.backward(0, &params[0], tokens, &g, None).unwrap().grad_params;
    if let Some(extra) = out.grads.grad_tied_wte {
        g0 = (g0 + extra).unwrap();
    }
    grads.insert(0, g0);
    (out.loss, grads)
}

/// Trains `cfg`'s model for `steps` steps in memory: init from `train.seed`, the seeded batches,
/// the warmup + cosine schedule, the global-norm clip over the units with gradients (in unit
/// order) and AdamW with the global step `t` (a skipped step does not advance it); a unit
/// without gradient is not updated.
pub fn train(cfg: &TrainConfig, steps: u64) -> Reference {
    let data = Corpus::load(&cfg.data.source(cfg.train.seq_len), &mut |_, _| {}).unwrap();
    let model = build_model(cfg, data.vocab_size()).unwrap();
    let mut master = init_params(model.units(), cfg.train.seed);
    let mut m: Vec<Vec<f32>> = master.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut v = m.clone();
    let mut sampler = Sampler::new(cfg.train.seed);
    let (opt, schedule, isa) = (optimizer_config(cfg), lr_schedule(cfg), Isa::detect());
    let (b, t) = (cfg.train.batch_size, cfg.train.seq_len);
    let compute = match opt.compute_dtype {
        DType::BF16 => candle_core::DType::BF16,
        _ => candle_core::DType::F32,
    };
    let (mut losses, mut updates) = (Vec::new(), 0u64);
    for step in 1..=steps {
        let lr = schedule.lr(step);
        let batch = data.next_batch(&mut sampler, b, t);
        let tokens = Tensor::from_slice(&batch.inputs, (b, t), &Device::Cpu).unwrap();
        let targets = Tensor::from_slice(&batch.targets, (b, t), &Device::Cpu).unwrap();
        // The compute copies: the master weights in the compute dtype.
        let params: Vec<Tensor> = master
            .iter()
            .map(|p| Tensor::from_slice(p, p.len(), &Device::Cpu).unwrap().to_dtype(compute).unwrap())
            .collect();
        let (loss, grads) = loss_and_grads(&*model, &params, &tokens, &targets);
        losses.push(loss);
        let grads: BTreeMap<usize, Grads> = grads
            .into_iter()
            .map(|(u, g)| {
                let g = match opt.compute_dtype {
                    DType::BF16 => Grads::BF16(g.to_vec1().unwrap()),
                    _ => Grads::F32(g.to_vec1().unwrap()),
                };
                (u, g)
            })
            .collect();
        let norm = global_norm(grads.values().map(|g| grad_sumsq(isa, g.as_slice()).unwrap()));
        if !norm.is_finite() {
            continue;
        }
        let scalars = opt.adam.scalars(updates + 1, lr, clip_scale(norm, opt.clip_norm)).unwrap();
        for (u, g) in &grads {
            let state = StateIo::InPlace { p: &mut master[*u], m: &mut m[*u], v: &mut v[*u] };
            adam_step(isa, &scalars, state, g.as_slice(), CopyOut::None).unwrap();
        }
        updates += 1;
    }
    Reference { losses, params: master }
}
