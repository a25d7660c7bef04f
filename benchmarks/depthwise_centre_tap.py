"""A depthwise convolution of a 1 x 1 map, through oneDNN and as its centre tap: the time and the bits.

Usage::

    python benchmarks/depthwise_centre_tap.py

One CPU thread, median of ``--repeats`` calls after 20 warm-up calls, no gradient:

- EfficientNet-Lite0's 5 x 5 depthwise convolution over 1,152 channels (no bias), two samples, on a 1 x 1 and a 2 x 2
  map, as ``nn.Conv2d`` and as :class:`~loko_lightning.models.vision.CentreTapConv2d`;
- a forward pass of two 32 px images through ``tf_efficientnet_lite0`` (random weights, frozen) with its depthwise
  convolutions plain and after :func:`~loko_lightning.models.vision.centre_tap_depthwise`.

Each line says whether the two outputs are equal bit for bit. Times depend on the CPU and what else runs; the ratios
between lines of one run are what to read.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import timm
import torch
from torch import nn

from loko_lightning.models.vision import CentreTapConv2d, centre_tap_depthwise


def median_ms(function: Callable[[], torch.Tensor], repeats: int) -> float:
    """The median time of ``function`` (milliseconds) over ``repeats`` calls after 20 warm-up calls."""
    for _ in range(20):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (signed zeros told apart)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def main(argv: list[str] | None = None) -> None:
    """Print the times and whether the bits agree."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    conv = nn.Conv2d(1152, 1152, 5, padding=2, groups=1152, bias=False).requires_grad_(False)
    fast = nn.Conv2d(1152, 1152, 5, padding=2, groups=1152, bias=False).requires_grad_(False)
    fast.load_state_dict(conv.state_dict())
    fast.__class__ = CentreTapConv2d
    print("| what | nn.Conv2d (ms) | centre tap (ms) | same bits |")
    print("|---|---|---|---|")
    with torch.no_grad():
        for size in (1, 2):
            x = torch.randn(2, 1152, size, size).clamp_min(0)
            plain, tapped = median_ms(lambda x=x: conv(x), args.repeats), median_ms(lambda x=x: fast(x), args.repeats)
            print(f"| 5 x 5 depthwise, 1,152 channels, 2 x {size} x {size} | {plain:.3f} | {tapped:.3f} | "
                  f"{same_bits(conv(x), fast(x))} |")  # fmt: skip
        network = timm.create_model("tf_efficientnet_lite0", pretrained=False, num_classes=10).eval()
        network.requires_grad_(False)
        images = torch.randn(2, 3, 32, 32)
        plain_ms, expected = median_ms(lambda: network(images), args.repeats), network(images)
        centre_tap_depthwise(network)
        tapped_ms, got = median_ms(lambda: network(images), args.repeats), network(images)
        print(f"| tf_efficientnet_lite0 forward, 2 x 3 x 32 x 32 | {plain_ms:.3f} | {tapped_ms:.3f} | "
              f"{same_bits(expected, got)} |")  # fmt: skip


if __name__ == "__main__":
    main()
