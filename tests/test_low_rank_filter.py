"""LoFi, the low-rank plus diagonal precision filter (filter: lofi<L>), against its float64 definition."""

import copy

import pytest
import torch
from loko_helpers import SmallConvNet, conv_stream, flat, jacrev_rows, mlp, teacher_stream

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters import FisherRows, LowRankPrecision, get_filter
from loko_lightning.kalman.reference import lofi_step_reference
from loko_lightning.kalman.time_update import TimeUpdate
from loko_lightning.kalman.update import loko_update


def _run(model, stream, rank, factorize, batch=1, p0_init="uniform", fisher="exact", **options):
    """The fast path and a copy of the model with the reference, step by step; compared after every step."""
    reference_model = copy.deepcopy(model)
    opt = LoKO(
        model.parameters(), p0=0.5, p0_init=p0_init, seed=4, filter=LowRankPrecision(rank, fisher), time_update=options
    )
    time_update = TimeUpdate(**options, reference=0.5)
    theta, p = flat(model.parameters()).detach().clone(), flat(opt.state[q]["cov"] for q in model.parameters())
    W = torch.zeros(theta.numel(), rank, dtype=torch.float64)
    engine = JacobianEngine(model, observation=opt.observation, factorize=factorize)
    twin = FisherRows(fisher, seed=4)  # the sampled Fisher's labels: the optimizer's generator, drawn alike
    samples = list(stream)
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        x = torch.cat([s[0] for s in chunk])
        label = torch.stack([s[1].argmax() for s in chunk])
        jz, y_hat = zip(*(jacrev_rows(reference_model, s[0], probabilities=False) for s in chunk), strict=True)
        targets = torch.stack([s[1] for s in chunk])
        sampled = twin.draw(torch.stack(y_hat) if batch > 1 else y_hat[0]) if fisher == "sampled" else None
        jz, y_hat = torch.stack(jz), torch.stack(y_hat)
        theta, p, W = lofi_step_reference(
            theta, p, W, jz, y_hat, targets, fisher=fisher, sampled=sampled, time_update=time_update
        )
        torch.nn.utils.vector_to_parameters(theta, reference_model.parameters())
        prediction, target, jacobians = engine.observe(x, label, batched=batch > 1)
        opt.step(lambda prediction=prediction, target=target, jacobians=jacobians: (prediction, target, jacobians))
        assert bool(opt.diagnostics["applied"])
        fast_W = torch.cat([opt.state[q]["W"] for q in model.parameters()])
        # float64 on both sides: the fast path solves an (L + B m)-square system by Woodbury and truncates by the
        # eigendecomposition of W̃ᵀW̃, the reference solves n x n and decomposes W Wᵀ + info: the same numbers up to
        # float64 rounding amplified by the conditioning of those systems.
        torch.testing.assert_close(flat(model.parameters()).detach(), theta, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(flat(opt.state[q]["cov"] for q in model.parameters()), p, rtol=1e-8, atol=1e-11)
        torch.testing.assert_close(fast_W @ fast_W.T, W @ W.T, rtol=1e-8, atol=1e-10)  # W up to signs of columns
    return opt


@pytest.mark.parametrize("rank", [1, 4])
def test_lofi_matches_the_float64_reference_on_dense_blocks(rank):
    opt = _run(mlp(), teacher_stream(30), rank, factorize=False)
    assert all(opt.state[q]["W"].shape[1] == rank for q in opt.param_groups[0]["params"])


def test_lofi_matches_the_reference_on_factored_blocks_with_process_noise():
    torch.manual_seed(0)
    _run(SmallConvNet().double(), conv_stream(20), 3, factorize=True, p0_init="constant", process_noise=1e-3)


def test_lofi_joint_step_of_several_samples_matches_the_reference():
    torch.manual_seed(0)
    _run(SmallConvNet().double(), conv_stream(18), 2, factorize=True, batch=3)


def test_lofi_with_shrinkage_and_inflation_matches_the_reference():
    _run(mlp(), teacher_stream(20), 2, factorize=False, shrinkage=0.01, inflation=0.02)


@pytest.mark.parametrize(
    ("model", "stream", "factorize", "batch"),
    [(mlp, lambda: teacher_stream(24), False, 1), (lambda: SmallConvNet().double(), lambda: conv_stream(18), True, 3)],
    ids=["dense", "factored-joint"],
)
def test_lofi_with_the_empirical_fisher_matches_the_reference(model, stream, factorize, batch):
    """One reverse row (d) per sample, which is also the only factor of the information: W̃ = [W, d_1 … d_B]."""
    torch.manual_seed(0)
    opt = _run(model(), stream(), 3, factorize=factorize, batch=batch, fisher="empirical")
    assert opt.observation.rows(10) == opt.observation.reverse_rows(10) == 1


@pytest.mark.parametrize(
    ("model", "stream", "factorize", "batch"),
    [(mlp, lambda: teacher_stream(24), False, 1), (lambda: SmallConvNet().double(), lambda: conv_stream(18), True, 3)],
    ids=["dense", "factored-joint"],
)
def test_lofi_with_a_sampled_fisher_matches_the_reference(model, stream, factorize, batch):
    """Two reverse rows per sample: d, and the factor of a label drawn from the prediction, W̃ = [W, f_1 … f_B]."""
    torch.manual_seed(0)
    opt = _run(model(), stream(), 3, factorize=factorize, batch=batch, fisher="sampled", process_noise=1e-3)
    assert opt.observation.rows(10) == opt.observation.reverse_rows(10) == 2


def test_the_sampled_fisher_is_the_exact_one_in_expectation():
    """E_s[(u_s − ŷ)(u_s − ŷ)ᵀ] = diag(ŷ) − ŷŷᵀ: the mean of many draws' outer products converges to it (the
    Monte Carlo error of 20,000 draws is about 0.5/√20000 ≈ 0.004 per entry; 0.02 is four of those)."""
    rows = FisherRows("sampled", seed=0)
    y_hat = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64).expand(20_000, 4)
    a = rows.cotangents(y_hat, torch.zeros_like(y_hat))[1]
    expected = torch.diag(y_hat[0]) - torch.outer(y_hat[0], y_hat[0])
    torch.testing.assert_close(a.T @ a / a.shape[0], expected, rtol=0, atol=0.02)
    drawn = torch.bincount(rows.draw(y_hat), minlength=4).double() / 20_000
    torch.testing.assert_close(drawn, y_hat[0], rtol=0, atol=0.02)


