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
    with_average = len(averaged) > 1  # an average of one task is that task again
    if with_average:
        head.append("Average" if len(averaged) == 8 else f"Average ({len(averaged)} tasks)")
    lines = ["| Model | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for m in report["models"]:
        cells = [_cell(t, m["tasks"].get(t)) for t in tasks]
        if with_average:
            cells.append("-" if m["average"] is None else f"{100 * m['average']:.1f}")
        lines.append(f"| {m['label']} | " + " | ".join(cells) + " |")
    r = report["recipe"]
    note = (f"Dev sets; each number is the median over seeds {r['seeds']} at the best learning "
            f"rate of {r['lrs']} (chosen per task and model by that median).")
    if with_average:
        note += (" A task's score is the mean of its numbers; the average is over the tasks' "
                 "scores" + (", WNLI left out as is customary." if "wnli" in tasks else "."))
    lines += ["", note]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str) -> dict:
    """glue.json, glue.md, glue.png in out_dir; returns their paths."""
    from ..tools.plotting import Scores, plot_scores

    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"glue.{k}") for k in ("json", "md", "png")}
    tmp = paths["json"] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, paths["json"])
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(markdown_table(report))
    tasks = report["tasks"]
    averaged = [t for t in tasks if t not in NOT_AVERAGED]
    with_average = len(averaged) > 1  # an average of one task is that task again
    groups = [GLUE_TASKS[t].title for t in tasks] + \
        (["Average\n(no WNLI)" if "wnli" in tasks else "Average"] if with_average else [])
    series, colour_of = [], {}
    for m in report["models"]:
        entries = [m["tasks"].get(t) for t in tasks]
        values = [None if e is None else 100 * e["score"] for e in entries]
        spreads = [None if e is None else [100 * x for x in e["score_range"]] for e in entries]
        if with_average:
            values.append(None if m["average"] is None else 100 * m["average"])
            spreads.append(None)
        # a model's random-init control: the model's colour, an open marker
        colour = colour_of.setdefault(m["model"], len(colour_of))
        series.append(Scores(m["label"], values, spreads, colour, m["init"] == "random"))
    r = report["recipe"]
    plot_scores(paths["png"], groups, series, "score on the dev set (%)",
                f"GLUE dev: median of {len(r['seeds'])} seed(s) at each task's best learning "
                f"rate", [f"Error bars: the seeds' range at that rate. Open markers: the same "
                          f"model from random initialisation. Recipe: batch {r['batch_size']}, "
                          f"{r['epochs']:g} epochs, learning rates {r['lrs']}, max length "
                          f"{r['max_length']}, dropout {r['dropout']}"
                          + (f", {report['max_train_samples']:,} training examples per task"
                             if report.get("max_train_samples") else "")
                          + ("; the average leaves out WNLI." if "wnli" in tasks else ".")],
                separate_last=with_average)
    return paths
