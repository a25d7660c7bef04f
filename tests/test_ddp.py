"""Joint LoKO updates under real torch.distributed (gloo, 2 processes on loopback, CPU): ranks stay identical, and W = 2
processes with B = 1 make the updates of one process with B = 2 on the same interleaved stream."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from loko_helpers import SmallConvNet, conv_stream, variant
from runs import outputs, trainable

from loko_lightning import FactoredJacobian, JacobianEngine, LoKO, OuterJacobian
from loko_lightning.cli.default import NEAREST_MEAN
from loko_lightning.kalman.distributed import all_gather_observations, observation_nbytes

# Every test here starts 2 processes (each imports torch, most run the whole CLI): tens of seconds each.
pytestmark = pytest.mark.slow

STEPS = 30


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup():
    torch.manual_seed(0)
    model = SmallConvNet()
    return model, LoKO(model.parameters(), p0=0.2, seed=1), [(x.float(), y.float()) for x, y in conv_stream(2 * STEPS)]


def state(model, opt):
    """θ̃, p̂, LoFi's W and R as one float64 vector (the checksum compares it whole)."""
    params = list(model.parameters())
    parts = [p.detach().reshape(-1) for p in params] + [opt.state[p]["cov"].reshape(-1) for p in params]
    parts += [opt.state[p]["W"].reshape(-1) for p in params if "W" in opt.state[p]]
    parts += [opt.state[p]["row_cov"].reshape(-1) for p in params if "row_cov" in opt.state[p]]
    return torch.cat([*parts, opt.state[params[0]]["R"].reshape(-1)]).double()


def worker(rank, world, port, out, loko_gathers=False):
    """``loko_gathers``: LoKO's exchange gathers the processes' observations (the closure returns its own only)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, opt, items = setup()
        opt.exchange.gather = loko_gathers
        nbytes = []
        with JacobianEngine(model, factorize=True) as engine:
            for step in range(STEPS):
                x, y = items[world * step + rank]  # the interleaved stream: rank r takes positions W·s + r

                def closure(x=x, y=y):
                    prediction, jacobians = engine.batch(x)
                    nbytes.append(observation_nbytes(prediction, y[None], jacobians))
                    if loko_gathers:
                        return prediction, y[None], jacobians
                    return all_gather_observations(prediction, y[None], jacobians)

                opt.step(closure)
        mine = state(model, opt)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        if rank == 0:
            torch.save({"states": gathered, "nbytes": nbytes[0], "step": int(opt.diagnostics["step"])}, out)
        dist.barrier()  # both ranks leave together (see ragged_worker)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "result.pt"
    mp.start_processes(worker, args=(2, free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    return torch.load(out)


def test_ranks_hold_identical_parameters_and_filter_state_after_many_steps(ddp_run):
    """No broadcast: both ranks apply the same update to bit-identical gathered observations, so θ̃, p̂ and R agree
    to the last bit after 30 joint updates (60 samples)."""
    first, second = ddp_run["states"]
    assert ddp_run["step"] == STEPS
    assert torch.equal(first, second)
    # Every rank sends its prediction, target and Jacobian factors: far fewer bytes than the dense Jacobian.
    model, _, _ = setup()
    dense = 4 * 4 * sum(p.numel() for p in model.parameters())
    assert 0 < ddp_run["nbytes"] < dense


def single_process(gather_like_ranks):
    """One process with B = 2 on the same stream: the joint update of positions 2s and 2s + 1."""
    model, opt, items = setup()
    conds = []
    with JacobianEngine(model, factorize=True) as engine:
        for step in range(STEPS):
            (x0, y0), (x1, y1) = items[2 * step : 2 * step + 2]
            y = torch.stack([y0, y1])

            def closure(x0=x0, x1=x1, y=y):
                if not gather_like_ranks:
                    prediction, jacobians = engine.batch(torch.cat([x0, x1]))
                    return prediction, y, jacobians
                # Each sample through its own batch of one, as each rank computes it, then concatenated.
                (p0, j0), (p1, j1) = engine.batch(x0), engine.batch(x1)
                return torch.cat([p0, p1]), y, [_cat(a, b) for a, b in zip(j0, j1, strict=True)]

            opt.step(closure)
            conds.append(opt.diagnostics["cond"].item())
    return state(model, opt), max(conds)


def _cat(a, b):
    if isinstance(a, OuterJacobian):
        return OuterJacobian(torch.cat([a.left, b.left]), torch.cat([a.right, b.right]))
    if isinstance(a, FactoredJacobian):
        return FactoredJacobian(torch.cat([a.left, b.left]), torch.cat([a.right, b.right]), a.param_shape)
    return torch.cat([a, b])


def test_loko_gathering_the_processes_observations_itself_is_the_closure_s_gather_bit_for_bit(ddp_run, tmp_path):
    """LoKO's replicated exchange with ``gather`` on (what the learner turns on under DDP), fed each process's own
    sample: the same updates as a closure that gathers every process's, bit for bit, on both ranks."""
    out = tmp_path / "result.pt"
    mp.start_processes(worker, args=(2, free_port(), str(out), True), nprocs=2, join=True, start_method="spawn")
    gathered_by_loko = torch.load(out)
    assert gathered_by_loko["step"] == STEPS
    for mine, theirs in zip(gathered_by_loko["states"], ddp_run["states"], strict=True):
        assert torch.equal(mine, theirs)


