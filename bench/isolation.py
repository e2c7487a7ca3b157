"""Versions in one service (issue 34): stable's p50 alone, beside a busy canary, and with a CPU-bound
shadow, directly and through the sidecar, for this tree and the trees of --trees in the same rounds.

Model `m`, served with both versions (version_policy all): v1, stable, `INPUT0 * 2` on FP32[1, 256]
(microseconds: it runs inline on the event loop; `--stable dense`: 16 x (MatMul 256x256, Relu), a
few hundred microseconds on the executor, where each version's bound on the run threads matters);
v2, the canary, dense_stack 300 x (MatMul 256x256, Relu) on the same input (several milliseconds
of CPU a run; `--canary-callers N` clients call it in the busy scenes). Each tree runs its own service and two
sidecars in front of it (routes: canary weight 0; the second mirrors every stable call to the canary,
`shadow: {share: 100, max_in_flight: 2}`), each process from its tree. One client, closed loop,
calls v1 for `--duration` seconds per scene:

  direct          client -> service
  direct_shadow   the same, and after each answer the client mirrors it to v2 as a sidecar would
                  that honours the service's grpc-retry-pushback-ms on a dropped shadow
                  (`x-model-dye: shadow`, at most 2 in flight, not awaited): the service's half
  direct_busy     the same, while a second client calls v2 back to back (a busy canary)
  sidecar         client -> sidecar -> service
  sidecar_shadow  client -> the shadowing sidecar: every answer is mirrored to v2 (CPU-bound)
  sidecar_busy    client -> sidecar, while a second client calls v2 back to back through it (pinned)

Scenes take turns within a round (the order reversed every other round), trees back to back per
scene, so that the machine's other load falls on all of them alike. Printed per tree: each scene's
p50 and p99 (medians over rounds), and each disturbed scene's p50 over its undisturbed one (the
median of the rounds' paired ratios, with their range); the target is 1.2x. For this tree, the
service's own count of shadows run and dropped (modelyard_shadow_calls_total) in the shadow scenes.
Nothing is pinned: how versions share the machine's cores is what is measured.

    .venv/bin/python -m bench.isolation [--trees base=/tmp/base] [--duration 3] [--rounds 3]
        [--intra-op-threads 0] [--inference-threads 0] [--stable scale|dense] [--canary-callers 1]
        [--scenes direct,direct_shadow,direct_busy,sidecar,sidecar_shadow,sidecar_busy]

Results go to bench/results/isolation.json. Everything runs on 127.0.0.1; every process started
here is stopped before exit.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.lib.report import source_state, write_json
from bench.lib.trees import pythonpath, source_trees
from bench.processes import ROOT, SERVICE_READY, ServerProcess, service_command
from models.demo_models import dense_stack, scaled_identity, write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.tensors import to_tensor

DEFAULT_OUTPUT = ROOT / "bench" / "results" / "isolation.json"
SIDECAR_READY = re.compile(r"sidecar serving gRPC on [^\s;,]+:(\d+)")
METRICS_AT = re.compile(r"metrics on http://[^\s/]+:(\d+)/metrics")
WIDTH = 256
CANARY_LAYERS = 300
TARGET_X = 1.2
PLAIN_ROUTES = "canary_weight: 0\n"
SHADOW_ROUTES = "canary_weight: 0\nshadow: {share: 100, max_in_flight: 2}\n"
# Scene -> (the path stable's calls take, the undisturbed scene it is compared with, busy canary).
SCENES: dict[str, tuple[str, str, bool]] = {
    "direct": ("direct", "direct", False),
    "direct_shadow": ("direct", "direct", False),
    "direct_busy": ("direct", "direct", True),
    "sidecar": ("sidecar", "sidecar", False),
    "sidecar_shadow": ("shadowing", "sidecar", False),
    "sidecar_busy": ("sidecar", "sidecar", True),
}
THIS = "now"


# --stable: v1 `scale` runs inline on the event loop (it takes no run thread); `dense` (16 layers,
# a few hundred microseconds) runs on the executor, where the versions' bounds matter.
STABLE = {"scale": lambda: scaled_identity(WIDTH, 2.0), "dense": lambda: dense_stack(16, WIDTH, seed=1)}


def build_repository(root: Path, intra_op_threads: int, stable: str = "scale") -> None:
    config: dict[str, object] = {"max_batch_size": 8, "version_policy": {"all": {}}}
    if intra_op_threads:
        config["execution"] = {"intra_op_threads": intra_op_threads}
    write_model(root, "m", 1, STABLE[stable](), config)
    write_model(root, "m", 2, dense_stack(CANARY_LAYERS, WIDTH), config)


def request(version: str = "") -> pb.InferRequest:
    x = np.ones((1, WIDTH), np.float32)
    return pb.InferRequest(model_name="m", model_version=version, inputs=[to_tensor("INPUT0", x)])


class Tree:
    """One tree's service and its two sidecars (plain, shadowing), run from the tree."""

    def __init__(self, label: str, tree: Path, work: Path, args: argparse.Namespace) -> None:
        self.label = label
        self.tree = tree
        env = ["env", f"PYTHONPATH={pythonpath(tree)}"]
        argv = [*env, *service_command(work / "models"), "--metrics-listen", "127.0.0.1:0", "--grace-s", "1"]
        if args.inference_threads:
            argv += ["--inference-threads", str(args.inference_threads)]
        self.service = ServerProcess(f"{label}-service", argv, work, SERVICE_READY, cwd=tree)
        self.routes = {"sidecar": work / f"{label}-plain.yaml", "shadowing": work / f"{label}-shadow.yaml"}
        self.routes["sidecar"].write_text(PLAIN_ROUTES)
        self.routes["shadowing"].write_text(SHADOW_ROUTES)
        self.sidecars: dict[str, ServerProcess] = {}
        self._env = env
        self._work = work
        self.addresses: dict[str, str] = {}

    async def start(self) -> None:
        self.service.spawn()
        port = await self.service.wait_ready()
        self.addresses["direct"] = f"127.0.0.1:{port}"
        for path, routes in self.routes.items():
            argv = [
                *self._env,
                sys.executable,
                "-m",
                "modelyard.sidecar",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                self.addresses["direct"],
                "--admin-listen",
                "",
                "--config",
                str(routes),
            ]
            sidecar = ServerProcess(f"{self.label}-{path}", argv, self._work, SIDECAR_READY, cwd=self.tree)
            sidecar.spawn()
            self.sidecars[path] = sidecar
        for path, sidecar in self.sidecars.items():
            self.addresses[path] = f"127.0.0.1:{await sidecar.wait_ready()}"
            await wait_dyed(self.addresses[path])

    def stop(self) -> None:
        for sidecar in self.sidecars.values():
            sidecar.stop()
        self.service.stop()

    def shadow_calls(self) -> dict[str, float]:
        """The service's modelyard_shadow_calls_total by outcome (none in a tree without it)."""
        found = METRICS_AT.search(self.service.log())
        if found is None:
            return {}
        with urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        counts: dict[str, float] = {}
        for line in text.splitlines():
            matched = re.match(r'modelyard_shadow_calls_total\{model="m",outcome="(\w+)"\} ([0-9.e+]+)', line)
            if matched:
                counts[matched.group(1)] = float(matched.group(2))
        return counts


