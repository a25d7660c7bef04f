"""Shared pieces of the module, CLI and reliability tests: a tiny module, a separable stream, a quiet trainer,
and a config override that sends a CLI run's logs and checkpoints into a test's folder."""

from functools import partial

import lightning.pytorch as pl
import torch
import yaml
from torch.utils.data import DataLoader

from loko_lightning import LoKO
from loko_lightning.cli import main
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.models import TimmClassifier

NETWORK_ARGS = {
    "backbone",
    "num_classes",
    "pretrained",
    "weights",
    "target",
    "r",
    "alpha",
    "dropout",
    "use_dora",
    "head_init",
}
GRADIENT = {"adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad}


def tiny(optimizer="loko", lr_scheduler=None, window=1000, **kwargs):
    """timm's ``test_resnet`` with rank-2 LoRA and a 4-class head (random backbone: no download).

    ``optimizer`` is ``"loko"`` (the other keywords that are not the network's go to :class:`LoKO`), ``"adamw"`` or
    ``"adagrad"`` (they go to the torch optimizer).
    """
    network = {k: kwargs.pop(k) for k in list(kwargs) if k in NETWORK_ARGS}
    factory = TimmClassifier(**{"backbone": "test_resnet", "num_classes": 4, "pretrained": False, "r": 2, **network})
    build = partial(GRADIENT.get(optimizer, LoKO), **kwargs)
    return OnlineClassifier(factory, build, lr_scheduler, window=window)


def stream(n, num_classes=4, size=32, seed=0):
    """``n`` samples in the DataModule's batch format: noisy copies of one random image per class."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, 3, size, size, generator=gen)
    items = []
    for i in range(n):
        label = int(torch.randint(num_classes, (), generator=gen))
        image = centres[label] + 0.5 * torch.randn(3, size, size, generator=gen)
        items.append({"inputs": image, "label": torch.tensor(label), "position": torch.tensor(i)})
    return items


def loader(items):
    return DataLoader(items, batch_size=1, shuffle=False)


def trainer(**kwargs):
    """One epoch, nothing written and nothing printed unless asked for."""
    defaults = dict(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def outputs(tmp_path, name="run", every=100, keep_all=False, plot=True, guard_every=100):
    """A second --config sending logs and checkpoints into tmp_path (a later config replaces lists whole)."""
    override = {
        "trainer": {
            "enable_progress_bar": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path), "name": name},
            },
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {
                        "dirpath": str(tmp_path / name / "checkpoints"),
                        "every_n_train_steps": every,
                        "save_last": True,
                        "save_top_k": -1 if keep_all else 1,
                    },
                },
                {"class_path": "loko_lightning.learner.OnlineReport", "init_args": {"plot": plot}},
                {"class_path": "loko_lightning.learner.DivergenceGuard", "init_args": {"check_every": guard_every}},
                {"class_path": "loko_lightning.learner.RNGStateCheckpoint"},
            ],
        }
    }
    path = tmp_path / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(override))
    return ["--config", str(path)]


def trainable(state_dict):
    """The adapters and the head of a checkpoint's ``state_dict`` (LoRA factors and peft's modules_to_save)."""
    return {k: v for k, v in state_dict.items() if "lora_" in k or "modules_to_save" in k}


def assert_same_tensors(a, b, what):
    """Two nested states (dicts, lists, tensors, numbers) equal, tensors bit for bit and of the same dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            assert_same_tensors(a[key], b[key], f"{what}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tensors(x, y, f"{what}[{i}]")
    else:
        assert a == b, what


def fit_full_and_resumed(tmp_path, common, check_part=None):
    """``loko fit`` on 24 samples three ways: whole; stopped after 12 with checkpoints every 6; resumed from the step-6
    checkpoint. ``check_part`` looks at that checkpoint first. Returns the whole and the resumed run's last checkpoints.
    """
    main(["fit", *common, *outputs(tmp_path, "full", every=24)])
    main(["fit", *common, "--trainer.max_steps", "12", *outputs(tmp_path, "part", every=6, keep_all=True)])
    part = tmp_path / "part" / "checkpoints" / "epoch=0-step=6.ckpt"
    if check_part is not None:
        check_part(torch.load(part, weights_only=False))
    main(["fit", *common, "--ckpt_path", str(part), *outputs(tmp_path, "resumed", every=24)])
    full = torch.load(tmp_path / "full" / "checkpoints" / "last.ckpt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=False)
    return full, resumed
