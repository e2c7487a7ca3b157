"""Who owns a model's canary weight on one sidecar: a fleet rollout controller, for a lease.

A controller's `PUT /canary/<model>` names itself (`"owner": "controller <url>"`) and a lease
(`"lease_s"`, renewed by its next PUT); while the lease runs, a PUT that does not name the same
owner, or a local rollout's start, is refused 409 (the controller wins: the fleet's weight is the
one the fleet's gates judged), and GET /canary shows `owner` and `owner_lease_s` beside the weight.
`"lease_s": 0` releases it. A lease that lapses (the controller is gone) leaves the weight as it
was and the model to its operator again. Leases are the process's memory only: a restarted sidecar
keeps its saved weight (the state file) and owes no one, until the controller's next push.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAX_LEASE_S = 600.0
MAX_OWNER = 256  # characters of an owner's name


@dataclass(frozen=True)
class Lease:
    owner: str
    until: float


class WeightOwners:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}

    def holder(self, model: str) -> Lease | None:
        """The lease on a model's weight now (None: nobody's, or it lapsed)."""
        lease = self._leases.get(model)
        if lease is not None and lease.until <= self._clock():
            del self._leases[model]
            return None
        return lease

    def claim(self, model: str, owner: str, lease_s: float) -> None:
        if lease_s <= 0:
            self._leases.pop(model, None)
        else:
            self._leases[model] = Lease(owner, self._clock() + lease_s)

    def view(self, model: str) -> dict[str, object]:
        lease = self.holder(model)
        if lease is None:
            return {}
        return {"owner": lease.owner, "owner_lease_s": round(max(0.0, lease.until - self._clock()), 3)}


def check_claim(owner: object, lease_s: object) -> tuple[str, float]:
    """An owner and lease from a PUT body; ValueError naming what is wrong."""
    if not isinstance(owner, str) or not 0 < len(owner) <= MAX_OWNER or not owner.isprintable():
        raise ValueError(f"owner must be printable text of 1 to {MAX_OWNER} characters")
    if isinstance(lease_s, bool) or not isinstance(lease_s, int | float):
        raise ValueError("lease_s must be a number of seconds")
    if not 0 <= lease_s <= MAX_LEASE_S:
        raise ValueError(f"lease_s must be from 0 to {MAX_LEASE_S:g}")
    return owner, float(lease_s)
