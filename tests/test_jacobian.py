import gc
import re
import sys
import weakref

import pytest
import timm
import torch
from peft import LoraConfig, get_peft_model
from timm.layers import BatchNormAct2d
from torch import nn

import loko_lightning.jacobians.reverse as jacobian_pass
from loko_lightning import JacobianEngine, OuterJacobian, jacobian
from loko_lightning.jacobians.blocks import FactoredJacobian, factored_is_cheaper
from loko_lightning.models.adapters import freeze_normalization


def row_by_row(model, x, params, observation="softmax"):
    """The obvious Jacobian: one backward pass per output row."""
    logits = model(x).reshape(-1)
    y = torch.softmax(logits, 0) if observation == "softmax" else logits
    rows = [torch.autograd.grad(y[a], params, retain_graph=True, allow_unused=True) for a in range(y.shape[0])]
    jacs = []
    for i, p in enumerate(params):
        jacs.append(torch.stack([r[i] if r[i] is not None else torch.zeros_like(p) for r in rows]))
    return y.detach(), jacs


def dense(jac):
    return jac.to_dense() if isinstance(jac, (OuterJacobian, FactoredJacobian)) else jac


@pytest.fixture(params=["jacobian", "engine"])
def via(request):
    """How the oracle tests compute: ``jacobian()`` per call, or one ``JacobianEngine`` reused over several inputs."""
    return request.param


def compute(model, xs, params=None, via="jacobian", **kwargs):
    """``(prediction, jacobians)`` for each input: by ``jacobian()``, or by one engine built before the first."""
    if via == "jacobian":
        return [jacobian(model, x, params, **kwargs) for x in xs]
    with JacobianEngine(model, params, **kwargs) as engine:
        return [engine(x) for x in xs]


def assert_jacobians_equal(model, x, params=None, via="jacobian", *, nonzero=False, **kwargs):
    """The Jacobian at ``x`` equals row-by-row autograd; an engine is also checked on two further inputs after it.

    ``nonzero``: also assert that every reference block has a non-zero entry, so no comparison is vacuous.
    """
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    xs = [x] if via == "jacobian" else [x, torch.randn_like(x), 2 * torch.randn_like(x)]
    results = compute(model, xs, params, via, **kwargs)
    for x_i, (prediction, jacs) in zip(xs, results, strict=True):
        ref_prediction, ref_jacs = row_by_row(model, x_i, params, kwargs.get("observation", "softmax"))
        # Same float32 arithmetic; the batched backward may sum in another order, so allow a few ulps of the
        # largest entry (torch's float32 defaults: rtol 1.3e-6, atol 1e-5).
        torch.testing.assert_close(prediction, ref_prediction)
        assert len(jacs) == len(params)
        for jac, ref, p in zip(jacs, ref_jacs, params, strict=True):
            assert tuple(jac.shape) == (prediction.shape[0], *p.shape)
            torch.testing.assert_close(dense(jac), ref)
            assert not nonzero or ref.abs().max() > 0, "an all-zero block compares nothing"
    return results[0][1]


@pytest.mark.parametrize("observation", ["softmax", "regression"])
@pytest.mark.parametrize("factorize", [False, True])
def test_mlp(observation, factorize, via):
    model = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 5))
    jacs = assert_jacobians_equal(model, torch.randn(1, 6), via=via, observation=observation, factorize=factorize)
    assert isinstance(jacs[2], OuterJacobian) == factorize


def test_chunked_equals_unchunked(via):
    model = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 7))
    xs = [torch.randn(1, 6) for _ in range(3)]
    full = compute(model, xs, via=via)
    chunked = compute(model, xs, via=via, chunk_size=3)
    for (_, a), (_, b) in zip(full, chunked, strict=True):
        for jac_a, jac_b in zip(a, b, strict=True):
            torch.testing.assert_close(jac_a, jac_b)


