"""The learning check: a recipe trained for a fixed wall-clock budget, its held-out MLM and NSP
accuracy against minutes of training, beside plain transformers trained the same way.

For each seed, one after another: our run, exactly the command a user types
(`bert-train experiment=budget_mini data.dir=... seed=S`), then transformers'
`BertForPreTraining` (dense MLM head, sdpa attention) in the same trainer: same data order,
masks, optimizer, schedule, budget and evaluation, only the model differs (and, as
transformers' attention has no such bias, without trainer.attention_locality).  Ours and
transformers alternate, so a machine that slows over the hour slows both alike.  Each run's load
from other processes is recorded (busy cores in /proc/stat minus the run's own CPU time).

    python bench/learning_check.py --data prepared/gutenberg128 --label gutenberg --seeds 1 2
    python bench/learning_check.py --data prepared/pydocs128 --label pydocs --seeds 1 2
    python bench/learning_check.py --data ... --experiment gutenberg_mini --no-transformers
    python bench/learning_check.py --data ... --seeds 1 2 3 --transformers-seeds 1 --reuse
    python bench/learning_check.py --data ... --set optim.lr=2e-3 --set model.pre_layer_norm=true
    python bench/learning_check.py --data ... --steps 1100   # a step budget instead of minutes

`--steps N` trains each run for N optimizer steps instead of a wall-clock budget: what a slower
machine gets in 15 minutes (a CPU without bf16 units takes about 1,100 steps), and results that
do not move with the machine's load, so runs can share it.

Prints a table (final held-out metrics per run, the median over seeds with min-max), writes
`bench/results/learning_<label>.json` and a picture of the curves (`--png`).  Scored on the
prepared held-out split: whole documents training never saw (bert-prep holds them out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import OtherLoad, median_and_range  # noqa: E402  (bench/, beside this file)

# The bar.  NSP is scored on a balanced split: the mean of the accuracies on true-next
# and random-next pairs (a held-out split of few documents is not 50/50 by itself).
TARGETS = {"eval_mlm_accuracy": 0.25, "eval_nsp_accuracy_balanced": 0.75}
RUN_FILE = "run.json"  # in each run's directory once the run has finished


# ---------------------------------------------------------------------------- the runs


def run_one(model: str, seed: int, args, run_dir: Path) -> dict:
    """Train one run in a fresh process; returns its curve and final metrics."""
    overrides = [f"experiment={args.experiment}", f"data.dir={args.data}", f"seed={seed}",
                 f"run_dir={run_dir}", f"name={args.label}_{model}_s{seed}",
                 *([f"trainer.budget_hours={args.minutes / 60}"] if not args.steps else
                   ["trainer.budget_hours=null", f"trainer.max_steps={args.steps}"]),
                 "trainer.progress_bar=false",
                 "trainer.report=false", *args.set]
    if model == "ours":
        cmd = [sys.executable, "-m", "bert_pretrain.train", *overrides]
    else:  # a few times slower per step: evaluate more often for a curve with as many points.
        # transformers' attention has no locality bias: it trains the recipe without it.
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *overrides,
               f"trainer.eval_every={args.transformers_eval_every}",
               "trainer.attention_locality=0"]
    started = time.time()
    load = OtherLoad(own="children")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    other_cores = load.cores()
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"error: the {model} run (seed {seed}) failed: {tail[0]}")
    curve, final = read_curve(run_dir / "metrics.jsonl")
    run = {"model": model, "seed": seed, "run_dir": str(run_dir), "curve": curve, **final,
           "wall_s": round(time.time() - started, 1),
           "other_load_cores": None if other_cores is None else round(other_cores, 3)}
    # Written last: its presence says the run finished, so --reuse can take it as it is.
    (run_dir / RUN_FILE).write_text(json.dumps(run, indent=1))
    return run


def read_curve(path: Path) -> tuple[list, dict]:
    """Evaluation records with the training minutes they were taken at, and the last one."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elapsed = {r["step"]: r["elapsed_s"] for r in records if "elapsed_s" in r}
    curve = []
    for r in records:
        if "eval_mlm_accuracy" in r:
            minutes = r.get("elapsed_s", elapsed.get(r["step"]))
            curve.append({"step": r["step"],
                          "minutes": None if minutes is None else round(minutes / 60, 3),
                          **{k: v for k, v in r.items() if k.startswith("eval_")}})
    if not curve:
        raise SystemExit(f"error: {path} has no evaluation record")
    last = curve[-1]
    steps = max(r["step"] for r in records)
    return curve, {"steps": steps, **{k: v for k, v in last.items() if k.startswith("eval_")}}


