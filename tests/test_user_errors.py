"""What a user's own code gets wrong, refused in one clear error naming the fix (not silently learned badly, not a
raw error from deep inside torch)."""

import lightning.pytorch as pl
import pytest
import torch
from runs import loader, stream, tiny, trainer
from torch import nn
from torch.nn import functional as F

from loko_lightning import LoKO, jacobian
from loko_lightning.errors import ConfigError
from loko_lightning.learner.metrics import OnlineAccuracy
from loko_lightning.learner.module import OnlineClassifier


def mlp(*tail):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3), *tail)


def step(model, optimizer, target, observe=None):
    x = torch.randn(1, 5)

    def closure():
        prediction, jacobians = jacobian(model, x)
        return (observe(prediction) if observe else prediction), target, jacobians

    return optimizer.step(closure)


def test_a_network_that_ends_in_softmax_is_refused():
    model = mlp(nn.Softmax(-1))
    with pytest.raises(ValueError, match="already probabilities.*remove the final Softmax"):
        jacobian(model, torch.randn(1, 5))
    jacobian(mlp(), torch.randn(1, 5))  # logits: fine


def test_a_single_logit_with_the_softmax_observation_is_refused():
    model = nn.Linear(5, 1)
    with pytest.raises(ValueError, match="one output per sample.*m >= 2 outputs"):
        jacobian(model, torch.randn(1, 5))
    jacobian(model, torch.randn(1, 5), observation="regression")  # observed as it is: fine


def test_probabilities_then_logits_are_skipped_on_the_device_and_refused_at_the_next_read():
    """The same layout: no host read on the step (the check runs on the device); a failing step changes nothing.
    Right after the layout's first step the count is read at once (logits on step 2 are refused on step 2); later
    the reads come every 2, 4, ... up to CHECK_EVERY steps."""
    from loko_lightning.kalman.optimizer import CHECK_EVERY

    model = mlp()
    optimizer = LoKO(model.parameters(), p0=0.1)
    target = F.one_hot(torch.tensor(1), 3).float()
    step(model, optimizer, target)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"the prediction is not.*\(1 of the last 1 steps failed it"):
        step(model, optimizer, target, observe=lambda p: torch.log(p))  # logits-like where probabilities belong
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    model = mlp()
    optimizer = LoKO(model.parameters(), p0=0.1)
    for _ in range(2 * CHECK_EVERY):  # clean steps: the window has grown to CHECK_EVERY
        step(model, optimizer, target)
    before = [p.clone() for p in model.parameters()]
    skipped = int(optimizer.state[next(model.parameters())]["skipped"])
    with pytest.raises(ValueError, match=rf"the prediction is not.*of the last {CHECK_EVERY} steps"):
        for _ in range(CHECK_EVERY):
            step(model, optimizer, target, observe=lambda p: torch.log(p))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert int(optimizer.state[next(model.parameters())]["skipped"]) > skipped


def test_an_integer_one_hot_target_names_the_dtype():
    model = mlp()
    optimizer = LoKO(model.parameters(), p0=0.1)
    with pytest.raises(ValueError, match=r"Invalid target: dtype torch.int64.*one_hot\(label, m\).float\(\)"):
        step(model, optimizer, F.one_hot(torch.tensor(1), 3))


@pytest.mark.parametrize(
    ("arguments", "field", "shown"),
    [
        ({"p0": "0.2"}, "p0", "'0.2' (str"),
        ({"p0": torch.tensor(0.2)}, "p0", "(Tensor"),
        ({"p0": True}, "p0", "True (bool"),
        ({"filter": {"name": "covariance", "beta": "0.95"}}, "filter", "Invalid beta: '0.95' (str"),
        ({"seed": "0"}, "seed", "'0' (str"),
        ({"seed": 1.5}, "seed", "1.5 (float"),
        ({"time_update": {"process_noise": False}}, "process_noise", "Invalid process_noise: False"),
    ],
)
def test_hyperparameters_of_the_wrong_type_are_named_with_their_type(arguments, field, shown):
    with pytest.raises(ConfigError, match=r"Invalid") as err:
        LoKO(mlp().parameters(), **{"p0": 0.1, **arguments})
    assert err.value.field == field and shown in str(err.value)


