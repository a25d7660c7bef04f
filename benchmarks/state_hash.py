"""The SHA-256 of a checkpoint's trained state: the adapters and head, the optimizer's state, the online metrics.

A refactor that keeps behaviour keeps these hashes: run the same ``loko fit`` before and after, same machine, same
seed, ``OMP_NUM_THREADS=1``, and compare::

    python benchmarks/state_hash.py outputs/debug/version_0/checkpoints/last.ckpt

Prints one line per part (``network``, ``model``, ``optimizer``, ``global_step``) and the whole.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import torch


def _feed(digest: Any, value: Any) -> None:
    """Hash a nested structure of tensors, numbers and strings in a fixed order (dict keys sorted)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            digest.update(f"K{key}".encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"V{value!r}".encode())


def state_hashes(path: str) -> dict[str, str]:
    """The hashes of a checkpoint's parts and of the whole.

    ``network`` (its weights), ``model`` (the network and the metric states), ``optimizer`` (its state, not its param
    groups), ``global_step`` and ``all`` (every part but ``network``, which ``model`` holds).
    """
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    model = checkpoint["state_dict"]
    network = {key: value for key, value in model.items() if key.startswith("network.")}
    optimizer = [state["state"] for state in checkpoint.get("optimizer_states", [])]
    parts = {"network": network, "model": model, "optimizer": optimizer, "global_step": checkpoint.get("global_step")}
    hashes = {}
    for name, value in parts.items():
        digest = hashlib.sha256()
        _feed(digest, value)
        hashes[name] = digest.hexdigest()[:16]
    digest = hashlib.sha256()
    _feed(digest, {key: value for key, value in parts.items() if key != "network"})
    hashes["all"] = digest.hexdigest()[:16]
    return hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    for path in parser.parse_args().checkpoints:
        hashes = state_hashes(path)
        print(path, " ".join(f"{key}={value}" for key, value in hashes.items()))


if __name__ == "__main__":
    main()
