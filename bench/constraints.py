"""Per-step mask time of paved's batched C++ constraint engine, side by side with anchors.

    tools/bazel run //bench:constraints -- [--quick] [--json]

One JSON schema (string, integer, enum-array and number fields), compact JSON (no optional
whitespace) in every engine. Each batch row is advanced by a different token prefix of a valid
document, so rows sit at different in-string / in-number / in-enum states. Methods, all timed
on the same rows:

  python         vLLM V0's outlines logits-processor pattern, in Python: for each row, look up
                 the allowed token ids of the row's DFA state (precomputed numpy int64 arrays,
                 one per state, built from outlines-core's index outside the timed region, like
                 V0's cached guide), build a float32 row of -inf, zero the allowed ids with
                 numpy fancy indexing and add it to the row's logits. Writes logits.
  outlines-core  `Guide.write_mask_into` per row into an int32 bitmask (Python loop, 1 thread).
  xgrammar       `BatchGrammarMatcher(threads).batch_fill_next_token_bitmask` into the bitmask.
  paved          `BatchMasker(V, threads).fill_bitmask(states, bitmask)`; `paved apply` is
                 `BatchMasker.apply(states, logits)` on float32 logits (compare with python);
                 `paved unique` is `fill_unique_bitmask` (each distinct mask once plus a row
                 index: what paved's vLLM processor sends to the device, which gathers rows).
  bitmask write  numpy `fill` of a [B, ceil(V/32)] int32 array: the step's output bytes and
                 nothing else, timed in the same shuffled rounds (a floor under the same cache
                 conditions, beside the copy-bandwidth floor).

Ratios are paved's time divided by the anchor's (lower is better): bitmask vs outlines-core
and xgrammar; vs python, `ratio_vs_python_b64_v128k` is the full `fill_bitmask` (the same
[B, W] output the other anchors write), `ratio_unique_vs_python_b64_v128k` is
`fill_unique_bitmask` (the host time of paved's device path: the processor in
libs/paved/constraints/vllm_processor.py sends the distinct masks and a row index, and the
device gathers and applies them) and `ratio_apply_vs_python_b64_v128k` is `apply` on float32
logits (the CPU-only path, bound by writing B * V * 4 bytes of logits). The Python V0
processor pays its whole per-row loop (allowed ids -> -inf row -> add) on the host. The floor is the
bytes a step must write (B * ceil(V/32) * 4 for the bitmask, B * V * 4 for logits) divided by
the copy bandwidth measured with numpy in the same run. With --json the last stdout line is
one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import statistics
import sys
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["math", "poetry", "engines", "music", "history", "chess"]},
        },
        "score": {"type": "number"},
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "tags", "score", "bio"],
    "additionalProperties": False,
}

# Valid compact documents; the rows' prefixes are cut from these. Exponents carry a sign
# (outlines-core's number regex requires one) and strings use no escapes, so the three
# engines agree on every prefix.
DOCUMENTS = [
    '{"name":"Ada Lovelace-Byron, Countess of Lovelace (1815)","age":36,"tags":["math","engines"],'
    '"score":-1234.5678e+12,"bio":"Wrote the first published algorithm for Babbage\'s Analytical '
    'Engine in 1843; her notes A to G run to 65 pages."}',
    '{"name":"Grace Brewster Murray Hopper","age":85,"tags":["math","history","chess"],'
    '"score":99.125,"bio":"Rear admiral, COBOL pioneer; she found a moth in the Mark II relay '
    'and taped it into the log book on 9 September 1947."}',
    '{"name":"Alan Mathison Turing","age":41,"tags":["math"],"score":0.5e-3,'
    '"bio":"Defined computability with a 1936 paper, broke Enigma at Bletchley Park and '
    'asked whether machines can think (1950)."}',
    '{"name":"Johann Sebastian Bach","age":65,"tags":["music","history"],"score":1685,'
    '"bio":"Cantor of St. Thomas in Leipzig from 1723 to 1750, wrote more than 1100 works, '
    'among them 48 preludes and fugues."}',
]

V32K = 32 * 1024
V128K = 128 * 1024
FULL_BATCHES = (1, 4, 16, 64, 256)
FULL_VOCABS = (V32K, V128K)
QUICK_BATCHES = (1, 16)
QUICK_VOCABS = (V32K,)

# ---------------------------------------------------------------------------------------
# Synthetic byte-level vocabulary: the 256 single bytes, one EOS (empty bytes), then
# deterministic multi-byte tokens shaped like BPE merges of English / JSON / code text.
# The first N tokens are the same for every V (smaller vocabularies are prefixes).


def _split(text: str) -> list[str]:
    return text.split()


_ONSETS = _split("b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sp")
_ONSETS += _split("st str th tr wh") + [""] * 6
_VOWELS = _split("a e i o u a e i o ea ou io ai ee oo ie au y")
_CODAS = _split("n r s t l m d nd ng st ck rs ts nt ll ss rt ct ght") + [""] * 10
_SUFFIXES = _split("ing ed er ly tion ment ness able ity es s al")
_COMMON = _split(
    "the of and to in is was for that with as on by at from it an be this are or which not "
    "have has had but were his her their they one all would there been if more when will "
    "also who can into only other its new some time these two may than first any after "
    "name id type value description title text data user items properties number string "
    "integer boolean array object null true false age score tags bio email url date count "
    "result error message status code content role model json schema key list index"
)
_PUNCT = [*"\",:{}[]().;!?-_/'*#@&%+=<>|~`$^", " ", " ", "\n", ",", ":"]
_JSON_PIECES = [*_split('":" "," ": ", {" "} ":[ "], "] },{ ":{" "}, ], },'), ' "']


def _word(rng: random.Random) -> str:
    if rng.random() < 0.08:
        w = rng.choice(_COMMON)
    else:
        n = rng.choices((1, 2, 3), weights=(60, 35, 5))[0]
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n))
        w += rng.choice(_SUFFIXES) if rng.random() < 0.3 else ""
    r = rng.random()
    if r < 0.10:
        w = w.capitalize()
    elif r < 0.13:
        w = w.upper()
    return w


def _token(rng: random.Random) -> bytes:
    # Shares follow a real 128k BPE vocabulary (and //models/tiny's): ~2% of tokens hold a
    # quote, ~0.2% a backslash, ~5% digits, ~13% non-ASCII bytes; the rest are word pieces.
    r = rng.random()
    if r < 0.70:  # word pieces, half with a leading space (GPT-style "Ġword")
        t = (" " if rng.random() < 0.5 else "") + _word(rng)
    elif r < 0.71:  # word glued to JSON punctuation: "name  name":  value", ...
        w = _word(rng)
        t = rng.choice(
            ['"' + w, w + '"', w + '":', w + '",', ' "' + w, w + '":"', '"' + w + '"', "_" + w, w + "_"]
        )
    elif r < 0.76:  # identifiers: camelCase / snake_case
        t = rng.choice(_COMMON) + rng.choice(["_", ""]) + _word(rng).capitalize()
    elif r < 0.81:  # numbers: 1-4 digits, decimals, exponents, digit groups
        d = str(rng.randint(0, 10 ** rng.randint(1, 4) - 1))
        t = rng.choice(
            [d, d, d, " " + d, "." + d, d + ".", "-" + d, "," + d, d + "e", "e+" + d, "e-" + d, d + ","]
        )
    elif r < 0.835:  # punctuation and JSON structure combinations
        if rng.random() < 0.2:
            t = rng.choice(_JSON_PIECES) + rng.choice(["", "", '"', " ", "\n"])
        else:
            t = "".join(rng.choice(_PUNCT) for _ in range(rng.randint(2, 4)))
    elif r < 0.865:  # whitespace runs (indentation, blank lines)
        t = rng.choice(["\n", "\n\n", "\t", "\r\n", ""]) + " " * rng.randint(1, 16)
    elif r < 0.867:  # escape sequences as they appear in JSON strings and code
        t = rng.choice(["\\n", '\\"', "\\\\", "\\t", "\\u00", "\\/", "\\r\\n", '\\"}', '.\\n"']) + rng.choice(
            ["", _word(rng)]
        )
    else:  # non-ASCII text: accented words, CJK, emoji, and partial UTF-8 byte pieces
        k = rng.random()
        if k < 0.4:
            t = (" " if rng.random() < 0.5 else "") + _word(rng) + rng.choice("éèàüöñçøåß")
        elif k < 0.8:
            t = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 3)))
        elif k < 0.9:
            t = chr(rng.randint(0x1F300, 0x1F64F))
        else:
            return chr(rng.randint(0x4E00, 0x9FFF)).encode()[:2]
    return t.encode()


def synthetic_vocab(vocab_size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    tokens = [bytes([b]) for b in range(256)] + [b""]  # id 256 is EOS
    seen = set(tokens)
    while len(tokens) < vocab_size:
        t = _token(rng)
        if t and t not in seen:
            seen.add(t)
            tokens.append(t)
    return tokens


def tiny_vocab(tokenizer_json: str) -> tuple[list[bytes], list[int]]:
    """Token bytes and EOS ids of the //models/tiny fixture, as paved's vLLM adapter sees them."""
    from transformers import AutoTokenizer

    from paved.constraints.vocab import token_bytes

    model_dir = os.path.dirname(os.path.abspath(tokenizer_json))
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        eos = json.load(f).get("eos_token_id", tok.eos_token_id)
    eos_ids = sorted({int(e) for e in (eos if isinstance(eos, list) else [eos])})
    return token_bytes(tok), eos_ids


