"""Run reports: a run's curves as pictures and its outcome as a table.

    bert-report runs/demo                      # -> runs/demo/report/
    bert-report runs/a runs/b -o reports/ab    # several runs overlaid, one column each

writes curves_steps.png and curves_tokens.png (training loss; MLM and NSP loss, training and
held-out; held-out MLM accuracy, over all predicted positions and at [MASK] positions only, with
the most-frequent-token baseline; held-out NSP accuracy with chance; learning rate; tokens/s --
against optimizer steps and against tokens seen) and
report.md (final metrics, throughput, training time, parameters, the key settings), all from
the run's metrics.jsonl and its saved config.

The MLM baseline (accuracy of always predicting the most frequent masked token) is taken from
metrics.jsonl when the trainer logged it (key `eval_mlm_majority_baseline`), else computed from
the held-out split of the run's data (`data.dir` in its config) when that is still there; the
report says which. `write_run_report(run_dir)` is what bert-train calls at the end of a run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from ..cli_errors import fail
from ..errors import UserError

PROG = "bert-report"
BASELINE_KEY = "eval_mlm_majority_baseline"
REPORT_DIR = "report"


@dataclass
class Run:
    run_dir: str
    name: str
    train: list  # training log records (with "loss")
    evals: list  # held-out records (with "eval_mlm_loss")
    config: dict = field(default_factory=dict)  # the resolved run config ({} if not found)
    model_config: dict = field(default_factory=dict)
    baseline: Optional[float] = None
    baseline_source: str = "not available"
    baseline_note: str = "not available"  # the same without paths, for the pictures
    checkpoint: Optional[str] = None

    def tokens_at(self, step: int) -> Optional[float]:
        """Tokens seen at `step`, interpolated between training log records (held-out records
        carry no token count)."""
        pts = [(r["step"], r["tokens_seen"]) for r in self.train if "tokens_seen" in r]
        if not pts:
            return None
        for (s0, t0), (s1, t1) in zip([(0, 0)] + pts, pts):
            if s0 <= step <= s1:
                return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)
        return pts[-1][1] if step > pts[-1][0] else None


def _read_jsonl(path: str) -> list:
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def _read_config(run_dir: str, checkpoint: Optional[str]) -> dict:
    """The resolved config saved in the latest checkpoint, else Hydra's .hydra/config.yaml."""
    from omegaconf import OmegaConf

    from ..components import checkpoint as ckpt

    texts = []
    if checkpoint:
        try:  # (read safely: a link or a device in its place is refused, not read forever)
            texts.append(ckpt.read_config_yaml(checkpoint))
        except (UserError, OSError):
            pass
    hydra_config = os.path.join(run_dir, ".hydra", "config.yaml")
    if os.path.isfile(hydra_config) and not os.path.islink(hydra_config):
        with open(hydra_config, encoding="utf-8") as f:
            texts.append(f.read(ckpt.MAX_STATE_BYTES))
    for text in texts:
        if text is not None:
            try:
                cfg = OmegaConf.create(text)
                try:
                    return OmegaConf.to_container(cfg, resolve=True)
                except Exception:  # ${hydra:...} interpolations outside a Hydra app
                    return OmegaConf.to_container(cfg, resolve=False)
            except Exception:
                continue
    return {}


def _baseline(run: Run) -> tuple:
    """(value or None, where it came from, the same without paths)."""
    logged = [r[BASELINE_KEY] for r in run.evals + run.train if r.get(BASELINE_KEY) is not None]
    if logged:
        return float(logged[-1]), "logged in metrics.jsonl", "logged in metrics.jsonl"
    data_dir = (run.config.get("data") or {}).get("dir")
    if not data_dir:
        return None, "not available (no data.dir in the run's config)", "not available"
    split = (run.config.get("data") or {}).get("eval_split", "validation")
    try:
        from ..components.data import PreparedData
        from ..components.evaluation import majority_baseline

        return majority_baseline(PreparedData(data_dir), split), \
            f"computed from {data_dir} ({split} split)", \
            f"computed from the run's data ({split} split)"
    except Exception as exc:  # data moved or deleted since: the report still has the rest
        return None, f"not available ({data_dir}: {str(exc).splitlines()[0][:80]})", \
            "not available (the run's data is gone)"


