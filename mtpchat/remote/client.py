"""HTTP to an OpenAI-compatible server: the model list, a streamed chat completion, /metrics.

Every way a server can fail a user (not running, a wrong key, a URL that is not an OpenAI API, a
stream cut mid-reply) becomes a `RemoteError` whose message is one line naming what went wrong and
what to do; no httpx exception leaves this module.
"""
from __future__ import annotations

import json
from typing import Iterator

from mtpchat.errors import UserError


class RemoteError(UserError):
    """The server could not be used; the message says why and what to do."""


class StreamCut(RemoteError):
    """The stream ended before the server said the reply was complete."""


def base_url(url: str) -> str:
    """The server's root: `http://host:8000`, `http://host:8000/` and `http://host:8000/v1` are one server."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


def _detail(response) -> str:
    """The server's own error message, where its body has one."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0][:200] if response.text.strip() else ""
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or "")
    return str(err)[:200]


class Server:
    def __init__(self, url: str, api_key: str | None = None, connect_timeout: float = 5.0,
                 read_timeout: float = 600.0):
        import httpx
        self.url = base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(
            read_timeout, connect=connect_timeout))

    def close(self) -> None:
        self.http.close()

    # --- errors ---
    def _unreachable(self, exc) -> RemoteError:
        import httpx
        what = "timed out" if isinstance(exc, httpx.TimeoutException) else (str(exc) or type(exc).__name__)
        err = RemoteError(f"cannot reach the server at {self.url} ({what}): is it running, and is --server right?")
        err.retry = True       # it may be starting: the app tries again (`run` says it once and exits)
        return err

    def _refused(self, response, path: str) -> RemoteError:
        code, detail = response.status_code, _detail(response)
        said = f": {detail}" if detail else ""
        if code in (401, 403):
            return RemoteError(f"the server at {self.url} refused the API key (HTTP {code}{said}); "
                               "pass the right one with --api-key")
        if code == 404:
            return RemoteError(f"{self.url}{path} does not exist (HTTP 404): --server must be the base URL of an "
                               "OpenAI-compatible server, e.g. http://host:8000")
        if code == 429:
            return RemoteError(f"the server is busy (HTTP 429{said}); try again in a moment")
        return RemoteError(f"the server answered HTTP {code} to {path}{said}")

    def _get(self, path: str):
        import httpx
        try:
            return self.http.get(path)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None

    # --- the API ---
    def models(self) -> list[dict]:
        """GET /v1/models; also the check that this is an OpenAI-compatible server at all."""
        r = self._get("/v1/models")
        if r.status_code != 200:
            raise self._refused(r, "/v1/models")
        try:
            data = r.json()["data"]
            assert isinstance(data, list) and all(isinstance(m, dict) and "id" in m for m in data)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise RemoteError(f"{self.url}/v1/models did not answer with an OpenAI model list: "
                              "is --server an OpenAI-compatible server (vLLM, SGLang, mtpchat serve)?") from None
        return data

    def metrics_text(self) -> str | None:
        """The Prometheus text of /metrics, or None where the server has none."""
        import httpx
        try:
            r = self.http.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        return r.text if r.status_code == 200 else None

    def stream_chat(self, body: dict) -> Iterator[dict]:
        """POST /v1/chat/completions with stream on; yields each event's JSON object. Closing the
        generator closes the connection, which is how a server learns to stop generating."""
        import httpx
        path = "/v1/chat/completions"
        try:
            with self.http.stream("POST", path, json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    r.read()
                    raise self._refused(r, path)
                done = finished = False    # [DONE], or a finish_reason where a server sends no [DONE]
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue            # comments, keep-alives, `event:` lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        event = json.loads(data)
                    except ValueError:
                        raise RemoteError(f"the server sent something that is not JSON in the stream: "
                                          f"{data[:80]!r}") from None
                    if isinstance(event, dict) and "error" in event and not event.get("choices"):
                        err = event["error"]
                        raise StreamCut(f"the server stopped the reply with an error: "
                                        f"{err.get('message', err) if isinstance(err, dict) else err}")
                    finished = finished or any(isinstance(c, dict) and c.get("finish_reason")
                                               for c in event.get("choices") or [])
                    yield event
                if not (done or finished):
                    raise StreamCut("the server ended the stream before the reply was complete")
        except httpx.HTTPError as exc:
            if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                raise self._unreachable(exc) from None
            raise StreamCut(f"the connection to the server broke mid-reply ({type(exc).__name__}: {exc})") from None
