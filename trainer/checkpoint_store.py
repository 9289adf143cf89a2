"""The commits under one checkpoint URI, as rank 0 reads and tends them.

Ownership (the incarnation token: only the newest start of a job commits or prunes), listing,
reading a manifest with its signature checked, quarantine, retention and discarding an abandoned
timeline. No collectives: the `Checkpointer` decides on rank 0 and tells the other ranks.

Retention (`retention_plan`, pure) keeps the newest `keep` commits and every `keepEvery`-th step
(what a spike rollback needs); it never deletes the newest commit, nor any folder that holds a
manifest it cannot verify (perhaps another key's run: not this run's to delete).

With a signing key, what the store acts on must be signed with it: only verified manifests
count as commits (for "newest" and for retention), and the owner token and quarantine markers
are signed when written and ignored, with a warning, when they do not verify. Someone who can
write the bucket but does not hold the key can then neither make the run delete its own commits
(planted newer manifests), nor send it back to an older one (a planted quarantine marker), nor
stop it committing (a planted owner token).
"""

from __future__ import annotations

import json
import logging
import time

from crucible.trainer import storage
from crucible.trainer.checkpoint_manifest import (INCARNATION, MANIFEST, QUARANTINE,
                                                  SIGNING_KEY_ENV, key_id, manifest_problem,
                                                  parse_step, sign, signature_problem, step_name)

log = logging.getLogger(__name__)


class StaleIncarnation(RuntimeError):
    """A newer start of the job owns the checkpoints: this one may neither commit nor prune."""


