#!/usr/bin/env bash
# The C loops (slotroute/_native.c) built with AddressSanitizer and UndefinedBehaviorSanitizer,
# run under the store, wire and capture tests: bash .ci/asan.sh WORKDIR (tox env "asan").
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:?usage: asan.sh WORKDIR}
rm -rf "$work/asan" && mkdir -p "$work/asan"
cp -r src/slotroute "$work/asan/" && rm -f "$work/asan/slotroute/"*.so
include=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$(python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
gcc -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined \
    -shared -fPIC -I"$include" src/slotroute/_native.c -o "$work/asan/slotroute/_native$suffix"
# Python itself is not instrumented: the sanitizer runtimes are preloaded, leak checks off.
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0 PYTHONPATH="$work/asan" \
    python -m pytest -p no:cacheprovider tests/test_store.py tests/test_wire.py tests/test_capture.py tests/test_connector_step.py \
    -k "not importing_slotroute and not triton_interpreter and not resident_memory" "${@:2}"
# Deselected: no Triton here (the C only), and the test of resident memory, which would
# count the freed arrays that ASan holds in its quarantine.
