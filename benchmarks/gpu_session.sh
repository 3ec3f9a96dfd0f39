#!/usr/bin/env bash
# One GPU sitting: kernel smoke compile, GPU tests, kernel benchmarks; every step logs under $OUT.
#   bash benchmarks/gpu_session.sh [steps...]
# steps: smoke tests bench (default: these three), sweep, ops (kvq bench ops + kvq autotune from it),
#        e2e (kvq bench e2e on a random-weight Llama-3-8B shape: $E2E_METHODS at $E2E_CONTEXTS, $E2E_ROUNDS (1)
#        interleaved rounds of $E2E_STEPS (64) steps, $E2E_NAME in the file name; #52's single-sequence bar:
#        E2E_METHODS=fp16,turboquant:3,turboquant:4,affine:4 E2E_CONTEXTS=4K,32K,128K E2E_ROUNDS=5 E2E_STEPS=128), dist (2 GPUs: NCCL tests + 64K decode benchmark),
#        durations (GPU time per decode-attention call, read by Nsight Compute), durations-loop (the same with the
#        decode loop's knobs flat32 and slack on and off, one sequence at 128K and 122 x 32K), profile (ncu --set full at 128K),
#        batch (kvq bench batch: BatchGenerator, $BATCHES (1,8) sequences of $BATCH_PROMPT (2048) tokens, 1 warm-up then $BATCH_REPS (3)
#        timed repetitions, their median and min-max reported), e2e-batch (kvq bench e2e --batch:
#        8 sequences at 8K, 32 at 4K), hostsplit (building vs mx.async_eval of a decode step at 4K),
#        growth (decode peak above the caches at 48 x 32K, turboquant:3, the stores grown at the flush and ahead of
#        it, benchmarks/investigations/growth_ahead.py), peaks (the same, step by step, with the stores' views kept
#        across the flush's writes as a third variant, benchmarks/investigations/decode_peaks.py), capacity (kvq bench capacity: the most 32K-token sequences that fit per cache, and their tokens/s, the median
#        of $CAPACITY_REPS (2) timed decodes at that batch; $CAPACITY_METHODS the caches, default fp16 and three),
#        streams (the streams kernel's GPU tests, a vecinfer calibration of random:llama3-8b, then kvq bench e2e for
#        qjl+affine:4, turboquant_prod:4 and vecinfer),
#        profile-streams (ncu --set full of the streams kernel at 128K: occupancy, stall reasons, DRAM throughput),
#        streams-tuning (the streams and encoder GPU tests, every tensor-core variant included, then the kernel's
#        time per call with the register-saving launch knobs beside the default, and a window flush's parts)
#        tests4 (the whole GPU suite with the prefill-chunk tests, -m "gpu or not slow", in 4 parallel groups: about
#        6 minutes instead of over 10), chain (decode attention chained as a step runs it, benchmarks/kernel_chain.py),
#        durations-batch (GPU time per call at 122 sequences of 32K: the capacity shape), ncu-source (ncu --set full of
#        the bound turboquant-3 step at 4K and 128K, its SASS source counters summarised by
#        benchmarks/ncu_source_summary.py), suite4 (every gpu test and the attention engine's tests on the GPU, 4 groups),
#        records (record_outputs before/after a refactor, kernels on), stepcost (cache_step_cost before/after, twice),
#        prefill-kernel (#51: the prefill kernel's GPU parity tests, every form, then its time beside MLX's masked and
#        causal attention at 8K and 32K, benchmarks/prefill_masks.py, for each form: --warpgroups 0 (mma.sync), 1, 2
#        (wgmma), 1p, 2p (wgmma pipelined); PK_FORMS and PK_TESTS (a pytest -k expression) narrow them), prefill-parts (the per-layer chunk breakdown at 8K and 32K, benchmarks/prefill_parts.py),
#        prefill-revisions (kvq bench prefill of SITE_BEFORE's and SITE_AFTER's packages, back to back, twice),
#        prefill-wired (#51: kvq bench prefill on random:llama3-8b, bfloat16, 8K and 32K, fp16 in the same run, with
#        the prefill kernel on (benchmarks/knobs.py --prefill '{"tc": true}') and off, each an untimed warm-up and
#        two timed repetitions), batch-prefill (BatchGenerator prefill of 8 x 2,048 with the first-block checks and
#        without, benchmarks/investigations/batch_prefill_regression.py), step-kernels (#52: GPU time of whole decode
#        steps by kernel at 32K, 2 layers, the streams methods beside kvcache and turboquant:3,
#        benchmarks/investigations/decode_step_kernels.py)
set -u
OUT=${OUT:-/tmp/out}
# the card in result names (h100, h200): runs on either, and a name must say which
DEV=${DEV:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print tolower($2)}')}
DEV=${DEV:-gpu}
mkdir -p "$OUT"
steps=${*:-smoke tests bench}
for step in $steps; do
  case $step in
    smoke) timeout 120 python3 -c '
