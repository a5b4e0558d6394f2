"""A run's settings as ``flatten_config`` makes them (``rlpulse.producers.sdk.run_config``), and as
``TrainingTelemetry(config=...)`` and ``set_config`` queue them on RUN_START: every accepted kind,
values as text, secrets redacted, each bound and its count, each error's message."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import importlib.util
import re
from types import SimpleNamespace

import pytest

from rlpulse.producers import AsyncTrainingTelemetry, InMemoryTransport, TrainingTelemetry
from rlpulse.producers.sdk import run_config as rc
from rlpulse.producers.sdk.queue import DICT_QUEUED_BYTES, ENTRY_BYTES, STEP_QUEUED_BYTES
from rlpulse.producers.sdk.run_config import flatten_config
from rlpulse.base.settings import Settings

pytestmark = pytest.mark.full  # new this round: make test stays under 6 minutes

SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "q", "RLPULSE_HEARTBEAT_INTERVAL": "1h"})


class Mode(enum.Enum):
    FAST = "fast"


@dataclasses.dataclass
class Optim:
    lr: float = 1e-5
    betas: tuple = (0.9, 0.99)


@dataclasses.dataclass
class Job:
    optim: Optim = dataclasses.field(default_factory=Optim)
    mode: Mode = Mode.FAST
    seed: int = 7


class Args:
    """What transformers' ``TrainingArguments.to_dict()`` gives: its own serialization."""

    def to_dict(self) -> dict:
        return {"learning_rate": 5e-3, "hub_token": "<HUB_TOKEN>", "report_to": ["none"]}


@dataclasses.dataclass
class ArgsDataclass(Args):
    """TrainingArguments is a dataclass with to_dict(): the latter is what is read."""

    learning_rate: float = 5e-3
    hub_token: str = "hf_live"
    internal: str = "left out by to_dict"


# -- accepted kinds -----------------------------------------------------------------------------
def test_a_mapping_flattens_to_dotted_names_with_values_as_text() -> None:
    got = flatten_config({"optim": {"lr": 1e-5, "betas": [0.9, 0.99], "sched": {"name": "cosine"}}, "n": 8,
                          "vllm": True, "off": False, "none": None, "nan": float("nan"), "inf": float("inf"),
                          "ninf": float("-inf"), "mode": Mode.FAST, "tags": ("a", "b"), "ids": {3, 1, 2},
                          "text": "Qwen/Qwen2.5-0.5B", "other": complex(1, 2), "empty": {}, "big": 10**20,
                          "nested_list": [{"a": 1}, [float("nan")]]})
    assert got == {"optim.lr": "1e-05", "optim.betas": "[0.9,0.99]", "optim.sched.name": "cosine", "n": "8",
                   "vllm": "true", "off": "false", "none": "null", "nan": "nan", "inf": "inf", "ninf": "-inf",
                   "mode": "fast", "tags": '["a","b"]', "ids": "[1,2,3]", "text": "Qwen/Qwen2.5-0.5B",
                   "other": "(1+2j)", "empty": "{}", "big": "100000000000000000000",
                   "nested_list": '[{"a":1},["nan"]]'}


def test_a_dataclass_is_read_field_by_field_nested_ones_too() -> None:
    assert flatten_config(Job()) == {"optim.lr": "1e-05", "optim.betas": "[0.9,0.99]", "mode": "fast", "seed": "7"}


def test_to_dict_is_read_before_the_dataclass_fields() -> None:
    assert flatten_config(Args()) == {"learning_rate": "0.005", "hub_token": "***", "report_to": '["none"]'}
    assert flatten_config(ArgsDataclass()) == {"learning_rate": "0.005", "hub_token": "***", "report_to": '["none"]'}


def test_an_argparse_namespace_and_nested_simple_namespaces_as_openrlhf_makes_them() -> None:
    assert flatten_config(argparse.Namespace(pretrain="m", n_samples_per_prompt=8)) == {
        "pretrain": "m", "n_samples_per_prompt": "8"}
    # openrlhf.utils.config.hierarchize: "--logger.wandb.project" -> args.logger.wandb.project
    args = SimpleNamespace(logger=SimpleNamespace(wandb=SimpleNamespace(project="p", key="wandb-secret")),
                           rollout=SimpleNamespace(n_samples_per_prompt=4))
    assert flatten_config(args) == {"logger.wandb.project": "p", "logger.wandb.key": "***", "rollout.n_samples_per_prompt": "4"}


@pytest.mark.skipif(importlib.util.find_spec("omegaconf") is None,
                    reason="omegaconf is not installed in this venv (verl's configs are OmegaConf DictConfigs)")
def test_an_omegaconf_dictconfig_is_resolved() -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"data": {"max_len": 512}, "actor": {"max_len": "${data.max_len}", "lr": 1e-6}})
    assert flatten_config(cfg) == {"data.max_len": "512", "actor.max_len": "512", "actor.lr": "1e-06"}