def test_load_state_dict_refuses_another_models_or_another_optimizers_state():
    target = F.one_hot(torch.tensor(1), 3).float()
    model = mlp()
    optimizer = LoKO(model.parameters(), p0=0.1)
    step(model, optimizer, target)
    other = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    with pytest.raises(ValueError, match="another model"):
        LoKO(other.parameters(), p0=0.1).load_state_dict(optimizer.state_dict())
    adamw = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 5)).sum().backward()
    adamw.step()
    with pytest.raises(ValueError, match="not LoKO's.*another optimizer"):
        LoKO(model.parameters(), p0=0.1).load_state_dict(adamw.state_dict())
    fresh = LoKO(model.parameters(), p0=0.1)
    fresh.load_state_dict(optimizer.state_dict())  # its own: fine
    step(model, fresh, target)


@pytest.mark.parametrize(("saved", "resumed"), [("loko", "adamw"), ("adamw", "loko")])
def test_resuming_with_another_kind_of_optimizer_is_refused(tmp_path, saved, resumed):
    items = stream(6)
    first = trainer(enable_checkpointing=True, default_root_dir=tmp_path, max_steps=3)
    first.fit(tiny(saved, **({"p0": 0.1} if saved == "loko" else {"lr": 1e-3})), loader(items))
    path = tmp_path / "saved.ckpt"
    first.save_checkpoint(path)
    learner = tiny(resumed, **({"p0": 0.1} if resumed == "loko" else {"lr": 1e-3}))
    with pytest.raises(ConfigError, match="cannot carry over") as err:
        trainer().fit(learner, loader(items), ckpt_path=path)
    assert err.value.field == "optimizer"
    loaded = OnlineClassifier.load_from_checkpoint(path, weights_only=True)  # using the weights is fine
    assert loaded(torch.randn(1, 3, 32, 32)).shape == (1, 4)


def test_online_accuracy_takes_a_batch_and_names_bad_shapes():
    scores = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5]])
    labels = torch.tensor([1, 2, 2])
    batch, one_by_one = OnlineAccuracy(), OnlineAccuracy()
    batch.update(scores, labels)
    for s, y in zip(scores, labels, strict=True):
        one_by_one.update(s, y)
    assert float(batch.compute()) == float(one_by_one.compute()) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match=r"expected \(m,\) scores with a 0-d label, or \(B, m\) with \(B,\) labels"):
        OnlineAccuracy().update(scores, torch.tensor(1))


def test_a_learner_given_a_model_name_says_what_it_takes():
    with pytest.raises(ConfigError, match="network must be a network factory.*TimmClassifier") as err:
        OnlineClassifier("resnet18")
    assert err.value.field == "network"


class OwnModule(pl.LightningModule):
    """A user's LightningModule with LoKO, written with one of two mistakes."""

    def __init__(self, mistake):
        super().__init__()
        self.model, self.mistake = mlp(), mistake
        self.automatic_optimization = mistake == "automatic optimization left on"

    def training_step(self, batch, batch_idx):
        x, label = batch
        if self.mistake == "automatic optimization left on":
            return F.cross_entropy(self.model(x), label)
        self.optimizers().step()  # "no closure passed"

    def configure_optimizers(self):
        return LoKO(self.model.parameters(), p0=0.1)


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        ("automatic optimization left on", "automatic_optimization = False"),
        ("no closure passed", "None.*self.optimizers\\(\\).step\\(closure\\)"),
    ],
)
def test_manual_optimisation_mistakes_say_what_to_change(mistake, message):
    data = [(torch.randn(5), torch.tensor(1)) for _ in range(2)]
    with pytest.raises(ValueError, match=message):
        trainer().fit(OwnModule(mistake), torch.utils.data.DataLoader(data, batch_size=1))


def test_an_output_of_more_than_two_dimensions_is_refused():
    """A conv net without its head gives (1, 4, 5, 5): not 100 classes."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    with pytest.raises(ValueError, match=r"shape \(1, 4, 5, 5\), but class scores are \(batch, m\).*as 100 classes"):
        jacobian(model, torch.randn(1, 3, 7, 7))
    jacobian(model, torch.randn(1, 3, 7, 7), observation="regression")  # dense outputs observed as they are
