#!/usr/bin/env bash
# One GPU window: `pdserve gpu-check`, then `pdserve gpu-bench` (roofline + slots sweep), then the
# GPU attention study if present, all inside WINDOW_S seconds (default 440: under 8 minutes with
# the timeouts' grace), their JSON and logs under $OUT.
#
#   OUT=/tmp/window bash benchmarks/gpu_window.sh      # from the repository root
#
# Each step gets what its cap and the window's remaining time allow, so the script ends in time
# whatever hangs; window.json records each step's exit status and seconds (124: cut by timeout).
set -u

OUT=${OUT:-results/gpu_window}
WINDOW_S=${WINDOW_S:-440}
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$OUT"
WORK=$(mktemp -d -t pdserve-gpu-window-XXXXXX)  # checkpoints: large, not brought back
start=$(date +%s)
steps=()

left() {
    echo $((WINDOW_S - ($(date +%s) - start)))
}

cap() {  # the smaller of a step's cap and the time left less a reserve for the steps after it
    local want=$1 reserve=$2 have
    have=$(($(left) - reserve))
    if [ "$have" -lt "$want" ]; then echo "$have"; else echo "$want"; fi
}

step() {  # step NAME SECONDS COMMAND...: run it under a timeout, log it, record its status
    local name=$1 seconds=$2 began status
    shift 2
    began=$(date +%s)
    if [ "$seconds" -lt 10 ]; then
        echo "[window] $name: no time left" >&2
        steps+=("\"$name\": {\"status\": \"no time left\"}")
        return
    fi
    echo "[window $(($(date +%s) - start))s] $name (up to ${seconds}s)" >&2
    timeout -k 10 "$seconds" "$@" >"$OUT/$name.out" 2>"$OUT/$name.log"
    status=$?
    steps+=("\"$name\": {\"status\": $status, \"seconds\": $(($(date +%s) - began))}")
    echo "[window $(($(date +%s) - start))s] $name exited $status" >&2
}

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

# the sweep runs in gpu-bench, after the roofline: gpu-check leaves it out
step gpu_check "$(cap 160 280)" "$PYTHON" -m deploy.cli gpu-check --no-sweep \
    --workdir "$WORK/check" --output "$OUT/gpu_check.json"

bench_s=$(cap 230 95)
step gpu_bench "$bench_s" "$PYTHON" -m deploy.cli gpu-bench --time-limit $((bench_s - 30)) \
    --workdir "$WORK/bench" --output "$OUT/gpu_bench.jsonl"

if [ -f benchmarks/studies/gpu_attention.py ]; then
    step gpu_attention "$(cap 90 10)" "$PYTHON" -m benchmarks.studies.gpu_attention
else
    steps+=("\"gpu_attention\": {\"status\": \"absent\"}")
fi

rm -rf "$WORK"
{
    printf '{"window_s": %d, "seconds": %d' "$WINDOW_S" $(($(date +%s) - start))
    for line in "${steps[@]}"; do printf ', %s' "$line"; done
    printf '}\n'
} >"$OUT/window.json"
cat "$OUT/window.json"
