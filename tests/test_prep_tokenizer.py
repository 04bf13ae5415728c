"""Tokenizer: trained or reused, saved so transformers.BertTokenizerFast encodes identically;
the cached corpus encoder is exact."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data_prep.config import TextCorpusConfig, TokenizerConfig
from data_prep.encoder import CorpusEncoder
from data_prep.errors import PrepError
from data_prep.pipeline import _sentence_batches, run
from data_prep.tokenizer import load_tokenizer, prepare_tokenizer

TRICKY = [
    "Hello, World!! It's 3.14 -- naïve café, résumé; Ünïcödé.",
    "Tabs\tand  double  spaces , and (parentheses) [brackets] {braces} \"quotes\"",
    "ΣΑΣ'Α ΌΛΟΙ σας İstanbul ǅ ß ﬁ Straße",
    "中文字符 and 日本語のテキスト mixed with English words",
    "e\u0301 combining accents a\u0300\u0301 and zero\u200bwidth and control\x07char",
    "[MASK] and [CLS] written in text are text, not special tokens",
    "averyveryveryverylongwordthatwillneverbeinanyvocabularyatallreallyverylongindeedyesxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
    "emoji 😀 🎉 and symbols © ® ™ ° ± µ § ¶",
    "",
    "   ",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prep_small):
    out = {}
    for lower in (True, False):
        d = str(tmp_path_factory.mktemp("prep_tok") / "tokenizer")
        pt = prepare_tokenizer(TokenizerConfig(vocab_size=3000, do_lower_case=lower),
                               lambda: _sentence_batches(TextCorpusConfig(
                                   paths=[prep_small])), d, progress=False)
        out[lower] = (d, pt)
    return out


def _sample_lines(path, n=3000):
    lines = [ln.strip() for ln in open(path, encoding="utf-8") if ln.strip()]
    return lines[:: max(1, len(lines) // n)] + TRICKY


@pytest.mark.parametrize("lower", [True, False])
def test_transformers_loads_and_encodes_identically(trained, lower, prep_small):
    transformers = pytest.importorskip("transformers")
    d, pt = trained[lower]
    hf = transformers.BertTokenizerFast.from_pretrained(d)
    assert len(hf) == pt.vocab_size
    assert hf.cls_token_id == pt.special_ids["cls"] and hf.mask_token_id == pt.special_ids["mask"]
    lines = _sample_lines(prep_small)
    ids, lens = CorpusEncoder(pt.tokenizer, pt.token_dtype).encode(lines)
    ours = np.split(ids.astype(np.int64), np.cumsum(lens)[:-1])
    for text, o in zip(lines, ours):
        if "[MASK]" in text:     # transformers treats literal special tokens in text as special
            continue
        assert hf(text)["input_ids"] == [pt.special_ids["cls"], *o.tolist(),
                                         pt.special_ids["sep"]], text
    # A pair encodes as [CLS] A [SEP] B [SEP] with segment ids, like the prepared rows.
    enc = hf("first part", "second part")
    assert enc["input_ids"][0] == pt.special_ids["cls"]
    assert enc["token_type_ids"][-1] == 1 and enc["token_type_ids"][0] == 0
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        assert json.load(f)["do_lower_case"] is lower


@pytest.mark.parametrize("lower", [True, False])
def test_cached_encoder_is_exact(trained, lower, prep_small):
    _, pt = trained[lower]
    lines = _sample_lines(prep_small, 20000)
    enc = CorpusEncoder(pt.tokenizer, pt.token_dtype, max_cache=500)   # also exercises reset
    assert enc.cached
    got = [enc.encode(lines[i:i + 700]) for i in range(0, len(lines), 700)]
    ids = np.concatenate([g[0] for g in got])
    lens = np.concatenate([g[1] for g in got])
    ref = pt.tokenizer.encode_batch(lines, add_special_tokens=False)
    assert lens.tolist() == [len(e.ids) for e in ref]
    assert ids.tolist() == [i for e in ref for i in e.ids]


def test_reuse_vocab_txt_and_tokenizer_json(trained, tmp_path):
    d, pt = trained[True]
    for name in ("vocab.txt", "tokenizer.json"):
        out = str(tmp_path / name)
        again = prepare_tokenizer(TokenizerConfig(vocab_file=os.path.join(d, name)), None, out,
                                  progress=False)
        assert again.sha256 == pt.sha256 and again.do_lower_case
        a = again.tokenizer.encode_batch(TRICKY, add_special_tokens=False)
        b = pt.tokenizer.encode_batch(TRICKY, add_special_tokens=False)
        assert [e.ids for e in a] == [e.ids for e in b]
    # A directory holding them works too.
    assert prepare_tokenizer(TokenizerConfig(vocab_file=d), None, str(tmp_path / "dir"),
                             progress=False).sha256 == pt.sha256


def test_bad_vocabularies(tmp_path):
    bad = tmp_path / "vocab.txt"
    bad.write_text("[PAD]\n[UNK]\nhello\nworld\n", encoding="utf-8")
    with pytest.raises(PrepError, match=r"lacks the special token\(s\) \[CLS\] \[SEP\] \[MASK\]"):
        load_tokenizer(str(bad))
    with pytest.raises(PrepError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing.txt"))
    bpe = tmp_path / "bpe.json"
    from tokenizers import Tokenizer, models
    Tokenizer(models.BPE()).save(str(bpe))
    with pytest.raises(PrepError, match="holds a BPE model"):
        load_tokenizer(str(bpe))


def test_trained_vocab_prep_end_to_end(prep_compose, prep_small, tmp_path, capsys):
    m = run(prep_compose("corpus=text", f"corpus.paths=[{prep_small}]",
                         f"output_dir={tmp_path}", "tokenizer.vocab_size=2000", "dupe_factor=1"))
    assert m["vocab_size"] == 2000 and m["token_dtype"] == "uint16"
    assert m["tokenizer"]["vocab_size_asked"] == 2000 and m["tokenizer"]["vocab_shortfall"] is None
    out, err = capsys.readouterr()
    assert "warning" not in err and out.rstrip().endswith("; vocabulary: 2,000 pieces")
    assert m["special_token_ids"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    vocab = open(tmp_path / "tokenizer" / "vocab.txt", encoding="utf-8").read().split("\n")
    assert len(vocab) - 1 == 2000 and vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    import hashlib
    assert m["tokenizer"]["sha256"] == hashlib.sha256(
        (tmp_path / "tokenizer" / "vocab.txt").read_bytes()).hexdigest()


def test_a_vocabulary_smaller_than_asked_is_one_warning_and_recorded(prep_compose, tmp_path,
                                                                      capsys):
    """A small corpus runs out of merges before tokenizer.vocab_size pieces: bert-prep says so
    (both numbers and why) in one line, the manifest records it, the final line repeats it."""
    words = [f"word{i}" for i in range(50)]
    corpus = tmp_path / "small.txt"
    corpus.write_text("\n\n".join("\n".join(" ".join(words[(d + s + k) % 50] for k in range(12))
                                             + " ." for s in range(6)) for d in range(20)),
                      encoding="utf-8")
    m = run(prep_compose("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={tmp_path / 'o'}",
                         "tokenizer.vocab_size=3000", "dupe_factor=1"))
    n = m["vocab_size"]
    assert 60 < n < 3000
    why = (f"the trained vocabulary has {n:,} pieces, not tokenizer.vocab_size=3,000: the corpus "
           "ran out of merges (no pair of pieces left occurs tokenizer.min_frequency=2 times or "
           "more); more text gives more pieces")
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == f"bert-prep: warning: {why}"
    assert sum("warning" in ln for ln in err.splitlines()) == 1
    assert m["tokenizer"]["vocab_size_asked"] == 3000 and m["tokenizer"]["vocab_shortfall"] == why
    assert out.rstrip().endswith(f"; vocabulary: {n:,} pieces of the 3,000 asked (see the "
                                 "warning above)")
    # a given vocabulary (tokenizer.vocab_file) is used as it is: nothing to warn about
    assert len(open(tmp_path / "o" / "tokenizer" / "vocab.txt").read().splitlines()) == n
    m = run(prep_compose("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={tmp_path / 'v'}",
                         f"tokenizer.vocab_file={tmp_path / 'o' / 'tokenizer' / 'vocab.txt'}",
                         "tokenizer.vocab_size=3000", "dupe_factor=1"))
    assert "warning" not in capsys.readouterr().err
    assert "vocab_size_asked" not in m["tokenizer"]


def test_google_style_vocab_layout_and_int32_ids(prep_compose, prep_tagged, tmp_path):
    """Google's vocab layout ([PAD] 0, [unused*], [UNK] 100, [CLS] 101 ...), grown past 65,536
    entries: ids are stored as int32, the special ids come from the vocab, and no [unusedN] is
    ever predicted or inserted as a random replacement."""
    from prep_arrays import load_manifest, load_split
    corpus, _ = prep_tagged
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]",
                                                                 "[MASK]"]
    tokens += [f"d{i}" for i in range(40)] + [f"k{i}" for i in range(40)]
    tokens += [f"filler{i}" for i in range(70000)]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    run(prep_compose("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={out}",
                     f"tokenizer.vocab_file={vocab}", "max_seq_length=64", "dupe_factor=3"))
    m = load_manifest(out)
    assert m["token_dtype"] == "int32" and m["vocab_size"] == len(tokens)
    assert m["special_token_ids"] == {"pad": 0, "unk": 99 + 1, "cls": 101, "sep": 102,
                                      "mask": 103}
    a = load_split(out)
    assert a["input_ids"].dtype == np.int32 and a["masked_labels"].dtype == np.int32
    assert (a["input_ids"][:, 0] == 101).all()
    assert not ((a["input_ids"] >= 1) & (a["input_ids"] <= 99)).any()     # no [unusedN]
    sel = a["masked_positions"] > 0
    assert (a["masked_labels"][sel] >= 104).all()
    # Random replacements do reach the large ids.
    assert (a["input_ids"] >= 65536).any()


def test_sentences_without_tokens_are_dropped_documents_kept(tmp_path, trained):
    from data_prep.token_store import tokenize_corpus
    _, pt = trained[True]
    stream = [(True, "first doc one."), (False, "\x07"), (False, "first doc two."),
              (True, "\x07\x07"), (False, "second doc, after an empty first sentence."),
              (True, "\x08"),                            # a document with no token at all
              (True, "third doc.")]
    for batch in (1, 2, 100):
        store = tokenize_corpus(iter(stream), pt.tokenizer, str(tmp_path / f"t{batch}"),
                                "uint16", batch, progress=False)
        assert store.num_sentences == 4 and store.num_documents == 3
        assert store.doc_off.tolist() == [0, 2, 3, 4]


def test_training_on_a_prefix(prep_compose, prep_small, tmp_path):
    from data_prep.tokenizer import _limited
    batches = iter([["a", "b", "c"], ["d", "e"], ["f"]])
    assert list(_limited(batches, 4)) == [["a", "b", "c"], ["d"]]
    full = prepare_tokenizer(TokenizerConfig(vocab_size=3000), lambda: _sentence_batches(
        TextCorpusConfig(paths=[prep_small])), str(tmp_path / "a"), progress=False)
    prefix = prepare_tokenizer(TokenizerConfig(vocab_size=3000, max_training_sentences=300),
                               lambda: _sentence_batches(TextCorpusConfig(
                                   paths=[prep_small])), str(tmp_path / "b"),
                               progress=False)
    assert prefix.vocab_size < full.vocab_size      # 300 sentences cannot fill 3,000 entries


def test_trained_ids_depend_only_on_the_token_set(trained):
    # The tokenizers trainer orders equally frequent pieces differently from run to run: the
    # canonical numbering gives the same ids for the same set of tokens, in whatever order.
    import random
    from data_prep.tokenizer import canonical
    _, pt = trained[True]
    assert pt.vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert pt.vocab[5:] == sorted(pt.vocab[5:])
    shuffled = list(pt.vocab)
    random.Random(0).shuffle(shuffled)
    again = canonical({t: i for i, t in enumerate(shuffled)}, True)
    assert again.get_vocab() == pt.tokenizer.get_vocab()
    assert again.encode_batch(TRICKY, add_special_tokens=False)[0].ids == \
        pt.tokenizer.encode_batch(TRICKY, add_special_tokens=False)[0].ids


def test_a_second_host_uses_the_tokenizer_saved_first(trained, tmp_path):
    d, pt = trained[True]
    import shutil
    shared = tmp_path / "tokenizer"
    shutil.copytree(d, shared)
    other = tmp_path / "other_vocab.txt"
    other.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")
    # reuse_saved with a saved tokenizer: loaded, nothing trained or replaced.
    got = prepare_tokenizer(TokenizerConfig(vocab_file=str(other)), None, str(shared),
                            progress=False, reuse_saved=True)
    assert got.sha256 == pt.sha256
    # A racing host that finished second keeps the first one's files and uses them.
    from data_prep.tokenizer import _finish, load_tokenizer, save_tokenizer
    mine = _finish(*load_tokenizer(str(other)))
    assert save_tokenizer(mine, str(shared), replace=False) is False
    assert (shared / "vocab.txt").read_text(encoding="utf-8").count("\n") == pt.vocab_size


_NORMALISER_TEXTS = ["Café naïve résumé déjà", "CAFÉ Naïve cafe naive", "中文字符 and 日本語",
                     "Ünïcödé ñ ç ø", "plain ascii words"]


def _small_vocab():
    chars = sorted(set("".join(_NORMALISER_TEXTS) + "".join(_NORMALISER_TEXTS).lower()
                       + "abcdefghijklmnopqrstuvwxyz") - {" "})
    words = ["café", "naïve", "résumé", "déjà", "cafe", "naive", "resume", "deja", "plain",
             "ascii", "words", "and", "中文字符", "日本語", "Café", "CAFÉ", "Naïve"]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words + chars + ["##" + c for c in chars]
    return {t: i for i, t in enumerate(dict.fromkeys(vocab))}


@pytest.mark.parametrize("settings", [
    dict(lowercase=True, strip_accents=False, handle_chinese_chars=True),
    dict(lowercase=True, strip_accents=None, handle_chinese_chars=True),
    dict(lowercase=False, strip_accents=None, handle_chinese_chars=True),
    dict(lowercase=False, strip_accents=True, handle_chinese_chars=False),
    dict(lowercase=True, strip_accents=True, handle_chinese_chars=False),
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_reused_tokenizer_json_round_trips_accents_and_cjk(tmp_path, settings, capsys):
    """A reused tokenizer.json's normaliser settings reach tokenizer_config.json, so that
    transformers' BertTokenizerFast (which rebuilds its normaliser from that file) encodes
    exactly like the tokenizer that wrote the data: accents kept or stripped, CJK split or not,
    case kept or lowered."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import BertWordPieceTokenizer
    src = tmp_path / "tokenizer.json"
    BertWordPieceTokenizer(_small_vocab(), clean_text=True, **settings)._tokenizer.save(str(src))
    out = tmp_path / "out"
    pt = prepare_tokenizer(TokenizerConfig(vocab_file=str(src),
                                           do_lower_case=settings["lowercase"]),
                           None, str(out), progress=False)
    assert capsys.readouterr().err == ""          # do_lower_case agrees: no warning
    hf = transformers.BertTokenizerFast.from_pretrained(str(out))
    ours = pt.tokenizer.encode_batch(_NORMALISER_TEXTS, add_special_tokens=False)
    for text, enc in zip(_NORMALISER_TEXTS, ours):
        assert hf(text, add_special_tokens=False)["input_ids"] == enc.ids, text
    unk = pt.special_ids["unk"]
    if settings["strip_accents"] is False:        # the accented words are in the vocab
        assert unk not in ours[0].ids
    cfg = json.load(open(out / "tokenizer_config.json"))
    assert cfg["do_lower_case"] is settings["lowercase"]
    assert cfg["tokenize_chinese_chars"] is settings["handle_chinese_chars"]


