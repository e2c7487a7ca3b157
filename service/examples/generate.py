"""Print a streamed completion from a running service, token by token, as it arrives.

make up                                   # in one terminal
python -m modelyard.service.examples.generate "def parse(self, text):"
python -m modelyard.service.examples.generate --temperature 0.8 --seed 1 --stop "\\n\\n" "import "
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc

from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc


def unescape(text: str) -> str:
    """Backslash escapes typed on a command line ("\\n") as the characters they name; other
    non-ASCII text stays as it is."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stream a completion from Modelyard's Generate.")
    parser.add_argument("prompt", nargs="?", default="def __init__(self")
    parser.add_argument("--address", default="127.0.0.1:50052")
    parser.add_argument("--model", default="codelm")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=0.0, help="0 = no nucleus cut")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="a stop sequence (repeatable)")
    args = parser.parse_args(argv)
    request = pb.GenerateRequest(
        model_name=args.model,
        prompt=unescape(args.prompt),
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=[unescape(s) for s in args.stop],
    )
    with grpc.insecure_channel(args.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        sys.stdout.write(request.prompt)
        try:
            for event in stub.Generate(request):
                sys.stdout.write(event.text)
                sys.stdout.flush()
                last = event
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    print(
        f"\n--- version {last.model_version}, finish {reason}, {last.usage.prompt_tokens} prompt + "
        f"{last.usage.completion_tokens} completion tokens, first token after "
        f"{last.time_to_first_token.ToMilliseconds()} ms",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
