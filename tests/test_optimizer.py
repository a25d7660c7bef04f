"""The optimizer's contract: state and checkpoints, checks and errors, non-finite steps, the cached plan."""

import copy
import subprocess
import sys

import pytest
import torch
from loko_helpers import SmallConvNet, conv_stream, factor_dense, loko_closure, mlp, teacher_stream

from loko_lightning import LoKO, jacobian
from loko_lightning.jacobians.blocks import FactoredJacobian
from loko_lightning.kalman import TimeUpdate
from loko_lightning.kalman.update import loko_update


def test_state_dict_round_trip_continues_bit_identically():
    stream = list(teacher_stream(40, dtype=torch.float32))
    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters(), seed=0, time_update={"process_noise": 1e-5})
    for x, y in stream[:20]:
        opt.step(loko_closure(model, x, y))
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    for x, y in stream[20:]:
        opt.step(loko_closure(model, x, y))

    restored = mlp(dtype=torch.float32)
    restored.load_state_dict(saved_model)
    opt2 = LoKO(restored.parameters(), seed=123)  # a different p0 draw, overwritten by the checkpoint
    opt2.load_state_dict(saved_opt)
    for x, y in stream[20:]:
        opt2.step(loko_closure(restored, x, y))
    for p, q in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["cov"], opt2.state[q]["cov"])
    first, first2 = next(model.parameters()), next(restored.parameters())
    for key in ("R", "step", "skipped"):
        assert torch.equal(opt.state[first][key], opt2.state[first2][key])


def test_float64_state_survives_checkpoint_of_float32_model():
    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters(), dtype=torch.float64, seed=0)
    x, y = next(teacher_stream(1, dtype=torch.float32))
    opt.step(loko_closure(model, x, y))
    opt2 = LoKO(model.parameters(), dtype=torch.float64)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in model.parameters():
        assert opt2.state[p]["cov"].dtype == torch.float64
        assert torch.equal(opt2.state[p]["cov"], opt.state[p]["cov"])
    assert opt2.state[next(model.parameters())]["R"].dtype == torch.float64


@pytest.mark.parametrize("where", ["prediction", "jacobian", "target"])
def test_non_finite_input_skips_update(where):
    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters(), seed=0)
    stream = list(teacher_stream(3, dtype=torch.float32))
    opt.step(loko_closure(model, *stream[0]))
    before = copy.deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in model.parameters()]
    x, y = stream[1]

    def bad_closure():
        prediction, jacobians = jacobian(model, x)
        if where == "prediction":
            prediction = prediction.clone()
            prediction[0] = float("nan")
        elif where == "jacobian":
            jacobians[1] = jacobians[1].clone()
            jacobians[1][0, 0] = float("inf")
        return prediction, (y * float("nan") if where == "target" else y), jacobians

    opt.step(bad_closure)
    assert not opt.diagnostics["applied"].item()
    assert opt.diagnostics["skipped"].item() == 1
    for p, q in zip(model.parameters(), params_before, strict=True):
        assert torch.equal(p, q)
    after = opt.state_dict()
    for index, state in before["state"].items():
        for key, value in state.items():
            if key != "skipped":  # the one counter a skipped update is meant to change
                assert torch.equal(after["state"][index][key], value), key
    opt.step(loko_closure(model, *stream[2]))
    assert opt.diagnostics["applied"].item()
    assert opt.diagnostics["step"].item() == 2


