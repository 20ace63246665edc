//! One training step and one evaluation of a [`Trainer`]: the forward over the embedding and the
//! blocks (layer-major over the micro-batches, checkpoints kept or offloaded), the head's loss
//! and backward at once, the backward in reverse with recomputation, each unit's gradients
//! pushed to the runtime as soon as they are made; and the accumulators that sum micro-batches.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Tensor;
use oogc_models::CausalLm;

use crate::runtime::{Phase, UnitId, UnitParams};

use super::{lr_schedule, moe, Block, Checkpointed, Evaluation, ExpertTraffic, Result, StepOutcome, Trainer};

impl Trainer {
    /// The embedding and the blocks forward from `tokens` (one `[B, T]` tensor per micro-batch),
    /// layer-major: each unit is fetched once and runs every micro-batch before the next unit.
    /// Returns the head's inputs (one per micro-batch) and per block what its backward needs.
    /// Resident experts stay pinned in `held` (training only); `cpu_tokens` counts expert tokens
    /// computed on the CPU.
    ///
    /// # Panics
    /// An MoE block with more than one micro-batch ([`TrainConfig::validate`] refuses it).
    fn forward_trunk(
        &mut self,
        tokens: &[Tensor],
        phase: Phase,
        held: &mut HashMap<UnitId, UnitParams>,
        cpu_tokens: &mut usize,
    ) -> Result<(Vec<Tensor>, Vec<Checkpointed>)> {
        let model = Arc::clone(&self.model);
        let embed = self.layout.embed;
        let mut xs = {
            let p = self.rt.fetch(self.ids[embed], phase)?;
            let _span = tracing::info_span!("compute::forward", unit = embed).entered();
            self.clock.time(|| {
                tokens.iter().map(|t| model.forward(embed, p.tensor(), t, None)).collect::<Result<Vec<_>, _>>()
            })?
        };
        let mut saved = Vec::with_capacity(self.layout.blocks.len());
        for (i, block) in self.layout.blocks.clone().iter().enumerate() {
            let (ys, routed) = match block {
                Block::Dense(u) => {
                    let p = self.rt.fetch(self.ids[*u], phase)?;
                    let _span = tracing::info_span!("compute::forward", unit = u).entered();
                    let ys = self.clock.time(|| {
                        xs.iter().map(|x| model.forward(*u, p.tensor(), x, None)).collect::<Result<Vec<_>, _>>()
                    })?;
                    (ys, None)
                }
                Block::Moe { trunk, experts } => {
                    let [x] = xs.as_slice() else { panic!("an MoE model trains one micro-batch per step") };
                    let state = self.moe.as_mut().expect("an MoE model has MoE state");
                    let (trunk, experts) = (self.ids[*trunk], experts.iter().map(|&e| self.ids[e]).collect::<Vec<_>>());
                    let (y, routing, placements) =
                        state.block_forward(&mut self.rt, &*model, i, trunk, &experts, x, phase, held, cpu_tokens)?;
                    (vec![y], Some((routing, placements)))
                }
            };
            let inputs = std::mem::replace(&mut xs, ys);
            let c = if self.cfg.activations.offload && phase == Phase::Forward && routed.is_none() {
                // Offloaded: D2H into pinned host memory now, the device copy dropped here.
                let stashed = inputs.iter().map(|x| self.rt.activations().stash(x)).collect::<Result<Vec<_>, _>>()?;
                Checkpointed { inputs: Vec::new(), stashed, moe: routed }
            } else {
                Checkpointed { inputs, stashed: Vec::new(), moe: routed }
            };
            saved.push(c);
        }
        Ok((xs, saved))
    }

