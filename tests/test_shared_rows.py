"""A weight's rows sharing one full covariance (``shared_rows``, the learner's ``head_covariance="shared"``).

Not the paper: the head's ``P_W = I ⊗ Σ`` with ``Σ`` full (``features x features``). The fast path
(:class:`~loko_lightning.kalman.shared_rows.SharedRowBlocks`) is held to the dense float64 reference
(:func:`~loko_lightning.kalman.reference.shared_rows_step_reference`: the Kalman update with that dense ``P``, then
the mean of the posterior's diagonal row blocks), for every Jacobian block kind and for joint steps.
"""

import copy
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from loko_helpers import SmallConvNet, conv_stream, flat_cov, loko_closure, mlp, teacher_stream
from runs import loader, outputs, stream, trainer
from test_multistream import batch_closure, batches
from torch.func import functional_call, jacrev

from loko_lightning import LoKO, jacobian
from loko_lightning.cli import main
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.reference import shared_rows_step_reference
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.learner.selection import AUTO_P0
from loko_lightning.models import TimmClassifier
from loko_lightning.serve.learner import ServingLearner

pytestmark = pytest.mark.usefixtures("one_thread")


class SharedRowsReference:
    """The filter the slow way: θ̃ one float64 vector, ``H`` from ``jacrev``, the dense reference step."""

    def __init__(self, model, opt, shared):
        self.model = copy.deepcopy(model)
        params = list(model.parameters())
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for p in params]
        self.theta = torch.cat([p.detach().reshape(-1) for p in params]).double()
        self.p = flat_cov(opt, params).double().clone()
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        self.spans = [(offsets[i], params[i].shape[0], params[i][0].numel()) for i in shared]
        self.sigmas = [opt.state[params[i]]["row_cov"].double().clone() for i in shared]
        self.R, self.k = None, 0

    def predict(self, theta, x):
        values, start = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            values[name] = theta[start : start + shape.numel()].reshape(shape)
            start += shape.numel()
        return torch.softmax(functional_call(self.model, values, (x,)).reshape(-1), 0)

    def step(self, xs, ys, beta, debias=False, prior_scale_rate=0.0, softmax_noise=False, process_noise=0.0):
        self.k += 1
        y_hat = torch.stack([self.predict(self.theta, x) for x in xs])
        H = torch.stack([jacrev(self.predict)(self.theta, x) for x in xs])
        if self.R is None:
            self.R = torch.zeros(y_hat.shape[1], y_hat.shape[1], dtype=torch.float64)
        self.theta, self.p, self.sigmas, self.R = shared_rows_step_reference(
            self.theta, self.p, self.sigmas, self.R, H, y_hat, torch.stack(ys), self.k,
            spans=self.spans, beta=beta, r_estimator="taylor", debias=debias, prior_scale_rate=prior_scale_rate,
            softmax_noise=softmax_noise, process_noise=process_noise,
        )  # fmt: skip
        return y_hat


def mlp_optimizer(model, **kwargs):
    w1, b1, w2, b2 = model.parameters()
    groups = [{"params": [w1, b1]}, {"params": [w2], "shared_rows": True}, {"params": [b2]}]
    return LoKO(groups, **{"p0": 0.3, "filter": {"name": "covariance", "beta": 0.9}, "seed": 3, **kwargs})


