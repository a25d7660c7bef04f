"""Every precision Lightning offers a LoKO run: the online metrics stay exact whatever the module's dtype."""

from pathlib import Path

import pytest
import torch
from runs import outputs

from loko_lightning.cli import main
from loko_lightning.learner.metrics import MovingAverage, OnlineAccuracy

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")
# A random-weight timm test network: the metrics, not the accuracy, are under test.
TINY = ["--model.network.backbone", "test_resnet", "--model.network.weights", "null", "--model.network.pretrained",
        "false", "--model.window", "50"]  # fmt: skip


def test_the_metric_states_keep_their_dtype_when_the_module_is_converted():
    """Lightning's bf16-true converts the module with .to(dtype), which torchmetrics does not guard: a bfloat16 count
    stops at 256. The online metrics' sums stay float64 and their counts integer."""
    accuracy, average = OnlineAccuracy(), MovingAverage(window=4)
    accuracy.to(torch.bfloat16)
    average.to(torch.bfloat16)
    assert accuracy.mean_value.dtype == accuracy.weight.dtype == average.buffer.dtype == torch.float64
    assert average.count.dtype == torch.long
    for _ in range(300):
        accuracy.update(torch.tensor([0.2, 0.8]), torch.tensor(1))
    assert float(accuracy.weight) == 300.0 and float(accuracy.compute()) == 1.0


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed", "16-true"])
def test_loko_fit_in_each_precision_counts_every_sample(tmp_path, precision):
    """260 samples through ``loko fit`` (more than a bfloat16 counter can hold: 256): the online accuracy is the number
    of correct prequential predictions over 260, and every sample is in the moving average."""
    data = ["--data.max_samples", "260", "--data.eval_max_samples", "4"]
    # A checkpoint at steps 130 and 260: the last one holds the whole run.
    run = outputs(tmp_path, every=130, plot=False)
    main(["fit", "--config", DEBUG, *TINY, *data, "--trainer.precision", precision, *run])
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert state["online_acc.weight"].dtype == torch.float64 and float(state["online_acc.weight"]) == 260.0
    correct = float(state["online_acc.mean_value"])
    assert correct == int(correct) and 0 < correct <= 260  # a count of correct predictions, exactly
    assert int(state["loss_avg.count"]) == 260
