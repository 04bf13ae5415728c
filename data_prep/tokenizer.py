"""WordPiece tokenizer: train one on the corpus, or reuse a vocab.txt / tokenizer.json.

Whatever the origin, the result is saved to ``<output_dir>/tokenizer/`` with `vocab.txt`,
`tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`, so that
``transformers.BertTokenizerFast.from_pretrained(dir)`` loads it and encodes exactly like the
tokenizer that built the data (tested).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from data_prep.config import SPECIAL_TOKENS, TokenizerConfig
from data_prep.errors import PrepError

_SPECIAL_KEYS = ("pad", "unk", "cls", "sep", "mask")


@dataclass
class PreparedTokenizer:
    tokenizer: object             # tokenizers.Tokenizer, set up to encode corpus text
    vocab: list[str]              # token of each id
    special_ids: dict             # {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    do_lower_case: bool
    sha256: str                   # of vocab.txt

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def token_dtype(self) -> str:
        return "uint16" if self.vocab_size <= 65536 else "int32"

    def continuation_mask(self) -> np.ndarray:
        """True for '##' word-continuation pieces (whole-word masking groups on it)."""
        return np.array([t.startswith("##") for t in self.vocab], dtype=bool)

    def special_mask(self) -> np.ndarray:
        """True for tokens never predicted nor used as random replacements: the five special
        tokens and any other bracketed placeholder ([unused0], ... in Google's vocabs)."""
        return np.array([bool(re.fullmatch(r"\[[^\[\]\s]+\]", t)) for t in self.vocab],
                        dtype=bool) | np.isin(np.arange(len(self.vocab)),
                                              list(self.special_ids.values()))


def _check_vocab(vocab: dict, origin: str) -> dict:
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise PrepError(f"{origin} lacks the special token(s) {' '.join(missing)}: add them to "
                        "the vocabulary (BERT needs [PAD] [UNK] [CLS] [SEP] [MASK])")
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        raise PrepError(f"{origin}: token ids are not contiguous 0..{len(ids) - 1}: the "
                        "vocabulary is corrupt")
    return {k: vocab[t] for k, t in zip(_SPECIAL_KEYS, SPECIAL_TOKENS)}


def _post_processor(special_ids: dict):
    from tokenizers.processors import TemplateProcessing
    return TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", special_ids["cls"]), ("[SEP]", special_ids["sep"])])


def _from_vocab_txt(path: str, do_lower_case: bool):
    from tokenizers import BertWordPieceTokenizer
    vocab: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                token = line.rstrip("\n")
                if token in vocab:
                    raise PrepError(f"{path}: token {token!r} appears twice (lines "
                                    f"{vocab[token] + 1} and {i + 1}): fix the vocab file")
                vocab[token] = i
    except UnicodeDecodeError:
        raise PrepError(f"{path}: not a UTF-8 vocab.txt (one token per line)") from None
    _check_vocab(vocab, path)
    return BertWordPieceTokenizer(vocab, lowercase=do_lower_case)._tokenizer, do_lower_case


def _from_tokenizer_json(path: str):
    from tokenizers import Tokenizer
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        model = spec.get("model", {}).get("type")
        if model != "WordPiece":
            raise PrepError(f"{path} holds a {model} model: BERT needs a WordPiece tokenizer "
                            "(train one by leaving tokenizer.vocab_file unset)")
        tok = Tokenizer.from_file(path)
    except PrepError:
        raise
    except (ValueError, OSError, Exception) as e:
        raise PrepError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0]})") \
            from None
    return tok, normalizer_settings(tok)["do_lower_case"]


def normalizer_settings(tok) -> dict:
    """do_lower_case / strip_accents / tokenize_chinese_chars of a tokenizer's normaliser, as
    transformers' BertTokenizerFast names them: it rebuilds its BertNormalizer from these keys of
    tokenizer_config.json (ignoring tokenizer.json's), so they must describe ours exactly."""
    norm = json.loads(tok.to_str()).get("normalizer") or {}
    if norm.get("type") == "BertNormalizer":
        return {"do_lower_case": bool(norm.get("lowercase", False)),
                "strip_accents": norm.get("strip_accents"),
                "tokenize_chinese_chars": bool(norm.get("handle_chinese_chars", True))}
    # A chain of simple normalisers (or none): the nearest BertNormalizer settings.
    kinds = {n.get("type") for n in norm.get("normalizers", [norm])}
    return {"do_lower_case": "Lowercase" in kinds, "strip_accents": "StripAccents" in kinds,
            "tokenize_chinese_chars": False}


