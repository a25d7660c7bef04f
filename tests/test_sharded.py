"""The sharded joint update (``LoKO(shard=True)``) under real torch.distributed (gloo, 2 and 3 processes on loopback):
beside the replicated update on the same interleaved stream, in the same processes, in float64."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from loko_helpers import SmallConvNet, conv_stream
from test_ddp import free_port, ragged_blocks

from loko_lightning import JacobianEngine, LoKO, jacobian
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.distributed import all_gather_observations, reset_traffic, traffic
from loko_lightning.kalman.sharded import ShardPlan, exchange_shards

# Each test starts 2 or 3 processes (each imports torch): about ten seconds each.
pytestmark = pytest.mark.slow

STEPS = 12
# (name, LoKO arguments, factorized Jacobians): the paper's filter on every block kind and on dense blocks only (the
# dense matrix assembled from the received segments), with a per-group time update, and the natural-gradient filter.
CASES = (
    ("paper", {}, True),
    ("dense", {}, False),
    ("time", {}, True),
    ("topk1", {"observation": "topk1"}, True),
    ("natural", {"filter": "natural", "p0": 0.05}, True),
    ("natural_exact", {"filter": "natural_exact", "p0": 0.05}, True),
)
# Per case, the time update of the two param groups (not the paper; the paper's cases have a small one too).
TIME = {
    "time": ({"inflation": 1e-3, "p_floor": 1e-4}, {"forgetting": 1e-3}),
    "natural": ({}, {}),
    "natural_exact": ({"forgetting": 1e-3}, {"shrinkage": 1e-3}),
}
POISON = 5  # the step at which the last rank's input is NaN: the joint step is skipped everywhere


def batch_at(items, world, rank, step):
    """Rank ``rank``'s samples of step ``step``: 2 each (positions interleaved by rank), 1 each at the last step but
    the first rank, which keeps 2 (the stream's short last step: unequal counts)."""
    per = 2
    start = step * world * per + rank * per
    count = per if step < STEPS - 1 or rank == 0 else 1
    xs, ys = zip(*items[start : start + count], strict=True)
    x = torch.cat(xs)
    if step == POISON and rank == world - 1:
        x = x.clone()
        x.view(-1)[0] = math.nan
    return x, torch.stack(ys).argmax(-1)


def build(name):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    first, second = TIME.get(name, ({"process_noise": 1e-4}, {"shrinkage": 1e-3}))  # differ between the groups
    groups = [
        {"params": [model.conv1.weight, model.conv1.bias, model.conv2.weight], **first},
        {"params": [p for n, p in model.named_parameters() if not n.startswith(("conv1", "conv2"))], **second},
    ]
    return model, groups


def flat(model, covs, R):
    params = list(model.parameters())
    return torch.cat([*(p.detach().reshape(-1) for p in params), *(c.reshape(-1) for c in covs), R.reshape(-1)])


def worker(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        items = list(conv_stream(world * 2 * STEPS))
        results = {}
        for name, arguments, factorize in CASES:
            model, groups = build(name)
            sharded_model = copy.deepcopy(model)
            sharded_groups = [
                {**g, "params": [dict(sharded_model.named_parameters())[n] for n in names(model, g["params"])]}
                for g in groups
            ]
            replicated = LoKO(groups, seed=1, **{"p0": 0.2, **arguments})
            sharded = LoKO(sharded_groups, seed=1, shard=True, collective_timeout=60, **{"p0": 0.2, **arguments})
            conds, bytes_replicated, bytes_sharded = [], 0, 0
            with (
                JacobianEngine(model, observation=replicated.observation, factorize=factorize) as engine,
                JacobianEngine(sharded_model, observation=sharded.observation, factorize=factorize) as sharded_engine,
            ):
                for step in range(STEPS):
                    x, label = batch_at(items, world, rank, step)
                    reset_traffic()
                    observation = engine.observe(x, label, batched=True)
                    replicated.step(lambda observation=observation: all_gather_observations(*observation))
                    bytes_replicated += traffic()["received"]
                    if not math.isnan(replicated.diagnostics["cond"].item()):
                        conds.append(replicated.diagnostics["cond"].item())
                    reset_traffic()
                    observation = sharded_engine.observe(x, label, batched=True)
                    prediction, target, _ = sharded.step(lambda observation=observation: observation)
                    bytes_sharded += traffic()["received"]
                    if step == STEPS - 1:
                        assert prediction.shape[0] == 2 * world - (world - 1)  # every process's samples
            sharded.consolidate_state_dict()
            state = sharded.state_dict()["state"]
            params = list(model.parameters())
            sharded_covs = [state[i]["cov"] for i in range(len(params))]
            mine = flat(sharded_model, sharded_covs, state[0]["R"])
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            reference = flat(model, [replicated.state[p]["cov"] for p in params], replicated.state[params[0]]["R"])
            start = torch.cat([p.detach().reshape(-1) for p in build(name)[0].parameters()])
            # The optimizer's own state is untouched by state_dict(): p̂ of its own parameters only, still views.
            owned = {i for i, owner in enumerate(sharded.exchange.shards.owners) if owner == rank}
            live = [i for i, p in enumerate(sharded_model.parameters()) if "cov" in sharded.state[p]]
            assert set(live) == owned, (live, owned)
            results[name] = {
                "sharded": gathered,
                "replicated": reference,
                "start": start,
                "n": start.numel(),
                "cond": max(conds, default=1.0),
                "steps": (int(state[0]["step"]), int(state[0]["skipped"])),
                "replicated_steps": (int(replicated.diagnostics["step"]), int(replicated.diagnostics["skipped"])),
                "p_mean": (sharded.diagnostics["p_mean"].item(), replicated.diagnostics["p_mean"].item()),
                "bytes": (bytes_replicated, bytes_sharded),
                "owners": sharded.exchange.shards.owners,
            }
            # The whole state once more (consolidate_state_dict is a collective), to resume in one process.
            sharded.consolidate_state_dict()
            results[name]["resume"] = {
                "sharded": (sharded.state_dict(), copy.deepcopy(sharded_model.state_dict())),
                "replicated": (replicated.state_dict(), copy.deepcopy(model.state_dict())),
            }
        # Text padded to different lengths on different processes: the shard's blocks are those of the gather.
        prediction, target, jacobians = ragged_blocks(rank % 2)
        shards = ShardPlan.balance([1, 1, 1], world)
        got = exchange_shards(prediction, target, jacobians, shards)
        expected = all_gather_observations(prediction, target, jacobians)
        mine = shards.mine(rank)
        dense = [j.to_dense() if hasattr(j, "to_dense") else j for j in got[2]]
        wanted = [expected[2][i] for i in mine]
        wanted = [j.to_dense() if hasattr(j, "to_dense") else j for j in wanted]
        results["ragged"] = bool(
            torch.equal(got[0], expected[0])
            and torch.equal(got[1], expected[1])
            and all(torch.equal(a, b) for a, b in zip(dense, wanted, strict=True))
        )
        flags = [None] * world
        dist.all_gather_object(flags, results["ragged"])
        results["ragged"] = flags
        # A closure whose result is wrong on the last process only: every process raises at the same step.
        model = torch.nn.Linear(3, 2).double()
        opt = LoKO(model.parameters(), seed=0, shard=True, collective_timeout=60)
        x, y = torch.randn(1, 3, dtype=torch.float64), torch.tensor([[0.0, 1.0]], dtype=torch.float64)

        def closure():
            prediction, jacobians = jacobian(model, x)
            return prediction[None], y, jacobians[:1] if rank == world - 1 else [j[None] for j in jacobians]

        try:
            opt.step(closure)
            raised = None
        except ValueError as err:
            raised = type(err).__name__ + ": " + str(err)
        messages = [None] * world
        dist.all_gather_object(messages, raised)
        results["invalid"] = messages
        with pytest.raises(ValueError, match="add_param_group after sharded steps"):
            sharded.add_param_group({"params": [torch.zeros(2, dtype=torch.float64, requires_grad=True)]})
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def names(model, params):
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for p in params]


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def sharded_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"sharded{request.param}") / "result.pt"
    world = request.param
    mp.start_processes(worker, args=(world, free_port(), str(out)), nprocs=world, join=True, start_method="spawn")
    return world, torch.load(out)


