"""Mixed precision through `oogc.torch.offload`: a bf16 `torch.nn.Module` (llama_gqa loaded in
bfloat16) runs with bf16 unit tensors, pushes bf16 gradients (half of fp32's D2H bytes) and
trains fp32 master weights; a model whose dtype is not the config's compute dtype, or that mixes
dtypes, is refused by name.

The oracle is plain PyTorch doing the same mixed precision by hand: the bf16 model's forward
and backward give bf16 gradients; they are up-cast (exactly) onto fp32 master weights, which
`torch.optim.AdamW(foreach=False)` updates in fp32; the bf16 parameters are then the masters
rounded to nearest even (`.to(torch.bfloat16)`), as the runtime's optimizer writes the compute
copies.

Tolerances (measured with 10 steps, lr = 1e-3):

* Step 1 is the f32 oracle's case: the same bf16 parameters, so the loss and the gradients are
  plain PyTorch's bit for bit; the masters differ only by the two AdamW kernels' rounding, within
  the AdamW fixture's 1e-5 relative + 1e-7 absolute (measured: one f32 ulp at most).
* The bf16 copies are the runtime's masters rounded to nearest even, bit for bit. Where the two
  kernels' masters, one f32 ulp apart, straddle a bf16 rounding midpoint, the copies differ by
  one bf16 ulp: measured 1 to 3 elements of 224k a step in steps 1 to 6; allowed 1e-4 of them
  after step 1.
* Such an element changes the next forward at bf16 resolution (2^-8 relative), and Adam, which
  divides by the gradient's running RMS, turns the slightly different gradients into updates
  that differ by up to a fair part of lr where a moment nearly cancels; the differences then
  spread (measured: from step 7, 2% of the copies differ by step 10). Losses: 1e-4 relative per
  step (measured at most 1.3e-5). Masters after 10 steps: 3e-4 absolute (measured 1.5e-4, in the
  embedding) but for at most 1e-4 of a tensor's elements (torch 2.15.0+cu132 from PyPI, CI's
  fallback when the CPU index is unreachable: 3 of the embedding's 65,536 up to 3.7e-3, where
  a bf16 rounding went the other way), and every element within 2e-2 (each run moves an element
  by about lr per step at most: 1e-2 over 10 steps); per tensor, the mean
  absolute difference at most 1 % of the mean absolute move of the oracle's masters over the 10
  steps: the bulk of the parameters track. Measured with torch 2.15.0: differences up to 9.4e-6
  (k_proj), 0.25 % of the move (an absolute bound of 5e-6, measured 2e-6 with an earlier torch,
  broke when torch's bf16 kernels changed the trajectory that the differences ride on).
"""

import pytest
import torch
from torch import nn

import oogc
import oogc.torch
from skips import need

transformers = need("transformers", "test_offload_bf16", "the Llama oracle")

from llama_run import BETAS, EPS, LR, STEPS, WD, batches


def load(path, dtype):
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype)
    model.train()
    return model


def units_of(model):
    return [model.model.embed_tokens, *model.model.layers, (model.model.norm, model.lm_head)]


