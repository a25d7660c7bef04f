"""The time update beyond Algorithm 1's identity: a shrinkage process model θ̃ ← (1 − λ)θ̃, P kept (the Kalman form of
decoupled weight decay), covariance inflation P ← (1 + α)P and stabilised forgetting P⁻¹ ← (1 − γ)P⁻¹ + γ/p_ref, each
against the float64 reference, each reducing to the paper's update when its parameter is 0, and every bad value
refused naming the field."""

import copy

import pytest
import torch
from loko_helpers import DenseModelFilter, flat, flat_cov, loko_closure, mlp, teacher_stream
from test_information_filter import _run as natural_run
from test_low_rank_filter import _run as lofi_run

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.reference import loko_step_reference, time_update_reference
from loko_lightning.kalman.time_update import CompiledTimeUpdate, TimeUpdate


@pytest.mark.parametrize(
    ("shrinkage", "inflation", "forgetting"),
    [(0.02, 0.0, 0.0), (0.0, 0.05, 0.0), (0.02, 0.05, 0.0), (0.0, 0.0, 0.05), (0.02, 0.05, 0.05)],
    ids=["shrink", "inflate", "both", "forget", "all"],
)
def test_time_update_matches_the_float64_reference(shrinkage, inflation, forgetting):
    model = mlp()
    opt = LoKO(
        model.parameters(),
        p0=0.3,
        seed=3,
        filter={"name": "covariance", "beta": 0.9},
        time_update={"shrinkage": shrinkage, "inflation": inflation, "forgetting": forgetting},
    )
    reference = DenseModelFilter(
        copy.deepcopy(model), flat_cov(opt, model.parameters()), beta=0.9, r_estimator="taylor", shrinkage=shrinkage,
        inflation=inflation, forgetting=forgetting, reference=0.3,
    )  # fmt: skip
    plain = DenseModelFilter(copy.deepcopy(model), flat_cov(opt, model.parameters()), beta=0.9, r_estimator="taylor")
    for x, y in teacher_stream(60):
        y_ref = reference.step(x, y)
        plain.step(x, y)
        y_fast, _, _ = opt.step(loko_closure(model, x, y, factorize=True))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    # float64 on both sides, the same arithmetic in another order (as test_covariance_filter's reference tests).
    torch.testing.assert_close(flat(model.parameters()).detach(), reference.theta, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(flat_cov(opt, model.parameters()), reference.p, rtol=1e-9, atol=1e-15)
    assert not torch.allclose(reference.theta, plain.theta, rtol=1e-6, atol=0)  # the option changed the run


def test_a_shrinkage_per_group_shrinks_only_that_group():
    model = mlp()
    head = list(model[2].parameters())
    groups = [{"params": list(model[0].parameters())}, {"params": head, "shrinkage": 0.05}]
    opt = LoKO(groups, p0=0.3, seed=3, filter={"name": "covariance", "beta": 0.9})
    sizes = [sum(p.numel() for p in model[0].parameters()), sum(p.numel() for p in head)]
    lam = torch.cat([torch.zeros(sizes[0], dtype=torch.float64), torch.full((sizes[1],), 0.05, dtype=torch.float64)])
    _matches_the_reference_per_entry(model, opt, shrinkage=lam)


def _matches_the_reference_per_entry(model, opt, **options):
    """30 steps of ``opt`` against the dense float64 filter with per-entry time-update ``options``, then compared
    (float64 on both sides, the same arithmetic in another order)."""
    reference = DenseModelFilter(
        copy.deepcopy(model), flat_cov(opt, model.parameters()), beta=0.9, r_estimator="taylor", **options
    )
    for x, y in teacher_stream(30):
        reference.step(x, y)
        opt.step(loko_closure(model, x, y, factorize=True))
    torch.testing.assert_close(flat(model.parameters()).detach(), reference.theta, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(flat_cov(opt, model.parameters()), reference.p, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("fisher", ["empirical", "exact"])
def test_time_update_in_the_information_form_matches_the_reference(fisher):
    natural_run(mlp(), teacher_stream(30), fisher, factorize=False, shrinkage=0.02, inflation=0.05)
    natural_run(mlp(), teacher_stream(30), fisher, factorize=False, forgetting=0.05, process_noise=1e-3)


def test_forgetting_per_group_uses_each_parameters_reference_variance():
    """With p0_init fan_in the reference variance is each parameter's p0 / fan_in; a group without forgetting keeps
    its p̂ as the paper's update leaves it."""
    model = mlp()
    first, head = list(model[0].parameters()), list(model[2].parameters())
    groups = [{"params": first}, {"params": head, "forgetting": 0.1}]
    opt = LoKO(groups, p0=0.3, p0_init="fan_in", filter={"name": "covariance", "beta": 0.9})
    fan_in = [p.shape[1:].numel() if p.dim() > 1 else 1 for p in model.parameters()]
    gamma = torch.cat([torch.full((p.numel(),), 0.1 if i >= len(first) else 0.0, dtype=torch.float64)
                       for i, p in enumerate(model.parameters())])  # fmt: skip
    pairs = zip(model.parameters(), fan_in, strict=True)
    ref = torch.cat([torch.full((p.numel(),), 0.3 / f, dtype=torch.float64) for p, f in pairs])
    _matches_the_reference_per_entry(model, opt, forgetting=gamma, reference=ref)


def test_forgetting_keeps_p_below_its_reference_where_inflation_does_not():
    """The precision is mixed with 1/p0 every step, so p̂ ≤ p0 whatever the data (p̂₀ ≤ p0, no process noise); inflation
    at the same rate lets the p̂ of parameters the data do not inform grow without bound (the head's bias of an unused
    class gets no information from a stream of other labels)."""
    stream = [(x, torch.nn.functional.one_hot(torch.tensor(0), 4).double()) for x, _ in teacher_stream(300)]
    for option, bounded in (("forgetting", True), ("inflation", False)):
        model = mlp()
        opt = LoKO(model.parameters(), p0=0.3, seed=1, filter="natural", time_update={option: 0.02})
        engine = JacobianEngine(model, observation=opt.observation)
        for x, y in stream:
            opt.step(lambda x=x, y=y, engine=engine: engine.observe(x, y.argmax()[None]))
        largest = float(flat_cov(opt, model.parameters()).max())
        assert (largest <= 0.3) == bounded, (option, largest)


def test_the_reference_forgetting_mixes_the_precisions():
    theta, p = torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([0.5, 0.1], dtype=torch.float64)
    new_theta, new_p = time_update_reference(theta, p, TimeUpdate(forgetting=0.25, reference=2.0))
    assert torch.equal(new_theta, theta)
    torch.testing.assert_close(new_p, 1 / (0.75 / p + 0.25 / 2.0), rtol=1e-15, atol=0)  # the same two float64 ops


def test_zero_shrinkage_inflation_and_forgetting_are_the_papers_update_bit_for_bit():
    model, twin = mlp(), mlp()
    plain = LoKO(model.parameters(), p0=0.3, seed=1)
    zero = LoKO(twin.parameters(), p0=0.3, seed=1, time_update={"shrinkage": 0.0, "inflation": 0.0, "forgetting": 0.0})
    for x, y in teacher_stream(20):
        plain.step(loko_closure(model, x, y, factorize=True))
        zero.step(loko_closure(twin, x, y, factorize=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    assert torch.equal(flat_cov(plain, model.parameters()), flat_cov(zero, twin.parameters()))
    theta, p = torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64)
    assert all(
        torch.equal(a, b) for a, b in zip(time_update_reference(theta, p, TimeUpdate()), (theta, p), strict=True)
    )


def test_a_skipped_step_applies_no_time_update():
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.3, seed=1, time_update={"shrinkage": 0.1, "inflation": 0.1, "forgetting": 0.1})
    x, y = next(teacher_stream(1))
    opt.step(loko_closure(model, x, y))
    before = [p.clone() for p in model.parameters()], flat_cov(opt, model.parameters())
    opt.step(loko_closure(model, torch.full_like(x, float("nan")), y))
    assert not bool(opt.diagnostics["applied"])
    assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters(), strict=True))
    assert torch.equal(before[1], flat_cov(opt, model.parameters()))


def test_the_reference_time_update_is_the_process_model():
    theta, p = torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([0.5, 0.1], dtype=torch.float64)
    new_theta, new_p = time_update_reference(theta, p, TimeUpdate(shrinkage=0.1, inflation=0.5))
    torch.testing.assert_close(new_theta, 0.9 * theta, rtol=0, atol=0)
    torch.testing.assert_close(new_p, 1.5 * p, rtol=0, atol=0)
    assert loko_step_reference.__kwdefaults__["time_update"] is None  # the identity model: nothing changes
    assert all(getattr(TimeUpdate(), key) == 0.0 for key in TimeUpdate.group_keys())


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"shrinkage": 1.0}, "shrinkage"),
        ({"shrinkage": -0.1}, "shrinkage"),
        ({"shrinkage": "0.01"}, "shrinkage"),
        ({"shrinkage": True}, "shrinkage"),
        ({"inflation": -1e-3}, "inflation"),
        ({"inflation": float("inf")}, "inflation"),
        ({"inflation": None}, "inflation"),
        ({"forgetting": 1.0}, "forgetting"),
        ({"forgetting": -1e-3}, "forgetting"),
        ({"forgetting": "1e-3"}, "forgetting"),
        ({"forgetting": False}, "forgetting"),
        ({"forgetting": float("nan")}, "forgetting"),
    ],
)
def test_bad_time_update_values_are_refused_naming_the_field(arguments, field):
    with pytest.raises(ConfigError, match=f"Invalid {field}") as err:
        LoKO(mlp().parameters(), p0=0.1, time_update=arguments)
    assert err.value.field == field