def test_every_process_ends_with_the_same_parameters_and_filter_state(sharded_run):
    """The new parameter values come from their owner, ``S`` from one all-reduce: after 12 joint steps (one of them
    skipped for a NaN on one process) every process holds the same θ̃, p̂ (gathered) and R, bit for bit."""
    world, results = sharded_run
    for name, _, _ in CASES:
        first, *others = results[name]["sharded"]
        assert all(torch.equal(first, other) for other in others), name
        assert results[name]["steps"] == (STEPS - 1, 1) == results[name]["replicated_steps"], name
        assert len(set(results[name]["owners"])) == world  # every process owns a shard; at W = 3 they are uneven


@pytest.mark.parametrize("name", ["natural", "natural_exact"])
def test_the_natural_gradient_filter_sharded_is_the_replicated_one_bit_for_bit(sharded_run, name):
    """The information-form update has no S: each entry depends on its own columns of H only (one row per sample,
    or m + 1 with the exact Fisher), which the all-to-all delivers unchanged and which are summed over the samples in
    an order that does not depend on where a column sits, so the sharded update is the replicated one bit for bit."""
    _, results = sharded_run
    case = results[name]
    assert torch.equal(case["sharded"][0], case["replicated"])
    assert (case["replicated"][: case["n"]] - case["start"]).abs().max() > 1e-3  # the parameters moved


