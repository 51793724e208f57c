#!/usr/bin/env bash
# The prepared GPU checks, in parts of a few minutes (a device call runs one or several, under
# the tool's 10-minute cap).
# Run from the repo root with `.whl` carried (httptools, orjson, llguidance; see ../shared/GPU.md), e.g.:
#   bash bench/gpu_check.sh kernels    # ~6 min: kernel tests on CUDA, kernel microbenchmarks
#   bash bench/gpu_check.sh serve      # ~5 min: sampling, whole-model parity, first request
#   bash bench/gpu_check.sh offload    # ~8 min: ft bench bw, then bench/offload.py
#   bash bench/gpu_check.sh models     # ~8 min: MLA, Gated DeltaNet and dequantizing kernels
#                                      #   (never yet run on CUDA), their tests and benches
#   bash bench/gpu_check.sh cpu-experts  # ~5 min: bw, the CPU's MoE products, the CPU arms
#                                      #   (and whether its AVX2 FMAs take denormals at speed)
#   bash bench/gpu_check.sh cpu-attention  # ~2 min: the CPU attentions' AVX-512 forms
#   bash bench/gpu_check.sh waves      # ~4 min: #21 part 2, cache sizes from top_k to all
#   bash bench/gpu_check.sh session    # ~5 min: kernels, bw and offload (with #21's cpu arm)
#                                      #   trimmed into one call, for a session's only lease
# A 15-minute session (start-up included) fits two parts: kernels + serve, or offload + one
# (2026-12-04: session, then cpu-experts + serve, used 765 s of 900).
# Everything is written under $OUT (or ./gpu-check-out).
# kernels: kernel tests on CUDA (float16/bfloat16, one fixed config per autotuned kernel) ->
#   microbenchmarks vs the torch reference and the HBM copy ceiling measured in the same run
#   (fused MoE: GEMV vs grouped at 1..64 tokens, each tuned config's error vs the reference).
# serve: sampler vs a full sort -> whole model through the kernels vs the references (bf16) ->
#   first-request TTFT after ready (no cold compile) at 1/7/100/1000/4000 prompt tokens.
# offload: `ft bench bw` (saves the profile auto/hybrid read) -> bench/offload.py (builds the
#   9.7 GB Qwen3-30B-A3B-shaped 8-layer model, then every arm and the transformers baselines).
# Several parts in one call (`bash bench/gpu_check.sh cpu-experts serve`) each write under
# $OUT/<part>, packed at the end into $OUT/results.tgz: one file back, not one per result.
set -uo pipefail
[ $# -gt 0 ] || set -- kernels
PARTS="kernels serve offload models cpu-experts cpu-attention waves session"
for PART in "$@"; do
  case " $PARTS " in *" $PART "*) ;; *)
    echo "unknown part $PART: one of $PARTS" >&2
    exit 2 ;;
  esac
done
ROOT=${OUT:-gpu-check-out}
mkdir -p "$ROOT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1

run_part() {
PART=$1
OUT=$ROOT
[ "$NPARTS" -eq 1 ] || OUT=$ROOT/$PART
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|NUMA node\(s\)|L3"
  lscpu | grep -o -E "amx_bf16|avx512_bf16|avx512f" | sort -u | tr "\n" " "; echo
  free -g | head -2; gcc --version | head -1; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

case "$PART" in
kernels)
  echo "== kernel tests on CUDA"
  # No -x: one failing shape must not hide the others. The whole log is kept.
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py > "$OUT/kernel_tests.txt" 2>&1
  tail -30 "$OUT/kernel_tests.txt"
  echo "== kernel microbenchmarks"
  timeout 60 python3 bench/kernels.py --dtype bf16 --ops rms_norm,rope,silu_and_mul,topk_softmax,write_kv,paged_attention \
    2>&1 | tee "$OUT/kernels.txt"
  echo "== fused MoE: GEMV vs grouped at 1..64 tokens (the crossover sets _GEMV_MAX_TOKENS)"
  timeout 150 python3 bench/kernels.py --dtype bf16 --ops fused_moe 2>&1 | tee "$OUT/kernels_moe.txt"
  ;;
