"""bert-glue's outputs: glue.json (every number), glue.md (the table in the layout of the BERT
paper's GLUE table: one column per task, MNLI first, the average last and without WNLI) and
glue.png (the models side by side per task)."""

from __future__ import annotations

import json
import os

from . import scoring
from .tasks import GLUE_TASKS, NOT_AVERAGED

# What a table cell shows, per task: its metrics in this order, joined by '/'.
CELL_METRICS = {"mnli": ("accuracy_m", "accuracy_mm"), "qqp": ("f1", "accuracy"),
                "mrpc": ("f1", "accuracy"), "stsb": ("pearson", "spearman"), "cola": ("mcc",)}
CELL_NAMES = {"mnli": "m/mm", "qqp": "F1/acc", "mrpc": "F1/acc", "stsb": "P/S", "cola": "MCC"}


def model_entry(label: str, path: str, init: str, summaries: dict) -> dict:
    """One model's row of glue.json: per task the fine-tuning summary's headline numbers."""
    tasks = {}
    for name, s in summaries.items():
        tasks[name] = {k: s[k] for k in ("score", "metrics", "best_lr", "score_range",
                                          "num_train", "train_seconds", "wall_seconds",
                                          "out_dir", "checkpoint")}
        tasks[name]["grid"] = [{"lr": g["lr"], "score": g["score"]} for g in s["grid"]]
    return {"label": label, "model": path, "init": init, "tasks": tasks,
            "average": scoring.glue_average({t: v["score"] for t, v in tasks.items()},
                                            NOT_AVERAGED)}


def _cell(task: str, entry) -> str:
    if entry is None:
        return "-"
    keys = CELL_METRICS.get(task, ("accuracy",))
    return "/".join(f"{100 * entry['metrics'][k]:.1f}" for k in keys)


def markdown_table(report: dict) -> str:
    tasks = report["tasks"]
    averaged = [t for t in tasks if t not in NOT_AVERAGED]
    head = [f"{GLUE_TASKS[t].title}" + (f" ({CELL_NAMES[t]})" if t in CELL_NAMES else "")
            for t in tasks]
    avg_name = "Average" if len(averaged) == 8 else \
        f"Average ({len(averaged)} task{'s' if len(averaged) > 1 else ''})"
    lines = ["| Model | " + " | ".join(head) + f" | {avg_name} |",
             "|---|" + "---:|" * (len(tasks) + 1)]
    for m in report["models"]:
        avg = m["average"]
        lines.append(f"| {m['label']} | " + " | ".join(_cell(t, m["tasks"].get(t))
                                                       for t in tasks)
                     + f" | {'-' if avg is None else f'{100 * avg:.1f}'} |")
    r = report["recipe"]
    lines += ["", f"Dev sets; each number is the median over seeds {r['seeds']} at the best "
                  f"learning rate of {r['lrs']} (chosen per task and model by that median). "
                  f"A task's score is the mean of its numbers; the average is over the tasks' "
                  f"scores" + (", WNLI left out as is customary." if "wnli" in tasks else ".")]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str) -> dict:
    """glue.json, glue.md, glue.png in out_dir; returns their paths."""
    from ..plotting import Bars, plot_grouped_bars

    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"glue.{k}") for k in ("json", "md", "png")}
    tmp = paths["json"] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, paths["json"])
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(markdown_table(report))
    tasks = report["tasks"]
    groups = [GLUE_TASKS[t].title for t in tasks] + \
        ["Average\n(no WNLI)" if "wnli" in tasks else "Average"]
    bars = []
    for m in report["models"]:
        entries = [m["tasks"].get(t) for t in tasks]
        values = [None if e is None else 100 * e["score"] for e in entries]
        spreads = [None if e is None else [100 * x for x in e["score_range"]] for e in entries]
        values.append(None if m["average"] is None else 100 * m["average"])
        spreads.append(None)
        bars.append(Bars(m["label"], values, spreads))
    r = report["recipe"]
    plot_grouped_bars(paths["png"], groups, bars, "task score (dev set)",
                      f"GLUE dev: median of {len(r['seeds'])} seed(s) at each task's best lr",
                      [f"bars: the seeds' range at that lr; Average leaves out WNLI; recipe: "
                       f"batch {r['batch_size']}, {r['epochs']:g} epochs, lrs {r['lrs']}, max "
                       f"length {r['max_length']}"], separate_last=True)
    return paths