def test_vocab_txt_cased_round_trips_accents_and_cjk(tmp_path):
    transformers = pytest.importorskip("transformers")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(t + "\n" for t in _small_vocab()), encoding="utf-8")
    pt = prepare_tokenizer(TokenizerConfig(vocab_file=str(vocab), do_lower_case=False), None,
                           str(tmp_path / "out"), progress=False)
    hf = transformers.BertTokenizerFast.from_pretrained(str(tmp_path / "out"))
    for text, enc in zip(_NORMALISER_TEXTS,
                         pt.tokenizer.encode_batch(_NORMALISER_TEXTS, add_special_tokens=False)):
        assert hf(text, add_special_tokens=False)["input_ids"] == enc.ids, text
    assert hf.tokenize("Café") == ["Café"]         # cased: neither lowered nor stripped


def test_do_lower_case_that_disagrees_with_a_tokenizer_json_is_reported(tmp_path, capsys):
    from tokenizers import BertWordPieceTokenizer
    src = tmp_path / "tokenizer.json"
    BertWordPieceTokenizer(_small_vocab(), lowercase=False)._tokenizer.save(str(src))
    pt = prepare_tokenizer(TokenizerConfig(vocab_file=str(src), do_lower_case=True), None,
                           str(tmp_path / "out"), progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer.do_lower_case=true is ignored" in err[0], err
    assert "tokenizer.json" in err[0] and not pt.do_lower_case
