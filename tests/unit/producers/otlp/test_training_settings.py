"""Seed 001's training settings on an OTLP job's resource (``identity.training_settings``): which
attributes they are, how they are written, and that they ride the run's RUN_START once per run and
attempt (``MetricTranslator``)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList

from rlpulse.producers.otlp.identity import OtlpRejected, training_settings
from rlpulse.producers.otlp.metrics import MetricTranslator
from tests.unit.producers.otlp.test_metrics import RUN, S, SEC, T0, counter, of, request

pytestmark = pytest.mark.full  # new this round: make test stays under 6 minutes

SETTINGS = {S + "model": "Qwen/Qwen2.5-0.5B", S + "rl.algorithm": "grpo", S + "rl.num_generations": 8,
            "rlpulse.config.learning_rate": 1e-6, "rlpulse.config.use_vllm": True,
            "rlpulse.config.judge_api_key": "sk-live"}
WRITTEN = {"model": "Qwen/Qwen2.5-0.5B", "rl.algorithm": "grpo", "rl.num_generations": "8", "learning_rate": "1e-06",
           "use_vllm": "true", "judge_api_key": "***"}


def test_the_seeds_attributes_and_rlpulse_config_ones_are_settings_identity_and_labels_are_not() -> None:
    resource = {**RUN, **SETTINGS, S + "job.rank": 3, S + "job.role": "actor", S + "rl.step": 4, S + "instance": "pod-1",
                S + "rl.rollout.id": "x", "rlpulse.run_id": "r1", "host.name": "node-1", "k8s.pod.name": "p"}
    assert training_settings(resource) == WRITTEN


def test_an_rlpulse_config_attribute_wins_over_the_seeds_of_the_same_name_and_values_keep_their_shape() -> None:
    got = training_settings({"rlpulse.config.model": "mine", S + "model": "seed's", "rlpulse.config.ids": b"\x01\xff",
                             "rlpulse.config.optim": {"lr": 1e-5, "betas": [0.9, 0.99]}, "rlpulse.config.unset": None})
    assert got == {"model": "mine", "ids": "01ff", "optim.lr": "1e-05", "optim.betas": "[0.9,0.99]"}


def test_a_resource_without_settings_has_none() -> None:
    assert training_settings(RUN) == {}


@pytest.mark.parametrize("resource, reason", [
    ({"rlpulse.config._rlpulse.x": 1}, "the training settings in the resource attributes: config key '_rlpulse.x' uses "
                                       "the prefix '_rlpulse.', which rlpulse reserves for its own marks"),
    ({"rlpulse.config.a.b": 1, "rlpulse.config.a": {"b": 2}},
     "the training settings in the resource attributes: config key 'a.b' is given twice once nested names are joined "
     "with dots"),
])
def test_settings_that_cannot_be_written_refuse_the_request_saying_why(resource: dict[str, Any], reason: str) -> None:
    with pytest.raises(OtlpRejected) as info:
        training_settings(resource)
    assert str(info.value) == reason


def starts(outs: list) -> list[tuple[int, dict[str, str]]]:
    return [(s["attempt"], s["config"]) for s in of(outs, "Step") if s["type"] == "RUN_START"]


def test_the_settings_ride_the_run_start_once_per_run_and_attempt() -> None:
    t = MetricTranslator()
    job = {**RUN, **SETTINGS}
    first = t.translate(request(counter("rl.step.count", 0, T0 + SEC), resource=job), T0)
    again = t.translate(request(counter("rl.step.count", 1, T0 + 2 * SEC), resource=job), T0)
    resumed = t.translate(request(counter("rl.step.count", 0, T0 + 3 * SEC), resource={**job, S + "run.attempt": 2,
                                                                                      S + "model": "other"}), T0)
    assert starts(first) == [(1, WRITTEN)] and starts(again) == [] and starts(resumed) == [(2, {**WRITTEN, "model": "other"})]
    assert [(s["type"], s["config"]) for s in of(again, "Step")] == [("STEP", {})]


def test_a_refused_request_leaves_the_run_unseen_and_the_next_one_starts_it() -> None:
    t = MetricTranslator()
    with pytest.raises(OtlpRejected, match="reserves for its own marks"):
        t.translate(request(counter("rl.step.count", 0, T0 + SEC), resource={**RUN, "rlpulse.config._rlpulse.x": 1}), T0)
    assert starts(t.translate(request(counter("rl.step.count", 0, T0 + SEC), resource={**RUN, **SETTINGS}), T0)) == [
        (1, WRITTEN)]


def test_kvlist_and_array_resource_values_as_opentelemetry_sends_them() -> None:
    optim = AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key="lr", value=AnyValue(double_value=1e-5))]))
    betas = AnyValue(array_value=ArrayValue(values=[AnyValue(double_value=0.9), AnyValue(double_value=0.99)]))
    req = request(counter("rl.step.count", 0, T0 + SEC))
    req.resource_metrics[0].resource.attributes.extend(
        [KeyValue(key="rlpulse.config.optim", value=optim), KeyValue(key=S + "betas", value=betas)])
    assert starts(MetricTranslator().translate(req, T0)) == [(1, {"optim.lr": "1e-05", "betas": "[0.9,0.99]"})]
