"""Triton protocol details through NVIDIA's tritonclient: BYTES tensors, model load with a config
or files, classification, BF16, streaming final responses, statistics, log and trace settings.

As in test_tritonclient.py, tritonclient cannot be imported in this process (both register the
protobuf package `inference`), so one client process runs every section and prints JSON.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from models.demo_models import dense_classifier, scaled_identity, write_model
from tests.bf16_model import bf16_double
from tests.strings_model import byte_lookup, string_identity
from tests.support import REPO_ROOT, start_service_process
from tests.triton.integration.test_tritonclient import Run, arr, assert_error, ort_run, section

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tritonclient") is None, reason="tritonclient is not installed"
)

CLIENT = r"""
import base64, json, os, sys, threading, traceback

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

client = grpcclient.InferenceServerClient(url=sys.argv[1])
rng = np.random.default_rng(7)


def enc(array):
    array = np.ascontiguousarray(array)
    return {"dtype": array.dtype.str, "shape": list(array.shape),
            "b64": base64.b64encode(array.tobytes()).decode("ascii")}


def b64s(items):
    return [base64.b64encode(x).decode("ascii") for x in items]


def error_of(call):
    try:
        call()
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return None


def tensor(name, array, datatype):
    inp = grpcclient.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array)
    return inp


ITEMS = [b"hello", b"", b"a\x00b", "\u00e9\u20ac".encode(), b"\x00", b"\t \n"]


def text_array():
    array = np.empty((2, 3), dtype=object)
    array.reshape(-1)[:] = ITEMS
    return array


def bytes_section():
    out = {}
    for model in ("text", "text_batched"):
        result = client.infer(model, [tensor("TEXT", text_array(), "BYTES")])
        out[model] = b64s(result.as_numpy("ECHO").reshape(-1).tolist())
        out[model + "_shape"] = list(result.as_numpy("ECHO").shape)
    done, box = threading.Event(), []

    def callback(result, error):
        box.append(error.message() if error else b64s(result.as_numpy("ECHO").reshape(-1).tolist()))
        done.set()

    client.start_stream(callback=callback)
    try:
        client.async_stream_infer("text_batched", [tensor("TEXT", text_array(), "BYTES")])
        out["stream_delivered"] = done.wait(30)
    finally:
        client.stop_stream()
    out["stream"] = box
    binary = np.array([[b"ok", b"\xff\xfe", b"\x89PNG\r\n"]], dtype=object)
    out["non_utf8"] = client.infer("lookup", [tensor("TEXT", binary, "BYTES")]).as_numpy("ID").tolist()
    out["non_utf8_echo"] = error_of(lambda: client.infer("text", [tensor("TEXT", binary, "BYTES")]))
    return out


def load_section():
    import pathlib
    x = np.ones((5, 16), np.float32)
    model_bytes = (pathlib.Path(sys.argv[2]) / "scaler" / "1" / "model.onnx").read_bytes()
    out = {"before": client.get_model_config("scaler").config.max_batch_size}
    client.load_model("scaler", config='{"max_batch_size": 4}')
    out["after"] = client.get_model_config("scaler").config.max_batch_size
    out["too_big"] = error_of(lambda: client.infer("scaler", [tensor("INPUT0", x, "FP32")]))
    out["fits"] = enc(client.infer("scaler", [tensor("INPUT0", x[:4], "FP32")]).as_numpy("OUTPUT0"))
    out["malformed"] = error_of(lambda: client.load_model("scaler", config='{"max_batch_size": '))
    out["unknown_field"] = error_of(lambda: client.load_model("scaler", config='{"no_such": 1}'))
    sequence = json.dumps({"sequence_batching": {"iterative_sequence": True}})  # (provisional in Triton)
    out["unsupported"] = error_of(lambda: client.load_model("scaler", config=sequence))
    too_big = json.dumps({"max_batch_size": 4, "dynamic_batching": {"preferred_batch_size": [8]}})
    out["invalid_value"] = error_of(lambda: client.load_model("scaler", config=too_big))
    out["still_four"] = client.get_model_config("scaler").config.max_batch_size
    # What get_model_config answers loads back unchanged (the round trip of a Triton user).
    for model in ("text_batched", "labelled"):
        before = client.get_model_config(model, as_json=True)["config"]
        client.load_model(model, config=json.dumps(before))
        out[model + "_round_trip"] = client.get_model_config(model, as_json=True)["config"] == before
    client.load_model("scaler")
    out["reverted"] = client.get_model_config("scaler").config.max_batch_size
    upload_config = json.dumps({"max_batch_size": 8, "input": [
        {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}]})
    out["files_without_config"] = error_of(
        lambda: client.load_model("uploaded", files={"file:1/model.onnx": model_bytes}))
    out["escaping_path"] = error_of(lambda: client.load_model(
        "uploaded", config=upload_config, files={"file:../1/model.onnx": model_bytes}))
    out["no_model_file"] = error_of(
        lambda: client.load_model("uploaded", config=upload_config, files={"file:1/other.onnx": model_bytes}))
    out["garbage_model"] = error_of(
        lambda: client.load_model("uploaded", config=upload_config, files={"file:1/model.onnx": b"not onnx"}))
    client.load_model("uploaded", config=upload_config, files={"file:1/model.onnx": model_bytes})
    out["uploaded_config"] = client.get_model_config("uploaded").config.max_batch_size
    out["uploaded_y"] = enc(client.infer("uploaded", [tensor("INPUT0", x, "FP32")]).as_numpy("OUTPUT0"))
    out["uploaded_too_big"] = error_of(
        lambda: client.infer("uploaded", [tensor("INPUT0", np.ones((9, 16), np.float32), "FP32")]))
    client.unload_model("uploaded")
    return out


