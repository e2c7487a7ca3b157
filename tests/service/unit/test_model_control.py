"""Model control, shared by ModelService and KServe: the name is checked (naming the request's
field) before anything a load brings is read, for that name becomes the upload's folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.service.api.model_control import LoadParameters, ModelControl
from modelyard.service.errors import InvalidInput
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.providers import ProviderChoice


@pytest.mark.parametrize("field", ["name", "model_name"])
async def test_a_bad_name_is_refused_by_its_field_before_the_load_parameters_are_read(
    tmp_path: Path, field: str
) -> None:
    manager = ModelManager(tmp_path, ProviderChoice(False, "test: CPU"), drain_timeout_s=1.0)
    control = ModelControl(manager)
    read: list[str] = []

    def brought() -> LoadParameters:
        read.append("read")
        return LoadParameters()

    try:
        with pytest.raises(InvalidInput, match=f"^{field} '../x'"):
            await control.load("../x", field, brought)
        with pytest.raises(InvalidInput, match=f"^{field} '../x'"):
            await control.unload("../x", field)
        assert read == []
        assert manager.statuses() == []  # nothing reached the manager
    finally:
        await manager.close()
