"""The models' views (layers.view.ModelView): the one owner of what a dyed call reads per model that
changes only with the route table, the versions the upstreams serve, or the breakers.

A view is made on a model's first call and kept while the upstreams serve the model (a name
nobody serves gets a fresh view per call: any name a client sends is asked for, and earns no
state). All of them are dropped at once when something they hold may have changed:
- the route table (reloaded from its file, changed over the admin endpoint or by a rollout: a new
  table is bound whole, so the first call under it finds the views are of another);
- what the upstreams serve, whether they have reported it, and their health (every such change
  calls `Sidecar.upstreams_changed`, which calls `clear`), and the breakers pruned after such a
  change (`clear` again, so that no view holds a breaker the sidecar dropped).
A breaker's state is not held: the view holds the breaker itself, whose `allow` reads it; nor
are channels (a TLS renewal's new ones): an attempt asks its upstream for its method.
"""

from __future__ import annotations

from typing import Any

from modelyard.sidecar.layers.view import ModelView, model_view
from modelyard.sidecar.routes.route_table import RouteSource, RouteTable
from modelyard.sidecar.upstreams import Upstream, Upstreams


class ModelViews:
    def __init__(self, routes: RouteSource, upstreams: Upstreams) -> None:
        self._routes = routes
        self._upstreams = upstreams
        self._table: RouteTable | None = None
        self._views: dict[str, ModelView[Upstream]] = {}

    def of(self, model: str) -> ModelView[Any]:
        """The model's view under the current table (layers.view.Views)."""
        table = self._routes.table
        if table is self._table:
            found = self._views.get(model)
            if found is not None:
                return found
        else:
            self._table, self._views = table, {}
        view = model_view(model, table, self._upstreams)
        if view.known:
            self._views[model] = view
        return view

    def clear(self) -> None:
        """Something a view holds may have changed: every view is made again on its next call."""
        self._views = {}
