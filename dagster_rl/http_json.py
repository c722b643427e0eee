"""JSON over HTTP with the standard library, errors that name the endpoint: what the LLM judge and
the rollout server's client share."""

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from dagster_rl.errors import DagsterRLError


class EndpointError(DagsterRLError):
    """An HTTP endpoint was unreachable, too slow, or answered an error `status` (None: no answer)."""

    def __init__(self, message: str, status: int | None = None, body: str = ""):
        super().__init__(message)
        self.status, self.body = status, body


def request(method: str, url: str, body: Any | None, *, api_key: str | None, timeout_s: float, who: str) -> bytes:
    """The raw answer of `method url` with a JSON `body` (None: no body); `who` names the endpoint in errors."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        raise EndpointError(f"{who} {url} answered HTTP {e.code}: {detail}", e.code, detail) from None
    except (TimeoutError, socket.timeout):
        raise EndpointError(f"{who} {url} did not answer within {timeout_s} s") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (TimeoutError, socket.timeout)):
            raise EndpointError(f"{who} {url} did not answer within {timeout_s} s") from None
        raise EndpointError(f"{who} {url} is unreachable: {e.reason}") from None
    except ConnectionError as e:  # reset mid-request
        raise EndpointError(f"{who} {url} is unreachable: {e!r}") from None
