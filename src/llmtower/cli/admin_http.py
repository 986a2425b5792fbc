"""A small HTTP client for the ``/v1/admin`` routes, shared by ``llmtower ctl``,
``llmtower preload`` and ``llmtower diag``: one request, the server's OpenAI error envelope
turned into one line."""
from __future__ import annotations

from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


class AdminError(Exception):
    """A failure to report in one line (server down, refused, bad answer)."""


def add_server_args(p, timeout_default: float = 60.0) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"server address (default: {DEFAULT_URL})")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--engine-id", default="all",
                   help="'all' (default) or the index of one data-parallel engine")
    p.add_argument("--timeout", type=float, default=timeout_default,
                   help=f"seconds to wait for the server (default: {timeout_default:g})")


def post(url: str, path: str, api_key: str | None, timeout_s: float,
         params: dict[str, str] | None = None, json: Any = None) -> Any:
    """POST ``/v1/admin/{path}``; the server's JSON answer."""
    r = _send("POST", url, path, api_key, timeout_s, params, json)
    try:
        return r.json()
    except ValueError:
        raise AdminError(f"the server's answer is not JSON: {r.text[:200]}") from None


def get(url: str, path: str, api_key: str | None, timeout_s: float,
        params: dict[str, str] | None = None) -> bytes:
    """GET ``/v1/admin/{path}``; the answer's bytes, for the caller to decode."""
    return _send("GET", url, path, api_key, timeout_s, params, None).content


def _send(method: str, url: str, path: str, api_key: str | None, timeout_s: float,
          params: dict[str, str] | None, json: Any) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.request(method, f"{url.rstrip('/')}/v1/admin/{path}", params=params,
                          json=json, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise AdminError(f"cannot reach the server at {url}: {e}; is `llmtower serve` running "
                         "there (--url)?") from None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):  # not an OpenAI error envelope
            message = r.text[:200]
        hint = " (give --api-key)" if r.status_code == 401 else ""
        raise AdminError(f"the server answered {r.status_code}: {message}{hint}")
    return r
