"""NVIDIA's tritonclient (gRPC) against `python -m modelyard.service`, as a Triton user would drive it.

tritonclient and our generated code both register protobuf package `inference` in the process-wide
descriptor pool, so tritonclient can never be imported here (this process imports `service`).
The module therefore runs one service process and one client process: the client script below
runs every check in order, each in its own section, and prints one JSON document; the tests read
their section of it and compute reference outputs here with ONNX Runtime or numpy on the same
model files. Arrays cross the process boundary as base64 of their bytes, so comparisons are exact.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from models import demo_models
from tests.support import REPO_ROOT, start_service_process

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tritonclient") is None, reason="tritonclient is not installed"
)


# Runs in a child process: `python -c CLIENT ADDRESS`. Sections run in order and share one
# service, so each one leaves the service as it found it (the repository section runs last).
CLIENT = r"""
import base64, json, sys, threading, traceback

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

client = grpcclient.InferenceServerClient(url=sys.argv[1])
rng = np.random.default_rng(20240601)


def enc(array):
    array = np.ascontiguousarray(array)
    return {"dtype": array.dtype.str, "shape": list(array.shape),
            "b64": base64.b64encode(array.tobytes()).decode("ascii")}


def failure(exc):
    return {"status": exc.status(), "message": exc.message()}


def error_of(call):
    try:
        call()
    except InferenceServerException as exc:
        return failure(exc)
    return None


def tensor(name, array, datatype):
    inp = grpcclient.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array)
    return inp


def fp32(rows, cols):
    return rng.standard_normal((rows, cols), dtype=np.float32)


def infer_classifier(x, **kwargs):
    return client.infer("classifier", [tensor("INPUT0", x, "FP32")], **kwargs)


def outputs_of(result):
    return [(o.name, o.datatype, list(o.shape)) for o in result.get_response().outputs]


def health():
    return {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "classifier_ready": client.is_model_ready("classifier"),
        "classifier_v1_ready": client.is_model_ready("classifier", "1"),
        "classifier_v9_ready": client.is_model_ready("classifier", "9"),
        "scaler_v1_ready": client.is_model_ready("scaler", "1"),
        "nope_ready": client.is_model_ready("nope"),
    }


def metadata():
    server = client.get_server_metadata()
    meta = client.get_model_metadata("classifier")
    scaler = client.get_model_metadata("scaler", model_version="1")
    config = client.get_model_config("classifier").config
    mixed = client.get_model_config("mixed").config
    as_json = client.get_model_metadata("mixed", as_json=True)
    index = client.get_model_repository_index()

    def tensors(items):
        return [(t.name, t.datatype, list(t.shape)) for t in items]

    def config_tensors(items):
        return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in items]

    return {
        "server": {"name": server.name, "version": server.version, "extensions": list(server.extensions)},
        "classifier": {"name": meta.name, "versions": list(meta.versions), "platform": meta.platform,
                       "inputs": tensors(meta.inputs), "outputs": tensors(meta.outputs)},
        "scaler_versions": list(scaler.versions),
        "mixed_json": as_json,
        "config": {"name": config.name, "platform": config.platform, "backend": config.backend,
                   "max_batch_size": config.max_batch_size, "input": config_tensors(config.input),
                   "output": config_tensors(config.output)},
        "mixed_config": {"max_batch_size": mixed.max_batch_size, "input": config_tensors(mixed.input),
                         "output": config_tensors(mixed.output)},
        "index": [(m.name, m.version, m.state) for m in index.models],
        "metadata_nope": error_of(lambda: client.get_model_metadata("nope")),
        "config_nope": error_of(lambda: client.get_model_config("nope")),
    }


