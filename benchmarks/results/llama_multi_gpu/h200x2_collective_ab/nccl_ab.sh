#!/bin/bash
# A/B of NCCL settings on the 2-GPU compute-bound strong row (8B-like, 8 layers, 32768 global tokens).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.:benchmarks NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
L=${LAYERS:-8}
S="python3 benchmarks/llama_multi_gpu.py --piece largest --shape 8b --layers $L --reps 5 --warmup 2 --fill-device cuda:0 --largest-headroom 1.25 --largest-host-reserve-gb 16"
t0=$(date +%s)
$S --gpus 1 --tokens 16384 --piece-out $OUT/g1.json > /tmp/g1.log 2>&1; echo "g1 rc=$? $(( $(date +%s)-t0 ))s"; grep '"step_s"' /tmp/g1.log
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING $S --gpus 2 --tokens 32768 --piece-out $OUT/base.json --profile-dir /tmp/p > /tmp/base.log 2>&1; echo "base rc=$? $(( $(date +%s)-t0 ))s"; grep '"step_s"' /tmp/base.log
grep -E "NCCL INFO (.*channels|.*Channel 00|.*proto|.*Algo|.*Proto|.*LL128|.*AllGather|.*ReduceScatter)" /tmp/base.log | sort | uniq -c | sort -rn | head -40 > $OUT/nccl_info.txt
grep -c "NCCL INFO" /tmp/base.log >> $OUT/nccl_info.txt
f=$(find /tmp/p -name 'perfetto_trace.json.gz' | head -1); ls -la $f; cp $f $OUT/trace_base.json.gz
for v in "NCCL_MAX_NCHANNELS=8" "NCCL_MAX_NCHANNELS=4" "NCCL_PROTO=Simple"; do
  name=$(echo $v | tr '=' '_')
  env $v $S --gpus 2 --tokens 32768 --piece-out $OUT/$name.json > /tmp/$name.log 2>&1; echo "$v rc=$? $(( $(date +%s)-t0 ))s"; grep '"step_s"' /tmp/$name.log
done
