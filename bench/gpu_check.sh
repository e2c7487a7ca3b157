#!/usr/bin/env bash
# The GPU check: one command on a bare machine with an NVIDIA GPU and no package registry, in under
# ten minutes. It unpacks the packages bench/gpu_prepare.sh made (.gpu/parts/), runs the CUDA
# tests, and measures CPU and CUDA side by side in one run: Infer p50 and rows/s at batch 1 and 64
# on an MLP and a MiniLM-L6-shaped encoder with the service's overhead over a bare ONNX Runtime
# loop (bench.gpu), Generate tokens/s at 1, 8 and 32 streams (bench.generate), and a swap under
# load with the device memory before, during and after (bench.swaps). Everything it prints goes to
# one file, $OUT/gpu_check.txt (OUT: the device tool's folder, else bench/results/gpu-check).
#
#   bash bench/gpu_check.sh
#
# Each step has its own time bound, and the whole check 570 s; a failed step is reported and the
# others still run; the exit status says whether every step passed. On a host without CUDA the CUDA steps say why and skip:
# its CPU half still runs (that is how it is tried on a machine without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.txt") 2>&1
status=0
step() { echo; echo "== $* ($(date -u +%T), ${SECONDS} s in)"; }
# The whole check ends inside the device tool's 600 s a command (CHECK_S, 570 by default), so
# that what it printed comes back even when a step is slow: each step is bounded by its own
# limit or by what is left, whichever is less, and one that would get under 15 s is skipped.
deadline=$((SECONDS + ${CHECK_S:-570}))
bounded() {
    local own=$1 left=$((deadline - SECONDS))
    shift
    if [ "$left" -lt 15 ]; then
        echo "skipped: the check's ${CHECK_S:-570} s are spent"
        return 1
    fi
    timeout "$((own < left ? own : left))" "$@"
}

step "install"
SITE=/tmp/modelyard/site
if ls .gpu/parts/site.tar.xz.part* >/dev/null 2>&1; then
    # The parts gpu_prepare.sh made, in order: one xz stream, whose own checks fail on a part
    # missing or cut short. Nothing is fetched: the packages are unpacked, as installed there.
    rm -rf "$(dirname "$SITE")" && mkdir -p "$(dirname "$SITE")"
    ls -l .gpu/parts
    cat .gpu/parts/site.tar.xz.part* | xz -dc | tar -x -C "$(dirname "$SITE")" ||
        { echo "the carried parts do not make a whole archive: carry every part of .gpu/parts"; exit 1; }
    # This tree's modelyard: its package laid out in a folder of links (bench/lib/trees.py).
    links=$(python3 -m bench.lib.trees --pythonpath .) || exit 1
    export PYTHONPATH="$SITE:$links:$PWD"
else
    echo "no .gpu/parts: using this environment as it is"
    links=$(python3 -m bench.lib.trees --pythonpath .) || exit 1
    export PYTHONPATH="$links:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
# CUDA's libraries from this machine's own nvidia-* wheels (CUDA 13's nvidia/cu13/lib, cuDNN's
# nvidia/cudnn/lib): ONNX Runtime's preload looks beside its own package first (our unpacked
# folder, which has none), then on the loader's path, which this sets.
nvidia_libs=$(python3 -c 'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null |
    while read -r root; do find "$root" -maxdepth 3 -type d -name lib; done | tr '\n' ':')
if [ -n "$nvidia_libs" ]; then
    export LD_LIBRARY_PATH="${nvidia_libs%:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
python3 --version
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 || true
python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.__file__, o.get_available_providers())'
# One probe (a CUDA session's start costs seconds): its line to the output, the verdict kept.
cuda_ok=$(python3 -c 'import sys; from modelyard.service.runtime.providers import detect_providers as d
c = d(); print("provider:", c.default, "-", c.summary(), file=sys.stderr); print(int(c.cuda_usable))')

step "CUDA tests (they skip, saying why, where CUDA cannot run)"
bounded 300 python3 -m pytest -q -rs -p no:cacheprovider tests/service/integration/test_cuda.py \
    tests/service/integration/test_cuda_fallback.py || status=1

step "Infer: CPU and CUDA, service against bare ONNX Runtime"
bounded 240 python3 -m bench.gpu --providers cpu,cuda --duration 3 --out "$OUT/gpu.json" || status=1

providers=cpu
[ "$cuda_ok" = 1 ] && providers="cpu cuda" || echo "(no CUDA here: the CUDA halves below are skipped)"
for provider in $providers; do
    step "Generate, execution.provider $provider"
    bounded 150 python3 -m bench.generate --provider "$provider" --tokens 32 --rounds 1 || status=1
done

last=${providers##* }
step "a swap under load, execution.provider $last, device memory before, during and after"
bounded 90 python3 -m bench.swaps --provider "$last" --swaps 10 --phase-s 5 --concurrency 8 || status=1

step "done: exit status $status"
exit "$status"