def config(model_bytes, **extra):
    return {
        "device": {"kind": "sim", "link_gbps": 0},
        # Below the model's size: the units move every step.
        "budgets": {"gpu": model_bytes * 7 // 10, "host": "256 MiB"},
        "optimizer": {"betas": list(BETAS), "eps": EPS, "weight_decay": WD, "clip_norm": 0.0, "threads": 2},
        **extra,
    }


def test_bf16_module_matches_plain_pytorch_mixed_precision(llama_gqa, shakespeare, monkeypatch):
    # The oracle: a bf16 model, fp32 masters, torch's AdamW in fp32, the bf16 copy refreshed by rounding.
    plain = load(llama_gqa, torch.bfloat16)
    names = [n for n, _ in plain.named_parameters()]
    params = list(plain.parameters())
    masters = [p.detach().float() for p in params]
    initial = [m.clone() for m in masters]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False, fused=False)
    plain_losses, plain_grads, plain_first = [], None, None
    for ids in batches(shakespeare):
        loss = plain(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if plain_grads is None:
            plain_grads = {n: p.grad.clone() for n, p in zip(names, params)}
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m.to(torch.bfloat16))
        if plain_first is None:
            plain_first = {n: (m.clone(), p.detach().clone()) for n, m, p in zip(names, masters, params)}
        plain.zero_grad(set_to_none=True)
        plain_losses.append(loss.item())

    model = load(llama_gqa, torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    # No compute_dtype in the config: offload takes the model's.
    engine = oogc.torch.offload(model, units_of(model), config(2 * numel), lr=LR)
    assert engine.runtime.compute_dtype == "bf16" and engine.dtype == torch.bfloat16

    # The tensors the modules run with, and the gradients pushed.
    seen = set()
    views = oogc.torch._Unit.views

    def spy_views(unit, flat, module):
        seen.add((flat.dtype, flat.numel() == unit.numel))
        return views(unit, flat, module)

    monkeypatch.setattr(oogc.torch._Unit, "views", spy_views)
    pushed, first_grads = [], {}
    push = engine._unit_grad

    def record(unit, grad):
        if grad is not None:
            pushed.append(grad.dtype)
            if engine.step_count == 0:
                first_grads[unit.name] = first_grads.get(unit.name, 0) + grad
        push(unit, grad)

    engine._unit_grad = record

    losses = []
    for ids in batches(shakespeare):
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        stats = engine.step()
        losses.append(loss.item())
        # The gradients crossed the link in bf16: two bytes a parameter, once each.
        assert stats["d2h_bytes"] == 2 * numel, stats
        assert stats["h2d_bytes"] > 0
        if engine.step_count == 1:
            first = engine.parameters()
            with torch.no_grad():
                copies = {}
                for unit in engine._units:
                    with engine.runtime.fetch(unit.index, "eval") as flat:
                        assert flat.dtype == torch.bfloat16
                        for slot in unit.slots:
                            module, local = slot.holders[0]
                            name = oogc.torch._qualified(model, module, local)
                            copies[name] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    assert seen == {(torch.bfloat16, True)}, f"unit tensors handed to torch: {seen}"
    assert set(pushed) == {torch.bfloat16}, f"gradients pushed: {set(pushed)}"

    # Step 1: plain PyTorch's loss and gradients bit for bit, its masters within AdamW's rounding.
    assert losses[0] == plain_losses[0]
    for unit in engine._units:
        for slot in unit.slots:
            module, local = slot.holders[0]
            name = oogc.torch._qualified(model, module, local)
            got = first_grads[unit.name][slot.offset : slot.offset + slot.numel].view(slot.shape)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, plain_grads[name]), f"step 1 gradient of {name} differs from plain PyTorch's"
    differing = 0
    for name, (master, copy) in plain_first.items():
        torch.testing.assert_close(first[name], master, rtol=1e-5, atol=1e-7, msg=lambda m: f"step 1 {name}: {m}")
        # The compute copy is the runtime's master rounded to nearest even, bit for bit ...
        assert torch.equal(copies[name], first[name].to(torch.bfloat16)), f"step 1 {name}: copy is not the rounded master"
        differing += int((copies[name] != copy).sum())
    # ... and plain PyTorch's bf16 parameters but where the masters straddle a rounding midpoint.
    assert differing <= 1e-4 * numel, f"step 1: {differing} bf16 parameters differ from plain PyTorch's"

    for step, (ours, theirs) in enumerate(zip(losses, plain_losses), 1):
        assert abs(ours - theirs) <= 1e-4 * abs(theirs), f"step {step}: loss {ours} vs plain {theirs}"
    ours = engine.parameters()
    for name, master, init in zip(names, masters, initial):
        assert ours[name].dtype == torch.float32
        diff = (ours[name] - master).abs()
        beyond = int((diff > 3e-4).sum())
        assert beyond <= 1e-4 * diff.numel(), f"step {STEPS} {name}: {beyond} of {diff.numel()} masters differ by more than 3e-4"
        assert float(diff.max()) <= 2 * LR * STEPS, f"step {STEPS} {name}: a master differs by {float(diff.max())}"
        # The bulk tracks: the mean difference is a small part of how far the masters moved.
        mean = float((ours[name] - master).abs().mean())
        moved = float((master - init).abs().mean())
        assert mean <= 0.01 * moved, f"step {STEPS} {name}: mean absolute difference {mean}, {mean / moved:.2%} of the mean move {moved}"


def test_bf16_gradients_are_half_the_d2h_bytes_of_f32(llama_gqa):
    ids = torch.arange(32).reshape(2, 16)
    d2h = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load(llama_gqa, dtype)
        numel = sum(p.numel() for p in model.parameters())
        engine = oogc.torch.offload(model, units_of(model), config(4 * numel), lr=LR)
        engine(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        d2h[dtype] = engine.step()["d2h_bytes"]
    assert d2h[torch.float32] == 4 * numel and d2h[torch.bfloat16] * 2 == d2h[torch.float32], d2h


def tiny(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(dtype)


def test_a_dtype_mismatch_is_refused_by_name(tmp_path):
    budgets = {"gpu": "1 MiB"}
    model = tiny(torch.bfloat16)
    with pytest.raises(oogc.UsageError) as e:
        oogc.torch.offload(model, list(model), {"budgets": budgets, "compute_dtype": "f32"})
    message = str(e.value)
    # The cause (the model's dtype, the config's) and the fixes.
    assert "torch.bfloat16" in message and "compute_dtype is 'f32'" in message
    assert "compute_dtype = 'bf16'" in message and "model.to(torch.float32)" in message
    # A TOML config says it the same way.
    path = tmp_path / "oogc.toml"
    path.write_text('compute_dtype = "bf16"\n[budgets]\ngpu = "1 MiB"\n')
    f32 = tiny()
    with pytest.raises(oogc.UsageError, match=r"torch.float32 \(0.weight\) but the config's compute_dtype is 'bf16'"):
        oogc.torch.offload(f32, list(f32), str(path))
    # Said and matching, it offloads.
    engine = oogc.torch.offload(model, list(model), str(path))
    assert engine.dtype == torch.bfloat16


def test_mixed_dtypes_are_refused_by_name():
    model = tiny(torch.bfloat16)
    model[1].float()  # the LayerNorm in fp32, the Linears in bf16
    with pytest.raises(oogc.UsageError, match=r"unit '0\+1' mixes dtypes: 0.weight is torch.bfloat16 but 1.weight is torch.float32"):
        oogc.torch.offload(model, [(model[0], model[1]), model[2]], {"budgets": {"gpu": "1 MiB"}})
    with pytest.raises(oogc.UsageError, match=r"unit '1' is torch.float32 .* unit '0' is torch.bfloat16 .* one compute dtype"):
        oogc.torch.offload(model, list(model), {"budgets": {"gpu": "1 MiB"}})
    model = tiny(torch.float64)
    with pytest.raises(oogc.UsageError, match="float64 on cpu; units take float32, bfloat16 or float16"):
        oogc.torch.offload(model, list(model), {"budgets": {"gpu": "1 MiB"}})


def test_a_bf16_module_evaluates_as_plain_pytorch():
    """The eval path (no graph) of a small bf16 model: plain PyTorch's outputs bit for bit."""
    model = tiny(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
    engine = oogc.torch.offload(model, list(model), {"budgets": {"gpu": "1 MiB"}})
    with torch.no_grad():
        got = engine(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