def assert_matches(model, opt, reference, shared):
    # The same float64 arithmetic in another order (as the paper's filter against its reference): relative error
    # near 1e-13 after tens of contracting steps, so 1e-9 leaves room without hiding an algorithmic difference.
    params = list(model.parameters())
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    torch.testing.assert_close(theta, reference.theta, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(flat_cov(opt, params), reference.p, rtol=1e-9, atol=1e-15)
    for i, sigma in zip(shared, reference.sigmas, strict=True):
        torch.testing.assert_close(opt.state[params[i]]["row_cov"], sigma, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(opt.state[params[0]]["R"], reference.R, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("factorize", [True, False])
def test_single_sample_steps_match_the_dense_float64_reference(factorize):
    """40 samples, the head's weight shared (an outer-product block, or a dense one without factorize)."""
    model = mlp()
    opt = mlp_optimizer(model)
    reference = SharedRowsReference(model, opt, shared=[2])
    for x, y in teacher_stream(40):
        y_ref = reference.step([x], [y], beta=0.9)[0]
        y_fast, _, jacs = opt.step(loko_closure(model, x, y, factorize=factorize))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert type(jacs[2]).__name__ == ("OuterJacobian" if factorize else "Tensor")
    assert_matches(model, opt, reference, shared=[2])
    assert opt.diagnostics["step"].item() == 40


@pytest.mark.parametrize("debias", [False, True])
def test_joint_steps_match_the_dense_float64_reference(debias):
    """B = 3: the stacked observation's factored block (B positions) in the shared covariance; debiased, each
    sample's block of ``S`` holds ``R_k / (1 - β^k)`` (the text default's head)."""
    model = mlp()
    opt = mlp_optimizer(model, filter={"name": "covariance", "beta": 0.9, "debias": debias})
    reference = SharedRowsReference(model, opt, shared=[2])
    for xs, ys in batches(teacher_stream(60), 3):
        y_ref = reference.step(xs, ys, beta=0.9, debias=debias)
        y_fast, _, _ = opt.step(batch_closure(model, xs, ys, factorize=True))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert_matches(model, opt, reference, shared=[2])


def test_a_conv_weight_seen_at_several_positions_matches_the_reference(monkeypatch):
    """A convolution's rows (output channels) sharing ``Σ`` over ``in x kh x kw``: a factored block with k > 1."""
    monkeypatch.setattr(sys.modules["loko_lightning.jacobians.reverse"], "factored_is_cheaper", lambda *args: True)
    torch.manual_seed(3)
    model = SmallConvNet().double()
    params = list(model.parameters())
    conv2 = [n for n, _ in model.named_parameters()].index("conv2.weight")
    head = [n for n, _ in model.named_parameters()].index("head.weight")
    groups = [{"params": [p], "shared_rows": i in (conv2, head)} for i, p in enumerate(params)]
    opt = LoKO(groups, p0=0.3, seed=3, filter={"name": "covariance", "beta": 0.9})
    reference = SharedRowsReference(model, opt, shared=[conv2, head])
    kinds = set()
    for x, y in conv_stream(20):
        reference.step([x], [y], beta=0.9)
        _, _, jacs = opt.step(loko_closure(model, x, y, factorize=True))
        kinds.add(type(jacs[conv2]).__name__)
    assert kinds == {"FactoredJacobian"}
    assert_matches(model, opt, reference, shared=[conv2, head])


def process_noise_optimizer(model, q_shared, q_rest, **kwargs):
    """The head's rows sharing Σ with their own process noise, the other groups another: ``q`` per entry."""
    w1, b1, w2, b2 = model.parameters()
    groups = [
        {"params": [w1, b1], "process_noise": q_rest},
        {"params": [w2], "shared_rows": True, "process_noise": q_shared},
        {"params": [b2], "process_noise": q_rest},
    ]
    opt = LoKO(groups, p0=0.3, seed=3, **kwargs)
    fills = [(p.numel(), q_shared if p is w2 else q_rest) for p in (w1, b1, w2, b2)]
    q = torch.cat(
        [torch.full((n,), value, dtype=torch.float64) for n, value in fills]
    )  # float64: 1e-3 is not in float32
    return opt, q


@pytest.mark.parametrize("factorize", [True, False])
@pytest.mark.parametrize("prior_scale_rate", [0.0, 0.03])
def test_process_noise_on_a_shared_covariance_matches_the_dense_float64_reference(factorize, prior_scale_rate):
    """One sample at a time: the prior ``Σ + q I`` (formed as ``Σ R + q R``; a dense block's ``Σ + q I``), the
    downdate committed on ``s (Σ + q I)``, each group's own ``q``, with and without the prior's scale."""
    model = mlp()
    flt = {"name": "covariance", "beta": 0.9, "prior_scale_rate": prior_scale_rate}
    opt, q = process_noise_optimizer(model, 2e-3, 1e-3, filter=flt)
    reference = SharedRowsReference(model, opt, shared=[2])
    for x, y in teacher_stream(40):
        y_ref = reference.step([x], [y], beta=0.9, prior_scale_rate=prior_scale_rate, process_noise=q)[0]
        y_fast, _, _ = opt.step(loko_closure(model, x, y, factorize=factorize))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert_matches(model, opt, reference, shared=[2])
    # Not a test that cannot fail: 40 steps of q moved Σ's diagonal well beyond the tolerance.
    plain = mlp_optimizer(model := mlp(), filter=flt)
    for x, y in teacher_stream(40):
        plain.step(loko_closure(model, x, y, factorize=factorize))
    w2 = list(model.parameters())[2]
    assert (reference.sigmas[0].diagonal() - plain.state[w2]["row_cov"].diagonal()).abs().max() > 1e-3


def test_process_noise_on_a_shared_covariance_in_joint_steps_matches_the_reference():
    """B = 3: the stacked observation's factored block (k = 3 positions), where ``Σ⁺`` is formed from ``Σ + q I``."""
    model = mlp()
    opt, q = process_noise_optimizer(model, 2e-3, 1e-3, filter={"name": "covariance", "beta": 0.9, "debias": True})
    reference = SharedRowsReference(model, opt, shared=[2])
    for xs, ys in batches(teacher_stream(60), 3):
        y_ref = reference.step(xs, ys, beta=0.9, debias=True, process_noise=q)
        y_fast, _, _ = opt.step(batch_closure(model, xs, ys, factorize=True))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert_matches(model, opt, reference, shared=[2])


def test_shared_rows_off_is_the_papers_update_bit_for_bit():
    models = [mlp(), mlp()]
    w1, b1, w2, b2 = models[0].parameters()
    off = LoKO([{"params": [w1, b1]}, {"params": [w2], "shared_rows": False}, {"params": [b2]}], p0=0.3, seed=3)
    paper = LoKO(models[1].parameters(), p0=0.3, seed=3)
    for x, y in teacher_stream(20):
        for model, opt in zip(models, (off, paper), strict=True):
            opt.step(loko_closure(model, x, y))
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(off.state[p]["cov"], paper.state[q]["cov"])
    assert all("row_cov" not in off.state[p] for p in models[0].parameters())


def test_the_prior_is_the_rows_mean_draw_and_p_hat_holds_the_diagonal():
    model = mlp()
    drawn = LoKO(model.parameters(), p0=0.3, seed=3).state[list(model.parameters())[2]]["cov"]
    opt = mlp_optimizer(model)
    w2 = list(model.parameters())[2]
    torch.testing.assert_close(opt.state[w2]["row_cov"], torch.diag(drawn.mean(0)), rtol=0, atol=0)
    for x, y in teacher_stream(10):
        opt.step(loko_closure(model, x, y))
    sigma = opt.state[w2]["row_cov"]
    assert torch.equal(sigma, sigma.T)
    assert torch.linalg.eigvalsh(sigma).min() > 0
    assert torch.equal(opt.state[w2]["cov"], sigma.diagonal()[None].expand_as(w2))


def test_a_resumed_state_continues_the_run_exactly():
    model, copy_model = mlp(), mlp()
    opt = mlp_optimizer(model)
    samples = list(teacher_stream(20))
    for x, y in samples[:10]:
        opt.step(loko_closure(model, x, y))
    copy_model.load_state_dict(model.state_dict())
    resumed = mlp_optimizer(copy_model)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for x, y in samples[10:]:
        opt.step(loko_closure(model, x, y))
        resumed.step(loko_closure(copy_model, x, y))
    for p, q in zip(model.parameters(), copy_model.parameters(), strict=True):
        assert torch.equal(p, q)
    w2, v2 = list(model.parameters())[2], list(copy_model.parameters())[2]
    assert torch.equal(opt.state[w2]["row_cov"], resumed.state[v2]["row_cov"])


def test_a_state_of_the_other_covariance_is_refused():
    """The same groups, the head's diagonal in the state: loading it into a shared Σ would drop the setting."""
    w1, b1, w2, b2 = mlp().parameters()
    paper = LoKO([{"params": [w1, b1]}, {"params": [w2]}, {"params": [b2]}], p0=0.3, seed=3)
    with pytest.raises(ValueError, match=r"shared_rows are \[False, False, False\], this optimizer's \[False, True"):
        mlp_optimizer(mlp()).load_state_dict(paper.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "group", "message"),
    [
        ({}, {"shared_rows": "yes"}, "'yes' \\(must be true or false\\)"),
        ({"filter": "natural"}, {}, "filter 'natural' keeps no full covariance"),
        ({"filter": "lofi2"}, {}, "filter 'lofi2' keeps no full covariance"),
        ({"shard": True}, {}, "the sharded update does not split a shared covariance"),
        ({}, {"p_floor": 1e-4}, "the time updates p_floor are not built for a shared covariance"),
        ({}, {"forgetting": 0.01, "process_noise": 1e-4}, "the time updates forgetting are not built for a shared"),
        ({}, {"with_bias": True}, "every parameter of the group must be a matrix"),
    ],
)
def test_where_shared_rows_is_not_built_it_is_refused_naming_the_field(kwargs, group, message):
    model = mlp()
    w1, b1, w2, b2 = model.parameters()
    params = [w2, b2] if group.pop("with_bias", False) else [w2]
    with pytest.raises(ConfigError, match=message) as error:
        LoKO([{"params": [w1, b1]}, {"params": params, "shared_rows": True, **group}], p0=0.3, **kwargs)
    assert (error.value.field, error.value.owner) == ("shared_rows", LoKO)


def network():
    return TimmClassifier("test_resnet", 4, pretrained=False, r=2)


def test_the_learners_head_covariance_shares_the_head_weights_rows_only():
    torch.manual_seed(0)
    module = OnlineClassifier(network(), partial(LoKO, p0=0.1, seed=0), head_covariance="shared")
    trainer(max_steps=3).fit(module, loader(stream(3)))
    opt = module.optimizers().optimizer
    shared = {name for name, p in module.network.named_parameters() if "row_cov" in opt.state.get(p, {})}
    assert shared == {"base_model.model.fc.modules_to_save.default.weight"}  # not its bias, not the LoRA matrices
    (name,) = shared
    weight = module.network.get_parameter(name)
    assert opt.state[weight]["row_cov"].shape == (weight.shape[1], weight.shape[1])
    assert opt.diagnostics["step"].item() == 3


def test_every_p0_auto_candidate_shares_the_heads_rows():
    module = OnlineClassifier(network(), partial(LoKO, p0="auto", seed=0), head_covariance="shared")
    trainer(max_steps=3).fit(module, loader(stream(3)))
    snapshots = module.online_step.states.snapshots
    assert len(snapshots) == len(AUTO_P0)
    for value, snapshot in zip(AUTO_P0, snapshots, strict=True):
        groups = snapshot["optimizer"]["param_groups"]
        assert {g["p0"] for g in groups} == {value}
        assert [g["shared_rows"] for g in groups] == [False, True, False]
        assert sum("row_cov" in s for s in snapshot["optimizer"]["state"].values()) == 1


@pytest.mark.parametrize(
    ("optimizer", "value", "message"),
    [
        (partial(LoKO, p0=0.1), "full", "head_covariance must be one of diagonal, shared, got 'full'"),
        (partial(torch.optim.AdamW, lr=1e-3), "shared", "a gradient optimizer keeps none"),
        (partial(LoKO, p0=0.1, filter="natural"), "shared", "filter 'natural' keeps no full covariance"),
        (partial(LoKO, p0=0.1, time_update={"inflation": 1e-4}), "shared", "time updates inflation"),
    ],
)
def test_a_bad_head_covariance_is_refused_before_the_network_is_built(optimizer, value, message):
    with pytest.raises(ConfigError, match=message) as error:
        OnlineClassifier(network(), optimizer, head_covariance=value)
    assert error.value.field == "head_covariance"


def test_loko_fit_checkpoints_and_serves_a_shared_head_covariance(tmp_path):
    """``--model.head_covariance shared`` end to end: the checkpoint holds Σ, and a server loads it."""
    debug = str(Path(__file__).resolve().parents[1] / "configs" / "debug.yaml")
    common = ["--config", debug, "--data.max_samples", "4", "--data.eval_max_samples", "4"]
    main(["fit", *common, "--model.head_covariance", "shared", *outputs(tmp_path, every=4)])
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["hyper_parameters"]["head_covariance"] == "shared"
    states = last["optimizer_states"][0]["state"]
    sigmas = [s["row_cov"] for s in states.values() if "row_cov" in s]
    assert len(sigmas) == 1 and sigmas[0].shape[0] == sigmas[0].shape[1]
    served = ServingLearner.from_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    served_sigmas = [s["row_cov"] for s in served.optimizer.state.values() if "row_cov" in s]
    assert len(served_sigmas) == 1 and torch.equal(served_sigmas[0], sigmas[0])


@pytest.mark.parametrize("time_update", [None, {"process_noise": 1e-3}])
def test_a_skipped_step_leaves_the_shared_rows_covariance_alone(time_update):
    """A non-finite prediction is skipped: θ̃, p̂, R and the head's Σ keep their values (the filter commits Σ only where
    the step is applied; the proposal for a skipped step still holds a changed Σ, so writing it would show; with process
    noise the commit adds q to Σ's diagonal only where applied)."""
    model = mlp()
    opt = mlp_optimizer(model, time_update=time_update)
    samples = list(teacher_stream(6))
    for x, y in samples[:5]:
        opt.step(loko_closure(model, x, y))
    before = copy.deepcopy(opt.state_dict()["state"])
    theta = [p.detach().clone() for p in model.parameters()]
    x, y = samples[5]
    prediction, jacobians = jacobian(model, x)
    bad = prediction.detach().clone()
    bad[1] = float("nan")
    opt.step(lambda: (bad, y, jacobians))
    assert not bool(opt.diagnostics["applied"])
    after = opt.state_dict()["state"]
    for index, state in before.items():
        for key, value in state.items():
            expected = value + 1 if key == "skipped" else value
            assert torch.equal(after[index][key], expected), (index, key)
    assert "row_cov" in after[2]
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), theta, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_downdate_written_a_block_of_rows_at_a_time_is_sigma_minus_the_outer_product_bit_for_bit(dtype):
    """``Downdate.commit`` forms ``t tᵀ`` ``ROWS`` rows at a time (the last block ragged here: 300 = 2 x 128 + 44) and
    subtracts each block: every entry is ``Σ_ij − t_i t_j`` rounded as ``Σ − outer(t, t)`` rounds it, so the two are
    equal, not close; a skipped step (``t`` not finite) leaves ``Σ`` as it was."""
    from loko_lightning.kalman.shared_rows import Downdate

    generator = torch.Generator().manual_seed(0)
    root = torch.randn(300, 300, generator=generator, dtype=dtype)
    sigma = root @ root.T / 300
    t = torch.randn(300, generator=generator, dtype=dtype) / 3
    expected = sigma - torch.outer(t, t)
    got = sigma.clone()
    Downdate(t).commit(got, torch.tensor(True))
    assert Downdate.ROWS < 300 and 300 % Downdate.ROWS != 0
    assert torch.equal(got, expected) and torch.equal(got, got.T)
    kept = sigma.clone()
    Downdate(torch.full_like(t, float("nan"))).commit(kept, torch.tensor(False))
    assert torch.equal(kept, sigma)
