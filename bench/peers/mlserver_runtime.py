"""An MLServer (1.7) custom inference runtime for ONNX models, written the way MLServer's custom
runtime guide does it: an `MLModel` whose `load` opens the model file named by `parameters.uri` in
its model-settings.json and whose `predict` decodes the V2 inputs with `NumpyCodec`, runs ONNX
Runtime (one intra-op thread, as everywhere in the floor benchmark) and encodes the outputs.

bench/peer_servers.py lays out the folder that `mlserver start` serves: this file beside a
settings.json (ports on 127.0.0.1, everything else MLServer's defaults) and one folder per model
with its model-settings.json (`"implementation": "mlserver_runtime.OnnxRuntimeModel"`). It runs
under MLServer's own virtual environment (`make bench-peers`), never ours.
"""

from __future__ import annotations

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxRuntimeModel(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        path = await get_model_uri(self.settings, wellknown_filenames=["model.onnx"])
        self._session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self._output_names = [meta.name for meta in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {tensor.name: NumpyCodec.decode_input(tensor) for tensor in payload.inputs}
        outputs = self._session.run(None, feeds)
        return InferenceResponse(
            model_name=self.name,
            id=payload.id,
            outputs=[
                NumpyCodec.encode_output(name, array)
                for name, array in zip(self._output_names, outputs, strict=True)
            ],
        )
