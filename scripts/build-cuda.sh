#!/bin/bash
# Builds `oogc --features cuda` (the swapper's CUDA backend + candle's CUDA backend) on a machine
# WITHOUT a GPU, into dist/oogc-cuda/: the stripped binary (about 24 MB, small enough to carry to
# the GPU machine), run.sh, which finds the CUDA 13 user-space libraries the binary links
# (cuBLAS, cuBLASLt, cuRAND, cudart) and starts it, the swapper's tests, and data/ (the text and
# fixtures `oogc gpu-check` reads; scripts/device-check.sh runs it there), wheels/: the Python
# module built with `--features cuda` (maturin; abi3, any CPython >= 3.9), which gpu-check's
# check 10 installs to run oogc.torch.offload beside the PyTorch peers, and BUILD.txt (the git
# revision, the toolchain, the binary's NEEDED libraries and where each comes from on the GPU
# machine; also printed). At most 56 MiB in all (checked). The GPU machine needs no Rust toolchain.
#
#   scripts/build-cuda.sh [--bundle-libs] [CUDA_ROOT]    # default CUDA_ROOT: target/cuda13 (1.2 GB)
#   scripts/build-cuda.sh --clippy [CUDA_ROOT]           # lint instead: clippy -D warnings on every
#                                                        # target (tests too) of the workspace with `cuda`
#
# The toolkit comes from PyPI wheels via $OOGC_SHARED/tools/setup-cuda-root.sh (nvcc, headers, the
# libraries above, and a link-time stub of libcuda generated from cudarc's sources); OOGC_SHARED
# (default ../shared beside the repository) also holds the data copied into dist. A fresh clone
# builds: `cargo fetch --locked` first brings every crate (cudarc's sources among them) into
# $CARGO_HOME, wherever that is. CUDA_COMPUTE_CAP=90 (default) compiles candle's kernels for
# Hopper (H100/H200): as PTX, which the driver compiles at load time (run.sh keeps its JIT cache
# in /tmp/oogc-cuda-jit-cache, so each check's process reuses what the first compiled).
# --bundle-libs also copies the libraries into dist/oogc-cuda/lib (about 730 MB: for a GPU
# machine that has the driver but no CUDA 13 wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
START_S=$(date +%s)
BUNDLE=0 CLIPPY=0
case "${1:-}" in
  --bundle-libs) BUNDLE=1; shift ;;
  --clippy) CLIPPY=1; shift ;;
esac
ROOT=${1:-$PWD/target/cuda13}
SHARED=${OOGC_SHARED:-../shared}
SETUP=$SHARED/tools/setup-cuda-root.sh
# Every crate of the lock file, whatever the features (cudarc is only needed with `cuda`, which a
# CPU build never fetched): the setup script reads cudarc's sources, the build needs the rest.
cargo fetch --locked
if [ ! -x "$ROOT/py/nvidia/cu13/bin/nvcc" ]; then
  [ -f "$SETUP" ] || { echo "error: $SETUP not found (the shared tools beside the repository)" >&2
                       echo "fix: set OOGC_SHARED to the shared directory (data/, fixtures/, tools/)" >&2; exit 1; }
  echo "assembling the CUDA 13.0 toolkit from PyPI wheels into $ROOT (needs pip and network)"
  # The setup script looks for cudarc 0.19's sources under ~/.cargo/registry/src. Where cargo
  # keeps them elsewhere (CARGO_HOME), it runs with a HOME whose .cargo/registry/src holds a link
  # to the locked cudarc (pip's config and cache stay the user's: XDG_*, ~/.pip).
  CUDARC_DIR=$(cargo metadata --locked --format-version 1 --all-features | python3 -c 'import sys, json
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "cudarc" and p["version"].startswith("0.19."):
        print(p["manifest_path"].rsplit("/", 1)[0])' | tail -1)
  [ -n "$CUDARC_DIR" ] && [ -d "$CUDARC_DIR" ] || { echo "error: cudarc 0.19 not in the lock file's packages" >&2; exit 1; }
  if ls -d "$HOME"/.cargo/registry/src/*/cudarc-0.19.*/ >/dev/null 2>&1; then
    bash "$SETUP" "$ROOT" >/dev/null
  else
    SHIM=$(mktemp -d "${TMPDIR:-/tmp}/oogc-setup-home.XXXXXX")
    mkdir -p "$SHIM/.cargo/registry/src/locked"
    ln -s "$CUDARC_DIR" "$SHIM/.cargo/registry/src/locked/$(basename "$CUDARC_DIR")"
    [ -d "$HOME/.pip" ] && ln -s "$HOME/.pip" "$SHIM/.pip"
    XDG_CONFIG=${XDG_CONFIG_HOME:-$HOME/.config} XDG_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}
    HOME=$SHIM XDG_CONFIG_HOME=$XDG_CONFIG XDG_CACHE_HOME=$XDG_CACHE bash "$SETUP" "$ROOT" >/dev/null
    rm -rf "$SHIM"
  fi