def test_wrong_shapes_raise():
    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters())
    x, y = next(teacher_stream(1, dtype=torch.float32))
    prediction, jacobians = jacobian(model, x)
    with pytest.raises(ValueError, match=r"Invalid target: expected shape \(4,\).*got \(3,\)"):
        opt.step(lambda: (prediction, y[:3], jacobians))
    # A 2-d prediction is a batch (B, m): its target must be one too.
    with pytest.raises(ValueError, match=r"Invalid target: expected shape \(1, 4\) like the prediction, got \(4,\)"):
        opt.step(lambda: (prediction[None], y, jacobians))
    with pytest.raises(ValueError, match=r"Invalid prediction: expected shape \(m,\), got \(\)"):
        opt.step(lambda: (prediction[0], y, jacobians))
    with pytest.raises(ValueError, match=r"expected 4 \(one per parameter\), got 3"):
        opt.step(lambda: (prediction, y, jacobians[:3]))
    with pytest.raises(ValueError, match=r"Invalid jacobians\[0\]: expected shape \(4, 7, 5\), got \(4, 5, 7\)"):
        opt.step(lambda: (prediction, y, [jacobians[0].transpose(1, 2), *jacobians[1:]]))
    with pytest.raises(ValueError, match="closure"):
        opt.step()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"p0": 0.0}, "Invalid p0"),
        ({"p0": -1.0}, "Invalid p0"),
        ({"p0": float("nan")}, "Invalid p0"),
        ({"filter": {"name": "covariance", "beta": 1.0}}, "Invalid beta"),
        ({"filter": {"name": "covariance", "beta": 0.0}}, "Invalid beta"),
        ({"time_update": {"process_noise": -1e-3}}, "Invalid process_noise"),
        ({"time_update": {"p_floor": -1e-3}}, "Invalid p_floor"),
        ({"time_update": {"p_floor": float("inf")}}, "Invalid p_floor"),
        ({"filter": {"name": "covariance", "r_estimator": "kalman"}}, "Invalid r_estimator"),
        ({"p0_init": "normal"}, "Invalid p0_init"),
        ({"dtype": torch.float16}, "Invalid dtype"),
    ],
)
def test_invalid_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoKO(mlp().parameters(), **kwargs)


def test_param_groups_carry_their_own_p0():
    model = mlp(dtype=torch.float32)
    opt = LoKO(
        [
            {"params": model[0].parameters(), "p0": 1e-3, "p0_init": "constant"},
            {"params": model[2].parameters()},
        ],
        p0=0.2,
        seed=0,
    )
    assert torch.equal(opt.state[model[0].weight]["cov"], torch.full((7, 5), 1e-3))
    head = opt.state[model[2].weight]["cov"]
    assert (head > 0).all() and (head <= 0.2).all() and head.std() > 0.02  # U(0, 0.2] has std 0.058
    with pytest.raises(ValueError, match="describe the single filter, not a group"):
        LoKO([{"params": model[0].parameters(), "beta": 0.5}])


def test_fan_in_p0_is_the_constant_p0_over_each_parameters_fan_in():
    conv = torch.nn.Conv2d(3, 4, 3)
    lora_b = torch.nn.Linear(2, 6, bias=True)
    opt = LoKO([*conv.parameters(), *lora_b.parameters()], p0=3.0, p0_init="fan_in")
    assert torch.equal(opt.state[conv.weight]["cov"], torch.full((4, 3, 3, 3), 3.0 / 27))  # in · kh · kw
    assert torch.equal(opt.state[conv.bias]["cov"], torch.full((4,), 3.0))  # a vector: fan-in 1
    assert torch.equal(opt.state[lora_b.weight]["cov"], torch.full((6, 2), 1.5))  # rank 2


def test_seed_makes_p0_reproducible():
    a = LoKO(mlp().parameters(), seed=7)
    b = LoKO(mlp().parameters(), seed=7)
    for sa, sb in zip(a.state.values(), b.state.values(), strict=True):
        assert torch.equal(sa["cov"], sb["cov"])


