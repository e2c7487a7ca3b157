"""The ONNX model builders and the bundled demo repository (models/demo)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml

from models import demo_models
from models.demo_models import (
    build_demo_repository,
    dense_classifier,
    dense_stack,
    multi_io,
    rebuild_demo_repository,
    scaled_identity,
    serialize,
    write_model,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
COMMITTED_DEMO = REPO_ROOT / "models" / "demo"


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (hidden ones included), by relative path, with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    data = model.read_bytes() if isinstance(model, Path) else serialize(model)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    build_demo_repository(root)
    return root


# --- determinism and the committed tree --------------------------------------------------------


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    build_demo_repository(tmp_path / "a")
    build_demo_repository(tmp_path / "b")
    a, b = tree(tmp_path / "a"), tree(tmp_path / "b")
    assert a == b
    assert set(a) == {
        "classifier/config.yaml",
        "classifier/1/model.onnx",
        "scaler/config.yaml",
        "scaler/1/model.onnx",
        "scaler/2/model.onnx",
        "mixed/config.yaml",
        "mixed/v1/model.onnx",
    }


def built(root: Path) -> dict[str, bytes]:
    """The part of a demo tree that this module builds: everything but the trained models."""
    return {
        rel: data for rel, data in tree(root).items() if rel.split("/")[0] not in demo_models.TRAINED_MODELS
    }


def test_committed_demo_repository_is_fresh(demo: Path) -> None:
    assert COMMITTED_DEMO.is_dir(), "models/demo is missing: run `python -m models.demo_models`"
    assert built(COMMITTED_DEMO) == tree(demo), (
        "models/demo is stale: rebuild it with `python -m models.demo_models models/demo`"
    )


def test_committed_trained_models_are_complete_and_small() -> None:
    """The trained language model is committed whole (so `make up` needs no training) and small."""
    trained = {rel: data for rel, data in tree(COMMITTED_DEMO).items() if rel not in built(COMMITTED_DEMO)}
    assert set(trained) == {
        "codelm/config.yaml",
        "codelm/1/model.onnx",
        "codelm/1/tokenizer.json",
        "codelm/1/chat_template.jinja",  # its chat template, a file of its own (not trained)
    }
    assert len(trained["codelm/1/model.onnx"]) < 8 * 1024 * 1024
    model = onnx.load_model_from_string(trained["codelm/1/model.onnx"])
    assert model.ir_version <= 10  # what ONNX Runtime accepts
    assert {p.key: p.value for p in model.metadata_props}["context_length"] == "256"


def test_rebuild_keeps_the_trained_models(tmp_path: Path, demo: Path) -> None:
    root = tmp_path / "demo"
    write_model(root, "stale", 1, scaled_identity(2, 1.0))
    assert demo_models.copy_trained_models(COMMITTED_DEMO, root) == ["codelm"]
    rebuild_demo_repository(root)
    assert built(root) == tree(demo)
    assert {rel: data for rel, data in tree(root).items() if rel.startswith("codelm/")} == {
        rel: data for rel, data in tree(COMMITTED_DEMO).items() if rel.startswith("codelm/")
    }


def test_demo_files_are_small(demo: Path) -> None:
    for rel, data in tree(demo).items():
        assert len(data) < 64 * 1024, rel


def test_same_seed_same_bytes_other_seed_other_bytes() -> None:
    assert serialize(dense_classifier(8, 4, 3, seed=7)) == serialize(dense_classifier(8, 4, 3, seed=7))
    assert serialize(dense_classifier(8, 4, 3, seed=7)) != serialize(dense_classifier(8, 4, 3, seed=8))
    assert serialize(dense_stack(2, 8, seed=1)) == serialize(dense_stack(2, 8, seed=1))


def test_models_use_an_ir_version_onnxruntime_accepts() -> None:
    for model in (dense_classifier(4, 4, 2, seed=0), scaled_identity(4, 2.0), multi_io(), dense_stack(1, 4)):
        assert model.ir_version == demo_models.IR_VERSION
        assert [(o.domain, o.version) for o in model.opset_import] == [("", demo_models.OPSET)]
        onnx.checker.check_model(model, full_check=True)


# --- the demo models run, with the expected outputs --------------------------------------------


def test_classifier(demo: Path) -> None:
    sess = session(demo / "classifier" / "1" / "model.onnx")
    x = np.random.default_rng(0).standard_normal((5, 64), dtype=np.float32)
    out = run(sess, {"INPUT0": x})
    assert list(out) == ["OUTPUT0"]
    y = out["OUTPUT0"]
    assert y.dtype == np.float32 and y.shape == (5, 8)
    assert np.all(y >= 0)
    np.testing.assert_allclose(y.sum(axis=1), np.ones(5), rtol=1e-5)
    # Different rows give different distributions (the weights are not degenerate).
    assert not np.allclose(y[0], y[1])


def test_classifier_config_matches_graph(demo: Path) -> None:
    config = yaml.safe_load((demo / "classifier" / "config.yaml").read_text())
    assert config["max_batch_size"] == 32
    sess = session(demo / "classifier" / "1" / "model.onnx")
    (inp,) = sess.get_inputs()
    (outp,) = sess.get_outputs()
    assert config["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 64]}]
    assert config["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 8]}]
    assert (inp.name, inp.type, inp.shape) == ("INPUT0", "tensor(float)", ["batch", 64])
    assert (outp.name, outp.type, outp.shape) == ("OUTPUT0", "tensor(float)", ["batch", 8])


@pytest.mark.parametrize(("version", "scale"), [("1", 2.0), ("2", 3.0)])
def test_scaler_versions(demo: Path, version: str, scale: float) -> None:
    sess = session(demo / "scaler" / version / "model.onnx")
    x = np.random.default_rng(1).standard_normal((3, 16), dtype=np.float32)
    y = run(sess, {"INPUT0": x})["OUTPUT0"]
    assert y.dtype == np.float32 and y.shape == (3, 16)
    np.testing.assert_array_equal(y, x * np.float32(scale))


def test_scaler_config_serves_both_versions(demo: Path) -> None:
    config = yaml.safe_load((demo / "scaler" / "config.yaml").read_text())
    assert config["version_policy"] == {"latest": 2}
    assert config["max_batch_size"] > 0


def test_mixed(demo: Path) -> None:
    sess = session(demo / "mixed" / "v1" / "model.onnx")
    rng = np.random.default_rng(2)
    a = rng.standard_normal((6, 4), dtype=np.float32)
    b = rng.integers(-100, 100, size=(6, 4), dtype=np.int64)
    out = run(sess, {"a": a, "b": b})
    assert out["sum"].dtype == np.float32 and out["sum"].shape == (6, 4)
    assert out["argmax"].dtype == np.int64 and out["argmax"].shape == (6,)
    np.testing.assert_array_equal(out["sum"], a + b.astype(np.float32))
    np.testing.assert_array_equal(out["argmax"], np.argmax(a, axis=1))
    # Output selection: asking for one output only returns just that one.
    (only,) = sess.run(["argmax"], {"a": a, "b": b})
    np.testing.assert_array_equal(only, np.argmax(a, axis=1))


def test_every_config_matches_its_graph(demo: Path) -> None:
    """Names, datatypes and shapes in each config.yaml agree with every version's graph."""
    ort_names = {"tensor(float)": "FP32", "tensor(int64)": "INT64"}
    for config_path in sorted(demo.glob("*/config.yaml")):
        config = yaml.safe_load(config_path.read_text())
        for model_path in sorted(config_path.parent.glob("*/model.onnx")):
            sess = session(model_path)
            for key, args in (("inputs", sess.get_inputs()), ("outputs", sess.get_outputs())):
                if key not in config:
                    continue
                graph = [
                    {
                        "name": a.name,
                        "datatype": ort_names[a.type],
                        "shape": [d if isinstance(d, int) else -1 for d in a.shape],
                    }
                    for a in args
                ]
                assert config[key] == graph, model_path


