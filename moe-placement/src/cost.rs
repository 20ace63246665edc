//! Where a cold expert computes: fetched to the GPU, or on the CPU from its host copy.
//!
//! Fiddler (Kamahori et al. 2024, "Fiddler: CPU-GPU orchestration for fast inference of MoE
//! models") computes a cold expert on the CPU when few tokens are routed to it: moving the
//! weights costs `bytes / bandwidth` whatever the token count, while CPU compute grows with the
//! tokens. In training both directions count, so the model here is (seconds, per step):
//!
//! | placement | cost of an expert with `t` tokens |
//! |---|---|
//! | [`Placement::Resident`] (hot) | `t·f / gpu_flops` + `grad_bytes / d2h` (its gradients go to the CPU optimizer) |
//! | [`Placement::Fetch`] | `param_bytes / h2d` + `t·f / gpu_flops` + `grad_bytes / d2h` |
//! | [`Placement::Cpu`] | `t·f / cpu_flops` (backward on the CPU too; gradients go straight to the CPU optimizer) |
//! | [`Placement::Skip`] (`t = 0`) | nothing: no transfer, no compute |
//!
//! `f` is [`ExpertShape::flops_per_token`]: FLOPs of one token through one expert, forward and
//! backward (with recompute). Activations moved for CPU compute are neglected (a token's hidden
//! state is `d_model` elements; an expert is `2·d_model·d_ff`).
//!
//! The rates are calibrated at start-up from figures the caller measures (a CPU GEMM rate, see
//! [`calibrate_cpu_gemm`]; the link bandwidth) and corrected online from measured times
//! ([`CostModel::observe_cpu`], [`CostModel::observe_fetch`], ...): each observation moves the
//! rate by an exponential moving average of weight [`CostModelConfig::observe_weight`].
//!
//! **The block model** ([`CostModel::block_cost`], used by [`CostModel::place_block`] and the
//! `oogc bench moe` replay): the experts of one block run on two engines at once. The GPU path
//! fetches cold experts on the H2D link while it computes the resident ones, and computes a
//! fetched one after it arrives: `gpu_path_s = max(gpu_s, h2d_s + g_last)`, with `g_last` the
//! GPU time of the smallest fetched expert (computed last). Gradients leave on the D2H link
//! (`d2h_s`) overlapping later compute; the CPU computes its experts in parallel (`cpu_s`).
//! `block_s = max(gpu_path_s, d2h_s, cpu_s)`.

use serde::{Deserialize, Serialize};

use crate::error::{config, positive, Result};

/// Where one expert runs in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Hot: its compute copy is on the GPU; compute there.
    Resident,
    /// Cold: copy it host → device, then compute on the GPU.
    Fetch,
    /// Cold: compute forward and backward on the CPU from the host copy.
    Cpu,
    /// No tokens were routed to it: no transfer, no compute.
    Skip,
}

/// The size of one expert (every expert of a model has the same shape).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ExpertShape {
    /// Bytes of the compute copy moved by a fetch (H2D).
    pub param_bytes: u64,
    /// Bytes of the gradients sent to the CPU optimizer (D2H) after a GPU backward.
    pub grad_bytes: u64,
    /// FLOPs per routed token, forward + backward (recompute included): about 8 × the expert's
    /// parameters for a two-matrix MLP with recompute (2 forward, 2 recompute, 4 backward).
    pub flops_per_token: f64,
}

/// The start-up figures of a [`CostModel`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModelConfig {
    /// Host → device bandwidth, GB/s (10⁹ B/s). Default: 16 (PCIe 4.0 x16 achieved).
    pub h2d_gbps: f64,
    /// Device → host bandwidth, GB/s (10⁹ B/s). Default: 16.
    pub d2h_gbps: f64,
    /// Achieved GPU rate on expert GEMMs, GFLOP/s (10⁹ FLOP/s). Default: 50 000.
    pub gpu_gflops: f64,
    /// Achieved CPU rate on expert GEMMs, GFLOP/s; measure it ([`calibrate_cpu_gemm`], or the
    /// trainer's own CPU matmul). Default: 100.
    pub cpu_gflops: f64,
    /// Weight of one online observation in the rate's moving average, in `(0, 1]`. Default: 0.2.
    pub observe_weight: f64,
}