# ---------------------------------------------------------------------- transformers worker


def worker(overrides: list[str]) -> None:
    """bert-train's trainer with transformers' BertForPreTraining as the model."""
    from bert_pretrain.components.cpu_runtime import prefer_passive_omp_wait

    prefer_passive_omp_wait()  # as bert-train, before torch loads libgomp
    import torch.nn.functional as F
    import transformers
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from bert_pretrain.config import register, settings
    from bert_pretrain.model import BertConfig
    from bert_pretrain.model.bert import PreTrainingOutput
    from bert_pretrain.trainer import Trainer

    class TransformersBert(transformers.BertForPreTraining):
        """transformers' model behind our forward signature: dense logits over every position,
        the losses computed from them as transformers does (cross-entropy, -100 ignored), summed
        or averaged as the trainer asks.  Same parameter names, so checkpoints are ours."""

        def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
                    next_sentence_label=None, output_attentions=False,
                    output_hidden_states=False, loss_reduction="mean", num_labelled=None):
            # (num_labelled: our model's gather of the labelled rows; transformers' head is dense)
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                  token_type_ids=token_type_ids)
            logits, nsp_logits = out.prediction_logits, out.seq_relationship_logits
            mlm = nsp = None
            if labels is not None:
                mlm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                      labels.reshape(-1), reduction=loss_reduction)
            if next_sentence_label is not None:
                nsp = F.cross_entropy(nsp_logits.float(), next_sentence_label.reshape(-1),
                                      reduction=loss_reduction)
            total = None if mlm is None or nsp is None else mlm + nsp
            return PreTrainingOutput(total, mlm, nsp, logits, None, nsp_logits)

    class TransformersTrainer(Trainer):
        def _setup_model(self):
            from accelerate.utils import set_seed

            values = {**self.s.model, "vocab_size": self.data.vocab_size,
                      "pad_token_id": self.data.special.get("pad", 0)}
            self.model_cfg = BertConfig.from_dict(values)
            self.hf_state, self.import_notes = None, []
            set_seed(self.s.seed)
            self.raw_model = TransformersBert(
                transformers.BertConfig(**self.model_cfg.to_hf_dict()))

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "train"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    trainer = TransformersTrainer(settings(cfg), OmegaConf.to_container(cfg, resolve=True),
                                  OmegaConf.to_yaml(cfg, resolve=True))
    trainer.fit()


# ------------------------------------------------------------------------------ summary


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for model in dict.fromkeys(r["model"] for r in runs):
        mine = [r for r in runs if r["model"] == model]
        rows.append({"model": model, "runs": len(mine), **median_and_range(mine, (
            "steps", "eval_mlm_accuracy", "eval_mlm_accuracy_masked", "eval_nsp_accuracy",
            "eval_nsp_accuracy_balanced", "eval_mlm_loss", "other_load_cores"))})
    return rows


