#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpus: corpus/attention/ and corpus/parse/, one file a seed.

The attention seeds cover the valid layouts (MHA, GQA, MQA, decode with split-KV, causal with
rows that see no key, padded, head-major, broadcast and shared buffers, every call and
kernel, merge, attention sinks and ragged batches) and each rule that rejects a problem or a
call; the parse seeds the accepted and rejected values of every parser. The byte format is
the one attention_fuzz.cpp and parse_fuzz.cpp document. Usage (from anywhere; rewrites both
folders):

    /usr/bin/python3 property_tests/fuzz/make_corpus.py
"""
import pathlib
import shutil
import struct

HERE = pathlib.Path(__file__).resolve().parent
INT64_MAX = 2**63 - 1

# attention_fuzz.cpp's kSpecial table of field(): the values worth naming here.
SPECIAL = {0: 0, INT64_MAX: 1, INT64_MAX // 4: 5, INT64_MAX // 4 + 1: 6}


def field(v):
    """An int64 field as field() decodes it."""
    if 0 <= v < 0x80:
        return bytes([v])
    if 0 <= v < 8192:
        return bytes([0x80 | (v >> 8), v & 0xFF])
    if v in SPECIAL:
        return bytes([0xA0 | SPECIAL[v]])
    if -32 <= v <= -1:
        return bytes([0xC0 | (-1 - v)])
    return bytes([0xE0]) + struct.pack("<q", v)


# Strides: strides()'s modes.
TOKEN, HEAD = bytes([0]), bytes([1])
BROADCAST, ZERO = bytes([4]), bytes([6])


def padded_token(head, seq, batch):
    return bytes([2, head, seq, batch])


def padded_head(seq, head, batch):
    return bytes([3, seq, head, batch])


def any_strides(batch, seq, head):
    return bytes([5]) + field(batch) + field(seq) + field(head)


def one_stride(which, value):  # token-major with stride `which` (0 batch, 1 seq, 2 head) set
    return bytes([7, which]) + field(value)


# lse strides: lse_strides()'s modes.
LSE_DENSE, LSE_HEAD_OUTER = bytes([0]), bytes([1])


def lse_padded(head, batch):
    return bytes([2, head, batch])


def lse_any(batch, head):
    return bytes([3]) + field(batch) + field(head)


# Scale: scale()'s modes.
SCALE_DEFAULT = bytes([0])


def scale_bits(f):
    return bytes([1]) + struct.pack("<f", f)


def scale_special(i):  # 0: 0, 2: inf, 4: NaN, 6: the smallest subnormal, 10: 1e30
    return bytes([2, i])


def scale_sixteenths(n):
    return bytes([3, n & 0xFF])


def problem(b, lq, lk, h, hkv, d, causal=False, scale=SCALE_DEFAULT, q=TOKEN, k=TOKEN, v=TOKEN,
            o=TOKEN, lse=LSE_DENSE):
    return (b"".join(field(x) for x in (b, lq, lk, h, hkv, d)) + bytes([int(causal)]) + scale +
            q + k + v + o + lse)


# Fake addresses: fake_addresses()'s modes, five of them (q, k, v, o, lse).
NULL, OWN = bytes([0]), bytes([1])


def at(other, offset):  # `offset` floats from tensor `other`'s address
    return bytes([2, other]) + field(offset)


def own_plus(n):
    return bytes([3, n])


OWN_ALL = OWN * 5

# Memory: run_calls()'s byte. Bits 0-1 inputs (0 separate, 1 k == v, 2 q == k == v), bits
# 2-4 outputs (4 o inside q, 5 o inside v, 6 lse inside o, 7 a null pointer), bit 5 lse null.
SEPARATE, SHARED_KV, SHARED_QKV = 0, 1, 2
O_IN_Q, O_IN_V, LSE_IN_O, NULL_POINTER = 4 << 2, 5 << 2, 6 << 2, 7 << 2
NO_LSE = 0x20


def memory(bits, *extra):
    return bytes([bits, *extra])


# Values: Values' mode (0 uniform, 1 times 2^e, 2 with NaN/Inf/specials, 3 few values), e, seed.
def values(mode=0, exponent=0, seed=1):
    return bytes([mode, exponent & 0xFF]) + struct.pack("<Q", seed)


# Calls: bit 0 mha::attention, 1 by name, 2 the driver, 3 the kernel alone, 4 threads 1 vs 2,
# 5 merge, 6 bits 1-3 for every kernel. Kernel: an index into all_kernels() (x86-64: naive, blocked, xsimd-avx2,
# xsimd-avx512, highway-sse4, highway-avx2, highway-avx3, highway-avx3-dl, avx2, avx512).
# Threads byte: bit 0 two threads, bits 1-4 the workspace offset in floats.
def calls(bits, kernel=0, threads=0):
    return bytes([bits, kernel, threads])


ALL_CALLS = 1 | 2 | 4 | 8 | 16
EVERY_KERNEL = 2 | 4 | 8 | 64


# Merge: count byte (0: 0, 1: -1, 2: INT_MIN, 3-6: 1-4 parts), the parts' o strides and lse
# strides, flags (1 in place, 2 lse null, 4 a null part, 8 null arrays, 16 the null part is
# an o), and the null part's index.
def merge(count_byte, o=TOKEN, lse=LSE_DENSE, flags=0, null_part=None):
    return bytes([count_byte]) + o + lse + bytes([flags] + ([] if null_part is None else [null_part]))


# The sections run_calls reads, all zeros: for seeds whose problem is rejected (or only
# checked) but that need the sections after them. Memory, values and calls bytes.
NO_RUN = bytes(1 + 10 + 3)

# The last sections (read_extras()): sinks, lengths, then where check_call finds those arrays.
# A sink is a sink_value(): (s - 64) / 4 for a byte s < 0x80, a named special, or any float.
SINK_SPECIAL = {"-inf": 0, "inf": 1, "nan": 2, "-nan": 3, "max": 4, "-max": 5, "1e30": 6,
                "-1e30": 7, "88.8": 8, "-88.8": 9, "-150": 12, "denorm": 15, "1e38": 27}


def sink(x):
    if isinstance(x, str):
        return bytes([0x80 | SINK_SPECIAL[x]])
    if float(x * 4).is_integer() and -16 <= x < 16:
        return bytes([int(x * 4) + 64])
    return bytes([0xA0]) + struct.pack("<f", x)


NO_SINKS = bytes([0])


def sinks_all(x):  # every head x
    return bytes([1]) + sink(x)


def sinks_each(*xs):  # one per head
    return bytes([2]) + b"".join(sink(x) for x in xs)


def sinks_but(x, head, y):  # every head x but `head`, y
    return bytes([3]) + sink(x) + field(head) + sink(y)


# One length array: read_length_array()'s modes.
def lens_each(*v):
    return bytes([0]) + b"".join(field(x) for x in v)


def lens_short_by(*v):  # the tensors' length minus each
    return bytes([1]) + b"".join(field(x) for x in v)


def lens_full_but(b, x):  # every sequence whole but sequence b, x
    return bytes([2]) + field(b) + field(x)


def lens_spread(step, start):  # (b step + start) mod (length + 1)
    return bytes([3]) + field(step) + field(start)


def lengths(q=None, kv=None):
    return bytes([int(q is not None) | 2 * int(kv is not None)]) + (q or b"") + (kv or b"")


NO_LENGTHS = bytes([0])
O, LSE = 1, 2  # outputs for fake_at
SINKS, Q_LENS, KV_LENS, ALIBI = 0, 1, 2, 3  # arrays


def fake_at(output, array, offset):  # a fake o or lse `offset` floats from the array's start
    return bytes([output | array << 2]) + field(offset)


def placed(array, in_lse=False, offset=0):  # the array copied inside the real o's (lse's) buffer
    return bytes([(array + 1) | 4 * int(in_lse), offset])


NO_WINDOW = bytes([0])


def window(w):  # read_window()'s mode 1: the window itself
    return bytes([1]) + field(w)


def window_short_by(n):  # mode 2: kv_len - n
    return bytes([2]) + field(n)


NO_SOFTCAP = bytes([0])


def softcap(c):  # read_softcap()'s mode 1: the float itself (NaN, negative, +inf included)
    return bytes([1]) + struct.pack("<f", c)


NO_ALIBI = b""  # read_alibi() past the input's end: mode 0, none


def alibi_byte(b):  # alibi_slope()'s byte: below 0x80 2^(b / 8 - 12), else a special
    return bytes([b])


def alibi_all(slope, offset=0):  # read_alibi()'s mode 1: one slope byte for every head
    return bytes([1]) + slope + field(offset)


def alibi_each(*slopes, offset=0):  # mode 2: a slope byte per head
    return bytes([2]) + b"".join(slopes) + field(offset)


def alibi_geometric(offset=0):  # mode 3: 2^(-8 (h + 1) / heads)
    return bytes([3]) + field(offset)


def alibi_float(x, offset=0):  # mode 1 with any float (4 bytes) for every head
    return bytes([1, 0xa0]) + struct.pack("<f", x) + field(offset)


def extras(sinks=NO_SINKS, lens=NO_LENGTHS, fake=bytes([0]), place=bytes([0]), win=NO_WINDOW,
           cap=NO_SOFTCAP, alibi=NO_ALIBI):
    return sinks + lens + fake + place + win + cap + alibi


def attention_seeds():
    s = {}
    run = OWN_ALL + memory(SEPARATE)
    # Valid layouts, every call.
    s["mha"] = problem(1, 5, 5, 2, 2, 8) + run + values() + calls(ALL_CALLS, 9, 1)
    s["gqa-causal-prefill"] = (problem(2, 17, 17, 4, 2, 16, causal=True) + run + values(seed=2) +
                               calls(ALL_CALLS, 8, 3))
    s["mqa"] = problem(1, 9, 9, 8, 1, 33) + run + values(seed=3) + calls(ALL_CALLS, 1)
    s["decode-split-kv"] = (problem(1, 1, 600, 4, 1, 16, causal=True, k=HEAD, v=HEAD) + run +
                            values(seed=4) + calls(ALL_CALLS, 9, 1))
    s["decode-mha-long"] = (problem(1, 1, 1000, 8, 8, 32, k=HEAD, v=HEAD) + run + values(seed=5) +
                            calls(1 | 4 | 16, 8, 1))
    s["decode-gqa-rows"] = (problem(2, 3, 700, 4, 2, 20, causal=True, k=HEAD, v=HEAD) + run +
                            values(seed=6) + calls(ALL_CALLS, 0, 1))
    s["causal-rows-see-nothing"] = (problem(1, 7, 3, 2, 1, 5, causal=True) + run + values(seed=7) +
                                    calls(ALL_CALLS, 9))
    s["head-major-padded"] = (problem(2, 6, 11, 3, 3, 17, causal=True, q=HEAD,
                                      k=padded_head(3, 5, 7), v=padded_token(1, 2, 3),
                                      o=padded_token(4, 0, 9), lse=lse_padded(3, 1)) + run +
                              values(seed=8) + calls(ALL_CALLS, 1))
    s["lse-heads-outer"] = (problem(3, 4, 4, 2, 2, 3, o=HEAD, lse=LSE_HEAD_OUTER) + run +
                            values(seed=9) + calls(ALL_CALLS, 2))
    s["broadcast-batch"] = (problem(3, 4, 9, 4, 2, 12, k=BROADCAST, v=BROADCAST) + run +
                            values(seed=10) + calls(ALL_CALLS, 3))
    s["one-key-row"] = (problem(2, 1, 5, 2, 1, 7, k=one_stride(1, 0)) + run + values(seed=11) +
                        calls(ALL_CALLS, 4))
    s["shared-kv"] = (problem(1, 8, 8, 4, 4, 16) + OWN_ALL + memory(SHARED_KV) + values(seed=12) +
                      calls(ALL_CALLS, 5))
    s["fused-qkv"] = (problem(1, 8, 8, 2, 2, 16, q=padded_token(0, 64, 0), k=padded_token(0, 64, 0),
                              v=padded_token(0, 64, 0)) + OWN_ALL + memory(SHARED_QKV) +
                      values(seed=13) + calls(ALL_CALLS, 6))
    s["no-lse"] = (problem(1, 20, 20, 2, 1, 9, causal=True) + OWN_ALL + memory(NO_LSE) +
                   values(seed=14) + calls(ALL_CALLS, 7))
    s["d-129-tails"] = (problem(1, 33, 60, 2, 2, 129, causal=True) + run + values(seed=15) +
                        calls(ALL_CALLS, 9, 7))
    # The stride of an axis with one index (one batch, head, key or query) addresses nothing,
    # so check() admits any value: every kernel, decoding and tiled (regressions: kernels
    # formed pointers one row past the last, whose offsets overflowed).
    for name, lq in (("decode", 1), ("tiled", 40)):
        huge = INT64_MAX
        q_strides = any_strides(huge, huge if lq == 1 else 16, huge)
        s[f"unused-strides-huge-{name}"] = (
            problem(1, lq, 1, 1, 1, 16, q=q_strides, k=any_strides(huge, huge, huge),
                    v=any_strides(huge, huge, huge), o=q_strides, lse=lse_any(huge, huge)) +
            run + values(seed=23) + calls(1 | EVERY_KERNEL, 0, 1))
    # Values: large logits, NaN/Inf, subnormal V (outside the tolerance model), few values.
    s["large-logits"] = (problem(1, 6, 40, 2, 2, 8, scale=scale_sixteenths(-8)) + run +
                         values(1, 6, seed=16) + calls(ALL_CALLS, 9))
    s["nan-inf"] = (problem(1, 5, 30, 2, 1, 8, causal=True) + run + values(2, seed=17) +
                    calls(ALL_CALLS, 1))
    s["tiny-values"] = (problem(1, 4, 6, 1, 1, 4) + run + values(1, -120, seed=18) +
                        calls(ALL_CALLS, 9))
    s["equal-keys"] = (problem(1, 12, 12, 2, 2, 6, causal=True) + run + values(3, seed=19) +
                       calls(ALL_CALLS, 8))
    s["subnormal-scale"] = (problem(1, 3, 5, 1, 1, 2, scale=scale_special(6)) + run +
                            values(seed=20) + calls(1 | 8, 0))
    # Merge: parts from the bytes, in place, without lse, and its rejections.
    merged = problem(2, 3, 8, 2, 1, 5) + run + values(2, seed=21) + calls(1 | 32, 0)
    s["merge-2-parts"] = merged + merge(4)
    s["merge-4-parts-padded-in-place"] = (problem(1, 4, 4, 3, 3, 6) + run + values(seed=22) +
                                          calls(1 | 32, 0) + merge(6, flags=1))
    s["merge-3-parts-other-strides"] = (merged + merge(5, padded_head(1, 2, 3), lse_padded(2, 0),
                                                       2))
    s["merge-count-0"] = merged + merge(0)
    s["merge-null-arrays"] = merged + merge(3, flags=8)
    s["merge-null-part-lse"] = merged + merge(5, flags=4, null_part=1)
    s["merge-null-part-o"] = merged + merge(5, flags=4 | 16, null_part=2)
    # Regressions: merge read outside parts whose strides are negative or overflow.
    s["merge-parts-stride-negative"] = merged + merge(4, any_strides(-8, 10, 5))
    s["merge-parts-lse-overflow"] = merged + merge(4, TOKEN, lse_any(INT64_MAX, 2))
    s["merge-parts-found-by-fuzzing"] = bytes.fromhex(
        "021111181818181804021001000000000001010101000000020000000000000026"
        "08bdbdbdbdbdda03")

    # Attention sinks: finite, -inf (none, for that head), huge; rows that see no key (lse is
    # the sink), split-KV (the chunks without the sink, merged with it once), NaN/Inf inputs.
    s["sinks-mha"] = (problem(1, 5, 5, 2, 2, 8) + run + values(seed=40) + calls(ALL_CALLS, 9, 1) +
                      extras(sinks_each(1.5, -2.25)))
    s["sinks-causal-rows-see-nothing"] = (
        problem(2, 7, 3, 4, 2, 5, causal=True) + run + values(seed=41) + calls(ALL_CALLS, 8) +
        extras(sinks_each(0.5, "-inf", -3, 10)))
    s["sinks-decode-split-kv"] = (
        problem(1, 1, 600, 4, 1, 16, causal=True, k=HEAD, v=HEAD) + run + values(seed=42) +
        calls(ALL_CALLS, 9, 1) + extras(sinks_each(2, -1, 0, 5.75)))
    s["sinks-huge"] = (problem(1, 4, 9, 3, 3, 8) + run + values(seed=43) + calls(ALL_CALLS, 1) +
                       extras(sinks_each("max", "1e30", "-1e30")))
    s["sinks-nan-inf-inputs"] = (problem(1, 5, 30, 2, 1, 8, causal=True) + run +
                                 values(2, seed=44) + calls(ALL_CALLS, 1) + extras(sinks_all(3)))
    # Ragged batches: empty sequences (no query, no key), whole ones, each array alone, with
    # padded layouts, broadcast and shared KV, and a split-KV decode cut per sequence.
    s["ragged-causal"] = (
        problem(3, 6, 9, 2, 1, 8, causal=True) + run + values(seed=45) + calls(ALL_CALLS, 9, 1) +
        extras(lens=lengths(lens_each(6, 0, 2), lens_each(9, 4, 0))))
    s["ragged-sinks-padded"] = (
        problem(2, 5, 7, 2, 2, 6, causal=True, q=HEAD, k=padded_head(3, 5, 7),
                o=padded_token(4, 0, 9), lse=lse_padded(3, 1)) + run + values(seed=46) +
        calls(ALL_CALLS, 1) + extras(sinks_each(1, -0.5), lengths(lens_each(3, 5),
                                                                  lens_each(7, 0))))
    s["ragged-q-only-broadcast"] = (
        problem(3, 4, 9, 4, 2, 12, k=BROADCAST, v=BROADCAST) + run + values(seed=47) +
        calls(ALL_CALLS, 3) + extras(lens=lengths(q=lens_short_by(0, 1, 3))))
    s["ragged-kv-only-decode-split-kv"] = (
        problem(3, 1, 700, 4, 2, 16, causal=True, k=HEAD, v=HEAD) + run + values(seed=48) +
        calls(ALL_CALLS, 9, 1) + extras(sinks_all(0.25), lengths(kv=lens_each(700, 300, 512))))
    s["ragged-spread-shared-kv"] = (
        problem(4, 8, 8, 4, 4, 16) + OWN_ALL + memory(SHARED_KV) + values(seed=49) +
        calls(ALL_CALLS, 5) + extras(lens=lengths(lens_spread(3, 1), lens_spread(5, 2))))
    # Every kernel alone, by name and through the driver, on sinks and ragged lengths together:
    # rows that see no key inside a sequence, a sequence without keys, one without queries.
    s["ragged-sinks-every-kernel"] = (
        problem(3, 5, 9, 4, 2, 8, causal=True) + run + values(seed=53) +
        calls(1 | EVERY_KERNEL, 0, 1) + extras(sinks_each(1, "-inf", -2, 0.5),
                                               lengths(lens_each(5, 2, 0), lens_each(9, 1, 4))))
    s["ragged-sinks-decode-every-kernel"] = (
        problem(2, 1, 40, 8, 2, 16, causal=True, k=HEAD, v=HEAD) + run + values(seed=54) +
        calls(1 | EVERY_KERNEL, 0, 1) + extras(sinks_but(-1.25, 5, 7.5),
                                               lengths(kv=lens_each(40, 13))))
    # Merge with sinks (each counted once; rows no part saw get lse = the sink) and with
    # q_lens (only each sequence's rows).
    s["merge-sinks"] = (problem(2, 3, 8, 2, 1, 5) + run + values(2, seed=52) + calls(1 | 32, 0) +
                        merge(4) + extras(sinks_each(0.75, "-inf")))
    s["merge-sinks-ragged-in-place"] = (
        problem(2, 4, 4, 3, 3, 6) + run + values(seed=51) + calls(1 | 32, 0) + merge(6, flags=1) +
        extras(sinks_each(-1, 2, 12), lengths(lens_each(2, 4))))

    # Sliding windows: of one key, crossing KV tiles (prefill, and a split decode's chunks), as
    # long as the keys (no window), huge, with sinks and ragged lengths, every kernel.
    s["window-one-key"] = (problem(1, 6, 6, 2, 2, 8, causal=True) + run + values(seed=60) +
                           calls(ALL_CALLS, 9, 1) + extras(win=window(1)))
    s["window-prefill-tiles"] = (problem(1, 140, 300, 1, 1, 8, causal=True) + run +
                                 values(seed=61) + calls(ALL_CALLS, 1) + extras(win=window(129)))
    s["window-decode-split-kv"] = (problem(1, 1, 1500, 4, 1, 8) + run + values(seed=62) +
                                   calls(ALL_CALLS, 9, 1) + extras(win=window(600)))
    s["window-all-keys"] = (problem(1, 5, 9, 2, 2, 4, causal=True) + run + values(seed=63) +
                            calls(ALL_CALLS, 1) + extras(win=window_short_by(0)))
    s["window-huge"] = (problem(2, 3, 7, 2, 1, 4) + run + values(seed=64) + calls(ALL_CALLS, 1) +
                        extras(win=window(INT64_MAX)))
    s["window-sinks-ragged-every-kernel"] = (
        problem(3, 9, 40, 4, 2, 8, causal=True) + run + values(seed=65) +
        calls(1 | EVERY_KERNEL, 0, 1) + extras(sinks_each(1, "-inf", -2, 0.5),
                                               lengths(lens_each(9, 2, 0), lens_each(40, 5, 31)),
                                               win=window(7)))
    s["window-nan-inf-inputs"] = (problem(1, 5, 30, 2, 1, 8, causal=True) + run +
                                  values(2, seed=66) + calls(ALL_CALLS, 1) + extras(win=window(4)))

    # Soft-capping: prefill and a split decode with caps that matter, logits far past the cap
    # (2^6 values: every logit saturates), NaN and Inf inputs, with sinks and a window, and the
    # caps check() rejects (NaN, negative, below 2^-126, above 2^120) or takes as none (+inf).
    s["softcap-prefill"] = (problem(1, 40, 40, 4, 2, 16, causal=True) + run + values(seed=70) +
                            calls(ALL_CALLS, 9, 1) + extras(cap=softcap(0.5)))
    s["softcap-decode-split-kv"] = (problem(1, 1, 1500, 4, 1, 8, k=HEAD, v=HEAD) + run +
                                    values(seed=71) + calls(ALL_CALLS, 9, 1) +
                                    extras(cap=softcap(2.0)))
    s["softcap-saturated"] = (problem(2, 9, 30, 2, 1, 8, causal=True) + run +
                              values(1, 6, seed=72) + calls(ALL_CALLS, 1) +
                              extras(cap=softcap(3.0)))
    s["softcap-nan-inf-inputs"] = (problem(1, 5, 30, 2, 1, 8, causal=True) + run +
                                   values(2, seed=73) + calls(ALL_CALLS, 1) +
                                   extras(cap=softcap(1.0)))
    s["softcap-sinks-window-every-kernel"] = (
        problem(1, 12, 50, 4, 2, 8, causal=True) + run + values(seed=74) +
        calls(1 | EVERY_KERNEL, 0, 1) + extras(sinks_each(1, "-inf", -2, 0.5), win=window(9),
                                               cap=softcap(0.75)))
    for name, c in [("nan", float("nan")), ("negative", -1.0), ("tiny", 2.0**-127),
                    ("huge", 2.0**121), ("inf", float("inf"))]:
        s[f"softcap-{name}"] = (problem(1, 3, 5, 2, 1, 4) + run + values(seed=75) +
                                calls(ALL_CALLS, 1) + extras(cap=softcap(c)))

    # ALiBi: geometric slopes on a causal prefill (bottom-right positions, q_len < kv_len), a
    # non-causal problem with an offset (distances both ways), a split decode (the driver's
    # chunks keep the whole's distances), a ragged batch, a wall (2^3.9 per key: far keys weigh
    # nothing), with a soft-cap, sinks and a window, NaN and Inf inputs, all-zero slopes; and
    # the slopes and offsets check() rejects.
    s["alibi-prefill"] = (problem(1, 24, 40, 4, 2, 16, causal=True) + run + values(seed=80) +
                          calls(ALL_CALLS, 9, 1) + extras(alibi=alibi_geometric()))
    s["alibi-offset-not-causal"] = (problem(1, 9, 30, 2, 1, 8) + run + values(seed=81) +
                                    calls(ALL_CALLS, 9, 1) +
                                    extras(alibi=alibi_each(alibi_byte(70), alibi_byte(90),
                                                            offset=-12)))
    s["alibi-decode-split-kv"] = (problem(1, 1, 1500, 4, 1, 8, k=HEAD, v=HEAD) + run +
                                  values(seed=82) + calls(ALL_CALLS, 9, 1) +
                                  extras(alibi=alibi_geometric()))
    s["alibi-ragged"] = (problem(3, 5, 9, 4, 2, 8, causal=True) + run + values(seed=83) +
                         calls(1 | EVERY_KERNEL, 0, 1) +
                         extras(lens=lengths(lens_each(5, 2, 0), lens_each(9, 1, 4)),
                                alibi=alibi_geometric(offset=3)))
    s["alibi-wall"] = (problem(1, 20, 20, 2, 2, 8, causal=True) + run + values(seed=84) +
                       calls(ALL_CALLS, 1) + extras(alibi=alibi_all(alibi_byte(0x7f))))
    s["alibi-softcap-sinks-window-every-kernel"] = (
        problem(1, 12, 50, 4, 2, 8, causal=True) + run + values(seed=85) +
        calls(1 | EVERY_KERNEL, 0, 1) + extras(sinks_each(1, "-inf", -2, 0.5), win=window(9),
                                               cap=softcap(0.75), alibi=alibi_geometric()))
    s["alibi-nan-inf-inputs"] = (problem(1, 5, 30, 2, 1, 8, causal=True) + run +
                                 values(2, seed=86) + calls(ALL_CALLS, 1) +
                                 extras(alibi=alibi_geometric()))
    s["alibi-zeros"] = (problem(1, 6, 9, 2, 1, 8, causal=True) + run + values(seed=87) +
                        calls(ALL_CALLS, 1) + extras(alibi=alibi_all(alibi_byte(0x80), offset=5)))
    for name, x in [("nan", float("nan")), ("negative", -2.0**-149), ("huge", 2.0**32 + 512),
                    ("inf", float("inf"))]:
        s[f"reject-alibi-{name}"] = (problem(1, 3, 5, 2, 1, 4) + run + values(seed=88) +
                                     calls(ALL_CALLS, 1) + extras(alibi=alibi_float(x)))
    s["reject-alibi-offset-huge"] = (problem(1, 3, 5, 2, 1, 4) + run + values(seed=88) +
                                     calls(ALL_CALLS, 1) +
                                     extras(alibi=alibi_geometric(offset=2**62 + 1)))

    # check() rejections, one rule each.
    small = dict(b=1, lq=2, lk=3, h=2, hkv=1, d=4)

    def bad(**changes):
        a = dict(small)
        a.update(changes)
        return problem(**a) + OWN_ALL

    s["reject-batch-0"] = bad(b=0)
    s["reject-q-len-negative"] = bad(lq=-1)
    s["reject-head-dim-huge-negative"] = bad(d=-(2**62))
    s["reject-heads-not-multiple"] = bad(h=6, hkv=4)
    s["reject-scale-0"] = bad(scale=scale_special(0))
    s["reject-scale-nan"] = bad(scale=scale_bits(float("nan")))
    s["reject-q-stride-negative"] = bad(q=any_strides(-1, 8, 4))
    s["reject-k-offset-overflow"] = bad(k=one_stride(1, INT64_MAX // 4))
    s["reject-o-offset-overflow"] = bad(lq=3, o=any_strides(0, INT64_MAX // 4 + 1, 4))
    s["reject-o-overlaps-itself"] = bad(o=ZERO)
    s["reject-o-interleaved"] = bad(o=any_strides(16, 8, 2))
    s["reject-lse-stride-negative"] = bad(lse=lse_any(-5, 2))
    s["reject-lse-overflow"] = bad(b=2, lse=lse_any(INT64_MAX, 2))
    s["reject-lse-overlaps-itself"] = bad(lse=lse_any(4, 0))
    # The sinks and lengths, and the order of their rules: after the others but lse's.
    s["reject-sinks-nan"] = bad() + NO_RUN + extras(sinks_each(1, "nan"))
    s["reject-sinks-minus-nan"] = bad() + NO_RUN + extras(sinks_each("-nan", "inf"))
    s["reject-sinks-inf"] = bad(h=4) + NO_RUN + extras(sinks_but(0.5, 2, "inf"))
    s["reject-q-lens-negative"] = bad(b=2) + NO_RUN + extras(lens=lengths(q=lens_each(2, -1)))
    s["reject-kv-lens-past"] = bad(b=2) + NO_RUN + extras(lens=lengths(kv=lens_each(3, 4)))
    s["reject-kv-lens-huge"] = bad(b=3) + NO_RUN + extras(
        lens=lengths(kv=lens_full_but(1, INT64_MAX)))
    s["reject-q-lens-before-kv-lens"] = bad(b=2) + NO_RUN + extras(
        lens=lengths(lens_each(1, 3), lens_each(-1, 0)))
    s["reject-sinks-before-lens"] = bad(b=2) + NO_RUN + extras(
        sinks_each(0, "nan"), lengths(lens_each(5, 5)))
    s["reject-lens-before-lse"] = bad(b=2, lse=lse_any(-5, 2)) + NO_RUN + extras(
        lens=lengths(kv=lens_short_by(0, -1)))
    s["reject-scale-before-sinks"] = bad(scale=scale_special(4)) + NO_RUN + extras(
        sinks_all("nan"))
    s["reject-window-negative"] = bad() + NO_RUN + extras(win=window(-1))
    s["reject-window-huge-negative"] = bad() + NO_RUN + extras(win=window_short_by(INT64_MAX))
    s["reject-window-before-sinks"] = bad() + NO_RUN + extras(sinks_all("nan"), win=window(-3))
    # check_call on fake addresses, and on real buffers: nulls and overlaps.
    ok = problem(**small)
    s["call-null-q"] = ok + NULL + OWN * 4
    s["call-o-overlaps-q"] = ok + OWN * 3 + at(0, 2) + OWN
    s["call-lse-overlaps-v"] = ok + OWN * 4 + at(2, 1)
    s["call-lse-overlaps-o"] = ok + OWN * 4 + at(3, 3)
    s["call-after-o-ok"] = ok + OWN * 3 + at(0, 16) + own_plus(3)
    tail = values(seed=30) + calls(1 | 2, 9)
    s["buffers-o-in-q"] = ok + OWN_ALL + memory(O_IN_Q, 3) + tail
    s["buffers-o-in-v"] = ok + OWN_ALL + memory(O_IN_V | SHARED_KV, 1) + tail
    s["buffers-lse-in-o"] = ok + OWN_ALL + memory(LSE_IN_O, 5) + tail
    s["buffers-null-k"] = ok + OWN_ALL + memory(NULL_POINTER, 1) + tail
    s["buffers-null-o"] = ok + OWN_ALL + memory(NULL_POINTER, 3) + tail
    # Outputs overlapping the sinks or a length array: fake addresses, then real buffers.
    ok2 = problem(**dict(small, b=2))
    s["call-o-overlaps-sinks"] = ok + OWN_ALL + NO_RUN + extras(sinks_each(1, 2),
                                                               fake=fake_at(O, SINKS, -3))
    s["call-o-overlaps-alibi"] = ok + OWN_ALL + NO_RUN + extras(fake=fake_at(O, ALIBI, -3),
                                                               alibi=alibi_geometric())
    s["call-lse-overlaps-kv-lens"] = ok2 + OWN_ALL + NO_RUN + extras(
        lens=lengths(kv=lens_each(3, 1)), fake=fake_at(LSE, KV_LENS, 3))
    s["call-o-after-q-lens"] = ok2 + OWN_ALL + NO_RUN + extras(
        lens=lengths(q=lens_each(2, 1)), fake=fake_at(O, Q_LENS, 4))
    s["buffers-sinks-in-o"] = ok + OWN_ALL + memory(SEPARATE) + tail + extras(
        sinks_each(1, 2), place=placed(SINKS, offset=3))
    s["buffers-q-lens-in-lse"] = ok2 + OWN_ALL + memory(SEPARATE) + tail + extras(
        lens=lengths(q=lens_each(1, 2)), place=placed(Q_LENS, in_lse=True, offset=1))
    s["buffers-kv-lens-in-o-no-lse"] = ok2 + OWN_ALL + memory(NO_LSE) + tail + extras(
        lens=lengths(kv=lens_each(0, 3)), place=placed(KV_LENS))
    return s


def parse_seeds():
    s = {}
    for i, text in enumerate(["", "avx2", "avx512icl", "sse9", "AVX2"]):
        s[f"max-isa-{i}"] = bytes([0]) + text.encode()
    for i, text in enumerate(["", "3", "4096", "4097", "0", " +7", "4x", "99999999999999999999"]):
        s[f"num-threads-{i}"] = bytes([1]) + text.encode()
    for i, text in enumerate(["32K,512K", "48k,2048K\n", "2K,512K", "64K,32K", "32K,512K,1M",
                              ",512K", "32K,512K,", "32K,512K,4M,8M"]):
        s[f"caches-{i}"] = bytes([2]) + text.encode()
    for i, text in enumerate(["1024M", "1025M", " 4K", "12Q", "18446744073709551617"]):
        s[f"cache-size-{i}"] = bytes([3]) + text.encode()
    for i, text in enumerate(["0-3,8-11", "0,64", "3-1", "0-", "0;1"]):
        s[f"cpu-list-{i}"] = bytes([4]) + text.encode()
    # Regressions: CPU numbers whose count overflowed int64_t, or that no system has.
    s["cpu-list-overflow"] = bytes([4]) + b"0-99999999999999999999"
    s["cpu-list-overflow-sum"] = bytes([4]) + b"0-4611686018427387904,0-4611686018427387904"
    s["cpu-list-huge-number"] = bytes([4]) + b"0,6444444444444"
    for name in ["naive", "blocked", "xsimd-avx2", "xsimd-avx512", "highway-sse4",
                 "highway-avx2", "highway-avx3", "highway-avx3-dl", "avx2", "avx512", "neon",
                 "portable", "fastest", ""]:
        s[f"kernel-{name or 'empty'}"] = bytes([5]) + name.encode()
    return s


def write(target, seeds):
    folder = HERE / "corpus" / target
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, data in seeds.items():
        (folder / name).write_bytes(data)
    print(f"{folder}: {len(seeds)} seeds")


if __name__ == "__main__":
    write("attention", attention_seeds())
    write("parse", parse_seeds())
