#!/usr/bin/env bash
# The GPU machine's check, in order, each part with its own time limit (about 8 minutes in all):
#   1. the GPU test tier (HVD_TEST_REQUIRE_GPU=1: a missing GPU fails instead of skipping)
#   2. benchmarks/gpu_gradsync.py: ResNet-50's gradient set, device plane vs one raw NCCL call
#   3. benchmarks/gpu_training.py: ResNet-50 and a transformer stack, fp32 and AMP,
#      hvd.DistributedOptimizer vs DDP vs no communication, few steps (np=2 too with two GPUs)
#   4. benchmarks/plane_per_tensor.py at np=1: the device plane's host work per tensor
#      (allreduce_async_, synchronize, one grouped_allreduce_ of 161 tensors; no transport)
# Usage, from anywhere:  OUT=results-dir bash benchmarks/gpu_check.sh
# Everything lands under $OUT (default ./gpu-check): device.txt, one log per part, summary.txt,
# the test tier's JUnit XML and the benchmarks' JSON lines. Exits non-zero if any part failed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
{
  date -u
  nvidia-smi || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
  python -c "import horovod; print('horovod from', horovod.__file__)"
  mpirun --version 2>&1 | head -1
} > "$OUT/device.txt" 2>&1
GPUS=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
status=0
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc after $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}
part gpu_tier 270 env HVD_TEST_REQUIRE_GPU=1 python -m pytest -m gpu tests/gpu -v -rs -p no:cacheprovider \
  --junitxml "$OUT/gpu_tier.xml"
part gpu_gradsync 75 mpirun -np 1 python benchmarks/gpu_gradsync.py --model resnet50 --reps 10
grep '^{' "$OUT/gpu_gradsync.log" > "$OUT/gpu_gradsync.jsonl" 2>/dev/null
part gpu_training 110 python benchmarks/gpu_training.py --steps 10 --warmup 3 --out "$OUT/gpu_training.jsonl"
part plane_per_tensor 45 python benchmarks/plane_per_tensor.py --tensors 161 --reps 30
grep '^{' "$OUT/plane_per_tensor.log" > "$OUT/plane_per_tensor.jsonl" 2>/dev/null
if [ "$GPUS" -ge 2 ]; then
  part gpu_training_np2 90 python benchmarks/gpu_training.py --np 2 --steps 8 --warmup 3 \
    --out "$OUT/gpu_training_np2.jsonl"
fi
exit $status