impl Default for CostModelConfig {
    fn default() -> Self {
        Self { h2d_gbps: 16.0, d2h_gbps: 16.0, gpu_gflops: 50_000.0, cpu_gflops: 100.0, observe_weight: 0.2 }
    }
}

/// The cost of one block's experts under a placement (see the module docs for the model).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct BlockCost {
    /// Expert bytes copied H2D (fetches), bytes.
    pub h2d_bytes: u64,
    /// Gradient bytes copied D2H (resident and fetched experts), bytes.
    pub d2h_bytes: u64,
    /// Tokens computed on the CPU.
    pub cpu_tokens: u64,
    /// H2D link time, seconds.
    pub h2d_s: f64,
    /// D2H link time, seconds.
    pub d2h_s: f64,
    /// GPU compute, seconds.
    pub gpu_s: f64,
    /// CPU compute, seconds.
    pub cpu_s: f64,
    /// The block's predicted time, seconds.
    pub block_s: f64,
}

/// Which placements [`CostModel::place_block`] may choose for cold experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColdMode {
    /// Fetch or CPU, by the cost model.
    FetchOrCpu,
    /// Always fetch (no CPU compute).
    FetchOnly,
}

/// Costs of expert placements, calibrated at start-up and corrected online. Rates are kept in
/// B/s and FLOP/s.
#[derive(Debug, Clone, Serialize)]
pub struct CostModel {
    shape: ExpertShape,
    h2d_bps: f64,
    d2h_bps: f64,
    gpu_flops: f64,
    cpu_flops: f64,
    weight: f64,
}

impl CostModel {
    /// A model for experts of `shape` with the start-up figures `cfg`.
    ///
    /// # Errors
    /// [`crate::Error::Config`] naming the field for a rate that is not a positive number, a
    /// `flops_per_token` that is not, or an `observe_weight` outside `(0, 1]`.
    pub fn new(shape: ExpertShape, cfg: CostModelConfig) -> Result<Self> {
        positive("flops_per_token", shape.flops_per_token)?;
        let w = cfg.observe_weight;
        if !(w.is_finite() && w > 0.0 && w <= 1.0) {
            return Err(config("observe_weight", format!("{w} must be in (0, 1]")));
        }
        Ok(Self {
            shape,
            h2d_bps: positive("h2d_gbps", cfg.h2d_gbps)? * 1e9,
            d2h_bps: positive("d2h_gbps", cfg.d2h_gbps)? * 1e9,
            gpu_flops: positive("gpu_gflops", cfg.gpu_gflops)? * 1e9,
            cpu_flops: positive("cpu_gflops", cfg.cpu_gflops)? * 1e9,
            weight: w,
        })
    }

    /// The expert shape.
    pub fn shape(&self) -> ExpertShape {
        self.shape
    }

    /// The current rates as a [`CostModelConfig`] (GB/s, GFLOP/s), for logs.
    pub fn rates(&self) -> CostModelConfig {
        CostModelConfig {
            h2d_gbps: self.h2d_bps / 1e9,
            d2h_gbps: self.d2h_bps / 1e9,
            gpu_gflops: self.gpu_flops / 1e9,
            cpu_gflops: self.cpu_flops / 1e9,
            observe_weight: self.weight,
        }
    }

    /// Seconds to copy `bytes` host → device.
    pub fn h2d_s(&self, bytes: u64) -> f64 {
        bytes as f64 / self.h2d_bps
    }

    /// Seconds to copy `bytes` device → host.
    pub fn d2h_s(&self, bytes: u64) -> f64 {
        bytes as f64 / self.d2h_bps
    }

    /// GPU seconds for `tokens` tokens through one expert (forward + backward).
    pub fn gpu_s(&self, tokens: f64) -> f64 {
        tokens * self.shape.flops_per_token / self.gpu_flops
    }

