"""Nothing lost, nothing trusted blindly: a save killed (kill -9) or out of disk at *every* phase leaves the
last complete checkpoint loadable, whole, and what it left behind is removed by the next save; what is loaded
is what was saved (each file's SHA-256, the manifest's own), from an optimizer of the same class."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import time
from dataclasses import replace

import pytest
import torch

import minizero.checkpoint.files as files
from minizero import checkpoint
from minizero.checkpoint import CheckpointError
from minizero.checkpoint.directory import find as find_with_notes
from minizero.course.harness.experiment import Experiment, build, run_experiment
from minizero.course.harness.tasks import TASKS
from minizero.run.launch import RankError
from minizero.stages import Stage


def _stage(value: float | None = None) -> Stage:
    """One device's stage over the small MLP, every parameter set to ``value`` (so a load says whose it was)."""
    model = TASKS["mlp"].make_model(0, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if value is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
    return Stage(model, optimizer)


def _loaded_value(root) -> float:
    """The one value every parameter of the checkpoint ``root`` resolves to holds (fails on a mix)."""
    stage = _stage()
    checkpoint.load(stage, root)
    values = {float(v) for p in stage.module.parameters() for v in p.detach().reshape(-1)}
    assert len(values) == 1, f"a mix of two saves: {sorted(values)[:4]}"
    return values.pop()


def _leftovers(root) -> list[str]:
    return sorted([p.name for p in root.iterdir() if p.name.startswith(".")] +
                  [str(p.relative_to(root)) for p in root.glob("step-*/*") if files.TEMPORARY in p.name])


class _Events:
    """Counts the moments a save can be cut at -- a file's first and second write (nothing, then part of it
    on disk), each fsync, each rename, each removal -- and acts (``act(event)``) at the ``at``-th."""

    def __init__(self, at: int, act):
        self.at, self.act, self.count, self.kept = at, act, 0, []

    def tick(self, event: str, args) -> None:
        if event == "a file's bytes":  # a file's first two writes only: torch.save writes many times
            args[0].writes_seen = getattr(args[0], "writes_seen", 0) + 1  # (on the object: ids are reused)
            if args[0].writes_seen > 2:
                return
        self.count += 1
        if self.count - 1 == self.at:  # (counted first: an act that raises must not be met again)
            self.act(event, args)

    def __enter__(self):
        def counted(owner, name, event):
            original = getattr(owner, name)
            self.kept.append((owner, name, original))

            def wrapper(*args, **kwargs):
                self.tick(event, args)
                return original(*args, **kwargs)
            setattr(owner, name, wrapper)
        counted(files._Hashing, "write", "a file's bytes")
        counted(os, "fsync", "fsync")
        counted(os, "replace", "rename")
        counted(shutil, "rmtree", "removal")
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self.kept):
            setattr(owner, name, original)


class _FullDisk:
    def __init__(self, f):
        self.f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)


def _old_run(root):
    """A run that saved steps 2 and 4 (parameters 1.0), then resumed from 2: its next save is step 4 again."""
    checkpoint.save(_stage(0.5), root, 2)
    checkpoint.save(_stage(1.0), root, 4)


def _save_killed_at(at: int, root) -> bool:
    """Save step 4 again (parameters 2.0) in a forked child that kill -9s itself at event ``at``; whether it
    was killed (False: the save finished before event ``at``)."""
    stage = _stage(2.0)
    pid = os.fork()
    if pid == 0:  # the child: nothing of pytest's may run here, so every way out is os._exit
        try:
            with _Events(at, lambda event, args: os.kill(os.getpid(), signal.SIGKILL)):
                checkpoint.save(stage, root, 4)
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(3)
    for _ in range(600):  # a child that hangs (a lock held across the fork) fails the test, never the suite
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the child saving with a kill at event {at} did not end in 60 s")
    assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0, f"the save failed at event {at}: {status}"
    return os.WIFSIGNALED(status)


