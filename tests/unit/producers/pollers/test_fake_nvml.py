"""tests/fake_nvml.py against the real ``pynvml`` (nvidia-ml-py, installed with rlpulse[dev]): the fake's errors are
pynvml's classes, its constants pynvml's values, its functions pynvml's names and parameters, what they return the
fields of pynvml's structures; and the GPU poller on the real path the fake now takes for a bad index."""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace

import pytest

from rlpulse.producers.pollers.gpu_poller import GpuPoller, Placement
from rlpulse.producers.sdk.sender import Outgoing
from rlpulse.base.settings import Settings
from tests import fake_nvml
from tests.fake_nvml import CONSTANTS, ERRORS, FakeHandle, FakeNvml

pytestmark = pytest.mark.full

pynvml = pytest.importorskip("pynvml")


def fake_functions() -> list[str]:
    return sorted(n for n, v in vars(FakeNvml).items() if n.startswith("nvml") and callable(v))


def test_the_fakes_errors_are_pynvmls_classes() -> None:
    for name in ERRORS:
        assert getattr(fake_nvml, name) is getattr(pynvml, name) is getattr(FakeNvml, name), name
    # NVMLError(code) maps to the code's class, as pynvml's NVMLError.__new__ does
    mismatch = FakeNvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    assert type(mismatch) is pynvml.NVMLError_ArgumentVersionMismatch and mismatch.value == 25
    assert FakeNvml.NVMLError_Timeout().value == pynvml.NVML_ERROR_TIMEOUT
    assert issubclass(FakeNvml.NVMLError_InvalidArgument, pynvml.NVMLError)


def test_a_bad_index_raises_invalid_argument_as_the_real_library() -> None:
    fake = FakeNvml(["GPU-a"])
    for index in (1, -1, 99):
        with pytest.raises(pynvml.NVMLError_InvalidArgument) as caught:
            fake.nvmlDeviceGetHandleByIndex(index)
        assert caught.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT and str(caught.value) == "Invalid Argument"


def test_the_fakes_constants_are_pynvmls() -> None:
    for name in CONSTANTS:
        assert getattr(FakeNvml, name) == getattr(pynvml, name), name
    consts = {n for n in vars(FakeNvml) if n.startswith(("NVML_", "nvmlEventType", "nvmlMemory"))}
    assert consts == set(CONSTANTS)  # every constant the fake has is checked here


def test_every_function_of_the_fake_is_pynvmls_with_its_parameters() -> None:
    assert len(fake_functions()) >= 20
    for name in fake_functions():
        real = getattr(pynvml, name, None)
        assert callable(real), f"pynvml has no {name}"
        ours = inspect.signature(getattr(FakeNvml([]), name))
        theirs = inspect.signature(real)
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
               [(p.name, p.kind, p.default) for p in theirs.parameters.values()], name


def fields(struct: type) -> list[str]:
    return [f[0] for f in struct._fields_]


def test_what_the_fake_returns_has_pynvmls_shapes() -> None:
    fake = FakeNvml(["GPU-a"])
    fake.push(0, mem_used=3, mem_reserved=2, mem_total=10, util_gpu=40, util_memory=5, nvlink_tx_kib=7)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    v1, v2 = fake.nvmlDeviceGetMemoryInfo(h), fake.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert type(v1) is pynvml.c_nvmlMemory_t and (v1.total, v1.free, v1.used) == (10, 5, 5)  # v1's used has reserved
    assert type(v2) is pynvml.c_nvmlMemory_v2_t and (v2.version, v2.total, v2.reserved, v2.free, v2.used) == (
        pynvml.nvmlMemory_v2, 10, 2, 5, 3)
    util = fake.nvmlDeviceGetUtilizationRates(h)
    assert type(util) is pynvml.c_nvmlUtilization_t and (util.gpu, util.memory) == (40, 5)
    [tx] = fake.nvmlDeviceGetFieldValues(h, [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF)])
    assert type(tx) is pynvml.c_nvmlFieldValue_t and tx.value.ullVal == 7 and tx.nvmlReturn == pynvml.NVML_SUCCESS
    assert type(fake.nvmlGpmQueryDeviceSupport(h)) is pynvml.c_nvmlGpmSupport_t
    assert isinstance(fake.nvmlDeviceGetUUID(h), str) and len(fake.nvmlDeviceGetRemappedRows(h)) == 4
    # what the fake cannot fill with ctypes (its handles are not pointers) has the structures' fields
    fake.xid(0, 79)
    event = fake.nvmlEventSetWait_v2(fake.nvmlEventSetCreate(), 5)
    assert isinstance(event, SimpleNamespace) and list(vars(event)) == fields(pynvml.c_nvmlEventData_t)
    metrics = FakeNvml.c_nvmlGpmMetricsGet_t()
    assert list(vars(metrics)) == fields(pynvml.c_nvmlGpmMetricsGet_t)
    assert list(vars(metrics.metrics[0])) == fields(pynvml.c_nvmlGpmMetric_t)
    assert len(metrics.metrics) == pynvml.NVML_GPM_METRIC_MAX


def test_the_gpu_poller_takes_a_bad_index_as_a_gpu_it_cannot_read(caplog) -> None:
    out: list[Outgoing] = []
    poller = GpuPoller(FakeNvml(["GPU-a"]), out.append, Settings(topic_prefix="t"), indices=[0, 3], host="h1",
                       clock=lambda: 1_000, placement=Placement(run_id="r1"))
    with caplog.at_level(logging.WARNING):
        assert poller.open()
        poller.sample()
        records = poller.export()
    assert [r["hw_id"] for r in records] == ["GPU-a"]
    assert [(o.key, o.record["hw_id"]) for o in out if o.schema == "Placement"] == [("GPU-a", "GPU-a"), ("h1/3", None)]
    assert "GPU 3: cannot read its handle/UUID (Invalid Argument)" in caplog.text
    assert FakeHandle(0) in {FakeHandle(0)}  # the fake's handles stay hashable keys, as the poller keeps them
