"""The batching layer: a batcher for each served version whose config asks for dynamic batching.

It attaches to a version when the version loads (ModelManager.on_load), before it serves, and lets
go when the version retires (ServedVersion.on_retire): the batcher is closed after the version
drained, so that nothing holds the session any more. The data plane asks it for a version's
batcher; the runtime knows nothing of it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Executor

from modelyard.service.batching.batcher import Batcher, BatchSettings
from modelyard.service.cores import usable_cores
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.runtime.served import ServedVersion
from modelyard.service.scheduling.clock import Clock

log = logging.getLogger(__name__)


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
        self._batchers: dict[ServedVersion, Batcher] = {}
        # The same, read-only, for the request path: an `in` and a `get`, no call of this layer's
        # per request.
        self.batchers: Mapping[ServedVersion, Batcher] = self._batchers

    def batcher(self, served: ServedVersion) -> Batcher | None:
        """The version's batcher; None when its requests run one by one."""
        return self._batchers.get(served)

    def attach(self, served: ServedVersion) -> None:
        """A version loaded (ModelManager.on_load): build its batcher if its config asks for one."""
        if served.config.dynamic_batching is None:
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

    async def _detach(self, served: ServedVersion) -> None:
        """The version retired and drained: close its batcher and let go of it."""
        batcher = self._batchers.pop(served, None)
        if batcher is not None:
            await batcher.close()
