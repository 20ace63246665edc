//! The `Runtime` API as a trainer other than ours embeds it: a unit computed on the CPU from its
//! host copy (`fetch_host` / `push_grads_host`, the cold-expert path) trains exactly as the same
//! unit fetched to the device, and moves no bytes H2D; `Memory::is_on_device` says whether a
//! fetch will move bytes.

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

/// `Memory::is_on_device` predicts whether a fetch moves bytes H2D (what the MoE metrics count
/// as an expert's H2D bytes and hits): across steps, while a finished update is still to be
/// published (its device copy then stale) as well as after, for units fetched on demand as
/// experts are.
#[test]
fn is_on_device_predicts_whether_a_fetch_moves_bytes() {
    let numel = W * W + W;
    // The budget holds every unit: copies stay on the device until an update makes them stale.
    let mut rt = Runtime::new(RuntimeConfig::sim(8 * numel as u64 * 4), oogc::dist::Ranks::single()).unwrap();
    let units: Vec<UnitId> = (0..3)
        .map(|l| {
            let init: Vec<f32> = (0..numel).map(|i| ((i * 7 + l) % 11) as f32 / 11.0 - 0.5).collect();
            let id = rt.add_unit(&format!("expert{l}"), &init).unwrap();
            rt.set_unscheduled(id).unwrap();
            id
        })
        .collect();
    let mut checked = [0usize; 2];
    for step in 1..=4u64 {
        rt.begin_step(step, 1e-2).unwrap();
        for phase in [Phase::Forward, Phase::Backward] {
            // Unit 2 is used in odd steps only: its update stays unpublished for a step.
            for (k, &u) in units.iter().enumerate().filter(|&(k, _)| k < 2 || step % 2 == 1) {
                let predicted_hit = rt.memory().is_on_device(u);
                let before = rt.memory().residency_metrics().htod.bytes;
                let p = rt.fetch(u, phase).unwrap();
                let moved = rt.memory().residency_metrics().htod.bytes - before;
                assert_eq!(predicted_hit, moved == 0, "step {step} {phase:?} unit {k}: moved {moved} B");
                checked[usize::from(predicted_hit)] += 1;
                if phase == Phase::Backward {
                    let g = (p.tensor().ones_like().unwrap() * 1e-3).unwrap();
                    drop(p);
                    rt.push_grads(u, &g).unwrap();
                }
            }
        }
        rt.finish_step().unwrap();
    }
    // Both outcomes occurred: forward fetches after an update move bytes, backward ones hit.
    assert!(checked[0] > 0 && checked[1] > 0, "{checked:?}");
}
