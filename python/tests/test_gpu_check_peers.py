"""The peers' script of ``oogc gpu-check`` (check 10, ``cli/src/gpu_check/torch_peers.py``) on the
CPU: the GPU machine runs it on CUDA, so CI rehearses its code here — the oogc peer through
``oogc.torch.offload`` on the sim device beside the resident PyTorch peer, same model, same data."""

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "cli" / "src" / "gpu_check" / "torch_peers.py"
SHAPE = ["--hidden", "64", "--intermediate", "176", "--layers", "2", "--heads", "4", "--kv-heads", "2",
         "--vocab", "128", "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1"]


def peer(name, tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "train", "--peer", name, "--device", "cpu", *SHAPE],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_oogc_peer_trains_the_peers_model_through_offload(tmp_path):
    ours, torch_resident = peer("oogc", tmp_path), peer("resident", tmp_path)
    assert "skipped" not in ours and "error" not in ours, ours
    assert ours["params"] == torch_resident["params"]
    # Every parameter's gradient went D2H once in the step (f32 on the sim device), and the
    # budget (a quarter of parameters + state) forced fetches beyond one pass over the units.
    assert ours["d2h_bytes"] == 4 * ours["params"], ours
    assert ours["h2d_bytes"] >= 4 * ours["params"], ours
    assert ours["tokens_per_s"] > 0 and math.isfinite(ours["loss"])
    # The same model and batches, three AdamW steps of lr 3e-4: the losses agree closely (the
    # resident peer computes under bf16 autocast).
    assert abs(ours["loss"] - torch_resident["loss"]) < 0.02 * torch_resident["loss"], (ours, torch_resident)
