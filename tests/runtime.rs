//! The `Runtime` API as a trainer other than ours embeds it: a unit computed on the CPU from its
//! host copy (`fetch_host` / `push_grads_host`, the cold-expert path) trains exactly as the same
//! unit fetched to the device, and moves no bytes H2D.

use candle_core::{Device, Tensor, Var};
use oogc::runtime::{Phase, Runtime, RuntimeConfig, UnitId};

const W: usize = 16;

fn layer(params: &Tensor, x: &Tensor) -> candle_core::Result<Tensor> {
    let w = params.narrow(0, 0, W * W)?.reshape((W, W))?;
    let b = params.narrow(0, W * W, W)?;
    x.matmul(&w)?.broadcast_add(&b)?.tanh()
}

/// Trains 3 layers for `steps` steps; the middle one on the CPU when `cpu_middle`. Returns the
/// losses, the final master weights and the H2D bytes.
fn train(cpu_middle: bool, steps: u64) -> (Vec<f32>, Vec<Vec<f32>>, u64) {
    let numel = W * W + W;
    let mut rt = Runtime::new(RuntimeConfig::sim(4 * numel as u64 * 4), oogc::dist::Ranks::single()).unwrap();
    let units: Vec<UnitId> = (0..3)
        .map(|l| {
            let init: Vec<f32> = (0..numel).map(|i| (((i * 31 + l * 17) % 97) as f32 / 97.0 - 0.5) * 0.3).collect();
            rt.add_unit(&format!("layer{l}"), &init).unwrap()
        })
        .collect();
    if cpu_middle {
        rt.set_unscheduled(units[1]).unwrap();
    }
    let x =
        Tensor::from_vec((0..8 * W).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect::<Vec<_>>(), (8, W), &Device::Cpu)
            .unwrap();
    let target = x.cos().unwrap();
    let mut losses = Vec::new();
    let mut h2d = 0;
    for step in 1..=steps {
        rt.begin_step(step, 1e-2).unwrap();
        let fetch = |rt: &mut Runtime, u: usize, phase| {
            if cpu_middle && u == 1 {
                rt.fetch_host(units[u]).unwrap()
            } else {
                rt.fetch(units[u], phase).unwrap()
            }
        };
        let mut inputs = Vec::new();
        let mut h = x.clone();
        for u in 0..3 {
            let p = fetch(&mut rt, u, Phase::Forward);
            inputs.push(h.clone());
            h = layer(p.tensor(), &h).unwrap();
        }
        let diff = (h - &target).unwrap();
        losses.push(diff.sqr().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap());
        let mut grad = (diff * (2.0 / (8 * W) as f64)).unwrap();
        for u in (0..3).rev() {
            let p = fetch(&mut rt, u, Phase::Backward);
            let (w, input) = (Var::from_tensor(p.tensor()).unwrap(), Var::from_tensor(&inputs[u]).unwrap());
            drop(p);
            let grads = (layer(w.as_tensor(), input.as_tensor()).unwrap() * &grad)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let g = grads.get(&w).unwrap();
            if cpu_middle && u == 1 {
                rt.push_grads_host(units[u], g).unwrap();
            } else {
                rt.push_grads(units[u], g).unwrap();
            }
            grad = grads.get(&input).unwrap().clone();
        }
        h2d += rt.finish_step().unwrap().figures.h2d_bytes;
    }
    rt.sync().unwrap();
    let params = units.iter().map(|&u| rt.unit_state(u).unwrap().master).collect();
    (losses, params, h2d)
}

#[test]
fn a_unit_computed_on_the_cpu_trains_exactly_as_on_the_device_and_moves_no_h2d_bytes() {
    let (loss_dev, params_dev, h2d_dev) = train(false, 6);
    let (loss_cpu, params_cpu, h2d_cpu) = train(true, 6);
    assert_eq!(loss_dev, loss_cpu);
    assert_eq!(params_dev, params_cpu);
    assert!(loss_dev[5] < loss_dev[0], "{loss_dev:?}");
    // The middle unit's fetches (forward + backward each step, or once when kept) are gone.
    let unit_bytes = ((W * W + W) * 4) as u64;
    assert!(h2d_cpu + 6 * unit_bytes <= h2d_dev, "cpu {h2d_cpu} vs device {h2d_dev}");
}
