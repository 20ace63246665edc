"""What the Llama offload tests share: the run's shape, torch.optim.AdamW's (and the runtime's)
hyper-parameters, and the seeded byte batches of the training text."""

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