def print_table(runs: list[dict], summary: list[dict], args) -> None:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    print(f"learning check: {args.label} ({args.data}), experiment={args.experiment}, "
          f"{budget_words(args)} of training per run")
    print(f"{'run':<22} {'steps':>6} {'MLM acc':>8} {'[MASK] acc':>10} {'NSP acc':>8} "
          f"{'NSP bal.':>8} {'MLM loss':>8} {'other load':>10}")
    for r in runs:
        print(f"{r['model'] + ' seed ' + str(r['seed']):<22} {r['steps']:>6} "
              f"{pct(r.get('eval_mlm_accuracy')):>8} {pct(r.get('eval_mlm_accuracy_masked')):>10} "
              f"{pct(r.get('eval_nsp_accuracy')):>8} "
              f"{pct(r.get('eval_nsp_accuracy_balanced')):>8} {r['eval_mlm_loss']:>8.3f} "
              f"{r['other_load_cores'] if r['other_load_cores'] is not None else '-':>10}")
    print("median over seeds (min-max):")
    for s in summary:
        def cell(key):
            if key not in s:
                return "-"
            lo, hi = s[key + "_range"]
            return f"{pct(s[key])} ({pct(lo)}-{pct(hi)})"
        print(f"  {s['model']:<13} steps {s['steps']:.0f}  MLM {cell('eval_mlm_accuracy')}  "
              f"[MASK] {cell('eval_mlm_accuracy_masked')}  NSP {cell('eval_nsp_accuracy')}  "
              f"NSP balanced {cell('eval_nsp_accuracy_balanced')}")
    ours = next((s for s in summary if s["model"] == "ours"), None)
    if ours:
        met = [f"{k.split('_')[1].upper()} {'met' if ours[k] >= v else 'NOT met'} "
               f"(median {pct(ours[k])}, target {pct(v)})" for k, v in TARGETS.items()
               if k in ours]
        print("targets: " + "; ".join(met))


def budget_words(args) -> str:
    return f"{args.steps:,} steps" if args.steps else f"{args.minutes:g} minutes"


