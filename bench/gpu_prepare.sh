#!/usr/bin/env bash
# Prepares the GPU check (bench/gpu_check.sh) for a GPU machine that reaches no package registry:
# the wheels the check installs there, for that machine's Python (3.12, x86-64 Linux), tarred and
# split into parts that each fit one call of the device tool (64 MiB with the working tree).
#
#   bash bench/gpu_prepare.sh            # here, with the registry: writes .gpu/parts/ (ignored by git)
#
# The GPU machine already has numpy, onnx, tokenizers, prometheus-client, pyyaml, flatbuffers,
# ml-dtypes, nvidia-ml-py, pytest-timeout and CUDA 13's NVIDIA libraries (cuBLAS, cuDNN, cuFFT,
# cuRAND, the runtime; /work/.library/device/KINDS.md lists them); this carries what it lacks:
# ONNX Runtime's CUDA build and our gRPC, settings and test dependencies, pinned as in our venv.
# Then, with the device tool: one call per part, back to back (the machine stays warm ~30 s
# between calls and keeps what earlier calls carried), each carrying `.gpu/parts/<part>` with the
# command `true`; then one call carrying nothing new that runs `bash bench/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu
PY_VERSION=${PY_VERSION:-3.12}
PART_MB=${PART_MB:-50}
WHEELS=(
    onnxruntime-gpu==1.31.1
    grpcio==1.85.1
    grpcio-health-checking==1.85.1
    grpcio-reflection==1.85.1
    protobuf==7.36.2
    msgspec==0.23.0
    watchdog==7.1.0
    pytest==9.2.0
    pytest-asyncio==1.5.0
)
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
rm -rf "$DEST"
mkdir -p "$DEST/wheels" "$DEST/parts"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${platforms[@]}" -d "$DEST/wheels" "${WHEELS[@]}"
tar -C "$DEST" -cf - wheels | split -b "${PART_MB}m" -d - "$DEST/parts/wheels.tar.part"
rm -rf "$DEST/wheels"
echo "wheels for Python $PY_VERSION in $(ls "$DEST/parts" | wc -l) parts of at most $PART_MB MiB:"
ls -l "$DEST/parts"
