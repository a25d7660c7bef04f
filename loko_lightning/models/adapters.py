"""peft LoRA/DoRA adapters: where they go (target presets, names, a regex) and the one ``LoraConfig`` builder.

Every network family places its adapters through :func:`resolve_targets` and configures them through
:func:`lora_config`, so a target means the same on every backbone and is refused alike. Target presets:

- ``"convs"``: every ``nn.Conv2d`` with ``groups == 1`` (peft cannot adapt depthwise/grouped convolutions unless
  the rank is divisible by ``groups``), the paper's placement for CNNs.
- ``"query"``: the attention *query* projection, the paper's placement for transformers. timm ViTs compute
  q, k and v with one fused ``qkv`` Linear; peft on ``qkv`` would adapt all three. :class:`SplitQKV` rewrites
  each fused Linear as three Linears with the same weights whose outputs are concatenated (the same function),
  so that LoRA adapts exactly the query rows of ``qkv``. Separate projections (timm Eva's ``q_proj``, BERT's and
  RoBERTa's ``query``) are targeted as they are.
- a list of module names, or one regular expression matched against full module names.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from loko_lightning.errors import ConfigError

PRESETS = ("convs", "query")
# Separate query projections in the wild: timm Eva (q_proj), HF BERT/RoBERTa (query).
_QUERY_NAMES = ("q_proj", "query")
_ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm, nn.LayerNorm)


def check_target(target: Any) -> None:
    """A target must be a preset, a valid regular expression, or a non-empty list of module names.

    Raises:
        ConfigError: naming ``target``.
    """
    if isinstance(target, str):
        if target in PRESETS:
            return
        try:
            re.compile(target)
        except re.error as err:
            message = f"target={target!r} is not a preset {PRESETS} nor a valid regex ({err})"
            raise ConfigError(message, field="target") from err
        if target:
            return
    elif isinstance(target, Sequence) and target and all(isinstance(n, str) and n for n in target):
        return
    raise ConfigError(
        f"target must be a preset {PRESETS}, a regular expression or a list of module names, got {target!r}",
        field="target",
    )


class SplitQKV(nn.Module):
    """A fused ``qkv`` Linear as three Linears ``q``, ``k``, ``v`` with concatenated outputs.

    Computes exactly what the fused layer computes (its weight and bias rows are copied into the three parts),
    but exposes the query projection as a module of its own so that an adapter can target it alone.

    Args:
        fused: the ``nn.Linear`` with ``out_features = 3 · d`` (rows ordered q, k, v, as in timm).
    """

    def __init__(self, fused: nn.Linear) -> None:
        super().__init__()
        if fused.out_features % 3:
            raise ValueError(f"Invalid qkv layer: out_features {fused.out_features} is not divisible by 3")
        dim = fused.out_features // 3
        parts = []
        for index in range(3):
            part = nn.Linear(fused.in_features, dim, bias=fused.bias is not None)
            part = part.to(device=fused.weight.device, dtype=fused.weight.dtype)
            with torch.no_grad():
                part.weight.copy_(fused.weight[index * dim : (index + 1) * dim])
                if fused.bias is not None:
                    part.bias.copy_(fused.bias[index * dim : (index + 1) * dim])
            part.weight.requires_grad_(fused.weight.requires_grad)
            parts.append(part)
        self.q, self.k, self.v = parts
        self.in_features, self.out_features = fused.in_features, fused.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``cat([q(x), k(x), v(x)], -1)``, the fused layer's output."""
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def resolve_targets(model: nn.Module, target: str | Sequence[str], *, rank: int, exclude: str = "") -> list[str]:
    """Full names of the modules an adapter goes on.

    ``"query"`` rewrites fused ``qkv`` Linears with :class:`SplitQKV` in place (see the module docstring).

    Args:
        model: the backbone.
        target: ``"convs"``, ``"query"``, a list of module names, or a regular expression (full match).
        rank: the adapter rank (grouped convolutions need ``rank % groups == 0``).
        exclude: a module name whose subtree is never targeted (the new head, trained in full).

    Returns:
        Sorted list of module names.

    Raises:
        ConfigError: no module matches, a name is unknown, belongs to the head or is not adaptable, or a grouped conv
            is targeted; an unknown name is listed with close names and the adaptable modules.
    """
    check_target(target)

    def allowed(name: str) -> bool:
        return not exclude or (name != exclude and not name.startswith(exclude + "."))

    if target == "convs":
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.groups == 1 and allowed(n)]
    elif target == "query":
        for name, module in list(model.named_modules()):
            if name.endswith("qkv") and isinstance(module, nn.Linear) and allowed(name):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, SplitQKV(module))
        names = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and allowed(n) and (n.endswith(".qkv.q") or n.split(".")[-1] in _QUERY_NAMES)
        ]
    elif isinstance(target, str):
        pattern = re.compile(target)
        names = [n for n, m in model.named_modules() if n and pattern.fullmatch(n) and allowed(n)]
    else:
        modules = dict(model.named_modules())
        unknown = [n for n in target if n not in modules]
        if unknown:
            candidates = _candidates(model, allowed)
            close = sorted({c for n in unknown for c in difflib.get_close_matches(n, candidates, n=3)})
            raise ConfigError(
                f"unknown module(s) in target: {unknown}; close names: {close}; adaptable modules of "
                f"{type(model).__name__} (first 20 of {len(candidates)}): {candidates[:20]}",
                field="target",
            )
        head = [n for n in target if not allowed(n)]
        if head:
            message = f"target {head} belong to the new head, which is trained in full, not adapted"
            raise ConfigError(message, field="target")
        names = list(target)
    if not names:
        candidates = _candidates(model, allowed)
        raise ConfigError(
            f"target={target!r} matches no adaptable module of {type(model).__name__}. Presets: {PRESETS}; "
            f"candidates (first 20 of {len(candidates)}): {candidates[:20]}",
            field="target",
        )
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, _ADAPTABLE):
            raise ConfigError(
                f"target {name!r} is a {type(module).__name__}, which peft LoRA cannot adapt; "
                f"target Linear/Conv/Embedding layers, e.g. {_candidates(model, allowed)[:5]}",
                field="target",
            )
        groups = getattr(module, "groups", 1)
        if groups > 1 and rank % groups:
            raise ConfigError(
                f"target {name!r} is a grouped convolution (groups={groups}); peft needs the rank "
                f"(r={rank}) divisible by groups. Use the 'convs' preset, which skips grouped convolutions.",
                field="target",
            )
    return sorted(set(names))