def read_run(run_dir: str) -> Run:
    from ..components import checkpoint as ckpt
    from ..components.checkpoint_manager import CheckpointManager

    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isdir(run_dir):
        raise UserError(f"{run_dir}: no such run directory")
    if not os.path.isfile(metrics):
        raise UserError(f"{run_dir} has no metrics.jsonl: pass a bert-train run directory "
                        f"(run_dir=...)")
    records = _read_jsonl(metrics)
    if not records:
        raise UserError(f"{metrics} has no records yet: let the run log at least one step")
    # The newest checkpoint's saved settings (of the run's current line, as resume=auto and
    # bert-export take it), read without verifying its weights (a report reads no tensor;
    # checking a large checkpoint's checksums would take longer than the rest).
    checkpoint = CheckpointManager(run_dir, warn=lambda message: None).latest(verify=False)
    model_config = {}
    if checkpoint:
        try:
            model_config = ckpt.read_train_state(checkpoint, verify=False).get("model_config", {})
        except UserError:
            pass
    config = _read_config(run_dir, checkpoint)
    name = config.get("name") or os.path.basename(os.path.normpath(run_dir))
    run = Run(run_dir, str(name), [r for r in records if "loss" in r],
              [r for r in records if "eval_mlm_loss" in r], config, model_config,
              checkpoint=checkpoint)
    # Same step logged twice (a resumed run re-evaluating, or the final eval): keep the last.
    run.evals = list({r["step"]: r for r in run.evals}.values())
    run.baseline, run.baseline_source, run.baseline_note = _baseline(run)
    return run


# --------------------------------------------------------------------------- pictures


def _panels(runs: list, x_of) -> list:
    from .plotting import Panel, Series

    def series(i, records, key, label, style="-", marker=None):
        return i, Series([x_of(runs[i], r) for r in records], [r.get(key) for r in records],
                         label, style, marker)

    train_l, held_l = "training (mean over the log window)", "held-out"
    loss = Panel("training loss (MLM + NSP)", "loss")
    mlm = Panel("MLM loss", "cross-entropy")
    nsp = Panel("NSP loss", "cross-entropy")
    mlm_acc = Panel("held-out MLM accuracy", "accuracy")
    nsp_acc = Panel("held-out NSP accuracy", "accuracy")
    lr = Panel("learning rate", "lr", log_ok=False)
    speed = Panel("throughput", "tokens / s", log_ok=False)
    for i, run in enumerate(runs):
        loss.series.append(series(i, run.train, "loss", train_l))
        mlm.series += [series(i, run.train, "mlm_loss", train_l),
                       series(i, run.evals, "eval_mlm_loss", held_l, "--", "o")]
        nsp.series += [series(i, run.train, "nsp_loss", train_l),
                       series(i, run.evals, "eval_nsp_loss", held_l, "--", "o")]
        mlm_acc.series += [series(i, run.evals, "eval_mlm_accuracy", held_l, "--", "o"),
                           # what fill-mask does: 80% of the predicted positions hold [MASK],
                           # the rest a random or the original token (easier to guess)
                           series(i, run.evals, "eval_mlm_accuracy_masked",
                                  "held-out, [MASK] positions only", "--", "^")]
        if run.baseline is not None:
            mlm_acc.hlines.append((i, run.baseline, "most frequent token (baseline)", "-."))
        nsp_acc.series.append(series(i, run.evals, "eval_nsp_accuracy", held_l, "--", "o"))
        lr.series.append(series(i, run.train, "lr", train_l))
        speed.series.append(series(i, run.train, "tokens_per_s", train_l))
    nsp_acc.hlines.append((None, 0.5, "chance", ":"))
    return [loss, mlm, nsp, mlm_acc, nsp_acc, lr, speed]


