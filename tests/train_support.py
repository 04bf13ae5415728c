"""Test support for the training tests: a tiny prepared-data directory written exactly as
docs/prepared-format.md specifies (for unit tests that must not depend on bert-prep's speed), and
a helper that runs bert-prep for real (end-to-end tests)."""

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from time_limits import hang_limit

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A child process's PYTHONPATH: this checkout first, then whatever the suite was given. Where the
# dependencies themselves come through PYTHONPATH (the GPU machine installs the ones its image
# lacks with `pip install --target /tmp/site`), a child given REPO alone cannot import Hydra.
CHILD_PYTHONPATH = os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
# The same with tests/ too, for a child that runs a helper script of the suite (an empty entry,
# as a trailing ':' of an unset PYTHONPATH gives, would put the working directory on sys.path).
CHILD_PYTHONPATH_WITH_TESTS = os.pathsep.join(
    [REPO, os.path.join(REPO, "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
# wandb is a dependency of every install of this project, but the GPU machine's image leaves it
# out (../shared/gpu/README.md); there the tests of the wandb logger are skipped, not failed.
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                 reason="wandb is not installed (the GPU machine's image)")


def write_prepared(root: str, num_train: int = 96, num_valid: int = 24, seq: int = 32,
                   max_pred: int = 5, vocab_size: int = 64, seed: int = 0,
                   shards: int = 2, whole_word: bool = False) -> str:
    """Synthetic instances with a learnable structure (segment B repeats A's token pattern when
    the NSP label is 0), static masks with BERT's rules, and a WordPiece-style vocab."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range((vocab_size - len(SPECIALS)) // 2)]
    pieces = [f"##p{i}" for i in range(vocab_size - len(SPECIALS) - len(words))]
    vocab = SPECIALS + words + pieces
    assert len(vocab) == vocab_size
    os.makedirs(os.path.join(root, "tokenizer"), exist_ok=True)
    with open(os.path.join(root, "tokenizer", "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    sha = hashlib.sha256("\n".join(vocab).encode()).hexdigest()
    splits = {}
    for split, n in (("train", num_train), ("validation", num_valid)):
        per = [n // shards + (1 if i < n % shards else 0) for i in range(shards)]
        infos = []
        for si, count in enumerate(per):
            ids = np.zeros((count, seq), dtype=np.uint16)
            lengths = np.zeros(count, dtype=np.uint16)
            seg_a = np.zeros(count, dtype=np.uint16)
            mpos = np.zeros((count, max_pred), dtype=np.uint16)
            mlab = np.zeros((count, max_pred), dtype=np.uint16)
            nsp = rng.integers(0, 2, size=count).astype(np.uint8)
            for i in range(count):
                la = int(rng.integers(3, (seq - 3) // 2))
                lb = int(rng.integers(3, (seq - 3) // 2))
                a = rng.integers(len(SPECIALS), vocab_size, size=la)
                b = (a[:lb] if lb <= la else np.resize(a, lb)) if nsp[i] == 0 else \
                    rng.integers(len(SPECIALS), vocab_size, size=lb)
                toks = np.concatenate([[2], a, [3], b, [3]])
                length = len(toks)
                cand = np.array([j for j in range(length) if toks[j] > 4])
                k = min(max_pred, max(1, int(round(length * 0.15))))
                chosen = np.sort(rng.choice(cand, size=k, replace=False))
                orig = toks.copy()
                for j in chosen:
                    r = rng.random()
                    if r < 0.8:
                        toks[j] = 4
                    elif r >= 0.9:
                        toks[j] = rng.integers(5, vocab_size)
                ids[i, :length] = toks
                lengths[i], seg_a[i] = length, la + 2
                mpos[i, :k], mlab[i, :k] = chosen, orig[chosen]
            path = f"{split}/shard-{si:05d}"
            os.makedirs(os.path.join(root, path), exist_ok=True)
            for name, arr in (("input_ids", ids), ("lengths", lengths),
                              ("segment_a_lengths", seg_a), ("masked_positions", mpos),
                              ("masked_labels", mlab), ("next_sentence_labels", nsp)):
                np.save(os.path.join(root, path, name + ".npy"), arr)
            infos.append({"path": path, "num_instances": count})
        splits[split] = {"num_instances": n, "shards": infos}
    manifest = {
        "format_version": 1, "complete": True, "max_seq_length": seq,
        "max_predictions_per_seq": max_pred, "vocab_size": vocab_size, "token_dtype": "uint16",
        "special_token_ids": {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4},
        "tokenizer": {"path": "tokenizer", "sha256": sha, "do_lower_case": True},
        "splits": splits,
        "masking": {"masked_lm_prob": 0.15, "whole_word_mask": whole_word,
                    "max_predictions_per_seq": max_pred},
        "seed": seed,
    }
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return root


def _save_split(root, split, arrays, shards=2):
    n = len(arrays["lengths"])
    cut = np.linspace(0, n, shards + 1).astype(int)
    infos = []
    for si in range(shards):
        path = f"{split}/shard-{si:05d}"
        os.makedirs(os.path.join(root, path), exist_ok=True)
        for name, arr in arrays.items():
            np.save(os.path.join(root, path, name + ".npy"), arr[cut[si]:cut[si + 1]])
        infos.append({"path": path, "num_instances": int(cut[si + 1] - cut[si])})
    return {"num_instances": n, "shards": infos}


def write_context_prepared(root: str, num_train: int = 4096, num_valid: int = 512,
                           seq: int = 24, num_words: int = 30, seed: int = 0) -> str:
    """Prepared data (docs/prepared-format.md) where only the context tells the masked token.

    Tokens are w0..w{num_words-1}; segment A counts up from a random word (w7 w8 w9 ...,
    wrapping round), so every word is equally frequent (a model that ignores the context, i.e.
    learns only frequencies, is right 1 time in num_words) while a masked word is its left
    neighbour + 1.  NSP: an IsNext segment B (label 0) keeps counting where A stopped; a random B
    (label 1) counts up from a random other word, so the label is learnable from the junction.
    Static masks with BERT's rules: ~15% of the words, 80% [MASK] / 10% random / 10% kept."""
    rng = np.random.default_rng(seed)
    vocab = SPECIALS + [f"w{i}" for i in range(num_words)]
    os.makedirs(os.path.join(root, "tokenizer"), exist_ok=True)
    with open(os.path.join(root, "tokenizer", "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    max_pred = max(1, int(round(seq * 0.15)))
    w0 = len(SPECIALS)
    splits = {}
    for split, n in (("train", num_train), ("validation", num_valid)):
        a = {"input_ids": np.zeros((n, seq), np.uint16), "lengths": np.zeros(n, np.uint16),
             "segment_a_lengths": np.zeros(n, np.uint16),
             "masked_positions": np.zeros((n, max_pred), np.uint16),
             "masked_labels": np.zeros((n, max_pred), np.uint16),
             "next_sentence_labels": rng.integers(0, 2, n).astype(np.uint8)}
        for i in range(n):
            la = int(rng.integers(4, (seq - 3) // 2 + 1))
            lb = int(rng.integers(4, seq - 3 - la + 1))
            start_a = int(rng.integers(num_words))
            start_b = start_a + la
            if a["next_sentence_labels"][i]:
                start_b += int(rng.integers(1, num_words))      # anywhere but the next word
            words_a = w0 + (start_a + np.arange(la)) % num_words
            words_b = w0 + (start_b + np.arange(lb)) % num_words
            toks = np.concatenate([[2], words_a, [3], words_b, [3]])
            length = len(toks)
            cand = np.flatnonzero(toks >= w0)
            k = min(max_pred, max(1, int(round(length * 0.15))))
            chosen = np.sort(rng.choice(cand, size=k, replace=False))
            orig = toks.copy()
            for j in chosen:
                r = rng.random()
                if r < 0.8:
                    toks[j] = 4
                elif r >= 0.9:
                    toks[j] = rng.integers(w0, len(vocab))
            a["input_ids"][i, :length] = toks
            a["lengths"][i], a["segment_a_lengths"][i] = length, la + 2
            a["masked_positions"][i, :k], a["masked_labels"][i, :k] = chosen, orig[chosen]
        splits[split] = _save_split(root, split, a)
    manifest = {
        "format_version": 1, "complete": True, "max_seq_length": seq,
        "max_predictions_per_seq": max_pred, "vocab_size": len(vocab), "token_dtype": "uint16",
        "special_token_ids": {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4},
        "tokenizer": {"path": "tokenizer",
                      "sha256": hashlib.sha256("\n".join(vocab).encode()).hexdigest(),
                      "do_lower_case": True},
        "splits": splits,
        "masking": {"masked_lm_prob": 0.15, "whole_word_mask": False,
                    "max_predictions_per_seq": max_pred},
        "seed": seed,
    }
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return root


def run_bert_train(args, cwd, env=None):
    """bert-train in a subprocess (the real entry point: Hydra, exit codes, stderr)."""
    full_env = {**os.environ, "WANDB_MODE": "disabled", **(env or {})}
    return subprocess.run([sys.executable, "-m", "bert_pretrain.train", *_no_report(args)],
                          cwd=cwd,
                          env=full_env, capture_output=True, text=True, timeout=hang_limit())


def _no_report(overrides) -> list:
    """Tests skip the end-of-run pictures (seconds of matplotlib per run) unless they ask, and
    train in fp32 unless they ask (trainer.mixed_precision=auto means bf16 on CPUs with bf16
    units: the exactness tests compare to 1e-6, and CI machines differ)."""
    overrides = list(overrides)
    for key, value in (("trainer.report", "false"), ("trainer.mixed_precision", "no")):
        if not any(o.lstrip("+").startswith(key + "=") for o in overrides):
            overrides.append(f"{key}={value}")
    return overrides


def read_metrics(run_dir: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def compose(overrides):
    """The composed bert-train config (Hydra's compose API: same files, same schema)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from bert_pretrain.config import register

    register()
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf", "train"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides))


def train_in_process(overrides) -> float:
    """Run training in this process (faster than a subprocess; same code path after Hydra)."""
    from omegaconf import OmegaConf

    from bert_pretrain.config import settings
    from bert_pretrain.trainer import train

    cfg = compose(_no_report(overrides))
    return train(settings(cfg), OmegaConf.to_container(cfg, resolve=True),
                 OmegaConf.to_yaml(cfg, resolve=True))


@contextlib.contextmanager
def _started(commands: list[tuple[list, dict]]):
    """Every (command, environment) started at once in the repository; on leaving, any still
    running is killed."""
    procs = []
    try:
        for command, env in commands:
            procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def run_all(commands: list[tuple[list, dict]]) -> list[subprocess.CompletedProcess]:
    """Start every (command, environment) at once and wait for all, each within the test's
    hang limit."""
    results = []
    with _started(commands) as procs:
        for (command, _), p in zip(commands, procs):
            out, err = p.communicate(timeout=hang_limit())
            results.append(subprocess.CompletedProcess(command, p.returncode, out, err))
    return results


def await_one_of(commands: list[tuple[list, dict]], awaited: int) -> tuple[list, str, str]:
    """Start every (command, environment) at once in the repository, wait (within the test's
    hang limit) for command `awaited`, then kill any still running.  Returns the processes (each
    with its returncode) and the awaited one's stdout and stderr."""
    with _started(commands) as procs:
        out, err = procs[awaited].communicate(timeout=hang_limit())
    return procs, out, err
