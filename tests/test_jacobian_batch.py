"""The engine's batched pass (``JacobianEngine.batch``): each sample's own rows, against row-by-row autograd."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_jacobian import ConvZoo, TinyConvNet, dense, lora_resnet, row_by_row
from timm.layers import Conv2dSame
from torch import nn

import loko_lightning.jacobians.reverse as jacobian_pass
from loko_lightning import JacobianEngine, OuterJacobian
from loko_lightning.jacobians.blocks import FactoredJacobian


def assert_batch_equals_row_by_row(engine, model, xs, params, observation="softmax", *, nonzero=False):
    """``engine.batch(xs)`` gives, for every sample b, the Jacobian of sample b alone (one backward pass per row).

    ``nonzero``: also assert that every reference block has a non-zero entry, so no comparison is vacuous.
    """
    prediction, jacs = engine.batch(xs)
    B = xs.shape[0]
    assert prediction.shape[0] == B and len(jacs) == len(params)
    for b in range(B):
        ref_prediction, ref_jacs = row_by_row(model, xs[b : b + 1], params, observation)
        # Same float32 arithmetic as the reference, summed in another order (torch's float32 defaults: rtol
        # 1.3e-6, atol 1e-5, a few ulps of the largest entry).
        torch.testing.assert_close(prediction[b], ref_prediction)
        for jac, ref, p in zip(jacs, ref_jacs, params, strict=True):
            assert tuple(jac.shape) == (B, prediction.shape[1], *p.shape)
            torch.testing.assert_close(dense(jac)[b], ref)
            assert not nonzero or ref.abs().max() > 0, "an all-zero block compares nothing"
    return jacs


@pytest.mark.parametrize("observation", ["softmax", "regression"])
@pytest.mark.parametrize("factorize", [False, True])
def test_conv_zoo_batch(observation, factorize, monkeypatch):
    """Every fast-path configuration (and the generic grouped conv) with B = 3, factored and dense."""
    if factorize:
        monkeypatch.setattr(jacobian_pass, "factored_is_cheaper", lambda *args: True)
    torch.manual_seed(0)
    model = ConvZoo()
    params = [p for p in model.parameters() if p.requires_grad]
    with JacobianEngine(model, observation=observation, factorize=factorize) as engine:
        jacs = assert_batch_equals_row_by_row(engine, model, torch.randn(3, 3, 13, 11), params, observation)
        assert_batch_equals_row_by_row(engine, model, torch.randn(2, 3, 13, 11), params, observation)  # another B
    kinds = {type(j).__name__ for j in jacs}
    assert kinds == ({"FactoredJacobian", "OuterJacobian", "Tensor"} if factorize else {"Tensor"})


def spy_on_reverse_passes(monkeypatch):
    """The reverse passes the engine runs, each as the number of samples its prediction holds (1: one sample)."""
    seen = []
    original = jacobian_pass._batched_grad

    def spy(prediction, *args, **kwargs):
        seen.append(prediction.shape[0] if prediction.dim() == 2 else 1)
        return original(prediction, *args, **kwargs)

    monkeypatch.setattr(jacobian_pass, "_batched_grad", spy)
    return seen


def test_fast_path_only_model_uses_the_shared_pass(monkeypatch):
    """Only fast-path parameters: m - 1 cotangents shared by the B samples (not B·(m - 1)), still exact."""
    seen = spy_on_reverse_passes(monkeypatch)
    torch.manual_seed(1)
    model = TinyConvNet(m=5)
    model.train()
    model(torch.randn(16, 3, 8, 8) * 2 + 1)  # non-trivial running statistics
    model.eval()
    params = [p for n, p in model.named_parameters() if "bn" not in n]
    for p in model.parameters():
        p.requires_grad_(any(p is q for q in params))
    with JacobianEngine(model, params, factorize=True) as engine:
        assert_batch_equals_row_by_row(engine, model, torch.randn(4, 3, 8, 8), params)
    assert seen == [4]


def test_generic_parameters_and_weights_used_outside_their_layer_go_one_sample_at_a_time(monkeypatch):
    """A layer-norm weight (generic) and a Linear weight also used directly: one pass per sample, exact.

    (One-sample cotangents through the batch's graph would cost B times more: each runs back through all B samples.)
    """
    seen = spy_on_reverse_passes(monkeypatch)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)
            self.norm = nn.LayerNorm(6)
            self.head = nn.Linear(6, 4)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            h = h + torch.tanh(h @ self.fc.weight.T)  # the weight outside its layer
            return self.head(self.norm(h))

    torch.manual_seed(2)
    model = Tied()
    params = list(model.parameters())
    with JacobianEngine(model, factorize=True) as engine:
        assert_batch_equals_row_by_row(engine, model, torch.randn(3, 6), params)
    assert seen == [1, 1, 1]  # generic parameters: one sample at a time from the start
    with JacobianEngine(model, [model.fc.weight, model.head.weight], factorize=True) as engine:
        assert_batch_equals_row_by_row(engine, model, torch.randn(3, 6), [model.fc.weight, model.head.weight])
    # The shared pass found fc.weight used outside its layer: redone one sample at a time.
    assert seen == [1, 1, 1, 3, 1, 1, 1]


def test_model_that_folds_the_batch_goes_one_sample_at_a_time():
    """A Linear that sees (B·T, C) rather than the batch first: the engine falls back to one pass per sample."""

    class Folded(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Linear(3, 5)
            self.head = nn.Linear(5, 4)

        def forward(self, x):  # x: (B, T, 3)
            B, T, C = x.shape
            h = torch.tanh(self.tokens(x.reshape(B * T, C))).reshape(B, T, -1).mean(1)
            return self.head(h)

    torch.manual_seed(3)
    model = Folded()
    params = list(model.parameters())
    with JacobianEngine(model, factorize=True) as engine:
        assert_batch_equals_row_by_row(engine, model, torch.randn(3, 7, 3), params)


@pytest.mark.parametrize("chunk_size", [1, 4, 7])
def test_chunks_bound_the_rows_and_change_nothing(chunk_size):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.LayerNorm(9), nn.Linear(9, 7))
    xs = torch.randn(3, 6)
    with JacobianEngine(model) as engine:
        _, full = engine.batch(xs)
    with JacobianEngine(model, chunk_size=chunk_size) as engine:
        _, chunked = engine.batch(xs)
    for a, b in zip(full, chunked, strict=True):
        torch.testing.assert_close(a, b)


def test_peft_lora_resnet_batch(monkeypatch):
    """The peft/timm case (LoRA on every conv of a ResNet, frozen batch norms, new head) with B = 2, no zero block."""
    monkeypatch.setattr(jacobian_pass, "factored_is_cheaper", lambda *args: True)
    model = lora_resnet("resnet10t", num_classes=5, r=2, lora_alpha=4)
    params = [p for p in model.parameters() if p.requires_grad]
    with JacobianEngine(model, params, factorize=True, chunk_size=4) as engine:
        jacs = assert_batch_equals_row_by_row(engine, model, torch.randn(2, 3, 32, 32), params, nonzero=True)
    assert any(isinstance(j, FactoredJacobian) for j in jacs) and isinstance(jacs[-2], OuterJacobian)
    assert all(p.grad is None for p in model.parameters())


class TFSame(nn.Module):
    """timm's ``Conv2dSame`` (TensorFlow's "SAME" padding, worked out from each input's size; asymmetric at these
    sizes), as the ``tf_*`` EfficientNets' stems use it."""

    def __init__(self, m=5):
        super().__init__()
        self.stem = Conv2dSame(3, 6, 3, stride=2, bias=False)
        self.down = Conv2dSame(6, 4, (2, 3), stride=(2, 1), dilation=(1, 2))
        self.pointwise = Conv2dSame(4, 8, 1)
        self.head = nn.Linear(8, m)

    def forward(self, x):
        x = torch.tanh(self.stem(x))
        x = torch.tanh(self.down(x))
        return self.head(torch.tanh(self.pointwise(x)).mean((2, 3)))


