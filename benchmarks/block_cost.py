"""What a block-diagonal covariance would hold for a config's trainable parameters (hypothesis 4's cost).

Usage::

    python benchmarks/block_cost.py                                  # EfficientNet-Lite0/10 classes, ResNet-50/100
    python benchmarks/block_cost.py --configs cifar10_resnet18 --chunk 64 128

The config's network is built on the meta device (no weights, no memory). For every trainable parameter, a "row" is
its entries for one output (``numel / shape[0]``): one row of LoRA A is a rank's weights over the layer's inputs, one
row of LoRA B an output's ``r`` weights, one row of the head a class's weights over the features. It prints, per kind
(``loko_lightning.models.adapters.parameter_kind``) and in all: the diagonal's entries (the paper's ``p̂``, one per
parameter), a full block per row (``Σ rows × row²``), and blocks of at most ``chunk`` consecutive entries of a row;
each also as a multiple of the diagonal. A step's extra arithmetic is about ``m`` (the classes) times the entries
(``P_b H_bᵀ`` for every block).
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def counts(config: str, chunks: list[int]) -> dict[str, list[int]]:
    """Per kind: [diagonal, row blocks, *chunk blocks] entries for the config's trainable parameters."""
    from loko_lightning.cli import LoKOCLI
    from loko_lightning.data import StreamDataModule
    from loko_lightning.learner.module import OnlineClassifier
    from loko_lightning.models.adapters import parameter_kind

    args = ["--config", str(ROOT / "configs" / f"{config}.yaml"), "--model.network.pretrained", "false"]
    args += ["--trainer.logger", "false"]
    with torch.device("meta"):
        cli = LoKOCLI(OnlineClassifier, StreamDataModule, args=args, run=False)
    out: dict[str, list[int]] = {}
    for name, param in cli.model.network.named_parameters():
        if not param.requires_grad:
            continue
        rows = param.shape[0] if param.dim() > 0 else 1
        row = param.numel() // rows
        full = [param.numel(), rows * row * row]
        for chunk in chunks:
            whole, rest = divmod(row, chunk)
            full.append(rows * (whole * chunk * chunk + rest * rest))
        totals = out.setdefault(parameter_kind(name), [0] * len(full))
        out[parameter_kind(name)] = [a + b for a, b in zip(totals, full, strict=True)]
    out["all"] = [sum(values[i] for values in out.values()) for i in range(2 + len(chunks))]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["fashion_mnist_lite0", "cifar100_resnet50"])
    parser.add_argument("--chunk", nargs="+", type=int, default=[64])
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for config in args.configs:
        table = counts(config, args.chunk)
        print(f"\n{config}\n")
        heads = " | ".join(f"blocks of <= {c}" for c in args.chunk)
        print(f"| kind | diagonal | a block per row | {heads} |")
        print("|---|---|---|" + "---|" * len(args.chunk))
        for kind, values in table.items():
            diag = values[0]
            cells = [f"{values[0]:,}"] + [f"{v:,} ({v / diag:.0f}x)" for v in values[1:]]
            print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
