"""The prefix cache of the host-scheduled devices (cpu, gpu): full KV pages kept after the requests that
wrote them release them, and mapped into the page table of a later request whose known tokens start with
the same tokens, so that it reads those positions' keys and values instead of computing them again.

A page is named by the chain of the tokens up to its end: key(j) = blake2b(key(j - 1) + tokens of page j),
so one key stands for a whole prefix (a page's keys and values depend on every token before it, and on
its positions, which a prefix shares). Only full pages are named, and a request always computes its last
known token itself (its logits choose its next token), so a page is never written by two requests.

What a request reads from a cached page is what it would have written there: a position's keys and values
depend on that position's tokens and the ones before it alone, never on the step's chunking nor on what
else shared its steps (the serving device's batch and chunk invariance), so a request's tokens and logits
are bit for bit the same with or without the cache.

Pages: each is free (on the pool's stack), or held by the requests whose page tables hold it (`refs`
counts them), or cached and held by none (`evictable`, least recently released first). A request takes a
free page first, else evicts the least recently released cached one.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

_ROOT = b"mdsl prefix"


class PrefixCache:
    """Named pages, their holders' counts and the evictable ones, over a pool of `num_pages` pages."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.refs = np.zeros(num_pages, np.int32)   # requests whose page table holds the page
        self._page_of: dict = {}                    # key -> page
        self._key_of: dict = {}                     # page -> key
        self.evictable: OrderedDict = OrderedDict()   # cached pages no request holds, least recently released first
        # the same as masks over the pages, for the pool check at every step (linear numpy time, however many)
        self._named = np.zeros(num_pages, bool)
        self._idle = np.zeros(num_pages, bool)
        self.hits = 0                               # tokens whose keys and values a request found here

    def keys(self, tokens: np.ndarray, pages: int, known: list) -> list:
        """The keys of the first `pages` full pages of `tokens`, extending `known` (the keys of a prefix of
        them, computed before)."""
        ps = self.page_size
        out = list(known[:pages])
        for j in range(len(out), pages):
            digest = hashlib.blake2b(out[-1] if out else _ROOT, digest_size=16)
            digest.update(np.ascontiguousarray(tokens[j * ps:(j + 1) * ps], np.int32).tobytes())
            out.append(digest.digest())
        return out

    def lookup(self, keys: list) -> list:
        """The cached pages of the longest run of `keys` from the first."""
        found = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            found.append(page)
        return found

    def register(self, key: bytes, page: int) -> None:
        """Name a held full page, unless its key already names another (two requests computed the same
        prefix at once: the later one's page stays its own)."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key
            self._named[page] = True

    def hold(self, page: int) -> None:
        """A request's page table takes `page` (a cached one leaves the evictable pages)."""
        if self.refs[page] == 0:
            self.evictable.pop(page, None)
            self._idle[page] = False
        self.refs[page] += 1

    def release(self, page: int) -> bool:
        """A request's page table lets `page` go; whether it is free now (held by none and not cached: back
        to the pool's stack). A cached page held by none becomes the most recently released evictable."""
        self.refs[page] -= 1
        if self.refs[page]:
            return False
        if page in self._key_of:
            self.evictable[page] = None
            self._idle[page] = True
            return False
        return True

    def evict(self) -> int:
        """The least recently released cached page, forgotten, for a request to take."""
        page, _ = self.evictable.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self._named[page] = self._idle[page] = False
        return page

    def check(self, free: np.ndarray, held: np.ndarray) -> bool:
        """Every page free, held (`held`: every page-table entry, a page as many times as it is held) as
        `refs` counts, or cached and evictable, and never two of these."""
        n = len(self.refs)
        counts = np.bincount(held, minlength=n) if len(held) else np.zeros(n, np.int64)
        if len(counts) != n or not np.array_equal(counts, self.refs):
            return False
        status = (self.refs > 0).astype(np.int64) + self._idle
        status += np.bincount(free, minlength=n)[:n] if len(free) else 0
        return bool(np.all(status == 1) and np.all(self._named[self._idle]) and np.all(self.refs[self._idle] == 0)
                    and np.count_nonzero(self._idle) == len(self.evictable))
