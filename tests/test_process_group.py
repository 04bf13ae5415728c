"""A peer that never comes is an error in one line after trainer.process_group_timeout_s, never a
silent hang: process 0 of 2 started by hand (as a launcher would, RANK/WORLD_SIZE/MASTER_* in
the environment) with no process 1.  Before components/process_group.py the wait was accelerate's
init_process_group with torch's default timeout: 30 minutes, then a traceback.  And a peer lost
in the middle of the run (it dies, or hangs past the timeout) ends the other process in one line
too, where gloo's traceback ended it before.  And processes started with other settings (another
override on one machine, other data) stop at start-up in one line that names the difference,
and a process whose peer stopped at an error of its own in start-up ends in one line."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from test_distributed import free_port
from time_limits import hang_limit
from bert_pretrain.components.run_setup import _comparable, _differences, code_digest
from train_support import REPO, await_one_of, run_all, write_prepared


def test_process_0_alone_stops_in_one_line_after_the_timeout(tmp_path):
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": "0",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.train", "experiment=smoke",
                        f"data.dir={data}", f"run_dir={tmp_path / 'run'}", "trainer.cpu=true",
                        "trainer.process_group_timeout_s=2"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit())
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    assert lines[0].startswith(f"bert-train: error: process 0 of 2 could not join the others at "
                               f"127.0.0.1:{port} within trainer.process_group_timeout_s=2 (")
    assert not (tmp_path / "run").exists()  # nothing left behind


@pytest.mark.parametrize("fault, words", [
    ("1:step:3", "by peer"),            # process 1 dies mid-step: its connection closes
    ("1:step:3:STOP", "Timed out"),     # process 1 hangs: the all-reduce waits out the timeout
])
def test_a_peer_lost_mid_run_ends_the_other_in_one_line(tmp_path, fault, words):
    """Two processes started by hand (as a launcher would); process 1 dies or hangs in the middle
    of step 3 (BERT_TRAIN_FAULT).  Process 0, waiting for it in the step's all-reduce, ends in
    one line naming the step and the checkpoint to resume from, exit status 1: not gloo's
    traceback, and not a wait without end."""
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    port = free_port()
    procs, out, err = await_one_of([(
        [sys.executable, "-m", "bert_pretrain.train", "experiment=smoke", f"data.dir={data}",
         f"run_dir={tmp_path / 'run'}", "trainer.cpu=true", "trainer.checkpoint_every=2",
         "trainer.max_steps=6", "trainer.process_group_timeout_s=3", "trainer.prefetch=false"],
        {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": str(rank),
         "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
         "BERT_TRAIN_FAULT": fault}) for rank in (0, 1)], awaited=0)
    assert procs[0].returncode == 1, out + err
    assert "Traceback" not in err, err
    lost = [line for line in err.splitlines() if line.startswith("bert-train: error:")]
    assert len(lost) == 1, err
    assert lost[0].startswith("bert-train: error: [rank 0] lost the other processes after step 2 "
                              "(gloo: "), lost[0]
    assert words in lost[0] and "trainer.process_group_timeout_s=3 s" in lost[0]
    assert "resume=auto continues from the last complete checkpoint (step 2)" in lost[0]


def pair(tmp_path, data: str, overrides: dict[int, list[str]], wrap: dict[int, list[str]] | None
         = None, run_dir=None) -> list[subprocess.CompletedProcess]:
    """Processes 0 and 1 of one job, started by hand (as a launcher would), the same command
    (run_dir: tmp_path/run unless given) plus each one's own `overrides`, each under its own
    `wrap` command if any; both awaited."""
    port = free_port()
    return run_all([(
        [*(wrap or {}).get(rank, []), sys.executable, "-m", "bert_pretrain.train",
         "experiment=smoke", f"data.dir={data}", f"run_dir={run_dir or tmp_path / 'run'}",
         "trainer.cpu=true", "trainer.max_steps=4",
         "trainer.process_group_timeout_s=30", "trainer.prefetch=false", *overrides.get(rank, [])],
        {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": str(rank),
         "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        for rank in (0, 1)])


def errors(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in r.stderr.splitlines() if "error" in line.lower()]


def test_processes_started_with_other_settings_stop_at_start_up_in_one_line(tmp_path):
    """Process 1 of a job got another optim.lr and trainer.max_steps (a machine launched with a
    stale command): it trained on before, DDP's replicas drifting apart without a word (each
    applied the averaged gradient with its own lr), or, with another max_steps, both waited in a
    collective for the process-group timeout.  Now both stop before anything is written, exit
    status 2, and rank 0 prints the one line naming the difference."""
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    r0, r1 = pair(tmp_path, data, {0: ["optim.lr=0.001"],
                                   1: ["optim.lr=0.0005", "trainer.max_steps=8"]})
    assert (r0.returncode, r1.returncode) == (2, 2), r0.stderr + r1.stderr
    assert errors(r0) == [
        "bert-train: error: rank 1 runs other settings than rank 0: optim.lr: 0.0005 there, "
        "0.001 on rank 0; trainer.max_steps: 8 there, 4 on rank 0; every process of a job must "
        "run the same bert-train command (the same overrides, config files and prepared data on "
        "every machine)"], r0.stderr
    assert errors(r1) == [], r1.stderr  # (rank 0 says it; rank 1's error file has it)
    assert "Traceback" not in r0.stderr + r1.stderr
    assert not (tmp_path / "run").exists()  # nothing left behind


@pytest.mark.parametrize("other", ["copy", "other data"])
def test_each_machine_may_read_its_own_copy_of_the_data_but_not_other_data(tmp_path, other):
    """data.dir may differ between processes (a copy on each machine's own disk): a copy of the
    same prepared data trains; data prepared otherwise (another manifest) is refused in one
    line naming both folders."""
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    mine = str(tmp_path / "mine")
    if other == "copy":
        shutil.copytree(data, mine)
    else:
        write_prepared(mine, num_train=24, num_valid=8)
    r0, r1 = pair(tmp_path, data, {1: [f"data.dir={mine}"]})
    if other == "copy":
        assert (r0.returncode, r1.returncode) == (0, 0), r0.stderr + r1.stderr
        assert "bert-train: finished at step 4" in r0.stdout
        return
    assert (r0.returncode, r1.returncode) == (2, 2), r0.stderr + r1.stderr
    line, = errors(r0)
    assert line.startswith(f"bert-train: error: rank 1 runs other settings than rank 0: "
                           f"data.dir's manifest.json: {mine} (sha256 "), line
    assert f" there, {data} (sha256 " in line and line.count(";") == 1, line


def test_a_peer_that_stops_at_its_own_error_in_start_up_ends_the_other_in_one_line(tmp_path):
    """Process 1's data folder is missing on its machine: it stops with its own line (exit 2;
    in its error file, rank 0 prints the job's lines); process 0, waiting for it in start-up,
    ended in Hydra's 'Error executing job' and gloo's traceback.  Now one line, exit status 1,
    and no run folder left."""
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    r0, r1 = pair(tmp_path, data, {1: [f"data.dir={tmp_path / 'missing'}"]})
    assert (r0.returncode, r1.returncode) == (1, 2), r0.stderr + r1.stderr
    assert "Traceback" not in r0.stderr and "Error executing job" not in r0.stderr, r0.stderr
    line, = errors(r0)
    assert line.startswith("bert-train: error: [rank 0] lost the other processes during start-up"
                           " (gloo: "), line
    assert line.endswith("nothing was trained. Run the same command again once that is fixed")
    assert not (tmp_path / "run").exists()


def test_the_difference_line_names_hosts_other_ranks_and_counts_the_rest():
    base = {"optim.lr": 0.001, "trainer.max_steps": 10, "a": 1, "b": 2, "c": 3,
            "data.dir's manifest.json": "ab" * 32}
    other = {**base, "a": 5, "b": 6, "c": 7, "optim.lr": 0.002}
    line = _differences([(base, "gpu-a", "/d"), (base, "gpu-a", "/d"), (other, "gpu-b", "/d"),
                         ({**base, "a": 9}, "gpu-c", "/d")])
    assert line.startswith("rank 2 on gpu-b and 1 other rank(s) runs other settings than rank 0 "
                           "on gpu-a: a: 5 there, 1 on rank 0; b: 6 there, 2 on rank 0; c: 7 "
                           "there, 3 on rank 0 (and 1 more settings); every process"), line
    # a key only one side has; a manifest one side could not read is left to the data's check
    assert _differences([(base, "h", "/d"), ({**base, "extra": 1}, "h", "/d")]).startswith(
        "rank 1 runs other settings than rank 0: extra: 1 there, unset on rank 0;")
    assert _differences([(base, "h", "/d"), ({**base, "data.dir's manifest.json": None}, "h",
                                             "/e")]) == ""


def own_mount_of(folder) -> list[str] | None:
    """A command prefix that runs a command in a mount namespace of its own where `folder` is a
    fresh empty tmpfs (as another machine's own disk at the same path would be), or None where
    this machine cannot make one (no unshare, no privilege for a mount namespace)."""
    wrap = ["sh", "-c", f'mount -t tmpfs none "{folder}" && exec "$@"', "sh"]
    for unshare in (["unshare", "-m", "--propagation", "private"],
                    ["unshare", "-U", "-r", "-m", "--propagation", "private"]):
        try:
            if subprocess.run([*unshare, *wrap, "true"], capture_output=True,
                              timeout=hang_limit()).returncode == 0:
                return [*unshare, *wrap]
        except OSError:
            return None
    return None


def test_a_run_dir_that_is_not_one_folder_for_every_process_stops_at_start_up(tmp_path):
    """Process 1 runs where run_dir's parent is a folder of its own (a mount namespace with a
    tmpfs there: another machine whose run_dir is on its own disk).  Before, the job trained to
    the first checkpoint and process 1 ended there in a traceback ('Parent directory
    .../.tmp-step-00000002 does not exist'); now both stop at start-up, exit status 2, rank 0
    prints one line naming the folder, and nothing is left in it."""
    runs = tmp_path / "runs"
    runs.mkdir()
    wrap = own_mount_of(runs)
    if wrap is None:
        pytest.skip("this machine cannot make a mount namespace (unshare -m / -Urm)")
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    r0, r1 = pair(tmp_path, data, {}, wrap={1: wrap}, run_dir=runs / "run")
    assert (r0.returncode, r1.returncode) == (2, 2), r0.stderr + r1.stderr
    assert errors(r0) == [
        f"bert-train: error: run_dir {runs / 'run'} is not one folder for every process: rank 1 "
        f"does not see the folder rank 0 locked there; every process writes its part of each "
        f"checkpoint into it, so put run_dir on storage every machine mounts at the same path "
        f"(NFS, Lustre, a shared disk)"], r0.stderr
    assert "Traceback" not in r0.stderr + r1.stderr, r1.stderr
    assert list(runs.iterdir()) == []  # (rank 0's run folder, made for this run, removed)


def test_the_settings_compared_hold_the_data_torch_and_our_code(tmp_path):
    """What each process compares beside its config: data.dir's manifest (not the path), torch's
    version, and a digest of bert_pretrain's .py files, which changes with any of their bytes
    (a machine whose checkout was not updated)."""
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    flat = _comparable({"data": {"dir": data, "seq": 32}, "optim": {"lr": 0.1, "betas": [1, 2]}})
    assert "data.dir" not in flat and flat["data.seq"] == 32 and flat["optim.betas"] == [1, 2]
    assert len(flat["data.dir's manifest.json"]) == 64 and flat["torch version"]
    assert _comparable({"data": {"dir": str(tmp_path / "none")}})["data.dir's manifest.json"] \
        is None
    package = tmp_path / "bert_pretrain"
    shutil.copytree(os.path.join(REPO, "bert_pretrain"), package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert code_digest(str(package)) == flat["bert_pretrain's code"] == code_digest()
    trainer = package / "trainer.py"
    trainer.write_text(trainer.read_text() + "\n# a line more\n")
    assert code_digest(str(package)) != code_digest()


@pytest.mark.parametrize("env, refused", [
    ({}, False),
    ({"RANK": "0"}, False),                       # (accelerate ignores RANK alone)
    ({"WORLD_SIZE": "1", "RANK": "0"}, False),
    ({"LOCAL_RANK": "0"}, True),                  # a launched job's shell, copied
    ({"RANK": "1", "WORLD_SIZE": "2"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, True),        # mpirun
    ({"LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1"}, False),
])
def test_a_launchers_variables_without_its_address_are_refused(monkeypatch, env, refused):
    from bert_pretrain.components.process_group import _GROUP_VARIABLES, check_launch_environment
    from bert_pretrain.errors import ConfigError

    for name in (*_GROUP_VARIABLES, "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if not refused:
        check_launch_environment()
        return
    with pytest.raises(ConfigError) as exc_info:
        check_launch_environment()
    names = [n for n in _GROUP_VARIABLES if n in env]
    assert str(exc_info.value).startswith(
        f"the environment sets {', '.join(f'{n}={env[n]}' for n in names)} (a launcher's "
        f"variables) but not MASTER_ADDR") and f"unset {' '.join(names)}" in str(exc_info.value)


@pytest.mark.parametrize("env", [{"LOCAL_RANK": "0"}, {"RANK": "1", "WORLD_SIZE": "2"}])
def test_bert_train_with_a_launchers_variables_but_no_launcher_stops_in_one_line(tmp_path, env):
    """Before: accelerate took the process for one of a group and ended in torch's traceback
    ('environment variable MASTER_ADDR expected, but not set'); a RANK other than 0 printed
    nothing at all, since only the main process of a launch prints a user error."""
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.train", "experiment=smoke",
                        f"data.dir={data}", f"run_dir={tmp_path / 'run'}", "trainer.max_steps=3"],
                       cwd=REPO, env={**clean, "OMP_NUM_THREADS": "1", **env},
                       capture_output=True, text=True, timeout=hang_limit())
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("bert-train: error: the environment sets ") and \
        lines[0].endswith("to run one process"), lines[0]
    assert not (tmp_path / "run").exists()
