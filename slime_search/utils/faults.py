"""What kind of fault an exception is. One that passes is a service timing out, refusing or dropping connections, or
busy or failing on its side. One that would come back on every try is a bug: a TypeError, a KeyError, a 4xx answer. A
disk that is full or over its quota is told apart too.

The reward plugins and search clients a run loads use whichever HTTP library they like (aiohttp, httpx, requests, an
SDK). So the test is by what the exception says about itself, along its chain of causes:
- a `transient` attribute that is a bool (a plugin's own word) decides;
- the built-in TimeoutError and ConnectionError (refused, reset, aborted, broken pipe), and an OSError whose errno is a
  network one (aiohttp's connector errors carry it);
- an HTTP status of 5xx, 429 or 408 on the exception (`status`, `status_code`) or its response (`response.status_code`,
  `response.status`);
- a class in its hierarchy named for a timeout or a connection (httpx.ConnectError and ReadTimeout,
  aiohttp.ServerDisconnectedError, openai.APIConnectionError, requests.ConnectionError, ...).
Anything else is taken to come back: the run stops on it rather than wait for a fault that will not pass.
"""

from __future__ import annotations

import errno
import re

TRANSIENT = "transient"  # an error kind: the fault passes (a retry later may succeed)
LASTING = "lasting"  # an error kind: the same input fails the same way again
NETWORK_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EPIPE,
    }
)
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
PASSING_STATUS = frozenset({408, 429})  # request timeout, too many requests; and every 5xx
PASSING_CLASS_NAME = re.compile(r"Timeout|Connect|Disconnect|RemoteProtocol|Transport|Network|Unavailable")
MAX_CHAIN = 16  # causes followed (a chain is finite, but a cycle of __context__ is possible)


def causes(err: BaseException):
    """`err`, then its causes (`__cause__`, else `__context__`), each once."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen and len(seen) < MAX_CHAIN:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def http_status(err: BaseException) -> int | None:
    """The HTTP status an exception carries, on itself or on its response."""
    response = getattr(err, "response", None)
    for value in (getattr(err, "status", None), getattr(err, "status_code", None), getattr(response, "status_code", None),
                  getattr(response, "status", None)):  # fmt: skip
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value
    return None


def _passes(err: BaseException) -> bool | None:
    """Whether this one exception (not its causes) is of a fault that passes; None when it does not say."""
    own = getattr(err, "transient", None)
    if isinstance(own, bool):
        return own
    if isinstance(err, (TimeoutError, ConnectionError)):
        return True
    if isinstance(err, OSError) and err.errno in NETWORK_ERRNOS:
        return True
    status = http_status(err)
    if status is not None:
        return status >= 500 or status in PASSING_STATUS
    if any(PASSING_CLASS_NAME.search(cls.__name__) for cls in type(err).__mro__):
        return True
    return None


def is_transient(err: BaseException) -> bool:
    """Whether `err` is of a fault that passes (see the module's docstring): the first exception of its chain that says
    decides."""
    for each in causes(err):
        verdict = _passes(each)
        if verdict is not None:
            return verdict
    return False


def error_kind(err: BaseException) -> str:
    return TRANSIENT if is_transient(err) else LASTING


def disk_full_error(err: BaseException) -> OSError | None:
    """The OSError ENOSPC or EDQUOT (no space left, disk quota exceeded) behind `err`, if any. It is looked for along
    the error's causes. An error gathered from several workers has its workers' errors looked at too: the
    CheckpointException of a torch_dist save holds one per rank, and Ray's RayTaskError its `cause`."""
    pending, seen = [err], set()
    while pending and len(seen) < 4 * MAX_CHAIN:
        for each in causes(pending.pop()):
            if id(each) in seen:
                continue
            seen.add(id(each))
            if isinstance(each, OSError) and each.errno in DISK_FULL_ERRNOS:
                return each
            cause = getattr(each, "cause", None)
            if isinstance(cause, BaseException):
                pending.append(cause)
            failures = getattr(each, "failures", None)  # torch's CheckpointException: rank -> (exception, traceback)
            if isinstance(failures, dict):
                pending.extend(pair[0] for pair in failures.values() if isinstance(pair, tuple) and pair)
    return None
