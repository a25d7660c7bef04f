"""A new filter family and a new time update through the seams they plug into, without other changes.

The other extension points have their toys beside their families: a new observation and a new R estimator in
test_observation.py, a new backbone family in test_factory.py, a new data source in test_data.py.
"""

import copy

import pytest
import torch
from loko_helpers import flat, mlp, teacher_stream

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.kalman.filters import Filter, Proposal
from loko_lightning.kalman.filters.information import categorical_rows
from loko_lightning.kalman.groups import group_time_updates
from loko_lightning.kalman.time_update import TimeUpdate


class FixedGain(Filter):
    """A toy filter: the belief's variances never change and the mean moves by ``p̂ ⊙ J_zᵀ e`` (plain SGD with a
    per-parameter step ``p̂``): one module's worth of code through the same interface as the real families."""

    name = "fixed_gain"

    def observation_for(self, observation):
        return categorical_rows(observation, "empirical", type(self))  # one row: the gradient of the label

    def r_estimators(self, observation):
        return ("softmax",)

    def propose(self, plan, evidence, belief, reduce=None):
        prior = plan.time.prior(belief.cov)
        rows = plan.rows_matrix(evidence.blocks)
        torch.mul(rows.sum(0), prior, out=plan.update)
        posterior = plan.work.copy_(prior)
        innovation = evidence.target.to(plan.dtype) - evidence.prediction.to(plan.dtype)
        return Proposal(posterior=posterior, finite=torch.isfinite(innovation).all(), innovation=innovation)


def test_a_new_filter_family_trains_through_loko_like_its_definition():
    """The toy through LoKO and the Jacobian engine equals SGD with step p0 on the cross-entropy, computed by hand."""
    model = mlp()
    twin = copy.deepcopy(model)
    opt = LoKO(model.parameters(), p0=0.05, p0_init="constant", filter=FixedGain())
    assert opt.defaults["filter"] == {"name": "fixed_gain"}
    engine = JacobianEngine(model, observation=opt.observation)
    for x, y in teacher_stream(12):
        label = y.argmax()[None]
        opt.step(lambda x=x, label=label: engine.observe(x, label))
        loss = torch.nn.functional.cross_entropy(twin(x), label)
        grads = torch.autograd.grad(loss, list(twin.parameters()))
        with torch.no_grad():
            for param, grad in zip(twin.parameters(), grads, strict=True):
                param.sub_(0.05 * grad)
    # float64: the engine's reverse row and autograd's gradient are the same sums in another order.
    torch.testing.assert_close(flat(model.parameters()), flat(twin.parameters()), rtol=1e-12, atol=1e-14)
    assert int(opt.diagnostics["step"]) == 12 and int(opt.diagnostics["skipped"]) == 0
    assert all(torch.equal(opt.state[p]["cov"], torch.full_like(p, 0.05)) for p in model.parameters())


def test_a_new_filter_family_gets_the_time_update_and_the_skip_for_free():
    """The optimizer's pipeline, not the filter, applies the process noise (through plan.time), shrinkage and the
    skip of a non-finite step."""
    model = mlp()
    opt = LoKO(
        model.parameters(),
        p0=0.05,
        p0_init="constant",
        filter=FixedGain(),
        time_update={"process_noise": 0.01, "shrinkage": 0.1},
    )
    engine = JacobianEngine(model, observation=opt.observation)
    x, y = next(teacher_stream(1))
    before = [p.detach().clone() for p in model.parameters()]
    prediction, target, jacobians = engine.observe(x, y.argmax()[None])
    opt.step(lambda: (prediction, target, jacobians))
    for param, old, jac in zip(model.parameters(), before, jacobians, strict=True):
        # θ ← (1 − λ)(θ + (p0 + q) d): the shrinkage scales the updated parameters (float64, a few roundings).
        torch.testing.assert_close(param.detach(), 0.9 * (old + 0.06 * jac[0]), rtol=1e-13, atol=1e-15)
        assert torch.equal(opt.state[param]["cov"], torch.full_like(param, 0.05) + 0.01)  # the prior, kept
    bad = [j.clone() for j in jacobians]
    bad[0].view(-1)[0] = float("nan")
    state = [p.detach().clone() for p in model.parameters()]
    opt.step(lambda: (prediction, target, bad))
    assert not bool(opt.diagnostics["applied"])
    assert all(torch.equal(a, b) for a, b in zip(state, model.parameters(), strict=True))


