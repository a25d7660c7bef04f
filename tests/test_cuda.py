"""The CUDA path (every test here is marked ``gpu``: skipped, with the reason, where there is no CUDA device).

Each observation's step on the GPU is the same float64 step on the CPU, and a run trained on a GPU through the real
CLI continues on the CPU from its checkpoint and loads there for prediction."""

import copy

import pytest
import torch
from loko_helpers import SmallConvNet, conv_stream, flat, variant
from runs import outputs

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.cli import main
from loko_lightning.learner.module import OnlineClassifier

pytestmark = pytest.mark.gpu
ACCELERATOR = "gpu"

VARIANTS = [
    ("softmax", {}),
    ("softmax", {"filter": {"name": "covariance", "r_estimator": "residual"}, "time_update": {"process_noise": 1e-3}}),
    ("natural", {}),
    ("natural_exact", {"time_update": {"shrinkage": 0.01}}),
    ("topk1", {}),
    ("lofi3", {"time_update": {"inflation": 0.02}}),
    ("lofi3_empirical", {"time_update": {"forgetting": 0.05}}),
    ("natural_sampled", {}),  # the drawn labels come from a CPU generator seeded by `seed`, alike on both devices
    ("lofi3_sampled", {}),
    ("softmax", {"average": 0.9}),
]


def _steps(device, observation, options, batch, n=12, shared_head=False):
    """``n`` float64 samples of the conv stream through the engine and LoKO on ``device``, ``batch`` per step;
    ``shared_head`` puts the head's weight in a ``shared_rows`` group (one full ``Σ`` for its rows)."""
    torch.manual_seed(0)
    model = SmallConvNet().double().to(device)
    groups = model.parameters()
    if shared_head:
        *body, weight, bias = model.parameters()  # the groups in the engine's (the module's) parameter order
        groups = [{"params": body}, {"params": [weight], "shared_rows": True}, {"params": [bias]}]
    opt = LoKO(groups, p0=0.5, seed=4, **variant(observation), **options)  # p̂0 drawn on the CPU
    engine = JacobianEngine(model, observation=opt.observation, factorize=True)
    samples = list(conv_stream(n))
    for start in range(0, n, batch):
        chunk = samples[start : start + batch]
        x = torch.cat([s[0] for s in chunk]).to(device)
        label = torch.stack([s[1].argmax() for s in chunk]).to(device)
        prediction, target, jacobians = engine.observe(x, label, batched=batch > 1)
        opt.step(lambda prediction=prediction, target=target, jacobians=jacobians: (prediction, target, jacobians))
        assert bool(opt.diagnostics["applied"])
    params = list(model.parameters())
    state = {
        "theta": flat(params).detach().cpu(),
        "cov": flat(opt.state[q]["cov"] for q in params).cpu(),
        "device": {opt.state[q]["cov"].device.type for q in params} | {q.device.type for q in params},
    }
    if shared_head:
        state["row_cov"] = opt.state[model.head.weight]["row_cov"].cpu()
        state["device"] |= {opt.state[model.head.weight]["row_cov"].device.type}
    if "average" in opt.state[params[0]]:
        state["average"] = flat(opt.state[q]["average"] for q in params).cpu()
    if "W" in opt.state[params[0]]:
        W = torch.cat([opt.state[q]["W"] for q in params]).cpu()
        state["WWt"] = W @ W.T  # W up to the signs of its columns, which eigensolvers choose freely
    return state


def assert_same_step(cpu, cuda):
    """The states of :func:`_steps` on the two devices, with the float64 tolerances the tests below justify."""
    assert cuda["device"] == {"cuda"} and cpu["device"] == {"cpu"}
    torch.testing.assert_close(cuda["theta"], cpu["theta"], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(cuda["cov"], cpu["cov"], rtol=1e-8, atol=1e-11)
    if "row_cov" in cpu:  # sums of the same products as the covariance's diagonal: its tolerance
        torch.testing.assert_close(cuda["row_cov"], cpu["row_cov"], rtol=1e-8, atol=1e-11)
    if "WWt" in cpu:
        torch.testing.assert_close(cuda["WWt"], cpu["WWt"], rtol=1e-8, atol=1e-10)
    if "average" in cpu:  # a convex combination of the means above: their tolerance
        torch.testing.assert_close(cuda["average"], cpu["average"], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("observation", "options"), VARIANTS, ids=[f"{o}-{sorted(k)}" for o, k in VARIANTS])
def test_a_cuda_step_is_the_cpu_step_in_float64(observation, options, batch):
    """The same float64 arithmetic on both devices: they differ only in the order of the reductions (BLAS, cuBLAS,
    cuSOLVER), a relative n·eps64 ≈ 1e-14 per step that the pseudo-inverse and the eigendecompositions amplify by
    their conditioning (< 1e4 here), so the float64 reference tests' tolerance holds between the devices too."""
    assert_same_step(_steps("cpu", observation, options, batch), _steps("cuda", observation, options, batch))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("options", [{}, {"average": 0.9}], ids=["plain", "average"])
def test_a_shared_head_covariance_on_cuda_is_the_cpu_step_in_float64(options, batch):
    """The head's rows sharing one ``Σ`` (``shared_rows``): the same float64 arithmetic on both devices, so the
    tolerance above; ``Σ`` itself is a sum of the same products as ``P``'s diagonal, held to that diagonal's."""
    cpu = _steps("cpu", "softmax", options, batch, shared_head=True)
    assert "row_cov" in cpu
    assert_same_step(cpu, _steps("cuda", "softmax", options, batch, shared_head=True))


def test_a_gpu_run_continues_on_the_cpu_and_loads_there(tmp_path, monkeypatch):
    """Train on a GPU (the debug config's first 20 of 30 samples, checkpoint every 10), then resume the same run on
    a machine without one: the optimizer state comes back on the CPU, the stream continues at sample 21, and the
    checkpoint loads for prediction on the CPU."""
    monkeypatch.chdir(tmp_path)
    common = ["--config", "debug", "--data.max_samples", "30", "--data.eval_max_samples", "12",
              "--trainer.limit_val_batches", "0"]  # fmt: skip
    main(["fit", *common, "--trainer.accelerator", ACCELERATOR, "--trainer.devices", "1", "--trainer.max_steps", "20",
          *outputs(tmp_path, "gpu", every=10, plot=False)])  # fmt: skip
    ckpt = tmp_path / "gpu" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 20
    main(["fit", *common, "--trainer.accelerator", "cpu", "--ckpt_path", str(ckpt),
          *outputs(tmp_path, "cpu", every=10, plot=False)])  # fmt: skip
    resumed = torch.load(tmp_path / "cpu" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 30
    learner = OnlineClassifier.load_from_checkpoint(ckpt, weights_only=True, map_location="cpu")
    assert {p.device.type for p in learner.parameters()} == {"cpu"}
    for key, value in learner.state_dict().items():
        assert torch.equal(value, saved["state_dict"][key]), key
    with torch.no_grad():
        logits = copy.deepcopy(learner).network(torch.zeros(1, 3, 32, 32))
    assert logits.shape == (1, 10) and torch.isfinite(logits).all()
