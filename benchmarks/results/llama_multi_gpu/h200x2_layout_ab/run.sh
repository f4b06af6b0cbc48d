#!/usr/bin/env bash
# One nvidia-h200-x2 call (carry .whl), about 560 s: the weight-layout A/B at 8 layers (the package's "fsdp"
# split, on the held layout's first dimension since the eighth run, against --shard largest, the rule before;
# the 2-GPU rows traced), then the 32-layer strong rows with torchrun (the links measured by the alternating
# method; the torchrun build timed). Files: ab_{fsdp,largest}.json, trace_{fsdp,largest}.json.gz, l32s.json,
# l32s.md, l32s_torchrun.log. See ../README.md, seventh and eighth runs.
# An argument runs one part: "ab" (about 260 s) or "l32s" (about 300 s); none runs both.
set -u
part=${1:-all}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,pci.bus_id --format=csv,noheader
[ "$part" = l32s ] || for s in fsdp largest; do
  timeout 125 python3 benchmarks/llama_multi_gpu.py --gpus 2 --shapes 8b --layers 8 --tokens 16384 --no-torchrun \
    --anchors '' --reps 5 --warmup 2 --budget-s 120 --shard "$s" --profile-dir "/tmp/p_$s" --profile-tokens 32768 \
    --out-dir "/tmp/ab_$s" > "/tmp/ab_$s.log" 2>&1
  cp "/tmp/ab_$s/llama_multi_gpu.json" "$OUT/ab_$s.json"
  f=$(find "/tmp/p_$s" -name perfetto_trace.json.gz | head -1); [ -n "$f" ] && cp "$f" "$OUT/trace_$s.json.gz"
  grep -E '"step_s"|error' "/tmp/ab_$s.log" | tail -4
  python3 benchmarks/trace_summary.py "$f" 2>/dev/null | grep "compute by kind"
done
[ "$part" = ab ] && exit 0
timeout 300 python3 benchmarks/llama_multi_gpu.py --gpus 2 --shapes 8b --layers 32 --tokens 32768 --torchrun-shapes 8b \
  --torchrun-tokens 16384 --anchors '' --reps 3 --warmup 1 --budget-s 295 --out-dir /tmp/l32s > /tmp/l32s.log 2>&1
cp /tmp/l32s/llama_multi_gpu.json "$OUT/l32s.json"; cp /tmp/l32s/llama_multi_gpu.md "$OUT/l32s.md"
cp /tmp/l32s/logs/torchrun_8b.log "$OUT/l32s_torchrun.log" 2>/dev/null
grep -E '"built"|"step_s"' /tmp/l32s.log | tail -8
