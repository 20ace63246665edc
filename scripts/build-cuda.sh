#!/bin/bash
# Builds `oogc --features cuda` (the swapper's CUDA backend + candle's CUDA backend) on a machine
# WITHOUT a GPU, into dist/oogc-cuda/: the stripped binary (about 24 MB, small enough to carry to
# the GPU machine), run.sh, which finds the CUDA 13 user-space libraries the binary links
# (cuBLAS, cuBLASLt, cuRAND, cudart) and starts it, the swapper's tests, and data/ (the text and
# fixtures `oogc gpu-check` reads; scripts/gpu-check.sh runs it), and wheels/: the Python module
# built with `--features cuda` (maturin; abi3, any CPython >= 3.9), which gpu-check's check 10
# installs to run oogc.torch.offload beside the PyTorch peers. At most 56 MiB in all (checked).
# The GPU machine needs no Rust toolchain.
#
#   scripts/build-cuda.sh [--bundle-libs] [CUDA_ROOT]    # default CUDA_ROOT: target/cuda13 (1.2 GB)
#   scripts/build-cuda.sh --clippy [CUDA_ROOT]           # lint instead: clippy -D warnings on every
#                                                        # target (tests too) of the workspace with `cuda`
#
# The toolkit comes from PyPI wheels via ../shared/tools/setup-cuda-root.sh (nvcc, headers, the
# libraries above, and a link-time stub of libcuda). CUDA_COMPUTE_CAP=90 (default) compiles
# candle's kernels for Hopper (H100/H200). --bundle-libs also copies the libraries into
# dist/oogc-cuda/lib (about 730 MB: for a GPU machine that has the driver but no CUDA 13 wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=0 CLIPPY=0
case "${1:-}" in
  --bundle-libs) BUNDLE=1; shift ;;
  --clippy) CLIPPY=1; shift ;;
esac
ROOT=${1:-$PWD/target/cuda13}
SETUP=../shared/tools/setup-cuda-root.sh
if [ ! -x "$ROOT/py/nvidia/cu13/bin/nvcc" ]; then
  [ -f "$SETUP" ] || { echo "error: $SETUP not found (the shared tools beside the repository)" >&2; exit 1; }
  echo "assembling the CUDA 13.0 toolkit from PyPI wheels into $ROOT (needs pip and network)"
  bash "$SETUP" "$ROOT" >/dev/null
fi
export CUDA_HOME=$ROOT/py/nvidia/cu13 CUDA_PATH=$ROOT/py/nvidia/cu13
export PATH=$CUDA_HOME/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# Link against the stub libcuda (the real one comes with the driver) and the wheels' libraries;
# at run time the binary looks in $ORIGIN/lib first, then where run.sh points LD_LIBRARY_PATH.
export LIBRARY_PATH=$CUDA_HOME/lib/stubs:$CUDA_HOME/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
export RUSTFLAGS="${RUSTFLAGS:-} -C link-arg=-Wl,-rpath,\$ORIGIN/lib -L $CUDA_HOME/lib/stubs -L $CUDA_HOME/lib"
# Its own target directory: other RUSTFLAGS would otherwise rebuild the CPU build's artifacts.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
if [ "$CLIPPY" = 1 ]; then
  # Every crate with a `cuda` feature, all targets (the CUDA backend's tests among them); candle's
  # kernels are compiled with nvcc by candle-kernels' build script, as for the binary.
  exec cargo clippy --workspace --features cuda --all-targets --locked -- -D warnings