TIME_UPDATES = {
    "alone": {},
    "process noise": {"process_noise": 1e-3},
    "shrinkage": {"shrinkage": 0.02},
    "inflation": {"inflation": 0.05},
    "forgetting": {"forgetting": 0.05},
    "inflation and forgetting": {"inflation": 0.05, "forgetting": 0.05},
}


@pytest.mark.parametrize("form", ["covariance", "natural", "natural_exact", "lofi2", "lofi2_empirical"])
@pytest.mark.parametrize("option", TIME_UPDATES)
def test_the_floor_with_each_time_update_in_each_form_matches_the_reference(form, option, monkeypatch):
    """``p_floor`` where it binds, beside each time update, in every filter: the fast path against the float64
    reference after every step (the helpers assert it), in the order the docs give (the time update, then the
    floor; the information form also floors the posterior its mean reads)."""
    cuts = []
    floored = CompiledTimeUpdate.floored

    def counting(self, posterior):  # how many entries the floor raised
        cuts.append(0 if self.floor is None else int((posterior < self.floor).sum()))
        return floored(self, posterior)

    monkeypatch.setattr(CompiledTimeUpdate, "floored", counting)
    options = {"p_floor": 0.12, **TIME_UPDATES[option]}
    if form == "covariance":
        model = mlp()
        opt = LoKO(model.parameters(), p0=0.5, seed=3, time_update=options, filter={"name": "covariance", "beta": 0.9})
        reference = DenseModelFilter(copy.deepcopy(model), flat_cov(opt, model.parameters()), beta=0.9,
                                     r_estimator="taylor", reference=0.5, **options)  # fmt: skip
        for x, y in teacher_stream(40):
            y_ref = reference.step(x, y)
            y_fast, _, _ = opt.step(loko_closure(model, x, y, factorize=True))
            torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
        # float64 on both sides, the same arithmetic in another order (as test_covariance_filter's reference tests).
        torch.testing.assert_close(flat(model.parameters()).detach(), reference.theta, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(flat_cov(opt, model.parameters()), reference.p, rtol=1e-9, atol=1e-15)
    elif form.startswith("natural"):
        fisher = "exact" if form == "natural_exact" else "empirical"
        opt = natural_run(mlp(), teacher_stream(30), fisher, factorize=False, **options)
    else:
        fisher = "empirical" if form.endswith("_empirical") else "exact"
        opt = lofi_run(mlp(), teacher_stream(24), 2, factorize=False, fisher=fisher, **options)
    cov = flat_cov(opt, opt.param_groups[0]["params"])
    assert sum(cuts) > 0 and (cov > 0.12).any(), "the floor must bind for some entries and not for others"
