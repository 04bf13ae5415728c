"""Each corpus source, read through the same pipeline."""
from __future__ import annotations

import json

import pytest

from data_prep.config import (BuiltinCorpusConfig, DocumentsCorpusConfig, HFCorpusConfig,
                              TextCorpusConfig)
from data_prep.corpus import read_corpus
from data_prep.errors import PrepError
from data_prep.pipeline import run


def _docs(cfg):
    """The corpus as a list of documents (lists of sentences)."""
    docs = []
    for new, s in read_corpus(cfg):
        if new:
            docs.append([])
        docs[-1].append(s)
    return docs


def test_text_files_dirs_and_globs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1.txt").write_text("One.\nTwo.\n\n\n  \nThree.\n", encoding="utf-8")
    (tmp_path / "a" / "2.txt").write_text("Four.\n\nFive.\nSix.", encoding="utf-8")
    (tmp_path / "a" / ".hidden").write_text("never read\n", encoding="utf-8")
    expect = [["One.", "Two."], ["Three."], ["Four."], ["Five.", "Six."]]
    assert _docs(TextCorpusConfig(paths=[str(tmp_path / "a")])) == expect
    assert _docs(TextCorpusConfig(paths=[str(tmp_path / "a" / "*.txt")])) == expect
    assert _docs(TextCorpusConfig(paths=[str(tmp_path / "a" / "2.txt"),
                                         str(tmp_path / "a" / "1.txt")])) == expect[2:] + expect[:2]


def test_documents_split_into_sentences_by_blingfire(tmp_path):
    (tmp_path / "d1.txt").write_text(
        "Dr. Smith paid $3.50 for it. He was happy!\nThe line goes on here.\n\n"
        "A second paragraph. It has \"quotes.\" Right?\n", encoding="utf-8")
    (tmp_path / "d2.txt").write_text("Another document, one sentence.\n", encoding="utf-8")
    per_file = _docs(DocumentsCorpusConfig(paths=[str(tmp_path)]))
    assert per_file == [["Dr. Smith paid $3.50 for it.", "He was happy!",
                         "The line goes on here.", "A second paragraph.",
                         "It has \"quotes.\"", "Right?"],
                        ["Another document, one sentence."]]
    per_block = _docs(DocumentsCorpusConfig(paths=[str(tmp_path)], document_per="blank_line"))
    assert per_block == [per_file[0][:3], per_file[0][3:], per_file[1]]


def test_builtin_corpus_is_real_english():
    docs = _docs(BuiltinCorpusConfig())
    assert len(docs) > 300
    text = " ".join(s for d in docs for s in d)
    assert 1_500_000 < len(text) < 10_000_000
    for word in ("the", "function", "returns", "module", "object"):
        assert f" {word} " in text
    assert not any(s.startswith(">>>") for d in docs for s in d)
    assert len(_docs(BuiltinCorpusConfig(include_docstrings=False))) < 200


def test_builtin_corpus_adds_installed_packages_docstrings(tmp_path, monkeypatch):
    """corpus.packages: every module of the package with a docstring is one document, its
    doctest lines left out, its tests/ skipped; nothing is imported (a module that would raise
    on import is read all the same)."""
    from data_prep.corpus import fingerprint

    pkg = tmp_path / "fakedocs"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "tests").mkdir()
    (pkg / "__init__.py").write_text('"""The package. It has two sentences."""\n'
                                     'raise RuntimeError("never imported")\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "tools.py").write_text(
        'def f():\n    """Return the answer.\n\n    >>> f() == 42\n    """\n    return 42\n')
    (pkg / "tests" / "test_x.py").write_text('"""A test module, not prose."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = BuiltinCorpusConfig(include_topics=False, include_docstrings=False,
                              packages=["fakedocs"])
    assert _docs(cfg) == [["The package.", "It has two sentences."], ["Return the answer."]]
    assert fingerprint(cfg)["package fakedocs"] == ""  # no distribution metadata: no version
    with_stdlib = _docs(BuiltinCorpusConfig(include_topics=False, packages=["fakedocs"]))
    assert len(with_stdlib) > 100 and with_stdlib[-1] == ["Return the answer."]
    for bad, message in ((["no_such_pkg_xyz"], "'no_such_pkg_xyz' is not an installed package"),
                         (["os.path"], "is not a top-level package name"),
                         ([3], "must be a list of package names")):
        with pytest.raises(PrepError, match=message):
            BuiltinCorpusConfig(packages=bad)


