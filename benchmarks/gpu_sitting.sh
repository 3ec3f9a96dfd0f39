#!/usr/bin/env bash
# One sitting on a lent GPU machine with no network, on top of benchmarks/gpu_session.sh: MLX from the offline
# bundle, kvq from two revisions' wheels, the kernel GPU tests in parallel groups, and GPU time per decode call of
# both revisions. Results under $OUT (the device tool's folder that comes back).
#
# On this machine first (once; see the device tool's notes for the two carry calls):
#   bash ../shared/gpu/bundle.sh .gpu            # MLX's CUDA build, in parts; the tree is ~14 MB, so split the
#   cat .gpu/mlx-cuda.tar.xz.part-* > /tmp/f && rm .gpu/mlx-cuda.tar.xz.part-* \
#     && split -b 38M -a 2 /tmp/f .gpu/mlx-cuda.tar.xz.part-    # bundle in 38 MiB parts to stay under 64 MiB a call
#   bash benchmarks/gpu_revisions.sh BEFORE HEAD .gpu/rev     # .gpu/rev/{before,after}/*.whl
# Then, on the device (call B carries .gpu/mlx-cuda.tar.xz.part-ab, .gpu/wheels, .gpu/install.sh, .gpu/rev):
#   bash benchmarks/gpu_sitting.sh install ktests dur [any gpu_session.sh step ...] pack
# Steps:
#   install  MLX into /tmp/kvq-site (.gpu/install.sh; the first part stashed in /tmp/stash by call A), each
#            revision's wheels into /tmp/site-before and /tmp/site-after
#   ktests   tests/test_kernels_gpu.py -m gpu against the after revision, in $T_GROUPS (4) parallel groups, each cut
#            at $T_TIMEOUT (400) s; $T_K: a pytest -k expression narrowing them
#   dur      benchmarks/kernel_durations.py for each side of $DUR_SIDES (after) at $DUR_CONTEXTS (131072) tokens,
#            $DUR_BATCH (1) sequences, with $DUR_VARIANTS (a variants JSON file, after side only) and $DUR_TAG in
#            the file names
#   prefill  kvq bench prefill of each side of $PF_SIDES (before after) on random:llama3-8b at $PF_CONTEXTS, then
#            benchmarks/investigations/prefill_host_profile.py's split of the host's time (8 layers, 8K)
#   prefill-chunk  kvq bench prefill of the after side with chunks of $PF_CHUNK (8192) tokens, fp16 alike
#   steps    decode_step_kernels.py (GPU time of decode steps by kernel, 2 layers at $STEPS_CONTEXT) of each side of
#            $STEPS_SIDES (before after), $STEPS_BATCH sequences; $STEPS_N timed steps after $STEPS_WARMUP (36, 34:
#            with $STEPS_FLUSH 32 one flush among them; every launch is profiled, so fewer steps finish sooner)
#   stimes   streams_kernel_times.py (the streams kernel and merge per call, fp16 SDPA beside) of each side of $ST_SIDES
#            (before after), the after side with the knob variants $ST_VARIANTS (JSON)
#   hostwait decode_host_split.py at 32K for $HW_METHODS (turboquant:3): batches 1-4 and 32, then 32 with the buffer
#            cache emptied after the fill and with no cache (the leads for the batched step's wait, #52: it was the
#            fill's cached buffers, and the fill empties them since ae25aa6, so this step now checks the fix); then
#            investigations/mlx_batch_wait.py, the same question asked of MLX alone
#   batch-sides  kvq bench batch (BatchGenerator) of each side of $BS_SIDES at $BATCHES x $BATCH_PROMPT, fp16 in each
#   ctests   the CPU suite's files $CT_FILES (the chunk, guard and rotating tests) run on the GPU, against each side of
#            $CT_SIDES (before after), all in parallel, each cut at $CT_TIMEOUT (270) s; prints the failures of each
#            side (several fail on a GPU at both revisions: exactness and hook counts written for the CPU, so a
#            change shows as a failure of its side only); $CT_AFTER_ONLY: files the before side lacks
#   pack     every file under $OUT into one archive (put it last: the device tool returns a limited number of files)
#   other    benchmarks/gpu_session.sh's step of that name, with the after revision on PYTHONPATH
set -u
export OUT=${OUT:-/tmp/res}; mkdir -p "$OUT"
S=/tmp/kvq-site
A=$S:/tmp/site-after
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print tolower($2)}'); export DEV
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    install) bash .gpu/install.sh $S /tmp/stash .gpu > "$OUT/install.log" 2>&1; tail -1 "$OUT/install.log"
             for side in before after; do
               [ -d /tmp/site-$side ] || [ ! -d .gpu/rev/$side ] ||
                 python3 -m pip install -q --no-index --no-deps --target /tmp/site-$side .gpu/rev/$side/*.whl
             done
             nvidia-smi --query-gpu=name,memory.total --format=csv,noheader;;
    ktests) PYTHONPATH=$A python3 -m pytest tests/test_kernels_gpu.py -m gpu ${T_K:+-k "$T_K"} --collect-only -q \
              -p no:cacheprovider 2>/dev/null | grep '::' > /tmp/k_ids.txt
            echo "$(wc -l < /tmp/k_ids.txt) tests"
            rm -f /tmp/k_ids.a?; split -n r/${T_GROUPS:-4} /tmp/k_ids.txt /tmp/k_ids.
            for g in /tmp/k_ids.a?; do
              (PYTHONPATH=$A MLX_ENABLE_TF32=0 timeout ${T_TIMEOUT:-400} python3 -m pytest -q --tb=short \
                 -p no:cacheprovider $(cat $g) > "$OUT/ktests_$(basename $g).log" 2>&1) &
            done
            wait
            for g in "$OUT"/ktests_*.log; do tail -n 1 "$g"; done
            grep -h -E "^(FAILED|ERROR)" "$OUT"/ktests_*.log | cut -c1-300;;
    dur) for side in ${DUR_SIDES:-after}; do
           variants=""; [ "$side" = after ] && [ -n "${DUR_VARIANTS:-}" ] && variants="--variants $DUR_VARIANTS"
           name="dur-$side-${DUR_TAG:-x}"
           PYTHONPATH=$S:/tmp/site-$side timeout ${DUR_TIMEOUT:-200} python3 benchmarks/kernel_durations.py \
             --out "$OUT/$name.json" --contexts ${DUR_CONTEXTS:-131072} --batch ${DUR_BATCH:-1} $variants \
             > "$OUT/$name.log" 2>&1
           echo "== $name"; { grep -E "bound|sdpa" "$OUT/$name.log" || tail -c 1500 "$OUT/$name.log"; } | cut -c1-200
         done;;
    prefill) # kvq bench prefill of each side (random:llama3-8b, bfloat16, $PF_CONTEXTS, 2 reps, fp16 in the same
             # run), then prefill_host_profile.py's split of the host's time per layer and chunk (8 layers, 8K)
             for side in ${PF_SIDES:-before after}; do
               PYTHONPATH=$S:/tmp/site-$side timeout ${PF_TIMEOUT:-200} python3 -m kvq.cli bench prefill \
                 --model random:llama3-8b --dtype bfloat16 --contexts ${PF_CONTEXTS:-8192,32768} --reps 2 \
                 --methods ${PF_METHODS:-kvcache,turboquant:3,turboquant:4,affine:4} --out "$OUT/prefill" \
                 --name "prefill-$side" --no-progress > "$OUT/prefill-$side.log" 2>&1
               echo "== prefill-$side"; grep "^| [a-z]" "$OUT/prefill/prefill-$side.md" | cut -c1-160
               for m in kvcache turboquant:3; do
                 PYTHONPATH=$S:/tmp/site-$side timeout 120 python3 benchmarks/investigations/prefill_host_profile.py \
                   "$OUT/php-$side" --method $m --layers 8 --context 8192 2>&1 | grep "^split" | cut -c1-600
               done
             done;;
    prefill-chunk) # the after side with larger chunks (mlx-lm's --prefill-step-size) for fp16 and kvq alike: kvq's
             # host work is per chunk and layer, so a larger chunk spreads it over more tokens
             PYTHONPATH=$A timeout ${PF_TIMEOUT:-200} python3 -m kvq.cli bench prefill --model random:llama3-8b \
               --dtype bfloat16 --contexts ${PF_CONTEXTS:-8192,32768} --reps 2 --chunk ${PF_CHUNK:-8192} \
               --methods ${PF_METHODS:-kvcache,turboquant:3,turboquant:4,affine:4} --out "$OUT/prefill" \
               --name "prefill-chunk${PF_CHUNK:-8192}" --no-progress > "$OUT/prefill-chunk.log" 2>&1
             grep "^| [a-z]" "$OUT/prefill/prefill-chunk${PF_CHUNK:-8192}.md" | cut -c1-160;;
    steps) # #52: GPU time of whole decode steps by kernel (decode_step_kernels.py, 2 layers at $STEPS_CONTEXT, default
           # 32K) for each side of $STEPS_SIDES (before after); under Nsight Compute, three methods take 3-5 minutes a side
           for side in ${STEPS_SIDES:-before after}; do
             PYTHONPATH=$S:/tmp/site-$side timeout ${STEPS_TIMEOUT:-400} python3 benchmarks/investigations/decode_step_kernels.py \
               --out "$OUT/step-kernels-$side-${STEPS_CONTEXT:-32768}.json" --context ${STEPS_CONTEXT:-32768} --layers 2 \
               --steps ${STEPS_N:-36} --warmup ${STEPS_WARMUP:-34} --flush ${STEPS_FLUSH:-32} --methods ${STEPS_METHODS:-kvcache,qjl+affine:4,turboquant_prod:4} \
               --batch ${STEPS_BATCH:-1} > "$OUT/step-kernels-$side.log" 2>&1
             echo "== steps-$side"; { grep "normal step us" "$OUT/step-kernels-$side.log" || tail -c 1500 "$OUT/step-kernels-$side.log"; } | cut -c1-200
             python3 -c 'import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    normal = [s for s in r["steps"] if not s["flushed"]]
    by = {}
    for s in normal:
        for name, us in s["kernels"]:
            if "merge" in name or "streams" in name or "sdpa" in name or "attend" in name:
                by.setdefault(name[:50], []).append(us)
    print(r["method"], {k: round(sorted(v)[len(v) // 2], 1) for k, v in by.items()})' "$OUT/step-kernels-$side-${STEPS_CONTEXT:-32768}.json" 2>&1 | cut -c1-400
           done;;
    stimes) # #52: the streams kernel's whole call (kernel and merge; streams_kernel_times.py) of each side of
            # $ST_SIDES (before after) at $ST_CONTEXTS, the after side also with the knob variants $ST_VARIANTS
            for side in ${ST_SIDES:-before after}; do
              variants=""; [ "$side" = after ] && [ -n "${ST_VARIANTS:-}" ] && variants="--variants $ST_VARIANTS"
              PYTHONPATH=$S:/tmp/site-$side MLX_ENABLE_TF32=0 timeout ${ST_TIMEOUT:-200} python3 benchmarks/streams_kernel_times.py \
                --out "$OUT/stimes-$side.json" --contexts ${ST_CONTEXTS:-32768,131072} $variants > "$OUT/stimes-$side.log" 2>&1
              echo "== stimes-$side"; tail -n 25 "$OUT/stimes-$side.log" | cut -c1-220
            done;;
    hostwait) # #52: the batched step's wait for the device (benchmarks/results/host/README.md, 2026-12-07): the
              # step split at the 8-byte boundary of the tokens (batches 1-4), then 32 sequences with the buffer
              # cache emptied after the fill and with no cache
              for opts in "--batches 1,2,3,4,32" "--batches 32 --clear-cache" "--batches 32 --cache-limit-gb 0"; do
                tag=$(echo "$opts" | tr -s -c 'a-z0-9\n' '-' | sed 's/^-*//; s/-*$//')
                PYTHONPATH=$A timeout ${HW_TIMEOUT:-200} python3 benchmarks/decode_host_split.py --context 32768 \
                  --methods ${HW_METHODS:-turboquant:3} --steps 24 $opts --out "$OUT/hostwait-$tag.json" \
                  > "$OUT/hostwait-$tag.log" 2>&1
                echo "== $opts"; { grep "batch" "$OUT/hostwait-$tag.log" || tail -c 1000 "$OUT/hostwait-$tag.log"; } | cut -c1-200
              done
              # the same question asked of MLX alone (no kvq, no mlx-lm): a toy decoder at batches 1-4 and 32
              PYTHONPATH=$A timeout ${HW_TIMEOUT:-200} python3 benchmarks/investigations/mlx_batch_wait.py \
                --out "$OUT/hostwait-mlx-alone.json" > "$OUT/hostwait-mlx-alone.log" 2>&1
              echo "== MLX alone"; { grep '"batch"' "$OUT/hostwait-mlx-alone.log" || tail -c 1000 "$OUT/hostwait-mlx-alone.log"; } | cut -c1-200;;
    batch-sides) # #52: kvq bench batch (mlx-lm's BatchGenerator) of each side of $BS_SIDES (before after), fp16 in
             # each run, $BATCHES sequences of $BATCH_PROMPT tokens, warm-up untimed, $BATCH_REPS (3) repetitions;
             # $BATCH_SHORTEST: prompts spread from $BATCH_PROMPT down to it (--shortest: a revision from f1f21d1 on)
             for side in ${BS_SIDES:-before after}; do
               name="$(date +%F)-$DEV-batch${BATCHES:-8}x${BATCH_PROMPT:-2048}${BATCH_SHORTEST:+-to$BATCH_SHORTEST}-$side-$(cat .gpu/rev/$side/REVISION)"
               PYTHONPATH=$S:/tmp/site-$side timeout ${BATCH_TIMEOUT:-280} python3 -m kvq.cli bench batch \
                 --model random:llama3-8b --dtype bfloat16 --methods ${BATCH_METHODS:-fp16,turboquant:3,turboquant:4,affine:4} \
                 --batches ${BATCHES:-8} --prompt ${BATCH_PROMPT:-2048} ${BATCH_SHORTEST:+--shortest $BATCH_SHORTEST} \
                 --tokens 64 --warmup 1 --reps ${BATCH_REPS:-3} \
                 --no-progress --out "$OUT/batch" --name "$name" > "$OUT/$name.log" 2>&1
               echo "== $name"; grep -E "^\| (kvcache|fp16|turbo|affine)" "$OUT/$name.log" | cut -c1-230 || tail -c 1500 "$OUT/$name.log"
             done;;
    ctests) for side in ${CT_SIDES:-before after}; do
              for f in ${CT_FILES:-tests/test_prefill_chunks.py tests/test_outlier_layers.py tests/test_key_scales.py tests/test_rotating_cache.py tests/test_guard_ahead.py}; do
                case " ${CT_AFTER_ONLY-tests/test_guard_ahead.py} " in *" $f "*) [ "$side" = before ] && continue;; esac
                (PYTHONPATH=$S:/tmp/site-$side timeout ${CT_TIMEOUT:-270} python3 -m pytest -v -p no:cacheprovider --tb=line $f \
                   > "$OUT/ctests-$side-$(basename $f .py).log" 2>&1) &
              done
            done
            wait
            for side in ${CT_SIDES:-before after}; do
              echo "== ctests $side"; grep -h -E "^FAILED|^ERROR| passed| failed" "$OUT"/ctests-$side-*.log | cut -c1-200
            done;;
    pack) # everything under $OUT in one archive: the device tool brings back only so many files a call, and a
          # step's results beyond that count were lost (2026-12-07)
          name="sitting-$(date +%H%M%S).tgz"
          (cd "$OUT" && tar czf "/tmp/$name" --exclude='sitting-*.tgz' . && \
             find . -mindepth 1 ! -name 'sitting-*.tgz' -delete && mv "/tmp/$name" .) && ls "$OUT";;
    *) PYTHONPATH=$A bash benchmarks/gpu_session.sh $step;;
  esac
  echo "## $step took $(( $(date +%s) - t0 )) s"
done
