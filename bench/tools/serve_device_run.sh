#!/usr/bin/env bash
# One device call on the lent GPU (carry .dev .fa3 .fijit: 57 MiB in all): optionally the default
# sweep (decode + prefill) and its emitted config for this GPU, then bench/serve_bench.py
# (`vllm serve` + `vllm bench serve`). Stays inside TOTAL_S (default 585 s); packs what it made
# into at most 8 files under $OUT (the device tool's limit).
#   SWEEP=1       the sweep into $OUT/results.db, config into /tmp/tuned (kept while the machine is warm);
#   SWEEP=auto    the same, only where no packaged config names this GPU
#   MODELS=h16    serve_bench's models; SETUPS=tuned,untuned,triton16,vllm_default; SERVE=0 skips it.
#                 tuned needs vLLM's FA3 library where its config serves FA3 (vllm_default always
#                 does): carry .fa3 beside .dev (bench/tools/prepare-serve-carry.sh --fa3). Calls
#                 chained on a warm machine add their setups to one serve_bench.json
#   CONFIG=DIR    the tuned setup's config folder (default: /tmp/tuned when a sweep made one, else
#                 the packaged configs)
#   TVA=1         bench/tuned_vs_auto.py on /tmp/work/results.db and that config first (TVA_BUDGET s)
#   JIT_OUT=1     FlashInfer's JIT cache packed into $OUT/flashinfer_jit.tar.xz: carried next time as
#                 .fijit/flashinfer_jit.tar.xz, serve-env.sh unpacks it (no rebuild at server start)
#   PREFILL_AFTER=1  after the servers, the prefill sweep into /tmp/work/results.db and the config
#                 emitted again (decode + prefill), both into $OUT
source bench/tools/serve-call.sh   # set -u, the clock (start, total, left), the serving env, the GPU line
python3 -c "import vllm.entrypoints.openai.api_server, vllm.benchmarks.serve, vllm._C_stable_libtorch; print('serve imports ok')" 2>&1 | tail -3
echo "setup $(( $(date +%s) - start )) s"
W=/tmp/work; mkdir -p $W
if [ "${SWEEP:-0}" = auto ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' _)
  if ls vllm_metax/configs/device_name="$gpu".json >/dev/null 2>&1 || ls /tmp/tuned/device_name=*.json >/dev/null 2>&1; then SWEEP=0; else SWEEP=1; fi
  echo "SWEEP=auto: $SWEEP ($gpu)"
fi
if [ "${SWEEP:-0}" = 1 ]; then
  rm -rf $W/results.db* $W/sweep_configs /tmp/tuned; mkdir -p $W/sweep_configs /tmp/tuned
  /usr/bin/time -f "sweep wall %e s" timeout 300 python3 -m mla_tune sweep --db $W/results.db \
    --configs-dir $W/sweep_configs --time-budget 240 -q > $W/sweep.txt 2>&1
  echo "sweep rc=$?"; tail -4 $W/sweep.txt
  /usr/bin/time -f "prefill-sweep wall %e s" timeout 120 python3 -m mla_tune prefill-sweep \
    --db $W/results.db > $W/prefill_sweep.txt 2>&1
  echo "prefill-sweep rc=$?"; tail -3 $W/prefill_sweep.txt
  python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('pragma wal_checkpoint(truncate)')" $W/results.db
  python3 -m mla_tune emit --db $W/results.db --out /tmp/tuned > $W/emit.txt 2>&1
  echo "emit rc=$?"; tail -3 $W/emit.txt
  cp $W/results.db $OUT/results.db
  for f in /tmp/tuned/device_name=*.json; do cp "$f" "$OUT/tuned_config.json"; done
fi
cfg=${CONFIG:-}
[ -z "$cfg" ] && ls /tmp/tuned/device_name=*.json >/dev/null 2>&1 && cfg=/tmp/tuned
short=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'H[0-9]{3}' | head -1 | tr 'H' 'h')
if [ "${TVA:-0}" = 1 ] && [ -n "$cfg" ] && [ -f $W/results.db ]; then
  echo "== tuned_vs_auto ($(left) s left)"
  timeout $(( ${TVA_BUDGET:-110} + 40 )) python3 bench/tuned_vs_auto.py --db $W/results.db \
    --config "$(ls $cfg/device_name=*.json | head -1)" --out $OUT --name tuned_vs_auto_${short:-gpu} \
    --budget-s ${TVA_BUDGET:-110} --samples 15 --rounds 3 > $W/tuned_vs_auto.txt 2>&1
  echo "tuned_vs_auto rc=$?"; grep -A14 "^| group" $W/tuned_vs_auto.txt | head -22
fi
if [ "${SERVE:-1}" = 1 ]; then
  echo "== serve_bench ($(left) s left), config folder: ${cfg:-packaged}"
  timeout $(( $(left) - 25 )) python3 bench/serve_bench.py --out $W/serve --models ${MODELS:-h16} \
    --setups ${SETUPS:-tuned,untuned,triton16,vllm_default} ${cfg:+--config-folder $cfg} ${SERVE_ARGS:-} 2>&1 \
    | tee $W/serve_bench.txt | grep -E "^\[|^model|Traceback|Error" | tail -60
  echo "serve_bench rc=${PIPESTATUS[0]}"
  cp $W/serve/serve_bench.json $W/serve/serve_bench.md $OUT/ 2>/dev/null
fi
pkill -INT -f "vllm.entrypoints.cli.main serve" 2>/dev/null; sleep 2; pkill -KILL -f "vllm.entrypoints.cli.main serve" 2>/dev/null
if [ "${PREFILL_AFTER:-0}" = 1 ] && [ -f $W/results.db ] && [ "$(left)" -gt 90 ]; then
  echo "== prefill-sweep ($(left) s left)"
  /usr/bin/time -f "prefill-sweep wall %e s" timeout $(( $(left) - 40 )) python3 -m mla_tune prefill-sweep \
    --db $W/results.db > $W/prefill_sweep.txt 2>&1
  echo "prefill-sweep rc=$?"; tail -3 $W/prefill_sweep.txt
  python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('pragma wal_checkpoint(truncate)')" $W/results.db
  mkdir -p /tmp/tuned_pf && python3 -m mla_tune emit --db $W/results.db --out /tmp/tuned_pf > $W/emit_pf.txt 2>&1
  echo "emit rc=$?"; tail -3 $W/emit_pf.txt
  cp $W/results.db $OUT/results.db
  for f in /tmp/tuned_pf/device_name=*.json; do cp "$f" "$OUT/tuned_config_prefill.json"; done
fi
if [ "${JIT_OUT:-0}" = 1 ] && [ -d /tmp/fiws/.cache ]; then     # for the next machine's .fijit/
  tar -C /tmp/fiws -cJf $OUT/flashinfer_jit.tar.xz .cache
  size=$(stat -c %s $OUT/flashinfer_jit.tar.xz); echo "FlashInfer JIT cache: $size bytes"
  [ "$size" -gt 16000000 ] && { echo "  too big to come back (16 MB a file)"; rm -f $OUT/flashinfer_jit.tar.xz; }
fi
tar -C $W -czf $OUT/logs.tgz --exclude results.db $(cd $W && ls -d *.txt serve/*.log 2>/dev/null)
echo "done in $(( $(date +%s) - start )) s"
