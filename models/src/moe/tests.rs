//! Tests of the shared MoE pieces: the generic in-memory step ([`crate::lm::loss_parts_and_grads`])
//! reproduces MoE-GPT's own ([`crate::Gpt::loss_parts_and_grads`]) bitwise — so MoE-GPT's
//! behaviour through the trait's new calls ([`crate::MoeLm::finish_forward`],
//! [`crate::MoeLm::aux_loss`]: defaults) is unchanged — and the dense path is the dense loop.

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::lm::{loss_and_grads, loss_parts_and_grads, CausalLm};
use crate::{init_params, Gpt, GptConfig, MoeConfig, Routing};

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
        let (want, want_grads) = gpt.loss_parts_and_grads(&params, &tokens, &targets).unwrap();
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
        let p = crate::ops::softmax_last_dim(&t.logits).unwrap();
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