    /// Runs one optimizer step on the next training batch: `train.micro_batches` micro-batches
    /// of `train.batch_size` sequences, drawn as one batch of their product (so a run's batches
    /// do not depend on how a step is split), trained layer-major (each unit fetched once in the
    /// forward and once in the backward for all of them) with their gradients summed before the
    /// unit's one [`Runtime::push_grads`](crate::runtime::Runtime::push_grads). The loss and its gradients are those of the mean
    /// cross-entropy over every counted token of the step: micro-batch `j` with `n_j` counted
    /// tokens of `N` in all contributes its mean's gradient scaled by `n_j / N`.
    ///
    /// # Errors
    /// Runtime, model or candle failures; with ranks, a failed collective (the run cannot go
    /// on: the caller ends it, [`Ranks::abort`](crate::dist::Ranks::abort)).
    pub fn train_step(&mut self) -> Result<StepOutcome> {
        let started = std::time::Instant::now();
        self.clock.take();
        crate::hooks::crash_point("step");
        let step = self.step + 1;
        let lr = lr_schedule(&self.cfg).lr(step);
        let (micro, k) = (self.cfg.train.batch_size, self.cfg.train.micro_batches.max(1));
        // This rank's windows of the step's global batch (all of it in a world of one).
        let (rank, ranks) = (self.ranks.world().rank, self.ranks.world().size);
        let shard = crate::data::Shard { rank, ranks };
        let batch = self.data.next_batch_shard(&mut self.sampler, micro * k, self.cfg.train.seq_len, shard);
        if let Some(dump) = &mut self.batch_dump {
            dump.write_step(step, &batch, k)?;
        }
        let per_micro = batch.inputs.len() / k;
        let split = |ids: &[u32]| ids.chunks(per_micro).map(|c| self.tokens(c)).collect::<Result<Vec<_>>>();
        let inputs = split(&batch.inputs)?;
        let targets = split(&batch.targets)?;
        let model = Arc::clone(&self.model);
        let (embed, head) = (self.layout.embed, self.layout.head);
        self.rt.begin_step(self.updates + 1, lr)?;

        if let Some(m) = &mut self.moe {
            m.traffic = ExpertTraffic::default();
        }
        // Forward: keep each block's inputs (the activation checkpoints of every micro-batch).
        let mut held = HashMap::new();
        let mut cpu_tokens = 0;
        let (xs, mut saved) = self.forward_trunk(&inputs, Phase::Forward, &mut held, &mut cpu_tokens)?;
        let routed: Vec<Vec<usize>> = saved.iter().filter_map(|c| c.moe.as_ref().map(|(r, _)| r.counts())).collect();
        // The pass's routings together: a load-balancing loss pooled over the blocks (Mixtral)
        // gives each routing its weights before any block's backward; MoE-GPT's is per block.
        let aux = match model.moe() {
            Some(moe) => self.clock.time(|| -> Result<f64> {
                let mut routings: Vec<&mut oogc_models::Routing> =
                    saved.iter_mut().filter_map(|c| c.moe.as_mut().map(|(r, _)| r)).collect();
                moe.finish_forward(&mut routings)?;
                let routings: Vec<&oogc_models::Routing> = routings.into_iter().map(|r| &*r).collect();
                Ok(moe.aux_loss(&routings))
            })?,
            None => 0.0,
        };

        // The turn: the head's forward, loss and backward at once, per micro-batch. Immediate
        // updates start here: a checkpoint in flight must have read the state by then.
        self.before_updates(true);
        self.rt.end_forward();
        let (loss, mut grad_xs, tied_grad) = {
            let emb = if model.tied_head() { Some(self.rt.fetch(self.ids[embed], Phase::Backward)?) } else { None };
            let p = self.rt.fetch(self.ids[head], Phase::Backward)?;
            let _span = tracing::info_span!("compute::backward", unit = head).entered();
            let mut acc = HeadAccumulator::new(batch.targets.chunks(per_micro));
            self.clock.time(|| -> Result<()> {
                for (x, t) in xs.iter().zip(&targets) {
                    acc.add(model.head_loss_backward(p.tensor(), x, emb.as_ref().map(|e| e.tensor()), t)?)?;
                }
                Ok(())
            })?;
            drop((p, emb));
            let mut grads = acc.grads.expect("at least one micro-batch");
            if crate::hooks::nan_grads_at(step) {
                grads = grads.affine(f64::NAN, 0.0)?;
            }
            self.rt.push_grads(self.ids[head], &grads)?;
            (acc.loss, acc.grad_inputs, acc.tied)
        };

        // Backward in reverse, recomputing each block from its checkpoints.
        for (i, block) in self.layout.blocks.clone().iter().enumerate().rev() {
            let mut c = saved.pop().expect("one checkpoint per block");
            if !c.stashed.is_empty() {
                // Offloaded checkpoints come back H2D; the next block's first one is prefetched
                // so its copy overlaps this block's backward.
                for id in std::mem::take(&mut c.stashed) {
                    c.inputs.push(self.rt.activations().take(id)?);
                }
                if let Some(&next) = saved.last().and_then(|n| n.stashed.first()) {
                    self.rt.activations().prefetch(next)?;
                }
            }
            grad_xs = match block {
                Block::Dense(u) => {
                    let p = self.rt.fetch(self.ids[*u], Phase::Backward)?;
                    let (grads, grad_inputs) = {
                        let _span = tracing::info_span!("compute::backward", unit = u).entered();
                        self.clock.time(|| backward_micro_batches(&*model, *u, p.tensor(), &c.inputs, &grad_xs))?
                    };
                    drop(p);
                    self.rt.push_grads(self.ids[*u], &grads)?;
                    grad_inputs.into_iter().map(|g| g.expect("a block returns its input's gradient")).collect()
                }
                Block::Moe { trunk, experts } => {
                    let (routing, placements) = c.moe.expect("an MoE block keeps its routing");
                    let state = self.moe.as_mut().expect("an MoE model has MoE state");
                    let (x_in, grad_y) = (&c.inputs[0], &grad_xs[0]);
                    let experts: Vec<UnitId> = experts.iter().map(|&e| self.ids[e]).collect();
                    let args =
                        moe::BlockBackward { block: i, trunk: self.ids[*trunk], experts: &experts, x_in, grad_y };
                    vec![state.block_backward(&mut self.rt, &*model, args, &routing, &placements, &mut held)?]
                }
            };
        }
        {
            let p = self.rt.fetch(self.ids[embed], Phase::Backward)?;
            let (mut grads, _) = {
                let _span = tracing::info_span!("compute::backward", unit = embed).entered();
                self.clock.time(|| backward_micro_batches(&*model, embed, p.tensor(), &inputs, &grad_xs))?
            };
            drop(p);
            if let Some(extra) = tied_grad {
                // The embedding's own gradient and the tied head's, summed in f32 for half
                // dtypes (the same value as candle's half add, which rounds f32's sum once).
                grads = self.clock.time(|| -> Result<Tensor> { Ok((widen(&grads)? + widen(&extra)?)?) })?;
            }
            self.rt.push_grads(self.ids[embed], &grads)?;
        }
        // The step's updates are committed here: so must the checkpoint in flight have read it.
        self.before_updates(false);
        let stats = self.rt.finish_step()?;
        self.step = step;
        if !stats.figures.skipped {
            self.updates += 1;
        }
        if let Some(m) = &mut self.moe {
            m.after_step(&mut self.rt, step, &routed)?;
        }
        // The step's loss over the global batch: the ranks' means averaged (equal shards).
        // Every gradient reduction of the step is done (finish_step waited for them).
        let loss = if ranks > 1 {
            let mut l = [loss];
            self.ranks.all_reduce_sum_f64(&mut l).map_err(crate::runtime::RuntimeError::from)?;
            l[0] / ranks as f64
        } else {
            loss
        };
        Ok(StepOutcome {
            loss,
            lr,
            tokens: batch.inputs.len() * ranks,
            stats,
            aux_loss: aux,
            routed_tokens: routed,
            cpu_tokens,
            expert_traffic: self.moe.as_ref().map(|m| m.traffic).unwrap_or_default(),
            wall_s: started.elapsed().as_secs_f64(),
            compute_s: self.clock.take(),
        })
    }

