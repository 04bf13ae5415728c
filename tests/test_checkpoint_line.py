"""The checkpoint line's invariants, tested directly (checkpoint_line.py): a save killed at any
point between its writes, on a fresh line, a branched line, a line that starts from another run's
checkpoint and a re-save of the same step, is found by resume=auto (the new checkpoint once it is
renamed into place, else the previous end of the line), and nothing is moved aside or deleted by
the next start; a user's own folders in checkpoints/ are never removed."""

import os
import shutil

import pytest
import torch

from bert_pretrain.components import checkpoint as ckpt
from bert_pretrain.components import checkpoint_manager as cm
from bert_pretrain.model import BertConfig, BertForPreTraining
from test_checkpoint import SMALL


class Killed(BaseException):
    """What a kill -9 is to the code under test: nothing after it runs, no except clause
    catches it."""


# The writes a save makes that change what is on disk for a reader (everything else happens
# inside a temporary folder no reader looks at).
MUTATIONS = (("os", "rename"), ("os", "replace"), ("os", "remove"), ("shutil", "rmtree"))


class KillAt:
    """Raise Killed at the `at`-th filesystem mutation (None: count them, kill nothing)."""

    def __init__(self, monkeypatch, at=None):
        self.at, self.count = at, 0
        modules = {"os": os, "shutil": shutil}
        for module, name in MUTATIONS:
            real = getattr(modules[module], name)
            monkeypatch.setattr(modules[module], name, self._wrap(real))

    def _wrap(self, real):
        def mutate(*args, **kwargs):
            if self.at is not None and self.count == self.at:
                raise Killed
            self.count += 1
            return real(*args, **kwargs)
        return mutate


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return BertForPreTraining(BertConfig(**SMALL))


def _save(manager, step, model):
    return manager.save(step, model=model,
                        optimizer_state=torch.optim.AdamW(model.parameters()).state_dict(),
                        extra_state={}, train_state={"model_config": model.config.to_dict()},
                        config_yaml="seed: 1\n", tokenizer_dir=None)


def _resume_auto(run):
    """What bert-train's start does with resume=auto: repair, find, begin. Returns (the
    checkpoint found, the names begin moved aside)."""
    manager = cm.CheckpointManager(run)
    manager.repair()
    found = manager.find("auto")
    return found, manager.begin(found)


def _fresh(root, model):
    """A fresh run: no checkpoint yet; the save under test is its first."""
    return cm.CheckpointManager(os.path.join(root, "run")), None


def _continued(root, model):
    """A line of three checkpoints (keep_last_k=2, so the save under test also deletes)."""
    manager = cm.CheckpointManager(os.path.join(root, "run"), keep_last_k=2)
    for step in (1, 2, 3):
        _save(manager, step, model)
    return manager, "step-00000003"


def _branched(root, model):
    """Steps 1-4, then a resume from step 2: 3 and 4 are moved aside; the save under test is
    the branch's first."""
    run = os.path.join(root, "run")
    first = cm.CheckpointManager(run)
    for step in (1, 2, 3, 4):
        _save(first, step, model)
    manager = cm.CheckpointManager(run)
    manager.begin(os.path.join(cm.checkpoints_root(run), "step-00000002"))
    return manager, "step-00000002"


def _from_another_run(root, model):
    """This run resumed from another run's step 2: its line starts outside the run dir."""
    other = cm.CheckpointManager(os.path.join(root, "other"))
    for step in (1, 2):
        _save(other, step, model)
    manager = cm.CheckpointManager(os.path.join(root, "run"))
    manager.begin(os.path.join(cm.checkpoints_root(os.path.join(root, "other")), "step-00000002"))
    return manager, None


def _resave(root, model):
    """The line's end is saved again at the same step (the .old swap)."""
    manager = cm.CheckpointManager(os.path.join(root, "run"))
    for step in (1, 2):
        _save(manager, step, model)
    manager = cm.CheckpointManager(os.path.join(root, "run"))
    manager.begin(manager.find("auto"))
    return manager, "step-00000002"


