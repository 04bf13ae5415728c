"""`bert-glue`: the GLUE table for one or several pretrained models, from one command.

    bert-glue 'models=[runs/demo]'                                  # all nine tasks, the hub
    bert-glue 'models=[runs/a,runs/b]' tasks=fast data_dir=glue_data controls=true

Every (model, task) is a bert-finetune grid in <out_dir>/<model label>/<task>/ (so a rerun skips
what finished and resumes what was interrupted; a folder that holds the grid of another model or
recipe is left as it is and the new one goes beside it, <task>-2: identity.py); then glue.json,
glue.md and glue.png, the report of this command.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import hydra
from omegaconf import DictConfig, OmegaConf

# (also: OpenMP policy, schemas)
from .cli import CONF_DIR, check_command_line, guarded, interruptible


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", label).strip("_") or "model"


def run_glue(g, config_yaml: str = "") -> dict:
    """Fine-tune every model on every task of `g` (GlueSettings); write the report."""
    from .config import FinetuneSettings
    from .glue_report import model_entry, write_report
    from .grid import describe_summary, prepare_job, run_grid, say_main
    from .pretrained import load_pretrained
    from .runner import Session
    from .tasks import TaskConfig

    session = Session.start(g.trainer, config_yaml, "bert-glue")
    say = say_main(session)
    start = time.perf_counter()
    entries = []  # each model, then (controls=true) the same model from random init
    for label, path in zip(g.labels, g.models):
        entries.append((label, path, "pretrained"))
        if g.controls:
            entries.append((f"{label} (random init)", path, "random"))
    controls = " and their random-init controls" if g.controls else ""
    say(f"bert-glue: {len(g.models)} model(s){controls} x {len(g.tasks)} task(s) "
        f"({', '.join(g.tasks)}), {len(g.recipe.lrs)} lr x {len(g.recipe.seeds)} seed(s) each; "
        f"precision {session.precision}; out_dir {g.out_dir}")
    models, loaded = [], {}
    try:
        for label, path, init in entries:
            if path not in loaded:
                loaded[path] = load_pretrained(path)
                for note in loaded[path].warnings(g.recipe.pooling):
                    say(f"bert-glue: warning: {note}")
            summaries = {}
            for task in g.tasks:
                s = FinetuneSettings(
                    task=TaskConfig(name=task, data_dir=g.data_dir,
                                    max_train_samples=g.max_train_samples,
                                    max_eval_samples=g.max_eval_samples),
                    recipe=g.recipe, trainer=g.trainer, impl=g.impl, model=path, init=init,
                    out_dir=os.path.join(g.out_dir, _slug(label), task))
                job = prepare_job(s, loaded[path], config_yaml, say, precision=session.precision)
                summaries[task] = run_grid(session, job, s.out_dir, say)
                say(f"bert-glue: {label}: {describe_summary(summaries[task])}")
            models.append(model_entry(label, path, init, summaries))
        report = {"tasks": list(g.tasks), "models": models,
                  "recipe": dataclasses.asdict(g.recipe), "precision": session.precision,
                  "processes": session.world, "max_train_samples": g.max_train_samples,
                  "wall_seconds": round(time.perf_counter() - start, 1)}
        if session.main:
            from .glue_report import markdown_table

            from ..command_record import write_record

            paths = write_report(report, g.out_dir)
            write_record(g.out_dir, config_yaml, replace=True)  # the record of this report
            say("\n" + markdown_table(report))
            say(f"bert-glue: wrote {paths['json']}, {paths['md']}, {paths['png']}")
        return report
    finally:
        session.accelerator.end_training()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="glue")
def _run(cfg: DictConfig) -> float:
    from .config import glue_settings

    report = guarded("bert-glue", lambda: run_glue(glue_settings(cfg),
                                                   OmegaConf.to_yaml(cfg, resolve=True)))
    average = report["models"][0]["average"]  # the first model's, for a sweeper
    return float("nan") if average is None else average


def main() -> None:
    from .config import GlueConfig

    def work():
        check_command_line("bert-glue", "glue", GlueConfig)
        _run()

    interruptible("bert-glue", work)


if __name__ == "__main__":
    main()
