"""An HTTP client of an OpenAI-compatible inference server (vLLM's API server).

Owns: the connection to the server (one per request, closed when the request ends: a
closed stream is how the server learns of a cancellation), the API key (read from an
environment variable or a file, sent as a bearer token, never logged or shown), server-
sent events, and turning every failure into a :class:`BackendError` with one clear line:
down (refused / unreachable), slow (no byte within ``timeout_s``), an HTTP error (the
server's own message), a stream cut short. ``retryable`` says whether the same request
may be sent again — the caller decides whether anything was streamed already.
Must not touch: prompts, tokens' meaning, the scheduler.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from codespec.daemon.service.protocol import BACKEND, ProtocolError


class BackendError(ProtocolError):
    """The server is down, slow, refused the request or serves another model."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(BACKEND, message)
        self.retryable = retryable


def read_api_key(env_name: str, file: str) -> str | None:
    """The API key: ``$env_name`` when set, else the first line of ``file``, else None."""
    key = os.environ.get(env_name, "").strip() if env_name else ""
    if key:
        return key
    if file:
        path = Path(os.path.expanduser(file))
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise BackendError(f"cannot read the API key file {path}: {exc.strerror}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise BackendError(f"the API key file {path} is empty")
        return key
    return None


def _server_message(status: int, body: bytes) -> str:
    """The server's own error text for an HTTP error (OpenAI's and vLLM's layouts)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:300] or f"HTTP {status}"
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:300]
    return str(err)[:300]


class OpenAIClient:
    """Requests to one server: ``get_json``, ``post_json`` and ``stream`` (server-sent
    events of a ``stream: true`` request)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 30.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BackendError(f"backend url {url!r} is not an http:// or https:// address")
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._base = parts.path.rstrip("/")
        if self._base.endswith("/v1"):  # the API's root given: paths below carry /v1
            self._base = self._base[:-3]
        self._key = api_key
        self.timeout_s = timeout_s

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        return f"OpenAIClient({self.url!r}, api_key={'set' if self._key else 'none'})"

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=timeout)
        try:
            conn.connect()
        except TimeoutError:
            conn.close()
            raise BackendError(f"the backend at {self.url} did not accept a connection "
                               f"within {timeout:g} s", retryable=True) from None  # fmt: skip
        except OSError as exc:
            conn.close()
            why = exc.strerror or type(exc).__name__
            raise BackendError(
                f"the backend at {self.url} is down ({why.lower()})", retryable=True
            ) from None
        if conn.sock is not None:
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _headers(self, body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if body:
            headers["Content-Type"] = "application/json"
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        return headers

    def _send(
        self, method: str, path: str, body: Any, timeout: float | None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; the open connection and its response (status checked)."""
        conn = self._connect(timeout or self.timeout_s)
        data = json.dumps(body).encode() if body is not None else None
        try:
            conn.request(method, self._base + path, data, self._headers(data is not None))
            resp = conn.getresponse()
        except BaseException as exc:
            conn.close()
            raise self._failure(exc, timeout or self.timeout_s) from None
        if resp.status != 200:
            try:
                text = resp.read()
            except (OSError, http.client.HTTPException):
                text = b""
            conn.close()
            raise self._http_error(resp.status, text)
        return conn, resp

    def _http_error(self, status: int, body: bytes) -> BackendError:
        msg = _server_message(status, body)
        if status in (401, 403):
            what = "refused the API key" if self._key else "needs an API key"
            return BackendError(f"the backend at {self.url} {what} (HTTP {status}): {msg}")
        return BackendError(f"the backend at {self.url} answered HTTP {status}: {msg}",
                            retryable=status >= 500)  # fmt: skip

    def _failure(self, exc: BaseException, timeout: float) -> BaseException:
        """The BackendError for an exception raised while talking to the server."""
        if isinstance(exc, BackendError):
            return exc
        if isinstance(exc, TimeoutError):
            return BackendError(f"the backend at {self.url} sent nothing for {timeout:g} s "
                                "(slow or stuck)", retryable=True)  # fmt: skip
        if isinstance(exc, (OSError, http.client.HTTPException)):
            return BackendError(f"the backend at {self.url} closed the connection "
                                f"({type(exc).__name__})", retryable=True)  # fmt: skip
        return exc

    def get_json(self, path: str, timeout: float | None = None) -> Any:
        return self._json("GET", path, None, timeout)

    def post_json(self, path: str, body: Any, timeout: float | None = None) -> Any:
        return self._json("POST", path, body, timeout)

    def get_text(self, path: str, timeout: float | None = None) -> str:
        conn, resp = self._send("GET", path, None, timeout)
        try:
            return resp.read().decode("utf-8", "replace")
        except BaseException as exc:
            raise self._failure(exc, timeout or self.timeout_s) from None
        finally:
            conn.close()

    def _json(self, method: str, path: str, body: Any, timeout: float | None) -> Any:
        conn, resp = self._send(method, path, body, timeout)
        try:
            raw = resp.read()
        except BaseException as exc:
            raise self._failure(exc, timeout or self.timeout_s) from None
        finally:
            conn.close()
        try:
            return json.loads(raw)
        except ValueError:
            raise BackendError(f"the backend at {self.url} answered {path} with no JSON") from None

    def stream(self, path: str, body: Any) -> Iterator[dict[str, Any]]:
        """POST ``body`` and yield each server-sent event's JSON until ``[DONE]``. Closing
        the generator closes the connection: the server drops the request."""
        conn, resp = self._send("POST", path, body, None)
        try:
            while True:
                try:
                    line = resp.readline()
                except BaseException as exc:
                    raise self._failure(exc, self.timeout_s) from None
                if not line:
                    raise BackendError(f"the backend at {self.url} ended the stream early",
                                       retryable=True)  # fmt: skip
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event:
                    raise BackendError(f"the backend at {self.url} failed the request: "
                                       f"{_server_message(500, data)}")  # fmt: skip
                yield event
        finally:
            conn.close()
