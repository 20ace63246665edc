"""PyTorch's side of `scripts/bench-cpu-vs-torch.sh`: tokens/s of transformers'
`LlamaForCausalLM` of a given shape trained resident on the CPU with
`torch.optim.AdamW(fused=True)` and gradient clipping, as a user of PyTorch would on this machine,
with activation recompute per decoder layer (`gradient_checkpointing_enable()`, as oogc
recomputes each unit in the backward) or without. Random token batches (the speed of a step does
not depend on the text). Prints one JSON object on its last line.

    python scripts/torch_llama_cpu.py --hidden 128 --intermediate 344 --layers 4 --heads 4 \
        --kv-heads 2 --vocab 1024 --batch 16 --seq 128 --steps 40 --threads 2 [--recompute]
"""

import argparse
import json
import time

import torch
import transformers


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("hidden", "intermediate", "layers", "heads", "kv-heads", "vocab", "batch", "seq", "steps"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2, help="steps run before the timed ones")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--recompute", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.seq,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    if a.recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)

    def step() -> float:
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(a.warmup):
        step()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    s = time.perf_counter() - t
    print(json.dumps({
        "peer": "pytorch-recompute" if a.recompute else "pytorch",
        "params": sum(p.numel() for p in model.parameters()),
        "steps": a.steps,
        "train_s": s,
        "tokens_per_s": a.steps * a.batch * a.seq / s,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": a.threads,
    }))


if __name__ == "__main__":
    main()