def retention_plan(committed: list[int], keep: int, keep_every: int) -> list[int]:
    """Committed steps to delete: all but the newest `keep` and, for each multiple of
    `keep_every`, the first commit at or after it (below the next multiple). Usually that is the
    multiple itself; when its save was skipped (the store was slow) or failed, the next commit
    stands in for it, so a long run keeps its milestones for rollbacks whatever the store did."""
    newest = set(sorted(committed)[-keep:]) if keep > 0 else set()
    if committed:
        newest.add(max(committed))  # never the newest commit, whatever keep says
    first_of_span: dict[int, int] = {}
    for s in sorted(committed):
        if keep_every and s >= keep_every:
            first_of_span.setdefault(s // keep_every, s)
    kept_forever = set(first_of_span.values())
    return sorted(s for s in committed if s not in newest | kept_forever)


class CommitStore:
    """The checkpoints under `uri`; `key` is the signing key (None: manifests are not checked)."""

    def __init__(self, uri: str, key: bytes | None):
        self.uri, self.key = uri, key
        # Set by claim(); None for a reader (`crucible eval`), which fences no one.
        self.incarnation: str | None = None
        self.generation = 0      # this start's claim's count (rank 0)
        self._unchecked_noted = False  # "signature not checked" is logged once per process
        # Objects ignored for want of a valid signature, by path: each is logged once.
        self.ignored: dict[str, str] = {}

    # -- signed documents -----------------------------------------------------------------------
    def _doc(self, doc: dict, kind: str) -> bytes:
        """`doc` as written: signed when the store holds a key."""
        return json.dumps(sign(doc, self.key, kind) if self.key is not None else doc).encode()

    def _read_doc(self, uri: str, kind: str) -> dict | None:
        """The JSON document at `uri`; with a key, None when it is not validly signed (ignored
        and reported once, never acted on). Storage errors propagate."""
        data = storage.read_bytes(uri, metadata=True)
        if self.key is None:
            return json.loads(data)
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as err:    # "[[[[..." nests past the parser's limit
            doc, problem = None, f"the {kind} is not valid JSON ({type(err).__name__})"
        else:
            problem = (signature_problem(doc, self.key, kind) if isinstance(doc, dict)
                       else f"the {kind} is not a JSON object")
        if problem is None:
            return doc
        self._ignore(uri, problem)
        return None

    def _ignore(self, uri: str, why: str) -> None:
        """An object not acted on: recorded, and logged the first time only (listings repeat)."""
        if uri not in self.ignored:
            self.ignored[uri] = why
            log.warning("%s ignored: %s (%d object(s) under %s ignored so far)", uri, why,
                        len(self.ignored), self.uri)

    # -- fencing ------------------------------------------------------------------------------
    def claim(self, token: str, *, write: bool) -> None:
        """Make `token` the owner of the URI (`write`: this is rank 0, which records it). An
        older incarnation still running (a pod terminating after its replacement started) then
        finds another token and neither commits nor prunes: checked before every commit and
        every deletion, which narrows the race to the time between that read and the write.
        Each claim counts one more than the one it replaces (`generation`): with a key, an
        older signed token put back later (a replay) is then told apart from a newer start's."""
        self.incarnation = token
        if write:
            self.generation = self._owner_generation() + 1
            self._write_token()

    def _write_token(self) -> None:
        storage.write_bytes(storage.join(self.uri, INCARNATION), self._doc(
            {"token": self.incarnation, "time": time.time(), "generation": self.generation},
            "incarnation"), metadata=True)

    def _owner_generation(self) -> int:
        """The generation of the token under the URI now (0: none, or none this run trusts)."""
        try:
            doc = self._read_doc(storage.join(self.uri, INCARNATION), "incarnation")
        except (ValueError, RecursionError):   # an unreadable token: none this run trusts
            return 0
        except Exception as err:  # noqa: BLE001 - storage errors come in many classes
            if storage.not_found(err):   # no token: the first start
                return 0
            # The store failed: counting from 0 would make an older start still running take
            # this claim for a replay (the caller retries the claim).
            raise
        generation = doc.get("generation") if isinstance(doc, dict) else None
        return generation if isinstance(generation, int) and generation >= 0 else 0

    def check_owner(self, what: str) -> None:
        """Raise StaleIncarnation unless this start still owns the URI (fails closed: an
        unreadable token means not owned, and the save or deletion waits for the next try). With
        a key, a token not signed with it was not written by any start of this job: ignored."""
        if self.incarnation is None:
            return
        uri = storage.join(self.uri, INCARNATION)
        try:
            doc = self._read_doc(uri, "incarnation")
            if doc is None:
                return
            owner, generation = doc["token"], doc.get("generation")
        except Exception as err:  # noqa: BLE001 - the reason goes into the refusal
            raise StaleIncarnation(f"cannot {what}: the owner token under {self.uri} cannot be "
                                   f"read ({storage.explain(err, self.uri)})") from None
        if (self.key is not None and owner != self.incarnation and isinstance(generation, int)
                and generation < self.generation):
            # Signed, but older than our own claim: put back by someone replaying it. Ours is
            # written again, so that the older start it names (if it still runs) stays fenced.
            log.warning("%s: an older owner token (generation %d, ours %d) was put back; "
                        "writing ours again", uri, generation, self.generation)
            self._write_token()
            return
        if owner != self.incarnation:
            raise StaleIncarnation(f"cannot {what}: a newer start of this job owns {self.uri} "
                                   f"(token {owner}, ours {self.incarnation})")

    # -- listing and reading ------------------------------------------------------------------
    def manifest_steps(self) -> list[int]:
        """Steps with a commit manifest and no quarantine marker (with a key: no validly signed
        one), oldest first: what a load tries, verifying each."""
        steps = [parse_step(name) for name in storage.list_dirs(self.uri, metadata=True)]
        return sorted(s for s in steps if s is not None
                      and storage.exists(storage.join(self.uri, step_name(s), MANIFEST),
                                         metadata=True)
                      and not self._quarantined(s))

    def committed_steps(self) -> list[int]:
        """The commits this run may act on (the newest, retention), oldest first: every
        manifest step without a key, only those whose manifest verifies with one."""
        steps = self.manifest_steps()
        return steps if self.key is None else [s for s in steps if self._verified(s)]

    def _quarantined(self, step: int) -> bool:
        """Without a key, a marker's presence quarantines. With one, only a marker signed with
        it, for this very step (a signed marker copied to another folder is a replay); anything
        else is ignored, whatever makes it unreadable."""
        marker = storage.join(self.uri, step_name(step), QUARANTINE)
        if not storage.exists(marker, metadata=True):
            return False
        if self.key is None:
            return True
        try:
            doc = self._read_doc(marker, "quarantine")
        except Exception as err:  # noqa: BLE001 - a directory, an unreadable object: ignored
            self._ignore(marker, f"it cannot be read ({storage.explain(err, marker)})")
            return False
        if doc is not None and doc.get("step") != step:
            self._ignore(marker, f"it is a signed marker of step {doc.get('step')!r}, copied here")
            return False
        return doc is not None

    def _ours(self, step: int) -> bool:
        """Whether this run may delete the step's folder. With a key, not one whose manifest
        it cannot verify and that it did not quarantine (perhaps a run under another key wrote
        it, perhaps it was planted: either way not acted on); any other folder is a commit, an
        abandoned save or a quarantined commit of this job's."""
        if self.key is None or not storage.exists(storage.join(self.uri, step_name(step),
                                                               MANIFEST)):
            return True
        return self._verified(step) or self._quarantined(step)

    def _verified(self, step: int) -> bool:
        """The step's manifest is well-formed and validly signed with the key (quietly: the
        load reports what is wrong with a commit it tries)."""
        try:
            manifest = json.loads(storage.read_bytes(
                storage.join(self.uri, step_name(step), MANIFEST), metadata=True))
        except (ValueError, RecursionError):   # not JSON: not verifiable
            return False
        except Exception as err:  # noqa: BLE001 - storage errors come in many classes
            if storage.not_found(err):
                return False
            # The store failed, not the manifest: a commit left out of the list for a timeout
            # would be pruned as an abandoned save. The caller retries, or skips this pass.
            raise
        return (manifest_problem(manifest, step) is None
                and signature_problem(manifest, self.key) is None)

    def read_commit(self, step: int) -> tuple[dict | None, str | None, bool]:
        """(manifest, None, False), or (None, why the commit cannot be read, whether only the key
        is in question: unsigned, or signed with another key than this run holds). A storage
        error other than "not there" is raised: it says nothing about the commit."""
        try:
            manifest = json.loads(storage.read_bytes(
                storage.join(self.uri, step_name(step), MANIFEST), metadata=True))
        except (ValueError, RecursionError) as err:
            # With a key, nothing unsigned is judged: skipped as the key's question.
            return None, f"the manifest is not valid JSON ({err})", self.key is not None
        except Exception as err:  # noqa: BLE001 - storage errors come in many classes
            if not storage.not_found(err):
                # The store failed, not the commit (a timeout, a 503, a store restarting): the
                # caller retries or stops; quarantining a good commit for it would lose it.
                raise
            return None, f"the manifest cannot be read ({storage.explain(err, self.uri)})", False
        if self.key is not None:
            # The signature first: a malformed manifest that is not validly signed was not
            # written by a start holding the key, so it is skipped, never quarantined (the
            # quarantine marker the run would write is signed, and could be replayed).
            if not isinstance(manifest, dict):
                return None, f"the manifest is a {type(manifest).__name__}, not signed", True
            problem = self._signature_problem(manifest, step)
            if problem:
                sig = manifest.get("signature")
                return None, problem, (sig is None or not isinstance(sig, dict)
                                       or sig.get("key_id") != key_id(self.key))
        problem = manifest_problem(manifest, step)
        if problem:
            return None, problem, False
        if self.key is None:
            self._signature_problem(manifest, step)   # says once that it went unchecked
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
        marker = self._doc({"step": step, "reason": problem, "time": time.time()}, "quarantine")
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
            # Folders of saves that died before their manifest, and quarantined commits.
            for name in storage.list_dirs(self.uri):
                s = parse_step(name)
                if s is not None and s < newest and s not in committed and self._ours(s):
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
                if s is not None and s > step and self._ours(s):
                    storage.delete_tree(storage.join(self.uri, name))
        except StaleIncarnation as err:
            log.error("%s", err)
