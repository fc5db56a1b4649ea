"""Faults of the machine, not of tether or of the input: one line and exit status 5 each,
nothing left behind that blocks the same command, no process outliving its command.

Real processes and real file systems throughout: a path under /proc that cannot be made, a
tmpfs mounted read-only or too small for a checkpoint (where this machine lets the test
mount one: as root; else a directory without write permission and a file-size limit), a
`tether experiment` killed with SIGTERM and with SIGKILL, two model builds racing on a cold
cache. The Ray faults are in tests/test_ray.py, the trainer rank that never joins in
tests/test_distributed.py.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.race_gates import wait_until
from tether.cli import main
from tether.testbed import ensure_default_model

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SMALL = ["run.progress=false", "run.threads=1", "rollout.prompts_per_step=4",
         "rollout.group_size=2", "rollout.max_new_tokens=12", "task.eval_size=8",
         "eval.every=0", "eval.samples=0", "diagnostics.monitor_every=0", "train.steps=3",
         "run.checkpoint_every=1"]


def _one_line(err: str) -> str:
    """The single line a fault prints (stderr holds nothing else of tether's)."""
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("tether")
             and "rollout worker" not in ln and "trainer rank" not in ln]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


@contextmanager
def _tmpfs(path: Path, size: str, *options: str):
    """A tmpfs of `size` at `path`; skips the test where mounting is not allowed."""
    path.mkdir()
    opts = ",".join([f"size={size}", *options])
    if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                      check=False, capture_output=True).returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_run_dir_that_cannot_be_made_is_one_line_status_5(tmp_path, capsys, warm_model_dir):
    status = main(["train", f"model.path={warm_model_dir}", "run.dir=/proc/tether-missing/run",
                   *SMALL])
    line = _one_line(capsys.readouterr().err)
    assert status == 5 and line.startswith("tether train: environment: run.dir=/proc/tether-missing")
    assert "No such file or directory (ENOENT)" in line


def test_a_read_only_run_dir_is_one_line_status_5(tmp_path, capsys, warm_model_dir):
    mount = tmp_path / "ro"
    with _tmpfs(mount, "1m", "ro") as mounted:
        if not mounted:  # not root: a directory without write permission
            if os.geteuid() == 0:
                pytest.skip("root without mount: no unwritable directory can be made")
            mount.chmod(0o500)
        status = main(["train", f"model.path={warm_model_dir}", f"run.dir={mount}/run", *SMALL])
    line = _one_line(capsys.readouterr().err)
    assert status == 5 and f"run.dir={mount}/run" in line
    assert ("(EROFS)" if mounted else "(EACCES)") in line


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_stops_the_run_with_one_line_and_status_5(mode, tmp_path, warm_model_dir):
    """A checkpoint (28 MB) does not fit: config.yaml and the metric rows do. The async
    run's worker is ended with it."""
    disk, run_dir = tmp_path / "disk", tmp_path / "disk" / "run"
    args = ["train", f"model.path={warm_model_dir}", f"run.dir={run_dir}", *SMALL,
            f"loop.mode={mode}"]
    with _tmpfs(disk, "1m") as mounted:
        limit = None if mounted else 1 << 20  # else: a 1 MiB file-size limit (EFBIG)

        def limited() -> None:
            if limit:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails instead
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        t0 = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "tether.cli", *args], env=ENV,
                             preexec_fn=limited, check=False, capture_output=True, text=True, timeout=300)
        line = _one_line(run.stderr)
        assert run.returncode == 5, run.stderr[-3000:]
        assert str(run_dir / "checkpoints") in line
        assert ("(ENOSPC)" if mounted else "(EFBIG)") in line and "--resume" in line
        assert "rollout worker 0 ready" in run.stderr if mode == "async" else True
        assert time.monotonic() - t0 < 120


def test_a_failed_start_leaves_nothing_that_blocks_the_same_command(tmp_path, capsys,
                                                                    warm_model_dir):
    run_dir, broken = tmp_path / "run", tmp_path / "not-a-model"
    broken.mkdir()
    args = ["train", f"run.dir={run_dir}", *SMALL, "train.steps=1"]
    assert main([*args, f"model.path={broken}"]) == 2  # the model fails after the run dir was made
    assert "no config.json" in capsys.readouterr().err
    assert not run_dir.exists()
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")  # a directory the user made keeps what it held
    assert main([*args, f"model.path={broken}"]) == 2
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    assert main([*args, f"model.path={warm_model_dir}"]) == 0  # fixed: the same command runs
    assert (run_dir / "final" / "config.json").is_file()


