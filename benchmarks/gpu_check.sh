#!/usr/bin/env bash
# The CUDA checks, on a machine with one GPU, from the repository root with the package installed: the tests marked
# `gpu`, a short `loko fit` on the GPU (the paper's filter and LoFi), the DDP and sharded tests on this machine's torch,
# then LoKO's step time against AdamW's on the GPU for the paper's filter and the variants. Each part writes to OUT_DIR
# and a failing part does not stop the next.
#   bash benchmarks/gpu_check.sh OUT_DIR
set -uo pipefail
out="${1:?usage: gpu_check.sh OUT_DIR}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python -c "import torch, timm, peft, lightning; print('torch', torch.__version__, 'timm', timm.__version__, \
'peft', peft.__version__, 'lightning', lightning.__version__)" | tee -a "$out/gpu.txt"

echo "== tests marked gpu"
python -m pytest -m gpu -p no:cacheprovider -q tests/test_cuda.py tests/test_reliability.py 2>&1 | tee "$out/tests.txt"

echo "== loko fit on the GPU"
for preset in loko_paper loko_lofi; do
    loko fit --config configs/debug.yaml --config "configs/presets/$preset.yaml" --trainer.accelerator gpu \
        --trainer.devices 1 --data.max_samples 60 --trainer.logger.init_args.save_dir "$out/fit" 2>&1 \
        | grep -E "Average online|Error|error" | tee -a "$out/fit.txt"
done

echo "== DDP and sharded tests (gloo, on this machine's torch)"
python -m pytest -p no:cacheprovider -q tests/test_ddp.py tests/test_sharded.py 2>&1 | tail -n 5 | tee "$out/ddp.txt"

echo "== step time on the GPU"
for variant in "--filter covariance" "--filter natural" "--observation topk5" "--filter lofi10_empirical"; do
    # shellcheck disable=SC2086 (the variant is two words on purpose)
    python benchmarks/step_time.py --device cuda $variant --cases resnet18:10 resnet50:100 \
        --text-cases --steps 30 2>&1 | grep -E "^\| |^torch|Error|error" | tee -a "$out/step_time_resnet.txt"
    # shellcheck disable=SC2086
    python benchmarks/step_time.py --device cuda $variant --cases vit_base_patch16_224:100 \
        --image-size 224 --target query --text-cases --steps 30 2>&1 | grep -E "^\| |^torch|Error|error" \
        | tee -a "$out/step_time_vit.txt"
done
