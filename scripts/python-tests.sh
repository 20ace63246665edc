#!/usr/bin/env bash
# The Python package's tests on a clean machine: a venv (target/python-venv) with CPU torch,
# transformers, pytest and maturin; `pip install ./python` (maturin builds the extension with
# cargo, in this workspace's target dir); pytest python/tests. Needs python3 (>= 3.9, with
# venv), cargo, network for pip, ../shared beside the checkout (the llama_gqa and mixtral_moe
# fixtures and tinyshakespeare), and the `oogc` binary for test_trainer_vs_torch.py
# (target/debug/oogc: `cargo build -p oogc-cli`, or OOGC_BIN=PATH).
#
#   scripts/python-tests.sh            # after `cargo build --workspace` (CI): the extension in the dev
#                                      # profile, reusing the build's dependencies
#   OOGC_PY_PROFILE=release scripts/python-tests.sh
#   OOGC_PY_VENV=DIR scripts/python-tests.sh -k dlpack   # another venv; arguments go to pytest
#   OOGC_TORCH_INDEX=URL scripts/python-tests.sh         # torch from another index than PyTorch's CPU one
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${OOGC_PY_VENV:-target/python-venv}
profile=${OOGC_PY_PROFILE:-dev}
python=${PYTHON:-python3}
# Two cores: torch, the optimizer and rayon must not oversubscribe.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2}

t0=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# No pip cache (the venv is what is kept; a cache of torch's wheels would double its gigabytes on
# CI's disk), and pip's unpacking beside the venv rather than in a /tmp that may be small.
mkdir -p target/pip-tmp
pip() { TMPDIR=$PWD/target/pip-tmp "$venv/bin/python" -m pip --disable-pip-version-check -q --no-cache-dir "$@"; }
# CPU torch from its own index (PyPI's Linux wheel brings CUDA libraries: gigabytes for nothing);
# OOGC_TORCH_INDEX names another index (a mirror). Skipped when the venv has a torch already.
# When that index cannot be reached (some sandboxes, CI among them, reach PyPI only), PyPI's
# wheel: it works on the CPU too, only larger. Its CUDA libraries are needed to import it (its
# libtorch_cuda links them), triton (1 GB, for torch.compile, which the tests never call) is not:
# torch without its dependencies, then those but triton (pip then says torch lacks triton).
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  if ! pip install torch --retries 1 --timeout 20 --index-url "${OOGC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"; then
    echo "python-tests: the CPU torch index is unreachable; installing torch from PyPI (with its CUDA libraries, without triton)" >&2
    pip install --no-deps torch
    "$venv/bin/python" -c 'from importlib.metadata import requires
for r in requires("torch") or []:
    if "extra ==" not in r and not r.split(";")[0].strip().startswith("triton"):
        print(r)' > target/pip-tmp/torch-deps.txt
    pip install -r target/pip-tmp/torch-deps.txt
  fi
fi
pip install transformers pytest 'maturin>=1.9.4,<2'
echo "python-tests: venv ready in $((SECONDS - t0)) s ($("$venv/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"

t1=$SECONDS
# maturin is the build backend; --profile dev reuses what `cargo build --workspace` compiled.
MATURIN_PEP517_ARGS="--profile $profile" pip install ./python
echo "python-tests: pip install ./python in $((SECONDS - t1)) s"

t2=$SECONDS
# From the repository root, so that `import oogc` is the installed package, not python/oogc/.
# -rs: every skip's reason in the summary (python/tests/skips.py counts them in OOGC_SKIP_LOG).
"$venv/bin/python" -m pytest python/tests -q -rs -p no:cacheprovider "$@"
echo "python-tests: pytest in $((SECONDS - t2)) s; all in $((SECONDS - t0)) s"
