"""``data.batch_size`` B in the learner and the stream: joint updates, prequential counting, exact resume."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from data_files import N_TRAIN
from runs import loader, stream, tiny
from runs import trainer as quiet
from test_stream import Recorder, SaveAt, quiet_trainer, trainer
from torch.nn import functional as F
from torch.utils.data import DataLoader

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.data import CIFAR10, StreamDataModule
from loko_lightning.data.stream import _StreamBatchSampler


def test_batches_of_the_learner_are_joint_loko_steps_scored_before_the_update():
    """B = 3: the module equals LoKO.step on engine.batch closures, bit for bit, and its online accuracy counts all
    six predictions, each made before the update of its step."""
    torch.manual_seed(0)
    module = tiny(p0=0.05, p0_init="constant")
    reference = copy.deepcopy(module.network)
    items = stream(6)
    t = quiet()
    t.fit(module, DataLoader(items, batch_size=3))
    assert t.global_step == 2

    params = [p for p in reference.parameters() if p.requires_grad]
    opt = LoKO(params, p0=0.05, p0_init="constant")
    correct, l1 = [], []
    with JacobianEngine(reference, params, factorize=True) as engine:
        for start in (0, 3):
            chunk = items[start : start + 3]
            x = torch.stack([item["inputs"] for item in chunk])
            y = F.one_hot(torch.stack([item["label"] for item in chunk]), 4).float()

            def closure(x=x, y=y):
                prediction, jacobians = engine.batch(x)
                return prediction, y, jacobians

            prediction, _, _ = opt.step(closure)
            correct += (prediction.argmax(-1) == y.argmax(-1)).tolist()
            l1 += (y - prediction).abs().sum(-1).tolist()
    for p, q in zip(params, module.trainable_parameters, strict=True):
        assert torch.equal(p, q)
    assert module.online_acc.weight.item() == 6
    assert module.online_acc.compute().item() == pytest.approx(sum(correct) / 6, abs=1e-7)
    # Float32 sums of the same six values in the same order: equal up to one rounding of the last digit.
    assert module.loss_avg.compute().item() == pytest.approx(sum(l1) / 6, rel=1e-6)


def test_batch_of_one_learner_is_unchanged():
    """batch_size 1 takes the single-sample path: the same parameters as LoKO.step on single samples."""
    torch.manual_seed(0)
    module = tiny(p0=0.05, p0_init="constant")
    reference = copy.deepcopy(module.network)
    items = stream(3)
    quiet().fit(module, loader(items))
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = LoKO(params, p0=0.05, p0_init="constant")
    with JacobianEngine(reference, params, factorize=True) as engine:
        for item in items:
            y = F.one_hot(item["label"], 4).float()

            def closure(x=item["inputs"][None], y=y):
                prediction, jacobians = engine(x)
                return prediction, y, jacobians

            opt.step(closure)
    for p, q in zip(params, module.trainable_parameters, strict=True):
        assert torch.equal(p, q)


def test_nonfinite_sample_in_a_joint_step_skips_the_whole_step():
    """B = 3, a NaN in the second sample of step 2: that joint update is skipped (parameters, p̂, R and LoKO's counter
    as after step 1), all three samples of the step are counted in ``skipped``, the NaN one is left out of the metrics
    while the two finite predictions, made before the update, are scored, and the steps around it are applied."""
    torch.manual_seed(0)
    module = tiny(p0=0.05, p0_init="constant")
    items = stream(9)
    items[4]["inputs"] = items[4]["inputs"].clone()
    items[4]["inputs"][1, 2, 3] = float("nan")
    states = []

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            optimizer = trainer.optimizers[0]
            params = pl_module.trainable_parameters
            shared = optimizer.state[params[0]]
            states.append(
                {
                    "params": [p.detach().clone() for p in params],
                    "cov": [optimizer.state[p]["cov"].clone() for p in params],
                    "R": shared["R"].clone(),
                    "step": int(shared["step"]),
                    "skipped": int(shared["skipped"]),
                    "module_skipped": int(pl_module.skipped),
                }
            )

    t = quiet(callbacks=[Snapshot()])
    t.fit(module, DataLoader(items, batch_size=3))
    assert t.global_step == 3
    first, poisoned, last = states
    for key in ("params", "cov"):
        assert all(torch.equal(a, b) for a, b in zip(first[key], poisoned[key], strict=True)), key
    assert torch.equal(first["R"], poisoned["R"]) and first["R"].any()
    assert [s["step"] for s in states] == [1, 1, 2] and [s["skipped"] for s in states] == [0, 1, 1]
    assert [s["module_skipped"] for s in states] == [0, 3, 3]  # every sample of the skipped step
    assert not all(torch.equal(a, b) for a, b in zip(poisoned["params"], last["params"], strict=True))
    assert all(torch.isfinite(p).all() for p in module.trainable_parameters)
    assert float(t.logged_metrics["train/skipped"]) == 3
    assert module.online_acc.weight.item() == 8 and int(module.loss_avg.count) == 8


def test_gradient_baseline_takes_the_mean_loss_of_a_batch():
    """One AdamW step on a batch of 4 equals a hand-made AdamW step on the mean cross-entropy of the 4 samples.

    Adam's first step, ``lr · g / (|g| + eps)``, does not depend on the scale of ``g`` when eps is negligible, so
    eps = 1e-3 (the size of these gradients) makes it depend on it: a sum of the losses (4x the gradient) or one
    sample's loss would step differently. The reference uses the same float32 gradient; its AdamW arithmetic is in
    float64, torch's in float32: each of its few operations rounds to float32, a few ulps of ``|θ|`` and of the step
    (at most ``lr``), hence ``4 eps32 (|θ| + lr)``.
    """
    torch.manual_seed(0)
    lr, eps, weight_decay = 1e-2, 1e-3, 0.01
    module = tiny(optimizer="adamw", lr=lr, eps=eps, weight_decay=weight_decay, head_init="timm")
    reference = copy.deepcopy(module).train()
    items = stream(4)
    t = quiet()
    t.fit(module, DataLoader(items, batch_size=4))
    assert t.global_step == 1 and module.online_acc.weight.item() == 4

    x = torch.stack([item["inputs"] for item in items])
    labels = torch.stack([item["label"] for item in items])
    params = reference.trainable_parameters
    grads = torch.autograd.grad(F.cross_entropy(reference(x), labels), params)  # the mean over the batch
    float32 = torch.finfo(torch.float32).eps
    moved = 0
    for before, g, after in zip(params, grads, module.trainable_parameters, strict=True):
        theta, g = before.detach().double(), g.double()
        m_hat, v_hat = g, g * g  # the first step's bias-corrected moments: (1 - β1) g / (1 - β1), (1 - β2) g² / ...
        expected = theta * (1 - lr * weight_decay) - lr * m_hat / (v_hat.sqrt() + eps)
        error = (after.detach().double() - expected).abs()
        assert (error <= 4 * float32 * (theta.abs() + lr)).all(), error.max()
        moved += int((g.abs() > eps).sum())
    assert moved > 0  # some steps are far from the weight decay alone


@pytest.mark.parametrize(("length", "batch", "world"), [(20, 3, 2), (21, 2, 2), (7, 1, 2), (10, 4, 1), (9, 2, 3)])
def test_ranks_take_disjoint_chunks_of_every_step_in_stream_order(length, batch, world):
    samplers = [_StreamBatchSampler(length, 0, batch, world, rank) for rank in range(world)]
    steps = [list(s) for s in samplers]
    assert len({len(s) for s in steps}) == 1 and all(len(s) == len(steps[0]) for s in samplers)
    order = [p for step in zip(*steps, strict=True) for chunk in step for p in chunk]
    assert all(chunk for s in steps for chunk in s)  # every rank has a sample in every step
    tail = length % (batch * world)
    dropped = tail if tail < world else 0  # a last step that cannot give every rank a sample is left out
    assert order == list(range(length - dropped))
    for step in zip(*steps, strict=True):  # every rank knows where the whole step ends
        end = max(p for chunk in step for p in chunk) + 1
        assert all(s.step_end(p) == end for s, chunk in zip(samplers, step, strict=True) for p in chunk)


@quiet_trainer
def test_batched_stream_resumes_mid_stream_exactly(cifar10, tmp_path):
    """batch_size 3: a checkpoint after step 2 resumes at position 6; together the runs see every position once."""

    class BatchRecorder(Recorder):
        def training_step(self, batch, batch_idx):
            pairs = zip(batch["position"], batch["inputs"], strict=True)
            self.seen += [(int(p), False, float(x.double().sum())) for p, x in pairs]
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward((self.weight * batch["inputs"].mean()).sum())
            optimizer.step()

    def datamodule():
        return StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), seed=3, batch_size=3)

    ckpt = tmp_path / "mid.ckpt"
    full = BatchRecorder()
    trainer(tmp_path, callbacks=[SaveAt(ckpt, 2)]).fit(full, datamodule=datamodule())
    assert [p for p, _, _ in full.seen] == list(range(N_TRAIN))
    saved = torch.load(ckpt, weights_only=False)
    assert saved["StreamDataModule"]["position"] == 6
    resumed = BatchRecorder()
    trainer(tmp_path).fit(resumed, datamodule=datamodule(), ckpt_path=ckpt)
    assert resumed.seen == full.seen[6:]


@quiet_trainer
@pytest.mark.parametrize(("before", "after"), [(3, 2), (1, 4), (4, 1)], ids=["3-to-2", "1-to-4", "4-to-1"])
def test_resume_with_another_batch_size_continues_at_the_next_unseen_position(cifar10, tmp_path, before, after):
    """The checkpoint holds the stream position, not a batch count: a run resumed with another batch_size starts at
    the first position not trained on and goes on in steps of the new size, so the two runs together train on every
    position once, in stream order (the filter's state does not depend on the batch size)."""

    class BatchRecorder(Recorder):
        def training_step(self, batch, batch_idx):
            self.seen += [int(p) for p in batch["position"]]
            self.sizes.append(len(batch["position"]))
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward((self.weight * batch["inputs"].mean()).sum())
            optimizer.step()

    def datamodule(batch_size):
        return StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), seed=3, batch_size=batch_size)

    ckpt = tmp_path / "mid.ckpt"
    first = BatchRecorder()
    first.sizes = []
    trainer(tmp_path, callbacks=[SaveAt(ckpt, 2)]).fit(first, datamodule=datamodule(before))
    position = torch.load(ckpt, weights_only=False)["StreamDataModule"]["position"]
    assert position == 2 * before
    resumed = BatchRecorder()
    resumed.sizes = []
    trainer(tmp_path).fit(resumed, datamodule=datamodule(after), ckpt_path=ckpt)
    assert first.seen[:position] + resumed.seen == list(range(N_TRAIN))
    assert resumed.sizes == [after] * ((N_TRAIN - position) // after) + [(N_TRAIN - position) % after] * (
        (N_TRAIN - position) % after > 0
    )
