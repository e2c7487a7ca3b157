"""The batching layer: a batcher for each served version whose config asks for dynamic batching,
sequence batching (service/sequences/: a stateful model) or decoupled responses
(service/decoupled/: a version whose requests get 0..N responses).

It attaches to a version when the version loads (ModelManager.on_load), before it serves, and lets
go when the version retires (ServedVersion.on_retire): the batcher is closed after the version
drained, so that nothing holds the session any more. The data plane asks it for a version's
batcher; the runtime knows nothing of it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Executor

from modelyard.process.cores import usable_cores
from modelyard.service.batching.batcher import Batcher, BatchSettings
from modelyard.service.decoupled.runner import DecoupledRunner
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.runtime.served import ServedVersion
from modelyard.service.scheduling.clock import Clock
from modelyard.service.sequences.batcher import SequenceBatcher, SequenceDirectory

log = logging.getLogger(__name__)

# What runs a version's requests instead of one run each, as the data plane asks it.
VersionBatcher = Batcher | SequenceBatcher | DecoupledRunner


class BatchingLayer:
    def __init__(
        self,
        executor: Executor,
        metrics: ServiceMetrics,
        clock: Clock | None = None,  # test seam: a clock stepped by hand
        cpus: int = 0,  # 0: this machine's
    ) -> None:
        self._executor = executor
        self._metrics = metrics
        self._clock = clock
        self._cpus = cpus or usable_cores()
        # Keyed by the version object itself (identity): a reloaded version with the same number
        # is another key, so the old batcher drains while the new one serves.
        self._batchers: dict[ServedVersion, VersionBatcher] = {}
        # The same, read-only, for the request path: an `in` and a `get`, no call of this layer's
        # per request.
        self.batchers: Mapping[ServedVersion, VersionBatcher] = self._batchers
        # Which version each live sequence lives on, for every sequence model (the KServe API
        # sends a step that names no version there).
        self.sequences = SequenceDirectory()
        # Said with every step of a sequence this process does not have (a worker's: set by the
        # composition root).
        self.sequence_note = ""

    def batcher(self, served: ServedVersion) -> Batcher | None:
        """The version's dynamic batcher; None when its requests run one by one (or through one
        of the other kinds: `runner_of`)."""
        found = self._batchers.get(served)
        return found if isinstance(found, Batcher) else None

    def runner_of(self, served: ServedVersion) -> VersionBatcher | None:
        """What runs the version's requests: a dynamic batcher, a sequence batcher or a decoupled
        runner; None when its requests run one by one."""
        return self._batchers.get(served)

    def attach(self, served: ServedVersion) -> None:
        """A version loaded (ModelManager.on_load): build its batcher if its config asks for one."""
        config = served.config
        if config.sequence_batching is not None:
            sequences = config.sequence_batching
            log.info(
                "%s is a sequence model (strategy %s, %d instance%s, idle sequences released after %d us)",
                served.label,
                sequences.strategy,
                len(served.instances.all),
                "" if len(served.instances.all) == 1 else "s",
                sequences.max_sequence_idle_us,
            )
            self._batchers[served] = SequenceBatcher(
                served, sequences, self._executor, self.sequences, note=self.sequence_note
            )
            served.on_retire(self._detach)
            return
        if config.decoupled is not None:
            self._batchers[served] = DecoupledRunner(served, self._executor)
            served.on_retire(self._detach)
            return
        if config.dynamic_batching is None:
            return
        settings = BatchSettings.from_config(served.config, served.runner.provider, self._cpus)
        label = served.label
        levels = settings.admission.priority_levels
        log.info(
            "%s batches up to %d rows (leaves at %d or after %.0f us), %d batch%s at a time on %d "
            "instance%s, %d priority level%s",
            label,
            settings.max_batch_size,
            settings.target_rows,
            settings.max_queue_delay_s * 1e6,
            settings.concurrency,
            "" if settings.concurrency == 1 else "es",
            len(served.instances.all),
            "" if len(served.instances.all) == 1 else "s",
            levels,
            "" if levels == 1 else "s",
        )
        metrics = self._metrics.batching(served.model, str(served.version), levels)
        self._batchers[served] = Batcher(
            served.instances, settings, self._executor, served.stats, metrics, self._clock, label
        )
        served.on_retire(self._detach)

    async def close_sequences(self) -> None:
        """Shutting down, once no call can come any more: release every live sequence, so that
        the versions' drain waits for the requests running, not for sequences' next steps."""
        for batcher in list(self._batchers.values()):
            if isinstance(batcher, SequenceBatcher):
                await batcher.close()

    async def _detach(self, served: ServedVersion) -> None:
        """The version retired and drained: close its batcher and let go of it."""
        batcher = self._batchers.pop(served, None)
        if batcher is not None:
            await batcher.close()