    /// The validation loss over the fixed validation batches, with the latest parameters
    /// (pending updates are awaited): nats per token and bits per byte.
    ///
    /// # Errors
    /// Runtime, model or candle failures; with ranks, a failed collective.
    pub fn evaluate(&mut self) -> Result<Evaluation> {
        let model = Arc::clone(&self.model);
        let (embed, head) = (self.layout.embed, self.layout.head);
        let (mut nats, mut targets, mut bytes) = (0.0, 0u64, 0u64);
        // Each rank evaluates its shard of every validation batch; the sums are the run's.
        let ranks = self.ranks.world().size;
        for b in self.val.clone() {
            let inputs = self.tokens(&b.inputs)?;
            let target_ids = self.tokens(&b.targets)?;
            let (mut held, mut cpu) = (HashMap::new(), 0);
            let (xs, _) = self.forward_trunk(std::slice::from_ref(&inputs), Phase::Eval, &mut held, &mut cpu)?;
            drop(held);
            let x = &xs[0];
            let emb = if model.tied_head() { Some(self.rt.fetch(self.ids[embed], Phase::Eval)?) } else { None };
            let p = self.rt.fetch(self.ids[head], Phase::Eval)?;
            let mean = model.head_loss(p.tensor(), x, emb.as_ref().map(|e| e.tensor()), &target_ids)?;
            nats += mean * b.targets.len() as f64;
            targets += b.targets.len() as u64;
            bytes += b.target_bytes;
        }
        if ranks > 1 {
            let mut sums = [nats, targets as f64, bytes as f64];
            self.ranks.all_reduce_sum_f64(&mut sums).map_err(crate::runtime::RuntimeError::from)?;
            (nats, targets, bytes) = (sums[0], sums[1] as u64, sums[2] as u64);
        }
        Ok(Evaluation {
            nats_per_token: nats / targets.max(1) as f64,
            bits_per_byte: nats / bytes.max(1) as f64 / std::f64::consts::LN_2,
        })
    }
}