class TinyConvNet(nn.Module):
    def __init__(self, m=4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, m)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def test_conv_net_with_batchnorm_in_eval_mode(via):
    model = TinyConvNet()
    # Non-trivial running statistics, so eval-mode BatchNorm is not the identity.
    model.train()
    model(torch.randn(16, 3, 8, 8) * 2 + 1)
    model.eval()
    stats = model.bn1.running_mean.clone()
    assert_jacobians_equal(model, torch.randn(1, 3, 8, 8), via=via)
    assert_jacobians_equal(model, torch.randn(1, 3, 8, 8), via=via, factorize=True)
    assert torch.equal(model.bn1.running_mean, stats)


def test_batchnorm_in_training_mode_is_refused():
    model = TinyConvNet().train()
    with pytest.raises(ValueError, match=r"'bn1'.*training mode.*eval"):
        jacobian(model, torch.randn(1, 3, 8, 8))


def test_batchnorm_switched_to_training_mode_after_building_is_refused():
    model = TinyConvNet().eval()
    x = torch.randn(1, 3, 8, 8)
    with JacobianEngine(model) as engine:
        engine(x)
        model.bn2.train()
        with pytest.raises(ValueError, match=r"'bn2'.*training mode.*eval"):
            engine(x)
        assert torch.equal(model.bn2.running_mean, torch.zeros(8))  # refused before the forward pass
        model.eval()
        prediction, _ = engine(x)
    torch.testing.assert_close(prediction, row_by_row(model, x, list(model.parameters()))[0])


def lora_resnet(name, num_classes, r, lora_alpha):
    """A timm ResNet with LoRA on every conv and a new head, in eval mode, with no block whose Jacobian is zero.

    timm zero-initialises the last batch norm scale of every residual block (``zero_init_last``), and peft starts
    LoRA's B at zero: either makes most LoRA blocks' Jacobians exactly zero, so comparing them would test nothing.
    Here every batch norm gets random affine parameters and running statistics and every B is random.
    """
    backbone = timm.create_model(name, pretrained=False, num_classes=num_classes, zero_init_last=False)
    with torch.no_grad():
        for module in backbone.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    convs = [n for n, m in backbone.named_modules() if isinstance(m, nn.Conv2d)]
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=convs, modules_to_save=["fc"])
    model = get_peft_model(backbone, config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)
    return model.eval()


def test_peft_lora_resnet18(via):
    """LoRA rank 4 on every conv of a timm resnet18 and a new trainable 10-class head (peft modules_to_save)."""
    model = lora_resnet("resnet18", num_classes=10, r=4, lora_alpha=4)
    params = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in params) == 148_822
    x = torch.randn(1, 3, 32, 32)
    jacs = assert_jacobians_equal(model, x, params, via=via, factorize=True, nonzero=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    head = names.index(next(n for n in names if n.endswith("fc.modules_to_save.default.weight")))
    assert isinstance(jacs[head], OuterJacobian)
    # Frozen weights received no gradient.
    assert all(p.grad is None for p in model.parameters())


def test_bad_inputs():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"batch dimension 1, got shape \(2, 3\)"):
        jacobian(model, torch.randn(2, 3))
    with pytest.raises(ValueError, match="Invalid observation"):
        jacobian(model, torch.randn(1, 3), observation="sigmoid")
    with pytest.raises(ValueError, match="Invalid chunk_size"):
        JacobianEngine(model, chunk_size=0)
    engine = JacobianEngine(model)
    with pytest.raises(ValueError, match=r"batch dimension 1, got shape \(2, 3\)"):
        engine(torch.randn(2, 3))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine(torch.randn(1, 3))
    with pytest.raises(ValueError, match="no trainable parameters"):
        jacobian(model.requires_grad_(False), torch.randn(1, 3))


# ---------------------------------------------------------------- fast path for Linear / Conv2d weights


def force_factored(monkeypatch):
    """Make ``factorize=True`` return every fast-path weight in factored form, whatever the cost model says."""
    monkeypatch.setattr(jacobian_pass, "factored_is_cheaper", lambda *args: True)