def infer():
    x = fp32(5, 64)
    result = infer_classifier(x, request_id="req-42")
    response = result.get_response()
    # Triton's own request parameters (priority, timeout) and custom ones travel in `parameters`.
    param_x = fp32(1, 64)
    with_params = infer_classifier(param_x, priority=1, timeout=10_000_000, parameters={"custom": "yes"})
    gzip_x = fp32(3, 64)
    gzipped = infer_classifier(gzip_x, compression_algorithm="gzip")
    async_x = fp32(2, 64)
    done, box = threading.Event(), {}

    def callback(result, error):
        box["result"], box["error"] = result, error
        done.set()

    client.async_infer("classifier", [tensor("INPUT0", async_x, "FP32")], callback)
    if not done.wait(30):
        raise TimeoutError("async_infer never called back")
    if box["error"] is not None:
        raise box["error"]
    return {
        "x": enc(x),
        "y": enc(result.as_numpy("OUTPUT0")),
        "model_name": response.model_name,
        "model_version": response.model_version,
        "id": response.id,
        "outputs": outputs_of(result),
        "param_x": enc(param_x),
        "param_y": enc(with_params.as_numpy("OUTPUT0")),
        "gzip_x": enc(gzip_x),
        "gzip_y": enc(gzipped.as_numpy("OUTPUT0")),
        "async_x": enc(async_x),
        "async_y": enc(box["result"].as_numpy("OUTPUT0")),
    }


def mixed():
    a = fp32(3, 4)
    b = rng.integers(-100, 100, size=(3, 4), dtype=np.int64)
    inputs = [tensor("a", a, "FP32"), tensor("b", b, "INT64")]
    only = client.infer("mixed", inputs, outputs=[grpcclient.InferRequestedOutput("argmax")])
    both = client.infer("mixed", inputs, outputs=[grpcclient.InferRequestedOutput("sum"),
                                                  grpcclient.InferRequestedOutput("argmax")])
    every = client.infer("mixed", inputs)
    return {
        "a": enc(a), "b": enc(b),
        "only_outputs": outputs_of(only), "only_argmax": enc(only.as_numpy("argmax")),
        "only_sum_is_none": only.as_numpy("sum") is None,
        "both_outputs": outputs_of(both),
        "both_sum": enc(both.as_numpy("sum")), "both_argmax": enc(both.as_numpy("argmax")),
        "every_outputs": sorted(name for name, _, _ in outputs_of(every)),
    }


def versions():
    x = fp32(4, 16)
    out = {"x": enc(x)}
    for key, version in (("v1", "1"), ("v2", "2"), ("default", "")):
        result = client.infer("scaler", [tensor("INPUT0", x, "FP32")], model_version=version)
        out[key] = {"y": enc(result.as_numpy("OUTPUT0")), "version": result.get_response().model_version}
    return out


def typed():
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(sys.argv[1]))

    def request(model, *tensors, version=""):
        req = service_pb2.ModelInferRequest(model_name=model, model_version=version, id="typed")
        for name, datatype, array, field in tensors:
            inp = req.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
            getattr(inp.contents, field).extend(array.ravel().tolist())
        return req

    def rpc_error(req):
        try:
            stub.ModelInfer(req)
        except grpc.RpcError as exc:
            return {"status": str(exc.code()), "message": exc.details()}
        return None

    x = fp32(2, 64)
    classifier = client._client_stub.ModelInfer(request("classifier", ("INPUT0", "FP32", x, "fp32_contents")))
    a = fp32(2, 4)
    b = rng.integers(-5, 5, size=(2, 4), dtype=np.int64)
    mixed = stub.ModelInfer(request("mixed", ("a", "FP32", a, "fp32_contents"),
                                    ("b", "INT64", b, "int64_contents")))
    mixed_result = grpcclient.InferResult(mixed)
    short = request("classifier", ("INPUT0", "FP32", x, "fp32_contents"))
    del short.inputs[0].contents.fp32_contents[-1]
    wrong_field = request("classifier", ("INPUT0", "FP32", x.astype(np.float64), "fp64_contents"))
    return {
        "x": enc(x),
        "y": enc(grpcclient.InferResult(classifier).as_numpy("OUTPUT0")),
        "id": classifier.id,
        "version": classifier.model_version,
        "a": enc(a), "b": enc(b),
        "sum": enc(mixed_result.as_numpy("sum")), "argmax": enc(mixed_result.as_numpy("argmax")),
        "short": rpc_error(short),
        "wrong_field": rpc_error(wrong_field),
    }


