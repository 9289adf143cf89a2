"""Metadata-only list and watch of the kinds the operator needs only by name, owner and
annotations (a job's ConfigMap, Service, ServiceAccount, Role, RoleBinding, NetworkPolicy).

Why by hand: kopf lists and watches whole objects, and a tenant may create as many of these as
its quota allows with the job label on them. 600 labelled ConfigMaps of 900 KiB took the
operator from about 100 MiB to 2.2 GiB, past its limit, for every tenant. The apiserver serves
metadata alone when asked (`Accept: ...;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1`, what
client-go's metadata informer does); kopf cannot ask for it and no Python library does, so this
is that informer's loop (client-go tools/cache/reflector.go): list in pages from one snapshot,
watch from the list's resourceVersion with bookmarks, list again at once on 410 Gone and after
a backoff on other errors.

Metadata can be large too (256 KiB of annotations, managedFields with an entry per data key):
a page is read only up to MAX_PAGE_BYTES (past it, the same page is asked again in fewer
objects), and each object is reduced to its small view in the watch's thread (`to_view`), so
neither a whole page nor a whole object's metadata reaches the index.

One thread per (kind, namespace) watch, because the `kubernetes` client blocks; the views are
applied to the index on the event loop (`call_soon_threadsafe`), so passes read the index there
as they read kopf's. Must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kopf._cogs.structs.references import match_namespace, select_specific_namespaces
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines
from urllib3.exceptions import ReadTimeoutError

from crucible.operator.apiclient import describe

log = logging.getLogger(__name__)

_AS = ";g=meta.k8s.io;v=v1, application/json"
ACCEPT_LIST = "application/json;as=PartialObjectMetadataList" + _AS
ACCEPT_WATCH = "application/json;as=PartialObjectMetadata" + _AS
PAGE = 100                  # objects a list page asks for at first
MAX_PAGE_BYTES = 8 << 20    # a page's JSON read at most (parsed, about ten times that)
WATCH_S = 240               # the server ends each watch after this; then it is made again
READ_TIMEOUT_S = WATCH_S + 60   # bookmarks are not promised: only a dead connection is this quiet
BACKOFF_S = (0.5, 1, 2, 5, 10, 30)

# (kind, metadata) -> (job key, view), or None for an object that is no job's: in the thread.
ToView = Callable[[str, dict], "tuple[Any, Any] | None"]
# One object as posted to the loop: (uid, namespace, key, view).
Entry = tuple[str, str, Any, Any]


class PageTooLarge(Exception):
    """A list page over MAX_PAGE_BYTES: ask for fewer objects."""


class MetadataIndex(Mapping):
    """key -> the views of one kind's objects under it, as kopf's index shows them (`get(key,
    ())` iterates views). Written only on the event loop."""

    def __init__(self, kind: str, on_seen: Callable[[Any, Any], None] = lambda key, view: None):
        self.kind, self._on_seen = kind, on_seen
        self._by_uid: dict[str, tuple[Any, str]] = {}    # uid -> (key, namespace)
        self._by_key: dict[Any, dict[str, Any]] = {}
        self.listed: set[str | None] = set()             # scopes listed at least once

    def __getitem__(self, key):
        return tuple(self._by_key[key].values())

    def __iter__(self) -> Iterator:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def covers(self, namespace: str) -> bool:
        """Whether a list has shown this namespace's objects (until then, an absent child may
        exist)."""
        return None in self.listed or namespace in self.listed

    def apply(self, event: str, entry: Entry) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) of one object."""
        uid, namespace, key, view = entry
        self._drop(uid)
        if event != "DELETED" and key is not None:
            self._by_uid[uid] = (key, namespace)
            self._by_key.setdefault(key, {})[uid] = view
            self._on_seen(key, view)

    def replace(self, scope: str | None, entries: list[Entry]) -> None:
        """A whole list of one watch's scope (a namespace; None: all): what it lacks is gone."""
        listed = {entry[0] for entry in entries}
        for uid, (_, namespace) in list(self._by_uid.items()):
            if (scope is None or namespace == scope) and uid not in listed:
                self._drop(uid)
        for entry in entries:
            self.apply("ADDED", entry)
        self.listed.add(scope)

    def _drop(self, uid: str) -> None:
        old = self._by_uid.pop(uid, None)
        if old is not None:
            views = self._by_key.get(old[0], {})
            views.pop(uid, None)
            if not views:
                self._by_key.pop(old[0], None)


class Scopes:
    """Where to watch for kopf's `--namespace` patterns (globs, comma lists, `!` exclusions;
    kopf's own matching, so the operator's two kinds of watch agree): in each namespace named
    plainly, or, if any pattern is more than a name, everywhere, keeping what matches."""

    def __init__(self, patterns: tuple[str, ...] = ()):
        self.patterns = tuple(patterns)
        specific = select_specific_namespaces(self.patterns)
        self.everywhere = not self.patterns or any(p not in specific for p in self.patterns)
        self.watched: list[str | None] = [None] if self.everywhere else sorted(specific)

    def serves(self, namespace: str) -> bool:
        return not self.patterns or any(match_namespace(namespace, p) for p in self.patterns)


def path(group: str, version: str, plural: str, namespace: str | None) -> str:
    root = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