serve)
  echo "== sampling vs a full-vocabulary sort"
  timeout 60 python3 bench/sampler.py --device cuda 2>&1 | tee "$OUT/sampler.txt"
  echo "== model through the kernels vs the references"
  timeout 120 python3 bench/cuda_parity.py --device cuda --dtype bfloat16 --where 2>&1 | tee "$OUT/parity.txt"
  echo "== first request after ready"
  timeout 60 python3 tools/make_tiny_model.py --family qwen3_moe --out /tmp/gpu-tiny --dtype bfloat16 \
    --hidden-size 1024 --num-layers 4 --num-experts 64 --top-k 8 --moe-intermediate-size 512 \
    --max-position-embeddings 8192 >/dev/null
  timeout 150 python3 bench/first_request.py --model /tmp/gpu-tiny --device cuda \
    --lengths 1 7 100 1000 4000 --out "$OUT/first_request.json" 2>&1 | tee "$OUT/first_request.txt"
  ;;
models)
  echo "== MLA, Gated DeltaNet and dequantizing kernel tests on CUDA"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_mla.py \
    tests/test_kernels_gated_delta.py tests/test_kernels_dequant.py > "$OUT/model_kernel_tests.txt" 2>&1
  tail -30 "$OUT/model_kernel_tests.txt"
  echo "== their microbenchmarks (DeepSeek-V3 / GLM-4.7-Flash MLA, Qwen3.6 Gated DeltaNet, quantized MoE)"
  timeout 240 python3 bench/kernels.py --dtype bf16 \
    --ops mla_attention,gated_delta_rule,causal_conv1d,fused_moe_quant 2>&1 | tee "$OUT/kernels_models.txt"
  ;;
offload)
  echo "== ft bench bw"
  timeout 90 python3 -m freetoken.cli bench bw 2>&1 | tee "$OUT/bw.txt"
  echo "== bench/offload.py"
  timeout 420 python3 bench/offload.py --workdir /tmp --out "$OUT/offload.json" 2>&1 | tee "$OUT/offload.txt"
  ;;
cpu-experts)
  # #21's CPU side on this host (timeouts summing to 540 s): `ft bench bw` (the profile
  # hybrid and auto read), one MoE layer's CPU products alone at the offload model's shape,
  # then the arms that use the CPU. The model is built first, not beside the CPU
  # measurements: its random weights keep every core busy (on 2026-12-04 bw and cpu_moe ran
  # beside it and read 4-5 GB/s where the engine, after it, ran the CPU experts at ~92).
  echo "== AVX2 FMAs on float32 denormals (whether cpu_dot.h's FT_F8L_SHIFT, AMD-only, would"
  echo "   run at its speed on this CPU's AVX2 build)"
  timeout 20 python3 bench/fma_denormals.py 2>&1 | tee "$OUT/fma_denormals.txt"
  echo "== the offload model"
  timeout 180 python3 bench/offload.py --model /tmp/offload-model --build-only 2>&1 | tail -3
  echo "== ft bench bw"
  timeout 40 python3 -m freetoken.cli bench bw 2>&1 | tee "$OUT/bw.txt"
  echo "== one MoE layer on the CPU (128 experts, D 2048, I 768; INT4 g32 as Kimi-K2's;"
  echo "   512 tokens: a prefill chunk, the AMX kernel against oneDNN an expert at a time)"
  timeout 70 python3 bench/cpu_moe.py --experts 128 --hidden 2048 --width 768 \
    --tokens 1,8,16,512 --formats int4_g32 \
    --arms "bf16 native,bf16 onednn,bf16 packed,int4_g32 native" --reps 5 2>&1 \
    | tee "$OUT/cpu_moe.txt"
  for threads in 15 8; do       # all cores but one, half: a team fighting other threads?
    timeout 25 python3 bench/cpu_moe.py --experts 128 --hidden 2048 --width 768 --tokens 1 \
      --formats "" --arms "bf16 native" --reps 5 --threads $threads 2>&1 | tee -a "$OUT/cpu_moe.txt"
  done
  echo "== bench/offload.py: the arms that compute experts on the CPU"
  timeout 120 python3 bench/offload.py --model /tmp/offload-model --skip-transformers \
    --decode-tokens 16 --batches 1,8,16 --out "$OUT/offload.json" \
    --arms cpu,hybrid,auto,resident 2>&1 | tee "$OUT/offload.txt"
  echo "== the same, the CPU experts on all cores but one"
  timeout 80 python3 bench/offload.py --model /tmp/offload-model --skip-transformers \
    --decode-tokens 16 --batches 1,8 --prefill-tokens 0 --arms cpu,hybrid \
    --moe-cpu-threads $(( $(nproc) - 1 )) 2>&1 | tee -a "$OUT/offload.txt"
  ;;
