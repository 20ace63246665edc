"""What the Llama offload tests share: the run's shape, torch.optim.AdamW's (and the runtime's)
hyper-parameters, the offloaded runs' config, and the seeded byte batches of the training text."""

import torch

STEPS, BATCH, SEQ = 10, 4, 32
# torch.optim.AdamW's arguments, and the runtime's: no clipping, constant lr.
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def batches(text: bytes):
    """`STEPS` batches of `BATCH` byte sequences of `SEQ` from the text's first 200 kB (seed 0)."""
    g = torch.Generator().manual_seed(0)
    data = torch.tensor(list(text[:200_000]), dtype=torch.long)
    for _ in range(STEPS):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        yield torch.stack([data[s : s + SEQ] for s in starts])


def offload_config(model_bytes: int, nvme_dir: str, clip_norm: float = 0.0, threads: int = 2) -> dict:
    """The runtime's config of the offloaded runs: the sim device with an unlimited link, a
    device budget of 70 % of the model (below its size: units move every step), the optimizer
    state on NVMe in `nvme_dir`, the hyper-parameters above."""
    return {
        "device": {"kind": "sim", "link_gbps": 0},
        "budgets": {
            "gpu": model_bytes * 7 // 10,
            "host": "256 MiB",
            "optimizer_state": "nvme",
            "nvme_dirs": [nvme_dir],
            "nvme_size": "32 MiB",
        },
        "optimizer": {"betas": list(BETAS), "eps": EPS, "weight_decay": WD, "clip_norm": clip_norm, "threads": threads},
    }