import mlx.core as mx, kvq, kvq_metal
from kvq.plugins import registry
b = kvq_metal.gpu_backend(); print("backend", b, mx.default_device())
p = kvq.make_params("turboquant", bits=4)
x = mx.random.normal((1, 2, 300, 128)).astype(mx.float16)
k = registry().implementations[("turboquant", b)]; m = registry().implementations[("turboquant", "mlx")]
for name, fn in [("quantize", lambda: k.kvq_quantize(x, p).data["codes"]),
                 ("dequantize", lambda: k.kvq_dequantize(m.kvq_quantize(x, p), mx.float16)),
                 ("attend", lambda: k.attend_kernel(mx.random.normal((1, 8, 1, 128)), m.kvq_quantize(x, p), m.kvq_quantize(x, p), 0.1)[0])]:
    try:
        mx.eval(fn()); print("ok", name)
    except Exception as e:
        print("FAIL", name, str(e)[:6000])
' > "$OUT/smoke.log" 2>&1; tail -c 4000 "$OUT/smoke.log";;
    tests) MLX_ENABLE_TF32=0 timeout 600 python3 -m pytest tests/test_kernels_gpu.py -m gpu -q -x --tb=short -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; tail -c 3000 "$OUT/gpu_tests.log";;
    bench) timeout 300 python3 benchmarks/kernels.py "$OUT/kernels_${DEV}.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; tail -c 3000 "$OUT/bench.log";;
    sweep) timeout 200 python3 benchmarks/kernels.py "$OUT/sweep.json" --sweep-only > "$OUT/sweep.log" 2>&1; tail -c 3000 "$OUT/sweep.log";;
    ops) mkdir -p "$OUT/ops"
         timeout ${OPS_TIMEOUT:-240} python3 -m kvq.cli bench ops --no-progress --out "$OUT/ops" > "$OUT/ops/bench_ops.log" 2>&1
         python3 -m kvq.cli autotune --from-bench "$OUT/ops/bench_ops.json" --out-dir "$OUT/ops" >> "$OUT/ops/bench_ops.log" 2>&1
         tail -c 2000 "$OUT/ops/bench_ops.log";;
    e2e) name="$(date +%F)-${DEV}-${E2E_NAME:-random-llama3-8b}"
         timeout ${E2E_TIMEOUT:-570} python3 -m kvq.cli bench e2e --model random:llama3-8b --dtype bfloat16 \
           --methods ${E2E_METHODS:-fp16,mlx-affine:4,mlx-affine:8,affine:4,turboquant:4,turboquant:k4v3,turboquant:3} \
           --contexts ${E2E_CONTEXTS:-4K,16K,32K,64K,128K} --steps ${E2E_STEPS:-64} --rounds ${E2E_ROUNDS:-1} \
           --largest-first --no-progress --out "$OUT/e2e" --name "$name" > "$OUT/e2e.log" 2>&1
         python3 -m kvq.cli bench e2e --report "$OUT/e2e/$name.json" > /dev/null 2>&1
         tail -c 3000 "$OUT/e2e.log";;
    durations) timeout ${DURATIONS_TIMEOUT:-200} python3 benchmarks/kernel_durations.py --out "$OUT/durations.json" \
                 --variants benchmarks/profile_variants.json > "$OUT/durations.log" 2>&1; tail -c 4000 "$OUT/durations.log";;
    durations-loop) # the decode loop's knobs (flat32, slack) on and off, in one process: one sequence at 128K, then
                    # 122 sequences of 32K (the capacity shape), GPU us per call
                    timeout ${DURATIONS_TIMEOUT:-200} python3 benchmarks/kernel_durations.py --out "$OUT/durations-loop.json" \
                      --contexts 131072 --variants benchmarks/investigations/profile_variants_loop.json > "$OUT/durations-loop.log" 2>&1
                    grep -E "bound|sdpa" "$OUT/durations-loop.log"
                    timeout ${DURATIONS_TIMEOUT:-200} python3 benchmarks/kernel_durations.py --out "$OUT/durations-loop-b122.json" \
                      --contexts 32768 --batch 122 --variants benchmarks/investigations/profile_variants_loop.json \
                      > "$OUT/durations-loop-b122.log" 2>&1
                    grep -E "bound|sdpa" "$OUT/durations-loop-b122.log";;
    profile) timeout 200 ncu --clock-control none -k regex:decode_attend_tc -c 3 --set full -o "$OUT/attend" \
               python3 benchmarks/profile_attend.py > "$OUT/profile.log" 2>&1
             ncu -i "$OUT/attend.ncu-rep" --page details > "$OUT/attend_details.txt" 2>&1
             grep -E "Duration|Registers Per|Achieved Occ|DRAM Through|Issue Slots" "$OUT/attend_details.txt";;
    batch) mkdir -p "$OUT/batch"
           timeout ${BATCH_TIMEOUT:-500} python3 -m kvq.cli bench batch --model random:llama3-8b --dtype bfloat16 \
             --methods fp16,turboquant:3,turboquant:4,affine:4 --batches ${BATCHES:-1,8} --prompt ${BATCH_PROMPT:-2048} --tokens 64 \
             --warmup 1 --reps ${BATCH_REPS:-3} --no-progress --out "$OUT/batch" --name "$(date +%F)-${DEV}-batch${BATCH_NAME:-}" \
             > "$OUT/batch.log" 2>&1
           grep -E "^(###|\| (kvcache|fp16|turbo|affine))" "$OUT/batch.log" || tail -c 2000 "$OUT/batch.log";;
    e2e-batch) mkdir -p "$OUT/e2e"
           for bc in 8:8K 32:4K; do
             timeout ${E2E_TIMEOUT:-270} python3 -m kvq.cli bench e2e --model random:llama3-8b --dtype bfloat16 \
               --methods fp16,turboquant:3,turboquant:4,affine:4 --batch ${bc%%:*} --contexts ${bc##*:} --steps 64 \
               --no-progress --out "$OUT/e2e" --name "$(date +%F)-${DEV}-batch${bc%%:*}" > "$OUT/e2e-batch${bc%%:*}.log" 2>&1
             grep -E "^(###|\| (fp16|turbo|affine))" "$OUT/e2e-batch${bc%%:*}.log" | cut -c1-220
           done;;
    growth) mkdir -p "$OUT/growth"  # decode peak above the caches, stores grown at the flush and ahead of it (#52)
           for mode in at-flush ahead; do
             timeout ${GROWTH_TIMEOUT:-280} python3 benchmarks/investigations/growth_ahead.py $mode \
               --model random:llama3-8b --dtype bfloat16 --methods ${GROWTH_METHODS:-turboquant:3} \
               --batch ${GROWTH_BATCH:-48} --contexts 32K --steps 256 --no-progress --no-plot --out "$OUT/growth" \
               --name "$(date +%F)-${DEV}-growth-$mode" > "$OUT/growth-$mode.log" 2>&1 || tail -c 1500 "$OUT/growth-$mode.log"
             python3 -c 'import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(sys.argv[2], r["method"], "kv GB %.2f" % (r["kv_bytes"] / 1e9), "decode peak above the caches GB %.2f" % ((r["peak_memory_growth"] - r["kv_bytes"]) / 1e9), "tokens/s %.1f" % r.get("tokens_per_second", 0))' \
               "$OUT/growth/$(date +%F)-${DEV}-growth-$mode.json" $mode
           done;;
    peaks) timeout ${PEAKS_TIMEOUT:-300} python3 benchmarks/investigations/decode_peaks.py "$OUT/decode_peaks_${DEV}.json" \
             > "$OUT/decode_peaks.log" 2>&1; tail -c 2500 "$OUT/decode_peaks.log";;
    capacity) mkdir -p "$OUT/capacity"
           timeout ${CAPACITY_TIMEOUT:-560} python3 -m kvq.cli bench capacity --model random:llama3-8b --dtype bfloat16 \
             --methods ${CAPACITY_METHODS:-fp16,turboquant:3,turboquant:4,affine:4} --context 32K --reps ${CAPACITY_REPS:-2} --no-progress \
             --out "$OUT/capacity" --name "$(date +%F)-${DEV}-capacity" > "$OUT/capacity.log" 2>&1
           grep -E "^\| (kvcache|fp16|turbo|affine)" "$OUT/capacity.log" || tail -c 2000 "$OUT/capacity.log";;
    streams) MLX_ENABLE_TF32=0 timeout 200 python3 -m pytest tests/test_kernels_gpu.py -m gpu -q -k streams --tb=short \
               -p no:cacheprovider > "$OUT/gpu_streams.log" 2>&1; tail -c 1500 "$OUT/gpu_streams.log"
             mkdir -p "$OUT/streams"
             # vecinfer on the random-weight shape: a calibration of that model (its keys are random too)
             timeout 240 python3 -m kvq.cli calibrate --model random:llama3-8b --sub-dim 4 --code-bits 8 --quiet \
               > "$OUT/calibrate.log" 2>&1 || tail -c 1500 "$OUT/calibrate.log"
             timeout ${E2E_TIMEOUT:-300} python3 -m kvq.cli bench e2e --model random:llama3-8b --dtype bfloat16 \
               --methods fp16,qjl+affine:4,turboquant_prod:4,vecinfer --contexts ${E2E_CONTEXTS:-32K,128K} --steps 64 \
               --largest-first --no-progress --out "$OUT/streams" --name "$(date +%F)-${DEV}-streams" > "$OUT/streams.log" 2>&1
             grep -E "^\| (fp16|qjl|turbo)" "$OUT/streams.log" | cut -c1-300 || tail -c 2000 "$OUT/streams.log";;
    profile-streams) timeout 300 ncu --clock-control none --set full -k regex:"decode_attend_streams" -c 4 \
               -o "$OUT/streams" python3 benchmarks/profile_streams.py > "$OUT/profile_streams.log" 2>&1
             ncu -i "$OUT/streams.ncu-rep" --page details > "$OUT/streams_details.txt" 2>&1
             grep -E "Duration|Registers Per|Achieved Occ|DRAM Through|Stall|Warp Cycles" "$OUT/streams_details.txt" | head -60;;
    streams-tuning) MLX_ENABLE_TF32=0 timeout 500 python3 -m pytest tests/test_kernels_gpu.py -m gpu -q --tb=short \
               -p no:cacheprovider -k "streams or encoder or selection" > "$OUT/gpu_tests_streams.log" 2>&1
             tail -c 2000 "$OUT/gpu_tests_streams.log"
             timeout 200 python3 benchmarks/streams_kernel_times.py --out "$OUT/streams_kernel_times.json" --variants \
               '{"qsh": {"qsh": true, "pf": false, "nt": 1}, "qsh_pf": {"qsh": true}, "single": {"qsh": true, "pf": false, "nt": 1, "rep": false}}' \
               > "$OUT/streams_kernel_times.log" 2>&1; tail -c 3000 "$OUT/streams_kernel_times.log"
             timeout 300 python3 benchmarks/flush_parts.py --out "$OUT/flush_parts.json" \
               --methods qjl+affine:4,turboquant_prod:4,turboquant:4 > "$OUT/flush_parts.log" 2>&1; tail -c 1500 "$OUT/flush_parts.log";;
    hostsplit) timeout 200 python3 benchmarks/decode_host_split.py > "$OUT/hostsplit.log" 2>&1; cat "$OUT/hostsplit.log";;
    dist) KVQ_TEST_DISTRIBUTED_BACKEND=nccl timeout 240 python3 -m pytest tests/test_distributed.py -q -x \
            -p no:cacheprovider > "$OUT/dist_tests.log" 2>&1; tail -c 1500 "$OUT/dist_tests.log"
          # mlx.launch is a console script: run its entry point with this interpreter
          timeout 300 python3 -c 'import sys; from importlib.metadata import entry_points; (e,) = entry_points(group="console_scripts", name="mlx.launch"); sys.argv[0] = "mlx.launch"; sys.exit(e.load()())' \
            --backend nccl -n 2 -- python3 benchmarks/distributed_decode.py \
            --context 65536 --out "$OUT/distributed_decode.json" > "$OUT/dist_bench.log" 2>&1
          tail -c 1500 "$OUT/dist_bench.log";;
    tests4) MLX_ENABLE_TF32=0 python3 -m pytest tests/test_kernels_gpu.py tests/test_prefill_chunks.py -m "gpu or not slow" \
              --collect-only -q -p no:cacheprovider 2>/dev/null | grep '::' > /tmp/gpu_ids.txt
            split -n r/4 /tmp/gpu_ids.txt /tmp/gpu_ids.
            for g in /tmp/gpu_ids.a?; do
              (MLX_ENABLE_TF32=0 timeout 560 python3 -m pytest -q --tb=short -p no:cacheprovider $(cat $g) \
                 > "$OUT/gpu_tests_$(basename $g).log" 2>&1) &
            done
            wait
            for g in "$OUT"/gpu_tests_gpu_ids.*.log; do tail -n 3 "$g" | grep -E "passed|failed|error"; done
            grep -h -E "^(FAILED|ERROR)" "$OUT"/gpu_tests_gpu_ids.*.log | cut -c1-300;;
    suite4) # every test marked gpu, and the attention engine's tests of any device (chunks, rotating and packed
            # caches, the hot path's depth) run on this GPU, in 4 parallel groups
            # (--rootdir .: ids relative to this tree, wherever the project's pyproject.toml lies)
            { python3 -m pytest tests -m gpu --collect-only -q -p no:cacheprovider --rootdir .
              python3 -m pytest tests/test_prefill_chunks.py tests/test_chunk_partitions.py tests/test_packed_rows.py \
                tests/test_rotating_cache.py tests/test_hot_path_depth.py -m "not slow" --collect-only -q \
                -p no:cacheprovider --rootdir .
            } 2>/dev/null | grep '::' | sort -u > /tmp/suite_ids.txt
            split -n r/4 /tmp/suite_ids.txt /tmp/suite_ids.
            for g in /tmp/suite_ids.a?; do
              (MLX_ENABLE_TF32=0 timeout 540 python3 -m pytest -q --tb=short -p no:cacheprovider --rootdir . $(cat $g) \
                 > "$OUT/suite_$(basename $g).log" 2>&1) &
            done
            wait
            for g in "$OUT"/suite_suite_ids.*.log; do tail -n 3 "$g" | grep -E "passed|failed|error"; done
            grep -h -E "^(FAILED|ERROR)" "$OUT"/suite_suite_ids.*.log | cut -c1-300;;
    records) # greedy tokens and logits before and after a refactor, kernels on (SITE_BEFORE, SITE_AFTER: the two
             # revisions' packages, benchmarks/gpu_revisions.sh)
             PYTHONPATH=/tmp/kvq-site:$SITE_BEFORE timeout 280 python3 benchmarks/record_outputs.py "$OUT/rec_before.npz" \
               --kernels auto > "$OUT/rec_before.log" 2>&1
             PYTHONPATH=/tmp/kvq-site:$SITE_AFTER timeout 280 python3 benchmarks/record_outputs.py "$OUT/rec_after.npz" \
               --kernels auto --compare "$OUT/rec_before.npz" --rtol ${RECORD_RTOL:-1e-6} > "$OUT/rec_after.log" 2>&1
             grep -v "tokens \[" "$OUT/rec_after.log" | tail -c 3000;;
    stepcost) # host cost of a decode step of the caches alone, before and after, back to back, twice
             for i in 1 2; do for side in before after; do
               site=SITE_${side^^}
               PYTHONPATH=/tmp/kvq-site:${!site} timeout 140 python3 benchmarks/cache_step_cost.py --rounds 2 \
                 --out "$OUT/stepcost_${side}_$i.json" > "$OUT/stepcost_${side}_$i.log" 2>&1
               echo "$side $i"; grep "round 2" "$OUT/stepcost_${side}_$i.log"
             done; done;;
    chain) timeout 400 python3 benchmarks/kernel_chain.py --out "$OUT/chain.json" ${CHAIN_ARGS:-} > "$OUT/chain.log" 2>&1
           tail -c 4000 "$OUT/chain.log";;
    durations-batch) timeout 300 python3 benchmarks/kernel_durations.py --out "$OUT/durations-batch.json" --batch 122 \
                       --contexts 32768 ${DURATIONS_ARGS:-} > "$OUT/durations-batch.log" 2>&1
                     tail -c 3000 "$OUT/durations-batch.log";;
    ncu-source) for ctx in 4096 131072; do
                  # the bound steps' kernels are named ..._b<hash> (the plan baked in); profile_attend.py runs each
                  # method's twice (a warm-up first), turboquant-4 then turboquant-3: the 4th is turboquant-3's
                  timeout 200 ncu --clock-control none -k "regex:decode_attend_tc_[0-9a-f]+_b[0-9a-f]+$" --launch-skip 3 \
                    --launch-count 1 --set full -o "/tmp/ncu$ctx" -f python3 benchmarks/profile_attend.py --contexts $ctx \
                    > "$OUT/ncu-source-$ctx.log" 2>&1
                  ncu --import "/tmp/ncu$ctx.ncu-rep" --page details > "$OUT/ncu-details-$ctx.txt" 2>&1
                  ncu --import "/tmp/ncu$ctx.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu$ctx.csv" 2>&1
                  python3 benchmarks/ncu_source_summary.py "/tmp/ncu$ctx.csv" > "$OUT/ncu-source-$ctx.txt" 2>&1
                  grep -E "Duration|Elapsed Cycles|SM Active Cycles" "$OUT/ncu-details-$ctx.txt"
                done;;
    prefill-kernel) MLX_ENABLE_TF32=0 timeout ${PK_TEST_TIMEOUT:-330} python3 -m pytest tests/test_prefill_kernel_gpu.py -q \
                      --tb=short -p no:cacheprovider -k "${PK_TESTS:-not nothing_selected}" > "$OUT/prefill_kernel_tests.log" 2>&1
                    tail -c 2500 "$OUT/prefill_kernel_tests.log"
                    # the kernel's forms: mma.sync, wgmma with 1 and 2 warpgroups, and those pipelined (suffix p)
                    for wg in ${PK_FORMS:-0 1 2 1p 2p}; do
                      pipe=""; [[ $wg == *p ]] && pipe=--pipeline
                      (cd benchmarks && timeout 150 python3 prefill_masks.py "$OUT/masks-wg$wg" --contexts 8K,32K \
                        --reps 10 --warpgroups ${wg%p} $pipe > "$OUT/prefill_masks-wg$wg.log" 2>&1)
                      python3 -c 'import json,sys; [print({k: (round(v * 1e3, 3) if k.endswith("_s") else v) for k, v in r.items()}) for r in json.load(open(sys.argv[1]))["rows"]]' \
                        "$OUT/masks-wg$wg/prefill_masks.json" 2>/dev/null || tail -c 1500 "$OUT/prefill_masks-wg$wg.log"
                    done;;
    prefill-parts) (cd benchmarks && timeout 240 python3 prefill_parts.py "$OUT/parts" --contexts 8K,32K \
                     > "$OUT/prefill_parts.log" 2>&1); tail -c 2500 "$OUT/prefill_parts.log";;
    batch-prefill) # the first-block checks' device waits in a batch's prefill (kvq.cache.guard.Batched): BatchGenerator
                   # prefill of 8 x 2,048, fp16 beside turboquant:3 in every repetition, with the checks and without
                   for off in "" --guard-off; do
                     (cd /tmp && timeout 150 python3 "$OLDPWD/benchmarks/investigations/batch_prefill_regression.py" \
                       "$OUT/batch-prefill${off}" --reps 3 $off > "$OUT/batch-prefill${off}.log" 2>&1)
                     echo "== checks ${off:-on}"; grep "^{" "$OUT/batch-prefill${off}.log" || tail -c 1500 "$OUT/batch-prefill${off}.log"
                   done;;
    prefill-revisions) # kvq bench prefill of two revisions' packages back to back, twice (SITE_BEFORE, SITE_AFTER:
                       # benchmarks/gpu_revisions.sh), kvcache in every run: a change to the prefill path measured
                       for i in 1 2; do for side in before after; do
                         site=SITE_${side^^}
                         PYTHONPATH=/tmp/kvq-site:${!site} MLX_ENABLE_TF32=0 timeout 200 python3 -m kvq.cli bench prefill \
                           --model random:llama3-8b --dtype bfloat16 --contexts 8K,32K --reps 3 \
                           --methods kvcache,turboquant:3,turboquant:4,affine:4 --out "$OUT/prefill" \
                           --name "prefill-$side-$i" --no-progress --no-plot > "$OUT/prefill_${side}_$i.log" 2>&1
                         echo "== $side $i"; grep -E "^(###|\| (kvcache|turbo|affine))" "$OUT/prefill_${side}_$i.log" \
                           || tail -c 1500 "$OUT/prefill_${side}_$i.log"
                       done; done;;
    prefill-wired) for tc in true false; do
                     MLX_ENABLE_TF32=0 timeout 280 python3 benchmarks/knobs.py --prefill "{\"tc\": $tc}" -- bench prefill \
                       --model random:llama3-8b --dtype bfloat16 --contexts 8K,32K --reps 3 \
                       --methods kvcache,turboquant:3,turboquant:4,affine:4 --out "$OUT/prefill" --name "prefill-tc-$tc" \
                       --no-progress --no-plot > "$OUT/prefill_tc_$tc.log" 2>&1
                     tail -c 2500 "$OUT/prefill_tc_$tc.log"
                   done;;
    step-kernels) # #52: GPU time of whole decode steps by kernel (2 layers of random:llama3-8b at $STEPS_CONTEXT,
                  # default 32K), the streams methods beside kvcache and turboquant:3: where the streams step's time
                  # goes (kernel, query preparation, merge, the flush steps apart)
                  timeout ${STEPS_TIMEOUT:-300} python3 benchmarks/investigations/decode_step_kernels.py \
                    --out "$OUT/step-kernels-${STEPS_CONTEXT:-32768}.json" --context ${STEPS_CONTEXT:-32768} --layers 2 \
                    --steps 36 --warmup 34 --methods ${STEPS_METHODS:-kvcache,turboquant:3,qjl+affine:4,turboquant_prod:4} \
                    > "$OUT/step-kernels.log" 2>&1; tail -c 2500 "$OUT/step-kernels.log";;
  esac
done
