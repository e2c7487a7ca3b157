"""Model control, one for both APIs: ModelService's LoadModel / UnloadModel and KServe's
RepositoryModelLoad / RepositoryModelUnload (service/api/kserve/repository.py) check the name,
write a load's files and serve its override the same way.

With workers, these four RPCs are answered by every worker through the supervisor, which replays
them to a worker that joins later (service/workers/member.py, merge.FANNED): each worker runs
this same code on its own manager."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from modelyard.service.api.names import check_model
from modelyard.service.errors import ModelLoadError
from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.repository.uploads import UploadSpace, write_upload
from modelyard.service.runtime.manager import LoadOverride, ModelManager
from modelyard.service.runtime.status import ModelStatus, VersionState


@dataclass(frozen=True)
class LoadParameters:
    """What a load brings instead of the repository's (KServe's load parameters)."""

    config: ModelConfig | None = None
    files: dict[str, bytes] = field(default_factory=dict)  # relative path -> content, checked


@dataclass(frozen=True)
class ModelControl:
    manager: ModelManager
    uploads: UploadSpace | None = None  # where a load's files go; None: no limit

    async def load(
        self, name: str, name_field: str, brought: Callable[[], LoadParameters] | None = None
    ) -> ModelStatus:
        """Serve `name` as on disk now, or as `brought` says. `brought` is read only once the
        name is checked: the name becomes the upload's folder (write_upload checks again)."""
        check_model(name, name_field=name_field)
        override = None
        if brought is not None:
            load = brought()
            if load.config is not None:
                upload = None
                if load.files:
                    upload = await asyncio.get_running_loop().run_in_executor(
                        None, write_upload, None, name, load.files, self.uploads
                    )
                override = LoadOverride(load.config, upload)
        status = await self.manager.load(name, override)
        failed = [
            f"version {v.version}: {v.reason}"
            for v in status.versions.values()
            if v.state == VersionState.FAILED
        ]
        if override is not None and failed:
            # The override was not applied in full: say so rather than answer OK.
            raise ModelLoadError(f"failed to load {name!r}: {'; '.join(failed)}")
        return status

    async def unload(self, name: str, name_field: str) -> ModelStatus:
        check_model(name, name_field=name_field)
        return await self.manager.unload(name)
