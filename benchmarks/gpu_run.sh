#!/usr/bin/env bash
# Runs on the GPU machine after ../shared/gpu's install (vLLM 0.26 in /tmp/site): installs vllm-duo there,
# then the named stages; logs and JSON go to $OUT. usage: bash benchmarks/gpu_run.sh STAGE...
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=/tmp/duo-work; mkdir -p $WORK   # many files: each stage tars its folder into $OUT (8 files come back)
bench() {  # bench NAME WORKLOADS... : vllm-duo bench, dense vs duo, Llama-3.1-8B shape with dummy weights
  local name=$1; shift
  timeout ${BENCH_TIMEOUT:-560} python3 -m vllm_duo.cli bench --model /tmp/llama8b --tokenizer /tmp/smol \
    --pattern Meta-Llama-3.1-8B-Instruct --sparsity 0.5 --timeout 420 --out $WORK/$name "$@" 2>&1 | tail -30
  tar czf "$OUT/$name.tgz" -C $WORK "$name"
}
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
for stage in "$@"; do
  echo "== $stage $(date +%T), GPU memory in use: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
  case $stage in
    tests) timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    kernel_tests) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py 2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -8 ;;
    e2e_tests) timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_e2e.py 2>&1 | tee "$OUT/gpu_e2e_tests.log" | tail -15 ;;
    bench1) bench bench-1 --workloads capacity short --capacity-sparsity 0.25 0.5 0.75 ;;
    bench2) bench bench-2 --workloads prefill_heavy decode_heavy ;;
    bench3) bench bench-3 --workloads ttft_128k tpot_64k ;;
    bench4) bench bench-4 --workloads serve_16k ;;
    bench5) bench bench-5 --workloads prefill_heavy short ;;
    serve)  # tests/test_server.py through `vllm serve` (on CUDA it launches that; the carried vLLM is unpacked, not
      # pip-installed, so its console script is written here: the same two lines pip would write)
      mkdir -p /tmp/bin && printf '#!/usr/bin/env python3\nfrom vllm.entrypoints.cli.main import main\nmain()\n' > /tmp/bin/vllm
      chmod +x /tmp/bin/vllm
      PATH=/tmp/bin:$PATH timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_server.py 2>&1 \
        | tee "$OUT/gpu_server_tests.log" | tail -15 ;;
    tp_tests) timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_tp.py 2>&1 | tee "$OUT/gpu_tp_tests.log" | tail -15 ;;
    bench_tp2) bench bench-tp2 --workloads prefill_heavy decode_heavy --engine-args '--tensor-parallel-size 2' ;;
    kernels) timeout 300 python3 benchmarks/kernels_bench.py 2>&1 | tee "$OUT/kernels_bench.log" | tail -40 ;;
    quick)  # prefill-heavy throughput, dense (FA3) vs duo 50%, via ../shared/gpu/bench.sh
      duo='{"duo": {"pattern": "Meta-Llama-3.1-8B-Instruct", "sparsity": 0.5, "sink": 64, "recent": 256}}'
      bash /tmp/gpu-carry/bench.sh dense_16k 16000 512 32 17000
      bash /tmp/gpu-carry/bench.sh duo50_16k 16000 512 32 17000 --attention-backend duo --additional-config "$duo" ;;
    capacity)  # vLLM's startup figure at 131072 tokens per request
      duo='{"duo": {"pattern": "Meta-Llama-3.1-8B-Instruct", "sparsity": 0.5, "sink": 64, "recent": 256}}'
      bash /tmp/gpu-carry/bench.sh dense_cap 128 16 4 131072
      bash /tmp/gpu-carry/bench.sh duo50_cap 128 16 4 131072 --attention-backend duo --additional-config "$duo" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
