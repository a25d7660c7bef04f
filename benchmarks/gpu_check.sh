#!/usr/bin/env bash
# The CUDA checks, on a machine with one GPU, from the repository root with the package installed: the tests marked
# `gpu`, then LoKO's step time against AdamW's on the GPU for the paper's observation and the variants. Each part
# writes to OUT_DIR and a failing part does not stop the next.
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

echo "== step time on the GPU"
for observation in softmax natural topk5 lofi10_empirical; do
    python benchmarks/step_time.py --device cuda --observation "$observation" --cases resnet18:10 resnet50:100 \
        --text-cases --steps 30 2>&1 | grep -E "^\| |^torch|Error|error" | tee -a "$out/step_time_resnet.txt"
    python benchmarks/step_time.py --device cuda --observation "$observation" --cases vit_base_patch16_224:100 \
        --image-size 224 --target query --text-cases --steps 30 2>&1 | grep -E "^\| |^torch|Error|error" \
        | tee -a "$out/step_time_vit.txt"
done
