#!/usr/bin/env bash
# One H200 run of the serving measurements (issue 7): KV transfer GB/s between two processes with its copy ceiling
# (bench_kv_transfer.py), disaggregated vs colocated TTFT and the engine-level transfer (bench_pd.py, synthetic
# SmolLM2-135M), gRPC vs offline engine (load_test.py --compare-offline). Results go to $OUT (or ./out).
# The H200 lacks grpcio >= 1.85.1 / protobuf >= 7.35.1 / grpcio-health-checking / grpcio-reflection: carry wheels in
# .carry/serve_whl (see /work/.library/device/README.md) and they are installed into /tmp/site first.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
if ls .carry/serve_whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .carry/serve_whl/*.whl && export PYTHONPATH=/tmp/site:.
fi
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
  df -h /dev/shm | tail -1; nproc
  python3 -c "import grpc, google.protobuf, cupy; print('grpc', grpc.__version__, 'protobuf', google.protobuf.__version__, 'cupy', cupy.__version__)"
  echo "== bench_kv_transfer"
  [ "${T_KV:-100}" -gt 0 ] && timeout "${T_KV:-100}" python3 benchmarks/bench_kv_transfer.py --pages 2048 --grpc-pages 128 \
    --chunks "${KV_CHUNKS:-64,256}" --copiers "${KV_COPIERS:-auto}" ${KV_EXTRA:-} --reps 3 --out "$OUT/kv_transfer.json"
  echo "== bench_pd"
  [ "${T_PD:-100}" -gt 0 ] && timeout "${T_PD:-100}" python3 benchmarks/bench_pd.py --model synthetic --prompt-tokens 1024,4096 --reps 5 \
    --num-pages 2048 --kv-chunk-pages 64 --out "$OUT/pd.json"
  echo "== load_test"
  [ "${T_LOAD:-100}" -gt 0 ] && timeout "${T_LOAD:-100}" python3 benchmarks/load_test.py --spawn synthetic --compare-offline \
    --num-requests "${LOAD_N:-256}" --concurrency "${LOAD_C:-128}" --prompt-len "${LOAD_P:-uniform:128:512}" \
    --output-len "${LOAD_O:-uniform:64:128}" --warmup-same --max-num-seqs "${LOAD_C:-128}" --num-pages 8192 \
    --out "$OUT/load.json"
  ls /dev/shm | grep tbjax-kv || echo "no shm segments left"
} 2>&1 | tee "$OUT/log"
