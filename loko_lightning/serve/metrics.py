"""``/metrics`` of ``loko serve``: the Prometheus text exposition of a learning server's counters and gauges.

:func:`service_metrics` writes a :class:`~loko_lightning.serve.service.FeedbackService`'s, from its public attributes;
its step times and feedback lags are summaries (:func:`summary`: quantiles over the last ``WINDOW`` values, sum and
count over all). :func:`prometheus_value` writes one value as the format does (a follower's metrics too).
"""

from __future__ import annotations

import math
from typing import Any

# How many of the last step times and feedback lags the quantiles in /metrics are computed over.
WINDOW = 1000


def service_metrics(service: Any) -> str:
    """The Prometheus text exposition of a feedback service's counters and gauges.

    Args:
        service: a :class:`~loko_lightning.serve.service.FeedbackService` (its public attributes are read).
    """
    learner = service.learner
    rows: list[tuple[str, str, str, list[tuple[str, float]]]] = [
        ("loko_feedback_accepted_total", "counter", "feedback accepted (in the log)", [("", service.accepted)]),
        (
            "loko_samples_learned_total",
            "counter",
            "feedback samples learned (skipped ones included)",
            [("", service.position)],
        ),
        (
            "loko_samples_skipped_total",
            "counter",
            "samples whose update was not finite (nothing changed)",
            [("", learner.skipped)],
        ),
        (
            "loko_feedback_refused_busy_total",
            "counter",
            "feedback refused because the queue was full (429)",
            [("", service.refused_busy)],
        ),
        ("loko_predictions_total", "counter", "inputs predicted since the start", [("", service.predictions)]),
        (
            "loko_online_accuracy",
            "gauge",
            "accuracy of the served predictions that received feedback",
            [("", learner.served_accuracy)],
        ),
        (
            "loko_prequential_accuracy",
            "gauge",
            "accuracy of each learned sample's prediction just before its step",
            [("", learner.online_accuracy)],
        ),
        (
            "loko_status",
            "gauge",
            "1 for the status /health says: ok, degraded (it learns; something failed), failed (it does not)",
            [(f'{{status="{name}"}}', int(name == service.status[0])) for name in ("ok", "degraded", "failed")],
        ),
        ("loko_queue_length", "gauge", "accepted feedback waiting for the learner", [("", service.queue_length)]),
        ("loko_queue_capacity", "gauge", "queue length beyond which feedback is refused", [("", service.queue_size)]),
        ("loko_queue_bytes", "gauge", "bytes of the queued feedback's inputs", [("", service.queue_bytes_used)]),
        ("loko_pending_bytes", "gauge", "bytes of the kept predictions' inputs", [("", service.pending_bytes_used)]),
        (
            "loko_parameter_version",
            "gauge",
            "samples learned by the parameters predictions read",
            [("", learner.version)],
        ),
    ]
    rows.append(
        summary(
            "loko_step_seconds",
            "wall time of one learner step",
            service.step_seconds,
            service.step_seconds_sum,
            service.step_count,
        )
    )
    rows.append(
        summary(
            "loko_feedback_lag_seconds",
            "from a feedback's acknowledgement to its update",
            service.lags,
            service.lag_sum,
            service.lag_count,
        )
    )
    lines = []
    for name, kind, help_text, samples in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{suffix} {prometheus_value(value)}" for suffix, value in samples]
    return "\n".join(lines) + "\n"


def summary(name: str, help_text: str, window: Any, total: float, count: int) -> tuple[str, str, str, list]:
    """A Prometheus summary: quantiles over the last values, sum and count over all."""
    values = sorted(window)
    samples = []
    for q in (0.5, 0.99):
        value = values[min(len(values) - 1, int(q * len(values)))] if values else math.nan
        samples.append((f'{{quantile="{q}"}}', value))
    samples += [("_sum", total), ("_count", count)]
    return name, "summary", help_text, samples


def prometheus_value(value: float) -> str:
    """A sample's value as the Prometheus text format writes it (``NaN``, an integer, or a float's repr)."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return repr(float(value)) if isinstance(value, float) else str(int(value))
