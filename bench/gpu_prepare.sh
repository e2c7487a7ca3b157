#!/usr/bin/env bash
# Prepares the GPU check (bench/gpu_check.sh) for a GPU machine that reaches no package registry:
# the Python packages the check needs there and that machine lacks, for its Python (3.12, x86-64
# Linux), installed here into one folder, compressed (xz) and split into parts that each fit one
# call of the device tool beside the working tree (64 MiB a call, both together).
#
#   bash bench/gpu_prepare.sh            # here, with the registry: writes .gpu/parts/ (ignored by git)
#
# The GPU machine already has numpy, onnx, tokenizers, prometheus-client, pyyaml, flatbuffers,
# ml-dtypes, nvidia-ml-py, pytest's own needs, pytest-timeout and CUDA 13's NVIDIA libraries
# (cuBLAS, cuDNN, cuFFT, cuRAND, the runtime; /work/.library/device/KINDS.md lists them); this
# carries what it lacks: ONNX Runtime's CUDA build (less its TensorRT provider, which the check
# never loads) and our gRPC, settings and test dependencies, pinned as in our venv (pybreaker: the
# tests' conftest imports the sidecar's support). A dry run (docs/gpu.md) checks that list: a
# Python 3.12 with only the machine's packages, no network. The machine unpacks the parts
# (gpu_check.sh): no pip and no registry there. docs/gpu.md gives the
# device calls: one per part, back to back, the last one also running the check.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu
PY_VERSION=${PY_VERSION:-3.12}
WHEELS=(
    onnxruntime-gpu==1.31.1
    grpcio==1.85.1
    grpcio-health-checking==1.85.1
    grpcio-reflection==1.85.1
    protobuf==7.36.2
    msgspec==0.23.0
    watchdog==7.1.0
    pybreaker==1.4.1
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
target=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp "${platforms[@]}")
python3 -m pip download --quiet --no-deps "${target[@]}" -d "$DEST/wheels" "${WHEELS[@]}"
# Installed here for that Python (the wheels only unpack: nothing of them runs here).
python3 -m pip install --quiet --no-deps --no-compile "${target[@]}" --target "$DEST/site" "$DEST"/wheels/*.whl
rm -rf "$DEST/wheels" "$DEST/site/bin" "$DEST"/site/onnxruntime/capi/libonnxruntime_providers_tensorrt.so
# Each call carries one part beside the working tree (tracked and untracked files git does not
# ignore: what the device tool sends, 8-9 MiB here), 64 MiB in all; 2 MiB are left for the tree
# to grow between now and the calls.
tree_kib=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -k --apparent-size -c -- 2>/dev/null | tail -1 | cut -f1)
part_mib=${PART_MB:-$((64 - (tree_kib + 1023) / 1024 - 2))}
tar -C "$DEST" -cf - site | xz -T0 -6 | split -b "${part_mib}m" -d - "$DEST/parts/site.tar.xz.part"
rm -rf "$DEST/site"
parts=$(ls "$DEST/parts" | wc -l)
echo "the working tree: $((tree_kib / 1024)) MiB; the packages for Python $PY_VERSION in $parts parts of at most $part_mib MiB:"
ls -l "$DEST/parts"
echo "device calls (docs/gpu.md), back to back:"
for part in $(ls "$DEST/parts" | head -n $((parts - 1))); do
    echo "  carry [\".gpu/parts/$part\"], command: true"
done
echo "  carry [\".gpu/parts/$(ls "$DEST/parts" | tail -1)\"], command: bash bench/gpu_check.sh, timeout_s 600"
