"""Every filter and observation in float32, where real runs go, against the same step in float64.

Along a run, each step starts both sides from the same state (the float64 state rounded to float32) and the same
observation (computed once in float32, the float64 side reading its exact float64 value), so the difference is the
filter's float32 arithmetic alone. The float64 side is LoKO's float64 fast path, which the reference tests hold to the
dense float64 references to about 1e-9 (relative), far below every bound here. Each bound is first-order rounding
analysis with eps = eps(float32) = 2u (a factor 2 for the second-order terms):

- the covariance form (observations softmax and top-k): the solve with S, relative error ~ cond(S)·eps in the update
  and in (KH)_ii, so ``|Δθ32 − Δθ64| ≤ 10·cond(S)·eps·max|Δθ64|`` and ``|p̂32 − p̂64| ≤ 10·cond(S)·eps·p̂_prior``
  (the 10 covers the sums of S = H P Hᵀ over the few hundred parameters, as the single-step test of
  test_covariance_filter);
- the information form: elementwise, each entry from its own column: the sum of ``rows`` squares (all positive:
  ``rows·u``), ``1 + p̂·info``, a reciprocal and two products: ``(rows + 4)·u`` relative on p̂ and ``(rows + 5)·u`` on
  each entry of the update;
- LoFi: the Woodbury solve of the whole precision Λ' = diag(1/p̂) + W̃W̃ᵀ, relative error ``cond(Λ')·eps``
  normwise in the update, and the cut of W̃ᵀW̃ to rank L, whose kept subspace moves by ``eps·λ_max/gap``
  (``gap`` between the L-th and (L+1)-th eigenvalues), so each diagonal entry ``1/p̂_i`` moves by at most
  ``2·|w̃_i|²·eps·(λ_max/gap + c)`` (``c`` columns of W̃, the rounding of their sum of squares) beside the three
  roundings of ``1/p̂`` itself (``2·eps/p̂``), and ``W Wᵀ`` by ``2·eps·λ_max·(λ_max/gap + c)``;
- the head's rows sharing one full Σ (``shared_head``): the covariance form's bounds, and each entry of the new Σ
  within ``10·cond(S)·eps`` of Σ's largest entry (its correction ``Σ R N̄ Rᵀ Σ`` comes from the same solve and is no
  larger than Σ);
- the regression observation: the covariance form's bounds (raw outputs, the Taylor R);
- the sampled Fisher (``natural_sampled``, ``lofi3_sampled``): the information form's and LoFi's bounds with their
  two rows (both sides read the same drawn label's rows);
- every time update at once (``time_update``: process noise q, shrinkage λ, inflation α, stabilised forgetting γ
  and a floor): the covariance form's bounds on the prior ``p̂ + q``, scaled by ``1 + α``, plus four roundings of
  ``p̂`` (``+ q``, ``× (1 + α)``, forgetting's product and quotient, whose derivative is at most ``1/(1 − γ)``) and
  one more of ``θ`` (``× (1 − λ)``);
- the final ``θ + Δθ`` rounds once more: ``eps·|θ|`` per entry.

Every step must be applied, every parameter tensor must move and LoFi's W must take each step's information.
"""

import copy

import pytest
import torch
from loko_helpers import SmallConvNet, conv_stream, flat, variant

from loko_lightning import JacobianEngine, LoKO

EPS = torch.finfo(torch.float32).eps
VARIANTS = [
    "covariance",
    "topk2",
    "regression",
    "natural",
    "natural_exact",
    "natural_sampled",
    "lofi3",
    "lofi3_empirical",
    "lofi3_sampled",
    "shared_head",
    "time_update",
]
# The time_update variant's process model (small enough that the prior stays the filter's, large enough to matter).
TIME_UPDATE = {"process_noise": 1e-3, "shrinkage": 1e-2, "inflation": 1e-2, "forgetting": 1e-2, "p_floor": 1e-6}


def _loko(model, name):
    """LoKO of the variant; ``shared_head``: the covariance filter with the head's rows sharing one full Σ."""
    if name == "shared_head":
        groups = [{"params": [p], "shared_rows": n == "head.weight"} for n, p in model.named_parameters()]
        return LoKO(groups, p0=0.3, seed=3)
    if name == "time_update":
        return LoKO(model.parameters(), p0=0.3, seed=3, time_update=TIME_UPDATE)
    return LoKO(model.parameters(), p0=0.3, seed=3, **variant(name))


def _cast(state_dict, dtype):
    state_dict = copy.deepcopy(state_dict)
    for state in state_dict["state"].values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point():
                state[key] = value.to(dtype)
    return state_dict


def _rows(blocks):
    """H (or the filter's rows) as one float64 ``(rows, n)`` matrix."""
    dense = [b.to_dense() if hasattr(b, "to_dense") else b for b in blocks]
    return torch.cat([b.double().reshape(b.shape[0], -1) for b in dense], 1)


def _lofi_bounds(prior, W, rows, rank):
    """cond(Λ'), λ_max and the gap of W̃ᵀW̃ at the cut, and |w̃_i|², all float64, from the step's inputs."""
    factors = rows[:1] if rows.shape[0] == 1 else rows[1:]
    wide = torch.cat([W, factors.T], 1)
    precision = torch.diag(1 / prior) + wide @ wide.T
    values = torch.linalg.eigvalsh(precision)
    gram = torch.linalg.eigvalsh(wide.T @ wide).flip(0)  # descending
    gap = (gram[rank - 1] - gram[rank]).clamp_min(torch.finfo(torch.float64).tiny)
    return float(values[-1] / values[0]), float(gram[0]), float(gap), (wide * wide).sum(1), wide.shape[1]