@pytest.mark.parametrize("lora", [False, True])
def test_timm_same_padding_convolutions_take_the_fast_path(lora, monkeypatch):
    """In a batch their weights (or the LoRA factors peft gives them, which are Conv2dSame too) come out of the shared
    batched pass in factored form, exact, with the padding of each input's size; one sample keeps autograd's weight
    gradient for them (dense blocks)."""
    monkeypatch.setattr(jacobian_pass, "factored_is_cheaper", lambda *args: True)
    seen = spy_on_reverse_passes(monkeypatch)
    torch.manual_seed(5)
    model = TFSame()
    if lora:
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["stem", "down", "pointwise"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(p, std=0.3)
        assert isinstance(model.base_model.model.stem.lora_A["default"], Conv2dSame)
    params = [p for p in model.parameters() if p.requires_grad]
    with JacobianEngine(model, params, factorize=True) as engine:
        for shape in [(1, 3, 13, 11), (1, 3, 12, 10)]:
            x = torch.randn(shape)
            prediction, jacs = engine(x)
            ref_prediction, ref_jacs = row_by_row(model, x, params)
            torch.testing.assert_close(prediction, ref_prediction)  # float32 defaults, see above
            for jac, ref in zip(jacs, ref_jacs, strict=True):
                torch.testing.assert_close(dense(jac), ref)
            assert all(isinstance(j, torch.Tensor) for j in jacs[:-2])
        jacs = assert_batch_equals_row_by_row(engine, model, torch.randn(3, 3, 13, 11), params)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    conv_weights = [n for n in names if n.endswith("weight") and "head" not in n]
    assert len(conv_weights) == (6 if lora else 3)
    assert all(isinstance(j, FactoredJacobian) for n, j in zip(names, jacs, strict=True) if n in conv_weights)
    assert seen == [1, 1, 3]  # one reverse pass per call: none went one sample at a time


def test_dense_batch_blocks_share_one_buffer():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    with JacobianEngine(model) as engine:
        _, jacs = engine.batch(torch.randn(2, 4))
    base = jacs[0].untyped_storage().data_ptr()
    assert all(j.untyped_storage().data_ptr() == base for j in jacs)


def test_bad_batch_inputs():
    model = nn.Sequential(nn.Linear(4, 3))
    with JacobianEngine(model) as engine, pytest.raises(ValueError, match="expected a batch of samples"):
        engine.batch(torch.randn(0, 4))