# -- secrets ------------------------------------------------------------------------------------
def test_secret_looking_keys_and_their_subtrees_are_redacted_special_tokens_are_not() -> None:
    got = flatten_config({"api_key": "sk-1", "OPENAI_APIKEY": "sk-2", "db_password": "p", "passwd": "p",
                          "client_secret": "s", "credentials": {"user": "u", "pw": "p"}, "private_key": "k",
                          "aws_access_key_id": "a", "hub_token": "hf", "token": "t", "key": "k",
                          "pad_token": "<pad>", "eos_token": "<eos>", "input_key": "context_messages",
                          "max_tokens": 64, "judges": [{"name": "j", "api_key": "sk-3"}]})
    assert got == {"api_key": "***", "OPENAI_APIKEY": "***", "db_password": "***", "passwd": "***",
                   "client_secret": "***", "credentials": "***", "private_key": "***", "aws_access_key_id": "***",
                   "hub_token": "***", "token": "***", "key": "***", "pad_token": "<pad>", "eos_token": "<eos>",
                   "input_key": "context_messages", "max_tokens": "64", "judges": '[{"name":"j","api_key":"***"}]'}


# -- bounds -------------------------------------------------------------------------------------
def test_a_mapping_nested_deeper_than_max_depth_is_one_json_value() -> None:
    deep: dict = {"leaf": 1}
    for i in reversed(range(rc.MAX_DEPTH)):
        deep = {f"l{i}": deep}
    name = ".".join(f"l{i}" for i in range(rc.MAX_DEPTH))
    assert flatten_config(deep) == {name: '{"leaf":1}'}


def test_a_long_value_is_cut_to_max_value_with_its_mark_and_counted() -> None:
    got = flatten_config({"prompt": "x" * 5000, "b": "y" * rc.MAX_VALUE})
    assert len(got["prompt"]) == rc.MAX_VALUE and got["b"] == "y" * rc.MAX_VALUE
    cut = int(re.fullmatch(r"x+…\(\+(\d+) chars\)", got["prompt"]).group(1))
    assert got["prompt"].count("x") + cut == 5000
    assert got[rc.TRUNCATED_KEY] == "1" and rc.DROPPED_KEY not in got


def test_a_key_longer_than_max_key_is_left_out_and_counted() -> None:
    got = flatten_config({"a" * (rc.MAX_KEY + 1): 1, "ok": 2, "b" * rc.MAX_KEY: 3})
    assert got == {"ok": "2", "b" * rc.MAX_KEY: "3", rc.DROPPED_KEY: "1"}


def test_past_max_keys_the_first_in_sorted_order_are_kept_with_the_count() -> None:
    got = flatten_config({f"k{i:04d}": i for i in range(rc.MAX_KEYS + 10)})
    assert len(got) == rc.MAX_KEYS - 1  # room is kept for both marks: 510 settings and the dropped count
    kept = [k for k in got if not k.startswith(rc.RESERVED)]
    assert kept == [f"k{i:04d}" for i in range(rc.MAX_KEYS - 2)]
    assert got[rc.DROPPED_KEY] == "12"


def test_past_max_bytes_the_rest_is_left_out_and_counted() -> None:
    got = flatten_config({f"k{i:03d}": "v" * 1000 for i in range(300)})  # 300 x 1004 bytes > 256 KiB
    per = 4 + 1000
    assert len(got) - 1 == rc.MAX_BYTES // per and got[rc.DROPPED_KEY] == str(300 - rc.MAX_BYTES // per)
    assert sum(len(k) + len(v) for k, v in got.items() if k != rc.DROPPED_KEY) <= rc.MAX_BYTES


def test_nothing_in_bounds_adds_no_mark() -> None:
    assert flatten_config({}) == {} and flatten_config({"a": 1}) == {"a": "1"}


# -- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, message", [
    (42, "config must be a mapping, a dataclass, an object with to_dict() (TrainingArguments), an argparse Namespace, "
         "a SimpleNamespace or an OmegaConf DictConfig; got int"),
    (Job, "config must be a mapping, a dataclass, an object with to_dict() (TrainingArguments), an argparse Namespace, "
          "a SimpleNamespace or an OmegaConf DictConfig; got type"),
    ({1: "a"}, "config key 1 must be a non-empty string (got int)"),
    ({"a": {"": 1}}, "config key a.'' must be a non-empty string (got str)"),
    ({"a.b": 1, "a": {"b": 2}}, "config key 'a.b' is given twice once nested names are joined with dots"),
    ({"_rlpulse.x": 1}, "config key '_rlpulse.x' uses the prefix '_rlpulse.', which rlpulse reserves for its own marks"),
    ({"bad\ud800": 1}, "config key 'bad\\ud800' is not valid text (surrogates not allowed at position 3)"),
    ({"k": "bad\udc00"}, "config key 'k': value is not valid text (surrogates not allowed at position 3)"),
])
def test_a_bad_config_raises_naming_what(config: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        flatten_config(config)
    assert str(info.value) == message


def test_a_to_dict_that_is_no_mapping_or_raises_is_a_value_error() -> None:
    class List:
        def to_dict(self) -> list:
            return [1]

    class Broken:
        def to_dict(self) -> dict:
            raise RuntimeError("boom")

    with pytest.raises(ValueError, match=r"^config: List.to_dict\(\) returned list, not a mapping$"):
        flatten_config(List())
    with pytest.raises(ValueError, match=r"^config: Broken.to_dict\(\) raised RuntimeError: boom$"):
        flatten_config({"nested": Broken()})


# -- on RUN_START ---------------------------------------------------------------------------------
def run_starts(transport: InMemoryTransport) -> list[tuple]:
    return [(r["time_ns"], r["step_count"], r["config"]) for r in transport.records("steps") if r["type"] == "RUN_START"]


def test_config_rides_the_run_start_and_no_other_event() -> None:
    transport = InMemoryTransport()
    with TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport, config={"lr": 1e-5, "api_key": "x"}) as tel:
        tel.step_completed(0, metrics={"loss": 1.0})
        assert tel.config == {"lr": "1e-05", "api_key": "***"}
    assert [(r["type"], r["config"]) for r in transport.records("steps")] == [
        ("RUN_START", {"lr": "1e-05", "api_key": "***"}), ("STEP", {}), ("RUN_END", {})]