def _siblings(order):
    """The line's end (step 2) has two children that the pointer does not list, steps 3 and
    4, saved in `order` (each by a save the pointer's rewrite never reached, the other hidden
    meanwhile: two unrecorded continuations of one end).  The line follows the newest (highest
    step), whatever order they came in and listdir gives them; the other stays, off the line."""
    def setup(root, model):
        run = os.path.join(root, "run")
        manager = cm.CheckpointManager(run)
        for step in (1, 2):
            _save(manager, step, model)
        folder = cm.checkpoints_root(run)
        pointer = open(os.path.join(folder, cm.POINTER)).read()
        for step in order:
            others = [n for n in os.listdir(folder) if n.startswith("step-0000000")
                      and ckpt.step_of(n) > 2]
            for name in others:
                os.rename(os.path.join(folder, name), os.path.join(root, name))
            _save(cm.CheckpointManager(run), step, model)  # continues step 2
            for name in others:
                os.rename(os.path.join(root, name), os.path.join(folder, name))
            open(os.path.join(folder, cm.POINTER), "w").write(pointer)
        assert {cm.CheckpointManager(run).chain.parent_of(n)
                for n in ("step-00000003", "step-00000004")} == {"step-00000002"}
        return cm.CheckpointManager(run), "step-00000004"
    return setup


def _off_line_in_own_folder(root, model):
    """This run resumed from another run's step 2 and saved step 3, then resumed from that
    run's step 8 (step 3 stays, off the new line), then explicitly from its own step 3 again:
    the line is [step 3], and its root, the other run's step 2, comes with it."""
    other = cm.CheckpointManager(os.path.join(root, "other"))
    for step in (2, 8):
        _save(other, step, model)
    source = cm.checkpoints_root(os.path.join(root, "other"))
    run = os.path.join(root, "run")
    manager = cm.CheckpointManager(run)
    manager.begin(os.path.join(source, "step-00000002"))
    _save(manager, 3, model)
    assert cm.CheckpointManager(run).begin(os.path.join(source, "step-00000008")) == []
    manager = cm.CheckpointManager(run)
    assert manager.begin(os.path.join(cm.checkpoints_root(run), "step-00000003")) == []
    return manager, "step-00000003"


SCENARIOS = {"fresh": (_fresh, 5), "continued": (_continued, 4), "branched": (_branched, 3),
             "from another run": (_from_another_run, 3), "re-save": (_resave, 2),
             "siblings, lower step first": (_siblings((3, 4)), 5),
             "siblings, higher step first": (_siblings((4, 3)), 5),
             "off-line checkpoint of its own": (_off_line_in_own_folder, 4)}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_save_killed_at_any_point_is_found_by_resume_auto(scenario, model, tmp_path,
                                                             monkeypatch):
    setup, step = SCENARIOS[scenario]
    name = ckpt.step_dir_name(step)
    with monkeypatch.context() as m:  # how many writes a whole save makes
        counter = KillAt(m)
        manager, _ = setup(str(tmp_path / "count"), model)
        counter.count = 0
        _save(manager, step, model)
        writes = counter.count
    assert writes >= 2  # (the rename into place, the pointer)
    for at in range(writes + 1):
        root = tmp_path / f"kill{at}"
        manager, before = setup(str(root), model)
        run = manager.run_dir
        with monkeypatch.context() as m:
            KillAt(m, at)
            try:
                _save(manager, step, model)
            except Killed:
                pass
        ckpt._verified.clear()  # a new process
        saved = os.path.isfile(os.path.join(cm.checkpoints_root(run), name, ckpt.STATE_JSON))
        found, moved = _resume_auto(run)
        expected = name if saved else before
        assert (found and os.path.basename(found)) == expected, (scenario, at)
        assert moved == [], (scenario, at)  # nothing of the line is taken for a branch
        aside = [n for n in os.listdir(cm.checkpoints_root(run))
                 if n.startswith(cm.ABANDONED_PREFIX)]
        assert len(aside) == (scenario == "branched"), (scenario, at)  # (the setup's branch)
        # the next save continues the line found, and the line is whole again
        manager = cm.CheckpointManager(run)
        manager.repair()
        manager.begin(manager.find("auto"))
        _save(manager, step + 1, model)
        line = manager.current_line()
        assert line[-1] == ckpt.step_dir_name(step + 1) and line[-2:-1] == \
            ([expected] if expected else []), (scenario, at, line)
        # invariant 1: each names the previous one as its parent (a re-save not itself), the
        # first the line's root (or a checkpoint of this run that retention took off the line)
        assert [manager.chain.parent_of(n) for n in line[1:]] == line[:-1], (scenario, at)
        first, root = manager.chain.parent_of(line[0]), manager.chain.read().root
        assert first == root or (root is None and ckpt.STEP_DIR.match(first or "")), \
            (scenario, at, first, root)