class MetadataWatch(threading.Thread):
    """Keeps `index` equal to the views of `plural` objects carrying `label` in `scope` (a
    namespace; None: all, kept where `serves`). `listed` is called on the loop after each
    complete list."""

    def __init__(self, api, group: str, version: str, plural: str, scope: str | None,
                 label: str, index: MetadataIndex, to_view: ToView,
                 loop: asyncio.AbstractEventLoop, serves: Callable[[str], bool] = lambda ns: True,
                 listed: Callable[[], None] = lambda: None):
        super().__init__(name=f"watch-{plural}-{scope or 'all'}", daemon=True)
        self.api, self.url = api, path(group, version, plural, scope)
        self.scope, self.label, self.index, self.to_view = scope, label, index, to_view
        self.loop, self.serves, self.listed = loop, serves, listed
        self.stopping = threading.Event()
        self._lock = threading.Lock()     # the response in flight, closed by one side only
        self._response = None

    def stop(self) -> None:
        """Ends the thread: a read blocked on the socket returns now."""
        self.stopping.set()
        with self._lock:
            response, self._response = self._response, None
        if response is not None:
            _close(response)

    def run(self) -> None:
        failures = 0
        version = None
        while not self.stopping.is_set():
            try:
                if version is None:
                    version = self._list()
                    failures = 0
                version, relist_now = self._watch(version)
                if version is None and not relist_now:
                    raise RuntimeError("the watch ended with an error")
            except Exception as err:   # noqa: BLE001 -- any failure: wait, then list again
                if self.stopping.is_set():
                    return
                delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                log.warning("metadata watch of %s: %s; listing again in %ss", self.url,
                            describe(err) if not isinstance(err, RuntimeError) else err, delay)
                version = None
                self.stopping.wait(delay)

    def _post(self, fn, *args) -> None:
        if self.stopping.is_set():
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:          # the loop is closed: the operator is gone
            self.stopping.set()

    def _entry(self, meta: dict) -> Entry | None:
        namespace = meta.get("namespace") or ""
        uid = meta.get("uid")
        if not uid or not self.serves(namespace):
            return None
        seen = self.to_view(self.index.kind, meta)
        key, view = seen if seen is not None else (None, None)
        return uid, namespace, key, view

    def _request(self, accept: str, **query):
        query = {"labelSelector": self.label, **query}
        response = self.api.call_api(
            self.url, "GET", query_params=list(query.items()),
            header_params={"Accept": accept}, auth_settings=["BearerToken"],
            _preload_content=False, _request_timeout=(10, READ_TIMEOUT_S))
        return response[0] if isinstance(response, tuple) else response

    def _page(self, query: dict) -> dict:
        response = self._request(ACCEPT_LIST, **query)
        with self._held(response):
            data = response.read(MAX_PAGE_BYTES + 1)
        if len(data) > MAX_PAGE_BYTES:
            raise PageTooLarge
        return json.loads(data)

    @contextlib.contextmanager
    def _held(self, response):
        """`response` in flight while the block runs, so that stop() can close it; closed
        after (unless stop() did)."""
        with self._lock:
            self._response = response
        try:
            yield
        finally:
            with self._lock:
                mine, self._response = self._response is response, None
            if mine:
                _close(response)

    def _list(self) -> str:
        """The whole list, page by page from one snapshot; the index's scope replaced once it
        is complete. A page too large is asked again in fewer objects."""
        entries: list[Entry] = []
        token, limit = "", PAGE
        while True:
            try:
                page = self._page({"limit": limit, **({"continue": token} if token else {})})
            except PageTooLarge:
                if limit == 1:
                    raise RuntimeError("one object's metadata is over "
                                       f"{MAX_PAGE_BYTES >> 20} MiB") from None
                limit = max(1, limit // 4)
                continue
            for item in page.get("items") or ():
                entry = self._entry(item.get("metadata") or {})
                if entry is not None:
                    entries.append(entry)
            meta = page.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                self._post(self.index.replace, self.scope, entries)
                self._post(self.listed)
                return meta.get("resourceVersion")

    def _watch(self, version: str) -> tuple[str | None, bool]:
        """One watch from `version`: (the version to go on from, None to list again; whether
        to list again at once: the version expired)."""
        response = self._request(ACCEPT_WATCH, watch="true", resourceVersion=version,
                                 allowWatchBookmarks="true", timeoutSeconds=WATCH_S)
        with self._held(response):
            if self.stopping.is_set():       # stop() ran before the response was held
                return version, False
            try:
                for line in iter_resp_lines(response):
                    if self.stopping.is_set():
                        return version, False
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        expired = obj.get("code") == 410
                        log.log(logging.INFO if expired else logging.WARNING,
                                "metadata watch of %s ended: %s", self.url, obj.get("message"))
                        return None, expired
                    meta = obj.get("metadata") or {}
                    version = meta.get("resourceVersion") or version
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        entry = self._entry(meta)
                        if entry is not None:
                            self._post(self.index.apply, kind, entry)
                return version, False
            except ReadTimeoutError:        # nothing for READ_TIMEOUT_S: watch again from here
                return version, False
            except ApiException as err:
                if err.status == 410:
                    return None, True
                raise


def _close(response) -> None:
    """Shut the socket (a read blocked on it in another thread returns) and close it, never
    handing a half-read stream back to the pool (the next request there would read its rest)."""
    for end in (response.shutdown, response.close):
        try:
            end()
        except Exception:  # noqa: BLE001 -- released or closed already
            pass
