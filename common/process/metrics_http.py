"""The Prometheus /metrics HTTP endpoint of a process: its own registry, served on a thread, over
HTTPS when TLS files are given (modelyard.process.tls: reloaded when they change). `HttpServer`
serves any WSGI app that way (the sidecar's admin endpoint)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from modelyard.process.tls import HttpTls, TlsFiles, warn_if_plaintext

log = logging.getLogger(__name__)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # scrapes are not worth a log line
        pass


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class HttpServer:
    """A WSGI app on its own thread (a thread per connection), over HTTPS when TLS files are given."""

    def __init__(
        self,
        app: WsgiApp,
        host: str,
        port: int,
        tls: TlsFiles | None = None,
        what: str = "the metrics endpoint",
    ) -> None:
        warn_if_plaintext(host, what, tls)

        contexts = HttpTls(tls) if tls is not None else None

        class Server(ThreadingWSGIServer):  # a class per server: its address family is its own
            address_family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]

            def get_request(self) -> tuple[socket.socket, Any]:
                conn, address = self.socket.accept()
                if contexts is None:
                    return conn, address
                # The handshake runs in the request's thread, on its first read: a client that
                # connects and says nothing must not hold up the accept loop.
                context = contexts.current()
                return context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False), address

            def handle_error(self, request: Any, client_address: Any) -> None:
                # A failed handshake or a dropped connection is the client's; socketserver would
                # print a traceback per connection (a log flood on demand).
                log.debug("%s: connection from %s failed", what, client_address, exc_info=True)

        self._httpd: WSGIServer = make_server(host, port, app, Server, handler_class=_Quiet)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True, name="metrics")
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class MetricsServer(HttpServer):
    """prometheus_client's WSGI app for one registry (so tests can run several in one process)."""

    def __init__(
        self, registry: CollectorRegistry, host: str, port: int, tls: TlsFiles | None = None
    ) -> None:
        super().__init__(make_wsgi_app(registry), host, port, tls)