def test_a_save_killed_at_every_phase_leaves_a_whole_checkpoint(tmp_path):
    """kill -9 at every moment of a re-save of step 4: ``latest`` resolves to a complete checkpoint, which loads
    whole -- the old save's values or the new one's, never a mix, never nothing -- and the next save leaves
    nothing of the killed one behind."""
    at, outcomes, between = 0, [], 0
    while True:
        root = tmp_path / f"killed-{at}"
        _old_run(root)
        if not _save_killed_at(at, root):
            break
        outcomes.append(_loaded_value(root))
        if not (root / "step-00000004").exists():  # killed between the two renames: the step itself resolves too
            found, notes = find_with_notes(root / "step-00000004")
            assert found.name.startswith(".step-00000004.saving-") and "the rename into place" in notes[0], notes
            between += 1
        checkpoint.save(_stage(3.0), root, 5)  # the next save
        assert _leftovers(root) == [], f"killed at event {at}"
        assert _loaded_value(root) == 3.0
        at += 1
    assert at >= 12, f"only {at} moments to cut a save at: the events are not being counted"
    assert between == 1, f"killed between the two renames {between} times"
    assert outcomes[0] == 1.0 and outcomes[-1] == 2.0 and set(outcomes) == {1.0, 2.0}, outcomes  # both sides seen
    assert outcomes == sorted(outcomes)  # once the new save is in place, it stays the one loaded


def test_a_killed_save_is_skipped_and_said(tmp_path):
    _old_run(tmp_path)
    assert _save_killed_at(3, tmp_path)  # into the rank file's bytes
    found, notes = find_with_notes(tmp_path)
    assert found == tmp_path / "step-00000004"
    assert notes[0].startswith("skipped .step-00000004.saving-") and "a save that did not finish" in notes[0]
    assert notes[-1] == "took step-00000004, which 'latest' names"
    assert any(files.TEMPORARY in p.name for p in tmp_path.glob(".step-*/*"))  # the half-written file...
    checkpoint.save(_stage(3.0), tmp_path, 5)
    assert _leftovers(tmp_path) == []  # ...is gone after the next save


def test_a_full_disk_at_every_phase_fails_the_save_and_keeps_the_old_one(tmp_path):
    """ENOSPC at each write and fsync of a re-save: the save fails naming the file and the full disk, the old
    step 4 still loads, and nothing of the failed save is left on disk."""
    def full(event, args):
        if event == "a file's bytes":  # the file's own write fails, as a full disk's does
            args[0].f = _FullDisk(args[0].f)
        if event == "fsync":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    at, failed, kept = 0, 0, []
    while True:
        root = tmp_path / f"full-{at}"
        _old_run(root)
        try:
            with _Events(at, full) as events:
                checkpoint.save(_stage(2.0), root, 4)
        except CheckpointError as error:
            failed += 1
            said, value = str(error), _loaded_value(root)
            assert "No space left on device" in said, said
            # The message tells the truth about which save the directory now resolves to.
            assert (value == 1.0) == ("could not be written: No space left on device (the disk is full" in said
                                      and "the previous checkpoint stands" in said), (value, said)
            assert (value == 2.0) == ("step-00000004: complete and in place, but" in said), (value, said)
            kept.append(value)  # 2.0 only if the disk filled after the new save was in place
            assert [name for name in _leftovers(root) if ".replaced-" not in name] == []  # no staging, no .tmp
            checkpoint.save(_stage(3.0), root, 5)
            assert _leftovers(root) == []  # and an old step put aside goes with the next save
        if events.count <= at:
            break
        at += 1
    assert failed >= 6, f"only {failed} writes or fsyncs failed: the disk was never full where it matters"
    assert kept.count(1.0) >= 5 and kept.count(2.0) >= 1, kept  # both sides of the rename were hit


