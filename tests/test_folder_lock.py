"""One writer per folder: a second bert-prep into an output_dir, or a second bert-train into a run
folder, that another live process is writing stops in one line (exit 2) and changes nothing; a
writer killed with SIGKILL holds nothing, so the same command then continues."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH, write_prepared

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}

# The first writer: the real command in a child, held (after it took its lock) until the test
# writes a line to its stdin: the overlap is made, not waited for.
HELD = textwrap.dedent("""
    import sys
    module, target, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    import importlib
    owner_name, attr = target.rsplit(".", 1)
    owner = importlib.import_module(owner_name)
    holder, _, name = attr.rpartition(":")
    obj = getattr(owner, holder) if holder else owner
    real = getattr(obj, name)

    def held(*args, **kwargs):
        print("HOLDING", flush=True)
        sys.stdin.readline()
        return real(*args, **kwargs)

    setattr(obj, name, held)
    sys.argv = ["cmd", *argv]
    importlib.import_module(module).main()
""")


def hold(cwd, module: str, target: str, argv: list) -> subprocess.Popen:
    """Start `module`'s main() with `target` (module.attr or module.Class:method, reached
    after the lock is taken) waiting for a line on stdin; returns once it waits."""
    proc = subprocess.Popen([sys.executable, "-c", HELD, module, target, *argv], cwd=str(cwd),
                            env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip() == "HOLDING":
            return proc
    proc.wait()
    raise AssertionError(proc.stderr.read()[-3000:])


def command(cwd, prog: str, argv: list) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), prog), *argv],
                          cwd=str(cwd), env=ENV, capture_output=True, text=True, timeout=hang_limit())


def files(root) -> dict:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = os.path.getsize(path)
    return out


def one_error_line(p, prog: str) -> str:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr[-3000:])
    assert lines[0].startswith(f"{prog}: error: ") and "Traceback" not in p.stderr
    return lines[0]


def test_a_second_bert_prep_into_one_output_dir_stops_in_one_line(tmp_path, prep_tagged):
    text, vocab = prep_tagged
    args = ["corpus=text", f"corpus.paths=[{text}]", "output_dir=out",
            f"tokenizer.vocab_file={vocab}", "max_seq_length=64", "tokens_per_shard=2000",
            "num_proc=1", "progress=false"]
    first = hold(tmp_path, "data_prep.build", "data_prep.pipeline._run", args)
    try:
        before = files(tmp_path / "out")
        p = command(tmp_path, "bert-prep", args)
        line = one_error_line(p, "bert-prep")
        assert f"is being written by another bert-prep (process {first.pid})" in line, line
        assert files(tmp_path / "out") == before
        out, err = first.communicate("go\n", timeout=hang_limit())
        assert first.returncode == 0, err[-3000:]
    finally:
        first.kill()
    assert (tmp_path / "out" / "manifest.json").is_file()
    # killed while holding the lock: the same command runs at once (nothing stale to clear)
    killed = hold(tmp_path, "data_prep.build", "data_prep.pipeline._run",
                  [*args, "output_dir=out2"])
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    p = command(tmp_path, "bert-prep", [*args, "output_dir=out2"])
    assert p.returncode == 0, p.stderr[-3000:]


def test_a_second_bert_train_into_one_run_folder_stops_in_one_line(tmp_path):
    prepared = write_prepared(str(tmp_path / "prep"), num_train=32, num_valid=8)
    args = ["experiment=smoke", f"data.dir={prepared}", "run_dir=run", "trainer.max_steps=4",
            "trainer.warmup_steps=1", "trainer.checkpoint_every=2", "trainer.eval_every=0",
            "trainer.report=false", "resume=auto"]
    first = hold(tmp_path, "bert_pretrain.train", "bert_pretrain.trainer.Trainer:fit", args)
    try:
        # a save the first one has in progress: the second must not "repair" it away
        saving = tmp_path / "run" / "checkpoints" / ".tmp-step-00000002"
        saving.mkdir(parents=True)
        (saving / "model.safetensors").write_bytes(b"being written")
        before = files(tmp_path / "run")
        p = command(tmp_path, "bert-train", args)
        line = one_error_line(p, "bert-train")
        assert f"is being written by another bert-train (process {first.pid})" in line, line
        assert files(tmp_path / "run") == before and saving.is_dir()
        out, err = first.communicate("go\n", timeout=hang_limit())
        assert first.returncode == 0, err[-3000:]
    finally:
        first.kill()
    assert (tmp_path / "run" / "checkpoints" / "step-00000004").is_dir()
