"""One request's place in a sequence: its correlation id and its START and END flags, as Triton's
clients send them (KServe request parameters sequence_id, sequence_start, sequence_end; the API
reads them, service/api/kserve/sequences.py)."""

from __future__ import annotations

from dataclasses import dataclass

from modelyard.common.names import echo

# The longest string id kept: a live sequence's id is state the service holds.
MAX_ID_CHARS = 256
MAX_ID = (1 << 64) - 1  # Triton's ids are uint64 (or strings)


@dataclass(frozen=True, slots=True)
class Step:
    sequence_id: int | str  # > 0, or a non-empty string (0 and "" mean "no sequence")
    start: bool = False
    end: bool = False

    @property
    def shown(self) -> str:
        """The id as messages say it: `sequence 1000`, `sequence 'a1b2'`."""
        return (
            f"sequence {self.sequence_id}"
            if isinstance(self.sequence_id, int)
            else f"sequence {echo(self.sequence_id)}"
        )
