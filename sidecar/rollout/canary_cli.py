"""`modelyard canary ...`: the sidecar's admin endpoint from a shell (weights and rollouts).

    modelyard canary get [MODEL]
    modelyard canary set MODEL WEIGHT [--stable V] [--canary V]
    modelyard canary rollout start MODEL [--steps 1,5,25,50,100] [--dwell-s 60] [--min-calls 100]
        [--judge-calls N] [--max-error-excess X] [--max-latency-ratio X] [--latency-floor-s S]
        [--min-agreement X]
    modelyard canary rollout status [MODEL]
    modelyard canary rollout pause|resume|abort MODEL
    modelyard canary --controller URL rollout start|status|pause|resume|abort ...

With --controller (MODELYARD_ROLLOUTS_URL) the rollout verbs go to the fleet rollout controller
(`modelyard rollouts`, docs/fleet-rollouts.md): one rollout across every sidecar of the fleet, the
same requests and answers (its token the same way: --token, --token-file, ...).

Also `python -m modelyard.sidecar.rollout.canary_cli ...`. The admin URL comes from --admin-url, else
MODELYARD_ADMIN_URL (default http://127.0.0.1:9101); the token from --token, --token-file (its first
word: the sidecar's own tokens file will do), MODELYARD_ADMIN_TOKEN or MODELYARD_ADMIN_TOKEN_FILE, in
that order (a file keeps the token out of `ps` and the shell's history); the sidecar refuses changes
without one unless it runs with --admin-open. --ca-file (MODELYARD_ADMIN_CA) verifies an HTTPS admin
endpoint. The answer is printed as
JSON; exit status 0, 1 when the endpoint refused (its error and reason on stderr), 2 for a usage
mistake or no answer at all.
Standard library only: an operator's laptop needs nothing of the sidecar's dependencies.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

DEFAULT_URL = "http://127.0.0.1:9101"
GATE_OPTIONS = (
    "judge_calls",
    "max_error_excess",
    "max_latency_ratio",
    "latency_floor_s",
    "median_floor_s",
    "min_agreement",
)


def _finite(text: str) -> float:
    """A number flag: finite (the endpoint refuses NaN and infinities; JSON has no word for them)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


_finite.__name__ = "finite number"  # argparse's words: "invalid finite number value: 'inf'"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modelyard canary", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--admin-url", default=os.environ.get("MODELYARD_ADMIN_URL", DEFAULT_URL))
    parser.add_argument(
        "--controller",
        default=os.environ.get("MODELYARD_ROLLOUTS_URL", ""),
        help="the fleet rollout controller's URL: rollouts across every sidecar (env MODELYARD_ROLLOUTS_URL)",
    )
    parser.add_argument("--token", help="the admin token (env MODELYARD_ADMIN_TOKEN)")
    parser.add_argument(
        "--token-file", help="a file whose first word is the admin token (env MODELYARD_ADMIN_TOKEN_FILE)"
    )
    parser.add_argument("--ca-file", default=os.environ.get("MODELYARD_ADMIN_CA", ""))
    parser.add_argument("--timeout-s", type=float, default=10.0)
    verbs = parser.add_subparsers(dest="verb", required=True)
    get = verbs.add_parser("get", help="the weights (one model's, or all)")
    get.add_argument("model", nargs="?")
    put = verbs.add_parser("set", help="set a model's canary weight (and versions)")
    put.add_argument("model")
    put.add_argument("weight", type=_finite)
    put.add_argument("--stable")
    put.add_argument("--canary")
    rollout = verbs.add_parser("rollout", help="progressive rollouts").add_subparsers(
        dest="action", required=True
    )
    start = rollout.add_parser("start", help="start a rollout")
    start.add_argument("model")
    start.add_argument("--steps", help="weights, comma-separated (e.g. 1,5,25,50,100)")
    start.add_argument("--dwell-s", type=_finite)
    start.add_argument("--min-calls", type=int)
    for option in GATE_OPTIONS:
        start.add_argument("--" + option.replace("_", "-"), type=_finite)
    status = rollout.add_parser("status", help="one model's rollout, or all")
    status.add_argument("model", nargs="?")
    for action in ("pause", "resume", "abort"):
        rollout.add_parser(action, help=f"{action} a model's rollout").add_argument("model")
    return parser


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, JSON body) for the command line."""
    if args.verb == "get":
        return "GET", "/canary", None
    if args.verb == "set":
        body: dict[str, Any] = {"canary_weight": args.weight}
        body.update({k: getattr(args, k) for k in ("stable", "canary") if getattr(args, k) is not None})
        return "PUT", f"/canary/{quote(args.model, safe='')}", body
    model = quote(args.model, safe="") if args.model else ""
    if args.action == "status":
        return "GET", f"/rollouts/{model}" if model else "/rollouts", None
    if args.action == "start":
        spec: dict[str, Any] = {}
        if args.steps:
            try:
                spec["steps"] = [_finite(s) for s in args.steps.split(",") if s.strip()]
            except ValueError:
                message = f"--steps {args.steps!r}: expected finite numbers, comma-separated"
                raise ValueError(message) from None
        if args.dwell_s is not None:
            spec["dwell_s"] = args.dwell_s
        if args.min_calls is not None:
            spec["min_calls"] = args.min_calls
        for option in GATE_OPTIONS:
            value = getattr(args, option)
            if value is not None:
                spec[option] = int(value) if option == "judge_calls" else value
        return "POST", f"/rollouts/{model}", spec
    return "POST", f"/rollouts/{model}/{args.action}", None


def _token(args: argparse.Namespace) -> str:
    """The token: --token, --token-file, MODELYARD_ADMIN_TOKEN, MODELYARD_ADMIN_TOKEN_FILE (first found);
    ValueError for a token file that cannot be read or holds none."""
    if args.token:
        return str(args.token)
    path = args.token_file
    if not path:
        token = os.environ.get("MODELYARD_ADMIN_TOKEN", "")
        if token:
            return token
        path = os.environ.get("MODELYARD_ADMIN_TOKEN_FILE", "")
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as file:
            for line in file:
                words = line.split()
                if words and not words[0].startswith("#"):
                    return words[0]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"token file {path}: cannot read it ({exc})") from None
    raise ValueError(f"token file {path}: holds no token")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        method, path, body = _request(args)
        data = json.dumps(body, allow_nan=False).encode() if body is not None else None
        token = _token(args)
    except ValueError as exc:  # a number that is not finite, a token file that is not one
        parser.error(str(exc))
    if args.controller and args.verb != "rollout":
        parser.error(
            "--controller takes the rollout verbs only (the weights are each sidecar's: --admin-url)"
        )
    base = args.controller or args.admin_url
    request = urllib.request.Request(
        base.rstrip("/") + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=args.ca_file) if args.ca_file else None
    try:
        with urllib.request.urlopen(request, timeout=args.timeout_s, context=context) as answer:
            doc = json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            refused = json.loads(exc.read())
            print(f"modelyard canary: {exc.code} {refused['error']} ({refused['reason']})", file=sys.stderr)
        except (ValueError, KeyError, TypeError):
            print(f"modelyard canary: {exc.code} {exc.reason}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"modelyard canary: no answer from {base}: {exc}", file=sys.stderr)
        return 2
    if args.verb == "get" and args.model:
        found = (doc.get("models") or {}).get(args.model)
        doc = {
            "model": args.model,
            **(found or {"canary_weight": doc.get("canary_weight"), "source": "default"}),
        }
    print(json.dumps(doc, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