async def wait_dyed(address: str) -> None:
    """Until the sidecar routes m (it has learned its versions: an answer dyed stable)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            call = stub.Infer(request(), wait_for_ready=True, timeout=10)
            await call
            if ("x-model-dye", "stable") in tuple(await call.trailing_metadata() or ()):
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the sidecar at {address} never dyed a call")


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def scene(
    address: str,
    busy_address: str | None,
    duration_s: float,
    direct: bool,
    mirror: bool = False,
    canary_callers: int = 1,
) -> dict[str, float]:
    """Stable's latencies at `address` for `duration_s`, one client in a closed loop; with
    `busy_address`, a second client calls the canary there back to back meanwhile. Directly,
    stable is named (the service's default is the newest version, the canary); through the
    sidecar it is not (the sidecar dyes the call stable: a pinned call would not be mirrored)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        stable = request("1" if direct else "")
        for _ in range(20):  # warm-up
            await stub.Infer(stable, timeout=30)
        stop = asyncio.Event()
        canary_calls = 0

        async def busy() -> None:
            nonlocal canary_calls
            assert busy_address is not None
            async with grpc.aio.insecure_channel(busy_address) as busy_channel:
                busy_stub = pb_grpc.InferenceServiceStub(busy_channel)
                pinned = request("2")
                while not stop.is_set():
                    await busy_stub.Infer(pinned, timeout=30)
                    canary_calls += 1

        shadow, mirrored = request("2"), set[asyncio.Future[Any]]()
        shadow_md = (("x-model-dye", "shadow"),)
        paused_until = 0.0  # the service's grpc-retry-pushback-ms after a dropped shadow

        async def mirror_one() -> None:
            nonlocal paused_until
            try:
                await stub.Infer(shadow, metadata=shadow_md, timeout=30)
            except grpc.aio.AioRpcError as exc:  # dropped: RESOURCE_EXHAUSTED shadow_dropped
                trailing: Any = exc.trailing_metadata() or ()
                pushback = dict(trailing).get("grpc-retry-pushback-ms", "")
                if pushback.isdigit():
                    paused_until = time.perf_counter() + int(pushback) / 1e3

        load = asyncio.gather(*(busy() for _ in range(canary_callers))) if busy_address else None
        try:
            if load is not None:
                await asyncio.sleep(0.2)  # the canary under way
            latencies: list[float] = []
            end = time.perf_counter() + duration_s
            while time.perf_counter() < end:
                started = time.perf_counter()
                await stub.Infer(stable, timeout=30)
                latencies.append(time.perf_counter() - started)
                # As the sidecar's shadow.max_in_flight 2, and honouring the service's pushback.
                if mirror and len(mirrored) < 2 and time.perf_counter() >= paused_until:
                    task = asyncio.ensure_future(mirror_one())
                    mirrored.add(task)
                    task.add_done_callback(mirrored.discard)
        finally:
            stop.set()
            if load is not None:
                await load
            await asyncio.gather(*mirrored)
    return {
        "p50_ms": pct(latencies, 0.5) * 1e3,
        "p99_ms": pct(latencies, 0.99) * 1e3,
        "calls": len(latencies),
        "canary_calls": canary_calls,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    labels = [(THIS, ROOT), *args.trees]
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        label: {s: [] for s in SCENES} for label, _ in labels
    }
    shadows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-isolation-") as tmp:
        work = Path(tmp)
        build_repository(work / "models", args.intra_op_threads, args.stable)
        trees = [Tree(label, tree, work, args) for label, tree in labels]
        try:
            for tree in trees:
                await tree.start()
            chosen = [name for name in SCENES if name in args.scenes]
            for round_ in range(args.rounds):
                order = chosen if round_ % 2 == 0 else list(reversed(chosen))
                for name in order:
                    path, _, busy = SCENES[name]
                    for tree in trees if round_ % 2 == 0 else list(reversed(trees)):
                        shadowed = name.endswith("_shadow")
                        before = tree.shadow_calls() if shadowed else {}
                        busy_at = (
                            tree.addresses["sidecar" if path != "direct" else "direct"] if busy else None
                        )
                        mirror = name == "direct_shadow"
                        got = await scene(
                            tree.addresses[path],
                            busy_at,
                            args.duration,
                            path == "direct",
                            mirror,
                            args.canary_callers,
                        )
                        if shadowed:
                            after = tree.shadow_calls()
                            for outcome, count in after.items():
                                got[f"shadows_{outcome}"] = count - before.get(outcome, 0.0)
                        results[tree.label][name].append(got)
                        print(
                            f"round {round_ + 1} {tree.label:>6} {name:<15} p50 {got['p50_ms']:6.2f} ms"
                            f"  p99 {got['p99_ms']:6.2f} ms  ({got['calls']:.0f} calls"
                            + (f", canary {got['canary_calls']:.0f}" if busy else "")
                            + "".join(
                                f", shadows {k[8:]} {v:.0f}"
                                for k, v in got.items()
                                if k.startswith("shadows_")
                            )
                            + ")",
                            flush=True,
                        )
            for tree in trees:
                shadows[tree.label] = tree.shadow_calls()
        finally:
            for tree in trees:
                tree.stop()
    return {
        "scenes": results,
        "shadow_calls": shadows,
        "ratios": ratios(results),
        "args": {k: v for k, v in vars(args).items() if k not in ("trees", "output")},
        "trees": {label: str(path) for label, path in labels},
        "source": source_state(ROOT),
    }


def ratios(results: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, dict[str, list[float]]]:
    """Per tree and disturbed scene: the rounds' p50 over the undisturbed scene's in the same round."""
    out: dict[str, dict[str, list[float]]] = {}
    for label, scenes in results.items():
        out[label] = {}
        for name, (_, baseline, _) in SCENES.items():
            if name == baseline or not scenes[name] or not scenes[baseline]:
                continue
            pairs = zip(scenes[name], scenes[baseline], strict=True)
            out[label][name] = [got["p50_ms"] / base["p50_ms"] for got, base in pairs]
    return out


def report(document: dict[str, Any]) -> None:
    results, found = document["scenes"], document["ratios"]
    print("\nstable's p50 / p99 (ms), medians over rounds; disturbed over undisturbed p50 (paired by round):")
    for label, scenes in results.items():
        print(f"\n  {label}")
        for name, rounds in scenes.items():
            if not rounds:
                continue
            p50 = statistics.median(r["p50_ms"] for r in rounds)
            p99 = statistics.median(r["p99_ms"] for r in rounds)
            line = f"    {name:<15} p50 {p50:6.2f}  p99 {p99:7.2f}"
            if name in found[label]:
                values = found[label][name]
                ratio = statistics.median(values)
                verdict = "met" if ratio <= TARGET_X else "NOT met"
                line += (
                    f"   x{ratio:.2f} ({min(values):.2f}-{max(values):.2f}; target {TARGET_X}x: {verdict})"
                )
            print(line)
        calls = document["shadow_calls"].get(label)
        if calls:
            print(f"    service's shadows: {', '.join(f'{k} {v:.0f}' for k, v in sorted(calls.items()))}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--trees", type=source_trees, default=[], help="LABEL=PATH,... measured beside this tree"
    )
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per scene")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--intra-op-threads", type=int, default=0, help="the model's execution.intra_op_threads"
    )
    parser.add_argument("--inference-threads", type=int, default=0, help="the services' --inference-threads")
    parser.add_argument(
        "--scenes",
        type=lambda text: [part for part in text.split(",") if part],
        default=list(SCENES),
        help=f"a comma-separated subset of {','.join(SCENES)} (a disturbed scene needs its undisturbed one)",
    )
    parser.add_argument("--stable", choices=sorted(STABLE), default="scale", help="v1's graph")
    parser.add_argument("--canary-callers", type=int, default=1, help="clients calling v2 in the busy scenes")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    document = asyncio.run(run(args))
    report(document)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.output, document)
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
