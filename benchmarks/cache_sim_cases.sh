#!/usr/bin/env bash
# The shared-prefix traces of issue 28, dense vs duo through `vllm-duo cache-sim` (vLLM's scheduler and KV cache
# manager, no model; a few seconds each on a CPU): one JSON and one table per trace into OUT_DIR (default
# cache-sim). usage: OUT_DIR=DIR bash benchmarks/cache_sim_cases.sh [CASE...]
set -uo pipefail
out=${OUT_DIR:-cache-sim}; mkdir -p "$out"
BF16=(--dense-kv-tokens 462944 --kv-cache-dtype bf16)  # an H100's dense caches for the Llama-3.1-8B shape
FP8=(--dense-kv-tokens 915000 --kv-cache-dtype fp8)
declare -A CASES=(
  [fp8_40x20k]="${FP8[*]}"                                                   # the issue's: everything fits duo
  [bf16_40x12k]="--documents 40 --document-len 12000 ${BF16[*]}"            # the bf16 one
  [fp8_70x20k]="--documents 70 --requests 560 ${FP8[*]}"                    # dense holds about half
  [bf16_36x20k]="--documents 36 --requests 144 ${BF16[*]}"                  # dense holds about half
  [bf16_120x12k]="--documents 120 --document-len 12000 --requests 960 ${BF16[*]}"  # more than duo holds
  [bf16_system_2k]="--system-len 2048 --documents 40 --document-len 10000 ${BF16[*]}"
  [bf16_questions_20_1500]="--documents 40 --document-len 12000 --question-len 20 --question-len-max 1500 ${BF16[*]}"
  [bf16_questions_3000]="--documents 40 --document-len 12000 --question-len 3000 ${BF16[*]}"
  [bf16_arrivals_1_per_step]="--documents 70 --document-len 12000 --requests 560 --output-len 500 --arrivals-per-step 1 ${BF16[*]}"
  [bf16_chat_40x16k]="--documents 40 --document-len 16000 --requests 40 --turns 6 --question-len 128 --output-len 256 ${BF16[*]}"
  [bf16_unique_6k]="--documents 320 --document-len 6000 --requests 320 ${BF16[*]}"
  [fp8_8x20k]="--documents 8 --requests 160 ${FP8[*]}"                      # everything fits dense too
)
failed=0
for case in "${@:-${!CASES[@]}}"; do
  echo "## $case"
  # shellcheck disable=SC2086
  python -m vllm_duo.tools.cli cache-sim ${CASES[$case]} --json "$out/$case.json" 2>/dev/null | tee "$out/$case.md" \
    || failed=1
done
exit $failed
