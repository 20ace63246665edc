#!/usr/bin/env python3
"""Builds tests/fixtures/dense_among_sparse/: tiny Qwen3-MoE and Qwen2-MoE models with dense
layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`), computed by
transformers in float32 on the CPU: the oracle of tests/dense_among_sparse.rs.

Run with the project's Python environment (torch and transformers):

    /work/pyvenv/bin/python scripts/make-dense-among-sparse-fixture.py [OUT_DIR]

Per case (a directory named after it) it writes, as ../shared/fixtures/moe/ does (README there):
`config.json` (save_pretrained's), `model.safetensors` in the Hub's per-expert layout
(`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`; transformers 5 keeps the experts
fused in memory and converts on load: the script reloads the file with `from_pretrained` and
checks the logits), `tokenizer.json` (characters of the training text, so that the vocabulary
and the files stay small), `reference.safetensors` (`input_ids`, `labels` already shifted with
the last 3 of row 1 ignored (-100), `logits`, `loss_ce`, `aux_loss` (transformers'
`load_balancing_loss_func` over the sparse layers' router logits), `loss` = `loss_ce` +
`router_aux_loss_coef` x `aux_loss`, `router_logits` [sparse layers, B*T, E] and `grad.<name>`
for every parameter) and `step.safetensors` (every parameter after one
`torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)` step on those
gradients). `cases.json` lists the cases. Deterministic (fixed seeds); a case whose top-k choice
of some token is within 1e-3 of a tie is refused (another summation order could flip it).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

import transformers
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt")
B, T = 2, 16
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
COMMON = dict(
    vocab_size=96,
    hidden_size=16,
    intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    router_aux_loss_coef=0.02,
    output_router_logits=True,
    bos_token_id=0,
    eos_token_id=0,
)
CASES = {
    "qwen3_moe_mlp_only": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True,
             tie_word_embeddings=True),
        "Qwen3-MoE, 3 layers, mlp_only_layers [1]: layers 0 and 2 sparse (4 experts top-2 renormalized), "
        "layer 1 a dense SwiGLU MLP of intermediate_size 32; tied head; loss = CE + 0.02 x the load-balancing "
        "loss pooled over the 2 sparse layers",
    ),
    "qwen2_moe_sparse_step": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
             shared_expert_intermediate_size=16, tie_word_embeddings=False),
        "Qwen2-MoE, 4 layers, decoder_sparse_step 2: layers 1 and 3 sparse (4 experts top-2, shared expert of "
        "16 behind its sigmoid gate), layers 0 and 2 dense SwiGLU MLPs of intermediate_size 32 (no shared "
        "expert); q/k/v bias; untied head; loss = CE + 0.02 x the load-balancing loss pooled over the 2 sparse layers",
    ),
}


def char_tokenizer(text):
    """A tokenizer.json whose tokens are the text's characters (no merges), id 0 `<|endoftext|>`."""
    chars = sorted(set(text))
    vocab = {"<|endoftext|>": 0}
    for c in chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def per_expert(model, tensors):
    """The model's named tensors (parameters or their gradients: `tensors(p)`) in the Hub's
    per-expert layout: the fused `experts.gate_up_proj` [E, 2I, d] and `experts.down_proj`
    [E, d, I] split into `experts.e.{gate,up,down}_proj.weight`."""
    out = {}
    for name, p in model.named_parameters():
        t = tensors(p).detach().clone().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        elif name.endswith("mlp.gate.weight") or name.endswith("mlp.gate"):
            out[name if name.endswith(".weight") else name + ".weight"] = t
        else:
            out[name] = t
    return out