def test_an_invalid_observation_on_one_process_stops_every_process_at_once(sharded_run):
    """The last process's closure returns one block too few: it raises its own error, the others learn it at the
    first exchange and raise too, instead of waiting for it until the timeout."""
    world, results = sharded_run
    *others, last = results["invalid"]
    assert last.startswith("ValueError: Invalid jacobians: expected 2 (one per parameter), got 1"), last
    assert all(
        m == f"InvalidElsewhere: Invalid observation on process {world - 1}: its closure's result failed the "
        "checks (that process's error says which); every process stops at this step"
        for m in others
    ), others


@pytest.mark.parametrize("name", ["paper", "dense", "time", "topk1"])
def test_the_paper_filter_sharded_equals_the_replicated_one_to_rounding(sharded_run, name):
    """Only the order of the sum ``H P Hᵀ = Σ_shards H_r P_r H_rᵀ`` differs (shard by shard instead of kind by kind).

    Reordering a sum of ``n`` products changes it by at most ``n·eps`` times the sum of their magnitudes, which by
    Cauchy-Schwarz is at most ``‖S‖`` per entry, so ``S`` moves by a relative ``d·n·eps`` in norm (``d`` its size,
    ``W·B·m`` here at most ``2·W·4``); the update, a solve with ``S``, moves by at most ``cond(S)`` times that relative
    to itself; 12 steps compound it. The bound is ``12 · max cond(S) · d · n · eps64`` relative to the parameters'
    total change (and to p̂'s).
    """
    world, results = sharded_run
    case = results[name]
    n, got, want = case["n"], case["sharded"][0], case["replicated"]
    d = 2 * world * 4
    bound = STEPS * case["cond"] * d * n * torch.finfo(torch.float64).eps
    change = (want[:n] - case["start"]).abs().max()
    err_params = (got[:n] - want[:n]).abs().max() / change
    err_cov = ((got[n:] - want[n:]).abs() / want[n:].abs().clamp_min(1e-300)).max()
    print(f"{name} W={world}: relative error θ̃ {err_params:.3g}, p̂/R {err_cov:.3g}, bound {bound:.3g}")
    assert change > 1e-3
    assert err_params < bound and err_cov < bound, (err_params.item(), err_cov.item(), bound)
    p_mean, p_mean_replicated = case["p_mean"]
    assert abs(p_mean - p_mean_replicated) <= bound * p_mean_replicated


