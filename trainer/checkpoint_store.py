"""The commits under one checkpoint URI, as rank 0 reads and tends them.

Ownership (the incarnation token: only the newest start of a job commits or prunes), listing,
reading a manifest with its signature checked, quarantine, retention and discarding an abandoned
timeline. No collectives: the `Checkpointer` decides on rank 0 and tells the other ranks.

Retention (`retention_plan`, pure) keeps the newest `keep` commits and every `keepEvery`-th step
(what a spike rollback needs); it never deletes the newest commit.
"""

from __future__ import annotations

import json
import logging
import time

from crucible.trainer import storage
from crucible.trainer.checkpoint_manifest import (INCARNATION, MANIFEST, QUARANTINE,
                                                  SIGNING_KEY_ENV, key_id, manifest_problem,
                                                  parse_step, signature_problem, step_name)

log = logging.getLogger(__name__)


class StaleIncarnation(RuntimeError):
    """A newer start of the job owns the checkpoints: this one may neither commit nor prune."""


def retention_plan(committed: list[int], keep: int, keep_every: int) -> list[int]:
    """Committed steps to delete: all but the newest `keep` and the multiples of `keep_every`."""
    newest = set(sorted(committed)[-keep:]) if keep > 0 else set()
    if committed:
        newest.add(max(committed))  # never the newest commit, whatever keep says
    kept_forever = {s for s in committed if keep_every and s % keep_every == 0}
    return sorted(s for s in committed if s not in newest | kept_forever)


class CommitStore:
    """The checkpoints under `uri`; `key` is the signing key (None: manifests are not checked)."""

    def __init__(self, uri: str, key: bytes | None):
        self.uri, self.key = uri, key
        # Set by claim(); None for a reader (`crucible eval`), which fences no one.
        self.incarnation: str | None = None
        self._unchecked_noted = False  # "signature not checked" is logged once per process

    # -- fencing ------------------------------------------------------------------------------
    def claim(self, token: str, *, write: bool) -> None:
        """Make `token` the owner of the URI (`write`: this is rank 0, which records it). An
        older incarnation still running (a pod terminating after its replacement started) then
        finds another token and neither commits nor prunes: checked before every commit and
        every deletion, which narrows the race to the time between that read and the write."""
        self.incarnation = token
        if write:
            storage.write_bytes(storage.join(self.uri, INCARNATION),
                                json.dumps({"token": token, "time": time.time()}).encode())

    def check_owner(self, what: str) -> None:
        """Raise StaleIncarnation unless this start still owns the URI (fails closed: an
        unreadable token means not owned, and the save or deletion waits for the next try)."""
        if self.incarnation is None:
            return
        try:
            owner = json.loads(storage.read_bytes(storage.join(self.uri, INCARNATION)))["token"]
        except Exception as err:  # noqa: BLE001 - the reason goes into the refusal
            raise StaleIncarnation(f"cannot {what}: the owner token under {self.uri} cannot be "
                                   f"read ({storage.explain(err, self.uri)})") from None
        if owner != self.incarnation:
            raise StaleIncarnation(f"cannot {what}: a newer start of this job owns {self.uri} "
                                   f"(token {owner}, ours {self.incarnation})")

    # -- listing and reading ------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps with a commit manifest and no quarantine marker, oldest first."""
        steps = [parse_step(name) for name in storage.list_dirs(self.uri)]
        return sorted(s for s in steps if s is not None
                      and storage.exists(storage.join(self.uri, step_name(s), MANIFEST))
                      and not storage.exists(storage.join(self.uri, step_name(s), QUARANTINE)))

    def read_commit(self, step: int) -> tuple[dict | None, str | None, bool]:
        """(manifest, None, False), or (None, why the commit cannot be read, whether only the key
        is in question: unsigned, or signed with another key than this run holds)."""
        try:
            manifest = json.loads(storage.read_bytes(storage.join(self.uri, step_name(step),
                                                                  MANIFEST)))
        except ValueError as err:
            return None, f"the manifest is not valid JSON ({err})", False
        except Exception as err:  # noqa: BLE001 - any storage error: the reason is kept
            return None, f"the manifest cannot be read ({storage.explain(err, self.uri)})", False
        problem = manifest_problem(manifest, step)
        if problem:
            return None, problem, False
        problem = self._signature_problem(manifest, step)
        if problem:
            sig = manifest.get("signature")
            return None, problem, (sig is None or (isinstance(sig, dict) and sig.get("key_id")
                                                   != key_id(self.key)))
        return manifest, None, False

    def _signature_problem(self, manifest: dict, step: int) -> str | None:
        """With a key: why the manifest is not validly signed with it (the commit is then refused
        like a corrupt one), or None. Without: None, saying once that a signature went unchecked.
        The manifest's checksums cover every file a load reads (`.metadata` before it is
        unpickled), so a valid signature covers their contents too."""
        if self.key is None:
            if manifest.get("signature") is not None and not self._unchecked_noted:
                self._unchecked_noted = True
                sig = manifest["signature"]
                kid = sig.get("key_id") if isinstance(sig, dict) else None
                log.warning("%s/%s is signed (key id %r), but %s is not set: its signature is not "
                            "checked", self.uri, step_name(step), kid, SIGNING_KEY_ENV)
            return None
        problem = signature_problem(manifest, self.key)
        if problem is None:
            log.info("%s/%s: manifest signature verified (key id %s)", self.uri, step_name(step),
                     key_id(self.key))
            return None
        return problem

    # -- tending --------------------------------------------------------------------------------
    def quarantine(self, step: int, problem: str) -> None:
        """Mark a commit that cannot be loaded so no later resume, and no retention count, takes
        it for a checkpoint (the files stay for inspection until retention sweeps them)."""
        marker = json.dumps({"step": step, "reason": problem, "time": time.time()}).encode()
        try:
            storage.write_bytes(storage.join(self.uri, step_name(step), QUARANTINE), marker)
        except Exception as err:  # noqa: BLE001 - the fallback goes on; the log says why
            log.warning("could not mark %s/%s as quarantined: %s", self.uri, step_name(step),
                        storage.explain(err, self.uri))

    def prune(self, newest: int, keep: int, keep_every: int) -> None:
        """Retention after committing `newest`, and the folders of saves that died before their
        manifest, older than it. Housekeeping: a failure is logged and retried next commit."""
        try:
            self.check_owner("prune old checkpoints")
            committed = self.committed_steps()
            for step in retention_plan(committed, keep, keep_every):
                storage.delete_tree(storage.join(self.uri, step_name(step)))
            for name in storage.list_dirs(self.uri):
                s = parse_step(name)
                if s is not None and s < newest and s not in committed:
                    storage.delete_tree(storage.join(self.uri, name))
        except Exception as err:  # noqa: BLE001 - retention is housekeeping: log and go on
            log.warning("checkpoint retention failed (will retry after the next commit): %s",
                        storage.explain(err, self.uri))

    def discard_after(self, step: int) -> None:
        """Delete every checkpoint newer than `step`: after a rollback they belong to an
        abandoned timeline, and a later resume must not pick them up."""
        try:
            self.check_owner(f"discard the checkpoints after step {step}")
            for name in storage.list_dirs(self.uri):
                s = parse_step(name)
                if s is not None and s > step:
                    storage.delete_tree(storage.join(self.uri, name))
        except StaleIncarnation as err:
            log.error("%s", err)
