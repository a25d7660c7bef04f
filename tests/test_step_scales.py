"""One step size per kind of parameter: LoKO's group ``p0_scale`` and the learner's ``step_scales``.

The paper gives every trainable parameter the same prior scale ``p0``. ``step_scales`` multiplies it per kind (the
head, LoRA A, LoRA B): the filter's update is the paper's, from another initial ``p̂``, so it is checked against
the same update started from that ``p̂`` (explicit per-group ``p0``), and with every factor 1 against the paper's run.
"""

from functools import partial
from pathlib import Path

import pytest
import torch
from loko_helpers import loko_closure, mlp, teacher_stream
from runs import loader, outputs, stream, trainer

from loko_lightning import LoKO
from loko_lightning.cli import main
from loko_lightning.errors import ConfigError
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.learner.selection import AUTO_P0
from loko_lightning.models import TimmClassifier
from loko_lightning.models.adapters import parameter_kind
from loko_lightning.serve.learner import ServingLearner

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")
pytestmark = pytest.mark.usefixtures("one_thread")


def network():
    return TimmClassifier("test_resnet", 4, pretrained=False, r=2)


def run(model, opt, samples):
    for x, y in samples:
        opt.step(loko_closure(model, x, y))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("p0_init", ["constant", "fan_in", "uniform"])
def test_a_groups_p0_scale_is_its_p0_times_the_factor(p0_init):
    """p0 0.2 with p0_scale 0.25 on the first layer is p0 0.05 there: the same p̂ and the same run (factors that are
    powers of 2: the products are exact in binary floating point)."""
    samples = list(teacher_stream(30))
    torch.manual_seed(0)
    scaled_model, explicit_model = mlp(), mlp()
    explicit_model.load_state_dict(scaled_model.state_dict())
    scaled = LoKO(
        [{"params": scaled_model[0].parameters(), "p0_scale": 0.25}, {"params": scaled_model[2].parameters()}],
        p0=0.2,
        p0_init=p0_init,
        time_update={"forgetting": 0.01},  # its reference variance is the group's prior too
        seed=3,
    )
    explicit = LoKO(
        [{"params": explicit_model[0].parameters(), "p0": 0.05}, {"params": explicit_model[2].parameters()}],
        p0=0.2,
        p0_init=p0_init,
        time_update={"forgetting": 0.01},
        seed=3,
    )
    for a, b in zip(scaled_model.parameters(), explicit_model.parameters(), strict=True):
        assert torch.equal(scaled.state[a]["cov"], explicit.state[b]["cov"])
    for a, b in zip(run(scaled_model, scaled, samples), run(explicit_model, explicit, samples), strict=True):
        assert torch.equal(a, b)


def test_p0_scale_one_is_the_papers_update():
    samples = list(teacher_stream(30))
    torch.manual_seed(0)
    grouped_model, plain_model = mlp(), mlp()
    plain_model.load_state_dict(grouped_model.state_dict())
    grouped = LoKO(
        [{"params": grouped_model[0].parameters(), "p0_scale": 1.0}, {"params": grouped_model[2].parameters()}],
        seed=0,
    )
    plain = LoKO(plain_model.parameters(), seed=0)
    for a, b in zip(run(grouped_model, grouped, samples), run(plain_model, plain, samples), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "0.1", True])
def test_a_bad_p0_scale_is_refused_naming_it(bad):
    with pytest.raises(ConfigError, match="p0_scale") as error:
        LoKO([{"params": mlp().parameters(), "p0_scale": bad}])
    assert error.value.field == "p0_scale"


def test_parameter_kinds_follow_peft_names():
    assert parameter_kind("base_model.model.conv1.lora_A.default.weight") == "lora_A"
    assert parameter_kind("base_model.model.layer1.0.conv2.lora_B.default.weight") == "lora_B"
    assert parameter_kind("base_model.model.embed.lora_embedding_A.default") == "lora_A"
    assert parameter_kind("base_model.model.fc.modules_to_save.default.weight") == "head"
    assert parameter_kind("base_model.model.fc.weight") == "head"
    assert parameter_kind("base_model.model.conv1.lora_magnitude_vector.default.weight") == "lora_magnitude"


def test_doras_magnitudes_are_adapters_not_the_head():
    """A DoRA network's magnitudes keep their own kind: ``{"head": 0.1}`` scales only the head's prior, and the
    adapters a run hands on (``adapters_from``) are every trainable parameter but the head."""
    torch.manual_seed(0)
    dora = TimmClassifier("test_resnet", 4, pretrained=False, r=2, use_dora=True)
    model = OnlineClassifier(dora, partial(LoKO, p0=0.2, seed=0), step_scales={"head": 0.1})
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    kinds = {parameter_kind(name) for name in names}
    assert kinds == {"head", "lora_A", "lora_B", "lora_magnitude"}
    scale = {
        id(p): group.get("p0_scale", 1.0)
        for group in model.configure_optimizers().param_groups
        for p in group["params"]
    }
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert scale[id(p)] == (0.1 if parameter_kind(name) == "head" else 1.0), name


