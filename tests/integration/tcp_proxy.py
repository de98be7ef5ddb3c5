"""A TCP proxy on 127.0.0.1 in front of a real server, which can go dark: an object-store outage.

``OutageProxy(host, port)`` forwards every connection to the server. ``arm(pattern, seconds, nth)``
makes the ``nth`` client request matching ``pattern`` (bytes, a regex) start an outage of ``seconds`` (several
patterns may be armed at once, each fires once):
open connections are reset and the listening socket is closed, so new connections are refused
(ECONNREFUSED) until it listens again on the same port. ``outages`` records (start, end) times.
"""

from __future__ import annotations

import re
import select
import socket
import struct
import threading
import time


class OutageProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._down_until = 0.0
        self._armed: list[list] = []  # [pattern, seconds, nth, matches so far]
        self.outages: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self, port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(128)
        return s

    def arm(self, pattern: bytes, seconds: float, nth: int = 1) -> None:
        with self._lock:
            self._armed.append([re.compile(pattern), seconds, nth, 0])

    def outage(self, seconds: float) -> None:
        """Reset every open connection and refuse new ones for ``seconds``."""
        with self._lock:
            now = time.time()
            self._down_until = now + seconds
            self.outages.append((now, now + seconds))
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            listener.close()
        for c in conns:  # RST, not FIN: the client sees "connection reset" mid-request
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()
            except OSError:
                pass

    def _serve(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                listener, down = self._listener, time.time() < self._down_until
            if listener is None:
                if not down:
                    with self._lock:
                        self._listener = self._listen(self.port)
                else:
                    time.sleep(0.05)
                continue
            try:
                ready, _, _ = select.select([listener], [], [], 0.1)
                if not ready:
                    continue
                client, _ = listener.accept()
            except (OSError, ValueError):  # closed by outage() between select and accept
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if from_client and self._trigger(data):
                    return  # outage() reset both ends
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _trigger(self, data: bytes) -> bool:
        with self._lock:
            fired = None
            for armed in self._armed:
                if armed[0].search(data):
                    armed[3] += 1
                    if armed[3] >= armed[2]:
                        fired = armed
                        break
            if fired is None:
                return False
            self._armed.remove(fired)
        self.outage(fired[1])
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.outage(0)
