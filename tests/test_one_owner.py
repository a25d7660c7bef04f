"""Every setting has one owner: the filter its settings, the param groups the prior and the time update; a resumed or
served optimizer is rebuilt from what the state dict saved and runs exactly what was fitted."""

import copy

import pytest
import torch
from loko_helpers import mlp, teacher_stream

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters import Covariance
from loko_lightning.kalman.time_update import TimeUpdate
from loko_lightning.serve.learner import _saved_loko

# Every family, by name and as an instance with settings that are not its defaults.
FILTERS = [Covariance(beta=0.9, r_estimator="residual", rcond=1e-6), "covariance"]
FILTERS += [f"natural{fisher}" for fisher in ("", "_exact", "_sampled")]
FILTERS += [f"lofi3{fisher}" for fisher in ("", "_empirical", "_sampled")]
# Each time update alone, at a value that is not its default (TimeUpdate's fields, so a new one is covered).
TIME_UPDATES = [{}] + [{key: 0.01} for key in TimeUpdate.group_keys()]


def _run(model, opt, stream):
    engine = JacobianEngine(model, observation=opt.observation)
    for x, y in stream:
        opt.step(lambda x=x, y=y: engine.observe(x, y.argmax()[None]))


@pytest.mark.parametrize("time_update", TIME_UPDATES, ids=lambda t: next(iter(t), "none"))
@pytest.mark.parametrize(
    "filter_", FILTERS, ids=lambda f: getattr(f, "spec", f) + ("*" if not isinstance(f, str) else "")
)
def test_a_resumed_and_a_served_optimizer_run_the_fitted_filter(filter_, time_update):
    """Fitted 3 steps, saved; rebuilt from the state dict alone (LoKO.arguments, as loko serve does): the same config
    (the filter with its settings, the groups' prior and time update), and 3 more steps equal bit for bit."""
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.3, seed=3, filter=filter_, **time_update)
    stream = list(teacher_stream(6))
    _run(model, opt, stream[:3])
    state = copy.deepcopy(opt.state_dict())
    for build in (lambda params: LoKO(params, **LoKO.arguments(state)), _saved_loko(state)):
        twin = copy.deepcopy(model)
        rebuilt = build(list(twin.parameters()))
        rebuilt.load_state_dict(copy.deepcopy(state))
        assert rebuilt.config() == opt.config()
        assert rebuilt.filter == opt.filter and type(rebuilt.filter) is type(opt.filter)
        fitted = copy.deepcopy(model)
        fitted_opt = LoKO(fitted.parameters(), p0=0.3, seed=3, filter=filter_, **time_update)
        fitted_opt.load_state_dict(copy.deepcopy(state))
        _run(fitted, fitted_opt, stream[3:])
        _run(twin, rebuilt, stream[3:])
        assert all(torch.equal(p, q) for p, q in zip(fitted.parameters(), twin.parameters(), strict=True))


def test_a_filter_instance_owns_its_settings():
    """Covariance(beta=0.9) runs and records beta 0.9 (the param groups once recorded LoKO's default 0.95 beside it);
    the same setting given to LoKO as well, with another value, is refused naming it."""
    opt = LoKO(mlp().parameters(), filter=Covariance(beta=0.9))
    assert opt.filter.beta == 0.9 and opt.param_groups[0]["filter"]["beta"] == 0.9
    assert "beta" not in opt.param_groups[0] and LoKO.arguments(opt.state_dict())["filter"]["beta"] == 0.9
    assert LoKO(mlp().parameters(), filter=Covariance(beta=0.9), beta=0.9).filter.beta == 0.9  # no conflict
    with pytest.raises(ConfigError, match="a setting has one owner") as info:
        LoKO(mlp().parameters(), filter=Covariance(beta=0.9), beta=0.95)
    assert info.value.field == "beta"
    assert LoKO(mlp().parameters(), beta=0.9, rcond=1e-6).filter == Covariance(beta=0.9, rcond=1e-6)
    with pytest.raises(ValueError, match="describe the single filter"):
        LoKO([{"params": mlp().parameters(), "beta": 0.9}])


def test_a_state_of_another_filter_is_refused():
    """Loading a state written by another filter (its settings included) would run another filter than the one
    fitted: refused, naming the filter."""
    model = mlp()
    opt = LoKO(model.parameters(), seed=3, beta=0.9)
    _run(model, opt, list(teacher_stream(2)))
    with pytest.raises(ConfigError, match="it was written by filter") as info:
        LoKO(mlp().parameters(), seed=3).load_state_dict(opt.state_dict())
    assert info.value.field == "filter"


def test_a_checkpoint_of_before_the_filter_owned_its_settings_rebuilds_its_filter():
    """Old state dicts hold beta, r_estimator and rcond in the groups and the filter's name: rebuilt as that filter."""
    model = mlp()
    opt = LoKO(model.parameters(), seed=3, beta=0.9)
    _run(model, opt, list(teacher_stream(2)))
    state = copy.deepcopy(opt.state_dict())
    for group in state["param_groups"]:
        group.update(filter="covariance", beta=0.9, r_estimator="taylor", rcond=None)
    rebuilt = LoKO(mlp().parameters(), **LoKO.arguments(state))
    rebuilt.load_state_dict(state)
    assert rebuilt.filter == Covariance(beta=0.9) and "beta" not in rebuilt.param_groups[0]
    assert rebuilt.param_groups[0]["filter"] == Covariance(beta=0.9).config()