fi
export CUDA_HOME=$ROOT/py/nvidia/cu13 CUDA_PATH=$ROOT/py/nvidia/cu13
export PATH=$CUDA_HOME/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# The git revision the binaries embed (cli/build.rs reads OOGC_GIT_REV; the same rule: 12 hex
# digits, -dirty when a tracked file differs), so BUILD.txt names the same one.
if REV=$(git rev-parse --short=12 HEAD 2>/dev/null); then
  [ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || REV=$REV-dirty
else
  REV=unknown
fi
export OOGC_GIT_REV=${OOGC_GIT_REV:-$REV}
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
# run: OOGC_REQUIRE_GPU=1), e.g. `run.sh --tests device::cuda`; `run.sh --ldd` prints where each
# library resolves. Libraries: dist's lib/ if bundled, else the CUDA 13 wheels of this
# machine's Python (nvidia-cublas, nvidia-curand, nvidia-cuda-runtime: what torch cu130 installs),
# else the system's; libcuda.so.1 comes from the NVIDIA driver. candle's kernels are PTX that the
# driver compiles when a process first loads them: its JIT cache (CUDA_CACHE_PATH, up to 4 GiB)
# lets every later process (each gpu-check check is one) load them compiled.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WHEELS=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)/nvidia/cu13/lib
if [ -d "$WHEELS" ]; then export LD_LIBRARY_PATH=$WHEELS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/oogc-cuda-jit-cache} CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
unset CUDA_CACHE_DISABLE
BIN=$HERE/oogc
if [ "${1:-}" = "--ldd" ]; then
  echo "LD_LIBRARY_PATH=$HERE/lib:${LD_LIBRARY_PATH:-}"
  exec env LD_LIBRARY_PATH="$HERE/lib:${LD_LIBRARY_PATH:-}" ldd "$BIN"