def errors():
    good = fp32(5, 64)
    out = {
        "unknown_model": error_of(lambda: client.infer("nope", [tensor("INPUT0", good, "FP32")])),
        "unknown_version": error_of(lambda: infer_classifier(good, model_version="9")),
        "bad_version": error_of(lambda: infer_classifier(good, model_version="latest")),
        "wrong_name": error_of(
            lambda: client.infer("classifier", [tensor("WRONG_INPUT", good, "FP32")])),
        "wrong_datatype": error_of(lambda: client.infer(
            "classifier", [tensor("INPUT0", good.astype(np.int32), "INT32")])),
        "wrong_shape": error_of(lambda: infer_classifier(fp32(5, 63))),
        "too_big": error_of(lambda: infer_classifier(fp32(33, 64))),
        "unknown_output": error_of(lambda: client.infer(
            "classifier", [tensor("INPUT0", good, "FP32")],
            outputs=[grpcclient.InferRequestedOutput("NOPE")])),
        "missing_input": error_of(lambda: client.infer("mixed", [tensor("a", fp32(2, 4), "FP32")])),
        "batch_mismatch": error_of(lambda: client.infer("mixed", [
            tensor("a", fp32(2, 4), "FP32"), tensor("b", np.zeros((3, 4), np.int64), "INT64")])),
    }
    after = infer_classifier(good)
    out["after"] = {"x": enc(good), "y": enc(after.as_numpy("OUTPUT0"))}
    return out


def stream():
    lock, done, received = threading.Lock(), threading.Event(), []

    def callback(result, error):
        with lock:
            if error is not None:
                received.append({"error": error.message(), "status": error.status()})
            else:
                response = result.get_response()
                received.append({"id": response.id, "model": response.model_name,
                                 "version": response.model_version, "y": enc(result.as_numpy("OUTPUT0"))})
            if len(received) == 3:
                done.set()

    x = fp32(2, 16)
    c = fp32(3, 64)
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer("scaler", [tensor("INPUT0", x, "FP32")], model_version="1",
                                  request_id="s-1")
        client.async_stream_infer("nope", [tensor("INPUT0", x, "FP32")], request_id="s-2")
        client.async_stream_infer("classifier", [tensor("INPUT0", c, "FP32")], request_id="s-3")
        delivered = done.wait(30)
    finally:
        client.stop_stream()
    return {"x": enc(x), "c": enc(c), "delivered": delivered, "received": received}


def statistics():
    before = client.get_inference_statistics("classifier")
    rows = [1, 2, 3, 4]
    for n in rows:
        infer_classifier(fp32(n, 64))
    after = client.get_inference_statistics("classifier")

    def summary(response):
        return [{"name": s.name, "version": s.version, "inference_count": s.inference_count,
                 "execution_count": s.execution_count, "success": s.inference_stats.success.count,
                 "success_ns": s.inference_stats.success.ns, "last_inference": s.last_inference}
                for s in response.model_stats]

    every = client.get_inference_statistics()
    scaler = client.get_inference_statistics("scaler")
    scaler_v1 = client.get_inference_statistics("scaler", model_version="1")
    return {
        "rows": rows,
        "before": summary(before),
        "after": summary(after),
        "every": sorted((s.name, s.version) for s in every.model_stats),
        "scaler": sorted(s.version for s in scaler.model_stats),
        "scaler_v1": [s.version for s in scaler_v1.model_stats],
        "nope": error_of(lambda: client.get_inference_statistics("nope")),
    }


