"""A decoupled version's request on ModelStreamInfer: its 0..N responses, as Triton sends them.

Each data response carries `triton_final_response: false` (Triton sets the parameter on every
response of a decoupled model); after the last one the request is complete, and a client that set
`triton_enable_empty_final_response` gets an empty response (no outputs; the request's id, model
and version) with `triton_final_response: true`, the only way it can tell a request with zero
responses from one still running. A failure mid-way is the request's last response: in-band
(`error_message`, as any failed stream request), with `triton_final_response: true`.

The responses of one request all come before the next request of the stream is read: a stream's
requests are answered in order (Triton's may interleave)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.service.api.errors import serving
from modelyard.service.dataplane import Call, InferResult
from modelyard.service.errors import ServiceError
from modelyard.tensors import TensorError

FINAL_RESPONSE = "triton_final_response"

# A failed request's in-band answer on the stream (the servicer's).
InBand = Callable[[pb.ModelInferRequest, Exception, serving], pb.ModelStreamInferResponse]


class Responses:
    """The responses of one decoupled request, on `held`: its own lease of the request's version
    (Call.detached), released once the last response is out (or `release`, should the stream
    never start)."""

    def __init__(
        self,
        held: Call,
        results: AsyncGenerator[InferResult] | None,
        answered: Callable[[InferResult], pb.ModelInferResponse],
        request: pb.ModelInferRequest,
    ) -> None:
        self._held = held
        assert results is not None  # a decoupled version's call (Call.is_decoupled)
        self._results = results
        self._answered = answered
        self._request = request

    def release(self) -> None:
        """Give back the version's lease (once: a lease's release; `stream` does when it ends)."""
        self._held.release()

    async def stream(
        self, final_flag: bool, call: serving, first: bool, in_band: InBand
    ) -> AsyncGenerator[pb.ModelStreamInferResponse]:
        """The stream's messages for this request. `first`: no response of the stream has been
        sent yet (its x-served-version goes with this request's first response)."""
        served = self._held.served
        try:
            try:
                async for result in self._results:
                    response = self._answered(result)
                    response.parameters[FINAL_RESPONSE].bool_param = False
                    if first:
                        first = False
                        await call.stream_answered(response.model_version)
                    else:
                        call.version = response.model_version
                    yield pb.ModelStreamInferResponse(infer_response=response)
            except (ServiceError, TensorError) as exc:
                failed = in_band(self._request, exc, call)
                failed.infer_response.parameters[FINAL_RESPONSE].bool_param = True
                yield failed
                return
        finally:
            await self._results.aclose()
            self.release()
        call.version = call.version or served.version_name
        if final_flag:
            empty = pb.ModelInferResponse(
                model_name=served.model, model_version=served.version_name, id=self._request.id
            )
            empty.parameters[FINAL_RESPONSE].bool_param = True
            yield pb.ModelStreamInferResponse(infer_response=empty)