# ---------------------------------------------------------------------------------------
# Row prefixes: greedy longest-match tokenization of the documents, cut at token boundaries
# that leave the row inside a string value, an enum string or a number.


def _value_spans(doc: str) -> list[tuple[int, int, str]]:
    """(start, end, kind) byte spans: a cut k with start < k <= end leaves the row inside."""
    spans = []
    data = doc.encode()
    i, expect_value, depth_array = 0, False, 0
    while i < len(data):
        c = chr(data[i])
        if c == '"':
            j = i + 1
            while data[j] != ord('"'):
                j += 2 if data[j] == ord("\\") else 1
            if expect_value or depth_array:
                spans.append((i, j, "enum" if depth_array else "string"))
            expect_value = False
            i = j + 1
        elif c == ":":
            expect_value = True
            i += 1
        elif c in "-0123456789":
            j = i
            while j < len(data) and chr(data[j]) in "+-0123456789.eE":
                j += 1
            spans.append((i, j, "number"))
            expect_value = False
            i = j
        else:
            depth_array += {"[": 1, "]": -1}.get(c, 0)
            expect_value = expect_value and c not in ",}"
            i += 1
    return spans


def greedy_tokenize(data: bytes, index: dict[bytes, int], max_len: int) -> list[int]:
    out, i = [], 0
    while i < len(data):
        for n in range(min(max_len, len(data) - i), 0, -1):
            t = index.get(data[i : i + n])
            if t is not None:
                out.append(t)
                i += n
                break
        else:
            raise ValueError(f"byte {data[i]!r} at {i} has no token")
    return out


