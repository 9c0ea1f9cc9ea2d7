#!/bin/bash
# A second vLLM for the device machine, beside the one its kit installs: vLLM VERSION's
# wheel, slimmed as ../shared/gpu-vllm/make_kit.sh slims it, cut into parts that each
# fit one `run` call beside the checkout. The kit's torch and dependencies serve both
# (the 0.32 kit's ran 0.29 on 2026-11-26, docs/vllm.md), so one session can run both
# versions after the kit's calls and these few.
#
#   bash benchmarks/wheel_parts.sh 0.29.0 [FOLDER]      # here, from the checkout's root
#
# FOLDER (default .vw, added to .git/info/exclude) receives s/wheel.tsv (name, sha256,
# parts) and one folder per part, w00, w01, ...; the script prints the calls that send
# them. On the device each call stages its part and the last installs the wheel
# (`gpu_device.sh wheel`); then VLLM_SITE=DIR runs gpu_device.sh on that vLLM.
# env: PART=bytes per part (default 57000000), as make_kit.sh.
set -euo pipefail
VERSION=${1:?usage: wheel_parts.sh VERSION [FOLDER]}
FOLDER=${2:-.vw}
cd "$(dirname "$0")/.."
PART=${PART:-57000000}
site=/tmp/site$(echo "$VERSION" | cut -d. -f1,2 | tr -d .)
kit=.wheel_kit
trap 'rm -rf "$kit"; sed -i "\#^/$kit/\$#d" .git/info/exclude' EXIT
bash ../shared/gpu-vllm/make_kit.sh "$VERSION" . "$kit" > /dev/null
IFS=$'\t' read -r _ name offset size sha < <(awk -F'\t' '$1 == "vllm"' "$kit/s/manifest.tsv")
rm -rf "$FOLDER" && mkdir -p "$FOLDER/s"
grep -qxF "/$FOLDER/" .git/info/exclude || echo "/$FOLDER/" >> .git/info/exclude
# the kit's parts are one byte stream; the wheel is the range the manifest names (head
# stops reading there: the pipe's writers end on SIGPIPE, and the sha256 checks the range)
(set +o pipefail; cat "$kit"/p[0-9][0-9]/p[0-9][0-9].bin | tail -c +$((offset + 1)) | head -c "$size") > "$FOLDER/s/$name"
echo "$sha  $FOLDER/s/$name" | sha256sum -c --quiet
split -b "$PART" -d -a 2 "$FOLDER/s/$name" "$FOLDER/s/w"
rm "$FOLDER/s/$name"
parts=$(ls "$FOLDER"/s/w[0-9][0-9] | wc -l)
printf '%s\t%s\t%s\n' "$name" "$sha" "$parts" > "$FOLDER/s/wheel.tsv"
for p in "$FOLDER"/s/w[0-9][0-9]; do n=$(basename "$p"); mkdir "$FOLDER/$n"; mv "$p" "$FOLDER/$n/"; done
echo "$name: $size bytes in $parts parts. After the kit's calls, in order, each within 30 s of the previous reply:"
for d in "$FOLDER"/w[0-9][0-9]; do n=$(basename "$d")
  echo "  run(command=\"bash benchmarks/gpu_device.sh wheel $FOLDER/$n $site\", carry=[\"$FOLDER/s\",\"$FOLDER/$n\"], timeout_s=240)"
done
echo "Then VLLM_SITE=$site bash benchmarks/gpu_device.sh ... runs on vLLM $VERSION."