def _candidates(model: nn.Module, allowed: Callable[[str], bool]) -> list[str]:
    """The names of the modules peft LoRA can adapt (outside the head)."""
    return [n for n, m in model.named_modules() if n and isinstance(m, _ADAPTABLE) and allowed(n)]


def lora_config(
    targets: Sequence[str], *, r: int, alpha: float | None, dropout: float, use_dora: bool, **options: Any
) -> LoraConfig:
    """The peft ``LoraConfig`` of exactly ``targets``.

    Args:
        targets: full module names (what :func:`resolve_targets` returned).
        r: adapter rank.
        alpha: LoRA scaling numerator (scale ``alpha / r``); ``None``: ``r`` (scale 1).
        dropout: LoRA dropout.
        use_dora: DoRA (weight-decomposed LoRA): adds a trainable magnitude vector per adapted layer.
        **options: what the family adds: the head to train in full (``modules_to_save``) or a peft ``task_type``.
    """
    return LoraConfig(
        r=r,
        lora_alpha=float(r if alpha is None else alpha),
        lora_dropout=dropout,
        # One anchored regex: a list would also match every module whose name merely *ends* with a target.
        target_modules="^(?:" + "|".join(re.escape(t) for t in targets) + ")$",
        use_dora=use_dora,
        **options,
    )


def adapt(model: nn.Module, config: LoraConfig) -> PeftModel:
    """``get_peft_model(model, config)``: only the adapters and the modules to save stay trainable."""
    with warnings.catch_warnings():  # peft asks transformers 5 a deprecated question; nothing for the user to do
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def freeze_normalization(model: nn.Module) -> nn.Module:
    """Put every normalisation layer in eval mode (running statistics frozen; batch size 1 has no batch stats)."""
    for module in model.modules():
        if isinstance(module, _NORMS):
            module.eval()
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts (peft's frozen copy of the head counted once, as frozen)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


#: The kinds of trainable parameter (:func:`parameter_kind`), e.g. for ``OnlineClassifier``'s ``step_scales``.
PARAMETER_KINDS = ("head", "lora_A", "lora_B", "lora_magnitude")


def parameter_kind(name: str) -> str:
    """The kind of a trainable parameter, from its name.

    ``"lora_A"`` or ``"lora_B"`` for a parameter of a LoRA matrix (peft's ``lora_A``/``lora_embedding_A``, ...),
    ``"lora_magnitude"`` for DoRA's magnitude vector (``lora_magnitude_vector``), else ``"head"``: every other
    trainable parameter (the new head, peft's ``modules_to_save``, a trainable bias). The adapters saved by a run
    (:meth:`~loko_lightning.learner.module.OnlineClassifier.load_adapters`) are every kind but ``"head"``.
    """
    parts = name.split(".")
    if "lora_A" in parts or "lora_embedding_A" in parts:
        return "lora_A"
    if "lora_B" in parts or "lora_embedding_B" in parts:
        return "lora_B"
    if "lora_magnitude_vector" in parts:
        return "lora_magnitude"
    return "head"