@pytest.fixture(scope="module")
def rows():
    # 6 documents of paragraph text.
    return [{"id": i, "text": f"Document {i} starts here. It talks about topic {i}.\n\n"
                             f"Its second paragraph has more words in it. The end of {i}."}
            for i in range(6)]


@pytest.fixture(scope="module")
def hf_sources(rows, tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    d = tmp_path_factory.mktemp("prep_hf")
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(d / "data.parquet"))
    with open(d / "data.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    ds.save_to_disk(str(d / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(
        str(d / "saved_dict"))
    return d


@pytest.mark.parametrize("kind", ["parquet", "json", "saved", "saved_dict"])
@pytest.mark.parametrize("streaming", [False, True])
def test_hf_sources(hf_sources, kind, streaming):
    d = hf_sources
    if kind in ("parquet", "json"):
        cfg = HFCorpusConfig(name=kind, data_files=str(d / ("data." + (
            "parquet" if kind == "parquet" else "jsonl"))), streaming=streaming,
            cache_dir=str(d / "cache"))
    else:
        cfg = HFCorpusConfig(name=str(d / kind), streaming=streaming)
    docs = _docs(cfg)
    assert len(docs) == 6
    assert docs[2] == ["Document 2 starts here.", "It talks about topic 2.",
                       "Its second paragraph has more words in it.", "The end of 2."]
    cfg.max_documents = 4
    assert len(_docs(cfg)) == 4


def test_hf_lines_mode(hf_sources):
    docs = _docs(HFCorpusConfig(name=str(hf_sources / "saved"), sentence_split="lines"))
    assert docs[0] == ["Document 0 starts here. It talks about topic 0.",
                       "Its second paragraph has more words in it. The end of 0."]


def test_hf_errors(hf_sources):
    d = hf_sources
    with pytest.raises(PrepError, match=r"text_column='body' is not a column .*\['id', 'text'\]"):
        _docs(HFCorpusConfig(name=str(d / "saved"), text_column="body"))
    with pytest.raises(PrepError, match=r"split='validation' is not in"):
        _docs(HFCorpusConfig(name=str(d / "saved_dict"), split="validation"))
    with pytest.raises(PrepError, match="text_column='id' holds int"):
        _docs(HFCorpusConfig(name=str(d / "saved"), text_column="id"))
    with pytest.raises(PrepError, match="cannot load dataset"):
        _docs(HFCorpusConfig(name="parquet", data_files=str(d / "missing.parquet"),
                             cache_dir=str(d / "cache")))


def test_hf_source_end_to_end(prep_compose, hf_sources, tmp_path):
    m = run(prep_compose("corpus=hf", "corpus.name=parquet",
                         f"corpus.data_files={hf_sources / 'data.parquet'}",
                         f"corpus.cache_dir={hf_sources / 'cache'}", "corpus.streaming=true",
                         f"output_dir={tmp_path}", "tokenizer.vocab_size=100",
                         "tokenizer.min_frequency=1", "max_seq_length=32",
                         "validation_fraction=0.2"))
    assert m["counts"]["num_documents"] == 6 and m["counts"]["num_sentences"] == 24
    assert m["splits"]["validation"]["num_documents"] == 2
    assert m["stats"]["num_instances"] > 0


