"""A full disk, however the writer reports it (safetensors' SafetensorError, numpy's bare
"N requested and M written"), is one line that names the full disk and the folder, exit 2;
what was written before stays whole, and the same command continues once there is space.
The full disk is injected (the writer replaced in the process), not made."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH, write_prepared

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}

# bert-train whose safetensors writer meets a full disk at one checkpoint, as it says it then.
FULL_AT_SAVE = textwrap.dedent("""
    import sys
    import safetensors
    import bert_pretrain.components.checkpoint as ckpt

    real = ckpt.save_model
    full_at = sys.argv[1]

    def save_model(model, path, *args, **kwargs):
        if full_at in path:
            raise safetensors.SafetensorError(
                'Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                'message: "No space left on device" })')
        return real(model, path, *args, **kwargs)

    ckpt.save_model = save_model
    sys.argv = ["bert-train", *sys.argv[2:]]
    from bert_pretrain.train import main
    main()
""")


def test_a_checkpoint_save_on_a_full_disk_is_one_line_and_resume_continues(tmp_path):
    prepared = write_prepared(str(tmp_path / "prep"), num_train=32, num_valid=8)
    args = ["experiment=smoke", f"data.dir={prepared}", "run_dir=run", "trainer.max_steps=6",
            "trainer.warmup_steps=1", "trainer.checkpoint_every=2", "trainer.eval_every=0",
            "trainer.report=false", "trainer.progress_bar=false"]
    p = subprocess.run([sys.executable, "-c", FULL_AT_SAVE, "step-00000004", *args],
                       cwd=str(tmp_path), env=ENV, capture_output=True, text=True, timeout=hang_limit())
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    root = os.path.join("run", "checkpoints")
    assert lines[0].startswith("bert-train: error: could not save checkpoint step 4 in "), lines
    assert f"No space left on device, " in lines[0] and f"MB free on the disk of {root}" in \
        lines[0], lines[0]
    assert "step-00000002 is intact" in lines[0] and "resume=auto" in lines[0], lines[0]
    assert sorted(os.listdir(tmp_path / root)) == ["latest", "step-00000002"] or \
        sorted(n for n in os.listdir(tmp_path / root) if n.startswith("step-")) == \
        ["step-00000002"], os.listdir(tmp_path / root)
    assert not [n for n in os.listdir(tmp_path / root) if n.startswith(".tmp")]
    p = subprocess.run([os.path.join(os.path.dirname(sys.executable), "bert-train"), *args,
                        "resume=auto"], cwd=str(tmp_path), env=ENV, capture_output=True,
                       text=True, timeout=hang_limit())
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / root / "step-00000006").is_dir()
    from bert_pretrain.components import checkpoint as ckpt

    assert ckpt.read_train_state(str(tmp_path / root / "step-00000006"))["step"] == 6


def test_a_shard_meeting_a_full_disk_as_numpy_reports_it_is_named_so(
        prep_compose, prep_tagged, tmp_path, monkeypatch):
    """numpy's tofile says '4096 requested and 0 written' (no errno): the line says the disk
    is full and which folder, not 'OSError: fix the cause'; the finished shards are kept as
    they were and the re-run completes."""
    from data_prep import pipeline, shards
    from data_prep.errors import PrepIOError

    text, vocab = prep_tagged
    out = tmp_path / "out"
    cfg = prep_compose("corpus=text", f"corpus.paths=[{text}]", f"output_dir={out}",
                       f"tokenizer.vocab_file={vocab}", "max_seq_length=64",
                       "tokens_per_shard=2000", "num_proc=1", "progress=false")
    real_save, shard_dirs = np.save, []

    def short_write(path, *args, **kwargs):
        if ".tmp-shard-" in str(path) and os.path.dirname(path) not in shard_dirs:
            shard_dirs.append(os.path.dirname(path))
        if len(shard_dirs) == 3:  # the third shard's first file
            raise OSError("4096 requested and 0 written")
        return real_save(path, *args, **kwargs)

    monkeypatch.setattr(shards.np, "save", short_write)
    with pytest.raises(PrepIOError) as e:
        pipeline.run(cfg)
    message = str(e.value)
    assert re.match(r"writing (train|validation)/shard-\d{5}: No space left on device: free "
                    r"some space \(", message), message
    assert f"MB free on the disk of {out}) or choose another output_dir" in message, message
    assert "re-run the same command to resume" in message and "\n" not in message
    kept = {f"{split}/{n}": (out / split / n / "input_ids.npy").read_bytes()
            for split in ("train", "validation") if (out / split).is_dir()
            for n in os.listdir(out / split) if n.startswith("shard-")}
    assert len(kept) == 2, sorted(kept)  # the two finished before the full disk
    monkeypatch.undo()
    assert len(pipeline.run(cfg)["splits"]["train"]["shards"]) > 2
    for name, data in kept.items():
        assert (out / name / "input_ids.npy").read_bytes() == data