def run_labels(runs: list) -> list:
    """The runs' names; where two share one (two runs of the same experiment), the fewest
    trailing components of their directories that tell them apart (a/demo, b/demo), never a
    whole path from the machine they ran on."""
    names = [r.name for r in runs]
    if len(set(names)) == len(names):
        return names
    parts = [os.path.abspath(r.run_dir).split(os.sep) for r in runs]
    for n in range(1, max(len(p) for p in parts) + 1):
        tails = ["/".join(p[-n:]) for p in parts]
        if len(set(tails)) == len(tails):
            return tails
    return [f"{name} ({i + 1})" for i, name in enumerate(names)]  # the same directory twice


def draw_curves(runs: list, out_dir: str) -> list:
    from .plotting import plot_panels

    names = run_labels(runs)
    notes = [f"baseline {name}: {r.baseline_note}" for name, r in zip(names, runs)]
    title = ", ".join(names) if len(runs) <= 3 else f"{len(runs)} runs"
    by_step = plot_panels(_panels(runs, lambda run, r: r["step"]), names, "optimizer step",
                          title, os.path.join(out_dir, "curves_steps.png"), notes)
    by_tokens = plot_panels(
        _panels(runs, lambda run, r: r.get("tokens_seen", run.tokens_at(r["step"]))), names,
        "tokens seen", title, os.path.join(out_dir, "curves_tokens.png"), notes, counts_x=True)
    return [by_step, by_tokens]


# --------------------------------------------------------------------------- report.md


