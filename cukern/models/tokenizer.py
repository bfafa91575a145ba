"""A tokenizer built from a GGUF file's own vocabulary (``tokenizer.ggml.*``), so a model needs no other file.

Two algorithms, chosen by ``tokenizer.ggml.model``:

* ``"llama"`` - SentencePiece BPE (Gemma, Llama 1/2): spaces become ``▁``, adjacent pieces are
  merged highest score first (leftmost on ties) while the merged piece is a normal token, and a
  piece left outside the vocabulary falls back to its UTF-8 bytes (``<0xXX>`` tokens);
* ``"gpt2"`` - byte-level BPE (Qwen2/3, Llama 3): a pre-tokenizer regex splits the text, each
  piece's bytes are mapped to printable characters and merged by the rank of ``tokenizer.ggml.merges``.

In both, user-defined tokens (and control tokens such as ``<start_of_turn>`` when
``special=True``) are matched as whole strings first, longest first.
"""

from __future__ import annotations

import heapq
import re

import numpy as np

from cukern.params import check_int

__all__ = ["Tokenizer", "TokenizerError"]

# tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# pre-tokenizer patterns by tokenizer.ggml.pre (byte-level BPE); \p{..} needs the `regex` package
_PRE = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    # o200k (gpt-oss): words split at a lower -> upper case change, a contraction kept on its word, digits
    # in threes, "/" kept with trailing newlines after punctuation
    "gpt-4o": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
              r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
              r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_PRE["default"] = _PRE["gpt2"]
_PRE["qwen3"] = _PRE["qwen2"]


class TokenizerError(ValueError):
    pass