def load_tokenizer(path: str, do_lower_case: bool = True):
    """A tokenizers.Tokenizer from a vocab.txt, a tokenizer.json or a dir with either.

    A vocab.txt is normalised as `do_lower_case` says; a tokenizer.json carries its own
    normaliser, which wins (a one-line warning on stderr when `do_lower_case` disagrees)."""
    if os.path.isdir(path):
        for name in ("tokenizer.json", "vocab.txt"):
            if os.path.isfile(os.path.join(path, name)):
                return load_tokenizer(os.path.join(path, name), do_lower_case)
        raise PrepError(f"tokenizer.vocab_file={path!r} is a directory without vocab.txt or "
                        "tokenizer.json")
    if not os.path.isfile(path):
        raise PrepError(f"tokenizer.vocab_file={path!r}: no such file")
    if path.endswith(".json"):
        tok, lower = _from_tokenizer_json(path)
        if lower != do_lower_case:
            print(f"bert-prep: warning: tokenizer.do_lower_case={str(do_lower_case).lower()} is "
                  f"ignored: {path} has its own normaliser (lowercase={str(lower).lower()}), "
                  f"which is used", file=sys.stderr)
        return tok, lower
    return _from_vocab_txt(path, do_lower_case)


def train_tokenizer(cfg: TokenizerConfig, batches: Callable[[], Iterator[list[str]]],
                    progress: bool):
    from tokenizers import BertWordPieceTokenizer

    from bert_pretrain.components.progress import on_terminal
    wp = BertWordPieceTokenizer(lowercase=cfg.do_lower_case)
    wp.train_from_iterator(_limited(batches(), cfg.max_training_sentences),
                           vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                           limit_alphabet=cfg.limit_alphabet, special_tokens=list(SPECIAL_TOKENS),
                           show_progress=progress and on_terminal())
    # The trainer breaks ties between equally frequent pieces in hash-map order, so the same
    # vocabulary comes out with ids in a different order from run to run (and, about one run
    # in ten, with a different last piece when a tie straddles vocab_size).  WordPiece does not
    # care about ids: number the pieces canonically (special tokens, then code-point order) so
    # that the same vocabulary always gives the same ids and the same prepared data.
    return canonical(wp.get_vocab(), cfg.do_lower_case), cfg.do_lower_case


def canonical(vocab: dict, do_lower_case: bool):
    """A BERT WordPiece tokenizer whose ids depend only on the set of tokens."""
    from tokenizers import BertWordPieceTokenizer
    order = list(SPECIAL_TOKENS) + sorted(t for t in vocab if t not in SPECIAL_TOKENS)
    return BertWordPieceTokenizer({t: i for i, t in enumerate(order)},
                                  lowercase=do_lower_case)._tokenizer


def _limited(batches: Iterator[list[str]], limit) -> Iterator[list[str]]:
    """The first `limit` sentences (all when None): the trainer's word counts grow with the
    text it sees, so a huge corpus can train its vocabulary on a prefix."""
    left = limit
    for batch in batches:
        if left is not None:
            batch = batch[:left]
            left -= len(batch)
        if batch:
            yield batch
        if left == 0:
            return


def _finish(tok, do_lower_case: bool) -> PreparedTokenizer:
    vocab_map = tok.get_vocab(with_added_tokens=True)
    special_ids = _check_vocab(vocab_map, "the tokenizer")
    vocab = [""] * len(vocab_map)
    for t, i in vocab_map.items():
        vocab[i] = t
    tok.post_processor = _post_processor(special_ids)
    tok.no_truncation()
    tok.no_padding()
    text = "".join(t + "\n" for t in vocab).encode("utf-8")
    return PreparedTokenizer(tok, vocab, special_ids, do_lower_case,
                             hashlib.sha256(text).hexdigest())


