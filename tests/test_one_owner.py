"""Every setting has one owner: the filter its settings, the param groups the prior and the time update; a resumed or
served optimizer is rebuilt from what the state dict saved and runs exactly what was fitted."""

import copy

import pytest
import torch
from loko_helpers import mlp, teacher_stream

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters import FILTER_SETTINGS, Covariance
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
    opt = LoKO(model.parameters(), p0=0.3, seed=3, filter=filter_, time_update=time_update)
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
        fitted_opt = LoKO(fitted.parameters(), p0=0.3, seed=3, filter=filter_, time_update=time_update)
        fitted_opt.load_state_dict(copy.deepcopy(state))
        _run(fitted, fitted_opt, stream[3:])
        _run(twin, rebuilt, stream[3:])
        assert all(torch.equal(p, q) for p, q in zip(fitted.parameters(), twin.parameters(), strict=True))


def test_a_filter_instance_owns_its_settings():
    """Covariance(beta=0.9) runs and records beta 0.9 (the param groups once recorded LoKO's default 0.95 beside it);
    a config with settings builds the same filter; a group holding a filter setting is refused."""
    opt = LoKO(mlp().parameters(), filter=Covariance(beta=0.9))
    assert opt.filter.beta == 0.9 and opt.param_groups[0]["filter"]["beta"] == 0.9
    assert "beta" not in opt.param_groups[0] and LoKO.arguments(opt.state_dict())["filter"]["beta"] == 0.9
    assert LoKO(mlp().parameters(), filter={"name": "covariance", "beta": 0.9, "rcond": 1e-6}).filter == Covariance(
        beta=0.9, rcond=1e-6
    )
    with pytest.raises(ValueError, match="describe the single filter"):
        LoKO([{"params": mlp().parameters(), "beta": 0.9}])


@pytest.mark.parametrize(
    ("keyword", "owner"),
    [(key, "filter") for key in FILTER_SETTINGS] + [(k, "time_update") for k in TimeUpdate.group_keys()],
)
def test_a_setting_given_to_loko_instead_of_its_owner_is_refused_saying_where_it_goes(keyword, owner):
    """LoKO's keywords of before (beta=..., process_noise=...): refused naming the setting and the argument that takes
    it, and that argument given as the message says builds the optimizer."""
    with pytest.raises(ConfigError, match=f"Invalid {keyword}: a setting of the {owner.replace('_', ' ')}") as info:
        LoKO(mlp().parameters(), **{keyword: 0.5})
    assert info.value.field == keyword and f"{owner}=" in str(info.value)
    value = {"name": "covariance", keyword: 0.5} if owner == "filter" else {keyword: 0.5}
    if keyword == "r_estimator":
        value[keyword] = "residual"
    built = LoKO(mlp().parameters(), **{owner: value})
    assert built.param_groups[0]["filter" if owner == "filter" else keyword] == (
        built.filter.config() if owner == "filter" else 0.5
    )


def test_an_invalid_filter_setting_or_time_update_field_is_refused_naming_it():
    """The filter checks its own settings; the time update refuses a field it does not have."""
    with pytest.raises(ConfigError, match="Invalid beta") as info:
        LoKO(mlp().parameters(), filter={"name": "covariance", "beta": 1.5})
    assert (info.value.field, info.value.owner) == ("filter", LoKO)  # the argument to fix: --model.optimizer.filter
    with pytest.raises(ConfigError, match="Invalid beta") as info:
        Covariance(beta=0)
    assert (info.value.field, info.value.owner) == ("beta", Covariance)
    with pytest.raises(ConfigError, match="no field 'noise'") as info:
        LoKO(mlp().parameters(), time_update={"noise": 0.1})
    assert info.value.field == "time_update"
    with pytest.raises(ConfigError, match="Invalid p_floor") as info:
        LoKO(mlp().parameters(), time_update={"p_floor": -1.0})
    assert info.value.field == "p_floor"


def test_a_state_of_another_filter_is_refused():
    """Loading a state written by another filter (its settings included) would run another filter than the one
    fitted: refused, naming the filter."""
    model = mlp()
    opt = LoKO(model.parameters(), seed=3, filter={"name": "covariance", "beta": 0.9})
    _run(model, opt, list(teacher_stream(2)))
    with pytest.raises(ConfigError, match="it was written by filter") as info:
        LoKO(mlp().parameters(), seed=3).load_state_dict(opt.state_dict())
    assert info.value.field == "filter"


def test_a_checkpoint_of_before_the_filter_owned_its_settings_rebuilds_its_filter():
    """Old state dicts hold beta, r_estimator and rcond in the groups and the filter's name: rebuilt as that filter."""
    model = mlp()
    opt = LoKO(model.parameters(), seed=3, filter={"name": "covariance", "beta": 0.9})
    _run(model, opt, list(teacher_stream(2)))
    state = copy.deepcopy(opt.state_dict())
    for group in state["param_groups"]:
        group.update(filter="covariance", beta=0.9, r_estimator="taylor", rcond=None)
    rebuilt = LoKO(mlp().parameters(), **LoKO.arguments(state))
    rebuilt.load_state_dict(state)
    assert rebuilt.filter == Covariance(beta=0.9) and "beta" not in rebuilt.param_groups[0]
    assert rebuilt.param_groups[0]["filter"] == Covariance(beta=0.9).config()


def test_a_learner_checkpoint_of_before_rebuilds_its_optimizer():
    """A checkpoint's optimizer config of before (LoKO's beta and process_noise keywords): rebuilt as today's."""
    from loko_lightning.learner.checks import optimizer_from_config

    saved = {
        "class_path": "loko_lightning.kalman.optimizer.LoKO",
        "init_args": {"p0": 0.1, "beta": 0.9, "process_noise": 1e-4},
    }
    opt = optimizer_from_config(saved)(mlp().parameters())
    assert opt.filter == Covariance(beta=0.9) and opt.param_groups[0]["process_noise"] == 1e-4