/// Accumulates the head's outcome of a step's micro-batches as one batch of all of them: the
/// loss is the mean over every counted token (`Σ n_j · loss_j / N`, micro-batch `j` counting
/// `n_j` of the step's `N` targets that are not [`oogc_models::IGNORE_INDEX`]); the head's
/// gradients and the tied embedding's are summed with micro-batch `j`'s scaled by `n_j / N`, and
/// so is each micro-batch's input gradient. With one micro-batch nothing is scaled (bit for bit
/// the batch's own outcome).
struct HeadAccumulator {
    /// `n_j / N` per micro-batch; empty for one micro-batch.
    shares: Vec<f64>,
    loss: f64,
    grads: Option<Tensor>,
    grad_inputs: Vec<Tensor>,
    tied: Option<Tensor>,
}

impl HeadAccumulator {
    /// For the micro-batches whose targets are `targets` (flat ids each).
    fn new<'a>(targets: impl ExactSizeIterator<Item = &'a [u32]>) -> Self {
        let shares = if targets.len() == 1 {
            Vec::new()
        } else {
            let counted: Vec<usize> =
                targets.map(|t| t.iter().filter(|&&id| id != oogc_models::IGNORE_INDEX).count()).collect();
            let total = counted.iter().sum::<usize>().max(1) as f64;
            counted.iter().map(|&n| n as f64 / total).collect()
        };
        Self { shares, loss: 0.0, grads: None, grad_inputs: Vec::new(), tied: None }
    }

    /// Adds the next micro-batch's outcome. With several micro-batches the parameters'
    /// gradients are scaled and summed in f32 for half dtypes (one rounding at the push); each
    /// input gradient is scaled in f32 and rounded back to its dtype (the blocks' backward takes
    /// the params' dtype).
    fn add(&mut self, out: oogc_models::HeadLossGrads) -> Result<()> {
        let share = self.shares.get(self.grad_inputs.len()).copied();
        let scale = |t: Tensor| -> Result<Tensor> {
            Ok(match share {
                Some(s) => widen(&t)?.affine(s, 0.0)?,
                None => t,
            })
        };
        self.loss = match share {
            Some(s) => self.loss + out.loss * s,
            None => out.loss,
        };
        sum_into(&mut self.grads, scale(out.grads.grad_params)?)?;
        let grad_input = out.grads.grad_input.expect("the head returns its input's gradient");
        let dtype = grad_input.dtype();
        self.grad_inputs.push(scale(grad_input)?.to_dtype(dtype)?);
        if let Some(t) = out.grads.grad_tied_wte {
            sum_into(&mut self.tied, scale(t)?)?;
        }
        Ok(())
    }
}

/// `acc += t` (`acc = t` when empty). Gradients of half dtypes (bf16, f16) are summed in f32:
/// the sum stays f32 and is rounded once, when it is pushed (DESIGN.md "Precision": gradient
/// accumulation in f32). One term alone is left as it is.
fn sum_into(acc: &mut Option<Tensor>, t: Tensor) -> Result<()> {
    *acc = Some(match acc.take() {
        Some(a) => (widen(&a)? + widen(&t)?)?,
        None => t,
    });
    Ok(())
}

/// `t` in f32 when it is of a half dtype (exact), else `t` itself.
fn widen(t: &Tensor) -> Result<Tensor> {
    Ok(match t.dtype() {
        candle_core::DType::BF16 | candle_core::DType::F16 => t.to_dtype(candle_core::DType::F32)?,
        _ => t.clone(),
    })
}

/// The backward of unit `unit` for each micro-batch (its checkpointed `inputs` and output
/// gradients `grad_ys`, in order) with one fetch of its parameters: the parameters' gradients
/// summed over the micro-batches (in order) and each micro-batch's input gradient.
fn backward_micro_batches(
    model: &dyn CausalLm,
    unit: usize,
    params: &Tensor,
    inputs: &[Tensor],
    grad_ys: &[Tensor],
) -> Result<(Tensor, Vec<Option<Tensor>>)> {
    let mut sum = None;
    let mut grad_inputs = Vec::with_capacity(inputs.len());
    for (x, g) in inputs.iter().zip(grad_ys) {
        let ug = model.backward(unit, params, x, g, None)?;
        sum_into(&mut sum, ug.grad_params)?;
        grad_inputs.push(ug.grad_input);
    }
    Ok((sum.expect("at least one micro-batch"), grad_inputs))
}
