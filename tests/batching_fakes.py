"""Test seams for batching: a clock stepped by hand, runners that hold and record their runs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.runtime.providers import ProviderChoice
from modelyard.service.runtime.session import ModelRunner, load_runner

HOLD_LIMIT_S = 30.0  # a held run that is never released fails the test instead of hanging it


class ManualClock:
    """A batching clock that moves only when the test says so (service.scheduling.clock.Clock)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._waiting: set[asyncio.Event] = set()
        self.waits = 0  # calls to wait: each one is a loop that took its turn and looks again

    def now(self) -> float:
        return self._now

    async def wait(self, event: asyncio.Event, until: float | None) -> None:
        self.waits += 1
        if until is not None and self._now >= until:
            await asyncio.sleep(0)
            return
        self._waiting.add(event)
        try:
            await event.wait()
        finally:
            self._waiting.discard(event)

    def advance(self, seconds: float) -> None:
        self._now += seconds
        for event in list(self._waiting):
            event.set()  # waiters look at the time again


class Gate:
    """Holds runs on executor threads until opened; counts runs that are inside."""

    def __init__(self, open_: bool = True) -> None:
        self._open = threading.Event()
        if open_:
            self._open.set()
        self.entered = 0

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    def pass_(self) -> None:
        self.entered += 1
        if not self._open.wait(HOLD_LIMIT_S):
            raise TimeoutError("a held run was never released")


class FakeRunner:
    """A model without ONNX Runtime: "y" = 2 * x and "s" = the row sums of x. It records the x of
    every run, holds runs at its gate, and fails any run whose x holds a NaN."""

    def __init__(self, inline: bool = False) -> None:
        self.inline = inline
        self.gate = Gate()
        self.runs: list[np.ndarray] = []

    @property
    def runs_inline(self) -> bool:
        return self.inline

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str], options: Any = None
    ) -> list[np.ndarray]:
        if not self.inline:
            self.gate.pass_()
        x = feeds["x"]
        self.runs.append(np.array(x))
        if np.isnan(x).any():
            raise ValueError("x holds a NaN")
        outputs = {"y": x * 2, "s": x.sum(axis=1)}
        return [outputs[name] for name in output_names]

    @property
    def rows(self) -> list[int]:
        return [len(x) for x in self.runs]


class FaultyRunner(FakeRunner):
    """A FakeRunner whose every run fails with `error`, as ONNX Runtime raises it (held at its
    gate first, and recorded)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str], options: Any = None
    ) -> list[np.ndarray]:
        self.gate.pass_()
        self.runs.append(np.array(feeds["x"]))
        raise self.error


class HandClock:
    """A plain clock callable (time.monotonic's stand-in) whose `now` the test sets by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class RecordingRunner(ModelRunner):
    """A real ONNX Runtime runner that records each run's first input and can be held at a gate.
    Always runs on the executor, so that a held run never blocks the event loop."""

    gate: Gate = field(default_factory=Gate)
    runs: list[np.ndarray] = field(default_factory=list)

    @property
    def runs_inline(self) -> bool:
        return False

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str], options: Any = None
    ) -> list[np.ndarray]:
        self.gate.pass_()
        self.runs.append(np.array(next(iter(feeds.values()))))
        return super().run(feeds, output_names, options)


@dataclass
class Runners:
    """The loader seam of build_service: every version loads as a RecordingRunner, kept here by
    (model, version) so that tests can hold, release and inspect it."""

    held: set[tuple[str, int]] = field(default_factory=set)  # versions whose runs start held
    loaded: dict[tuple[str, int], RecordingRunner] = field(default_factory=dict)  # the latest loaded
    # Every runner loaded for a version, in load order: a version of N instances adds N.
    every: dict[tuple[str, int], list[RecordingRunner]] = field(default_factory=dict)

    def loader(self) -> Callable[[Path, ModelConfig, ProviderChoice], ModelRunner]:
        def load(model_file: Path, config: ModelConfig, providers: ProviderChoice) -> ModelRunner:
            runner = load_runner(model_file, config, providers)
            key = (model_file.parent.parent.name, int(model_file.parent.name.lstrip("v")))
            recording = RecordingRunner(
                **{f.name: getattr(runner, f.name) for f in fields(runner)},
                gate=Gate(open_=key not in self.held),
            )
            self.loaded[key] = recording
            self.every.setdefault(key, []).append(recording)
            return recording

        return load

    def __getitem__(self, key: tuple[str, int]) -> RecordingRunner:
        return self.loaded[key]