def test_a_file_damaged_in_place_is_refused_naming_it(tmp_path):
    """Same size, other bytes -- 16 float32 zeros, or 64 bytes of 0x7f -- loaded silently before digests."""
    checkpoint.save(_stage(1.0), tmp_path, 1)
    victim = tmp_path / "step-00000001" / "rank-00000-of-00001.pt"
    clean = victim.read_bytes()
    payload_at = clean.index(torch.tensor([1.0] * 4).numpy().tobytes())  # a run of the parameters' bytes
    for damage in (bytes(64), b"\x7f" * 64):
        victim.write_bytes(clean[:payload_at] + damage + clean[payload_at + 64:])
        with pytest.raises(CheckpointError, match="rank-00000-of-00001.pt: its SHA-256 differs from the "
                                                  "manifest's: the file was damaged"):
            checkpoint.load(_stage(), tmp_path)
    victim.write_bytes(clean)
    assert _loaded_value(tmp_path) == 1.0


@pytest.mark.parametrize("edit, message", [
    (lambda m: {**m, "step": 2}, "manifest.json: its contents do not match its SHA-256 (it was edited"),
    (lambda m: {k: v for k, v in m.items() if k != "state"}, "manifest.json: field 'state' is missing"),
    (lambda m: {**m, "files": [], "sha256": None}, "manifest.json: field 'files' is a list, not a dict"),
    (lambda m: [m], "not a minizero checkpoint manifest (format 'list')"),
])
def test_a_damaged_or_edited_manifest_is_refused_naming_the_field(tmp_path, edit, message):
    checkpoint.save(_stage(1.0), tmp_path, 4)
    path = tmp_path / "step-00000004" / "manifest.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checkpoint.load(_stage(), tmp_path)


def test_a_manifest_moved_to_another_step_is_refused(tmp_path):
    checkpoint.save(_stage(1.0), tmp_path, 4)
    (tmp_path / "step-00000004").rename(tmp_path / "step-00000002")
    with pytest.raises(CheckpointError, match="says step 4, but its directory is step-00000002"):
        checkpoint.load(_stage(), tmp_path / "step-00000002")


def test_a_first_format_checkpoint_still_loads_with_a_note(tmp_path):
    """A run saved before digests is not lost to an upgrade: it loads, saying what was not verified."""
    checkpoint.save(_stage(1.0), tmp_path, 1)
    path = tmp_path / "step-00000001" / "manifest.json"
    old = json.loads(path.read_text())
    old = {**{k: v for k, v in old.items() if k not in ("sha256", "optimizer")}, "format_version": 1,
           "files": {name: size for name, (size, _) in old["files"].items()}}
    path.write_text(json.dumps(old))
    stage = _stage()
    info = checkpoint.load(stage, tmp_path)
    assert "written in format version 1, before files carried digests: sizes checked, contents not" in info["notes"]
    assert all(torch.all(p == 1.0) for p in stage.module.parameters())
    path.write_text(json.dumps({**old, "save_id": old["save_id"] + 1}))  # a file of another save, as far as it knows
    with pytest.raises(CheckpointError, match="rank-00000-of-00001.pt: written by another save than the manifest's"):
        checkpoint.load(_stage(), tmp_path)
    path.write_text(json.dumps({k: v for k, v in old.items() if k != "state"}))
    with pytest.raises(CheckpointError, match="manifest.json: field 'state' is missing"):
        checkpoint.load(_stage(), tmp_path)


# ---------------------------------------------------------------------- on ranks: the optimizer it is loaded into
def _load_into(me, exp, root):
    """A stage of ``exp`` loads ``root``: the notes, or the error, it gives."""
    stage, _, comm, _ = build(me, exp)
    try:
        return checkpoint.load(stage, root)["notes"]
    except CheckpointError as error:
        return f"CheckpointError: {error}"
    finally:
        comm.close()


@pytest.mark.parametrize("stage", ["ddp", "zero2"])
def test_another_optimizer_class_is_refused(pools, tmp_path, stage):
    """AdamW's state into SGD: zero2 ran on silently with AdamW's lr, ddp failed with KeyError: 'momentum'."""
    exp = Experiment(stage=stage, steps=1, dtype="float32", optimizer="adamw", model={"d_model": 8, "n_layer": 1,
                                                                                      "n_head": 2, "block_size": 4})
    pools.run(2, run_experiment, replace(exp, save=str(tmp_path)))
    errors = pools.run(2, _load_into, replace(exp, optimizer="sgd"), str(tmp_path))
    assert all(e.startswith("CheckpointError: ") for e in errors), errors
    assert "saved with optimizer AdamW, this run's is SGD; build the optimizer the saved run used " \
           "(AdamW)" in errors[0]