def test_lofi_with_forgetting_matches_the_reference():
    opt = _run(mlp(), teacher_stream(24), 2, factorize=False, forgetting=0.05, process_noise=1e-3)
    assert opt.param_groups[0]["forgetting"] == 0.05


def test_lofi_empirical_names_round_trip():
    lofi = get_filter("lofi7_empirical")
    assert (lofi.rank, lofi.fisher, lofi.spec) == (7, "empirical", "lofi7_empirical")
    assert get_filter(lofi.spec) == lofi and get_filter("lofi7").fisher == "exact"
    with pytest.raises(ConfigError, match="lofi<rank>_empirical"):
        get_filter("lofi7_exact")
    sampled = get_filter("lofi7_sampled")
    assert (sampled.fisher, sampled.spec, get_filter("natural_sampled").spec) == ("sampled", "lofi7_sampled",
                                                                                   "natural_sampled")  # fmt: skip


def test_lofi_keeps_the_diagonal_of_the_precision_exactly():
    """Cutting the low-rank part to rank L moves the rest to the diagonal: diag(Λ) = 1/p̂₀ + Σ diag(information)."""
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.5, p0_init="constant", filter="lofi2")
    engine = JacobianEngine(model, observation=opt.observation)
    information = torch.zeros(sum(q.numel() for q in model.parameters()), dtype=torch.float64)
    for x, y in teacher_stream(10):
        prediction, target, jacobians = engine.observe(x, y.argmax()[None])
        rows = jacobians[0].shape[0]  # d, then the m Fisher factors
        information += sum(torch.cat([j[r].reshape(-1) for j in jacobians]) ** 2 for r in range(1, rows))
        opt.step(lambda p=prediction, t=target, j=jacobians: (p, t, j))
    W = torch.cat([opt.state[q]["W"] for q in model.parameters()])
    diagonal = 1 / flat(opt.state[q]["cov"] for q in model.parameters()) + (W * W).sum(1)
    torch.testing.assert_close(diagonal, 1 / 0.5 + information, rtol=1e-10, atol=1e-12)  # float64 sums