def test_the_learners_groups_keep_the_parameter_order_and_scale_loko_p0():
    torch.manual_seed(0)
    plain = OnlineClassifier(network(), partial(LoKO, p0=0.2, seed=0))
    torch.manual_seed(0)
    scaled = OnlineClassifier(network(), partial(LoKO, p0=0.2, seed=0), step_scales={"head": 0.5, "lora_B": 2})
    groups = scaled.parameter_groups()
    order = [p for group in groups for p in group["params"]]
    assert [id(p) for p in order] == [id(p) for p in scaled.trainable_parameters]
    names = {id(p): name for name, p in scaled.network.named_parameters()}
    expected = {"head": 0.5, "lora_A": 1.0, "lora_B": 2.0}
    assert all(expected[parameter_kind(names[id(p)])] == g["scale"] for g in groups for p in g["params"])
    assert any(parameter_kind(names[id(p)]) == "head" for p in order)
    a, b = plain.build_optimizer(), scaled.build_optimizer()
    assert [g["p0_scale"] for g in b.param_groups] == [g["scale"] for g in groups]
    for p, q in zip(plain.trainable_parameters, scaled.trainable_parameters, strict=True):
        factor = expected[parameter_kind(names[id(q)])]
        # The same U(0, 1] draws times 0.2 or 0.2 x factor in float64, each rounded once to float32: equal up to
        # that one rounding (a relative 2^-24; factors that are powers of 2 make the products exact, so equal).
        torch.testing.assert_close(b.state[q]["cov"], a.state[p]["cov"] * factor, rtol=2**-24, atol=0)


def test_a_gradient_optimizers_lr_is_scaled_per_kind():
    module = OnlineClassifier(network(), partial(torch.optim.AdamW, lr=1e-3), step_scales={"head": 10})
    names = {id(p): name for name, p in module.network.named_parameters()}
    optimizer = module.build_optimizer()
    for group in optimizer.param_groups:
        kinds = {parameter_kind(names[id(p)]) for p in group["params"]}
        assert group["lr"] == pytest.approx(1e-2 if kinds == {"head"} else 1e-3, rel=1e-15)


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        ({"classifier": 0.1}, "unknown kind of parameter 'classifier'; known: head, lora_A, lora_B"),
        ({"head": 0}, "factor of head must be a finite number > 0"),
        ({"lora_A": float("inf")}, "factor of lora_A"),
        ({"head": "small"}, "factor of head"),
        (0.1, "must map kinds of parameter to factors"),
    ],
)
def test_bad_step_scales_name_the_field(scales, message):
    with pytest.raises(ConfigError, match=message) as error:
        OnlineClassifier(network(), partial(LoKO, p0=0.2), step_scales=scales)
    assert error.value.field == "step_scales"


def test_p0_auto_chooses_the_scale_and_keeps_the_ratio():
    """Every candidate of p0: auto is LoKO with that p0 and the head's p0_scale."""
    module = OnlineClassifier(network(), partial(LoKO, p0="auto", seed=0), step_scales={"head": 0.1})
    trainer(max_steps=3).fit(module, loader(stream(3)))
    snapshots = module.online_step.states.snapshots
    assert len(snapshots) == len(AUTO_P0)
    for value, snapshot in zip(AUTO_P0, snapshots, strict=True):
        groups = snapshot["optimizer"]["param_groups"]
        assert {g["p0"] for g in groups} == {value}
        assert sorted({g["p0_scale"] for g in groups}) == [0.1, 1.0]


def test_a_served_checkpoint_keeps_its_groups(tmp_path):
    torch.manual_seed(0)
    module = OnlineClassifier(network(), partial(LoKO, p0=0.1, seed=0), step_scales={"head": 0.5})
    fit = trainer(max_steps=3)
    fit.fit(module, loader(stream(3)))
    fit.save_checkpoint(tmp_path / "scaled.ckpt")
    served = ServingLearner.from_checkpoint(tmp_path / "scaled.ckpt")
    live = module.optimizers().optimizer
    assert [g["p0_scale"] for g in served.optimizer.param_groups] == [g["p0_scale"] for g in live.param_groups]
    for p, q in zip(module.trainable_parameters, served.module.trainable_parameters, strict=True):
        assert torch.equal(served.optimizer.state[q]["cov"], live.state[p]["cov"])


def test_loko_fit_takes_step_scales_from_the_command_line(tmp_path):
    common = ["--config", DEBUG, "--data.max_samples", "4", "--data.eval_max_samples", "4"]
    main(["fit", *common, "--model.step_scales", "{head: 0.1}", *outputs(tmp_path, every=4)])
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["hyper_parameters"]["step_scales"] == {"head": 0.1}
    groups = last["optimizer_states"][0]["param_groups"]
    assert [g["p0_scale"] for g in groups] == [1.0, 0.1]  # LoRA A and B through the body, then the new head