# --- the other builders ------------------------------------------------------------------------


def test_classifier_without_batch_dimension() -> None:
    sess = session(dense_classifier(10, 6, 4, seed=3, batch=False))
    assert sess.get_inputs()[0].shape == [10]
    y = run(sess, {"INPUT0": np.ones(10, dtype=np.float32)})["OUTPUT0"]
    assert y.shape == (4,)
    assert y.sum() == pytest.approx(1.0, rel=1e-5)


def test_dense_stack_runs_and_stays_finite() -> None:
    model = dense_stack(layers=4, width=32, seed=5)
    assert sum(1 for n in model.graph.node if n.op_type == "MatMul") == 4
    x = np.random.default_rng(4).standard_normal((3, 32), dtype=np.float32)
    y = run(session(model), {"INPUT0": x})["OUTPUT0"]
    assert y.shape == (3, 32) and y.dtype == np.float32
    assert np.all(np.isfinite(y)) and np.all(y >= 0) and np.any(y > 0)


def test_builders_reject_bad_sizes() -> None:
    with pytest.raises(ValueError):
        dense_classifier(0, 4, 2, seed=0)
    with pytest.raises(ValueError):
        dense_stack(layers=0)


# --- writing models ----------------------------------------------------------------------------


def test_write_model_layout_and_no_leftovers(tmp_path: Path) -> None:
    path = write_model(tmp_path, "m", 3, scaled_identity(2, 1.5), {"max_batch_size": 4})
    write_model(tmp_path, "m", "v4", scaled_identity(2, 2.5))
    assert path == tmp_path / "m" / "3" / "model.onnx"
    assert set(tree(tmp_path)) == {"m/config.yaml", "m/3/model.onnx", "m/v4/model.onnx"}
    assert yaml.safe_load((tmp_path / "m" / "config.yaml").read_text()) == {"max_batch_size": 4}
    assert onnx.load(str(path)) == scaled_identity(2, 1.5)
    # Overwriting an existing version replaces it in place.
    write_model(tmp_path, "m", 3, scaled_identity(2, 9.0))
    assert path.read_bytes() == serialize(scaled_identity(2, 9.0))
    assert set(tree(tmp_path)) == {"m/config.yaml", "m/3/model.onnx", "m/v4/model.onnx"}


@pytest.mark.parametrize(
    ("name", "version"), [("../x", 1), ("m", "latest"), ("m", "v"), ("m", True), ("", 1)]
)
def test_write_model_rejects_bad_names_and_versions(tmp_path: Path, name: str, version: int | str) -> None:
    with pytest.raises(ValueError):
        write_model(tmp_path, name, version, scaled_identity(2, 1.0))
    assert not any(tmp_path.iterdir())


def test_rebuild_replaces_the_tree_exactly(tmp_path: Path, demo: Path) -> None:
    root = tmp_path / "demo"
    write_model(root, "stale", 1, scaled_identity(2, 1.0))
    write_model(root, "scaler", 7, scaled_identity(2, 1.0))
    rebuild_demo_repository(root)
    assert tree(root) == tree(demo)
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]


def test_rebuild_refuses_to_delete_what_is_not_a_repository(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing"):
        rebuild_demo_repository(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert demo_models.main([str(tmp_path)]) == 1
