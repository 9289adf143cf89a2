"""Optional PII scrubbing: e-mail addresses and public IP addresses replaced by placeholders.

Owns: `ScrubPii`, a formatter. Must not: drop documents (a scrubbed document is still text).

Follows datatrove's `PIIFormatter` (src/datatrove/pipeline/formatters/pii.py), which FineWeb runs
after dedup (examples/fineweb.py): the same e-mail pattern (RFC 5322-like), and IPv4 addresses
replaced only when `ipaddress` calls them global (private, loopback and documentation ranges are
not personal). One difference: datatrove rotates through its placeholders in the order it meets
them, which depends on how documents were sharded; we pick the placeholder from a hash of the
matched value, so a sharded run writes the same bytes as a single one.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import ClassVar

import xxhash

from crucible.trainer.corpus.step import Formatter

_EMAIL = re.compile(
    r"\b[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@"
    r"(?:(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)")
_IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(?:25[0-5]|2[0-4]\d|[01]?\d\d?)\b")
# example.com / example.org are reserved for documentation (RFC 2606).
EMAIL_PLACEHOLDERS = ("email@example.com", "firstname.lastname@example.org")
# Addresses from the TEST-NET documentation ranges (RFC 5737): never anyone's address.
IP_PLACEHOLDERS = ("192.0.2.1", "198.51.100.7", "203.0.113.42")


def _pick(value: str, choices: tuple[str, ...]) -> str:
    return choices[xxhash.xxh3_64_intdigest(value.encode()) % len(choices)]


@dataclass
class ScrubPii(Formatter):
    name: ClassVar[str] = "pii"
    why: ClassVar[str] = "do not teach the model people's e-mail addresses or public IP addresses"
    requires: ClassVar[tuple[str, ...]] = ("xxhash",)

    emails: bool = True
    ips: bool = True
    only_public_ips: bool = True   # datatrove default: private/loopback addresses are not PII

    def _email(self, match: re.Match) -> str:
        self.count("emails_replaced")
        return _pick(match.group(0), EMAIL_PLACEHOLDERS)

    def _ip(self, match: re.Match) -> str:
        found = match.group(0)
        try:
            address = ipaddress.ip_address(found)
        except ValueError:   # e.g. "01.2.3.4": leading zeros make it a version string, not an IP
            return found
        if self.only_public_ips and not address.is_global:
            return found
        self.count("ips_replaced")
        return _pick(found, IP_PLACEHOLDERS)

    def format(self, text: str) -> str:
        if self.emails and "@" in text:
            text = _EMAIL.sub(self._email, text)
        if self.ips:
            text = _IPV4.sub(self._ip, text)
        return text
