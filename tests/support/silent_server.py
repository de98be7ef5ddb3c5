"""An endpoint that accepts connections and never answers (a stalled store, a black-holing proxy)."""

from __future__ import annotations

import socket
import threading


class SilentServer:
    """Listens on 127.0.0.1, accepts every connection, reads what comes and never writes a byte.
    ``endpoint``: its ``http://`` address; ``close()`` drops every connection."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)  # held open, never answered (the kernel buffers the request)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> "SilentServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