fi
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
# Check 11's config (its data and NVMe paths are replaced by the check's).
mkdir -p "$DIST/data/configs"
cp configs/llama-8b-h100.toml "$DIST/data/configs/"
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
# What each binary needs at run time (ELF NEEDED), and where it comes from on the GPU machine.
needed() {
  local lib from
  for lib in $(readelf -d "$1" | awk '/\(NEEDED\)/ { gsub(/[][]/, "", $NF); print $NF }'); do
    case "$lib" in
      libcuda.so.*) from="the NVIDIA driver (its library folder; not in any wheel)" ;;
      libcublas.so.* | libcublasLt.so.*) from="wheel nvidia-cublas: <site-packages>/nvidia/cu13/lib (torch cu130's)" ;;
      libcurand.so.*) from="wheel nvidia-curand: <site-packages>/nvidia/cu13/lib (torch cu130's)" ;;
      libcudart.so.*) from="wheel nvidia-cuda-runtime: <site-packages>/nvidia/cu13/lib (torch cu130's)" ;;
      libnvrtc.so.*) from="wheel nvidia-cuda-nvrtc: <site-packages>/nvidia/cu13/lib (torch cu130's)" ;;
      libc.so.* | libm.so.* | libdl.so.* | libpthread.so.* | librt.so.* | ld-linux*) from="glibc (the system)" ;;
      libgcc_s.so.* | libstdc++.so.*) from="the system's GCC runtime" ;;
      *) from="UNKNOWN: not known to be on the GPU machine" ;;
    esac
    if [[ "$from" == wheel* ]] && [ ! -e "$CUDA_HOME/lib/$lib" ]; then from="$from; NOT in this toolkit's lib"; fi
    printf '  %-20s %s\n' "$lib" "$from"
  done
}
# The binary starts (with the driver's stub standing in for libcuda.so.1, the toolkit's libraries
# for the wheels'): it prints its version, the revision it embeds.
STUB=$(mktemp -d "${TMPDIR:-/tmp}/oogc-libcuda-stub.XXXXXX")
ln -s "$CUDA_HOME/lib/stubs/libcuda.so" "$STUB/libcuda.so.1"
if ! VERSION=$(LD_LIBRARY_PATH=$STUB:$CUDA_HOME/lib "$DIST/oogc" --version 2>&1); then
  rm -rf "$STUB"
  echo "error: $DIST/oogc does not start with the toolkit's libraries and the stub libcuda: $VERSION" >&2
  exit 1
fi
rm -rf "$STUB"
WHEEL_SO=$(mktemp -d "${TMPDIR:-/tmp}/oogc-wheel.XXXXXX")
python3 -c 'import sys, zipfile, glob
for w in glob.glob(sys.argv[1] + "/*.whl"):
    z = zipfile.ZipFile(w)
    for n in z.namelist():
        if n.endswith(".so"):
            open(sys.argv[2] + "/" + n.rsplit("/", 1)[-1], "wb").write(z.read(n))' "$DIST/wheels" "$WHEEL_SO"
{
  echo "oogc CUDA bundle: $VERSION"
  echo "built $(date -u '+%F %T UTC') on $(uname -m) by scripts/build-cuda.sh in $(($(date +%s) - START_S)) s"
  echo "toolchain: $(rustc --version); $(nvcc --version | tail -1); CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
  echo "GLIBC: up to $(objdump -T "$DIST/oogc" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
  echo
  echo "oogc NEEDED, and where each comes from on the GPU machine (run.sh: dist's lib/ if bundled,"
  echo "then <site-packages>/nvidia/cu13/lib of python3, then the system's):"
  needed "$DIST/oogc"
  echo "swapper-tests NEEDED:"
  needed "$DIST/swapper-tests"
  for so in "$WHEEL_SO"/*.so; do
    [ -e "$so" ] || continue
    echo "wheels/ $(basename "$so") NEEDED (check 10 loads it beside torch):"
    needed "$so"
  done
} >"$DIST/BUILD.txt"
rm -rf "$WHEEL_SO"
cat "$DIST/BUILD.txt"
if grep -q "UNKNOWN\|NOT in" "$DIST/BUILD.txt"; then
  echo "warning: a library above is not known to be on the GPU machine: check it before the device call" >&2
fi
SIZE=$(du -sb "$DIST" | cut -f1)
echo
echo "built $DIST/oogc ($(du -h "$DIST/oogc" | cut -f1)), $DIST/swapper-tests, $DIST/wheels ($(du -sh "$DIST/wheels" | cut -f1)), $DIST/data ($(du -sh "$DIST/data" | cut -f1)) and $DIST/BUILD.txt: $SIZE bytes ($((SIZE >> 20)) MiB) in all, in $(($(date +%s) - START_S)) s"
echo "on the GPU machine: scripts/device-check.sh (README.md, \"GPU\": the device call), or $DIST/run.sh [--tests|--ldd]"
