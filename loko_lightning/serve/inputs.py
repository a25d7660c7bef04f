"""An input's forms in ``loko serve``: as sent, as a preprocessed tensor in the feedback log, and its size in memory.

An image is kept as it was sent (base64), or as its preprocessed tensor when that is smaller; the log then holds the
tensor as a JSON value (:func:`loggable`), read back by :func:`logged_tensor`. :func:`input_bytes` is what the bounds
on kept predictions and queued feedback count.
"""

from __future__ import annotations

import base64
from typing import Any

import torch
from torch import Tensor


def loggable(tensor: Tensor) -> dict[str, Any]:
    """A preprocessed input as a JSON value: its bytes in base64, its shape and dtype."""
    data = tensor.detach().contiguous().cpu().numpy().tobytes()
    return {"tensor": base64.b64encode(data).decode(), "shape": list(tensor.shape), "dtype": str(tensor.dtype)[6:]}


def logged_tensor(value: Any) -> Tensor | None:
    """The preprocessed input a log record holds (:func:`loggable`), or ``None`` for a raw one (an image, a text)."""
    if not isinstance(value, dict) or "tensor" not in value:
        return None
    data = bytearray(base64.b64decode(value["tensor"]))
    return torch.frombuffer(data, dtype=getattr(torch, value["dtype"])).reshape(value["shape"])


def input_bytes(value: Any) -> int:
    """The bytes an input holds in memory, about: its strings' lengths (base64 images and texts), a tensor's data."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (list, tuple)):
        return sum(input_bytes(item) for item in value)
    return 0