def classification_section():
    x = rng.standard_normal((3, 64), dtype=np.float32)
    top3 = client.infer("labelled", [tensor("INPUT0", x, "FP32")],
                        outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=3)])
    every = client.infer("labelled", [tensor("INPUT0", x[:1], "FP32")],
                         outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=100)])
    response = top3.get_response().outputs[0]
    return {
        "x": enc(x),
        "top3": [[s.decode() for s in row] for row in top3.as_numpy("OUTPUT0").tolist()],
        "datatype": response.datatype, "shape": list(response.shape),
        "every": [s.decode() for s in every.as_numpy("OUTPUT0").reshape(-1).tolist()],
        "on_bytes": error_of(lambda: client.infer("text", [tensor("TEXT", text_array(), "BYTES")],
                             outputs=[grpcclient.InferRequestedOutput("ECHO", class_count=2)])),
        "label_filename": client.get_model_config("labelled").config.output[0].label_filename,
    }


def bf16_section():
    from tritonclient.grpc import model_config_pb2
    x = np.array([[1.0, -2.5, 0.1, 7.0], [0.0, 1e-3, -65504.0, 3.0]], np.float32)
    result = client.infer("bf16", [tensor("X", x, "BF16")])
    meta = client.get_model_metadata("bf16")
    config = client.get_model_config("bf16").config
    return {
        "x": enc(x), "y": enc(result.as_numpy("Y")), "y32": enc(result.as_numpy("Y32")),
        "outputs": [(o.name, o.datatype) for o in result.get_response().outputs],
        "metadata": [(t.name, t.datatype) for t in list(meta.inputs) + list(meta.outputs)],
        "config": [model_config_pb2.DataType.Name(t.data_type)
                   for t in list(config.input) + list(config.output)],
        "as_fp32": error_of(lambda: client.infer("bf16", [tensor("X", x, "FP32")])),
    }


def protocol_section():
    x = np.ones((2, 16), np.float32)
    lock, done, received = threading.Lock(), threading.Event(), []

    def callback(result, error):
        with lock:
            if error is not None:
                received.append({"error": error.message()})
            else:
                params = result.get_response().parameters
                flag = "triton_final_response"
                final = params[flag].bool_param if flag in params else None
                received.append({"id": result.get_response().id, "final": final,
                                 "has_output": result.as_numpy("OUTPUT0") is not None})
            if len(received) == 2:
                done.set()

    client.start_stream(callback=callback)
    try:
        client.async_stream_infer("scaler", [tensor("INPUT0", x, "FP32")], request_id="with",
                                  enable_empty_final_response=True)
        client.async_stream_infer("scaler", [tensor("INPUT0", x, "FP32")], request_id="without")
        delivered = done.wait(30)
    finally:
        client.stop_stream()

    def stats(model):
        (s,) = client.get_inference_statistics(model).model_stats
        i = s.inference_stats
        return {"success": i.success.count, "fail": i.fail.count, "queue": i.queue.count,
                "compute_infer": i.compute_infer.count, "compute_input": i.compute_input.count,
                "compute_output": i.compute_output.count, "compute_ns": i.compute_infer.ns,
                "execution_count": s.execution_count}

    before = stats("scaler")
    for _ in range(3):
        client.infer("scaler", [tensor("INPUT0", x, "FP32")])
    bad = error_of(lambda: client.infer("scaler", [tensor("INPUT0", np.ones((2, 15), np.float32), "FP32")]))
    after = stats("scaler")
    text = np.array([[b"x"]], dtype=object)

    def echo_at(priority):
        result = client.infer("text_batched", [tensor("TEXT", text, "BYTES")], priority=priority)
        return b64s(result.as_numpy("ECHO").reshape(-1).tolist())

    return {
        "delivered": delivered, "received": received,
        "before": before, "after": after, "bad": bad,
        "metadata_v1": list(client.get_model_metadata("scaler", model_version="1").versions),
        "metadata_any": list(client.get_model_metadata("scaler").versions),
        "priority_out_of_range": echo_at(9),
        "priority_in_range": echo_at(1),
    }