def randomize(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                # A sharp router: top-k choices far from ties.
                p.copy_(1.0 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def forward(model, cfg, input_ids, labels):
    out = model(input_ids=input_ids, output_router_logits=True)
    logits = out.logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    router = tuple(out.router_logits)
    aux = load_balancing_loss_func(router, cfg.num_experts, cfg.num_experts_per_tok)
    return logits, ce, aux, router


def top_k_margin(router, k):
    worst = float("inf")
    for r in router:
        p = torch.softmax(r.float(), dim=-1).sort(dim=-1, descending=True).values
        worst = min(worst, (p[:, k - 1] - p[:, k]).min().item())
    return worst


def make_case(out_dir, name, config_cls, model_cls, extra, what, ids_all, tok):
    cfg = config_cls(**COMMON, **extra)
    cfg.rope_parameters = {"rope_theta": 1e6, "rope_type": "default"}
    for seed in range(100):
        model = model_cls(cfg).float().eval()
        randomize(model, 1000 + seed)
        input_ids = torch.tensor(ids_all[: B * (T + 1)], dtype=torch.long).reshape(B, T + 1)
        labels = input_ids[:, 1:].clone()
        input_ids = input_ids[:, :-1].contiguous()
        labels[1, -3:] = -100
        with torch.no_grad():
            _, _, _, router = forward(model, cfg, input_ids, labels)
        if top_k_margin(router, cfg.num_experts_per_tok) > 1e-3:
            break
    else:
        sys.exit(f"{name}: no seed gives top-k choices away from ties")
    model.zero_grad()
    logits, ce, aux, router = forward(model, cfg, input_ids, labels)
    loss = ce + cfg.router_aux_loss_coef * aux
    loss.backward()
    sparse = [i for i, l in enumerate(model.model.layers) if hasattr(l.mlp, "experts")]
    assert len(router) == len(sparse), (len(router), sparse)

    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    model.config.architectures = [model_cls.__name__]
    model.config.save_pretrained(d)
    params = per_expert(model, lambda p: p)
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    save_file(params, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    tok.save(os.path.join(d, "tokenizer.json"))
    grads = per_expert(model, lambda p: p.grad)
    if cfg.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    ref = {
        "input_ids": input_ids,
        "labels": labels,
        "logits": logits.detach().contiguous(),
        "loss": loss.detach().reshape(()),
        "loss_ce": ce.detach().reshape(()),
        "aux_loss": aux.detach().reshape(()),
        "router_logits": torch.stack([r.detach() for r in router]).contiguous(),
    }
    ref.update({f"grad.{k}": v for k, v in grads.items()})
    save_file(ref, os.path.join(d, "reference.safetensors"))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    opt.step()
    stepped = per_expert(model, lambda p: p)
    if cfg.tie_word_embeddings:
        stepped.pop("lm_head.weight", None)
    save_file(stepped, os.path.join(d, "step.safetensors"))

    # transformers reads the per-expert file back to the same model.
    again = model_cls.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logits2 = again(input_ids=input_ids).logits
    assert torch.equal(logits2, logits.detach()), f"{name}: the saved checkpoint reloads to other logits"
    n_params = sum(v.numel() for v in params.values())
    print(f"{name}: sparse layers {sparse}, {n_params} parameters, loss {loss.item():.6f}, "
          f"top-k margin {top_k_margin(router, cfg.num_experts_per_tok):.4f}")
    return {
        "what": what,
        "model_type": cfg.model_type,
        "class": model_cls.__name__,
        "sparse_layers": sparse,
        "parameters": n_params,
        "loss": loss.item(),
        "adamw": {k: list(v) if isinstance(v, tuple) else v for k, v in ADAMW.items()},
    }


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures", "dense_among_sparse")
    text = open(TEXT, encoding="utf-8").read()
    tok = char_tokenizer(text)
    ids_all = tok.encode(text[:2000]).ids
    cases = {}
    for name, (config_cls, model_cls, extra, what) in CASES.items():
        cases[name] = make_case(out_dir, name, config_cls, model_cls, extra, what, ids_all, tok)
    meta = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "batch": [B, T],
        "dtype": "float32",
        "loss": "mean cross-entropy over labels != -100 + router_aux_loss_coef x aux_loss (sparse layers only)",
        "tolerance_hint": "logits and loss: 1e-4 relative + 1e-5 absolute; gradients: 1e-3 relative + 1e-6 "
        "absolute; AdamW step: 1e-5 relative + 1e-7 absolute",
        "cases": cases,
    }
    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
