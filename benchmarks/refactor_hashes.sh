#!/usr/bin/env bash
# The checkpoint-state hashes a behaviour-keeping refactor must keep: `loko fit` on the debug config (60 real MNIST
# digits, Lite0, seed 0, one thread per process) with the paper's filter, the natural filter, LoFi, the average with the
# shared head covariance, and a sharded 2-process run (gloo on loopback), each hashed by benchmarks/state_hash.py.
# Run it before and after on the same machine and compare the lines:
#   bash benchmarks/refactor_hashes.sh > before.txt   # ... change ...   bash benchmarks/refactor_hashes.sh > after.txt
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SAMPLES="${SAMPLES:-60}"
fit() {
    local name="$1"
    shift
    (cd "$WORK" && python -m loko_lightning.cli fit --config "$ROOT/configs/debug.yaml" "$@" \
        --data.max_samples "$SAMPLES" --data.eval_max_samples 8 --trainer.logger false \
        --trainer.default_root_dir "$WORK/$name" >"$WORK/$name.log" 2>&1) || { tail -30 "$WORK/$name.log" >&2; exit 1; }
    local ckpt
    ckpt="$(find "$WORK/$name" -name last.ckpt | head -1)"
    echo "$name $(python benchmarks/state_hash.py "$ckpt" | cut -d' ' -f2-)"
}
fit paper
fit natural --model.optimizer.init_args.filter natural --model.optimizer.init_args.p0 0.03
fit lofi --model.optimizer.init_args.filter lofi10 --model.optimizer.init_args.p0 0.03
fit average_head_shared --config "$ROOT/configs/presets/loko_images.yaml"
fit sharded --trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu \
    --model.optimizer.init_args.shard true
