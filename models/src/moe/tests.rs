//! Tests of the shared MoE pieces: the generic in-memory step ([`crate::lm::loss_parts_and_grads`])
//! reproduces MoE-GPT's own step bitwise (the sequence MoE-GPT ran before the families shared
//! one loop, kept here as [`moe_gpt_step`]: the forward's expert outputs kept, the combine's
//! backward, experts in reverse order) — so MoE-GPT's behaviour through the trait's calls
//! ([`crate::MoeLm::finish_forward`], [`crate::MoeLm::aux_loss`]: defaults) is unchanged — and
//! the dense path is the dense loop.

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::lm::{loss_and_grads, loss_parts_and_grads, CausalLm, MoeLm};
use crate::{init_params, Gpt, GptConfig, LossParts, MoeConfig, Routing};

fn ids(b: usize, t: usize, vocab: usize, rng: &mut impl Rng) -> Tensor {
    let v: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..vocab as u32)).collect();
    Tensor::from_vec(v, (b, t), &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// MoE-GPT's step as it ran before the families shared [`loss_parts_and_grads`]: per block the
/// trunk, the experts with tokens and the combine, keeping the trunk's `h`, the routing and the
/// experts' outputs; backward (after the head's) the combine's backward from the kept outputs,
/// the experts in reverse order (an expert without tokens not called, its gradient zero), the
/// scatter of their input gradients and the trunk's backward.
fn moe_gpt_step(gpt: &Gpt, params: &[Tensor], tokens: &Tensor, targets: &Tensor) -> (LossParts, Vec<Tensor>) {
    let cfg = gpt.config();
    let n_units = gpt.units().len();
    let mut x = gpt.forward(0, &params[0], tokens, None).unwrap();
    let mut kept = Vec::with_capacity(cfg.n_layer);
    let mut aux = 0.0;
    for i in 0..cfg.n_layer {
        let tr = gpt.trunk_forward(i, &params[cfg.block_unit(i)], &x).unwrap();
        let mut outs = Vec::with_capacity(tr.routing.num_experts());
        for e in 0..tr.routing.num_experts() {
            outs.push(
                tr.routing
                    .expert_input(e, &tr.h)
                    .unwrap()
                    .map(|h_e| gpt.expert_forward(&params[cfg.expert_unit(i, e)], &h_e).unwrap()),
            );
        }
        let y = gpt.combine(&tr.x1, &tr.routing, &outs).unwrap();
        aux += tr.routing.aux_loss();
        kept.push((x, tr.h, tr.routing, outs));
        x = y;
    }

    let mut grads: Vec<Option<Tensor>> = vec![None; n_units];
    let tied = cfg.tied_head.then(|| &params[0]);
    let head = gpt.head_loss_backward(&params[n_units - 1], &x, tied, targets).unwrap();
    let mut g = head.grads.grad_input.expect("head has an input gradient");
    grads[n_units - 1] = Some(head.grads.grad_params);
    for i in (0..cfg.n_layer).rev() {
        let (x_in, h, routing, outs) = kept.pop().expect("one per block");
        let cg = routing.combine_backward(&g, &outs).unwrap();
        let mut grad_inputs = vec![None; routing.num_experts()];
        for e in (0..routing.num_experts()).rev() {
            let u = cfg.expert_unit(i, e);
            let (Some(h_e), Some(go)) = (routing.expert_input(e, &h).unwrap(), &cg.grad_outputs[e]) else {
                grads[u] = Some(params[u].zeros_like().unwrap());
                continue;
            };
            let eg = gpt.expert_backward(&params[u], &h_e, go).unwrap();
            grads[u] = Some(eg.grad_params);
            grad_inputs[e] = Some(eg.grad_input);
        }
        let grad_h = routing.scatter_input_grads(&grad_inputs).unwrap();
        let u = cfg.block_unit(i);
        let tg = gpt.trunk_backward(i, &params[u], &x_in, &routing, &g, &grad_h, &cg.grad_gates).unwrap();
        grads[u] = Some(tg.grad_params);
        g = tg.grad_input.expect("the trunk has an input gradient");
    }
    let mut g0 = gpt.backward(0, &params[0], tokens, &g, None).unwrap().grad_params;
    if let Some(gt) = head.grads.grad_tied_wte {
        g0 = (g0 + gt).unwrap();
    }
    grads[0] = Some(g0);
    (LossParts { ce: head.loss, aux }, grads.into_iter().map(|g| g.expect("set")).collect())
}

#[test]
fn generic_step_is_moe_gpts_bitwise() {
    for (top_k, capacity_factor, tied, dtype) in
        [(2, None, false, DType::F32), (1, Some(1.0), true, DType::F32), (2, Some(0.75), false, DType::F64)]
    {
        let cfg = GptConfig {
            vocab_size: 64,
            d_model: 16,
            n_layer: 2,
            n_head: 2,
            max_seq_len: 8,
            tied_head: tied,
            moe: Some(MoeConfig { experts: 4, top_k, aux_loss_coef: 0.1, capacity_factor, d_expert: Some(24) }),
            ..GptConfig::default()
        };
        let gpt = Gpt::new(cfg.clone()).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let params: Vec<Tensor> =
            init_params(&cfg.units(), 11).iter().map(|f| crate::unit_tensor(f, dtype, &Device::Cpu).unwrap()).collect();
        let (tokens, targets) = (ids(3, 8, 64, &mut rng), ids(3, 8, 64, &mut rng));
        let (want, want_grads) = moe_gpt_step(&gpt, &params, &tokens, &targets);
        let (got, got_grads) = loss_parts_and_grads(&gpt, &params, &tokens, &targets).unwrap();
        assert_eq!(got.ce.to_bits(), want.ce.to_bits(), "{got:?} vs {want:?}");
        assert_eq!(got.aux.to_bits(), want.aux.to_bits(), "{got:?} vs {want:?}");
        assert!(want.aux > 0.0);
        for (u, (a, b)) in got_grads.iter().zip(&want_grads).enumerate() {
            assert_eq!(bits(a), bits(b), "top_k {top_k} unit {u}");
        }
        let (total, _) = loss_and_grads(&gpt, &params, &tokens, &targets).unwrap();
        assert_eq!(total.to_bits(), want.total().to_bits());
        // The trait's defaults: finish_forward leaves a routing as it was, aux_loss sums the blocks'.
        let moe = gpt.moe().unwrap();
        let x = gpt.forward(0, &params[0], &tokens, None).unwrap();
        let t = moe.trunk_forward(0, &params[cfg.block_unit(0)], &x).unwrap();
        let mut r = t.routing.clone();
        moe.finish_forward(&mut [&mut r]).unwrap();
        assert!(r.aux_weights().is_none());
        assert_eq!(r.aux_loss().to_bits(), t.routing.aux_loss().to_bits());
        let rs: [&Routing; 2] = [&r, &t.routing];
        assert_eq!(moe.aux_loss(&rs).to_bits(), (r.aux_loss() + t.routing.aux_loss()).to_bits());
        // The trunk's router logits are the probabilities' preimage.
        let p = crate::kernels::softmax_last_dim(&t.logits).unwrap();
        assert_eq!(bits(&p), bits(&t.probs));
    }
}

#[test]
fn dense_models_take_the_dense_loop() {
    let cfg = GptConfig { vocab_size: 64, d_model: 16, n_layer: 2, n_head: 2, max_seq_len: 8, ..GptConfig::default() };
    let gpt = Gpt::new(cfg.clone()).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let params: Vec<Tensor> =
        init_params(&cfg.units(), 3).iter().map(|f| crate::unit_tensor(f, DType::F32, &Device::Cpu).unwrap()).collect();
    let (tokens, targets) = (ids(2, 8, 64, &mut rng), ids(2, 8, 64, &mut rng));
    let (loss, grads) = loss_and_grads(&gpt, &params, &tokens, &targets).unwrap();
    let (parts, grads2) = loss_parts_and_grads(&gpt, &params, &tokens, &targets).unwrap();
    assert_eq!((parts.ce.to_bits(), parts.aux), (loss.to_bits(), 0.0));
    for (a, b) in grads.iter().zip(&grads2) {
        assert_eq!(bits(a), bits(b));
    }
}