class ConvZoo(nn.Module):
    """Every Conv2d/Linear configuration the fast path handles, plus ones it must leave to autograd."""

    def __init__(self, m=5):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, stride=2, padding=1, bias=False)
        self.dilated = nn.Conv2d(6, 6, 3, padding=2, dilation=2)
        self.same = nn.Conv2d(6, 4, (2, 3), padding="same")  # asymmetric implicit padding
        self.reflect = nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")
        self.valid = nn.Conv2d(4, 4, 2, padding="valid", stride=(1, 2))
        self.pointwise = nn.Conv2d(4, 8, 1)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)  # generic path
        self.tokens = nn.Linear(8, 8)
        self.head = nn.Linear(8, m)

    def forward(self, x):
        x = torch.tanh(self.stem(x))
        x = torch.tanh(self.dilated(x))
        x = torch.tanh(self.same(x))
        x = torch.tanh(self.reflect(x))
        x = torch.tanh(self.valid(x))
        x = torch.tanh(self.grouped(torch.tanh(self.pointwise(x))))
        tokens = x.flatten(2).transpose(1, 2)  # (1, positions, 8)
        tokens = torch.tanh(self.tokens(tokens))
        return self.head(tokens.mean(1))


@pytest.mark.parametrize("observation", ["softmax", "regression"])
@pytest.mark.parametrize("factorize", [False, True])
def test_fast_path_matches_autograd_on_conv_configurations(observation, factorize, via, monkeypatch):
    if factorize:
        force_factored(monkeypatch)
    model = ConvZoo()
    jacs = assert_jacobians_equal(
        model, torch.randn(1, 3, 13, 11), via=via, observation=observation, factorize=factorize
    )
    names = [n for n, p in model.named_parameters()]
    kinds = {n: type(j).__name__ for n, j in zip(names, jacs, strict=True)}
    if factorize:
        assert kinds["stem.weight"] == "FactoredJacobian"
        assert kinds["tokens.weight"] == "FactoredJacobian"
        assert kinds["head.weight"] == "OuterJacobian"
        assert kinds["grouped.weight"] == "Tensor"  # groups > 1: generic path
        assert kinds["dilated.bias"] == "Tensor"
    else:
        assert set(kinds.values()) == {"Tensor"}


def test_unbatched_conv_input_and_batch_folded_inside_the_model(via):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 3, padding=1)
            self.head = nn.Linear(3 * 4 * 4 * 2, 4)

        def forward(self, x):
            a = self.conv(x[0])  # unbatched (C, H, W) input
            b = self.conv(torch.cat([x, x.flip(-1)]))[1:]  # the model makes its own batch of 2
            return self.head(torch.cat([a[None], b]).reshape(1, -1))

    assert_jacobians_equal(Odd(), torch.randn(1, 2, 4, 4), via=via, factorize=True)