def test_the_time_update_is_built_from_each_param_group():
    """One TimeUpdate per parameter from its group's settings; the reference variance only where forgetting is on."""
    model = mlp()
    head = list(model[2].parameters())
    groups = [{"params": list(model[0].parameters())}, {"params": head, "forgetting": 0.01, "p0": 0.5}]
    opt = LoKO(groups, p0=0.2, p0_init="fan_in", time_update={"process_noise": 1e-3})
    updates = group_time_updates(opt.param_groups, range(4))
    assert updates[0] == TimeUpdate(process_noise=1e-3) and updates[1] == updates[0]
    assert updates[2] == TimeUpdate(process_noise=1e-3, forgetting=0.01, reference=0.5 / 7)  # fan_in of the weight
    assert updates[3].reference == 0.5  # a bias: fan_in 1
    assert set(TimeUpdate.group_keys()) <= set(opt.defaults)


class AccumulatedGain(Filter):
    """A toy *stateful* family: a per-entry buffer ``info`` (the running sum of the squared gradient of the label's
    log-probability) that the filter declares, and the step ``p̂ ⊙ d / (1 + p̂ ⊙ info)`` (AdaGrad-like). It touches no
    package file: the optimizer creates, flattens, saves, loads and checks the buffer because the family declares it."""

    name = "accumulated_gain"

    def observation_for(self, observation):
        return categorical_rows(observation, "empirical", type(self))

    def r_estimators(self, observation):
        return ("softmax",)

    def entries(self):
        return {"info": 0}

    def propose(self, plan, evidence, belief, reduce=None):
        prior = plan.time.prior(belief.cov)
        direction = plan.rows_matrix(evidence.blocks).sum(0)
        info = belief.entries["info"] + direction.square()
        torch.div(prior * direction, 1 + prior * info, out=plan.update)
        innovation = evidence.target.to(plan.dtype) - evidence.prediction.to(plan.dtype)
        finite = torch.isfinite(innovation).all() & torch.isfinite(info).all()
        return Proposal(plan.work.copy_(prior), finite, innovation, entries={"info": info})


def _by_hand(model, stream, p0):
    """AccumulatedGain written out: autograd's gradient and one buffer per parameter."""
    info = [torch.zeros_like(p) for p in model.parameters()]
    for x, y in stream:
        loss = torch.nn.functional.cross_entropy(model(x), y.argmax()[None])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for param, grad, acc in zip(model.parameters(), grads, info, strict=True):
                acc.add_(grad.square())
                param.sub_(p0 * grad / (1 + p0 * acc))
    return info


def test_a_new_stateful_filter_family_gets_its_state_kept_saved_and_checked():
    """Through LoKO: the same run as by hand (float64: the same sums in another order), the buffer in the state dict;
    a resume from the state dict continues bit for bit; a skipped step leaves the buffer alone; a saved buffer of
    another shape is refused, naming the parameter."""
    model, twin, resumed_model = mlp(), mlp(), mlp()
    stream = list(teacher_stream(10))
    opt = LoKO(model.parameters(), p0=0.05, p0_init="constant", filter=AccumulatedGain())
    engine = JacobianEngine(model, observation=opt.observation)
    for x, y in stream[:5]:
        opt.step(lambda x=x, y=y: engine.observe(x, y.argmax()[None]))
    state = copy.deepcopy(opt.state_dict())
    assert all("info" in entry for entry in state["state"].values())
    resumed_model.load_state_dict(model.state_dict())
    resumed = LoKO(resumed_model.parameters(), p0=0.05, p0_init="constant", filter=AccumulatedGain())
    resumed.load_state_dict(state)
    resumed_engine = JacobianEngine(resumed_model, observation=resumed.observation)
    for x, y in stream[5:]:
        opt.step(lambda x=x, y=y: engine.observe(x, y.argmax()[None]))
        resumed.step(lambda x=x, y=y: resumed_engine.observe(x, y.argmax()[None]))
    info = _by_hand(twin, stream, 0.05)
    torch.testing.assert_close(flat(model.parameters()), flat(twin.parameters()), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(flat(opt.state[p]["info"] for p in model.parameters()), flat(info), rtol=1e-12, atol=0)
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["info"], resumed.state[q]["info"])
    # A skipped step: nothing moves, the buffer included.
    buffers = [opt.state[p]["info"].clone() for p in model.parameters()]
    prediction, target, jacobians = engine.observe(*stream[0][:1], stream[0][1].argmax()[None])
    opt.step(lambda: (prediction * float("nan"), target, jacobians))
    assert not bool(opt.diagnostics["applied"])
    assert all(torch.equal(opt.state[p]["info"], b) for p, b in zip(model.parameters(), buffers, strict=True))
    # Another model's buffer is refused.
    state["state"][0]["info"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"parameter 0's 'info' \(accumulated_gain\) has shape \(3,\)"):
        LoKO(mlp().parameters(), filter=AccumulatedGain()).load_state_dict(state)