def locality_minutes(run_dir: str) -> float | None:
    """Training minutes after which the run's attention locality bias was off (None: never
    on)."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text()
               .splitlines() if line.strip()]
    train = [r for r in records if "attention_locality" in r]
    if not train or not train[0]["attention_locality"]:
        return None
    off = next((r for r in train if r["attention_locality"] == 0), train[-1])
    return off["elapsed_s"] / 60


def plot(runs: list[dict], args, baseline: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    colours = {"ours": "tab:blue", "transformers": "tab:orange"}
    panels = ((axes[0], "eval_mlm_accuracy", "held-out MLM accuracy"),
              (axes[1], "eval_mlm_accuracy_masked", "held-out MLM accuracy at [MASK] positions"),
              (axes[2], "eval_nsp_accuracy_balanced",
               "held-out NSP accuracy (balanced: mean over true/random next)"))
    local = [m for m in (locality_minutes(r["run_dir"]) for r in runs if r["model"] == "ours")
             if m is not None]
    for ax, key, title in panels:
        if local and not args.steps:
            ax.axvspan(0, max(local), color="tab:blue", alpha=0.07,
                       label="ours: attention locality bias on")
        for r in runs:
            x = "step" if args.steps else "minutes"
            points = [(p[x], p[key]) for p in r["curve"]
                      if p[x] is not None and p.get(key) is not None]
            if not points:
                continue
            xs, ys = zip(*points)
            label = f"{'bert-pretrain' if r['model'] == 'ours' else 'transformers'} " \
                    f"seed {r['seed']}"
            # colour tells the models apart, line style and marker the seeds of one model
            nth = [q["seed"] for q in runs if q["model"] == r["model"]].index(r["seed"])
            ax.plot(xs, [100 * y for y in ys], marker="osD^v"[nth % 5], markersize=2.8,
                    linewidth=1.2, linestyle=("-", "--", ":", "-.")[nth % 4],
                    color=colours[r["model"]], alpha=(1.0, 0.75, 0.6, 0.5)[min(nth, 3)],
                    label=label)
        if key in TARGETS:
            ax.axhline(100 * TARGETS[key], color="grey", linestyle="--", linewidth=1,
                       label=f"target {100 * TARGETS[key]:.0f}%")
        if key == "eval_mlm_accuracy" and baseline is not None:
            ax.axhline(100 * baseline, color="black", linestyle=":", linewidth=1,
                       label=f"most frequent token {100 * baseline:.1f}%")
        if key == "eval_nsp_accuracy_balanced":
            ax.axhline(50, color="black", linestyle=":", linewidth=1, label="chance 50%")
        ax.set_xlabel("optimizer steps" if args.steps else
                      "minutes of training (evaluation not counted)")
        ax.set_ylabel("%")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"experiment={args.experiment} on {args.label}: {budget_words(args)} per run "
                 f"on {os.cpu_count()} CPU cores, scored on held-out documents", fontsize=10)
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"picture: {args.png}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a bert-prep output directory")
    p.add_argument("--label", default=None, help="names the results (default: data dir name)")
    p.add_argument("--experiment", default="budget_mini")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--minutes", type=float, default=15.0, help="training budget per run")
    p.add_argument("--steps", type=int, default=None,
                   help="train N optimizer steps per run instead of --minutes")
    p.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="only our runs")
    p.add_argument("--transformers-seeds", type=int, nargs="+", default=None,
                   help="seeds of the transformers runs (default: --seeds)")
    p.add_argument("--transformers-eval-every", type=int, default=50,
                   help="evaluation interval (steps) of the transformers runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a bert-train override for every run (repeatable)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    p.add_argument("--png", default=None, help="picture path (default next to the JSON)")
    p.add_argument("--runs-dir", default=None, help="where the runs go (default bench/results/"
                                                    "learning_<label>_runs)")
    p.add_argument("--reuse", action="store_true",
                   help="keep the finished runs already in --runs-dir and train only the "
                        "missing ones (after an interruption, or to add seeds)")
    args = p.parse_args(argv)
    if not (Path(args.data) / "manifest.json").is_file():
        p.error(f"--data {args.data}: not a bert-prep output directory (no manifest.json)")
    args.data = str(Path(args.data).resolve())
    args.label = args.label or Path(args.data).name
    results = ROOT / "bench" / "results"
    args.out = args.out or str(results / f"learning_{args.label}.json")
    args.png = args.png or str(Path(args.out).with_suffix(".png"))
    runs_dir = Path(args.runs_dir or results / f"learning_{args.label}_runs").resolve()
    if runs_dir.exists() and any(runs_dir.iterdir()) and not args.reuse:
        p.error(f"{runs_dir} is not empty: remove it, pass another --runs-dir, or --reuse to "
                f"keep its finished runs")
    trf_seeds = args.seeds if args.transformers_seeds is None else args.transformers_seeds
    plan = [(model, seed) for seed in dict.fromkeys([*args.seeds, *trf_seeds])
            for model in ("ours", "transformers")
            if (seed in args.seeds if model == "ours" else args.transformers and seed in trf_seeds)]
    runs = []
    for model, seed in plan:
        run_dir = runs_dir / f"{model}_s{seed}"
        if args.reuse and (run_dir / RUN_FILE).is_file():
            print(f"reusing {model}, seed {seed}: {run_dir}", flush=True)
            runs.append(json.loads((run_dir / RUN_FILE).read_text()))
            continue
        if run_dir.exists():
            p.error(f"{run_dir} holds an unfinished run (no {RUN_FILE}): remove it")
        print(f"training {model}, seed {seed}, {budget_words(args)} ...", flush=True)
        runs.append(run_one(model, seed, args, run_dir))
    from bert_pretrain.components.data import PreparedData
    from bert_pretrain.components.evaluation import majority_baseline

    baseline = majority_baseline(PreparedData(args.data), "validation")
    summary = summarise(runs)
    print_table(runs, summary, args)
    result = {"label": args.label, "data": args.data, "experiment": args.experiment,
              "minutes": None if args.steps else args.minutes, "steps": args.steps,
              "overrides": args.set, "cpu_count": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "most_frequent_token_accuracy": baseline,
              "targets": TARGETS, "summary": summary, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"results: {args.out}")
    plot(runs, args, baseline)


if __name__ == "__main__":
    main()