def _compile_pre(pattern: str):
    try:
        import regex
    except ImportError:   # Python's re has no \p{L} / \p{N}; an approximation would mis-split some text
        raise TokenizerError("byte-level BPE tokenizers need the 'regex' package for their pre-tokenizer "
                             "(pip install regex, or the 'model' extra)") from None
    return regex.compile(pattern)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Encode text to token ids and back, from the vocabulary stored in a GGUF file."""

    def __init__(self, tokens, *, model: str, scores=None, token_types=None, merges=None, pre: str = "default",
                 bos_id: int | None = None, eos_id: int | None = None, unk_id: int | None = None,
                 add_bos: bool = False, add_eos: bool = False, add_space_prefix: bool = False,
                 eot_ids=()):
        self.tokens = list(tokens)
        n = len(self.tokens)
        if model not in ("llama", "gpt2"):
            raise TokenizerError(f"unsupported tokenizer model {model!r} (cukern reads 'llama' and 'gpt2')")
        self.model = model
        self.scores = np.zeros(n, np.float32) if scores is None else np.asarray(scores, np.float32)
        self.types = np.full(n, NORMAL, np.int32) if token_types is None else np.asarray(token_types, np.int32)
        if self.scores.shape != (n,) or self.types.shape != (n,):
            raise TokenizerError(f"scores/token_type must have one entry per token ({n})")
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.add_bos, self.add_eos, self.add_space_prefix = add_bos, add_eos, add_space_prefix
        self.stop_ids = {i for i in (eos_id, *eot_ids) if i is not None}
        self.vocab = {}
        for i, t in enumerate(self.tokens):
            self.vocab.setdefault(t, i)
        special = [(t, i) for i, t in enumerate(self.tokens) if self.types[i] in (CONTROL, USER_DEFINED) and t]
        self._special = {t: i for t, i in special}
        user = sorted((t for t, i in special if self.types[i] == USER_DEFINED), key=len, reverse=True)
        every = sorted(self._special, key=len, reverse=True)
        self._split_user = re.compile("(" + "|".join(map(re.escape, user)) + ")") if user else None
        self._split_all = re.compile("(" + "|".join(map(re.escape, every)) + ")") if every else None
        if model == "llama":
            self._byte_ids = [self.vocab.get(f"<0x{b:02X}>") for b in range(256)]
            self._normal = {t: i for i, t in enumerate(self.tokens) if self.types[i] == NORMAL}
        else:
            if merges is None:
                raise TokenizerError("a 'gpt2' tokenizer needs tokenizer.ggml.merges")
            self._ranks = {}
            for r, m in enumerate(merges):
                a, sep, b = m.partition(" ")
                if not sep:
                    raise TokenizerError(f"merge {r} ({m!r}) is not two space-separated pieces")
                self._ranks.setdefault((a, b), r)
            if pre not in _PRE:
                raise TokenizerError(f"unsupported pre-tokenizer {pre!r} (cukern knows {', '.join(sorted(_PRE))})")
            self._pre = _compile_pre(_PRE[pre])
            self._b2u = _bytes_to_unicode()
            self._u2b = {c: b for b, c in self._b2u.items()}
        self._cache: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, source) -> "Tokenizer":
        """From a GGUF path, a ``gguf.GGUFReader`` or a :class:`cukern.models.GGUFModel`."""
        import gguf

        from cukern.models.gguf_parse import GGUFError, _Reader, read_key
        path = getattr(source, "path", source)
        try:
            reader = getattr(source, "reader", None) or (source if isinstance(source, gguf.GGUFReader)
                                                         else _Reader(source))
        except GGUFError as e:
            raise TokenizerError(f"{path}: {e}") from None

        def get(key, kind, default=None, **limits):
            try:
                return read_key(reader, "tokenizer.ggml." + key, kind, path, default, **limits)
            except UnicodeDecodeError as e:   # gguf.GGUFReader decodes strings strictly
                raise TokenizerError(f"{path}: tokenizer.ggml.{key} is not UTF-8 ({e.reason})") from None
            except GGUFError as e:
                raise TokenizerError(str(e)) from None

        tokens = get("tokens", "array of str")
        if not tokens:
            raise TokenizerError(f"{path}: no tokenizer.ggml.tokens: the file carries no vocabulary")
        model = get("model", "str")
        if model is None:
            raise TokenizerError(f"{path}: missing tokenizer.ggml.model")
        n = len(tokens)

        def token_id(key):
            return get(key, "int", lo=0, hi=n - 1)

        eot = [token_id(k) for k in ("eot_token_id", "eom_token_id")]
        args = dict(scores=get("scores", "array of float"), token_types=get("token_type", "array of int"),
                    merges=get("merges", "array of str"), pre=get("pre", "str", "default"),
                    bos_id=token_id("bos_token_id"), eos_id=token_id("eos_token_id"),
                    unk_id=token_id("unknown_token_id"), add_bos=get("add_bos_token", "bool", model == "llama"),
                    add_eos=get("add_eos_token", "bool", False),
                    add_space_prefix=get("add_space_prefix", "bool", model == "llama"),
                    eot_ids=[e for e in eot if e is not None])
        try:
            return cls(tokens, model=model, **args)
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}") from None

    def __len__(self) -> int:
        return len(self.tokens)

    # ------------------------------------------------------------------ encode
    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of ``text``. ``special``: also match control tokens written in the text
        (``<start_of_turn>``); user-defined tokens are always matched. BOS per the file unless given.
        Text that is not valid Unicode (a lone surrogate such as ``"\\udce9"``) is a TokenizerError."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text holds a lone surrogate U+{ord(text[e.start]):04X} at index {e.start}: "
                                 f"it has no UTF-8 encoding, so no tokens") from None
        ids = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError("this vocabulary has no BOS token")
            ids.append(self.bos_id)
        splitter = self._split_all if special else self._split_user
        parts = splitter.split(text) if splitter is not None else [text]
        first = True
        for k, part in enumerate(parts):
            if k % 2 == 1:  # a special token matched whole
                ids.append(self._special[part])
            elif part:
                if self.model == "llama":
                    if first and self.add_space_prefix:
                        part = " " + part
                    ids.extend(self._spm(part.replace(" ", "\u2581")))
                else:
                    for word in self._pre.findall(part):
                        ids.extend(self._bpe(word))
            first = False
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _spm(self, text: str) -> list[int]:
        if text in self._cache:
            return self._cache[text]
        sym = list(text)                      # symbols; merged ones become "" and are skipped
        nxt = list(range(1, len(sym) + 1))
        prv = list(range(-1, len(sym) - 1))
        heap = []

        def push(i, j):
            if j < len(sym):
                t = self._normal.get(sym[i] + sym[j])
                if t is not None:
                    heapq.heappush(heap, (-float(self.scores[t]), i, j, sym[i] + sym[j]))

        for i in range(len(sym) - 1):
            push(i, i + 1)
        while heap:
            _, i, j, piece = heapq.heappop(heap)
            if not sym[i] or not sym[j] or nxt[i] != j or sym[i] + sym[j] != piece:
                continue                       # stale: one side was merged since
            sym[i], sym[j] = piece, ""
            nxt[i] = nxt[j]
            if nxt[i] < len(sym):
                prv[nxt[i]] = i
            if prv[i] >= 0:
                push(prv[i], i)
            push(i, nxt[i])
        ids = []
        i = 0
        while i < len(sym):
            s = sym[i]
            t = self.vocab.get(s)
            if t is not None and self.types[t] in (NORMAL, USER_DEFINED):
                ids.append(t)
            else:
                for b in s.encode("utf-8"):
                    bt = self._byte_ids[b]
                    if bt is None:
                        if self.unk_id is None:
                            raise TokenizerError(f"byte {b:#x} of {s!r} has no token and there is no UNK token")
                        bt = self.unk_id
                    ids.append(bt)
            i = nxt[i]
        if len(self._cache) < 100_000:
            self._cache[text] = ids
        return ids

    def _bpe(self, word: str) -> list[int]:
        if word in self._cache:
            return self._cache[word]
        parts = [self._b2u[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            best, at = None, -1
            for k in range(len(parts) - 1):
                r = self._ranks.get((parts[k], parts[k + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, k
            if best is None:
                break
            a, b = parts[at], parts[at + 1]
            merged, k = [], 0
            while k < len(parts):             # merge every occurrence of this pair, left to right
                if k < len(parts) - 1 and parts[k] == a and parts[k + 1] == b:
                    merged.append(a + b)
                    k += 2
                else:
                    merged.append(parts[k])
                    k += 1
            parts = merged
        ids = []
        for p in parts:
            t = self.vocab.get(p)
            if t is None:
                if self.unk_id is None:
                    raise TokenizerError(f"piece {p!r} is not in the vocabulary and there is no UNK token")
                t = self.unk_id
            ids.append(t)
        if len(self._cache) < 100_000:
            self._cache[word] = ids
        return ids

    # ------------------------------------------------------------------ decode
    def token_bytes(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes one token stands for (control tokens: b"" unless ``special``)."""
        token_id = check_int("token id", token_id)
        if not 0 <= token_id < len(self.tokens):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary [0, {len(self.tokens)})")
        t, kind = self.tokens[token_id], self.types[token_id]
        if kind in (CONTROL, UNKNOWN, UNUSED):
            return t.encode("utf-8") if special else b""
        if kind == USER_DEFINED:
            return t.encode("utf-8")
        if self.model == "llama":
            if kind == BYTE:
                return bytes([int(t[3:5], 16)])
            return t.replace("\u2581", " ").encode("utf-8")
        return bytes(self._u2b[c] for c in t) if all(c in self._u2b for c in t) else t.encode("utf-8")

    def decode(self, ids, *, special: bool = False) -> str:
        ids = list(ids)
        data = b"".join(self.token_bytes(i, special=special) for i in ids)
        text = data.decode("utf-8", errors="replace")
        if self.model == "llama" and self.add_space_prefix and text.startswith(" "):
            first = next((int(i) for i in ids if self.types[int(i)] not in (CONTROL,)), None)
            if first is not None:
                text = text[1:]
        return text


class StreamDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self._pending = b""

    def push(self, token_id: int) -> str:
        data = self._pending + self.tok.token_bytes(token_id)
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                text = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._pending = data[cut:]
            return text
        self._pending = b""
        return data.decode("utf-8", errors="replace")

    def flush(self) -> str:
        text, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return text
