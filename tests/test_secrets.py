"""Secrets in the environment never reach what a run writes: logs, Hydra's saved config,
checkpoints, metrics, wandb's offline run directory, the console.

The run uses wandb offline (wandb keeps a copy of the config, the console output and its
settings) and a config value interpolated from a secret variable, the one way a secret can
enter bert-train's config.
"""
import os
import subprocess
import sys

from bert_pretrain.components.redact import redact, secret_values
from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH, REPO, needs_wandb, write_prepared

SECRETS = {
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567",  # wandb's 40-hex form
    "HF_TOKEN": "hf_FaKeToKeN1234567890abcdefXYZ",
    "GITHUB_TOKEN": "ghp_FaKe0987654321zyxwvu",
    "MY_SERVICE_SECRET": "s3cr3t-v4lue-never-write-me",
    "AWS_SECRET_ACCESS_KEY": "AKfakeAWSsecretKEYvalue/+=",
    "OPENAI_API_KEY": "sk-fakeOPENAIkey55555",
}


def _every_file(*roots):
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for f in files:
                yield os.path.join(dirpath, f)


def test_redact_replaces_secret_values_only():
    env = {"HF_TOKEN": "hf_abcdef123", "PATH": "/usr/bin", "OMP_NUM_THREADS": "1",
           "SHORT_KEY": "1"}
    secrets = secret_values(env)
    assert secrets == {"hf_abcdef123": "HF_TOKEN"}
    assert redact({"a": ["x hf_abcdef123 y", 3], "/usr/bin": None}, secrets) == \
        {"a": ["x <redacted:HF_TOKEN> y", 3], "/usr/bin": None}


@needs_wandb
def test_no_secret_in_anything_a_run_writes(tmp_path):
    data = write_prepared(str(tmp_path / "data"), num_train=32, num_valid=8)
    run_dir, hydra_dir = tmp_path / "run", tmp_path / "hydra"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(SECRETS, HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH,
               WANDB_SILENT="false")
    r = subprocess.run(
        [sys.executable, "-m", "bert_pretrain.train", "experiment=smoke", f"data.dir={data}",
         f"run_dir={run_dir}", f"hydra.run.dir={hydra_dir}", "logger=wandb",
         "logger.mode=offline", "trainer.max_steps=3", "trainer.checkpoint_every=3",
         # a user who wires a token into the config (it ends up in the resolved config)
         "logger.tags=[smoke,${oc.env:HF_TOKEN}]", "logger.group=${oc.env:MY_SERVICE_SECRET}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-3000:]
    files = list(_every_file(run_dir, hydra_dir))
    names = {os.path.relpath(f, run_dir) for f in files}
    assert any(n.startswith("wandb/") and n.endswith(".wandb") for n in names), names
    assert any(n.endswith("config.yaml") and n.startswith("checkpoints") for n in names)
    assert "metrics.jsonl" in names
    leaks = []
    for path in files:
        blob = open(path, "rb").read()
        leaks += [(path, name) for name, value in SECRETS.items() if value.encode() in blob]
    leaks += [("console", name) for name, value in SECRETS.items()
              if value in r.stdout + r.stderr]
    assert not leaks, leaks
    # the interpolated values were replaced, not dropped silently
    saved = open(next(f for f in files if f.endswith("config.yaml") and "checkpoints" in f)).read()
    assert "<redacted:HF_TOKEN>" in saved and "<redacted:MY_SERVICE_SECRET>" in saved
