"""IO binding (service/runtime/iobinding.py), run on the CPU: the binding code the CUDA sessions use,
with device "cpu", gives what session.run gives on real models (several outputs, chosen and
reordered outputs, mixed element types, a strided input, dynamic batches through the batcher);
its failures are classified as session.run's are; and which sessions take it (CUDA only).

The same code on a real device is tests/service/integration/test_cuda.py's."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument, RuntimeException

from models import demo_models
from modelyard.service.batching.batcher import Batcher, BatchSettings
from modelyard.service.errors import DeadlineExceeded, InvalidInput
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.repository.model_config import ModelConfig, parse_config
from modelyard.service.runtime.instances import Instances
from modelyard.service.runtime.iobinding import UNTYPED_PREFIX, DeviceBinding, binding_for, typed_failure
from modelyard.service.runtime.providers import CPU, CUDA, ProviderChoice
from modelyard.service.runtime.runs import RunControl
from modelyard.service.runtime.served import VersionStats
from modelyard.service.runtime.session import ModelRunner, load_runner, run_checked
from modelyard.service.scheduling.queue import AdmissionPolicy
from tests.batching_fakes import Gate, RecordingRunner
from tests.support import eventually

ON_CPU = DeviceBinding("cpu", 0)
NO_GPU = ProviderChoice(False, "test: no CUDA")


def session(model: bytes) -> ort.InferenceSession:
    return ort.InferenceSession(model, providers=[CPU])


def multi_io_feeds(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal((rows, 4), dtype=np.float32),
        "b": rng.integers(-5, 5, (rows, 4), dtype=np.int64),
    }


def loaded(tmp_path: Path, name: str, model: object, config: dict[str, object]) -> ModelRunner:
    path = demo_models.write_model(tmp_path, name, 1, model, config)  # type: ignore[arg-type]
    return load_runner(path, parse_config(config), NO_GPU)


def test_bound_runs_give_what_session_run_gives_for_every_output_and_order() -> None:
    sess = session(demo_models.serialize(demo_models.multi_io()))
    feeds = multi_io_feeds(5)
    for names in (["sum", "argmax"], ["argmax", "sum"], ["argmax"]):
        expected = sess.run(names, feeds)
        bound = ON_CPU.run(sess, feeds, names)
        assert len(bound) == len(names)
        for got, want in zip(bound, expected, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
        # The outputs were copied out of ONNX Runtime's buffers (session.run's are views of them):
        # the bound path ran, not session.run.
        assert all(o.flags.owndata for o in bound) and not any(o.flags.owndata for o in expected)


def test_a_strided_input_is_bound_as_a_contiguous_copy_with_the_same_answer() -> None:
    sess = session(demo_models.serialize(demo_models.mlp((8, 16, 3))))
    wide = np.random.default_rng(1).standard_normal((6, 16), dtype=np.float32)
    strided = wide[:, ::2]  # every other column: not one contiguous block
    assert not strided.flags.c_contiguous
    (expected,) = sess.run(["OUTPUT0"], {"INPUT0": np.ascontiguousarray(strided)})
    (got,) = ON_CPU.run(sess, {"INPUT0": strided}, ["OUTPUT0"])
    np.testing.assert_array_equal(got, expected)


def test_read_only_inputs_as_decoded_requests_give_are_bound_as_they_are() -> None:
    sess = session(demo_models.serialize(demo_models.multi_io()))
    feeds = {k: np.frombuffer(v.tobytes(), v.dtype).reshape(v.shape) for k, v in multi_io_feeds(3).items()}
    assert not any(v.flags.writeable for v in feeds.values())
    for got, want in zip(ON_CPU.run(sess, feeds, ["sum", "argmax"]), sess.run(None, feeds), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_runner_with_the_binding_answers_as_the_plain_runner(tmp_path: Path) -> None:
    plain = loaded(tmp_path, "multi", demo_models.multi_io(), {"max_batch_size": 8})
    assert plain.binding is None  # the CPU path stays session.run
    bound = dataclasses.replace(plain, binding=ON_CPU)
    feeds = multi_io_feeds(3, seed=2)
    for got, want in zip(
        bound.run(feeds, ("argmax", "sum")), plain.run(feeds, ("argmax", "sum")), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_failures_of_a_bound_run_are_classified_as_session_runs_are(tmp_path: Path) -> None:
    bound = dataclasses.replace(
        loaded(tmp_path, "multi", demo_models.multi_io(), {"max_batch_size": 8}), binding=ON_CPU
    )
    wrong_type = {"a": np.ones((2, 4), np.float32), "b": np.ones((2, 4), np.float32)}
    with pytest.raises(InvalidInput, match="data type"):
        run_checked(bound, wrong_type, ("sum",), "model multi version 1")
    # A stopped run stops through the binding's run too (its RunOptions reach ONNX Runtime).
    control = RunControl()
    control.options.terminate = True
    with pytest.raises(Exception, match=r"[Tt]erminat"):
        bound.run(multi_io_feeds(2), ("sum",), control.options)
    control.terminate(DeadlineExceeded("stopped by the test"))
    with pytest.raises(DeadlineExceeded, match="stopped by the test"):
        run_checked(bound, multi_io_feeds(2), ("sum",), "model multi version 1", control)


def test_a_bound_runs_untyped_error_gets_the_type_session_run_gives() -> None:
    sess = session(demo_models.serialize(demo_models.multi_io()))
    wrong_type = {"a": np.ones((2, 4), np.float32), "b": np.ones((2, 4), np.float32)}
    # What ONNX Runtime's run_with_iobinding raises for it: the status code is gone.
    with pytest.raises(RuntimeError) as raised:
        binding = sess.io_binding()
        for name, value in wrong_type.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("sum", "cpu", 0)
        sess.run_with_iobinding(binding)
    assert type(raised.value) is RuntimeError and str(raised.value).startswith(UNTYPED_PREFIX)
    typed = typed_failure(raised.value, sess, wrong_type, ["sum"], None)
    assert isinstance(typed, InvalidArgument) and "Unexpected input data type" in str(typed)
    # Where session.run succeeds, the bound run's own message stands, as ORT's runtime error.
    own = typed_failure(RuntimeError(UNTYPED_PREFIX + "bound output"), sess, multi_io_feeds(2), ["sum"], None)
    assert isinstance(own, RuntimeException) and str(own) == "bound output"


def test_only_cuda_sessions_of_numeric_tensors_take_the_binding(tmp_path: Path) -> None:
    numeric = loaded(tmp_path, "mlp", demo_models.mlp((4, 3)), {"max_batch_size": 4}).signature
    assert binding_for(CUDA, 2, numeric) == DeviceBinding("cuda", 2)
    assert binding_for(CPU, 0, numeric) is None
    assert binding_for(CUDA, 0, numeric, enabled=False) is None  # execution.io_binding: false
    strings = dataclasses.replace(numeric, inputs=(dataclasses.replace(numeric.inputs[0], datatype="BYTES"),))
    assert strings.string_inputs and binding_for(CUDA, 0, strings) is None
    bf16 = dataclasses.replace(numeric, outputs=(dataclasses.replace(numeric.outputs[0], datatype="BF16"),))
    assert bf16.has_bf16 and binding_for(CUDA, 0, bf16) is None
    assert parse_config({"execution": {"io_binding": False}}).execution.io_binding is False
    assert ModelConfig().execution.io_binding is True


@pytest.fixture
async def executor() -> AsyncIterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=2)
    yield pool
    pool.shutdown(wait=True)


async def test_dynamic_batches_through_the_binding_answer_each_request_as_alone(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    plain = loaded(tmp_path, "multi", demo_models.multi_io(), {"max_batch_size": 16})
    runner = RecordingRunner(
        **{f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)}, gate=Gate(open_=False)
    )
    runner = dataclasses.replace(runner, binding=ON_CPU)
    settings = BatchSettings(16, 16, 0.0, 1, AdmissionPolicy())
    batcher = Batcher(
        Instances([runner]), settings, executor, VersionStats(), ServiceMetrics().batching("m", "1", 1)
    )
    requests = [multi_io_feeds(rows, seed=rows) for rows in (1, 3, 2, 4)]
    # The first takes the only run slot and is held; the others queue behind it and form a batch.
    first = asyncio.ensure_future(batcher.infer(requests[0], ("sum", "argmax")))
    await eventually(lambda: runner.gate.entered == 1, "the first run to start")
    rest = [asyncio.ensure_future(batcher.infer(r, ("argmax", "sum"))) for r in requests[1:]]
    await eventually(lambda: batcher.queued == 3, "three requests queued")
    runner.gate.open()
    answers = await asyncio.gather(first, *rest)
    await batcher.close()
    assert [len(x) for x in runner.runs] == [1, 9]  # one run alone, then one batch of three
    for feeds, answer in zip(requests, answers, strict=True):
        want_sum, want_argmax = plain.session.run(["sum", "argmax"], feeds)
        np.testing.assert_array_equal(answer["sum"], want_sum)
        np.testing.assert_array_equal(answer["argmax"], want_argmax)