    /// CPU seconds for `tokens` tokens through one expert (forward + backward): the cost of
    /// [`Placement::Cpu`].
    pub fn cpu_s(&self, tokens: f64) -> f64 {
        tokens * self.shape.flops_per_token / self.cpu_flops
    }

    /// Seconds of [`Placement::Resident`]: GPU compute and the gradients' D2H.
    pub fn resident_s(&self, tokens: f64) -> f64 {
        self.gpu_s(tokens) + self.d2h_s(self.shape.grad_bytes)
    }

    /// Seconds of [`Placement::Fetch`]: the weights' H2D, GPU compute, the gradients' D2H.
    pub fn fetch_s(&self, tokens: f64) -> f64 {
        self.h2d_s(self.shape.param_bytes) + self.resident_s(tokens)
    }

    /// The placement of one expert with `tokens` routed tokens taken alone: [`Placement::Skip`]
    /// for 0 tokens, [`Placement::Resident`] when hot, else the cheaper of
    /// [`CostModel::cpu_s`] and [`CostModel::fetch_s`] (ties go to the CPU: no transfer).
    pub fn place(&self, tokens: u64, resident: bool) -> Placement {
        if tokens == 0 {
            Placement::Skip
        } else if resident {
            Placement::Resident
        } else if self.cpu_s(tokens as f64) <= self.fetch_s(tokens as f64) {
            Placement::Cpu
        } else {
            Placement::Fetch
        }
    }

    /// The token count above which a cold expert is fetched rather than computed on the CPU,
    /// taken alone; `None` when the CPU is at least as fast as the GPU (always CPU).
    pub fn crossover_tokens(&self) -> Option<f64> {
        let per_token = self.shape.flops_per_token * (1.0 / self.cpu_flops - 1.0 / self.gpu_flops);
        (per_token > 0.0).then(|| (self.h2d_s(self.shape.param_bytes) + self.d2h_s(self.shape.grad_bytes)) / per_token)
    }

    /// The seconds per step saved by keeping an expert resident rather than cold, for an expert
    /// that receives tokens with probability `p_used` per step and `expected_tokens` tokens per
    /// step on average: `p · (cold(t/p) − resident(t/p))`, cold being the cheaper of fetch and
    /// CPU (fetch only under [`ColdMode::FetchOnly`]). 0 for an expert never used. With
    /// `keeps_gradients` (the hot expert's optimizer is on the device) a resident expert costs
    /// its compute alone: its gradients stay on the device.
    pub fn hot_benefit_s(&self, expected_tokens: f64, p_used: f64, mode: ColdMode, keeps_gradients: bool) -> f64 {
        if p_used <= 0.0 || expected_tokens <= 0.0 {
            return 0.0;
        }
        let t = expected_tokens / p_used;
        let cold = match mode {
            ColdMode::FetchOrCpu => self.fetch_s(t).min(self.cpu_s(t)),
            ColdMode::FetchOnly => self.fetch_s(t),
        };
        let resident = if keeps_gradients { self.gpu_s(t) } else { self.resident_s(t) };
        p_used * (cold - resident).max(0.0)
    }

    /// The cost of one block's experts (`tokens[e]` routed to expert `e`) under `placements`
    /// (see the module docs). An expert with 0 tokens costs nothing whatever its placement.
    ///
    /// # Panics
    /// When the slices differ in length.
    pub fn block_cost(&self, tokens: &[u64], placements: &[Placement]) -> BlockCost {
        assert_eq!(tokens.len(), placements.len(), "one placement per expert");
        let mut c = BlockCost::default();
        let mut g_last = f64::INFINITY;
        for (&t, &p) in tokens.iter().zip(placements) {
            if t == 0 {
                continue;
            }
            match p {
                Placement::Skip => {}
                Placement::Cpu => {
                    c.cpu_tokens += t;
                    c.cpu_s += self.cpu_s(t as f64);
                }
                Placement::Resident | Placement::Fetch => {
                    let g = self.gpu_s(t as f64);
                    c.gpu_s += g;
                    c.d2h_bytes += self.shape.grad_bytes;
                    if p == Placement::Fetch {
                        c.h2d_bytes += self.shape.param_bytes;
                        g_last = g_last.min(g);
                    }
                }
            }
        }
        c.h2d_s = self.h2d_s(c.h2d_bytes);
        c.d2h_s = self.d2h_s(c.d2h_bytes);
        let gpu_path = if g_last.is_finite() { c.gpu_s.max(c.h2d_s + g_last) } else { c.gpu_s };
        c.block_s = gpu_path.max(c.d2h_s).max(c.cpu_s);
        c
    }