def test_shared_layer_and_tied_weight_reuse(via):
    """A layer called twice, and its weight also used outside it: every use is counted."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            h = torch.tanh(self.fc(h))  # the same layer again
            h = h + torch.tanh(h @ self.fc.weight.T)  # and its weight used directly
            return self.head(h)

    model = Tied()
    for factorize in (False, True):
        jacs = assert_jacobians_equal(model, torch.randn(1, 6), via=via, factorize=factorize)
        assert isinstance(jacs[0], torch.Tensor)  # reuse outside the layer: dense, exact
    model.fc.weight.requires_grad_(False)  # only the bias: dense sum over calls
    assert_jacobians_equal(model, torch.randn(1, 6), via=via, factorize=True)


def test_keyword_call_and_no_grad_call_and_unused_layer(via):
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.frozen_use = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            h = torch.tanh(self.fc(input=x)) + torch.tanh(self.fc(x))
            with torch.no_grad():
                h = h + self.frozen_use(x)
            return self.head(h)

    model = Mixed()
    jacs = assert_jacobians_equal(model, torch.randn(1, 4), via=via, factorize=True)
    assert all(j.abs().max() == 0 for j in jacs[2:6])  # no gradient flows through the no-grad and unused layers


def test_input_modified_in_place_after_the_layer_is_not_silently_wrong(via):
    """The fast path reads a layer's input after the forward pass; an in-place change would corrupt it.

    Plain autograd refuses such a model (the input is saved for the weight gradient), and so does jacobian(): it
    notices the change and redoes the pass generically, which raises autograd's own error.
    """

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            h = x * 2
            out = self.fc(h)
            h.mul_(3)
            return self.head(torch.tanh(out) + h)

    model = InPlace()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        compute(model, [torch.randn(1, 4)], via=via, factorize=True)
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in model.modules())


def test_output_modified_in_place_after_the_layer(via):
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(12, 4))
    assert_jacobians_equal(model, torch.randn(1, 2, 4, 4), via=via, factorize=True)


@pytest.mark.parametrize("factorize", [False, True])
def test_peft_lora_resnet18_factorized(factorize, via, monkeypatch):
    """The peft/timm case with factored blocks: exact (no block zero), and frozen weights still get no gradient."""
    if factorize:
        force_factored(monkeypatch)
    model = lora_resnet("resnet18", num_classes=10, r=4, lora_alpha=8)
    params = [p for p in model.parameters() if p.requires_grad]
    x = torch.randn(1, 3, 32, 32)
    jacs = assert_jacobians_equal(model, x, params, via, factorize=factorize, chunk_size=4, nonzero=True)
    factored = [j for j in jacs if isinstance(j, (FactoredJacobian, OuterJacobian))]
    assert len(factored) == (41 if factorize else 0)  # every LoRA A/B weight and the head weight
    assert all(p.grad is None for p in model.parameters())


def test_dense_blocks_share_one_buffer():
    """Dense Jacobians are column blocks of one (m, n) matrix, which the Kalman update uses without a copy."""
    from loko_lightning.kalman.plan import UpdatePlan

    model = TinyConvNet()
    model.eval()
    _, jacs = jacobian(model, torch.randn(1, 3, 8, 8))
    plan = UpdatePlan(jacs, [j.shape[1:] for j in jacs], torch.float32, torch.device("cpu"))
    stacked = plan.dense.matrix(jacs)
    assert stacked.untyped_storage().data_ptr() == jacs[0].untyped_storage().data_ptr()
    torch.testing.assert_close(stacked, torch.cat([j.reshape(4, -1) for j in jacs], 1), rtol=0, atol=0)
    # Blocks from elsewhere are concatenated instead.
    copies = [j.clone() for j in jacs]
    torch.testing.assert_close(plan.dense.matrix(copies), stacked, rtol=0, atol=0)


def test_factored_jacobian_to_dense_and_cost_model():
    left, right = torch.randn(3, 4, 5), torch.randn(6, 5)
    jac = FactoredJacobian(left, right, torch.Size((4, 2, 3)))
    assert jac.shape == (3, 4, 2, 3)
    expected = torch.einsum("aip,jp->aij", left, right).reshape(3, 4, 2, 3)
    torch.testing.assert_close(jac.to_dense(), expected)
    assert jac.to(torch.float64).left.dtype == torch.float64
    # Deep layers (few positions) with many outputs favour the factored form, shallow layers the dense one.
    assert factored_is_cheaper(m=100, rows=4, cols=4608, k=1)
    assert factored_is_cheaper(m=100, rows=4, cols=2304, k=4)
    assert not factored_is_cheaper(m=10, rows=4, cols=576, k=64)
    assert not factored_is_cheaper(m=100, rows=256, cols=4, k=64)


def test_single_output_position_convolutions(via):
    """Convolutions whose output is one pixel (deep layers at low resolution): taps on padding, strides, dilation."""

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.down = nn.Conv2d(3, 6, 3, stride=2, padding=1)  # 2x2 -> 1x1, four taps meet data
            self.centre = nn.Conv2d(6, 6, 3, padding=1)  # 1x1 -> 1x1, centre tap only
            self.frozen = nn.Conv2d(6, 6, 3, padding=2, dilation=2, bias=False)  # centre tap, dilated
            self.skip = nn.Conv2d(3, 6, 1, stride=2)  # 1x1 kernel, stride 2 on 2x2
            self.tail = nn.Conv2d(6, 5, 3, padding=1)
            self.frozen.requires_grad_(False)
            self.centre.bias.requires_grad_(False)

        def forward(self, x):
            h = torch.tanh(self.down(x)) + self.skip(x)
            h = torch.tanh(self.centre(h))
            h = torch.tanh(self.frozen(h)) + h
            return self.tail(h)[..., 0, 0] + self.tail(h[0])[None, :, 0, 0]  # batched and unbatched calls

    model = Deep()
    for factorize in (False, True):
        assert_jacobians_equal(model, torch.randn(1, 3, 2, 2), via=via, factorize=factorize)


class FrozenZoo(nn.Module):
    """Trainable layers around frozen convolutions and batch norms of every geometry the shortcuts handle.

    The first layer is trainable, so its Jacobian needs the cotangent through every frozen layer after it.
    """

    def __init__(self, m=4):
        super().__init__()
        self.first = nn.Conv2d(3, 6, 3, padding=1)  # trainable: 6 x 16 x 16
        self.big = nn.Conv2d(6, 6, 3, padding=1)  # frozen, large map: generic backward
        self.norm = nn.BatchNorm2d(6)
        self.fused = BatchNormAct2d(5, act_layer=nn.ReLU6)  # timm's batch norm + ReLU6 in one module
        self.fused_plain = BatchNormAct2d(4, apply_act=False)
        self.down = nn.Conv2d(6, 5, 3, stride=4, padding=1)  # frozen, 16x16 -> 4x4: map >> kernel, generic
        self.pointwise = nn.Conv2d(5, 7, 1)  # frozen pointwise
        self.plain_norm = nn.BatchNorm2d(7, affine=False)
        self.batch_stats = nn.BatchNorm2d(7, track_running_stats=False)  # uses batch statistics: no shortcut
        self.dilated = nn.Conv2d(7, 4, 3, padding=2, dilation=2)  # frozen, dense, dilated
        self.oblong = nn.Conv2d(4, 4, (2, 3), stride=(1, 2), padding=(1, 0))  # frozen, dense, asymmetric
        self.corner = nn.Conv2d(4, 3, (2, 1), stride=2)  # frozen, dense, 5x1 -> 2x1: input row 4 is never read
        self.trained_pointwise = nn.Conv2d(7, 7, 1)  # trainable pointwise: its backward is the matrix product
        self.head = nn.Linear(3, m)  # trainable
        self.features = nn.BatchNorm1d(3)
        for module in (self.big, self.norm, self.down, self.pointwise, self.dilated, self.oblong, self.corner):
            module.requires_grad_(False)
        for norm in (self.norm, self.fused, self.fused_plain, self.plain_norm, self.features):
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
        self.norm.weight.data.uniform_(0.5, 1.5)
        self.fused.weight.data.uniform_(4.0, 12.0)  # outputs on both sides of ReLU6's clamps
        self.fused.bias.data.copy_(torch.tensor([-6.0, -3.0, 0.0, 3.0, 6.0]))
        self.fused.requires_grad_(False)
        self.fused_plain.requires_grad_(False)
        self.batch_stats.requires_grad_(False)
        self.features.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        h = torch.tanh(self.norm(self.big(h)))
        h = torch.tanh(self.pointwise(self.fused(self.down(h))))
        h = self.batch_stats(self.plain_norm(h))
        h = torch.tanh(self.trained_pointwise(h))
        h = torch.tanh(self.oblong(self.fused_plain(self.dilated(h))))
        h = self.corner(h).mean((2, 3))
        return self.head(self.features(h))


def count_shortcuts(monkeypatch):
    """Record the kind of every backward substituted by loko_lightning.jacobians.frozen."""
    backward = sys.modules["loko_lightning.jacobians.frozen"]
    kinds = []

    def substitute(x, out, grad_input):
        kinds.append(getattr(grad_input, "func", grad_input).__qualname__.split(".")[0])
        return real(x, out, grad_input)

    real = backward.substitute
    monkeypatch.setattr(backward, "substitute", substitute)
    return kinds


def test_frozen_layer_shortcuts_match_autograd(via, monkeypatch):
    """The cheaper backward of frozen batch norms and convolutions (and of trainable pointwise ones) is exact.

    float64: both sides add the same products in another order, relative errors of order 1e-15; 1e-10 leaves room
    without hiding a wrong tap or channel (those are O(1) errors).
    """
    torch.manual_seed(0)
    model = FrozenZoo().double().eval()
    xs = [torch.randn(1, 3, 16, 16, dtype=torch.float64) for _ in range(1 if via == "jacobian" else 3)]
    params = [p for p in model.parameters() if p.requires_grad]
    kinds = count_shortcuts(monkeypatch)
    for factorize in (False, True):
        engine = JacobianEngine(model, params, factorize=factorize)
        for x in xs:
            kinds.clear()
            prediction, jacs = jacobian(model, x, params, factorize=factorize) if via == "jacobian" else engine(x)
            ref_prediction, ref_jacs = row_by_row(model, x, params)
            assert torch.equal(prediction, ref_prediction)  # the forward values are the layers' own
            for jac, ref in zip(jacs, ref_jacs, strict=True):
                torch.testing.assert_close(dense(jac), ref, rtol=1e-10, atol=1e-12)
            # big and down keep their generic backward, batch_stats is no fixed affine map; the others are replaced.
            assert sorted(kinds) == sorted(["_scale_grad"] * 5 + ["_dense_grad"] * 3 + ["_pointwise_grad"] * 2), kinds
        engine.close()


def assert_engine_matches_autograd(engine, model, x, params):
    """float64 on both sides: see test_frozen_layer_shortcuts_match_autograd for the tolerance."""
    _, jacs = engine(x)
    _, ref_jacs = row_by_row(model, x, params)
    for jac, ref in zip(jacs, ref_jacs, strict=True):
        torch.testing.assert_close(dense(jac), ref, rtol=1e-10, atol=1e-12)


def test_frozen_convolution_matrix_follows_its_weight():
    """An engine's cached dense matrix of a frozen convolution (or scale of a batch norm) follows its tensor.

    It is rebuilt when the tensor changes in place (a new version), is replaced (a new tensor), or is given new data
    (``.data =``: the same tensor and version).
    """
    torch.manual_seed(1)
    model = FrozenZoo().double().eval()
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    with JacobianEngine(model, params) as engine:
        engine(x)  # builds the matrices
        with torch.no_grad():
            model.oblong.weight.mul_(-2.0)
        model.dilated.weight = nn.Parameter(torch.randn_like(model.dilated.weight), requires_grad=False)
        assert_engine_matches_autograd(engine, model, x, params)
        model.corner.weight.data = torch.randn_like(model.corner.weight)
        with torch.no_grad():
            model.norm.running_var.mul_(3.0)
        model.fused.running_var.data = model.fused.running_var.data * 0.5
        assert_engine_matches_autograd(engine, model, x, params)


# ---------------------------------------------------------------- the engine: hooks, caches, structure changes


def hook_count(model):
    return sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in model.modules())


def test_engine_hooks_are_inert_outside_its_calls(monkeypatch):
    """Registered once, the hooks change nothing when the model runs outside the engine: same outputs, same gradients,
    no backward substituted, no cache growth; and the engine's own results are still right afterwards."""
    torch.manual_seed(2)
    model = FrozenZoo().double().eval()
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]

    def plain():  # a forward and backward pass as an AdamW step does it
        out = model(x)
        grads = torch.autograd.grad(out.logsumexp(-1).sum(), params)
        return out.detach(), grads

    ref_out, ref_grads = plain()
    kinds = count_shortcuts(monkeypatch)
    engine = JacobianEngine(model, params, factorize=True)
    assert hook_count(model) > 0
    engine(x)
    caches = {**engine._hooks.conv_matrices, **engine._hooks.norm_scales}
    assert caches and engine.cache_nbytes > 0
    kinds.clear()
    out, grads = plain()
    with torch.no_grad():
        no_grad_out = model(x)
    assert not kinds  # no shortcut was applied
    assert torch.equal(out, ref_out) and torch.equal(no_grad_out, ref_out)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert {**engine._hooks.conv_matrices, **engine._hooks.norm_scales} == caches  # nothing added or rebuilt
    assert_engine_matches_autograd(engine, model, x, params)
    engine.close()