def test_a_sharded_process_receives_a_fraction_of_the_replicated_bytes(sharded_run):
    """Per process and step the all-to-all delivers the process's own shard (about 1/W of the blocks) where the
    all-gather delivers all of them; on this tiny model the S all-reduce and the parameters' all-gather add back a
    part, so the saving is checked against the whole, not against 1/W."""
    world, results = sharded_run
    replicated, sharded = results["dense"]["bytes"]
    assert 0 < sharded < replicated, (sharded, replicated)


def test_factored_blocks_with_different_positions_are_exchanged_zero_padded(sharded_run):
    """Texts padded to different lengths on different processes: each owner receives its blocks zero-padded to the
    longest, the same blocks the replicated gather gives, and every process's predictions and targets."""
    _, results = sharded_run
    assert all(results["ragged"])


def test_a_shard_per_process_needs_as_many_parameters_as_processes():
    """Whole tensors are the unit: with fewer tensors than processes one would own nothing, so it is refused by name;
    the largest go first, each to the least-loaded process."""
    with pytest.raises(ConfigError, match="shard=True splits the parameters.*2 parameter tensors for 3 processes"):
        ShardPlan.balance([5, 1], 3)
    assert ShardPlan.balance([1, 8, 3, 3, 2], 2).owners == (0, 0, 1, 1, 1)  # loads 9 and 8


def test_shard_is_refused_for_a_low_rank_precision_and_does_nothing_in_one_process():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match="Invalid shard: filter 'lofi2'"):
        LoKO(model.parameters(), filter="lofi2", shard=True)
    with pytest.raises(ConfigError, match="collective_timeout"):
        LoKO(model.parameters(), shard=True, collective_timeout=0)
    single, sharded = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    sharded.load_state_dict(single.state_dict())
    x, y = torch.randn(1, 3), torch.tensor([0.0, 1.0])
    for model, shard in ((single, False), (sharded, True)):
        opt = LoKO(model.parameters(), seed=0, shard=shard)

        def closure(model=model):
            prediction, jacobians = jacobian(model, x)
            return prediction, y, jacobians

        for _ in range(3):
            opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(single.parameters(), sharded.parameters(), strict=True))


@pytest.mark.parametrize("name", ["natural", "natural_exact", "paper"])
def test_a_sharded_state_resumes_in_one_process_exactly(sharded_run, name):
    """The consolidated state of a sharded run (2 or 3 processes) loads into one unsharded LoKO with every parameter's
    p̂ where it belongs. For the natural-gradient filter the sharded run equals the replicated one bit for bit, so the
    resumed state equals the replicated run's, and 4 more single-process steps from each stay equal bit for bit; for
    the paper's filter the loaded state is the consolidated one bit for bit and goes on learning."""
    world, results = sharded_run
    arguments = dict(next(args for case, args, _ in CASES if case == name))
    stream = list(conv_stream(world * 2 * STEPS + 8))[world * 2 * STEPS :]
    runs = {}
    for kind in ("sharded", "replicated"):
        state, weights = results[name]["resume"][kind]
        model, groups = build(name)
        model.load_state_dict(weights)
        opt = LoKO(groups, seed=1, **{"p0": 0.2, **arguments})
        opt.load_state_dict(copy.deepcopy(state))
        loaded = opt.state_dict()["state"]
        for index, saved in state["state"].items():
            for key, value in saved.items():
                assert torch.equal(loaded[index][key], value), (kind, index, key)
        runs[kind] = (model, opt)
    if name.startswith("natural"):
        (a, opt_a), (b, opt_b) = runs["sharded"], runs["replicated"]
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    for model, opt in runs.values():
        with JacobianEngine(model, observation=opt.observation, factorize=True) as engine:
            for x, y in stream[:4]:
                opt.step(lambda x=x, y=y: engine.observe(x, y.argmax()[None]))  # noqa: B023 (called at once)
                assert bool(opt.diagnostics["applied"])
    if name.startswith("natural"):
        (a, opt_a), (b, opt_b) = runs["sharded"], runs["replicated"]
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(opt_a.state[p]["cov"], opt_b.state[q]["cov"])