def test_the_first_save_after_a_resume_from_another_run_is_found_without_the_pointer(model,
                                                                                      tmp_path):
    """Killed between its rename and the pointer's rewrite: the pointer still holds the empty
    line begin() wrote, and resume=auto must continue from the save (not start over and move
    it aside)."""
    other = str(tmp_path / "other")
    first = cm.CheckpointManager(other)
    for step in (1, 2):
        _save(first, step, model)
    run = str(tmp_path / "run")
    manager = cm.CheckpointManager(run)
    manager.begin(os.path.join(cm.checkpoints_root(other), "step-00000002"))
    pointer = open(os.path.join(cm.checkpoints_root(run), cm.POINTER)).read()
    path = _save(manager, 3, model)
    open(os.path.join(cm.checkpoints_root(run), cm.POINTER), "w").write(pointer)
    found, moved = _resume_auto(run)
    assert found == path and moved == []
    assert sorted(os.listdir(cm.checkpoints_root(run))) == [cm.POINTER, "step-00000003"]


def test_repair_keeps_a_users_own_folders(model, tmp_path):
    """`cp -r step-00000002 step-00000002.old` is a backup, and `notes.old` is the user's:
    repairing interrupted saves removes only what a save leaves behind."""
    run = str(tmp_path / "run")
    manager = cm.CheckpointManager(run)
    for step in (1, 2):
        _save(manager, step, model)
    root = cm.checkpoints_root(run)
    shutil.copytree(os.path.join(root, "step-00000002"), os.path.join(root, "step-00000002.old"))
    os.makedirs(os.path.join(root, "notes.old"))
    open(os.path.join(root, "notes.old", "todo.txt"), "w").write("keep me\n")
    found, moved = _resume_auto(run)
    assert os.path.basename(found) == "step-00000002" and moved == []
    assert ckpt.verify_checkpoint(os.path.join(root, "step-00000002.old"))["step"] == 2
    assert open(os.path.join(root, "notes.old", "todo.txt")).read() == "keep me\n"


def test_an_earlier_versions_interrupted_resave_is_said_not_moved(model, tmp_path):
    """Before .old-step-N a killed re-save left step-N.old alone: resume=auto names it (it may
    be the only copy) and leaves it, as it leaves a user's backup."""
    run = str(tmp_path / "run")
    manager = cm.CheckpointManager(run)
    for step in (1, 2):
        _save(manager, step, model)
    root = cm.checkpoints_root(run)
    os.rename(os.path.join(root, "step-00000002"), os.path.join(root, "step-00000002.old"))
    said = []
    manager = cm.CheckpointManager(run, warn=said.append)
    manager.repair()
    assert any("step-00000002.old has no step-00000002 beside it" in line for line in said), said
    assert os.path.isdir(os.path.join(root, "step-00000002.old"))
