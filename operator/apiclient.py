"""The operator's connection to the Kubernetes API: credentials, a deadline on every call, and
which errors mean "try again".

Owns three facts the rest of the operator must not get wrong:
- **Credentials**: in-cluster first, then $KUBECONFIG, read when asked (the `kubernetes` package
  reads $KUBECONFIG once at import, which would pin whatever was set then).
- **Every call has a deadline.** The generated client sends `timeout=None` to urllib3 unless a
  call passes `_request_timeout`, and urllib3 then blocks for as long as the socket does: a
  half-open connection (a node's NAT table flushed, an apiserver behind a dead load balancer)
  holds a pass, or a leader's Lease renewal, forever. `TimedApiClient` gives every call that
  names none the client's default (client-go's `rest.Config.Timeout` plays the same part).
- **Connection errors are transient.** urllib3 raises its own `HTTPError` family
  (`MaxRetryError` for a refused connection, `ReadTimeoutError`, `ProtocolError`), which are
  not `OSError`s; the client raises `ApiException` only for an HTTP answer. `CONNECTION_ERRORS`
  is the one list every caller catches.

Must not import torch, kopf or the decision code.
"""

from __future__ import annotations

import os

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

# (connect, read) seconds for an ordinary call. The read deadline is generous: a LIST of every
# pod of a large cluster can take seconds; a healthy write takes milliseconds.
DEFAULT_TIMEOUT_S = (5.0, 30.0)

# What a call raises when no HTTP answer came back: retry later, never give up on a job for it.
CONNECTION_ERRORS = (OSError, urllib3.exceptions.HTTPError)
# ... and with an HTTP answer: the caller looks at `.status`.
API_ERRORS = (ApiException,) + CONNECTION_ERRORS


class TimedApiClient(client.ApiClient):
    """`kubernetes.client.ApiClient` whose calls all have a deadline (`timeout_s` unless the call
    names its own)."""

    def __init__(self, configuration: client.Configuration,
                 timeout_s: float | tuple[float, float] = DEFAULT_TIMEOUT_S):
        super().__init__(configuration)
        self.timeout_s = timeout_s

    def call_api(self, *args, **kwargs):
        if kwargs.get("_request_timeout") is None:
            kwargs["_request_timeout"] = self.timeout_s
        return super().call_api(*args, **kwargs)


def client_configuration() -> client.Configuration:
    """In-cluster credentials first, then $KUBECONFIG (read now)."""
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                client_configuration=cfg)
    return cfg


def api_client(pool_size: int, timeout_s: float | tuple[float, float] = DEFAULT_TIMEOUT_S,
               retries: int | None = None) -> TimedApiClient:
    """A client with `pool_size` connections (one per thread that calls at once). `retries`:
    urllib3's own retries of a failed connection or read (None: its default, 3; a caller that
    retries on a schedule of its own passes 0, or a call could take four deadlines)."""
    cfg = client_configuration()
    cfg.connection_pool_maxsize = max(4, pool_size)
    if retries is not None:
        cfg.retries = retries
    return TimedApiClient(cfg, timeout_s)


def bearer_token(header: str) -> str | None:
    """The token of an Authorization value. The scheme is case-insensitive (RFC 9110 11.1), and
    the kubernetes client writes it as "bearer" in-cluster and "Bearer" from a kubeconfig."""
    scheme, _, rest = header.strip().partition(" ")
    token = rest if scheme.lower() == "bearer" else header
    return token.strip() or None


def describe(err: BaseException) -> str:
    """A connection error in one line, without its traceback or any header it carried."""
    status = getattr(err, "status", None)
    if status is not None:
        return f"HTTP {status} {getattr(err, 'reason', '')}".strip()
    reason = getattr(err, "reason", None)   # MaxRetryError: the error underneath
    return f"{type(err).__name__}: {reason or err}"[:300]
