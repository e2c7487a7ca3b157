"""modelyard.flat.v1.Inference/Infer: Infer with FlatBuffers messages (modelyard.flat), for large
tensors. Inputs reach the model as numpy views of the request's bytes; the same data plane, checks,
metrics and statistics as our protobuf Infer."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from modelyard import flat
from modelyard.common.headers import DYE_SHADOW
from modelyard.service.api.errors import Context, serving
from modelyard.service.api.metadata import call_fields
from modelyard.service.api.scheduling import scheduling
from modelyard.service.dataplane import DataPlane, TensorReader
from modelyard.service.intake import TensorHeader
from modelyard.service.metrics import ServiceMetrics
from modelyard.tensors import TensorError, name_of


def _identity(data: bytes) -> bytes:
    return data


def _headers(decoded: flat.Infer) -> list[TensorHeader]:
    return [
        TensorHeader(name, name_of(array.dtype), array.shape, array.nbytes, False)
        for name, array in decoded.tensors.items()
    ]


def _arrays(decoded: flat.Infer) -> dict[str, np.ndarray]:
    return decoded.tensors


# A flat request's tensors, for the data plane (Call.take_inputs): its arrays are views of the
# request's bytes already, checked by their headers.
_FLAT = TensorReader(_headers, _arrays)


class FlatInferenceServicer:
    def __init__(self, dataplane: DataPlane, metrics: ServiceMetrics) -> None:
        self._dataplane = dataplane
        self._metrics = metrics

    def handlers(self) -> dict[str, Any]:
        """Its one method's handler (bytes in, bytes out), for the request pipeline
        (service/api/pipeline.py), as service_of gives those of the protobuf services."""
        return {
            flat.METHOD_NAME: grpc.unary_unary_rpc_method_handler(
                self.Infer, request_deserializer=_identity, response_serializer=_identity
            )
        }

    async def Infer(self, request: bytes, context: Context) -> bytes:
        failure: TensorError | None = None
        try:
            decoded = flat.decode_request(request)
        except TensorError as exc:
            decoded, failure = None, exc
        async with serving(
            context, self._metrics, "InferFlat", decoded.model_name if decoded else ""
        ) as call:
            if decoded is None:
                assert failure is not None
                raise failure
            version, _, priority, dye = call_fields(context, decoded.model_name, decoded.model_version, "", 0)
            with self._dataplane.open(decoded.model_name, version, dye) as held:
                inputs = await held.take_inputs(
                    len(decoded.tensors), len(decoded.output_names), decoded, _FLAT
                )
                asked = scheduling(context, priority, 0, dye == DYE_SHADOW)
                result = await held.infer(inputs, decoded.output_names, asked)
            if dye:  # a proxy's call: it judges the version by its run's own timing
                call.answered_run(str(result.version), held.queue_ns, held.run_ns)
            else:
                call.answered(str(result.version))
            return flat.encode_response(result.model, str(result.version), result.outputs)
