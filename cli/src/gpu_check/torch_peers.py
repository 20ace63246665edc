"""The PyTorch side of `oogc gpu-check` (checks 8 and 10); embedded in the oogc binary, which
writes it to its scratch directory and runs it with the machine's python3. Prints one JSON
object on its last stdout line.

  torch_peers.py bandwidth --bytes N --iters K
      H2D and D2H GB/s of a pinned host tensor's copy_(non_blocking=True), timed with CUDA events.
  torch_peers.py train --peer resident|fsdp2|oogc --hidden .. --intermediate .. --layers ..
                   --heads .. --kv-heads .. --vocab .. --batch .. --seq .. --steps .. --warmup ..
                   [--device cuda|cpu] [--gpu-budget BYTES]
      tokens/s of a Llama (RMSNorm, RoPE, GQA attention through SDPA, SwiGLU; bf16 compute,
      activation checkpointing per layer as oogc recomputes) trained with AdamW:
      resident  — fp32 parameters on the GPU, autocast bf16, torch.optim.AdamW(fused=True);
      fsdp2     — FSDP2 (fully_shard per layer and the root) at world size 1 with
                  CPUOffloadPolicy and MixedPrecisionPolicy(bf16 params, fp32 reduce), AdamW on
                  the CPU parameters (fused where torch allows it);
      oogc      — oogc.torch.offload (the wheel built with the `cuda` feature, which gpu-check
                  installs from dist/oogc-cuda/wheels into its scratch directory): the same
                  model in bf16 with its embedding, each layer and the norm with the head as
                  units, GPU budget --gpu-budget (default: a quarter of parameters + state, as
                  check 9), AdamW in oogc's CPU optimizer.
  --device cpu runs the same code on the CPU (oogc's sim device): how CI rehearses the oogc peer.
"""

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time


def bandwidth(args):
    import torch

    n, k = args.bytes, args.iters
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(k):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = timed(lambda: host.copy_(dev, non_blocking=True))
    return {
        "h2d_gbps": n * k / h2d / 1e9,
        "d2h_gbps": n * k / d2h / 1e9,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
    }


def build_model(a, torch, recompute=True):
    """The Llama of the peers; ``recompute`` checkpoints each layer with torch's checkpoint
    (oogc recomputes at unit boundaries itself, so its peer runs without it)."""
    nn, F = torch.nn, torch.nn.functional
    head_dim = a.hidden // a.heads

    class RMSNorm(nn.Module):
        def __init__(self, d, eps=1e-5):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))
            self.eps = eps

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * self.weight.float()).to(x.dtype)

    def rope(x, cos, sin):
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm(a.hidden)
            self.q_proj = nn.Linear(a.hidden, a.heads * head_dim, bias=False)
            self.k_proj = nn.Linear(a.hidden, a.kv_heads * head_dim, bias=False)
            self.v_proj = nn.Linear(a.hidden, a.kv_heads * head_dim, bias=False)
            self.o_proj = nn.Linear(a.heads * head_dim, a.hidden, bias=False)
            self.post_attention_layernorm = RMSNorm(a.hidden)
            self.gate_proj = nn.Linear(a.hidden, a.intermediate, bias=False)
            self.up_proj = nn.Linear(a.hidden, a.intermediate, bias=False)
            self.down_proj = nn.Linear(a.intermediate, a.hidden, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            h = self.input_layernorm(x)
            q = self.q_proj(h).view(b, t, a.heads, head_dim).transpose(1, 2)
            k = self.k_proj(h).view(b, t, a.kv_heads, head_dim).transpose(1, 2)
            v = self.v_proj(h).view(b, t, a.kv_heads, head_dim).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            rep = a.heads // a.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
            h = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
            self.layers = nn.ModuleList([Layer() for _ in range(a.layers)])
            self.norm = RMSNorm(a.hidden)
            self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)

        def forward(self, ids, targets):
            from torch.utils.checkpoint import checkpoint

            t = ids.shape[1]
            inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=ids.device).float() / head_dim))
            ang = torch.outer(torch.arange(t, device=ids.device).float(), inv)
            ang = torch.cat((ang, ang), dim=-1)
            cos, sin = ang.cos()[None, None], ang.sin()[None, None]
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False) if recompute else layer(x, cos, sin)
            logits = self.lm_head(self.norm(x)).float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return Llama()