@pytest.mark.parametrize("name", VARIANTS)
def test_a_float32_run_stays_within_the_rounding_bound_of_float64(name):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    start = [p.detach().float().clone() for p in model.parameters()]
    opt64 = _loko(model, name)
    # The float32 prediction is a probability vector to float32 rounding only: the check against logits passed as
    # probabilities would refuse it in float64.
    opt64.observation.check = opt64.observation.violation = lambda *args: None
    rows_per_sample = None
    for x, y in conv_stream(24):
        # Both sides start from the same state: the float64 one rounded to float32.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.float())
        opt64.load_state_dict(_cast(_cast(opt64.state_dict(), torch.float32), torch.float64))
        model32 = copy.deepcopy(model).float()
        opt32 = _loko(model32, name)
        opt32.load_state_dict(_cast(opt64.state_dict(), torch.float32))
        label = y.float()[None] if name == "regression" else y.argmax()[None]  # a regression's target: the values
        with JacobianEngine(model32, observation=opt32.observation, factorize=True) as engine:
            prediction, target, blocks = engine.observe(x.float(), label)
        params64 = list(model.parameters())
        theta0 = flat(params64).detach().clone()
        prior = flat(opt64.state[p]["cov"] for p in params64).clone()
        shared = {id(p) for p in params64 if "row_cov" in opt64.state[p]}
        sigma_prior = [opt64.state[p]["row_cov"].clone() for p in params64 if id(p) in shared]
        rank = int(name[4]) if name.startswith("lofi") else 0
        low_rank = torch.cat([opt64.state[p].get("W", torch.zeros(p.numel(), rank)).double() for p in params64])
        rows = _rows(blocks)
        rows_per_sample = rows.shape[0]
        opt32.step(lambda: (prediction, target, blocks))  # noqa: B023 (called at once)
        opt64.step(lambda: (prediction.double(), target.double(), [b.to(torch.float64) for b in blocks]))  # noqa: B023
        assert bool(opt32.diagnostics["applied"]) and bool(opt64.diagnostics["applied"])

        theta64 = flat(params64).detach()
        theta32 = flat(model32.parameters()).detach().double()
        step = (theta64 - theta0).abs().max()
        p64 = flat(opt64.state[p]["cov"] for p in params64)
        p32 = flat(opt32.state[p]["cov"] for p in model32.parameters()).double()
        theta_error = (theta32 - theta64).abs() - EPS * theta64.abs()
        if name == "time_update":
            cond = float(opt64.diagnostics["cond"])
            q, alpha, gamma = (TIME_UPDATE[key] for key in ("process_noise", "inflation", "forgetting"))
            bound = 10 * cond * EPS * (prior + q) * (1 + alpha) / (1 - gamma) + 4 * EPS * p64
            assert ((p32 - p64).abs() <= bound).all()
            assert (theta_error <= 10 * cond * EPS * step + EPS * theta64.abs()).all()
        elif name in ("covariance", "topk2", "regression", "shared_head"):
            cond = float(opt64.diagnostics["cond"])
            assert (theta_error <= 10 * cond * EPS * step).all(), (cond, float(theta_error.max() / step / EPS))
            assert ((p32 - p64).abs() <= 10 * cond * EPS * prior).all()
            # Σ: the same solve, its correction Σ R N̄ Rᵀ Σ no larger than Σ itself: relative to Σ's largest entry.
            pairs = zip(params64, model32.parameters(), strict=True)
            sigmas = [(opt64.state[p]["row_cov"], opt32.state[q]["row_cov"]) for p, q in pairs if id(p) in shared]
            assert len(sigmas) == (name == "shared_head")
            for (s64, s32), s0 in zip(sigmas, sigma_prior, strict=True):
                assert ((s32.double() - s64).abs() <= 10 * cond * EPS * s0.abs().max()).all()
        elif name.startswith("natural"):
            update = (theta64 - theta0).abs()
            assert (theta_error <= (rows_per_sample + 5) * EPS / 2 * update + EPS * theta64.abs()).all()
            assert ((p32 - p64).abs() <= (rows_per_sample + 4) * EPS / 2 * p64).all()
        else:
            cond, top, gap, norms, columns = _lofi_bounds(prior, low_rank, rows, rank)
            assert (theta_error <= 10 * cond * EPS * step).all(), (cond, float(theta_error.max() / step / EPS))
            spread = 2 * EPS * (top / gap + columns)
            assert ((1 / p32 - 1 / p64).abs() <= spread * norms + 2 * EPS / p64).all()
            W64 = torch.cat([opt64.state[p]["W"] for p in params64])
            W32 = torch.cat([opt32.state[p]["W"] for p in model32.parameters()]).double()
            assert ((W32 @ W32.T - W64 @ W64.T).abs() <= spread * top + EPS * (W64 @ W64.T).abs()).all()
            assert (low_rank != W32).any()  # the step's information reached W
        model32_final = model32
    # Every parameter tensor moved in the float32 run (the last step started from the float64 trajectory).
    assert int(opt32.diagnostics["skipped"]) == 0
    for before, after in zip(start, model32_final.parameters(), strict=True):
        assert not torch.equal(before, after.detach())
