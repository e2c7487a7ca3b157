"""KServe's Python model server (kserve 0.21) serving every ONNX model of a repository, written the
way KServe's custom-model guide does it: a `kserve.Model` per model whose `predict` takes the V2
`InferRequest` and returns an `InferResponse`, started by `ModelServer().start(models)` with its
REST and gRPC servers (the gRPC one is what bench/floor.py calls). ONNX Runtime with one intra-op
thread, as everywhere in the floor benchmark.

Runs under KServe's own virtual environment (`make bench-peers`), never ours:

    .cache/peers-venv/kserve/bin/python bench/peers/kserve_server.py REPOSITORY --grpc_port P --http_port Q

REPOSITORY holds <model>/1/model.onnx (the service's layout). KServe's own flags (--grpc_port,
--http_port, ...) are read by kserve.model_server's parser, as in KServe's examples. KServe binds
its gRPC server to [::] and its REST server to 0.0.0.0 (neither address is a setting).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import onnxruntime as ort
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer, model_server


class OnnxModel(Model):
    def __init__(self, name: str, path: Path) -> None:
        super().__init__(name)
        self.path = path
        self.load()

    def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        self.output_names = [meta.name for meta in self.session.get_outputs()]
        self.ready = True
        return self.ready

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> InferResponse:
        feeds = {infer_input.name: infer_input.as_numpy() for infer_input in payload.inputs}
        outputs = []
        for name, array in zip(self.output_names, self.session.run(None, feeds), strict=True):
            output = InferOutput(name=name, shape=list(array.shape), datatype="FP32")
            output.set_data_from_numpy(array)
            outputs.append(output)
        return InferResponse(response_id=payload.id, model_name=self.name, infer_outputs=outputs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(parents=[model_server.parser])
    parser.add_argument("repository", type=Path)
    args, _ = parser.parse_known_args()
    paths = sorted(args.repository.glob("*/1/model.onnx"))
    models = [OnnxModel(path.parent.parent.name, path) for path in paths]
    ModelServer().start(models)
