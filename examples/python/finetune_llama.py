#!/usr/bin/env python3
"""Fine-tunes a Hugging Face LlamaForCausalLM on tinyshakespeare through oogc.torch.offload.

Every decoder layer, the embedding and the final norm with the head become oogc units: their
parameters live in the runtime (the compute copies on the sim device, swapped under a GPU
budget below the model's size), the fp32 master weights and AdamW moments on NVMe, updated by
the runtime's CPU AdamW while the backward goes on. ``--plain`` trains the same model the
usual way (everything in memory, ``torch.optim.AdamW(fused=True)``) for comparison figures.

    python examples/python/finetune_llama.py                       # ../shared/fixtures/llama/llama_gqa
    python examples/python/finetune_llama.py PATH/TO/CHECKPOINT --steps 100
    python examples/python/finetune_llama.py --plain

Text is tokenized with the checkpoint's tokenizer when it has one, else as bytes (ids 0..255,
which needs a vocabulary of at least 256).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parents[2]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", type=Path, default=REPO / "../shared/fixtures/llama/llama_gqa",
                   help="a Hugging Face Llama checkpoint directory (default: %(default)s)")
    p.add_argument("--data", type=Path, default=REPO / "../shared/data/tinyshakespeare.txt")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gpu-fraction", type=float, default=0.7,
                   help="the sim device's budget as a fraction of the model's bytes (default: %(default)s)")
    p.add_argument("--link-gbps", type=float, default=16.0, help="the sim device's H2D/D2H rate, 0 = unthrottled")
    p.add_argument("--nvme-dir", type=Path, default=None, help="where the optimizer state goes (default: a temp dir)")
    p.add_argument("--threads", type=int, default=2, help="torch and optimizer threads")
    p.add_argument("--plain", action="store_true", help="plain PyTorch with torch.optim.AdamW(fused=True)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def tokens(model_dir: Path, data: Path, vocab: int) -> torch.Tensor:
    text = data.read_text()
    if (model_dir / "tokenizer.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        return torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    if vocab < 256:
        raise SystemExit(f"{model_dir} has no tokenizer.json and a vocabulary of {vocab} < 256 (bytes)")
    return torch.tensor(list(text.encode()), dtype=torch.long)


def progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="step")
    except ImportError:
        return None


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    data = tokens(args.model, args.data, model.config.vocab_size)
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(args.seed)

    def batch() -> torch.Tensor:
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=g)
        return torch.stack([data[s : s + args.seq] for s in starts])

    engine = None
    if args.plain:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.1, fused=True)
        forward = model
    else:
        import oogc.torch

        nvme = args.nvme_dir or Path(tempfile.mkdtemp(prefix="oogc-nvme-"))
        nvme.mkdir(parents=True, exist_ok=True)
        head = (model.model.norm, model.lm_head)
        if model.config.tie_word_embeddings:  # one parameter, one unit: embedding with the head
            units = [(model.model.embed_tokens, *head), *model.model.layers]
        else:
            units = [model.model.embed_tokens, *model.model.layers, head]
        config = {
            "device": {"kind": "sim", "link_gbps": args.link_gbps},
            "budgets": {
                "gpu": int(model_bytes * args.gpu_fraction),
                "optimizer_state": "nvme",
                "nvme_dirs": [str(nvme)],
                "nvme_size": max(64 << 20, 40 * model_bytes),
            },
            "optimizer": {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "clip_norm": 1.0,
                          "threads": args.threads},
        }
        engine = oogc.torch.offload(model, units, config, lr=args.lr)
        forward = engine

    bar = progress(args.steps)
    losses, step_times = [], []
    for step in range(1, args.steps + 1):
        ids = batch()
        t0 = time.perf_counter()
        loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if engine is not None:
            engine.step()
            engine.zero_grad()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        step_times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            bar.update(1)
        elif step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step:5d}  loss {losses[-1]:.4f}  {step_times[-1] * 1e3:.0f} ms", flush=True)
    if bar is not None:
        bar.close()

    # Steady state: the first step records the schedule (and warms caches); leave it out.
    steady = step_times[1:] or step_times
    tokens_per_s = args.batch * args.seq * len(steady) / sum(steady)
    summary = {
        "mode": "plain" if args.plain else "oogc",
        "model": str(args.model.resolve()),
        "model_bytes": model_bytes,
        "steps": args.steps,
        "tokens_per_step": args.batch * args.seq,
        "tokens_per_s": round(tokens_per_s, 1),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    if engine is not None:
        traffic = engine.runtime.traffic()
        summary["gpu_budget_bytes"] = int(model_bytes * args.gpu_fraction)
        summary["bytes_per_link"] = {link: traffic[link]["bytes"] for link in ("htod", "dtoh", "nvme_read", "nvme_write")}
        summary["bytes_per_link_per_step"] = {k: v // args.steps for k, v in summary["bytes_per_link"].items()}
        summary["peak_bytes"] = engine.runtime.peak_bytes()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{summary['mode']}: {summary['tokens_per_s']} tokens/s (steps 2..{args.steps}), "
              f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}")
        if engine is not None:
            for link, b in summary["bytes_per_link"].items():
                print(f"  {link:10s} {b / 2**20:10.2f} MiB  ({b / args.steps / 2**20:.2f} MiB/step)")


if __name__ == "__main__":
    main()
