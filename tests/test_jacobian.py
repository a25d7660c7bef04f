import pytest
import timm
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from loko_lightning import OuterJacobian, jacobian


def row_by_row(model, x, params, output="softmax"):
    """The obvious Jacobian: one backward pass per output row."""
    logits = model(x).reshape(-1)
    y = torch.softmax(logits, 0) if output == "softmax" else logits
    rows = [torch.autograd.grad(y[a], params, retain_graph=True, allow_unused=True) for a in range(y.shape[0])]
    jacs = []
    for i, p in enumerate(params):
        jacs.append(torch.stack([r[i] if r[i] is not None else torch.zeros_like(p) for r in rows]))
    return y.detach(), jacs


def dense(jac):
    return jac.to_dense() if isinstance(jac, OuterJacobian) else jac


def assert_jacobians_equal(model, x, params=None, **kwargs):
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    prediction, jacs = jacobian(model, x, params, **kwargs)
    ref_prediction, ref_jacs = row_by_row(model, x, params, kwargs.get("output", "softmax"))
    # Same float32 arithmetic; the batched backward may sum in another order, so allow a few ulps of the
    # largest entry (torch's float32 defaults: rtol 1.3e-6, atol 1e-5).
    torch.testing.assert_close(prediction, ref_prediction)
    assert len(jacs) == len(params)
    for jac, ref, p in zip(jacs, ref_jacs, params, strict=True):
        assert tuple(jac.shape) == (prediction.shape[0], *p.shape)
        torch.testing.assert_close(dense(jac), ref)
    return jacs


@pytest.mark.parametrize("output", ["softmax", "identity"])
@pytest.mark.parametrize("factorize_head", [False, True])
def test_mlp(output, factorize_head):
    model = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 5))
    jacs = assert_jacobians_equal(model, torch.randn(1, 6), output=output, factorize_head=factorize_head)
    assert isinstance(jacs[2], OuterJacobian) == factorize_head


def test_chunked_equals_unchunked():
    model = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 7))
    x = torch.randn(1, 6)
    _, full = jacobian(model, x)
    _, chunked = jacobian(model, x, chunk_size=3)
    for a, b in zip(full, chunked, strict=True):
        torch.testing.assert_close(a, b)


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


def test_conv_net_with_batchnorm_in_eval_mode():
    model = TinyConvNet()
    # Non-trivial running statistics, so eval-mode BatchNorm is not the identity.
    model.train()
    model(torch.randn(16, 3, 8, 8) * 2 + 1)
    model.eval()
    stats = model.bn1.running_mean.clone()
    assert_jacobians_equal(model, torch.randn(1, 3, 8, 8))
    assert_jacobians_equal(model, torch.randn(1, 3, 8, 8), factorize_head=True)
    assert torch.equal(model.bn1.running_mean, stats)


def test_batchnorm_in_training_mode_is_refused():
    model = TinyConvNet().train()
    with pytest.raises(ValueError, match=r"'bn1'.*training mode.*eval"):
        jacobian(model, torch.randn(1, 3, 8, 8))


def test_peft_lora_resnet18():
    """LoRA rank 4 on every conv of a timm resnet18 and a new trainable 10-class head (peft modules_to_save)."""
    backbone = timm.create_model("resnet18", pretrained=False, num_classes=10)
    convs = [n for n, m in backbone.named_modules() if isinstance(m, nn.Conv2d)]
    model = get_peft_model(backbone, LoraConfig(r=4, lora_alpha=4, target_modules=convs, modules_to_save=["fc"]))
    # peft's default B = 0 makes every A-Jacobian zero; random B makes the comparison meaningful.
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in params) == 148_822
    x = torch.randn(1, 3, 32, 32)
    jacs = assert_jacobians_equal(model, x, params, factorize_head=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    head = names.index(next(n for n in names if n.endswith("fc.modules_to_save.default.weight")))
    assert isinstance(jacs[head], OuterJacobian)
    # Frozen weights received no gradient.
    assert all(p.grad is None for p in model.parameters())


def test_bad_inputs():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"batch dimension 1, got shape \(2, 3\)"):
        jacobian(model, torch.randn(2, 3))
    with pytest.raises(ValueError, match="Invalid output"):
        jacobian(model, torch.randn(1, 3), output="sigmoid")
    with pytest.raises(ValueError, match="no trainable parameters"):
        jacobian(model.requires_grad_(False), torch.randn(1, 3))