def test_a_bad_config_raises_when_the_object_is_made() -> None:
    with pytest.raises(ValueError, match="config key 1 must be a non-empty string"):
        TrainingTelemetry("p", "r", settings=SETTINGS, transport=InMemoryTransport(), config={1: 2})


def test_set_config_before_start_rides_the_run_start_after_it_a_second_one_with_the_first_ones_time() -> None:
    transport = InMemoryTransport()
    tel = TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport)
    assert tel.set_config({"a": 1}) == {"a": "1"}
    with tel:
        tel.step_completed(0)
        tel.step_completed(1)
        assert tel.set_config(argparse.Namespace(b=2)) == {"b": "2"}
        with pytest.raises(ValueError, match="config key 1"):
            tel.set_config({1: 1})
        assert tel.config == {"b": "2"}  # a bad one changes nothing
    (t0, c0, first), (t1, c1, second) = run_starts(transport)
    assert (first, second, c0, c1) == ({"a": "1"}, {"b": "2"}, 0, 2) and t0 == t1


def test_the_asyncio_face_takes_config_and_set_config() -> None:
    transport = InMemoryTransport()

    async def job() -> None:
        async with AsyncTrainingTelemetry("p", "r", settings=SETTINGS, transport=transport, config={"a": 1}) as tel:
            assert await tel.set_config({"b": 2}) == {"b": "2"}

    asyncio.run(job())
    assert [c for _, _, c in run_starts(transport)] == [{"a": "1"}, {"b": "2"}]


def test_a_rank_other_than_0_sends_no_run_start_with_its_settings() -> None:
    transport = InMemoryTransport()
    with TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport, rank=1, world_size=2, config={"a": 1}) as tel:
        tel.set_config({"b": 1})
    assert transport.records("steps") == []


def test_the_run_starts_settings_count_against_the_buffer() -> None:
    config = {"learning_rate": 5e-3, "model": "Qwen/Qwen2.5-0.5B"}
    flat = flatten_config(config)
    size = STEP_QUEUED_BYTES + DICT_QUEUED_BYTES + sum(len(k) + len(x) for k, x in flat.items()) + ENTRY_BYTES * len(flat)
    for budget, queued in ((size, 1), (size - 1, 0)):
        transport = InMemoryTransport()
        tel = TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport, buffer_bytes=budget, config=config)
        tel.sender.start = lambda: None  # no sender thread yet: what start() queues stays to be read
        tel.start()
        assert (tel.pending, tel.dropped) == (queued, 1 - queued)
        assert [r["config"] for _, _, r in tel.sender.queued_records()] == [flat] * queued
        del tel.sender.start
        tel.sender.start()
        tel.abandon()


def test_a_secret_in_a_flat_dotted_name_or_a_dashed_one_is_redacted() -> None:
    """As an OTel resource's attributes arrive (flat, dotted) and as a user writes a flat dict."""
    flat = flatten_config({"wandb.key": "s1", "hf.token": "s2", "a": {"b.token": "s3"}, "openai_key": "s4",
                           "api-key": "s5", "data": {"prompt_key": "prompt", "best_eval_metric_key": "acc"},
                           "pad_token": "<pad>", "lr": 1e-5})
    assert flat == {"a.b.token": "***", "api-key": "***", "data.best_eval_metric_key": "acc", "data.prompt_key": "prompt",
                    "hf.token": "***", "lr": "1e-05", "openai_key": "***", "pad_token": "<pad>", "wandb.key": "***"}
    assert not any(v.startswith("s") and v[1:].isdigit() for v in flat.values())


def test_an_omegaconf_that_cannot_resolve_is_a_value_error() -> None:
    omegaconf = pytest.importorskip("omegaconf", reason="omegaconf is not installed in this venv")
    broken = omegaconf.OmegaConf.create({"a": "${missing}"})
    with pytest.raises(ValueError, match="OmegaConf could not resolve it"):
        flatten_config(broken)
