"""One rank of the ranks test (``test_offload_ranks.py``), started by ``torchrun``, or the
single process it is compared with: llama_gqa through ``oogc.torch.offload`` for ``STEPS`` steps
of ``llama_run.batches``, optimizer state on NVMe, clipping by the global norm. A rank takes its
rows of each global batch; alone, the process takes them all. Writes ``{out}/rank{r}.pt``: the
losses (averaged over the ranks by the trainer's own all-reduce on the default group, issued
between the backward and ``engine.step()``, while the runtime's reductions may still run), the
step stats and the final fp32 master weights.

    torchrun --standalone --nproc-per-node 2 python/tests/ranks_run.py FIXTURE TEXT OUT
    python python/tests/ranks_run.py FIXTURE TEXT OUT        # one process, the whole batch
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from llama_run import LR, batches, offload_config  # noqa: E402

import oogc  # noqa: E402
import oogc.torch  # noqa: E402

CLIP = 0.5


def main(fixture: str, text: str, out: str) -> None:
    torch.set_num_threads(1)
    ranked = "WORLD_SIZE" in os.environ
    (Path(out) / "nvme").mkdir(parents=True, exist_ok=True)
    if ranked:
        dist.init_process_group("gloo")
    rank, size = (dist.get_rank(), dist.get_world_size()) if ranked else (0, 1)
    model = transformers.LlamaForCausalLM.from_pretrained(fixture, dtype=torch.float32)
    model.train()
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    config = offload_config(model_bytes, str(Path(out) / "nvme"), clip_norm=CLIP, threads=1)
    units = [model.model.embed_tokens, *model.model.layers, (model.model.norm, model.lm_head)]
    engine = oogc.torch.offload(model, units, config, lr=LR, process_group=dist.group.WORLD if ranked else None)
    losses, stats = [], []
    for ids in batches(Path(text).read_bytes()):
        rows = ids.shape[0] // size
        mine = ids[rank * rows : (rank + 1) * rows]
        loss = engine(input_ids=mine, labels=mine, use_cache=False).loss
        loss.backward()
        mean = loss.detach().clone()
        if ranked:
            dist.all_reduce(mean)
            mean /= size
        stats.append(engine.step())
        losses.append(mean.item())
    params = engine.parameters()
    traffic, peak = engine.runtime.traffic(), engine.runtime.peak_bytes()
    torch.save({"rank": rank, "size": size, "world": oogc.world(), "losses": losses, "stats": stats, "params": params,
                "traffic": traffic, "peak": peak},
               Path(out) / f"rank{rank}.pt")
    if ranked:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