fi
cargo build --release --locked --features cuda --bin oogc
# The swapper's tests, its GPU tests among them (round trip, budget, concurrency on the CUDA
# device; they skip loudly without one, and OOGC_REQUIRE_GPU=1 makes a skip fail).
TESTS=$(cargo test --release --locked -p oogc-swapper --features cuda-linked --lib --no-run --message-format=json \
        | python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "oogc_swapper":
        print(m["executable"])')
DIST=dist/oogc-cuda
# (The data copied below keeps the read-only modes of ../shared in an older dist: make it removable.)
[ -d "$DIST" ] && chmod -R u+w "$DIST"
rm -rf "$DIST" && mkdir -p "$DIST/lib"
cp "$CARGO_TARGET_DIR/release/oogc" "$DIST/"
cp "$TESTS" "$DIST/swapper-tests"
strip "$DIST/oogc" "$DIST/swapper-tests"
if [ "$BUNDLE" = 1 ]; then
  # Every library that resolves into the toolkit (cuBLAS pulls in cuBLASLt), not the libcuda stub.
  for l in $(LD_LIBRARY_PATH=$CUDA_HOME/lib:$CUDA_HOME/lib/stubs ldd "$DIST/oogc" | awk '/=> \// {print $3}' \
             | grep "^$CUDA_HOME/" | grep -v /stubs/); do
    cp -L "$l" "$DIST/lib/"
  done
fi
cat > "$DIST/run.sh" <<'RUN'
#!/bin/bash
# Starts oogc (CUDA build), or with `--tests [FILTER]` the swapper's tests (GPU ones required to
# run: OOGC_REQUIRE_GPU=1), e.g. `run.sh --tests device::cuda`. Libraries: dist's lib/ if bundled, else the CUDA 13 wheels of this
# machine's Python (nvidia-cublas, nvidia-curand, nvidia-cuda-runtime: what torch cu130 installs),
# else the system's; libcuda.so.1 comes from the NVIDIA driver.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WHEELS=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)/nvidia/cu13/lib
if [ -d "$WHEELS" ]; then export LD_LIBRARY_PATH=$WHEELS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
BIN=$HERE/oogc
if [ "${1:-}" = "--tests" ]; then shift; BIN=$HERE/swapper-tests; export OOGC_REQUIRE_GPU=${OOGC_REQUIRE_GPU:-1}; fi
if ! LD_LIBRARY_PATH=$HERE/lib:${LD_LIBRARY_PATH:-} ldd "$BIN" | grep -q "not found"; then
  exec "$BIN" "$@"
fi
echo "error: libraries missing for $HERE/oogc:" >&2
LD_LIBRARY_PATH=$HERE/lib:${LD_LIBRARY_PATH:-} ldd "$HERE/oogc" | grep "not found" >&2
echo "fix: install the NVIDIA driver (libcuda.so.1) and CUDA 13 cuBLAS/cuRAND/cudart (pip install nvidia-cublas nvidia-curand nvidia-cuda-runtime), or rebuild with --bundle-libs" >&2
exit 1
RUN
chmod +x "$DIST/run.sh"
# The data of `oogc gpu-check` (its default --shared directory when run from dist: data/ beside the
# binary): the training text and the Llama-family fixtures its checks read.
SHARED=../shared
for f in "$SHARED/data/tinyshakespeare.txt" "$SHARED/fixtures/llama/tokenizer.json"; do
  [ -f "$f" ] || { echo "error: $f not found (the shared data beside the repository)" >&2; exit 1; }
done
mkdir -p "$DIST/data/data" "$DIST/data/fixtures/llama"
cp "$SHARED/data/tinyshakespeare.txt" "$SHARED/data/README.md" "$DIST/data/data/"
cp "$SHARED/fixtures/llama/tokenizer.json" "$SHARED/fixtures/llama/cases.json" "$SHARED/fixtures/llama/README.md" \
   "$DIST/data/fixtures/llama/"
# The CUDA wheel of the Python module (check 10's oogc.torch.offload peer). maturin from the
# Python tests' venv, else a venv of its own (pip, network).
MATURIN=${MATURIN:-}
if [ -z "$MATURIN" ]; then
  if [ -x target/python-venv/bin/maturin ]; then MATURIN=target/python-venv/bin/maturin
  else
    [ -x target/maturin-venv/bin/maturin ] || { python3 -m venv target/maturin-venv && \
      target/maturin-venv/bin/python -m pip -q --disable-pip-version-check install 'maturin>=1.9.4,<2'; }
    MATURIN=target/maturin-venv/bin/maturin
  fi
fi
# A plain linux tag, no auditwheel: the module links the CUDA libraries the GPU machine's torch
# brings (check 10 runs it there, beside torch), which no manylinux policy allows.
"$MATURIN" build --release --locked -m python/Cargo.toml --features cuda --compatibility linux --auditwheel skip \
  --out "$DIST/wheels" --strip --quiet
cp -r "$SHARED/fixtures/llama/llama_gqa" "$SHARED/fixtures/llama/qwen2_tied" "$SHARED/fixtures/llama/mixtral_moe" \
   "$DIST/data/fixtures/llama/"
# Check 4's device-optimizer vectors: three of torch's AdamW/Adam cases (4.6 MB; the cases
# cli/src/gpu_check/numerics.rs names in DEVICE_ADAM_CASES).
mkdir -p "$DIST/data/fixtures/adamw"
cp "$SHARED/fixtures/adamw/cases.json" "$SHARED/fixtures/adamw/README.md" "$DIST/data/fixtures/adamw/"
for c in adam_l2 adamw_bigeps adamw_nowd_tiny; do cp "$SHARED"/fixtures/adamw/$c.*.f32 "$DIST/data/fixtures/adamw/"; done
chmod -R u+w "$DIST/data"
# dist/oogc-cuda is carried to the GPU machine, which takes at most 64 MiB: keep it within 56 MiB
# (the bundled libraries of --bundle-libs are for a machine without the wheels, not this limit).
SIZE=$(du -sb "$DIST" | cut -f1)
LIMIT=$((56 << 20))
if [ "$BUNDLE" = 1 ]; then
  echo "note: $DIST is $((SIZE >> 20)) MiB with the bundled libraries (over the 56 MiB a carry to the GPU machine allows)"
elif [ "$SIZE" -gt "$LIMIT" ]; then
  echo "error: $DIST is $SIZE bytes ($((SIZE >> 20)) MiB), over the limit of $LIMIT bytes (56 MiB):" >&2
  du -ab --max-depth=4 "$DIST" | sort -rn | head -15 >&2
  exit 1
fi
echo "built $DIST/oogc ($(du -h "$DIST/oogc" | cut -f1)), $DIST/swapper-tests, $DIST/wheels ($(du -sh "$DIST/wheels" | cut -f1)) and $DIST/data ($(du -sh "$DIST/data" | cut -f1)): $((SIZE >> 20)) MiB in all; start them with $DIST/run.sh [--tests], or scripts/gpu-check.sh OUT_DIR"
echo "needs: GLIBC up to $(objdump -T "$DIST/oogc" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1), libcuda.so.1 (driver), CUDA 13 cuBLAS/cuRAND/cudart"
