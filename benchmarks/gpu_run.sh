#!/usr/bin/env bash
# Runs on the GPU machine after ../shared/gpu's install (vLLM 0.26 in /tmp/site): installs vllm-duo there,
# then the named stages; logs and JSON go to $OUT. usage: VLLM_DUO_COMMIT=<commit> bash benchmarks/gpu_run.sh STAGE...
# (the machine gets the working tree without .git: the commit the results name comes from VLLM_DUO_COMMIT)
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=/tmp/duo-work; mkdir -p $WORK   # many files: each stage tars its folder into $OUT (8 files come back)
DEADLINE=${DEADLINE:-570}  # seconds of this script that bench parts may use (a device command stops at 600)
# an eval engine's share of the GPU, so that evals run side by side (no spaces: it travels in EVAL_ARGS)
EVAL_ENGINE='{"gpu_memory_utilization":0.25,"kv_cache_memory_bytes":4000000000}'
bench() {  # bench NAME ARGS...: vllm-duo bench, dense vs duo, Llama-3.1-8B shape with dummy weights, into $WORK/NAME
  local name=$1; shift
  timeout $((DEADLINE - SECONDS)) python3 -m vllm_duo.tools.cli bench --model /tmp/llama8b --tokenizer /tmp/smol \
    --pattern Meta-Llama-3.1-8B-Instruct --sparsity 0.5 --timeout 420 --out $WORK/$name "$@" 2>&1 | tail -14
  tar czf "$OUT/$name.tgz" -C $WORK "$name"
}
suite() {  # suite ARGS...: one part of a suite split over the calls of one warm machine (all parts in one folder)
  bench suite "$@"
}
mutant() {  # mutant lost_key|lost_window: a copy of the installed package whose row pass loses keys; prints its path
  local dir=/tmp/mutant-$1 line="tl.where(squeezed, sink + count + taken, 0)" lost="sink + count"
  [ $1 = lost_key ] && lost="sink + count + taken - 1"
  rm -rf $dir && mkdir -p $dir && cp -r /tmp/site/vllm_duo $dir/
  sed -i "s/$line/tl.where(squeezed, $lost, 0)/" $dir/vllm_duo/kernels/row_pages.py
  grep -q "squeezed, $lost, 0)" $dir/vllm_duo/kernels/row_pages.py || { echo "mutant $1: no line to patch" >&2; return 1; }
  echo $dir:$PYTHONPATH
}
# INSTALLED=1: an earlier call of this machine installed it (stages run side by side must not install at once)
[ -n "${INSTALLED:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . \
  > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
for stage in "$@"; do
  echo "== $stage $(date +%T), GPU memory in use: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
  case $stage in
    tests) timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    kernel_tests) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py 2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -8 ;;
    e2e_tests) timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_e2e.py 2>&1 | tee "$OUT/gpu_e2e_tests.log" | tail -15 ;;
    tests_both)  # kernel_tests and e2e_tests at once: one call instead of two (each e2e engine takes 30% of the GPU)
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py > "$OUT/gpu_kernel_tests.log" 2>&1 &
      timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_e2e.py > "$OUT/gpu_e2e_tests.log" 2>&1 &
      wait; tail -n 6 "$OUT/gpu_kernel_tests.log"; tail -n 12 "$OUT/gpu_e2e_tests.log" ;;
    # one group after the other (~6 min): side by side, an engine's startup memory check fails when the other
    # group's engine frees memory during it (vLLM: `init_snapshot.free_memory >= free_gpu_memory`)
    e2e_bf16) for group in "path or all_retrieval_equals" "cuda_graphs or prefix_hit"; do
        timeout $((DEADLINE - SECONDS)) python3 -m pytest -q -m gpu -p no:cacheprovider -k "$group" \
          tests/test_gpu_e2e.py > "$OUT/gpu_e2e_${group%% *}.log" 2>&1
        tail -n 2 "$OUT/gpu_e2e_${group%% *}.log"
      done ;;
    # no duo kernel compiles while serving (the warm-up; vLLM's JIT monitor), bf16 and fp8 KV (~3 min)
    compiles) timeout $((DEADLINE - SECONDS)) python3 -m pytest -q -m gpu -p no:cacheprovider -k compiles \
        tests/test_gpu_e2e.py > "$OUT/gpu_e2e_compiles.log" 2>&1; tail -n 4 "$OUT/gpu_e2e_compiles.log" ;;
    # the full suite (issue 6) in parts of at most ~8 minutes; each workload's dense and duo runs on one machine
    suite1) suite --workloads capacity --capacity-sparsity 0.25 0.5 0.75; suite --workloads ttft_128k --only dense ;;
    suite2) suite --workloads ttft_128k --only duo; suite --workloads tpot_64k --only dense ;;
    suite3) suite --workloads tpot_64k --only duo ;;
    suite4) suite --workloads short; suite --workloads serve_16k --only dense ;;
    suite5) suite --workloads serve_16k --only duo
      suite --workloads decode_heavy --only dense ;;
    suite6) suite --workloads decode_heavy --only duo ;;
    suite7) suite --workloads prefill_heavy ;;
    serve16k_dense) suite --workloads serve_16k --only dense ;;  # suite4-5's serving parts, one call each
    serve16k_duo) suite --workloads serve_16k --only duo ;;
    # issue 9: zigzag (layer-exclusive) vs head-level duo vs dense at 50%, one part per backend (not run yet)
    zigzag1) bench zigzag --workloads tpot_sweep --zigzag-sparsity 0.5 --only dense ;;
    zigzag2) bench zigzag --workloads tpot_sweep --zigzag-sparsity 0.5 --only duo ;;
    zigzag3) bench zigzag --workloads tpot_sweep --zigzag-sparsity 0.5 --only zigzag ;;
    zigzag_long)  # ONLY=dense|duo|zigzag: the sweep's 16k-96k lengths, for a machine with time for two backends
      bench zigzag-long --workloads tpot_sweep --zigzag-sparsity 0.5 --set tpot_sweep.input_lens=16384,65536,98304 \
        --only ${ONLY:?set ONLY} ;;
    zigzag4) bench zigzag --workloads decode_heavy --zigzag-sparsity 0.5 --only zigzag ;;  # dense, duo: suite5-6
    identify)  # DuoAttention gates for SmolLM2: IDENTIFY_STEPS steps (default 2000) at its 8k context, IDENTIFY_ARGS more
      # options (e.g. "--seed 43", or "--layer-gates" for ZigzagAttention's per-layer gates), IDENTIFY_NAME a folder of
      # its own ($WORK/identify-NAME) so runs with other options keep separate checkpoints. A call stops a minute
      # before its deadline with the training state saved; the same stage in the next call of the warm machine
      # continues it (about 18 min for 2000 steps on an H100). The pattern stays there for the eval stage.
      dir=$WORK/identify${IDENTIFY_NAME:+-$IDENTIFY_NAME}; mkdir -p $dir
      timeout $((DEADLINE - SECONDS)) python3 -m vllm_duo.tools.cli identify --model /tmp/smol --steps ${IDENTIFY_STEPS:-2000} \
        --checkpoint $dir/state.pt --time-limit $((DEADLINE - SECONDS - 60)) \
        -o $dir/SmolLM2-135M-Instruct.json --name SmolLM2-135M-Instruct \
        --alias HuggingFaceTB/SmolLM2-135M-Instruct --alias smollm2 --license Apache-2.0 ${IDENTIFY_ARGS:-} 2>&1 | tr '\r' '\n' \
        | tee -a "$dir/identify.log" | grep -v "^identify: .*[0-9]%|" | tail -14
      grep "^identify: " "$dir/identify.log" | tail -1
      cp $dir/identify.log "$OUT/"; cp $dir/*.json "$OUT/" 2>/dev/null ;;
    identify_bg)  # the identify stage without a time limit, in a session of its own (setsid): it outlives this call
      # and trains on while the machine stays warm, beside the evals of the next calls; identify_status reports it.
      # A mask fine-tune (issue 31): IDENTIFY_ARGS="--target-sparsity 0.25 --init-pattern SmolLM2-135M-Instruct
      # --repeated-haystack 0.5" (the bundled pattern by name, or by path /tmp/site/vllm_duo/patterns/*.json) writes
      # that pattern with masks["0.25"] added (its names, sink/recent 64/512 and license kept: --name etc. unused);
      # evaluate it with the eval stage's EVAL_PATTERN=$WORK/identify-NAME/SmolLM2-135M-Instruct.json.
      dir=$WORK/identify${IDENTIFY_NAME:+-$IDENTIFY_NAME}; mkdir -p $dir
      setsid nohup python3 -m vllm_duo.tools.cli identify --model /tmp/smol --steps ${IDENTIFY_STEPS:-2000} \
        --checkpoint $dir/state.pt -o $dir/SmolLM2-135M-Instruct.json --name SmolLM2-135M-Instruct \
        --alias HuggingFaceTB/SmolLM2-135M-Instruct --alias smollm2 --license Apache-2.0 ${IDENTIFY_ARGS:-} \
        > $dir/identify.log 2>&1 < /dev/null &
      echo "started $dir (pid $!)" ;;
    identify_status)  # the last line of every identify run in $WORK; finished ones' patterns and logs into $OUT
      for dir in $WORK/identify*; do
        echo "$dir: $(tr '\r' '\n' < $dir/identify.log | grep -v '^ *$' | tail -1 | cut -c1-200)"
        [ -f $dir/SmolLM2-135M-Instruct.json ] && mkdir -p "$OUT/${dir##*/}" && cp $dir/*.json "$OUT/${dir##*/}/" \
          && tr '\r' '\n' < $dir/identify.log | grep -v "^identify: .*[0-9]%|" > "$OUT/${dir##*/}/identify.log"
      done ;;
    eval)  # needle eval through vLLM on SmolLM2 (issues 20, 31): 400 varied-needle prompts (1k-6k tokens) and 400
      # classic passkey prompts (1.5k-7k) x 7 methods, one engine per method and per grid row for streaming50 (16
      # engines). EVAL_PATTERN: default the bundled pattern, or a file (e.g. an identify run's); EVAL_ARGS: more
      # options (e.g. "--methods full duo25 duo50 --seed 0": duoXX serves sparsity XX%, with the mask trained for it
      # when the file stores one, masks["0.XX"]). Results are written after each method, so a run stopped by the
      # deadline keeps the methods it finished; exit code 3 = a full-attention method under 90% of a family's
      # prompts (the eval cannot see a loss there).
      name=eval-${EVAL_NAME:-smollm2}
      timeout $((DEADLINE - SECONDS)) python3 -m vllm_duo.tools.cli eval --model /tmp/smol --no-progress \
        --pattern ${EVAL_PATTERN:-SmolLM2-135M-Instruct} --out $WORK/$name ${EVAL_ARGS:-} 2>&1 \
        | tee "$OUT/$name.log" | tail -20
      tar czf "$OUT/$name.tgz" -C $WORK "$name" ;;
    mask_round)  # issue 31 in one call: a mask fine-tuned for sparsity TARGET (0.25) from the bundled pattern per seed
      # of SEEDS (all at once, STEPS steps), then each evaluated at once (full and duoXX, both families, EVAL_SEED 0:
      # the tuning prompts; seeds 1 and 2 are held out), each engine in a quarter of the GPU; patterns and evals
      # into $OUT. A seed's eval needs its pattern: a failed fine-tune shows in its log, and its eval is skipped.
      pct=$(python3 -c "print(round(${TARGET:-0.25} * 100))")
      for seed in ${SEEDS:-44 45}; do
        dir=$WORK/identify-mask$pct-$seed; mkdir -p $dir
        timeout $((DEADLINE - SECONDS - 240)) python3 -m vllm_duo.tools.cli identify --model /tmp/smol \
          --steps ${STEPS:-500} --target-sparsity ${TARGET:-0.25} --init-pattern SmolLM2-135M-Instruct \
          --repeated-haystack 0.5 --seed $seed -o $dir/SmolLM2-135M-Instruct.json > $dir/identify.log 2>&1 &
      done; wait
      for seed in ${SEEDS:-44 45}; do
        dir=$WORK/identify-mask$pct-$seed; mkdir -p "$OUT/${dir##*/}"; cp $dir/* "$OUT/${dir##*/}/"
        tr '\r' '\n' < $dir/identify.log | grep -v "^identify: .*[0-9]%|" | tail -3 | cut -c1-200
        [ -f $dir/SmolLM2-135M-Instruct.json ] || continue
        INSTALLED=1 DEADLINE=$((DEADLINE - SECONDS)) EVAL_NAME=mask$pct-$seed-seed${EVAL_SEED:-0} \
          EVAL_PATTERN=$dir/SmolLM2-135M-Instruct.json \
          EVAL_ARGS="--methods full duo$pct --seed ${EVAL_SEED:-0} --engine-args $EVAL_ENGINE" \
          bash benchmarks/gpu_run.sh eval > $WORK/eval-mask$pct-$seed.out 2>&1 &
      done; wait; tail -n 4 $WORK/eval-mask$pct-*.out ;;
    serve)  # tests/test_server.py through `vllm serve` (on CUDA it launches that; the carried vLLM is unpacked, not
      # pip-installed, so its console script is written here: the same two lines pip would write)
      mkdir -p /tmp/bin && printf '#!/usr/bin/env python3\nimport sys\nfrom vllm.entrypoints.cli.main import main\nif __name__ == "__main__":\n    sys.exit(main())\n' > /tmp/bin/vllm
      chmod +x /tmp/bin/vllm
      PATH=/tmp/bin:$PATH timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_server.py -k "${SERVE_TESTS:-}" 2>&1 \
        | tee "$OUT/gpu_server_tests.log" | tail -15 ;;
    tp_tests) timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_tp.py 2>&1 | tee "$OUT/gpu_tp_tests.log" | tail -15 ;;
    bench_tp2) bench bench-tp2 --workloads prefill_heavy decode_heavy --engine-args '--tensor-parallel-size 2' ;;
    # issue 18: duo with fp8 KV against dense fp8 (and dense bf16 for capacity), all parts into one folder "fp8"
    fp8_e2e_tests) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -k fp8 -s tests/test_gpu_e2e.py 2>&1 \
        | tee "$OUT/gpu_fp8_e2e_tests.log" | grep -v "^\(INFO\|WARNING\|(\)" | tail -25 ;;
    fp8_capacity) bench fp8 --workloads capacity --capacity-sparsity 0.5 --kv-cache-dtype auto fp8 ;;
    # the single-request ceiling: one eager startup per backend and KV dtype (ONLY=dense|duo, one call each)
    ceiling) bench ceiling --workloads ceiling --capacity-sparsity ${SPARSITY:-0.5 0.75} \
        --kv-cache-dtype ${KV:-auto fp8} --only ${ONLY:?set ONLY=dense or duo} ;;
    fp8_latency_prefill) bench fp8 --workloads tpot_64k prefill_heavy --kv-cache-dtype fp8 --only ${ONLY:?set ONLY} ;;
    fp8_decode) bench fp8 --workloads decode_heavy --kv-cache-dtype fp8 --only ${ONLY:?set ONLY=dense or duo} ;;
    # bf16 decode at many requests, where the Triton decode merges split heads in its launch (decode.py): ONLY=dense
    # then ONLY=duo on one warm machine, ~4-5 min each
    many_decode) bench many-decode --workloads short decode_heavy --only ${ONLY:?set ONLY=dense or duo} ;;
    fp8_serve) bench fp8 --workloads serve_16k --set serve_16k.request_rates=${RATE:-2} --kv-cache-dtype fp8 \
        --only ${ONLY:?set ONLY=dense or duo} ;;
    # issue 32: decode at batch 4 over 64k and 127k contexts, one server per backend (KV=fp8|auto, ONLY=dense|duo);
    # /tmp/llama8b's config allows 131,072 tokens, which leave 127k of prompt room for 256 output tokens
    tpot_long) bench tpot-long-${KV:-fp8} --workloads tpot_sweep --kv-cache-dtype ${KV:-fp8} \
        --set tpot_sweep.input_lens=${LENS:-65536,130048} tpot_sweep.max_model_len=${MAXLEN:-131072} \
        ${ONLY:+--only $ONLY} ;;
    # issue 32: one request longer than dense fp8's whole cache, served end to end by duo at fp8 on the Llama-3-8B
    # shape with a 4M-token position range (the Gradient-4194k config: dummy weights, so its rope_theta is only
    # copied); LONG_LEN tokens in, 128 out, TTFT and TPOT from `bench serve` and the engine's histograms. long_bg
    # runs it in a session of its own (it outlives the call, ~10 min); long_status reports it.
    long_request) mkdir -p /tmp/gradient4194k && cp /tmp/llama8b/* /tmp/gradient4194k/ && python3 -c "
import json; p = '/tmp/gradient4194k/config.json'; c = json.load(open(p))
c.update(max_position_embeddings=4194304, rope_theta=2804339835.0); c.pop('rope_scaling', None)
json.dump(c, open(p, 'w'), indent=1)"
      DEADLINE=${LONG_DEADLINE:-1700} bench long-request --model /tmp/gradient4194k \
        --pattern Llama-3-8B-Instruct-Gradient-4194k --workloads tpot_sweep --kv-cache-dtype fp8 --only ${ONLY:-duo} \
        --timeout ${LONG_DEADLINE:-1700} --engine-args "--max-num-seqs 8" \
        --set tpot_sweep.num_prompts=1 tpot_sweep.max_concurrency=1 tpot_sweep.input_lens=${LONG_LEN:-1000000} \
        tpot_sweep.output_len=128 tpot_sweep.max_model_len=$((${LONG_LEN:-1000000} + 1024)) ;;
    long_bg) setsid nohup bash benchmarks/gpu_run.sh long_request > $WORK/long_request.out 2>&1 < /dev/null &
      echo "started long_request (pid $!)" ;;
    long_status) tr '\r' '\n' < $WORK/long_request.out | grep -v '^ *$' | tail -5
      tail -n 3 $WORK/long-request/logs/*server*.log 2>/dev/null | cut -c1-250
      [ -d $WORK/long-request ] && tar czf "$OUT/long-request.tgz" -C $WORK long-request ;;
    # issue 22: short requests, 32 at once at 1k and 4k tokens (tpot_sweep has them 4 at once), one backend per call
    short_itl) bench short --workloads short_itl --only ${ONLY:?set ONLY} ;;
    # issue 32: TTFT of 32 requests at 1k sent at once, REPEATS clients one after the other against each server
    # (how their arrival splits them over the first steps varies: 3 runs spread 0.82-1.05x); KV the dtype; one
    # backend per call, ~7 min each with 10 repeats (ONLY=dense, then ONLY=duo: the folder gathers both); SIDE=1:
    # both servers up at once, their clients in turn (dense, duo, then duo, dense, ...), one call (~3 min of
    # startups, 40 s a pair of clients: REPEATS=6 in about 7.5 min)
    short_ttft) if [ -n "${SIDE:-}" ]; then which="--side-by-side"; else which="--only ${ONLY:?set ONLY or SIDE=1}"; fi
      bench short-ttft-${KV:-auto}${SIDE:+-side} --workloads short_itl --kv-cache-dtype ${KV:-auto} $which \
        --set short_itl.input_lens=1024 short_itl.repeats=${REPEATS:-10} ;;
    # issue 32: short_ttft's burst in one process, stepped as served (profile_steps.py --timeline): REPEATS timed
    # bursts of 32 x 1k and one profiled, GPU busy against idle, dense then duo (~2 min each; the server's
    # max_model_len and token budget; BACKENDS: one of them alone; OUTPUT tokens a prompt, served: 256; ARRIVAL ms
    # over which the prompts arrive, 0: at once)
    # (BACKENDS may name one twice, e.g. "dense duo duo dense": each process its own files, numbered in order)
    burst_timeline) i=0; for backend in ${BACKENDS:-dense duo}; do
        i=$((i + 1)); tag=${i}_${backend}_${KV:-auto}_out${OUTPUT:-256}_arrival${ARRIVAL:-0}
        timeout 280 python3 benchmarks/profile_steps.py --backend $backend --model /tmp/llama8b --tokenizer /tmp/smol \
          --load-format dummy --kv-cache-dtype ${KV:-auto} --context 97976 --max-num-batched-tokens 8192 --burst 32 \
          --burst-len 1024 --burst-out ${OUTPUT:-256} --burst-arrival-ms ${ARRIVAL:-0} --timeline ${REPEATS:-10} \
          --out "$OUT/timeline_$tag.json" > "$OUT/timeline_$tag.log" 2>&1
        grep -A15 "^== " "$OUT/timeline_$tag.log" | cut -c1-400
      done ;;
    tpot_short) bench tpot-short --workloads tpot_sweep --set tpot_sweep.input_lens=1024,4096 ;;  # 4 at once, both
    # issue 19: prefix caching on both sides, bf16 and fp8 (ONLY=dense or duo: one backend per call)
    prefix_docs) bench prefix --workloads shared_docs --kv-cache-dtype ${KV:-auto} --only ${ONLY:?set ONLY} ;;
    prefix_chat) bench prefix --workloads chat_turns repeat_32k --kv-cache-dtype ${KV:-auto} --only ${ONLY:?set ONLY} ;;
    # issue 19's target case: more chats than dense's cache holds (64 x ~20k tokens: 2.7x dense bf16's 463k-token
    # pool, 1.4x dense fp8's), so dense queues while duo still fits them at fp8
    prefix_saturated) bench prefix-saturated --workloads chat_turns --set chat_turns.num_prompts=${CHATS:-64} \
        --kv-cache-dtype ${KV:-auto} --only ${ONLY:?set ONLY} ;;
    # issue 28: shared documents beyond dense's cache, `vllm bench throughput` over prefix_repetition prompts, dense
    # then duo (ONLY=dense|duo for one of them); KV the cache dtype (fp8), DOCS x DOC_LEN tokens with PROMPTS
    # questions (the 40 x 20,000 and 320), each shape in a folder of its own
    prefix_full) doc_len=${DOC_LEN:-20000}
      bench prefix-full-${KV:-fp8}-${DOCS:-40}x${doc_len} --workloads shared_docs_full --kv-cache-dtype ${KV:-fp8} \
        --set shared_docs_full.num_documents=${DOCS:-40} shared_docs_full.input_len=$doc_len \
        shared_docs_full.num_prompts=${PROMPTS:-320} shared_docs_full.max_model_len=$((doc_len + 736)) \
        ${ONLY:+--only $ONLY} ;;
    profile)  # issue 22: step times and torch profiles, dense then duo, the chat_turns shape (KV=auto|fp8); PROFILE_ARGS
      # changes the shape (e.g. "--batch 4 --context 1024") and PROFILE_TAG names its files
      for backend in dense duo; do
        tag=${backend}_${KV:-auto}${PROFILE_TAG:+_$PROFILE_TAG}
        timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/profile_steps.py --backend $backend --model /tmp/llama8b \
          --tokenizer /tmp/smol --load-format dummy --kv-cache-dtype ${KV:-auto} ${PROFILE_ARGS:-} --out "$OUT/profile_$tag.json" \
          > "$OUT/profile_$tag.log" 2>&1; grep -A40 "^== " "$OUT/profile_$tag.log" | cut -c1-150
      done ;;
    kernels) timeout 300 python3 benchmarks/kernels_bench.py 2>&1 | tee "$OUT/kernels_bench.log" | tail -40 ;;
    kernels_fp8) timeout 300 python3 benchmarks/kernels_bench.py --fp8 2>&1 | tee "$OUT/kernels_bench_fp8.log" | tail -30 ;;
    kernels_mixed) timeout 300 python3 benchmarks/kernels_bench.py --mixed 2>&1 | tee "$OUT/kernels_bench_mixed.log" | tail -60 ;;
    kernels_long) timeout 400 python3 benchmarks/kernels_bench.py --long-decode 2>&1 \
        | tee "$OUT/kernels_bench_long.log" | tail -60 ;;
    # issue 33: decode steps with Squeezed Attention's lookup and sparse decode against duo's (kernels, no engine)
    squeeze_bench) timeout 400 python3 benchmarks/kernels_bench.py --squeeze-decode 2>&1 \
        | tee "$OUT/kernels_bench_squeeze.log" | tail -40 ;;
    # issue 33: the lookup's and the sparse decode's launch settings swept at 4 x 128k, 1/16 (each part alone, then whole)
    squeeze_sweep) timeout 500 python3 benchmarks/kernels_bench.py --squeeze-sweep 2>&1 \
        | tee "$OUT/kernels_bench_squeeze_sweep.log" | grep -v "^  " | tail -30 ;;
    # issue 33: Nsight Compute over the 4 lookup kernels of one layer of the third eager squeezed step (4 x 128k, 1/16)
    squeeze_ncu) timeout 400 ncu --clock-control none --kernel-name "regex:_centroid_|_band_ends|_run_pages" \
        --launch-skip 256 --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats \
        --section Occupancy --section SchedulerStats --section WarpStateStats \
        python3 benchmarks/kernels_bench.py --squeeze-ncu > "$OUT/ncu_squeeze.txt" 2>&1
      grep -E "^  [_a-z]|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" \
        "$OUT/ncu_squeeze.txt" | head -60 ;;
    # issue 33: the cost of clustering one context's retrieval keys (Llama-3.1-8B's 128 heads, 16k-128k keys)
    cluster_bench) timeout 400 python3 benchmarks/cluster_bench.py ${CLUSTER_ARGS:-} 2>&1 | tee "$OUT/cluster_bench.log" \
        | tail -20 ;;  # CLUSTER_ARGS e.g. "--heads 4 --iters 10 --lengths 131072 --inits random" (one layer served;
      # "--repeats 2 --tiles 128x128x8,256x64x8" times the assignment's other tiles, each iteration's parts apart)
    sparse_tests) timeout 300 python3 -m pytest -q -rP -m gpu -p no:cacheprovider tests/test_sparse_kernels.py \
        tests/test_clustering.py 2>&1 | tee "$OUT/gpu_sparse_tests.log" | grep -E "window [0-9]+ \{|passed|failed" ;;
    # issue 33 served: the sparse kernels' GPU tests beside the squeeze end to end on SmolLM2 (CUDA graphs, bf16, fp8)
    squeeze_tests)
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_kernels.py tests/test_clustering.py \
        > "$OUT/gpu_sparse_tests.log" 2>&1 &
      timeout 560 python3 -m pytest -q -rP -m gpu -p no:cacheprovider -k squeeze tests/test_gpu_e2e.py \
        > "$OUT/gpu_e2e_squeeze.log" 2>&1 &
      wait; tail -n 6 "$OUT/gpu_sparse_tests.log"; grep -E "^(auto|fp8)|shift:|Error|passed|failed" "$OUT/gpu_e2e_squeeze.log" ;;
    # issue 33: the fp8 end-to-end squeeze test (-rP: its shifts) on two mutants that must fail (`mutant`): each
    # squeezed row's row pass without its newest key, and without its whole window (RUNS; fp8: the test as installed;
    # ~4 min each, one engine at a time, as vLLM budgets an engine's memory by what the whole GPU uses)
    squeeze_e2e_fp8) for run in ${RUNS:-fp8_lost_key fp8_lost_window}; do
        path=$PYTHONPATH; [ $run = fp8 ] || path=$(mutant ${run#fp8_}) || exit 1
        PYTHONPATH=$path timeout 290 python3 -m pytest -q -rP -m gpu -p no:cacheprovider -k "squeeze and fp8" \
          tests/test_gpu_e2e.py > "$OUT/gpu_e2e_squeeze_$run.log" 2>&1
        grep -E "^fp8|shift:|passed|failed" "$OUT/gpu_e2e_squeeze_$run.log" | sed "s/^/$run: /" | cut -c1-220
      done ;;
    # issue 33: the sparse kernels' GPU tests on the same two mutants (~1 min each): which tests catch them
    sparse_mutants) for run in lost_key lost_window; do
        path=$(mutant $run) || exit 1
        PYTHONPATH=$path timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_kernels.py \
          > "$OUT/gpu_sparse_$run.log" 2>&1
        grep -E "^FAILED|passed|failed" "$OUT/gpu_sparse_$run.log" | sed "s/^/$run: /" | cut -c1-200
      done ;;
    # issue 33: whether the squeeze, or the KV cache's size, moves prompt logprobs on the GPU and by which attention
    # (KV: fp8 or auto; SET: squeeze, seven engines, ~8 min, or kv_size, six engines, ~7 min; one engine at a time)
    prefill_kv_size) timeout 560 python3 benchmarks/prefill_kv_size.py --kv-cache-dtype ${KV:-fp8} \
        --runs ${SET:-squeeze} --out "$OUT/prefill_kv_size_${SET:-squeeze}_${KV:-fp8}.json" 2>&1 \
        | grep -E "prompt logprobs|Error" ;;
    # issue 33's accuracy: full, duo50 and duo50 squeezed at two budgets on both families (SEED, default 1), two
    # evals side by side, each engine in a quarter of the GPU; KV=fp8: all of them over an fp8 KV cache (where the
    # squeeze keeps fp8 centroids); SQ_METHODS the second eval's methods instead (e.g. "duo50-sq12 duo50-sq12k32")
    squeeze_eval) kv=${KV:+-$KV}
      for methods in "full$kv duo50$kv" "${SQ_METHODS:-duo50$kv-sq20 duo50$kv-sq12}"; do
        INSTALLED=1 DEADLINE=$((DEADLINE - SECONDS)) EVAL_NAME=squeeze-${methods// /-} \
          EVAL_ARGS="--methods $methods --seed ${SEED:-1} --engine-args $EVAL_ENGINE" bash benchmarks/gpu_run.sh eval > $WORK/squeeze-eval-${methods// /-}.out 2>&1 &
      done; wait; tail -n 12 $WORK/squeeze-eval-*.out ;;
    # issue 33's served decode step profiled (the squeeze ran 5.7x slower than duo at 4 x 128k, kernels say 2x faster):
    # duo, duo with the squeeze at 1/16 with CUDA graphs and eager, 4 x 32k fp8 decode (PROFILE_ARGS to change)
    squeeze_profile)
      for variant in "duo:" "squeeze:--squeeze 0.0625" "squeeze_eager:--squeeze 0.0625 --enforce-eager"; do
        tag=${variant%%:*}
        timeout 200 python3 benchmarks/profile_steps.py --backend duo --model /tmp/llama8b --tokenizer /tmp/smol \
          --load-format dummy --kv-cache-dtype fp8 --batch 4 --context 32768 --burst 0 ${variant#*:} \
          ${PROFILE_ARGS:-} --out "$OUT/profile_$tag.json" > "$OUT/profile_$tag.log" 2>&1
        grep -A30 "^== " "$OUT/profile_$tag.log" | cut -c1-150
      done ;;
    # issue 33's speed: decode of 4 requests of 128k tokens at once (tpot_sweep's median inter-token latency), fp8 KV,
    # ONLY=dense|duo|squeeze (duo with the squeeze at budgets 1/16 and 1/4), all into one folder; WEIGHTS=fp8: every
    # server with --quantization fp8 (a folder of its own); KPC: the squeeze's keys per centroid (default 16)
    squeeze_tpot) bench squeeze-tpot${WEIGHTS:+-w$WEIGHTS} --workloads tpot_sweep --set tpot_sweep.input_lens=130816 \
        --max-model-len tpot_sweep=131072 --kv-cache-dtype fp8 --squeeze ${SQUEEZE:-0.0625 0.25} --only ${ONLY:?set ONLY} \
        ${WEIGHTS:+--engine-args "--quantization $WEIGHTS"} ${KPC:+--squeeze-keys-per-cluster $KPC} ;;
    # issue 33's shared document: 32 questions at once over one 64k document, 1,024 tokens each answer, fp8 KV, prefix
    # caching; ONLY=dense|duo|squeeze (the squeeze clusters the document once and every question reads it)
    squeeze_doc) bench squeeze-doc --workloads shared_doc_64k --kv-cache-dtype fp8 --squeeze ${SQUEEZE:-0.0625} \
        --only ${ONLY:?set ONLY} ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