def train(a):
    import torch

    out = {"peer": a.peer, "torch": torch.__version__}
    torch.manual_seed(1)
    dev = torch.device(a.device)
    if a.peer == "oogc":
        return train_oogc(a, torch, dev, out)
    if a.peer == "resident":
        model = build_model(a, torch).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        autocast = lambda: torch.autocast(a.device, dtype=torch.bfloat16)  # noqa: E731
    elif a.peer == "fsdp2":
        import torch.distributed as dist

        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        model = build_model(a, torch)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp, offload_policy=CPUOffloadPolicy())
        fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy())
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
            out["optimizer"] = "AdamW(fused=True) on the CPU"
        except Exception as e:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
            out["optimizer"] = f"AdamW (foreach) on the CPU; fused refused: {type(e).__name__}: {e}"
        import contextlib

        autocast = contextlib.nullcontext
    else:
        raise SystemExit(f"unknown peer {a.peer}")
    out["params"] = sum(p.numel() for p in model.parameters())
    times = []
    sync = synchronizer(torch, dev)
    for step in range(a.warmup + a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=dev)
        sync()
        t0 = time.perf_counter()
        with autocast():
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        try:
            opt.step()
        except Exception as e:
            if step > 0 or "fused=True" not in out.get("optimizer", ""):
                raise
            # Fused AdamW refused these (sharded CPU) parameters at its first step: the default.
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
            out["optimizer"] = f"AdamW (foreach) on the CPU; fused failed: {type(e).__name__}: {e}"
            opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
        out["loss"] = float(loss.detach())
    step_s = statistics.median(times)
    out.update(step_s=step_s, tokens_per_s=a.batch * a.seq / step_s)
    if dev.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    if not math.isfinite(out["loss"]):
        out["error"] = "non-finite loss"
    return out


def synchronizer(torch, dev):
    """What waits for the device's queued work before a step is timed (nothing on the CPU)."""
    return torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def train_oogc(a, torch, dev, out):
    """The oogc peer: the model's units offloaded by ``oogc.torch.offload``."""
    try:
        import oogc.torch
    except Exception as e:  # the wheel is not installed where this python looks
        out["skipped"] = f"oogc's Python module is not importable here: {type(e).__name__}: {e}"
        return out
    out["oogc"] = getattr(oogc, "__file__", "?")
    cuda = a.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    # The parameters start on the CPU (offload moves them into the runtime), in the compute dtype.
    model = build_model(a, torch, recompute=False).to(dtype)
    params = sum(p.numel() for p in model.parameters())
    out["params"] = params
    units = [model.embed_tokens, *model.layers, (model.norm, model.lm_head)]
    width = 2 if cuda else 4
    budget = a.gpu_budget or params * (width + 12) // 4
    out["gpu_budget_bytes"] = budget
    config = {
        "device": {"kind": "cuda:0" if cuda else "sim", "link_gbps": 0.0},
        "budgets": {"gpu": budget, "host": params * 16 + (8 << 30)},
        "optimizer": {"betas": [0.9, 0.95], "weight_decay": 0.1, "clip_norm": 1.0},
        "compute_dtype": "bf16" if cuda else "f32",
    }
    engine = oogc.torch.offload(model, units, config, lr=3e-4)
    times = []
    sync = synchronizer(torch, dev)
    for step in range(a.warmup + a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=dev)
        sync()
        t0 = time.perf_counter()
        loss = engine(ids[:, :-1], ids[:, 1:])
        loss.backward()
        stats = engine.step()
        sync()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
        out["loss"] = float(loss.detach())
        out["h2d_bytes"], out["d2h_bytes"] = stats.get("h2d_bytes"), stats.get("d2h_bytes")
    step_s = statistics.median(times)
    out.update(step_s=step_s, tokens_per_s=a.batch * a.seq / step_s)
    if cuda:
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    if not math.isfinite(out["loss"]):
        out["error"] = "non-finite loss"
    return out


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("bandwidth")
    b.add_argument("--bytes", type=int, required=True)
    b.add_argument("--iters", type=int, required=True)
    t = sub.add_parser("train")
    t.add_argument("--peer", required=True)
    for name in ["hidden", "intermediate", "layers", "heads", "kv-heads", "vocab", "batch", "seq", "steps", "warmup"]:
        t.add_argument(f"--{name}", type=int, required=True)
    t.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    t.add_argument("--gpu-budget", type=int, default=0)
    a = p.parse_args()
    result = bandwidth(a) if a.mode == "bandwidth" else train(a)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