    /// Places one block's experts: `tokens[e]` tokens routed to expert `e`, `resident[e]` whether
    /// it is hot. Experts with 0 tokens are [`Placement::Skip`], hot ones
    /// [`Placement::Resident`]. Cold ones start from [`CostModel::place`] (each taken alone);
    /// then the block is balanced on its predicted time ([`CostModel::block_cost`]), where the
    /// CPU and the links run in parallel: the CPU is one engine shared by the block's CPU
    /// experts, so the CPU expert with the most tokens moves back to [`Placement::Fetch`] while
    /// that lowers the block's time; then, while the CPU has room, the fetched expert with the
    /// fewest tokens moves to the CPU while that lowers it (each one saves the same bytes).
    ///
    /// # Panics
    /// When the slices differ in length.
    pub fn place_block(&self, tokens: &[u64], resident: &[bool], mode: ColdMode) -> Vec<Placement> {
        assert_eq!(tokens.len(), resident.len(), "one residency flag per expert");
        let mut p: Vec<Placement> = tokens
            .iter()
            .zip(resident)
            .map(|(&t, &r)| match (self.place(t, r), mode) {
                (Placement::Cpu, ColdMode::FetchOnly) => Placement::Fetch,
                (x, _) => x,
            })
            .collect();
        let mut best = self.block_cost(tokens, &p).block_s;
        while let Some(e) = (0..p.len()).filter(|&e| p[e] == Placement::Cpu).max_by_key(|&e| (tokens[e], e)) {
            p[e] = Placement::Fetch;
            let s = self.block_cost(tokens, &p).block_s;
            if s < best {
                best = s;
            } else {
                p[e] = Placement::Cpu;
                break;
            }
        }
        if mode == ColdMode::FetchOrCpu {
            while let Some(e) = (0..p.len()).filter(|&e| p[e] == Placement::Fetch).min_by_key(|&e| (tokens[e], e)) {
                p[e] = Placement::Cpu;
                let s = self.block_cost(tokens, &p).block_s;
                if s < best {
                    best = s;
                } else {
                    p[e] = Placement::Fetch;
                    break;
                }
            }
        }
        p
    }

    fn blend(&self, old: f64, measured: f64) -> f64 {
        if measured.is_finite() && measured > 0.0 {
            (1.0 - self.weight) * old + self.weight * measured
        } else {
            old
        }
    }

    /// Corrects the CPU rate from a measured CPU expert computation: `tokens` tokens (forward +
    /// backward) took `seconds`. Ignored for 0 tokens or a non-positive time.
    pub fn observe_cpu(&mut self, tokens: u64, seconds: f64) {
        if tokens > 0 && seconds > 0.0 {
            self.cpu_flops = self.blend(self.cpu_flops, tokens as f64 * self.shape.flops_per_token / seconds);
        }
    }

    /// Corrects the GPU rate from a measured GPU expert computation of `tokens` tokens.
    pub fn observe_gpu(&mut self, tokens: u64, seconds: f64) {
        if tokens > 0 && seconds > 0.0 {
            self.gpu_flops = self.blend(self.gpu_flops, tokens as f64 * self.shape.flops_per_token / seconds);
        }
    }

