"""The learning-rate-free peers (Prodigy, D-Adaptation, DoG, Mechanic) from their packages, through loko fit."""

from pathlib import Path

import pytest
import torch
from runs import outputs, trainable

from loko_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")
BASELINES = ROOT / "configs" / "baselines"
PACKAGES = {"prodigy": "prodigyopt", "dadaptation": "dadaptation", "dog": "dog", "mechanic": "mechanic_pytorch"}


@pytest.mark.parametrize("peer", sorted(PACKAGES))
def test_each_lr_free_peer_fits_the_debug_config(peer, tmp_path, one_thread):
    """12 real MNIST digits through EfficientNet-Lite0: every step recorded, the adapters and head moved from where
    they started (zero head, zero LoRA B) and stayed finite."""
    pytest.importorskip(PACKAGES[peer])
    args = ["--config", DEBUG, "--config", str(BASELINES / f"{peer}.yaml")]
    args += ["--data.max_samples", "12", "--data.eval_max_samples", "4", "--trainer.limit_val_batches", "0"]
    main(["fit", *args, *outputs(tmp_path, "run", every=12)])
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 12
    weights = trainable(checkpoint["state_dict"])
    head = [key for key in weights if "modules_to_save" in key and key.endswith("weight")]
    lora_b = [key for key in weights if "lora_B" in key]
    assert head and lora_b and all(torch.isfinite(value).all() for value in weights.values())
    assert all(weights[key].abs().sum() > 0 for key in head), "the head never moved"
    assert any(weights[key].abs().sum() > 0 for key in lora_b), "the adapters never moved"