def row_prefixes(tokens: list[bytes], batch: int) -> list[tuple[list[int], str]]:
    """`batch` (token prefix, state kind) pairs, spread over every candidate cut point."""
    index = {}
    for tid, t in enumerate(tokens):
        if t:
            index.setdefault(t, tid)
    max_len = max(len(t) for t in tokens)
    candidates = []
    for doc in DOCUMENTS:
        ids = greedy_tokenize(doc.encode(), index, max_len)
        spans = _value_spans(doc)
        k = 0
        for n, tid in enumerate(ids):
            k += len(tokens[tid])
            for start, end, kind in spans:
                if start < k <= end:
                    candidates.append((ids[: n + 1], kind))
                    break
    # Rows take the kinds in turn (string, number, enum, ...); within a kind they walk a
    # deterministic shuffle of its cut points, so rows differ until a kind runs out.
    kinds = ("string", "number", "enum")
    groups = {k: [c for c in candidates if c[1] == k] for k in kinds}
    for k in kinds:
        random.Random(1).shuffle(groups[k])
    return [groups[kinds[i % 3]][(i // 3) % len(groups[kinds[i % 3]])] for i in range(batch)]


# ---------------------------------------------------------------------------------------
# Timing


def _spread_order(names: list[str], apart: set[str], after: str | None, rng: random.Random) -> list[str]:
    """A random order of `names` in which no two of `apart` are neighbours, nor the first of
    them right after `after` (the previous round's last call)."""
    order = list(names)
    for _ in range(1000):
        rng.shuffle(order)
        calls = [after, *order] if after is not None else order
        if not any(a in apart and b in apart for a, b in itertools.pairwise(calls)):
            return order
    raise ValueError(f"no order keeps {sorted(apart)} apart among {names}")


def interleaved_medians(
    fns: dict, warmup: int, reps: int, min_s: float, apart=frozenset()
) -> dict[str, float]:
    """Median seconds per call of each function. Calls go round-robin (one call of each per
    round), so every method sees the same background load on a shared machine; rounds go on
    until each has `reps` samples and the cell has run for `min_s` per method. Each round runs
    the methods in a new (seeded) random order: what a call costs depends on what ran before
    it (a method that follows xgrammar finds the bitmask and the masks evicted to DRAM; see
    --predecessor-effect), so no method always inherits the same predecessor. Methods in
    `apart` (paved's, which read the same cached masks) never run back to back, so none of
    them finds the masks warmed by a sibling: each follows an anchor, as an anchor does."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    deadline = time.perf_counter() + min_s * len(fns)
    rng = random.Random(0)
    order: list[str] = []
    rounds = 0
    while rounds < reps or (time.perf_counter() < deadline and rounds < 50 * reps):
        order = _spread_order(list(fns), set(apart), order[-1] if order else None, rng)
        for name in order:
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth(quick: bool) -> float:
    """Bytes per second of a large numpy copy, best of repeats (256 MiB)."""
    n = 256 * 1024 * 1024 // 4
    src = np.ones(n, dtype=np.float32)
    dst = np.empty_like(src)
    times = []
    np.copyto(dst, src)
    for _ in range(5 if quick else 9):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return src.nbytes / min(times)


# ---------------------------------------------------------------------------------------
# Engines


class Outlines:
    def __init__(self, tokens: list[bytes], eos_ids: list[int]):
        import outlines_core as oc

        self.oc = oc
        mapping: dict[bytes, list[int]] = {}
        for tid, t in enumerate(tokens):
            if t and tid not in eos_ids:
                mapping.setdefault(t, []).append(tid)
        t0 = time.perf_counter()
        self.vocabulary = oc.Vocabulary(eos_ids[0], mapping)
        self.vocab_s = time.perf_counter() - t0

    def compile(self):
        # Compact JSON: an empty whitespace pattern, like paved's "compact" and xgrammar's
        # any_whitespace=False with (",", ":") separators.
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), "")
        return self.oc.Index(regex, self.vocabulary)

    def guides(self, index, prefixes):
        out = []
        for ids, _ in prefixes:
            g = self.oc.Guide(index, max_rollback=0)
            for t in ids:
                g.advance(t, return_tokens=False)
            out.append(g)
        return out

    @staticmethod
    def fill(guides, bitmask: np.ndarray) -> None:
        words = bitmask.shape[1]
        base, stride = bitmask.ctypes.data, bitmask.strides[0]
        for i, g in enumerate(guides):
            g.write_mask_into(base + i * stride, words, 4)


class PythonV0:
    """The V0 per-request pattern: a Python loop over rows, numpy fancy indexing per row."""

    def __init__(self, index, guides):
        cache: dict[int, np.ndarray] = {}
        self.row_allowed = []
        for g in guides:
            s = g.get_state()
            if s not in cache:
                cache[s] = np.asarray(index.get_allowed_tokens(s), dtype=np.int64)
            self.row_allowed.append(cache[s])

    def apply(self, logits: np.ndarray) -> None:
        vocab_size = logits.shape[1]
        for i, allowed in enumerate(self.row_allowed):
            mask = np.full(vocab_size, -np.inf, dtype=np.float32)
            mask[allowed] = 0.0
            logits[i] += mask


class XGrammar:
    def __init__(self, tokens: list[bytes], eos_ids: list[int], threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo(
            tokens, xgr.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=eos_ids
        )
        self.vocab_s = time.perf_counter() - t0
        self.threads = threads
        self.batch = xgr.BatchGrammarMatcher(threads)

    def compile(self):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        return compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def matchers(self, compiled, prefixes):
        out = []
        for ids, _ in prefixes:
            m = self.xgr.GrammarMatcher(compiled)
            for t in ids:
                if not m.accept_token(t):
                    raise RuntimeError(f"xgrammar rejected token {t} of prefix {ids}")
            out.append(m)
        return out

    def fill(self, matchers, bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class Paved:
    def __init__(self, native, tokens: list[bytes], eos_ids: list[int], threads: int):
        self.native = native
        t0 = time.perf_counter()
        self.vocab = native.Vocab(tokens, eos_ids, len(tokens))
        self.vocab_s = time.perf_counter() - t0
        self.masker = native.BatchMasker(len(tokens), threads)
        self.vocab_size = len(tokens)

    def compile(self):
        return self.native.Constraint.json_schema(self.vocab, json.dumps(SCHEMA), "compact")

    def first_mask(self):
        """Compile, then one complete mask row at the start state (time to first full mask)."""
        c = self.compile()
        row = np.zeros((1, self.native.bitmask_words(self.vocab_size)), dtype=np.int32)
        self.masker.fill_bitmask([c.new_state()], row)
        return c

    def document_walk(self, doc_ids: list[int]):
        """Compile, then a mask at every step of one whole document (one full generation)."""
        c = self.compile()
        row = np.zeros((1, self.native.bitmask_words(self.vocab_size)), dtype=np.int32)
        s = c.new_state()
        for t in doc_ids:
            self.masker.fill_bitmask([s], row)
            if not s.advance(t):
                raise RuntimeError(f"paved rejected token {t} while walking a valid document")
        self.masker.fill_bitmask([s], row)
        return c

    def cold_step(self, prefixes, words: int) -> float:
        """Seconds of the first fill_bitmask on a freshly compiled constraint (empty mask cache)."""
        states = self.states(self.compile(), prefixes)
        bitmask = np.zeros((len(states), words), dtype=np.int32)
        t0 = time.perf_counter()
        self.masker.fill_bitmask(states, bitmask)
        return time.perf_counter() - t0

    def states(self, constraint, prefixes):
        out = []
        for ids, _ in prefixes:
            s = constraint.new_state()
            for t in ids:
                if not s.advance(t):
                    raise RuntimeError(f"paved rejected token {t} of prefix {ids}")
            out.append(s)
        return out


def load_native():
    try:
        import _paved_constraints as native
    except ImportError as e:
        return None, f"_paved_constraints not importable ({e})"
    missing = [n for n in ("Vocab", "Constraint", "BatchMasker") if not hasattr(native, n)]
    if missing:
        return None, f"_paved_constraints has no {', '.join(missing)} yet"
    return native, None


# ---------------------------------------------------------------------------------------
# Correctness: allowed sets of paved vs the anchors, on a few rows per vocabulary.

_OUTLINES_EXCLUDED = (b"\\u", b"\x7f", *(bytes([0xC2, b]) for b in range(0x80, 0xA0)))


def _documented(token: bytes, kind: str, last: bytes, anchor: str) -> bool:
    """True if a paved/anchor difference on `token` (after a prefix whose last token is
    `last`) is one of the anchor's documented departures from JSON: outlines-core forbids
    \\uXXXX escapes and U+007F..U+009F in strings and requires a sign after an exponent."""
    if anchor != "outlines-core":
        return False
    if kind in ("string", "enum") and any(x in token for x in _OUTLINES_EXCLUDED):
        return True
    return kind == "number" and (b"e" in token or b"E" in token or last[-1:] in (b"e", b"E"))


def allowed_bits(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[B, V] bool of a [B, ceil(V/32)] int32 bitmask (padding bits past V dropped)."""
    return np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].astype(bool)


def compare_masks(tokens, prefixes, bitmasks: dict[str, np.ndarray]) -> dict:
    """Every row's allowed set, paved vs each anchor: differing (row, token) pairs, and how
    many of them are the anchor's documented departures from JSON."""
    vocab_size = len(tokens)
    result = {}
    paved = allowed_bits(bitmasks["paved"], vocab_size)
    for anchor in ("xgrammar", "outlines-core"):
        other = allowed_bits(bitmasks[anchor], vocab_size)
        total = explained = 0
        examples = []
        for r, t in zip(*np.nonzero(paved != other), strict=True):
            total += 1
            kind, last = prefixes[r][1], tokens[prefixes[r][0][-1]]
            if _documented(tokens[t], kind, last, anchor):
                explained += 1
            elif len(examples) < 4:
                side = "paved only" if paved[r, t] else f"{anchor} only"
                examples.append(f"row {r} ({kind}) token {t} {tokens[t]!r}: {side}")
        result[anchor] = {
            "rows": len(prefixes),
            "differences": total,
            "documented": explained,
            "unexplained": total - explained,
            "examples": examples,
        }
    return result


# ---------------------------------------------------------------------------------------


def compile_times(oc, xg, pv, doc_ids, reps: int) -> tuple[dict, dict, object, object, object]:
    """Median (and first) compile times: a fresh compile each repeat, vocabularies built once."""
    out: dict[str, float] = {}
    first: dict[str, float] = {}
    keep: dict[str, object] = {}

    def _ms(fn, n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        first[len(out)] = times[0]
        return statistics.median(times)

    def oc_compile():
        keep["index"] = oc.compile()

    def xg_compile():
        keep["xgrammar"] = xg.compile()

    out["outlines-core Index"] = _ms(oc_compile, reps)
    out["xgrammar compile (info)"] = _ms(xg_compile, reps)
    constraint = None
    if pv:
        out["paved json_schema (lazy)"] = _ms(pv.compile, 2 * reps + 1)
        out["paved compile + first full mask"] = _ms(pv.first_mask, 2 * reps + 1)
        out["paved compile + mask at every step of a document"] = _ms(lambda: pv.document_walk(doc_ids), reps)
        constraint = pv.compile()
    first = {k: first[i] for i, k in enumerate(out)}
    return out, first, keep["index"], keep["xgrammar"], constraint


def bench_batch(b, tokens, oc, index, xg, compiled, pv, constraint, timing, check_rows_at_b) -> tuple:
    """µs/step of every method at batch size b; correctness check of a few rows if asked."""
    vocab_size = len(tokens)
    words = (vocab_size + 31) // 32
    prefixes = row_prefixes(tokens, b)
    guides = oc.guides(index, prefixes)
    py = PythonV0(index, guides)
    matchers = xg.matchers(compiled, prefixes)
    names = ("outlines-core", "xgrammar", "paved", "floor") if pv else ("outlines-core", "xgrammar", "floor")
    masks = {name: np.zeros((b, words), dtype=np.int32) for name in names}
    rng = np.random.default_rng(0)
    logits_py = rng.standard_normal((b, vocab_size), dtype=np.float32)
    fns = {
        "python": lambda: py.apply(logits_py),
        "outlines-core": lambda: Outlines.fill(guides, masks["outlines-core"]),
        "xgrammar": lambda: xg.fill(matchers, masks["xgrammar"]),
        # Writing the step's bitmask bytes and nothing else, under the same cache conditions.
        "bitmask write": lambda: masks["floor"].fill(-1),
    }
    if pv:
        states = pv.states(constraint, prefixes)
        logits_pv = rng.standard_normal((b, vocab_size), dtype=np.float32)
        fns["paved"] = lambda: pv.masker.fill_bitmask(states, masks["paved"])
        fns["paved apply"] = lambda: pv.masker.apply(states, logits_pv)
        unique = np.zeros((b, words), dtype=np.int32)
        row_index = np.zeros(b, dtype=np.int32)
        fns["paved unique"] = lambda: pv.masker.fill_unique_bitmask(states, unique, row_index)
    paved_methods = {name for name in fns if name.startswith("paved")}
    res = {name: 1e6 * t for name, t in interleaved_medians(fns, *timing, apart=paved_methods).items()}
    n_unique = None
    if pv:
        n_unique = pv.masker.fill_unique_bitmask(states, unique, row_index)
        if not np.array_equal(unique[:n_unique][row_index], masks["paved"]):
            print("  WARNING: paved unique rows do not gather to fill_bitmask's bitmask", flush=True)
        cold = [pv.cold_step(prefixes, words) for _ in range(max(1, timing[1] // 2))]
        res["paved cold"] = 1e6 * statistics.median(cold)
        # apply must mask exactly what fill_bitmask allows.
        if not np.array_equal(np.isfinite(logits_pv), allowed_bits(masks["paved"], vocab_size)):
            print("  WARNING: paved apply and fill_bitmask disagree", flush=True)
    check = None
    if check_rows_at_b:
        check = compare_masks(tokens, prefixes, masks) if pv else {}
        xg_bits = allowed_bits(masks["xgrammar"], vocab_size)
        oc_bits = allowed_bits(masks["outlines-core"], vocab_size)
        check["xgrammar vs outlines-core differences"] = int((xg_bits != oc_bits).sum())
    return res, check, n_unique


def run_vocab(label: str, tokens: list[bytes], eos_ids: list[int], batches, args, native) -> dict:
    print(f"\n== V={len(tokens)} ({label}) ==", flush=True)
    oc = Outlines(tokens, eos_ids)
    xg = XGrammar(tokens, eos_ids, args.threads)
    pv = Paved(native, tokens, eos_ids, args.threads) if native else None
    index_of = {t: i for i, t in reversed(list(enumerate(tokens))) if t}
    doc_ids = greedy_tokenize(DOCUMENTS[0].encode(), index_of, max(len(t) for t in tokens))
    compile_ms, first_ms, index, compiled, constraint = compile_times(
        oc, xg, pv, doc_ids, 1 if args.quick else 3
    )
    for k, v in compile_ms.items():
        print(f"  compile: {k:50s} {v:10.1f} ms (first {first_ms[k]:.1f})", flush=True)
    info = {
        "vocab_size": len(tokens),
        "threads": args.threads,
        "vocab_build_ms": {"outlines-core": 1e3 * oc.vocab_s, "xgrammar": 1e3 * xg.vocab_s},
        "compile_ms": compile_ms,
        "compile_first_ms": first_ms,
        "paved_stats": None,
        "unique_rows": {},  # distinct masks per batch size: the rows fill_unique_bitmask writes
    }
    if pv:
        info["vocab_build_ms"]["paved"] = 1e3 * pv.vocab_s
    max_b = max(batches)
    rows = row_prefixes(tokens, max_b)
    kinds = {k: sum(1 for _, kk in rows if kk == k) for k in ("string", "number", "enum")}
    print(f"  rows at B={max_b}: {kinds}, distinct prefixes {len({tuple(p) for p, _ in rows})}")
    timing = (1, 3, 0.05) if args.quick else (3, 7, 0.3)  # warmup, min repeats, min seconds
    us: dict[str, dict[int, float]] = {m: {} for m in METHODS}
    for b in batches:
        res, check, n_unique = bench_batch(
            b, tokens, oc, index, xg, compiled, pv, constraint, timing, b == max_b
        )
        info["unique_rows"][b] = n_unique
        for m, v in res.items():
            us[m][b] = v
        if check is not None:
            info["check"] = check
        print(f"  B={b:<4d} µs/step: " + "  ".join(f"{m} {v:.0f}" for m, v in res.items()), flush=True)
        gc.collect()
    info["us_per_step"] = us
    if pv:
        info["paved_stats"] = constraint.stats()  # after every step: mask-cache entries and hits
    for anchor, c in info["check"].items():
        if isinstance(c, dict):
            print(
                f"  check paved vs {anchor}, all {c['rows']} rows: {c['differences']} differing "
                f"(row, token) pairs, {c['documented']} documented, {c['unexplained']} unexplained"
            )
            for e in c["examples"]:
                print(f"    {e}")
    xo = info["check"]["xgrammar vs outlines-core differences"]
    print(f"  check xgrammar vs outlines-core: {xo} differences")
    return info


def pool_threads(native, args) -> dict:
    """`--pool-threads`: paved fill_bitmask at V=128k, BatchMasker with 1 vs 2 threads, small
    batches. Calls alternate between the two maskers; each is timed warm, and after a 32 MiB
    write that evicts the CPU caches (what the other methods of a round, or a model step, do
    to the masks and the bitmask). Median / p90 / p99 in µs."""
    v = V128K
    tokens = synthetic_vocab(v)
    pv = Paved(native, tokens, [256], 1)
    constraint = pv.compile()
    maskers = {1: pv.masker, 2: native.BatchMasker(v, 2)}
    junk = np.zeros(8 << 20, dtype=np.float32)
    reps = 200 if args.quick else 2000
    out: dict = {}
    print(f"| fill_bitmask, V={v}, µs (median / p90 / p99) | 1 thread | 2 threads |")
    print("|---|---:|---:|")
    for b in args.batch_sizes or (1, 2, 4, 8, 64):
        states = pv.states(constraint, row_prefixes(tokens, b))
        bitmask = np.zeros((b, (v + 31) // 32), dtype=np.int32)
        for cache in ("warm", "cold"):
            times: dict[int, list[float]] = {t: [] for t in maskers}
            for _ in range(20):
                for m in maskers.values():
                    m.fill_bitmask(states, bitmask)
            for _ in range(reps if cache == "warm" else reps // 4):
                for t, m in maskers.items():
                    if cache == "cold":
                        junk[:] = 1.0
                    t0 = time.perf_counter()
                    m.fill_bitmask(states, bitmask)
                    times[t].append(1e6 * (time.perf_counter() - t0))
            cells = {}
            for t, x in times.items():
                x.sort()
                cells[t] = [statistics.median(x), x[len(x) * 9 // 10], x[len(x) * 99 // 100]]
            out[f"B={b} {cache}"] = cells
            row = " | ".join(" / ".join(f"{c:.1f}" for c in cells[t]) for t in maskers)
            print(f"| B={b}, {cache} | {row} |", flush=True)
    return out


def predecessor_effect(native, args) -> dict:
    """`--predecessor-effect`: what the call before costs a B=64, V=128k step. paved
    fill_bitmask, fill_unique_bitmask and a one-thread numpy write of the same [64, 4096]
    int32 bytes, each timed warm (right after itself), after a 32 MiB numpy write, and after an
    xgrammar batch fill of the same rows. Median µs. This is why the main table shuffles the
    order of its rounds."""
    v, b = V128K, 64
    tokens = synthetic_vocab(v)
    prefixes = row_prefixes(tokens, b)
    pv = Paved(native, tokens, [256], args.threads)
    constraint = pv.compile()
    states = pv.states(constraint, prefixes)
    xg = XGrammar(tokens, [256], args.threads)
    matchers = xg.matchers(xg.compile(), prefixes)
    words = (v + 31) // 32
    bitmask, xg_mask, numpy_mask = (np.zeros((b, words), dtype=np.int32) for _ in range(3))
    unique, row_index = np.zeros((b, words), dtype=np.int32), np.zeros(b, dtype=np.int32)
    junk = np.zeros(8 << 20, dtype=np.float32)
    calls = {
        "paved fill_bitmask": lambda: pv.masker.fill_bitmask(states, bitmask),
        "paved fill_unique_bitmask": lambda: pv.masker.fill_unique_bitmask(states, unique, row_index),
        "numpy write of the bitmask bytes (1 thread)": lambda: numpy_mask.fill(-1),
    }
    before = {
        "warm": lambda: None,
        "after a 32 MiB write": lambda: junk.fill(1.0),
        "after xgrammar": lambda: xg.fill(matchers, xg_mask),
    }
    reps = 30 if args.quick else 150
    out: dict = {}
    print(f"| B={b}, V={v}, µs (median) | " + " | ".join(before) + " |")
    print("|---|" + "---:|" * len(before))
    for name, call in calls.items():
        for _ in range(5):
            call()
        cells = {}
        for cond, pre in before.items():
            times = []
            for _ in range(reps):
                pre()
                t0 = time.perf_counter()
                call()
                times.append(1e6 * (time.perf_counter() - t0))
            cells[cond] = statistics.median(times)
        out[name] = cells
        print(f"| {name} | " + " | ".join(f"{cells[c]:.0f}" for c in before) + " |", flush=True)
    return out


def fill_breakdown(native, args) -> dict:
    """`--fill-breakdown`: what a B=64, V=128k `fill_bitmask` pays beyond writing its bytes.
    Each call runs after a 32 MiB write (as in a model step), in shuffled rounds, beside a
    one-thread numpy write of the same [64, 4096] int32 bytes: paved on the bench's rows (a
    JSON document's states: n distinct cached masks), on 64 distinct States that share one
    mask (each row's lookup is paid, one mask is read), and on 64 rows without a state (one
    all-allowed mask, no lookup). `traffic_ratio` is the bytes the call must move (the bitmask
    written plus each distinct mask read once) over the bytes the numpy write moves."""
    v, b = V128K, 64
    tokens = synthetic_vocab(v)
    pv = Paved(native, tokens, [256], args.threads)
    constraint = pv.compile()
    words = (v + 31) // 32
    rows = {
        "bench rows": pv.states(constraint, row_prefixes(tokens, b)),
        "one mask, 64 states": [constraint.new_state() for _ in range(b)],
        "no state": [None] * b,
    }
    out_masks = {name: np.zeros((b, words), dtype=np.int32) for name in rows}
    floor = np.zeros((b, words), dtype=np.int32)
    calls = {
        f"paved, {name}": (lambda s=s, m=out_masks[name]: pv.masker.fill_bitmask(s, m))
        for name, s in rows.items()
    }
    calls["numpy write"] = lambda: floor.fill(-1)
    junk = np.zeros(8 << 20, dtype=np.float32)
    for fn in calls.values():
        for _ in range(5):
            fn()
    # The rows each variant wrote are what it claims: the start state's mask, all-allowed.
    start = np.zeros(words, dtype=np.int32)
    rows["one mask, 64 states"][0].fill_bitmask_row(start)
    assert (out_masks["one mask, 64 states"] == start).all()
    assert allowed_bits(out_masks["no state"], v).all()
    distinct = {name: len(np.unique(m, axis=0)) for name, m in out_masks.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    rng = random.Random(0)
    for _ in range(60 if args.quick else 400):
        rng.shuffle(names)
        for name in names:
            junk.fill(1.0)
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(1e6 * (time.perf_counter() - t0))
    write_us = statistics.median(times["numpy write"])
    out: dict = {"numpy_write_us": write_us}
    print(
        f"| B={b}, V={v}, after a 32 MiB write | µs (median) | ÷ numpy write"
        " | distinct masks | traffic ratio |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, t in times.items():
        us = statistics.median(t)
        key = name.removeprefix("paved, ")
        n = distinct.get(key)
        traffic = None if n is None else (b + n) / b
        out[name] = {
            "us": us,
            "ratio_vs_numpy_write": us / write_us,
            "distinct_masks": n,
            "traffic_ratio": traffic,
        }
        extra = "| | |" if n is None else f"| {n} | {traffic:.2f} |"
        print(f"| {name} | {us:.1f} | {us / write_us:.2f} {extra}", flush=True)
    return out


METHODS = (
    "python",
    "outlines-core",
    "xgrammar",
    "paved",
    "paved unique",
    "paved apply",
    "paved cold",
    "bitmask write",
)
_LABELS = {
    "python": "python V0 loop (logits)",
    "outlines-core": "outlines-core write_mask_into",
    "xgrammar": "xgrammar BatchGrammarMatcher, {t} thr",
    "paved": "**paved fill_bitmask, {t} thr**",
    "paved unique": "**paved fill_unique_bitmask (device path), {t} thr**",
    "paved apply": "paved apply (logits), {t} thr",
    "paved cold": "paved fill_bitmask, first step of a fresh constraint",
    "bitmask write": "bitmask bytes written by numpy (1 thread, same rounds)",
}


def _ratios(us: dict, a: str, anchor: str, batches) -> list:
    return [us[a][b] / us[anchor][b] if b in us[a] and b in us[anchor] else None for b in batches]


def table(results: dict, bw: float) -> str:
    lines = []
    for label, info in results.items():
        us, v = info["us_per_step"], info["vocab_size"]
        batches = sorted(us["python"])
        floor = [1e6 * b * ((v + 31) // 32) * 4 / bw for b in batches]
        rows = [
            (_LABELS[m].format(t=info["threads"]), [us[m].get(b) for b in batches], "{:.0f}") for m in METHODS
        ]
        rows += [
            (
                "distinct masks in the batch (rows fill_unique_bitmask writes)",
                [info["unique_rows"].get(b) for b in batches],
                "{:.0f}",
            ),
            ("bitmask write floor", floor, "{:.2f}"),
            ("paved / outlines-core", _ratios(us, "paved", "outlines-core", batches), "{:.3f}"),
            ("paved / xgrammar", _ratios(us, "paved", "xgrammar", batches), "{:.4f}"),
            ("paved apply / python", _ratios(us, "paved apply", "python", batches), "{:.4f}"),
            ("paved fill_bitmask / python", _ratios(us, "paved", "python", batches), "{:.4f}"),
            ("paved fill_unique_bitmask / python", _ratios(us, "paved unique", "python", batches), "{:.4f}"),
            ("paved fill_bitmask / numpy write", _ratios(us, "paved", "bitmask write", batches), "{:.2f}"),
            (
                "paved / floor",
                [us["paved"].get(b, 0) / f or None for b, f in zip(batches, floor, strict=True)],
                "{:.1f}",
            ),
        ]
        lines.append(f"| V={v} ({label}), µs/step | " + " | ".join(f"B={b}" for b in batches) + " |")
        lines.append("|---|" + "---:|" * len(batches))
        for name, vals, fmt in rows:
            cells = ("—" if x is None else fmt.format(x) for x in vals)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def compile_table(results: dict) -> str:
    labels = list(results)
    keys = list(dict.fromkeys(k for info in results.values() for k in info["compile_ms"]))
    lines = ["| compile, ms (median) | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for k in keys:
        cells = (
            f"{results[lab]['compile_ms'][k]:.1f}" if k in results[lab]["compile_ms"] else "—"
            for lab in labels
        )
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _check_total(results: dict, anchor: str, key: str) -> int | None:
    counts = [info["check"][anchor][key] for info in results.values() if anchor in info.get("check", {})]
    return sum(counts) if counts else None


def summarize(results: dict, bw: float, native, args, wall_s: float) -> dict:
    b, v = 64, V128K
    big = results.get(f"synthetic {v // 1024}k")
    us = big["us_per_step"] if big else {m: {} for m in METHODS}
    cm = big["compile_ms"] if big else {}

    def ratio(a, anchor):
        return us[a][b] / us[anchor][b] if b in us[a] and b in us[anchor] else None

    def compile_ratio(key):
        return cm[key] / cm["outlines-core Index"] if key in cm else None

    floor_us = 1e6 * b * ((v + 31) // 32) * 4 / bw
    logits_floor_us = 1e6 * b * v * 4 / bw
    return {
        "ratio_vs_outlines_core_b64_v128k": ratio("paved", "outlines-core"),
        "ratio_vs_xgrammar_b64_v128k": ratio("paved", "xgrammar"),
        # The full [B, W] bitmask vs the Python V0 loop (which does all its work on the host);
        # the device path's host time (distinct masks only, gathered on the device) and apply
        # (CPU path, logits) reported beside it.
        "ratio_vs_python_b64_v128k": ratio("paved", "python"),
        "ratio_unique_vs_python_b64_v128k": ratio("paved unique", "python"),
        "ratio_apply_vs_python_b64_v128k": ratio("paved apply", "python"),
        "unique_rows_b64_v128k": big["unique_rows"].get(b) if big else None,
        # paved's full fill over writing the same bytes with numpy in the same rounds.
        "paved_over_bitmask_write_b64_v128k": ratio("paved", "bitmask write"),
        "compile_ratio_vs_outlines_core": compile_ratio("paved compile + first full mask"),
        "compile_ratio_vs_outlines_core_lazy_only": compile_ratio("paved json_schema (lazy)"),
        "compile_ratio_vs_outlines_core_document_walk": compile_ratio(
            "paved compile + mask at every step of a document"
        ),
        "us_b64_v128k": {m: us[m].get(b) for m in METHODS},
        "copy_bandwidth_gb_s": bw / 1e9,
        "bitmask_bytes_per_step_b64_v128k": b * ((v + 31) // 32) * 4,
        "floor_us_b64_v128k": floor_us,
        "paved_over_floor_b64_v128k": us["paved"][b] / floor_us if b in us["paved"] else None,
        "logits_bytes_per_step_b64_v128k": b * v * 4,
        "logits_floor_us_b64_v128k": logits_floor_us,
        "paved_apply_over_logits_floor_b64_v128k": (
            us["paved apply"][b] / logits_floor_us if b in us["paved apply"] else None
        ),
        # Allowed-set differences over every row of the largest batch, all vocabularies.
        "check_differences_vs_xgrammar": _check_total(results, "xgrammar", "differences"),
        "check_unexplained_vs_xgrammar": _check_total(results, "xgrammar", "unexplained"),
        "check_differences_vs_outlines_core": _check_total(results, "outlines-core", "differences"),
        "check_unexplained_vs_outlines_core": _check_total(results, "outlines-core", "unexplained"),
        "targets": {
            "ratio_vs_outlines_core": 0.1,
            "ratio_vs_xgrammar": 0.05,
            "ratio_vs_python": 0.01,
            "compile_ratio_vs_outlines_core": 1.0,
        },
        "paved_available": native is not None,
        "quick": args.quick,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "load_average_1m_end": os.getloadavg()[0],
        "wall_s": wall_s,
        "results": results,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: V=32k (+tiny), B in 1,16, few repeats")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--threads", type=int, default=2, help="threads for xgrammar and paved (default 2)")
    p.add_argument("--tiny-tokenizer", help="tokenizer.json of //models/tiny: also bench its real vocab")
    p.add_argument("--vocab-sizes", type=lambda s: [int(x) for x in s.split(",")], help="override V list")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], help="override B list")
    p.add_argument(
        "--pool-threads", action="store_true", help="only compare 1 vs 2 masker threads at small B (V=128k)"
    )
    p.add_argument(
        "--predecessor-effect",
        action="store_true",
        help="only time B=64, V=128k steps warm, after a 32 MiB write and after xgrammar",
    )
    p.add_argument(
        "--fill-breakdown",
        action="store_true",
        help="only time B=64, V=128k fill_bitmask on the bench's rows, one shared mask and no state"
        ", beside a numpy write",
    )
    args = p.parse_args(argv)

    t_start = time.perf_counter()
    native, why = load_native()
    batches = args.batch_sizes or (QUICK_BATCHES if args.quick else FULL_BATCHES)
    vocabs = args.vocab_sizes or (QUICK_VOCABS if args.quick else FULL_VOCABS)
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}; cpus: {os.cpu_count()}")
    if native is None:
        print(f"paved engine unavailable: {why}; measuring the anchors only")
    if args.pool_threads or args.predecessor_effect or args.fill_breakdown:
        if native is None:
            return 1
        mode = (
            pool_threads
            if args.pool_threads
            else predecessor_effect
            if args.predecessor_effect
            else fill_breakdown
        )
        out = mode(native, args)
        print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
        if args.json:
            print(json.dumps(out, separators=(",", ":")))
        return 0
    bw = copy_bandwidth(args.quick)
    print(f"numpy copy bandwidth (best of repeats): {bw / 1e9:.2f} GB/s")

    runs = []
    if args.tiny_tokenizer:
        runs.append(("tiny", *tiny_vocab(args.tiny_tokenizer)))
    for v in vocabs:
        runs.append(
            (f"synthetic {v // 1024}k" if v % 1024 == 0 else f"synthetic {v}", synthetic_vocab(v), [256])
        )
    results = {label: run_vocab(label, tokens, eos, batches, args, native) for label, tokens, eos in runs}
    print()
    print(table(results, bw))
    print(compile_table(results))
    summary = summarize(results, bw, native, args, time.perf_counter() - t_start)
    if V128K not in vocabs or 64 not in batches:
        print("\n(no B=64, V=128k cell in this run: the *_b64_v128k keys are null)")
    if args.json:
        print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