def test_engine_close_removes_every_hook():
    model = FrozenZoo().eval()
    x = torch.randn(1, 3, 16, 16)
    engine = JacobianEngine(model)
    engine(x)
    assert hook_count(model) > 0
    engine.close()
    assert hook_count(model) == 0 and engine.cache_nbytes == 0
    with JacobianEngine(model) as engine:
        engine(x)
        assert hook_count(model) > 0
    assert hook_count(model) == 0
    jacobian(model, x)  # the convenience function leaves nothing behind either
    assert hook_count(model) == 0


def test_engine_caches_are_per_engine_and_freed_with_it():
    """Two engines on two models share nothing; deleting an engine frees its caches and removes its hooks."""
    models = [FrozenZoo().eval(), FrozenZoo().eval()]
    x = torch.randn(1, 3, 16, 16)
    engines = [JacobianEngine(model) for model in models]
    for engine in engines:
        engine(x)
    for engine, model in zip(engines, models, strict=True):
        cached = set(engine._hooks.conv_matrices) | set(engine._hooks.norm_scales)
        assert cached and cached <= set(model.modules())
    matrix = weakref.ref(next(iter(engines[0]._hooks.conv_matrices.values()))[-1])
    engine_ref = weakref.ref(engines[0])
    del engines[0], engine
    assert engine_ref() is None and matrix() is None  # freed at once, no reference cycle to wait for
    assert hook_count(models[0]) == 0
    gc.collect()
    assert len(engines[0]._hooks.conv_matrices) == 3  # the other engine is untouched
    engines[0](x)


