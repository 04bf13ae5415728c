"""Resume after a crash, split over hosts, merge: always the same bytes as one clean run, and
no manifest until every shard exists."""
from __future__ import annotations

import filecmp
import os
import shutil

import pytest

from data_prep import pipeline
from data_prep.errors import PrepError
from data_prep.pipeline import run


@pytest.fixture(scope="module")
def setup(prep_compose, prep_tagged, tmp_path_factory):
    corpus, vocab = prep_tagged
    base = tmp_path_factory.mktemp("prep_resume")

    def cfg(out, *extra):
        return prep_compose("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={out}",
                            f"tokenizer.vocab_file={vocab}", "max_seq_length=64",
                            "dupe_factor=3", "tokens_per_shard=2000",
                            "validation_fraction=0.1", "num_proc=1", *extra)
    ref = base / "ref"
    manifest = run(cfg(ref))
    return cfg, ref, manifest, base


def _shards(m):
    return [s["path"] for sp in m["splits"].values() for s in sp["shards"]]


def same_as_ref(out, ref, m):
    assert os.path.exists(out / "manifest.json")
    for s in _shards(m):
        cmp = filecmp.dircmp(ref / s, out / s)
        assert not cmp.left_only and not cmp.right_only, s
        for f in cmp.common_files:
            assert filecmp.cmp(ref / s / f, out / s / f, shallow=False), f"{s}/{f}"
    assert not any(n.startswith(".tmp") for sp in ("train", "validation")
                   for n in os.listdir(out / sp))


def test_resume_after_crash(setup, monkeypatch):
    cfg, ref, m, base = setup
    assert len(_shards(m)) >= 8
    out = base / "crash"
    real = pipeline._build_shard
    calls = []

    def dying(task):
        if len(calls) == 4:
            # Simulate the process dying mid-shard: a half-written temp dir stays behind.
            split, index = task
            half = out / split / f".tmp-shard-{index:05d}-otherhost-99"
            half.mkdir(parents=True)
            (half / "input_ids.npy").write_bytes(b"\x93NUMPY garbage")
            raise KeyboardInterrupt
        calls.append(task)
        return real(task)
    monkeypatch.setattr(pipeline, "_build_shard", dying)
    with pytest.raises(KeyboardInterrupt):
        run(cfg(out))
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(pipeline, "_build_shard", real)

    built = []
    monkeypatch.setattr(pipeline, "_build_shard", lambda t: (built.append(t), real(t))[1])
    run(cfg(out))
    assert len(built) == len(_shards(m)) - 4          # finished shards were skipped
    same_as_ref(out, ref, m)
    # A complete dir: a re-run does nothing and returns the manifest.
    built.clear()
    assert run(cfg(out))["stats"] == m["stats"]
    assert built == []


def test_deleted_shards_are_rebuilt_identically(setup):
    cfg, ref, m, base = setup
    out = base / "deleted"
    shutil.copytree(ref, out)
    os.remove(out / "manifest.json")
    for s in _shards(m)[1::3]:
        shutil.rmtree(out / s)
    run(cfg(out, "num_proc=2"))
    same_as_ref(out, ref, m)


def test_split_over_hosts_then_merge(setup, monkeypatch):
    cfg, ref, m, base = setup
    out = base / "hosts"
    assert run(cfg(out, "num_hosts=3", "host_index=0")) is None
    assert not (out / "manifest.json").exists()
    assert run(cfg(out, "num_hosts=3", "host_index=2")) is None
    n_done = sum(len([d for d in os.listdir(out / sp) if d.startswith("shard-")])
                 for sp in ("train", "validation"))
    assert 0 < n_done < len(_shards(m))
    # The last host to finish finds every shard present and writes the manifest itself.
    assert run(cfg(out, "num_hosts=3", "host_index=1"))["stats"] == m["stats"]
    os.remove(out / "manifest.json")
    built = []
    real = pipeline._build_shard
    monkeypatch.setattr(pipeline, "_build_shard", lambda t: (built.append(t), real(t))[1])
    merged = run(cfg(out))           # the merge step: all shards exist, writes the manifest
    assert built == []
    assert merged["stats"] == m["stats"]
    same_as_ref(out, ref, m)


def test_other_settings_refuse_or_overwrite(setup):
    cfg, ref, m, base = setup
    out = base / "other"
    shutil.copytree(ref, out)
    with pytest.raises(PrepError, match="holds a prep with other settings .*overwrite=true"):
        run(cfg(out, "seed=1"))
    assert (out / "manifest.json").exists()
    m2 = run(cfg(out, "seed=1", "overwrite=true"))
    assert m2["seed"] == 1 and m2["stats"] != m["stats"]