def save_tokenizer(pt: PreparedTokenizer, directory: str, replace: bool = True) -> bool:
    """Write the four files transformers expects, into a temp dir renamed into place.
    With replace=False an existing directory wins (returns False): hosts sharing an output
    dir then all use the first tokenizer saved."""
    tmp = f"{directory}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "vocab.txt"), "w", encoding="utf-8") as f:
        f.writelines(t + "\n" for t in pt.vocab)
    pt.tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    names = dict(zip(_SPECIAL_KEYS, SPECIAL_TOKENS))
    special_map = {f"{k}_token": v for k, v in names.items()}
    config = {"tokenizer_class": "BertTokenizer", **normalizer_settings(pt.tokenizer),
              "model_max_length": 512,
              "clean_up_tokenization_spaces": False, **special_map}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
    if replace:
        shutil.rmtree(directory, ignore_errors=True)
    try:
        os.rename(tmp, directory)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if replace or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
            raise
        return False
    return True


def prepare_tokenizer(cfg: TokenizerConfig, batches: Callable[[], Iterator[list[str]]],
                      directory: str, progress: bool = True, reuse_saved: bool = False
                      ) -> PreparedTokenizer:
    """Train or load the tokenizer, save it to `directory`, and return it ready to encode.

    `reuse_saved`: a resumed prep loads the tokenizer it saved before instead of retraining.
    """
    saved = os.path.join(directory, "tokenizer.json")
    if reuse_saved and os.path.isfile(saved):
        tok, lower = _from_tokenizer_json(saved)
        return _ready(_warn_if_short(cfg, _finish(tok, lower)))
    if cfg.vocab_file:
        tok, lower = load_tokenizer(os.path.expanduser(cfg.vocab_file), cfg.do_lower_case)
    else:
        tok, lower = train_tokenizer(cfg, batches, progress)
    pt = _finish(tok, lower)
    # An existing directory can only be another host's of this same prep (a new or
    # re-configured prep starts from an empty output dir): the first one saved wins.
    if not save_tokenizer(pt, directory, replace=False):
        tok, lower = _from_tokenizer_json(saved)
        pt = _finish(tok, lower)
    return _ready(_warn_if_short(cfg, pt))


def vocab_shortfall(cfg: TokenizerConfig, vocab_size: int) -> str | None:
    """Why a trained vocabulary has fewer pieces than tokenizer.vocab_size, or None.

    The WordPiece trainer grows the vocabulary by merging the most frequent pair of adjacent
    pieces until it has vocab_size pieces or no pair occurs min_frequency times: then every
    frequent word is already one piece, and a small corpus stops it early (Python's topic docs,
    0.5 MB, give 4,320 pieces of 8,000).  The model then has the smaller vocabulary: it is the
    manifest's vocab_size."""
    if cfg.vocab_file or vocab_size >= cfg.vocab_size:
        return None
    return (f"the trained vocabulary has {vocab_size:,} pieces, not tokenizer.vocab_size="
            f"{cfg.vocab_size:,}: the corpus ran out of merges (no pair of pieces left occurs "
            f"tokenizer.min_frequency={cfg.min_frequency} times or more); more text gives more "
            f"pieces")


def _warn_if_short(cfg: TokenizerConfig, pt: PreparedTokenizer) -> PreparedTokenizer:
    why = vocab_shortfall(cfg, pt.vocab_size)
    # (nothing but the special tokens: the corpus held no text, which is an error said later)
    if why and pt.vocab_size > len(SPECIAL_TOKENS):
        print(f"bert-prep: warning: {why}", file=sys.stderr, flush=True)
    return pt


def _ready(pt: PreparedTokenizer) -> PreparedTokenizer:
    # Corpus text is data: a literal "[MASK]" in it must be tokenized as text, not turned into
    # the special token (which would corrupt the instance structure).
    pt.tokenizer.encode_special_tokens = True
    return pt
