#!/usr/bin/env bash
# Issue #51 on the lent GPU: serving as users run it (vLLM's default compilation), one call per
# PHASE on one warm machine (carry .dev .fa3; the caches under /tmp/cache live while it is warm):
#   PHASE=cold   h16 vLLM's own server and tuned, each started cold (their own empty vLLM/inductor/
#                Triton caches: --cache-root; tuned after `mla-tune prebuild`, timed apart: --prebuild),
#                the served-tokens check, CELLS x REPEATS
#   PHASE=warm   the same two servers started again on those caches (warm starts), then the v3tp8
#                model (DeepSeek-V3's layers on one TP8 rank) tuned and vLLM's own: CELLS x REPEATS
#                with a decode profile (attention's share of a step)
# Results: $OUT/serve_bench_<phase>.{json,md}, $OUT/logs_<phase>.tgz; copied every 20 s while running.
source bench/tools/serve-call.sh   # set -u, the clock (start, total, left), the serving env, the GPU line
W=/tmp/work; C=/tmp/cache; mkdir -p $W $C
phase=${PHASE:-cold}
serve=$W/serve_$phase
mkdir -p $serve
( while sleep 20; do cp $serve/serve_bench.json $OUT/serve_bench_$phase.json 2>/dev/null; done ) &
copier=$!
cells=${CELLS:-long@inf,chat@inf}
reps=${REPEATS:-3}
if [ "$phase" = cold ]; then
  rm -rf $C/h16_*
  echo "== serve_bench h16 cold, tuned after its prebuild ($(left) s left)"
  timeout $(( $(left) - 30 )) python3 bench/serve_bench.py --out $serve --models h16 \
    --setups vllm_default,tuned --cache-root $C --prebuild --tokens --cells $cells --repeats $reps 2>&1 \
    | tee $W/serve_$phase.txt | grep -E "^\[|^model|Traceback|Error" | tail -40
  echo "serve_bench rc=${PIPESTATUS[0]}"
else
  echo "== warm starts ($(left) s left)"
  timeout 260 python3 bench/serve_bench.py --out $W/serve_warm_starts --models h16 \
    --setups vllm_default,tuned --cache-root $C --start-only 1 2>&1 | grep -E "^\[|Error" | tail -8
  cp $W/serve_warm_starts/serve_bench.json $OUT/serve_bench_warm_starts.json 2>/dev/null
  echo "== serve_bench v3tp8 ($(left) s left)"
  # the same FlashInfer modules (DeepSeek's attention dims): prebuilt once, not measured again here
  rm -rf $C/v3tp8_*; mkdir -p $C/v3tp8_tuned && cp -r $C/h16_tuned/flashinfer $C/v3tp8_tuned/
  timeout $(( $(left) - 30 )) python3 bench/serve_bench.py --out $serve --models v3tp8 \
    --setups vllm_default,tuned --cache-root $C --cells $cells --repeats $reps \
    ${PROFILE_ARGS:---profile --profile-prompt 0 --profile-batch 8 --profile-batch-prompt 4096} 2>&1 \
    | tee $W/serve_$phase.txt | grep -E "^\[|^model|Traceback|Error" | tail -40
  echo "serve_bench rc=${PIPESTATUS[0]}"
fi
kill $copier 2>/dev/null
pkill -INT -f "vllm.entrypoints.cli.main serve" 2>/dev/null; sleep 2; pkill -KILL -f "vllm.entrypoints.cli.main serve" 2>/dev/null
cp $serve/serve_bench.json $OUT/serve_bench_$phase.json 2>/dev/null
cp $serve/serve_bench.md $OUT/serve_bench_$phase.md 2>/dev/null
tar -C $W -czf $OUT/logs_$phase.tgz $(cd $W && ls -d *.txt serve_*/*.log 2>/dev/null)
echo "done in $(( $(date +%s) - start )) s"