def repository():
    x = fp32(2, 16)

    def scaler_index():
        return sorted((m.version, m.state) for m in client.get_model_repository_index().models
                      if m.name == "scaler")

    client.unload_model("scaler")
    unloaded = {
        "ready": client.is_model_ready("scaler"),
        "ready_v1": client.is_model_ready("scaler", "1"),
        "index": scaler_index(),
        "infer": error_of(lambda: client.infer("scaler", [tensor("INPUT0", x, "FP32")])),
        "others_ready": client.is_model_ready("classifier"),
    }
    client.load_model("scaler")
    result = client.infer("scaler", [tensor("INPUT0", x, "FP32")])
    loaded = {
        "ready": client.is_model_ready("scaler"),
        "index": scaler_index(),
        "y": enc(result.as_numpy("OUTPUT0")),
        "version": result.get_response().model_version,
    }
    return {"x": enc(x), "unloaded": unloaded, "loaded": loaded,
            "load_nope": error_of(lambda: client.load_model("nope"))}


results = {}
for section in (health, metadata, infer, mixed, versions, typed, errors, stream, statistics, repository):
    try:
        results[section.__name__] = {"ok": True, "value": section()}
    except Exception:
        results[section.__name__] = {"ok": False, "error": traceback.format_exc()}
client.close()
json.dump(results, sys.stdout)
"""


@dataclass
class Run:
    repository: Path
    results: dict[str, Any]
    log: list[str]
    returncode: int


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    repository = tmp_path_factory.mktemp("tritonclient") / "models"
    demo_models.build_demo_repository(repository)
    # Management open, as Triton's explicit model control: the client drives repository calls.
    service = start_service_process(repository, "--management-open")
    try:
        client = subprocess.run(
            [sys.executable, "-c", CLIENT, service.address],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=REPO_ROOT,
        )
        assert client.returncode == 0, f"client failed:\n{client.stderr}\nservice log:\n" + "\n".join(
            service.log
        )
        results = json.loads(client.stdout)
    finally:
        returncode = service.stop()
    yield Run(repository, results, service.log, returncode)


def section(run: Run, name: str) -> Any:
    entry = run.results[name]
    assert entry["ok"], f"client section {name!r} raised:\n{entry['error']}\nservice log:\n" + "\n".join(
        run.log[-40:]
    )
    return entry["value"]


def arr(encoded: dict[str, Any]) -> np.ndarray:
    data = base64.b64decode(encoded["b64"])
    return np.frombuffer(data, dtype=np.dtype(encoded["dtype"])).reshape(encoded["shape"])


def ort_run(repository: Path, model: str, version: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    folder = repository / model / version
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    return list(session.run(None, feeds))


def classify(run: Run, x: np.ndarray) -> np.ndarray:
    return ort_run(run.repository, "classifier", "1", {"INPUT0": x})[0]


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7)


def assert_error(error: dict[str, str] | None, status: str, *words: str) -> None:
    assert error is not None, "the call succeeded; an error was expected"
    assert status in (error["status"] or ""), error
    for word in words:
        assert word in error["message"], error


def test_health(run: Run) -> None:
    assert section(run, "health") == {
        "live": True,
        "ready": True,
        "classifier_ready": True,
        "classifier_v1_ready": True,
        "classifier_v9_ready": False,
        "scaler_v1_ready": True,
        "nope_ready": False,
    }


def test_server_and_model_metadata(run: Run) -> None:
    meta = section(run, "metadata")
    assert meta["server"]["name"] == "modelyard"
    assert meta["server"]["version"]
    assert {"model_repository", "model_configuration", "statistics"} <= set(meta["server"]["extensions"])
    assert meta["classifier"] == {
        "name": "classifier",
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": [["INPUT0", "FP32", [-1, 64]]],
        "outputs": [["OUTPUT0", "FP32", [-1, 8]]],
    }
    assert meta["scaler_versions"] == ["1"]  # a requested version lists that version only, as Triton
    # as_json goes through MessageToJson: int64 shapes come back as strings.
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["mixed_json"]["inputs"]] == [
        ("a", "FP32", ["-1", "4"]),
        ("b", "INT64", ["-1", "4"]),
    ]
    assert_error(meta["metadata_nope"], "NOT_FOUND", "nope")


def test_model_config(run: Run) -> None:
    meta = section(run, "metadata")
    # Triton leaves the batch dimension out of dims when max_batch_size > 0.
    assert meta["config"] == {
        "name": "classifier",
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "max_batch_size": 32,
        "input": [["INPUT0", "TYPE_FP32", [64]]],
        "output": [["OUTPUT0", "TYPE_FP32", [8]]],
    }
    mixed = meta["mixed_config"]
    assert mixed["max_batch_size"] == 8
    assert mixed["input"] == [["a", "TYPE_FP32", [4]], ["b", "TYPE_INT64", [4]]]
    (sum_name, sum_type, sum_dims), (argmax_name, argmax_type, argmax_dims) = mixed["output"]
    assert (sum_name, sum_type, sum_dims) == ("sum", "TYPE_FP32", [4])
    # argmax is [batch]: one scalar per row. Triton itself would write dims [1] with reshape
    # shape []; dims [] carries the same meaning, so either is accepted here.
    assert (argmax_name, argmax_type) == ("argmax", "TYPE_INT64")
    assert argmax_dims in ([], [1])
    assert_error(meta["config_nope"], "NOT_FOUND")


def test_repository_index(run: Run) -> None:
    index = {tuple(m) for m in section(run, "metadata")["index"]}
    assert index == {
        ("classifier", "1", "READY"),
        ("mixed", "1", "READY"),
        ("scaler", "1", "READY"),
        ("scaler", "2", "READY"),
    }


def test_infer_raw_matches_onnxruntime(run: Run) -> None:
    result = section(run, "infer")
    x, y = arr(result["x"]), arr(result["y"])
    assert x.shape == (5, 64)
    assert y.shape == (5, 8)
    assert_close(y, classify(run, x))
    assert result["model_name"] == "classifier"
    assert result["model_version"] == "1"
    assert result["id"] == "req-42"
    assert result["outputs"] == [["OUTPUT0", "FP32", [5, 8]]]
    assert_close(arr(result["param_y"]), classify(run, arr(result["param_x"])))
    assert_close(arr(result["gzip_y"]), classify(run, arr(result["gzip_x"])))
    assert_close(arr(result["async_y"]), classify(run, arr(result["async_x"])))


def test_output_selection_and_mixed_dtypes(run: Run) -> None:
    result = section(run, "mixed")
    a, b = arr(result["a"]), arr(result["b"])
    assert result["only_outputs"] == [["argmax", "INT64", [3]]]
    assert result["only_sum_is_none"]
    np.testing.assert_array_equal(arr(result["only_argmax"]), np.argmax(a, axis=1).astype(np.int64))
    assert result["both_outputs"] == [["sum", "FP32", [3, 4]], ["argmax", "INT64", [3]]]
    assert_close(arr(result["both_sum"]), a + b.astype(np.float32))
    np.testing.assert_array_equal(arr(result["both_argmax"]), np.argmax(a, axis=1))
    assert result["every_outputs"] == ["argmax", "sum"]


def test_model_version_pinning(run: Run) -> None:
    result = section(run, "versions")
    x = arr(result["x"])
    for key, scale, version in (("v1", 2.0, "1"), ("v2", 3.0, "2"), ("default", 3.0, "2")):
        assert result[key]["version"] == version, key
        np.testing.assert_array_equal(arr(result[key]["y"]), x * np.float32(scale), err_msg=key)


def test_typed_contents(run: Run) -> None:
    result = section(run, "typed")
    assert_close(arr(result["y"]), classify(run, arr(result["x"])))
    assert result["id"] == "typed"
    assert result["version"] == "1"
    a, b = arr(result["a"]), arr(result["b"])
    assert_close(arr(result["sum"]), a + b.astype(np.float32))
    np.testing.assert_array_equal(arr(result["argmax"]), np.argmax(a, axis=1))
    assert_error(result["short"], "INVALID_ARGUMENT", "INPUT0", "fp32_contents")
    assert_error(result["wrong_field"], "INVALID_ARGUMENT", "INPUT0")


def test_errors_map_to_triton_status_codes(run: Run) -> None:
    errors = section(run, "errors")
    assert_error(errors["unknown_model"], "NOT_FOUND", "nope")
    assert_error(errors["unknown_version"], "NOT_FOUND", "9")
    assert_error(errors["bad_version"], "INVALID_ARGUMENT", "latest")
    assert_error(errors["wrong_name"], "INVALID_ARGUMENT", "WRONG_INPUT")
    assert_error(errors["wrong_datatype"], "INVALID_ARGUMENT", "INPUT0", "INT32")
    assert_error(errors["wrong_shape"], "INVALID_ARGUMENT", "INPUT0", "63")
    assert_error(errors["too_big"], "INVALID_ARGUMENT", "INPUT0", "33")
    assert_error(errors["unknown_output"], "INVALID_ARGUMENT", "NOPE")
    assert_error(errors["missing_input"], "INVALID_ARGUMENT", "'b'")
    assert_error(errors["batch_mismatch"], "INVALID_ARGUMENT")
    after = errors["after"]
    assert_close(arr(after["y"]), classify(run, arr(after["x"])))


def test_stream_answers_errors_in_band(run: Run) -> None:
    result = section(run, "stream")
    assert result["delivered"], result["received"]
    first, second, third = result["received"]
    assert first["id"] == "s-1"
    assert (first["model"], first["version"]) == ("scaler", "1")
    np.testing.assert_array_equal(arr(first["y"]), arr(result["x"]) * np.float32(2.0))
    assert "nope" in second["error"], second
    assert third["id"] == "s-3"
    assert (third["model"], third["version"]) == ("classifier", "1")
    assert_close(arr(third["y"]), classify(run, arr(result["c"])))


def test_inference_statistics(run: Run) -> None:
    stats = section(run, "statistics")
    rows = stats["rows"]
    [before], [after] = stats["before"], stats["after"]
    assert (after["name"], after["version"]) == ("classifier", "1")
    assert after["success"] - before["success"] == len(rows)
    assert after["execution_count"] - before["execution_count"] == len(rows)
    assert after["inference_count"] - before["inference_count"] == sum(rows)
    assert after["success_ns"] > before["success_ns"]
    assert after["last_inference"] > 0
    # Earlier sections ran successful inferences on classifier too.
    assert before["success"] > 0
    assert stats["every"] == [["classifier", "1"], ["mixed", "1"], ["scaler", "1"], ["scaler", "2"]]
    assert stats["scaler"] == ["1", "2"]
    assert stats["scaler_v1"] == ["1"]
    assert_error(stats["nope"], "NOT_FOUND")


def test_unload_and_load(run: Run) -> None:
    result = section(run, "repository")
    unloaded = result["unloaded"]
    assert unloaded["ready"] is False
    assert unloaded["ready_v1"] is False
    assert unloaded["others_ready"] is True
    assert unloaded["index"] == [["1", "UNAVAILABLE"], ["2", "UNAVAILABLE"]]
    error = unloaded["infer"]
    assert error is not None
    assert "NOT_FOUND" in error["status"] or "UNAVAILABLE" in error["status"], error
    assert "scaler" in error["message"]
    loaded = result["loaded"]
    assert loaded["ready"] is True
    assert loaded["index"] == [["1", "READY"], ["2", "READY"]]
    assert loaded["version"] == "2"
    np.testing.assert_array_equal(arr(loaded["y"]), arr(result["x"]) * np.float32(3.0))
    assert_error(result["load_nope"], "NOT_FOUND", "nope")


def test_service_log_clean_and_graceful_stop(run: Run) -> None:
    assert not [line for line in run.log if "Traceback" in line or "internal error" in line], run.log
    assert run.returncode == 0, run.log[-20:]
