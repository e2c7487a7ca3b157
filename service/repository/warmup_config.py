"""`model_warmup` in config.yaml (its keys: model_config_schema.WarmupDoc): Triton's warm-up samples
(model_config.proto ModelWarmup), the requests a version runs before it serves instead of the
synthetic ones (service/runtime/warmup.py builds them).

    model_warmup:
      - name: numbers            # for logs
        batch_size: 1            # rows of the sample (0: skipped, as Triton)
        count: 1                 # runs of it (0: once, as Triton)
        inputs:
          INPUT0: {datatype: BYTES, dims: [16], input_data_file: input0.bin}   # in <model>/warmup/
          INPUT1: {datatype: INT32, dims: [16], random_data: true}             # or zero_data: true

Each input gives exactly one of zero_data, random_data, input_data_file; dims leave out the batch
dimension and are fixed (no -1), as Triton's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from modelyard.process.documents import DocumentError
from modelyard.service.repository.model_config_schema import WARMUP_FOLDER as WARMUP_FOLDER
from modelyard.service.repository.model_config_schema import WarmupDoc
from modelyard.tensors import is_known

Source = Literal["zero", "random", "file"]


@dataclass(frozen=True)
class WarmupInput:
    datatype: str
    dims: tuple[int, ...]
    source: Source
    file: str = ""  # in <model>/warmup/, when source == "file"


@dataclass(frozen=True)
class WarmupSample:
    name: str
    batch_size: int
    count: int
    inputs: tuple[tuple[str, WarmupInput], ...]  # by input name, in the config's order

    @property
    def runs(self) -> int:
        return max(1, self.count)


def parse_warmup(docs: list[WarmupDoc]) -> tuple[WarmupSample, ...]:
    samples = []
    for i, doc in enumerate(docs):
        where = f"model_warmup[{i}] ({doc.name})"
        if not doc.inputs:
            raise DocumentError(f"{where}.inputs", "give every input of the model")
        inputs = []
        for name, item in doc.inputs.items():
            at = f"{where}.inputs.{name}"
            if not is_known(item.datatype):
                raise DocumentError(f"{at}.datatype", f"unknown datatype {item.datatype!r}")
            given = [s for s, on in (("zero", item.zero_data), ("random", item.random_data)) if on]
            given += ["file"] if item.input_data_file else []
            if len(given) != 1:
                raise DocumentError(at, "give exactly one of zero_data, random_data, input_data_file")
            source: Source = "zero" if given[0] == "zero" else "random" if given[0] == "random" else "file"
            inputs.append((name, WarmupInput(item.datatype, tuple(item.dims), source, item.input_data_file)))
        samples.append(WarmupSample(doc.name, doc.batch_size, doc.count, tuple(inputs)))
    return tuple(samples)


def warmup_files(model_dir: Path, samples: tuple[WarmupSample, ...]) -> list[Path]:
    """The files the samples read (in the model's warmup folder): they count as part of every
    version, as label files do (a changed one reloads the versions)."""
    files = {item.file for sample in samples for _, item in sample.inputs if item.source == "file"}
    return [model_dir / WARMUP_FOLDER / name for name in sorted(files)]