def test_two_processes_with_one_sample_equal_one_process_with_two(ddp_run):
    """W = 2, B = 1 against one process with B = 2 on the same interleaved stream.

    With each sample's Jacobian computed in a batch of one, as on the ranks, the observations are the same bits,
    and so is every update. With both samples in one batch of two, the batched kernels round differently (float32,
    a few ulps per Jacobian entry); the update amplifies a relative input error by at most cond(S), and 30 steps
    compound it: the bound is 30 · max cond(S) · 16 eps32 relative to the parameters' total change.
    """
    rank0 = ddp_run["states"][0]
    same_inputs, _ = single_process(gather_like_ranks=True)
    assert torch.equal(same_inputs, rank0)

    batched, cond = single_process(gather_like_ranks=False)
    model, _, _ = setup()
    n = sum(p.numel() for p in model.parameters())
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    change = (rank0[:n] - start).abs().max()
    err = (batched[:n] - rank0[:n]).abs().max() / change
    bound = STEPS * cond * 16 * torch.finfo(torch.float32).eps
    print(f"W=2 vs B=2 batched: relative error {err.item():.3g}, bound {bound:.3g}, max cond(S) {cond:.3g}")
    assert err < bound, (err.item(), bound)
    assert change > 1e-3  # the parameters moved: the comparison means something


def label_setup(observation):
    torch.manual_seed(0)
    model = SmallConvNet()
    if observation == "shared_head":  # not label-dependent rows: the head's rows sharing a full covariance
        groups = [{"params": [p], "shared_rows": name == "head.weight"} for name, p in model.named_parameters()]
        opt = LoKO(groups, p0=0.05, seed=1)
    else:
        opt = LoKO(model.parameters(), p0=0.05, seed=1, **variant(observation))
    return model, opt, [(x.float(), y.float()) for x, y in conv_stream(2 * STEPS)]


