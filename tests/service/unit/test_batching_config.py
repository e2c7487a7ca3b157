"""The dynamic_batching section of config.yaml: priorities, queue policies, run concurrency."""

from __future__ import annotations

from typing import Any

import pytest

from modelyard.service.batching.batcher import BatchSettings
from modelyard.service.repository.model_config import ConfigError, parse_config
from modelyard.service.runtime.providers import CPU
from modelyard.service.scheduling.queue import AdmissionPolicy, QueuePolicy

ISSUE_EXAMPLE: dict[str, Any] = {
    "max_batch_size": 64,
    "dynamic_batching": {
        "max_queue_delay_us": 2000,
        "preferred_batch_sizes": [16, 32],
        "priority_levels": 2,
        "default_priority_level": 2,
        "default_queue_policy": {
            "max_queue_size": 256,
            "default_timeout_us": 0,
            "allow_timeout_override": True,
        },
        "priority_queue_policy": {1: {"max_queue_size": 64}},
    },
}


def test_the_issue_example_parses() -> None:
    batching = parse_config(ISSUE_EXAMPLE).dynamic_batching
    assert batching is not None
    assert batching.max_queue_delay_us == 2000 and batching.preferred_batch_sizes == (16, 32)
    assert batching.max_concurrent_batches == 0
    default = QueuePolicy(max_queue_size=256, default_timeout_us=0, allow_timeout_override=True)
    # A level's policy takes the keys it leaves out from default_queue_policy.
    level1 = QueuePolicy(max_queue_size=64, default_timeout_us=0, allow_timeout_override=True)
    assert batching.admission == AdmissionPolicy(2, 2, default, ((1, level1),))
    assert batching.admission.policy(1) == level1 and batching.admission.policy(2) == default
    settings = BatchSettings.from_config(parse_config(ISSUE_EXAMPLE), CPU, cpus=2)
    assert settings.target_rows == 32 and settings.max_queue_delay_s == 0.002 and settings.concurrency == 1


def test_defaults_one_level_no_bounds() -> None:
    batching = parse_config({"max_batch_size": 8, "dynamic_batching": {}}).dynamic_batching
    assert batching is not None and batching.admission == AdmissionPolicy()
    settings = BatchSettings.from_config(
        parse_config({"max_batch_size": 8, "dynamic_batching": {"max_concurrent_batches": 3}}), CPU, 2
    )
    assert settings.target_rows == 8 and settings.concurrency == 3


def test_default_level_is_the_lowest_unless_given() -> None:
    raw = {"max_batch_size": 8, "dynamic_batching": {"priority_levels": 3}}
    batching = parse_config(raw).dynamic_batching
    assert batching is not None and batching.admission.default_priority_level == 3


def _with(**batching: object) -> dict[str, object]:
    return {"max_batch_size": 8, "dynamic_batching": batching}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"dynamic_batching": {}}, "needs max_batch_size >= 1"),
        (_with(preferred_batch_sizes=[4, 16]), "above max_batch_size 8"),
        (_with(priority_levels=0), "dynamic_batching.priority_levels"),
        (_with(priority_levels=2, default_priority_level=3), "default_priority_level: 3 is not a level"),
        (_with(priority_queue_policy={3: {}}), "key 3 is not a priority level in 1..1"),
        (_with(priority_queue_policy={"high": {}}), "key 'high'"),
        (_with(default_queue_policy={"max_queue_size": -1}), "default_queue_policy.max_queue_size"),
        (_with(default_queue_policy={"timeout_action": "DELAY"}), "unknown key(s) timeout_action"),
        (_with(default_queue_policy={"allow_timeout_override": "yes"}), "allow_timeout_override"),
        (_with(priority_queue_policy={1: {"default_timeout_us": 1.5}}), "priority_queue_policy.1"),
        (_with(max_concurrent_batches=-1), "max_concurrent_batches"),
    ],
)
def test_bad_batching_configs_name_the_key(raw: object, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw)
    assert words in str(caught.value)
