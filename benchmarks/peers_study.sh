#!/usr/bin/env bash
# The peers study: LoKO and its peers on the same seeded streams, one benchmarks/compare.py run per (stream, learner,
# seed), PARALLEL at a time, each into OUT/<stream>/<learner>_s<seed>; then one table per stream pooled over seeds:
#   python benchmarks/compare.py --table-from OUT/<stream>/<learner>_s* ... --pool --at 500 1000 2000 5000
#
#   bash benchmarks/peers_study.sh                          # every stream, learner and seed, one at a time
#   STREAMS="bbc" SEEDS="0" PARALLEL=2 bash benchmarks/peers_study.sh
#
# Streams: fm32 (Fashion-MNIST at 32 px, 5,000 samples), mnist5k (MNIST-5k at 32 px, its 4,500 training digits),
# glyphs100 (100 classes, 5,000), bbc (BBC News, 1,000; text). Learners: paper (the config's LoKO), lofi (the exact
# LoFi preset, images) or auto_text (p0 chosen from the text grid, text), adamw_tuned (lr chosen online, annealed to
# the stream's end), adamw_const (the same, constant), schedulefree, ivon, posteriors (configs/baselines/).
# Timings in these runs are not comparable when PARALLEL > 1: step times come from a run alone (docs/results/peers.md).
set -euo pipefail
cd "$(dirname "$0")/.."

STREAMS="${STREAMS:-fm32 mnist5k glyphs100 bbc}"
SEEDS="${SEEDS:-0 1 2}"
LEARNERS="${LEARNERS:-adamw_tuned adamw_const schedulefree ivon posteriors paper best}"
PARALLEL="${PARALLEL:-1}"
OUT="${OUT:-results/peers}"
PYTHON="${PYTHON:-python}"
THREADS="${THREADS:-1}"
SAMPLES="${SAMPLES:-}"  # a shorter stream for a dry run (and SELECT, the selection's samples)
SELECT="${SELECT:-}"
PRINT_EVERY="${PRINT_EVERY:-0}"  # a progress line every N samples in each run's log.txt (0: none)
EXTRA="${EXTRA:-}"  # more `loko fit` overrides for every run, e.g. EXTRA="--model.select.values [0.1,0.3,1,3]"

stream_args() {
    case "$1" in
        fm32) echo "--config configs/fashion_mnist_lite0.yaml --samples 5000" ;;
        mnist5k) echo "--config configs/fashion_mnist_lite0.yaml --samples 5000" ;;
        glyphs100) echo "--config configs/glyphs100_lite0.yaml --samples 5000" ;;
        bbc) echo "--config configs/text_quickstart.yaml --samples 1000" ;;
        *) echo "unknown stream $1" >&2; exit 2 ;;
    esac
}

stream_overrides() {
    case "$1" in
        mnist5k) echo "--data.source MNIST5k --data.source.image_size 32" ;;
        *) echo "" ;;
    esac
}

learner_args() {  # the compare.py arguments of a learner on a stream
    case "$2" in
        paper) echo "--optimizers loko" ;;
        best)
            if [ "$1" = bbc ]; then echo "--config configs/presets/loko_text.yaml --optimizers loko"
            else echo "--optimizers loko"; fi ;;
        *) echo "--optimizers $2" ;;
    esac
}

learner_overrides() {  # the loko fit flags of a learner on a stream (after compare.py's --)
    if [ "$2" = best ] && [ "$1" != bbc ]; then
        echo "--model.optimizer.init_args.filter lofi10 --model.optimizer.init_args.p0 0.03"
    fi
}

jobs=()
for seed in $SEEDS; do
    for stream in $STREAMS; do
        for learner in $LEARNERS; do
            jobs+=("$stream $learner $seed")
        done
    done
done

run_one() {
    local stream=$1 learner=$2 seed=$3
    local out="$OUT/$stream/${learner}_s$seed"
    if [ -f "$out/summary.json" ]; then
        return 0
    fi
    mkdir -p "$out"
    # shellcheck disable=SC2046
    local shorter=()
    if [ -n "$SAMPLES" ]; then shorter+=(--samples "$SAMPLES"); fi
    if [ -n "$SELECT" ]; then shorter+=(--select-samples "$SELECT"); fi
    "$PYTHON" benchmarks/compare.py $(stream_args "$stream") $(learner_args "$stream" "$learner") --seeds "$seed" \
        "${shorter[@]}" --threads "$THREADS" --csv-every 10 --print-every "$PRINT_EVERY" --out "$out" -- $(stream_overrides "$stream") $(learner_overrides "$stream" "$learner") $EXTRA \
        >"$out/log.txt" 2>&1 \
        || echo "FAILED: $stream $learner $seed (see $out/log.txt)"
}
export -f run_one stream_args stream_overrides learner_args learner_overrides
export OUT PYTHON THREADS SAMPLES SELECT EXTRA PRINT_EVERY

printf '%s\n' "${jobs[@]}" | xargs -P "$PARALLEL" -L 1 bash -c 'run_one $0 $1 $2'
echo "done: ${#jobs[@]} runs under $OUT"