def label_worker(rank, world, port, out, observation):
    """An observation whose rows depend on the label, under the interleaved stream: each rank uses its own labels."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, opt, items = label_setup(observation)
        with JacobianEngine(model, observation=opt.observation, factorize=True) as engine:
            for step in range(STEPS):
                x, y = items[world * step + rank]
                opt.step(lambda x=x, y=y: all_gather_observations(*engine.observe(x, y.argmax()[None], batched=True)))
        mine = state(model, opt)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        if rank == 0:
            torch.save({"states": gathered, "step": int(opt.diagnostics["step"])}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("observation", ["natural_exact", "topk1", "lofi2", "shared_head"])
def test_label_dependent_rows_keep_ranks_identical_and_equal_one_process_with_both_samples(tmp_path, observation):
    """The exact-Fisher natural gradient (m + 1 rows per sample), top-1 (the label, the most probable other class
    and the rest, chosen per sample), LoFi (its W from every process's rows) and the head's shared row covariance
    (its Σ from every process's samples): both ranks hold the same bits after 30 joint steps, and they are the bits
    of one process observing the two samples jointly (each through its own batch of one, as on the ranks)."""
    out = tmp_path / "result.pt"
    args = (2, free_port(), str(out), observation)
    mp.start_processes(label_worker, args=args, nprocs=2, join=True, start_method="spawn")
    result = torch.load(out)
    first, second = result["states"]
    assert result["step"] == STEPS and torch.equal(first, second)

    model, opt, items = label_setup(observation)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with JacobianEngine(model, observation=opt.observation, factorize=True) as engine:
        for step in range(STEPS):
            parts = [engine.observe(x, y.argmax()[None], batched=True) for x, y in items[2 * step : 2 * step + 2]]
            prediction, target = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            blocks = [_cat(a, b) for a, b in zip(parts[0][2], parts[1][2], strict=True)]
            opt.step(lambda prediction=prediction, target=target, blocks=blocks: (prediction, target, blocks))
    assert torch.equal(state(model, opt), first)
    assert (first[: start.numel()] - start.double()).abs().max() > 1e-3  # the parameters moved


def ragged_blocks(rank):
    """Rank ``rank``'s observation: texts padded to ``3 + rank`` positions, so its factored block has that many."""
    gen = torch.Generator().manual_seed(10 + rank)
    k, m = 3 + rank, 4
    prediction, target = torch.rand(2, m, generator=gen), torch.rand(2, m, generator=gen)
    factored = FactoredJacobian(torch.randn(2, m, 5, k, generator=gen), torch.randn(2, 6, k, generator=gen), (5, 6))
    outer = OuterJacobian(torch.randn(2, m, 3, generator=gen), torch.randn(2, 7, generator=gen))
    return prediction, target, [factored, outer, torch.randn(2, m, 2, generator=gen)]


def ragged_worker(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        prediction, target, jacobians = all_gather_observations(*ragged_blocks(rank))
        if rank == 0:
            dense = [jac.to_dense() if hasattr(jac, "to_dense") else jac for jac in jacobians]
            torch.save(
                {"prediction": prediction, "target": target, "dense": dense, "k": jacobians[0].left.shape[-1]}, out
            )
        # Both ranks leave together: rank 0 (the store's host) once hung in destroy_process_group under torch 2.6
        # after rank 1 had exited while it was still saving.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_factored_blocks_with_different_positions_per_process_are_gathered_zero_padded(tmp_path):
    """Text batches padded to different lengths on different processes: a factored block's positions differ; the
    gather pads the shorter with zero positions (which add exactly nothing) instead of failing on the shapes."""
    out = tmp_path / "ragged.pt"
    mp.start_processes(ragged_worker, args=(2, free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    got = torch.load(out)
    mine = [ragged_blocks(rank) for rank in range(2)]
    assert got["k"] == 4
    assert torch.equal(got["prediction"], torch.cat([m[0] for m in mine]))
    assert torch.equal(got["target"], torch.cat([m[1] for m in mine]))
    for index, dense in enumerate(got["dense"]):
        expected = [m[2][index] for m in mine]
        expected = torch.cat([e.to_dense() if hasattr(e, "to_dense") else e for e in expected])
        assert torch.equal(dense, expected), index


ROOT = Path(__file__).resolve().parents[1]


def _loko_command(tmp_path, name, *extra, every=6, samples=24, callbacks=(), guard_every=100):
    """The ``loko fit`` command line of a debug-config run writing into ``tmp_path``, and its environment."""
    args = outputs(tmp_path, name, every=every, keep_all=True, plot=False, guard_every=guard_every)
    config = yaml.safe_load(Path(args[1]).read_text())
    checksum = {"class_path": "ddp_checksum.Checksum", "init_args": {"path": str(tmp_path / f"{name}.pt")}}
    config["trainer"]["callbacks"] += [checksum, *callbacks]
    Path(args[1]).write_text(yaml.safe_dump(config))
    command = [
        sys.executable, "-m", "loko_lightning.cli", "fit", "--config", str(ROOT / "configs" / "debug.yaml"),
        "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
        "--data.max_samples", str(samples), "--data.eval_max_samples", "8", *args, *extra,
    ]  # fmt: skip
    # One intra-op thread per process whatever the machine's cores (Lightning would give cores // processes): the bits
    # these tests compare depend on it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    return command, env


def loko_ddp(tmp_path, name, *extra, every=6, samples=24, callbacks=(), guard_every=100):
    """``loko fit`` on the debug config under DDP (2 CPU processes, gloo) in a subprocess, as a user runs it."""
    command, env = _loko_command(tmp_path, name, *extra, every=every, samples=samples, callbacks=callbacks,
                                 guard_every=guard_every)  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp_path / f"{name}.pt"), tmp_path / name / "checkpoints", done.stderr


def loko_two_nodes(tmp_path, name, *extra, every=6, samples=24):
    """``loko fit`` as 2 "nodes" of one process each, started by hand as on a cluster without a launcher: the same
    command on each node with ``--trainer.num_nodes 2 --trainer.devices 1`` and ``NODE_RANK`` 0 and 1, the master's
    address and port in the environment (here loopback: both "nodes" are this machine)."""
    nodes = ("--trainer.num_nodes", "2", "--trainer.devices", "1")
    command, env = _loko_command(tmp_path, name, *nodes, *extra, every=every, samples=samples)
    env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(command, cwd=tmp_path, env={**env, "NODE_RANK": str(node)}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
        for node in range(2)
    ]  # fmt: skip
    errors = [proc.communicate(timeout=600)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    return torch.load(tmp_path / f"{name}.pt"), tmp_path / name / "checkpoints"


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One 2-process ``loko fit`` of 24 samples (12 joint steps), checkpoints every 6 steps, shared by the tests."""
    tmp_path = tmp_path_factory.mktemp("two_processes")
    return loko_ddp(tmp_path, "full")


def test_loko_fit_under_ddp_stays_in_sync_and_resumes_exactly(tmp_path, two_processes):
    """A real `loko fit --trainer.strategy ddp --trainer.devices 2`: 24 samples in 12 joint steps of 2; both ranks end
    with the same θ̃, p̂ and R; a run resumed under DDP from the step-6 checkpoint ends bit for bit like it."""
    full, checkpoints, _ = two_processes
    assert full["world_size"] == 2
    first, second = full["states"]
    assert torch.equal(first, second)
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["global_step"] == 12
    assert last["state_dict"]["online_acc.weight"].item() == 24  # every rank's predictions scored once
    assert last["StreamDataModule"]["position"] == 24

    middle = str(checkpoints / "epoch=0-step=6.ckpt")
    resumed, resumed_checkpoints, _ = loko_ddp(tmp_path, "resumed", "--ckpt_path", middle)
    assert torch.equal(resumed["states"][0], first) and torch.equal(resumed["states"][1], first)
    again = torch.load(resumed_checkpoints / "last.ckpt", weights_only=False)
    for key in ("online_acc.mean_value", "online_acc.weight", "loss_avg.buffer", "loss_avg.count"):
        assert torch.equal(again["state_dict"][key], last["state_dict"][key]), key


def test_the_image_default_under_ddp_scores_every_process_s_averaged_predictions(tmp_path, two_processes):
    """``presets/loko_images`` (the averaged mean, the shared head covariance) under DDP, refused before (the averaged
    mean predicted each process's own samples only): both processes' averaged predictions are gathered and scored
    once each, and the ranks stay in sync."""
    preset = str(ROOT / "configs" / "presets" / "loko_images.yaml")
    averaged, checkpoints, _ = loko_ddp(tmp_path, "images", "--config", preset)
    first, second = averaged["states"]
    assert torch.equal(first, second)
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["state_dict"]["online_acc.weight"].item() == 24  # every rank's predictions scored once
    assert last["hyper_parameters"]["head_covariance"] == "shared"
    # The scores are the averaged mean's, not the filter's: the same stream without the average scores otherwise.
    plain = torch.load(two_processes[1] / "last.ckpt", weights_only=False)
    nll = [key for key in last["state_dict"] if key.startswith("nll.")]
    assert nll and any(not torch.equal(last["state_dict"][k], plain["state_dict"][k]) for k in nll)


def test_the_mixture_under_ddp_learns_every_process_s_samples_in_step_and_resumes_exactly(tmp_path):
    """The image default with its mixture (``presets/loko_images`` + ``presets/loko_mixture_lda``, its pools and
    nearest class mean and its recalibration) under DDP, refused before (its state was one process's): every process
    mixes and learns from both processes' samples in rank order, so the mixture's weights, LDA's hits and head, the
    nearest-mean head and the recalibration's bins are the same on both ranks (in the checksum), LDA and the bins
    counted each of the 24 samples once, every prediction was scored once, and a run resumed under DDP from the step-6
    checkpoint ends bit for bit like the whole one."""
    presets = []
    for name in ("loko_images", "loko_mixture_lda"):
        presets += ["--config", str(ROOT / "configs" / "presets" / f"{name}.yaml")]
    presets += [NEAREST_MEAN]
    full, checkpoints, _ = loko_ddp(tmp_path, "mixture", *presets)
    first, second = full["states"]
    assert torch.equal(first, second)
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["state_dict"]["online_acc.weight"].item() == 24  # every rank's predictions scored once
    spec = last["hyper_parameters"]["mixture"]
    assert spec["nearest_mean"] is True and spec["pools"] == [0.5, 1.0]
    mixture = last["loko_mixture"]
    (lda,) = mixture["lda"]["state"].values()
    assert float(mixture["seen"]) == 24 and lda["count"].sum().item() == 24 and lda["samples"].item() == 24
    assert spec["calibration"] == 300 and float(mixture["bin_counts"].sum()) == 24
    assert mixture["log_weights"].exp().max() < 1  # the weights moved from the prior, not to one expert
    middle = str(checkpoints / "epoch=0-step=6.ckpt")
    resumed, _, _ = loko_ddp(tmp_path, "mixture_resumed", *presets, "--ckpt_path", middle)
    assert torch.equal(resumed["states"][0], first) and torch.equal(resumed["states"][1], first)


def test_the_prior_scale_under_ddp_stays_in_sync_and_resumes_exactly(tmp_path):
    """The text default's filter (``presets/loko_text``: ``p0`` 10, the prior's scale set online, the shared head
    covariance) on the debug network under DDP: each joint step's scale comes from both processes' innovations, the
    ranks end identical, every sample scored once, and a run resumed from the step-6 checkpoint ends bit for bit like
    it. The same filter with the sharded update (a covariance per head row) stays in sync too."""
    preset = ("--config", str(ROOT / "configs" / "presets" / "loko_text.yaml"))
    full, checkpoints, _ = loko_ddp(tmp_path, "scaled", *preset)
    first, second = full["states"]
    assert torch.equal(first, second)
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["state_dict"]["online_acc.weight"].item() == 24
    assert last["hyper_parameters"]["head_covariance"] == "shared"
    middle = str(checkpoints / "epoch=0-step=6.ckpt")
    resumed, _, _ = loko_ddp(tmp_path, "scaled_resumed", *preset, "--ckpt_path", middle)
    assert torch.equal(resumed["states"][0], first) and torch.equal(resumed["states"][1], first)
    shard = ("--model.optimizer.init_args.shard", "true", "--model.head_covariance", "diagonal")
    sharded, _, _ = loko_ddp(tmp_path, "scaled_sharded", *preset, *shard)
    assert torch.equal(sharded["states"][0], sharded["states"][1])
    assert max(sharded["held"]) < sharded["parameters"]


def test_the_image_default_with_the_sharded_update_stays_in_sync(tmp_path):
    """``loko fit`` deciding the default under DDP with ``shard: true``: the image default with a covariance per head
    row, its averaged mean and its mixture, each process updating its own shard; the ranks end identical (θ̃, p̂, R and
    the mixture's state), every sample scored once."""
    shard = ("--loko", "default", "--model.optimizer.init_args.shard", "true")
    full, checkpoints, log = loko_ddp(tmp_path, "sharded_default", *shard)
    assert "presets/loko_images with a covariance per head row" in log
    first, second = full["states"]
    assert torch.equal(first, second)
    assert max(full["held"]) < full["parameters"]  # sharded: each process held p̂ of its own parameters only
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["state_dict"]["online_acc.weight"].item() == 24 and float(last["loko_mixture"]["seen"]) == 24
    assert last["hyper_parameters"]["head_covariance"] == "diagonal"
    assert last["hyper_parameters"]["mixture"]["nearest_mean"] is True  # as every image default


def test_a_sharded_loko_fit_stays_in_sync_checkpoints_the_whole_state_and_resumes_exactly(tmp_path, two_processes):
    """``--model.optimizer.init_args.shard true``: each process updates its shard of the adapters; the ranks end with
    the same θ̃, p̂ (gathered) and R, every sample is scored once, the checkpoints and the divergence guard's records
    hold every parameter's p̂ (gathered by consolidate_state_dict on every process), and a run resumed from the
    step-6 checkpoint ends bit for bit like the uninterrupted one. Against the replicated run only the order of one
    sum differs, which float32 steps amplify: the bound against the replicated update is tested in test_sharded.py
    (float64), the gap is printed here."""
    shard = ("--model.optimizer.init_args.shard", "true")
    # The divergence guard keeps the state of every 4th step (the whole state, gathered on every process).
    full, checkpoints, _ = loko_ddp(tmp_path, "sharded", *shard, guard_every=4)
    first, second = full["states"]
    assert torch.equal(first, second)
    # The update was sharded: each process held p̂ of its own parameters only (all of them between them), where the
    # replicated run held every one on every process.
    parameters = full["parameters"]
    assert sum(full["held"]) == parameters and max(full["held"]) < parameters
    assert two_processes[0]["held"] == [parameters, parameters]
    replicated = two_processes[0]["states"][0]
    print(f"sharded vs replicated: largest difference {(first - replicated).abs().max().item():.3g}")
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["global_step"] == 12 and last["state_dict"]["online_acc.weight"].item() == 24
    state = last["optimizer_states"][0]["state"]
    params = trainable(last["state_dict"])
    assert sorted(state) == list(range(len(params)))
    shapes = sorted(tuple(state[i]["cov"].shape) for i in range(len(params)))
    assert shapes == sorted(tuple(p.shape) for p in params.values())
    middle = str(checkpoints / "epoch=0-step=6.ckpt")
    resumed, _, _ = loko_ddp(tmp_path, "sharded_resumed", *shard, "--ckpt_path", middle, guard_every=4)
    assert torch.equal(resumed["states"][0], first) and torch.equal(resumed["states"][1], first)

    # The same checkpoint resumed by one process, unsharded: the whole state loads, the pass goes on at the next
    # unseen sample (12 more steps of one sample) and scores every sample once.
    single = ("--trainer.strategy", "auto", "--trainer.devices", "1", "--model.optimizer.init_args.shard", "false")
    alone, alone_checkpoints, _ = loko_ddp(tmp_path, "sharded_resumed_alone", *single, "--ckpt_path", middle)
    assert alone["world_size"] == 1 and alone["held"] == [parameters]
    assert torch.isfinite(alone["states"]).all()
    again = torch.load(alone_checkpoints / "last.ckpt", weights_only=False)
    assert again["global_step"] == 6 + 12 and again["state_dict"]["online_acc.weight"].item() == 24
    assert again["StreamDataModule"]["position"] == 24


def test_one_sharded_step_is_the_replicated_step_within_its_rounding_bound(tmp_path):
    """One joint step of 2 processes (one sample each) through ``loko fit`` in float64 (``--trainer.precision
    64-true``: the network, its Jacobians and the filter), sharded and replicated. Only the order of the sum
    ``H P Hᵀ`` differs (shard by shard instead of kind by kind): a relative perturbation of ``S`` of at most about
    ``ñ·eps`` of ``|H| P |H|ᵀ``, so the update and ``(K H)_ii`` differ by at most about ``cond(S)·ñ·eps`` relative
    (sharded.py's derivation; 10x for the sums forming ``S`` itself), plus one rounding of ``θ̃ + Δθ̃``."""
    one_step = ("--trainer.precision", "64-true")
    replicated, _, _ = loko_ddp(tmp_path, "replicated64", *one_step, samples=2)
    sharded, _, _ = loko_ddp(tmp_path, "sharded64", *one_step, "--model.optimizer.init_args.shard", "true", samples=2)
    parameters = replicated["parameters"]
    assert max(sharded["held"]) < parameters and replicated["held"] == [parameters, parameters]
    theta0, cov0 = replicated["start"]["theta"], replicated["start"]["cov"]
    assert torch.equal(theta0, sharded["start"]["theta"]) and torch.equal(cov0, sharded["start"]["cov"])
    n, eps = theta0.numel(), torch.finfo(torch.float64).eps
    bound = 10 * replicated["cond"] * n * eps
    rep, shard = replicated["states"][0], sharded["states"][0]
    assert torch.equal(shard, sharded["states"][1])
    step = (rep[:n] - theta0).abs().max()
    assert step > 0
    assert ((shard[:n] - rep[:n]).abs() <= bound * step + eps * rep[:n].abs()).all()
    assert ((shard[n : 2 * n] - rep[n : 2 * n]).abs() <= bound * cov0).all()


def test_two_nodes_of_one_process_equal_one_node_of_two_and_resume_exactly(tmp_path, two_processes):
    """2 "nodes" × 1 process (``NODE_RANK`` 0 and 1, ``--trainer.num_nodes 2``, loopback) through the real ``loko fit``:
    the ranks end bit-equal, and equal to one node of 2 processes (the same W = 2, the same stream split, the same
    thread count per process); the metrics cover every sample once; a 2-node run resumed from the step-6 checkpoint
    ends bit for bit like them."""
    full, _, _ = two_processes
    nodes, checkpoints = loko_two_nodes(tmp_path, "nodes")
    assert nodes["world_size"] == 2
    assert torch.equal(nodes["states"][0], nodes["states"][1])
    assert torch.equal(nodes["states"][0], full["states"][0])
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["global_step"] == 12 and last["state_dict"]["online_acc.weight"].item() == 24
    resumed, _ = loko_two_nodes(tmp_path, "nodes_resumed", "--ckpt_path", str(checkpoints / "epoch=0-step=6.ckpt"))
    assert torch.equal(resumed["states"][0], full["states"][0]) and torch.equal(resumed["states"][1], full["states"][0])


def test_a_resume_with_another_number_of_processes_goes_on_at_the_next_unseen_sample(tmp_path, two_processes):
    """The step-6 checkpoint of 2 processes (12 samples), resumed by one process, and the step-12 checkpoint of one
    process, resumed by 2: each goes on at the next unseen stream position and ends the pass after the last sample,
    every sample scored once and none trained twice (the filter's state does not depend on the number of processes;
    the trajectory does, as a joint update of 2 samples is not two updates of one)."""
    single = ["--trainer.strategy", "auto", "--trainer.devices", "1"]
    _, two, _ = two_processes
    _, one, _ = loko_ddp(tmp_path, "one", *single)
    for name, checkpoint, extra, steps in (
        ("two-then-one", two / "epoch=0-step=6.ckpt", single, 6 + 12),
        ("one-then-two", one / "epoch=0-step=12.ckpt", (), 12 + 6),
    ):
        result, checkpoints, _ = loko_ddp(tmp_path, name, *extra, "--ckpt_path", str(checkpoint))
        states = result["states"]  # one process: its own vector; two: one row per rank
        assert states.dim() == 1 or torch.equal(states[0], states[1]), name
        last = torch.load(checkpoints / "last.ckpt", weights_only=False)
        assert last["StreamDataModule"]["position"] == 24 and last["StreamDataModule"]["steps"] == steps, name
        assert last["global_step"] == steps, name
        assert last["state_dict"]["online_acc.weight"].item() == 24, name  # every sample scored once
        assert last["optimizer_states"][0]["state"][0]["step"].item() == steps, name  # one update per step


@pytest.mark.parametrize("signal", ["SIGKILL", "SIGSTOP"], ids=["killed", "hung"])
def test_a_lost_process_ends_the_run_in_one_line_and_resumes_exactly(tmp_path, two_processes, signal):
    """Rank 1 dies (SIGKILL) or hangs (SIGSTOP) before step 7, after the step-6 checkpoint: the survivor (rank 0)
    exits within a bounded time (the 5-second collective timeout for the hang) with one line naming the lost rank, the
    checkpoint and the resume command, no traceback; ``--ckpt_path last`` then ends bit for bit like the uninterrupted
    run (checked after the kill; the hang leaves the same checkpoint)."""
    lose = {"class_path": "ddp_checksum.LoseOneRank", "init_args": {"rank": 1, "step": 6, "signal": signal}}
    command, env = _loko_command(tmp_path, "lost", "--model.collective_timeout", "5", callbacks=[lose])
    started = time.monotonic()
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - started
    assert done.returncode == 4, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("loko: error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    checkpoints = tmp_path / "lost" / "checkpoints"
    assert "lost rank 1 of the 2 processes at training step 7" in lines[0]
    assert str(checkpoints) in lines[0] and "--ckpt_path last" in lines[0]
    assert elapsed < 120, elapsed  # the run itself takes about 30 s here; a hang would wait for the timeout
    if signal == "SIGSTOP":
        return  # the checkpoint is the same as when rank 1 is killed: its resume is checked there
    full, _, _ = two_processes
    resumed, _, _ = loko_ddp(tmp_path, "lost_resumed", "--ckpt_path", str(checkpoints / "last.ckpt"))
    assert torch.equal(resumed["states"][0], full["states"][0]) and torch.equal(resumed["states"][1], full["states"][0])


def test_gradient_baseline_under_ddp_all_reduces_and_scores_every_process(tmp_path):
    """AdamW under DDP: DDP's gradient all-reduce keeps the ranks' parameters equal; the metrics count both ranks."""
    adamw = ["--config", str(ROOT / "configs" / "baselines" / "adamw.yaml"), "--model.lr_scheduler.total_iters", "6"]
    result, checkpoints, _ = loko_ddp(tmp_path, "adamw", *adamw, every=3, samples=12)
    assert torch.equal(result["states"][0], result["states"][1])
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["global_step"] == 6 and last["state_dict"]["online_acc.weight"].item() == 12


def test_a_nan_on_one_process_skips_the_joint_step_everywhere(tmp_path):
    """AdamW under DDP with a NaN input on rank 1 at step 2: the processes agree to skip that step (no process waits
    alone in DDP's all-reduce), stay in sync, and count both samples of the step as skipped; rank 0's finite
    prediction is scored, the NaN one is not."""
    adamw = ["--config", str(ROOT / "configs" / "baselines" / "adamw.yaml"), "--model.lr_scheduler.total_iters", "6"]
    poison = {"class_path": "ddp_checksum.PoisonOneRank", "init_args": {"rank": 1, "step": 2}}
    result, checkpoints, _ = loko_ddp(tmp_path, "nan", *adamw, every=3, samples=12, callbacks=[poison])
    assert torch.equal(result["states"][0], result["states"][1])
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["global_step"] == 6 and last["state_dict"]["skipped"].item() == 2
    assert last["state_dict"]["online_acc.weight"].item() == 11


def test_a_nan_on_one_process_skips_the_loko_joint_step_on_both(tmp_path):
    """LoKO under DDP with a NaN input on rank 1 at step 2 (of 6): both ranks gather the non-finite observation and
    skip the joint update alike. The checkpoints around that step hold the same parameters, p̂, R and update count;
    the ranks end in sync, with both samples of the step counted as skipped; rank 0's finite prediction of that step,
    made before the update, is scored and the NaN one is left out of the online metrics."""
    poison = {"class_path": "ddp_checksum.PoisonOneRank", "init_args": {"rank": 1, "step": 2}}
    result, checkpoints, _ = loko_ddp(tmp_path, "loko_nan", every=1, samples=12, callbacks=[poison])
    assert torch.equal(result["states"][0], result["states"][1])
    before = torch.load(checkpoints / "epoch=0-step=2.ckpt", weights_only=False)
    after = torch.load(checkpoints / "epoch=0-step=3.ckpt", weights_only=False)
    before_params, after_params = trainable(before["state_dict"]), trainable(after["state_dict"])
    assert before_params and all(torch.equal(before_params[k], after_params[k]) for k in before_params)
    before_opt, after_opt = before["optimizer_states"][0]["state"], after["optimizer_states"][0]["state"]
    for index, state in before_opt.items():
        for key in ("cov", "R", "step"):
            if key in state:
                assert torch.equal(state[key], after_opt[index][key]), (index, key)
    assert int(before_opt[0]["step"]) == 2 and int(after_opt[0]["skipped"]) == 1
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["global_step"] == 6 and int(last["optimizer_states"][0]["state"][0]["step"]) == 5
    assert last["state_dict"]["skipped"].item() == 2
    assert last["state_dict"]["online_acc.weight"].item() == 11
    assert not all(torch.equal(after_params[k], v) for k, v in trainable(last["state_dict"]).items())


def test_a_streamed_source_under_ddp_splits_each_step_and_resumes_exactly(tmp_path):
    """`--data.source HFStream --data.source.path parquet` under DDP (2 processes): every process reads the stream
    and trains on its share of each step, the ranks stay bit-equal, every sample is scored once, and a run resumed
    from the step-6 checkpoint ends bit for bit like the uninterrupted one."""
    from test_streaming import write_parquet

    root = write_parquet(tmp_path / "data", n_train=30)
    data = ("--data.source", "HFStream", "--data.source.path", "parquet", "--data.source.root", str(root),
            "--data.source.shuffle_buffer", "7")  # fmt: skip
    full, checkpoints, _ = loko_ddp(tmp_path, "streamed", *data)
    assert torch.equal(full["states"][0], full["states"][1])
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert last["global_step"] == 12 and last["state_dict"]["online_acc.weight"].item() == 24
    assert last["StreamDataModule"]["position"] == 24
    middle = str(checkpoints / "epoch=0-step=6.ckpt")
    resumed, _, _ = loko_ddp(tmp_path, "streamed_resumed", *data, "--ckpt_path", middle)
    assert torch.equal(resumed["states"][0], full["states"][0]) and torch.equal(resumed["states"][1], full["states"][0])