def test_a_damaged_rank_file_is_refused_on_every_rank(pools, tmp_path):
    """One rank's file of a 2-rank zero3 save, damaged in place: every rank refuses, naming it."""
    exp = Experiment(stage="zero3", steps=1, dtype="float32", optimizer="adamw",
                     model={"d_model": 8, "n_layer": 1, "n_head": 2, "block_size": 4})
    pools.run(2, run_experiment, replace(exp, save=str(tmp_path)))
    victim = tmp_path / "step-00000001" / "rank-00001-of-00002.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    victim.write_bytes(bytes(data))
    with pytest.raises(RankError) as caught:
        pools.run(2, run_experiment, replace(exp, resume=str(tmp_path), first_step=1))
    assert "rank-00001-of-00002.pt: its SHA-256 differs from the manifest's" in caught.value.remote_traceback


def _sharded_save(me, root: str, step: int, value: float, at: int | None = None, victim: int = -1):
    """Every rank saves zero2's shards of the small MLP (every parameter ``value``) as checkpoint ``step``; rank
    ``victim`` kill -9s itself at its ``at``-th event.  Each surviving rank returns its count of events and what
    the directory resolves to *from that rank's process* once its ``save`` has returned."""
    exp = Experiment(stage="zero2", task="mlp", steps=1, dtype="float32", optimizer="adamw")
    stage, _, comm, _ = build(me, exp)
    try:
        with torch.no_grad():
            for p in stage.module.parameters():
                p.fill_(value)
        kill = (lambda event, args: os.kill(os.getpid(), signal.SIGKILL))
        with _Events(at if me.rank == victim else -1, kill) as events:
            checkpoint.save(stage, root, step)
        return events.count, find_with_notes(root)[0].name
    finally:
        comm.close()


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_at_every_moment_of_a_sharded_save_leaves_a_whole_checkpoint(pools, tmp_path, victim):
    """Two ranks re-save step 4 over a run that saved steps 2 and 4; rank ``victim`` is killed (kill -9) at each
    of its moments in turn -- before and inside its file's writes, each fsync, and on rank 0 the manifest, each
    rename of the publish and ``latest``, the removal of the old step.  Whatever the moment, ``latest`` resolves to
    a complete checkpoint that loads whole (the old save or the new, never a mix); once the new one is in place it
    stays; and the next save leaves nothing of the killed one.  A save that returned is complete and in place as
    seen from another rank's process."""
    def old_run(root):
        pools.run(2, _sharded_save, str(root), 2, 0.5)
        pools.run(2, _sharded_save, str(root), 4, 1.0)

    counts = pools.run(2, _sharded_save, str(tmp_path / "unharmed"), 4, 2.0)
    assert [name for _, name in counts] == ["step-00000004"] * 2  # returned on each rank: in place for both
    moments = counts[victim][0]
    assert moments >= (10 if victim == 0 else 3), f"rank {victim}: only {moments} moments counted"
    outcomes = []
    for at in range(moments):
        root = tmp_path / f"killed-{at}"
        old_run(root)
        with pytest.raises(RankError) as ended:
            pools.run(2, _sharded_save, str(root), 4, 2.0, at=at, victim=victim)
        assert f"rank {victim}" in str(ended.value), (at, str(ended.value)[:300])
        found, notes = find_with_notes(root)
        outcomes.append(_loaded_value(found))
        pools.run(2, _sharded_save, str(root), 5, 3.0)  # the next save
        assert _leftovers(root) == [], f"rank {victim} killed at its moment {at}"
        assert _loaded_value(root) == 3.0
    assert outcomes[0] == 1.0 and set(outcomes) <= {1.0, 2.0}, outcomes
    assert outcomes == sorted(outcomes), outcomes  # once the new save is in place, it stays the one loaded
    if victim == 0:
        assert outcomes[-1] == 2.0, outcomes  # killed after the publish: the new one resolves