cpu-attention)
  # The CPU decode attention's AVX-512 forms (cpu_heads.h's hsum8 folding 16 lanes,
  # softmax_keys' lane periods; the development machine has AVX2 only) against the torch
  # path, then one layer's decode step on all cores but one: the key splits keep the
  # threads busy at batch 1 (bf16 16-key blocks take the AMX tiles where this CPU has them).
  # Then the prefill attention's vector kernel (cpu_flash_attention.c) in its AVX-512 form
  # (12 x 2 score tiles of 16 lanes) and the AMX one, tested, and timed against torch's path.
  # Timeouts summing to 180 s.
  echo "== tests/test_cpu_decode.py -k attention, tests/test_cpu_prefill_attention.py"
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cpu_decode.py -k attention \
    tests/test_cpu_prefill_attention.py 2>&1 | tail -5 | tee "$OUT/cpu_attention_tests.txt"
  echo "== bench/cpu_decode_attention.py on all cores but one"
  timeout 50 python3 bench/cpu_decode_attention.py --threads $(( $(nproc) - 1 )) \
    --contexts 8192,32768 --batches 1 --reps 5 2>&1 | tee "$OUT/cpu_decode_attention.txt"
  echo "== bench/cpu_attention.py --kernel vector (prefill) on all cores but one"
  timeout 30 python3 bench/cpu_attention.py --kernel vector --threads $(( $(nproc) - 1 )) \
    --shapes 32/4x128 --lengths 4096 --reps 3 2>&1 | tee "$OUT/cpu_prefill_attention.txt"
  ;;
waves)
  # #21 part 2 on the link it is for: every cache size from top_k slots to every expert
  # (prefill chunks of 256 route to nearly every expert of a layer: caches below a layer run
  # them in waves), against the resident run's tokens. Timeouts summing to 480 s.
  echo "== the offload model"
  timeout 180 python3 bench/offload.py --model /tmp/offload-model --build-only 2>&1 | tail -3
  echo "== bench/waves.py"
  timeout 300 python3 bench/waves.py --model /tmp/offload-model --out "$OUT/waves.json" 2>&1 \
    | tee "$OUT/waves.txt"
  ;;
session)
  # A whole 15-minute lease in one call (~5 min; timeouts summing to 565 s: run it with
  # timeout_s 580): the parts above, trimmed, in the order that matters if time runs out;
  # the offload model is written in the background while the kernel tests run. At most 8
  # files come back: env, kernel_tests, bw, build, offload.txt/.json, kernels.
  (timeout 240 python3 bench/offload.py --model /tmp/offload-model --build-only \
     > "$OUT/build.txt" 2>&1) &
  BUILD=$!
  echo "== kernel tests on CUDA"
  XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")      # compiles in 4 processes
  timeout 150 python3 -m pytest -q -p no:cacheprovider $XD tests/test_kernels.py \
    > "$OUT/kernel_tests.txt" 2>&1
  tail -25 "$OUT/kernel_tests.txt"
  wait $BUILD           # bw times the CPU: not beside the build's random weights
  echo "== ft bench bw"
  timeout 45 python3 -m freetoken.cli bench bw 2>&1 | tee "$OUT/bw.txt"
  echo "== bench/offload.py (the cpu arm: #21's CPU experts with attention on the GPU)"
  timeout 190 python3 bench/offload.py --model /tmp/offload-model --skip-transformers \
    --decode-tokens 16 --batches 1,8,16 --out "$OUT/offload.json" \
    --arms resident,cpu,offload-lfu-decay,hybrid,auto,offload-lru-noprefetch,offload-lfu-decay-prefetch-all \
    2>&1 | tee "$OUT/offload.txt"
  echo "== kernel microbenchmarks"
  timeout 50 python3 bench/kernels.py --dtype bf16 --ops fused_moe --rounds 3 2>&1 | tee "$OUT/kernels.txt"
  timeout 30 python3 bench/kernels.py --dtype bf16 --rounds 3 \
    --ops rms_norm,rope,silu_and_mul,topk_softmax,write_kv,paged_attention 2>&1 | tee -a "$OUT/kernels.txt"
  ;;
esac
echo "done; results in $OUT"
}

NPARTS=$#
for PART in "$@"; do
  run_part "$PART"
done
if [ "$NPARTS" -gt 1 ]; then
  tar czf "$ROOT/results.tgz" -C "$ROOT" "$@" && rm -rf "${@/#/$ROOT/}"
  echo "packed: $ROOT/results.tgz"
fi