def test_engine_rescans_when_the_model_changes():
    """Modules or parameters added, removed or replaced after building: the engine scans again on its next call."""

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 3, 3, padding=1)
            self.b = nn.Conv2d(3, 3, 3, padding=1).requires_grad_(False)  # frozen: dense backward on 4x4 maps
            self.head = nn.Linear(48, 4)

        def forward(self, x):
            return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))).flatten(1))

    torch.manual_seed(3)
    model = Pair().double()
    x = torch.randn(1, 3, 4, 4, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    engine = JacobianEngine(model, params, factorize=True)
    assert_engine_matches_autograd(engine, model, x, params)
    assert model.b._forward_hooks and not model.b._forward_pre_hooks
    # b now shares a's (differentiated) weight: its frozen-layer shortcut would drop that weight's gradient through b.
    model.b.weight = model.a.weight
    assert_engine_matches_autograd(engine, model, x, params)
    assert model.b._forward_pre_hooks  # b is a fast-path layer now
    # A layer added later: differentiated through (its parameters are not among the engine's), and checked.
    old_head = model.head
    model.head = nn.Sequential(nn.BatchNorm1d(48), nn.Linear(48, 4)).double()
    with pytest.raises(ValueError, match=r"'head.0'.*training mode"):
        engine(x)
    assert hook_count(old_head) == 0  # a removed module keeps no hooks
    model.head.eval()
    assert_engine_matches_autograd(engine, model, x, params)
    engine.close()


def test_engine_under_autocast_uses_the_generic_path(monkeypatch):
    """Under autocast the hooks stay inert (the fast path assumes the layers' own dtype), and come back after it."""
    model = FrozenZoo().eval()
    x = torch.randn(1, 3, 16, 16)
    kinds = count_shortcuts(monkeypatch)
    with JacobianEngine(model) as engine:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            prediction, jacs = engine(x)
            ref_prediction, ref_jacs = jacobian(model, x)
        assert not kinds
        assert torch.equal(prediction, ref_prediction)
        assert all(torch.equal(a, b) for a, b in zip(jacs, ref_jacs, strict=True))
        engine(x)
        assert kinds


# ---------------------------------------------------------------- models the Jacobian cannot serve, refused by name


@pytest.mark.parametrize(
    "layer",
    [
        nn.Dropout(0.1),
        nn.Dropout2d(0.5),
        nn.AlphaDropout(0.2),
        nn.FeatureAlphaDropout(0.2),
        nn.RReLU(),
        timm.layers.DropPath(0.1),
        timm.layers.DropBlock2d(0.1, block_size=1),
    ],
    ids=lambda layer: type(layer).__name__,
)
def test_random_layer_in_training_mode_is_refused(layer):
    """A random layer in training mode would make every call's prediction (and Jacobian) a different draw."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), layer, nn.Flatten(), nn.Linear(16, 3))
    x = torch.randn(1, 3, 2, 2)
    with pytest.raises(ValueError, match=rf"'1' \({type(layer).__name__}, .*\) is random in training mode.*eval"):
        jacobian(model.train(), x)
    with JacobianEngine(model.eval()) as engine:
        engine(x)
        model[1].train()  # switched after building: refused too
        with pytest.raises(ValueError, match=r"model.get_submodule\('1'\).eval\(\)"):
            engine(x)
    assert_jacobians_equal(model.eval(), x)


def test_random_layer_with_nothing_to_draw_is_accepted_in_training_mode():
    model = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.0), nn.RReLU(0.2, 0.2), nn.Linear(5, 3)).train()
    assert_jacobians_equal(model, torch.randn(1, 4))


def test_lora_dropout_in_training_mode_is_refused():
    backbone = timm.create_model("resnet18", pretrained=False, num_classes=3)
    model = get_peft_model(
        backbone, LoraConfig(r=2, target_modules=["conv1"], lora_dropout=0.1, modules_to_save=["fc"])
    )
    freeze_normalization(model.train())
    with pytest.raises(ValueError, match=r"'base_model.model.conv1.lora_dropout.default' \(Dropout, p=0.1\)"):
        jacobian(model, torch.randn(1, 3, 32, 32))


@pytest.mark.parametrize("shape", [(1, 6), (1, 6, 1, 1)])
def test_batch_norm_without_running_statistics_at_batch_size_one_is_refused_by_name(shape):
    norm = (
        nn.BatchNorm1d(6, track_running_stats=False)
        if len(shape) == 2
        else nn.BatchNorm2d(6, affine=False, track_running_stats=False)
    )
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(6, 6), nn.Unflatten(1, shape[1:]), norm, nn.Flatten(), nn.Linear(6, 3)
    )
    model.eval()
    with pytest.raises(
        ValueError, match=rf"'3' \({type(norm).__name__}\) has no running statistics.*shape {re.escape(str(shape))}"
    ):
        jacobian(model, torch.randn(*shape))


def test_params_that_do_not_require_grad_are_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    model[2].bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"parameter '2.bias' has requires_grad=False"):
        jacobian(model, torch.randn(1, 4), list(model.parameters()))
    with pytest.raises(ValueError, match=r"params\[1\] \(not a parameter of the model\) has requires_grad=False"):
        jacobian(model, torch.randn(1, 4), [model[0].weight, torch.zeros(3)])
    model[2].bias.requires_grad_(True)
    with JacobianEngine(model, list(model.parameters())) as engine:
        engine(torch.randn(1, 4))
        model[0].weight.requires_grad_(False)  # frozen after building
        with pytest.raises(ValueError, match=r"parameter '0.weight' has requires_grad=False"):
            engine(torch.randn(1, 4))
