"""Which missed answers the memory tier takes: every one (``admit = "first"``), or, once the tier
is full, only one whose key was seen before (``admit = "second"``, the default of the exact mode).

A stream of inputs that never repeat (every frame of a moving camera) would otherwise copy each
input into the memory tier (the key holds the input's bytes: 1.2 MB for a 320² float image, a
copy that costs more than the look-up) only to evict it unread, and push out the entries that do
repeat. TinyLFU (Einziger et al., "TinyLFU: A Highly Efficient Cache Admission Policy", 2017)
puts a *doorkeeper* in front of its frequency sketch for this: an item seen once is remembered by
its hash only, and admitted at its second sighting. Ours is that doorkeeper alone:

- ``Doorkeeper``: a direct-mapped table of 64-bit fingerprints (the key's sketch: the xxh3-64 of
  its header and a sample of its bytes, ``device_agents.cache.key``, so a first sighting costs no
  hash of the whole input), ``slots`` of them (64 K: 512 KB). A probe is one index and one compare; a
  fingerprint that lands on an occupied slot replaces it, so the table remembers the latest
  sightings (a key seen again after many others may need a third sighting) and says "seen" of a
  key it was not shown only when their sketches are equal (64 bits compared, not a Bloom filter's
  few): that key is then stored at its first sighting, which costs a copy, never a wrong answer.
- Admission gates only what would evict: while the memory tier has room for an entry, it is
  taken at its first sighting (a fresh agent caches the first answer, so the first repeat hits).

The approximate and semantic modes admit every answer: the requests they answer are near, never
byte-identical, so an exact second sighting would never come.
"""

from __future__ import annotations

from array import array

ADMIT_CHOICES = ("first", "second")
DOORKEEPER_SLOTS = 1 << 16


class Doorkeeper:
    """Fingerprints of keys seen once. Thread-safe enough: a race loses a sighting, nothing else
    (each probe and store is one operation on the table under the GIL)."""

    __slots__ = ("_mask", "_table")

    def __init__(self, slots: int = DOORKEEPER_SLOTS) -> None:
        if slots <= 0 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        self._table = array("Q", bytes(8 * slots))
        self._mask = slots - 1

    def seen_before(self, fingerprint: int) -> bool:
        """True if ``fingerprint`` (a key's 64-bit sketch) was shown since its slot last changed
        hands; it is remembered either way."""
        fingerprint |= 1  # never 0, an empty slot's value
        slot = (fingerprint >> 1) & self._mask
        if self._table[slot] == fingerprint:
            return True
        self._table[slot] = fingerprint
        return False