    /// Corrects the H2D bandwidth from a measured fetch of `bytes` that took `seconds`.
    pub fn observe_fetch(&mut self, bytes: u64, seconds: f64) {
        if bytes > 0 && seconds > 0.0 {
            self.h2d_bps = self.blend(self.h2d_bps, bytes as f64 / seconds);
        }
    }

    /// Corrects the D2H bandwidth from a measured gradient copy of `bytes` that took `seconds`.
    pub fn observe_d2h(&mut self, bytes: u64, seconds: f64) {
        if bytes > 0 && seconds > 0.0 {
            self.d2h_bps = self.blend(self.d2h_bps, bytes as f64 / seconds);
        }
    }
}

/// Measures this CPU's rate on a small single-threaded f32 matrix product (`n × n` times
/// `n × n`, blocked i-k-j loop), in GFLOP/s. A start-up figure for
/// [`CostModelConfig::cpu_gflops`] when the trainer has no measurement of its own GEMM
/// (candle's is faster: multiply by the CPU threads and prefer an online correction).
/// Takes about `repeats · 2n³` FLOPs (n = 128, repeats = 8: 34 MFLOP, a few ms).
pub fn calibrate_cpu_gemm() -> f64 {
    const N: usize = 128;
    const REPEATS: usize = 8;
    let a: Vec<f32> = (0..N * N).map(|i| (i % 7) as f32 * 0.25).collect();
    let b: Vec<f32> = (0..N * N).map(|i| (i % 5) as f32 * 0.5).collect();
    let mut c = vec![0f32; N * N];
    let start = std::time::Instant::now();
    for _ in 0..REPEATS {
        c.iter_mut().for_each(|x| *x = 0.0);
        for i in 0..N {
            for k in 0..N {
                let aik = a[i * N + k];
                let (row, brow) = (&mut c[i * N..(i + 1) * N], &b[k * N..(k + 1) * N]);
                for (x, &y) in row.iter_mut().zip(brow) {
                    *x += aik * y;
                }
            }
        }
        std::hint::black_box(&mut c);
    }
    let s = start.elapsed().as_secs_f64().max(1e-9);
    (REPEATS * 2 * N * N * N) as f64 / s / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        // 1 MB expert, 1 GB/s links, 1 MFLOP per token, GPU 1 TFLOP/s, CPU 1 GFLOP/s.
        let shape = ExpertShape { param_bytes: 1_000_000, grad_bytes: 1_000_000, flops_per_token: 1e6 };
        let cfg =
            CostModelConfig { h2d_gbps: 1.0, d2h_gbps: 1.0, gpu_gflops: 1000.0, cpu_gflops: 1.0, observe_weight: 1.0 };
        CostModel::new(shape, cfg).unwrap()
    }

    #[test]
    fn zero_tokens_skip_and_cost_nothing() {
        let m = model();
        assert_eq!(m.place(0, false), Placement::Skip);
        assert_eq!(m.place(0, true), Placement::Skip);
        let p = m.place_block(&[0, 0, 5], &[false, true, false], ColdMode::FetchOrCpu);
        assert_eq!(&p[..2], &[Placement::Skip, Placement::Skip]);
        let c = m.block_cost(&[0, 0], &[Placement::Fetch, Placement::Resident]);
        assert_eq!((c.h2d_bytes, c.d2h_bytes, c.block_s), (0, 0, 0.0));
    }

    #[test]
    fn cpu_for_few_tokens_fetch_for_many_and_observations_move_the_crossover() {
        let mut m = model();
        // Transfers: 2 ms; CPU 1 ms per token, GPU 1 µs: crossover ≈ 2.002 tokens.
        let x = m.crossover_tokens().unwrap();
        assert!((x - 2.0 / 0.999).abs() < 1e-9, "{x}");
        assert_eq!(m.place(1, false), Placement::Cpu);
        assert_eq!(m.place(2, false), Placement::Cpu);
        assert_eq!(m.place(3, false), Placement::Fetch);
        assert_eq!(m.place(100, false), Placement::Fetch);
        assert_eq!(m.place(1, true), Placement::Resident);
        // The CPU turns out 10x faster than calibrated (weight 1: the new figure replaces it).
        m.observe_cpu(10, 0.001);
        assert!((m.rates().cpu_gflops - 10.0).abs() < 1e-9);
        assert!(m.crossover_tokens().unwrap() > 19.0);
        assert_eq!(m.place(10, false), Placement::Cpu);
        // The link turns out 10x slower: fetching gets dearer still.
        m.observe_fetch(1_000_000, 0.01);
        assert!(m.crossover_tokens().unwrap() > 100.0);
        assert_eq!(m.place(100, false), Placement::Cpu);
        // Nonsense observations are ignored.
        let before = m.rates();
        m.observe_cpu(0, 1.0);
        m.observe_fetch(10, 0.0);
        assert_eq!(m.rates(), before);
    }

    #[test]
    fn the_shared_cpu_sends_the_largest_cpu_expert_back_to_the_gpu() {
        let m = model();
        // Each expert alone would go to the CPU (2 tokens < 2.002), but 4 of them make 8 ms of
        // CPU time against ~2 ms per extra fetch on the link.
        let tokens = [2, 2, 2, 2];
        let p = m.place_block(&tokens, &[false; 4], ColdMode::FetchOrCpu);
        let all_cpu = m.block_cost(&tokens, &[Placement::Cpu; 4]).block_s;
        let chosen = m.block_cost(&tokens, &p).block_s;
        assert!(chosen < all_cpu, "{p:?}: {chosen} vs {all_cpu}");
        assert!(p.contains(&Placement::Fetch) && p.contains(&Placement::Cpu), "{p:?}");
        let f = m.place_block(&tokens, &[false; 4], ColdMode::FetchOnly);
        assert_eq!(f, vec![Placement::Fetch; 4]);
        // Alone, 3 tokens would be fetched (3 ms CPU > 2 ms); beside 4 fetches that keep the
        // links busy 4 ms, the CPU is idle: the smallest expert goes there.
        let tokens = [3, 50, 60, 70, 80];
        let p = m.place_block(&tokens, &[false; 5], ColdMode::FetchOrCpu);
        assert_eq!(p[0], Placement::Cpu, "{p:?}");
        assert!(p[1..].iter().all(|&x| x == Placement::Fetch), "{p:?}");
        let fetched = m.block_cost(&tokens, &[Placement::Fetch; 5]).block_s;
        assert!(m.block_cost(&tokens, &p).block_s < fetched);
    }

    #[test]
    fn benefit_of_residency_saturates_at_the_transfer() {
        let m = model();
        assert_eq!(m.hot_benefit_s(0.0, 0.0, ColdMode::FetchOrCpu, false), 0.0);
        let many = m.hot_benefit_s(1000.0, 1.0, ColdMode::FetchOrCpu, false);
        assert!((many - 0.001).abs() < 1e-12, "{many}: a fetch's H2D");
        // 1.5 tokens: 1.5 ms on the CPU against 1 ms of gradient D2H when resident.
        let few = m.hot_benefit_s(1.5, 1.0, ColdMode::FetchOrCpu, false);
        assert!(few < many && few > 0.0, "{few}");
        // 1 token: the CPU (1 ms) is as cheap as the resident expert's gradient copy: no benefit.
        assert!(m.hot_benefit_s(1.0, 1.0, ColdMode::FetchOrCpu, false) < 1e-6);
        assert!((m.hot_benefit_s(1.0, 1.0, ColdMode::FetchOnly, false) - 0.001).abs() < 1e-12);
        // A hot expert whose optimizer is on the device keeps its gradients there: residency
        // saves the fetch's H2D and the gradients' D2H.
        let both = m.hot_benefit_s(1000.0, 1.0, ColdMode::FetchOnly, true);
        assert!((both - 2.0 * many).abs() < 1e-12, "{both} vs H2D + D2H {}", 2.0 * many);
        assert!(calibrate_cpu_gemm() > 0.0);
    }
}