def _processes() -> dict[int, tuple[str, int, int, int]]:
    """pid -> (state, parent pid, process group, session) of every process on the machine."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            state, ppid, pgrp, sid = stat[stat.rindex(")") + 2:].split()[:4]
            out[int(d.name)] = (state, int(ppid), int(pgrp), int(sid))
    return out


def _descendants(root: int) -> dict[int, tuple[str, int, int, int]]:
    procs, found, frontier = _processes(), {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, info in procs.items():
            if info[1] == parent and pid not in found:
                found[pid] = info
                frontier.append(pid)
    return found


def _stop_and_check(cmd: list[str], log: Path, sig: signal.Signals) -> None:
    """Start the experiment; once its async cell's rollout worker runs, send `sig` to the
    parent; no process of its session, its tree or its cells' groups may live 15 s later."""
    with open(log, "w") as f:
        parent = subprocess.Popen(cmd, env=ENV, stdout=f, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    started = wait_until(lambda: "rollout worker 0 ready" in log.read_text(),
                         lambda: parent.poll() is None)
    assert started, log.read_text()[-3000:]
    tree = _descendants(parent.pid)
    groups = {info[2] for info in tree.values()}
    # The async cell runs in a group of its own, with its rollout worker in it.
    assert any(info[1] != parent.pid and info[2] not in (parent.pid, pid)
               for pid, info in tree.items()), tree
    parent.send_signal(sig)
    parent.wait(timeout=60)
    text = log.read_text()
    assert parent.returncode == (128 + sig if sig == signal.SIGTERM else -sig), text[-3000:]
    if sig == signal.SIGTERM:
        assert "stopped by SIGTERM; the running cells were ended" in text

    def alive() -> dict[int, tuple[str, int, int, int]]:
        return {pid: info for pid, info in _processes().items() if info[0] != "Z" and (
            pid in tree or info[2] in groups or info[3] == parent.pid)}

    deadline = time.monotonic() + 15
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive() == {}


def test_killed_experiment_leaves_no_process_and_reruns_to_the_end(tmp_path, warm_model_dir):
    """Stopped by SIGTERM, rerun, killed by SIGKILL, rerun to the end: each time while the
    async cell runs, whose rollout worker is the cell's child, the grandchild the cell's
    process group must take along."""
    out = tmp_path / "exp"
    cmd = [sys.executable, "-m", "tether.cli", "experiment", "dlc", "--quick", "--out", str(out),
           "--model", str(warm_model_dir), "--workers", "2", "--only", "fp8_async2:dlc_window"]
    _stop_and_check(cmd, tmp_path / "term.txt", signal.SIGTERM)
    # The stopped run's time is on record (a record accrues every run's), with the cells it
    # finished (the reference may have, beside the async cell), not the one it stopped.
    done = len(list((out / "cells").glob("*/done.json")))
    assert json.loads((out / "timing.json").read_text())[-1] | {"wall_seconds": 0} == {
        "wall_seconds": 0, "cells_run": done, "cells_failed": 0, "workers": 2, "stopped": True}
    assert not (out / "cells" / "fp8_async2__dlc_window__s0" / "done.json").exists()
    _stop_and_check(cmd, tmp_path / "kill.txt", signal.SIGKILL)
    rerun = subprocess.run(cmd, check=False, env=ENV, capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "0 failed" in rerun.stdout
    assert all((d / "done.json").is_file() for d in (out / "cells").iterdir())


def test_concurrent_builds_of_one_cold_cache_build_once(tmp_path, capsys):
    """A second build of the same model starts while a `tether init-model` process holds the
    lock (it has said it is building): it waits, then returns the first one's model."""
    first = subprocess.Popen([sys.executable, "-m", "tether.cli", "init-model",
                              f"model.cache_dir={tmp_path}", "model.warmstart_steps=10"],
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    head = first.stdout.readline()
    assert head.startswith("building tether's tiny dense model"), head
    second = ensure_default_model(str(tmp_path), warmstart_steps=10)  # in this process
    rest = first.communicate(timeout=300)[0]
    assert first.returncode == 0, rest
    said = capsys.readouterr().out
    assert said.startswith("waiting for another process building") and "building tether" not in said
    assert "building tether's tiny" not in rest  # built once, by the first
    assert str(second) == rest.strip().splitlines()[-1] and (second / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".building-")] == []
