#!/usr/bin/env bash
# Every GPU check in one run, for a machine with CUDA, torch and triton already installed (no downloads):
# build lazyckpt in place (its C checksum loop included), run the tests marked `gpu`, then benchmarks/gpu_copy.py.
# Usage: bash benchmarks/gpu_checks.sh OUTDIR [BUDGET_S]   (BUDGET_S: seconds for gpu_copy.py's sweeps, default 300)
# Everything is written under OUTDIR (test log, gpu_copy.json, gpu_copy.log). A failed build stops the run; after
# it, each step runs even if the one before failed.
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUTDIR [BUDGET_S]}
budget=${2:-300}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
echo "== build $(date -u +%H:%M:%S)"
$py -m pip install -q --no-deps --no-build-isolation -e . > "$out/build.log" 2>&1 || { cat "$out/build.log"; exit 1; }
$py -c "import torch, lazyckpt.format.checksum; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
echo "== gpu tests $(date -u +%H:%M:%S)"
$py -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/gpu_tests.log" | tail -15 || status=1
echo "== gpu_copy.py $(date -u +%H:%M:%S)"
$py benchmarks/gpu_copy.py --out "$out/gpu_copy.json" --budget-s "$budget" 2>&1 | tee "$out/gpu_copy.log" | tail -60 || status=1
echo "== done $(date -u +%H:%M:%S)"
exit $status