def shm_section():
    # Python's own POSIX shared memory (tritonclient's helper module needs pkg_resources).
    from multiprocessing import shared_memory
    x = rng.standard_normal((4, 16), dtype=np.float32)
    name_in, name_out = f"modelyard_test_in_{os.getpid()}", f"modelyard_test_out_{os.getpid()}"
    key_in, key_out = "/" + name_in, "/" + name_out
    region_in = shared_memory.SharedMemory(name_in, create=True, size=x.nbytes + 64)
    region_out = shared_memory.SharedMemory(name_out, create=True, size=x.nbytes)

    def out_contents():
        return np.frombuffer(region_out.buf, np.float32, count=x.size).reshape(4, 16).copy()

    out = {"x": enc(x)}
    try:
        region_in.buf[64:64 + x.nbytes] = x.tobytes()
        client.unregister_system_shared_memory()
        client.register_system_shared_memory("in", key_in, x.nbytes + 64)
        client.register_system_shared_memory("out", key_out, x.nbytes)
        status = client.get_system_shared_memory_status()
        out["status"] = sorted((r.name, r.key, r.offset, r.byte_size) for r in status.regions.values())
        inp = grpcclient.InferInput("INPUT0", [4, 16], "FP32")
        inp.set_shared_memory("in", x.nbytes, offset=64)
        requested = grpcclient.InferRequestedOutput("OUTPUT0")
        requested.set_shared_memory("out", x.nbytes)
        result = client.infer("scaler", [inp], outputs=[requested])
        out["outputs"] = [(o.name, o.datatype, list(o.shape)) for o in result.get_response().outputs]
        out["raw_lengths"] = [len(r) for r in result.get_response().raw_output_contents]
        out["y"] = enc(out_contents())
        # Mixed: input inline, output to shared memory; and the other way round.
        requested_only = grpcclient.InferRequestedOutput("OUTPUT0")
        requested_only.set_shared_memory("out", x.nbytes)
        client.infer("scaler", [tensor("INPUT0", x * 2, "FP32")], outputs=[requested_only])
        out["y_mixed"] = enc(out_contents())
        from_shm = client.infer("scaler", [inp])
        out["y_inline"] = enc(from_shm.as_numpy("OUTPUT0"))

        def with_input(region, size, offset=0):
            bad = grpcclient.InferInput("INPUT0", [4, 16], "FP32")
            bad.set_shared_memory(region, size, offset=offset)
            return lambda: client.infer("scaler", [bad])

        out["input_past_end"] = error_of(with_input("in", x.nbytes, offset=128))
        out["input_wrong_size"] = error_of(with_input("in", x.nbytes - 4))
        out["unknown_region"] = error_of(with_input("nope", x.nbytes))
        small = grpcclient.InferRequestedOutput("OUTPUT0")
        small.set_shared_memory("out", x.nbytes // 2)
        out["output_too_small"] = error_of(lambda: client.infer("scaler", [inp], outputs=[small]))
        out["duplicate"] = error_of(lambda: client.register_system_shared_memory("in", key_in, 16))
        out["too_long"] = error_of(
            lambda: client.register_system_shared_memory("long", key_in, 16, offset=x.nbytes + 60))
        out["missing_key"] = error_of(lambda: client.register_system_shared_memory("m", "/no_such_key_x", 4))
        out["status_unknown"] = error_of(lambda: client.get_system_shared_memory_status("nope"))
        out["cuda"] = error_of(lambda: client.register_cuda_shared_memory("c", b"\0" * 64, 0, 16))
        out["cuda_status"] = len(client.get_cuda_shared_memory_status().regions)
        client.unregister_system_shared_memory("in")
        out["after_one"] = sorted(client.get_system_shared_memory_status().regions)
        client.unregister_system_shared_memory()
        out["after_all"] = sorted(client.get_system_shared_memory_status().regions)
        out["extensions"] = list(client.get_server_metadata().extensions)
    finally:
        for region in (region_in, region_out):
            region.close()
            region.unlink()
    return out


def settings_section():
    out = {"log_before": json.loads(json.dumps(client.get_log_settings(as_json=True)))}
    out["log_verbose"] = client.update_log_settings({"log_verbose_level": 1}, as_json=True)
    out["log_back"] = client.update_log_settings({"log_verbose_level": 0, "log_info": True}, as_json=True)
    out["log_file"] = error_of(lambda: client.update_log_settings({"log_file": "/tmp/x.log"}))
    out["log_unknown"] = error_of(lambda: client.update_log_settings({"log_colour": True}))
    out["trace_global"] = client.get_trace_settings(as_json=True)
    out["trace_model"] = client.update_trace_settings(
        model_name="scaler", settings={"trace_rate": "5", "trace_level": ["TIMESTAMPS"]}, as_json=True)
    out["trace_global_after"] = client.get_trace_settings(as_json=True)
    out["trace_cleared"] = client.update_trace_settings(
        model_name="scaler", settings={"trace_rate": None}, as_json=True)
    update = client.update_trace_settings
    out["trace_bad_level"] = error_of(lambda: update(settings={"trace_level": ["LOUD"]}))
    out["trace_bad_rate"] = error_of(lambda: update(settings={"trace_rate": "0"}))
    out["trace_unknown_model"] = error_of(lambda: update(model_name="nope", settings={}))
    return out


SECTIONS = [bytes_section, load_section, classification_section, bf16_section, protocol_section,
            shm_section, settings_section]
results = {}
for section in SECTIONS:
    try:
        results[section.__name__] = {"ok": True, "value": section()}
    except Exception:
        results[section.__name__] = {"ok": False, "error": traceback.format_exc()}
client.close()
json.dump(results, sys.stdout)
"""

ITEMS = [b"hello", b"", b"a\x00b", "é€".encode(), b"\x00", b"\t \n"]
# Class 5 has an empty line: Triton then writes no label. Class 7 has no line at all.
CLASS_NAMES = ["zero", "one", "two", "three", "four", "", "six"]
LABELS = {"label_filename": "labels.txt"}


def build_repository(root: Path) -> None:
    write_model(root, "text", 1, string_identity(), {"max_batch_size": 8})
    write_model(root, "lookup", 1, byte_lookup([b"ok", b"\xff\xfe", b"\x89PNG\r\n"]), {"max_batch_size": 8})
    write_model(
        root,
        "text_batched",
        1,
        string_identity(),
        {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_us": 1000, "priority_levels": 2}},
    )
    write_model(root, "scaler", 1, scaled_identity(16, 2.0), {"max_batch_size": 64})
    write_model(
        root,
        "labelled",
        1,
        dense_classifier(64, 32, 8, seed=1),
        {
            "max_batch_size": 8,
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 8], **LABELS}],
        },
    )
    write_model(root, "bf16", 1, bf16_double(), {"max_batch_size": 8})
    (root / "labelled" / "labels.txt").write_text("\n".join(CLASS_NAMES) + "\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    repository = tmp_path_factory.mktemp("triton-extensions") / "models"
    build_repository(repository)
    # Management open, as Triton's explicit model control: the client drives repository calls.
    service = start_service_process(repository, "--management-open")
    try:
        client = subprocess.run(
            [sys.executable, "-c", CLIENT, service.address, str(repository)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
        )
        assert client.returncode == 0, f"client failed:\n{client.stderr}\nservice log:\n" + "\n".join(
            service.log
        )
        results = json.loads(client.stdout)
    finally:
        returncode = service.stop()
    yield Run(repository, results, service.log, returncode)


def b64s(items: list[bytes]) -> list[str]:
    return [base64.b64encode(x).decode("ascii") for x in items]


def test_bytes_round_trip_byte_for_byte(run: Run) -> None:
    result = section(run, "bytes_section")
    for model in ("text", "text_batched"):
        assert result[model] == b64s(ITEMS), model
        assert result[model + "_shape"] == [2, 3]
    assert result["stream_delivered"]
    assert result["stream"] == [b64s(ITEMS)]
    # Any bytes reach a model that takes them; they cannot come back in a string output.
    assert result["non_utf8"] == [[0, 1, 2]]
    assert_error(result["non_utf8_echo"], "UNIMPLEMENTED", "not UTF-8")


def test_load_with_config_override_and_files(run: Run) -> None:
    result = section(run, "load_section")
    assert (result["before"], result["after"]) == (64, 4)
    assert_error(result["too_big"], "INVALID_ARGUMENT", "exceeds max_batch_size 4")
    np.testing.assert_array_equal(arr(result["fits"]), np.full((4, 16), 2.0, np.float32))
    assert_error(result["malformed"], "INVALID_ARGUMENT", "config")
    assert_error(result["unknown_field"], "INVALID_ARGUMENT", "no_such")
    assert_error(result["unsupported"], "INVALID_ARGUMENT", "sequence_batching.iterative_sequence")
    assert_error(result["invalid_value"], "INVALID_ARGUMENT", "preferred_batch_sizes")
    assert result["still_four"] == 4  # a refused load changes nothing
    assert result["reverted"] == 64  # a load without a config goes back to config.yaml
    assert result["text_batched_round_trip"] and result["labelled_round_trip"]
    assert_error(result["files_without_config"], "INVALID_ARGUMENT", "config")
    assert_error(result["escaping_path"], "INVALID_ARGUMENT", "../1/model.onnx")
    assert_error(result["no_model_file"], "INVALID_ARGUMENT", "model.onnx")
    assert_error(result["garbage_model"], "FAILED_PRECONDITION", "onnxruntime cannot load it")
    assert result["uploaded_config"] == 8
    np.testing.assert_array_equal(arr(result["uploaded_y"]), np.full((5, 16), 2.0, np.float32))
    assert_error(result["uploaded_too_big"], "INVALID_ARGUMENT", "max_batch_size 8")
    # The files went to a private folder, not into the repository.
    assert not (run.repository / "uploaded").exists()


def expected_classes(row: np.ndarray, k: int) -> list[str]:
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
    names = [*CLASS_NAMES, ""]
    return [f"{float(row[i]):f}:{i}" + (f":{names[i]}" if names[i] else "") for i in order]


def test_classification_top_k_with_labels(run: Run) -> None:
    result = section(run, "classification_section")
    x = arr(result["x"])
    probabilities = ort_run(run.repository, "labelled", "1", {"INPUT0": x})[0]
    assert (result["datatype"], result["shape"]) == ("BYTES", [3, 3])
    assert result["top3"] == [expected_classes(row, 3) for row in probabilities]
    assert result["every"] == expected_classes(probabilities[0], 8)  # k capped at the class count
    assert_error(result["on_bytes"], "INVALID_ARGUMENT", "ECHO", "numeric")
    assert result["label_filename"] == "labels.txt"


def test_bf16_end_to_end(run: Run) -> None:
    result = section(run, "bf16_section")
    x = arr(result["x"])
    # tritonclient sends BF16 as the upper half of each FP32 (truncation); so do we here.
    sent = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert result["outputs"] == [["Y", "BF16"], ["Y32", "FP32"]]
    np.testing.assert_array_equal(arr(result["y32"]), sent * 2)
    np.testing.assert_array_equal(arr(result["y"]), (sent * 2).astype(ml_dtypes.bfloat16).astype(np.float32))
    assert result["metadata"] == [["X", "BF16"], ["Y", "BF16"], ["Y32", "FP32"]]
    assert result["config"] == ["TYPE_BF16", "TYPE_BF16", "TYPE_FP32"]
    assert_error(result["as_fp32"], "INVALID_ARGUMENT", "X", "BF16")


def test_streaming_final_flag_metadata_statistics_priority(run: Run) -> None:
    result = section(run, "protocol_section")
    assert result["delivered"], result["received"]
    # Asked for: the one response of the request carries triton_final_response = true (no empty
    # response follows: the data and the final flag come together). Not asked for: no flag.
    assert result["received"] == [
        {"id": "with", "final": True, "has_output": True},
        {"id": "without", "final": None, "has_output": True},
    ]
    before, after = result["before"], result["after"]
    assert after["success"] - before["success"] == 3
    assert after["fail"] - before["fail"] == 1  # the request whose shape did not fit
    for counter in ("compute_infer", "compute_input", "compute_output", "queue"):
        assert after[counter] - before[counter] == 3, counter
    assert after["compute_ns"] > before["compute_ns"]
    assert_error(result["bad"], "INVALID_ARGUMENT", "INPUT0")
    assert result["metadata_v1"] == ["1"]
    assert result["metadata_any"] == ["1"]
    assert result["priority_out_of_range"] == b64s([b"x"])  # the default level, as Triton
    assert result["priority_in_range"] == b64s([b"x"])


def test_system_shared_memory(run: Run) -> None:
    result = section(run, "shm_section")
    x = arr(result["x"])
    assert [(name, offset, size) for name, _, offset, size in result["status"]] == [
        ("in", 0, x.nbytes + 64),
        ("out", 0, x.nbytes),
    ]
    np.testing.assert_array_equal(arr(result["y"]), x * np.float32(2))
    assert result["outputs"] == [["OUTPUT0", "FP32", [4, 16]]]
    assert result["raw_lengths"] == [0]  # written into the region; the raw entry stays, empty
    np.testing.assert_array_equal(arr(result["y_mixed"]), x * np.float32(4))
    np.testing.assert_array_equal(arr(result["y_inline"]), x * np.float32(2))
    assert_error(result["input_past_end"], "INVALID_ARGUMENT", "INPUT0", "leave shared memory region 'in'")
    assert_error(result["input_wrong_size"], "INVALID_ARGUMENT", "INPUT0", "bytes")
    assert_error(result["unknown_region"], "INVALID_ARGUMENT", "'nope'")
    assert_error(result["output_too_small"], "INVALID_ARGUMENT", "OUTPUT0", "do not fit")
    assert_error(result["duplicate"], "INVALID_ARGUMENT", "already registered")
    assert_error(result["too_long"], "INVALID_ARGUMENT", "exceeds")
    assert_error(result["missing_key"], "INVALID_ARGUMENT", "cannot be opened")
    assert_error(result["status_unknown"], "NOT_FOUND", "nope")
    assert_error(result["cuda"], "UNIMPLEMENTED", "CUDA shared memory is not supported")
    assert result["cuda_status"] == 0
    assert result["after_one"] == ["out"]
    assert result["after_all"] == []
    assert "system_shared_memory" in result["extensions"]
    assert "cuda_shared_memory" not in result["extensions"]


def test_log_and_trace_settings(run: Run) -> None:
    result = section(run, "settings_section")
    settings = result["log_before"]["settings"]
    assert settings["log_info"] == {"bool_param": True}
    assert settings["log_verbose_level"] in ({"uint32_param": 0}, {})
    assert result["log_verbose"]["settings"]["log_verbose_level"] == {"uint32_param": 1}
    assert result["log_back"]["settings"]["log_info"] == {"bool_param": True}
    assert result["log_back"]["settings"]["log_verbose_level"] in ({"uint32_param": 0}, {})
    # The verbose level reached the live logger: the service logged at DEBUG meanwhile.
    assert any(" DEBUG " in line for line in run.log), run.log[-20:]
    assert_error(result["log_file"], "INVALID_ARGUMENT", "stderr")
    assert_error(result["log_unknown"], "INVALID_ARGUMENT", "log_colour")
    assert result["trace_global"]["settings"]["trace_level"] == {"value": ["OFF"]}
    model = result["trace_model"]["settings"]
    assert model["trace_rate"] == {"value": ["5"]}
    assert model["trace_level"] == {"value": ["TIMESTAMPS"]}
    assert result["trace_global_after"]["settings"]["trace_rate"] == {"value": ["1000"]}
    assert result["trace_cleared"]["settings"]["trace_rate"] == {"value": ["1000"]}  # back to global
    assert_error(result["trace_bad_level"], "INVALID_ARGUMENT", "LOUD")
    assert_error(result["trace_bad_rate"], "INVALID_ARGUMENT", "trace_rate")
    assert_error(result["trace_unknown_model"], "NOT_FOUND", "nope")


def test_service_log_clean_and_graceful_stop(run: Run) -> None:
    assert not [line for line in run.log if "Traceback" in line or "internal error" in line], run.log
    assert run.returncode == 0, run.log[-20:]
