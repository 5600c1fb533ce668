"""Run a server app in a background thread on a loopback port (tests, bench/serve_load.py)."""

from __future__ import annotations

import socket
import threading
import time


def uvicorn_server(config):
    """A uvicorn.Server over `config` whose exit (SIGINT, SIGTERM: handle_exit) first stops
    the app's running requests (hyspec.server.state.ServerState.begin_shutdown, on the event
    loop): each ends at once with a 503, a stream with its error event and [DONE], and the
    server exits; plain uvicorn would wait for every open request to run to its end."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            state = getattr(getattr(self.config.app, "state", None), "hyspec", None)
            loop = getattr(getattr(state, "worker", None), "_loop", None)
            if not self.should_exit and loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(state.begin_shutdown)  # (a signal handler: only schedule it)
            super().handle_exit(sig, frame)

    return Server(config)


class ServerThread:
    """uvicorn on an already-bound socket (port 0: the OS picks a free one, no race)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 shutdown_timeout: float | None = None) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn_server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                                                    timeout_graceful_shutdown=shutdown_timeout))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
