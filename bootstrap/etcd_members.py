"""The etcd cluster's members as etcd3gw clients: the two things etcd3gw does not do, kept thin.

etcd3gw (docs/bootstrap.md says why this library) talks to one endpoint and has no notion of a
user. So:

- Failover: one etcd3gw client per endpoint; `Members.call` runs a request on the member that
  answered last and, when that one cannot be reached or has no leader, on the next ones. When
  none answers: BootstrapTimeout naming every endpoint and what each said.
- Authentication: etcd's gateway takes a token from ``POST /v3/auth/authenticate`` in the
  Authorization header. `_TokenAuth` is a requests auth hook given to etcd3gw through its own
  ``session`` parameter: it fetches the token on first use and, when the member says the token
  is invalid (etcd's simple tokens expire when unused for --auth-token-ttl), fetches a new one
  and sends the request once more. A refused password is BootstrapAuthError (permanent).

Every other etcd error becomes a BootstrapError with the server's words.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import requests
from etcd3gw import exceptions as etcd_exc
from etcd3gw.client import Etcd3Client

from .client import BootstrapAuthError, BootstrapError, BootstrapTimeout
from .etcd_config import PASSWORD_ENV, USER_ENV, EtcdConfig

log = logging.getLogger("kvstage.bootstrap.etcd")

API_PATH = "/v3/"          # etcd >= 3.4 (Debian bookworm ships 3.4.23)
T = TypeVar("T")

# gRPC codes etcd answers with (through the gateway's JSON body)
_UNAUTHENTICATED, _PERMISSION_DENIED, _UNAVAILABLE = 16, 7, 14
_AUTH_WORDS = ("user name is empty", "permission denied", "invalid auth token", "authentication failed",
               "user name not found", "invalid user ID or password")


def etcd_error(detail: object) -> tuple[int | None, str]:
    """(gRPC code, message) of an etcd gateway error body; (None, text) when it is not one."""
    text = str(detail or "")
    try:
        body = json.loads(text)
        return body.get("code"), str(body.get("message") or body.get("error") or text)
    except (ValueError, AttributeError):
        return None, text


class _TokenAuth(requests.auth.AuthBase):
    """Authorization: <token> on every request to one member; a new token once on a 401."""

    def __init__(self, base_url: str, user: str, password: str, timeout_s: float):
        self._url = base_url + API_PATH + "auth/authenticate"
        self._user, self._password, self._timeout = user, password, timeout_s
        self._token: str | None = None
        self._lock = threading.Lock()
        self.session: requests.Session | None = None   # the member's, for TLS settings

    def _fetch(self, stale: str | None) -> str:
        with self._lock:
            if self._token is not None and self._token != stale:
                return self._token
            s = self.session or requests
            resp = s.post(self._url, json={"name": self._user, "password": self._password}, timeout=self._timeout)
            if resp.status_code != 200:
                code, msg = etcd_error(resp.text)
                if resp.status_code in (400, 401, 403) and code not in (_UNAVAILABLE,):
                    raise BootstrapAuthError(f"etcd refused user {self._user!r}: {msg} (check {USER_ENV} and "
                                             f"{PASSWORD_ENV})")
                raise etcd_exc.ConnectionFailedError(resp.text, resp.reason)   # e.g. no leader: try another member
            self._token = resp.json()["token"]
            return self._token

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        r.headers["Authorization"] = self._fetch(None)
        r.register_hook("response", self._again_on_401)
        return r

    def _again_on_401(self, resp: requests.Response, **kwargs) -> requests.Response:
        if resp.status_code != 401 or resp.request.headers.get("X-Kvstage-Retry"):
            return resp
        token = self._fetch(resp.request.headers.get("Authorization"))
        _ = resp.content  # consume the refusal, so its connection can be reused
        resp.close()
        again = resp.request.copy()
        again.headers["Authorization"] = token
        again.headers["X-Kvstage-Retry"] = "1"
        new = resp.connection.send(again, **kwargs)
        new.history.append(resp)
        new.request = again
        return new


class Member:
    """One endpoint: its URL, its etcd3gw client and that client's requests session."""

    def __init__(self, url: str, cfg: EtcdConfig, timeout_s: float):
        host, _, port = url.split("://", 1)[1].rpartition(":")
        self.url = url
        self.session = requests.Session()
        if cfg.ca_cert is not None:
            self.session.verify = cfg.ca_cert
        if cfg.cert is not None:
            self.session.cert = (cfg.cert, cfg.key)
        if cfg.user is not None:
            auth = _TokenAuth(url, cfg.user, cfg.password or "", timeout_s)
            auth.session = requests.Session()
            auth.session.verify, auth.session.cert = self.session.verify, self.session.cert
            self.session.auth = auth
        self.client = Etcd3Client(host=host.strip("[]"), port=int(port),
                                                 protocol="https" if cfg.secure else "http",
                                                 timeout=timeout_s, api_path=API_PATH, session=self.session)

    def close(self) -> None:
        self.session.close()
        auth = self.session.auth
        if isinstance(auth, _TokenAuth) and auth.session is not None:
            auth.session.close()


class Members:
    """Requests that go on when a member is down (the one that answered last is asked first)."""

    def __init__(self, cfg: EtcdConfig, timeout_s: float):
        self.cfg = cfg
        self.members = [Member(u, cfg, timeout_s) for u in cfg.urls]
        self._current = 0
        self._lock = threading.Lock()

    def order(self) -> list[Member]:
        """Every member, the one that answered last first."""
        with self._lock:
            start = self._current
        n = len(self.members)
        return [self.members[(start + i) % n] for i in range(n)]

    def answered(self, member: Member) -> None:
        with self._lock:
            self._current = self.members.index(member)

    def call(self, what: str, fn: Callable[[Etcd3Client], T]) -> T:
        """fn(client) on the members in turn until one answers. Raises BootstrapTimeout (none
        answered, every endpoint named), BootstrapAuthError, or BootstrapError (etcd refused)."""
        failures = []
        for m in self.order():
            try:
                result = fn(m.client)
            except (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError,
                    etcd_exc.InternalServerError) as exc:
                failures.append(f"{m.url}: {_short(exc)}")
                continue
            except etcd_exc.Etcd3Exception as exc:
                raise refusal(what, exc) from None
            self.answered(m)
            return result
        raise BootstrapTimeout(f"no etcd member answered {what} ({', '.join(self.cfg.urls)}): "
                               + "; ".join(failures))

    def close(self) -> None:
        for m in self.members:
            m.close()


def refusal(what: str, exc: etcd_exc.Etcd3Exception) -> BootstrapError:
    code, msg = etcd_error(exc.detail_text)
    if code in (_UNAUTHENTICATED, _PERMISSION_DENIED) or any(w in msg for w in _AUTH_WORDS):
        hint = f" (set {USER_ENV} and {PASSWORD_ENV})" if "user name is empty" in msg else ""
        return BootstrapAuthError(f"etcd refused {what}: {msg}{hint}")
    return BootstrapError(f"etcd refused {what}: {msg}", "internal")


def _short(exc: Exception) -> str:
    code, msg = etcd_error(getattr(exc, "detail_text", None) or str(exc))
    text = msg or type(exc).__name__
    if "Connection refused" in text:
        return "connection refused"
    return text if len(text) <= 200 else text[:200] + "..."