def test_torch_only_import_pulls_no_lightning():
    code = (
        "import sys, loko_lightning, loko_lightning.kalman.optimizer, loko_lightning.jacobians.engine\n"
        "import loko_lightning.kalman.update\n"
        "import loko_lightning.kalman.reference\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_factored_jacobian_shapes_are_checked_and_non_finite_skips():
    model = SmallConvNet()
    opt = LoKO(model.parameters(), seed=0)
    x, y = next(conv_stream(1))
    x, y = x.float(), y.float()
    prediction, jacs = jacobian(model, x)
    good = factor_dense(jacs[0], model.conv1.weight)
    bad = FactoredJacobian(good.left, good.right[:-1], model.conv1.weight.shape)
    with pytest.raises(ValueError, match=r"Invalid jacobians\[0\]"):
        opt.step(lambda: (prediction, y, [bad, *jacs[1:]]))
    wrong_rows = FactoredJacobian(good.left[:, :2], good.right, model.conv1.weight.shape)
    with pytest.raises(ValueError, match=r"Invalid jacobians\[0\]"):
        opt.step(lambda: (prediction, y, [wrong_rows, *jacs[1:]]))
    before = [p.detach().clone() for p in model.parameters()]
    nan_left = good.left.clone()
    nan_left[0, 0, 0] = float("nan")
    opt.step(lambda: (prediction, y, [FactoredJacobian(nan_left, good.right, good.param_shape), *jacs[1:]]))
    assert not opt.diagnostics["applied"].item()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    opt.step(lambda: (prediction, y, [good, *jacs[1:]]))
    assert opt.diagnostics["applied"].item()


def test_cached_plan_and_flat_covariance_equal_the_stateless_update():
    """LoKO keeps one update plan and p̂ as one flat vector between steps; that must not change any number.

    The stateless :func:`loko_update` (a plan built per call, p̂ gathered from and scattered back to separate
    tensors) is run beside the optimizer on the same Jacobians. The layout changes mid-stream (dense, then
    factored blocks, then dense again: a new plan and a new flat order each time), and the optimizer's state is
    replaced by ``load_state_dict`` mid-stream (the flat vector must be rebuilt from the new tensors). Both sides
    do the same operations on the same values, so they agree exactly.
    """
    torch.manual_seed(4)
    model = SmallConvNet().double()
    model_b = copy.deepcopy(model)
    opt = LoKO(model.parameters(), seed=0, time_update={"process_noise": 1e-4})
    params_b = list(model_b.parameters())
    covs = [opt.state[p]["cov"].clone() for p in model.parameters()]
    R, step = torch.zeros(4, 4, dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    for i, (x, y) in enumerate(conv_stream(12)):
        factorize = 4 <= i < 8
        prediction, jacs = jacobian(model, x, factorize=factorize)
        prediction_b, jacs_b = jacobian(model_b, x, factorize=factorize)
        assert torch.equal(prediction, prediction_b)
        opt.step(lambda: (prediction, y, jacs))  # noqa: B023 (called at once)
        state = {"cov": covs, "R": R, "step": step}
        expected = loko_update(params_b, jacs_b, state, prediction_b, y, time_update=TimeUpdate(process_noise=1e-4))
        if i == 9:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        for p, q, cov in zip(model.parameters(), params_b, covs, strict=True):
            assert torch.equal(p, q), i
            assert torch.equal(opt.state[p]["cov"], cov), i
        # The optimizer computes p̂'s statistics when they are read; they are those of this step.
        diagnostics = opt.diagnostics
        for key, value in expected.items():
            assert torch.equal(diagnostics[key], value), (i, key)
    assert opt.diagnostics["step"].item() == 12


def test_lr_is_refused_with_p0_named():
    """LoKO has no learning rate; an lr given to the constructor or in a param group is an error, not ignored."""
    model = mlp(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"Invalid lr: LoKO has no learning rate.*p0"):
        LoKO(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"Invalid lr: LoKO has no learning rate.*p0"):
        LoKO([{"params": model[0].parameters(), "lr": 1e-3}])
    opt = LoKO(model[0].parameters())
    with pytest.raises(ValueError, match=r"Invalid lr: LoKO has no learning rate.*p0"):
        opt.add_param_group({"params": model[2].parameters(), "lr": 1e-3})
    assert len(opt.param_groups) == 1
    with pytest.raises(TypeError, match="momentum"):
        LoKO(model.parameters(), momentum=0.9)


def test_schedulers_and_lr_monitor_on_loko_say_there_is_no_learning_rate(tmp_path):
    """A torch scheduler or Lightning's LearningRateMonitor on LoKO: a KeyError that says why, not ``KeyError: 'lr'``.

    Also after ``load_state_dict`` (which rebuilds the param groups) and a deep copy.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    from loko_lightning.errors import NoLearningRateError

    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters())
    no_lr = r"LoKO has no learning rate \('lr'\).*p0.*remove them"
    with pytest.raises(KeyError, match=no_lr):
        torch.optim.lr_scheduler.LinearLR(opt)
    restored = LoKO(mlp(dtype=torch.float32).parameters())
    restored.load_state_dict(opt.state_dict())
    for optimizer in (restored, copy.deepcopy(opt)):
        with pytest.raises(NoLearningRateError, match=no_lr):
            optimizer.param_groups[0]["lr"]
        assert optimizer.param_groups[0]["p0"] == 0.2  # the other keys read as before
    with pytest.raises(KeyError, match="^'momentum'$"):
        opt.param_groups[0]["momentum"]

    class OwnLoop(pl.LightningModule):  # a user's own module with manual optimisation, as in the README
        def __init__(self):
            super().__init__()
            self.net = mlp(dtype=torch.float32)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.optimizers().step(loko_closure(self.net, x[0], y[0]))

        def configure_optimizers(self):
            return LoKO(self.net.parameters())

    x, y = zip(*teacher_stream(4, dtype=torch.float32), strict=True)
    data = torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=1)
    trainer = pl.Trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path),
        callbacks=[LearningRateMonitor()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(KeyError, match=no_lr):
        trainer.fit(OwnLoop(), data)


def test_frozen_parameter_in_the_optimizer_names_requires_grad():
    model = mlp(dtype=torch.float32)
    model[0].requires_grad_(False)
    opt = LoKO(model.parameters())
    x, y = next(teacher_stream(1, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"expected 4 \(one per parameter\), got 2; 2 of .* requires_grad=False"):
        opt.step(loko_closure(model, x, y))


@pytest.mark.parametrize("items", [2, 4])
def test_closure_result_of_the_wrong_length_says_how_many_came_back(items):
    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters())
    x, y = next(teacher_stream(1, dtype=torch.float32))
    prediction, jacobians = jacobian(model, x)
    result = (prediction, y, jacobians, None)[:items]
    with pytest.raises(ValueError, match=rf"Invalid closure result: .*got {items} items"):
        opt.step(lambda: result)


def test_logits_against_a_one_hot_target_are_refused_unless_regression_is_declared():
    """A one-hot target with a prediction that is not a probability vector (logits) names the fix; a declared
    regression observation takes the same input; a non-finite first prediction is skipped, not refused."""
    model = mlp(dtype=torch.float32)
    stream = list(teacher_stream(3, dtype=torch.float32))
    opt = LoKO(model.parameters(), seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r'prediction is not .*jacobian\(\.\.\., observation="softmax"\)'):
        opt.step(loko_closure(model, *stream[0], observation="regression"))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))

    regression = LoKO(model.parameters(), seed=0, observation="regression")
    for x, y in stream:
        regression.step(loko_closure(model, x, y, observation="regression"))
    assert regression.diagnostics["step"].item() == 3

    x, y = stream[0]
    prediction, jacobians = jacobian(model, x)
    opt.step(lambda: (torch.full_like(prediction, float("nan")), y, jacobians))
    assert not opt.diagnostics["applied"].item()
    opt.step(loko_closure(model, x, y))  # softmax output: accepted
    assert opt.diagnostics["applied"].item()
    with pytest.raises(ValueError, match="Invalid observation"):
        LoKO(model.parameters(), observation="logits")
