"""The protocol's tables: C-ABI offsets, numpy views and C structs from the same table (checked by NVRTC),
regions whose arrays do not overlap; the sampler's Philox and its top-k / top-p rules."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from mdsl.serving.protocol import (CONTROL, LAYOUTS, QUEUE_SLOT, REGION_ALIGN, RING_RECORD, ServingShape,
                                   c_declarations, device_region, host_region)
from mdsl.serving.sampling import allowed_tokens, gumbel_noise, philox4x32, sample

SHAPE = ServingShape(max_batch=5, page_size=4, num_pages=11, max_seq=30)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.name)
def test_layouts_place_fields_as_c_does(layout):
    at = 0
    for f in layout.fields:
        offset = layout.offsets[f.name]
        assert offset % f.align == 0 and offset >= at and offset - at < f.align
        at = offset + f.size
    assert layout.size % layout.align == 0 and layout.size - at < layout.align
    dtype = layout.dtype()
    assert dtype.itemsize == layout.size
    assert {name: dtype.fields[name][1] for name in dtype.names} == layout.offsets


def test_the_documented_places_of_the_sequence_words_and_the_devices_control_line():
    assert QUEUE_SLOT.offsets["seq"] == RING_RECORD.offsets["seq"] == 0
    assert RING_RECORD.size == 32
    assert CONTROL.offsets["queue_taken"] == 128 and CONTROL.offsets["ring_read"] < 128


def _host_compile(source: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("g++") or "g++", "-std=c++17", "-fsyntax-only", "-x", "c++", "-"],
                          input="#include <cstddef>\n" + source, capture_output=True, text=True)


def test_the_c_declarations_compile_with_the_hosts_sizes_and_offsets():
    nvrtc = pytest.importorskip("mdsl.backend.cuda.nvrtc")
    source = c_declarations(SHAPE)
    assert f"static_assert(sizeof(QueueSlot) == {QUEUE_SLOT.size}" in source
    nvrtc.compile_ptx(source)              # what a device includes: its sizes agree with the host's
    if shutil.which("g++") is None:
        pytest.skip("no host C++ compiler to check the offsets with offsetof")
    assert _host_compile(source).returncode == 0
    # the offsets are checked: a wrong one does not compile
    at = RING_RECORD.offsets["token"]
    wrong = source.replace(f"offsetof(RingRecord, token) == {at}", f"offsetof(RingRecord, token) == {at + 4}")
    assert wrong != source and _host_compile(wrong).returncode != 0


@pytest.mark.parametrize("region", [host_region(SHAPE), device_region(SHAPE)], ids=lambda r: r.name)
def test_region_arrays_are_aligned_and_disjoint(region):
    buffer = region.allocate()
    views = region.views(buffer)
    assert all(offset % REGION_ALIGN == 0 for offset in region.offsets.values())
    for k, (name, view) in enumerate(views.items()):
        view.view(np.uint8)[...] = k + 1
    for k, (name, view) in enumerate(views.items()):
        assert np.all(view.view(np.uint8) == k + 1), name
    assert buffer.size == region.size


def test_philox_gives_random123s_known_answers():
    # Random123's kat_vectors for philox4x32 with 10 rounds: counter, key, output
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in cases:
        assert tuple(int(x) for x in philox4x32(counter, key)) == expected


def test_greedy_is_the_first_maximum_and_top_k_1_is_greedy():
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.9], np.float32)
    assert sample(logits, temperature=0.0, top_k=0, top_p=1.0, seed=1, position=0) == 1
    for seed in range(20):
        assert sample(logits, temperature=1.5, top_k=1, top_p=1.0, seed=seed, position=seed) == 1


def test_top_k_and_top_p_allow_what_their_definitions_say():
    rng = np.random.default_rng(0)
    for _ in range(50):
        logits = np.round(rng.standard_normal(12) * 2, 1).astype(np.float32)    # rounding makes ties
        k, p, t = int(rng.integers(0, 13)), float(rng.uniform(0.05, 1.0)), float(rng.uniform(0.3, 2.0))
        ranked = sorted(range(12), key=lambda i: (-logits[i], i))
        kept = ranked[:k] if k else ranked
        probs = np.exp(logits[kept].astype(np.float64) / t)
        probs /= probs.sum()
        last = next(j for j in range(len(kept)) if probs[:j + 1].sum() >= p * (1 - 1e-12))
        expected = sorted(i for i in kept if logits[i] >= logits[kept[last]]) if p < 1 else sorted(kept)
        assert list(allowed_tokens(logits, t, k, p)) == expected


def test_sampling_follows_the_softmax_and_depends_only_on_seed_and_position():
    logits = np.array([1.0, 0.0, -0.5, 2.0, 0.5, -2.0], np.float32)
    draws = [sample(logits, temperature=1.0, top_k=0, top_p=1.0, seed=7, position=pos) for pos in range(6000)]
    freq = np.bincount(draws, minlength=6) / len(draws)
    softmax = np.exp(logits) / np.exp(logits).sum()
    assert np.abs(freq - softmax).max() < 0.02
    again = [sample(logits, temperature=1.0, top_k=0, top_p=1.0, seed=7, position=pos) for pos in range(200)]
    assert again == draws[:200]
    other = [sample(logits, temperature=1.0, top_k=0, top_p=1.0, seed=8, position=pos) for pos in range(200)]
    assert other != draws[:200]
    noise = gumbel_noise(7, 3, 6)
    assert noise.dtype == np.float32 and np.all(np.isfinite(noise))