def test_lofi_keeps_w_as_views_of_one_flat_tensor_with_the_gathering_path_s_numbers():
    """The optimizer keeps W flat in the plan's order (the states are views, nothing is gathered or copied per step);
    the functional update, which gathers and scatters the blocks every call, gives the same numbers bit for bit."""
    model, twin = mlp(), mlp()
    opt = LoKO(model.parameters(), p0=0.5, seed=1, filter="lofi3_empirical")
    covs = [opt.state[q]["cov"].clone() for q in model.parameters()]
    blocks = [torch.zeros(q.numel(), 3, dtype=torch.float64) for q in model.parameters()]
    R, step = torch.zeros(4, 4, dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    engine, twin_engine = (JacobianEngine(m, observation=opt.observation) for m in (model, twin))
    for x, y in teacher_stream(8):
        opt.step(lambda x=x, y=y: engine.observe(x, y.argmax()[None]))
        prediction, target, jacobians = twin_engine.observe(x, y.argmax()[None])
        state = {"cov": covs, "R": R, "step": step, "W": blocks}
        with torch.no_grad():
            loko_update(list(twin.parameters()), jacobians, state, prediction, target, filter="lofi3_empirical")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    states = [opt.state[q]["W"] for q in model.parameters()]
    assert all(torch.equal(w, b) for w, b in zip(states, blocks, strict=True))
    assert len({w.untyped_storage().data_ptr() for w in states}) == 1  # one storage: views of the flat W


@pytest.mark.parametrize("spec", ["lofi3", "lofi3_sampled"])
def test_lofi_resumes_from_its_state_dict_exactly(spec):
    """The sampled Fisher's generator is in the state dict: the resumed run draws the labels the first one does,
    though the second optimizer is built with another seed."""
    model, twin = mlp(), mlp()
    first = LoKO(model.parameters(), p0=0.5, seed=1, filter=spec)
    stream = list(teacher_stream(12))
    engine = JacobianEngine(model, observation=first.observation)
    for x, y in stream[:6]:
        first.step(lambda x=x, y=y: engine.observe(x, y.argmax()[None]))
    twin.load_state_dict(model.state_dict())
    second = LoKO(twin.parameters(), p0=0.5, seed=1, filter=spec)
    saved = first.state_dict()
    assert ("observation_rng" in saved) == spec.endswith("_sampled")
    if spec.endswith("_sampled"):
        second.observation.generator.manual_seed(99)  # as another seed would leave it
    second.load_state_dict(saved)
    twin_engine = JacobianEngine(twin, observation=second.observation)
    for x, y in stream[6:]:
        first.step(lambda x=x, y=y: engine.observe(x, y.argmax()[None]))
        second.step(lambda x=x, y=y: twin_engine.observe(x, y.argmax()[None]))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


@pytest.mark.parametrize("rank", [0, -1, True, 2.5])
def test_a_bad_rank_is_refused(rank):
    with pytest.raises(ConfigError, match="Invalid rank"):
        LowRankPrecision(rank)
    assert get_filter("lofi10").rank == 10 and get_filter("lofi10").spec == "lofi10"
    with pytest.raises(ConfigError, match="lofi<rank>"):
        get_filter("lofi")


@pytest.mark.parametrize("where", ["jacobian", "prediction"])
def test_lofi_skips_a_non_finite_step_and_keeps_w(where):
    """A NaN in a Jacobian row (W̃ then holds it) or in the prediction: θ̃, p̂ and W keep their values, the step is
    counted as skipped, and the next finite step is applied as if the bad one had not come."""
    model, twin = mlp(), mlp()
    opt = LoKO(model.parameters(), p0=0.5, seed=1, filter="lofi2", time_update={"inflation": 0.01})
    other = LoKO(twin.parameters(), p0=0.5, seed=1, filter="lofi2", time_update={"inflation": 0.01})
    engine, twin_engine = (
        JacobianEngine(model, observation=opt.observation),
        JacobianEngine(twin, observation=other.observation),
    )
    stream = list(teacher_stream(4))
    for x, y in stream[:2]:
        opt.step(lambda x=x, y=y: engine.observe(x, y.argmax()[None]))
        other.step(lambda x=x, y=y: twin_engine.observe(x, y.argmax()[None]))
    before = [p.detach().clone() for p in model.parameters()]
    state = {key: flat(opt.state[q][key] for q in model.parameters()).clone() for key in ("cov", "W")}
    prediction, target, jacobians = engine.observe(*stream[2][0:1], stream[2][1].argmax()[None])
    if where == "jacobian":
        jacobians = [j.clone() for j in jacobians]
        jacobians[1].view(-1)[3] = float("nan")
    else:
        prediction = prediction.clone()
        prediction[0] = float("nan")
    opt.step(lambda: (prediction, target, jacobians))
    assert not bool(opt.diagnostics["applied"]) and int(opt.diagnostics["skipped"]) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for key, value in state.items():
        assert torch.equal(flat(opt.state[q][key] for q in model.parameters()), value), key
    x, y = stream[3]
    opt.step(lambda: engine.observe(x, y.argmax()[None]))
    other.step(lambda: twin_engine.observe(x, y.argmax()[None]))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    assert torch.equal(
        flat(opt.state[q]["W"] for q in model.parameters()), flat(other.state[q]["W"] for q in twin.parameters())
    )