def _num(value, fmt="{:.4f}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


def _duration(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    h, rest = divmod(int(round(seconds)), 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def count_parameters(checkpoint: Optional[str]) -> Optional[int]:
    """Parameters of a checkpoint's model (the tied decoder counted once), from the
    model.safetensors header alone: no tensor is read, no model built."""
    import numpy as np

    from .export import TIED_KEYS

    file = os.path.join(checkpoint, "model.safetensors") if checkpoint else ""
    if checkpoint and not os.path.isfile(file):
        return _count_sharded(checkpoint, TIED_KEYS)
    if not os.path.isfile(file):
        return None
    from safetensors import safe_open

    with safe_open(file, framework="numpy") as f:
        return int(sum(np.prod(f.get_slice(k).get_shape(), dtype=np.int64) for k in f.keys()
                       if k not in TIED_KEYS))


def _count_sharded(checkpoint: str, tied) -> Optional[int]:
    """Parameters of a sharded checkpoint, from its shard index (the global shapes)."""
    import math

    from ..components.sharded_checkpoint import SHARDED_DIR, read_metadata
    from ..errors import CheckpointError

    folder = os.path.join(checkpoint, SHARDED_DIR)
    if not os.path.isdir(folder):
        return None
    try:
        entries = read_metadata(folder).state_dict_metadata
    except CheckpointError:
        return None
    skip = {"model." + k for k in tied}
    return sum(math.prod(e.size) for k, e in entries.items()
               if k.startswith("model.") and k not in skip and hasattr(e, "size"))


def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


SETTINGS = (  # (row label, config key) in report.md's settings table
    ("hidden size x layers x heads", None), ("intermediate size", "model.intermediate_size"),
    ("position embeddings", "model.position_embedding_type"),
    ("pre-LayerNorm", "model.pre_layer_norm"), ("optimizer", "optim.name"),
    ("peak learning rate", "optim.lr"), ("weight decay", "optim.weight_decay"),
    ("schedule", "scheduler.name"), ("warmup steps", "trainer.warmup_steps"),
    ("max steps", "trainer.max_steps"), ("time budget (hours)", "trainer.budget_hours"),
    ("global batch (sequences)", "trainer.global_batch_size"),
    ("mixed precision", "trainer.mixed_precision"), ("masking", "data.masking"),
    ("data", "data.dir"), ("seed", "seed"),
)


def run_rows(run: Run) -> dict:
    """The numbers of report.md, by row label (strings as printed)."""
    last = run.train[-1] if run.train else {}
    final_eval = run.evals[-1] if run.evals else {}
    elapsed = last.get("elapsed_s")
    tokens = last.get("tokens_seen")
    rows = {
        "final step": str(max([r["step"] for r in run.train + run.evals] or [0])),
        "tokens seen": _num(tokens, "{:,}"),
        "training time (evaluation and saving excluded)": _duration(elapsed),
        "mean throughput (tokens/s)": _num(tokens / elapsed if tokens and elapsed else None,
                                           "{:,.0f}"),
        "final training loss (last log window)": _num(last.get("loss")),
        "held-out at step": str(final_eval.get("step", "-")),
        "held-out MLM loss": _num(final_eval.get("eval_mlm_loss")),
        "held-out MLM accuracy": _num(final_eval.get("eval_mlm_accuracy")),
        "held-out MLM accuracy at [MASK] positions": _num(
            final_eval.get("eval_mlm_accuracy_masked")),
        "most-frequent-token baseline": _num(run.baseline),
        "held-out NSP loss": _num(final_eval.get("eval_nsp_loss")),
        "held-out NSP accuracy": _num(final_eval.get("eval_nsp_accuracy")),
        "parameters": _num(count_parameters(run.checkpoint), "{:,}"),
    }
    mc = run.model_config or run.config.get("model") or {}
    for label, key in SETTINGS:
        if key is None:
            value = "x".join(str(mc.get(k, "?")) for k in ("hidden_size", "num_hidden_layers",
                                                           "num_attention_heads"))
        else:
            value = mc.get(key.split(".", 1)[1]) if key.startswith("model.") and mc else None
            value = _get(run.config, key) if value is None else value
        rows[label] = "-" if value is None else str(value)
    return rows


def write_markdown(runs: list, path: str, pictures: list) -> str:
    table = [run_rows(r) for r in runs]
    header = "| | " + " | ".join(r.name for r in runs) + " |"
    lines = [f"# Run report: {', '.join(r.name for r in runs)}", "",
             "Run directories: " + ", ".join(f"`{r.run_dir}`" for r in runs), "",
             header, "|---" * (len(runs) + 1) + "|"]
    for label in table[0]:
        lines.append(f"| {label} | " + " | ".join(t[label] for t in table) + " |")
    lines += ["", "Baseline: " + "; ".join(f"{r.name}: {r.baseline_source}" for r in runs),
              "NSP chance level: 0.5 (bert-prep draws a random next segment half of the time).",
              "Latest checkpoint: " + ", ".join(f"`{r.checkpoint}`" for r in runs), ""]
    lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pictures]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def report(run_dirs: list, out_dir: Optional[str] = None) -> str:
    """Write the pictures and report.md for `run_dirs` into `out_dir` (default:
    <run_dir>/report for one run); returns report.md's path."""
    if not run_dirs:
        raise UserError("give at least one run directory")
    if out_dir is None:
        if len(run_dirs) > 1:
            raise UserError("several runs: choose where the report goes with -o OUT_DIR")
        out_dir = os.path.join(run_dirs[0], REPORT_DIR)
    if os.path.isfile(out_dir):
        raise UserError(f"-o {out_dir} is a file; pass a directory")
    runs = [read_run(d) for d in run_dirs]
    os.makedirs(out_dir, exist_ok=True)
    pictures = draw_curves(runs, out_dir)
    return write_markdown(runs, os.path.join(out_dir, "report.md"), pictures)


def write_run_report(run_dir: str) -> str:
    """bert-train's end-of-run report: <run_dir>/report/{report.md, curves_*.png}."""
    return report([run_dir])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Draw a run's curves (PNG) and write report.md from its "
                               "metrics.jsonl; several runs are overlaid.",
        epilog="example: bert-report runs/demo   (writes runs/demo/report/)")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("-o", "--out", help="output directory (default: RUN_DIR/report for "
                                            "one run; required for several)")
    args = parser.parse_args(argv)
    try:
        path = report(args.run_dirs, args.out)
    except UserError as exc:
        fail(PROG, str(exc))
    out = os.path.dirname(path)
    print(f"{PROG}: wrote {path}, {os.path.join(out, 'curves_steps.png')} and "
          f"{os.path.join(out, 'curves_tokens.png')}")


if __name__ == "__main__":
    main()