def test_text_and_documents_end_to_end(prep_compose, tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(5):
        (src / f"{i}.txt").write_text(" ".join(f"Sentence {j} of file {i} is here."
                                               for j in range(30)), encoding="utf-8")
    m = run(prep_compose("corpus=documents", f"corpus.paths=[{src}]",
                         f"output_dir={tmp_path / 'out'}", "tokenizer.vocab_size=100",
                         "tokenizer.min_frequency=1", "max_seq_length=32", "dupe_factor=2",
                         "validation_fraction=0"))
    assert m["counts"]["num_documents"] == 5 and m["counts"]["num_sentences"] == 150
    assert m["splits"]["validation"]["num_instances"] == 0
    assert m["splits"]["train"]["num_instances"] > 50


# ---- compressed corpus files -----------------------------------------------------------------
PLAIN = "One.\nTwo.\n\nThree.\nFour.\nBZh91AY&SY is text here.\n"
EXPECT = [["One.", "Two."], ["Three.", "Four.", "BZh91AY&SY is text here."]]


def _compressors():
    import bz2
    import gzip
    import lzma
    found = {"gzip": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}
    try:
        import zstandard
        found["zstd"] = zstandard.ZstdCompressor().compress
    except ImportError:
        pass
    return found


@pytest.mark.parametrize("kind", sorted(_compressors()))
@pytest.mark.parametrize("name", ["corpus.{kind}", "misleading.txt", "no_extension"])
def test_compressed_files_are_read_by_their_magic_bytes(tmp_path, kind, name):
    path = tmp_path / name.format(kind=kind)
    path.write_bytes(_compressors()[kind](PLAIN.encode()))
    assert _docs(TextCorpusConfig(paths=[str(path)])) == EXPECT
    assert _docs(DocumentsCorpusConfig(paths=[str(path)], document_per="blank_line")) == [
        ["One.", "Two."], ["Three.", "Four.", "BZh91AY&SY is text here."]]


@pytest.mark.parametrize("kind", sorted(_compressors()))
def test_a_compressed_file_cut_short_is_an_error_not_a_shorter_corpus(tmp_path, kind):
    """A download cut off mid-file: every format must say so, never read the part that arrived
    as if it were the whole corpus (zstandard's stream_reader returned it without a word)."""
    lines = [f"Sentence {i} of a corpus that compresses to more than one block." for i in
             range(20000)]
    whole = _compressors()[kind](("\n".join(lines) + "\n").encode())
    (tmp_path / "cut").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(PrepError, match=rf"cut: corrupt or truncated {kind} data") as e:
        _docs(TextCorpusConfig(paths=[str(tmp_path / "cut")]))
    assert "\n" not in str(e.value)


def test_a_zstd_file_of_several_frames_is_read_whole(tmp_path):
    """`cat a.zst b.zst > c.zst` is a valid zstd file: every frame is read, in order."""
    zstandard = pytest.importorskip("zstandard")
    first, second = "One.\nTwo.\n\n", "Three.\nFour.\n"
    (tmp_path / "c.zst").write_bytes(zstandard.ZstdCompressor().compress(first.encode()) +
                                     zstandard.ZstdCompressor().compress(second.encode()))
    assert _docs(TextCorpusConfig(paths=[str(tmp_path / "c.zst")])) == [["One.", "Two."],
                                                                       ["Three.", "Four."]]


def test_text_that_starts_like_a_magic_number_is_text(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("BZh9 is a bzip2 header.\n\nPK is a zip header.\n", encoding="utf-8")
    assert _docs(TextCorpusConfig(paths=[str(path)])) == [["BZh9 is a bzip2 header."],
                                                          ["PK is a zip header."]]


def test_bad_compressed_and_archive_files_are_one_line_errors(tmp_path):
    import gzip
    import io
    import tarfile
    import zipfile
    data = gzip.compress(PLAIN.encode() * 200)
    (tmp_path / "truncated.gz").write_bytes(data[:len(data) // 2])
    (tmp_path / "latin1.txt.gz").write_bytes(gzip.compress("Café crème.\n".encode("latin-1")))
    with zipfile.ZipFile(tmp_path / "c.zip", "w") as z:
        z.writestr("c.txt", PLAIN)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        info = tarfile.TarInfo("c.txt")
        info.size = len(PLAIN)
        t.addfile(info, io.BytesIO(PLAIN.encode()))
    (tmp_path / "c.tgz").write_bytes(buf.getvalue())
    (tmp_path / "c.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 20)
    cases = {
        "truncated.gz": r"truncated\.gz: corrupt or truncated gzip data \(.*\): check it, "
                        r"e\.g\. `gzip -t .*truncated\.gz`",
        "latin1.txt.gz": r"latin1\.txt\.gz: not UTF-8 text \(gzip-compressed, invalid byte "
                         r"0xe9 at line 1, byte 3\): convert it",
        "c.zip": r"c\.zip is a zip archive, not text: extract it \(`unzip`\)",
        "c.tgz": r"c\.tgz is a gzip-compressed tar archive, not text: extract it",
    }
    try:
        import zstandard  # noqa: F401
        cases["c.zst"] = r"c\.zst: corrupt or truncated zstd data"
    except ImportError:
        cases["c.zst"] = (r"c\.zst is zstd-compressed and the zstandard package is not "
                          r"installed: decompress it \(`zstd -d .*c\.zst`\) or `pip install "
                          r"zstandard`")
    for name, pattern in cases.items():
        with pytest.raises(PrepError, match=pattern) as e:
            _docs(TextCorpusConfig(paths=[str(tmp_path / name)]))
        assert "\n" not in str(e.value)
