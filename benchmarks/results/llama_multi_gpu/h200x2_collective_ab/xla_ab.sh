#!/bin/bash
# A/B of XLA collective-combining flags on the 2-GPU compute-bound strong row (8B-like, 8 layers, 32768 global tokens).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.:benchmarks NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
L=${LAYERS:-8}
S="python3 benchmarks/llama_multi_gpu.py --piece largest --shape 8b --layers $L --reps 5 --warmup 2 --fill-device cuda:0 --largest-headroom 1.25 --largest-host-reserve-gb 16 --gpus 2 --tokens 32768"
t0=$(date +%s)
i=0
for v in "" "--xla_gpu_all_gather_combine_threshold_bytes=1048576" "--xla_gpu_all_gather_combine_threshold_bytes=1048576 --xla_gpu_reduce_scatter_combine_threshold_bytes=1048576 --xla_gpu_all_reduce_combine_threshold_bytes=1048576" "--xla_gpu_enable_latency_hiding_scheduler=true" "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_all_gather_combine_threshold_bytes=1048576 --xla_gpu_reduce_scatter_combine_threshold_bytes=1048576 --xla_gpu_all_reduce_combine_threshold_bytes=1048576"; do
  i=$((i+1))
  XLA_FLAGS="$v" $S --piece-out $OUT/v$i.json --profile-dir /tmp/p$i > /tmp/v$i.log 2>&1; echo "v$i [$v] rc=$? $(( $(date +%s)-t0 ))s"; grep '"step_s"' /tmp/v$i.log | cut -c1-200
done
